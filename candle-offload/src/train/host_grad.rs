//! Offloaded training's gradients summed in F32 in host memory ([`accumulate_on_host`],
//! [`HostGradients`]), where the host optimizer (`candle_offload_kernels::optimizer::HostAdamW`)
//! steps the masters, and the loss scale taken out of them there ([`scale_host_in_place`]).

use candle_core::{CpuStorage, DType, Device, Layout, Tensor};

/// Elements per task of the host gradient conversions.
const GRAD_CHUNK: usize = 1 << 18;

/// Gradients summed in F32 in host memory, as offloaded training keeps them: `g` (any float
/// dtype, on any device) brought to the host and added into `acc` (F32, on the CPU) in place,
/// or, with no `acc` yet, converted into a new F32 tensor. Both conversions run on every core
/// (rayon); the result is the same as `acc + g.to_dtype(F32)`. [`HostGradients`] does the
/// same with the device-to-host copy through a reused page-locked buffer.
pub fn accumulate_on_host(acc: Option<Tensor>, g: &Tensor) -> candle_core::Result<Tensor> {
    apply_on_host(acc, g, true)
}

/// [`accumulate_on_host`], or (`add` false) `g` written into `acc`.
fn apply_on_host(acc: Option<Tensor>, g: &Tensor, add: bool) -> candle_core::Result<Tensor> {
    let g = g.to_device(&Device::Cpu)?.contiguous()?;
    let (storage, layout) = g.storage_and_layout();
    let (Some((a, b)), candle_core::Storage::Cpu(s)) = (layout.contiguous_offsets(), &*storage)
    else {
        candle_core::bail!("accumulate_on_host: gradient not contiguous on the host");
    };
    let values = match s {
        CpuStorage::F32(v) => Values::F32(&v[a..b]),
        CpuStorage::F16(v) => Values::F16(&v[a..b]),
        CpuStorage::BF16(v) => Values::Bf16(&v[a..b]),
        _ => candle_core::bail!("accumulate_on_host: the gradient has to be F32, F16 or BF16"),
    };
    accumulate_values(acc, values, g.shape(), add)
}

/// Offloaded training's gradient sums in host memory ([`accumulate_on_host`]), with the
/// device-to-host copies of GPU gradients going through one reused page-locked buffer: at the
/// link's pinned rate, and with no fresh pageable memory faulted in per gradient.
pub struct HostGradients {
    staging: crate::sys::Downloader,
}

impl std::fmt::Debug for HostGradients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostGradients").finish_non_exhaustive()
    }
}

impl Default for HostGradients {
    fn default() -> Self {
        Self::new()
    }
}

impl HostGradients {
    /// No staging buffer yet: the first GPU gradient allocates it (its size).
    pub fn new() -> Self {
        Self {
            staging: crate::sys::Downloader::new(),
        }
    }

    /// `acc + g` in F32 on the host ([`accumulate_on_host`]); a GPU gradient is copied through
    /// the staging buffer.
    pub fn accumulate(&mut self, acc: Option<Tensor>, g: &Tensor) -> candle_core::Result<Tensor> {
        self.apply(acc, g, true)
    }

    /// `g` in F32 written into `buf` (an F32 host tensor of `g`'s shape, e.g. the previous
    /// step's sum, which nothing else reads any more): the first contribution of a step,
    /// without allocating (and faulting in) a new host buffer.
    pub fn overwrite(&mut self, buf: Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
        self.apply(Some(buf), g, false)
    }

    fn apply(&mut self, acc: Option<Tensor>, g: &Tensor, add: bool) -> candle_core::Result<Tensor> {
        if !g.device().is_cuda() {
            return apply_on_host(acc, g, add);
        }
        let dtype = g.dtype();
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            candle_core::bail!("HostGradients: the gradient has to be F32, F16 or BF16");
        }
        let bytes = self.staging.download(g)?;
        accumulate_values(acc, Values::Le(dtype, bytes), g.shape(), add)
    }
}

/// A gradient's values on the host: typed, or little-endian bytes of a float dtype.
#[derive(Clone, Copy)]
enum Values<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
    Bf16(&'a [half::bf16]),
    Le(DType, &'a [u8]),
}

impl Values<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F16(v) => v.len(),
            Self::Bf16(v) => v.len(),
            Self::Le(d, b) => b.len() / d.size_in_bytes(),
        }
    }

    /// Elements `start..start + dst.len()` as F32, written into `dst` or added to it.
    fn apply(&self, start: usize, dst: &mut [f32], add: bool) {
        let end = start + dst.len();
        let put = |d: &mut f32, v: f32| {
            if add {
                *d += v
            } else {
                *d = v
            }
        };
        match self {
            Self::F32(v) => dst
                .iter_mut()
                .zip(&v[start..end])
                .for_each(|(d, s)| put(d, *s)),
            Self::F16(v) => dst
                .iter_mut()
                .zip(&v[start..end])
                .for_each(|(d, s)| put(d, s.to_f32())),
            Self::Bf16(v) => dst
                .iter_mut()
                .zip(&v[start..end])
                .for_each(|(d, s)| put(d, s.to_f32())),
            Self::Le(DType::F32, b) => dst
                .iter_mut()
                .zip(b[4 * start..4 * end].chunks_exact(4))
                .for_each(|(d, s)| put(d, f32::from_le_bytes([s[0], s[1], s[2], s[3]]))),
            Self::Le(DType::F16, b) => dst
                .iter_mut()
                .zip(b[2 * start..2 * end].chunks_exact(2))
                .for_each(|(d, s)| put(d, half::f16::from_le_bytes([s[0], s[1]]).to_f32())),
            Self::Le(_, b) => dst
                .iter_mut()
                .zip(b[2 * start..2 * end].chunks_exact(2))
                .for_each(|(d, s)| put(d, half::bf16::from_le_bytes([s[0], s[1]]).to_f32())),
        }
    }
}

/// `acc + values` (`add`) or `values` written into `acc`, or `values` as a new F32 tensor with
/// no `acc`, of `shape`, on every core.
fn accumulate_values(
    acc: Option<Tensor>,
    values: Values<'_>,
    shape: &candle_core::Shape,
    add: bool,
) -> candle_core::Result<Tensor> {
    use rayon::prelude::*;
    let n = values.len();
    if n != shape.elem_count() {
        candle_core::bail!("accumulate_on_host: {n} values for shape {shape:?}");
    }
    match acc {
        Some(acc) => {
            if acc.shape() != shape || acc.dtype() != DType::F32 || !acc.device().is_cpu() {
                candle_core::bail!(
                    "accumulate_on_host: an F32 host sum of {:?} cannot take a gradient of {:?}",
                    acc.dims(),
                    shape.dims()
                );
            }
            acc.inplace_op1(&AddInto(values, add))?;
            Ok(acc)
        }
        None => {
            let mut out = vec![0f32; n];
            out.par_chunks_mut(GRAD_CHUNK)
                .enumerate()
                .for_each(|(i, d)| values.apply(i * GRAD_CHUNK, d, false));
            Tensor::from_vec(out, shape, &Device::Cpu)
        }
    }
}

/// The values an in-place host op writes: `s` as F32, its contiguous part, or an error naming
/// the op and what `s` holds.
fn contiguous_f32_mut<'a>(
    op: &str,
    what: &str,
    s: &'a mut CpuStorage,
    l: &Layout,
) -> candle_core::Result<&'a mut [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{op}: the {what} has to be F32");
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: the {what} has to be contiguous");
    };
    Ok(&mut v[a..b])
}

/// `acc += values` (or `acc = values` when `.1` is false) over a contiguous F32 `acc` on the
/// host, on every core.
struct AddInto<'a>(Values<'a>, bool);

impl candle_core::InplaceOp1 for AddInto<'_> {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        use rayon::prelude::*;
        let acc = contiguous_f32_mut("add-into", "sum", s, l)?;
        if acc.len() != self.0.len() {
            candle_core::bail!("add-into: {} values into {}", self.0.len(), acc.len());
        }
        acc.par_chunks_mut(GRAD_CHUNK)
            .enumerate()
            .for_each(|(i, d)| self.0.apply(i * GRAD_CHUNK, d, self.1));
        Ok(())
    }
}

/// `g *= factor` over a contiguous F32 `g` on the host, on every core, noting whether every
/// result is finite.
struct ScaleInPlace {
    factor: f32,
    finite: std::sync::atomic::AtomicBool,
}

impl candle_core::InplaceOp1 for ScaleInPlace {
    fn name(&self) -> &'static str {
        "scale-in-place"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        use rayon::prelude::*;
        use std::sync::atomic::Ordering;
        let g = contiguous_f32_mut("scale-in-place", "gradient", s, l)?;
        let factor = self.factor;
        g.par_chunks_mut(GRAD_CHUNK).for_each(|d| {
            let mut all = true;
            for x in d.iter_mut() {
                *x *= factor;
                all &= x.is_finite();
            }
            if !all {
                self.finite.store(false, Ordering::Relaxed);
            }
        });
        Ok(())
    }
}

/// Multiplies a host F32 gradient by `factor` in place, on every core, and says whether every
/// value is finite afterwards; `None` where `g` is not a contiguous F32 host tensor (the
/// caller then uses tensor ops).
pub(crate) fn scale_host_in_place(g: &Tensor, factor: f32) -> candle_core::Result<Option<bool>> {
    if !g.device().is_cpu() || g.dtype() != DType::F32 || !g.is_contiguous() {
        return Ok(None);
    }
    let op = ScaleInPlace {
        factor,
        finite: std::sync::atomic::AtomicBool::new(true),
    };
    g.inplace_op1(&op)?;
    Ok(Some(op.finite.load(std::sync::atomic::Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host sums equal `acc + g.to_dtype(F32)` bit for bit, from every float dtype, over more
    /// than one chunk, from strided gradients too; a sum of another shape is refused.
    #[test]
    fn accumulate_on_host_matches_the_tensor_sum() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let n = GRAD_CHUNK + 37;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let a = Tensor::randn(0f32, 1., (2, n), &dev)?.to_dtype(dtype)?;
            let b = Tensor::randn(0f32, 1., (n, 2), &dev)?
                .to_dtype(dtype)?
                .t()?;
            let first = accumulate_on_host(None, &a)?;
            let want = a.to_dtype(DType::F32)?;
            assert_eq!(first.to_vec2::<f32>()?, want.to_vec2::<f32>()?, "{dtype:?}");
            let sum = accumulate_on_host(Some(first), &b)?;
            let want = (want + b.to_dtype(DType::F32)?)?;
            assert_eq!(sum.to_vec2::<f32>()?, want.to_vec2::<f32>()?, "{dtype:?}");
            let e = accumulate_on_host(Some(sum), &a.narrow(1, 0, 5)?).unwrap_err();
            assert!(e.to_string().contains("cannot take"), "{e}");
        }
        Ok(())
    }
}
