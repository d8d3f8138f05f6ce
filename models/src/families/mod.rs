//! The model families this crate ships, and the registry `config.json` is looked up in.
//!
//! Adding a family: write `families/NAME.rs` (its [`Family`](crate::family::Family)
//! implementation and a [`Registration`]) and add one line to [`REGISTRY`].

use crate::family::Registration;

pub mod gemma;
pub mod llama;
pub mod phi3;

/// Every family `Config::from_json_str` knows, by HF `model_type`.
pub static REGISTRY: &[Registration] =
    &[llama::REGISTRATION, phi3::REGISTRATION, gemma::REGISTRATION];

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
