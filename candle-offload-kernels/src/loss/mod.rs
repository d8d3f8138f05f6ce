//! Per-row softmax cross-entropy of logits against U32 targets with its own backward pass
//! ([`cross_entropy`]): computed over the vocabulary in block-wide chunks, the forward keeping
//! one log-sum-exp per row and the backward recomputing the probabilities chunk by chunk, so no
//! F32 probability matrix exists. On a CUDA device it runs `kernels/loss.cu`; on the CPU a
//! direct loop computes the same thing. The losses are F32.

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType, D};

use crate::util::{check_dtypes, check_rows, contiguous, of_f32, row_f32, IntoCpu};

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
        let out = crate::loss::cuda::cross_entropy_fwd(self.vocab, (s1, l1), (s2, l2))?;
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
        let out = crate::loss::cuda::cross_entropy_bwd(self.vocab, (s1, l1), (s2, l2), (s3, l3))?;
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
