//! Gemma (`GemmaForCausalLM`) and Gemma 2 (`Gemma2ForCausalLM`): GeGLU, RMSNorm applied as
//! `1 + w` in F32, embeddings scaled by `sqrt(hidden)`, head_dim 256 and tied embeddings; Gemma 2
//! adds norms after attention and after the MLP, scores scaled by `query_pre_attn_scalar`,
//! soft-capped attention and final logits, and sliding-window layers alternating with global
//! ones (`layer_types`, or every even layer). Norm weights from a GGUF file already hold the
//! `1 +` ([`Gemma::norm_offset`] 0).
//!
//! Fields a config leaves out take transformers 5's defaults (head_dim 256; Gemma 2: soft-caps
//! 50 and 30, sliding window 4096); `null` turns a soft-cap or the window off. Gemma 1's
//! activation is `hidden_act`, as transformers 5 reads it.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use crate::family::{embed_lookup, Config, DecoderBlock, Family, UnitWeights};
use crate::hf_config::{CommonDefaults, HfFields, Registration};
use crate::layers::{
    attention_tensors, hf_tensors, mlp_tensors, norm_tensors, soft_cap, Activation, AttentionSpec,
    GatedMlp, Norm, PreNormBlock, SelfAttention, TensorShape,
};
use crate::ModelError;

/// `gemma` and `gemma2` configs.
pub const REGISTRATION: Registration = Registration {
    model_types: &[
        ("gemma", "GemmaForCausalLM"),
        ("gemma2", "Gemma2ForCausalLM"),
    ],
    from_hf,
};

/// The Gemma family (version 1 or 2).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma {
    /// 1 or 2.
    pub version: u8,
    /// The MLP gate's activation (`gelu_pytorch_tanh`).
    pub act: Activation,
    /// Scores are divided by `sqrt(query_pre_attn_scalar)` (Gemma 2; Gemma 1: head_dim).
    pub query_pre_attn_scalar: f64,
    /// Attention score soft-capping (Gemma 2).
    pub attn_logit_softcapping: Option<f64>,
    /// Final logit soft-capping (Gemma 2).
    pub final_logit_softcapping: Option<f64>,
    /// The sliding window of the layers that have one.
    pub sliding_window: Option<usize>,
    /// Per layer: whether it uses the sliding window.
    pub sliding_layers: Vec<bool>,
    /// Norm weights are applied as `norm_offset + w` (1 from HF checkpoints; 0 from GGUF
    /// files, whose converter adds the 1).
    pub norm_offset: f64,
}

fn from_hf(f: &HfFields<'_>) -> crate::Result<Config> {
    let (mut cfg, gemma) = parse(f)?;
    cfg.family = Arc::new(gemma);
    Ok(cfg)
}

/// The shared fields (with a placeholder family) and the family's own.
fn parse(f: &HfFields<'_>) -> crate::Result<(Config, Gemma)> {
    let version = if f.model_type == "gemma2" { 2 } else { 1 };
    // As transformers 5: Gemma 1 reads `hidden_act` (a `hidden_activation` beside it is
    // ignored, so a `"gelu"` there means the exact GELU), Gemma 2 `hidden_activation`.
    let field = if version == 2 {
        "hidden_activation"
    } else {
        "hidden_act"
    };
    let act_name = f.str_or(field, "gelu_pytorch_tanh")?;
    let act = Activation::from_hf(act_name).ok_or_else(|| {
        ModelError::config(f.path, field, format!("{act_name:?} is not supported"))
    })?;
    if f.bool_or("attention_bias", false)? {
        return Err(ModelError::config(
            f.path,
            "attention_bias",
            "biased attention projections are not supported for gemma",
        ));
    }
    if f.bool_or("use_bidirectional_attention", false)? {
        return Err(ModelError::config(
            f.path,
            "use_bidirectional_attention",
            "bidirectional attention (embedding models) is not supported",
        ));
    }
    match Config::hf_rope_scaling(f) {
        None | Some(("default", _, _)) => {}
        Some((other, _, field)) => {
            return Err(ModelError::config(
                f.path,
                field,
                format!("rope type {other:?} is not supported for gemma"),
            ))
        }
    }
    let placeholder = Arc::new(Gemma {
        version,
        act,
        query_pre_attn_scalar: 1.0,
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
        sliding_window: None,
        sliding_layers: Vec::new(),
        norm_offset: 1.0,
    });
    let mut cfg = Config::from_hf_common(
        f,
        placeholder,
        CommonDefaults {
            tie_word_embeddings: true,
            ..Default::default()
        },
    )?;
    // transformers' defaults for fields a config leaves out (null is kept as "none").
    if f.get("head_dim").is_none() {
        cfg.head_dim = 256;
    }
    cfg.max_position_embeddings = f.opt_usize("max_position_embeddings")?.unwrap_or(8192);
    let n = cfg.num_hidden_layers;
    let gemma = if version == 1 {
        Gemma {
            version,
            act,
            query_pre_attn_scalar: cfg.head_dim as f64,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            sliding_window: None,
            sliding_layers: vec![false; n],
            norm_offset: 1.0,
        }
    } else {
        // Absent: transformers' default; null: none.
        let or_default = |name: &str, default: f64| -> crate::Result<Option<f64>> {
            if f.obj.contains_key(name) {
                f.opt_f64(name)
            } else {
                Ok(Some(default))
            }
        };
        let sliding_window = if f.obj.contains_key("sliding_window") {
            f.opt_usize("sliding_window")?
        } else {
            Some(4096)
        };
        let sliding_layers = f.sliding_layers(n, |i| (i + 1) % 2 == 1)?;
        Gemma {
            version,
            act,
            query_pre_attn_scalar: f.f64_or("query_pre_attn_scalar", 256.0)?,
            attn_logit_softcapping: or_default("attn_logit_softcapping", 50.0)?,
            final_logit_softcapping: or_default("final_logit_softcapping", 30.0)?,
            sliding_window,
            sliding_layers,
            norm_offset: 1.0,
        }
    };
    Ok((cfg, gemma))
}

impl Family for Gemma {
    fn name(&self) -> &str {
        if self.version == 2 {
            "gemma2"
        } else {
            "gemma"
        }
    }

    fn tensors(&self, cfg: &Config) -> Vec<TensorShape> {
        hf_tensors(cfg, |p, out| {
            attention_tensors(p, cfg, out);
            mlp_tensors(p, cfg, out);
            let mut norms = vec!["input_layernorm", "post_attention_layernorm"];
            if self.version == 2 {
                norms.extend(["pre_feedforward_layernorm", "post_feedforward_layernorm"]);
            }
            norm_tensors(p, &norms, cfg.hidden_size, out);
        })
    }

    fn embed(&self, cfg: &Config, w: UnitWeights<'_>, ids: &Tensor) -> Result<Tensor> {
        embed_lookup(cfg, &self.layout(cfg).embed, &w, ids)? * (cfg.hidden_size as f64).sqrt()
    }

    fn block(
        &self,
        cfg: &Config,
        w: UnitWeights<'_>,
        layer: usize,
        norm_dtype: DType,
    ) -> Result<Box<dyn DecoderBlock>> {
        let h = cfg.hidden_size;
        let _ = norm_dtype; // Gemma's norms compute in F32.
        let norm =
            |name: &str| Norm::load_f32(h, cfg.rms_norm_eps, self.norm_offset, w.vb().pp(name));
        let sliding = self.sliding_layers.get(layer).copied().unwrap_or(false);
        let spec = AttentionSpec {
            score_div: self.query_pre_attn_scalar.sqrt(),
            softcap: self.attn_logit_softcapping,
            window: if sliding { self.sliding_window } else { None },
            ..AttentionSpec::of(cfg)
        };
        let attn = SelfAttention::load(w.pp("self_attn"), h, spec, cfg.attention_bias)?;
        let mlp = GatedMlp::load(w.pp("mlp"), h, cfg.intermediate_size, self.act)?.into();
        let block = if self.version == 2 {
            PreNormBlock {
                input_norm: norm("input_layernorm")?,
                attn,
                post_attn_norm: Some(norm("post_attention_layernorm")?),
                pre_mlp_norm: norm("pre_feedforward_layernorm")?,
                mlp,
                post_mlp_norm: Some(norm("post_feedforward_layernorm")?),
            }
        } else {
            PreNormBlock {
                input_norm: norm("input_layernorm")?,
                attn,
                post_attn_norm: None,
                pre_mlp_norm: norm("post_attention_layernorm")?,
                mlp,
                post_mlp_norm: None,
            }
        };
        Ok(Box::new(block))
    }

    fn final_norm(&self, cfg: &Config, vb: VarBuilder, _dtype: DType) -> Result<Norm> {
        Norm::load_f32(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset, vb)
    }

    fn finish_logits(&self, _cfg: &Config, logits: Tensor) -> Result<Tensor> {
        match self.final_logit_softcapping {
            Some(cap) => soft_cap(&logits, cap),
            None => Ok(logits),
        }
    }

    fn finishes_logits(&self, _cfg: &Config) -> bool {
        self.final_logit_softcapping.is_some()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// A Gemma 2 config, small, with the fields transformers writes unless `drop` names them.
    fn config(model_type: &str, extra: serde_json::Value, drop: &[&str]) -> String {
        let mut c = serde_json::json!({
            "model_type": model_type, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 100,
            "query_pre_attn_scalar": 144, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
        });
        for (k, v) in extra.as_object().into_iter().flatten() {
            c[k] = v.clone();
        }
        let obj = c.as_object_mut().unwrap();
        for d in drop {
            obj.remove(*d);
        }
        c.to_string()
    }

    fn parse_str(text: &str) -> crate::Result<(Config, Gemma)> {
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        let obj = v.as_object().unwrap();
        parse(&HfFields {
            obj,
            path: Path::new("/m/config.json"),
            model_type: obj["model_type"].as_str().unwrap(),
        })
    }

    #[test]
    fn gemma2_layer_types_explicit_or_every_even_layer() {
        let (cfg, g) = parse_str(&config("gemma2", serde_json::json!({}), &[])).unwrap();
        assert_eq!(g.sliding_layers, [true, false, true, false]);
        assert_eq!(
            (g.version, g.query_pre_attn_scalar, g.sliding_window),
            (2, 144.0, Some(4096))
        );
        assert_eq!(
            (g.attn_logit_softcapping, g.final_logit_softcapping),
            (Some(50.0), Some(30.0))
        );
        assert!(cfg.tie_word_embeddings);
        let kinds = serde_json::json!({"layer_types":
            ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]});
        let (_, g) = parse_str(&config("gemma2", kinds, &[])).unwrap();
        assert_eq!(g.sliding_layers, [false, true, true, false]);
    }

    #[test]
    fn gemma2_defaults_are_transformers_and_null_means_none() {
        let absent = [
            "head_dim",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "sliding_window",
            "hidden_activation",
            "max_position_embeddings",
        ];
        let (cfg, g) = parse_str(&config("gemma2", serde_json::json!({}), &absent)).unwrap();
        assert_eq!((cfg.head_dim, cfg.max_position_embeddings), (256, 8192));
        assert_eq!(
            (g.query_pre_attn_scalar, g.sliding_window, g.act),
            (256.0, Some(4096), Activation::GeluTanh)
        );
        assert_eq!(
            (g.attn_logit_softcapping, g.final_logit_softcapping),
            (Some(50.0), Some(30.0))
        );
        let nulls = serde_json::json!({"attn_logit_softcapping": null, "final_logit_softcapping": null,
            "sliding_window": null});
        let (_, g) = parse_str(&config("gemma2", nulls, &[])).unwrap();
        assert_eq!(
            (
                g.attn_logit_softcapping,
                g.final_logit_softcapping,
                g.sliding_window
            ),
            (None, None, None)
        );
    }

    #[test]
    fn gemma1_reads_hidden_act_as_transformers_5() {
        let g1 =
            serde_json::json!({"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"});
        let (cfg, g) = parse_str(&config("gemma", g1, &["head_dim"])).unwrap();
        assert_eq!((g.version, g.act, cfg.head_dim), (1, Activation::Gelu, 256));
        // Scores over sqrt(head_dim), no caps, no windows, whatever else the file says.
        assert_eq!(
            (
                g.query_pre_attn_scalar,
                g.attn_logit_softcapping,
                g.sliding_window
            ),
            (256.0, None, None)
        );
        assert_eq!(g.sliding_layers, [false; 4]);
        let (_, g) = parse_str(&config("gemma", serde_json::json!({}), &[])).unwrap();
        assert_eq!(g.act, Activation::GeluTanh);
    }

    #[test]
    fn bad_gemma_configs_name_the_field() {
        let p = Path::new("/m/config.json");
        let err = |model_type: &str, extra: serde_json::Value| {
            Config::from_json_str(&config(model_type, extra, &[]), p)
                .unwrap_err()
                .to_string()
        };
        let e = err(
            "gemma2",
            serde_json::json!({"layer_types": ["full_attention"]}),
        );
        assert!(
            e.contains("/m/config.json") && e.contains("layer_types") && e.contains("4"),
            "{e}"
        );
        let e = err(
            "gemma2",
            serde_json::json!({"layer_types": ["full_attention", "chunked_attention", "full_attention", "full_attention"]}),
        );
        assert!(
            e.contains("layer_types") && e.contains("chunked_attention"),
            "{e}"
        );
        let e = err("gemma2", serde_json::json!({"hidden_activation": "relu"}));
        assert!(e.contains("hidden_activation") && e.contains("relu"), "{e}");
        let e = err(
            "gemma2",
            serde_json::json!({"attn_logit_softcapping": -1.0}),
        );
        assert!(e.contains("attn_logit_softcapping"), "{e}");
        let e = err("gemma", serde_json::json!({"attention_bias": true}));
        assert!(e.contains("attention_bias"), "{e}");
        let e = err(
            "gemma",
            serde_json::json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        );
        assert!(e.contains("rope_scaling") && e.contains("linear"), "{e}");
    }

    #[test]
    fn unknown_model_type_lists_the_supported_ones() {
        let text = config("gemma4", serde_json::json!({}), &[]);
        let e = Config::from_json_str(&text, Path::new("/m/config.json")).unwrap_err();
        assert!(matches!(e, ModelError::UnknownArchitecture { .. }), "{e:?}");
        let e = e.to_string();
        for known in [
            "llama", "mistral", "qwen2", "phi3", "gemma", "gemma2", "qwen3", "gemma3",
        ] {
            assert!(e.contains(known), "{known} missing from: {e}");
        }
        assert!(e.contains("gemma4") && e.contains("/m/config.json"), "{e}");
    }

    #[test]
    fn gemma2_tensor_names_have_four_norms_and_no_head() {
        let cfg = Config::from_json_str(
            &config("gemma2", serde_json::json!({}), &[]),
            Path::new("c.json"),
        )
        .unwrap();
        let names: Vec<String> = cfg.expected_tensors().into_iter().map(|(n, _)| n).collect();
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            assert!(names.contains(&format!("model.layers.3.{norm}.weight")));
        }
        assert!(!names.iter().any(|n| n == "lm_head.weight"));
        assert_eq!(cfg.layout().head_unit(), "model.embed_tokens");
    }
}
