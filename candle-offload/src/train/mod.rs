//! Training on small GPUs: mixed precision, dynamic loss scaling and gradient checkpointing.
//!
//! Candle has autograd and optimizers but no autocast, no loss scaler and no checkpointing;
//! these three pieces add them without touching Candle:
//! - [`Autocast`]: matmuls (and attention's projections) in F16 or BF16 while master weights,
//!   norms, softmax, the loss and reductions stay in F32; the casts are ordinary differentiable
//!   ops, so gradients reach the F32 masters.
//! - [`GradScaler`] / [`ScaledOptimizer`]: PyTorch's dynamic loss scaling around any
//!   `candle_nn::Optimizer`.
//! - [`Checkpointer`]: `checkpoint(segment, input)` and `checkpoint_sequential(blocks, n, input)`
//!   keep only segment boundaries in the forward pass and recompute each segment during the
//!   backward pass; with an offload runtime the recompute fetches the segment's weights again.
//!
//! - [`accumulate_on_host`] / [`HostGradients`]: gradients summed in F32 in host memory, where
//!   offloaded training's optimizer steps the masters.
//!
//! The training ops with kernels of their own (RMSNorm, SwiGLU, softmax cross-entropy,
//! FlashAttention-2, a fused AdamW) are in [`crate::kernels`] (`norm::rms_norm`,
//! `activation::swiglu`, `loss::cross_entropy`, `attention::flash_attention`,
//! `optimizer::FusedAdamW` and `optimizer::HostAdamW`).
//!
//! Models must use differentiable ops on the training path: `candle_nn::ops::softmax` (not
//! `softmax_last_dim`), `rms_norm_slow` / `RmsNorm::forward_diff` (not the fused `rms_norm`),
//! `rope_slow` (not `rope`); the fused kernels silently cut the gradient graph
//! (candle-internals.md §4.4).

mod autocast;
mod checkpoint;
pub mod grad;
mod host_grad;
mod scaler;

/// Turns cudarc's per-buffer event tracking of `device`'s context on or off and returns
/// whether it was on (a no-op returning `on` on a CPU or without `cuda`). Tracking records and
/// waits on an event per buffer per launch once the context has a second stream, which Candle's
/// own device stream already makes it; a training step on one stream needs none of it. Turn it
/// off only while nothing in the process uses this GPU's context on another stream (no
/// offload runtime, no second Candle device on this GPU: hazard H15 in ARCHITECTURE.md), and
/// back on after. `Trainer` does this for resident training unless
/// `TrainSettings::event_tracking` keeps it.
pub fn set_event_tracking(device: &candle_core::Device, on: bool) -> candle_core::Result<bool> {
    if device.is_cpu() {
        return Ok(on);
    }
    crate::sys::set_event_tracking(device, on)
}
pub use autocast::{Autocast, AutocastBackend, CastOrigins, Precision};
pub use checkpoint::{segment_ranges, Checkpointer, GradSink};
pub use host_grad::{accumulate_on_host, HostGradients};
pub use scaler::{GradScaler, GradScalerConfig, ScaledOptimizer, StepOutcome};
