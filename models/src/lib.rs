//! Causal language models on the candle-offload runtime: the LLaMA family (Llama 2/3,
//! Mistral, Qwen2, SmolLM), Qwen3, Phi-3, Gemma 1/2/3, the mixtures of experts Mixtral and
//! Qwen3-MoE, and any application's own decoder.
//!
//! - [`loader`]: find a model (local directory, HF Hub, GGUF file) and load its weights into a
//!   host store and its tokenizer.
//! - [`quantize`]: quantize a safetensors checkpoint's projections on load, cached as a GGUF.
//! - [`CausalLm`] (also named [`Llama`]): the family-neutral decoder, taking each unit from an
//!   [`candle_offload::OffloadRuntime`] as it runs, on one device or as a pipeline over
//!   several; [`generation::generate`] runs it token by token.
//! - [`family`]: the extension point. A [`Family`] names its checkpoint's tensors and units and
//!   builds its blocks from acquired units, and the [`Config`] it reads is defined with it;
//!   [`families`] holds the ones this crate ships and the registry `config.json` is looked up
//!   in, [`hf_config`] the readers of a `config.json`'s fields they use, and [`layers`] the
//!   building blocks they share.
//! - [`batching`]: continuous batching, sequences joining and leaving a running batch.
//! - [`Trainer`]: fine-tuning any family whose blocks have a training path.
//! - [`ChatTemplate`]: the model's own chat template.
//! - [`Tokenizer`]: a `tokenizer.json`, or the tokenizer of a GGUF file rebuilt as llama.cpp
//!   reads it.
//!
//! # Bring your own model
//! A decoder written with candle-nn runs offloaded (under a budget, streamed, prefetched) and
//! sharded over devices by implementing [`Family`] for it and setting that family on a
//! [`Config`]:
//! 1. [`Family::tensors`] lists the checkpoint's tensors with their shapes, and
//!    [`Family::layout`] names the units (embeddings, `{layer_prefix}{i}`, final norm, head).
//! 2. [`Family::block`] builds one layer from its acquired unit ([`UnitWeights`]: the unit's
//!    `VarBuilder`, and its quantized tensors for [`UnitWeights::linear`]), returning
//!    a [`DecoderBlock`] whose `forward(xs, ctx, kv)` runs with the KV cache the model owns
//!    (`ctx` has the position, the RoPE tables and the masks).
//! 3. [`Config::new`] takes the shapes the runtime plans with (layers, widths, heads, vocab)
//!    and the family.
//!
//! [`CausalLm::builder`] then does the rest, on one device or over several: the reservation
//! for the KV cache and activations, the kept units, Belady over the sweep, the device map.
//! `examples/own_model/` is a complete example in under 60 lines of glue.

pub mod batching;
pub mod causal;
pub mod chat;
pub mod config;
mod error;
pub mod families;
pub mod family;
mod files;
pub mod generation;
mod gguf;
mod gguf_arch;
pub mod gguf_save;
pub mod hf_config;
pub mod layers;
pub mod llama;
pub mod loader;
pub mod lora;
pub mod quantize;
pub mod sampling;
pub mod tokenizer;
pub mod train;

pub use causal::stop_ranks;
pub use causal::{
    CausalLm, CausalLmBuilder, DeviceMapChoice, DeviceMapRequest, ExpertStats, GraphStats,
    HiddenTransfer, HostLayers, HostTotals, LayerSteps, ModelSource, OffloadSettings, RaggedSeq,
    RankRequest, RankStep, StepSeq, HOST_STEP_ROWS, MIN_PROMPT_CHUNK,
};
pub use chat::ChatTemplate;
pub use config::Config;
pub use error::{ModelError, Result};
pub use family::{
    DecoderBlock, ExpertLayout, Family, Hidden, Layout, RaggedSegment, StepCtx, TrainCtx,
    UnitWeights,
};
pub use layers::{Cache, KvCache};
pub use llama::Llama;
pub use loader::{ModelFiles, Weights};
pub use tokenizer::Tokenizer;
pub use train::{
    PhaseObserver, StepReport, TrainPhase, TrainSettings, Trainer, IGNORE_TARGET, OPTIMIZER_FILE,
};
