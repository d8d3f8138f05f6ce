//! A CPU matmul of dense F16 or BF16 weights (F32 in the op, not taken by [`forward`]) against a few activation rows (a decode
//! step), as a Candle [`CustomOp2`]: `xs · wᵀ` with `w` (n, k) and at most [`MAX_ROWS`] rows of
//! `xs`, each weight row read once per call and multiplied against every activation row in
//! F32 (`simd_dense::dot_dense_rows_add`: F16C/AVX2 or AVX-512 conversion and FMA, detected at run
//! time), the output columns split over the spinning workers of [`crate::pool`]. Candle 0.11's CPU
//! matmul runs a decode step through the `gemm` crate, which is not built for one row, and
//! widens a BF16 weight to F32 on every call.
//!
//! [`forward`] returns `None` for anything it does not cover (another device, dtype or layout,
//! more rows, a tensor that tracks gradients), and the caller then runs Candle's matmul.
//! Results are Candle's F32 product of the same weights to float-summation order, rounded once
//! to `xs`'s dtype.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::linear::cpu_quant::transpose;
use crate::linear::simd_dense::{self, DenseRow};

/// The most activation rows [`forward`] takes; from there on Candle's GEMM runs (its register
/// tiling reuses each loaded weight over more rows than a dot product per row does).
pub const MAX_ROWS: usize = 8;

/// Output columns per work item at the least.
const MIN_COLS_PER_ITEM: usize = 16;

/// Work items per thread: enough that a thread the OS did not schedule in time holds up at
/// most a few of them.
const ITEMS_PER_THREAD: usize = 4;

/// Whether [`forward`] multiplies by `w`: a 2-D contiguous F16 or BF16 tensor on the CPU that
/// tracks no gradient. F32 weights keep Candle's matmul, though the op is faster on one row
/// (docs/tuning.md, CPU threads): the CPU F32 path then stays bit-identical to a plain
/// candle-nn model's (the own-model test's promise), and Candle matched the op at eight rows.
pub fn supports(w: &Tensor) -> bool {
    matches!(w.dtype(), DType::F16 | DType::BF16) && dense_on_cpu(w)
}

/// A 2-D contiguous weight on the CPU that tracks no gradient: what the op reads, whatever its
/// float dtype.
fn dense_on_cpu(w: &Tensor) -> bool {
    w.device().is_cpu() && w.rank() == 2 && w.is_contiguous() && !w.track_op()
}

/// Whether [`forward`] multiplies `xs` by `w` (rather than declining): [`supports`] says yes,
/// and `xs` is on the CPU, tracks no gradient, is in `w`'s dtype or F32 and has 1 to
/// [`MAX_ROWS`] rows of a non-zero width (an `xs` of another width than `w`'s is an error).
pub fn applies(w: &Tensor, xs: &Tensor) -> bool {
    if !takes(w, xs) {
        return false;
    }
    let k = w.dims()[1];
    let m = xs.elem_count() / k.max(1);
    xs.dims().last() != Some(&k) || (k != 0 && m != 0 && m <= MAX_ROWS)
}

/// The checks of [`applies`] before the shapes: [`supports`], and `xs` on the CPU, without a
/// gradient, in `w`'s dtype or F32.
fn takes(w: &Tensor, xs: &Tensor) -> bool {
    supports(w)
        && xs.device().is_cpu()
        && !xs.track_op()
        && (xs.dtype() == w.dtype() || xs.dtype() == DType::F32)
}

/// `xs · wᵀ` for `w` of shape (n, k) and `xs` (..., k) of at most [`MAX_ROWS`] rows in `w`'s
/// dtype or F32 on the CPU, accumulated in F32, in `xs`'s dtype; `None` when [`supports`] says
/// no or `xs` does not fit, so that the caller runs Candle's matmul instead. `tuning` gives the
/// prefetch distance.
pub fn forward(
    w: &Tensor,
    xs: &Tensor,
    tuning: &crate::tuning::KernelTuning,
) -> Result<Option<Tensor>> {
    if !takes(w, xs) {
        return Ok(None);
    }
    let (n, k) = w.dims2()?;
    let dims = xs.dims();
    if dims.last() != Some(&k) {
        candle_core::bail!("dense matmul: input {dims:?} against weight ({n}, {k})");
    }
    let m = xs.elem_count() / k.max(1);
    if k == 0 || m == 0 || m > MAX_ROWS {
        return Ok(None);
    }
    // The activations in F32 once per call, contiguous (a strided view is copied).
    let x32 = xs.to_dtype(DType::F32)?.reshape((m, k))?.contiguous()?;
    let op = DenseMatMul {
        pf: tuning.cpu_prefetch_bytes,
    };
    let ys = x32.apply_op2_no_bwd(w, &op)?;
    let mut out = dims.to_vec();
    *out.last_mut().expect("non-empty dims") = n;
    Ok(Some(ys.to_dtype(xs.dtype())?.reshape(out)?))
}

/// `xs · wᵀ` in F32 for a router's logits: `w` (n, k) a contiguous F32, F16 or BF16 tensor on
/// the CPU and `xs` (m, k) of any float dtype with at most [`MAX_ROWS`] rows, neither
/// tracking a gradient, computed as [`forward`] computes it (F32 weights included); `None`
/// elsewhere (the caller composes Candle's matmul). `(m, n)` F32.
pub fn logits(
    w: &Tensor,
    xs: &Tensor,
    tuning: &crate::tuning::KernelTuning,
) -> Result<Option<Tensor>> {
    let (m, k) = xs.dims2()?;
    let takes = matches!(w.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && dense_on_cpu(w)
        && w.dims()[1] == k
        && xs.device().is_cpu()
        && !xs.track_op()
        && (1..=MAX_ROWS).contains(&m)
        && k > 0;
    if !takes {
        return Ok(None);
    }
    let x32 = xs.to_dtype(DType::F32)?.contiguous()?;
    let op = DenseMatMul {
        pf: tuning.cpu_prefetch_bytes,
    };
    Ok(Some(x32.apply_op2_no_bwd(w, &op)?))
}

/// The op: F32 activations (m, k) against a dense weight (n, k), F32 out (m, n).
struct DenseMatMul {
    /// The prefetch distance.
    pf: usize,
}

impl CustomOp2 for DenseMatMul {
    fn name(&self) -> &'static str {
        "candle-offload-cpu-dense-matmul"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xs_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k) = xs_l.shape().dims2()?;
        let (n, kw) = w_l.shape().dims2()?;
        if k != kw {
            candle_core::bail!("dense matmul: input ({m}, {k}) against weight ({n}, {kw})");
        }
        let xs = match (xs, xs_l.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((a, b))) => &v[a..b],
            _ => candle_core::bail!("dense matmul: input must be contiguous F32"),
        };
        let Some((a, b)) = w_l.contiguous_offsets() else {
            candle_core::bail!("dense matmul: weight must be contiguous");
        };
        let mut out_t = vec![0f32; n * m];
        match w {
            CpuStorage::F16(w) => columns(&mut out_t, (m, k), xs, self.pf, |c| {
                DenseRow::F16(&w[a + c * k..a + (c + 1) * k])
            }),
            CpuStorage::BF16(w) => columns(&mut out_t, (m, k), xs, self.pf, |c| {
                DenseRow::BF16(&w[a + c * k..a + (c + 1) * k])
            }),
            CpuStorage::F32(w) => columns(&mut out_t, (m, k), xs, self.pf, |c| {
                DenseRow::F32(&w[a + c * k..a + (c + 1) * k])
            }),
            other => candle_core::bail!("dense matmul: weight dtype {:?}", other.dtype()),
        }
        debug_assert!(b - a == n * k);
        Ok((CpuStorage::F32(transpose(out_t, m, n)), Shape::from((m, n))))
    }
}

/// Fills `out_t`, the output in column-major order (`m` values per column), on the spinning
/// pool: column `c` is weight row `row(c)` against the `m` rows of `xs`. Work items are ranges
/// of columns, each writing its own slice. With several rows, `k` is walked in blocks whose
/// activations fit in L1 ([`X_BLOCK_BYTES`]), all the item's columns per block: the
/// activations are re-read for every weight row, and from L2 that, not memory, bounded the
/// kernel.
fn columns<'a>(
    out_t: &mut [f32],
    (m, k): (usize, usize),
    xs: &[f32],
    pf: usize,
    row: impl Fn(usize) -> DenseRow<'a> + Sync,
) {
    let n = out_t.len() / m;
    let cols = cols_per_item(n, crate::pool::threads());
    let kb = k_block(m, k);
    crate::pool::for_each_chunk_mut(out_t, cols * m, |task, part| {
        let col0 = task * cols;
        for k0 in (0..k).step_by(kb) {
            let len = kb.min(k - k0);
            for (c, col) in part.chunks_mut(m).enumerate() {
                let w = match row(col0 + c) {
                    DenseRow::F16(w) => DenseRow::F16(&w[k0..k0 + len]),
                    DenseRow::BF16(w) => DenseRow::BF16(&w[k0..k0 + len]),
                    DenseRow::F32(w) => DenseRow::F32(&w[k0..k0 + len]),
                };
                simd_dense::dot_dense_rows_add(w, &xs[k0..], k, col, pf);
            }
        }
    });
}

/// Bytes of activations (F32, all rows) one block of `k` holds, to stay in L1.
const X_BLOCK_BYTES: usize = 32 << 10;

/// The block of `k` for `m` rows: all of it for one row (the weights' rows then stream in
/// order), else what [`X_BLOCK_BYTES`] hold, a multiple of 64.
fn k_block(m: usize, k: usize) -> usize {
    if m <= 1 {
        return k.max(1);
    }
    (X_BLOCK_BYTES / (4 * m) / 64 * 64).clamp(64, k.max(64))
}

/// Output columns per work item for `n` columns on `threads` threads.
fn cols_per_item(n: usize, threads: usize) -> usize {
    n.div_ceil(ITEMS_PER_THREAD * threads.max(1))
        .max(MIN_COLS_PER_ITEM)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::tuning::KernelTuning;

    /// max |got - want| / max |want|, in F32.
    fn rel_max(got: &Tensor, want: &Tensor) -> f32 {
        assert_eq!(got.dims(), want.dims());
        let got = got.to_dtype(DType::F32).unwrap();
        let d = (&got - want).unwrap().abs().unwrap().flatten_all().unwrap();
        let w = want.abs().unwrap().flatten_all().unwrap();
        let d = d.max(0).unwrap().to_scalar::<f32>().unwrap();
        d / w.max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// Against Candle's F32 matmul of the same (rounded) weights: 1 to 8 rows, leading batch
    /// dims, widths that are not multiples of the 8 or 16 lanes, column counts that are not
    /// multiples of a work item; F32 activations within F32 rounding, activations in the
    /// weights' dtype within that dtype's rounding of the output.
    #[test]
    fn agrees_with_candle_matmul() {
        let dev = Device::Cpu;
        let shapes: [(&[usize], usize); 9] = [
            (&[1, 1, 37], 23),
            (&[1, 64], 1),
            (&[2, 100], 50),
            (&[3, 1, 17], 70),
            (&[4, 33], 129),
            (&[1, 5, 255], 16),
            (&[6, 576], 300),
            (&[7, 15], 9),
            (&[2, 4, 4099], 133),
        ];
        for dtype in [DType::F16, DType::BF16] {
            for (i, &(xs_dims, n)) in shapes.iter().enumerate() {
                let k = *xs_dims.last().unwrap();
                let s = 1.0 / (k as f64).sqrt();
                let w = Tensor::randn(0f32, s as f32, (n, k), &dev).unwrap();
                let w = w.to_dtype(dtype).unwrap();
                let w32 = w.to_dtype(DType::F32).unwrap();
                assert!(supports(&w));
                let x32 = Tensor::randn(0f32, 1.0, xs_dims, &dev).unwrap();
                let want = x32.broadcast_matmul(&w32.t().unwrap()).unwrap();
                let got = forward(&w, &x32, &KernelTuning::default())
                    .unwrap()
                    .expect("F32 activations are taken");
                assert_eq!(got.dtype(), DType::F32);
                let e = rel_max(&got, &want);
                assert!(e <= 1e-5, "{dtype:?} {i} {xs_dims:?} x {n}: F32 {e}");
                let xd = x32.to_dtype(dtype).unwrap();
                let want = xd
                    .to_dtype(DType::F32)
                    .unwrap()
                    .broadcast_matmul(&w32.t().unwrap())
                    .unwrap();
                let got = forward(&w, &xd, &KernelTuning::default())
                    .unwrap()
                    .expect("same-dtype activations");
                assert_eq!(got.dtype(), dtype);
                let e = rel_max(&got, &want);
                assert!(e <= 1e-2, "{dtype:?} {i} {xs_dims:?} x {n}: {e}");
                // Candle's own matmul in the dtype, for the record of what it replaces.
                let candle = xd.broadcast_matmul(&w.t().unwrap()).unwrap();
                assert!(rel_max(&candle, &want) <= 1e-2);
            }
            // F32 weights, one row, through the op (the benchmark's path).
            let w = Tensor::randn(0f32, 0.1, (131, 4099), &dev).unwrap();
            let x = Tensor::randn(0f32, 1.0, (1, 1, 4099), &dev).unwrap();
            let want = x.broadcast_matmul(&w.t().unwrap()).unwrap();
            let got = x
                .reshape((1, 4099))
                .unwrap()
                .apply_op2_no_bwd(&w, &DenseMatMul { pf: 4096 });
            let got = got.unwrap().reshape((1, 1, 131)).unwrap();
            assert!(rel_max(&got, &want) <= 1e-5);
            // A strided input (a transposed view): made contiguous first.
            let w = Tensor::randn(0f32, 0.1, (45, 64), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let x = Tensor::randn(0f32, 1.0, (64, 3), &dev)
                .unwrap()
                .t()
                .unwrap();
            assert!(!x.is_contiguous());
            let want = x
                .matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap())
                .unwrap();
            let got = forward(&w, &x, &KernelTuning::default()).unwrap().unwrap();
            assert!(rel_max(&got, &want) <= 1e-5);
            let got = forward(&w, &x.to_dtype(dtype).unwrap(), &KernelTuning::default())
                .unwrap()
                .unwrap();
            let want = x
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap())
                .unwrap();
            assert!(rel_max(&got, &want) <= 1e-2);
        }
    }

    /// What the op leaves to Candle: more than [`MAX_ROWS`] rows, F32 or non-contiguous
    /// weights, activations in another dtype, tensors that track gradients; a width that does
    /// not match is an error.
    #[test]
    fn refuses_what_it_does_not_cover() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (8, 32), &dev).unwrap();
        let wh = w.to_dtype(DType::F16).unwrap();
        let x = |rows: usize, dtype: DType| {
            Tensor::randn(0f32, 1.0, (rows, 32), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        assert!(
            forward(&wh, &x(MAX_ROWS, DType::F16), &KernelTuning::default())
                .unwrap()
                .is_some()
        );
        assert!(
            forward(&wh, &x(MAX_ROWS + 1, DType::F16), &KernelTuning::default())
                .unwrap()
                .is_none()
        );
        assert!(forward(&w, &x(1, DType::F32), &KernelTuning::default())
            .unwrap()
            .is_none());
        assert!(forward(&wh, &x(1, DType::BF16), &KernelTuning::default())
            .unwrap()
            .is_none());
        let wt = Tensor::randn(0f32, 1.0, (32, 8), &dev)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap()
            .t()
            .unwrap();
        assert!(forward(&wt, &x(1, DType::F16), &KernelTuning::default())
            .unwrap()
            .is_none());
        let var = Var::from_tensor(&wh).unwrap();
        assert!(
            forward(var.as_tensor(), &x(1, DType::F16), &KernelTuning::default())
                .unwrap()
                .is_none()
        );
        assert!(forward(
            &wh,
            &x(1, DType::F16).narrow(1, 0, 16).unwrap(),
            &KernelTuning::default()
        )
        .is_err());
        // A router's logits take F32 weights too, but no weight or row that tracks a gradient.
        let logits_of =
            |w: &Tensor, xs: &Tensor| logits(w, xs, &KernelTuning::default()).unwrap().is_some();
        assert!(logits_of(&w, &x(1, DType::F32)));
        assert!(!logits_of(var.as_tensor(), &x(1, DType::F32)));
        let row = Var::from_tensor(&x(1, DType::F32)).unwrap();
        assert!(!logits_of(&w, row.as_tensor()));
    }

    #[test]
    fn work_items() {
        assert_eq!(cols_per_item(4096, 2), 512);
        assert_eq!(cols_per_item(4096, 16), 64);
        assert_eq!(cols_per_item(23, 16), 16);
        assert_eq!(cols_per_item(1, 1), 16);
        assert_eq!(k_block(1, 11008), 11008);
        assert_eq!(k_block(8, 11008), 1024);
        assert_eq!(k_block(3, 100), 100);
        assert_eq!(k_block(8, 17), 64);
    }
}

/// Decode's dense matmul against Candle's on this CPU (not run by default):
/// `cargo test --release -p candle-offload --lib -- --ignored ab_dense --nocapture`.
#[cfg(test)]
mod kernel_ab {
    use std::time::{Duration, Instant};

    use candle_core::Device;

    use super::*;
    use crate::tuning::KernelTuning;

    /// The 7B LLaMA layer shapes (n x k), F16 and F32 one row and eight, BF16 one row: Candle's
    /// `matmul` (`x · wᵀ`, what `candle_nn::Linear` runs) against [`forward`] (F32 weights
    /// through the op itself). Each side runs a batch of calls over copies of the weight that
    /// together exceed 512 MiB (more than this host's 260 MiB L3, so each call reads its
    /// weights from memory), batches alternated 5 times with 20 ms between (the workers park).
    /// One JSON record per line after `RECORD`.
    #[test]
    #[ignore]
    fn ab_dense() {
        let dev = Device::Cpu;
        let cases = [
            (DType::F16, 1usize),
            (DType::F16, 8),
            (DType::BF16, 1),
            (DType::F32, 1),
            (DType::F32, 8),
        ];
        for (dtype, m) in cases {
            for (n, k) in [(4096usize, 4096usize), (11008, 4096), (4096, 11008)] {
                let bytes = n * k * dtype.size_in_bytes();
                let copies = (512usize << 20).div_ceil(bytes).max(2);
                let ws: Vec<Tensor> = (0..copies)
                    .map(|_| {
                        Tensor::randn(0f32, 0.02, (n, k), &dev)
                            .unwrap()
                            .to_dtype(dtype)
                            .unwrap()
                    })
                    .collect();
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let ours = |w: &Tensor| {
                    if dtype == DType::F32 {
                        x.apply_op2_no_bwd(w, &DenseMatMul { pf: 4096 }).unwrap()
                    } else {
                        forward(w, &x, &KernelTuning::default()).unwrap().unwrap()
                    }
                };
                let candle = |w: &Tensor| x.matmul(&w.t().unwrap()).unwrap();
                // Warm-up (page faults, the pool's threads) and a check.
                let e = {
                    let (a, b) = (ours(&ws[0]), candle(&ws[0]));
                    let (a, b) = (
                        a.to_dtype(DType::F32).unwrap(),
                        b.to_dtype(DType::F32).unwrap(),
                    );
                    let d = (&a - &b).unwrap().abs().unwrap().flatten_all().unwrap();
                    d.max(0).unwrap().to_scalar::<f32>().unwrap()
                        / b.abs()
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .max(0)
                            .unwrap()
                            .to_scalar::<f32>()
                            .unwrap()
                };
                assert!(e < 1e-2, "{dtype:?} {n}x{k}: {e}");
                let (mut t_candle, mut t_ours) = (Vec::new(), Vec::new());
                for _ in 0..5 {
                    std::thread::sleep(Duration::from_millis(20));
                    let t = Instant::now();
                    for w in &ws {
                        candle(w);
                    }
                    t_candle.push(t.elapsed().as_secs_f64() / copies as f64);
                    std::thread::sleep(Duration::from_millis(20));
                    let t = Instant::now();
                    for w in &ws {
                        ours(w);
                    }
                    t_ours.push(t.elapsed().as_secs_f64() / copies as f64);
                }
                let median = |v: &mut Vec<f64>| {
                    v.sort_by(f64::total_cmp);
                    v[v.len() / 2]
                };
                let (c, o) = (median(&mut t_candle), median(&mut t_ours));
                println!(
                    "RECORD {{\"dtype\": \"{dtype:?}\", \"rows\": {m}, \"n\": {n}, \"k\": {k}, \
                     \"weight_mib\": {:.1}, \"copies\": {copies}, \"candle_ms\": {:.3}, \
                     \"ours_ms\": {:.3}, \"candle_gbs\": {:.2}, \"ours_gbs\": {:.2}, \
                     \"speedup\": {:.2}, \"candle_ms_all\": {:?}, \"ours_ms_all\": {:?}}}",
                    bytes as f64 / (1 << 20) as f64,
                    c * 1e3,
                    o * 1e3,
                    bytes as f64 / c / 1e9,
                    bytes as f64 / o / 1e9,
                    c / o,
                    t_candle
                        .iter()
                        .map(|t| (t * 1e6).round() / 1e3)
                        .collect::<Vec<_>>(),
                    t_ours
                        .iter()
                        .map(|t| (t * 1e6).round() / 1e3)
                        .collect::<Vec<_>>(),
                );
            }
        }
    }

    /// Software prefetch in the host layers' matmuls: a 7B LLaMA layer's seven projections
    /// (q, k, v, o: 4096 x 4096; gate, up: 11008 x 4096; down: 4096 x 11008) against one row,
    /// as a decode step runs them, over `LAYERS` copies (more than a 300 MiB L3): F16 through
    /// [`forward`], Q8_0 through `cpu_quant` with F32 and with 8-bit activations (q, k, v and
    /// gate, up in one pass each), and Q4_K with Q6_K for v and down (Q4_K_M) through its
    /// K-quant loop. Each distance of
    /// [`simd::prefetch_bytes`] (0: none) runs a sweep over the copies, distances alternated
    /// over 7 rounds; medians, GB/s of weights read. Every distance's outputs must equal the
    /// first's bit for bit. One JSON record per line after `RECORD`.
    #[test]
    #[ignore]
    fn ab_prefetch() {
        use std::sync::Arc;

        use candle_core::quantized::{GgmlDType, QStorage, QTensor};

        const LAYERS: usize = 4;
        let dev = Device::Cpu;
        let shapes = [
            (4096usize, 4096usize),
            (4096, 4096),
            (4096, 4096),
            (4096, 4096),
            (11008, 4096),
            (11008, 4096),
            (4096, 11008),
        ];
        // Cheap, varied values (the rate does not depend on them).
        let values = |n: usize, seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        };
        let f16_layers: Vec<Vec<Tensor>> = (0..LAYERS)
            .map(|l| {
                shapes
                    .iter()
                    .enumerate()
                    .map(|(j, &(n, k))| {
                        Tensor::from_vec(values(n * k, l * 7 + j), (n, k), &dev)
                            .unwrap()
                            .to_dtype(DType::F16)
                            .unwrap()
                    })
                    .collect()
            })
            .collect();
        // GGML blocks from bytes (any bits are a block): each block's f16 scales small (for
        // Q8_0 its quants from byte 2 on, for the K types every byte before the scales are
        // written), the rest varied modulo `modulus`; weight `j` of the layer of type `ty(j)`.
        let blocks = |ty: &dyn Fn(usize) -> GgmlDType, modulus: usize| -> Vec<Vec<Arc<QTensor>>> {
            (0..LAYERS)
                .map(|l| {
                    shapes
                        .iter()
                        .enumerate()
                        .map(|(j, &(n, k))| {
                            let ty = ty(j);
                            let (first, scales): (usize, &[usize]) = match ty {
                                GgmlDType::Q8_0 => (2, &[0]),
                                GgmlDType::Q6K => (0, &[208]),
                                _ => (0, &[0, 2]),
                            };
                            let size = ty.type_size();
                            let mut b = vec![0u8; n * k / ty.block_size() * size];
                            for (i, blk) in b.chunks_exact_mut(size).enumerate() {
                                for (t, q) in blk[first..].iter_mut().enumerate() {
                                    *q = ((i * 31 + t * 7 + l + j) % modulus) as u8;
                                }
                                for &at in scales {
                                    blk[at..at + 2]
                                        .copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                                }
                            }
                            let b = std::borrow::Cow::Borrowed(&b[..]);
                            let st = QStorage::from_data(b, &dev, ty).unwrap();
                            Arc::new(QTensor::new(st, (n, k)).unwrap())
                        })
                        .collect()
                })
                .collect()
        };
        let q8_layers = blocks(&|_| GgmlDType::Q8_0, 255);
        // Q4_K_M as llama.cpp writes it, near enough: Q6_K for v and down, Q4_K elsewhere.
        let kq_layers = blocks(
            &|j| {
                if j == 2 || j == 6 {
                    GgmlDType::Q6K
                } else {
                    GgmlDType::Q4K
                }
            },
            251,
        );
        let kq_bytes: usize = kq_layers[0]
            .iter()
            .map(|w| w.storage_size_in_bytes())
            .sum::<usize>()
            * LAYERS;
        let x = Tensor::from_vec(values(4096, 9), (1, 4096), &dev).unwrap();
        let x2 = Tensor::from_vec(values(11008, 5), (1, 11008), &dev).unwrap();
        let (x16, x216) = (
            x.to_dtype(DType::F16).unwrap(),
            x2.to_dtype(DType::F16).unwrap(),
        );
        let f16_sweep = |t: &KernelTuning| -> Vec<Tensor> {
            let mut outs = Vec::new();
            for ws in &f16_layers {
                for (j, w) in ws.iter().enumerate() {
                    let x = if j == 6 { &x216 } else { &x16 };
                    outs.push(forward(w, x, t).unwrap().unwrap());
                }
            }
            outs
        };
        let quant_sweep = |layers: &Vec<Vec<Arc<QTensor>>>, t: &KernelTuning| -> Vec<Tensor> {
            let mut outs = Vec::new();
            let many = |ws: &[&Arc<QTensor>], x: &Tensor| {
                crate::linear::cpu_quant::forward_many(ws, x, t)
                    .unwrap()
                    .unwrap()
            };
            for ws in layers {
                outs.extend(many(&[&ws[0], &ws[1], &ws[2]], &x));
                outs.extend(many(&[&ws[3]], &x));
                outs.extend(many(&[&ws[4], &ws[5]], &x));
                outs.extend(many(&[&ws[6]], &x2));
            }
            outs
        };
        let as_f32 = |t: &Tensor| -> Vec<f32> {
            let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            t.to_vec1::<f32>().unwrap()
        };
        let elems: usize = shapes.iter().map(|(n, k)| n * k).sum::<usize>() * LAYERS;
        let distances = [0usize, 1024, 2048, 4096, 8192, 16384];
        let q8_sweep = |t: &KernelTuning| {
            let t = KernelTuning {
                cpu_q8_activations: true,
                ..*t
            };
            quant_sweep(&q8_layers, &t)
        };
        let q8f_sweep = |t: &KernelTuning| quant_sweep(&q8_layers, t);
        // Our K-quant loop whatever the thread count (`cpu_quant::KQUANT_MIN_THREADS`).
        let kq_sweep = |t: &KernelTuning| {
            let t = KernelTuning {
                cpu_kquants: Some(true),
                ..*t
            };
            quant_sweep(&kq_layers, &t)
        };
        type Sweep<'a> = &'a dyn Fn(&KernelTuning) -> Vec<Tensor>;
        let runs: [(&str, usize, Sweep); 4] = [
            ("F16", elems * 2, &f16_sweep),
            ("Q8_0 (8-bit activations)", elems / 32 * 34, &q8_sweep),
            ("Q8_0", elems / 32 * 34, &q8f_sweep),
            ("Q4_K_M (Q4_K, Q6_K for v and down)", kq_bytes, &kq_sweep),
        ];
        for (weights, bytes, sweep) in runs {
            let at = |pf: usize| KernelTuning {
                cpu_prefetch_bytes: pf,
                ..KernelTuning::default()
            };
            let want: Vec<Vec<f32>> = sweep(&at(0)).iter().map(as_f32).collect();
            let mut times = vec![Vec::new(); distances.len()];
            for _ in 0..7 {
                for (s, &pf) in distances.iter().enumerate() {
                    let tuning = at(pf);
                    std::thread::sleep(Duration::from_millis(20));
                    let t = Instant::now();
                    let got = sweep(&tuning);
                    times[s].push(t.elapsed().as_secs_f64());
                    for (g, w) in got.iter().zip(&want) {
                        assert!(as_f32(g) == *w, "{weights} {pf}: outputs differ");
                    }
                }
            }
            for (s, &pf) in distances.iter().enumerate() {
                let mut t = times[s].clone();
                t.sort_by(f64::total_cmp);
                let med = t[t.len() / 2];
                println!(
                    "RECORD {{\"weights\": \"{weights}\", \"bytes_ahead\": {pf}, \
                     \"layers\": {LAYERS}, \"threads\": {}, \"layer_ms\": {:.3}, \
                     \"gbs\": {:.2}, \"sweep_ms_all\": {:?}}}",
                    crate::pool::threads(),
                    med * 1e3 / LAYERS as f64,
                    bytes as f64 / med / 1e9,
                    times[s]
                        .iter()
                        .map(|t| (t * 1e6).round() / 1e3)
                        .collect::<Vec<_>>(),
                );
            }
        }
    }
}
