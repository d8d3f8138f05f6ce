//! The pre-norm residual step of a decoder layer: `x + residual` and the RMSNorm of the sum in
//! one kernel ([`rms_norm_residual`]), also writing the normed rows quantized for the next
//! matmuls under variant 4 ([`rms_norm_residual_q8`]).

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor, WithDType, D};

#[cfg(feature = "cuda")]
use crate::util::LINEAR_SMALL_MAX_ROWS;
use crate::util::{check_dtypes, contiguous, cpu_dispatch3, f32_of, of_f32, stacked_shape};

#[derive(Debug)]
struct RmsNormResidual {
    eps: f32,
    /// `Some`: the CUDA kernel also writes the normed rows quantized for variant 4
    /// ([`rms_norm_residual_q8`]) and leaves their buffer here.
    #[cfg(feature = "cuda")]
    q8: Option<std::cell::RefCell<Option<candle_core::CudaStorage>>>,
}

impl RmsNormResidual {
    const NAME: &'static str = "rms-norm-residual";
}

/// `out` = all sums, then all normed rows (the layout the CUDA kernel writes).
fn rms_norm_residual_cpu<T: WithDType>(
    x: &[T],
    r: &[T],
    w: &[T],
    (xl, rl, wl): (&Layout, &Layout, &Layout),
    eps: f32,
) -> Result<Vec<T>> {
    let op = RmsNormResidual::NAME;
    let (x, r, w) = (
        contiguous(x, xl, op)?,
        contiguous(r, rl, op)?,
        contiguous(w, wl, op)?,
    );
    let n_cols = w.len();
    let el = x.len();
    let mut out = vec![of_f32::<T>(0.0); 2 * el];
    let (sums, normed) = out.split_at_mut(el);
    let rows = x
        .chunks(n_cols)
        .zip(r.chunks(n_cols))
        .zip(sums.chunks_mut(n_cols).zip(normed.chunks_mut(n_cols)));
    for ((xr, rr), (sr, nr)) in rows {
        let mut acc = 0f32;
        for ((s, &a), &b) in sr.iter_mut().zip(xr).zip(rr) {
            *s = of_f32(f32_of(a) + f32_of(b));
            let v = f32_of(*s);
            acc += v * v;
        }
        let inv = 1.0 / (acc / n_cols as f32 + eps).sqrt();
        for ((n, &s), &g) in nr.iter_mut().zip(sr.iter()).zip(w) {
            *n = of_f32(f32_of(s) * inv * f32_of(g));
        }
    }
    Ok(out)
}

impl candle_core::CustomOp3 for RmsNormResidual {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = cpu_dispatch3!(
            Self::NAME,
            s1,
            s2,
            s3,
            rms_norm_residual_cpu,
            (l1, l2, l3),
            self.eps
        );
        Ok((out, stacked_shape(l1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (out, xq) = crate::norm::cuda::rms_norm_residual(
            self.eps,
            (s1, l1),
            (s2, l2),
            (s3, l3),
            self.q8.is_some(),
        )?;
        if let Some(slot) = &self.q8 {
            *slot.borrow_mut() = xq;
        }
        Ok((out, stacked_shape(l1)))
    }
}

/// `(x + residual, rmsnorm(x + residual) · weight)` in one pass: the residual add of a pre-norm
/// decoder layer and the norm after it. `x` and `residual` have one shape (any rank ≥ 1), its
/// last dim the length of `weight`; the sum is rounded to the dtype before it is normalized,
/// as the composition ([`rms_norm_residual_unfused`]) does.
pub fn rms_norm_residual(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let op = RmsNormResidual {
        eps: eps as f32,
        #[cfg(feature = "cuda")]
        q8: None,
    };
    rms_norm_residual_with(x, residual, weight, &op)
}

/// [`rms_norm_residual`] through `op` (which may also quantize the normed rows).
fn rms_norm_residual_with(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    op: &RmsNormResidual,
) -> Result<(Tensor, Tensor)> {
    check_dtypes(RmsNormResidual::NAME, &[x, residual, weight])?;
    if x.shape() != residual.shape() {
        candle_core::bail!(
            "{}: x {:?} and residual {:?} differ in shape",
            RmsNormResidual::NAME,
            x.shape(),
            residual.shape()
        );
    }
    let width = x.dim(D::Minus1)?;
    if weight.dims1()? != width {
        candle_core::bail!(
            "{}: weight {:?} does not match the last dim of x {:?}",
            RmsNormResidual::NAME,
            weight.shape(),
            x.shape()
        );
    }
    if x.elem_count() == 0 {
        return rms_norm_residual_unfused(x, residual, weight, f64::from(op.eps));
    }
    let out =
        x.contiguous()?
            .apply_op3_no_bwd(&residual.contiguous()?, &weight.contiguous()?, op)?;
    Ok((out.get(0)?, out.get(1)?))
}

/// [`rms_norm_residual`] for a norm whose rows go next into GGML-block matmuls of variant 4
/// ([`QlinearVariant::V4`](crate::QlinearVariant::V4), which quantizes x to 8 bits in a launch of its own): on a GPU, for
/// decode rows (at most 8, a width that is a multiple of 32, inputs that start 16-byte aligned,
/// at most 32768 wide), the same kernel also writes the normed rows quantized, and [`qlinear_small_multi`](crate::linear::qlinear_small_multi) / [`qlinear_silu_mul`](crate::linear::qlinear_silu_mul) given that very
/// tensor (by its id; the latest norm's only, per thread) read them instead of quantizing them
/// again. The results equal [`rms_norm_residual`]'s, and the matmuls' theirs, bit for bit.
/// Elsewhere it is [`rms_norm_residual`].
pub fn rms_norm_residual_q8(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    {
        let width = x.dim(D::Minus1)?;
        let rows = x.elem_count() / width.max(1);
        if x.device().is_cuda()
            && width.is_multiple_of(32)
            && (1..=LINEAR_SMALL_MAX_ROWS).contains(&rows)
        {
            let op = RmsNormResidual {
                eps: eps as f32,
                q8: Some(std::cell::RefCell::new(None)),
            };
            let (sum, normed) = rms_norm_residual_with(x, residual, weight, &op)?;
            if let Some(xq) = op.q8.and_then(std::cell::RefCell::into_inner) {
                crate::handover::prequantized::remember(&normed, xq, rows, width);
            }
            return Ok((sum, normed));
        }
    }
    rms_norm_residual(x, residual, weight, eps)
}

/// `norm(x + residual)` and the sum for the input of the linear layer `next`: where `next`
/// takes x quantized ([`Linear::takes_quantized_x`](crate::linear::Linear::takes_quantized_x)),
/// [`rms_norm_residual_q8`], else [`rms_norm_residual`]; the caller need not know which.
pub fn rms_norm_residual_for(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
    next: &crate::linear::Linear,
) -> Result<(Tensor, Tensor)> {
    let rows = x.elem_count() / x.dim(candle_core::D::Minus1)?.max(1);
    if next.takes_quantized_x(rows) {
        rms_norm_residual_q8(x, residual, weight, eps)
    } else {
        rms_norm_residual(x, residual, weight, eps)
    }
}

/// The Candle composition [`rms_norm_residual`] replaces: an add, then Candle's RMSNorm.
pub fn rms_norm_residual_unfused(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let sum = (x + residual)?;
    let normed = candle_nn::ops::rms_norm(&sum, weight, eps as f32)?;
    Ok((sum, normed))
}
