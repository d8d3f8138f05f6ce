//! `kernels::linear` against the compositions and dequantized weights: the decode matmuls of
//! dense and GGML-block weights (every kernel variant, the K-quants), and the CPU dense matmul
//! behind `layers::Linear`.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_offload::kernels::{activation, linear};
use candle_offload::{KernelTuning, QlinearVariant, QlinearVariants};

use crate::ops::common::*;

fn linear_small_matches_composition(device: &Device) -> anyhow::Result<()> {
    // (x shape, weight rows): one row, several, the most the kernel takes, one past it (the
    // composition), a width that is not a multiple of 8 (the composition), a 7B-sized row.
    let shapes: [(&[usize], usize); 7] = [
        (&[1, 1, 64], 37),
        (&[1, 3, 4096], 128),
        (&[8, 16], 5),
        (&[9, 64], 3),
        (&[2, 12], 7),
        (&[1, 1, 11008], 64),
        (&[1, 4096], 1000),
    ];
    for dtype in DTYPES {
        for (i, &(xs, n)) in shapes.iter().enumerate() {
            let k = *xs.last().expect("rank ≥ 1");
            let x = random(xs, 1.0, 40 + i as u64, dtype, device)?;
            let w = random(
                &[n, k],
                1.0 / (k as f32).sqrt(),
                50 + i as u64,
                dtype,
                device,
            )?;
            let got = linear::linear_small(&x, &w)?;
            let want = linear::linear_small_unfused(&x, &w)?;
            ensure_close(&format!("linear_small {xs:?} x {n}"), &got, &want, dtype)?;
        }
        // A strided x (a transposed view) and a weight that is a view past its buffer's start.
        let x = random(&[64, 2], 1.0, 60, dtype, device)?.t()?;
        let w = random(&[12, 64], 0.125, 61, dtype, device)?.narrow(0, 3, 9)?;
        ensure_close(
            "linear_small views",
            &linear::linear_small(&x, &w)?,
            &linear::linear_small_unfused(&x, &w)?,
            dtype,
        )?;
    }
    Ok(())
}
/// q, k and v (GQA widths) in one launch, and a SwiGLU gate and up with the SiLU · mul.
fn linear_small_multi_matches_composition(device: &Device) -> anyhow::Result<()> {
    for dtype in DTYPES {
        for (i, xs) in [
            &[1usize, 1, 256][..],
            &[1, 3, 64],
            &[8, 4096],
            &[9, 64],
            &[1, 12],
        ]
        .into_iter()
        .enumerate()
        {
            let k = *xs.last().expect("rank ≥ 1");
            let seed = 70 + 10 * i as u64;
            let s = 1.0 / (k as f32).sqrt();
            let x = random(xs, 1.0, seed, dtype, device)?;
            let ws = [
                random(&[96, k], s, seed + 1, dtype, device)?,
                random(&[32, k], s, seed + 2, dtype, device)?,
                random(&[32, k], s, seed + 3, dtype, device)?,
            ];
            let got = linear::linear_small_multi(&x, &[&ws[0], &ws[1], &ws[2]])?;
            anyhow::ensure!(got.len() == 3);
            for (g, w) in got.iter().zip(&ws) {
                anyhow::ensure!(g.is_contiguous(), "outputs are contiguous");
                ensure_close(
                    &format!("linear_small_multi {xs:?}"),
                    g,
                    &linear::linear_small_unfused(&x, w)?,
                    dtype,
                )?;
            }
            let got = linear::linear_silu_mul(&x, &ws[1], &ws[2])?;
            let want = activation::silu_mul_unfused(
                &linear::linear_small_unfused(&x, &ws[1])?,
                &linear::linear_small_unfused(&x, &ws[2])?,
            )?;
            ensure_close(&format!("linear_silu_mul {xs:?}"), &got, &want, dtype)?;
        }
    }
    Ok(())
}
test_device!(
    linear_small_multi_matches_composition,
    ops_linear_small_multi_cpu,
    ops_linear_small_multi_gpu
);

test_device!(
    linear_small_matches_composition,
    ops_linear_small_cpu,
    ops_linear_small_gpu
);

/// A router's logits in F32 (`linear::router_logits`): a decode row of every dtype against the
/// weight in F32 arithmetic (the pool's dense kernel on the CPU, one launch on a GPU), and
/// the composition for several rows on a GPU and for a width that is not a multiple of 8;
/// F32 out, within F32's rounding of the sum.
fn router_logits_are_f32_products(device: &Device) -> anyhow::Result<()> {
    for dtype in DTYPES {
        for (i, (rows, k, n)) in [(1, 2048, 128), (1, 64, 60), (3, 64, 8), (1, 12, 4)]
            .into_iter()
            .enumerate()
        {
            let seed = 300 + 10 * i as u64;
            let x = random(&[rows, k], 1.0, seed, dtype, device)?;
            let w = random(&[n, k], 1.0 / (k as f32).sqrt(), seed + 1, dtype, device)?;
            let got = linear::router_logits(&x, &w, &Default::default())?;
            anyhow::ensure!(got.dtype() == DType::F32 && got.dims() == [rows, n]);
            let want = x
                .to_dtype(DType::F32)?
                .matmul(&w.to_dtype(DType::F32)?.t()?)?;
            ensure_close(
                &format!("router_logits {rows}x{k} by {n} {dtype:?}"),
                &got,
                &want,
                DType::F32,
            )?;
        }
    }
    // x and the weight of different dtypes: the composition.
    let x = random(&[1, 64], 1.0, 3, DType::F32, device)?;
    let w = random(&[8, 64], 0.125, 4, DType::F16, device)?;
    let want = x.matmul(&w.to_dtype(DType::F32)?.t()?)?;
    ensure_close(
        "router_logits F32 x, F16 weight",
        &linear::router_logits(&x, &w, &Default::default())?,
        &want,
        DType::F32,
    )?;
    let x = random(&[1, 64], 1.0, 1, DType::F16, device)?;
    let w = random(&[8, 32], 1.0, 2, DType::F16, device)?;
    anyhow::ensure!(
        linear::router_logits(&x, &w, &Default::default()).is_err(),
        "widths differ"
    );
    Ok(())
}
test_device!(
    router_logits_are_f32_products,
    ops_router_logits_cpu,
    ops_router_logits_gpu
);

/// The GGML block types the quantized few-row kernels take.
pub(crate) const QTYPES: [GgmlDType; 5] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
];

/// Variants 3's and 4's tolerance against their quantized-x reference: in F32 for the summation order, in
/// F16 and BF16 for the output's rounding (up to 2^-11 and 2^-9 of a value).
fn v3_tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 1e-3,
        _ => 4e-3,
    }
}

/// x (rows, k; k a multiple of 32) in F32 on the CPU, rounded as variants 3 and 4 quantize it: per
/// block of 32 values of a row, d = amax / 127 and each value round_ties_even(v · (127 /
/// amax)) · d (0 where 127 / amax is not finite), with the kernel's f32 operations.
fn quantize_x_q8(x: &Tensor) -> anyhow::Result<Tensor> {
    let x = x.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let mut v = x.flatten_all()?.to_vec1::<f32>()?;
    for block in v.chunks_mut(32) {
        let amax = block.iter().fold(0.0f32, |a, e| a.max(e.abs()));
        let d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let scale = if id.is_finite() { id } else { 0.0 };
        for e in block {
            *e = (*e * scale).round_ties_even() * d;
        }
    }
    Ok(Tensor::from_vec(v, x.shape(), &Device::Cpu)?)
}

/// Kernel choices with `variant` forced for every block type (`None`: each type's default).
fn tuned(variant: Option<QlinearVariant>) -> KernelTuning {
    let mut t = KernelTuning::default();
    if let Some(v) = variant {
        t.qlinear = QlinearVariants::all(v);
    }
    t
}

/// The names a variant is given by (`kernels.qlinear`), each its variant's, in any case;
/// others none.
#[test]
fn ops_qlinear_variant_names() {
    for v in QlinearVariant::ALL {
        assert_eq!(QlinearVariant::parse(v.name()), Some(v));
        assert_eq!(QlinearVariant::parse(&v.name().to_uppercase()), Some(v));
    }
    for bad in ["", "v5", "v2r3", "v3r4", "v4r2", "2"] {
        assert_eq!(QlinearVariant::parse(bad), None, "{bad:?}");
    }
}

/// The per-type defaults: every block type with a kernel listed once (the K-quants too), each
/// type's default its entry, and a type without one V2.
#[test]
fn ops_qlinear_default_variants() {
    let defaults = QlinearVariants::default();
    for t in QTYPES.into_iter().chain([GgmlDType::Q4K, GgmlDType::Q6K]) {
        let entries: Vec<_> = defaults
            .entries()
            .into_iter()
            .filter(|(ty, _)| *ty == t)
            .collect();
        assert_eq!(entries.len(), 1, "{t:?}");
        assert_eq!(defaults.of(t), entries[0].1, "{t:?}");
    }
    assert_eq!(defaults.of(GgmlDType::Q2K), QlinearVariant::V2);
}

/// `qlinear_small`, its q/k/v and gate/up forms, against x times the blocks dequantized to F32,
/// on a GPU once per kernel variant forced (v1; v2 with the rows per warp it picks, and with 2
/// and 4 forced; v3; v4) and once with each block type's default variant (checked as the
/// variant the type runs): the kernel within the usual tolerances, except v3 and v4, which
/// quantize x: within [`v3_tolerance`] of x rounded to its 8-bit blocks as both do times the
/// same weights (tight enough for a wrong nibble, offset or scale to fail) and, like the
/// composition, within 5e-2 of the unquantized x;
/// the composition (the CPU, and 9 rows on a GPU: Candle's quantized matmul, which quantizes x
/// to 8 bits) within 5e-2, and equal to it. Block counts that leave rows unaligned or odd (1,
/// 3, 5, 11, 65 blocks), more than one round of staged blocks (65, 128, 344), more than one
/// chunk of x in v3 (130 and 344 blocks of 7 and 8 rows), rows of blocks padded in v4's buffer
/// (every count here but 128), 1 to 8 rows and 9 rows (the composition); weights of 37, 8 and 8 rows (column counts that are no multiple of the 2 or 4
/// rows a warp of v2 and v3 reads, nor of the columns of a block of threads, so a warp's
/// columns span two weights and run past the last), a pair of 8 and 37, and gate/up pairs of 8
/// and of 37 rows.
fn qlinear_small_matches_dequantized(device: &Device) -> anyhow::Result<()> {
    if !device.is_cuda() {
        // The CPU path is the composition whatever the variant.
        return qlinear_small_matches_dequantized_in(device, None);
    }
    let forced = QlinearVariant::ALL.map(Some);
    for variant in forced.into_iter().chain([None]) {
        qlinear_small_matches_dequantized_in(device, variant)?;
    }
    Ok(())
}

/// The checks for one forced variant, or (`None`) each block type's default; on the CPU, where
/// the composition runs whatever the variant, with `None`.
fn qlinear_small_matches_dequantized_in(
    device: &Device,
    variant: Option<QlinearVariant>,
) -> anyhow::Result<()> {
    let tun = tuned(variant);
    for (t, &qtype) in QTYPES.iter().enumerate() {
        // The kernel the type runs on a GPU.
        let runs = variant.unwrap_or_else(|| QlinearVariants::default().of(qtype));
        anyhow::ensure!(
            tun.qlinear_variant(qtype) == runs,
            "{qtype:?} runs {:?}, not {runs:?}",
            tun.qlinear_variant(qtype)
        );
        let name = match variant {
            Some(v) => v.name().to_string(),
            None => format!("default ({})", runs.name()),
        };
        for dtype in DTYPES {
            for (i, xs) in [
                &[1usize, 1, 32][..],
                &[1, 96],
                &[2, 160],
                &[1, 3, 1088],
                &[4, 96],
                &[8, 2080],
                &[5, 4096],
                &[6, 352],
                &[8, 4160],
                &[7, 11008],
                &[9, 64],
            ]
            .into_iter()
            .enumerate()
            {
                let k = *xs.last().expect("rank ≥ 1");
                let seed = 300 + 20 * t as u64 + 3 * i as u64;
                let x = random(xs, 1.0, seed, dtype, device)?;
                let s = 1.0 / (k as f32).sqrt();
                let mut ws = Vec::new();
                for (j, n) in [37usize, 8, 8, 37].into_iter().enumerate() {
                    let w = random(&[n, k], s, seed + 100 + j as u64, DType::F32, &Device::Cpu)?;
                    ws.push(QTensor::quantize_onto(&w, qtype, device)?);
                }
                // The reference: x times the dequantized weights in F32, rounded to the dtype
                // once at the end (as the kernels do), SiLU·mul included.
                let dense_f32 = |w: &QTensor| -> anyhow::Result<Tensor> {
                    Ok(x.to_dtype(DType::F32)?
                        .broadcast_matmul(&w.dequantize(device)?.t()?)?)
                };
                let dense =
                    |w: &QTensor| -> anyhow::Result<Tensor> { Ok(dense_f32(w)?.to_dtype(dtype)?) };
                // v3's and v4's: x rounded as their kernels quantize it, times the same weights
                // (on the CPU).
                let xq = quantize_x_q8(&x)?;
                let qdense = |w: &QTensor| -> anyhow::Result<Tensor> {
                    let w = w.dequantize(device)?.to_device(&Device::Cpu)?;
                    Ok(xq.broadcast_matmul(&w.t()?)?)
                };
                let kernel = device.is_cuda() && x.elem_count() / k <= 8;
                let v3 = kernel && matches!(runs, QlinearVariant::V3 | QlinearVariant::V4);
                let check =
                    |what: &str, got: &Tensor, want: &Tensor, qwant: &Tensor, unfused: &Tensor| {
                        let what = format!("{what} {name} {qtype:?} {xs:?}");
                        if v3 {
                            let (d, tol) = (rel_diff_values(got, qwant)?, v3_tolerance(dtype));
                            anyhow::ensure!(
                                d <= tol,
                                "{what} {dtype:?}: {d:e} > {tol:e} (x quantized)"
                            );
                            // The 8-bit rounding of x itself, bounded as for the composition,
                            // which quantizes x to 8 bits too (2.04e-2 measured on a GPU at
                            // [1, 96] BF16 SiLU·mul of Q8_0: three blocks, little averaging).
                            let d = rel_diff_values(got, want)?;
                            anyhow::ensure!(d <= 5e-2, "{what} {dtype:?}: {d:e} > 5e-2 (x)");
                            return Ok(());
                        }
                        if kernel {
                            return ensure_close(&what, got, want, dtype);
                        }
                        anyhow::ensure!(
                            rel_diff(got, unfused)? == 0.0,
                            "{what}: not the composition"
                        );
                        let d = rel_diff(got, want)?;
                        anyhow::ensure!(d <= 5e-2, "{what} {dtype:?}: relative difference {d:e}");
                        Ok(())
                    };
                for set in [&[&ws[0], &ws[1], &ws[2]][..], &[&ws[1], &ws[0]]] {
                    let got = linear::qlinear_small_multi(&x, set, &tun)?;
                    anyhow::ensure!(got.len() == set.len());
                    for (g, w) in got.iter().zip(set) {
                        anyhow::ensure!(g.is_contiguous(), "outputs are contiguous");
                        let unfused = linear::qlinear_small_unfused(&x, w)?;
                        check("qlinear_small_multi", g, &dense(w)?, &qdense(w)?, &unfused)?;
                    }
                }
                let one = linear::qlinear_small(&x, &ws[0], &tun)?;
                check(
                    "qlinear_small",
                    &one,
                    &dense(&ws[0])?,
                    &qdense(&ws[0])?,
                    &linear::qlinear_small_unfused(&x, &ws[0])?,
                )?;
                for (gate, up) in [(&ws[1], &ws[2]), (&ws[0], &ws[3])] {
                    let got = linear::qlinear_silu_mul(&x, gate, up, &tun)?;
                    let want = activation::silu_mul_unfused(&dense_f32(gate)?, &dense_f32(up)?)?
                        .to_dtype(dtype)?;
                    let unfused = activation::silu_mul(
                        &linear::qlinear_small_unfused(&x, gate)?,
                        &linear::qlinear_small_unfused(&x, up)?,
                    )?;
                    let qwant = activation::silu_mul_unfused(&qdense(gate)?, &qdense(up)?)?;
                    check("qlinear_silu_mul", &got, &want, &qwant, &unfused)?;
                }
            }
        }
    }
    Ok(())
}
test_device!(
    qlinear_small_matches_dequantized,
    ops_qlinear_small_cpu,
    ops_qlinear_small_gpu
);

/// `KernelTuning::qlinear_small_rows` bounds the rows the GGML-block decode kernels take: past
/// it `qlinear_small` and its gate/up form run the composition (on a GPU Candle's quantized
/// matmul, x quantized to 8 bits), within 5e-2 of x times the dequantized weights; on the CPU
/// no decode kernel fits at all.
fn qlinear_small_rows_bound_the_kernels(device: &Device) -> anyhow::Result<()> {
    let k = 512;
    for limit in [1usize, 2, 4] {
        let mut tun = KernelTuning::default();
        tun.qlinear_small_rows = limit;
        for qtype in [GgmlDType::Q4K, GgmlDType::Q8_0] {
            let w = |seed| -> anyhow::Result<QTensor> {
                let w = random(
                    &[64, k],
                    1.0 / (k as f32).sqrt(),
                    seed,
                    DType::F32,
                    &Device::Cpu,
                )?;
                Ok(QTensor::quantize_onto(&w, qtype, device)?)
            };
            let (a, b) = (w(1300)?, w(1301)?);
            let dense = |x: &Tensor, q: &QTensor| -> anyhow::Result<Tensor> {
                Ok(x.broadcast_matmul(&q.dequantize(device)?.t()?)?)
            };
            for rows in [1usize, 2, 3, 4, 8] {
                let x = random(&[rows, k], 1.0, 1200 + rows as u64, DType::F32, device)?;
                let fits = linear::qlinear_small_fits(&x, &[&a], &tun)?;
                anyhow::ensure!(
                    fits == (device.is_cuda() && rows <= limit),
                    "{qtype:?}, {rows} rows, at most {limit}: fits {fits}"
                );
                let d = rel_diff(&linear::qlinear_small(&x, &a, &tun)?, &dense(&x, &a)?)?;
                anyhow::ensure!(d <= 5e-2, "{qtype:?}, {rows} rows, at most {limit}: {d}");
                let got = linear::qlinear_silu_mul(&x, &a, &b, &tun)?;
                let want = activation::silu_mul_unfused(&dense(&x, &a)?, &dense(&x, &b)?)?;
                let d = rel_diff(&got, &want)?;
                anyhow::ensure!(d <= 5e-2, "{qtype:?} gate/up, {rows} rows: {d}");
            }
        }
    }
    Ok(())
}
test_device!(
    qlinear_small_rows_bound_the_kernels,
    ops_qlinear_small_rows_cpu,
    ops_qlinear_small_rows_gpu
);

/// `KernelTuning::qlinear_k_v4_rows`: from that many rows of x Q4_K and Q6_K (whose variant
/// is `v3`) give what `v4` forced gives, bit for bit, below it what `v3` forced gives; Q8_0
/// keeps `v3` and Q4_0 its `v4` at any rows. On the CPU every variant is the same composition.
fn qlinear_k_v4_rows_switch_the_v3_types(device: &Device) -> anyhow::Result<()> {
    use candle_offload::QlinearVariant as V;
    let k = 512;
    let mut tun = KernelTuning::default();
    tun.qlinear_k_v4_rows = 3;
    let forced = |v: V| {
        let mut t = KernelTuning::default();
        t.qlinear = QlinearVariants::all(v);
        t
    };
    let bits = |t: &Tensor| -> anyhow::Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    for qtype in [
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q4_0,
    ] {
        let w = random(
            &[96, k],
            1.0 / (k as f32).sqrt(),
            1400,
            DType::F32,
            &Device::Cpu,
        )?;
        let w = QTensor::quantize_onto(&w, qtype, device)?;
        let own = QlinearVariants::default().of(qtype);
        for rows in [1usize, 2, 3, 4, 8] {
            let k_quant = matches!(qtype, GgmlDType::Q4K | GgmlDType::Q6K);
            let want = match own {
                V::V3 if k_quant && rows >= 3 => V::V4,
                v => v,
            };
            anyhow::ensure!(
                tun.qlinear_variant_at(qtype, rows) == want,
                "{qtype:?}, {rows} rows: {:?}",
                tun.qlinear_variant_at(qtype, rows)
            );
            for dtype in DTYPES {
                let x = random(&[rows, k], 1.0, 1410 + rows as u64, dtype, device)?;
                let got = bits(&linear::qlinear_small(&x, &w, &tun)?)?;
                let expect = bits(&linear::qlinear_small(&x, &w, &forced(want))?)?;
                anyhow::ensure!(
                    got == expect,
                    "{qtype:?} {dtype:?}, {rows} rows: not {want:?}'s"
                );
            }
        }
    }
    Ok(())
}
test_device!(
    qlinear_k_v4_rows_switch_the_v3_types,
    ops_qlinear_k_v4_rows_cpu,
    ops_qlinear_k_v4_rows_gpu
);

/// The K-quant kernels, Q4_K and Q6_K (on by default, `KernelTuning::qlinear_k`): `qlinear_small`,
/// its q/k/v form and its gate/up form against x times the dequantized super-blocks in F32. On a GPU with the
/// kernel on: converting to floats (variant 2 forced), within the usual tolerances, and the
/// fit says so; with x quantized to 8 bits (variants 3 and 4 forced, and each type's default):
/// within [`v3_tolerance`] of x rounded as variants 3 and 4 round it times the same weights (a
/// wrong nibble, high bit, scale or min fails that) and within 5e-2 of x;
/// with the kernel off (and on the CPU):
/// the composition, Candle's quantized matmul, which quantizes x to 8 bits (within 5e-2). Rows
/// 1 to 8, and 9 (the composition); widths of 1, 2, 3, 11, 16 and 43 super-blocks (Q6_K rows
/// of an odd number of super-blocks start 2 bytes past a 4-byte boundary; 43 of 7 rows take v3
/// three chunks of x); weights of 37
/// and 8 rows (a pair of 8 and 37 in one launch, columns past a warp's).
fn qlinear_k_matches_dequantized(device: &Device) -> anyhow::Result<()> {
    use QlinearVariant as V;
    // (kernel on, its columns per warp converting to floats, the variant forced or None for
    // each type's default): 2 (Q4_K, up to 2 rows of x) sums each dot product in the same
    // order as 1, so its outputs must equal those bit for bit.
    // The last: warps a column group under variant 3 (0: the grid's size chooses).
    let modes: &[(bool, usize, Option<V>, usize)] = if device.is_cuda() {
        &[
            (true, 1, Some(V::V2), 0),
            (true, 2, Some(V::V2), 0),
            (true, 1, Some(V::V3), 1),
            (true, 1, Some(V::V3), 2),
            (true, 1, Some(V::V4), 0),
            (true, 1, None, 0),
            (false, 1, Some(V::V2), 0),
        ]
    } else {
        &[(false, 1, None, 0)]
    };
    let mut by_one: std::collections::HashMap<String, Vec<f32>> = Default::default();
    for &(on, cols, variant, splits) in modes {
        let mut tun = tuned(variant);
        tun.qlinear_k = on;
        tun.qlinear_k_splits = splits;
        tun.qlinear_k_rows = cols;
        for (dtype, qtype) in DTYPES
            .into_iter()
            .flat_map(|d| [(d, GgmlDType::Q4K), (d, GgmlDType::Q6K)])
        {
            for (i, xs) in [
                &[1usize, 1, 256][..],
                &[2, 512],
                &[1, 3, 768],
                &[5, 2816],
                &[8, 4096],
                &[7, 11008],
                &[9, 256],
            ]
            .into_iter()
            .enumerate()
            {
                let k = *xs.last().expect("rank ≥ 1");
                let rows = xs.iter().product::<usize>() / k;
                let seed = 900 + 7 * i as u64;
                // x quantized to 8 bits: the variant the type runs is 3 or 4.
                let q8 = matches!(tun.qlinear_variant(qtype), V::V3 | V::V4);
                let x = random(xs, 1.0, seed, dtype, device)?;
                let s = 1.0 / (k as f32).sqrt();
                let mut ws = Vec::new();
                for (j, n) in [37usize, 8, 8, 37].into_iter().enumerate() {
                    let w = random(&[n, k], s, seed + 50 + j as u64, DType::F32, &Device::Cpu)?;
                    ws.push(QTensor::quantize_onto(&w, qtype, device)?);
                }
                let kernel = on && device.is_cuda() && rows <= 8;
                anyhow::ensure!(
                    linear::qlinear_small_fits(&x, &[&ws[0]], &tun)? == kernel,
                    "fit {xs:?} with the kernel {}",
                    if on { "on" } else { "off" }
                );
                let dense_f32 = |w: &QTensor| -> anyhow::Result<Tensor> {
                    Ok(x.to_dtype(DType::F32)?
                        .broadcast_matmul(&w.dequantize(device)?.t()?)?)
                };
                // x rounded as the quantizing kernel rounds it, times the same weights.
                let xq = quantize_x_q8(&x)?;
                let qdense = |w: &QTensor| -> anyhow::Result<Tensor> {
                    let w = w.dequantize(device)?.to_device(&Device::Cpu)?;
                    Ok(xq.broadcast_matmul(&w.t()?)?)
                };
                let mut same = |what: &str, got: &Tensor| -> anyhow::Result<()> {
                    if !on || q8 {
                        return Ok(());
                    }
                    let key = format!("{what} {dtype:?} {qtype:?} {xs:?}");
                    let v = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    match by_one.get(&key) {
                        None if cols == 1 => {
                            by_one.insert(key, v);
                        }
                        None => anyhow::bail!("{key}: no output with one column a warp"),
                        Some(want) => anyhow::ensure!(
                            *want == v,
                            "{key}: {cols} columns a warp differ from one"
                        ),
                    }
                    Ok(())
                };
                let check = |what: &str, got: &Tensor, want_f32: &Tensor, qwant: &Tensor| {
                    let what = format!(
                        "{what} {qtype:?} {xs:?} kernel {on} columns {cols} variant {variant:?} \
                         splits {splits}"
                    );
                    let want = want_f32.to_dtype(dtype)?;
                    if kernel && q8 {
                        let (d, tol) = (rel_diff_values(got, qwant)?, v3_tolerance(dtype));
                        anyhow::ensure!(
                            d <= tol,
                            "{what} {dtype:?}: {d:e} > {tol:e} (x quantized)"
                        );
                        let d = rel_diff_values(got, &want)?;
                        anyhow::ensure!(d <= 5e-2, "{what} {dtype:?}: {d:e} > 5e-2 (x)");
                        return Ok(());
                    }
                    if kernel {
                        return ensure_close(&what, got, &want, dtype);
                    }
                    let d = rel_diff(got, &want)?;
                    anyhow::ensure!(d <= 5e-2, "{what} {dtype:?}: relative difference {d:e}");
                    Ok(())
                };
                let one = linear::qlinear_small(&x, &ws[0], &tun)?;
                check("qlinear_small", &one, &dense_f32(&ws[0])?, &qdense(&ws[0])?)?;
                same("qlinear_small", &one)?;
                for (s, set) in [&[&ws[0], &ws[1], &ws[2]][..], &[&ws[1], &ws[3]]]
                    .into_iter()
                    .enumerate()
                {
                    let got = linear::qlinear_small_multi(&x, set, &tun)?;
                    anyhow::ensure!(got.len() == set.len());
                    for (j, (g, w)) in got.iter().zip(set).enumerate() {
                        anyhow::ensure!(g.is_contiguous(), "outputs are contiguous");
                        check("qlinear_small_multi", g, &dense_f32(w)?, &qdense(w)?)?;
                        same(&format!("qlinear_small_multi {s} {j}"), g)?;
                    }
                }
                for (s, (gate, up)) in [(&ws[1], &ws[2]), (&ws[0], &ws[3])].into_iter().enumerate()
                {
                    let got = linear::qlinear_silu_mul(&x, gate, up, &tun)?;
                    let want = activation::silu_mul_unfused(&dense_f32(gate)?, &dense_f32(up)?)?;
                    let qwant = activation::silu_mul_unfused(&qdense(gate)?, &qdense(up)?)?;
                    check("qlinear_silu_mul", &got, &want, &qwant)?;
                    same(&format!("qlinear_silu_mul {s}"), &got)?;
                }
            }
        }
    }
    Ok(())
}
test_device!(
    qlinear_k_matches_dequantized,
    ops_qlinear_k_cpu,
    ops_qlinear_k_gpu
);

/// `layers::Linear` with a dense weight on the CPU: F16/BF16 decode-sized inputs (1 to 8
/// rows, leading batch dims, a strided view) go through `cpu_dense` and agree with the F32
/// product of the same weights and bias within the dtype's rounding; more rows, and F32
/// weights, run Candle's matmul and agree too.
#[test]
fn ops_cpu_dense_linear() -> anyhow::Result<()> {
    let tun = KernelTuning::default();
    use candle_offload_models::layers::{Linear, LinearWeight};
    let dev = Device::Cpu;
    for dtype in DTYPES {
        for (i, (xs, n)) in [
            (&[1usize, 1, 4099][..], 37usize),
            (&[2, 3, 100], 130),
            (&[8, 33], 17),
            (&[1, 5, 576], 300),
            (&[9, 64], 20),
            (&[3, 6, 64], 20),
        ]
        .into_iter()
        .enumerate()
        {
            let k = *xs.last().expect("rank ≥ 1");
            let seed = 900 + 10 * i as u64;
            let x = random(xs, 1.0, seed, dtype, &dev)?;
            let w = random(&[n, k], 1.0 / (k as f32).sqrt(), seed + 1, dtype, &dev)?;
            let b = random(&[n], 0.5, seed + 2, dtype, &dev)?;
            let rows = x.elem_count() / k;
            anyhow::ensure!(
                candle_offload::kernels::linear::cpu_dense::forward(&w, &x, &tun)?.is_some()
                    == (dtype != DType::F32
                        && rows <= candle_offload::kernels::linear::cpu_dense::MAX_ROWS)
            );
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let want = f32(&x)?
                .broadcast_matmul(&f32(&w)?.t()?)?
                .broadcast_add(&f32(&b)?)?;
            let linear = Linear::new(LinearWeight::Dense(w.clone()), Some(b.clone()), tun);
            let got = linear.forward(&x)?;
            anyhow::ensure!(got.dtype() == dtype);
            ensure_close_values(&format!("cpu_dense {xs:?} x {n}"), &got, &want, dtype)?;
            let no_bias = Linear::new(LinearWeight::Dense(w.clone()), None, tun);
            let want = f32(&x)?.broadcast_matmul(&f32(&w)?.t()?)?;
            ensure_close_values("cpu_dense no bias", &no_bias.forward(&x)?, &want, dtype)?;
        }
        // A strided input (a transposed view).
        let x = random(&[64, 3], 1.0, 990, dtype, &dev)?.t()?;
        let w = random(&[21, 64], 0.125, 991, dtype, &dev)?;
        let got = Linear::new(LinearWeight::Dense(w.clone()), None, tun).forward(&x)?;
        let want = x
            .to_dtype(DType::F32)?
            .matmul(&w.to_dtype(DType::F32)?.t()?)?;
        ensure_close_values("cpu_dense strided", &got, &want, dtype)?;
    }
    Ok(())
}

/// A decode row through its routed experts (`linear::qexperts_row`): on a GPU the grouped
/// kernels, which must take these experts (`qexperts_row_fits`), against each expert's own
/// decode matmuls (`qlinear_silu_mul`, then `qlinear_small`), their outputs weighted and
/// summed in F32: the same arithmetic but for the sum's one rounding, so within the dtype's
/// tolerance. Block types of 32 and the K-quants, a down of another type than gate and up,
/// 1 to 17 experts (two groups of launches, the second added to the first). On the CPU (and
/// for experts of mixed types, which no kernel takes) the composition itself.
fn qexperts_row_matches_each_expert(device: &Device) -> anyhow::Result<()> {
    let tun = KernelTuning::default();
    let (hidden, inter) = (512usize, 256usize);
    let types = [
        (GgmlDType::Q8_0, GgmlDType::Q8_0),
        (GgmlDType::Q4K, GgmlDType::Q6K),
        (GgmlDType::Q4K, GgmlDType::Q4K),
        (GgmlDType::Q4_0, GgmlDType::Q8_0),
    ];
    for dtype in DTYPES {
        for (t, &(gt, dt)) in types.iter().enumerate() {
            for (c, count) in [1usize, 3, 8, 17].into_iter().enumerate() {
                let seed = 5000 + 100 * t as u64 + 10 * c as u64;
                let x = random(&[1, 1, hidden], 1.0, seed, dtype, device)?;
                let w = |shape: &[usize], ty, s: u64| -> anyhow::Result<QTensor> {
                    let k = shape[1] as f32;
                    let v = random(shape, 1.0 / k.sqrt(), s, DType::F32, &Device::Cpu)?;
                    Ok(QTensor::quantize_onto(&v, ty, device)?)
                };
                let mut weights = Vec::new();
                for e in 0..count {
                    let s = seed + 1000 * (e as u64 + 1);
                    weights.push((
                        w(&[inter, hidden], gt, s)?,
                        w(&[inter, hidden], gt, s + 1)?,
                        w(&[hidden, inter], dt, s + 2)?,
                        0.9 / (e as f32 + 1.0),
                    ));
                }
                let experts: Vec<linear::QExpert<'_>> = weights
                    .iter()
                    .map(|(g, u, d, weight)| linear::QExpert {
                        gate: g,
                        up: u,
                        down: d,
                        weight: *weight,
                    })
                    .collect();
                let what = format!("qexperts_row {gt:?}/{dt:?} {count} experts {dtype:?}");
                anyhow::ensure!(
                    linear::qexperts_row_fits(&x, &experts, &tun)? == device.is_cuda(),
                    "{what}: the kernels' fit"
                );
                let got = linear::qexperts_row(&x, &experts, &tun)?;
                anyhow::ensure!(got.dims() == x.dims() && got.dtype() == dtype, "{what}");
                let mut want = Tensor::zeros(x.dims(), DType::F32, device)?;
                let mut composed: Option<Tensor> = None;
                for e in &experts {
                    let y = linear::qlinear_small(
                        &linear::qlinear_silu_mul(&x, e.gate, e.up, &tun)?,
                        e.down,
                        &tun,
                    )?;
                    want = (want + (y.to_dtype(DType::F32)? * f64::from(e.weight))?)?;
                    let y = y.affine(f64::from(e.weight), 0.0)?;
                    composed = Some(match composed {
                        Some(o) => (o + y)?,
                        None => y,
                    });
                }
                if device.is_cuda() {
                    ensure_close_values(&what, &got, &want, dtype)?;
                } else {
                    let composed = composed.expect("experts");
                    anyhow::ensure!(
                        rel_diff(&got, &composed)? == 0.0,
                        "{what}: not the composition"
                    );
                }
            }
        }
    }
    // Experts of mixed types: no kernel; the composition, on every device.
    let dtype = DType::F16;
    let x = random(&[1, 256], 1.0, 77, dtype, device)?;
    let q = |ty, s| -> anyhow::Result<QTensor> {
        let v = random(&[256, 256], 1.0 / 16.0, s, DType::F32, &Device::Cpu)?;
        Ok(QTensor::quantize_onto(&v, ty, device)?)
    };
    let (a, b) = (
        [
            q(GgmlDType::Q8_0, 1)?,
            q(GgmlDType::Q8_0, 2)?,
            q(GgmlDType::Q8_0, 3)?,
        ],
        [
            q(GgmlDType::Q4_0, 4)?,
            q(GgmlDType::Q4_0, 5)?,
            q(GgmlDType::Q4_0, 6)?,
        ],
    );
    let experts = [
        linear::QExpert {
            gate: &a[0],
            up: &a[1],
            down: &a[2],
            weight: 0.6,
        },
        linear::QExpert {
            gate: &b[0],
            up: &b[1],
            down: &b[2],
            weight: 0.4,
        },
    ];
    anyhow::ensure!(!linear::qexperts_row_fits(&x, &experts, &tun)?);
    let got = linear::qexperts_row(&x, &experts, &tun)?;
    let mut want: Option<Tensor> = None;
    for e in &experts {
        let y = linear::qlinear_small(
            &linear::qlinear_silu_mul(&x, e.gate, e.up, &tun)?,
            e.down,
            &tun,
        )?
        .affine(f64::from(e.weight), 0.0)?;
        want = Some(match want {
            Some(o) => (o + y)?,
            None => y,
        });
    }
    anyhow::ensure!(
        rel_diff(&got, &want.expect("two experts"))? == 0.0,
        "mixed types"
    );
    Ok(())
}
test_device!(
    qexperts_row_matches_each_expert,
    ops_qexperts_row_cpu,
    ops_qexperts_row_gpu
);
