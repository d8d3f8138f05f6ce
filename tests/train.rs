//! Training: checkpointed gradients equal plain ones exactly (resident and offloaded),
//! autocast gradients stay within named tolerances of F32, the loss scaler skips, backs off
//! and grows as PyTorch's does, and fine-tuning lowers the loss on a fixed text.

use std::collections::HashMap;

use crate::util::{scratch, Scratch};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW, SGD};
use candle_offload::train::{GradScaler, GradScalerConfig, StepOutcome};
use candle_offload::{MemoryLimit, Precision};
use candle_offload_models::loader;
use candle_offload_models::{TrainSettings, Trainer};

/// Relative gradient error allowed under F16 autocast (‖g − g₃₂‖ / ‖g₃₂‖ per tensor).
const F16_GRAD_TOLERANCE: f64 = 1e-2;
/// The same under BF16 autocast (8 mantissa bits instead of 11).
const BF16_GRAD_TOLERANCE: f64 = 5e-2;

/// The tiny LLaMA (tied embeddings or not) in a fresh temporary directory, removed when the
/// returned [`Scratch`] is dropped, and its files.
fn tiny(tag: &str, tied: bool) -> anyhow::Result<(Scratch, loader::ModelFiles)> {
    let dir = scratch(&format!("train-{tag}"));
    crate::models::write_tiny_llama(&dir, tied, false)?;
    let files = loader::from_dir(&dir)?;
    Ok((dir, files))
}

/// [`tiny`] of another family.
fn tiny_kind(
    tag: &str,
    kind: crate::models::Tiny,
) -> anyhow::Result<(Scratch, loader::ModelFiles)> {
    let dir = scratch(&format!("train-{tag}-{}", kind.tag()));
    crate::models::write_tiny(&dir, kind)?;
    let files = loader::from_dir(&dir)?;
    Ok((dir, files))
}

/// A fixed batch: two sequences of 12 tokens and their next-token targets.
fn batch(device: &Device) -> anyhow::Result<(Tensor, Tensor)> {
    let ids: Vec<u32> = (0..26u32).map(|i| (i * 37 + 11) % 101).collect();
    let rows = |off: usize| ids[off..off + 13].to_vec();
    let (a, b) = (rows(0), rows(13));
    let inputs = Tensor::new(vec![a[..12].to_vec(), b[..12].to_vec()], device)?;
    let targets = Tensor::new(vec![a[1..].to_vec(), b[1..].to_vec()], device)?;
    Ok((inputs, targets))
}

fn settings(segments: usize) -> TrainSettings {
    TrainSettings {
        checkpoint_segments: segments,
        batch_size: 2,
        seq_len: 12,
        ..Default::default()
    }
}

/// Loss, gradients, recomputed segments, and (offloaded) layer fetches and peak bytes resident.
type Grads = (f32, HashMap<String, Tensor>, usize, Option<(u64, u64, u64)>);

fn grads(files: &loader::ModelFiles, device: &Device, s: &TrainSettings) -> anyhow::Result<Grads> {
    let mut trainer = Trainer::from_files(files, device, s)?;
    let (inputs, targets) = batch(device)?;
    let (loss, g) = trainer.loss_and_grads(&inputs, &targets)?;
    let offload = match trainer.runtime() {
        Some(rt) => {
            let st = rt.stats()?;
            let layer_fetches = st
                .units
                .iter()
                .filter(|u| u.name.starts_with("model.layers."))
                .map(|u| u.misses)
                .sum();
            Some((
                layer_fetches,
                st.peak_resident_bytes,
                st.weight_capacity_bytes,
            ))
        }
        None => None,
    };
    Ok((loss, g, trainer.recomputed_segments(), offload))
}

fn values(t: &Tensor) -> anyhow::Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
}

fn rel_err(a: &Tensor, b: &Tensor) -> anyhow::Result<f64> {
    let (a, b) = (values(a)?, values(b)?);
    let diff: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    Ok((diff / norm.max(1e-30)).sqrt())
}

/// 1 segment, 2 segments and one per layer, resident and offloaded under a budget that holds
/// only a few layers, with and without head groups and loss chunks: bit-identical gradients.
fn checkpointed_gradients_are_exact(device: &Device) -> anyhow::Result<()> {
    let (_dir, files) = tiny("exact", false)?;
    let n_layers = files.config.num_hidden_layers;
    for (head_chunks, loss_chunk) in [(1, None), (2, Some(5))] {
        let with = |mut s: TrainSettings| {
            s.head_chunks = Some(head_chunks);
            s.loss_chunk_tokens = loss_chunk;
            s
        };
        let (loss0, plain, _, _) = grads(&files, device, &with(settings(0)))?;
        // Offloaded blocks go through Candle's graph (the hand-written block backward pass is
        // for resident weights): their reference is the plain run through the graph too.
        let (graph_loss0, graph_plain, _, _) = grads(
            &files,
            device,
            &TrainSettings {
                hand_backward: false,
                ..with(settings(0))
            },
        )?;
        assert_eq!(
            plain.len(),
            1 + 1 + 1 + 9 * n_layers,
            "every tensor has a gradient"
        );
        for segments in [1, 2, n_layers] {
            for offload in [false, true] {
                let mut s = with(settings(segments));
                s.offload = offload;
                let seg_len = n_layers.div_ceil(segments) as u64;
                let layer = 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 96 + 2 * 64) as u64;
                if offload {
                    let kept = 4 * (2 * 101 * 64 + 64) as u64;
                    let reserve = files
                        .config
                        .train_reserve_bytes(2, 12, segments, DType::F32);
                    // Room for one segment plus one layer in flight: fewer than all layers
                    // unless a segment is the whole model.
                    s.gpu_memory_limit =
                        Some(MemoryLimit::Bytes(reserve + kept + (seg_len + 1) * layer));
                }
                let (loss, g, recomputes, streamed) = grads(&files, device, &s)?;
                let what = format!("{segments} segments, offload {offload}, heads {head_chunks}, loss chunk {loss_chunk:?}");
                let (loss0, plain) = if offload {
                    (graph_loss0, &graph_plain)
                } else {
                    (loss0, &plain)
                };
                assert_eq!(loss, loss0, "{what}");
                assert!(recomputes >= segments, "{what}: {recomputes} recomputes");
                if let Some((fetches, peak, capacity)) = streamed {
                    assert!(
                        peak <= capacity,
                        "{what}: peak {peak} > capacity {capacity}"
                    );
                    if seg_len + 1 < n_layers as u64 {
                        // Forward and recompute each need every layer; the budget holds fewer.
                        assert!(fetches > n_layers as u64, "{what}: {fetches} layer fetches");
                    }
                }
                for (name, want) in plain {
                    let got = g
                        .get(name)
                        .unwrap_or_else(|| panic!("{what}: no gradient for {name}"));
                    assert_eq!(values(got)?, values(want)?, "{what}: {name}");
                }
            }
        }
    }
    Ok(())
}
test_device!(
    checkpointed_gradients_are_exact,
    checkpointed_gradients_are_exact_cpu,
    checkpointed_gradients_are_exact_gpu
);

/// Every family trains through the one trainer: Phi-3 (fused projections, partial rotary,
/// sliding window), Gemma (1 + w norms, scaled embeddings) and Gemma 2 (post-norms,
/// soft-capping, alternating windows) give every tensor a gradient, checkpointed and offloaded
/// gradients equal plain ones bit for bit, and a few AdamW steps lower the loss.
fn every_family_trains(device: &Device) -> anyhow::Result<()> {
    use crate::models::Tiny;
    for kind in [Tiny::Phi3, Tiny::Gemma, Tiny::Gemma2] {
        let (_dir, files) = tiny_kind("family", kind)?;
        let n_tensors = files.config.expected_tensors().len();
        let (loss0, plain, _, _) = grads(&files, device, &settings(0))?;
        assert_eq!(
            plain.len(),
            n_tensors,
            "{kind:?}: every tensor has a gradient"
        );
        let mut s = settings(2);
        s.offload = true;
        s.head_chunks = Some(2);
        let (loss, g, _, _) = grads(&files, device, &s)?;
        assert_eq!(loss, loss0, "{kind:?}");
        for (name, want) in &plain {
            assert_eq!(values(&g[name])?, values(want)?, "{kind:?}: {name}");
        }
        let mut s = settings(1);
        s.adamw.lr = 1e-2;
        let mut trainer = Trainer::from_files(&files, device, &s)?;
        let (inputs, targets) = batch(device)?;
        let first = trainer.step(&inputs, &targets)?.loss;
        let mut last = first;
        for _ in 0..8 {
            last = trainer.step(&inputs, &targets)?.loss;
        }
        assert!(last < first * 0.9, "{kind:?}: loss {first} -> {last}");
    }
    Ok(())
}
test_device!(
    every_family_trains,
    every_family_trains_cpu,
    every_family_trains_gpu
);

/// Tied embeddings collect gradients from the embedding lookup and the output head, in the
/// outer graph and in checkpointed loss chunks, offloaded: the same as plain backprop (up to
/// the order of the sum).
fn tied_embeddings_offloaded(device: &Device) -> anyhow::Result<()> {
    let (_dir, files) = tiny("tied", true)?;
    let (_, plain, _, _) = grads(&files, device, &settings(0))?;
    let mut s = settings(2);
    s.offload = true;
    s.loss_chunk_tokens = Some(7);
    let (_, g, _, _) = grads(&files, device, &s)?;
    for (name, want) in &plain {
        let e = rel_err(&g[name], want)?;
        assert!(e < 1e-6, "{name}: relative error {e}");
    }
    Ok(())
}
test_device!(
    tied_embeddings_offloaded,
    tied_embeddings_offloaded_cpu,
    tied_embeddings_offloaded_gpu
);

/// Heads 64 wide with GQA 4:1, so that the fused trainer's attention is
/// `train::flash_attention` on a GPU too (its F32 and F16/BF16 kernels there): its
/// loss and gradients against the compositions (`fused: false`) under F32 and F16/BF16
/// autocast, within the named tolerances (1e-4 in F32).
fn flash_attention_trains_like_the_composition(device: &Device) -> anyhow::Result<()> {
    let (_dir, files) = tiny_kind("flash", crate::models::Tiny::WideHeads)?;
    for (precision, tol) in [
        (Precision::F32, 1e-4),
        (Precision::F16, F16_GRAD_TOLERANCE),
        (Precision::BF16, BF16_GRAD_TOLERANCE),
    ] {
        let mut s = settings(2);
        s.precision = precision;
        let (loss, g, _, _) = grads(&files, device, &s)?;
        s.fused = false;
        let (loss_ref, reference, _, _) = grads(&files, device, &s)?;
        assert!(
            ((loss - loss_ref) / loss_ref).abs() < tol as f32,
            "{precision}: loss {loss} fused, {loss_ref} composed"
        );
        for (name, want) in &reference {
            let e = rel_err(&g[name], want)?;
            assert!(e < tol, "{precision}: {name}: relative error {e} > {tol}");
        }
    }
    Ok(())
}
test_device!(
    flash_attention_trains_like_the_composition,
    flash_attention_trains_like_the_composition_cpu,
    flash_attention_trains_like_the_composition_gpu
);

/// F16 and BF16 autocast gradients (on the F32 masters) within the named tolerances of F32.
fn autocast_gradients_are_close(device: &Device) -> anyhow::Result<()> {
    let (_dir, files) = tiny("autocast", false)?;
    let (loss32, reference, _, _) = grads(&files, device, &settings(2))?;
    for (precision, tol) in [
        (Precision::F16, F16_GRAD_TOLERANCE),
        (Precision::BF16, BF16_GRAD_TOLERANCE),
    ] {
        let mut s = settings(2);
        s.precision = precision;
        let (loss, g, _, _) = grads(&files, device, &s)?;
        assert!(
            (loss - loss32).abs() < 50.0 * tol as f32,
            "{precision}: loss {loss} vs {loss32}"
        );
        let mut worst = (0.0, String::new());
        for (name, want) in &reference {
            assert_eq!(
                g[name].dtype(),
                DType::F32,
                "{name}: masters get F32 gradients"
            );
            let e = rel_err(&g[name], want)?;
            if e > worst.0 {
                worst = (e, name.clone());
            }
        }
        eprintln!(
            "{precision}: worst relative gradient error {} ({})",
            worst.0, worst.1
        );
        assert!(
            worst.0 < tol,
            "{precision}: {} relative error {} > {tol}",
            worst.1,
            worst.0
        );
    }
    Ok(())
}
test_device!(
    autocast_gradients_are_close,
    autocast_gradients_are_close_cpu,
    autocast_gradients_are_close_gpu
);

fn store_with(var: &Var, g: Vec<f32>) -> anyhow::Result<GradStore> {
    let mut s = GradStore::default();
    s.insert(var.as_tensor(), Tensor::new(g, var.device())?);
    Ok(s)
}

#[test]
fn grad_scaler_skips_backs_off_and_grows() -> anyhow::Result<()> {
    let d = GradScalerConfig::default();
    assert_eq!(
        (
            d.init_scale,
            d.growth_factor,
            d.backoff_factor,
            d.growth_interval
        ),
        (65536.0, 2.0, 0.5, 2000),
        "PyTorch's defaults"
    );
    let w = Var::new(vec![1f32, 2., 3.], &Device::Cpu)?;
    let mut opt = SGD::new(vec![w.clone()], 0.1)?;
    let mut scaler = GradScaler::new(GradScalerConfig {
        init_scale: 1024.0,
        growth_interval: 3,
        ..d
    });
    // Scaled gradients are unscaled before the step: 1024 * [1, 1, 1] steps by 0.1 * 1.
    let out = scaler.step(
        &mut opt,
        std::slice::from_ref(&w),
        &store_with(&w, vec![1024.; 3])?,
    )?;
    assert_eq!(out, StepOutcome::Applied { scale: 1024.0 });
    assert_eq!(w.to_vec1::<f32>()?, vec![0.9, 1.9, 2.9]);
    // An overflow: skipped, nothing changes, the scale halves and the good-step count resets.
    for bad in [f32::INFINITY, f32::NAN] {
        let out = scaler.step(
            &mut opt,
            std::slice::from_ref(&w),
            &store_with(&w, vec![1., bad, 1.])?,
        )?;
        assert!(!out.applied());
        assert_eq!(w.to_vec1::<f32>()?, vec![0.9, 1.9, 2.9]);
    }
    assert_eq!(scaler.scale(), 256.0);
    assert_eq!(scaler.skipped_steps(), 2);
    // Three good steps in a row double it.
    for i in 0..3 {
        let out = scaler.step(
            &mut opt,
            std::slice::from_ref(&w),
            &store_with(&w, vec![0.; 3])?,
        )?;
        assert_eq!(out.scale(), if i < 2 { 256.0 } else { 512.0 });
    }
    assert_eq!(scaler.good_steps(), 0);
    // Scaling the loss multiplies it.
    let l = Tensor::new(2f32, &Device::Cpu)?;
    assert_eq!(scaler.scale_loss(&l)?.to_scalar::<f32>()?, 1024.0);
    // Disabled: scale 1, nothing skipped.
    let off = GradScaler::disabled();
    assert_eq!(off.scale_loss(&l)?.to_scalar::<f32>()?, 2.0);
    Ok(())
}

/// The first F16 step at PyTorch's initial scale overflows (65536 × the loss gradient does
/// not fit F16) and is skipped; the scaler backs off until steps apply.
#[test]
fn f16_training_backs_off_from_the_initial_scale() -> anyhow::Result<()> {
    let (_dir, files) = tiny("f16", false)?;
    let mut s = settings(1);
    s.precision = Precision::F16;
    let mut trainer = Trainer::from_files(&files, &Device::Cpu, &s)?;
    let (inputs, targets) = batch(&Device::Cpu)?;
    let mut outcomes = Vec::new();
    for _ in 0..12 {
        outcomes.push(trainer.step(&inputs, &targets)?.outcome);
    }
    assert!(outcomes.iter().any(|o| o.applied()), "{outcomes:?}");
    assert!(trainer.scaler().scale() <= 65536.0);
    assert_eq!(
        trainer.scaler().skipped_steps() as usize,
        outcomes.iter().filter(|o| !o.applied()).count()
    );
    Ok(())
}

/// A few hundred AdamW steps on a fixed text lower the loss, resident and offloaded.
fn finetuning_lowers_the_loss(device: &Device) -> anyhow::Result<()> {
    let (_dir, files) = tiny("finetune", false)?;
    let text = b"the quick brown fox jumps over the lazy dog; the quick brown fox jumps again. ";
    let ids: Vec<u32> = text.iter().map(|&c| c as u32 % 101).collect();
    for offload in [false, true] {
        let mut s = settings(2);
        s.offload = offload;
        s.seq_len = 16;
        s.adamw = ParamsAdamW {
            lr: 3e-3,
            ..Default::default()
        };
        let mut trainer = Trainer::from_files(&files, device, &s)?;
        let steps = if offload { 60 } else { 200 };
        let mut losses = Vec::new();
        for step in 0..steps {
            let start = (step * 5) % (ids.len() - 17);
            let inputs = Tensor::new(&ids[start..start + 16], device)?.unsqueeze(0)?;
            let targets = Tensor::new(&ids[start + 1..start + 17], device)?.unsqueeze(0)?;
            losses.push(trainer.step(&inputs, &targets)?.loss);
        }
        let first = losses[..5].iter().sum::<f32>() / 5.0;
        let last = losses[steps - 5..].iter().sum::<f32>() / 5.0;
        let want = if offload { 0.8 } else { 0.4 };
        eprintln!("offload {offload}: loss {first} -> {last} in {steps} steps");
        assert!(
            last < want * first,
            "offload {offload}: loss {first} -> {last}"
        );
    }
    Ok(())
}
test_device!(
    finetuning_lowers_the_loss,
    finetuning_lowers_the_loss_cpu,
    finetuning_lowers_the_loss_gpu
);

/// Offloaded training needs checkpointing; the refusal names the field.
#[test]
fn offload_without_checkpointing_is_refused() -> anyhow::Result<()> {
    let (_dir, files) = tiny("refuse", false)?;
    let mut s = settings(0);
    s.offload = true;
    let e = Trainer::from_files(&files, &Device::Cpu, &s)
        .unwrap_err()
        .to_string();
    assert!(e.contains("checkpoint_segments"), "{e}");
    Ok(())
}

/// The phase observer sees forward, backward, optimizer and the end of every step, in that
/// order, resident and offloaded; an error from it ends the step with that error.
#[test]
fn phase_observer_sees_each_phase_in_order() -> anyhow::Result<()> {
    use candle_offload_models::TrainPhase;
    use std::sync::{Arc, Mutex};
    let (_dir, files) = tiny("phases", false)?;
    let (inputs, targets) = batch(&Device::Cpu)?;
    for offload in [false, true] {
        let mut s = settings(1);
        s.offload = offload;
        let mut trainer = Trainer::from_files(&files, &Device::Cpu, &s)?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        trainer.set_phase_observer(Some(Box::new(move |p| {
            log.lock().expect("log").push(p);
            Ok(())
        })));
        trainer.step(&inputs, &targets)?;
        trainer.step(&inputs, &targets)?;
        let phases = [
            TrainPhase::Forward,
            TrainPhase::Backward,
            TrainPhase::Optimizer,
            TrainPhase::Done,
        ];
        assert_eq!(*seen.lock().expect("log"), [phases, phases].concat());
        trainer.set_phase_observer(Some(Box::new(|p| {
            if p == TrainPhase::Optimizer {
                candle_core::bail!("stop here")
            }
            Ok(())
        })));
        let e = trainer.step(&inputs, &targets).unwrap_err().to_string();
        assert!(e.contains("stop here"), "{e}");
    }
    Ok(())
}

/// Several offloaded steps update the masters as resident steps do: the host gradient sums
/// (written into the previous step's buffers from the second step on) carry each step's
/// gradients only.
#[test]
fn offloaded_steps_track_resident_steps() -> anyhow::Result<()> {
    let (_dir, files) = tiny("offload-steps", false)?;
    let (inputs, targets) = batch(&Device::Cpu)?;
    let mut params = Vec::new();
    for offload in [false, true] {
        let mut s = settings(2);
        s.offload = offload;
        s.adamw = ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        };
        let mut trainer = Trainer::from_files(&files, &Device::Cpu, &s)?;
        for _ in 0..4 {
            trainer.step(&inputs, &targets)?;
        }
        let mut p: Vec<(String, Tensor)> = trainer
            .named_parameters()
            .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
            .collect();
        p.sort_by(|a, b| a.0.cmp(&b.0));
        params.push(p);
    }
    for ((name, res), (_, off)) in params[0].iter().zip(&params[1]) {
        let d = rel_err(off, res)?;
        anyhow::ensure!(d <= 1e-4, "{name}: offloaded masters differ by {d:e}");
    }
    Ok(())
}

/// Unscaling finds an inf or a NaN wherever it is (one in a tensor, +inf and -inf in one
/// tensor or in two), and finite gradients beyond F32's range in sum but not in value do not
/// count as overflow.
#[test]
fn unscale_finds_non_finite_gradients_only() -> anyhow::Result<()> {
    let a = Var::new(&[0f32; 3], &Device::Cpu)?;
    let b = Var::new(&[0f32; 2], &Device::Cpu)?;
    // Scale 1: the values reach the check as they are.
    let scaler = GradScaler::new(GradScalerConfig {
        init_scale: 1.0,
        ..Default::default()
    });
    let cases: [(Vec<f32>, Vec<f32>, bool); 6] = [
        (vec![1., 2., 3.], vec![4., 5.], true),
        (vec![1., f32::NAN, 3.], vec![4., 5.], false),
        (vec![1., 2., f32::INFINITY], vec![4., 5.], false),
        (
            vec![f32::INFINITY, 2., f32::NEG_INFINITY],
            vec![4., 5.],
            false,
        ),
        (
            vec![f32::INFINITY, 2., 3.],
            vec![f32::NEG_INFINITY, 5.],
            false,
        ),
        (vec![3e38, -3e38, 1.], vec![-3e38, 3e38], true),
    ];
    for (ga, gb, finite) in cases {
        let mut grads = store_with(&a, ga.clone())?;
        grads.insert(b.as_tensor(), Tensor::new(gb.as_slice(), &Device::Cpu)?);
        let (_, ok) = scaler.unscale_owned(&[a.clone(), b.clone()], grads)?;
        assert_eq!(ok, finite, "{ga:?} {gb:?}");
    }
    Ok(())
}
