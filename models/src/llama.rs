//! The LLaMA-family model at its original path: `Llama` is the family-neutral
//! [`CausalLm`](crate::CausalLm) (every family runs through it), the architecture itself is
//! [`families::llama`](crate::families::llama), and the shared pieces are in
//! [`layers`](crate::layers).

pub use crate::causal::{
    argmax, CausalLm as Llama, DeviceMapChoice, HiddenTransfer, OffloadSettings, PlacementUnits,
    TransferTotals, TIED_HEAD,
};
pub use crate::families::llama::LlamaFamily;
pub use crate::layers::{causal_mask, Cache, Rope};

use crate::config::Config;

/// Every tensor a model of `cfg` must have, with its shape (its family's
/// [`tensors`](crate::family::Family::tensors)).
pub fn expected_tensors(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    cfg.expected_tensors()
}
