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
//! with transformers whenever the whole sequence stays on one side of that length.

use std::sync::Arc;

use candle_core::{DType, Device, Result};
use candle_nn::VarBuilder;

use crate::config::{CommonDefaults, Config};
use crate::family::{DecoderBlock, Family, HfFields, Registration};
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
    let act_name = f.str_or("hidden_act", "silu")?;
    let act = Activation::from_hf(act_name).ok_or_else(|| {
        ModelError::config(
            f.path,
            "hidden_act",
            format!("{act_name:?} is not supported"),
        )
    })?;
    let mut cfg = Config::from_hf_common(
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
    let partial = match rope.and_then(|(_, x, _)| x.get("partial_rotary_factor")) {
        Some(p) => p.as_f64(),
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
    if rotary_dim == 0 || rotary_dim % 2 != 0 {
        return Err(ModelError::config(
            f.path,
            "partial_rotary_factor",
            format!("gives {rotary_dim} rotated dimensions; RoPE needs an even, positive number"),
        ));
    }
    let long_rope = match rope {
        None | Some(("default", _, _)) => None,
        Some(("longrope" | "su" | "yarn", x, field)) => {
            let original = match x.get("original_max_position_embeddings") {
                Some(v) => v.as_u64().map(|v| v as usize),
                None => f.opt_usize("original_max_position_embeddings")?,
            }
            .filter(|v| *v > 0)
            .unwrap_or(cfg.max_position_embeddings);
            // As transformers: the top-level `original_max_position_embeddings` wins.
            let original = f
                .opt_usize("original_max_position_embeddings")?
                .unwrap_or(original);
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
    cfg.family = Arc::new(Phi3 {
        act,
        rotary_dim,
        long_rope,
        sliding_window: f.opt_usize("sliding_window")?,
    });
    Ok(cfg)
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
        let (factors, scale): (Vec<f64>, f64) = match &self.long_rope {
            None => (vec![1.0; dim / 2], 1.0),
            Some(r) => {
                let f = if max_len > r.original_max_position_embeddings {
                    &r.long_factor
                } else {
                    &r.short_factor
                };
                (f.clone(), r.attention_factor)
            }
        };
        let inv_freq: Vec<f32> = (0..dim / 2)
            .map(|k| (1.0 / (factors[k] * base.powf(exponent(k)))) as f32)
            .collect();
        Rope::from_inv_freq(&inv_freq, max_len, scale, dtype, device)
    }

    fn block(
        &self,
        cfg: &Config,
        vb: VarBuilder,
        _layer: usize,
        norm_dtype: DType,
    ) -> Result<Box<dyn DecoderBlock>> {
        let h = cfg.hidden_size;
        let norm = |name: &str| Norm::load(h, cfg.rms_norm_eps, 0.0, vb.pp(name), norm_dtype);
        let spec = AttentionSpec {
            window: self.sliding_window,
            ..AttentionSpec::of(cfg)
        };
        Ok(Box::new(PreNormBlock {
            input_norm: norm("input_layernorm")?,
            attn: SelfAttention::load_fused(vb.pp("self_attn"), "qkv_proj", h, spec)?,
            post_attn_norm: None,
            pre_mlp_norm: norm("post_attention_layernorm")?,
            mlp: GatedMlp::load_fused(
                vb.pp("mlp"),
                "gate_up_proj",
                h,
                cfg.intermediate_size,
                self.act,
            )?,
            post_mlp_norm: None,
        }))
    }
}
