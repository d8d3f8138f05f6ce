//! Attention: one inference step's attention over a KV cache, which chooses its kernel itself
//! ([`AttentionStep`]); a decode step's few new positions over a KV cache ([`decode_attention`] and its
//! padded, device-position and 8-bit forms), several sequences' decode positions over their
//! own caches at once ([`ragged_decode_attention`]), a prompt's pass over it ([`prompt_attention`]),
//! and causal self-attention for training with its own backward ([`flash_attention`],
//! FlashAttention-2). On a CUDA device they run `kernels/attention.cu`, `kernels/flash.cu` and
//! `kernels/flash_f32.cu`; on the CPU direct loops or the compositions compute the same thing.

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
mod decode;
mod dims;
mod flash;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod flash_cuda;
mod prompt;
mod ragged;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod ragged_cuda;
mod step;

pub use decode::{
    decode_attention, decode_attention_at, decode_attention_padded, decode_attention_q8,
    decode_attention_unfused,
};
pub use dims::{RaggedDecodeSeq, RaggedDims, ATTENTION_MAX_HEAD_DIM};
pub use flash::{
    flash_attention, flash_attention_backward, flash_attention_composite, flash_attention_forward,
    flash_attention_supported, flash_attention_with, FlashForward, FlashState, FLASH_GPU_F32,
    FLASH_GPU_HEAD_DIMS,
};
pub use prompt::{prompt_attention, prompt_attention_supported};
pub use ragged::{
    ragged_decode_attention, ragged_decode_attention_at, ragged_seq_table, set_ragged_positions,
};
pub use step::{
    AttentionKernel, AttentionShape, AttentionStep, StepInfo, StepMasks, DECODE_ATTENTION_MAX_NEW,
};
