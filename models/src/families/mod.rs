//! The model families this crate ships, and the registry `config.json` is looked up in:
//! [`Config::from_json_str`] picks the family by `model_type` and lets it read the rest, and
//! [`Config::to_hf_json`] writes a configuration back.
//!
//! Adding a family: write `families/NAME.rs` (its [`Family`](crate::family::Family)
//! implementation and a [`Registration`]) and add one line to [`REGISTRY`].

use std::path::Path;

use candle_transformers::models::llama::Llama3RopeType;

use crate::error::{ModelError, Result};
use crate::family::Config;
use crate::hf_config::{HfFields, Registration};

pub mod gemma;
pub mod gemma3;
pub mod llama;
pub mod moe;
pub mod phi3;
pub mod qwen3;

/// Every family `Config::from_json_str` knows, by HF `model_type`.
pub static REGISTRY: &[Registration] = &[
    llama::REGISTRATION,
    qwen3::REGISTRATION,
    moe::REGISTRATION,
    phi3::REGISTRATION,
    gemma::REGISTRATION,
    gemma3::REGISTRATION,
];

/// The registration of a `model_type`.
pub fn lookup(model_type: &str) -> Option<&'static Registration> {
    REGISTRY
        .iter()
        .find(|r| r.model_types.iter().any(|(m, _)| *m == model_type))
}

/// The `model_type` of an `architectures` entry (`LlamaForCausalLM` -> `llama`).
pub fn model_type_of_architecture(arch: &str) -> Option<&'static str> {
    REGISTRY
        .iter()
        .flat_map(|r| r.model_types.iter())
        .find(|(_, a)| *a == arch)
        .map(|(m, _)| *m)
}

/// The `architectures` entry transformers writes for a `model_type`.
pub fn architecture_of(model_type: &str) -> Option<&'static str> {
    REGISTRY
        .iter()
        .flat_map(|r| r.model_types.iter())
        .find(|(m, _)| *m == model_type)
        .map(|(_, a)| *a)
}

/// The supported `model_type`s, for messages.
pub fn supported() -> String {
    let names: Vec<&str> = REGISTRY
        .iter()
        .flat_map(|r| r.model_types.iter().map(|(m, _)| *m))
        .collect();
    format!(
        "{} (and models of their shape, such as SmolLM)",
        names.join(", ")
    )
}

impl Config {
    /// Reads and validates `config.json`.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?;
        Self::from_json_str(&text, path)
    }

    /// Parses and validates the text of a `config.json`; `path` names it in errors. The family
    /// is looked up in [`REGISTRY`] by `model_type` (or by `architectures` when there is no
    /// `model_type`), and reads the rest.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ModelError::file(path, format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| ModelError::file(path, "is not a JSON object"))?;
        let model_type = match obj.get("model_type").and_then(|m| m.as_str()) {
            Some(m) => m.to_string(),
            None => {
                let arch = obj
                    .get("architectures")
                    .and_then(|a| a.get(0))
                    .and_then(|a| a.as_str())
                    .ok_or_else(|| {
                        ModelError::config(path, "model_type", "missing (and no `architectures`)")
                    })?;
                model_type_of_architecture(arch).unwrap_or(arch).to_string()
            }
        };
        let registration = lookup(&model_type).ok_or_else(|| ModelError::UnknownArchitecture {
            path: path.into(),
            name: model_type.clone(),
            supported: supported(),
        })?;
        let cfg = (registration.from_hf)(&HfFields {
            obj,
            path,
            model_type: &model_type,
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// The HF `config.json` of this configuration: the object it was read from (if any),
    /// with every shared field [`Config::from_json_str`] reads written over it
    /// (`rope_scaling` when present), and `model_type`, `architectures` and
    /// `tie_word_embeddings`, so that a directory written with it loads here and in
    /// transformers.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let architecture = architecture_of(&self.model_type).unwrap_or("LlamaForCausalLM");
        let mut v = serde_json::Value::Object(self.extra.clone());
        let shared = serde_json::json!({
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
        });
        if let (Some(out), Some(shared)) = (v.as_object_mut(), shared.as_object()) {
            for (k, x) in shared {
                out.insert(k.clone(), x.clone());
            }
            if !out.contains_key("hidden_act") && !out.contains_key("hidden_activation") {
                out.insert("hidden_act".into(), "silu".into());
            }
            if let Some(p) = out
                .get_mut("rope_parameters")
                .and_then(|p| p.as_object_mut())
            {
                // Kept consistent with the shared field written above.
                if p.contains_key("rope_theta") {
                    p.insert("rope_theta".into(), f64::from(self.rope_theta).into());
                }
            }
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":576,
        "intermediate_size":1536,"num_attention_heads":9,"num_hidden_layers":30,"num_key_value_heads":3,
        "rms_norm_eps":1e-05,"rope_theta":100000,"tie_word_embeddings":true,"vocab_size":49152,
        "max_position_embeddings":8192,"bos_token_id":1,"eos_token_id":2}"#;

    /// Llama 2 7B has 6,738,415,616 parameters: less the embedding table (32000 x 4096) and the
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
