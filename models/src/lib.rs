//! LLaMA-family models (Llama 2/3, Mistral, Qwen2, SmolLM) on the candle-offload runtime.
//!
//! - [`loader`]: find a model (local directory, HF Hub, GGUF file) and load its weights into a
//!   host store and its tokenizer.
//! - [`Llama`]: the decoder, taking each unit from an [`candle_offload::OffloadRuntime`] as it
//!   runs; [`generation::generate`] runs it token by token.
//! - [`ChatTemplate`]: the model's own chat template.

pub mod chat;
pub mod config;
mod error;
pub mod generation;
pub mod llama;
pub mod loader;
pub mod train;

pub use chat::ChatTemplate;
pub use config::Config;
pub use error::{ModelError, Result};
pub use llama::{Cache, Llama, OffloadSettings};
pub use loader::{ModelFiles, Weights};
pub use train::{StepReport, TrainSettings, Trainer};
