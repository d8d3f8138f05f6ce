//! The pre-norm decoder layer's training pass with a hand-written backward pass.
//!
//! Through Candle's autograd, every op of a layer is a graph node, and Candle's backward walk
//! sums each node's gradient into a fresh zeroed buffer (`GradStore::or_insert` then `add`),
//! views and casts included: about forty full-size memsets and adds per layer, much of the GPU
//! time of a BF16 step. Candle's walk cannot be replaced (its
//! ops are private), so here the whole layer is one node ([`with_gradient`]): the forward pass
//! runs the same kernels without a graph and keeps what the backward pass reads; the backward
//! pass calls the fused ops' backward kernels, the matmuls' transposes and RoPE's inverse
//! rotation directly, writes each gradient once, frees the layer's activations as soon as it
//! has run, and hands the weights' gradients to the trainer through [`WeightGradSink`] (the
//! weights are not inputs of the node, so Candle computes nothing for them).
//!
//! Only the block this was written for takes this path: RMSNorm before attention and MLP (no
//! post-norms), separate q/k/v/o projections (biases allowed), plain causal flash attention
//! with full-width RoPE, a SiLU-gated MLP with separate projections; every projection either a
//! trained dense weight in the compute dtype, or, on a frozen base (LoRA), a frozen weight,
//! dense in the compute dtype or GGML blocks, with or without an adapter (without dropout),
//! whose gradients are then the only ones handed over. Anything else returns `None` and runs
//! through Candle's graph as before.

use std::sync::Mutex;

use candle_core::{DType, Result, Tensor};
use candle_offload::kernels::activation::{swiglu, swiglu_backward};
use candle_offload::kernels::attention::{
    flash_attention_backward, flash_attention_forward, flash_attention_supported, FlashState,
};
use candle_offload::kernels::norm::{rms_norm, rms_norm_backward};
use candle_offload::train::grad::with_gradient;

use super::attention::Qkv;
use super::block::{FeedForward, PreNormBlock};
use super::linear::{Linear, LinearWeight};
use super::mlp::{Activation, GateUp};
use super::norm::Norm;
use crate::family::{TrainCtx, WeightGradSink};

/// A projection: a trained dense weight (its gradient handed over under the weight as
/// served), or a frozen one, dense or GGML blocks, with its LoRA adapter if it has one (only
/// the adapter's gradients handed over).
enum Proj {
    Trained {
        served: Tensor,
        w: Tensor,
        bias: Option<(Tensor, Tensor)>,
    },
    Frozen(Linear),
}

impl Proj {
    /// `l` as this path runs it, computing in `dtype`: trained, a dense weight in `dtype`
    /// without an adapter; frozen (`frozen`), any weight whose adapter has no dropout (the
    /// recomputed forward pass must repeat the first).
    fn of(l: &Linear, dtype: DType, frozen: bool) -> Option<Self> {
        if frozen {
            if l.adapter().is_some_and(|a| a.dropout() > 0.0) {
                return None;
            }
            return match l.weight() {
                LinearWeight::Dense(w) if w.dtype() != dtype || w.rank() != 2 => None,
                _ => Some(Self::Frozen(l.clone())),
            };
        }
        if l.adapter().is_some() {
            return None;
        }
        let LinearWeight::Dense(w) = l.weight() else {
            return None;
        };
        if w.dtype() != dtype || w.rank() != 2 {
            return None;
        }
        Some(Self::Trained {
            served: w.clone(),
            w: w.detach(),
            bias: l.bias().map(|b| (b.clone(), b.detach())),
        })
    }

    /// `x W^T (+ b)` (plus the adapter's update) for x (rows, in).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Trained { w, bias, .. } => {
                let y = x.matmul(&w.t()?)?;
                match bias {
                    Some((_, b)) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
            Self::Frozen(l) => l.forward_frozen(x),
        }
    }

    /// The input's gradient for `dy` (rows, out), after handing the trained weight's (and
    /// bias's), or the adapter's, gradients to `sink`.
    fn backward(&self, x: &Tensor, dy: &Tensor, sink: &WeightGradSink) -> Result<Tensor> {
        match self {
            Self::Trained { served, w, bias } => {
                sink(served, dy.t()?.matmul(x)?)?;
                if let Some((served, _)) = bias {
                    sink(served, dy.to_dtype(DType::F32)?.sum(0)?)?;
                }
                dy.matmul(w)
            }
            Self::Frozen(l) => {
                let dx = l.input_gradient(dy)?;
                let Some(adapter) = l.adapter() else {
                    return Ok(dx);
                };
                let (dx, da, db) = adapter.backward(x, dy, dx)?;
                sink(adapter.a(), da)?;
                sink(adapter.b(), db)?;
                Ok(dx)
            }
        }
    }
}

/// An RMSNorm's weight (served and detached), epsilon, and whether it is trained.
struct RmsWeight {
    served: Tensor,
    w: Tensor,
    eps: f64,
    trained: bool,
}

impl RmsWeight {
    fn of(n: &Norm, dtype: DType, trained: bool) -> Option<Self> {
        let (w, eps) = n.rms_parts()?;
        (w.dtype() == dtype).then(|| Self {
            served: w.clone(),
            w: w.detach(),
            eps,
            trained,
        })
    }

    /// The input's gradient for the output's gradient `dy` (any float dtype; taken in the
    /// input's), after handing the weight's gradient to `sink` where it is trained.
    fn backward(&self, x: &Tensor, dy: &Tensor, sink: &WeightGradSink) -> Result<Tensor> {
        let (dx, dw) = rms_norm_backward(x, &self.w, self.eps, &dy.to_dtype(x.dtype())?)?;
        if self.trained {
            sink(&self.served, dw)?;
        }
        Ok(dx)
    }
}

/// The weights of a block this path can train.
struct Parts {
    input_norm: RmsWeight,
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    mlp_norm: RmsWeight,
    gate: Proj,
    up: Proj,
    down: Proj,
}

impl Parts {
    fn of(block: &PreNormBlock, xs: &Tensor, ctx: &TrainCtx<'_>) -> Result<Option<Self>> {
        let s = &block.attn.spec;
        let cd = ctx.compute;
        let FeedForward::Dense(mlp) = &block.mlp else {
            return Ok(None);
        };
        let plain = block.post_attn_norm.is_none()
            && block.post_mlp_norm.is_none()
            && s.softcap.is_none()
            && s.window.is_none()
            && !s.local_rope
            && block.attn.qk_norm.is_none()
            && mlp.act == Activation::Silu
            && ctx.masks.is_plain_causal()
            && ctx.rope.rotary_width()? >= s.head_dim
            && xs.rank() == 3
            && flash_attention_supported(xs.device(), cd, s.head_dim);
        if !plain {
            return Ok(None);
        }
        let (Qkv::Separate { q, k, v }, GateUp::Separate { gate, up }) =
            (&block.attn.qkv, &mlp.gate_up)
        else {
            return Ok(None);
        };
        let (stream, frozen) = (xs.dtype(), ctx.frozen_base);
        let parts = (|| {
            Some(Self {
                input_norm: RmsWeight::of(&block.input_norm, stream, !frozen)?,
                q: Proj::of(q, cd, frozen)?,
                k: Proj::of(k, cd, frozen)?,
                v: Proj::of(v, cd, frozen)?,
                o: Proj::of(&block.attn.o_proj, cd, frozen)?,
                mlp_norm: RmsWeight::of(&block.pre_mlp_norm, stream, !frozen)?,
                gate: Proj::of(gate, cd, frozen)?,
                up: Proj::of(up, cd, frozen)?,
                down: Proj::of(&mlp.down, cd, frozen)?,
            })
        })();
        Ok(parts)
    }
}

/// What the backward pass reads, taken (and so freed) when it runs.
struct Saved {
    x: Tensor,
    hc: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    flash: FlashState,
    o2: Tensor,
    x1: Tensor,
    h2c: Tensor,
    gate: Tensor,
    up: Tensor,
    act: Tensor,
}

impl PreNormBlock {
    /// The layer's output for `xs` (batch, seq, hidden) with its gradient computed by hand, or
    /// `None` where this block, device or context is not one this path handles (the caller
    /// then runs Candle's graph), or where no [`WeightGradSink`] is given.
    pub(super) fn forward_train_by_hand(
        &self,
        xs: &Tensor,
        ctx: &TrainCtx<'_>,
    ) -> Result<Option<Tensor>> {
        let block = self;
        let Some(sink) = &ctx.weight_grads else {
            return Ok(None);
        };
        let Some(p) = Parts::of(block, xs, ctx)? else {
            return Ok(None);
        };
        let _span = tracing::trace_span!("block.by_hand.forward").entered();
        let s = block.attn.spec;
        let (b, t, hidden) = xs.dims3()?;
        let (n, d, cd) = (b * t, s.head_dim, ctx.compute);
        let x = xs.detach().reshape((n, hidden))?;
        let heads = |y: &Tensor, nh: usize| y.reshape((b, t, nh, d))?.transpose(1, 2)?.contiguous();
        let hc = rms_norm(&x, &p.input_norm.w, p.input_norm.eps)?.to_dtype(cd)?;
        let q = ctx
            .rope
            .apply_plain(&heads(&p.q.forward(&hc)?, s.n_heads)?)?;
        let k = ctx
            .rope
            .apply_plain(&heads(&p.k.forward(&hc)?, s.n_kv_heads)?)?;
        let v = heads(&p.v.forward(&hc)?, s.n_kv_heads)?;
        let scale = (1.0 / s.score_div) as f32;
        let (o, flash) = flash_attention_forward(&q, &k, &v, scale)?;
        let o2 = o.transpose(1, 2)?.reshape((n, s.n_heads * d))?;
        let x1 = (&x + p.o.forward(&o2)?.to_dtype(x.dtype())?)?;
        let h2c = rms_norm(&x1, &p.mlp_norm.w, p.mlp_norm.eps)?.to_dtype(cd)?;
        let gate = p.gate.forward(&h2c)?;
        let up = p.up.forward(&h2c)?;
        let act = swiglu(&gate, &up)?;
        let out = (&x1 + p.down.forward(&act)?.to_dtype(x.dtype())?)?.reshape((b, t, hidden))?;
        if !xs.track_op() {
            return Ok(Some(out));
        }
        let saved = Mutex::new(Some(Saved {
            x,
            hc,
            q,
            k,
            v,
            o,
            flash,
            o2,
            x1,
            h2c,
            gate,
            up,
            act,
        }));
        let (sink, rope) = (sink.clone(), ctx.rope.clone());
        let out = with_gradient(xs, out, move |dy| {
            let _span = tracing::trace_span!("block.by_hand.backward").entered();
            let sv = saved
                .lock()
                .map_err(|_| candle_core::Error::Msg("block activations poisoned".into()))?
                .take()
                .ok_or_else(|| candle_core::Error::Msg("block backward ran twice".into()))?;
            let dy = dy.reshape((n, hidden))?;
            // MLP.
            let dyc = dy.to_dtype(cd)?;
            let dact = p.down.backward(&sv.act, &dyc, &sink)?;
            drop(sv.act);
            let (dgate, dup) = swiglu_backward(&sv.gate, &sv.up, &dact)?;
            drop((dact, sv.gate, sv.up));
            let dh2 = (p.gate.backward(&sv.h2c, &dgate, &sink)?
                + p.up.backward(&sv.h2c, &dup, &sink)?)?;
            drop((dgate, dup, sv.h2c));
            let dx1 = p.mlp_norm.backward(&sv.x1, &dh2, &sink)?;
            drop((dh2, sv.x1));
            let dx1 = (dy + dx1)?;
            // Attention.
            let do2 = p.o.backward(&sv.o2, &dx1.to_dtype(cd)?, &sink)?;
            drop(sv.o2);
            let do4 = do2.reshape((b, t, s.n_heads, d))?.transpose(1, 2)?;
            let (dq, dk, dv) =
                flash_attention_backward(&sv.q, &sv.k, &sv.v, &sv.o, &do4, &sv.flash)?;
            drop((do4, sv.q, sv.k, sv.v, sv.o, sv.flash));
            let rows = |g: Tensor, nh: usize| g.transpose(1, 2)?.reshape((n, nh * d));
            let dq = rows(rope.unrotate_plain(&dq)?, s.n_heads)?;
            let dk = rows(rope.unrotate_plain(&dk)?, s.n_kv_heads)?;
            let dv = rows(dv, s.n_kv_heads)?;
            let dh = ((p.q.backward(&sv.hc, &dq, &sink)? + p.k.backward(&sv.hc, &dk, &sink)?)?
                + p.v.backward(&sv.hc, &dv, &sink)?)?;
            drop((dq, dk, dv, sv.hc));
            let dx = p.input_norm.backward(&sv.x, &dh, &sink)?;
            (dx1 + dx)?.reshape((b, t, hidden))
        })?;
        Ok(Some(out))
    }
}
