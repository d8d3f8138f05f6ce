//! The tiny models give the same logits with the fused ops on and off.

use candle_core::{DType, Device, Tensor};
use candle_offload_models::Llama;

use crate::models::{for_each_tiny, resident_model, Tiny};
use crate::ops::common::*;

/// Every tiny family with the fused ops on and off: the same logits (F32 within 1e-4, F16
/// within 2e-2 of the logits' scale) for a whole sequence and for a prefill then decode steps
/// through the KV cache.
fn fused_models_match_unfused(device: &Device) -> anyhow::Result<()> {
    let dtypes: &[DType] = if device.is_cuda() {
        &[DType::F32, DType::F16]
    } else {
        &[DType::F32]
    };
    for_each_tiny(&Tiny::ALL, "ops", device, |dir| {
        for &dtype in dtypes {
            fused_model_matches_in(dir, device, dtype)
                .map_err(|e| e.context(format!("{dtype:?}")))?;
        }
        Ok(())
    })
}

fn fused_model_matches_in(
    dir: &std::path::Path,
    device: &Device,
    dtype: DType,
) -> anyhow::Result<()> {
    let mut model = resident_model(dir, device, dtype)?;
    anyhow::ensure!(model.fused() == device.is_cuda(), "default switch");
    let tol = if dtype == DType::F32 { 1e-4 } else { 2e-2 };
    let ids: Vec<u32> = (0..12).map(|i| (i * 37 % 101) as u32).collect();
    let input = Tensor::new(ids.as_slice(), device)?.unsqueeze(0)?;
    let run = |model: &Llama| -> anyhow::Result<Vec<Tensor>> {
        let mut out = vec![model.forward_all(&input)?];
        let mut cache = model.new_cache();
        out.push(model.forward(&input.narrow(1, 0, 5)?, 0, &mut cache)?);
        for (pos, &t) in ids.iter().enumerate().skip(5) {
            out.push(model.forward(&Tensor::new(&[t], device)?.unsqueeze(0)?, pos, &mut cache)?);
        }
        Ok(out)
    };
    model.set_fused(false);
    let plain = run(&model)?;
    model.set_fused(true);
    let fused = run(&model)?;
    for (i, (f, p)) in fused.iter().zip(&plain).enumerate() {
        let d = rel_diff(f, p)?;
        anyhow::ensure!(d <= tol, "output {i}: relative difference {d:e} > {tol:e}");
    }
    Ok(())
}
test_device!(
    fused_models_match_unfused,
    ops_fused_models_cpu,
    ops_fused_models_gpu
);
