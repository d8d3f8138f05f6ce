//! Gemma 3 text (`Gemma3ForCausalLM`, `model_type` `gemma3_text`; and the text model of a
//! multimodal `gemma3` checkpoint): Gemma 2's block (GeGLU, `1 + w` RMSNorms in F32 before and
//! after attention and the MLP, embeddings scaled by `sqrt(hidden)`, scores over
//! `sqrt(query_pre_attn_scalar)`) with an RMSNorm (`1 + w`) over each head of q and of k before
//! RoPE, sliding-window layers beside global ones, and two RoPE bases: the local layers rotate
//! with `rope_local_base_freq` unscaled, the global ones with `rope_theta` and its linear
//! scaling. No soft-capping unless a config asks for it. Norm weights from a GGUF file already
//! hold the `1 +` ([`Gemma3::norm_offset`] 0).
//!
//! Both config forms are read: transformers 5's `rope_parameters` keyed by layer type
//! (`sliding_attention`, `full_attention`) and `layer_types`; the older `rope_theta`,
//! `rope_local_base_freq`, `rope_scaling` and `sliding_window_pattern` (layer `i` is global
//! when `(i + 1) % pattern == 0`; 6 when absent). Fields a config leaves out take
//! transformers' defaults (a multimodal checkpoint's `text_config` leaves out most).
//!
//! A multimodal checkpoint keeps its text model under `language_model.model.` (and its head as
//! `language_model.lm_head`) when saved by transformers 4, under `model.language_model.` (head
//! `lm_head`) by transformers 5: the loader picks the one the checkpoint holds
//! ([`Family::for_checkpoint`]). The vision tower's tensors are not used.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use crate::family::{embed_lookup, Config, DecoderBlock, Family, Layout, UnitWeights};
use crate::hf_config::{CommonDefaults, HfFields, Registration};
use crate::layers::{
    attention_tensors, hf_tensors, mlp_tensors, norm_tensors, soft_cap, Activation, AttentionSpec,
    GatedMlp, Norm, PreNormBlock, Rope, SelfAttention, TensorShape,
};
use crate::ModelError;

/// `gemma3_text` and `gemma3` configs.
pub const REGISTRATION: Registration = Registration {
    model_types: &[
        ("gemma3_text", "Gemma3ForCausalLM"),
        ("gemma3", "Gemma3ForConditionalGeneration"),
    ],
    from_hf,
};

/// Where a checkpoint keeps the text model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextKeys {
    /// `model.*`, `lm_head` (`Gemma3ForCausalLM`).
    Text,
    /// `model.language_model.*`, `lm_head` (a multimodal checkpoint saved by transformers 5).
    LanguageModel,
    /// `language_model.model.*`, `language_model.lm_head` (one saved by transformers 4).
    LanguageModelV4,
}

impl TextKeys {
    /// The prefix of the text model's modules, and the output head's unit.
    fn prefixes(self) -> (&'static str, &'static str) {
        match self {
            Self::Text => ("model.", "lm_head"),
            Self::LanguageModel => ("model.language_model.", "lm_head"),
            Self::LanguageModelV4 => ("language_model.model.", "language_model.lm_head"),
        }
    }
}

/// One RoPE base with its linear scaling factor (1: none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeBase {
    /// The base.
    pub theta: f64,
    /// Positions are divided by this (`rope_type` `linear`).
    pub factor: f64,
}

impl RopeBase {
    fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        (0..head_dim)
            .step_by(2)
            .map(|i| (1.0 / self.theta.powf(i as f64 / head_dim as f64) / self.factor) as f32)
            .collect()
    }
}

/// The Gemma 3 text family.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3 {
    /// The MLP gate's activation (`gelu_pytorch_tanh`).
    pub act: Activation,
    /// Scores are divided by `sqrt(query_pre_attn_scalar)`.
    pub query_pre_attn_scalar: f64,
    /// Attention score soft-capping (none in released Gemma 3 models).
    pub attn_logit_softcapping: Option<f64>,
    /// Final logit soft-capping (none in released Gemma 3 models).
    pub final_logit_softcapping: Option<f64>,
    /// The sliding window of the local layers.
    pub sliding_window: Option<usize>,
    /// Per layer: whether it is a local (sliding-window) layer.
    pub sliding_layers: Vec<bool>,
    /// The global layers' RoPE.
    pub global_rope: RopeBase,
    /// The local layers' RoPE.
    pub local_rope: RopeBase,
    /// Where the checkpoint keeps the text model.
    pub keys: TextKeys,
    /// Norm weights are applied as `norm_offset + w` (1 from HF checkpoints; 0 from GGUF
    /// files, whose converter adds the 1).
    pub norm_offset: f64,
}

/// transformers' `Gemma3TextConfig` defaults for what a config leaves out.
const DEFAULTS: &[(&str, f64)] = &[
    ("vocab_size", 262_208.0),
    ("hidden_size", 2304.0),
    ("intermediate_size", 9216.0),
    ("num_hidden_layers", 26.0),
    ("num_attention_heads", 8.0),
    ("num_key_value_heads", 4.0),
    ("head_dim", 256.0),
    ("rms_norm_eps", 1e-6),
    ("max_position_embeddings", 131_072.0),
];

fn from_hf(f: &HfFields<'_>) -> crate::Result<Config> {
    let (mut cfg, gemma) = parse(f)?;
    cfg.family = Arc::new(gemma);
    Ok(cfg)
}

/// The text config of a `gemma3_text` or `gemma3` config, with transformers' defaults filled in
/// (a `gemma3` config's `text_config`, with the top level's special tokens and tying).
fn text_object(f: &HfFields<'_>) -> crate::Result<serde_json::Map<String, serde_json::Value>> {
    let mut text = if f.model_type == "gemma3" {
        let t = f
            .get("text_config")
            .and_then(|t| t.as_object())
            .ok_or_else(|| {
                ModelError::config(f.path, "text_config", "missing (a gemma3 config nests it)")
            })?
            .clone();
        let mut t = t;
        for k in ["bos_token_id", "eos_token_id", "tie_word_embeddings"] {
            if let (None, Some(v)) = (t.get(k).filter(|v| !v.is_null()), f.get(k)) {
                t.insert(k.into(), v.clone());
            }
        }
        t
    } else {
        f.obj.clone()
    };
    for (k, v) in DEFAULTS {
        if text.get(*k).is_none_or(|v| v.is_null()) {
            let v = if v.fract() == 0.0 {
                serde_json::Value::from(*v as u64)
            } else {
                serde_json::Value::from(*v)
            };
            text.insert((*k).into(), v);
        }
    }
    Ok(text)
}

/// A RoPE object's base and linear factor (`field` names it in errors); `theta` when it names
/// no base.
fn rope_base(
    f: &HfFields<'_>,
    x: Option<&serde_json::Value>,
    field: &str,
    theta: f64,
) -> crate::Result<RopeBase> {
    let Some(x) = x.filter(|x| !x.is_null()) else {
        return Ok(RopeBase { theta, factor: 1.0 });
    };
    let num = |key: &str| -> crate::Result<Option<f64>> {
        match x.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|v| v.is_finite() && *v > 0.0)
                .map(Some)
                .ok_or_else(|| {
                    ModelError::config(
                        f.path,
                        &format!("{field}.{key}"),
                        format!("expected a positive number, got {v}"),
                    )
                }),
        }
    };
    let rope_type = x
        .get("rope_type")
        .or_else(|| x.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let factor = match rope_type {
        "default" => 1.0,
        "linear" => num("factor")?.unwrap_or(1.0),
        other => {
            return Err(ModelError::config(
                f.path,
                field,
                format!("rope type {other:?} is not supported for gemma3 (default, linear)"),
            ))
        }
    };
    Ok(RopeBase {
        theta: num("rope_theta")?.unwrap_or(theta),
        factor,
    })
}

/// The shared fields (with a placeholder family) and the family's own.
fn parse(f: &HfFields<'_>) -> crate::Result<(Config, Gemma3)> {
    let text = text_object(f)?;
    let t = HfFields {
        obj: &text,
        path: f.path,
        model_type: "gemma3_text",
    };
    let act_name = t.str_or("hidden_activation", "gelu_pytorch_tanh")?;
    let act = Activation::from_hf(act_name).ok_or_else(|| {
        ModelError::config(
            f.path,
            "hidden_activation",
            format!("{act_name:?} is not supported"),
        )
    })?;
    for (field, what) in [
        ("attention_bias", "biased attention projections"),
        (
            "use_bidirectional_attention",
            "bidirectional attention (embedding models)",
        ),
    ] {
        if t.bool_or(field, false)? {
            return Err(ModelError::config(
                f.path,
                field,
                format!("{what} are not supported for gemma3"),
            ));
        }
    }
    // The two RoPE bases: transformers 5 keys them by layer type; older configs have the
    // global base and scaling at the top level and the local base beside them.
    let params = t.get("rope_parameters").filter(|p| p.is_object());
    let keyed = params.filter(|p| p.get("full_attention").is_some());
    let (global_rope, local_rope) = match keyed {
        Some(p) => (
            rope_base(
                &t,
                p.get("full_attention"),
                "rope_parameters.full_attention",
                1_000_000.0,
            )?,
            rope_base(
                &t,
                p.get("sliding_attention"),
                "rope_parameters.sliding_attention",
                10_000.0,
            )?,
        ),
        None => {
            let theta = match params.and_then(|p| p.get("rope_theta")) {
                Some(_) => rope_base(&t, params, "rope_parameters", 1_000_000.0)?.theta,
                None => t.f64_or("rope_theta", 1_000_000.0)?,
            };
            let scaling = match t.get("rope_scaling") {
                Some(s) => Some((s, "rope_scaling")),
                None => params.map(|p| (p, "rope_parameters")),
            };
            let global = match scaling {
                Some((s, field)) => rope_base(&t, Some(s), field, theta)?,
                None => RopeBase { theta, factor: 1.0 },
            };
            let global = RopeBase { theta, ..global };
            let local = RopeBase {
                theta: t.f64_or("rope_local_base_freq", 10_000.0)?,
                factor: 1.0,
            };
            (global, local)
        }
    };
    let placeholder = Arc::new(Gemma3 {
        act,
        query_pre_attn_scalar: 1.0,
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
        sliding_window: None,
        sliding_layers: Vec::new(),
        global_rope,
        local_rope,
        keys: TextKeys::Text,
        norm_offset: 1.0,
    });
    let mut cfg = Config::from_hf_common(
        &t,
        placeholder,
        CommonDefaults {
            tie_word_embeddings: true,
            ..Default::default()
        },
    )?;
    cfg.model_type = f.model_type.to_string();
    cfg.extra = f.obj.clone();
    cfg.rope_theta = global_rope.theta as f32;
    let n = cfg.num_hidden_layers;
    let pattern = t.opt_usize("sliding_window_pattern")?.unwrap_or(6);
    let sliding_layers = t.sliding_layers(n, |i| (i + 1) % pattern != 0)?;
    let sliding_window = if text.contains_key("sliding_window") {
        t.opt_usize("sliding_window")?
    } else {
        Some(4096)
    };
    let gemma = Gemma3 {
        act,
        query_pre_attn_scalar: t.f64_or("query_pre_attn_scalar", 256.0)?,
        attn_logit_softcapping: t.opt_f64("attn_logit_softcapping")?,
        final_logit_softcapping: t.opt_f64("final_logit_softcapping")?,
        sliding_window,
        sliding_layers,
        global_rope,
        local_rope,
        keys: if f.model_type == "gemma3" {
            TextKeys::LanguageModel
        } else {
            TextKeys::Text
        },
        norm_offset: 1.0,
    };
    Ok((cfg, gemma))
}

impl Gemma3 {
    fn sliding(&self, layer: usize) -> bool {
        self.sliding_layers.get(layer).copied().unwrap_or(false)
    }
}

impl Family for Gemma3 {
    fn name(&self) -> &str {
        "gemma3"
    }

    fn tensors(&self, cfg: &Config) -> Vec<TensorShape> {
        let text = hf_tensors(cfg, |p, out| {
            attention_tensors(p, cfg, out);
            let qk = ["self_attn.q_norm", "self_attn.k_norm"];
            norm_tensors(p, &qk, cfg.head_dim, out);
            mlp_tensors(p, cfg, out);
            let norms = [
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ];
            norm_tensors(p, &norms, cfg.hidden_size, out);
        });
        let (prefix, head) = self.keys.prefixes();
        text.into_iter()
            .map(|(name, shape)| {
                let name = match name.strip_prefix("model.") {
                    Some(rest) => format!("{prefix}{rest}"),
                    None => name.replacen("lm_head", head, 1),
                };
                (name, shape)
            })
            .collect()
    }

    fn layout(&self, cfg: &Config) -> Layout {
        let (prefix, head) = self.keys.prefixes();
        Layout {
            embed: format!("{prefix}embed_tokens"),
            layer_prefix: format!("{prefix}layers."),
            norm: format!("{prefix}norm"),
            head: (!cfg.tie_word_embeddings).then(|| head.to_string()),
            experts: None,
        }
    }

    fn for_checkpoint(&self, _cfg: &Config, names: &[String]) -> Option<Arc<dyn Family>> {
        if self.keys == TextKeys::Text {
            return None;
        }
        let has = |keys: TextKeys| {
            let embed = format!("{}embed_tokens.weight", keys.prefixes().0);
            names.contains(&embed)
        };
        [TextKeys::LanguageModel, TextKeys::LanguageModelV4]
            .into_iter()
            .find(|k| *k != self.keys && has(*k) && !has(self.keys))
            .map(|keys| {
                Arc::new(Gemma3 {
                    keys,
                    ..self.clone()
                }) as Arc<dyn Family>
            })
    }

    fn rope(&self, cfg: &Config, max_len: usize, dtype: DType, device: &Device) -> Result<Rope> {
        let tables = |r: &RopeBase| {
            Rope::from_inv_freq(&r.inv_freq(cfg.head_dim), max_len, 1.0, dtype, device)
        };
        tables(&self.global_rope)?.with_local(tables(&self.local_rope)?)
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
        let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let _ = norm_dtype; // Gemma's norms compute in F32.
        let norm = |name: &str, n| Norm::load_f32(n, eps, self.norm_offset, w.vb().pp(name));
        let sliding = self.sliding(layer);
        let spec = AttentionSpec {
            score_div: self.query_pre_attn_scalar.sqrt(),
            softcap: self.attn_logit_softcapping,
            window: if sliding { self.sliding_window } else { None },
            local_rope: sliding,
            ..AttentionSpec::of(cfg)
        };
        let attn = SelfAttention::load(w.pp("self_attn"), h, spec, false)?
            .with_qk_norm(norm("self_attn.q_norm", hd)?, norm("self_attn.k_norm", hd)?);
        Ok(Box::new(PreNormBlock {
            input_norm: norm("input_layernorm", h)?,
            attn,
            post_attn_norm: Some(norm("post_attention_layernorm", h)?),
            pre_mlp_norm: norm("pre_feedforward_layernorm", h)?,
            mlp: GatedMlp::load(w.pp("mlp"), h, cfg.intermediate_size, self.act)?.into(),
            post_mlp_norm: Some(norm("post_feedforward_layernorm", h)?),
        }))
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

    fn text(extra: serde_json::Value) -> String {
        let mut c = serde_json::json!({
            "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 100, "query_pre_attn_scalar": 24, "sliding_window": 8,
        });
        for (k, v) in extra.as_object().into_iter().flatten() {
            c[k] = v.clone();
        }
        c.to_string()
    }

    fn gemma3(text: &str) -> crate::Result<(Config, Gemma3)> {
        let cfg = Config::from_json_str(text, Path::new("/m/config.json"))?;
        let g = format!("{:?}", cfg.family);
        let (_, g3) = {
            let v: serde_json::Value = serde_json::from_str(text).unwrap();
            let obj = v.as_object().unwrap().clone();
            let f = HfFields {
                obj: &obj,
                path: Path::new("/m/config.json"),
                model_type: obj["model_type"].as_str().unwrap(),
            };
            parse(&f)?
        };
        assert!(g.starts_with("Gemma3"), "{g}");
        Ok((cfg, g3))
    }

    #[test]
    fn older_form_pattern_bases_and_scaling() {
        let (cfg, g) = gemma3(&text(serde_json::json!({
            "rope_theta": 1000000.0, "rope_local_base_freq": 10.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 3,
        })))
        .unwrap();
        assert_eq!(
            g.sliding_layers,
            [true, true, false, true, true, false, true]
        );
        assert_eq!(
            g.global_rope,
            RopeBase {
                theta: 1e6,
                factor: 8.0
            }
        );
        assert_eq!(
            g.local_rope,
            RopeBase {
                theta: 10.0,
                factor: 1.0
            }
        );
        assert_eq!((g.query_pre_attn_scalar, g.sliding_window), (24.0, Some(8)));
        assert_eq!(
            (g.attn_logit_softcapping, g.final_logit_softcapping),
            (None, None)
        );
        assert!(cfg.tie_word_embeddings);
        assert_eq!(cfg.rope_theta, 1e6);
        // Defaults: pattern 6.
        let (_, g) = gemma3(&text(serde_json::json!({}))).unwrap();
        assert_eq!(
            g.sliding_layers,
            [true, true, true, true, true, false, true]
        );
        assert_eq!(g.local_rope.theta, 10_000.0);
    }

    #[test]
    fn transformers5_rope_parameters_by_layer_type() {
        let (cfg, g) = gemma3(&text(serde_json::json!({
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}},
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                "sliding_attention", "full_attention", "full_attention", "sliding_attention"],
        })))
        .unwrap();
        assert_eq!(
            g.sliding_layers,
            [true, false, true, true, false, false, true]
        );
        assert_eq!((g.global_rope.theta, g.global_rope.factor), (50000.0, 4.0));
        assert_eq!((g.local_rope.theta, g.local_rope.factor), (10.0, 1.0));
        assert_eq!(cfg.rope_theta, 50000.0);
        let e = gemma3(&text(serde_json::json!({"rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "yarn", "factor": 4.0}}})))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("rope_parameters.full_attention") && e.contains("yarn"),
            "{e}"
        );
    }

    #[test]
    fn multimodal_config_nests_text_config_and_fills_defaults() {
        let c = serde_json::json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "eos_token_id": [1, 106],
            "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                "intermediate_size": 10240, "num_attention_heads": 8, "num_hidden_layers": 34,
                "num_key_value_heads": 4, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152},
        })
        .to_string();
        let cfg = Config::from_json_str(&c, Path::new("config.json")).unwrap();
        assert_eq!(
            (
                cfg.vocab_size,
                cfg.head_dim,
                cfg.hidden_size,
                cfg.model_type.as_str()
            ),
            (262_208, 256, 2560, "gemma3")
        );
        assert_eq!(cfg.eos_token_ids, [1, 106]);
        let layout = cfg.layout();
        assert_eq!(layout.embed, "model.language_model.embed_tokens");
        assert_eq!(layout.layer(3), "model.language_model.layers.3");
        let names: Vec<String> = cfg.expected_tensors().into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"model.language_model.layers.33.self_attn.q_norm.weight".into()));
        // A transformers 4 checkpoint: the loader switches to its keys.
        let v4 = vec!["language_model.model.embed_tokens.weight".to_string()];
        let fam = cfg.family.for_checkpoint(&cfg, &v4).unwrap();
        let v4cfg = Config {
            family: fam,
            tie_word_embeddings: false,
            ..cfg.clone()
        };
        let l = v4cfg.layout();
        assert_eq!(
            (l.embed.as_str(), l.head.as_deref()),
            (
                "language_model.model.embed_tokens",
                Some("language_model.lm_head")
            )
        );
        let v5 = vec!["model.language_model.embed_tokens.weight".to_string()];
        assert!(cfg.family.for_checkpoint(&cfg, &v5).is_none());
        // Written back and read again: the same model.
        let again =
            Config::from_json_str(&cfg.to_hf_json().to_string(), Path::new("c.json")).unwrap();
        assert_eq!((again.hidden_size, again.vocab_size), (2560, 262_208));
        let e = Config::from_json_str(
            r#"{"model_type":"gemma3","vision_config":{}}"#,
            Path::new("/m/config.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("text_config") && e.contains("/m/config.json"),
            "{e}"
        );
    }

    #[test]
    fn tensor_names_have_qk_norms_and_four_norms() {
        let cfg = Config::from_json_str(&text(serde_json::json!({})), Path::new("c.json")).unwrap();
        let t = cfg.expected_tensors();
        let shape = |n: &str| t.iter().find(|(m, _)| m == n).map(|(_, s)| s.clone());
        assert_eq!(
            shape("model.layers.6.self_attn.q_norm.weight"),
            Some(vec![16])
        );
        assert_eq!(
            shape("model.layers.0.post_feedforward_layernorm.weight"),
            Some(vec![64])
        );
        assert_eq!(shape("lm_head.weight"), None);
        let e = Config::from_json_str(
            &text(serde_json::json!({"use_bidirectional_attention": true})),
            Path::new("c.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("use_bidirectional_attention"), "{e}");
    }
}
