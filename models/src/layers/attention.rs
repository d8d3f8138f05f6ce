//! Self-attention: the projections (separate or fused q/k/v), optional per-head RMSNorms of q
//! and k (Qwen3, Gemma 3), RoPE (the model's tables, or its local ones: Gemma 3's
//! sliding-window layers), the KV cache, GQA/MQA, optional logit soft-capping and a sliding
//! window, and the output projection; the fused
//! decode and prompt kernels where they apply, the composition elsewhere, and the training
//! path.

use candle_core::{DType, Result, Tensor, D};
use candle_offload::kernels::attention::{
    flash_attention, flash_attention_supported, ragged_decode_attention,
    ragged_decode_attention_at, AttentionShape, AttentionStep, RaggedDecodeSeq, StepInfo,
    ATTENTION_MAX_HEAD_DIM,
};
use candle_offload::kernels::rope::QkNorm;

use super::cache::{KvCache, Masks};
use super::linear::{run, Linear};
use super::norm::Norm;
use crate::family::{Config, RaggedSegment, StepCtx, TrainCtx, UnitWeights};

pub use candle_offload::kernels::attention::DECODE_ATTENTION_MAX_NEW;

/// `cap · tanh(x / cap)` (Gemma 2's attention and final logit soft-capping).
pub fn soft_cap(x: &Tensor, cap: f64) -> Result<Tensor> {
    (x / cap)?.tanh()? * cap
}

/// How attention scores are formed once q and k are rotated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionSpec {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA: fewer; MQA: one).
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Scores are divided by this (`sqrt(head_dim)`, or Gemma 2's `sqrt(query_pre_attn_scalar)`).
    pub score_div: f64,
    /// Soft-capping of the scores before the mask (Gemma 2).
    pub softcap: Option<f64>,
    /// Keys further back than this are hidden (sliding-window layers).
    pub window: Option<usize>,
    /// Rotate with the RoPE tables' local set ([`crate::layers::Rope::for_layer`]: Gemma 3's
    /// sliding-window layers have their own base) instead of the global one.
    pub local_rope: bool,
}

impl AttentionSpec {
    /// The widths of the query and of the key (= value) projections.
    pub fn widths(&self) -> (usize, usize) {
        (
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        )
    }

    /// The attention op's form of it ([`AttentionStep`]).
    pub fn shape(&self) -> AttentionShape {
        AttentionShape {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            score_div: self.score_div,
            softcap: self.softcap,
            window: self.window,
        }
    }

    /// Plain attention of `cfg`'s shape: scores over `sqrt(head_dim)`, no cap, no window.
    pub fn of(cfg: &Config) -> Self {
        Self {
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            score_div: (cfg.head_dim as f64).sqrt(),
            softcap: None,
            window: None,
            local_rope: false,
        }
    }
}

/// One attention layer's projections of q, k and v: built once with the layer and never
/// moved after, so the separate form's size is not worth a box.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(super) enum Qkv {
    Separate { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

/// Self-attention: projections, RoPE, the KV cache, GQA/MQA and the output projection.
#[derive(Debug)]
pub struct SelfAttention {
    pub(super) qkv: Qkv,
    pub(super) o_proj: Linear,
    pub(super) spec: AttentionSpec,
    /// RMSNorms over each head of q and of k, before RoPE (width head_dim).
    pub(super) qk_norm: Option<(Norm, Norm)>,
}

impl SelfAttention {
    /// `q_proj`, `k_proj`, `v_proj` (with biases when `bias`) and `o_proj` under `w`, each
    /// dense or quantized as the unit holds it.
    pub fn load(
        w: UnitWeights<'_>,
        hidden: usize,
        spec: AttentionSpec,
        bias: bool,
    ) -> Result<Self> {
        let (q, kv) = spec.widths();
        Ok(Self {
            qkv: Qkv::Separate {
                q: w.pp("q_proj").linear(hidden, q, bias)?,
                k: w.pp("k_proj").linear(hidden, kv, bias)?,
                v: w.pp("v_proj").linear(hidden, kv, bias)?,
            },
            o_proj: w.pp("o_proj").linear(q, hidden, false)?,
            spec,
            qk_norm: None,
        })
    }

    /// One fused projection `fused` (rows: q, then k, then v) and `o_proj` under `w` (Phi-3).
    pub fn load_fused(
        w: UnitWeights<'_>,
        fused: &str,
        hidden: usize,
        spec: AttentionSpec,
    ) -> Result<Self> {
        let (q, kv) = spec.widths();
        Ok(Self {
            qkv: Qkv::Fused(w.pp(fused).linear(hidden, q + 2 * kv, false)?),
            o_proj: w.pp("o_proj").linear(q, hidden, false)?,
            spec,
            qk_norm: None,
        })
    }

    /// The same attention with `q_norm` and `k_norm` (each of width head_dim) applied to every
    /// head of q and of k before RoPE (Qwen3, Gemma 3).
    pub fn with_qk_norm(mut self, q_norm: Norm, k_norm: Norm) -> Self {
        self.qk_norm = Some((q_norm, k_norm));
        self
    }

    /// Whether q and k are normed per head before RoPE.
    pub fn has_qk_norm(&self) -> bool {
        self.qk_norm.is_some()
    }

    /// q (.., heads · head_dim) and k (.., kv_heads · head_dim) with the per-head norms applied
    /// (as they are without them).
    fn norm_qk(&self, q: Tensor, k: Tensor, train: bool) -> Result<(Tensor, Tensor)> {
        let Some((qn, kn)) = &self.qk_norm else {
            return Ok((q, k));
        };
        let s = &self.spec;
        let per_head = |t: Tensor, n: &Norm, heads: usize| -> Result<Tensor> {
            let dims = t.dims().to_vec();
            let mut split = dims[..dims.len() - 1].to_vec();
            split.extend([heads, s.head_dim]);
            let t = t.reshape(split)?;
            let t = if train {
                n.forward_diff(&t)?
            } else {
                n.forward(&t)?
            };
            t.reshape(dims)
        };
        Ok((per_head(q, qn, s.n_heads)?, per_head(k, kn, s.n_kv_heads)?))
    }

    /// The attention's shape and scoring.
    pub fn spec(&self) -> &AttentionSpec {
        &self.spec
    }

    /// The projection that reads its input (q, or the fused q/k/v).
    pub(super) fn first(&self) -> &Linear {
        match &self.qkv {
            Qkv::Separate { q, .. } => q,
            Qkv::Fused(l) => l,
        }
    }

    fn project(&self, xs: &Tensor, train: bool, fused: bool) -> Result<(Tensor, Tensor, Tensor)> {
        match &self.qkv {
            // q, k and v in one launch (each written contiguous) where the linear op can.
            Qkv::Separate { q, k, v } if !train => {
                let mut out = Linear::forward_many_with(xs, &[q, k, v], fused)?.into_iter();
                let mut next = || out.next().expect("three outputs");
                Ok((next(), next(), next()))
            }
            Qkv::Separate { q, k, v } => Ok((
                run(q, xs, train, fused)?,
                run(k, xs, train, fused)?,
                run(v, xs, train, fused)?,
            )),
            Qkv::Fused(l) => {
                let all = run(l, xs, train, fused)?;
                let (q, kv) = self.spec.widths();
                Ok((
                    all.narrow(D::Minus1, 0, q)?,
                    all.narrow(D::Minus1, q, kv)?,
                    all.narrow(D::Minus1, q + kv, kv)?,
                ))
            }
        }
    }

    /// Inference over `xs` (batch, seq, hidden) at positions `ctx.index_pos..`, appending to
    /// `kv`: the attention op ([`AttentionStep`]) chooses its kernel and runs it with the
    /// output projection.
    pub fn forward(&self, xs: &Tensor, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Tensor> {
        let (q, k, v) = self.project(xs, false, ctx.fused)?;
        let (step, q, k, v) = self.cached_step(q, k, v, true, ctx, kv)?;
        step.forward(&q, &k, &v, &self.o_proj)
    }

    /// [`forward`](Self::forward) for a ragged step: `xs` (1, rows, hidden) holds the new
    /// positions of several sequences one after the other, `segs` their counts and positions,
    /// `kvs` their caches (one each). The projections run over all rows at once, the attention
    /// per sequence over its own cache, the output projection over all rows again.
    pub fn forward_ragged(
        &self,
        xs: &Tensor,
        ctx: &StepCtx<'_>,
        segs: &[RaggedSegment],
        kvs: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let (b, rows, _) = xs.dims3()?;
        let total: usize = segs.iter().map(|s| s.len).sum();
        if b != 1 || total != rows || segs.len() != kvs.len() {
            candle_core::bail!(
                "a ragged step needs (1, rows, hidden) with the segments' {total} rows and one \
                 cache per segment: got ({b}, {rows}, ..), {} segments, {} caches",
                segs.len(),
                kvs.len()
            );
        }
        let (q, k, v) = self.project(xs, false, ctx.fused)?;
        let (q, k) = self.norm_qk(q, k, false)?;
        let mut outs = Vec::with_capacity(segs.len());
        let mut start = 0;
        // The leading one-position segments (a batch's decoding sequences) in one op, where
        // each alone would run the fused decode step.
        let decoders = segs.iter().take_while(|s| s.len == 1).count();
        let ragged = decoders > 1 && self.ragged_decode_applies(&q, ctx, segs[0].index_pos)?;
        if ctx.ragged_table.is_some() && (!ragged || decoders != segs.len()) {
            candle_core::bail!(
                "this attention cannot read a ragged step's positions on the device (a captured \
                 step runs eagerly instead)"
            );
        }
        if ragged {
            let s = &self.spec;
            let mut bufs = Vec::with_capacity(decoders);
            for kv in kvs[..decoders].iter_mut() {
                bufs.push(kv.room_for_one(s.n_kv_heads, s.head_dim, &k)?);
            }
            let seqs: Vec<RaggedDecodeSeq<'_>> = bufs
                .iter()
                .map(|(k_cache, v_cache, pos)| RaggedDecodeSeq {
                    k_cache,
                    v_cache,
                    pos: *pos,
                })
                .collect();
            let cut = |t: &Tensor| t.narrow(1, 0, decoders);
            let (q, k, v) = (cut(&q)?, cut(&k)?, cut(&v)?);
            let rope = ctx.rope.for_layer(s.local_rope).table();
            let dims = s.shape().ragged_dims();
            outs.push(match ctx.ragged_table {
                Some(table) => ragged_decode_attention_at(&q, &k, &v, rope, &seqs, dims, table)?,
                None => ragged_decode_attention(&q, &k, &v, rope, &seqs, dims)?,
            });
            for kv in kvs[..decoders].iter_mut() {
                kv.advance_one();
            }
            start = decoders;
        }
        for (seg, kv) in segs.iter().zip(kvs.iter_mut()).skip(start) {
            let cut = |t: &Tensor| t.narrow(1, start, seg.len);
            let masks = Masks::new(seg.len, seg.index_pos, xs.device());
            let seg_ctx = StepCtx {
                index_pos: seg.index_pos,
                rope: ctx.rope,
                masks: &masks,
                fused: ctx.fused,
                pos_dev: None,
                ragged_table: None,
                experts: ctx.experts,
            };
            let (step, q, k, v) =
                self.cached_step(cut(&q)?, cut(&k)?, cut(&v)?, false, &seg_ctx, kv)?;
            outs.push(step.attend(&q, &k, &v)?);
            start += seg.len;
        }
        let y = Tensor::cat(&outs, 1)?;
        self.o_proj.forward_with(&y, ctx.fused)
    }

    /// Whether a ragged step's decoding sequences run as one op: on a GPU, where one of them
    /// alone (q's first row at `index_pos`) would run the fused decode step (RoPE into the
    /// cache, then the decode kernel).
    fn ragged_decode_applies(
        &self,
        q: &Tensor,
        ctx: &StepCtx<'_>,
        index_pos: usize,
    ) -> Result<bool> {
        if !q.device().is_cuda() || ctx.pos_dev.is_some() {
            return Ok(false);
        }
        let masks = Masks::new(1, index_pos, q.device());
        let step = AttentionStep::new(
            self.spec.shape(),
            &q.narrow(1, 0, 1)?,
            StepInfo {
                index_pos,
                fused: ctx.fused,
                pos: None,
                masks: &masks,
                tuning: self.o_proj.tuning(),
            },
        )?;
        Ok(step.rotates_into_cache() && self.spec.head_dim <= ATTENTION_MAX_HEAD_DIM)
    }

    /// The per-head norms of q and k as one launch with their RoPE takes them: where both are
    /// plain RMSNorms.
    fn fused_qk_norm(&self) -> Option<QkNorm<'_>> {
        let (qn, kn) = self.qk_norm.as_ref()?;
        let ((q, eps), (k, _)) = (qn.rms_parts()?, kn.rms_parts()?);
        Some(QkNorm { q, k, eps })
    }

    /// The attention op for q, k and v (batch, seq, width, as the projections give them) in
    /// `ctx`, with k and v appended to `kv`: the step, q as it attends (batch, heads, seq,
    /// head_dim, rotated) and every cached position's keys and values. With `norm`, q's and k's
    /// per-head norms are applied first (in the kernel that rotates them into the cache, where
    /// that one runs).
    fn cached_step<'c>(
        &'c self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        norm: bool,
        ctx: &StepCtx<'c>,
        kv: &mut KvCache,
    ) -> Result<(AttentionStep<'c>, Tensor, Tensor, Tensor)> {
        let s = &self.spec;
        let (b, seq_len, _) = q.dims3()?;
        let shape =
            |t: Tensor, heads: usize| t.reshape((b, seq_len, heads, s.head_dim))?.transpose(1, 2);
        let rope = ctx.rope.for_layer(s.local_rope);
        let step = AttentionStep::new(
            s.shape(),
            &q,
            StepInfo {
                index_pos: ctx.index_pos,
                fused: ctx.fused,
                pos: ctx.pos_dev,
                masks: ctx.masks,
                tuning: self.o_proj.tuning(),
            },
        )?;
        let heads = |t: Tensor, n: usize| t.reshape((b, seq_len, n, s.head_dim));
        // The norms in the kernel that rotates q and k into the cache, where that one runs and
        // can take them; before it otherwise.
        let fused_norm = if norm && step.rotates_into_cache() {
            self.fused_qk_norm()
        } else {
            None
        };
        let (q, k) = if norm && fused_norm.is_none() {
            self.norm_qk(q, k, false)?
        } else {
            (q, k)
        };
        let (q, k, v) = match ctx.pos_dev {
            // A captured step: the position is read on the device, by the two kernels that
            // depend on it, so that every replay of the graph runs at its own position.
            Some(pos) if step.rotates_into_cache() => kv.append_rotated_at(
                &heads(q, s.n_heads)?,
                &heads(k, s.n_kv_heads)?,
                &heads(v, s.n_kv_heads)?,
                rope,
                pos,
                fused_norm,
            )?,
            // The attention op refuses it.
            Some(_) => (q, k, v),
            // One kernel rotates q and k from the projections' layout and writes k and v into
            // the cache.
            None if step.rotates_into_cache() => kv.append_rotated(
                &heads(q, s.n_heads)?,
                &heads(k, s.n_kv_heads)?,
                &heads(v, s.n_kv_heads)?,
                rope,
                ctx.index_pos,
                fused_norm,
            )?,
            None => {
                let (q, k) = if ctx.fused {
                    // One kernel reads both in the projections' layout and writes them
                    // transposed.
                    let (q, k) = (heads(q, s.n_heads)?, heads(k, s.n_kv_heads)?);
                    rope.apply_qk(&q, &k, ctx.index_pos)?
                } else {
                    (
                        rope.apply(&shape(q, s.n_heads)?, ctx.index_pos)?,
                        rope.apply(&shape(k, s.n_kv_heads)?, ctx.index_pos)?,
                    )
                };
                let v = shape(v, s.n_kv_heads)?.contiguous()?;
                let (k, v) = kv.append(&k.contiguous()?, &v)?;
                (q, k, v)
            }
        };
        Ok((step, q, k, v))
    }

    /// Causal self-attention over the whole sequence with differentiable ops (training).
    /// With `ctx.fused`, no soft-capping, no sliding window and the plain causal mask, where
    /// a kernel exists ([`flash_attention_supported`]): [`flash_attention`] over all heads
    /// (F32 scores and sums). Otherwise the composition: projections and the two attention
    /// matmuls in `xs`'s dtype, mask and softmax in F32; with `ctx.head_chunks > 1` the heads
    /// are processed in that many checkpointed groups, so only one group's score matrix is
    /// ever held (it is recomputed in the backward pass).
    pub fn forward_train(&self, xs: &Tensor, ctx: &TrainCtx<'_>) -> Result<Tensor> {
        let s = self.spec;
        let (b, seq_len, _) = xs.dims3()?;
        let shape =
            |t: Tensor, heads: usize| t.reshape((b, seq_len, heads, s.head_dim))?.transpose(1, 2);
        let (q, k, v) = self.project(xs, true, false)?;
        let (q, k) = self.norm_qk(q, k, true)?;
        let rope = ctx.rope.for_layer(s.local_rope);
        let q = rope.apply_diff(&shape(q, s.n_heads)?.contiguous()?)?;
        let k = rope.apply_diff(&shape(k, s.n_kv_heads)?.contiguous()?)?;
        let v = shape(v, s.n_kv_heads)?.contiguous()?;
        if ctx.fused
            && s.softcap.is_none()
            && s.window.is_none()
            && ctx.masks.is_plain_causal()
            && flash_attention_supported(q.device(), q.dtype(), s.head_dim)
        {
            // One op over all heads: no repeated k and v, no score matrix, no head groups.
            let y = flash_attention(&q, &k, &v, (1.0 / s.score_div) as f32)?;
            let y = y
                .transpose(1, 2)?
                .reshape((b, seq_len, s.n_heads * s.head_dim))?;
            return self.o_proj.forward_train(&y);
        }
        let rep = s.n_heads / s.n_kv_heads;
        let k = candle_transformers::utils::repeat_kv(k, rep)?.contiguous()?;
        let v = candle_transformers::utils::repeat_kv(v, rep)?.contiguous()?;
        let mask = ctx.masks.get(s.window)?;
        let y = if ctx.head_chunks <= 1 {
            train_attention(&q, &k, &v, mask.as_ref(), &s)?
        } else {
            let ck = candle_offload::Checkpointer::new();
            let mut outs = Vec::new();
            for r in candle_offload::train::segment_ranges(s.n_heads, ctx.head_chunks) {
                let part = |t: &Tensor| t.narrow(1, r.start, r.len());
                let qkv = Tensor::stack(&[part(&q)?, part(&k)?, part(&v)?], 0)?;
                let mask = mask.clone();
                outs.push(ck.checkpoint(
                    move |qkv| {
                        let get = |i| qkv.get(i);
                        train_attention(&get(0)?, &get(1)?, &get(2)?, mask.as_ref(), &s)
                    },
                    &qkv,
                )?);
            }
            Tensor::cat(&outs, 1)?
        };
        let y = y
            .transpose(1, 2)?
            .reshape((b, seq_len, s.n_heads * s.head_dim))?;
        self.o_proj.forward_train(&y)
    }
}

/// softmax(q kᵀ / div (capped) + mask) v with the matmuls in q's dtype and the softmax in F32.
fn train_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    s: &AttentionSpec,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let att = (q * (1.0 / s.score_div))?.matmul(&k.t()?)?;
    let att = att.to_dtype(DType::F32)?;
    let att = match s.softcap {
        Some(cap) => soft_cap(&att, cap)?,
        None => att,
    };
    let att = match mask {
        Some(m) => candle_offload::train::grad::add_constant(&att, m)?,
        None => att,
    };
    let att = candle_nn::ops::softmax(&att, D::Minus1)?.to_dtype(dtype)?;
    att.matmul(v)
}
