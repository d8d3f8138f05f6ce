//! A CPU quantized matmul for the GGML types whose Candle 0.11 CPU kernels have no SIMD path
//! in a portable build (Q4_1 and Q8_0 weights), as a Candle [`CustomOp1`]: the weight blocks
//! are multiplied as they are, against the F32 activations (by default: the dequantized
//! model's numbers, in another summation order) or, with [`KernelTuning::cpu_q8_activations`],
//! against activations quantized once per row as llama.cpp quantizes them (Q8_1 for Q4_1, Q8_0
//! for Q8_0: integer dot products, llama.cpp's numerics). The dot products run on AVX2 when the
//! CPU has it (`linear::simd`, detected at run time), split over a small pool of spinning workers
//! ([`crate::pool`]): a decode step is some 200 matmuls of a few hundred microseconds, and waking a
//! sleeping rayon worker for each costs about as much on a virtual machine (docs/tuning.md, CPU
//! threads). The caller runs chunks too and waits only for workers that took some, so a worker
//! the OS did not schedule in time costs the op its parallelism, not a wait.
//!
//! [`forward`] returns `None` for anything it does not cover (another device, type or dtype),
//! and the caller then runs Candle's `QMatMul`; results agree with it to float-summation order
//! (Candle rounds Q8_1 activations half away from zero, ggml and this op half to even).

use std::sync::Arc;

use rayon::prelude::*;

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K,
};
use candle_core::quantized::{GgmlDType, GgmlType, QTensor};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use crate::linear::{simd, simd_k};
use crate::tuning::KernelTuning;

/// Output columns per work item.
const COLS_PER_ITEM: usize = 16;

/// Block dot products below which a work item is not split off (a join costs about as much).
const MIN_BLOCKS_PER_TASK: usize = 2048;

/// Whether [`forward`] multiplies `w` itself: a 2-D Q4_1 or Q8_0 tensor on the CPU whose rows
/// are whole blocks.
pub fn supports(w: &QTensor) -> bool {
    w.device().is_cpu()
        && matches!(w.dtype(), GgmlDType::Q4_1 | GgmlDType::Q8_0)
        && w.shape().dims().len() == 2
        && w.shape().dims()[1].is_multiple_of(simd::QK)
}

/// `xs · wᵀ` for `w` of shape (n, k) held as GGML blocks and `xs` (..., k) in F32 on the CPU;
/// `None` when [`supports`] says no or `xs` is not F32, so that the caller runs Candle's
/// `QMatMul` instead. `tuning`: [`KernelTuning::cpu_q8_activations`],
/// [`KernelTuning::cpu_kquants`] and the prefetch distance.
pub fn forward(w: &Arc<QTensor>, xs: &Tensor, tuning: &KernelTuning) -> Result<Option<Tensor>> {
    if is_kquant(w.dtype()) {
        return Ok(kquant_many(&[w], xs, tuning)?.and_then(|mut ys| ys.pop()));
    }
    if !supports(w) || xs.dtype() != DType::F32 || !xs.device().is_cpu() {
        return Ok(None);
    }
    let (n, k) = w.shape().dims2()?;
    let dims = xs.dims();
    if dims.last() != Some(&k) {
        candle_core::bail!("quantized matmul: input {dims:?} against weight ({n}, {k})");
    }
    let m = xs.elem_count() / k;
    let ys = if m >= GEMM_ROWS && !tuning.cpu_q8_activations {
        // A prompt: the weights dequantized into a buffer once (every core, a few ms for a
        // whole small model) and Candle's F32 GEMM, whose register tiling beats a dot product
        // per row pair; the same numbers as the dequantized model's matmul.
        let wd = dequantize(w, n, k)?;
        xs.reshape((m, k))?.matmul(&wd.t()?)?
    } else {
        let op = QuantMatMul {
            w: w.clone(),
            n,
            k,
            q8: tuning.cpu_q8_activations,
            pf: tuning.cpu_prefetch_bytes,
        };
        xs.reshape((m, k))?.apply_op1_no_bwd(&op)?
    };
    let mut out = dims.to_vec();
    *out.last_mut().expect("non-empty dims") = n;
    Ok(Some(ys.reshape(out)?))
}

/// [`forward`] of one row `xs` (k values, F32) against an output head `w` (n, k) of Q8_0 blocks,
/// for a caller that takes only the largest logit (greedy decoding): every row that could be
/// the largest gets the number [`forward`] gives it, bit for bit, and every other row a lower
/// value than that largest one, so the index and value of the maximum are [`forward`]'s.
///
/// Each row is screened first with the activations quantized to Q8_0 (llama.cpp's arithmetic:
/// integer products, about half the work per block of the F32 path), together with a bound on
/// how far quantizing the activations moved it (`simd::Q8_0_SCREEN_BOUND`; the weights'
/// part of it is computed once per head and kept, `SCREEN_SCALES`). The largest
/// screened value less its bound is below the true maximum; only rows whose screened value
/// plus bound reaches it are computed again with the F32 activations (a handful of 49152 for
/// SmolLM2). Rows not recomputed keep their screened values, which are within their bound of
/// [`forward`]'s but not equal to them: sampling at a temperature needs [`forward`].
///
/// `None` where [`forward`] would take another path (other block types, more rows, 8-bit
/// activations on, another device).
pub fn forward_greedy(
    w: &Arc<QTensor>,
    xs: &Tensor,
    tuning: &KernelTuning,
) -> Result<Option<Tensor>> {
    let k = *xs.dims().last().unwrap_or(&0);
    let pf = tuning.cpu_prefetch_bytes;
    if tuning.cpu_q8_activations
        || w.dtype() != GgmlDType::Q8_0
        || !supports(w)
        || xs.dtype() != DType::F32
        || !xs.device().is_cpu()
        || xs.elem_count() != k
        || w.shape().dims()[1] != k
    {
        return Ok(None);
    }
    let n = w.shape().dims()[0];
    let nb = k / simd::QK;
    let row_bytes = nb * simd::Q8_0_BYTES;
    let data = w.data()?;
    if data.len() < n * row_bytes {
        candle_core::bail!(
            "quantized matmul: {} bytes of blocks for ({n}, {k})",
            data.len()
        );
    }
    let x = xs.flatten_all()?.to_vec1::<f32>()?;
    let mut yq = vec![0u8; row_bytes];
    simd::quantize_q8_0(&x, &mut yq);
    let amax = simd::block_amax(&x);
    let row = |r: usize| &data[r * row_bytes..(r + 1) * row_bytes];
    let scales = screen_scales(w, &data[..n * row_bytes], nb);
    let bound = simd::Q8_0_SCREEN_BOUND;
    // First a coarse bound per row, its weights' part summed over the blocks ahead and the
    // activations' the largest block's: one float per row read beside its blocks.
    let amax_all = amax.iter().fold(0f32, |a, &b| a.max(b));
    let per_task = MIN_BLOCKS_PER_TASK.div_ceil(nb).max(1);
    let mut screened = vec![0f32; 2 * n];
    crate::pool::for_each_chunk_mut(&mut screened, 2 * per_task, |task, part| {
        for (j, pair) in part.chunks_exact_mut(2).enumerate() {
            let r = task * per_task + j;
            pair[0] = simd::dot_q8_0_q8_0(row(r), &yq, pf);
            pair[1] = scales[r] * amax_all * bound;
        }
    });
    // Every row's true value is at least its screened value less its bound, so the largest of
    // these is at most the true maximum; a row whose screened value plus bound stays below it
    // cannot be the maximum.
    let floor = screened
        .chunks_exact(2)
        .map(|p| p[0] - p[1])
        .fold(f32::NEG_INFINITY, f32::max);
    if !floor.is_finite() || screened.iter().any(|v| v.is_nan()) {
        // NaN or infinite activations: the plain path says what they give.
        return forward(w, xs, tuning);
    }
    // The rows the coarse bound leaves (a handful a decode step for SmolLM2, a few thousand
    // where one block's activations stand far above the others), each with its tight bound,
    // block by block: `sum_b |d_b| * sum_j |q_bj| * amax[b]`. The floor stays a lower bound on
    // the maximum, and only rows reaching it are computed again with the F32 activations.
    let mut abs_scales = vec![0f32; nb];
    // (row, screened value, its tighter bound) for each.
    let candidates: Vec<(usize, f32, f32)> = screened
        .chunks_exact(2)
        .enumerate()
        .filter(|(_, p)| p[0] + p[1] >= floor)
        .map(|(r, p)| {
            simd::q8_0_abs_scales(row(r), &mut abs_scales);
            let tight = simd::weighted_sum(&abs_scales, &amax) * bound;
            (r, p[0], tight.min(p[1]))
        })
        .collect();
    let floor = candidates
        .iter()
        .map(|&(_, v, b)| v - b)
        .fold(floor, f32::max);
    let mut out: Vec<f32> = screened.chunks_exact(2).map(|p| p[0]).collect();
    for (r, v, b) in candidates {
        if v + b >= floor {
            out[r] = simd::dot_q8_0_f32(row(r), &x, pf);
        }
    }
    let mut dims = xs.dims().to_vec();
    *dims.last_mut().expect("non-empty dims") = n;
    Ok(Some(Tensor::from_vec(out, dims.as_slice(), xs.device())?))
}

/// The head [`forward_greedy`] screened last, held weakly, and the weights' part of its
/// coarse bound per row: `sum_b |d_b| * sum_j |q_bj|` ([`simd::q8_0_abs_scales`], summed).
/// Kept while that head lives (one float per row), so that a decode step's screen reads each
/// row's blocks and that float, instead of summing every block's magnitudes again (which made
/// the screen slower than the plain F32 head). The `Weak` keeps the head's allocation from
/// being reused by another tensor while it is kept here. One head at a time: models decoding in
/// turn in one process compute theirs again.
static SCREEN_SCALES: std::sync::Mutex<Option<KeptScales>> = std::sync::Mutex::new(None);

/// A head, held weakly, and its rows' bound scales ([`SCREEN_SCALES`]).
type KeptScales = (std::sync::Weak<QTensor>, Arc<Vec<f32>>);

/// [`SCREEN_SCALES`] for `w`, whose rows of `nb` Q8_0 blocks are `data`: computed (every core)
/// where another head, or none, is kept.
fn screen_scales(w: &Arc<QTensor>, data: &[u8], nb: usize) -> Arc<Vec<f32>> {
    let mut kept = SCREEN_SCALES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((head, scales)) = kept.as_ref() {
        if head.upgrade().is_some_and(|h| Arc::ptr_eq(&h, w)) {
            return scales.clone();
        }
    }
    let nb = nb.max(1);
    let row_bytes = nb * simd::Q8_0_BYTES;
    let mut rows = vec![0f32; data.len() / row_bytes];
    let per_task = MIN_BLOCKS_PER_TASK.div_ceil(nb).max(1);
    crate::pool::for_each_chunk_mut(&mut rows, per_task, |task, part| {
        let mut blocks = vec![0f32; nb];
        for (j, out) in part.iter_mut().enumerate() {
            let r = task * per_task + j;
            simd::q8_0_abs_scales(&data[r * row_bytes..(r + 1) * row_bytes], &mut blocks);
            *out = blocks.iter().sum();
        }
    });
    let scales = Arc::new(rows);
    *kept = Some((Arc::downgrade(w), scales.clone()));
    scales
}

/// [`forward`] of one row of `xs` (a decode step) against several weights of one block type
/// and width at once (q, k and v; gate and up): one pass of the pool over all their columns,
/// each column's number the one [`forward`] gives it (with 8-bit activations too: the row is
/// quantized once). K-quant weights may mix their types and take up to [`KQUANT_MAX_ROWS`]
/// rows ([`KernelTuning::cpu_kquants`]). `None` where [`forward`] would take another path for
/// any of them (another type, more rows), so that the caller multiplies them one by one.
pub fn forward_many(
    ws: &[&Arc<QTensor>],
    xs: &Tensor,
    tuning: &KernelTuning,
) -> Result<Option<Vec<Tensor>>> {
    let Some(first) = ws.first() else {
        return Ok(None);
    };
    if ws.iter().all(|w| is_kquant(w.dtype())) {
        return kquant_many(ws, xs, tuning);
    }
    let pf = tuning.cpu_prefetch_bytes;
    let ty = first.dtype();
    let k = *xs.dims().last().unwrap_or(&0);
    if xs.dtype() != DType::F32
        || !xs.device().is_cpu()
        || xs.elem_count() != k
        || !matches!(ty, GgmlDType::Q4_1 | GgmlDType::Q8_0)
        || ws
            .iter()
            .any(|w| !supports(w) || w.dtype() != ty || w.shape().dims().get(1) != Some(&k))
    {
        return Ok(None);
    }
    let ns: Vec<usize> = ws.iter().map(|w| w.shape().dims()[0]).collect();
    let total: usize = ns.iter().sum();
    let datas = ws.iter().map(|w| w.data()).collect::<Result<Vec<_>>>()?;
    let (block, nb) = match ty {
        GgmlDType::Q4_1 => (simd::Q4_1_BYTES, k / simd::QK),
        _ => (simd::Q8_0_BYTES, k / simd::QK),
    };
    let row_bytes = nb * block;
    for (d, &n) in datas.iter().zip(&ns) {
        if d.len() < n * row_bytes {
            candle_core::bail!(
                "quantized matmul: {} bytes of blocks for ({n}, {k})",
                d.len()
            );
        }
    }
    let x = xs.flatten_all()?.to_vec1::<f32>()?;
    // With 8-bit activations, the row quantized once as `QuantMatMul` quantizes it.
    let q8 = tuning.cpu_q8_activations;
    let yq = match (q8, ty) {
        (false, _) => Vec::new(),
        (true, GgmlDType::Q4_1) => {
            let mut y = vec![0u8; nb * simd::Q8_1_BYTES];
            simd::quantize_q8_1(&x, &mut y);
            y
        }
        (true, _) => {
            let mut y = vec![0u8; nb * simd::Q8_0_BYTES];
            simd::quantize_q8_0(&x, &mut y);
            y
        }
    };
    let ysum = if ty == GgmlDType::Q4_1 && !q8 {
        simd::block_sums(&x)
    } else {
        Vec::new()
    };
    // Column c of the concatenated output: weight i, its row r.
    let starts = column_starts(&ns);
    let row = |c: usize| column_of(&starts, c);
    let min_len = MIN_BLOCKS_PER_TASK.div_ceil(COLS_PER_ITEM * nb);
    // Tasks of an even number of columns, so that Q8_0 rows pair up as in `forward`.
    let per_task = COLS_PER_ITEM * min_len.max(1);
    let mut out = vec![0f32; total];
    crate::pool::for_each_chunk_mut(&mut out, per_task, |task, part| {
        let mut c = task * per_task;
        let end = c + part.len();
        while c < end {
            let (i, r) = row(c);
            let w = |r: usize| &datas[i][r * row_bytes..(r + 1) * row_bytes];
            let slot = c - task * per_task;
            if q8 {
                part[slot] = if ty == GgmlDType::Q4_1 {
                    simd::dot_q4_1_q8_1(w(r), &yq)
                } else {
                    simd::dot_q8_0_q8_0(w(r), &yq, pf)
                };
                c += 1;
            } else if ty == GgmlDType::Q4_1 {
                part[slot] = simd::dot_q4_1_f32_summed(w(r), &x, &ysum);
                c += 1;
            } else if r % 2 == 0 && r + 1 < ns[i] && c + 1 < end {
                (part[slot], part[slot + 1]) = simd::dot_q8_0_f32_pair(w(r), w(r + 1), &x, pf);
                c += 2;
            } else {
                part[slot] = simd::dot_q8_0_f32(w(r), &x, pf);
                c += 1;
            }
        }
    });
    let mut dims = xs.dims().to_vec();
    ns.iter()
        .zip(&starts)
        .map(|(&n, &s)| {
            *dims.last_mut().expect("non-empty dims") = n;
            Tensor::from_slice(&out[s..s + n], dims.as_slice(), xs.device())
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

pub use crate::tuning::KQUANT_MIN_THREADS;

/// The most activation rows of a K-quant matmul [`forward`] runs itself (decode steps of up
/// to eight sequences); prompts go to Candle's, whose tiled kernels reuse each weight tile
/// across many rows.
pub const KQUANT_MAX_ROWS: usize = 8;

/// Weight elements per work item of the K-quant loop (rounded up to whole output columns).
const KQUANT_ELEMS_PER_TASK: usize = 1 << 16;

/// Whether `t` is a K-quant block type (256 elements a block, activations in Q8_K blocks).
pub(crate) fn is_kquant(t: GgmlDType) -> bool {
    matches!(
        t,
        GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K
    )
}

/// A K-quant weight's blocks, typed.
pub(crate) enum KRows<'a> {
    Q2K(&'a [BlockQ2K]),
    Q3K(&'a [BlockQ3K]),
    Q4K(&'a [BlockQ4K]),
    Q5K(&'a [BlockQ5K]),
    Q6K(&'a [BlockQ6K]),
}

impl<'a> KRows<'a> {
    /// `bytes` as blocks of `ty`; `None` for another type or bytes that are not whole,
    /// aligned blocks.
    pub(crate) fn new(ty: GgmlDType, bytes: &'a [u8]) -> Option<Self> {
        use crate::linear::simd::k_blocks;
        Some(match ty {
            GgmlDType::Q2K => Self::Q2K(k_blocks(bytes)?),
            GgmlDType::Q3K => Self::Q3K(k_blocks(bytes)?),
            GgmlDType::Q4K => Self::Q4K(k_blocks(bytes)?),
            GgmlDType::Q5K => Self::Q5K(k_blocks(bytes)?),
            GgmlDType::Q6K => Self::Q6K(k_blocks(bytes)?),
            _ => return None,
        })
    }

    pub(crate) fn blocks(&self) -> usize {
        match self {
            Self::Q2K(b) => b.len(),
            Self::Q3K(b) => b.len(),
            Self::Q4K(b) => b.len(),
            Self::Q5K(b) => b.len(),
            Self::Q6K(b) => b.len(),
        }
    }

    /// Output values `out` of a run ([`dot_pairs`]) that starts at `at`, (weight row,
    /// activation row), with `m` activation rows of `nb` blocks in `yq`: `out[i]` is the dot
    /// product of the i-th pair,
    /// Candle's `vec_dot` (or the prefetching Q4_K/Q6_K kernels that compute it bit for bit).
    /// The block type is matched once for the run.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dot_run(
        &self,
        at: (usize, usize),
        m: usize,
        nb: usize,
        k: usize,
        yq: &[BlockQ8K],
        pf: usize,
        out: &mut [f32],
    ) {
        match self {
            Self::Q2K(b) => dot_pairs(b, yq, at, m, nb, out, |x, y| BlockQ2K::vec_dot(k, x, y)),
            Self::Q3K(b) => dot_pairs(b, yq, at, m, nb, out, |x, y| BlockQ3K::vec_dot(k, x, y)),
            Self::Q4K(b) => dot_columns(
                b,
                yq,
                at,
                m,
                nb,
                out,
                |x, y| crate::linear::simd_k::dot_q4k_q8k(x, y, pf),
                |x, ys, out| crate::linear::simd_k::dot_q4k_q8k_rows(x, ys, out, pf),
            ),
            Self::Q5K(b) => dot_pairs(b, yq, at, m, nb, out, |x, y| BlockQ5K::vec_dot(k, x, y)),
            Self::Q6K(b) => dot_columns(
                b,
                yq,
                at,
                m,
                nb,
                out,
                |x, y| crate::linear::simd_k::dot_q6k_q8k(x, y, pf),
                |x, ys, out| crate::linear::simd_k::dot_q6k_q8k_rows(x, ys, out, pf),
            ),
        }
    }
}

/// `out[i] = dot(weight row c, activation row r)` for the i-th (c, r) pair of a run that starts
/// at `(c, r)` and goes on row by row of the `m` activation rows, then column by column; rows
/// are `len` units long in `w` and in `y`.
pub(crate) fn dot_pairs<W, Y>(
    w: &[W],
    y: &[Y],
    (mut c, mut r): (usize, usize),
    m: usize,
    len: usize,
    out: &mut [f32],
    dot: impl Fn(&[W], &[Y]) -> f32,
) {
    for v in out {
        *v = dot(&w[c * len..(c + 1) * len], &y[r * len..(r + 1) * len]);
        r += 1;
        if r == m {
            r = 0;
            c += 1;
        }
    }
}

/// [`dot_pairs`] where a whole column of four or more rows (weight row `c` against all `m`
/// activation rows, which lie one after the other in `y`) goes through `rows(weight row, y,
/// out)`, a kernel that takes several rows at once; a column the run starts or ends inside,
/// and fewer rows, through `dot` pair by pair. `rows` must give `dot`'s values.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dot_columns<W, Y>(
    w: &[W],
    y: &[Y],
    (mut c, mut r): (usize, usize),
    m: usize,
    len: usize,
    out: &mut [f32],
    dot: impl Fn(&[W], &[Y]) -> f32,
    rows: impl Fn(&[W], &[Y], &mut [f32]),
) {
    let mut o = 0;
    while o < out.len() {
        let wr = &w[c * len..(c + 1) * len];
        if m >= 4 && r == 0 && out.len() - o >= m {
            rows(wr, &y[..m * len], &mut out[o..o + m]);
            o += m;
            c += 1;
        } else {
            out[o] = dot(wr, &y[r * len..(r + 1) * len]);
            o += 1;
            r += 1;
            if r == m {
                r = 0;
                c += 1;
            }
        }
    }
}

/// `xs · wᵀ` for each K-quant weight of `ws` (each (n, k), block types may differ) against
/// the same `xs` (at most [`KQUANT_MAX_ROWS`] rows of `k`, any float dtype), in one pass of
/// the spinning pool over all their output columns; outputs in `xs`'s dtype. The activations
/// are quantized to Q8_K once, as Candle's matmul quantizes them, and each output is Candle's
/// `vec_dot` of a weight row with them. `None` where this does not apply (turned off, another
/// device or type, more rows, weights whose bytes are not aligned blocks), so that the caller
/// runs Candle's matmul.
fn kquant_many(
    ws: &[&Arc<QTensor>],
    xs: &Tensor,
    tuning: &KernelTuning,
) -> Result<Option<Vec<Tensor>>> {
    let k = *xs.dims().last().unwrap_or(&0);
    let pf = tuning.cpu_prefetch_bytes;
    let on = tuning
        .cpu_kquants
        .unwrap_or_else(|| crate::pool::threads() >= KQUANT_MIN_THREADS);
    if ws.is_empty() || !on || !xs.device().is_cpu() || k == 0 || !k.is_multiple_of(QK_K) {
        return Ok(None);
    }
    let m = xs.elem_count() / k;
    if m == 0 || m > KQUANT_MAX_ROWS || !xs.dtype().is_float() {
        return Ok(None);
    }
    let mut ns = Vec::with_capacity(ws.len());
    for w in ws {
        match w.shape().dims() {
            &[n, wk] if wk == k && w.device().is_cpu() && is_kquant(w.dtype()) => ns.push(n),
            _ => return Ok(None),
        }
    }
    let nb = k / QK_K;
    let datas = ws.iter().map(|w| w.data()).collect::<Result<Vec<_>>>()?;
    let Some(rows) = ws
        .iter()
        .zip(&datas)
        .map(|(w, d)| KRows::new(w.dtype(), d))
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(None);
    };
    for ((rows, &n), w) in rows.iter().zip(&ns).zip(ws) {
        if rows.blocks() < n * nb {
            candle_core::bail!(
                "quantized matmul: {} blocks of {:?} for ({n}, {k})",
                rows.blocks(),
                w.dtype()
            );
        }
    }
    let x = xs.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    // Rows of whole blocks: the rows one after the other are the blocks one after the other.
    let mut yq = vec![BlockQ8K::zeros(); m * nb];
    simd_k::quantize_q8k(&x, &mut yq);
    let starts = column_starts(&ns);
    let total: usize = ns.iter().sum();
    let per_task = KQUANT_ELEMS_PER_TASK.div_ceil(k).max(1);
    // Column-major: the `m` values of output column c (all weights' columns in a row) at c * m.
    let mut out_t = vec![0f32; total * m];
    crate::pool::for_each_chunk_mut(&mut out_t, per_task * m, |task, part| {
        // The task's columns, weight by weight: one run each.
        let mut c = task * per_task;
        let mut done = 0;
        while done < part.len() {
            let (i, col) = column_of(&starts, c);
            let cols = (ns[i] - col).min((part.len() - done) / m);
            rows[i].dot_run(
                (col, 0),
                m,
                nb,
                k,
                &yq,
                pf,
                &mut part[done..done + cols * m],
            );
            done += cols * m;
            c += cols;
        }
    });
    let mut dims = xs.dims().to_vec();
    ns.iter()
        .zip(&starts)
        .map(|(&n, &s)| {
            *dims.last_mut().expect("non-empty dims") = n;
            let y = transpose(out_t[s * m..(s + n) * m].to_vec(), m, n);
            Tensor::from_vec(y, dims.as_slice(), xs.device())?.to_dtype(xs.dtype())
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// Where each weight's output columns start when the columns of weights `ns` rows long are
/// laid end to end (one pass over several projections).
fn column_starts(ns: &[usize]) -> Vec<usize> {
    ns.iter()
        .scan(0, |acc, &n| {
            let s = *acc;
            *acc += n;
            Some(s)
        })
        .collect()
}

/// Column `c` of the laid-out columns ([`column_starts`]): its weight and its row there.
fn column_of(starts: &[usize], c: usize) -> (usize, usize) {
    let i = starts.partition_point(|&s| s <= c) - 1;
    (i, c - starts[i])
}

/// Activation rows from which F32-activation matmuls dequantize the weights and run a GEMM.
const GEMM_ROWS: usize = 64;

/// `w` (n, k) of Q4_1 or Q8_0 blocks as an F32 tensor, rows dequantized in parallel
/// (`d * q + m`, `d * q`: as Candle's `dequantize` computes them).
fn dequantize(w: &QTensor, n: usize, k: usize) -> Result<Tensor> {
    let data = w.data()?;
    let nb = k / simd::QK;
    let mut out = vec![0f32; n * k];
    match w.dtype() {
        GgmlDType::Q4_1 => {
            let row = nb * simd::Q4_1_BYTES;
            out.par_chunks_mut(k).enumerate().for_each(|(r, o)| {
                let blocks = data[r * row..(r + 1) * row].chunks_exact(simd::Q4_1_BYTES);
                for (b, o) in blocks.zip(o.chunks_exact_mut(simd::QK)) {
                    let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                    let m = half::f16::from_le_bytes([b[2], b[3]]).to_f32();
                    let (lo, hi) = o.split_at_mut(simd::QK / 2);
                    for ((q, l), h) in b[4..].iter().zip(lo).zip(hi) {
                        *l = (q & 0x0f) as f32 * d + m;
                        *h = (q >> 4) as f32 * d + m;
                    }
                }
            });
        }
        _ => {
            let row = nb * simd::Q8_0_BYTES;
            out.par_chunks_mut(k).enumerate().for_each(|(r, o)| {
                let blocks = data[r * row..(r + 1) * row].chunks_exact(simd::Q8_0_BYTES);
                for (b, o) in blocks.zip(o.chunks_exact_mut(simd::QK)) {
                    let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                    for (q, v) in b[2..].iter().zip(o) {
                        *v = *q as i8 as f32 * d;
                    }
                }
            });
        }
    }
    Tensor::from_vec(out, (n, k), &candle_core::Device::Cpu)
}

/// A dot product of one row of weight blocks with one row of activation blocks.
type DotFn = fn(&[u8], &[u8], usize) -> f32;

/// The op: `w` (n, k) in Q4_1 or Q8_0 blocks.
struct QuantMatMul {
    w: Arc<QTensor>,
    n: usize,
    k: usize,
    /// [`KernelTuning::cpu_q8_activations`].
    q8: bool,
    /// The prefetch distance.
    pf: usize,
}

impl CustomOp1 for QuantMatMul {
    fn name(&self) -> &'static str {
        "candle-offload-cpu-qmatmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (m, k) = layout.shape().dims2()?;
        let (n, nb) = (self.n, self.k / simd::QK);
        let xs = match (storage, layout.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((a, b))) => &v[a..b],
            _ => candle_core::bail!("quantized matmul: input must be contiguous F32"),
        };
        let data = self.w.data()?;
        let pf = self.pf;
        let (w_block, y_block, dot): (usize, usize, DotFn) = match self.w.dtype() {
            GgmlDType::Q4_1 => (simd::Q4_1_BYTES, simd::Q8_1_BYTES, |x, y, _| {
                simd::dot_q4_1_q8_1(x, y)
            }),
            GgmlDType::Q8_0 => (simd::Q8_0_BYTES, simd::Q8_0_BYTES, simd::dot_q8_0_q8_0),
            other => candle_core::bail!("quantized matmul: {other:?} is not handled here"),
        };
        if data.len() < n * nb * w_block || k != self.k {
            candle_core::bail!(
                "quantized matmul: {} bytes of blocks for ({n}, {k})",
                data.len()
            );
        }
        let row_bytes = nb * w_block;
        let min_len = MIN_BLOCKS_PER_TASK.div_ceil(COLS_PER_ITEM * nb * m);
        let mut out_t = vec![0f32; n * m];
        let q4_1 = self.w.dtype() == GgmlDType::Q4_1;
        if !self.q8 {
            let dot: fn(&[u8], &[f32], usize) -> f32 = match self.w.dtype() {
                GgmlDType::Q4_1 => |x, y, _| simd::dot_q4_1_f32(x, y),
                _ => simd::dot_q8_0_f32,
            };
            if q4_1 && m > 1 {
                par_column_fours(
                    &mut out_t,
                    m,
                    min_len,
                    &data,
                    row_bytes,
                    |w, cols| match cols.len() {
                        4 => simd::dot_q4_1_f32_rows_cols4([w[0], w[1], w[2], w[3]], xs, cols),
                        _ => {
                            for (w, col) in w.iter().zip(cols.iter_mut()) {
                                simd::dot_q4_1_f32_rows(w, xs, col);
                            }
                        }
                    },
                );
            } else if q4_1 {
                // One row (a decode step): the activations' block sums once, for every column.
                let ysum = simd::block_sums(xs);
                par_columns(&mut out_t, m, min_len, &data, row_bytes, |w, col| {
                    col[0] = simd::dot_q4_1_f32_summed(w, xs, &ysum);
                });
            } else if m == 1 {
                // Q8_0, one row: two weight rows at a time (each row's number unchanged).
                par_column_fours(&mut out_t, m, min_len, &data, row_bytes, |w, cols| {
                    for (w, cols) in w.chunks(2).zip(cols.chunks_mut(2)) {
                        if let ([w0, w1], [c0, c1]) = (w, &mut *cols) {
                            (c0[0], c1[0]) = simd::dot_q8_0_f32_pair(w0, w1, xs, pf);
                        } else {
                            for (w, c) in w.iter().zip(cols.iter_mut()) {
                                c[0] = dot(w, xs, pf);
                            }
                        }
                    }
                });
            } else {
                // Q8_0, a prompt's rows: each weight block converted once for four rows.
                par_columns(&mut out_t, m, min_len, &data, row_bytes, |w, col| {
                    simd::dot_q8_0_f32_rows(w, xs, col, pf);
                });
            }
            return Ok((CpuStorage::F32(transpose(out_t, m, n)), Shape::from((m, n))));
        }
        // The activations, quantized once per row.
        let mut yq = vec![0u8; m * nb * y_block];
        for (x, y) in xs.chunks_exact(k).zip(yq.chunks_exact_mut(nb * y_block)) {
            match self.w.dtype() {
                GgmlDType::Q4_1 => simd::quantize_q8_1(x, y),
                _ => simd::quantize_q8_0(x, y),
            }
        }
        let yq = &yq[..];
        let scales = match (q4_1, m > 1) {
            (true, true) => simd::q8_1_scales(yq),
            (false, true) => simd::q8_0_scales(yq),
            _ => Vec::new(),
        };
        par_columns(&mut out_t, m, min_len, &data, row_bytes, |w, col| {
            if q4_1 && m > 1 {
                simd::dot_q4_1_q8_1_rows(w, yq, &scales, col);
            } else if m > 1 {
                simd::dot_q8_0_q8_0_rows(w, yq, &scales, col, pf);
            } else {
                for (v, y) in col.iter_mut().zip(yq.chunks_exact(nb * y_block)) {
                    *v = dot(w, y, pf);
                }
            }
        });
        Ok((CpuStorage::F32(transpose(out_t, m, n)), Shape::from((m, n))))
    }
}

/// Fills `out_t`, the output in column-major order (`m` values per column), on the spinning
/// pool ([`crate::pool`]):
/// `column(w, values)` computes the column of weight row `w` (`row_bytes` of `data`). Work
/// items are ranges of [`COLS_PER_ITEM`] columns, each writing its own slice, so no two workers
/// share one.
fn par_columns(
    out_t: &mut [f32],
    m: usize,
    min_len: usize,
    data: &[u8],
    row_bytes: usize,
    column: impl Fn(&[u8], &mut [f32]) + Sync + Send,
) {
    let cols = COLS_PER_ITEM * min_len.max(1);
    crate::pool::for_each_chunk_mut(out_t, cols * m, |task, part| {
        let col0 = task * cols;
        for (c, col) in part.chunks_mut(m).enumerate() {
            column(
                &data[(col0 + c) * row_bytes..(col0 + c + 1) * row_bytes],
                col,
            );
        }
    });
}

/// [`par_columns`] handing out four columns at a time (fewer at the end of the output):
/// `columns(weight_rows, values)` fills the columns of those weight rows.
fn par_column_fours(
    out_t: &mut [f32],
    m: usize,
    min_len: usize,
    data: &[u8],
    row_bytes: usize,
    columns: impl Fn(&[&[u8]], &mut [&mut [f32]]) + Sync + Send,
) {
    let per_task = COLS_PER_ITEM * min_len.max(1);
    crate::pool::for_each_chunk_mut(out_t, per_task * m, |task, part| {
        let col0 = task * per_task;
        let mut cols: Vec<&mut [f32]> = part.chunks_mut(m).collect();
        for (g, group) in cols.chunks_mut(4).enumerate() {
            let first = col0 + 4 * g;
            // No allocation per group: the head of a small model has 12288 of them a step.
            let rows: [&[u8]; 4] = std::array::from_fn(|j| {
                let c = first + j.min(group.len() - 1);
                &data[c * row_bytes..(c + 1) * row_bytes]
            });
            columns(&rows[..group.len()], group);
        }
    });
}

/// The (m, n) row-major output from its column-major form (`m` values per column); also
/// `cpu_dense`'s.
pub(crate) fn transpose(out_t: Vec<f32>, m: usize, n: usize) -> Vec<f32> {
    if m == 1 {
        return out_t;
    }
    let mut out = vec![0f32; m * n];
    for (c, col) in out_t.chunks_exact(m).enumerate() {
        for (r, v) in col.iter().enumerate() {
            out[r * n + c] = *v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module};

    use super::*;

    fn rel_l2(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().sqr().unwrap().sum_all().unwrap();
        let n = b.sqr().unwrap().sum_all().unwrap();
        (d.to_scalar::<f32>().unwrap() / n.to_scalar::<f32>().unwrap()).sqrt()
    }

    /// Several weights in one pass equal each weight on its own, bit for bit (one row; widths
    /// odd and even; F32 and 8-bit activations; a type mix and more rows decline).
    #[test]
    fn many_weights_equal_one_by_one() {
        let mut t = KernelTuning {
            cpu_kquants: Some(true),
            ..KernelTuning::default()
        };
        let dev = Device::Cpu;
        t.cpu_q8_activations = false;
        for ty in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let ws: Vec<Arc<QTensor>> = [37usize, 5, 64]
                .iter()
                .map(|&n| {
                    let w = Tensor::randn(0f32, 1.0, (n, 96), &dev).unwrap();
                    Arc::new(QTensor::quantize(&w, ty).unwrap())
                })
                .collect();
            let refs: Vec<&Arc<QTensor>> = ws.iter().collect();
            let xs = Tensor::randn(0f32, 1.0, (1, 1, 96), &dev).unwrap();
            let many = forward_many(&refs, &xs, &t)
                .unwrap()
                .expect("one row of Q4_1 / Q8_0");
            for (w, y) in ws.iter().zip(&many) {
                let one = forward(w, &xs, &t).unwrap().unwrap();
                assert_eq!(y.dims(), one.dims());
                let (a, b) = (
                    y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    one.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                assert_eq!(a, b, "{ty:?}");
            }
            let two = Tensor::randn(0f32, 1.0, (2, 96), &dev).unwrap();
            assert!(forward_many(&refs, &two, &t).unwrap().is_none(), "two rows");
            t.cpu_q8_activations = true;
            let many = forward_many(&refs, &xs, &t)
                .unwrap()
                .expect("8-bit activations");
            for (w, y) in ws.iter().zip(&many) {
                let one = forward(w, &xs, &t).unwrap().unwrap();
                let (a, b) = (
                    y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    one.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                assert_eq!(a, b, "{ty:?}, 8-bit activations");
            }
            t.cpu_q8_activations = false;
        }
        let other = Arc::new(
            QTensor::quantize(
                &Tensor::zeros((4, 96), DType::F32, &dev).unwrap(),
                GgmlDType::Q8_0,
            )
            .unwrap(),
        );
        let q41 = Arc::new(
            QTensor::quantize(
                &Tensor::zeros((4, 96), DType::F32, &dev).unwrap(),
                GgmlDType::Q4_1,
            )
            .unwrap(),
        );
        let xs = Tensor::zeros((1, 96), DType::F32, &dev).unwrap();
        assert!(
            forward_many(&[&q41, &other], &xs, &t).unwrap().is_none(),
            "mixed types"
        );
    }

    /// K-quant weights: each output is Candle's, bit for bit where Candle multiplies the
    /// blocks as they are (37 rows: no repacking into tiles of 16) and within float-summation
    /// noise where it repacks; several weights of mixed K types in one pass equal each on its
    /// own; up to `KQUANT_MAX_ROWS` rows, in F32 and F16; more rows, a non-K type in the mix
    /// and the switch turned off decline.
    #[test]
    fn kquants_match_candle() {
        let mut t = KernelTuning {
            cpu_kquants: Some(true),
            ..KernelTuning::default()
        };
        let dev = Device::Cpu;
        let k = 512;
        let types = [
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ];
        let quantize = |n: usize, ty: GgmlDType| {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
            Arc::new(QTensor::quantize(&w, ty).unwrap())
        };
        let values = |t: &Tensor| {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        t.cpu_kquants = Some(true);
        for ty in types {
            for m in [1usize, 3] {
                let xs = Tensor::randn(0f32, 1.0, (1, m, k), &dev).unwrap();
                for n in [37usize, 64] {
                    let w = quantize(n, ty);
                    let ours = forward(&w, &xs, &t).unwrap().expect("a K-quant decode row");
                    let candle = QMatMul::from_arc(w.clone()).unwrap().forward(&xs).unwrap();
                    assert_eq!(ours.dims(), candle.dims());
                    if n == 37 {
                        assert_eq!(values(&ours), values(&candle), "{ty:?} m {m}");
                    } else {
                        let e = rel_l2(&ours, &candle);
                        assert!(e < 1e-5, "{ty:?} m {m}: {e}");
                    }
                }
            }
        }
        let ws: Vec<Arc<QTensor>> = [
            (37, GgmlDType::Q4K),
            (5, GgmlDType::Q6K),
            (64, GgmlDType::Q4K),
        ]
        .into_iter()
        .map(|(n, ty)| quantize(n, ty))
        .collect();
        let refs: Vec<&Arc<QTensor>> = ws.iter().collect();
        for dtype in [DType::F32, DType::F16] {
            let xs = Tensor::randn(0f32, 1.0, (2, k), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let many = forward_many(&refs, &xs, &t)
                .unwrap()
                .expect("mixed K types");
            for (w, y) in ws.iter().zip(&many) {
                assert_eq!(y.dtype(), dtype);
                let one = forward(w, &xs.to_dtype(DType::F32).unwrap(), &t)
                    .unwrap()
                    .unwrap();
                assert_eq!(
                    values(y),
                    values(&one.to_dtype(dtype).unwrap()),
                    "{dtype:?}"
                );
            }
        }
        let rows = Tensor::randn(0f32, 1.0, (KQUANT_MAX_ROWS + 1, k), &dev).unwrap();
        assert!(
            forward(&ws[0], &rows, &t).unwrap().is_none(),
            "too many rows"
        );
        let q8 = quantize(4, GgmlDType::Q8_0);
        let one = Tensor::randn(0f32, 1.0, (1, k), &dev).unwrap();
        assert!(
            forward_many(&[&ws[0], &q8], &one, &t).unwrap().is_none(),
            "a K type beside Q8_0"
        );
        t.cpu_kquants = Some(false);
        assert!(forward(&ws[0], &one, &t).unwrap().is_none(), "turned off");
    }

    /// The greedy head keeps the maximum: the index and value of the largest logit are
    /// `forward`'s, bit for bit, and every row it did not recompute is below that value, for
    /// Gaussian rows and for clusters of near-tied rows (each a copy of one row with a few
    /// quants nudged) against activations with outliers. The screen's bound holds for every
    /// row, and its SIMD and scalar kernels agree. Other paths decline.
    #[test]
    fn greedy_head_keeps_the_maximum() {
        let mut t = KernelTuning {
            cpu_kquants: Some(true),
            ..KernelTuning::default()
        };
        t.cpu_q8_activations = false;
        let dev = Device::Cpu;
        for (case, (n, k)) in [(7usize, 64usize), (300, 576), (2049, 128)]
            .into_iter()
            .enumerate()
        {
            let base = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
            // Rows 0..n/2 near-tied: row 0 plus noise a thousandth of its scale.
            let half = n / 2;
            let tie = base
                .narrow(0, 0, 1)
                .unwrap()
                .broadcast_add(&(base.narrow(0, 0, half).unwrap() * 1e-3).unwrap())
                .unwrap();
            let w = Tensor::cat(&[&tie, &base.narrow(0, half, n - half).unwrap()], 0).unwrap();
            let q = Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap());
            let mut x: Vec<f32> = Tensor::randn(0f32, 1.0, k, &dev)
                .unwrap()
                .to_vec1()
                .unwrap();
            x[case] = 12.0;
            x[k - 1] = -8.0;
            // Aligned with row 0, so that the tied rows hold the maximum.
            let r0: Vec<f32> = w.get(0).unwrap().to_vec1().unwrap();
            for (v, w) in x.iter_mut().zip(&r0) {
                *v += 3.0 * w;
            }
            let xs = Tensor::from_vec(x.clone(), (1, k), &dev).unwrap();
            let values = |t: Result<Option<Tensor>>| -> Vec<f32> {
                t.unwrap()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            let exact = values(forward(&q, &xs, &t));
            let greedy = values(forward_greedy(&q, &xs, &t));
            let argmax = |v: &[f32]| {
                v.iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
                        if x > bv {
                            (i, x)
                        } else {
                            (bi, bv)
                        }
                    })
            };
            let (i, max) = argmax(&exact);
            assert_eq!(argmax(&greedy), (i, max), "case {case}: the maximum");
            // Again, with the head's bound scales kept from the first call.
            assert_eq!(
                values(forward_greedy(&q, &xs, &t)),
                greedy,
                "case {case}: the kept scales"
            );
            assert!(
                i < half,
                "case {case}: the maximum lies in the tied rows ({i})"
            );
            for (r, (&g, &e)) in greedy.iter().zip(&exact).enumerate() {
                assert!(
                    g == e || g < max,
                    "case {case}, row {r}: {g} (exact {e}, max {max})"
                );
            }
            // Some near-tied rows were recomputed, and (with rows enough) some were not.
            let recomputed = greedy.iter().zip(&exact).filter(|(g, e)| g == e).count();
            assert!(recomputed >= 2, "case {case}: {recomputed} rows recomputed");
            if n >= 300 {
                assert!(recomputed < n, "case {case}: every row recomputed");
            }
            // The screen's bound, and its kernels.
            let data = q.data().unwrap();
            let nb = k / simd::QK;
            let row_bytes = nb * simd::Q8_0_BYTES;
            let mut yq = vec![0u8; row_bytes];
            simd::quantize_q8_0(&x, &mut yq);
            let amax = simd::block_amax(&x);
            let mut abs_scales = vec![0f32; nb];
            for (r, &e) in exact.iter().enumerate() {
                let w = &data[r * row_bytes..(r + 1) * row_bytes];
                simd::q8_0_abs_scales(w, &mut abs_scales);
                let (v, scale) = (
                    simd::dot_q8_0_q8_0(w, &yq, t.cpu_prefetch_bytes),
                    simd::weighted_sum(&abs_scales, &amax),
                );
                let (vs, ss) = simd::dot_q8_0_q8_0_bound_scalar(w, &yq, &amax);
                assert!(
                    (v - vs).abs() <= 1e-5 * ss && (scale - ss).abs() <= 1e-5 * ss,
                    "case {case}, row {r}"
                );
                assert!(
                    (v - e).abs() <= scale * simd::Q8_0_SCREEN_BOUND,
                    "case {case}, row {r}: {v} vs {e}, scale {scale}"
                );
            }
        }
        let w = Tensor::randn(0f32, 1.0, (16, 64), &dev).unwrap();
        let q8 = Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap());
        let q41 = Arc::new(QTensor::quantize(&w, GgmlDType::Q4_1).unwrap());
        let one = Tensor::randn(0f32, 1.0, (1, 64), &dev).unwrap();
        let two = Tensor::randn(0f32, 1.0, (2, 64), &dev).unwrap();
        assert!(forward_greedy(&q8, &two, &t).unwrap().is_none(), "two rows");
        assert!(forward_greedy(&q41, &one, &t).unwrap().is_none(), "Q4_1");
        t.cpu_q8_activations = true;
        assert!(
            forward_greedy(&q8, &one, &t).unwrap().is_none(),
            "8-bit activations"
        );
    }

    #[test]
    fn agrees_with_candle_qmatmul() {
        let mut t = KernelTuning {
            cpu_kquants: Some(true),
            ..KernelTuning::default()
        };
        let dev = Device::Cpu;
        for (ty, q8) in [
            (GgmlDType::Q4_1, true),
            (GgmlDType::Q8_0, true),
            (GgmlDType::Q4_1, false),
            (GgmlDType::Q8_0, false),
        ] {
            t.cpu_q8_activations = q8;
            for m in [1, 3, 7, 8, 33, 65] {
                let w = Tensor::randn(0f32, 1.0, (37, 128), &dev).unwrap();
                let q = Arc::new(QTensor::quantize(&w, ty).unwrap());
                assert!(supports(&q));
                let xs = Tensor::randn(0f32, 1.0, (1, m, 128), &dev).unwrap();
                let ours = forward(&q, &xs, &t).unwrap().unwrap();
                let candle = QMatMul::from_arc(q.clone()).unwrap().forward(&xs).unwrap();
                assert_eq!(ours.dims(), candle.dims());
                let e = rel_l2(&ours, &candle);
                assert!(e < 1e-2, "{ty:?} m={m}: rel L2 {e}");
                let dense = xs.broadcast_matmul(&w.t().unwrap()).unwrap();
                let e = rel_l2(&ours, &dense);
                // The weights' own quantization error on Gaussian values: a Q4_1 step is
                // about 0.4 sigma (rms error ~0.12 relative), a Q8_0 step 1/127 of the block's
                // largest value.
                let bound = if ty == GgmlDType::Q4_1 { 0.2 } else { 0.02 };
                assert!(e < bound, "{ty:?} m={m}: rel L2 against dense {e}");
                if !q8 {
                    // F32 activations: the dequantized weights' own product, up to rounding.
                    let deq = q.dequantize(&dev).unwrap();
                    let exact = xs.broadcast_matmul(&deq.t().unwrap()).unwrap();
                    let e = rel_l2(&ours, &exact);
                    assert!(e < 1e-5, "{ty:?} m={m}: rel L2 against dequantized {e}");
                }
            }
        }
        t.cpu_q8_activations = false;
        let q = QTensor::quantize(
            &Tensor::zeros((8, 256), DType::F32, &dev).unwrap(),
            GgmlDType::Q4K,
        )
        .unwrap();
        let xs = Tensor::zeros((1, 256), DType::F32, &dev).unwrap();
        // K-quants: `kquants_match_candle`; with that loop off, Candle's.
        t.cpu_kquants = Some(false);
        assert!(forward(&Arc::new(q), &xs, &t).unwrap().is_none());
    }
}

/// Prefill's quantized matmul kernels side by side on this CPU (not run by default):
/// `cargo test --release -p candle-offload --lib -- --ignored ab_prefill --nocapture`.
#[cfg(test)]
mod kernel_ab {
    use super::*;
    use candle_core::Device;

    /// The one-column kernel (each weight row against four activation rows at a time) against
    /// the four-column one, over SmolLM2-135M's layer shapes at a 37-token prompt, alternated
    /// 30 times.
    #[test]
    #[ignore]
    fn ab_prefill_kernels() {
        let dev = Device::Cpu;
        for (n, k) in [(576usize, 576usize), (1536, 576), (576, 1536)] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
            let data = q.data().unwrap();
            let m = 37;
            let xs: Vec<f32> = Tensor::randn(0f32, 1.0, (m, k), &dev)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let nb = k / simd::QK;
            let row_bytes = nb * simd::Q4_1_BYTES;
            let min_len = MIN_BLOCKS_PER_TASK.div_ceil(COLS_PER_ITEM * nb * m);
            let mut out = vec![0f32; n * m];
            let (mut t_old, mut t_new) = (0f64, 0f64);
            for _ in 0..30 {
                let t = std::time::Instant::now();
                par_columns(&mut out, m, min_len, &data, row_bytes, |w, col| {
                    simd::dot_q4_1_f32_rows(w, &xs, col)
                });
                t_old += t.elapsed().as_secs_f64();
                let t = std::time::Instant::now();
                par_column_fours(&mut out, m, min_len, &data, row_bytes, |w, cols| {
                    if cols.len() == 4 {
                        simd::dot_q4_1_f32_rows_cols4([w[0], w[1], w[2], w[3]], &xs, cols)
                    } else {
                        for (w, c) in w.iter().zip(cols.iter_mut()) {
                            simd::dot_q4_1_f32_rows(w, &xs, c)
                        }
                    }
                });
                t_new += t.elapsed().as_secs_f64();
            }
            eprintln!(
                "n {n} k {k} m {m}: one-column {:.3} ms, four-column {:.3} ms",
                t_old / 30.0 * 1e3,
                t_new / 30.0 * 1e3
            );
        }
    }
}

/// The output head of SmolLM2-135M (49152 x 576, Q8_0) against one row on this CPU: the F32
/// activations' product, the greedy screen ([`forward_greedy`]) and 8-bit activations, 50 steps
/// each, three rounds (not run by default):
/// `cargo test --release -p candle-offload --lib -- --ignored ab_head --nocapture`.
#[cfg(test)]
mod head_ab {
    use super::*;
    use candle_core::Device;

    #[test]
    #[ignore]
    fn ab_head() {
        let mut t = KernelTuning {
            cpu_kquants: Some(true),
            ..KernelTuning::default()
        };
        let dev = Device::Cpu;
        let (n, k) = (49152usize, 576usize);
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
        let q = Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap());
        let xs = Tensor::randn(0f32, 1.0, (1, k), &dev).unwrap();
        let modes = ["f32", "greedy", "q8"];
        let mut times = vec![Vec::new(); modes.len()];
        for _ in 0..9 {
            for (mode, times) in modes.iter().zip(&mut times) {
                t.cpu_q8_activations = *mode == "q8";
                let start = std::time::Instant::now();
                for _ in 0..50 {
                    let _ = if *mode == "greedy" {
                        forward_greedy(&q, &xs, &t).unwrap().unwrap()
                    } else {
                        forward(&q, &xs, &t).unwrap().unwrap()
                    };
                }
                times.push(start.elapsed().as_secs_f64() * 1e3 / 50.0);
            }
        }
        for (mode, mut t) in modes.iter().zip(times) {
            t.sort_by(f64::total_cmp);
            eprintln!(
                "{mode}: median {:.3} ms (fastest {:.3}) of nine rounds",
                t[4], t[0]
            );
        }
    }
}

/// A decode step's Q4_1 projections of SmolLM2-135M (30 layers of q, k, v, o, gate, up and
/// down against one row of F32 activations), timed on this CPU (not run by default): `cargo
/// test --release -p candle-offload --lib -- --ignored ab_q4_1_decode --nocapture`.
#[cfg(test)]
mod q4_1_ab {
    use super::*;
    use candle_core::Device;

    #[test]
    #[ignore]
    fn ab_q4_1_decode() {
        let mut t = KernelTuning {
            cpu_kquants: Some(true),
            ..KernelTuning::default()
        };
        t.cpu_q8_activations = false;
        let dev = Device::Cpu;
        let shapes = [
            (576usize, 576usize),
            (192, 576),
            (192, 576),
            (576, 576),
            (1536, 576),
            (1536, 576),
            (576, 1536),
        ];
        // Thirty layers' weights, so that a step reads them from memory as the model does.
        let layers: Vec<Vec<(Arc<QTensor>, Tensor)>> = (0..30)
            .map(|_| {
                shapes
                    .iter()
                    .map(|&(n, k)| {
                        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
                        let q = Arc::new(QTensor::quantize(&w, GgmlDType::Q4_1).unwrap());
                        (q, Tensor::randn(0f32, 1.0, (1, k), &dev).unwrap())
                    })
                    .collect()
            })
            .collect();
        let bytes: usize = layers
            .iter()
            .flatten()
            .map(|(q, _)| q.storage_size_in_bytes())
            .sum();
        let mut times = Vec::new();
        for _ in 0..15 {
            let start = std::time::Instant::now();
            for layer in &layers {
                for (q, xs) in layer {
                    forward(q, xs, &t).unwrap().unwrap();
                }
            }
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        eprintln!(
            "Q4_1 decode step: median {:.3} ms (fastest {:.3}) of 15, {:.1} GB/s",
            times[7],
            times[0],
            bytes as f64 / times[7] / 1e6
        );
    }
}

/// The K-quant decode loop against Candle's quantized matmul on this CPU, for a 7B layer's
/// projections (not run by default): `cargo test --release -p candle-offload --lib
/// kquant_ab -- --ignored --nocapture`.
#[cfg(test)]
mod kquant_ab {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module};

    #[test]
    #[ignore]
    fn ab_kquant_layer() {
        let mut t = KernelTuning {
            cpu_kquants: Some(true),
            ..KernelTuning::default()
        };
        // The loop whatever this machine's default (`KQUANT_MIN_THREADS`).
        t.cpu_kquants = Some(true);
        let dev = Device::Cpu;
        let shapes = [
            (576usize, 1536usize, GgmlDType::Q4K),
            (1536, 576 * 4, GgmlDType::Q4K),
            (2048, 2048, GgmlDType::Q4K),
            (4096usize, 4096usize, GgmlDType::Q4K),
            (11008, 4096, GgmlDType::Q4K),
            (4096, 11008, GgmlDType::Q6K),
        ];
        for (n, k, ty) in shapes {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
            let q = Arc::new(QTensor::quantize(&w, ty).unwrap());
            let mm = QMatMul::from_arc(q.clone()).unwrap();
            let xs = Tensor::randn(0f32, 1.0, (1, k), &dev).unwrap();
            let bytes = q.storage_size_in_bytes() as f64;
            for round in 0..2 {
                for ours in [true, false] {
                    let start = std::time::Instant::now();
                    for _ in 0..20 {
                        let _ = if ours {
                            forward(&q, &xs, &t).unwrap().unwrap()
                        } else {
                            mm.forward(&xs).unwrap()
                        };
                    }
                    let s = start.elapsed().as_secs_f64() / 20.0;
                    eprintln!(
                        "round {round} ({n}, {k}) {ty:?} {}: {:.3} ms, {:.1} GB/s",
                        if ours { "ours" } else { "candle" },
                        s * 1e3,
                        bytes / s / 1e9
                    );
                }
            }
        }
    }
}
