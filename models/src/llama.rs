//! The LLaMA-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) on the offload runtime.
//!
//! Every weight lives in the runtime's host store. Each forward pass acquires the units in
//! order (embeddings, `model.layers.0` .. `model.layers.{N-1}`, the final norm, the output
//! head), builds each block from the unit's `VarBuilder` right before it runs, and releases the
//! unit right after, so the runtime can stream what does not fit the budget. GQA/MQA, RoPE
//! (with Llama 3 scaling), RMSNorm, SwiGLU, tied embeddings and q/k/v biases are supported.
//! The KV cache stays on the device; the caller reserves room for it in the budget.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::kv_cache::KvCache;
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder};
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

    /// RoPE with differentiable ops, from position 0 (training).
    fn apply_diff(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, seq_len, _) = x.dims4()?;
        candle_nn::rotary_emb::rope_slow(
            x,
            &self.cos.narrow(0, 0, seq_len)?,
            &self.sin.narrow(0, 0, seq_len)?,
        )
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
        self.o_proj.forward(&y)
    }
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
    let att = att.to_dtype(DType::F32)?.broadcast_add(mask)?;
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
    /// it, and the attention and MLP compute in `compute` (see [`Attention::forward_train`]
    /// for `head_chunks`).
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
        let h = self.mlp.forward(&h)?;
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

/// The units of a LLaMA-family model in the runtime's store.
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

/// A LLaMA-family causal LM whose weights come from an [`OffloadRuntime`].
#[derive(Debug)]
pub struct Llama {
    cfg: Config,
    rt: OffloadRuntime,
    dtype: DType,
    rope: Rope,
    units: Units,
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
        let store = rt.store().clone();
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
        let rope = Rope::new(&cfg, max_len, dtype, rt.device())?;
        Ok(Self {
            cfg,
            rt,
            dtype,
            rope,
            units,
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

    /// The runtime holding the weights.
    pub fn runtime(&self) -> &OffloadRuntime {
        &self.rt
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// A fresh KV cache for the positions this model was set up for.
    pub fn new_cache(&self) -> Cache {
        Cache::new(self.cfg.num_hidden_layers, self.rope.max_len())
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

    /// Embeddings and every decoder layer, each acquired from the runtime as it runs.
    fn decoder(&self, input_ids: &Tensor, index_pos: usize, cache: &mut Cache) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        if index_pos + seq_len > self.rope.max_len() {
            candle_core::bail!(
                "position {} is past the {} positions this model was set up for",
                index_pos + seq_len,
                self.rope.max_len()
            );
        }
        let (vocab, hidden) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let mut xs = {
            let unit = self.rt.acquire(self.units.embed)?;
            let w = unit
                .var_builder(self.dtype)
                .get((vocab, hidden), "model.embed_tokens.weight")?;
            Embedding::new(w, hidden).forward(input_ids)?
        };
        let mask = if seq_len > 1 {
            Some(causal_mask(seq_len, index_pos, xs.device())?)
        } else {
            None
        };
        for (l, &u) in self.units.layers.iter().enumerate() {
            let unit = self.rt.acquire(u)?;
            let block = Block::load(
                unit.var_builder(self.dtype).pp(format!("model.layers.{l}")),
                &self.cfg,
            )?;
            xs = block.forward(&xs, index_pos, &mut cache.kvs[l], &self.rope, mask.as_ref())?;
        }
        Ok(xs)
    }

    /// The final norm and the output head, logits in f32.
    fn head(&self, xs: &Tensor) -> Result<Tensor> {
        let (vocab, hidden) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let xs = {
            let unit = self.rt.acquire(self.units.norm)?;
            candle_nn::rms_norm(
                hidden,
                self.cfg.rms_norm_eps,
                unit.var_builder(self.dtype).pp("model.norm"),
            )?
            .forward(xs)?
        };
        let unit = self.rt.acquire(self.units.head)?;
        let name = if self.cfg.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let w = unit.var_builder(self.dtype).get((vocab, hidden), name)?;
        Linear::new(w, None).forward(&xs)?.to_dtype(DType::F32)
    }
}

/// Greedy argmax of logits (batch 1).
pub fn argmax(logits: &Tensor) -> Result<u32> {
    logits.flatten_all()?.argmax(D::Minus1)?.to_scalar::<u32>()
}
