//! A prompt's quantized projections on a GPU through 16-bit weights and cuBLAS
//! ([`qlinear_prefill`]): the GGML blocks dequantized a slice of rows at a time
//! ([`dequantize_rows`]) and multiplied on tensor cores, where Candle's quantized matmul would
//! quantize x to 8 bits and run integer tiles.

use candle_core::quantized::QTensor;
use candle_core::{DType, Result, Tensor, D};

use crate::linear::qlinear_small_type;
use crate::tuning::KernelTuning;

pub use crate::tuning::PREFILL_GEMM_MIN_ROWS;
/// The most bytes of F16 weight [`qlinear_prefill`] dequantizes at once: a larger weight goes
/// in slices of whole rows, each multiplied before the next is written, so that a prompt's
/// workspace grows by at most this much ([`prefill_gemm_bytes`]).
pub const PREFILL_GEMM_SLICE_BYTES: usize = 32 << 20;

/// The device bytes [`qlinear_prefill`] holds at once beside x and its output, for `rows` rows
/// of x against a weight of `n` output columns and width `k`: one 16-bit slice of the weight, x
/// in 16 bits and the 16-bit output (each slice's product goes straight into its columns).
/// Zero where it would not run (off, or fewer than [`KernelTuning::prefill_gemm_min_rows`]
/// rows).
pub fn prefill_gemm_bytes(rows: usize, n: usize, k: usize, tuning: &KernelTuning) -> u64 {
    if !tuning.prefill_gemm || rows < tuning.prefill_gemm_min_rows {
        return 0;
    }
    let slice_rows = prefill_slice_rows(n, k);
    (2 * (slice_rows * k + rows * k + rows * n)) as u64
}

/// Weight rows per slice of [`qlinear_prefill`]: as many as fit [`PREFILL_GEMM_SLICE_BYTES`] in
/// F16, a multiple of 64, at least 64, at most `n`.
fn prefill_slice_rows(n: usize, k: usize) -> usize {
    let fit = (PREFILL_GEMM_SLICE_BYTES / (2 * k.max(1))) / 64 * 64;
    fit.max(64).min(n)
}

/// Whether [`qlinear_prefill`] multiplies `x` by `w` (rather than declining): on
/// ([`KernelTuning::prefill_gemm`]), x on a GPU with at least
/// [`KernelTuning::prefill_gemm_min_rows`] rows, and a 2-D weight of a block type the
/// dequantizing kernel has.
pub(crate) fn prefill_applies(x: &Tensor, w: &QTensor, tuning: &KernelTuning) -> bool {
    let k = x.dims().last().copied().unwrap_or(0);
    let rows = x.elem_count() / k.max(1);
    tuning.prefill_gemm
        && x.device().is_cuda()
        && rows >= tuning.prefill_gemm_min_rows
        && qlinear_small_type(w.dtype()).is_some()
        && w.shape().rank() == 2
}

/// `x · wᵀ` for a prompt's rows on a GPU: w's blocks dequantized a slice of rows at a time and
/// multiplied by x through cuBLAS (F32 accumulation), returned in x's dtype. Both in F16 for F16
/// x; in BF16 for BF16 and F32 x, whose values may exceed F16's range (a model run in F32 for
/// that reason keeps it).
/// `None` where it does not apply: off ([`KernelTuning::prefill_gemm`]), not on a CUDA device,
/// fewer rows than [`KernelTuning::prefill_gemm_min_rows`], or a block type without the dequantizing kernel (Candle's
/// quantized matmul keeps those).
///
/// Candle's quantized matmul quantizes x to 8 bits and runs integer tiles (MMQ). For a long
/// prompt the F16 GEMM on tensor cores is faster, even with the weight written out in F16
/// first, and x keeps its precision (measured: docs/tuning.md, the prompt GEMM).
pub fn qlinear_prefill(x: &Tensor, w: &QTensor, tuning: &KernelTuning) -> Result<Option<Tensor>> {
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k.max(1);
    if !prefill_applies(x, w, tuning) {
        return Ok(None);
    }
    let (n, wk) = w.shape().dims2()?;
    if wk != k {
        candle_core::bail!("qlinear_prefill: x is {k} wide, the weight {wk}");
    }
    let _span = tracing::trace_span!("qlinear_prefill", rows, n, k).entered();
    let xg = x
        .reshape((rows, k))?
        .to_dtype(gemm_dtype(x.dtype()))?
        .contiguous()?;
    let y = gemm_dequantized(&xg, w)?;
    let mut out = x.dims().to_vec();
    *out.last_mut().expect("x has a last dim") = n;
    Ok(Some(y.to_dtype(x.dtype())?.reshape(out)?))
}

/// The 16-bit dtype [`gemm_dequantized`] runs x of `dtype` in: F16 for F16, BF16 for BF16 and
/// F32 (whose values may exceed F16's range).
pub(crate) fn gemm_dtype(dtype: DType) -> DType {
    if dtype == DType::F16 {
        DType::F16
    } else {
        DType::BF16
    }
}

/// x (rows × k, F16 or BF16, contiguous, on a GPU) times wᵀ (w n × k of a block type
/// [`dequantize_rows`] has), in x's dtype: w dequantized [`PREFILL_GEMM_SLICE_BYTES`] at a time
/// and multiplied by cuBLAS, whatever the rows (the callers choose by rows).
pub(crate) fn gemm_dequantized(x: &Tensor, w: &QTensor) -> Result<Tensor> {
    let (n, k) = w.shape().dims2()?;
    prefill_gemm_run(x, w, prefill_slice_rows(n, k))
}

/// Each expert's rows of x through its SiLU-gated MLP, into the same rows of `out`
/// (`cuda::experts_mlp`), its scratch in slices of at most [`PREFILL_GEMM_SLICE_BYTES`] as
/// [`qlinear_prefill`]'s (one slice of each weight for a 30B-A3B expert, several for a
/// Mixtral's).
#[cfg(feature = "cuda")]
pub(crate) fn experts_mlp(
    x: &candle_core::CudaStorage,
    x_l: &candle_core::Layout,
    experts: &[crate::gemm::cuda::ExpertGemm<'_>],
    out: &mut candle_core::CudaStorage,
) -> Result<()> {
    let Some(e) = experts.first() else {
        return Ok(());
    };
    let (inter, hidden) = e.weights[0].shape().dims2()?;
    let slices = (
        prefill_slice_rows(inter, 2 * hidden),
        prefill_slice_rows(hidden, inter),
    );
    crate::gemm::cuda::experts_mlp(x, x_l, experts, out, slices)
}

/// x (rows × k, F16 or BF16, contiguous) times wᵀ through `slice_rows` dequantized rows at a
/// time (`cuda::qlinear_prefill_gemm`).
#[cfg(feature = "cuda")]
fn prefill_gemm_run(x: &Tensor, w: &QTensor, slice_rows: usize) -> Result<Tensor> {
    let (storage, layout) = x.storage_and_layout();
    let candle_core::Storage::Cuda(xs) = &*storage else {
        candle_core::bail!("qlinear_prefill: x is not on a GPU");
    };
    let y = crate::gemm::cuda::qlinear_prefill_gemm(xs, layout, w, slice_rows)?;
    let n = w.shape().dims2()?.0;
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(y),
        (layout.shape().dims2()?.0, n),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

#[cfg(not(feature = "cuda"))]
fn prefill_gemm_run(_x: &Tensor, _w: &QTensor, _slice_rows: usize) -> Result<Tensor> {
    candle_core::bail!("qlinear_prefill: needs a build with `--features cuda`")
}

/// Rows `r0 .. r0 + rows` of `w` as a `dtype` (F16 or BF16) tensor (rows, k), on w's GPU: what
/// [`qlinear_prefill`] multiplies, a slice at a time. GGML's values (scale times quant, less the
/// min, in F32, rounded once). Errors for a weight not on a GPU, a block type without the
/// kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K have it), rows past the weight's, a
/// dtype other than F16 and BF16, or a build without CUDA.
#[cfg(feature = "cuda")]
pub fn dequantize_rows(w: &QTensor, r0: usize, rows: usize, dtype: DType) -> Result<Tensor> {
    let k = w.shape().dims2()?.1;
    let s = crate::gemm::cuda::dequantize_rows(w, r0, rows, dtype)?;
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(s),
        (rows, k),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// Rows `r0 .. r0 + rows` of `w` as a `dtype` tensor on w's GPU; this build has no CUDA, so it
/// errors.
#[cfg(not(feature = "cuda"))]
pub fn dequantize_rows(_w: &QTensor, _r0: usize, _rows: usize, _dtype: DType) -> Result<Tensor> {
    candle_core::bail!("dequantize_rows: needs a build with `--features cuda`")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_slices_bound_the_workspace() {
        for k in [32, 256, 4096, 5120, 11008, 13824, 100_000, 1 << 20] {
            for n in [1, 37, 64, 300, 4096, 4200, 11008, 32000] {
                let r = prefill_slice_rows(n, k);
                let at = format!("n {n} k {k}: {r} rows a slice");
                assert!(r >= 1 && r <= n, "{at}");
                assert!(r == n || r.is_multiple_of(64), "{at}");
                // A slice fits the bound unless even 64 rows do not.
                if 2 * 64 * k <= PREFILL_GEMM_SLICE_BYTES {
                    assert!(2 * r * k <= PREFILL_GEMM_SLICE_BYTES, "{at}");
                }
                // The workspace counted covers the slice, x and the output, from the fewest
                // rows the GEMM takes.
                let t = KernelTuning::default();
                for rows in [PREFILL_GEMM_MIN_ROWS, 512] {
                    let bytes = prefill_gemm_bytes(rows, n, k, &t);
                    assert!(bytes >= (2 * (r * k + rows * k + rows * n)) as u64, "{at}");
                }
                assert_eq!(prefill_gemm_bytes(PREFILL_GEMM_MIN_ROWS - 1, n, k, &t), 0);
                let off = KernelTuning {
                    prefill_gemm: false,
                    ..t
                };
                assert_eq!(prefill_gemm_bytes(512, n, k, &off), 0);
            }
        }
    }
}
