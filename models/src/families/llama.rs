//! The LLaMA family (Llama 2/3, Mistral, Qwen2, SmolLM): GQA/MQA, RoPE (with Llama 3
//! scaling), RMSNorm, SwiGLU, tied embeddings, and q/k/v biases (Qwen2).

use std::sync::Arc;

use candle_core::{DType, Device, Result};
use candle_transformers::models::llama::Llama3RopeConfig;

use crate::family::{Config, DecoderBlock, Family, UnitWeights};
use crate::hf_config::{CommonDefaults, HfFields, Registration};
use crate::layers::{
    attention_tensors, hf_tensors, mlp_tensors, norm_tensors, Activation, AttentionSpec, GatedMlp,
    Norm, PreNormBlock, Rope, SelfAttention, TensorShape,
};
use crate::ModelError;

/// `llama`, `mistral` and `qwen2` configs.
pub const REGISTRATION: Registration = Registration {
    model_types: &[
        ("llama", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
    ],
    from_hf,
};

/// The LLaMA family.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LlamaFamily {
    /// Per layer, the sliding window of its attention, if any: every layer of a Mistral whose
    /// config sets `sliding_window`; the layers `layer_types` names (by default those from
    /// `max_window_layers` on) of a Qwen2 with `use_sliding_window`; none for Llama.
    pub windows: Vec<Option<usize>>,
    /// Per rotated pair of dimensions, a divisor of its RoPE frequency: a GGUF file's
    /// `rope_freqs.weight` (Llama 3.1's scaling as llama.cpp's converter stores it, in place
    /// of the `rope_scaling` a `config.json` gives). `None`: the configuration's own RoPE.
    pub freq_factors: Option<Vec<f32>>,
}

/// The family without sliding windows (Llama, and GGUF files), shared.
pub fn family() -> Arc<dyn Family> {
    Arc::new(LlamaFamily::default())
}

/// The sliding windows of a `mistral`, `mixtral`, `qwen2`, `qwen3` or `qwen3_moe` config, as transformers applies them.
pub(crate) fn windows(f: &HfFields<'_>, n: usize) -> crate::Result<Vec<Option<usize>>> {
    let qwen = matches!(f.model_type, "qwen2" | "qwen2_moe" | "qwen3" | "qwen3_moe");
    let window = match f.model_type {
        "mistral" | "mixtral" => f.opt_usize("sliding_window")?,
        _ if qwen && f.bool_or("use_sliding_window", false)? => {
            if f.obj.contains_key("sliding_window") {
                f.opt_usize("sliding_window")?
            } else {
                Some(4096)
            }
        }
        _ => None,
    };
    let sliding = match window {
        None => None,
        Some(w) if qwen => {
            let from = f.opt_usize("max_window_layers")?.unwrap_or(28);
            Some((w, f.sliding_layers(n, |i| i >= from)?))
        }
        Some(w) => Some((w, f.sliding_layers(n, |_| true)?)),
    };
    Ok(match sliding {
        Some((w, layers)) => layers.into_iter().map(|s| s.then_some(w)).collect(),
        None => vec![None; n],
    })
}

/// The RoPE scaling of a config: none, or Llama 3's; other types are refused.
pub(crate) fn llama3_rope_scaling(f: &HfFields<'_>) -> crate::Result<Option<Llama3RopeConfig>> {
    Ok(match Config::hf_rope_scaling(f) {
        None | Some(("default", _, _)) => None,
        Some(("llama3", x, _)) => Some(
            serde_json::from_value::<Llama3RopeConfig>(x.clone())
                .map_err(|e| ModelError::config(f.path, "rope_scaling", e))?,
        ),
        Some((other, _, _)) => {
            return Err(ModelError::config(
                f.path,
                "rope_scaling",
                format!("rope type {other:?} is not supported"),
            ))
        }
    })
}

fn from_hf(f: &HfFields<'_>) -> crate::Result<Config> {
    let rope_scaling = llama3_rope_scaling(f)?;
    let mut cfg = Config::from_hf_common(
        f,
        family(),
        CommonDefaults {
            attention_bias: f.model_type == "qwen2",
            ..Default::default()
        },
    )?;
    cfg.rope_scaling = rope_scaling;
    let windows = windows(f, cfg.num_hidden_layers)?;
    if windows.iter().any(Option::is_some) {
        cfg.family = Arc::new(LlamaFamily {
            windows,
            freq_factors: None,
        });
    }
    Ok(cfg)
}

impl Family for LlamaFamily {
    fn name(&self) -> &str {
        "llama"
    }

    fn tensors(&self, cfg: &Config) -> Vec<TensorShape> {
        hf_tensors(cfg, |p, out| {
            attention_tensors(p, cfg, out);
            mlp_tensors(p, cfg, out);
            let norms = ["input_layernorm", "post_attention_layernorm"];
            norm_tensors(p, &norms, cfg.hidden_size, out);
        })
    }

    fn plain_attention(&self, _cfg: &Config) -> bool {
        self.windows.iter().all(Option::is_none)
    }

    fn rope(&self, cfg: &Config, max_len: usize, dtype: DType, device: &Device) -> Result<Rope> {
        let inv_freq = cfg.rope_inv_freq();
        let inv_freq = match &self.freq_factors {
            None => inv_freq,
            Some(f) if f.len() == inv_freq.len() => {
                inv_freq.iter().zip(f).map(|(x, d)| x / d).collect()
            }
            Some(f) => candle_core::bail!(
                "{} RoPE frequency factors for {} rotated pairs",
                f.len(),
                inv_freq.len()
            ),
        };
        Rope::from_inv_freq(&inv_freq, max_len, 1.0, dtype, device)
    }

    fn block(
        &self,
        cfg: &Config,
        w: UnitWeights<'_>,
        layer: usize,
        norm_dtype: DType,
    ) -> Result<Box<dyn DecoderBlock>> {
        let h = cfg.hidden_size;
        let norm = |name: &str| Norm::load(h, cfg.rms_norm_eps, 0.0, w.vb().pp(name), norm_dtype);
        let spec = AttentionSpec {
            window: self.windows.get(layer).copied().flatten(),
            ..AttentionSpec::of(cfg)
        };
        Ok(Box::new(PreNormBlock {
            input_norm: norm("input_layernorm")?,
            attn: SelfAttention::load(w.pp("self_attn"), h, spec, cfg.attention_bias)?,
            post_attn_norm: None,
            pre_mlp_norm: norm("post_attention_layernorm")?,
            mlp: GatedMlp::load(w.pp("mlp"), h, cfg.intermediate_size, Activation::Silu)?.into(),
            post_mlp_norm: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::Config;

    const BASE: &str = r#""hidden_size":64,"intermediate_size":96,"num_attention_heads":4,
        "num_hidden_layers":4,"vocab_size":101"#;

    fn family(extra: &str) -> String {
        let text = format!("{{{BASE},{extra}}}");
        let cfg = Config::from_json_str(&text, Path::new("config.json")).unwrap();
        format!("{:?}", cfg.family)
    }

    #[test]
    fn sliding_windows_follow_transformers() {
        let none = "LlamaFamily { windows: [], freq_factors: None }";
        assert_eq!(family(r#""model_type":"llama","sliding_window":8"#), none);
        assert_eq!(
            family(r#""model_type":"mistral","sliding_window":null"#),
            none
        );
        assert_eq!(
            family(r#""model_type":"mistral","sliding_window":8"#),
            "LlamaFamily { windows: [Some(8), Some(8), Some(8), Some(8)], freq_factors: None }"
        );
        assert_eq!(family(r#""model_type":"qwen2","sliding_window":8"#), none);
        assert_eq!(
            family(
                r#""model_type":"qwen2","use_sliding_window":true,"sliding_window":8,"max_window_layers":2"#
            ),
            "LlamaFamily { windows: [None, None, Some(8), Some(8)], freq_factors: None }"
        );
        let types = r#""layer_types":["sliding_attention","full_attention","sliding_attention","full_attention"]"#;
        assert_eq!(
            family(&format!(
                r#""model_type":"mistral","sliding_window":5,{types}"#
            )),
            "LlamaFamily { windows: [Some(5), None, Some(5), None], freq_factors: None }"
        );
        let bad = format!(
            r#"{{{BASE},"model_type":"mistral","sliding_window":5,"layer_types":["sliding_attention"]}}"#
        );
        let e = Config::from_json_str(&bad, Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("layer_types") && e.contains("c.json"), "{e}");
    }
}
