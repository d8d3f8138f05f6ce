//! The custom ops of candle-offload, on HuggingFace Candle: each replaces a short chain of
//! Candle ops (and their kernel launches) by one pass over the data, as a CUDA kernel of the
//! crate's own (`kernels/*.cu`, compiled to PTX at build time with the `cuda` feature) and a
//! CPU loop that computes the same thing. Grouped by op family, as Candle's own kernels are:
//!
//! - [`norm`]: the pre-norm residual step, `x + residual` and its RMSNorm in one kernel
//!   ([`norm::rms_norm_residual`]), and the training RMSNorm with its backward
//!   ([`norm::rms_norm`]).
//! - [`rope`]: half-rotated RoPE of q and k in one launch, also straight into a KV cache
//!   ([`rope::rope_qk`], [`rope::rope_qk_cache`]).
//! - [`activation`]: `silu(gate) · up` ([`activation::silu_mul`]) and the training SwiGLU
//!   ([`activation::swiglu`]).
//! - [`attention`]: a decode step's attention over a KV cache ([`attention::decode_attention`]),
//!   a prompt's ([`attention::prompt_attention`]) and FlashAttention-2 for training
//!   ([`attention::flash_attention`]).
//! - [`linear`]: `x · wᵀ` for a decode step's few rows, dense ([`linear::linear_small`]) or of
//!   GGML blocks ([`linear::qlinear_small`], one of several kernels per block type, chosen by
//!   [`KernelTuning`]), and the CPU matmuls of quantized and 16-bit weights
//!   ([`linear::cpu_quant`], [`linear::cpu_dense`]).
//! - [`gemm`]: a prompt's quantized projections through 16-bit weights and cuBLAS
//!   ([`gemm::qlinear_prefill`]).
//! - [`loss`]: softmax cross-entropy with its backward.
//! - [`optimizer`]: AdamW in one launch for every tensor ([`optimizer::FusedAdamW`]), and
//!   multi-threaded over host memory ([`optimizer::HostAdamW`]).
//! - [`pool`]: the CPU worker threads the CPU kernels split their work over.
//!
//! The `*_unfused` and `*_composite` functions are the Candle compositions each op is checked
//! against. The float ops take F32, F16 or BF16 (one dtype for every input) and accumulate in
//! F32. The inference ops are for inference: no gradient flows through them; the training ops
//! ([`norm::rms_norm`], [`activation::swiglu`], [`loss::cross_entropy`],
//! [`attention::flash_attention`]) have their own backward.
//!
//! # Feature flags
//! - `cuda`: the CUDA kernels (needs nvcc and `CUDA_COMPUTE_CAP` at build time). Without it the
//!   ops run their CPU loops or compositions on every device.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod activation;
pub mod attention;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
pub mod gemm;
mod handover;
pub mod linear;
pub mod loss;
pub mod norm;
pub mod optimizer;
#[allow(unsafe_code)]
pub mod pool;
pub mod rope;
pub mod tuning;
mod util;

pub use handover::{forget_handover, quantized_rows_found};
pub use tuning::{KernelTuning, QlinearVariant, QlinearVariants};

/// Prepares `device` for a step captured in a CUDA graph: makes this thread's completion
/// counters outside the graph, so that the captured kernels count in them instead of
/// allocating inside the capture.
#[cfg(feature = "cuda")]
pub fn prepare_capture(device: &candle_core::CudaDevice) -> candle_core::Result<()> {
    cuda::prepare_capture(device)
}

/// Launches an empty marker kernel, `profile_mark(phase)`, on `device`'s stream: a boundary a
/// profiler's kernel list shows in launch order.
#[cfg(feature = "cuda")]
pub fn profile_mark(device: &candle_core::CudaDevice, phase: u32) -> candle_core::Result<()> {
    cuda::profile_mark(device, phase)
}
