//! The LLaMA family (Llama 2/3, Mistral, Qwen2, SmolLM): GQA/MQA, RoPE (with Llama 3
//! scaling), RMSNorm, SwiGLU, tied embeddings, and q/k/v biases (Qwen2).

use std::sync::Arc;

use candle_core::{DType, Result};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::Llama3RopeConfig;

use crate::config::{CommonDefaults, Config};
use crate::family::{DecoderBlock, Family, HfFields, Registration};
use crate::layers::{
    attention_tensors, hf_tensors, mlp_tensors, norm_tensors, Activation, AttentionSpec, GatedMlp,
    Norm, PreNormBlock, SelfAttention, TensorShape,
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
#[derive(Debug, Clone, Copy, Default)]
pub struct LlamaFamily;

/// The family, shared.
pub fn family() -> Arc<dyn Family> {
    Arc::new(LlamaFamily)
}

fn from_hf(f: &HfFields<'_>) -> crate::Result<Config> {
    let rope_scaling = match Config::hf_rope_scaling(f) {
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
    };
    let mut cfg = Config::from_hf_common(
        f,
        family(),
        CommonDefaults {
            attention_bias: f.model_type == "qwen2",
            ..Default::default()
        },
    )?;
    cfg.rope_scaling = rope_scaling;
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

    fn block(
        &self,
        cfg: &Config,
        vb: VarBuilder,
        _layer: usize,
        norm_dtype: DType,
    ) -> Result<Box<dyn DecoderBlock>> {
        let h = cfg.hidden_size;
        let norm = |name: &str| Norm::load(h, cfg.rms_norm_eps, 0.0, vb.pp(name), norm_dtype);
        Ok(Box::new(PreNormBlock {
            input_norm: norm("input_layernorm")?,
            attn: SelfAttention::load(
                vb.pp("self_attn"),
                h,
                AttentionSpec::of(cfg),
                cfg.attention_bias,
            )?,
            post_attn_norm: None,
            pre_mlp_norm: norm("post_attention_layernorm")?,
            mlp: GatedMlp::load(vb.pp("mlp"), h, cfg.intermediate_size, Activation::Silu)?,
            post_mlp_norm: None,
        }))
    }
}
