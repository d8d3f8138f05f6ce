//! Bad inputs to the ops are refused with an error, not a wrong result or a panic.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_offload::kernels::{activation, attention, gemm, linear, norm, rope};
use candle_offload::KernelTuning;

use crate::ops::common::*;

fn bad_inputs_are_refused(device: &Device) -> anyhow::Result<()> {
    let tun = KernelTuning::default();
    let x = random(&[2, 8], 1.0, 1, DType::F32, device)?;
    let w = random(&[8], 1.0, 2, DType::F32, device)?;
    let half = x.to_dtype(DType::F16)?;
    let ints = Tensor::zeros((2, 8), DType::U32, device)?;
    fn err<T>(r: candle_core::Result<T>) -> anyhow::Result<String> {
        match r {
            Ok(_) => anyhow::bail!("accepted"),
            Err(e) => Ok(e.to_string()),
        }
    }
    let e = err(norm::rms_norm_residual(&x, &half, &w, 1e-5))?;
    anyhow::ensure!(e.contains("mixed dtypes"), "{e}");
    let e = err(norm::rms_norm_residual(&x, &x, &w.narrow(0, 0, 7)?, 1e-5))?;
    anyhow::ensure!(e.contains("weight"), "{e}");
    let e = err(norm::rms_norm_residual(&x, &x.reshape((4, 4))?, &w, 1e-5))?;
    anyhow::ensure!(e.contains("shape"), "{e}");
    let e = err(activation::silu_mul(&ints, &ints))?;
    anyhow::ensure!(e.contains("unsupported dtype"), "{e}");
    let e = err(activation::silu_mul(&x, &x.narrow(1, 0, 4)?))?;
    anyhow::ensure!(e.contains("shape"), "{e}");
    let q = random(&[1, 2, 4, 8], 1.0, 3, DType::F32, device)?;
    let k = random(&[1, 2, 2, 6], 1.0, 4, DType::F32, device)?;
    let table = Tensor::zeros((2, 8), DType::F32, device)?;
    let e = err(rope::rope_qk(&q, &k, &table))?;
    anyhow::ensure!(e.contains("do not fit"), "{e}");
    let e = err(rope::rope_qk(&q, &q, &table.narrow(0, 0, 1)?))?;
    anyhow::ensure!(e.contains("do not fit"), "{e}");
    // Attention: q heads not a multiple of kv heads, more new positions than cached, window 0.
    let (q3, kv4) = (
        random(&[1, 3, 1, 8], 1.0, 5, DType::F32, device)?,
        random(&[1, 2, 4, 8], 1.0, 6, DType::F32, device)?,
    );
    let e = err(attention::decode_attention(&q3, &kv4, &kv4, 1.0, None))?;
    anyhow::ensure!(e.contains("do not fit"), "{e}");
    let q5 = random(&[1, 2, 5, 8], 1.0, 7, DType::F32, device)?;
    let e = err(attention::decode_attention(&q5, &kv4, &kv4, 1.0, None))?;
    anyhow::ensure!(e.contains("do not fit"), "{e}");
    let e = err(attention::decode_attention(&q, &kv4, &kv4, 1.0, Some(0)))?;
    anyhow::ensure!(e.contains("window"), "{e}");
    // The prompt's attention names itself: mismatched heads, more rows than cached, dtypes.
    for (q, what) in [(&q3, "heads"), (&q5, "rows")] {
        let e = err(attention::prompt_attention(q, &kv4, &kv4, 1.0, &tun))?;
        anyhow::ensure!(
            e.contains("prompt-attention") && e.contains("do not fit"),
            "{what}: {e}"
        );
    }
    let e = err(attention::prompt_attention(
        &q5.to_dtype(DType::F16)?,
        &kv4,
        &kv4,
        1.0,
        &tun,
    ))?;
    anyhow::ensure!(e.contains("mixed dtypes"), "{e}");
    let e = err(linear::linear_small(
        &x,
        &w.reshape((1, 8))?.narrow(1, 0, 7)?,
    ))?;
    anyhow::ensure!(e.contains("does not match"), "{e}");
    // dequantize_rows names itself: rows past the weight, a type without its kernel, a dtype
    // it does not write (on a CPU, or without CUDA, every call is refused).
    let dense = random(&[64, 256], 0.1, 8, DType::F32, &Device::Cpu)?;
    let q4 = QTensor::quantize_onto(&dense, GgmlDType::Q4_0, device)?;
    let q5k = QTensor::quantize_onto(&dense, GgmlDType::Q5K, device)?;
    for (w, r0, rows, dtype, what) in [
        (&q4, 60, 10, DType::F16, "rows 60..70"),
        (&q4, 0, 0, DType::F16, "rows 0..0"),
        (&q5k, 0, 1, DType::F16, "no kernel for Q5K"),
        (&q4, 0, 1, DType::F32, "no kernel writes F32"),
    ] {
        let e = err(gemm::dequantize_rows(w, r0, rows, dtype))?;
        anyhow::ensure!(e.contains("dequantize_rows"), "{what}: {e}");
        anyhow::ensure!(!device.is_cuda() || e.contains(what), "{what}: {e}");
    }
    Ok(())
}
test_device!(
    bad_inputs_are_refused,
    ops_bad_inputs_cpu,
    ops_bad_inputs_gpu
);
