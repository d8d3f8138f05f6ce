//! Gemma (`GemmaForCausalLM`) and Gemma 2 (`Gemma2ForCausalLM`): GeGLU, RMSNorm applied as
//! `1 + w` in F32, embeddings scaled by `sqrt(hidden)`, head_dim 256 and tied embeddings; Gemma 2
//! adds norms after attention and after the MLP, scores scaled by `query_pre_attn_scalar`,
//! soft-capped attention and final logits, and sliding-window layers alternating with global
//! ones (`layer_types`, or every even layer).

use std::sync::Arc;

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::config::{CommonDefaults, Config};
use crate::family::{DecoderBlock, Family, HfFields, Registration};
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
}

fn from_hf(f: &HfFields<'_>) -> crate::Result<Config> {
    let version = if f.model_type == "gemma2" { 2 } else { 1 };
    // Gemma 2 names it `hidden_activation`; Gemma 1 `hidden_act` (and later `hidden_activation`).
    let (field, act_name) = match f.get("hidden_activation") {
        Some(_) => ("hidden_activation", f.str_or("hidden_activation", "")?),
        None => ("hidden_act", f.str_or("hidden_act", "gelu_pytorch_tanh")?),
    };
    let act = Activation::from_hf(act_name).ok_or_else(|| {
        ModelError::config(f.path, field, format!("{act_name:?} is not supported"))
    })?;
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
    });
    let mut cfg = Config::from_hf_common(
        f,
        placeholder,
        CommonDefaults {
            tie_word_embeddings: true,
            ..Default::default()
        },
    )?;
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
        }
    } else {
        let sliding_window = f.opt_usize("sliding_window")?;
        let sliding_layers = match f.get("layer_types") {
            None => (0..n).map(|i| (i + 1) % 2 == 1).collect(),
            Some(x) => {
                let kinds: Vec<&str> = x
                    .as_array()
                    .map(|a| a.iter().filter_map(|k| k.as_str()).collect())
                    .unwrap_or_default();
                if kinds.len() != n {
                    return Err(ModelError::config(
                        f.path,
                        "layer_types",
                        format!("expected {n} layer types (one per layer), got {x}"),
                    ));
                }
                kinds
                    .iter()
                    .map(|k| match *k {
                        "sliding_attention" => Ok(true),
                        "full_attention" => Ok(false),
                        other => Err(ModelError::config(
                            f.path,
                            "layer_types",
                            format!("unknown layer type {other:?}"),
                        )),
                    })
                    .collect::<crate::Result<_>>()?
            }
        };
        Gemma {
            version,
            act,
            query_pre_attn_scalar: f.f64_or("query_pre_attn_scalar", 256.0)?,
            attn_logit_softcapping: f.opt_f64("attn_logit_softcapping")?,
            final_logit_softcapping: f.opt_f64("final_logit_softcapping")?,
            sliding_window,
            sliding_layers,
        }
    };
    cfg.family = Arc::new(gemma);
    Ok(cfg)
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

    fn embed(&self, cfg: &Config, vb: VarBuilder, ids: &Tensor) -> Result<Tensor> {
        let w = vb.get(
            (cfg.vocab_size, cfg.hidden_size),
            "model.embed_tokens.weight",
        )?;
        let xs = candle_nn::Embedding::new(w, cfg.hidden_size).forward(ids)?;
        xs * (cfg.hidden_size as f64).sqrt()
    }

    fn block(
        &self,
        cfg: &Config,
        vb: VarBuilder,
        layer: usize,
        norm_dtype: DType,
    ) -> Result<Box<dyn DecoderBlock>> {
        let h = cfg.hidden_size;
        let norm = |name: &str| Norm::load(h, cfg.rms_norm_eps, 1.0, vb.pp(name), norm_dtype);
        let sliding = self.sliding_layers.get(layer).copied().unwrap_or(false);
        let spec = AttentionSpec {
            score_div: self.query_pre_attn_scalar.sqrt(),
            softcap: self.attn_logit_softcapping,
            window: if sliding { self.sliding_window } else { None },
            ..AttentionSpec::of(cfg)
        };
        let attn = SelfAttention::load(vb.pp("self_attn"), h, spec, cfg.attention_bias)?;
        let mlp = GatedMlp::load(vb.pp("mlp"), h, cfg.intermediate_size, self.act)?;
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

    fn final_norm(&self, cfg: &Config, vb: VarBuilder, dtype: DType) -> Result<Norm> {
        Norm::load(cfg.hidden_size, cfg.rms_norm_eps, 1.0, vb, dtype)
    }

    fn finish_logits(&self, _cfg: &Config, logits: Tensor) -> Result<Tensor> {
        match self.final_logit_softcapping {
            Some(cap) => soft_cap(&logits, cap),
            None => Ok(logits),
        }
    }
}
