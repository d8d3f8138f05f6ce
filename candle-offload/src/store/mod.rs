//! The host store: every weight, loaded once into (preferably page-locked) host memory,
//! grouped into units that move to the device together.
//!
//! Tensors are grouped by name: `model.layers.7.mlp.up_proj.weight` belongs to the unit
//! `model.layers.7` (see [`UnitGrouping`]); anything else belongs to its module
//! (`model.embed_tokens`, `lm_head`). Each unit is one contiguous host buffer with its tensors
//! at 256-byte aligned offsets, converted to the store's dtype on the way in.
//!
//! Each tensor carries its [`WeightFormat`]: a dense Candle dtype, or a GGML quantized type
//! kept as its raw blocks. The store and the copy engines move the bytes without looking at
//! them; the format decides the host size, the device size the budget counts, and what an
//! acquired unit hands out (a `Tensor` or a `QTensor`).
//!
//! Where a unit's bytes live is its storage tier (`TierKind`: pinned, pageable or disk), behind
//! one interface (`sys::HostTier`) that the store and the copy engines use without knowing
//! which tier it is.
//!
//! The store holds at most [`StoreConfig::host_memory_limit`] bytes in host memory (by default
//! 3/4 of the machine's RAM, [`default_host_limit`]). Units are placed in unit order (the
//! non-layer units, embeddings, norms and head, first, then the layers by index), each in
//! memory while it fits under the cap; a unit that does not fit stays in its checkpoint file
//! (the disk tier: safetensors, or any file its loader locates each tensor in with a
//! [`FileSource`], such as a GGUF), so with a small cap the last layers are the ones read from
//! disk, on every fetch: with O_DIRECT where the file system allows it, otherwise through the
//! page cache ([`StoreConfig::disk_page_cache`]).
//!
//! On a CUDA device the buffers are pinned (page-locked, portable, not write-combined, so the
//! CPU can still read them) up to a cap; past the cap, or where pinning fails, a unit stays in
//! pageable memory and its transfers go through the runtime's small pinned staging ring, with a
//! warning. Loading from safetensors streams tensor by tensor out of the memory-mapped file, so
//! the model is never held twice.
//!
//! The files, by concern: `config.rs` the settings, `format.rs` the weight formats,
//! `layout.rs` the units' layouts, `unit.rs` one unit and its bytes, `host.rs` the store and
//! its placement, `sources.rs` the loaders, `disk.rs` the disk tier's reads, `convert.rs` byte
//! conversions.

mod config;
mod convert;
mod disk;
mod format;
mod host;
mod layout;
mod sources;
mod unit;

pub use crate::sys::TierKind;
pub use config::{default_host_limit, resolve_host_limit, EngineKind, StoreConfig, UnitGrouping};
pub use convert::tensor_to_bytes;
pub use format::WeightFormat;
pub use host::HostStore;
pub use layout::TensorMeta;
pub use sources::{safetensors_in_dir, FileSource, RawTensorSpec, TensorSpec};
pub use unit::{HostBytes, HostUnit};
