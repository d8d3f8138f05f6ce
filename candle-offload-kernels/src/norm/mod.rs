//! RMSNorm: the pre-norm residual step of inference ([`rms_norm_residual`], with its 8-bit
//! copy of the rows for variant 4's matmuls, [`rms_norm_residual_q8`]) and the training RMSNorm
//! with its own backward ([`rms_norm`]). On a CUDA device they run `kernels/norm.cu` and
//! `kernels/norm_train.cu`; on the CPU direct loops compute the same thing.

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
mod residual;
mod train;

pub use residual::{
    rms_norm_residual, rms_norm_residual_for, rms_norm_residual_q8, rms_norm_residual_unfused,
};
pub use train::{rms_norm, rms_norm_backward, rms_norm_composite};
