//! `kernels::linear::Linear`, the one linear op: the kernel it chooses from the device, the
//! weight's format, the rows and the tuning, and that it runs that kernel (its result is the
//! kernel's own, bit for bit, with the bias added).

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_offload::kernels::gemm;
use candle_offload::kernels::linear::{
    self, cpu_dense, cpu_quant, Linear, LinearKernel, LinearWeight,
};
use candle_offload::{KernelTuning, QlinearVariant};

use crate::ops::common::*;

/// Bit for bit equal (shapes, dtypes and values).
fn same(a: &Tensor, b: &Tensor) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.shape() == b.shape() && a.dtype() == b.dtype(),
        "{a:?} vs {b:?}"
    );
    let (a, b) = (
        a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
    );
    anyhow::ensure!(a == b, "values differ");
    Ok(())
}

/// A dense F16 weight and a Q8_0 one against a decode step's row and a prompt's rows: on a GPU
/// the decode kernels for the row (not with the decode kernels off), Candle's matmul and the
/// prompt GEMM for the prompt; on the CPU the dense and quantized CPU matmuls; q, k and v of
/// blocks in one launch on a GPU. Each result is the chosen kernel's own.
fn linear_op_runs_the_kernel_it_chooses(device: &Device) -> anyhow::Result<()> {
    let t = KernelTuning::default();
    let gpu = device.is_cuda();
    let (n, k) = (48, 256);
    let w = random(&[n, k], 0.5, 1, DType::F16, device)?;
    let bias = random(&[n], 0.5, 2, DType::F16, device)?;
    let dense = Linear::new(LinearWeight::Dense(w.clone()), Some(bias.clone()), t);
    let x1 = random(&[1, 1, k], 1.0, 3, DType::F16, device)?;
    let x80 = random(&[1, 80, k], 1.0, 4, DType::F16, device)?;
    let with_bias = |y: Tensor| -> anyhow::Result<Tensor> { Ok(y.broadcast_add(&bias)?) };
    if gpu {
        anyhow::ensure!(dense.kernel(&x1, true)? == LinearKernel::SmallDense);
        same(
            &dense.forward(&x1)?,
            &with_bias(linear::linear_small(&x1, &w)?)?,
        )?;
        anyhow::ensure!(dense.kernel(&x1, false)? == LinearKernel::Candle);
    } else {
        anyhow::ensure!(dense.kernel(&x1, true)? == LinearKernel::CpuDense);
        let y = cpu_dense::forward(&w, &x1, &t)?.expect("the CPU dense matmul");
        same(&dense.forward(&x1)?, &with_bias(y)?)?;
    }
    anyhow::ensure!(dense.kernel(&x80, true)? == LinearKernel::Candle);
    let plain = candle_nn::Linear::new(w.clone(), Some(bias.clone()));
    same(
        &dense.forward(&x80)?,
        &candle_core::Module::forward(&plain, &x80)?,
    )?;

    let blocks = |seed: u64| -> anyhow::Result<Arc<QTensor>> {
        let w = random(&[n, k], 0.5, seed, DType::F32, &Device::Cpu)?;
        Ok(Arc::new(QTensor::quantize_onto(
            &w,
            GgmlDType::Q8_0,
            device,
        )?))
    };
    let layer = |q: &Arc<QTensor>| {
        Linear::new(
            LinearWeight::Quantized(QMatMul::QTensor(q.clone())),
            None,
            t,
        )
    };
    let (qa, qb, qc) = (blocks(5)?, blocks(6)?, blocks(7)?);
    let quant = layer(&qa);
    let x1 = x1.to_dtype(DType::F32)?;
    let x80 = x80.to_dtype(DType::F32)?;
    if gpu {
        let variant = t.qlinear_variant_at(GgmlDType::Q8_0, 1);
        anyhow::ensure!(quant.kernel(&x1, true)? == LinearKernel::SmallBlocks(variant));
        same(&quant.forward(&x1)?, &linear::qlinear_small(&x1, &qa, &t)?)?;
        anyhow::ensure!(quant.kernel(&x80, true)? == LinearKernel::PrefillGemm);
        let y = gemm::qlinear_prefill(&x80, &qa, &t)?.expect("the prompt GEMM");
        same(&quant.forward(&x80)?, &y)?;
        anyhow::ensure!(quant.takes_quantized_x(1) == (variant == QlinearVariant::V4));
        let (lb, lc) = (layer(&qb), layer(&qc));
        let many = Linear::forward_many(&x1, &[&quant, &lb, &lc])?;
        let want = linear::qlinear_small_multi(&x1, &[&qa, &qb, &qc], &t)?;
        for (got, want) in many.iter().zip(&want) {
            same(got, want)?;
        }
    } else {
        for x in [&x1, &x80] {
            anyhow::ensure!(quant.kernel(x, true)? == LinearKernel::CpuBlocks);
            let y = cpu_quant::forward(&qa, x, &t)?.expect("the CPU quantized matmul");
            same(&quant.forward(x)?, &y)?;
        }
    }
    Ok(())
}
test_device!(
    linear_op_runs_the_kernel_it_chooses,
    ops_linear_op_cpu,
    ops_linear_op_gpu
);

/// `Linear::takes_quantized_x`: only where the decode kernel that reads x quantized runs its
/// rows (a GPU, variant 4 at those rows, at most `qlinear_small_rows` rows); a prompt's rows,
/// which go to other kernels, and the CPU never.
fn takes_quantized_x_follows_the_decode_kernel(device: &Device) -> anyhow::Result<()> {
    let t = KernelTuning::default();
    let k = 256;
    for qtype in [GgmlDType::Q4_0, GgmlDType::Q4K, GgmlDType::Q8_0] {
        let w = random(&[64, k], 0.5, 20, DType::F32, &Device::Cpu)?;
        let w = Arc::new(QTensor::quantize_onto(&w, qtype, device)?);
        let l = Linear::new(LinearWeight::Quantized(QMatMul::QTensor(w)), None, t);
        for rows in [1usize, 2, 8, 9, 64] {
            let want = device.is_cuda()
                && rows <= t.qlinear_small_rows
                && t.qlinear_variant_at(qtype, rows) == QlinearVariant::V4;
            anyhow::ensure!(
                l.takes_quantized_x(rows) == want,
                "{qtype:?}, {rows} rows: takes quantized x {}",
                !want
            );
        }
    }
    Ok(())
}
test_device!(
    takes_quantized_x_follows_the_decode_kernel,
    ops_takes_quantized_x_cpu,
    ops_takes_quantized_x_gpu
);
