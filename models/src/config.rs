//! The LLaMA-family configuration: read from an HF `config.json` (Llama 2/3, Mistral, Qwen2,
//! SmolLM) or from GGUF metadata, and validated once.

use std::path::Path;
use std::sync::Arc;

use candle_transformers::models::llama::{Llama3RopeConfig, Llama3RopeType};

use crate::error::{ModelError, Result};
use crate::family::{Family, HfFields};

/// A validated decoder configuration: the fields every family shares, the family, and the
/// family's own fields as read.
#[derive(Debug, Clone)]
pub struct Config {
    /// The HF `model_type` (`llama`, `mistral`, `qwen2`, `phi3`, `gemma`, `gemma2`, ...).
    pub model_type: String,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (fewer than query heads: GQA; one: MQA).
    pub num_key_value_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f32,
    /// Llama 3 RoPE scaling, if any.
    pub rope_scaling: Option<Llama3RopeConfig>,
    /// Longest context.
    pub max_position_embeddings: usize,
    /// Whether the output head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections have biases (Qwen2).
    pub attention_bias: bool,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens.
    pub eos_token_ids: Vec<u32>,
    /// The family that builds the model's blocks (looked up by `model_type` when read from
    /// `config.json`; an application's own decoder sets its own).
    pub family: Arc<dyn Family>,
    /// The whole `config.json` object as read (empty for GGUF and hand-made configs): the
    /// family's own fields, kept by [`to_hf_json`](Self::to_hf_json).
    pub extra: serde_json::Map<String, serde_json::Value>,
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

/// Defaults a family gives the shared fields of an HF config when they are absent.
#[derive(Debug, Clone, Copy)]
pub struct CommonDefaults {
    /// `attention_bias` (Qwen2: true).
    pub attention_bias: bool,
    /// `tie_word_embeddings` (Gemma: true).
    pub tie_word_embeddings: bool,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
}

impl Default for CommonDefaults {
    fn default() -> Self {
        Self {
            attention_bias: false,
            tie_word_embeddings: false,
            rms_norm_eps: 1e-6,
        }
    }
}

impl Config {
    /// A configuration for an application's own decoder (`family`): the shapes the runtime
    /// plans with. The rest takes the usual defaults (`head_dim` = hidden / heads, as many KV
    /// heads as query heads, RMSNorm eps 1e-6, RoPE base 10 000 without scaling, 4096
    /// positions, untied head, no biases, no special tokens); set the public fields to change
    /// them, then [`validate`](Self::validate).
    pub fn new(
        family: Arc<dyn Family>,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        vocab_size: usize,
    ) -> Self {
        Self {
            model_type: family.name().to_string(),
            hidden_size,
            intermediate_size,
            vocab_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: num_attention_heads,
            head_dim: hidden_size / num_attention_heads.max(1),
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            attention_bias: false,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            family,
            extra: Default::default(),
        }
    }

    /// Reads and validates `config.json`.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?;
        Self::from_json_str(&text, path)
    }

    /// Parses and validates the text of a `config.json`; `path` names it in errors. The family
    /// is looked up in [`REGISTRY`](crate::families::REGISTRY) by `model_type` (or by
    /// `architectures` when there is no `model_type`), and reads the rest.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ModelError::file(path, format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| ModelError::file(path, "is not a JSON object"))?;
        let model_type = match obj.get("model_type").and_then(|m| m.as_str()) {
            Some(m) => m.to_string(),
            None => {
                let arch = obj
                    .get("architectures")
                    .and_then(|a| a.get(0))
                    .and_then(|a| a.as_str())
                    .ok_or_else(|| {
                        ModelError::config(path, "model_type", "missing (and no `architectures`)")
                    })?;
                crate::families::model_type_of_architecture(arch)
                    .unwrap_or(arch)
                    .to_string()
            }
        };
        let registration = crate::families::lookup(&model_type).ok_or_else(|| {
            ModelError::UnknownArchitecture {
                path: path.into(),
                name: model_type.clone(),
                supported: crate::families::supported(),
            }
        })?;
        let cfg = (registration.from_hf)(&HfFields {
            obj,
            path,
            model_type: &model_type,
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// The fields every family shares, read from an HF config, for `family` (a family's
    /// [`Registration::from_hf`](crate::family::Registration) starts here). The raw object is
    /// kept in [`extra`](Self::extra) for the family's own fields and for
    /// [`to_hf_json`](Self::to_hf_json). `rope_scaling` is left to the family.
    pub fn from_hf_common(
        f: &HfFields<'_>,
        family: Arc<dyn Family>,
        defaults: CommonDefaults,
    ) -> Result<Self> {
        let path = f.path;
        let hidden_size = f.usize("hidden_size")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let num_key_value_heads = f
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        let head_dim = f
            .opt_usize("head_dim")?
            .unwrap_or(hidden_size / num_attention_heads);
        // transformers 5 moved `rope_theta` and `rope_scaling` into `rope_parameters`.
        let rope_params = f.get("rope_parameters").filter(|v| v.is_object());
        let eos_token_ids = match f.get("eos_token_id") {
            None => Vec::new(),
            Some(x) => match serde_json::from_value::<OneOrMany>(x.clone()).map_err(|_| {
                ModelError::config(
                    path,
                    "eos_token_id",
                    format!("expected a token id or a list, got {x}"),
                )
            })? {
                OneOrMany::One(t) => vec![t],
                OneOrMany::Many(v) => v,
            },
        };
        let bos_token_id = match f.get("bos_token_id") {
            None => None,
            Some(x) => Some(x.as_u64().ok_or_else(|| {
                ModelError::config(
                    path,
                    "bos_token_id",
                    format!("expected a token id, got {x}"),
                )
            })? as u32),
        };
        Ok(Self {
            attention_bias: f.bool_or("attention_bias", defaults.attention_bias)?,
            model_type: f.model_type.to_string(),
            hidden_size,
            intermediate_size: f.usize("intermediate_size")?,
            vocab_size: f.usize("vocab_size")?,
            num_hidden_layers: f.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: f.f64_or("rms_norm_eps", defaults.rms_norm_eps)?,
            rope_theta: match rope_params.and_then(|p| p.get("rope_theta")) {
                Some(t) => t
                    .as_f64()
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .ok_or_else(|| {
                        ModelError::config(
                            path,
                            "rope_parameters.rope_theta",
                            format!("expected a positive number, got {t}"),
                        )
                    })? as f32,
                None => f.f64_or("rope_theta", 10_000.0)? as f32,
            },
            rope_scaling: None,
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: f.bool_or("tie_word_embeddings", defaults.tie_word_embeddings)?,
            bos_token_id,
            eos_token_ids,
            family,
            extra: f.obj.clone(),
        })
    }

    /// The `rope_scaling` object of an HF config (or transformers 5's `rope_parameters`),
    /// with its type (`default` when it names none); `None` when there is none.
    pub fn hf_rope_scaling<'a>(
        f: &'a HfFields<'_>,
    ) -> Option<(&'a str, &'a serde_json::Value, &'static str)> {
        let (x, field) = match f.get("rope_scaling") {
            Some(x) => (x, "rope_scaling"),
            None => (
                f.get("rope_parameters").filter(|v| v.is_object())?,
                "rope_parameters",
            ),
        };
        let rope_type = x
            .get("rope_type")
            .or_else(|| x.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        Some((rope_type, x, field))
    }

    /// The HF `config.json` of this configuration: the object it was read from (if any),
    /// with every shared field [`Config::from_json_str`] reads written over it
    /// (`rope_scaling` when present), and `model_type`, `architectures` and
    /// `tie_word_embeddings`, so that a directory written with it loads here and in
    /// transformers.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let architecture =
            crate::families::architecture_of(&self.model_type).unwrap_or("LlamaForCausalLM");
        let mut v = serde_json::Value::Object(self.extra.clone());
        let shared = serde_json::json!({
            "architectures": [architecture],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": f64::from(self.rope_theta),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
        });
        if let (Some(out), Some(shared)) = (v.as_object_mut(), shared.as_object()) {
            for (k, x) in shared {
                out.insert(k.clone(), x.clone());
            }
            if !out.contains_key("hidden_act") && !out.contains_key("hidden_activation") {
                out.insert("hidden_act".into(), "silu".into());
            }
            if let Some(p) = out
                .get_mut("rope_parameters")
                .and_then(|p| p.as_object_mut())
            {
                // Kept consistent with the shared field written above.
                if p.contains_key("rope_theta") {
                    p.insert("rope_theta".into(), f64::from(self.rope_theta).into());
                }
            }
        }
        if let Some(r) = &self.rope_scaling {
            let rope_type = match r.rope_type {
                Llama3RopeType::Llama3 => "llama3",
                Llama3RopeType::Default => "default",
            };
            v["rope_scaling"] = serde_json::json!({
                "rope_type": rope_type,
                "factor": f64::from(r.factor),
                "low_freq_factor": f64::from(r.low_freq_factor),
                "high_freq_factor": f64::from(r.high_freq_factor),
                "original_max_position_embeddings": r.original_max_position_embeddings,
            });
        }
        if let Some(b) = self.bos_token_id {
            v["bos_token_id"] = b.into();
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => v["eos_token_id"] = (*one).into(),
            many => v["eos_token_id"] = many.into(),
        }
        v
    }

    /// Checks the relations between fields.
    pub fn validate(&self, path: &Path) -> Result<()> {
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ModelError::config(
                path,
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::config(
                path,
                "head_dim",
                format!("{} is odd; RoPE needs an even width", self.head_dim),
            ));
        }
        self.family.validate(self, path)
    }

    /// The unit names of this model's family.
    pub fn layout(&self) -> crate::family::Layout {
        self.family.layout(self)
    }

    /// Every tensor a checkpoint of this configuration must have, with its shape.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        self.family.tensors(self)
    }

    /// RoPE inverse frequencies, with Llama 3 scaling where configured.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let base: Vec<f32> = (0..self.head_dim)
            .step_by(2)
            .map(|i| 1f32 / self.rope_theta.powf(i as f32 / self.head_dim as f32))
            .collect();
        match &self.rope_scaling {
            Some(r) if !matches!(r.rope_type, Llama3RopeType::Default) => {
                let low = r.original_max_position_embeddings as f32 / r.low_freq_factor;
                let high = r.original_max_position_embeddings as f32 / r.high_freq_factor;
                base.into_iter()
                    .map(|freq| {
                        let wavelen = 2. * std::f32::consts::PI / freq;
                        if wavelen < high {
                            freq
                        } else if wavelen > low {
                            freq / r.factor
                        } else {
                            let smooth = (r.original_max_position_embeddings as f32 / wavelen
                                - r.low_freq_factor)
                                / (r.high_freq_factor - r.low_freq_factor);
                            (1. - smooth) * freq / r.factor + smooth * freq
                        }
                    })
                    .collect()
            }
            _ => base,
        }
    }

    /// Device bytes to reserve beside the weights for a forward pass over `seq_len` new tokens
    /// with up to `max_len` positions in all: the KV cache (allocated once, whole); the live
    /// activations of one layer (hidden states, the MLP, f32 attention: queries, keys and
    /// values, scores and their softmax) with half again for the allocator's fragmentation;
    /// the logits; and 256 MiB for library workspaces (cuBLAS) and small tables.
    ///
    /// Measured on a 7B model with a 512-token prompt, 128 MiB of slack and no fragmentation
    /// allowance were 22-86 MiB short; this estimate is sized from that measurement.
    pub fn reserve_bytes(&self, seq_len: usize, max_len: usize, dtype: candle_core::DType) -> u64 {
        self.reserve_bytes_with(seq_len, max_len, dtype, false)
    }

    /// [`reserve_bytes`](Self::reserve_bytes), where with `attention_kernel` a pass's attention
    /// runs as one kernel ([`candle_offload::ops::prompt_attention`] on a GPU): then it holds
    /// no F32 copies of q, k and v and no score matrix, only the rotated queries and the
    /// output (twice: as the kernel writes it and as the output projection reads it) in
    /// `dtype`.
    pub fn reserve_bytes_with(
        &self,
        seq_len: usize,
        max_len: usize,
        dtype: candle_core::DType,
        attention_kernel: bool,
    ) -> u64 {
        let kv = self.kv_cache_bytes(max_len, dtype);
        let live = self.layer_activation_bytes(seq_len, max_len, dtype, attention_kernel);
        let logits = 2 * 4 * self.vocab_size as u64;
        kv + live
            + self.fragmentation_bytes(seq_len, max_len, dtype, attention_kernel)
            + logits
            + (256 << 20)
    }

    /// The live activations of one layer for `seq_len` new rows (hidden states, the MLP, and
    /// the attention's buffers: with `attention_kernel` the rotated queries and the output, else
    /// the f32 composition's copies and scores over `max_len` positions), as
    /// [`reserve_bytes_with`](Self::reserve_bytes_with) counts them.
    fn layer_activation_bytes(
        &self,
        seq_len: usize,
        max_len: usize,
        dtype: candle_core::DType,
        attention_kernel: bool,
    ) -> u64 {
        let d = dtype.size_in_bytes() as u64;
        let (s, m) = (seq_len as u64, max_len as u64);
        let (nh, hd) = (self.num_attention_heads as u64, self.head_dim as u64);
        let hidden = 8 * s * self.hidden_size as u64 * d;
        let mlp = 4 * s * self.intermediate_size as u64 * d;
        let attn = if attention_kernel {
            3 * s * nh * hd * d
        } else {
            4 * (2 * s * nh * hd + 2 * m * nh * hd + 3 * nh * s * m)
        };
        hidden + mlp + attn
    }

    /// The part of [`reserve_bytes_with`](Self::reserve_bytes_with) that allows for the
    /// allocator's fragmentation by those activations: half again their size. A stage that
    /// streams nothing while its prompt runs in passes may leave it out (the passes'
    /// allocations are all it makes, alike pass after pass); measured on the H200 with a
    /// resident 7B Q4_0 at passes of 149, 312 and 512 rows, the pool's bytes in use grew
    /// 3957, 3971, 3999 MiB, 42 MiB for 363 rows, against 121 MiB that the estimate adds over
    /// those rows (91 without this part).
    pub fn fragmentation_bytes(
        &self,
        seq_len: usize,
        max_len: usize,
        dtype: candle_core::DType,
        attention_kernel: bool,
    ) -> u64 {
        self.layer_activation_bytes(seq_len, max_len, dtype, attention_kernel) / 2
    }

    /// Device bytes a batch of `batch` sequences needs beyond [`reserve_bytes`](Self::reserve_bytes)
    /// for one (each further sequence's KV cache and activations; the workspace allowance is
    /// shared): what to add to `OffloadSettings::reserve_bytes` for
    /// [`generate_batch`](crate::generation::generate_batch).
    pub fn batch_reserve_bytes(
        &self,
        batch: usize,
        seq_len: usize,
        max_len: usize,
        dtype: candle_core::DType,
    ) -> u64 {
        let one = self.reserve_bytes(seq_len, max_len, dtype) - (256 << 20);
        batch.saturating_sub(1) as u64 * one
    }

    /// Device bytes Candle 0.11's CUDA quantized matmul holds beside the weights for `seq_len`
    /// rows, which the dense estimate above does not see: its stream-k fixup workspace (16 MiB,
    /// kept for the process), the activations quantized to Q8_1 blocks, and for the widest
    /// projection an F32 copy of the input and an F32 output. Measured: a 7B Q8_0 model with a
    /// 512-token prompt at 4 GiB went 42 MiB over its budget without it.
    ///
    /// From `tuning`'s [`prefill_gemm_min_rows`](candle_offload::KernelTuning::prefill_gemm_min_rows)
    /// rows on, a prompt's projections go through dequantized 16-bit weights and cuBLAS instead
    /// ([`candle_offload::ops::qlinear_prefill`], [`candle_offload::ops::prefill_gemm_bytes`]
    /// for the widest); block types without that kernel still take Candle's, so this is the
    /// larger of the two.
    pub fn quantized_matmul_bytes(
        &self,
        seq_len: usize,
        tuning: &candle_offload::KernelTuning,
    ) -> u64 {
        let s = seq_len as u64;
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let k = h.max(i) as u64;
        let fixup = 256 * 128 * 128 * 4;
        let q8_1 = (s * k.div_ceil(512) * 512 / 128 + 128) * 144;
        let mmq = fixup + q8_1 + 2 * s * k * 4;
        let q = self.num_attention_heads * self.head_dim;
        let gemm = [(i, h), (h, i), (q, h), (h, q)]
            .into_iter()
            .map(|(n, k)| candle_offload::ops::prefill_gemm_bytes(seq_len, n, k, tuning))
            .max()
            .unwrap_or(0);
        mmq.max(gemm)
    }

    /// Model FLOPs of one training step per token at `seq_len` (forward and backward, no
    /// recomputation), as MFU counts them (PaLM, appendix B): 6 per matmul parameter, every
    /// projection and the head (the embedding table is a lookup, unless tied to the head),
    /// plus 12 · layers · heads · head_dim · seq_len for the attention scores and their
    /// weighted sum (causal masking not discounted).
    pub fn train_flops_per_token(&self, seq_len: usize) -> f64 {
        let (h, i, v) = (
            self.hidden_size as f64,
            self.intermediate_size as f64,
            self.vocab_size as f64,
        );
        let (nh, kv, hd) = (
            self.num_attention_heads as f64,
            self.num_key_value_heads as f64,
            self.head_dim as f64,
        );
        let layer = h * nh * hd + 2.0 * h * kv * hd + nh * hd * h + 3.0 * h * i;
        let matmul_params = self.num_hidden_layers as f64 * layer + h * v;
        6.0 * matmul_params + 12.0 * self.num_hidden_layers as f64 * nh * hd * seq_len as f64
    }

    /// Device bytes a training step needs besides the weights, for `batch` sequences of
    /// `seq_len` tokens with `segments` checkpointed segments (0: none) and matmuls in
    /// `compute`: segment boundaries (F32), one segment's recomputed graph and its backward
    /// temporaries, one attention head group's scores (at most 64 MiB each), one chunk of
    /// output logits (at most 128 MiB), one segment's weight gradients, and workspace. An
    /// estimate; BENCHMARKS.md compares it with measured peaks.
    pub fn train_reserve_bytes(
        &self,
        batch: usize,
        seq_len: usize,
        segments: usize,
        compute: candle_core::DType,
    ) -> u64 {
        let c = compute.size_in_bytes() as u64;
        let tokens = (batch * seq_len) as u64;
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let (nh, kv, hd) = (
            self.num_attention_heads as u64,
            self.num_key_value_heads as u64,
            self.head_dim as u64,
        );
        let layers = self.num_hidden_layers as u64;
        let seg_len = if segments == 0 {
            layers
        } else {
            layers.div_ceil(segments.min(self.num_hidden_layers).max(1) as u64)
        };
        let boundaries = (segments as u64 + 2) * tokens * h * 4;
        // Residual, norms and casts in F32; projections, rotary copies and the MLP in `c`.
        let per_layer = tokens * (12 * h * 4 + (3 * nh * hd + 4 * kv * hd + 2 * h) * c + 4 * i * c);
        let scores = 4 * (64u64 << 20);
        let logits = 5 * (128u64 << 20);
        let layer_weights = (2 * h * nh * hd + 2 * h * kv * hd + 3 * h * i) * c;
        boundaries
            + 2 * seg_len * per_layer
            + scores
            + logits
            + 2 * seg_len * layer_weights
            + (256 << 20)
    }

    /// Bytes of the KV cache for `tokens` positions in `dtype`.
    pub fn kv_cache_bytes(&self, tokens: usize, dtype: candle_core::DType) -> u64 {
        (2 * self.num_hidden_layers
            * self.num_key_value_heads
            * self.head_dim
            * tokens
            * dtype.size_in_bytes()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":576,
        "intermediate_size":1536,"num_attention_heads":9,"num_hidden_layers":30,"num_key_value_heads":3,
        "rms_norm_eps":1e-05,"rope_theta":100000,"tie_word_embeddings":true,"vocab_size":49152,
        "max_position_embeddings":8192,"bos_token_id":1,"eos_token_id":2}"#;

    /// Llama 2 7B has 6,738,415,616 parameters: less the embedding table (32000 x 4096) and the
    /// norms (65 x 4096), 6,607,077,376 multiply in matmuls.
    #[test]
    fn train_flops_count_llama2_7b() {
        let c = Config::from_json_str(
            r#"{"model_type":"llama","hidden_size":4096,"intermediate_size":11008,
            "num_attention_heads":32,"num_hidden_layers":32,"num_key_value_heads":32,
            "vocab_size":32000,"rms_norm_eps":1e-5}"#,
            Path::new("config.json"),
        )
        .unwrap();
        assert_eq!(c.train_flops_per_token(0), 6.0 * 6_607_077_376.0);
        let attention = c.train_flops_per_token(4096) - c.train_flops_per_token(0);
        assert_eq!(attention, 12.0 * 32.0 * 4096.0 * 4096.0);
    }

    /// With the prompt-attention kernel the reservation drops exactly the composition's F32
    /// q/k/v copies and score matrix (with the fragmentation allowance) and adds the kernel's
    /// three (rows, heads · head_dim) tensors in the dtype; SmolLM's llama family is plain
    /// causal, a config with a sliding window is not.
    #[test]
    fn the_attention_kernel_reserves_less() {
        let c = Config::from_json_str(SMOL, Path::new("config.json")).unwrap();
        assert!(c.family.plain_attention(&c));
        let (nh, hd) = (9u64, 64u64);
        for (s, m) in [(1u64, 16u64), (64, 96), (512, 544)] {
            let (su, mu) = (s as usize, m as usize);
            let dense = c.reserve_bytes(su, mu, candle_core::DType::F16);
            assert_eq!(
                c.reserve_bytes_with(su, mu, candle_core::DType::F16, false),
                dense
            );
            let kernel = c.reserve_bytes_with(su, mu, candle_core::DType::F16, true);
            let composition = 4 * (2 * s * nh * hd + 2 * m * nh * hd + 3 * nh * s * m);
            let own = 3 * s * nh * hd * 2;
            let rest = 8 * s * 576 * 2 + 4 * s * 1536 * 2; // hidden states and the MLP
            let want = (rest + composition) * 3 / 2 - (rest + own) * 3 / 2;
            assert_eq!(dense - kernel, want, "{s} rows");
        }
        let windowed = SMOL.replace(
            "\"model_type\":\"llama\"",
            "\"model_type\":\"mistral\",\"sliding_window\":4096",
        );
        let w = Config::from_json_str(&windowed, Path::new("config.json")).unwrap();
        assert!(!w.family.plain_attention(&w));
    }

    #[test]
    fn reads_smollm_and_defaults_qwen2_bias() {
        let c = Config::from_json_str(SMOL, Path::new("config.json")).unwrap();
        assert_eq!(
            (c.head_dim, c.num_key_value_heads, c.tie_word_embeddings),
            (64, 3, true)
        );
        assert_eq!(c.eos_token_ids, [2]);
        assert!(!c.attention_bias);
        let q = SMOL.replace("\"model_type\":\"llama\"", "\"model_type\":\"qwen2\"");
        assert!(
            Config::from_json_str(&q, Path::new("c.json"))
                .unwrap()
                .attention_bias
        );
    }

    #[test]
    fn reads_transformers5_rope_parameters() {
        let v5 = SMOL.replace(
            "\"rope_theta\":100000,",
            "\"rope_parameters\":{\"rope_type\":\"llama3\",\"rope_theta\":500000.0,\"factor\":8.0,\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192},",
        );
        let c = Config::from_json_str(&v5, Path::new("config.json")).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rope_scaling.as_ref().map(|r| r.factor), Some(8.0));
        let plain = SMOL.replace(
            "\"rope_theta\":100000,",
            "\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":5.0},",
        );
        let c = Config::from_json_str(&plain, Path::new("config.json")).unwrap();
        assert!(c.rope_scaling.is_none());
        assert_eq!(c.rope_theta, 5.0);
    }

    /// Every field survives `to_hf_json` → `from_json_str`.
    fn same(a: &Config, b: &Config) -> bool {
        let rope = |c: &Config| {
            c.rope_scaling.as_ref().map(|r| {
                (
                    r.factor,
                    r.low_freq_factor,
                    r.high_freq_factor,
                    r.original_max_position_embeddings,
                    matches!(r.rope_type, Llama3RopeType::Llama3),
                )
            })
        };
        (
            &a.model_type,
            a.hidden_size,
            a.intermediate_size,
            a.vocab_size,
            a.num_hidden_layers,
            a.num_attention_heads,
            a.num_key_value_heads,
            a.head_dim,
        ) == (
            &b.model_type,
            b.hidden_size,
            b.intermediate_size,
            b.vocab_size,
            b.num_hidden_layers,
            b.num_attention_heads,
            b.num_key_value_heads,
            b.head_dim,
        ) && (a.rms_norm_eps, a.rope_theta, a.max_position_embeddings)
            == (b.rms_norm_eps, b.rope_theta, b.max_position_embeddings)
            && (a.tie_word_embeddings, a.attention_bias, a.bos_token_id)
                == (b.tie_word_embeddings, b.attention_bias, b.bos_token_id)
            && a.eos_token_ids == b.eos_token_ids
            && rope(a) == rope(b)
    }

    #[test]
    fn to_hf_json_round_trips() {
        let p = Path::new("config.json");
        let llama3 = SMOL.replace(
            "\"rope_theta\":100000,",
            "\"rope_theta\":500000.0,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192},\"head_dim\":128,",
        );
        let many_eos = SMOL
            .replace("\"eos_token_id\":2", "\"eos_token_id\":[2,7]")
            .replace(
                "\"tie_word_embeddings\":true",
                "\"tie_word_embeddings\":false",
            )
            .replace("\"rms_norm_eps\":1e-05", "\"rms_norm_eps\":3.3e-7");
        let no_ids = SMOL
            .replace(",\"bos_token_id\":1,\"eos_token_id\":2", "")
            .replace("\"model_type\":\"llama\"", "\"model_type\":\"qwen2\"");
        for text in [SMOL.to_string(), llama3, many_eos, no_ids] {
            let a = Config::from_json_str(&text, p).unwrap();
            let json = a.to_hf_json();
            let b = Config::from_json_str(&json.to_string(), p).unwrap();
            assert!(same(&a, &b), "{a:?}\n{json}\n{b:?}");
            assert_eq!(json["tie_word_embeddings"], a.tie_word_embeddings);
            assert!(json["architectures"][0]
                .as_str()
                .unwrap()
                .ends_with("ForCausalLM"));
        }
        let eos = Config::from_json_str(
            &SMOL.replace("\"eos_token_id\":2", "\"eos_token_id\":[2,7]"),
            p,
        )
        .unwrap()
        .to_hf_json();
        assert_eq!(eos["eos_token_id"], serde_json::json!([2, 7]));
    }

    #[test]
    fn bad_configs_name_the_file_and_field() {
        let p = Path::new("/m/config.json");
        let missing = SMOL.replace("\"hidden_size\":576,", "");
        let e = Config::from_json_str(&missing, p).unwrap_err().to_string();
        assert!(
            e.contains("/m/config.json") && e.contains("hidden_size") && e.contains("missing"),
            "{e}"
        );
        let bad = SMOL.replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":4");
        assert!(Config::from_json_str(&bad, p)
            .unwrap_err()
            .to_string()
            .contains("num_key_value_heads"));
        let neg = SMOL.replace("\"vocab_size\":49152", "\"vocab_size\":-3");
        assert!(Config::from_json_str(&neg, p)
            .unwrap_err()
            .to_string()
            .contains("vocab_size"));
        let arch = SMOL.replace("\"model_type\":\"llama\"", "\"model_type\":\"gpt2\"");
        assert!(matches!(
            Config::from_json_str(&arch, p),
            Err(ModelError::UnknownArchitecture { .. })
        ));
        assert!(Config::from_json_str("{ nope", p)
            .unwrap_err()
            .to_string()
            .contains("not valid JSON"));
    }
}
