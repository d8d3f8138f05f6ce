//! Reading an HF `config.json`: typed field readers that name the file and the field in errors
//! ([`HfFields`]), the fields every family shares ([`Config::from_hf_common`] with a family's
//! [`CommonDefaults`], [`Config::hf_rope_scaling`]), and how a family registers its reader
//! ([`Registration`]). The registry that picks the family by `model_type`, with
//! [`Config::from_json_str`] and [`Config::to_hf_json`], is [`crate::families`].

use std::path::Path;
use std::sync::Arc;

use crate::error::{ModelError, Result};
use crate::family::{Config, Family};

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
    /// The fields every family shares, read from an HF config, for `family` (a family's
    /// [`Registration::from_hf`] starts here). The raw object is
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
}

/// How the crate finds a family for a `config.json`.
#[derive(Debug, Clone, Copy)]
pub struct Registration {
    /// HF `model_type` values, each with the `architectures` entry transformers writes for it.
    pub model_types: &'static [(&'static str, &'static str)],
    /// Reads the whole configuration of a model of this family.
    pub from_hf: fn(&HfFields<'_>) -> crate::Result<Config>,
}

/// A `config.json` object with typed readers that name the file and the field in errors.
#[derive(Debug)]
pub struct HfFields<'a> {
    /// The parsed object.
    pub obj: &'a serde_json::Map<String, serde_json::Value>,
    /// The file, for errors.
    pub path: &'a Path,
    /// The `model_type` (given, or from `architectures`).
    pub model_type: &'a str,
}

impl HfFields<'_> {
    /// The raw value of a field (`None` when absent or null).
    pub fn get(&self, name: &str) -> Option<&serde_json::Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    /// A required positive integer.
    pub fn usize(&self, name: &str) -> crate::Result<usize> {
        let x = self
            .get(name)
            .ok_or_else(|| crate::ModelError::config(self.path, name, "missing"))?;
        let n = x.as_u64().ok_or_else(|| {
            crate::ModelError::config(
                self.path,
                name,
                format!("expected a positive integer, got {x}"),
            )
        })?;
        if n == 0 {
            return Err(crate::ModelError::config(
                self.path,
                name,
                "must be larger than zero",
            ));
        }
        Ok(n as usize)
    }

    /// An optional positive integer.
    pub fn opt_usize(&self, name: &str) -> crate::Result<Option<usize>> {
        match self.get(name) {
            None => Ok(None),
            Some(_) => self.usize(name).map(Some),
        }
    }

    /// A positive finite number, `default` when absent.
    pub fn f64_or(&self, name: &str, default: f64) -> crate::Result<f64> {
        match self.get(name) {
            None => Ok(default),
            Some(x) => x
                .as_f64()
                .filter(|f| f.is_finite() && *f > 0.0)
                .ok_or_else(|| {
                    crate::ModelError::config(
                        self.path,
                        name,
                        format!("expected a positive number, got {x}"),
                    )
                }),
        }
    }

    /// An optional positive finite number.
    pub fn opt_f64(&self, name: &str) -> crate::Result<Option<f64>> {
        match self.get(name) {
            None => Ok(None),
            Some(_) => self.f64_or(name, 1.0).map(Some),
        }
    }

    /// A boolean, `default` when absent.
    pub fn bool_or(&self, name: &str, default: bool) -> crate::Result<bool> {
        match self.get(name) {
            None => Ok(default),
            Some(x) => x.as_bool().ok_or_else(|| {
                crate::ModelError::config(
                    self.path,
                    name,
                    format!("expected true or false, got {x}"),
                )
            }),
        }
    }

    /// Which of `n` layers use a sliding window: `layer_types` (`sliding_attention` or
    /// `full_attention`, one per layer) when given, otherwise `default(layer)`.
    pub fn sliding_layers(
        &self,
        n: usize,
        default: impl Fn(usize) -> bool,
    ) -> crate::Result<Vec<bool>> {
        let Some(x) = self.get("layer_types") else {
            return Ok((0..n).map(default).collect());
        };
        let kinds: Vec<&str> = x
            .as_array()
            .map(|a| a.iter().filter_map(|k| k.as_str()).collect())
            .unwrap_or_default();
        if kinds.len() != n {
            return Err(crate::ModelError::config(
                self.path,
                "layer_types",
                format!("expected {n} layer types (one per layer), got {x}"),
            ));
        }
        kinds
            .iter()
            .map(|k| match *k {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(crate::ModelError::config(
                    self.path,
                    "layer_types",
                    format!("unknown layer type {other:?}"),
                )),
            })
            .collect()
    }

    /// A string, `default` when absent.
    pub fn str_or<'s>(&'s self, name: &str, default: &'s str) -> crate::Result<&'s str> {
        match self.get(name) {
            None => Ok(default),
            Some(x) => x.as_str().ok_or_else(|| {
                crate::ModelError::config(self.path, name, format!("expected a string, got {x}"))
            }),
        }
    }
}
