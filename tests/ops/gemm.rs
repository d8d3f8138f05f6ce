//! `kernels::gemm`: the prompt GEMM and its dequantizing kernels against Candle's dequantization.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_offload::kernels::gemm;
use candle_offload::KernelTuning;

use crate::ops::common::*;
use crate::ops::linear::QTYPES;

/// How far past `tol` of `want`'s magnitude (F32, on the CPU) the furthest element of `got`
/// lies: 0 when every element is within its rounding.
fn past_rounding(got: &Tensor, want: &Tensor, tol: f64) -> anyhow::Result<f32> {
    let got = got.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    Ok(((got - want)?.abs()? - (want.abs()? * tol)?)?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?)
}

/// `qlinear_prefill` (a prompt's rows through dequantized weights and cuBLAS): on the CPU,
/// and below `prefill_gemm_min_rows`, it declines. On a GPU, for every block type it
/// has a kernel for:
/// - `dequantize_rows` (rows 1 .. n - 1) gives each element within its dtype's rounding of
///   Candle's dequantization (its kernels of 8 elements a thread gave the same bits as the
///   first ones, of 32, before those went);
/// - x the identity (k rows) gives the weight's dequantized elements themselves, each within
///   F16's rounding (1e-3 relative; F16 x) or BF16's (4e-3; BF16 x) of Candle's
///   dequantization: a wrong nibble, high bit, scale or min anywhere fails;
/// - random x of `PREFILL_GEMM_MIN_ROWS` and 2x100 rows, in each dtype, within 1e-2 of x times
///   the dequantized weight in F32;
/// - weights of 37 and 300 rows, and (Q4_0) one of 4200 rows of 4096, over
///   `PREFILL_GEMM_SLICE_BYTES` in F16, which goes in two slices.
fn qlinear_prefill_matches_dequantized(device: &Device) -> anyhow::Result<()> {
    let tun = KernelTuning::default();
    for qtype in [GgmlDType::Q4_0, GgmlDType::Q4K] {
        let w = random(&[64, 256], 0.1, 7, DType::F32, &Device::Cpu)?;
        let w = QTensor::quantize_onto(&w, qtype, device)?;
        let min = tun.prefill_gemm_min_rows;
        let few = random(&[1, min - 1, 256], 1.0, 8, DType::F32, device)?;
        anyhow::ensure!(
            gemm::qlinear_prefill(&few, &w, &tun)?.is_none(),
            "ran on too few rows"
        );
        let many = random(&[1, min, 256], 1.0, 9, DType::F32, device)?;
        let ran = gemm::qlinear_prefill(&many, &w, &tun)?.is_some();
        anyhow::ensure!(ran == device.is_cuda(), "ran: {ran}, on {device:?}");
    }
    if !device.is_cuda() {
        return Ok(());
    }
    anyhow::ensure!(tun.prefill_gemm, "off by default");
    let types = QTYPES.iter().chain(&[GgmlDType::Q4K, GgmlDType::Q6K]);
    for (t, &qtype) in types.enumerate() {
        let sliced: &[(usize, usize)] = match qtype {
            GgmlDType::Q4_0 => &[(4200, 4096)],
            _ => &[],
        };
        for &(n, k) in [(37, 768), (300, 512)].iter().chain(sliced) {
            let what = format!("{qtype:?} {n}x{k}");
            let seed = 700 + 10 * t as u64 + n as u64;
            let w = random(
                &[n, k],
                1.0 / (k as f32).sqrt(),
                seed,
                DType::F32,
                &Device::Cpu,
            )?;
            let w = QTensor::quantize_onto(&w, qtype, device)?;
            let want = w.dequantize(&Device::Cpu)?;
            // Rows 1 .. n - 1 straight from the dequantizing kernel, each element within its
            // dtype's rounding of Candle's values.
            for (dtype, tol) in [(DType::F16, 1e-3), (DType::BF16, 4e-3)] {
                let got = gemm::dequantize_rows(&w, 1, n - 2, dtype)?;
                anyhow::ensure!(got.dims() == [n - 2, k], "{what}: {:?}", got.dims());
                let err = past_rounding(&got, &want.narrow(0, 1, n - 2)?, tol)?;
                anyhow::ensure!(err <= 1e-6, "{what} {dtype:?}: dequantized off by {err:e}");
            }
            // The identity: y's column c is row c of the weight, in the GEMM's dtype (F16 for
            // F16 x, BF16 otherwise), each element within its rounding.
            for (eye_dtype, tol) in [(DType::F16, 1e-3), (DType::BF16, 4e-3)] {
                let eye = Tensor::eye(k, eye_dtype, device)?;
                let got = gemm::qlinear_prefill(&eye, &w, &tun)?.expect("runs on the GPU");
                let err = past_rounding(&got.t()?, &want, tol)?;
                anyhow::ensure!(
                    err <= 1e-6,
                    "{what} {eye_dtype:?}: an element off by {err:e} past its rounding"
                );
            }
            for dtype in DTYPES {
                for xs in [&[gemm::PREFILL_GEMM_MIN_ROWS, k][..], &[2, 100, k]] {
                    let x = random(xs, 1.0, seed + 1, dtype, device)?;
                    let got = gemm::qlinear_prefill(&x, &w, &tun)?.expect("runs on the GPU");
                    anyhow::ensure!(got.dtype() == dtype, "{what}: {:?} out", got.dtype());
                    let want = x
                        .to_dtype(DType::F32)?
                        .to_device(&Device::Cpu)?
                        .broadcast_matmul(&want.t()?)?;
                    let d = rel_diff_values(&got, &want)?;
                    anyhow::ensure!(d <= 1e-2, "{what} {dtype:?} {xs:?}: {d:e}");
                }
            }
        }
    }
    Ok(())
}
test_device!(
    qlinear_prefill_matches_dequantized,
    ops_qlinear_prefill_cpu,
    ops_qlinear_prefill_gpu
);

/// `add_matmul_t` (y + a·bᵀ, on a GPU one GEMM into y) against the composition in F32 on the
/// CPU, for each dtype and shapes with rank-16 and odd inner widths: within 1e-5 in F32 and
/// each 16-bit dtype's rounding (1e-2) otherwise; shapes that do not make the product are
/// refused.
fn add_matmul_t_matches_the_composition(device: &Device) -> anyhow::Result<()> {
    for (t, &(m, n, k)) in [(37, 300, 16), (256, 64, 7), (1, 5, 3)].iter().enumerate() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let seed = 900 + 10 * t as u64;
            let y = random(&[m, n], 1.0, seed, dtype, device)?;
            let a = random(&[m, k], 1.0, seed + 1, dtype, device)?;
            let b = random(&[n, k], 1.0, seed + 2, dtype, device)?;
            let f32_cpu = |x: &Tensor| x.to_dtype(DType::F32)?.to_device(&Device::Cpu);
            let want = (f32_cpu(&y)? + f32_cpu(&a)?.matmul(&f32_cpu(&b)?.t()?)?)?;
            let got = gemm::add_matmul_t(y, &a, &b)?;
            anyhow::ensure!(
                got.dtype() == dtype && got.dims() == [m, n],
                "{:?}",
                got.shape()
            );
            let d = rel_diff_values(&got, &want)?;
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            anyhow::ensure!(d <= tol, "{m}x{n}x{k} {dtype:?}: {d:e}");
        }
    }
    let y = Tensor::zeros((4, 5), DType::F32, device)?;
    let a = Tensor::zeros((4, 3), DType::F32, device)?;
    anyhow::ensure!(
        gemm::add_matmul_t(y, &a, &Tensor::zeros((5, 2), DType::F32, device)?).is_err(),
        "a b of the wrong width was taken"
    );
    Ok(())
}
test_device!(
    add_matmul_t_matches_the_composition,
    ops_add_matmul_t_cpu,
    ops_add_matmul_t_gpu
);
