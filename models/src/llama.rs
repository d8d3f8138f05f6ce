//! The LLaMA-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) on the offload runtime.
//!
//! Every weight lives in the runtime's host store. Each forward pass acquires the units in
//! order (embeddings, `model.layers.0` .. `model.layers.{N-1}`, the final norm, the output
//! head), builds each block from the unit's `VarBuilder` right before it runs, and releases the
//! unit right after, so the runtime can stream what does not fit the budget. GQA/MQA, RoPE
//! (with Llama 3 scaling), RMSNorm, SwiGLU, tied embeddings and q/k/v biases are supported.
//! The KV cache stays on the device; the caller reserves room for it in the budget.

use std::ops::Range;

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::kv_cache::KvCache;
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder};
use candle_offload::placement::{
    plan_placement, DeviceBudget, DeviceMap, PlacementMode, PlacementRequest,
};
use candle_offload::{
    MemoryLimit, OffloadConfig, OffloadRuntime, OffloadStrategy, PolicyChoice, UnitId,
};

use crate::config::Config;
use crate::error::ModelError;

/// RoPE tables on the device.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// Tables for positions `0..max_len` in `dtype`.
    pub fn new(cfg: &Config, max_len: usize, dtype: DType, device: &Device) -> Result<Self> {
        let inv_freq = cfg.rope_inv_freq();
        let n = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, n), device)?;
        let t = Tensor::arange(0u32, max_len as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max_len, 1))?;
        let freqs = t.matmul(&inv_freq)?;
        Ok(Self {
            cos: freqs.cos()?.to_dtype(dtype)?,
            sin: freqs.sin()?.to_dtype(dtype)?,
        })
    }

    fn apply(&self, x: &Tensor, index_pos: usize) -> Result<Tensor> {
        let (_, _, seq_len, _) = x.dims4()?;
        let cos = self.cos.narrow(0, index_pos, seq_len)?;
        let sin = self.sin.narrow(0, index_pos, seq_len)?;
        candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin)
    }

    /// RoPE from position 0 for training: differentiable in `x`, with the tables treated as
    /// constants (no gradient computed for them).
    fn apply_diff(&self, x: &Tensor) -> Result<Tensor> {
        candle_offload::train::grad::rope(x, &self.cos, &self.sin)
    }

    /// Positions the tables cover.
    pub fn max_len(&self) -> usize {
        self.cos.dim(0).unwrap_or(0)
    }
}

/// Per-layer key/value cache, on the device, allocated once for the whole context (so that
/// decoding does not grow, copy or fragment it).
#[derive(Debug, Clone)]
pub struct Cache {
    kvs: Vec<KvCache>,
}

impl Cache {
    /// An empty cache for `n_layers` layers and up to `max_len` positions.
    pub fn new(n_layers: usize, max_len: usize) -> Self {
        Self {
            kvs: (0..n_layers).map(|_| KvCache::new(2, max_len)).collect(),
        }
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.kvs.first().map_or(0, |kv| kv.current_seq_len())
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    if bias {
        candle_nn::linear(in_dim, out_dim, vb)
    } else {
        candle_nn::linear_no_bias(in_dim, out_dim, vb)
    }
}

#[derive(Debug)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let bias = cfg.attention_bias;
        Ok(Self {
            q_proj: linear(h, cfg.num_attention_heads * hd, bias, vb.pp("q_proj"))?,
            k_proj: linear(h, cfg.num_key_value_heads * hd, bias, vb.pp("k_proj"))?,
            v_proj: linear(h, cfg.num_key_value_heads * hd, bias, vb.pp("v_proj"))?,
            o_proj: linear(cfg.num_attention_heads * hd, h, false, vb.pp("o_proj"))?,
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: hd,
        })
    }

    fn forward(
        &self,
        xs: &Tensor,
        index_pos: usize,
        kv: &mut KvCache,
        rope: &Rope,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, seq_len, _) = xs.dims3()?;
        let shape = |t: Tensor, heads: usize| {
            t.reshape((b, seq_len, heads, self.head_dim))?
                .transpose(1, 2)
        };
        let q = rope.apply(&shape(self.q_proj.forward(xs)?, self.n_heads)?, index_pos)?;
        let k = rope.apply(
            &shape(self.k_proj.forward(xs)?, self.n_kv_heads)?,
            index_pos,
        )?;
        let v = shape(self.v_proj.forward(xs)?, self.n_kv_heads)?.contiguous()?;
        let (k, v) = kv.append(&k.contiguous()?, &v)?;
        let rep = self.n_heads / self.n_kv_heads;
        let k = candle_transformers::utils::repeat_kv(k, rep)?.contiguous()?;
        let v = candle_transformers::utils::repeat_kv(v, rep)?.contiguous()?;
        // Scores, softmax and the weighted sum in f32, as the reference implementations do.
        let in_dtype = q.dtype();
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let att = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?;
        let att = match mask {
            Some(m) => att.broadcast_add(m)?,
            None => att,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att.matmul(&v)?.to_dtype(in_dtype)?;
        let y = y
            .transpose(1, 2)?
            .reshape((b, seq_len, self.n_heads * self.head_dim))?;
        self.o_proj.forward(&y)
    }
}

impl Attention {
    /// Causal self-attention over the whole sequence with differentiable ops (training):
    /// projections and the two attention matmuls in `xs`'s dtype, mask and softmax in F32.
    /// With `head_chunks > 1` the heads are processed in that many checkpointed groups, so
    /// only one group's score matrix is ever held (it is recomputed in the backward pass).
    fn forward_train(
        &self,
        xs: &Tensor,
        rope: &Rope,
        mask: &Tensor,
        head_chunks: usize,
    ) -> Result<Tensor> {
        let (b, seq_len, _) = xs.dims3()?;
        let shape = |t: Tensor, heads: usize| {
            t.reshape((b, seq_len, heads, self.head_dim))?
                .transpose(1, 2)
        };
        let q = rope.apply_diff(&shape(self.q_proj.forward(xs)?, self.n_heads)?.contiguous()?)?;
        let k =
            rope.apply_diff(&shape(self.k_proj.forward(xs)?, self.n_kv_heads)?.contiguous()?)?;
        let v = shape(self.v_proj.forward(xs)?, self.n_kv_heads)?.contiguous()?;
        let rep = self.n_heads / self.n_kv_heads;
        let k = candle_transformers::utils::repeat_kv(k, rep)?.contiguous()?;
        let v = candle_transformers::utils::repeat_kv(v, rep)?.contiguous()?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let y = if head_chunks <= 1 {
            causal_attention(&q, &k, &v, mask, scale)?
        } else {
            let ck = candle_offload::Checkpointer::new();
            let mut outs = Vec::new();
            for r in candle_offload::train::segment_ranges(self.n_heads, head_chunks) {
                let part = |t: &Tensor| t.narrow(1, r.start, r.len());
                let qkv = Tensor::stack(&[part(&q)?, part(&k)?, part(&v)?], 0)?;
                let mask = mask.clone();
                outs.push(ck.checkpoint(
                    move |qkv| {
                        let get = |i| qkv.get(i);
                        causal_attention(&get(0)?, &get(1)?, &get(2)?, &mask, scale)
                    },
                    &qkv,
                )?);
            }
            Tensor::cat(&outs, 1)?
        };
        let y = y
            .transpose(1, 2)?
            .reshape((b, seq_len, self.n_heads * self.head_dim))?;
        linear_2d(&self.o_proj, &y)
    }
}

/// A linear layer on (batch, seq, in) as one (batch·seq, in) matmul, for training: the weight
/// gradient is then one GEMM, where `Linear::forward` broadcasts the weight over the batch and
/// its backward pass materializes and sums a gradient per sequence.
fn linear_2d(l: &Linear, xs: &Tensor) -> Result<Tensor> {
    let (b, t, d) = xs.dims3()?;
    let y = xs.reshape((b * t, d))?.matmul(&l.weight().t()?)?;
    let y = match l.bias() {
        Some(bias) => y.broadcast_add(bias)?,
        None => y,
    };
    y.reshape((b, t, ()))
}

/// softmax(q kᵀ · scale + mask) v with the matmuls in q's dtype and the softmax in F32.
fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let att = (q * scale)?.matmul(&k.t()?)?;
    let att = candle_offload::train::grad::add_constant(&att.to_dtype(DType::F32)?, mask)?;
    let att = candle_nn::ops::softmax(&att, D::Minus1)?.to_dtype(dtype)?;
    att.matmul(v)
}

#[derive(Debug)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_proj: candle_nn::linear_no_bias(h, i, vb.pp("gate_proj"))?,
            up_proj: candle_nn::linear_no_bias(h, i, vb.pp("up_proj"))?,
            down_proj: candle_nn::linear_no_bias(i, h, vb.pp("down_proj"))?,
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let x =
            (candle_nn::ops::silu(&self.gate_proj.forward(xs)?)? * self.up_proj.forward(xs)?)?;
        self.down_proj.forward(&x)
    }

    /// The same for training: each projection one 2-D matmul (see [`linear_2d`]).
    fn forward_train(&self, xs: &Tensor) -> Result<Tensor> {
        let x = (candle_nn::ops::silu(&linear_2d(&self.gate_proj, xs)?)?
            * linear_2d(&self.up_proj, xs)?)?;
        linear_2d(&self.down_proj, &x)
    }
}

/// One decoder layer, built from the layer's unit right before it runs.
#[derive(Debug)]
pub struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl Block {
    /// Loads the block from `vb` (rooted at `model.layers.{i}`).
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let dtype = vb.dtype();
        Self::load_with_norm_dtype(vb, cfg, dtype)
    }

    /// Loads the block with its norm weights in `norm_dtype` and everything else in `vb`'s
    /// dtype (autocast keeps norms, like the residual stream, in F32).
    pub fn load_with_norm_dtype(vb: VarBuilder, cfg: &Config, norm_dtype: DType) -> Result<Self> {
        let norm = |name: &str| {
            candle_nn::rms_norm(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp(name).to_dtype(norm_dtype),
            )
        };
        Ok(Self {
            input_layernorm: norm("input_layernorm")?,
            self_attn: Attention::load(vb.pp("self_attn"), cfg)?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
        })
    }

    /// The training forward pass over a whole sequence from position 0, with differentiable
    /// ops only: the residual stream stays in `xs`'s dtype (F32 under autocast), norms run in
    /// it, and the attention and MLP compute in `compute`; `head_chunks > 1` runs attention over
    /// that many checkpointed head groups (only one group's scores exist at a time).
    pub fn forward_train(
        &self,
        xs: &Tensor,
        rope: &Rope,
        mask: &Tensor,
        compute: DType,
        head_chunks: usize,
    ) -> Result<Tensor> {
        let residual = xs;
        let h = self.input_layernorm.forward_diff(xs)?.to_dtype(compute)?;
        let h = self.self_attn.forward_train(&h, rope, mask, head_chunks)?;
        let xs = (h.to_dtype(residual.dtype())? + residual)?;
        let h = self
            .post_attention_layernorm
            .forward_diff(&xs)?
            .to_dtype(compute)?;
        let h = self.mlp.forward_train(&h)?;
        h.to_dtype(xs.dtype())? + xs
    }

    /// Runs the block on `xs` (batch, seq, hidden) at positions `index_pos..`.
    pub fn forward(
        &self,
        xs: &Tensor,
        index_pos: usize,
        kv: &mut KvCache,
        rope: &Rope,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let residual = xs;
        let h = self.self_attn.forward(
            &self.input_layernorm.forward(xs)?,
            index_pos,
            kv,
            rope,
            mask,
        )?;
        let xs = (h + residual)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&xs)?)?;
        h + xs
    }
}

/// The causal mask (F32, 0 or -inf) for `seq_len` new positions after `index_pos` cached ones.
pub fn causal_mask(seq_len: usize, index_pos: usize, device: &Device) -> Result<Tensor> {
    let kv_len = index_pos + seq_len;
    let mask: Vec<f32> = (0..seq_len)
        .flat_map(|i| {
            (0..kv_len).map(move |j| {
                if j > index_pos + i {
                    f32::NEG_INFINITY
                } else {
                    0.
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (seq_len, kv_len), device)
}

/// The units of a LLaMA-family model in the runtimes' (shared) store.
#[derive(Debug, Clone)]
struct Units {
    embed: UnitId,
    layers: Vec<UnitId>,
    norm: UnitId,
    head: UnitId,
}

/// How [`Llama::offloaded`] places a model's weights.
#[derive(Debug, Clone)]
pub struct OffloadSettings {
    /// The device memory budget; `None`: the memory free on a GPU, no limit on a CPU.
    pub gpu_memory_limit: Option<MemoryLimit>,
    /// How much stays resident.
    pub strategy: OffloadStrategy,
    /// Copies that may run ahead of their victims' release.
    pub prefetch_depth: usize,
    /// Victim selection; `None`: Belady over the model's own sweep.
    pub policy: Option<PolicyChoice>,
}

impl Default for OffloadSettings {
    fn default() -> Self {
        Self {
            gpu_memory_limit: None,
            strategy: OffloadStrategy::Minimal,
            prefetch_depth: 1,
            policy: None,
        }
    }
}

/// One pipeline stage: a device's runtime and the contiguous layers it runs.
#[derive(Debug)]
struct Stage {
    rt: OffloadRuntime,
    rope: Rope,
    layers: Range<usize>,
}

/// How hidden states cross from one stage's GPU to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HiddenTransfer {
    /// A device-to-device copy (peer-to-peer where peer access is on; otherwise the driver
    /// stages it), ordered after the producing kernels by an event.
    #[default]
    Device,
    /// Through host memory: copied down, then up (a fallback for setups where GPU-to-GPU
    /// copies fail).
    Host,
}

/// Time and bytes spent moving hidden states between stages.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TransferTotals {
    /// Copies made.
    pub copies: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds from the copy's start until the destination had it (measured only while
    /// [`Llama::time_transfers`] is on, which synchronizes both devices around each copy).
    pub seconds: f64,
}

/// A LLaMA-family causal LM whose weights come from one [`OffloadRuntime`] per device: one
/// device is the single-GPU path; several run the layers as a pipeline (layer sharding).
#[derive(Debug)]
pub struct Llama {
    cfg: Config,
    dtype: DType,
    stages: Vec<Stage>,
    units: Units,
    transfer: HiddenTransfer,
    timing: std::sync::atomic::AtomicBool,
    totals: std::sync::Mutex<TransferTotals>,
}

/// Every tensor a model of `cfg` must have, with its shape.
pub fn expected_tensors(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let mut out = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![cfg.vocab_size, h],
        ),
        ("model.norm.weight".to_string(), vec![h]),
    ];
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
        out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
        out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
        if cfg.attention_bias {
            out.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
            out.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
            out.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
        }
        out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
        out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
        out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        out.push((format!("{p}.input_layernorm.weight"), vec![h]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
    }
    out
}

impl Llama {
    /// The model of `cfg` over the weights in `rt`'s store, computing in `dtype`, with RoPE
    /// tables for `max_len` positions. Every tensor is checked (present, shape, float dtype)
    /// before anything runs; `source` names the weights in errors.
    pub fn new(
        cfg: Config,
        rt: OffloadRuntime,
        dtype: DType,
        max_len: usize,
        source: &std::path::Path,
    ) -> std::result::Result<Self, ModelError> {
        let n = cfg.num_hidden_layers;
        Self::sharded(cfg, vec![(rt, 0..n)], dtype, max_len, source)
    }

    /// The model run as a pipeline over `stages`: each runtime (one per device, all over the
    /// same host store) runs a contiguous range of layers, the ranges in order and covering
    /// every layer; the first stage also runs the embeddings, the last the final norm and the
    /// output head. Checks as [`new`](Self::new) does.
    pub fn sharded(
        cfg: Config,
        stages: Vec<(OffloadRuntime, Range<usize>)>,
        dtype: DType,
        max_len: usize,
        source: &std::path::Path,
    ) -> std::result::Result<Self, ModelError> {
        let Some((first, _)) = stages.first() else {
            return Err(ModelError::Config {
                path: source.into(),
                field: "devices".into(),
                reason: "no stage to run the model on".into(),
            });
        };
        let store = first.store().clone();
        let mut next = 0;
        for (i, (rt, range)) in stages.iter().enumerate() {
            if !std::sync::Arc::ptr_eq(rt.store(), &store) {
                return Err(ModelError::Config {
                    path: source.into(),
                    field: format!("stages[{i}]"),
                    reason: "every stage must share one host store".into(),
                });
            }
            if range.start != next || range.end < range.start {
                return Err(ModelError::Config {
                    path: source.into(),
                    field: format!("stages[{i}]"),
                    reason: format!(
                        "layers {}..{} do not continue from layer {next}",
                        range.start, range.end
                    ),
                });
            }
            next = range.end;
        }
        if next != cfg.num_hidden_layers {
            return Err(ModelError::Config {
                path: source.into(),
                field: "stages".into(),
                reason: format!(
                    "the stages run layers 0..{next}, the model has {}",
                    cfg.num_hidden_layers
                ),
            });
        }
        for (name, shape) in expected_tensors(&cfg) {
            let (_, meta) = store.tensor(&name).ok_or_else(|| ModelError::Tensor {
                path: source.into(),
                tensor: name.clone(),
                reason: "missing".into(),
            })?;
            if meta.shape.dims() != shape.as_slice() {
                return Err(ModelError::Tensor {
                    path: source.into(),
                    tensor: name,
                    reason: format!(
                        "has shape {:?}, the config implies {:?}",
                        meta.shape.dims(),
                        shape
                    ),
                });
            }
            if !meta.dtype.is_float() {
                return Err(ModelError::Tensor {
                    path: source.into(),
                    tensor: name,
                    reason: format!("has dtype {:?}, expected a float dtype", meta.dtype),
                });
            }
        }
        let unit = |name: &str| {
            store.unit_id(name).ok_or_else(|| ModelError::Tensor {
                path: source.into(),
                tensor: name.to_string(),
                reason: "no unit holds it".into(),
            })
        };
        let units = Units {
            embed: unit("model.embed_tokens")?,
            layers: (0..cfg.num_hidden_layers)
                .map(|l| unit(&format!("model.layers.{l}")))
                .collect::<std::result::Result<_, _>>()?,
            norm: unit("model.norm")?,
            head: if cfg.tie_word_embeddings {
                unit("model.embed_tokens")?
            } else {
                unit("lm_head")?
            },
        };
        let max_len = max_len.min(cfg.max_position_embeddings).max(1);
        let stages = stages
            .into_iter()
            .map(|(rt, layers)| {
                let rope = Rope::new(&cfg, max_len, dtype, rt.device())?;
                Ok(Stage { rt, rope, layers })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg,
            dtype,
            stages,
            units,
            transfer: HiddenTransfer::Device,
            timing: std::sync::atomic::AtomicBool::new(false),
            totals: std::sync::Mutex::new(TransferTotals::default()),
        })
    }

    /// The model of `files` over its weights in `store`, offloaded on `device` under `settings`:
    /// the budget reserves the KV cache and activations for prompts of `prompt_len` tokens and
    /// `max_len` positions in all, the non-layer units stay resident, and the policy follows the
    /// model's sweep unless `settings` names another.
    pub fn offloaded(
        files: &crate::loader::ModelFiles,
        store: std::sync::Arc<candle_offload::HostStore>,
        device: &Device,
        dtype: DType,
        prompt_len: usize,
        max_len: usize,
        settings: &OffloadSettings,
    ) -> std::result::Result<Self, ModelError> {
        let cfg = files.config.clone();
        let rt = OffloadRuntime::new(
            store.clone(),
            device,
            &OffloadConfig {
                gpu_memory_limit: settings.gpu_memory_limit,
                reserve_bytes: cfg.reserve_bytes(prompt_len, max_len, dtype),
                strategy: settings.strategy,
                policy: settings
                    .policy
                    .clone()
                    .unwrap_or_else(|| PolicyChoice::Schedule(Self::schedule(&store, &cfg))),
                prefetch_depth: settings.prefetch_depth,
                keep: Self::kept_units(&store, &cfg),
                ..Default::default()
            },
        )?;
        let reserve = cfg.reserve_bytes(prompt_len, max_len, dtype);
        let kv = cfg.kv_cache_bytes(max_len, dtype).min(reserve);
        rt.declare_reservation(&[
            ("KV cache", kv),
            ("activations and workspace", reserve - kv),
        ])?;
        Self::new(cfg, rt, dtype, max_len, &files.weights_path())
    }

    /// The units of a model of `cfg` with weights in `dtype`, for placement: `(pre, layers,
    /// post)` with their bytes, computed from the configuration alone (nothing is loaded).
    /// With tied embeddings the output head is the embedding matrix again, listed in `post`
    /// under [`TIED_HEAD`] (the last stage keeps its own copy).
    pub fn placement_units(cfg: &Config, dtype: DType) -> PlacementUnits {
        let mut sizes: std::collections::HashMap<String, u64> = Default::default();
        for (name, shape) in expected_tensors(cfg) {
            let unit = name
                .rsplit_once('.')
                .map(|(prefix, _)| prefix)
                .unwrap_or(&name);
            // `model.layers.3.mlp.up_proj` -> `model.layers.3`; `model.norm` stays.
            let unit = match unit.strip_prefix("model.layers.") {
                Some(rest) => format!("model.layers.{}", rest.split('.').next().unwrap_or(rest)),
                None => unit.to_string(),
            };
            let bytes = shape.iter().product::<usize>() * dtype.size_in_bytes();
            *sizes.entry(unit).or_default() += bytes as u64;
        }
        let size = |n: &str| sizes.get(n).copied().unwrap_or(0);
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| {
                let n = format!("model.layers.{l}");
                let b = size(&n);
                (n, b)
            })
            .collect();
        let head = if cfg.tie_word_embeddings {
            (TIED_HEAD.to_string(), size("model.embed_tokens"))
        } else {
            ("lm_head".to_string(), size("lm_head"))
        };
        PlacementUnits {
            pre: vec![("model.embed_tokens".into(), size("model.embed_tokens"))],
            layers,
            post: vec![("model.norm".into(), size("model.norm")), head],
        }
    }

    /// Plans which of `devices` runs which layers, before any weight is loaded: `limits` are
    /// the per-device budgets (`None`: the memory free on a GPU, no limit on a CPU; a single
    /// entry applies to every device), each device reserves the activations for prompts of
    /// `prompt_len` tokens and the KV cache of its own layers for `max_len` positions.
    /// `choice` is a mode or a map written by hand (checked against the model and budgets).
    #[allow(clippy::too_many_arguments)]
    pub fn plan_devices(
        cfg: &Config,
        dtype: DType,
        devices: &[Device],
        limits: &[Option<MemoryLimit>],
        prompt_len: usize,
        max_len: usize,
        choice: &DeviceMapChoice,
        prefetch_depth: usize,
    ) -> std::result::Result<DeviceMap, ModelError> {
        if devices.is_empty() {
            return Err(candle_offload::Error::InvalidConfig {
                field: "devices".into(),
                reason: "no device given".into(),
            }
            .into());
        }
        if limits.len() > 1 && limits.len() != devices.len() {
            return Err(candle_offload::Error::InvalidConfig {
                field: "gpu_memory_limit".into(),
                reason: format!(
                    "{} limits for {} devices: give one limit, or one per device",
                    limits.len(),
                    devices.len()
                ),
            }
            .into());
        }
        let units = Self::placement_units(cfg, dtype);
        let reserve = cfg.reserve_bytes(prompt_len, max_len, dtype);
        let kv_all = cfg.kv_cache_bytes(max_len, dtype).min(reserve);
        let kv_per_layer = kv_all / cfg.num_hidden_layers.max(1) as u64;
        let mut budgets = Vec::with_capacity(devices.len());
        for (i, dev) in devices.iter().enumerate() {
            let limit = limits.get(i).or(limits.first()).copied().flatten();
            let name = format!("{dev:?}");
            let info = if dev.is_cpu() {
                None
            } else {
                Some(candle_offload::diag::device_info(dev)?)
            };
            let budget = match (limit, &info) {
                (Some(l), info) => l.resolve(&name, info.as_ref().map(|i| i.total_bytes))?,
                (None, Some(info)) => info.free_bytes,
                (None, None) => u64::MAX / 4,
            };
            budgets.push((device_ordinal(dev, i), budget));
        }
        let request = |reserves: &[u64]| {
            budgets
                .iter()
                .zip(reserves)
                .map(|(&(ordinal, budget), &r)| DeviceBudget::new(ordinal, budget, r))
                .collect::<Vec<_>>()
        };
        let plan = |devs: &[DeviceBudget]| {
            let req = PlacementRequest {
                pre: &units.pre,
                layers: &units.layers,
                post: &units.post,
                devices: devs,
                mode: match choice {
                    DeviceMapChoice::Mode(m) => *m,
                    DeviceMapChoice::Map(_) => PlacementMode::Sequential,
                },
                prefetch_depth,
            };
            match choice {
                DeviceMapChoice::Mode(_) => plan_placement(&req),
                DeviceMapChoice::Map(map) => map.validate(&req),
            }
        };
        // First with every device reserving the whole KV cache (always enough), then with each
        // reserving only its own layers' share, kept if every device still has what it needs.
        let full = plan(&request(&vec![reserve; devices.len()]))?;
        let shares: Vec<u64> = full
            .devices
            .iter()
            .map(|d| reserve - kv_all + kv_per_layer * d.layer_count as u64)
            .collect();
        if let Ok(tight) = plan(&request(&shares)) {
            let enough = tight
                .devices
                .iter()
                .zip(&shares)
                .all(|(d, &r)| reserve - kv_all + kv_per_layer * d.layer_count as u64 <= r);
            if enough {
                return Ok(tight);
            }
        }
        Ok(full)
    }

    /// The model over its weights in `store`, run as a pipeline over `devices` as `map` says
    /// (from [`plan_devices`](Self::plan_devices)): one offload runtime per device with a
    /// layer, each with its own budget, reservation, copy stream and schedule. `settings`
    /// gives the strategy, depth and policy (its memory limit is the map's business).
    pub fn offloaded_sharded(
        files: &crate::loader::ModelFiles,
        store: std::sync::Arc<candle_offload::HostStore>,
        devices: &[Device],
        map: &DeviceMap,
        dtype: DType,
        max_len: usize,
        settings: &OffloadSettings,
    ) -> std::result::Result<Self, ModelError> {
        let cfg = files.config.clone();
        let real = |n: &str| {
            if n == TIED_HEAD {
                "model.embed_tokens".to_string()
            } else {
                n.to_string()
            }
        };
        let mut stages = Vec::new();
        for (i, dp) in map.devices.iter().enumerate() {
            if dp.layer_count == 0 {
                continue;
            }
            let device = devices
                .iter()
                .enumerate()
                .find(|(j, d)| device_ordinal(d, *j) == dp.ordinal)
                .map(|(_, d)| d.clone())
                .ok_or_else(|| candle_offload::Error::InvalidConfig {
                    field: format!("devices[{i}]"),
                    reason: format!(
                        "the device map names device {}, which was not given",
                        dp.ordinal
                    ),
                })?;
            let mut keep: Vec<String> = Vec::new();
            for k in dp.kept.iter().map(|k| real(k)) {
                if !keep.contains(&k) && store.unit_id(&k).is_some() {
                    keep.push(k);
                }
            }
            let layers = dp.layers();
            let mut served = keep.clone();
            served.extend(layers.clone().map(|l| format!("model.layers.{l}")));
            let mut order: Vec<UnitId> = Vec::new();
            if keep.iter().any(|k| k == "model.embed_tokens") && layers.start == 0 {
                order.extend(store.unit_id("model.embed_tokens"));
            }
            for l in layers.clone() {
                order.extend(store.unit_id(&format!("model.layers.{l}")));
            }
            for k in &keep {
                if k != "model.embed_tokens" || cfg.tie_word_embeddings {
                    if let Some(u) = store.unit_id(k) {
                        if !order.contains(&u) {
                            order.push(u);
                        }
                    }
                }
            }
            let rt = OffloadRuntime::new(
                store.clone(),
                &device,
                &OffloadConfig {
                    gpu_memory_limit: Some(MemoryLimit::Bytes(dp.budget_bytes)),
                    reserve_bytes: dp.reserve_bytes,
                    strategy: settings.strategy,
                    policy: settings
                        .policy
                        .clone()
                        .unwrap_or(PolicyChoice::Schedule(order)),
                    prefetch_depth: dp.prefetch_depth,
                    keep,
                    units: Some(served),
                    ..Default::default()
                },
            )?;
            let kv = cfg.kv_cache_bytes(max_len, dtype) / cfg.num_hidden_layers.max(1) as u64
                * dp.layer_count as u64;
            let kv = kv.min(dp.reserve_bytes);
            rt.declare_reservation(&[
                ("KV cache", kv),
                ("activations and workspace", dp.reserve_bytes - kv),
            ])?;
            stages.push((rt, layers));
        }
        Self::sharded(cfg, stages, dtype, max_len, &files.weights_path())
    }

    /// The order in which a forward pass acquires units (for a given schedule policy).
    pub fn schedule(store: &candle_offload::HostStore, cfg: &Config) -> Vec<UnitId> {
        let mut out = Vec::new();
        out.extend(store.unit_id("model.embed_tokens"));
        for l in 0..cfg.num_hidden_layers {
            out.extend(store.unit_id(&format!("model.layers.{l}")));
        }
        out.extend(store.unit_id("model.norm"));
        let head = if cfg.tie_word_embeddings {
            "model.embed_tokens"
        } else {
            "lm_head"
        };
        out.extend(store.unit_id(head));
        out
    }

    /// The units outside the decoder layers (embeddings, final norm, output head), which every
    /// forward pass uses. Keeping them resident leaves only equal-sized layers to stream, so
    /// the device allocator reuses every freed layer exactly and never fragments.
    pub fn kept_units(store: &candle_offload::HostStore, cfg: &Config) -> Vec<String> {
        let mut out = vec!["model.embed_tokens".to_string(), "model.norm".to_string()];
        if !cfg.tie_word_embeddings {
            out.push("lm_head".to_string());
        }
        out.retain(|u| store.unit_id(u).is_some());
        out
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The runtime of the first stage (the only one on a single device).
    pub fn runtime(&self) -> &OffloadRuntime {
        &self.stages[0].rt
    }

    /// Every stage's runtime with the layers it runs, in pipeline order.
    pub fn stages(&self) -> Vec<(&OffloadRuntime, Range<usize>)> {
        self.stages
            .iter()
            .map(|s| (&s.rt, s.layers.clone()))
            .collect()
    }

    /// Starts a step on every stage's runtime (see [`OffloadRuntime::begin_step`]).
    pub fn begin_step(&self) -> Result<()> {
        self.stages.iter().try_for_each(|s| s.rt.begin_step())
    }

    /// Ends a step on every stage's runtime.
    pub fn end_step(&self) -> Result<()> {
        self.stages.iter().try_for_each(|s| s.rt.end_step())
    }

    /// How hidden states move between stages (default: device to device).
    pub fn set_hidden_transfer(&mut self, how: HiddenTransfer) {
        self.transfer = how;
    }

    /// Measures each move of hidden states between stages, synchronizing both devices around
    /// it (a small cost per stage boundary; off by default).
    pub fn time_transfers(&self, on: bool) {
        self.timing.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Moves of hidden states between stages so far.
    pub fn transfer_totals(&self) -> TransferTotals {
        self.totals.lock().map(|t| *t).unwrap_or_default()
    }

    fn move_hidden(&self, xs: &Tensor, to: &Device) -> Result<Tensor> {
        let _span = tracing::debug_span!("llama.move_hidden").entered();
        let timing = self.timing.load(std::sync::atomic::Ordering::Relaxed);
        let bytes = (xs.elem_count() * xs.dtype().size_in_bytes()) as u64;
        let start = if timing {
            xs.device().synchronize()?;
            Some(std::time::Instant::now())
        } else {
            None
        };
        let out = match self.transfer {
            HiddenTransfer::Device => xs.contiguous()?.to_device(to)?,
            HiddenTransfer::Host => xs.to_device(&Device::Cpu)?.to_device(to)?,
        };
        let seconds = match start {
            Some(t0) => {
                to.synchronize()?;
                t0.elapsed().as_secs_f64()
            }
            None => 0.0,
        };
        if let Ok(mut t) = self.totals.lock() {
            t.copies += 1;
            t.bytes += bytes;
            t.seconds += seconds;
        }
        Ok(out)
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// A fresh KV cache for the positions this model was set up for.
    pub fn new_cache(&self) -> Cache {
        Cache::new(self.cfg.num_hidden_layers, self.stages[0].rope.max_len())
    }

    /// Logits (batch, vocab) in f32 for the last position of `input_ids` (batch, seq), whose
    /// first token sits at position `index_pos` (the number of tokens already in `cache`).
    pub fn forward(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let _span = tracing::debug_span!("llama.forward", index_pos).entered();
        let (_, seq_len) = input_ids.dims2()?;
        let xs = self.decoder(input_ids, index_pos, cache)?;
        self.head(&xs.narrow(1, seq_len - 1, 1)?)?.squeeze(1)
    }

    /// Logits (batch, seq, vocab) in f32 for every position of `input_ids`, from position 0
    /// with a fresh KV cache (for parity tests).
    pub fn forward_all(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        let xs = self.decoder(
            input_ids,
            0,
            &mut Cache::new(self.cfg.num_hidden_layers, seq_len),
        )?;
        self.head(&xs)
    }

    /// Embeddings and every decoder layer, each acquired from its stage's runtime as it runs;
    /// the hidden state moves to the next stage's device at each stage boundary.
    fn decoder(&self, input_ids: &Tensor, index_pos: usize, cache: &mut Cache) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        let first = &self.stages[0];
        if index_pos + seq_len > first.rope.max_len() {
            candle_core::bail!(
                "position {} is past the {} positions this model was set up for",
                index_pos + seq_len,
                first.rope.max_len()
            );
        }
        let (vocab, hidden) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let mut xs = {
            let unit = first.rt.acquire(self.units.embed)?;
            let w = unit
                .var_builder(self.dtype)
                .get((vocab, hidden), "model.embed_tokens.weight")?;
            Embedding::new(w, hidden).forward(&input_ids.to_device(first.rt.device())?)?
        };
        for (si, stage) in self.stages.iter().enumerate() {
            let device = stage.rt.device();
            if si > 0 {
                xs = self.move_hidden(&xs, device)?;
            }
            let mask = if seq_len > 1 {
                Some(causal_mask(seq_len, index_pos, device)?)
            } else {
                None
            };
            for l in stage.layers.clone() {
                let unit = stage.rt.acquire(self.units.layers[l])?;
                let block = Block::load(
                    unit.var_builder(self.dtype).pp(format!("model.layers.{l}")),
                    &self.cfg,
                )?;
                xs = block.forward(
                    &xs,
                    index_pos,
                    &mut cache.kvs[l],
                    &stage.rope,
                    mask.as_ref(),
                )?;
            }
        }
        Ok(xs)
    }

    /// The final norm and the output head (on the last stage), logits in f32.
    fn head(&self, xs: &Tensor) -> Result<Tensor> {
        let (vocab, hidden) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let rt = &self.stages[self.stages.len() - 1].rt;
        let xs = {
            let unit = rt.acquire(self.units.norm)?;
            candle_nn::rms_norm(
                hidden,
                self.cfg.rms_norm_eps,
                unit.var_builder(self.dtype).pp("model.norm"),
            )?
            .forward(xs)?
        };
        let unit = rt.acquire(self.units.head)?;
        let name = if self.cfg.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let w = unit.var_builder(self.dtype).get((vocab, hidden), name)?;
        Linear::new(w, None).forward(&xs)?.to_dtype(DType::F32)
    }
}

/// The planner's name for the output head of a model with tied embeddings (the embedding
/// matrix, kept a second time on the last stage).
pub const TIED_HEAD: &str = "model.embed_tokens (tied output head)";

/// A model's units as the placement planner takes them.
#[derive(Debug, Clone)]
pub struct PlacementUnits {
    /// Before the layers: the embeddings.
    pub pre: Vec<(String, u64)>,
    /// The decoder layers, in order.
    pub layers: Vec<(String, u64)>,
    /// After the layers: the final norm and the output head.
    pub post: Vec<(String, u64)>,
}

/// How [`Llama::plan_devices`] decides the device map.
#[derive(Debug, Clone)]
pub enum DeviceMapChoice {
    /// Planned in this mode (`--device-map sequential|balanced`).
    Mode(PlacementMode),
    /// Given (`--device-map plan.json`), checked against the model and budgets.
    Map(DeviceMap),
}

/// The ordinal a device map uses for `device`: the GPU's, or the position for a CPU.
fn device_ordinal(device: &Device, position: usize) -> usize {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
        _ => position,
    }
}

/// Greedy argmax of logits (batch 1).
pub fn argmax(logits: &Tensor) -> Result<u32> {
    logits.flatten_all()?.argmax(D::Minus1)?.to_scalar::<u32>()
}
