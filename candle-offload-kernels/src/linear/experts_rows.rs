//! A prompt's rows through their routed experts ([`qexperts_rows`]): the rows sorted by expert,
//! each expert a SiLU-gated MLP of GGML blocks. On a GPU, two launches for all the experts of
//! a layer (every expert's gate and up, then every down projection), each block of threads one
//! chunk of at most eight rows of one expert, instead of a gather, three matmuls, a scale and
//! a scatter per expert: a 512-token prompt routes its rows to most of a layer's experts, and
//! their launches, not their arithmetic, took its time. An expert with many rows (from
//! [`KernelTuning::experts_gemm_min_rows`]) goes instead through its weights dequantized to
//! 16 bits and cuBLAS, on tensor cores, as a prompt's dense projections do
//! ([`crate::gemm::qlinear_prefill`]).

use candle_core::quantized::QTensor;
use candle_core::{DType, Result, Tensor};

use crate::linear::experts::{shared_shape, types_fit};
use crate::tuning::KernelTuning;

/// Rows a block of threads takes of one expert (`ROWS_CHUNK_MAX` in kernels/qblocks.cuh).
pub(crate) const ROWS_CHUNK: usize = 8;

/// Chunks a launch takes at most (the grid's second dimension).
const MAX_CHUNKS: usize = 65_535;

/// One expert of a prompt's layer and how many of the sorted rows are its.
#[derive(Debug, Clone, Copy)]
pub struct QExpertRows<'a> {
    /// `(inter, hidden)`.
    pub gate: &'a QTensor,
    /// `(inter, hidden)`, gate's block type.
    pub up: &'a QTensor,
    /// `(hidden, inter)`.
    pub down: &'a QTensor,
    /// Its rows: the next `rows` of x after the experts before it.
    pub rows: usize,
}

/// Whether [`qexperts_rows`] takes rows like `x` (…, hidden) and `experts`: what the decode
/// row's grouped kernels need of the types and widths
/// ([`qexperts_row_fits`](crate::linear::qexperts_row_fits)), x (F32, F16 or BF16) of
/// `hidden` columns on a GPU, the experts' rows in at most 65,535 chunks of eight. (Their
/// count is [`qexperts_rows`]'s to check against its x: this one may be asked before the rows
/// are sorted.)
pub fn qexperts_rows_fits(
    x: &Tensor,
    experts: &[QExpertRows<'_>],
    tuning: &KernelTuning,
) -> Result<bool> {
    let Some((types, (hidden, inter))) =
        shared_shape(experts.iter().map(|e| [e.gate, e.up, e.down]))
    else {
        return Ok(false);
    };
    let Ok((_, width)) = x.dims2() else {
        return Ok(false);
    };
    let chunks: usize = experts.iter().map(|e| e.rows.div_ceil(ROWS_CHUNK)).sum();
    Ok(x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && width == hidden
        && chunks <= MAX_CHUNKS
        && types_fit(types, (hidden, inter), tuning))
}

/// Each expert's rows of `x` (rows, hidden), sorted by expert (`experts[0]`'s first), through
/// its MLP: `down_e(silu(gate_e · x) · (up_e · x))`, unweighted, `(rows, hidden)` in x's dtype
/// (x and the SwiGLU's output quantized to 8-bit blocks, integer dot products: by every block
/// of threads, variant 3, or once for all rows where [`KernelTuning::experts_rows_x_once`],
/// variant 4), except the experts with at least [`KernelTuning::experts_gemm_min_rows`] rows
/// ([`qexperts_rows_gemm_takes`]): each of those through 16-bit weights and cuBLAS. Only where
/// [`qexperts_rows_fits`] and the experts' rows are x's: an error otherwise.
pub fn qexperts_rows(
    x: &Tensor,
    experts: &[QExpertRows<'_>],
    tuning: &KernelTuning,
) -> Result<Tensor> {
    crate::util::check_dtypes("qexperts_rows", &[x])?;
    let rows: usize = experts.iter().map(|e| e.rows).sum();
    if x.dims2()?.0 != rows || !qexperts_rows_fits(x, experts, tuning)? {
        candle_core::bail!(
            "qexperts_rows: x {:?} and {} experts do not fit the grouped kernels",
            x.shape(),
            experts.len()
        );
    }
    let gemm: Vec<bool> = experts
        .iter()
        .map(|e| qexperts_rows_gemm_takes(e, tuning))
        .collect();
    launch(x, experts, &gemm, tuning.experts_rows_x_once)
}

/// Whether [`qexperts_rows`] takes `expert` through 16-bit weights and cuBLAS: at least
/// [`KernelTuning::experts_gemm_min_rows`] rows (not 0), and all three weights of a block type
/// the dequantizing kernel has.
pub fn qexperts_rows_gemm_takes(expert: &QExpertRows<'_>, tuning: &KernelTuning) -> bool {
    let min = tuning.experts_gemm_min_rows;
    min > 0
        && expert.rows >= min
        && [expert.gate, expert.up, expert.down]
            .iter()
            .all(|w| crate::linear::qlinear_small_type(w.dtype()).is_some())
}

#[cfg(feature = "cuda")]
fn launch(x: &Tensor, experts: &[QExpertRows<'_>], gemm: &[bool], x_once: bool) -> Result<Tensor> {
    use candle_core::backend::BackendDevice;
    let x = if crate::util::aligned16(x.layout(), x.dtype()) && x.is_contiguous() {
        x.clone()
    } else {
        x.force_contiguous()?
    };
    let rows: Vec<usize> = experts.iter().map(|e| e.rows).collect();
    let chunks = row_chunks(&rows, gemm);
    // The experts through cuBLAS, with their first rows.
    let mut at = 0;
    let heavy: Vec<crate::gemm::ExpertGemm<'_>> = experts
        .iter()
        .zip(gemm)
        .filter_map(|(e, &g)| {
            at += e.rows;
            g.then_some(crate::gemm::ExpertGemm {
                weights: [e.gate, e.up, e.down],
                first: at - e.rows,
                rows: e.rows,
            })
        })
        .collect();
    // The grouped kernels' experts (one expert goes by value, with no table of chunks).
    let grouped = if experts.len() == 1 {
        !gemm[0]
    } else {
        !chunks.is_empty()
    };
    let candle_core::Device::Cuda(dev) = x.device() else {
        candle_core::bail!("qexperts_rows: x is not on a GPU")
    };
    let (s, l) = x.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*s else {
        candle_core::bail!("qexperts_rows: x is not on a GPU")
    };
    let mut out = if grouped {
        let weights: Vec<[&QTensor; 3]> = experts.iter().map(|e| [e.gate, e.up, e.down]).collect();
        crate::linear::rows_cuda::qlinear_rows_experts(
            (s, l),
            &weights,
            &chunks,
            ROWS_CHUNK,
            x_once,
        )?
    } else {
        dev.zeros_impl(x.shape(), x.dtype())?
    };
    // The rest, each expert's rows written over its part of the output (which the grouped
    // launches left alone): straight into it where x is 16-bit, else through a 16-bit copy.
    let _span = tracing::trace_span!("qexperts_rows.gemm", experts = heavy.len()).entered();
    let wide = crate::gemm::gemm_dtype(x.dtype());
    if heavy.is_empty() || wide == x.dtype() {
        crate::gemm::experts_mlp(s, l, &heavy, &mut out)?;
        return Ok(storage_tensor(out, &x));
    }
    let xw = x.to_dtype(wide)?;
    let mut yw = dev.zeros_impl(x.shape(), wide)?;
    {
        let (sw, lw) = xw.storage_and_layout();
        let candle_core::Storage::Cuda(sw) = &*sw else {
            candle_core::bail!("qexperts_rows: x is not on a GPU")
        };
        crate::gemm::experts_mlp(sw, lw, &heavy, &mut yw)?;
    }
    let yw = storage_tensor(yw, &x).to_dtype(x.dtype())?;
    let out = storage_tensor(out, &x);
    for e in &heavy {
        out.slice_set(&yw.narrow(0, e.first, e.rows)?, 0, e.first)?;
    }
    Ok(out)
}

/// `s` as a tensor of x's shape.
#[cfg(feature = "cuda")]
fn storage_tensor(s: candle_core::CudaStorage, x: &Tensor) -> Tensor {
    Tensor::from_storage(
        candle_core::Storage::Cuda(s),
        x.shape().clone(),
        candle_core::op::BackpropOp::none(),
        false,
    )
}

#[cfg(not(feature = "cuda"))]
fn launch(
    _x: &Tensor,
    _experts: &[QExpertRows<'_>],
    _gemm: &[bool],
    _x_once: bool,
) -> Result<Tensor> {
    candle_core::bail!("qexperts_rows: needs a build with `--features cuda`")
}

/// The chunks of the sorted rows: `[expert, first row, rows, 0]`, at most [`ROWS_CHUNK`] rows
/// each, expert by expert, none for the experts `skip` marks (their rows are still counted).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn row_chunks(rows: &[usize], skip: &[bool]) -> Vec<[u32; 4]> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for (e, &n) in rows.iter().enumerate() {
        let mut c = if skip.get(e) == Some(&true) { n } else { 0 };
        while c < n {
            let m = ROWS_CHUNK.min(n - c);
            out.push([e as u32, (at + c) as u32, m as u32, 0]);
            c += m;
        }
        at += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_each_experts_rows_in_order() {
        let chunks = row_chunks(&[3, 0, 17, 8], &[]);
        assert_eq!(
            chunks,
            vec![
                [0, 0, 3, 0],
                [2, 3, 8, 0],
                [2, 11, 8, 0],
                [2, 19, 1, 0],
                [3, 20, 8, 0]
            ]
        );
        assert!(row_chunks(&[], &[]).is_empty());
        // The skipped experts' rows still count towards the next ones' first rows.
        assert_eq!(
            row_chunks(&[3, 0, 17, 8], &[false, false, true, false]),
            vec![[0, 0, 3, 0], [3, 20, 8, 0]]
        );
        assert!(row_chunks(&[5], &[true]).is_empty());
    }

    #[test]
    fn gemm_takes_experts_from_the_tuned_rows() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let w = |n: usize, k: usize, t| -> Result<QTensor> {
            QTensor::quantize(&Tensor::zeros((n, k), DType::F32, &dev)?, t)
        };
        use candle_core::quantized::GgmlDType as G;
        let (g, u, d) = (
            w(256, 256, G::Q4K)?,
            w(256, 256, G::Q4K)?,
            w(256, 256, G::Q6K)?,
        );
        let at = |rows| QExpertRows {
            gate: &g,
            up: &u,
            down: &d,
            rows,
        };
        let mut t = KernelTuning {
            experts_gemm_min_rows: 32,
            ..KernelTuning::default()
        };
        assert!(
            !qexperts_rows_gemm_takes(&at(31), &t)
                && qexperts_rows_gemm_takes(&at(32), &t)
                && qexperts_rows_gemm_takes(&at(500), &t)
        );
        t.experts_gemm_min_rows = 0;
        assert!(!qexperts_rows_gemm_takes(&at(500), &t));
        // A block type without the dequantizing kernel stays with the grouped kernels.
        let q2 = w(256, 256, G::Q2K)?;
        t.experts_gemm_min_rows = 1;
        let odd = QExpertRows {
            down: &q2,
            ..at(100)
        };
        assert!(!qexperts_rows_gemm_takes(&odd, &t));
        Ok(())
    }

    #[test]
    fn a_cpu_x_never_fits() -> Result<()> {
        let x = Tensor::zeros((2, 64), DType::F32, &candle_core::Device::Cpu)?;
        assert!(!qexperts_rows_fits(&x, &[], &KernelTuning::default())?);
        Ok(())
    }
}
