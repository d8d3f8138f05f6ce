//! The prompt GEMM: a prompt's rows against GGML-block weights through 16-bit weights and
//! cuBLAS ([`qlinear_prefill`]), with the dequantizing kernels of `kernels/gemm.cu`
//! ([`dequantize_rows`]); a prompt's many-row experts, each a SiLU-gated MLP, into their rows
//! of an output (`experts_mlp`, for [`crate::linear::qexperts_rows`]); and `y + a·bᵀ`
//! accumulated into y ([`add_matmul_t`]).

mod accumulate;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
mod prefill;

pub use accumulate::{add_matmul, add_matmul_t};

#[cfg(feature = "cuda")]
pub(crate) use cuda::ExpertGemm;
pub(crate) use prefill::prefill_applies;
pub use prefill::{
    dequantize_rows, prefill_gemm_bytes, qlinear_prefill, PREFILL_GEMM_MIN_ROWS,
    PREFILL_GEMM_SLICE_BYTES,
};
#[cfg(feature = "cuda")]
pub(crate) use prefill::{experts_mlp, gemm_dtype};
