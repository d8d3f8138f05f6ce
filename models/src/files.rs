//! A model's files as the loader finds them ([`ModelFiles`]: the configuration, the weights,
//! the tokenizer, the chat template) and the project's cache directory: what the loader and
//! quantize-on-load both read.

use std::path::{Path, PathBuf};

use crate::family::Config;

/// Where the weights are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Weights {
    /// One or more safetensors files (the shards of one model).
    Safetensors(Vec<PathBuf>),
    /// A GGUF file.
    Gguf(PathBuf),
}

/// The text of the special tokens a chat template refers to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence.
    pub bos: Option<String>,
    /// End of sequence.
    pub eos: Option<String>,
}

/// Everything needed to build a model and its tokenizer.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// The validated configuration.
    pub config: Config,
    /// The weights.
    pub weights: Weights,
    /// `tokenizer.json`, if the model has one (GGUF files carry their tokenizer inside).
    pub tokenizer_json: Option<PathBuf>,
    /// The chat template (Jinja), if the model has one.
    pub chat_template: Option<String>,
    /// Special tokens the chat template refers to.
    pub special_tokens: SpecialTokens,
    /// Where the model came from (a directory, a file, or `hub:<id>@<revision>`), for messages.
    pub origin: String,
}

impl ModelFiles {
    /// The path to name in errors about the weights.
    pub fn weights_path(&self) -> PathBuf {
        match &self.weights {
            Weights::Safetensors(files) if files.len() == 1 => files[0].clone(),
            Weights::Safetensors(files) => files
                .first()
                .and_then(|f| f.parent())
                .map(Path::to_path_buf)
                .unwrap_or_default(),
            Weights::Gguf(p) => p.clone(),
        }
    }
}

/// The project's cache directory: `$CANDLE_OFFLOAD_CACHE`, else `$XDG_CACHE_HOME/candle-offload`,
/// else `~/.cache/candle-offload`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CANDLE_OFFLOAD_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("candle-offload")
}
