//! `x · wᵀ` for a decode step's few rows of dense weights ([`linear_small`]): one
//! bandwidth-bound pass over the weight instead of cuBLAS's split-K GEMM, for one weight or
//! two or three that read the same x in one launch ([`linear_small_multi`]), and a SwiGLU's gate
//! and up with the SiLU · mul ([`linear_silu_mul`]).

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor, WithDType, D};

use crate::activation::silu_mul;
use crate::util::{
    aligned16, check_dtypes, contiguous, cpu_dispatch2, f32_of, of_f32, LINEAR_SMALL_MAX_ROWS,
};

#[derive(Debug, Clone, Copy)]
struct LinearSmall;

impl LinearSmall {
    const NAME: &'static str = "linear-small";
}

/// `x · wᵀ` of the contiguous `x` (rows, k) and `w` (n, k) in F32, row by row.
fn products_cpu<T: WithDType>(
    name: &str,
    x: &[T],
    w: &[T],
    (xl, wl): (&Layout, &Layout),
) -> Result<Vec<f32>> {
    let (x, w) = (contiguous(x, xl, name)?, contiguous(w, wl, name)?);
    let (_, k) = xl.shape().dims2()?;
    let k = k.max(1);
    let mut out = Vec::with_capacity(x.len() / k * w.len() / k);
    for xr in x.chunks(k) {
        for wr in w.chunks(k) {
            out.push(
                xr.iter()
                    .zip(wr)
                    .map(|(&a, &b)| f32_of(a) * f32_of(b))
                    .sum(),
            );
        }
    }
    Ok(out)
}

fn linear_small_cpu<T: WithDType>(x: &[T], w: &[T], layouts: (&Layout, &Layout)) -> Result<Vec<T>> {
    Ok(products_cpu(LinearSmall::NAME, x, w, layouts)?
        .into_iter()
        .map(of_f32)
        .collect())
}

impl candle_core::CustomOp2 for LinearSmall {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = cpu_dispatch2!(Self::NAME, s1, s2, linear_small_cpu, (l1, l2));
        Ok((out, Shape::from((l1.dims()[0], l2.dims()[0]))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::linear::cuda::linear_small((s1, l1), &[(s2, l2)], false)?;
        Ok((out, Shape::from((l1.dims()[0], l2.dims()[0]))))
    }
}

/// `x · wᵀ` for a weight `w` (out, in) and an `x` (…, in) of at most 8 rows in all (a decode
/// step): one pass over the weight that multiplies it by every row, F32 accumulation. On a GPU
/// this replaces cuBLAS's split-K GEMM and its reduction kernel (two launches, and a split-K
/// schedule that leaves bandwidth unused at one row) by one bandwidth-bound kernel. Falls back
/// to the composition ([`linear_small_unfused`]) for more rows, an `in` that is not a multiple
/// of 8 or a weight not 16-byte aligned.
pub fn linear_small(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    check_dtypes(LinearSmall::NAME, &[x, w])?;
    let (n, k) = w.dims2()?;
    if x.dim(D::Minus1)? != k {
        candle_core::bail!(
            "{}: x {:?} does not match the weight {:?}",
            LinearSmall::NAME,
            x.shape(),
            w.shape()
        );
    }
    let rows = x.elem_count() / k.max(1);
    let w = w.contiguous()?;
    if rows == 0
        || rows > LINEAR_SMALL_MAX_ROWS
        || !k.is_multiple_of(8)
        || !aligned16(w.layout(), w.dtype())
    {
        return linear_small_unfused(x, &w);
    }
    let mut out_dims = x.dims().to_vec();
    *out_dims.last_mut().expect("x has a last dim") = n;
    // An x that is strided or starts unaligned is copied (≤ 8 rows) to a fresh buffer.
    let x2 = x.reshape((rows, k))?;
    let x2 = if aligned16(x2.layout(), x2.dtype()) && x2.is_contiguous() {
        x2
    } else {
        x2.force_contiguous()?
    };
    x2.apply_op2_no_bwd(&w, &LinearSmall)?.reshape(out_dims)
}

#[derive(Debug, Clone, Copy)]
struct RouterLogits;

impl RouterLogits {
    const NAME: &'static str = "router-logits";
}

impl candle_core::CustomOp2 for RouterLogits {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => products_cpu(Self::NAME, x, w, (l1, l2))?,
            (CpuStorage::F16(x), CpuStorage::F16(w)) => products_cpu(Self::NAME, x, w, (l1, l2))?,
            (CpuStorage::BF16(x), CpuStorage::BF16(w)) => products_cpu(Self::NAME, x, w, (l1, l2))?,
            _ => candle_core::bail!("{}: unsupported or mixed dtypes", Self::NAME),
        };
        Ok((
            CpuStorage::F32(out),
            Shape::from((l1.dims()[0], l2.dims()[0])),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::linear::cuda::router_logits((s1, l1), (s2, l2))?;
        Ok((out, Shape::from((l1.dims()[0], l2.dims()[0]))))
    }
}

/// A router's logits `x · wᵀ` in F32 for a weight `w` (experts, in) and `x` (rows, in) of
/// float dtypes, computed in F32 whatever they are (the top-k of logits rounded to 16 bits
/// would tie or swap experts). On the CPU, for up to eight rows, the pool's dense kernel
/// ([`cpu_dense::logits`](crate::linear::cpu_dense::logits), `tuning`'s prefetch distance);
/// on a GPU, for one row (a decode step) of the weight's 16-bit dtype with `in` a multiple
/// of 8 and both 16-byte aligned, one launch; otherwise the composition: both cast to F32,
/// then a matmul. `(rows, experts)` F32.
pub fn router_logits(
    x: &Tensor,
    w: &Tensor,
    tuning: &crate::tuning::KernelTuning,
) -> Result<Tensor> {
    if !x.dtype().is_float() || !w.dtype().is_float() {
        candle_core::bail!(
            "{}: x {:?} and the weight {:?} have to be floats",
            RouterLogits::NAME,
            x.dtype(),
            w.dtype()
        );
    }
    let (_, k) = w.dims2()?;
    let (rows, xk) = x.dims2()?;
    if xk != k {
        candle_core::bail!(
            "{}: x {:?} does not match the weight {:?}",
            RouterLogits::NAME,
            x.shape(),
            w.shape()
        );
    }
    if let Some(logits) = crate::linear::cpu_dense::logits(w, x, tuning)? {
        return Ok(logits);
    }
    let fits = |t: &Tensor| t.is_contiguous() && aligned16(t.layout(), t.dtype());
    if !x.device().is_cuda()
        || x.dtype() == candle_core::DType::F32
        || x.dtype() != w.dtype()
        || rows != 1
        || !k.is_multiple_of(8)
        || !fits(w)
    {
        let x = x.to_dtype(candle_core::DType::F32)?;
        return x.matmul(&w.to_dtype(candle_core::DType::F32)?.t()?);
    }
    let x = if fits(x) {
        x.clone()
    } else {
        x.force_contiguous()?
    };
    x.apply_op2_no_bwd(w, &RouterLogits)
}

/// Whether [`linear_small_multi`] / [`linear_silu_mul`] can run their one CUDA launch on
/// `x` and `ws`: a GPU, ≤ 8 rows, a width that is a multiple of 8, contiguous weights of x's
/// dtype starting 16-byte aligned.
fn multi_fits(x: &Tensor, ws: &[&Tensor]) -> Result<bool> {
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k.max(1);
    let aligned = |t: &Tensor| t.is_contiguous() && aligned16(t.layout(), t.dtype());
    Ok(x.device().is_cuda()
        && rows > 0
        && rows <= LINEAR_SMALL_MAX_ROWS
        && k.is_multiple_of(8)
        && ws
            .iter()
            .all(|w| w.dtype() == x.dtype() && w.dims().get(1) == Some(&k) && aligned(w)))
}

/// Runs the multi-weight CUDA kernel (see `cuda::linear_small`) on x (rows, k),
/// returning its one output buffer as a flat tensor. Candle's custom ops take at most three
/// tensors, so this reads the storages directly (read locks, as `apply_op3` takes them) and
/// wraps the result as a tensor without a gradient.
#[cfg(feature = "cuda")]
fn linear_small_launch(x: &Tensor, ws: &[&Tensor], silu: bool) -> Result<Tensor> {
    use candle_core::Storage;
    let x = x.force_contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let guards: Vec<_> = ws.iter().map(|w| w.storage_and_layout()).collect();
    let Storage::Cuda(xs) = &*xs else {
        candle_core::bail!("{}: x is not on a GPU", LinearSmall::NAME)
    };
    let mut cw = Vec::with_capacity(ws.len());
    for (g, l) in &guards {
        let Storage::Cuda(s) = &**g else {
            candle_core::bail!("{}: a weight is not on the GPU", LinearSmall::NAME)
        };
        cw.push((s, *l));
    }
    let rows = xl.dims()[0];
    let cols: usize = if silu {
        ws[0].dim(0)?
    } else {
        ws.iter().map(|w| w.dim(0)).sum::<Result<usize>>()?
    };
    let out = crate::linear::cuda::linear_small((xs, xl), &cw, silu)?;
    let n = rows * cols;
    Ok(Tensor::from_storage(
        Storage::Cuda(out),
        n,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

#[cfg(not(feature = "cuda"))]
fn linear_small_launch(_x: &Tensor, _ws: &[&Tensor], _silu: bool) -> Result<Tensor> {
    candle_core::bail!(
        "{}: needs a build with `--features cuda`",
        LinearSmall::NAME
    )
}

/// `x · wᵢᵀ` for two or three weights (out_i, in) that read the same `x` (q, k and v; gate and
/// up): on a GPU, for at most 8 rows, one launch that writes each result contiguous; otherwise
/// one [`linear_small`] per weight.
pub fn linear_small_multi(x: &Tensor, ws: &[&Tensor]) -> Result<Vec<Tensor>> {
    if ws.is_empty() || ws.len() > 3 {
        candle_core::bail!("{}: 1 to 3 weights, not {}", LinearSmall::NAME, ws.len());
    }
    let mut refs = vec![x];
    refs.extend_from_slice(ws);
    check_dtypes(LinearSmall::NAME, &refs)?;
    if !multi_fits(x, ws)? {
        return ws.iter().map(|w| linear_small(x, w)).collect();
    }
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k;
    let flat = linear_small_launch(&x.reshape((rows, k))?, ws, false)?;
    let ns = ws.iter().map(|w| w.dim(0)).collect::<Result<Vec<_>>>()?;
    split_multi(x, &flat, &ns)
}

/// The results of a multi-weight launch: `flat` holds x's rows times each weight's `n`
/// columns, one weight after another; each comes back shaped as x with its last dim `n`.
pub(crate) fn split_multi(x: &Tensor, flat: &Tensor, ns: &[usize]) -> Result<Vec<Tensor>> {
    let rows = x.elem_count() / x.dim(D::Minus1)?;
    let mut out = Vec::with_capacity(ns.len());
    let mut at = 0;
    for &n in ns {
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("x has a last dim") = n;
        out.push(flat.narrow(0, at, rows * n)?.reshape(dims)?);
        at += rows * n;
    }
    Ok(out)
}

/// `silu(x · gateᵀ) · (x · upᵀ)` (a SwiGLU MLP before its down projection): on a GPU, for at
/// most 8 rows, one launch that reads both weights once; otherwise [`linear_small`] twice and
/// [`silu_mul`].
pub fn linear_silu_mul(x: &Tensor, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_dtypes(LinearSmall::NAME, &[x, gate, up])?;
    if gate.shape() != up.shape() {
        candle_core::bail!(
            "{}: gate {:?} and up {:?} differ in shape",
            LinearSmall::NAME,
            gate.shape(),
            up.shape()
        );
    }
    if !multi_fits(x, &[gate, up])? {
        return silu_mul(&linear_small(x, gate)?, &linear_small(x, up)?);
    }
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k;
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("x has a last dim") = gate.dim(0)?;
    linear_small_launch(&x.reshape((rows, k))?, &[gate, up], true)?.reshape(dims)
}

/// The composition [`linear_small`] replaces: `candle_nn::Linear`'s broadcast matmul.
pub fn linear_small_unfused(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.broadcast_matmul(&w.t()?)
}
