//! Qwen3 (`Qwen3ForCausalLM`): the LLaMA block (GQA, RoPE, RMSNorm, SwiGLU) with an RMSNorm
//! over each head of q and of k before RoPE (`q_norm`, `k_norm`, width `head_dim`), an
//! explicit `head_dim`, no q/k/v biases, a tied or untied head, and Qwen2's optional sliding
//! windows (`use_sliding_window`, `max_window_layers`, `layer_types`).

use std::sync::Arc;

use candle_core::{DType, Result};

use crate::family::{Config, DecoderBlock, Family, UnitWeights};
use crate::hf_config::{CommonDefaults, HfFields, Registration};
use crate::layers::{
    attention_tensors, hf_tensors, mlp_tensors, norm_tensors, Activation, AttentionSpec, GatedMlp,
    Norm, PreNormBlock, SelfAttention, TensorShape,
};

/// `qwen3` configs.
pub const REGISTRATION: Registration = Registration {
    model_types: &[("qwen3", "Qwen3ForCausalLM")],
    from_hf,
};

/// The Qwen3 family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Qwen3 {
    /// Per layer, the sliding window of its attention, if any (empty: none).
    pub windows: Vec<Option<usize>>,
}

/// The family without sliding windows (GGUF files), shared.
pub fn family() -> Arc<dyn Family> {
    Arc::new(Qwen3::default())
}

fn from_hf(f: &HfFields<'_>) -> crate::Result<Config> {
    let rope_scaling = super::llama::llama3_rope_scaling(f)?;
    let mut cfg = Config::from_hf_common(f, family(), CommonDefaults::default())?;
    cfg.rope_scaling = rope_scaling;
    let windows = super::llama::windows(f, cfg.num_hidden_layers)?;
    if windows.iter().any(Option::is_some) {
        cfg.family = Arc::new(Qwen3 { windows });
    }
    Ok(cfg)
}

impl Family for Qwen3 {
    fn name(&self) -> &str {
        "qwen3"
    }

    fn tensors(&self, cfg: &Config) -> Vec<TensorShape> {
        hf_tensors(cfg, |p, out| {
            attention_tensors(p, cfg, out);
            let qk = ["self_attn.q_norm", "self_attn.k_norm"];
            norm_tensors(p, &qk, cfg.head_dim, out);
            mlp_tensors(p, cfg, out);
            let norms = ["input_layernorm", "post_attention_layernorm"];
            norm_tensors(p, &norms, cfg.hidden_size, out);
        })
    }

    fn plain_attention(&self, _cfg: &Config) -> bool {
        self.windows.iter().all(Option::is_none)
    }

    fn block(
        &self,
        cfg: &Config,
        w: UnitWeights<'_>,
        layer: usize,
        norm_dtype: DType,
    ) -> Result<Box<dyn DecoderBlock>> {
        let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let norm = |name: &str, n| Norm::load(n, eps, 0.0, w.vb().pp(name), norm_dtype);
        let spec = AttentionSpec {
            window: self.windows.get(layer).copied().flatten(),
            ..AttentionSpec::of(cfg)
        };
        let attn = SelfAttention::load(w.pp("self_attn"), h, spec, cfg.attention_bias)?
            .with_qk_norm(norm("self_attn.q_norm", hd)?, norm("self_attn.k_norm", hd)?);
        Ok(Box::new(PreNormBlock {
            input_norm: norm("input_layernorm", h)?,
            attn,
            post_attn_norm: None,
            pre_mlp_norm: norm("post_attention_layernorm", h)?,
            mlp: GatedMlp::load(w.pp("mlp"), h, cfg.intermediate_size, Activation::Silu)?.into(),
            post_mlp_norm: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::Config;

    const QWEN3: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":64,
        "intermediate_size":96,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
        "num_hidden_layers":3,"vocab_size":101,"rope_theta":1000000.0,"tie_word_embeddings":true}"#;

    #[test]
    fn reads_head_dim_norms_and_no_bias() {
        let c = Config::from_json_str(QWEN3, Path::new("config.json")).unwrap();
        assert_eq!((c.head_dim, c.attention_bias), (32, false));
        assert_eq!(c.family.name(), "qwen3");
        assert!(c.family.plain_attention(&c));
        let t = c.expected_tensors();
        let shape = |n: &str| t.iter().find(|(m, _)| m == n).map(|(_, s)| s.clone());
        assert_eq!(
            shape("model.layers.2.self_attn.q_norm.weight"),
            Some(vec![32])
        );
        assert_eq!(
            shape("model.layers.0.self_attn.k_norm.weight"),
            Some(vec![32])
        );
        assert_eq!(
            shape("model.layers.0.self_attn.q_proj.weight"),
            Some(vec![128, 64])
        );
        assert_eq!(shape("lm_head.weight"), None);
        let json = c.to_hf_json();
        assert_eq!(json["architectures"][0], "Qwen3ForCausalLM");
    }

    #[test]
    fn sliding_windows_as_qwen2() {
        let w = QWEN3.replace(
            "\"tie_word_embeddings\":true",
            "\"use_sliding_window\":true,\"sliding_window\":8,\"max_window_layers\":1",
        );
        let c = Config::from_json_str(&w, Path::new("config.json")).unwrap();
        assert_eq!(
            format!("{:?}", c.family),
            "Qwen3 { windows: [None, Some(8), Some(8)] }"
        );
        assert!(!c.family.plain_attention(&c));
        let yarn = QWEN3.replace(
            "\"tie_word_embeddings\":true",
            "\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4.0}",
        );
        let e = Config::from_json_str(&yarn, Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_scaling") && e.contains("yarn"), "{e}");
    }
}
