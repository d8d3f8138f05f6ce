//! LoRA adapters against PEFT: an adapter PEFT saved on a tiny random llama
//! (`tests/fixtures/peft`, made by `scripts/peft_fixtures.py make`; rsLoRA, a rank pattern and
//! an alpha pattern, every projection targeted) gives PEFT's logits here; an adapter saved here
//! reloads bit-exactly with the same logits (and, with `LORA_PEFT_OUT` set, is written with its
//! logits for `scripts/peft_fixtures.py check` to load in PEFT); a merged base gives the
//! unmerged adapter's logits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::util::scratch;
use candle_core::{DType, Device, Tensor};
use candle_offload_models::lora::{merge, peft, Adapters, LoraConfig};
use candle_offload_models::{loader, CausalLm, ModelFiles};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/peft")
}

fn rel_l2(a: &Tensor, b: &Tensor) -> anyhow::Result<f64> {
    let a = a.to_dtype(DType::F64)?;
    let b = b.to_dtype(DType::F64)?;
    let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
    let den = b.sqr()?.sum_all()?.to_scalar::<f64>()?;
    Ok((num / den.max(1e-30)).sqrt())
}

/// The model of `files` in F32 on the CPU, with `adapters`.
fn model(files: &ModelFiles, adapters: Option<Arc<Adapters>>) -> anyhow::Result<CausalLm> {
    let store = loader::load_store(files, DType::F32, &Device::Cpu, None)?;
    let mut m = CausalLm::builder(files, Arc::new(store))
        .max_len(32)
        .build()?;
    m.set_adapters(adapters)?;
    Ok(m)
}

/// Logits (batch, seq, vocab) of every position of `ids`: those of the first half as prompts
/// (each prefix's last position), the rest as decode steps after the first half's prompt.
fn logits(m: &CausalLm, ids: &Tensor) -> anyhow::Result<Tensor> {
    let (_, t) = ids.dims2()?;
    let half = t / 2;
    let mut out = Vec::new();
    for row in 0..ids.dim(0)? {
        let ids = ids.narrow(0, row, 1)?;
        let mut per_pos = Vec::new();
        for p in 1..=half {
            let mut cache = m.new_cache();
            per_pos.push(m.forward(&ids.narrow(1, 0, p)?, 0, &mut cache)?);
        }
        let mut cache = m.new_cache();
        m.forward(&ids.narrow(1, 0, half)?, 0, &mut cache)?;
        for p in half..t {
            per_pos.push(m.forward(&ids.narrow(1, p, 1)?, p, &mut cache)?);
        }
        out.push(Tensor::cat(&per_pos, 0)?.unsqueeze(0)?);
    }
    Ok(Tensor::cat(&out, 0)?)
}

fn reference() -> anyhow::Result<(Tensor, Tensor)> {
    let t = candle_core::safetensors::load(fixtures().join("logits.safetensors"), &Device::Cpu)?;
    Ok((
        t["ids"].to_dtype(DType::U32)?,
        t["logits"].to_dtype(DType::F32)?,
    ))
}

#[test]
fn peft_adapter_gives_peft_logits() -> anyhow::Result<()> {
    let files = loader::from_dir(&fixtures().join("base"))?;
    let adapters = peft::load(&fixtures().join("adapter"), &files.config, &Device::Cpu)?;
    let cfg = adapters.config();
    assert!(cfg.use_rslora);
    assert_eq!(cfg.rank_of("model.layers.1.self_attn.q_proj"), 2);
    assert_eq!(adapters.modules().len(), 14);
    let (ids, want) = reference()?;
    let got = logits(&model(&files, Some(Arc::new(adapters)))?, &ids)?;
    let rel = rel_l2(&got, &want)?;
    eprintln!("peft_roundtrip_rel_l2 (PEFT's adapter here): {rel:.3e}");
    assert!(rel <= 1e-5, "rel L2 {rel} against PEFT's logits");
    // Without the adapter the logits are far from PEFT's: the comparison can fail.
    let base = logits(&model(&files, None)?, &ids)?;
    let off = rel_l2(&base, &want)?;
    assert!(off > 1e-2, "the adapter changes the logits by only {off}");
    Ok(())
}

/// Adapters of our own (random A and B, a rank pattern, rsLoRA off) saved in PEFT's format
/// reload bit-exactly with the same logits; their files are what PEFT writes (keys, config
/// fields); with `LORA_PEFT_OUT` set they are also written there with our logits, for
/// `scripts/peft_fixtures.py check tests/fixtures/peft/base $LORA_PEFT_OUT`.
#[test]
fn saved_adapter_reloads_bit_exactly() -> anyhow::Result<()> {
    let files = loader::from_dir(&fixtures().join("base"))?;
    let mut config = LoraConfig {
        r: 4,
        alpha: 6.0,
        target_modules: vec!["down_proj".into(), "q_proj".into(), "v_proj".into()],
        ..Default::default()
    };
    config
        .rank_pattern
        .insert("model.layers.0.self_attn.v_proj".into(), 3);
    let init = Adapters::init(config.clone(), &files.config, &Device::Cpu, 3)
        .map_err(anyhow::Error::msg)?;
    let mut tensors = BTreeMap::new();
    for (path, m) in init.modules() {
        let b = Tensor::randn(0f32, 0.3, m.b.shape(), &Device::Cpu)?;
        tensors.insert(path.clone(), (m.a.as_tensor().clone(), b));
    }
    let ours = Adapters::from_tensors(config, tensors, &Device::Cpu)?;
    // Kept for the PEFT cross-check where `LORA_PEFT_OUT` names a directory; else removed at
    // the end.
    let own = scratch("lora");
    let dir = match std::env::var_os("LORA_PEFT_OUT") {
        Some(d) => PathBuf::from(d),
        None => own.to_path_buf(),
    };
    peft::save(&ours, &dir, DType::F32)?;
    let back = peft::load(&dir, &files.config, &Device::Cpu)?;
    assert_eq!(back.config(), ours.config());
    for ((p, a), (q, b)) in ours.modules().iter().zip(back.modules()) {
        assert_eq!(p, q);
        assert_eq!(
            a.a.as_tensor().to_vec2::<f32>()?,
            b.a.as_tensor().to_vec2::<f32>()?
        );
        assert_eq!(
            a.b.as_tensor().to_vec2::<f32>()?,
            b.b.as_tensor().to_vec2::<f32>()?
        );
        assert_eq!(a.adapter.scale(), b.adapter.scale());
    }
    assert_eq!(
        back.modules()["model.layers.0.self_attn.v_proj"]
            .adapter
            .rank(),
        3
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(peft::CONFIG_FILE))?)?;
    assert_eq!(json["task_type"], "CAUSAL_LM");
    assert_eq!(json["bias"], "none");
    assert_eq!(
        json["target_modules"],
        serde_json::json!(["down_proj", "q_proj", "v_proj"])
    );
    let keys = candle_core::safetensors::load(dir.join(peft::WEIGHTS_FILE), &Device::Cpu)?;
    assert!(keys.contains_key("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
    assert_eq!(keys.len(), 2 * 3 * 2);
    let (ids, _) = reference()?;
    let a = logits(&model(&files, Some(Arc::new(ours)))?, &ids)?;
    let b = logits(&model(&files, Some(Arc::new(back)))?, &ids)?;
    assert_eq!(
        a.flatten_all()?.to_vec1::<f32>()?,
        b.flatten_all()?.to_vec1::<f32>()?
    );
    let mut out = std::collections::HashMap::new();
    out.insert("ids".to_string(), ids.to_dtype(DType::I64)?);
    out.insert("logits".to_string(), a);
    candle_core::safetensors::save(&out, dir.join("logits.safetensors"))?;
    Ok(())
}

/// The base with PEFT's adapter merged into its weights gives the unmerged logits.
#[test]
fn merged_base_gives_the_unmerged_logits() -> anyhow::Result<()> {
    let files = loader::from_dir(&fixtures().join("base"))?;
    let adapters = peft::load(&fixtures().join("adapter"), &files.config, &Device::Cpu)?;
    let tensors =
        candle_core::safetensors::load(fixtures().join("base/model.safetensors"), &Device::Cpu)?;
    let mut merged = Vec::new();
    for (name, t) in tensors {
        let t = match name.strip_suffix(".weight") {
            Some(path) => merge::merge_dense(&adapters, path, &t)?,
            None => t,
        };
        merged.push((name, t));
    }
    let store = candle_offload::HostStore::from_tensors(
        &merged,
        &candle_offload::StoreConfig {
            grouping: files.config.layout().grouping(),
            ..Default::default()
        },
        &Device::Cpu,
    )?;
    let m = CausalLm::builder(&files, Arc::new(store))
        .max_len(32)
        .build()?;
    let (ids, want) = reference()?;
    let rel = rel_l2(&logits(&m, &ids)?, &want)?;
    assert!(rel <= 1e-5, "merged: rel L2 {rel}");
    Ok(())
}

/// The fixture's base with its decoder layers' projections held as Q8_0 blocks (the rest
/// dense), and the same weights dequantized (its twin).
fn q8_stores(
    files: &ModelFiles,
) -> anyhow::Result<(candle_offload::HostStore, candle_offload::HostStore)> {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_offload::{HostStore, RawTensorSpec, StoreConfig, WeightFormat};
    let tensors =
        candle_core::safetensors::load(fixtures().join("base/model.safetensors"), &Device::Cpu)?;
    let cfg = StoreConfig {
        grouping: files.config.layout().grouping(),
        ..Default::default()
    };
    let mut specs = Vec::new();
    let mut bytes = Vec::new();
    let mut twin = Vec::new();
    for (name, t) in tensors {
        let blocks = name.starts_with("model.layers.") && t.rank() == 2;
        if blocks {
            let q = QTensor::quantize(&t, GgmlDType::Q8_0)?;
            twin.push((name.clone(), q.dequantize(&Device::Cpu)?));
            specs.push(RawTensorSpec {
                name,
                format: WeightFormat::Ggml(GgmlDType::Q8_0),
                shape: t.shape().clone(),
            });
            bytes.push(q.data()?.into_owned());
        } else {
            let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            bytes.push(v.iter().flat_map(|x| x.to_le_bytes()).collect());
            specs.push(RawTensorSpec {
                name: name.clone(),
                format: WeightFormat::Dense(DType::F32),
                shape: t.shape().clone(),
            });
            twin.push((name, t));
        }
    }
    let q8 = HostStore::from_raw(&specs, &cfg, &Device::Cpu, |spec, _, dst| {
        let i = specs.iter().position(|s| s.name == spec.name).unwrap();
        dst.copy_from_slice(&bytes[i]);
        Ok(())
    })?;
    Ok((q8, HostStore::from_tensors(&twin, &cfg, &Device::Cpu)?))
}

/// QLoRA inference: PEFT's adapter on a base of GGML blocks gives the logits it gives on the
/// dequantized twin (only the activations' rounding in the blocks' matmul differs); merged
/// into the blocks (re-quantized, the error reported) it stays close to unmerged.
#[test]
fn adapter_on_blocks_gives_the_dequantized_twins_logits() -> anyhow::Result<()> {
    let files = loader::from_dir(&fixtures().join("base"))?;
    let adapters = Arc::new(peft::load(
        &fixtures().join("adapter"),
        &files.config,
        &Device::Cpu,
    )?);
    let (q8, twin) = q8_stores(&files)?;
    assert_eq!(q8.ggml_tensor_count(), 14);
    let (ids, _) = reference()?;
    let build =
        |store: candle_offload::HostStore, a: Option<Arc<Adapters>>| -> anyhow::Result<CausalLm> {
            let mut m = CausalLm::builder(&files, Arc::new(store))
                .max_len(32)
                .build()?;
            m.set_adapters(a)?;
            Ok(m)
        };
    let cfg = candle_offload::StoreConfig {
        grouping: files.config.layout().grouping(),
        ..Default::default()
    };
    let (merged, report) = merge::merge_store(&q8, &adapters, &cfg, &Device::Cpu)?;
    assert_eq!(report.requantized.len(), 14);
    assert_eq!(merged.ggml_tensor_count(), 14);
    let worst = report.max_requant_rel_l2();
    assert!(worst > 0.0 && worst < 1e-2, "re-quantizing added {worst}");
    let on_blocks = logits(&build(q8, Some(adapters.clone()))?, &ids)?;
    let on_twin = logits(&build(twin, Some(adapters))?, &ids)?;
    let rel = rel_l2(&on_blocks, &on_twin)?;
    assert!(rel < 1e-2, "blocks vs twin: rel L2 {rel}");
    // Two roundings of Q8_0 (the weights' second quantization, the activations') through
    // two layers of large random weights: a few percent, where dropping the adapter is far more.
    let merged = logits(&build(merged, None)?, &ids)?;
    let rel = rel_l2(&merged, &on_blocks)?;
    let (q8, _) = q8_stores(&files)?;
    let without = rel_l2(&logits(&build(q8, None)?, &ids)?, &on_blocks)?;
    assert!(
        rel < 5e-2 && rel * 10.0 < without,
        "merged blocks vs unmerged: rel L2 {rel}, without the adapter {without}"
    );
    Ok(())
}

fn train_settings(segments: usize) -> candle_offload_models::TrainSettings {
    let mut s = candle_offload_models::TrainSettings {
        checkpoint_segments: segments,
        batch_size: 2,
        seq_len: 12,
        ..Default::default()
    };
    s.adamw.lr = 1e-2;
    s
}

/// Inputs and targets: the reference ids shifted by one.
fn batch() -> anyhow::Result<(Tensor, Tensor)> {
    let (ids, _) = reference()?;
    Ok((ids.narrow(1, 0, 11)?, ids.narrow(1, 1, 11)?))
}

/// LoRA training on a frozen base: only the adapters are parameters, the loss falls, a
/// checkpointed step gives the same gradients as a plain one, and the saved adapter reloads
/// bit-exactly.
#[test]
fn lora_training_lowers_the_loss_of_a_frozen_base() -> anyhow::Result<()> {
    use candle_offload_models::Trainer;
    let files = loader::from_dir(&fixtures().join("base"))?;
    let store = Arc::new(loader::load_store(&files, DType::F32, &Device::Cpu, None)?);
    let config = LoraConfig {
        r: 4,
        alpha: 8.0,
        ..Default::default()
    };
    let init =
        Adapters::init(config, &files.config, &Device::Cpu, 1).map_err(anyhow::Error::msg)?;
    let count = init.parameter_count();
    let (inputs, targets) = batch()?;
    // Gradients through one checkpointed segment equal the plain ones, bit for bit.
    let peft_adapter = peft::load(&fixtures().join("adapter"), &files.config, &Device::Cpu)?;
    let mut plain = Trainer::lora(
        files.config.clone(),
        store.clone(),
        peft_adapter.clone(),
        &Device::Cpu,
        &train_settings(0),
    )?;
    let mut ck = Trainer::lora(
        files.config.clone(),
        store.clone(),
        peft_adapter,
        &Device::Cpu,
        &train_settings(2),
    )?;
    let (la, ga) = plain.loss_and_grads(&inputs, &targets)?;
    let (lb, gb) = ck.loss_and_grads(&inputs, &targets)?;
    assert_eq!(la, lb);
    assert_eq!(ga.len(), 28);
    for (k, g) in &ga {
        assert_eq!(
            g.flatten_all()?.to_vec1::<f32>()?,
            gb[k].flatten_all()?.to_vec1::<f32>()?,
            "{k}"
        );
    }
    let mut trainer = Trainer::lora(
        files.config.clone(),
        store,
        init,
        &Device::Cpu,
        &train_settings(1),
    )?;
    assert_eq!(trainer.parameter_count(), count);
    let first = trainer.step(&inputs, &targets)?.loss;
    let mut last = first;
    for _ in 0..15 {
        last = trainer.step(&inputs, &targets)?.loss;
    }
    assert!(last < 0.9 * first, "loss {first} -> {last}");
    let dir = scratch("lora-train");
    trainer.save_adapter(&dir)?;
    let back = peft::load(&dir, &files.config, &Device::Cpu)?;
    for (path, m) in trainer.adapters().unwrap().modules() {
        let b = &back.modules()[path];
        assert_eq!(
            m.a.as_tensor().to_vec2::<f32>()?,
            b.a.as_tensor().to_vec2::<f32>()?
        );
        assert_eq!(
            m.b.as_tensor().to_vec2::<f32>()?,
            b.b.as_tensor().to_vec2::<f32>()?
        );
    }
    Ok(())
}

/// QLoRA: on a base of GGML blocks the adapters get the gradients they get on the dequantized
/// twin (the same weights; only the activations' rounding in the blocks' matmul differs).
#[test]
fn qlora_gradients_equal_the_dequantized_twins() -> anyhow::Result<()> {
    use candle_offload_models::Trainer;
    let files = loader::from_dir(&fixtures().join("base"))?;
    let (q8, twin) = q8_stores(&files)?;
    let adapter = peft::load(&fixtures().join("adapter"), &files.config, &Device::Cpu)?;
    let (inputs, targets) = batch()?;
    let mut on_blocks = Trainer::lora(
        files.config.clone(),
        Arc::new(q8),
        adapter.clone(),
        &Device::Cpu,
        &train_settings(1),
    )?;
    let mut on_twin = Trainer::lora(
        files.config.clone(),
        Arc::new(twin),
        adapter,
        &Device::Cpu,
        &train_settings(1),
    )?;
    let (lq, gq) = on_blocks.loss_and_grads(&inputs, &targets)?;
    let (lt, gt) = on_twin.loss_and_grads(&inputs, &targets)?;
    assert!((lq - lt).abs() < 1e-2 * lt.abs(), "loss {lq} vs {lt}");
    let mut worst: f64 = 0.0;
    for (k, g) in &gq {
        worst = worst.max(rel_l2(g, &gt[k])?);
    }
    assert!(worst < 2e-2, "adapter gradients differ by rel L2 {worst}");
    Ok(())
}

/// The trainer's loss and adapter gradients on PEFT's adapter equal PEFT's own (F32).
#[test]
fn lora_gradients_equal_peft_gradients() -> anyhow::Result<()> {
    use candle_offload_models::Trainer;
    let files = loader::from_dir(&fixtures().join("base"))?;
    let store = Arc::new(loader::load_store(&files, DType::F32, &Device::Cpu, None)?);
    let adapter = peft::load(&fixtures().join("adapter"), &files.config, &Device::Cpu)?;
    let want = candle_core::safetensors::load(fixtures().join("logits.safetensors"), &Device::Cpu)?;
    let (inputs, targets) = batch()?;
    let mut trainer = Trainer::lora(
        files.config.clone(),
        store,
        adapter,
        &Device::Cpu,
        &train_settings(1),
    )?;
    let (loss, grads) = trainer.loss_and_grads(&inputs, &targets)?;
    let peft_loss = want["loss"].to_vec1::<f32>()?[0];
    assert!(
        (loss - peft_loss).abs() <= 1e-5 * peft_loss.abs(),
        "loss {loss} vs PEFT's {peft_loss}"
    );
    assert_eq!(grads.len(), 28);
    let mut worst: f64 = 0.0;
    for (k, g) in &grads {
        let theirs = want
            .get(&format!("grad:{k}"))
            .ok_or_else(|| anyhow::anyhow!("PEFT has no gradient {k}"))?;
        worst = worst.max(rel_l2(g, theirs)?);
    }
    eprintln!("adapter gradients against PEFT's: max rel L2 {worst:.3e}");
    assert!(
        worst <= 1e-4,
        "adapter gradients differ from PEFT's by rel L2 {worst}"
    );
    Ok(())
}

/// The blocks' hand-written backward pass on a frozen base gives the adapters the gradients
/// Candle's graph gives them, on dense weights and on GGML blocks, and it is the pass that ran.
#[test]
fn lora_hand_backward_equals_the_graph() -> anyhow::Result<()> {
    use candle_offload_models::Trainer;
    let files = loader::from_dir(&fixtures().join("base"))?;
    let dense = Arc::new(loader::load_store(&files, DType::F32, &Device::Cpu, None)?);
    let (q8, _) = q8_stores(&files)?;
    let adapter = peft::load(&fixtures().join("adapter"), &files.config, &Device::Cpu)?;
    let (inputs, targets) = batch()?;
    for (base, store) in [("dense", dense), ("q8_0 blocks", Arc::new(q8))] {
        let run = |hand: bool| -> anyhow::Result<_> {
            let mut settings = train_settings(2);
            settings.hand_backward = hand;
            let mut t = Trainer::lora(
                files.config.clone(),
                store.clone(),
                adapter.clone(),
                &Device::Cpu,
                &settings,
            )?;
            let (loss, grads) = t.loss_and_grads(&inputs, &targets)?;
            Ok((loss, grads, t.hand_backward_gradients()))
        };
        let (lh, gh, by_hand) = run(true)?;
        let (lg, gg, by_graph) = run(false)?;
        assert_eq!(
            by_graph, 0,
            "{base}: the graph run handed gradients over by hand"
        );
        // Two per adapted projection (A and B), seven projections a layer.
        let layers = files.config.num_hidden_layers;
        assert_eq!(
            by_hand,
            14 * layers,
            "{base}: gradients handed over by hand"
        );
        assert!(
            (lh - lg).abs() <= 1e-6 * lg.abs(),
            "{base}: loss {lh} vs {lg}"
        );
        assert_eq!(gh.len(), gg.len());
        let mut worst: f64 = 0.0;
        for (k, g) in &gg {
            worst = worst.max(rel_l2(&gh[k], g)?);
        }
        assert!(
            worst <= 1e-5,
            "{base}: adapter gradients differ by rel L2 {worst}"
        );
    }
    Ok(())
}

/// MFU's FLOPs under LoRA: the base's matmuls without weight gradients (two thirds of full
/// training's), attention unchanged, each adapter FLOP of the forward pass three times.
#[test]
fn lora_flops_leave_out_the_bases_weight_gradients() -> anyhow::Result<()> {
    let files = loader::from_dir(&fixtures().join("base"))?;
    let cfg = &files.config;
    let seq = 12;
    let attention =
        12.0 * (cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq) as f64;
    let full = cfg.train_flops_per_token(seq);
    let lora = cfg.lora_train_flops_per_token(seq, 0.0);
    assert!((lora - (attention + (full - attention) * 2.0 / 3.0)).abs() < 1e-9 * full);
    assert!((cfg.lora_train_flops_per_token(seq, 10.0) - lora - 30.0).abs() < 1e-6);
    let adapters = peft::load(&fixtures().join("adapter"), cfg, &Device::Cpu)?;
    // q_proj of layer 1 has rank 2, every other module rank 4.
    let want: usize = adapters
        .modules()
        .values()
        .map(|m| 2 * m.adapter.rank() * (m.adapter.dims().0 + m.adapter.dims().1))
        .sum();
    assert_eq!(adapters.forward_flops_per_token(), want as u64);
    Ok(())
}

/// Ignored targets ([`IGNORE_TARGET`]: a chat prompt's tokens) add nothing: with the targets
/// after position k ignored, the loss and the gradients are those of the sequences cut at k
/// (the model is causal), for LoRA and for full training (whose head has a hand-written
/// backward pass).
#[test]
fn ignored_targets_give_the_cut_sequences_loss_and_gradients() -> anyhow::Result<()> {
    use candle_offload_models::{Trainer, IGNORE_TARGET};
    let files = loader::from_dir(&fixtures().join("base"))?;
    let (inputs, targets) = batch()?;
    let k = 6;
    let ignored = Tensor::cat(
        &[
            targets.narrow(1, 0, k)?,
            Tensor::full(IGNORE_TARGET, (2, 11 - k), &Device::Cpu)?,
        ],
        1,
    )?;
    let (cut_in, cut_tg) = (inputs.narrow(1, 0, k)?, targets.narrow(1, 0, k)?);
    let check = |t: &mut Trainer| -> anyhow::Result<()> {
        let (la, ga) = t.loss_and_grads(&inputs, &ignored)?;
        let (lb, gb) = t.loss_and_grads(&cut_in, &cut_tg)?;
        assert!((la - lb).abs() <= 1e-5 * lb.abs(), "loss {la} vs {lb}");
        assert_eq!(ga.len(), gb.len());
        for (k, g) in &ga {
            let rel = rel_l2(g, &gb[k])?;
            assert!(rel < 1e-4, "{k}: rel L2 {rel}");
        }
        Ok(())
    };
    let store = Arc::new(loader::load_store(&files, DType::F32, &Device::Cpu, None)?);
    let adapter = peft::load(&fixtures().join("adapter"), &files.config, &Device::Cpu)?;
    check(&mut Trainer::lora(
        files.config.clone(),
        store,
        adapter,
        &Device::Cpu,
        &train_settings(1),
    )?)?;
    let tensors =
        candle_core::safetensors::load(fixtures().join("base/model.safetensors"), &Device::Cpu)?;
    let mut full = Trainer::new(
        files.config.clone(),
        tensors.into_iter().collect(),
        &Device::Cpu,
        &train_settings(0),
        Path::new("base"),
    )?;
    check(&mut full)?;
    assert!(
        full.hand_backward_gradients() > 0,
        "the head's hand-written backward did not run"
    );
    Ok(())
}

/// LoRA reserves no room for the base's weight gradients: less than full training, by one
/// checkpointed segment's weights twice.
#[test]
fn lora_reserves_no_base_weight_gradients() -> anyhow::Result<()> {
    let files = loader::from_dir(&fixtures().join("base"))?;
    let cfg = &files.config;
    let full = cfg.train_reserve_bytes(2, 12, 2, DType::F32);
    let lora = cfg.lora_train_reserve_bytes(2, 12, 2, DType::F32);
    let (h, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let (nh, kv, hd) = (
        cfg.num_attention_heads as u64,
        cfg.num_key_value_heads as u64,
        cfg.head_dim as u64,
    );
    let layer = (2 * h * nh * hd + 2 * h * kv * hd + 3 * h * i) * 4;
    assert_eq!(full - lora, 2 * layer);
    Ok(())
}

/// A run resumed from a saved adapter and the AdamW state beside it continues as the run that
/// saved them: the next step gives the same adapters, bit for bit.
#[test]
fn resumed_training_continues_bit_exactly() -> anyhow::Result<()> {
    use candle_offload_models::{Trainer, OPTIMIZER_FILE};
    let files = loader::from_dir(&fixtures().join("base"))?;
    let store = Arc::new(loader::load_store(&files, DType::F32, &Device::Cpu, None)?);
    let config = LoraConfig {
        r: 2,
        target_modules: vec!["q_proj".into(), "down_proj".into()],
        ..Default::default()
    };
    let init =
        Adapters::init(config, &files.config, &Device::Cpu, 5).map_err(anyhow::Error::msg)?;
    let (inputs, targets) = batch()?;
    let mut first = Trainer::lora(
        files.config.clone(),
        store.clone(),
        init,
        &Device::Cpu,
        &train_settings(1),
    )?;
    for _ in 0..3 {
        first.step(&inputs, &targets)?;
    }
    let dir = scratch("lora-resume");
    first.save_adapter(&dir)?;
    assert!(dir.join(OPTIMIZER_FILE).exists());
    let saved = peft::load(&dir, &files.config, &Device::Cpu)?;
    let mut resumed = Trainer::lora(
        files.config.clone(),
        store.clone(),
        saved.clone(),
        &Device::Cpu,
        &train_settings(1),
    )?;
    assert!(resumed.load_optimizer(&dir)?);
    // Without the state, the moments start afresh and the step differs.
    let mut fresh = Trainer::lora(
        files.config.clone(),
        store,
        saved,
        &Device::Cpu,
        &train_settings(1),
    )?;
    first.step(&inputs, &targets)?;
    resumed.step(&inputs, &targets)?;
    fresh.step(&inputs, &targets)?;
    let flat = |t: &Trainer| -> anyhow::Result<Vec<f32>> {
        let mut out = Vec::new();
        for m in t.adapters().unwrap().modules().values() {
            out.extend(m.a.as_tensor().flatten_all()?.to_vec1::<f32>()?);
            out.extend(m.b.as_tensor().flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    };
    assert_eq!(flat(&first)?, flat(&resumed)?);
    assert_ne!(flat(&first)?, flat(&fresh)?);
    Ok(())
}
