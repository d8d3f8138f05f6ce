//! Activations: `silu(gate) · up` for inference ([`silu_mul`]; over F32 slices with a
//! vectorized `exp`, [`silu_mul_f32`]) and the training SwiGLU with its own backward
//! ([`swiglu`]). On a CUDA device they run `kernels/activation.cu`; on the CPU
//! direct loops compute the same thing.

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
mod silu;
#[allow(unsafe_code)]
mod simd;
mod swiglu;

pub use silu::{silu_mul, silu_mul_unfused};
pub use simd::{exp_shifted_in_place, silu_mul_f32};
pub use swiglu::{swiglu, swiglu_backward, swiglu_composite};
