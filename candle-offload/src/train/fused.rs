//! Fused training ops with their own backward passes, and a fused multi-tensor AdamW.
//!
//! Candle's fast kernels for RMSNorm and softmax have no backward pass (and
//! `candle_nn::RmsNorm::forward` silently cuts the gradient on contiguous input), so training
//! has used their compositions: a dozen elementwise and reduction kernels each way. These are
//! Candle custom ops whose `bwd` runs kernels of their own, so Candle's autograd goes through
//! them and any candle-nn code can use them:
//! - [`rms_norm`]: `x / sqrt(mean(x²) + eps) · w`, gradients for x and w.
//! - [`swiglu`]: `silu(gate) · up`, gradients for gate and up.
//! - [`cross_entropy`]: per-row softmax cross-entropy of logits against U32 targets (F32
//!   losses), computed over the vocabulary in block-wide chunks: the forward keeps one
//!   log-sum-exp per row, the backward recomputes the probabilities chunk by chunk, so no F32
//!   probability matrix exists.
//! - [`FusedAdamW`]: PyTorch/candle-nn AdamW (decoupled weight decay, bias correction) over F32
//!   variables: on a GPU one kernel launch updates every parameter and its moments (kept in
//!   two flat F32 buffers); on the CPU it is [`HostAdamW`].
//!
//! On a CUDA device the ops run `kernels/train.cu`; on the CPU direct loops compute the same
//! thing. All accumulate in F32 and take F32, F16 or BF16 (one dtype for every float input).
//! The `*_composite` functions are the Candle compositions each op is checked against, and the
//! path the trainer takes with its fused ops off.

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, Var, WithDType, D};
use candle_nn::{Optimizer, ParamsAdamW};

use super::HostAdamW;
use crate::ops::{check_dtypes, contiguous, f32_of, of_f32};

/// Applies `$f::<T>` to CPU buffers that are all of one float dtype `T` (the leading
/// arguments), passing the trailing arguments as they are; the result is whatever `$f` gives.
macro_rules! cpu_same {
    ($op:expr, [$($s:expr),+], $f:ident, |$($v:ident),+| ($($arg:expr),*)) => {
        match ($($s,)+) {
            ($(CpuStorage::F32($v),)+) => $f($($v,)+ $($arg),*),
            ($(CpuStorage::F16($v),)+) => $f($($v,)+ $($arg),*),
            ($(CpuStorage::BF16($v),)+) => $f($($v,)+ $($arg),*),
            _ => candle_core::bail!("{}: unsupported or mixed dtypes", $op),
        }
    };
}

/// Wraps a typed CPU result as storage.
trait IntoCpu {
    fn into_cpu(self) -> CpuStorage;
}
impl IntoCpu for Vec<f32> {
    fn into_cpu(self) -> CpuStorage {
        CpuStorage::F32(self)
    }
}
impl IntoCpu for Vec<half::f16> {
    fn into_cpu(self) -> CpuStorage {
        CpuStorage::F16(self)
    }
}
impl IntoCpu for Vec<half::bf16> {
    fn into_cpu(self) -> CpuStorage {
        CpuStorage::BF16(self)
    }
}

/// The width of the rows of a buffer of `len` elements (`width` > 0 dividing `len`).
fn check_rows(op: &str, len: usize, width: usize) -> Result<()> {
    if width == 0 || !len.is_multiple_of(width) {
        candle_core::bail!("{op}: {len} elements are not rows of {width}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

fn rstd_of(row: &[f32], eps: f32) -> f32 {
    let ss: f32 = row.iter().map(|v| v * v).sum();
    1.0 / (ss / row.len() as f32 + eps).sqrt()
}

fn row_f32<T: WithDType>(row: &[T]) -> Vec<f32> {
    row.iter().map(|&v| f32_of(v)).collect()
}

/// The forward pass: `x · rstd(x) · w`, rows of `w`'s length.
#[derive(Debug, Clone, Copy)]
struct RmsNorm {
    eps: f32,
}

impl RmsNorm {
    const NAME: &'static str = "fused-rms-norm";
}

fn rms_norm_cpu<T: WithDType>(
    x: &[T],
    w: &[T],
    (xl, wl): (&Layout, &Layout),
    eps: f32,
) -> Result<CpuStorage>
where
    Vec<T>: IntoCpu,
{
    let op = RmsNorm::NAME;
    let (x, w) = (contiguous(x, xl, op)?, contiguous(w, wl, op)?);
    check_rows(op, x.len(), w.len())?;
    let w = row_f32(w);
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(w.len()) {
        let row = row_f32(row);
        let r = rstd_of(&row, eps);
        out.extend(row.iter().zip(&w).map(|(v, g)| of_f32::<T>(v * r * g)));
    }
    Ok(out.into_cpu())
}

impl candle_core::CustomOp2 for RmsNorm {
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
        let out = cpu_same!(Self::NAME, [s1, s2], rms_norm_cpu, |x, w| (
            (l1, l2),
            self.eps
        ))?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::sys::train_kernels::rms_norm_fwd(self.eps, (s1, l1), (s2, l2))?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let dx = x.apply_op3_no_bwd(w, &g, &RmsNormBwdDx { eps: self.eps })?;
        let width = w.elem_count();
        let rstd = x.apply_op1_no_bwd(&RmsRstd {
            eps: self.eps,
            width,
        })?;
        let partial = x.apply_op3_no_bwd(&g, &rstd, &RmsNormBwdDw { width })?;
        let dw = partial.sum(0)?.to_dtype(w.dtype())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Each row's `1 / sqrt(mean(x²) + eps)`, F32.
#[derive(Debug, Clone, Copy)]
struct RmsRstd {
    eps: f32,
    width: usize,
}

impl RmsRstd {
    const NAME: &'static str = "fused-rms-norm-rstd";
}

fn rms_rstd_cpu<T: WithDType>(x: &[T], l: &Layout, width: usize, eps: f32) -> Result<CpuStorage> {
    let x = contiguous(x, l, RmsRstd::NAME)?;
    check_rows(RmsRstd::NAME, x.len(), width)?;
    Ok(CpuStorage::F32(
        x.chunks(width).map(|r| rstd_of(&row_f32(r), eps)).collect(),
    ))
}

impl candle_core::CustomOp1 for RmsRstd {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(x) => rms_rstd_cpu(x, l, self.width, self.eps)?,
            CpuStorage::F16(x) => rms_rstd_cpu(x, l, self.width, self.eps)?,
            CpuStorage::BF16(x) => rms_rstd_cpu(x, l, self.width, self.eps)?,
            other => candle_core::bail!("{}: unsupported dtype {:?}", Self::NAME, other.dtype()),
        };
        Ok((out, Shape::from(l.shape().elem_count() / self.width)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::sys::train_kernels::rms_rstd(self.eps, self.width, (s, l))?;
        Ok((out, Shape::from(l.shape().elem_count() / self.width)))
    }
}

/// RMSNorm's input gradient: `r·g·w - x·r³·mean(g·w·x)` per row.
#[derive(Debug, Clone, Copy)]
struct RmsNormBwdDx {
    eps: f32,
}

impl RmsNormBwdDx {
    const NAME: &'static str = "fused-rms-norm-bwd";
}

fn rms_norm_bwd_dx_cpu<T: WithDType>(
    x: &[T],
    w: &[T],
    g: &[T],
    (xl, wl, gl): (&Layout, &Layout, &Layout),
    eps: f32,
) -> Result<CpuStorage>
where
    Vec<T>: IntoCpu,
{
    let op = RmsNormBwdDx::NAME;
    let (x, w, g) = (
        contiguous(x, xl, op)?,
        contiguous(w, wl, op)?,
        contiguous(g, gl, op)?,
    );
    check_rows(op, x.len(), w.len())?;
    if g.len() != x.len() {
        candle_core::bail!("{op}: gradient of {} for x of {}", g.len(), x.len());
    }
    let n = w.len();
    let w = row_f32(w);
    let mut out = Vec::with_capacity(x.len());
    for (xr, gr) in x.chunks(n).zip(g.chunks(n)) {
        let (xr, gr) = (row_f32(xr), row_f32(gr));
        let r = rstd_of(&xr, eps);
        let dot: f32 = xr
            .iter()
            .zip(&gr)
            .zip(&w)
            .map(|((x, g), w)| g * w * x)
            .sum();
        let c = dot / n as f32 * r * r * r;
        out.extend(
            xr.iter()
                .zip(&gr)
                .zip(&w)
                .map(|((x, g), w)| of_f32::<T>(r * g * w - x * c)),
        );
    }
    Ok(out.into_cpu())
}

impl candle_core::CustomOp3 for RmsNormBwdDx {
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
        let out = cpu_same!(Self::NAME, [s1, s2, s3], rms_norm_bwd_dx_cpu, |x, w, g| (
            (l1, l2, l3),
            self.eps
        ))?;
        Ok((out, l1.shape().clone()))
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
        let out =
            crate::sys::train_kernels::rms_norm_bwd_dx(self.eps, (s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, l1.shape().clone()))
    }
}

/// RMSNorm's weight gradient as F32 partial sums of `g · x · rstd` over chunks of rows
/// (chunks, width); their sum over dim 0 is the gradient.
#[derive(Debug, Clone, Copy)]
struct RmsNormBwdDw {
    width: usize,
}

impl RmsNormBwdDw {
    const NAME: &'static str = "fused-rms-norm-bwd-weight";
}

fn rms_norm_bwd_dw_cpu<T: WithDType>(
    x: &[T],
    g: &[T],
    rstd: &[f32],
    (xl, gl, rl): (&Layout, &Layout, &Layout),
    n: usize,
) -> Result<Vec<f32>> {
    let op = RmsNormBwdDw::NAME;
    let (x, g, rstd) = (
        contiguous(x, xl, op)?,
        contiguous(g, gl, op)?,
        contiguous(rstd, rl, op)?,
    );
    check_rows(op, x.len(), n)?;
    if g.len() != x.len() || rstd.len() * n != x.len() {
        candle_core::bail!("{op}: buffers do not match x");
    }
    let mut acc = vec![0f32; n];
    for ((xr, gr), &r) in x.chunks(n).zip(g.chunks(n)).zip(rstd) {
        for ((a, &x), &g) in acc.iter_mut().zip(xr).zip(gr) {
            *a += f32_of(g) * f32_of(x) * r;
        }
    }
    Ok(acc)
}

impl candle_core::CustomOp3 for RmsNormBwdDw {
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
        let CpuStorage::F32(r) = s3 else {
            candle_core::bail!("{}: rstd has to be F32", Self::NAME)
        };
        let ls = (l1, l2, l3);
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => {
                rms_norm_bwd_dw_cpu(x, g, r, ls, self.width)
            }
            (CpuStorage::F16(x), CpuStorage::F16(g)) => {
                rms_norm_bwd_dw_cpu(x, g, r, ls, self.width)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => {
                rms_norm_bwd_dw_cpu(x, g, r, ls, self.width)
            }
            _ => candle_core::bail!("{}: unsupported or mixed dtypes", Self::NAME),
        }?;
        Ok((CpuStorage::F32(out), Shape::from((1, self.width))))
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
        use crate::sys::train_kernels as k;
        let out = k::rms_norm_bwd_dw(self.width, (s1, l1), (s2, l2), (s3, l3))?;
        let rows = l1.shape().elem_count() / self.width;
        Ok((
            out,
            Shape::from((rows.div_ceil(k::DW_ROWS_PER_CHUNK), self.width)),
        ))
    }
}

/// RMSNorm over the last dim, `x / sqrt(mean(x²) + eps) · weight`, with gradients for `x`
/// and `weight` (unlike `candle_nn::RmsNorm::forward`, which cuts them on contiguous input).
/// One dtype for both; F32 accumulation.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    check_dtypes(RmsNorm::NAME, &[x, weight])?;
    let width = x.dim(D::Minus1)?;
    if weight.dims1()? != width {
        candle_core::bail!(
            "{}: weight {:?} does not match the last dim of x {:?}",
            RmsNorm::NAME,
            weight.shape(),
            x.shape()
        );
    }
    if x.elem_count() == 0 {
        return rms_norm_composite(x, weight, eps);
    }
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })
}

/// [`rms_norm`]'s backward pass outside Candle's graph, for blocks that compute their own:
/// `(dx, dweight)` for the output's gradient `dy` (all of `x`'s dtype; `x` and `weight` as
/// the forward pass had them).
pub fn rms_norm_backward(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    dy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    use candle_core::CustomOp2;
    check_dtypes(RmsNorm::NAME, &[x, weight, dy])?;
    if x.shape() != dy.shape() || weight.dims1()? != x.dim(D::Minus1)? || x.elem_count() == 0 {
        candle_core::bail!(
            "{}: backward of x {:?}, weight {:?} with dy {:?}",
            RmsNorm::NAME,
            x.shape(),
            weight.shape(),
            dy.shape()
        );
    }
    let op = RmsNorm { eps: eps as f32 };
    match op.bwd(&x.contiguous()?, &weight.contiguous()?, dy, dy)? {
        (Some(dx), Some(dw)) => Ok((dx, dw)),
        _ => candle_core::bail!("{}: backward gave no gradient", RmsNorm::NAME),
    }
}

/// The composition [`rms_norm`] replaces (candle-nn's `rms_norm_slow`, differentiable): the
/// mean of squares in F32, then the weight in the input's dtype.
pub fn rms_norm_composite(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    candle_nn::ops::rms_norm_slow(x, weight, eps as f32)
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

#[derive(Debug, Clone, Copy)]
struct SwiGlu;

impl SwiGlu {
    const NAME: &'static str = "fused-swiglu";
}

fn sigmoid(a: f32) -> f32 {
    1.0 / (1.0 + (-a).exp())
}

fn swiglu_cpu<T: WithDType>(g: &[T], u: &[T], (gl, ul): (&Layout, &Layout)) -> Result<CpuStorage>
where
    Vec<T>: IntoCpu,
{
    let (g, u) = (
        contiguous(g, gl, SwiGlu::NAME)?,
        contiguous(u, ul, SwiGlu::NAME)?,
    );
    let out: Vec<T> = g
        .iter()
        .zip(u)
        .map(|(&g, &u)| {
            let a = f32_of(g);
            of_f32(a * sigmoid(a) * f32_of(u))
        })
        .collect();
    Ok(out.into_cpu())
}

impl candle_core::CustomOp2 for SwiGlu {
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
        let out = cpu_same!(Self::NAME, [s1, s2], swiglu_cpu, |g, u| ((l1, l2)))?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::sys::train_kernels::swiglu_fwd((s1, l1), (s2, l2))?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let both = gate.apply_op3_no_bwd(up, &grad.contiguous()?, &SwiGluBwd)?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

/// SwiGLU's gradients, stacked: (2, shape…), d gate then d up.
#[derive(Debug, Clone, Copy)]
struct SwiGluBwd;

impl SwiGluBwd {
    const NAME: &'static str = "fused-swiglu-bwd";
}

fn swiglu_bwd_cpu<T: WithDType>(
    a: &[T],
    u: &[T],
    g: &[T],
    (al, ul, gl): (&Layout, &Layout, &Layout),
) -> Result<CpuStorage>
where
    Vec<T>: IntoCpu,
{
    let op = SwiGluBwd::NAME;
    let (a, u, g) = (
        contiguous(a, al, op)?,
        contiguous(u, ul, op)?,
        contiguous(g, gl, op)?,
    );
    let n = a.len();
    let mut out = vec![of_f32::<T>(0.0); 2 * n];
    let (da, du) = out.split_at_mut(n);
    for i in 0..n {
        let (x, s, gi) = (f32_of(a[i]), sigmoid(f32_of(a[i])), f32_of(g[i]));
        da[i] = of_f32(gi * f32_of(u[i]) * s * (1.0 + x * (1.0 - s)));
        du[i] = of_f32(gi * x * s);
    }
    Ok(out.into_cpu())
}

impl candle_core::CustomOp3 for SwiGluBwd {
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
        let out = cpu_same!(Self::NAME, [s1, s2, s3], swiglu_bwd_cpu, |a, u, g| ((
            l1, l2, l3
        )))?;
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
        let out = crate::sys::train_kernels::swiglu_bwd((s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, stacked_shape(l1)))
    }
}

/// `(2, dims…)`.
fn stacked_shape(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

/// `silu(gate) · up` (the SwiGLU MLP's elementwise part), with gradients for both; `gate` and
/// `up` of one shape and dtype.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_dtypes(SwiGlu::NAME, &[gate, up])?;
    if gate.shape() != up.shape() {
        candle_core::bail!(
            "{}: gate {:?} and up {:?} differ in shape",
            SwiGlu::NAME,
            gate.shape(),
            up.shape()
        );
    }
    if gate.elem_count() == 0 {
        return swiglu_composite(gate, up);
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

/// [`swiglu`]'s backward pass outside Candle's graph, for blocks that compute their own:
/// `(dgate, dup)` for the output's gradient `dy` (one shape and dtype for all three).
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    use candle_core::CustomOp2;
    check_dtypes(SwiGlu::NAME, &[gate, up, dy])?;
    if gate.shape() != up.shape() || gate.shape() != dy.shape() || gate.elem_count() == 0 {
        candle_core::bail!(
            "{}: backward of gate {:?}, up {:?} with dy {:?}",
            SwiGlu::NAME,
            gate.shape(),
            up.shape(),
            dy.shape()
        );
    }
    match SwiGlu.bwd(&gate.contiguous()?, &up.contiguous()?, dy, dy)? {
        (Some(dg), Some(du)) => Ok((dg, du)),
        _ => candle_core::bail!("{}: backward gave no gradient", SwiGlu::NAME),
    }
}

/// The composition [`swiglu`] replaces.
pub fn swiglu_composite(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    candle_nn::ops::silu(gate)? * up
}

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy

#[derive(Debug, Clone, Copy)]
struct CrossEntropy {
    vocab: usize,
}

impl CrossEntropy {
    const NAME: &'static str = "fused-cross-entropy";
}

fn logsumexp(row: &[f32]) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f32 = row.iter().map(|v| (v - m).exp()).sum();
    m + s.ln()
}

fn target_in(op: &str, t: u32, vocab: usize) -> Result<usize> {
    let t = t as usize;
    if t >= vocab {
        candle_core::bail!("{op}: target {t} is outside the vocabulary of {vocab}");
    }
    Ok(t)
}

fn cross_entropy_cpu<T: WithDType>(
    x: &[T],
    t: &[u32],
    (xl, tl): (&Layout, &Layout),
    v: usize,
) -> Result<Vec<f32>> {
    let op = CrossEntropy::NAME;
    let (x, t) = (contiguous(x, xl, op)?, contiguous(t, tl, op)?);
    check_rows(op, x.len(), v)?;
    x.chunks(v)
        .zip(t)
        .map(|(row, &t)| {
            let row = row_f32(row);
            Ok(logsumexp(&row) - row[target_in(op, t, v)?])
        })
        .collect()
}

impl candle_core::CustomOp2 for CrossEntropy {
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
        let CpuStorage::U32(t) = s2 else {
            candle_core::bail!("{}: targets have to be U32", Self::NAME)
        };
        let ls = (l1, l2);
        let out = match s1 {
            CpuStorage::F32(x) => cross_entropy_cpu(x, t, ls, self.vocab),
            CpuStorage::F16(x) => cross_entropy_cpu(x, t, ls, self.vocab),
            CpuStorage::BF16(x) => cross_entropy_cpu(x, t, ls, self.vocab),
            other => candle_core::bail!("{}: unsupported dtype {:?}", Self::NAME, other.dtype()),
        }?;
        Ok((CpuStorage::F32(out), l2.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::sys::train_kernels::cross_entropy_fwd(self.vocab, (s1, l1), (s2, l2))?;
        Ok((out, l2.shape().clone()))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(DType::F32)?.contiguous()?;
        let dx = logits.apply_op3_no_bwd(targets, &g, &CrossEntropyBwd { vocab: self.vocab })?;
        Ok((Some(dx), None))
    }
}

/// The logits' gradient: `(softmax(x) - onehot(t)) · g` per row.
#[derive(Debug, Clone, Copy)]
struct CrossEntropyBwd {
    vocab: usize,
}

impl CrossEntropyBwd {
    const NAME: &'static str = "fused-cross-entropy-bwd";
}

fn cross_entropy_bwd_cpu<T: WithDType>(
    x: &[T],
    t: &[u32],
    g: &[f32],
    (xl, tl, gl): (&Layout, &Layout, &Layout),
    v: usize,
) -> Result<CpuStorage>
where
    Vec<T>: IntoCpu,
{
    let op = CrossEntropyBwd::NAME;
    let (x, t, g) = (
        contiguous(x, xl, op)?,
        contiguous(t, tl, op)?,
        contiguous(g, gl, op)?,
    );
    check_rows(op, x.len(), v)?;
    if t.len() * v != x.len() || g.len() != t.len() {
        candle_core::bail!("{op}: buffers do not match the logits");
    }
    let mut out = Vec::with_capacity(x.len());
    for ((row, &t), &g) in x.chunks(v).zip(t).zip(g) {
        let row = row_f32(row);
        let t = target_in(op, t, v)?;
        let lse = logsumexp(&row);
        out.extend(row.iter().enumerate().map(|(i, x)| {
            let p = (x - lse).exp() - if i == t { 1.0 } else { 0.0 };
            of_f32::<T>(p * g)
        }));
    }
    Ok(out.into_cpu())
}

impl candle_core::CustomOp3 for CrossEntropyBwd {
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
        let (CpuStorage::U32(t), CpuStorage::F32(g)) = (s2, s3) else {
            candle_core::bail!("{}: targets have to be U32, gradients F32", Self::NAME)
        };
        let ls = (l1, l2, l3);
        let out = match s1 {
            CpuStorage::F32(x) => cross_entropy_bwd_cpu(x, t, g, ls, self.vocab),
            CpuStorage::F16(x) => cross_entropy_bwd_cpu(x, t, g, ls, self.vocab),
            CpuStorage::BF16(x) => cross_entropy_bwd_cpu(x, t, g, ls, self.vocab),
            other => candle_core::bail!("{}: unsupported dtype {:?}", Self::NAME, other.dtype()),
        }?;
        Ok((out, l1.shape().clone()))
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
        let out =
            crate::sys::train_kernels::cross_entropy_bwd(self.vocab, (s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, l1.shape().clone()))
    }
}

/// [`cross_entropy`]'s backward pass outside Candle's graph, for heads that compute their own:
/// the logits' gradient (their dtype) for each row's loss gradient `dy` (rows), from the
/// forward pass's logits and targets.
pub fn cross_entropy_backward(logits: &Tensor, targets: &Tensor, dy: &Tensor) -> Result<Tensor> {
    use candle_core::CustomOp2;
    check_dtypes(CrossEntropy::NAME, &[logits])?;
    let (rows, vocab) = logits.dims2()?;
    if targets.dims1()? != rows || targets.dtype() != DType::U32 || dy.dims1()? != rows {
        candle_core::bail!(
            "{}: backward of logits {:?} with targets {:?} {:?} and dy {:?}",
            CrossEntropy::NAME,
            logits.shape(),
            targets.shape(),
            targets.dtype(),
            dy.shape()
        );
    }
    if rows == 0 || vocab == 0 {
        return logits.zeros_like();
    }
    let (logits, targets) = (logits.contiguous()?, targets.contiguous()?);
    match (CrossEntropy { vocab }).bwd(&logits, &targets, dy, dy)? {
        (Some(dx), _) => Ok(dx),
        _ => candle_core::bail!("{}: backward gave no gradient", CrossEntropy::NAME),
    }
}

/// Softmax cross-entropy of each row of `logits` (rows, vocab) against `targets` (rows, U32):
/// `logsumexp(row) - row[target]` as F32 (rows), with the gradient for `logits` (in their
/// dtype). No target is ignored: one outside the vocabulary is an error on the CPU and gives
/// NaN on a GPU (checking it there would need a device-to-host copy).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    check_dtypes(CrossEntropy::NAME, &[logits])?;
    let (rows, vocab) = logits.dims2()?;
    if targets.dims1()? != rows || targets.dtype() != DType::U32 {
        candle_core::bail!(
            "{}: targets {:?} {:?} do not match logits {:?} (one U32 per row)",
            CrossEntropy::NAME,
            targets.shape(),
            targets.dtype(),
            logits.shape()
        );
    }
    if rows == 0 || vocab == 0 {
        return cross_entropy_composite(logits, targets);
    }
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropy { vocab })
}

/// The composition [`cross_entropy`] replaces (what the trainer computed before): F32
/// log-softmax, then the targets' entries, negated.
pub fn cross_entropy_composite(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?.neg()
}

// ---------------------------------------------------------------------------------------------
// AdamW

/// PyTorch AdamW (decoupled weight decay, bias correction; candle-nn's `ParamsAdamW`) over F32
/// variables, fused: on a GPU one kernel launch steps every parameter with a gradient, its
/// moments kept in two flat F32 buffers on the device; on the CPU it is
/// [`HostAdamW`]. The arithmetic is candle-nn's `AdamW`, operation by
/// operation in F32, so the trajectories agree to rounding.
#[derive(Debug)]
pub struct FusedAdamW {
    state: AdamState,
    params: ParamsAdamW,
    step_t: usize,
}

#[derive(Debug)]
enum AdamState {
    Host(HostAdamW),
    Device {
        vars: Vec<Var>,
        /// Where each variable's moments start in `m` and `v`.
        offsets: Vec<usize>,
        m: Tensor,
        v: Tensor,
    },
}

impl FusedAdamW {
    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Whether the masters and moments live in host memory (`HostAdamW` underneath).
    pub(crate) fn on_host(&self) -> bool {
        matches!(self.state, AdamState::Host(_))
    }

    /// An AdamW step on `grads` times `grad_scale`, the scaling done as the kernel reads each
    /// gradient (PyTorch's unscale-in-the-step for a loss scaled by `1 / grad_scale`): no pass
    /// of its own over the gradients. `step` is `step_scaled(grads, 1.0)`, exactly.
    pub fn step_scaled(&mut self, grads: &GradStore, grad_scale: f64) -> Result<()> {
        let (vars, offsets, m, v) = match &mut self.state {
            AdamState::Host(o) => {
                if grad_scale == 1.0 {
                    return o.step(grads);
                }
                let mut scaled = GradStore::default();
                for &id in grads.get_ids() {
                    if let Some(g) = grads.get_id(id) {
                        scaled.insert_id(id, g.affine(grad_scale, 0.)?);
                    }
                }
                return o.step(&scaled);
            }
            AdamState::Device {
                vars,
                offsets,
                m,
                v,
            } => (vars, offsets, m, v),
        };
        self.step_t += 1;
        let p = &self.params;
        let t = self.step_t as i32;
        // The kernel's scalars as candle-nn's tensor ops round them (f64, then f32): lr,
        // 1 - lr·wd, β1, 1 - β1, β2, 1 - β2, the bias corrections 1 / (1 - βᵗ), eps, and the
        // gradients' factor.
        let scalars = [
            p.lr,
            1.0 - p.lr * p.weight_decay,
            p.beta1,
            1.0 - p.beta1,
            p.beta2,
            1.0 - p.beta2,
            1.0 / (1.0 - p.beta1.powi(t)),
            1.0 / (1.0 - p.beta2.powi(t)),
            p.eps,
            grad_scale,
        ]
        .map(|x| x as f32);
        let mut items = Vec::new();
        for (var, &offset) in vars.iter().zip(offsets.iter()) {
            if let Some(g) = grads.get(var) {
                if g.dims() != var.dims() {
                    candle_core::bail!(
                        "FusedAdamW: gradient {:?} for a variable {:?}",
                        g.shape(),
                        var.shape()
                    );
                }
                let g = g.to_dtype(DType::F32)?.contiguous()?;
                items.push((var.as_tensor().clone(), g, offset));
            }
        }
        device::adamw_step(&items, m, v, scalars)
    }
}

impl Optimizer for FusedAdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let Some(first) = vars.first() else {
            return Ok(Self {
                state: AdamState::Host(HostAdamW::new(vars, params.clone())?),
                params,
                step_t: 0,
            });
        };
        let device = first.device().clone();
        for v in &vars {
            if v.dtype() != DType::F32 || !v.device().same_device(&device) {
                candle_core::bail!(
                    "FusedAdamW updates F32 variables on one device; got {:?} on {:?} beside {:?}",
                    v.dtype(),
                    v.device(),
                    device
                );
            }
        }
        let state = if device.is_cpu() {
            AdamState::Host(HostAdamW::new(vars, params.clone())?)
        } else if device.is_cuda() {
            let mut offsets = Vec::with_capacity(vars.len());
            let mut total = 0;
            for v in &vars {
                offsets.push(total);
                total += v.elem_count();
            }
            AdamState::Device {
                m: Tensor::zeros(total, DType::F32, &device)?,
                v: Tensor::zeros(total, DType::F32, &device)?,
                vars,
                offsets,
            }
        } else {
            candle_core::bail!("FusedAdamW: no kernel for {device:?}")
        };
        Ok(Self {
            state,
            params,
            step_t: 0,
        })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_scaled(grads, 1.0)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
        if let AdamState::Host(o) = &mut self.state {
            o.set_learning_rate(lr);
        }
    }
}

/// The multi-tensor launch (the one place that needs the CUDA build).
#[cfg(feature = "cuda")]
mod device {
    use candle_core::{Result, Storage, Tensor};

    use crate::sys::train_kernels as k;

    /// Steps `(parameter, F32 contiguous gradient, moment offset)` in one launch.
    pub(super) fn adamw_step(
        items: &[(Tensor, Tensor, usize)],
        m: &Tensor,
        v: &Tensor,
        scalars: [f32; 10],
    ) -> Result<()> {
        let (ms, ml) = m.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (Storage::Cuda(ms), Storage::Cuda(vs)) = (&*ms, &*vs) else {
            candle_core::bail!("FusedAdamW: moments are not on the GPU")
        };
        let guards: Vec<_> = items
            .iter()
            .map(|(p, g, o)| (p.storage_and_layout(), g.storage_and_layout(), *o))
            .collect();
        let mut list = Vec::with_capacity(guards.len());
        for ((ps, pl), (gs, gl), offset) in &guards {
            let (Storage::Cuda(ps), Storage::Cuda(gs)) = (&**ps, &**gs) else {
                candle_core::bail!("FusedAdamW: a parameter or gradient is not on the GPU")
            };
            list.push(k::AdamItem {
                param: (ps, pl),
                grad: (gs, gl),
                offset: *offset,
            });
        }
        k::adamw_multi(&list, (ms, ml), (vs, vl), scalars)
    }
}

#[cfg(not(feature = "cuda"))]
mod device {
    use candle_core::{Result, Tensor};

    /// Without CUDA there are no device variables to step (`FusedAdamW::new` refuses them).
    pub(super) fn adamw_step(
        _items: &[(Tensor, Tensor, usize)],
        _m: &Tensor,
        _v: &Tensor,
        _scalars: [f32; 10],
    ) -> Result<()> {
        candle_core::bail!("FusedAdamW on a GPU needs a build with `--features cuda`")
    }
}
