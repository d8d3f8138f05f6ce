//! Run models whose weights do not fit in GPU memory, on HuggingFace Candle.
//!
//! Weights live in page-locked host memory ([`HostStore`]) grouped into units (a decoder
//! layer, or any group of tensors sharing a name prefix). An [`OffloadRuntime`] brings units
//! to the device on demand under a memory [`Budget`] it never exceeds, evicting by a policy that
//! fits the access pattern ([`ResidencyCache`]: LRU, or Belady over a learned periodic schedule
//! such as inference's layer sweep) and prefetching on a separate copy stream so transfers hide
//! behind compute. The same API runs on a CPU build, where the store is ordinary memory and
//! "fetching" makes CPU tensors, so everything can be tested without a GPU.
//!
//! # Brief overview
//! - [`HostStore`]: every weight once in host memory, loaded from safetensors or tensors.
//! - [`OffloadRuntime`]: `acquire(unit)` → [`UnitGuard`], whose
//!   [`var_builder`](UnitGuard::var_builder) feeds existing candle-nn / candle-transformers
//!   `load(vb, &cfg)` code; dropping the guard releases the unit.
//! - [`OffloadStats`]: bytes moved, GB/s, stall time, hits and misses per unit;
//!   [`OffloadRuntime::memory_summary`] prints them.
//! - [`plan_capacity`], [`ResidencyCache`], [`MemoryLimit`], [`placement::plan_placement`]
//!   (device maps for several GPUs): the pure planning parts.
//! - [`train`]: autocast, dynamic loss scaling and gradient checkpointing for training on top
//!   of Candle's autograd, with offloaded weights fetched again for each recomputed segment.
//! - [`kernels`]: the custom ops the models run (fused norms, RoPE, decode and prompt
//!   attention, the decode matmuls of dense and quantized weights, the prompt GEMM, the
//!   training kernels), by op family.
//!
//! # Example
//! A four-layer model run layer by layer with room for only two layers at a time:
//! ```
//! use std::sync::Arc;
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_offload::{HostStore, MemoryLimit, OffloadConfig, OffloadRuntime, StoreConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::Cpu;
//! // Weights as a checkpoint holds them: `layers.N.weight`, `layers.N.bias`.
//! let varmap = candle_nn::VarMap::new();
//! let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! for i in 0..4 {
//!     candle_nn::linear(16, 16, vb.pp(format!("layers.{i}")))?;
//! }
//! let named: Vec<(String, Tensor)> = varmap.data().lock().unwrap().iter()
//!     .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
//!     .collect();
//! let store = Arc::new(HostStore::from_tensors(&named, &StoreConfig::default(), &dev)?);
//! let layer_bytes = store.units()[0].bytes();
//!
//! let cfg = OffloadConfig {
//!     gpu_memory_limit: Some(MemoryLimit::Bytes(2 * layer_bytes)),
//!     prefetch_depth: 1,
//!     ..Default::default()
//! };
//! let rt = OffloadRuntime::new(store, &dev, &cfg)?;
//! let mut xs = Tensor::ones((1, 16), DType::F32, &dev)?;
//! for _step in 0..3 {
//!     for i in 0..4 {
//!         let unit = rt.acquire_layer(i)?;
//!         // Unchanged candle-nn code, fed from the acquired unit.
//!         let layer = candle_nn::linear(16, 16, unit.var_builder(DType::F32).pp(format!("layers.{i}")))?;
//!         xs = layer.forward(&xs)?;
//!     }
//! }
//! let stats = rt.stats()?;
//! assert!(stats.peak_resident_bytes <= 2 * layer_bytes);
//! println!("{}", stats.summary());
//! # Ok(())
//! # }
//! ```
//!
//! # Feature flags
//! - `cuda`: Candle's CUDA backend, pinned host memory, the copy stream and its events.
//!   Without it a `Device::Cuda` runtime is refused with [`Error::NotCompiledWithCuda`].
//! - `fault-injection`: `OffloadRuntime::inject_fetch_failures`, fetches that fail on demand,
//!   for fault tests only (off by default).

#![deny(unsafe_code)]
#![warn(missing_docs)]

#[macro_use]
mod keywords;

pub mod budget;
pub mod cache;
pub mod diag;
pub mod dist;
pub mod doctor;
mod error;
pub mod experts;
pub mod history;
pub mod placement;
pub mod plan;
mod runtime;
mod settings;
pub mod store;
#[allow(unsafe_code)]
mod sys;
pub mod telemetry;
pub mod train;
pub mod tuning;
pub mod varbuilder;

pub use budget::{human_bytes, Budget, MemoryLimit};
pub use cache::{ActivePolicy, PolicyChoice, ResidencyCache, UnitId};
pub use error::{Error, Result};
pub use history::{MemoryEvent, MemoryHistory};
pub use placement::{
    plan_placement, DeviceBudget, DeviceMap, DevicePlacement, PlacementError, PlacementMode,
    PlacementRequest, Residency, UnitPlacement,
};
pub use plan::{
    host_layer_split, plan_capacity, spread_host_choice, spread_host_prices, spread_host_set,
    spread_host_split, spread_host_split_at, staying_units, CapacityPlan, OffloadStrategy,
    SplitPrice, SplitRates, WeightNeed, MAX_PREFETCH_DEPTH,
};
pub use runtime::{LeakReport, OffloadConfig, OffloadRuntime, RuntimeError, StepGraph, UnitGuard};
pub use settings::Settings;
pub use store::{
    EngineKind, FileSource, HostStore, RawTensorSpec, StoreConfig, TensorSpec, TierKind,
    UnitGrouping, WeightFormat,
};
pub use telemetry::{OffloadStats, TransferStats, UnitStats};
pub use train::{Autocast, Checkpointer, GradScaler, GradScalerConfig, Precision, ScaledOptimizer};

/// The custom ops (norms, RoPE, attention, small and quantized linears, the prompt GEMM, the
/// training kernels and the CPU matmuls): the `candle-offload-kernels` crate.
pub use candle_offload_kernels as kernels;
pub use tuning::{DiskTuning, KernelTuning, QlinearVariant, QlinearVariants, Tuning, TuningError};
pub use varbuilder::UnitBackend;
