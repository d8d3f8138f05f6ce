//! The hand-over of x quantized to 8-bit blocks between a decode step's kernels: the ops that
//! make a matmul's x under variant 4 ([`QlinearVariant::V4`]) can also write it quantized
//! (`rms_norm_residual_q8`, `decode_attention_q8`, `qlinear_silu_mul_q8`), and the matmul that
//! takes that very tensor next reads those blocks instead of quantizing x in a launch of its
//! own. Per thread, the latest such tensor only.
//!
//! [`QlinearVariant::V4`]: crate::QlinearVariant::V4

/// Variant 4's bytes per block of 32 elements of one row of x in its buffer (kernels/q8.cuh,
/// `XBlock8` and the quants): 32 quants, then the scale and the quants' sum.
const QLINEAR4_X_BLOCK_BYTES: usize = 40;

/// The bytes of variant 4's buffer of quantized x for m rows of k: k / 32 blocks per row
/// rounded up to a multiple of 32, [`QLINEAR4_X_BLOCK_BYTES`] each.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn qlinear4_x_bytes(m: usize, k: usize) -> usize {
    m * (k / 32).next_multiple_of(32) * QLINEAR4_X_BLOCK_BYTES
}

/// Rows quantized for variant 4 by the op that wrote them (`rms_norm_residual_q8`,
/// `decode_attention_q8`, `qlinear_silu_mul_q8`), per thread: the latest such tensor's id
/// and variant 4's buffer of its rows.
#[cfg(feature = "cuda")]
pub(crate) mod prequantized {
    use candle_core::{Storage, Tensor, TensorId};
    use std::cell::RefCell;

    thread_local! {
        static LATEST: RefCell<Option<(TensorId, Tensor)>> = const { RefCell::new(None) };
        pub(crate) static FOUND: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    /// Keeps `xq`, the quantized buffer of `normed` (`rows` of `width`), for the matmuls that
    /// take `normed` next (replacing the one kept before).
    pub(crate) fn remember(
        normed: &Tensor,
        xq: candle_core::CudaStorage,
        rows: usize,
        width: usize,
    ) {
        let bytes = Tensor::from_storage(
            Storage::Cuda(xq),
            super::qlinear4_x_bytes(rows, width),
            candle_core::op::BackpropOp::none(),
            false,
        );
        LATEST.with(|l| *l.borrow_mut() = Some((normed.id(), bytes)));
    }

    /// Drops the kept buffer (a captured step must not end holding memory it allocated).
    pub(crate) fn forget() {
        LATEST.with(|l| *l.borrow_mut() = None);
    }

    /// The quantized rows of `x`, if the latest writer on this thread made `x` and them.
    pub(crate) fn of(x: &Tensor) -> Option<Tensor> {
        let found = LATEST.with(|l| match &*l.borrow() {
            Some((id, bytes)) if *id == x.id() => Some(bytes.clone()),
            _ => None,
        });
        if found.is_some() {
            FOUND.with(|f| f.set(f.get() + 1));
        }
        found
    }
}

/// Drops the quantized rows this thread keeps for the next matmul
/// ([`rms_norm_residual_q8`](crate::norm::rms_norm_residual_q8)
/// and the other writers of variant 4's buffer); candle-offload's `OffloadRuntime::capture_step` calls
/// it before a capture ends, so that the graph leaves no allocation of its own alive.
pub fn forget_handover() {
    #[cfg(feature = "cuda")]
    prequantized::forget();
}

/// How many times, on this thread, a GGML-block matmul found its x quantized by the op that
/// made it ([`rms_norm_residual_q8`](crate::norm::rms_norm_residual_q8),
/// [`decode_attention_q8`](crate::attention::decode_attention_q8),
/// [`qlinear_silu_mul_q8`](crate::linear::qlinear_silu_mul_q8)); 0
/// without CUDA. For tests and diagnostics.
pub fn quantized_rows_found() -> u64 {
    #[cfg(feature = "cuda")]
    return prequantized::FOUND.with(|f| f.get());
    #[cfg(not(feature = "cuda"))]
    0
}

/// The rows of `x` quantized by the op that made it (`rms_norm_residual_q8` and the like), if
/// it did.
pub(crate) fn prequantized_of(_x: &candle_core::Tensor) -> Option<candle_core::Tensor> {
    #[cfg(feature = "cuda")]
    return prequantized::of(_x);
    #[cfg(not(feature = "cuda"))]
    None
}
