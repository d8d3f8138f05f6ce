//! Self-attention: the projections (separate or fused q/k/v), optional per-head RMSNorms of q
//! and k (Qwen3, Gemma 3), RoPE (the model's tables, or its local ones: Gemma 3's
//! sliding-window layers), the KV cache, GQA/MQA, optional logit soft-capping and a sliding
//! window, and the output projection; the fused
//! decode and prompt kernels where they apply, the composition elsewhere, and the training
//! path.

use candle_core::{DType, Result, Tensor, D};
use candle_offload::kernels::attention::{flash_attention, flash_attention_supported};

use super::cache::KvCache;
use super::linear::{cpu_blocks_many, one_launch_weights, takes_quantized_x, Linear, OneLaunch};
use super::norm::Norm;
use crate::family::{Config, StepCtx, TrainCtx, UnitWeights};

/// The most new positions per step that attention runs through the fused
/// [`candle_offload::kernels::attention::decode_attention`] kernel (decode and short continuations); longer
/// prompts use the matmul composition, which is faster there.
pub const DECODE_ATTENTION_MAX_NEW: usize = 8;

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

#[derive(Debug)]
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

    /// Whether its input projection takes x quantized by the norm before it.
    pub(super) fn takes_quantized_x(&self) -> bool {
        match &self.qkv {
            Qkv::Separate { q, .. } => takes_quantized_x(q),
            Qkv::Fused(l) => takes_quantized_x(l),
        }
    }

    fn project(&self, xs: &Tensor, train: bool, fused: bool) -> Result<(Tensor, Tensor, Tensor)> {
        if let (false, true, Qkv::Separate { q, k, v }) = (train, fused, &self.qkv) {
            if let Some(ws) = one_launch_weights(xs, &[q, k, v])? {
                // q, k and v in one kernel, each written contiguous.
                let out = match ws {
                    OneLaunch::Dense(ws) => {
                        candle_offload::kernels::linear::linear_small_multi(xs, &ws)?
                    }
                    OneLaunch::Blocks(ws) => {
                        candle_offload::kernels::linear::qlinear_small_multi(xs, &ws, q.tuning())?
                    }
                };
                let mut out = out.into_iter();
                let mut next = || out.next().expect("three outputs");
                return Ok((next(), next(), next()));
            }
            // Blocks of two types (Q4_K_M keeps v in Q6_K in some layers): q and k in one
            // kernel, v in its own.
            if let Some(OneLaunch::Blocks(ws)) = one_launch_weights(xs, &[q, k])? {
                let mut out =
                    candle_offload::kernels::linear::qlinear_small_multi(xs, &ws, q.tuning())?
                        .into_iter();
                let mut next = || out.next().expect("two outputs");
                let (q, k) = (next(), next());
                return Ok((q, k, v.run_with(xs, train, fused)?));
            }
        }
        if let (false, Qkv::Separate { q, k, v }) = (train, &self.qkv) {
            // A CPU decode step: q, k and v in one pass of the matmul pool.
            if let Some(ys) = cpu_blocks_many(xs, &[q, k, v])? {
                let mut ys = ys.into_iter();
                let mut next = || ys.next().expect("three outputs");
                return Ok((next(), next(), next()));
            }
        }
        match &self.qkv {
            Qkv::Separate { q, k, v } => Ok((
                q.run_with(xs, train, fused)?,
                k.run_with(xs, train, fused)?,
                v.run_with(xs, train, fused)?,
            )),
            Qkv::Fused(l) => {
                let all = l.run_with(xs, train, fused)?;
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
    /// `kv`.
    pub fn forward(&self, xs: &Tensor, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Tensor> {
        let s = &self.spec;
        let (b, seq_len, _) = xs.dims3()?;
        let shape =
            |t: Tensor, heads: usize| t.reshape((b, seq_len, heads, s.head_dim))?.transpose(1, 2);
        let (q, k, v) = self.project(xs, false, ctx.fused)?;
        let (q, k) = self.norm_qk(q, k, false)?;
        let rope = ctx.rope.for_layer(s.local_rope);
        // The fused attention kernel; on the CPU also for a decode step of unfused ops, where
        // it replaces about ten small Candle ops per layer (casts, matmuls through the GEMM,
        // mask, softmax) with one loop over the cache.
        let cpu_step = xs.device().is_cpu() && seq_len == 1;
        let decode = (ctx.fused || cpu_step)
            && s.softcap.is_none()
            && seq_len <= DECODE_ATTENTION_MAX_NEW
            && (!ctx.masks.is_padded() || padded_decode(ctx, s));
        let heads = |t: Tensor, n: usize| t.reshape((b, seq_len, n, s.head_dim));
        // The decode attention's output as the output projection's rows: with `q8` the kernels
        // hand them over already flat (and quantized), otherwise (b, new, heads, head_dim).
        let q8 = takes_quantized_x(&self.o_proj);
        let rows = |y: Tensor| -> Result<Tensor> {
            if q8 {
                Ok(y)
            } else {
                y.reshape((b, seq_len, s.n_heads * s.head_dim))
            }
        };
        if let Some(pos) = ctx.pos_dev {
            // A captured step: the position is read on the device, by the two kernels that
            // depend on it, so that every replay of the graph runs at its own position.
            // A padded batch's counts are read on the device too (the graph's inputs).
            if !(ctx.fused && decode) {
                candle_core::bail!(
                    "this attention (soft-capping, a new position in a row's padding or \
                     unfused ops) cannot run in a captured step"
                );
            }
            let (q, k, v) = kv.append_rotated_at(
                &heads(q, s.n_heads)?,
                &heads(k, s.n_kv_heads)?,
                &heads(v, s.n_kv_heads)?,
                rope,
                pos,
            )?;
            let y = candle_offload::kernels::attention::decode_attention_at(
                &q,
                &k,
                &v,
                1.0 / s.score_div,
                s.window,
                pos,
                ctx.masks.pads_tensor()?.as_ref(),
                q8,
            )?;
            return self.o_proj.forward_step(&rows(y)?, ctx.fused);
        }
        let (q, k, v) = if ctx.fused && decode {
            // One kernel rotates q and k from the projections' layout and writes k and v
            // into the cache.
            kv.append_rotated(
                &heads(q, s.n_heads)?,
                &heads(k, s.n_kv_heads)?,
                &heads(v, s.n_kv_heads)?,
                rope,
                ctx.index_pos,
            )?
        } else {
            let (q, k) = if ctx.fused {
                // One kernel reads both in the projections' layout and writes them transposed.
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
        };
        if decode {
            // One kernel over the cache's views: no repeat, cast, copy, mask or softmax ops.
            let scale = 1.0 / s.score_div;
            let y = match ctx.masks.pads_tensor()? {
                // Each row's padding is left out by the kernel itself.
                Some(pads) => candle_offload::kernels::attention::decode_attention_padded(
                    &q, &k, &v, scale, s.window, &pads, q8,
                )?,
                // The kernel also quantizes its rows for the output projection.
                None if q8 => candle_offload::kernels::attention::decode_attention_q8(
                    &q, &k, &v, scale, s.window,
                )?,
                None => candle_offload::kernels::attention::decode_attention(
                    &q, &k, &v, scale, s.window,
                )?,
            };
            return self.o_proj.forward_step(&rows(y)?, ctx.fused);
        }
        if s.softcap.is_none()
            && s.window.is_none()
            && !ctx.masks.is_padded()
            && candle_offload::kernels::attention::prompt_attention_supported(
                xs.device(),
                q.dtype(),
                s.head_dim,
                self.o_proj.tuning(),
            )
        {
            // One flash-attention kernel over the cache's views: no F32 copies, no score
            // matrix, no mask or softmax launches.
            let y = candle_offload::kernels::attention::prompt_attention(
                &q,
                &k,
                &v,
                1.0 / s.score_div,
                self.o_proj.tuning(),
            )?;
            return self
                .o_proj
                .forward(&y.reshape((b, seq_len, s.n_heads * s.head_dim))?);
        }
        // Grouped-query attention without repeating k and v: the `rep` query heads of each kv
        // head are rows of one matmul against that head's keys, read from the cache's views
        // as they are (a repeat copied the whole cache `rep` times per layer and step).
        let rep = s.n_heads / s.n_kv_heads;
        let kv_len = k.dim(2)?;
        // Scores, softmax and the weighted sum in f32, as the reference implementations do.
        let in_dtype = q.dtype();
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let q = q
            .contiguous()?
            .reshape((b, s.n_kv_heads, rep * seq_len, s.head_dim))?;
        let att = (q.matmul(&k.t()?)? / s.score_div)?;
        let att = match s.softcap {
            Some(cap) => soft_cap(&att, cap)?,
            None => att,
        };
        let att = match ctx.masks.get(s.window)? {
            Some(m) => {
                // (seq, kv_len) or (b, 1, seq, kv_len) against (b, kv heads, rep, seq, kv_len).
                let m = if m.rank() == 4 { m.unsqueeze(1)? } else { m };
                att.reshape((b, s.n_kv_heads, rep, seq_len, kv_len))?
                    .broadcast_add(&m)?
                    .reshape((b, s.n_kv_heads, rep * seq_len, kv_len))?
            }
            None => att,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att
            .matmul(&v)?
            .reshape((b, s.n_heads, seq_len, s.head_dim))?
            .to_dtype(in_dtype)?;
        let y = y
            .transpose(1, 2)?
            .reshape((b, seq_len, s.n_heads * s.head_dim))?;
        self.o_proj.forward(&y)
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

/// Whether a padded batch's step can take the decode attention kernel, which leaves each row's
/// padding out itself: every new position past every row's padding (the decode steps after a
/// padded prompt), and a head dim the kernel takes.
fn padded_decode(ctx: &StepCtx<'_>, s: &AttentionSpec) -> bool {
    ctx.masks.pads().iter().all(|&p| p <= ctx.index_pos)
        && s.head_dim <= candle_offload::kernels::attention::ATTENTION_MAX_HEAD_DIM
}
