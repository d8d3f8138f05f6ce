//! The fused training ops of `candle_offload::kernels` (`norm::rms_norm`, `activation::swiglu`,
//! `loss::cross_entropy`, `attention::flash_attention`) against Candle autograd of the
//! compositions they replace, per device (the CPU runs their CPU loops, CUDA the project's
//! kernels): forward values and every gradient, F32 within 1e-5 and F16/BF16 within 1e-2 (max
//! abs difference over the reference's max abs; the reference runs in F32 on the same rounded
//! inputs), odd sizes; `FusedAdamW` follows candle-nn's `AdamW` within 1e-6 over 100 steps;
//! and the trainer's loss, gradients and steps agree with its fused ops on and off.

use candle_core::{DType, Device, Module as _, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use candle_offload::kernels::optimizer::FusedAdamW;
use candle_offload::kernels::{activation, loss, norm};
use candle_offload::Precision;
use candle_offload_models::{TrainSettings, Trainer};
use rand::Rng as _;

use crate::ops::common::{
    ensure_close_values as ensure_close, rel_diff_values as rel_diff, tolerance, DTYPES,
};

/// Uniform values in [-scale, scale) of `shape`, in F32 on the CPU.
fn random(shape: &[usize], scale: f32, seed: u64) -> anyhow::Result<Tensor> {
    let n = shape.iter().product();
    let mut rng = candle_offload_suite::rng(seed);
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// `values` in `dtype` on `device` as a variable, and the same rounded values in F32 as a
/// variable for the reference.
fn pair(values: &Tensor, dtype: DType, device: &Device) -> anyhow::Result<(Var, Var)> {
    let t = values.to_dtype(dtype)?.to_device(device)?;
    let r = t.to_dtype(DType::F32)?;
    Ok((Var::from_tensor(&t)?, Var::from_tensor(&r)?))
}

/// `sum(y · weights)` in F32: a loss whose gradient reaches every output element differently.
fn weighted_sum(y: &Tensor, weights: &Tensor) -> anyhow::Result<Tensor> {
    Ok((y.to_dtype(DType::F32)? * weights)?.sum_all()?)
}

/// Row shapes with odd widths (one element, one row, many rows, wider than a block).
const ROW_SHAPES: [&[usize]; 6] = [
    &[1, 1],
    &[1, 7],
    &[3, 7],
    &[2, 9, 577],
    &[5, 4099],
    &[130, 33],
];

fn rms_norm_matches_composition(device: &Device) -> anyhow::Result<()> {
    for dtype in DTYPES {
        for (i, shape) in ROW_SHAPES.iter().enumerate() {
            let width = shape[shape.len() - 1];
            let seed = 100 + i as u64;
            let (x, x32) = pair(&random(shape, 2.0, seed)?, dtype, device)?;
            let w_values = (random(&[width], 0.5, seed + 1)? + 1.0)?;
            let (w, w32) = pair(&w_values, dtype, device)?;
            let up = random(shape, 1.0, seed + 2)?.to_device(device)?;
            let eps = 1e-5;

            let y = norm::rms_norm(&x, &w, eps)?;
            anyhow::ensure!(y.dtype() == dtype, "output dtype {:?}", y.dtype());
            let grads = weighted_sum(&y, &up)?.backward()?;
            let y_ref = norm::rms_norm_composite(&x32, &w32, eps)?;
            let grads_ref = weighted_sum(&y_ref, &up)?.backward()?;

            let what = format!("rms_norm {shape:?}");
            ensure_close(&format!("{what} y"), &y, &y_ref, dtype)?;
            let g = |s: &candle_core::backprop::GradStore, v: &Var| {
                s.get(v)
                    .cloned()
                    .ok_or_else(|| anyhow::anyhow!("{what}: no gradient"))
            };
            // dx = w·dy/rms − x·Σ(w·dy·x)/(n·rms³): two terms of the size of w·dy/rms that
            // cancel (for a width of 1, down to w·dy·eps/rms³), so its rounding error is
            // relative to that size, whatever dx's own.
            let (dx, dx_ref) = (g(&grads, &x)?, g(&grads_ref, &x32)?);
            let rms = x32
                .as_tensor()
                .to_device(&Device::Cpu)?
                .sqr()?
                .mean_keepdim(candle_core::D::Minus1)?
                .affine(1.0, eps)?
                .sqrt()?;
            let term = (up
                .to_device(&Device::Cpu)?
                .broadcast_mul(&w32.as_tensor().to_device(&Device::Cpu)?)?)
            .abs()?
            .broadcast_div(&rms)?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
            let maxabs = |t: &Tensor| -> anyhow::Result<f32> {
                Ok(t.to_dtype(DType::F32)?
                    .to_device(&Device::Cpu)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?)
            };
            anyhow::ensure!(dx.shape() == dx_ref.shape(), "{what}: dx shape");
            let diff = maxabs(&(dx.to_dtype(DType::F32)? - dx_ref.to_dtype(DType::F32)?)?)?;
            let d = diff / maxabs(&dx_ref)?.max(term).max(f32::MIN_POSITIVE);
            anyhow::ensure!(
                d <= tolerance(dtype),
                "{what} dx {dtype:?}: difference {d:e} of the terms' size > {:e}",
                tolerance(dtype)
            );
            ensure_close(
                &format!("{what} dw"),
                &g(&grads, &w)?,
                &g(&grads_ref, &w32)?,
                dtype,
            )?;
        }
    }
    Ok(())
}
test_device!(
    rms_norm_matches_composition,
    train_ops_rms_norm_cpu,
    train_ops_rms_norm_gpu
);

/// candle-nn's `RmsNorm::forward` gives no gradient on contiguous input; ours does.
#[test]
fn rms_norm_keeps_the_gradient_candle_nn_cuts() -> anyhow::Result<()> {
    let x = Var::from_tensor(&random(&[3, 8], 1.0, 7)?)?;
    let w = Tensor::ones(8, DType::F32, &Device::Cpu)?;
    let cut = candle_nn::RmsNorm::new(w.clone(), 1e-5).forward(x.as_tensor())?;
    let cut_grads = cut.sum_all()?.backward()?;
    anyhow::ensure!(
        cut_grads.get(&x).is_none(),
        "candle-nn's RmsNorm now passes gradients: this test's premise changed"
    );
    let ours = norm::rms_norm(&x, &w, 1e-5)?;
    let grads = (ours * 2.0)?.sum_all()?.backward()?;
    anyhow::ensure!(grads.get(&x).is_some(), "fused rms_norm cut the gradient");
    Ok(())
}

fn swiglu_matches_composition(device: &Device) -> anyhow::Result<()> {
    for dtype in DTYPES {
        for (i, shape) in ROW_SHAPES.iter().enumerate() {
            let seed = 200 + i as u64;
            let (a, a32) = pair(&random(shape, 6.0, seed)?, dtype, device)?;
            let (u, u32_) = pair(&random(shape, 2.0, seed + 1)?, dtype, device)?;
            let up = random(shape, 1.0, seed + 2)?.to_device(device)?;

            let y = activation::swiglu(&a, &u)?;
            anyhow::ensure!(y.dtype() == dtype, "output dtype {:?}", y.dtype());
            let grads = weighted_sum(&y, &up)?.backward()?;
            let y_ref = activation::swiglu_composite(&a32, &u32_)?;
            let grads_ref = weighted_sum(&y_ref, &up)?.backward()?;

            let what = format!("swiglu {shape:?}");
            ensure_close(&format!("{what} y"), &y, &y_ref, dtype)?;
            let g = |s: &candle_core::backprop::GradStore, v: &Var| {
                s.get(v)
                    .cloned()
                    .ok_or_else(|| anyhow::anyhow!("{what}: no gradient"))
            };
            ensure_close(
                &format!("{what} d gate"),
                &g(&grads, &a)?,
                &g(&grads_ref, &a32)?,
                dtype,
            )?;
            ensure_close(
                &format!("{what} d up"),
                &g(&grads, &u)?,
                &g(&grads_ref, &u32_)?,
                dtype,
            )?;
        }
    }
    Ok(())
}
test_device!(
    swiglu_matches_composition,
    train_ops_swiglu_cpu,
    train_ops_swiglu_gpu
);

fn cross_entropy_matches_composition(device: &Device) -> anyhow::Result<()> {
    // (rows, vocab): one class, odd vocabularies, one wider than any block, many rows.
    let shapes = [(1, 1), (3, 7), (5, 577), (4, 4099), (2, 49_153), (67, 129)];
    for dtype in DTYPES {
        for (i, &(rows, vocab)) in shapes.iter().enumerate() {
            let seed = 300 + i as u64;
            let (x, x32) = pair(&random(&[rows, vocab], 8.0, seed)?, dtype, device)?;
            let mut rng = candle_offload_suite::rng(seed + 1);
            let t: Vec<u32> = (0..rows)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect();
            let targets = Tensor::new(t, device)?;
            let up = (random(&[rows], 1.0, seed + 2)? + 1.5)?.to_device(device)?;

            let loss = loss::cross_entropy(&x, &targets)?;
            anyhow::ensure!(loss.dtype() == DType::F32, "loss dtype {:?}", loss.dtype());
            let grads = (&loss * &up)?.sum_all()?.backward()?;
            let loss_ref = loss::cross_entropy_composite(&x32, &targets)?;
            let grads_ref = (&loss_ref * &up)?.sum_all()?.backward()?;

            let what = format!("cross_entropy ({rows}, {vocab})");
            // One class: every loss is exactly 0, so compare absolutely.
            if vocab == 1 {
                let l = loss.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
                anyhow::ensure!(l.iter().all(|v| *v == 0.0), "{what}: losses {l:?}");
            } else {
                ensure_close(&format!("{what} loss"), &loss, &loss_ref, dtype)?;
            }
            let dx = grads
                .get(&x)
                .ok_or_else(|| anyhow::anyhow!("{what}: no gradient"))?;
            let dx_ref = grads_ref
                .get(&x32)
                .ok_or_else(|| anyhow::anyhow!("{what}: no reference gradient"))?;
            anyhow::ensure!(dx.dtype() == dtype, "gradient dtype {:?}", dx.dtype());
            if vocab == 1 {
                let d = dx
                    .to_dtype(DType::F32)?
                    .abs()?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                anyhow::ensure!(d == 0.0, "{what}: gradient {d} for a single class");
            } else {
                ensure_close(&format!("{what} dx"), dx, dx_ref, dtype)?;
            }
        }
    }
    Ok(())
}
test_device!(
    cross_entropy_matches_composition,
    train_ops_cross_entropy_cpu,
    train_ops_cross_entropy_gpu
);

/// Transposed and narrowed inputs (copied, or read at an offset) give the same values and
/// gradients as contiguous ones.
fn strided_inputs_match(device: &Device) -> anyhow::Result<()> {
    let base = Var::from_tensor(&random(&[40, 33], 2.0, 500)?.to_device(device)?)?;
    let w = Var::from_tensor(&(random(&[40], 0.5, 501)? + 1.0)?.to_device(device)?)?;
    let up = random(&[33, 40], 1.0, 502)?.to_device(device)?;
    // A transposed view: the op copies it, the gradient flows back through the copy.
    let x_t = base.t()?;
    let y = norm::rms_norm(&x_t, &w, 1e-6)?;
    let g = weighted_sum(&y, &up)?.backward()?;
    let y_ref = norm::rms_norm_composite(&x_t, &w, 1e-6)?;
    let g_ref = weighted_sum(&y_ref, &up)?.backward()?;
    ensure_close("rms_norm transposed y", &y, &y_ref, DType::F32)?;
    for (what, v) in [("dx", &base), ("dw", &w)] {
        let (a, b) = (g.get(v), g_ref.get(v));
        let (Some(a), Some(b)) = (a, b) else {
            anyhow::bail!("rms_norm transposed {what}: missing gradient")
        };
        ensure_close(&format!("rms_norm transposed {what}"), a, b, DType::F32)?;
    }
    let (gate, upv) = (base.t()?, base.t()?.affine(0.5, 0.1)?);
    let y = activation::swiglu(&gate, &upv)?;
    let g = weighted_sum(&y, &up)?.backward()?;
    let y_ref = activation::swiglu_composite(&gate, &upv)?;
    let g_ref = weighted_sum(&y_ref, &up)?.backward()?;
    ensure_close("swiglu transposed y", &y, &y_ref, DType::F32)?;
    let (Some(a), Some(b)) = (g.get(&base), g_ref.get(&base)) else {
        anyhow::bail!("swiglu transposed: missing gradient")
    };
    ensure_close("swiglu transposed d base", a, b, DType::F32)?;
    // Rows 7.. of the logits and targets: contiguous views at an offset.
    let targets = Tensor::new((0..40u32).map(|i| (i * 7) % 33).collect::<Vec<_>>(), device)?;
    let (x, t) = (base.narrow(0, 7, 20)?, targets.narrow(0, 7, 20)?);
    let loss = loss::cross_entropy(&x, &t)?;
    let g = loss.sum_all()?.backward()?;
    let loss_ref = loss::cross_entropy_composite(&x, &t)?;
    let g_ref = loss_ref.sum_all()?.backward()?;
    ensure_close("cross_entropy offset loss", &loss, &loss_ref, DType::F32)?;
    let (Some(a), Some(b)) = (g.get(&base), g_ref.get(&base)) else {
        anyhow::bail!("cross_entropy offset: missing gradient")
    };
    ensure_close("cross_entropy offset dx", a, b, DType::F32)?;
    Ok(())
}
test_device!(
    strided_inputs_match,
    train_ops_strided_inputs_cpu,
    train_ops_strided_inputs_gpu
);

/// (batch, heads, kv heads, t, head width): one position; MQA, GQA 4:1 and plain heads; t odd
/// and past one and two 64-row tiles; both widths the GPU kernels have, and one they lack (the
/// composition there).
const ATTN_SHAPES: [(usize, usize, usize, usize, usize); 7] = [
    (1, 1, 1, 1, 64),
    (2, 4, 1, 37, 64),
    (1, 8, 2, 70, 128),
    (2, 4, 4, 129, 64),
    (2, 8, 2, 65, 128),
    (1, 4, 1, 129, 128),
    (2, 2, 1, 9, 40),
];

fn flash_attention_matches_composition(device: &Device) -> anyhow::Result<()> {
    use candle_offload::kernels::attention::{self, FlashForward};
    for (dtype, forward) in DTYPES
        .into_iter()
        .flat_map(|d| [(d, FlashForward::Mma), (d, FlashForward::Wmma)])
    {
        if device.is_cpu() && forward != FlashForward::default() {
            continue; // one CPU loop whatever the variant
        }
        for (i, &(b, h, hkv, t, d)) in ATTN_SHAPES.iter().enumerate() {
            let seed = 600 + 10 * i as u64;
            let (q, q32) = pair(&random(&[b, h, t, d], 2.0, seed)?, dtype, device)?;
            let (k, k32) = pair(&random(&[b, hkv, t, d], 2.0, seed + 1)?, dtype, device)?;
            let (v, v32) = pair(&random(&[b, hkv, t, d], 1.5, seed + 2)?, dtype, device)?;
            let up = random(&[b, h, t, d], 1.0, seed + 3)?.to_device(device)?;
            let scale = 1.0 / (d as f32).sqrt();

            // On a GPU every dtype (F32 unless FLASH_GPU_F32 is off) has kernels for these
            // widths: the op, not the composition, is what is checked there.
            let kernel = device.is_cpu()
                || (attention::FLASH_GPU_HEAD_DIMS.contains(&d)
                    && (dtype != DType::F32 || attention::FLASH_GPU_F32));
            anyhow::ensure!(
                attention::flash_attention_supported(device, dtype, d) == kernel,
                "{dtype:?}, width {d}: kernel expected: {kernel}"
            );
            let y = attention::flash_attention_with(&q, &k, &v, scale, forward)?;
            anyhow::ensure!(y.dtype() == dtype, "output dtype {:?}", y.dtype());
            let grads = weighted_sum(&y, &up)?.backward()?;
            let y_ref = attention::flash_attention_composite(&q32, &k32, &v32, scale)?;
            let grads_ref = weighted_sum(&y_ref, &up)?.backward()?;

            let what =
                format!("flash_attention {forward:?} (b {b}, h {h}, hkv {hkv}, t {t}, d {d})");
            ensure_close(&format!("{what} y"), &y, &y_ref, dtype)?;
            // Where every query sees one key (t = 1) softmax is constant and dq, dk are zero:
            // a relative difference is then meaningless, so their scale is floored at 1% of
            // dv's (the same upstream gradient's size).
            let max_abs = |t: &Tensor| -> anyhow::Result<f32> {
                Ok(t.to_dtype(DType::F32)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?)
            };
            let dv_ref = grads_ref
                .get(&v32)
                .ok_or_else(|| anyhow::anyhow!("{what}: no reference dv"))?;
            let floor = 1e-2 * max_abs(dv_ref)?;
            for (name, var, var32) in [("dq", &q, &q32), ("dk", &k, &k32), ("dv", &v, &v32)] {
                let g = grads
                    .get(var)
                    .ok_or_else(|| anyhow::anyhow!("{what}: no {name}"))?;
                let g_ref = grads_ref
                    .get(var32)
                    .ok_or_else(|| anyhow::anyhow!("{what}: no reference {name}"))?;
                anyhow::ensure!(g.dtype() == dtype, "{what} {name} dtype {:?}", g.dtype());
                let diff = max_abs(&(g.to_dtype(DType::F32)? - g_ref.to_dtype(DType::F32)?)?)?;
                let d = diff / max_abs(g_ref)?.max(floor);
                anyhow::ensure!(
                    d <= tolerance(dtype),
                    "{what} {name} {dtype:?}: relative difference {d:e} > {:e}",
                    tolerance(dtype)
                );
            }
        }
    }
    Ok(())
}
test_device!(
    flash_attention_matches_composition,
    train_ops_flash_attention_cpu,
    train_ops_flash_attention_gpu
);

/// Inputs at an odd offset in their buffers and transposed views: the same values and
/// gradients as the composition.
fn flash_attention_strided_inputs(device: &Device) -> anyhow::Result<()> {
    use candle_offload::kernels::attention;
    for dtype in [DType::F32, DType::BF16] {
        let (b, h, hkv, t, d) = (1, 4, 2, 33, 64);
        let base = random(&[1 + 3 * b * h * t * d], 2.0, 700)?;
        let (x, x32) = pair(&base, dtype, device)?;
        let n = b * h * t * d;
        let take = |x: &Tensor, i: usize, heads: usize| -> candle_core::Result<Tensor> {
            // (b, t, heads, d) at offset 1 + i·n, seen as (b, heads, t, d).
            x.narrow(0, 1 + i * n, b * heads * t * d)?
                .reshape((b, t, heads, d))?
                .transpose(1, 2)
        };
        let up = random(&[b, h, t, d], 1.0, 701)?.to_device(device)?;
        let y = attention::flash_attention(
            &take(&x, 0, h)?,
            &take(&x, 1, hkv)?,
            &take(&x, 2, hkv)?,
            0.125,
        )?;
        let g = weighted_sum(&y, &up)?.backward()?;
        let y_ref = attention::flash_attention_composite(
            &take(&x32, 0, h)?,
            &take(&x32, 1, hkv)?,
            &take(&x32, 2, hkv)?,
            0.125,
        )?;
        let g_ref = weighted_sum(&y_ref, &up)?.backward()?;
        ensure_close("flash_attention strided y", &y, &y_ref, dtype)?;
        let (Some(a), Some(r)) = (g.get(&x), g_ref.get(&x32)) else {
            anyhow::bail!("flash_attention strided: missing gradient")
        };
        ensure_close("flash_attention strided d base", a, r, dtype)?;
    }
    Ok(())
}
test_device!(
    flash_attention_strided_inputs,
    train_ops_flash_attention_strided_cpu,
    train_ops_flash_attention_strided_gpu
);

#[test]
fn train_ops_flash_attention_refuses_bad_input() -> anyhow::Result<()> {
    use candle_offload::kernels::attention::flash_attention;
    let q = random(&[1, 4, 5, 8], 1.0, 1)?;
    let kv = random(&[1, 2, 5, 8], 1.0, 2)?;
    let cases = [
        (
            "3 heads over 2",
            random(&[1, 3, 5, 8], 1.0, 3)?,
            kv.clone(),
            kv.clone(),
            1.0,
        ),
        (
            "other t",
            q.clone(),
            random(&[1, 2, 6, 8], 1.0, 4)?,
            random(&[1, 2, 6, 8], 1.0, 4)?,
            1.0,
        ),
        (
            "k and v differ",
            q.clone(),
            kv.clone(),
            random(&[1, 1, 5, 8], 1.0, 5)?,
            1.0,
        ),
        (
            "mixed dtypes",
            q.clone(),
            kv.to_dtype(DType::F16)?,
            kv.clone(),
            1.0,
        ),
        ("three dims", q.squeeze(0)?, kv.clone(), kv.clone(), 1.0),
        ("nan scale", q.clone(), kv.clone(), kv.clone(), f32::NAN),
    ];
    for (what, q, k, v, scale) in cases {
        match flash_attention(&q, &k, &v, scale) {
            Ok(_) => anyhow::bail!("{what}: accepted"),
            Err(e) => {
                let e = e.to_string();
                anyhow::ensure!(
                    e.contains("flash-attention") || e.contains("unexpected rank"),
                    "{what}: {e}"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn fused_ops_refuse_bad_input() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let x = random(&[2, 5], 1.0, 1)?;
    let err = |r: candle_core::Result<Tensor>| match r {
        Ok(_) => anyhow::bail!("accepted"),
        Err(e) => Ok(e.to_string()),
    };
    let e = err(norm::rms_norm(
        &x,
        &Tensor::ones(4, DType::F32, &dev)?,
        1e-5,
    ))?;
    anyhow::ensure!(e.contains("does not match"), "{e}");
    let e = err(norm::rms_norm(
        &x,
        &Tensor::ones(5, DType::F16, &dev)?,
        1e-5,
    ))?;
    anyhow::ensure!(e.contains("mixed dtypes"), "{e}");
    let e = err(activation::swiglu(&x, &random(&[5, 2], 1.0, 2)?))?;
    anyhow::ensure!(e.contains("differ in shape"), "{e}");
    let e = err(loss::cross_entropy(&x, &Tensor::new(&[1u32, 2, 3], &dev)?))?;
    anyhow::ensure!(e.contains("do not match"), "{e}");
    let e = err(loss::cross_entropy(&x, &Tensor::new(&[1u32, 5], &dev)?))?;
    anyhow::ensure!(e.contains("outside the vocabulary"), "{e}");
    Ok(())
}

/// Deterministic gradients for step `step` of each variable.
fn step_grads(
    vars: &[Var],
    step: usize,
    device: &Device,
) -> anyhow::Result<candle_core::backprop::GradStore> {
    let mut store = candle_core::backprop::GradStore::default();
    for (i, v) in vars.iter().enumerate() {
        // Every third step the last variable has no gradient (skipped, as candle-nn does).
        if i + 1 == vars.len() && step.is_multiple_of(3) {
            continue;
        }
        let g = random(v.dims(), 1.0, (step * 31 + i) as u64)?.to_device(device)?;
        store.insert(v.as_tensor(), g);
    }
    Ok(store)
}

fn fused_adamw_follows_candle_nn(device: &Device) -> anyhow::Result<()> {
    let shapes: [&[usize]; 4] = [&[7], &[33, 65], &[1], &[4, 4099]];
    let make = || -> anyhow::Result<Vec<Var>> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                Ok(Var::from_tensor(
                    &random(s, 1.0, 900 + i as u64)?.to_device(device)?,
                )?)
            })
            .collect()
    };
    let (ours_vars, ref_vars, scaled_vars) = (make()?, make()?, make()?);
    let params = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut ours = FusedAdamW::new(ours_vars.clone(), params.clone())?;
    let mut reference = AdamW::new(ref_vars.clone(), params.clone())?;
    // Gradients of a loss scaled by 2^10, unscaled inside the step: exactly `ours`.
    let mut scaled = FusedAdamW::new(scaled_vars.clone(), params)?;
    for step in 0..100 {
        if step == 50 {
            ours.set_learning_rate(5e-3);
            reference.set_learning_rate(5e-3);
            scaled.set_learning_rate(5e-3);
        }
        ours.step(&step_grads(&ours_vars, step, device)?)?;
        reference.step(&step_grads(&ref_vars, step, device)?)?;
        let grads = step_grads(&scaled_vars, step, device)?;
        let mut times = candle_core::backprop::GradStore::default();
        for v in &scaled_vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                times.insert(v.as_tensor(), (g * 1024.0)?);
            }
        }
        scaled.step_scaled(&times, 1.0 / 1024.0)?;
    }
    for (a, b) in ours_vars.iter().zip(&scaled_vars) {
        let (a, b) = (
            a.as_tensor().flatten_all()?.to_vec1::<f32>()?,
            b.as_tensor().flatten_all()?.to_vec1::<f32>()?,
        );
        anyhow::ensure!(a == b, "unscaled in the step: not the plain step's values");
    }
    for (i, (a, b)) in ours_vars.iter().zip(&ref_vars).enumerate() {
        let d = (a.as_tensor() - b.as_tensor())?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        anyhow::ensure!(
            d <= 1e-6,
            "parameter {i} {:?}: max difference {d:e}",
            a.dims()
        );
        // The trajectory moved: the comparison is not of two untouched copies.
        let moved = (a.as_tensor() - random(shapes[i], 1.0, 900 + i as u64)?.to_device(device)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        anyhow::ensure!(moved > 1e-2, "parameter {i} moved only {moved}");
    }
    Ok(())
}
test_device!(
    fused_adamw_follows_candle_nn,
    train_ops_fused_adamw_cpu,
    train_ops_fused_adamw_gpu
);

#[test]
fn fused_adamw_refuses_non_f32_variables() -> anyhow::Result<()> {
    let v = Var::from_tensor(&Tensor::zeros(3, DType::F16, &Device::Cpu)?)?;
    let e = FusedAdamW::new(vec![v], ParamsAdamW::default()).unwrap_err();
    anyhow::ensure!(e.to_string().contains("F32"), "{e}");
    Ok(())
}

/// The first loss, the gradients by name, and the losses of three steps.
type Run = (f32, Vec<(String, Tensor)>, Vec<f32>);

/// A tiny model's loss, gradients and three steps with the fused ops on and off.
fn trainer_fused_matches_unfused(device: &Device) -> anyhow::Result<()> {
    let dir = crate::util::scratch(&format!("train-ops-{}", device.is_cuda()));
    crate::models::write_tiny_llama(&dir, false, false)?;
    let files = candle_offload_models::loader::from_dir(&dir)?;
    let ids: Vec<u32> = (0..26u32).map(|i| (i * 37 + 11) % 101).collect();
    let inputs = Tensor::new(vec![ids[..12].to_vec(), ids[13..25].to_vec()], device)?;
    let targets = Tensor::new(vec![ids[1..13].to_vec(), ids[14..26].to_vec()], device)?;
    // Plain, and checkpointed with the loss over chunks of 5 tokens (views at an offset).
    for (segments, chunk) in [(0, None), (2, Some(5))] {
        let run = |fused: bool| -> anyhow::Result<Run> {
            let settings = TrainSettings {
                checkpoint_segments: segments,
                loss_chunk_tokens: chunk,
                batch_size: 2,
                seq_len: 12,
                fused,
                adamw: ParamsAdamW {
                    lr: 1e-3,
                    weight_decay: 0.01,
                    ..Default::default()
                },
                ..Default::default()
            };
            let mut trainer = Trainer::from_files(&files, device, &settings)?;
            let (loss, grads) = trainer.loss_and_grads(&inputs, &targets)?;
            let mut grads: Vec<_> = grads.into_iter().collect();
            grads.sort_by(|a, b| a.0.cmp(&b.0));
            let losses = (0..3)
                .map(|_| Ok(trainer.step(&inputs, &targets)?.loss))
                .collect::<anyhow::Result<Vec<f32>>>()?;
            Ok((loss, grads, losses))
        };
        let (loss_f, grads_f, steps_f) = run(true)?;
        let (loss_u, grads_u, steps_u) = run(false)?;
        anyhow::ensure!(
            ((loss_f - loss_u) / loss_u).abs() <= 1e-5,
            "{segments} segments: loss {loss_f} fused, {loss_u} unfused"
        );
        anyhow::ensure!(grads_f.len() == grads_u.len() && !grads_f.is_empty());
        for ((name, gf), (name_u, gu)) in grads_f.iter().zip(&grads_u) {
            anyhow::ensure!(name == name_u);
            let d = rel_diff(gf, gu)?;
            anyhow::ensure!(
                d <= 1e-4,
                "{segments} segments: {name}: gradient differs by {d:e}"
            );
        }
        for (a, b) in steps_f.iter().zip(&steps_u) {
            anyhow::ensure!(
                ((a - b) / b).abs() <= 1e-4,
                "step losses {steps_f:?} vs {steps_u:?}"
            );
        }
    }
    Ok(())
}
test_device!(
    trainer_fused_matches_unfused,
    train_ops_trainer_fused_cpu,
    train_ops_trainer_fused_gpu
);

/// Offloaded training's host gradient sums: through the page-locked staging of a GPU (or
/// straight from a CPU tensor) the same F32 values as `acc + g.to_dtype(F32)`, for every
/// float dtype, growing the staging buffer for a larger gradient after a smaller one, and
/// from a strided gradient.
fn host_gradients_sum_exactly(device: &Device) -> anyhow::Result<()> {
    use candle_offload::train::HostGradients;
    let mut sums = HostGradients::new();
    for (i, n) in [(0u64, 1000usize), (1, 300_001), (2, 17)] {
        for dtype in DTYPES {
            let a = random(&[n, 3], 2.0, 800 + i)?
                .to_dtype(dtype)?
                .to_device(device)?;
            let b = random(&[3, n], 2.0, 900 + i)?
                .to_dtype(dtype)?
                .to_device(device)?
                .t()?;
            let first = sums.accumulate(None, &a)?;
            let want = a.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            anyhow::ensure!(first.device().is_cpu(), "the sum lives on the host");
            anyhow::ensure!(
                first.to_vec2::<f32>()? == want.to_vec2::<f32>()?,
                "{dtype:?} n {n}: first gradient"
            );
            let sum = sums.accumulate(Some(first), &b)?;
            let want = (want + b.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)?;
            anyhow::ensure!(
                sum.to_vec2::<f32>()? == want.to_vec2::<f32>()?,
                "{dtype:?} n {n}: sum"
            );
        }
    }
    Ok(())
}
test_device!(
    host_gradients_sum_exactly,
    train_ops_host_gradients_cpu,
    train_ops_host_gradients_gpu
);

/// The hand-written backward pass of the plain pre-norm block against Candle's graph of the
/// same fused ops: loss, every gradient and three steps, plain and checkpointed, in F32 (and
/// BF16, within half precision's tolerance), for LLaMA, for Qwen2's q/k/v biases and with a
/// tied head, over one loss chunk and over five; the hand path must have run for every weight
/// of every layer and for the final norm and head of every chunk.
fn hand_backward_matches_graph(device: &Device) -> anyhow::Result<()> {
    let ids: Vec<u32> = (0..26u32).map(|i| (i * 37 + 11) % 101).collect();
    let inputs = Tensor::new(vec![ids[..12].to_vec(), ids[13..25].to_vec()], device)?;
    let targets = Tensor::new(vec![ids[1..13].to_vec(), ids[14..26].to_vec()], device)?;
    for (bias, tied) in [(false, false), (true, false), (false, true)] {
        // Head width 64 (the GPU's flash kernels take 64 and 128), MQA, 12 tokens (not a
        // multiple of a tile).
        let cfg = candle_offload_models::Config::from_json_str(
            &serde_json::json!({
                "model_type": if bias { "qwen2" } else { "llama" },
                "hidden_size": 128, "intermediate_size": 160, "num_hidden_layers": 2,
                "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 101,
                "tie_word_embeddings": tied,
            })
            .to_string(),
            std::path::Path::new("<hand-backward shape>"),
        )?;
        let tensors = cfg
            .expected_tensors()
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let r = random(&shape, 0.1, 4000 + i as u64)?;
                let t = if name.ends_with("norm.weight") {
                    (r + 1.0)?
                } else {
                    r
                };
                Ok((name, t))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Nine weights per layer (and three biases with them), plus the final norm's and the
        // head's for each loss chunk.
        let per_layers = cfg.num_hidden_layers * if bias { 12 } else { 9 };
        for (segments, chunk) in [(0, None), (2, Some(5usize))] {
            let want = per_layers + 2 * chunk.map_or(1, |c| 24usize.div_ceil(c));
            let run = |precision: Precision, hand: bool| -> anyhow::Result<(Run, usize)> {
                let settings = TrainSettings {
                    precision,
                    checkpoint_segments: segments,
                    loss_chunk_tokens: chunk,
                    batch_size: 2,
                    seq_len: 12,
                    hand_backward: hand,
                    adamw: ParamsAdamW {
                        lr: 1e-3,
                        weight_decay: 0.01,
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let mut trainer = Trainer::new(
                    cfg.clone(),
                    tensors.clone(),
                    device,
                    &settings,
                    std::path::Path::new("<random>"),
                )?;
                let (loss, grads) = trainer.loss_and_grads(&inputs, &targets)?;
                let by_hand = trainer.hand_backward_gradients();
                let mut grads: Vec<_> = grads.into_iter().collect();
                grads.sort_by(|a, b| a.0.cmp(&b.0));
                let losses = (0..3)
                    .map(|_| Ok(trainer.step(&inputs, &targets)?.loss))
                    .collect::<anyhow::Result<Vec<f32>>>()?;
                Ok(((loss, grads, losses), by_hand))
            };
            let mut runs = Vec::new();
            for precision in [Precision::F32, Precision::BF16] {
                let what = format!("bias {bias}, tied {tied}, {precision:?}, {segments} segments");
                let (hand, n_hand) = run(precision, true)?;
                let (graph, n_graph) = run(precision, false)?;
                anyhow::ensure!(
                    n_hand == want,
                    "{what}: {n_hand} gradients by hand, want {want}"
                );
                anyhow::ensure!(n_graph == 0, "{what}: {n_graph} by hand with it off");
                anyhow::ensure!(hand.1.len() == graph.1.len() && !hand.1.is_empty());
                runs.push((what, hand, graph));
            }
            // F32: the same sums in another order, so within F32 rounding.
            let (what, (loss_h, grads_h, steps_h), (loss_g, grads_g, steps_g)) = &runs[0];
            let rel = |a: f32, b: f32| ((a - b) / b).abs();
            anyhow::ensure!(
                rel(*loss_h, *loss_g) <= 1e-5,
                "{what}: loss {loss_h} by hand, {loss_g} through the graph"
            );
            for ((name, gh), (name_g, gg)) in grads_h.iter().zip(grads_g) {
                anyhow::ensure!(name == name_g);
                let d = rel_diff(gh, gg)?;
                anyhow::ensure!(d <= 1e-5, "{what}: {name}: gradient differs by {d:e}");
            }
            for (a, b) in steps_h.iter().zip(steps_g) {
                anyhow::ensure!(
                    rel(*a, *b) <= 1e-5,
                    "{what}: steps {steps_h:?} vs {steps_g:?}"
                );
            }
            // BF16: each path rounds differently (the graph sums in BF16 where the hand path
            // sums a bias's gradient in F32), so both are measured against the F32 gradients.
            // A few BF16 roundings (2^-8 each) in a row reach 1e-2 on either path: the hand
            // path must be within 2e-2 of F32, or no further than 1.5 times the graph is.
            let reference = &runs[0].1 .1;
            let (what, (loss_h, grads_h, _), (loss_g, grads_g, _)) = &runs[1];
            anyhow::ensure!(
                rel(*loss_h, runs[0].1 .0) <= 1e-2,
                "{what}: loss {loss_h} by hand, {} in F32 ({loss_g} through the graph)",
                runs[0].1 .0
            );
            for (((name, gh), (_, gg)), (_, want)) in grads_h.iter().zip(grads_g).zip(reference) {
                let (err_h, err_g) = (rel_diff(gh, want)?, rel_diff(gg, want)?);
                anyhow::ensure!(
                    err_h <= 2e-2 || err_h <= 1.5 * err_g,
                    "{what}: {name}: {err_h:e} from F32 by hand, {err_g:e} through the graph"
                );
            }
        }
    }
    Ok(())
}
test_device!(
    hand_backward_matches_graph,
    train_ops_hand_backward_cpu,
    train_ops_hand_backward_gpu
);

/// A resident trainer turns cudarc's event tracking off for its GPU's context while it lives
/// and restores it when dropped (`TrainSettings::event_tracking` keeps it on); on the CPU the
/// switch is a no-op that reports what it was asked.
fn trainer_event_tracking(device: &Device) -> anyhow::Result<()> {
    use candle_offload::train::set_event_tracking;
    let cfg = candle_offload_models::Config::from_json_str(
        &serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 101, "tie_word_embeddings": false,
        })
        .to_string(),
        std::path::Path::new("<tracking shape>"),
    )?;
    for keep in [false, true] {
        set_event_tracking(device, true)?;
        let settings = TrainSettings {
            event_tracking: keep,
            ..Default::default()
        };
        let trainer = Trainer::random(cfg.clone(), device, &settings)?;
        // Asking for the current state back: off while a trainer that turned it off lives.
        let during = set_event_tracking(device, keep)?;
        drop(trainer);
        let after = set_event_tracking(device, true)?;
        if device.is_cuda() {
            anyhow::ensure!(
                during == keep,
                "keep {keep}: tracking {during} during training"
            );
            anyhow::ensure!(
                after,
                "keep {keep}: tracking not restored after the trainer"
            );
        } else {
            anyhow::ensure!(
                during == keep && after,
                "the CPU's switch reports what it is asked"
            );
        }
    }
    Ok(())
}
test_device!(
    trainer_event_tracking,
    train_ops_event_tracking_cpu,
    train_ops_event_tracking_gpu
);
