//! Many small K-quant matmuls on the CPU in one pass of the worker pool: a
//! mixture-of-experts layer's experts for a decode step or a short prompt (each expert's gate
//! and up against its rows, then each expert's down against its own activations). Candle's
//! matmul would run each of them as a job of its own thread pool, a dozen synchronisations
//! of a few microseconds' work per layer; here every output value of every matmul is one work
//! item of one pass ([`crate::pool`]), each the dot product [`super::cpu_quant::forward`]'s
//! K-quant loop computes (Candle's `vec_dot` over the blocks as they are, against activations
//! quantized to Q8_K once per input), or for Q8_0 weights the prefetching Q8_0 dot product of
//! the dense path (`linear/simd.rs`) against the activations quantized to Q8_0 (as ggml's).

use std::sync::Arc;

use candle_core::quantized::k_quants::{BlockQ8K, QK8_0, QK_K};
use candle_core::quantized::GgmlDType;
use candle_core::quantized::{GgmlType, QTensor};
use candle_core::Result;

use super::cpu_quant::{dot_columns, is_kquant, KRows, KQUANT_MAX_ROWS};
use super::simd::{self, Q8_0_BYTES};
use super::simd_k;
use crate::tuning::KernelTuning;

/// Dot products per work item (about 64 Ki weights at a width of 1024).
const DOTS_PER_TASK: usize = 64;

/// One input of [`kquant_batch`]: `m` rows of `k` F32 values, row-major.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    /// The values.
    pub x: &'a [f32],
    /// The width of a row.
    pub k: usize,
}

/// Whether [`kquant_batch`] takes `w` against rows of width `k`: a 2-D K-quant or Q8_0 tensor
/// on the CPU, `(n, k)`, `k` whole Q8_K blocks.
pub fn supports(w: &QTensor, k: usize) -> bool {
    w.device().is_cpu()
        && (is_kquant(w.dtype()) || w.dtype() == GgmlDType::Q8_0)
        && k > 0
        && k.is_multiple_of(QK_K)
        && matches!(w.shape().dims(), &[_, wk] if wk == k)
}

/// `inputs[i] · wᵀ` for each `(w, i)` of `items` (`w` `(n, k)` K-quant blocks, input `i` at
/// most [`KQUANT_MAX_ROWS`] rows of the same `k`), all in one pass of the pool: item `j`'s
/// result is `m × n`, row-major. Each input is quantized to Q8_K once, however many items read
/// it. `None` where an item is not [`supports`]ed or an input has no rows or too many, so that
/// the caller takes another path.
pub fn kquant_batch(
    inputs: &[Rows<'_>],
    items: &[(&Arc<QTensor>, usize)],
    tuning: &KernelTuning,
) -> Result<Option<Vec<Vec<f32>>>> {
    let pf = tuning.cpu_prefetch_bytes;
    let mut ms = Vec::with_capacity(inputs.len());
    for r in inputs {
        if r.k == 0 || !r.k.is_multiple_of(QK_K) || !r.x.len().is_multiple_of(r.k) {
            return Ok(None);
        }
        let m = r.x.len() / r.k;
        if m == 0 || m > KQUANT_MAX_ROWS {
            return Ok(None);
        }
        ms.push(m);
    }
    let mut ns = Vec::with_capacity(items.len());
    for &(w, i) in items {
        let Some(input) = inputs.get(i) else {
            candle_core::bail!("expert matmul: no input {i} of {}", inputs.len());
        };
        if !supports(w, input.k) {
            return Ok(None);
        }
        ns.push(w.shape().dims()[0]);
    }
    let datas = items
        .iter()
        .map(|(w, _)| w.data())
        .collect::<Result<Vec<_>>>()?;
    let Some(rows) = items
        .iter()
        .zip(&datas)
        .map(|((w, _), d)| Blocks::new(w.dtype(), d))
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(None);
    };
    for ((rows, &n), &(w, i)) in rows.iter().zip(&ns).zip(items) {
        let nb = inputs[i].k / rows.block_len();
        if rows.blocks() < n * nb {
            candle_core::bail!(
                "expert matmul: {} blocks of {:?} for ({n}, {})",
                rows.blocks(),
                w.dtype(),
                inputs[i].k
            );
        }
    }
    // Each input quantized once per activation type its items read.
    let wants = |q8_0: bool| -> Vec<bool> {
        let mut w = vec![false; inputs.len()];
        for (r, &(_, i)) in rows.iter().zip(items) {
            w[i] |= matches!(r, Blocks::Q8_0(_)) == q8_0;
        }
        w
    };
    let yq = quantize_inputs(inputs, &wants(false));
    let y0: Vec<Vec<u8>> = inputs
        .iter()
        .zip(wants(true))
        .map(|(r, want)| {
            if !want {
                return Vec::new();
            }
            let mut y = vec![0u8; r.x.len() / QK8_0 * Q8_0_BYTES];
            simd::quantize_q8_0(r.x, &mut y);
            y
        })
        .collect();
    // Their scales as f32, converted once for every weight row.
    let dy0: Vec<Vec<f32>> = y0.iter().map(|y| simd::q8_0_scales(y)).collect();
    // Item j's values at starts[j]: column-major, its m values of output column c at c * m.
    let sizes: Vec<usize> = items
        .iter()
        .zip(&ns)
        .map(|(&(_, i), &n)| n * ms[i])
        .collect();
    let mut starts = Vec::with_capacity(sizes.len());
    let mut total = 0;
    for s in &sizes {
        starts.push(total);
        total += s;
    }
    let mut out = vec![0f32; total];
    crate::pool::for_each_chunk_mut(&mut out, DOTS_PER_TASK, |task, part| {
        let e0 = task * DOTS_PER_TASK;
        // The part's values run through items j, j + 1, ...: each run's item, rows and
        // activations are looked up once, and its (column, row) counted up from the first.
        let mut j = starts.partition_point(|&s| s <= e0) - 1;
        let mut local = e0 - starts[j];
        let mut done = 0;
        while done < part.len() {
            let i = items[j].1;
            let (m, k) = (ms[i], inputs[i].k);
            let len = (sizes[j] - local).min(part.len() - done);
            let run = &mut part[done..done + len];
            let at = (local / m, local % m);
            match &rows[j] {
                Blocks::K(rows) => rows.dot_run(at, m, k / QK_K, k, &yq[i], pf, run),
                Blocks::Q8_0(b) => dot_columns(
                    b,
                    &y0[i],
                    at,
                    m,
                    k / QK8_0 * Q8_0_BYTES,
                    run,
                    |x, y| simd::dot_q8_0_q8_0(x, y, pf),
                    |x, ys, out| {
                        simd::dot_q8_0_q8_0_rows(
                            x,
                            ys,
                            &dy0[i][..out.len() * (x.len() / Q8_0_BYTES)],
                            out,
                            pf,
                        )
                    },
                ),
            }
            done += len;
            j += 1;
            local = 0;
        }
    });
    Ok(Some(
        items
            .iter()
            .enumerate()
            .map(|(j, &(_, i))| {
                super::cpu_quant::transpose(
                    out[starts[j]..starts[j] + sizes[j]].to_vec(),
                    ms[i],
                    ns[j],
                )
            })
            .collect(),
    ))
}

/// Each input's rows quantized to Q8_K blocks where `want` says so (empty elsewhere).
fn quantize_inputs(inputs: &[Rows<'_>], want: &[bool]) -> Vec<Vec<BlockQ8K>> {
    inputs
        .iter()
        .zip(want)
        .map(|(r, &want)| {
            // Rows of whole blocks, one after the other: quantized as one run of blocks.
            let mut y = vec![BlockQ8K::zeros(); if want { r.x.len() / QK_K } else { 0 }];
            if want {
                simd_k::quantize_q8k(r.x, &mut y);
            }
            y
        })
        .collect()
}

/// A weight's blocks as the pass reads them.
enum Blocks<'a> {
    /// K-quant blocks, against Q8_K activations.
    K(KRows<'a>),
    /// Q8_0 blocks (their bytes), against Q8_0 activations.
    Q8_0(&'a [u8]),
}

impl<'a> Blocks<'a> {
    fn new(ty: GgmlDType, bytes: &'a [u8]) -> Option<Self> {
        match ty {
            GgmlDType::Q8_0 => bytes
                .len()
                .is_multiple_of(Q8_0_BYTES)
                .then_some(Self::Q8_0(bytes)),
            ty => KRows::new(ty, bytes).map(Self::K),
        }
    }

    fn blocks(&self) -> usize {
        match self {
            Self::K(r) => r.blocks(),
            Self::Q8_0(b) => b.len() / Q8_0_BYTES,
        }
    }

    /// Elements a block holds.
    fn block_len(&self) -> usize {
        match self {
            Self::K(_) => QK_K,
            Self::Q8_0(_) => QK8_0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::{Device, Tensor};

    /// Each item's result is the dequantized weight's product with its input, within the
    /// error of quantizing the activations to Q8_K, for mixed block types, widths and rows.
    #[test]
    fn batch_matches_each_matmul() {
        let dev = Device::Cpu;
        let t = KernelTuning::default();
        let q = |n, k, ty| {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
            Arc::new(QTensor::quantize(&w, ty).unwrap())
        };
        let ws = [
            q(48, 512, GgmlDType::Q4K),
            q(32, 512, GgmlDType::Q6K),
            q(16, 256, GgmlDType::Q4K),
            q(24, 512, GgmlDType::Q8_0),
            q(40, 256, GgmlDType::Q8_0),
        ];
        // Q8_0, Q4_K and Q6_K against 8 and 6 rows: whole columns through the four-row kernels,
        // and runs that start and end inside a column (64 dots a task).
        let xs: Vec<Vec<f32>> = [(3usize, 512usize), (1, 512), (8, 256), (6, 512)]
            .iter()
            .map(|&(m, k)| {
                Tensor::randn(0f32, 1.0, m * k, &dev)
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
            .collect();
        let inputs = [
            Rows { x: &xs[0], k: 512 },
            Rows { x: &xs[1], k: 512 },
            Rows { x: &xs[2], k: 256 },
            Rows { x: &xs[3], k: 512 },
        ];
        let items = [
            (&ws[0], 0),
            (&ws[1], 0),
            (&ws[0], 1),
            (&ws[2], 2),
            (&ws[3], 0),
            (&ws[3], 1),
            (&ws[4], 2),
            (&ws[3], 3),
            (&ws[1], 3),
        ];
        let got = kquant_batch(&inputs, &items, &t).unwrap().unwrap();
        for (&(w, i), y) in items.iter().zip(&got) {
            let k = inputs[i].k;
            let x = Tensor::from_slice(inputs[i].x, (inputs[i].x.len() / k, k), &dev).unwrap();
            let want = x
                .matmul(&w.dequantize(&dev).unwrap().t().unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert_eq!(y.len(), want.len());
            let err: f32 = y.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum();
            let norm: f32 = want.iter().map(|b| b * b).sum();
            assert!((err / norm).sqrt() < 0.02, "rel L2 {}", (err / norm).sqrt());
        }
        // Too many rows, or a type it has no loop for: the caller's path.
        let long = vec![0f32; 9 * 256];
        let r = [Rows { x: &long, k: 256 }];
        assert!(kquant_batch(&r, &[(&ws[2], 0)], &t).unwrap().is_none());
        let q4 = q(16, 256, GgmlDType::Q4_0);
        let r = [Rows { x: &xs[2], k: 256 }];
        assert!(kquant_batch(&r, &[(&q4, 0)], &t).unwrap().is_none());
    }
}
