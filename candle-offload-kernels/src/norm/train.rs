//! RMSNorm for training with its own backward pass ([`rms_norm`]): Candle's fast RMSNorm has
//! none (and `candle_nn::RmsNorm::forward` silently cuts the gradient on contiguous input), so
//! training would otherwise run its composition, a dozen elementwise and reduction kernels each
//! way.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, Shape, Tensor, WithDType, D};

use crate::util::{
    check_dtypes, check_rows, contiguous, cpu_same, f32_of, of_f32, row_f32, IntoCpu,
};

fn rstd_of(row: &[f32], eps: f32) -> f32 {
    let ss: f32 = row.iter().map(|v| v * v).sum();
    1.0 / (ss / row.len() as f32 + eps).sqrt()
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
        let out = crate::norm::cuda::rms_norm_fwd(self.eps, (s1, l1), (s2, l2))?;
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
        let out = crate::norm::cuda::rms_rstd(self.eps, self.width, (s, l))?;
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
        let out = crate::norm::cuda::rms_norm_bwd_dx(self.eps, (s1, l1), (s2, l2), (s3, l3))?;
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
        use crate::norm::cuda as k;
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
