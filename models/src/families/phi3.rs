//! Phi-3 (`Phi3ForCausalLM`: Phi-3, Phi-3.5, Phi-4-mini): one fused `qkv_proj`, one fused
//! `gate_up_proj` (SwiGLU), partial rotary, an optional sliding window, and the su/longrope
//! scaling of the 128k variants.
//!
//! LongRoPE divides each inverse frequency by a per-dimension factor (`short_factor`, or
//! `long_factor` past `original_max_position_embeddings`) and multiplies cos and sin by
//! `sqrt(1 + ln(factor) / ln(original_max))`. transformers switches to the long factors once
//! the sequence seen so far is longer than the original context; here the tables are made once
//! per model, so the long factors are used when the model is set up for more positions than
//! the original context (as llama.cpp and vLLM do), and the short ones otherwise. Both agree
//! with transformers whenever the whole sequence stays on one side of that length. As in
//! transformers, the original context is the top-level `original_max_position_embeddings`
//! (4096 when absent, whatever the rope object says), and `su` and `yarn` mean `longrope`.

use std::sync::Arc;

use candle_core::{DType, Device, Result};

use crate::family::{Config, DecoderBlock, Family, UnitWeights};
use crate::hf_config::{CommonDefaults, HfFields, Registration};
use crate::layers::{
    hf_tensors, norm_tensors, Activation, AttentionSpec, GatedMlp, Norm, PreNormBlock, Rope,
    SelfAttention, TensorShape,
};
use crate::ModelError;

/// `phi3` configs.
pub const REGISTRATION: Registration = Registration {
    model_types: &[("phi3", "Phi3ForCausalLM")],
    from_hf,
};

/// LongRoPE scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct LongRope {
    /// Per-dimension factors within the original context.
    pub short_factor: Vec<f64>,
    /// Per-dimension factors beyond it.
    pub long_factor: Vec<f64>,
    /// The context the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// The cos/sin multiplier.
    pub attention_factor: f64,
}

/// The Phi-3 family.
#[derive(Debug, Clone, PartialEq)]
pub struct Phi3 {
    /// SiLU for every released Phi-3.
    pub act: Activation,
    /// Rotated dimensions per head (`partial_rotary_factor · head_dim`).
    pub rotary_dim: usize,
    /// LongRoPE, if configured.
    pub long_rope: Option<LongRope>,
    /// Sliding window of every layer, if any.
    pub sliding_window: Option<usize>,
}

fn factors(
    f: &HfFields<'_>,
    x: &serde_json::Value,
    field: &str,
    key: &str,
    n: usize,
) -> crate::Result<Vec<f64>> {
    let name = format!("{field}.{key}");
    let list = x
        .get(key)
        .and_then(|v| v.as_array())
        .ok_or_else(|| ModelError::config(f.path, &name, "missing (a list of numbers)"))?;
    let out: Vec<f64> = list.iter().filter_map(|v| v.as_f64()).collect();
    if out.len() != list.len() || out.iter().any(|v| !v.is_finite() || *v <= 0.0) {
        return Err(ModelError::config(
            f.path,
            &name,
            "expected positive numbers",
        ));
    }
    if out.len() != n {
        return Err(ModelError::config(
            f.path,
            &name,
            format!("has {} factors, the rotary width needs {n}", out.len()),
        ));
    }
    Ok(out)
}

fn from_hf(f: &HfFields<'_>) -> crate::Result<Config> {
    let (mut cfg, phi3) = parse(f)?;
    cfg.family = Arc::new(phi3);
    Ok(cfg)
}

/// The shared fields (with a placeholder family) and the family's own.
fn parse(f: &HfFields<'_>) -> crate::Result<(Config, Phi3)> {
    let act_name = f.str_or("hidden_act", "silu")?;
    let act = Activation::from_hf(act_name).ok_or_else(|| {
        ModelError::config(
            f.path,
            "hidden_act",
            format!("{act_name:?} is not supported"),
        )
    })?;
    let cfg = Config::from_hf_common(
        f,
        Arc::new(Phi3 {
            act,
            rotary_dim: 0,
            long_rope: None,
            sliding_window: None,
        }),
        CommonDefaults {
            rms_norm_eps: 1e-5,
            ..Default::default()
        },
    )?;
    let rope = Config::hf_rope_scaling(f);
    // As transformers: the rope object's `partial_rotary_factor`, else the top-level one.
    let partial = match rope.and_then(|(_, x, field)| {
        x.get("partial_rotary_factor")
            .filter(|p| !p.is_null())
            .map(|p| (p, field))
    }) {
        Some((p, field)) => Some(p.as_f64().ok_or_else(|| {
            ModelError::config(
                f.path,
                &format!("{field}.partial_rotary_factor"),
                format!("expected a number, got {p}"),
            )
        })?),
        None => f.opt_f64("partial_rotary_factor")?,
    }
    .unwrap_or(1.0);
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(ModelError::config(
            f.path,
            "partial_rotary_factor",
            format!("{partial} is not in (0, 1]"),
        ));
    }
    let rotary_dim = (cfg.head_dim as f64 * partial) as usize;
    if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
        return Err(ModelError::config(
            f.path,
            "partial_rotary_factor",
            format!("gives {rotary_dim} rotated dimensions; RoPE needs an even, positive number"),
        ));
    }
    let long_rope = match rope {
        None | Some(("default", _, _)) => None,
        Some(("longrope" | "su" | "yarn", x, field)) => {
            // As transformers: the top-level field (default 4096) wins over the one in the
            // rope object.
            let original = f
                .opt_usize("original_max_position_embeddings")?
                .unwrap_or(4096);
            let factor = x
                .get("factor")
                .and_then(|v| v.as_f64())
                .unwrap_or(cfg.max_position_embeddings as f64 / original as f64);
            let attention_factor = match x.get("attention_factor").and_then(|v| v.as_f64()) {
                Some(a) => a,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
            };
            Some(LongRope {
                short_factor: factors(f, x, field, "short_factor", rotary_dim / 2)?,
                long_factor: factors(f, x, field, "long_factor", rotary_dim / 2)?,
                original_max_position_embeddings: original,
                attention_factor,
            })
        }
        Some((other, _, field)) => {
            return Err(ModelError::config(
                f.path,
                field,
                format!("rope type {other:?} is not supported for phi3 (default, longrope)"),
            ))
        }
    };
    let phi3 = Phi3 {
        act,
        rotary_dim,
        long_rope,
        sliding_window: f.opt_usize("sliding_window")?,
    };
    Ok((cfg, phi3))
}

impl Phi3 {
    /// The per-dimension factors and the cos/sin multiplier of RoPE tables for `max_len`
    /// positions: the long factors when that is beyond the original context (see the module
    /// docs), ones and 1 without LongRoPE.
    pub fn rope_factors(&self, max_len: usize) -> (Vec<f64>, f64) {
        match &self.long_rope {
            None => (vec![1.0; self.rotary_dim / 2], 1.0),
            Some(r) => {
                let f = if max_len > r.original_max_position_embeddings {
                    &r.long_factor
                } else {
                    &r.short_factor
                };
                (f.clone(), r.attention_factor)
            }
        }
    }
}

impl Family for Phi3 {
    fn name(&self) -> &str {
        "phi3"
    }

    fn tensors(&self, cfg: &Config) -> Vec<TensorShape> {
        let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        hf_tensors(cfg, |p, out| {
            out.push((
                format!("{p}.self_attn.qkv_proj.weight"),
                vec![q + 2 * kv, h],
            ));
            out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            out.push((format!("{p}.mlp.gate_up_proj.weight"), vec![2 * i, h]));
            out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
            norm_tensors(p, &["input_layernorm", "post_attention_layernorm"], h, out);
        })
    }

    fn rope(&self, cfg: &Config, max_len: usize, dtype: DType, device: &Device) -> Result<Rope> {
        let dim = self.rotary_dim;
        let base = f64::from(cfg.rope_theta);
        let exponent = |k: usize| (2 * k) as f64 / dim as f64;
        let (factors, scale) = self.rope_factors(max_len);
        let inv_freq: Vec<f32> = (0..dim / 2)
            .map(|k| (1.0 / (factors[k] * base.powf(exponent(k)))) as f32)
            .collect();
        Rope::from_inv_freq(&inv_freq, max_len, scale, dtype, device)
    }

    fn block(
        &self,
        cfg: &Config,
        w: UnitWeights<'_>,
        _layer: usize,
        norm_dtype: DType,
    ) -> Result<Box<dyn DecoderBlock>> {
        let h = cfg.hidden_size;
        let norm = |name: &str| Norm::load(h, cfg.rms_norm_eps, 0.0, w.vb().pp(name), norm_dtype);
        let spec = AttentionSpec {
            window: self.sliding_window,
            ..AttentionSpec::of(cfg)
        };
        Ok(Box::new(PreNormBlock {
            input_norm: norm("input_layernorm")?,
            attn: SelfAttention::load_fused(w.pp("self_attn"), "qkv_proj", h, spec)?,
            post_attn_norm: None,
            pre_mlp_norm: norm("post_attention_layernorm")?,
            mlp: GatedMlp::load_fused(
                w.pp("mlp"),
                "gate_up_proj",
                h,
                cfg.intermediate_size,
                self.act,
            )?
            .into(),
            post_mlp_norm: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// A Phi-3.5-mini-like config, small: head_dim 32, LongRoPE with 16 factors each.
    fn config(extra: serde_json::Value) -> String {
        let mut c = serde_json::json!({
            "model_type": "phi3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 100,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "short_factor": vec![1.5; 16], "long_factor": vec![8.0; 16]},
        });
        for (k, v) in extra.as_object().into_iter().flatten() {
            c[k] = v.clone();
        }
        c.to_string()
    }

    fn parse_str(text: &str) -> crate::Result<(Config, Phi3)> {
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        parse(&HfFields {
            obj: v.as_object().unwrap(),
            path: Path::new("/m/config.json"),
            model_type: "phi3",
        })
    }

    #[test]
    fn longrope_factors_and_attention_factor() {
        let (cfg, phi3) = parse_str(&config(serde_json::json!({}))).unwrap();
        assert_eq!((cfg.head_dim, phi3.rotary_dim), (32, 32));
        let r = phi3.long_rope.clone().unwrap();
        assert_eq!(r.original_max_position_embeddings, 4096);
        // factor = 131072 / 4096 = 32: sqrt(1 + ln 32 / ln 4096).
        let expected = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt();
        assert!((r.attention_factor - expected).abs() < 1e-12);
        assert_eq!(phi3.rope_factors(4096), (vec![1.5; 16], expected));
        assert_eq!(phi3.rope_factors(4097), (vec![8.0; 16], expected));
        // An explicit attention factor wins; `factor` overrides the ratio; no scaling: ones, 1.
        let given = serde_json::json!({"rope_scaling": {"rope_type": "longrope", "attention_factor": 1.25,
            "short_factor": vec![1.0; 16], "long_factor": vec![2.0; 16]}});
        let (_, phi3) = parse_str(&config(given)).unwrap();
        assert_eq!(phi3.long_rope.unwrap().attention_factor, 1.25);
        let factor = serde_json::json!({"rope_scaling": {"rope_type": "longrope", "factor": 1.0,
            "short_factor": vec![1.0; 16], "long_factor": vec![2.0; 16]}});
        let (_, phi3) = parse_str(&config(factor)).unwrap();
        assert_eq!(phi3.long_rope.unwrap().attention_factor, 1.0);
        let (_, plain) = parse_str(&config(serde_json::json!({"rope_scaling": null}))).unwrap();
        assert_eq!(plain.rope_factors(1 << 20), (vec![1.0; 16], 1.0));
    }

    #[test]
    fn original_context_is_the_top_level_field_as_in_transformers() {
        // The rope object's own value is ignored; without the top-level field: 4096.
        let inner = serde_json::json!({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": 64, "short_factor": vec![1.0; 16], "long_factor": vec![2.0; 16]}});
        let (_, phi3) = parse_str(&config(inner.clone())).unwrap();
        assert_eq!(
            phi3.long_rope.unwrap().original_max_position_embeddings,
            4096
        );
        let mut text: serde_json::Value = serde_json::from_str(&config(inner)).unwrap();
        text.as_object_mut()
            .unwrap()
            .remove("original_max_position_embeddings");
        let (_, phi3) = parse_str(&text.to_string()).unwrap();
        assert_eq!(
            phi3.long_rope.unwrap().original_max_position_embeddings,
            4096
        );
    }

    #[test]
    fn partial_rotary_from_rope_parameters_or_top_level() {
        // Phi-4-mini: 3/4 of a 32-wide head rotate, so 12 factors.
        let v5 = serde_json::json!({"rope_scaling": null, "rope_parameters": {"rope_type": "longrope",
            "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": vec![1.0; 12], "long_factor": vec![2.0; 12]}, "sliding_window": 262144});
        let (cfg, phi3) = parse_str(&config(v5)).unwrap();
        assert_eq!((cfg.head_dim, phi3.rotary_dim), (32, 24));
        assert_eq!(phi3.sliding_window, Some(262144));
        assert_eq!(cfg.rope_theta, 10000.0);
        let top = serde_json::json!({"rope_scaling": null, "partial_rotary_factor": 0.5});
        let (_, phi3) = parse_str(&config(top)).unwrap();
        assert_eq!((phi3.rotary_dim, phi3.long_rope), (16, None));
    }

    #[test]
    fn bad_factors_and_rope_types_name_the_field() {
        let longrope = |short: serde_json::Value, long: serde_json::Value| serde_json::json!({"rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long}});
        // (change, what the error must name)
        let cases = [
            (
                longrope(vec![1.0; 15].into(), vec![2.0; 16].into()),
                vec!["rope_scaling.short_factor", "15", "16"],
            ),
            // Factors for the whole head when only half of it rotates.
            (
                serde_json::json!({"partial_rotary_factor": 0.5}),
                vec!["rope_scaling.short_factor", "8"],
            ),
            (
                longrope(vec![1.0; 16].into(), serde_json::Value::Null),
                vec!["rope_scaling.long_factor", "missing"],
            ),
            (
                longrope(vec!["a"; 16].into(), vec![2.0; 16].into()),
                vec!["rope_scaling.short_factor", "positive"],
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
                vec!["rope_scaling", "dynamic"],
            ),
            (
                serde_json::json!({"rope_scaling": null, "partial_rotary_factor": 0.3}),
                vec!["partial_rotary_factor"],
            ),
            (
                serde_json::json!({"hidden_act": "relu2"}),
                vec!["hidden_act", "relu2"],
            ),
        ];
        for (change, named) in cases {
            let e = Config::from_json_str(&config(change.clone()), Path::new("/m/config.json"))
                .unwrap_err()
                .to_string();
            for n in named.iter().chain(&["/m/config.json"]) {
                assert!(e.contains(n), "{change}: {n:?} not in: {e}");
            }
        }
    }

    #[test]
    fn fused_tensor_names_and_shapes() {
        let cfg =
            Config::from_json_str(&config(serde_json::json!({})), Path::new("c.json")).unwrap();
        let t = cfg.expected_tensors();
        let find = |n: &str| t.iter().find(|(name, _)| name == n).map(|(_, s)| s.clone());
        // 8 query heads and 2 + 2 key/value heads of 32.
        assert_eq!(
            find("model.layers.1.self_attn.qkv_proj.weight"),
            Some(vec![384, 256])
        );
        assert_eq!(
            find("model.layers.0.mlp.gate_up_proj.weight"),
            Some(vec![1024, 256])
        );
        assert!(find("lm_head.weight").is_some());
        assert!(find("model.layers.0.self_attn.q_proj.weight").is_none());
        assert_eq!(cfg.family.name(), "phi3");
    }
}
