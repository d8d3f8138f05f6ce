//! The GGML block types the decode matmul kernels exist for, by the names their kernels carry,
//! and how many experts one grouped launch of them takes.

use candle_core::quantized::GgmlDType;

/// Experts one group of launches takes (more run as further groups, added to the first's;
/// `MAX_GROUP_EXPERTS` in kernels/qblocks.cuh).
pub const MAX_GROUP_EXPERTS: usize = 16;

/// The kernel name part of the GGML block types `qlinear_small` has a CUDA kernel for: blocks
/// of 32 elements, and Q4_K's and Q6_K's super-blocks of 256 (their own kernel,
/// [`KernelTuning::qlinear_k`](crate::KernelTuning::qlinear_k)).
pub(crate) fn qlinear_small_type(t: GgmlDType) -> Option<&'static str> {
    Some(match t {
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q4K => "q4_k",
        GgmlDType::Q6K => "q6_k",
        _ => return None,
    })
}

/// Whether `t` is a K-quant type with a kernel of its own (`qlinear_k_small` in kernels/linear_k.cu,
/// not one of the [`QlinearVariant`](crate::QlinearVariant)s).
pub(crate) fn is_qlinear_k_type(t: GgmlDType) -> bool {
    matches!(t, GgmlDType::Q4K | GgmlDType::Q6K)
}
