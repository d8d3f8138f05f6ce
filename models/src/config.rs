//! The LLaMA-family configuration: read from an HF `config.json` (Llama 2/3, Mistral, Qwen2,
//! SmolLM) or from GGUF metadata, and validated once.

use std::path::Path;

use candle_transformers::models::llama::{Llama3RopeConfig, Llama3RopeType};

use crate::error::{ModelError, Result};

/// Architectures (HF `model_type`) this crate implements.
pub const SUPPORTED: &str = "llama, mistral, qwen2 (and models of their shape, such as SmolLM)";

/// A validated LLaMA-family configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// `llama`, `mistral` or `qwen2`.
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
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl Config {
    /// Reads and validates `config.json`.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?;
        Self::from_json_str(&text, path)
    }

    /// Parses and validates the text of a `config.json`; `path` names it in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ModelError::file(path, format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| ModelError::file(path, "is not a JSON object"))?;
        let model_type = obj
            .get("model_type")
            .and_then(|m| m.as_str())
            .or_else(|| {
                obj.get("architectures")
                    .and_then(|a| a.get(0))
                    .and_then(|a| a.as_str())
                    .map(|a| match a {
                        "LlamaForCausalLM" => "llama",
                        "MistralForCausalLM" => "mistral",
                        "Qwen2ForCausalLM" => "qwen2",
                        other => other,
                    })
            })
            .ok_or_else(|| {
                ModelError::config(path, "model_type", "missing (and no `architectures`)")
            })?
            .to_string();
        if !["llama", "mistral", "qwen2"].contains(&model_type.as_str()) {
            return Err(ModelError::UnknownArchitecture {
                path: path.into(),
                name: model_type,
                supported: SUPPORTED,
            });
        }
        let usize_field = |name: &str| -> Result<usize> {
            let x = obj
                .get(name)
                .ok_or_else(|| ModelError::config(path, name, "missing"))?;
            let n = x.as_u64().ok_or_else(|| {
                ModelError::config(path, name, format!("expected a positive integer, got {x}"))
            })?;
            if n == 0 {
                return Err(ModelError::config(path, name, "must be larger than zero"));
            }
            Ok(n as usize)
        };
        let opt_usize = |name: &str| -> Result<Option<usize>> {
            match obj.get(name) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(_) => usize_field(name).map(Some),
            }
        };
        let f64_field = |name: &str, default: f64| -> Result<f64> {
            match obj.get(name) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .ok_or_else(|| {
                        ModelError::config(
                            path,
                            name,
                            format!("expected a positive number, got {x}"),
                        )
                    }),
            }
        };
        let bool_field = |name: &str, default: bool| -> Result<bool> {
            match obj.get(name) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(x) => x.as_bool().ok_or_else(|| {
                    ModelError::config(path, name, format!("expected true or false, got {x}"))
                }),
            }
        };
        let hidden_size = usize_field("hidden_size")?;
        let num_attention_heads = usize_field("num_attention_heads")?;
        let num_key_value_heads = opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
        let head_dim = opt_usize("head_dim")?.unwrap_or(hidden_size / num_attention_heads);
        // transformers 5 moved `rope_theta` and `rope_scaling` into `rope_parameters`.
        let rope_params = obj.get("rope_parameters").filter(|v| v.is_object());
        let rope_scaling_value = obj
            .get("rope_scaling")
            .filter(|v| !v.is_null())
            .or(rope_params);
        let rope_scaling = match rope_scaling_value {
            None | Some(serde_json::Value::Null) => None,
            Some(x) => {
                let rope_type = x
                    .get("rope_type")
                    .or_else(|| x.get("type"))
                    .and_then(|t| t.as_str())
                    .unwrap_or("default");
                match rope_type {
                    "llama3" => Some(
                        serde_json::from_value::<Llama3RopeConfig>(x.clone())
                            .map_err(|e| ModelError::config(path, "rope_scaling", e))?,
                    ),
                    "default" => None,
                    other => {
                        return Err(ModelError::config(
                            path,
                            "rope_scaling",
                            format!("rope type {other:?} is not supported"),
                        ))
                    }
                }
            }
        };
        let eos_token_ids = match obj.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => Vec::new(),
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
        let bos_token_id = match obj.get("bos_token_id") {
            None | Some(serde_json::Value::Null) => None,
            Some(x) => Some(x.as_u64().ok_or_else(|| {
                ModelError::config(
                    path,
                    "bos_token_id",
                    format!("expected a token id, got {x}"),
                )
            })? as u32),
        };
        let cfg = Self {
            attention_bias: bool_field("attention_bias", model_type == "qwen2")?,
            model_type,
            hidden_size,
            intermediate_size: usize_field("intermediate_size")?,
            vocab_size: usize_field("vocab_size")?,
            num_hidden_layers: usize_field("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: f64_field("rms_norm_eps", 1e-6)?,
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
                None => f64_field("rope_theta", 10_000.0)? as f32,
            },
            rope_scaling,
            max_position_embeddings: opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: bool_field("tie_word_embeddings", false)?,
            bos_token_id,
            eos_token_ids,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// The HF `config.json` of this configuration: every field [`Config::from_json_str`]
    /// reads (`rope_scaling` when present), with `model_type`, `architectures` and
    /// `tie_word_embeddings`, so that a directory written with it loads here and in
    /// transformers.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let architecture = match self.model_type.as_str() {
            "mistral" => "MistralForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            _ => "LlamaForCausalLM",
        };
        let mut v = serde_json::json!({
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
            "hidden_act": "silu",
        });
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
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(ModelError::config(
                path,
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.head_dim % 2 != 0 {
            return Err(ModelError::config(
                path,
                "head_dim",
                format!("{} is odd; RoPE needs an even width", self.head_dim),
            ));
        }
        Ok(())
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
        let d = dtype.size_in_bytes() as u64;
        let (s, m) = (seq_len as u64, max_len as u64);
        let (nh, hd) = (self.num_attention_heads as u64, self.head_dim as u64);
        let kv = self.kv_cache_bytes(max_len, dtype);
        let hidden = 8 * s * self.hidden_size as u64 * d;
        let mlp = 4 * s * self.intermediate_size as u64 * d;
        let attn = 4 * (2 * s * nh * hd + 2 * m * nh * hd + 3 * nh * s * m);
        let logits = 2 * 4 * self.vocab_size as u64;
        kv + (hidden + mlp + attn) * 3 / 2 + logits + (256 << 20)
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
