//! Rotary position embeddings (half-rotated, the GPT-NeoX / LLaMA layout) of q and k in one
//! pass ([`rope_qk`]), also writing k and v straight into a KV cache ([`rope_qk_cache`]), with
//! q's and k's per-head norms first where a model has them ([`QkNorm`]). On a
//! CUDA device they run `kernels/rope.cu`; on the CPU a direct loop (or the composition, for
//! the cache) computes the same thing.

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
mod dims;
mod qk;

pub use qk::{rope_qk, rope_qk_cache, rope_qk_cache_at, rope_qk_unfused, rope_table, QkNorm};
