//! Linear layers, `x · wᵀ`: a decode step's few rows against dense weights
//! ([`linear_small`]) or GGML blocks ([`qlinear_small`]) on a GPU, in one bandwidth-bound pass
//! over the weight, also for two or three weights that read the same x in one launch (q, k and
//! v; a SwiGLU's gate and up with the SiLU · mul; a decode row's routed experts, [`qexperts_row`],
//! and a prompt's, [`qexperts_rows`], its outputs summed back into their rows by
//! [`combine_rows`]); and on the CPU the quantized
//! ([`cpu_quant`]) and 16-bit ([`cpu_dense`]) matmuls with their SIMD kernels, split over the
//! [`crate::pool`]'s workers. On a CUDA device the few-row ops run `kernels/linear.cu`,
//! `kernels/linear_q8.cu` and `kernels/linear_k.cu`; elsewhere the compositions they replace.

mod blocks;
mod combine;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod combine_cuda;
pub mod cpu_dense;
pub mod cpu_experts;
pub mod cpu_quant;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
mod experts;
mod experts_rows;
mod layer;
pub mod lora;
mod quantized;
pub mod routed;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod routed_cuda;
mod routed_shape;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod rows_cuda;
#[allow(unsafe_code)]
mod simd;
#[allow(unsafe_code)]
mod simd_dense;
#[allow(unsafe_code)]
mod simd_k;
mod small;

pub(crate) use blocks::qlinear_small_type;
pub use blocks::MAX_GROUP_EXPERTS;
pub use combine::{combine_rows, NO_SLOT};
pub use experts::{qexperts_row, qexperts_row_fits, QExpert};
pub use experts_rows::{qexperts_rows, qexperts_rows_fits, qexperts_rows_gemm_takes, QExpertRows};
pub use layer::{Linear, LinearKernel, LinearWeight};
pub use lora::{quantized_train, LoraAdapter};
pub use quantized::{
    qlinear_silu_mul, qlinear_silu_mul_q8, qlinear_small, qlinear_small_fits, qlinear_small_multi,
    qlinear_small_unfused,
};
pub use routed::{ExpertTable, RoutedShape};
pub(crate) use simd::has_avx2;
pub use small::{
    linear_silu_mul, linear_small, linear_small_multi, linear_small_unfused, router_logits,
};
