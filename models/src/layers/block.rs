//! The pre-norm decoder layer that LLaMA, Qwen3, Phi-3 and Gemma 1/2/3 are all instances of:
//! `h = x + post_attn(attn(norm(x)))`, `out = h + post_mlp(mlp(pre_mlp(h)))`, with the residual
//! add and the next norm in one kernel on a fused step.

use candle_core::{Result, Tensor};

use super::attention::SelfAttention;
use super::cache::KvCache;
use super::linear::Linear;
use super::mlp::GatedMlp;
use super::moe::SparseMoe;
use super::norm::Norm;
use crate::family::{DecoderBlock, Hidden, RaggedSegment, StepCtx, TrainCtx};

/// A pre-norm decoder layer:
/// `h = x + post_attn(attn(norm(x)))`, `out = h + post_mlp(mlp(pre_mlp(h)))`, where the
/// post-norms exist only in Gemma 2 and 3.
#[derive(Debug)]
pub struct PreNormBlock {
    /// Before attention.
    pub input_norm: Norm,
    /// Self-attention.
    pub attn: SelfAttention,
    /// After attention, before the residual add (Gemma 2, 3).
    pub post_attn_norm: Option<Norm>,
    /// Before the MLP.
    pub pre_mlp_norm: Norm,
    /// The MLP: dense, or a mixture of experts.
    pub mlp: FeedForward,
    /// After the MLP, before the residual add (Gemma 2, 3).
    pub post_mlp_norm: Option<Norm>,
}

/// A block's MLP: dense, or a sparse mixture of experts.
#[derive(Debug)]
pub enum FeedForward {
    /// A gated MLP.
    Dense(GatedMlp),
    /// A mixture of experts.
    Sparse(SparseMoe),
}

impl From<GatedMlp> for FeedForward {
    fn from(m: GatedMlp) -> Self {
        Self::Dense(m)
    }
}

impl From<SparseMoe> for FeedForward {
    fn from(m: SparseMoe) -> Self {
        Self::Sparse(m)
    }
}

impl FeedForward {
    /// The linear layer that reads the normed rows first (none for a mixture of experts,
    /// whose router reads them first, in floats).
    fn first(&self) -> Option<&Linear> {
        match self {
            Self::Dense(m) => Some(m.first()),
            Self::Sparse(_) => None,
        }
    }

    fn forward(&self, xs: &Tensor, ctx: &StepCtx<'_>) -> Result<Tensor> {
        match self {
            Self::Dense(m) if ctx.fused => m.forward_fused(xs),
            Self::Dense(m) => m.forward(xs),
            Self::Sparse(m) => m.forward(xs, ctx, ctx.fused),
        }
    }

    fn forward_train(&self, xs: &Tensor, fused: bool) -> Result<Tensor> {
        match self {
            Self::Dense(m) if fused => m.forward_train_fused(xs),
            Self::Dense(m) => m.forward_train(xs),
            Self::Sparse(_) => {
                candle_core::bail!("mixture-of-experts layers have no training path")
            }
        }
    }
}

/// `norm(a + b)` and the sum: in one kernel on a fused step with an RMSNorm computed in the
/// inputs' dtype, all three of one dtype, the normed rows made for `next`, the linear layer
/// that reads them ([`candle_offload::kernels::norm::rms_norm_residual_for`]; plain rows when
/// no linear layer reads them first); otherwise the add, then the norm.
fn add_norm(
    norm: &Norm,
    ctx: &StepCtx<'_>,
    a: Tensor,
    b: Tensor,
    next: Option<&Linear>,
) -> Result<(Tensor, Tensor)> {
    let fusable = norm
        .rms_parts()
        .filter(|(w, _)| ctx.fused && w.dtype() == a.dtype() && b.dtype() == a.dtype());
    match (fusable, next) {
        (Some((w, eps)), Some(next)) => {
            candle_offload::kernels::norm::rms_norm_residual_for(&a, &b, w, eps, next)
        }
        (Some((w, eps)), None) => candle_offload::kernels::norm::rms_norm_residual(&a, &b, w, eps),
        (None, _) => {
            let sum = (a + b)?;
            let normed = norm.forward(&sum)?;
            Ok((sum, normed))
        }
    }
}

impl PreNormBlock {
    /// The block over `xs` with `attn` as its attention (on the normed rows).
    fn run(
        &self,
        xs: Hidden,
        ctx: &StepCtx<'_>,
        attn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Hidden> {
        let (residual, normed) = match xs {
            Hidden::Whole(xs) => {
                let normed = self.input_norm.forward(&xs)?;
                (xs, normed)
            }
            Hidden::Split { h, residual } => {
                add_norm(&self.input_norm, ctx, h, residual, Some(self.attn.first()))?
            }
        };
        let h = attn(&normed)?;
        let h = match &self.post_attn_norm {
            Some(n) => n.forward(&h)?,
            None => h,
        };
        // The residual add and the norm after it in one kernel where it can.
        let (xs, normed) = add_norm(&self.pre_mlp_norm, ctx, h, residual, self.mlp.first())?;
        let h = self.mlp.forward(&normed, ctx)?;
        match &self.post_mlp_norm {
            Some(n) => Ok(Hidden::Whole((n.forward(&h)? + xs)?)),
            None if ctx.fused => Ok(Hidden::Split { h, residual: xs }),
            None => Ok(Hidden::Whole((h + xs)?)),
        }
    }
}

impl DecoderBlock for PreNormBlock {
    fn forward(&self, xs: &Tensor, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Tensor> {
        self.forward_hidden(Hidden::Whole(xs.clone()), ctx, kv)?
            .into_tensor()
    }

    /// A fused step leaves the MLP's residual add to the next block's input norm (or the
    /// caller), which does it in its own kernel.
    fn forward_hidden(&self, xs: Hidden, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Hidden> {
        self.run(xs, ctx, |normed| self.attn.forward(normed, ctx, kv))
    }

    fn forward_ragged(
        &self,
        xs: Hidden,
        ctx: &StepCtx<'_>,
        segs: &[RaggedSegment],
        kvs: &mut [&mut KvCache],
    ) -> Result<Hidden> {
        self.run(xs, ctx, |normed| {
            self.attn.forward_ragged(normed, ctx, segs, kvs)
        })
    }

    /// The residual stream stays in `xs`'s dtype (F32 under autocast), norms run in it, and
    /// the attention and MLP compute in `ctx.compute`.
    fn forward_train(&self, xs: &Tensor, ctx: &TrainCtx<'_>) -> Result<Tensor> {
        if ctx.fused {
            if let Some(out) = self.forward_train_by_hand(xs, ctx)? {
                return Ok(out);
            }
        }
        let residual = xs;
        let stream = residual.dtype();
        let fused = ctx.fused;
        let h = self.input_norm.forward_train(xs, fused)?;
        let h = self.attn.forward_train(&h.to_dtype(ctx.compute)?, ctx)?;
        let h = h.to_dtype(stream)?;
        let h = match &self.post_attn_norm {
            Some(n) => n.forward_train(&h, fused)?,
            None => h,
        };
        let xs = (h + residual)?;
        let h = self.pre_mlp_norm.forward_train(&xs, fused)?;
        let h = h.to_dtype(ctx.compute)?;
        let h = self.mlp.forward_train(&h, fused)?;
        let h = h.to_dtype(stream)?;
        let h = match &self.post_mlp_norm {
            Some(n) => n.forward_train(&h, fused)?,
            None => h,
        };
        h + xs
    }
}
