//! The family-neutral offloaded causal LM: every model family runs through [`CausalLm`].
//!
//! Every weight lives in the runtime's host store. Each forward pass acquires the units in
//! order (embeddings, each decoder layer, the final norm, the output head, as the family's
//! [`Layout`](crate::Layout) names them), builds each block through the
//! [`Family`](crate::Family) from the unit's `VarBuilder` right before it runs, and releases
//! the unit right after, so the runtime can stream what does not fit the budget. The KV cache
//! stays on the device; the budget reserves room for it. One device is the single-GPU path,
//! with host layers in front of it where asked; several run the layers as a pipeline (layer
//! sharding), each device with its own runtime, budget, copy stream and schedule over one
//! shared host store.
//!
//! - `model.rs`: the struct, its stages and accessors;
//! - `builder.rs`: [`CausalLm::builder`], the one way to build it;
//! - `reserve.rs`: what a stage reserves beside its weights, and whether they fit;
//! - `host.rs`: host layers in front of one device (the split itself is planned in
//!   [`candle_offload::plan::spread`]);
//! - `devices.rs`: a pipeline over several devices and its device map;
//! - `ranks.rs`: the layer split over the ranks of a multi-process run, planned by rank 0;
//! - `experts.rs`: mixture-of-experts layers' experts acquired one by one as units;
//! - `forward.rs`: the forward pass; `ragged.rs`: one pass over several sequences, each with
//!   its own cache (continuous batching); `graph.rs` and `graph_state.rs`: decode steps replayed
//!   from CUDA graphs.

mod builder;
mod devices;
mod experts;
mod forward;
mod graph;
mod graph_state;
mod host;
mod model;
mod ragged;
mod ragged_graph;
mod rank_batch;
mod ranks;
mod reserve;
mod routed;

pub use builder::{CausalLmBuilder, ModelSource};
pub use candle_offload::plan::spread::{HostLayers, LayerSteps};
pub use devices::{DeviceMapChoice, DeviceMapRequest, PlacementUnits, TIED_HEAD};
pub use experts::ExpertStats;
pub use forward::{argmax, HOST_STEP_ROWS};
pub use graph_state::GraphStats;
pub use model::{CausalLm, HiddenTransfer, HostTotals, TransferTotals};
pub use ragged::RaggedSeq;
pub use rank_batch::{stop_ranks, RankStep, StepSeq};
pub use ranks::RankRequest;
pub use reserve::{OffloadSettings, MIN_PROMPT_CHUNK};
