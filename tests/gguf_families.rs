//! GGUF files of every architecture the GGUF loader supports, made by llama.cpp's own converter
//! from tiny random HF checkpoints (`tests/fixtures/gguf_families.tar.xz`, written by
//! `scripts/gguf_fixtures.py`): our logits from the F32 GGUF equal our logits from the
//! safetensors checkpoint (rel L2 ≤ 1e-5), greedy generation from the GGUF, offloaded, gives the
//! checkpoint's tokens, and the Q8_0 GGUF runs generation with its blocks kept.
//!
//! The fixtures' vocabulary is a SentencePiece model (`tokenizer.ggml.model` `llama`), so these
//! tests feed token ids; the text round trip through a GGUF's own tokenizer is tested with the
//! tokenizers.

use std::path::PathBuf;
use std::sync::Arc;

use crate::util::scratch;
use candle_core::{DType, Device, Tensor};
use candle_offload::{MemoryLimit, OffloadConfig, OffloadRuntime, PolicyChoice};
use candle_offload_models::generation::generate;
use candle_offload_models::loader::{self, ModelFiles};
use candle_offload_models::Llama;
use candle_transformers::generation::LogitsProcessor;

const FAMILIES: [&str; 8] = [
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3",
];

/// The fixtures, unpacked once per archive version and shared by every test and run (read
/// only: a test that writes files makes a [`scratch`] directory of its own).
fn fixtures() -> anyhow::Result<PathBuf> {
    static DIR: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    crate::util::unpacked_fixture("gguf_families", &DIR)
}

/// Our model of `files` in F32, offloaded: the budget holds half of the weights.
fn model(
    files: &ModelFiles,
    keep_blocks: bool,
    max_len: usize,
) -> anyhow::Result<(Llama, OffloadRuntime)> {
    let store = Arc::new(loader::load_store_with(
        files,
        DType::F32,
        &Device::Cpu,
        None,
        keep_blocks,
    )?);
    let layer = store
        .layer_unit(0)
        .map(|u| store.unit(u).bytes())
        .unwrap_or(0);
    let rt = OffloadRuntime::new(
        store.clone(),
        &Device::Cpu,
        &OffloadConfig {
            gpu_memory_limit: Some(MemoryLimit::Bytes(store.total_bytes() / 2 + 2 * layer)),
            policy: PolicyChoice::Schedule(Llama::schedule(&store, &files.config)),
            ..Default::default()
        },
    )?;
    let model = Llama::builder(files.config.clone(), rt.store().clone())
        .runtime(rt.clone())
        .dtype(DType::F32)
        .max_len(max_len)
        .source_path(files.weights_path())
        .build()?;
    Ok((model, rt))
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// 24 token ids (the windows of the fixtures are 8: crossed), the same for every family.
fn prompt(vocab: usize) -> Vec<u32> {
    (0..24u32).map(|i| (i * 37 + 11) % vocab as u32).collect()
}

fn logits(model: &Llama, ids: &[u32]) -> anyhow::Result<Vec<f32>> {
    let t = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
    Ok(model.forward_all(&t)?.flatten_all()?.to_vec1::<f32>()?)
}

fn greedy(model: &Llama, ids: &[u32], n: usize) -> anyhow::Result<Vec<u32>> {
    let mut sampler = LogitsProcessor::new(0, None, None);
    Ok(generate(model, ids, n, &mut sampler, &[], |_| Ok(()))?.0)
}

#[test]
fn gguf_logits_equal_safetensors_for_every_family() -> anyhow::Result<()> {
    let dir = fixtures()?;
    let mut report = Vec::new();
    for name in FAMILIES {
        let hf = loader::from_dir(&dir.join(name))?;
        let gguf = loader::from_gguf(&dir.join(format!("{name}.f32.gguf")))?;
        let (a, b) = (&hf.config, &gguf.config);
        assert_eq!(
            (
                a.family.name(),
                a.num_hidden_layers,
                a.head_dim,
                a.num_key_value_heads
            ),
            (
                b.family.name(),
                b.num_hidden_layers,
                b.head_dim,
                b.num_key_value_heads
            ),
            "{name}: the GGUF's configuration"
        );
        assert_eq!(a.tie_word_embeddings, b.tie_word_embeddings, "{name}");
        assert_eq!(a.vocab_size, b.vocab_size, "{name}");
        let ids = prompt(a.vocab_size);
        let steps = 8;
        let (ours_hf, _) = model(&hf, false, ids.len() + steps)?;
        let (ours_gguf, rt) = model(&gguf, false, ids.len() + steps)?;
        let (x, y) = (logits(&ours_gguf, &ids)?, logits(&ours_hf, &ids)?);
        let err = rel_l2(&x, &y);
        report.push(format!("{name}: rel L2 {err:.2e}"));
        assert!(
            err <= 1e-5,
            "{name}: GGUF logits differ from safetensors: rel L2 {err:.3e}"
        );
        assert_eq!(
            greedy(&ours_gguf, &ids, steps)?,
            greedy(&ours_hf, &ids, steps)?,
            "{name}: greedy tokens"
        );
        assert!(rt.stats()?.total.fetches > 0, "{name}: streamed");
    }
    eprintln!("{}", report.join("\n"));
    Ok(())
}

/// A Q8_0 GGUF of each architecture runs with its projections kept as blocks (phi3's fused
/// q/k/v and gate/up too), close to the F32 file.
#[test]
fn q8_0_gguf_of_every_family_generates_with_blocks_kept() -> anyhow::Result<()> {
    let dir = fixtures()?;
    for name in FAMILIES {
        let f32_files = loader::from_gguf(&dir.join(format!("{name}.f32.gguf")))?;
        let q8_files = loader::from_gguf(&dir.join(format!("{name}.q8_0.gguf")))?;
        let ids = prompt(q8_files.config.vocab_size);
        let steps = 6;
        let (reference, _) = model(&f32_files, false, ids.len() + steps)?;
        let (q8, rt) = model(&q8_files, true, ids.len() + steps)?;
        // Every projection of every layer, and the untied heads.
        let layers = q8_files.config.num_hidden_layers;
        assert!(
            rt.store().ggml_tensor_count() >= 3 * layers,
            "{name}: {} tensors kept as blocks",
            rt.store().ggml_tensor_count()
        );
        let err = rel_l2(&logits(&q8, &ids)?, &logits(&reference, &ids)?);
        assert!(err < 5e-2, "{name}: Q8_0 logits rel L2 {err:.3e} from F32");
        let tokens = greedy(&q8, &ids, steps)?;
        assert_eq!(tokens.len(), steps, "{name}");
        assert!(
            tokens
                .iter()
                .all(|t| (*t as usize) < q8_files.config.vocab_size),
            "{name}: {tokens:?}"
        );
    }
    Ok(())
}

/// An architecture outside the supported list is refused, naming it and the list.
#[test]
fn unsupported_gguf_architecture_names_the_supported_ones() -> anyhow::Result<()> {
    let dir = fixtures()?;
    let bytes = std::fs::read(dir.join("qwen3.f32.gguf"))?;
    // `general.architecture` = "qwen3" -> "qwen9" (same length).
    let at = bytes
        .windows(5)
        .position(|w| w == b"qwen3")
        .expect("the architecture string");
    let mut patched = bytes.clone();
    patched[at + 4] = b'9';
    let out = scratch("qwen9");
    let path = out.join("qwen9.gguf");
    std::fs::write(&path, patched)?;
    let e = loader::from_gguf(&path).unwrap_err().to_string();
    assert!(e.contains("qwen9") && e.contains("qwen9.gguf"), "{e}");
    for known in FAMILIES {
        assert!(e.contains(known), "{known} missing from: {e}");
    }
    Ok(())
}

/// A multimodal `gemma3` checkpoint (config nesting `text_config`, a vision tower beside) runs
/// its text model, whether transformers 5 saved it (`model.language_model.*`, `lm_head`) or
/// transformers 4 (`language_model.model.*`, `language_model.lm_head`): the same logits as the
/// `Gemma3ForCausalLM` checkpoint it was made from.
#[test]
fn multimodal_gemma3_checkpoint_under_either_key_layout() -> anyhow::Result<()> {
    let dir = fixtures()?;
    let text_dir = dir.join("gemma3");
    let text = loader::from_dir(&text_dir)?;
    let ids = prompt(text.config.vocab_size);
    let (reference, _) = model(&text, false, ids.len())?;
    let want = logits(&reference, &ids)?;
    let text_config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(text_dir.join("config.json"))?)?;
    let weights = candle_core::safetensors::load(text_dir.join("model.safetensors"), &Device::Cpu)?;
    let out = scratch("gemma3-mm");
    for (layout, prefix, head) in [
        ("v5", "model.language_model.", "lm_head"),
        ("v4", "language_model.model.", "language_model.lm_head"),
    ] {
        for tied in [true, false] {
            let mm = out.join(format!("gemma3-mm-{layout}-{tied}"));
            std::fs::create_dir_all(&mm)?;
            let mut tensors: std::collections::HashMap<String, Tensor> = weights
                .iter()
                .map(|(k, v)| {
                    (
                        format!("{prefix}{}", k.strip_prefix("model.").unwrap()),
                        v.clone(),
                    )
                })
                .collect();
            if !tied {
                tensors.insert(
                    format!("{head}.weight"),
                    weights["model.embed_tokens.weight"].clone(),
                );
            }
            // A vision tower the text model does not use.
            tensors.insert(
                "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight".into(),
                Tensor::zeros((32, 32), DType::F32, &Device::Cpu)?,
            );
            candle_core::safetensors::save(&tensors, mm.join("model.safetensors"))?;
            let mut text_cfg = text_config.clone();
            text_cfg
                .as_object_mut()
                .unwrap()
                .remove("tie_word_embeddings");
            let config = serde_json::json!({
                "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "tie_word_embeddings": tied, "text_config": text_cfg,
                "vision_config": {"hidden_size": 32},
            });
            std::fs::write(mm.join("config.json"), config.to_string())?;
            let files = loader::from_dir(&mm)?;
            assert_eq!(files.config.tie_word_embeddings, tied);
            let (ours, _) = model(&files, false, ids.len())?;
            let err = rel_l2(&logits(&ours, &ids)?, &want);
            assert!(err <= 1e-6, "{layout}, tied {tied}: rel L2 {err:.3e}");
        }
    }
    Ok(())
}

/// Phi-3 with LongRoPE from a GGUF (the factors as llama.cpp's converter stores them: the
/// tensors `rope_factors_{short,long}.weight`, the original context and the cos/sin multiplier
/// in the metadata) gives the logits of the safetensors checkpoint configured with the same
/// LongRoPE, past the original context (the long factors); bad factors are refused by name.
#[test]
fn phi3_longrope_gguf_equals_safetensors() -> anyhow::Result<()> {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    let fixtures = fixtures()?;
    let dir = scratch("longrope");
    std::fs::create_dir_all(dir.join("hf"))?;
    // The checkpoint, with LongRoPE over its rotary width of 4 (2 factors) and an original
    // context of 16.
    let (short, long) = ([1.0f32, 1.5], [2.0f32, 5.0]);
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("phi3/config.json"))?)?;
    cfg["original_max_position_embeddings"] = 16.into();
    cfg["rope_scaling"] = serde_json::json!({
        "type": "longrope", "short_factor": short, "long_factor": long,
    });
    std::fs::write(dir.join("hf/config.json"), cfg.to_string())?;
    std::fs::copy(
        fixtures.join("phi3/model.safetensors"),
        dir.join("hf/model.safetensors"),
    )?;
    // The GGUF of the same weights, with the factors as tensors.
    let write = |name: &str, factors: (&[f32], &[f32]), attn: Option<f32>| -> anyhow::Result<()> {
        let src = fixtures.join("phi3.f32.gguf");
        let mut f = std::fs::File::open(&src)?;
        let c = gguf_file::Content::read(&mut f)?;
        let mut tensors = Vec::new();
        for n in c.tensor_infos.keys() {
            tensors.push((n.clone(), c.tensor(&mut f, n, &Device::Cpu)?));
        }
        for (n, v) in [
            ("rope_factors_short.weight", factors.0),
            ("rope_factors_long.weight", factors.1),
        ] {
            let t = Tensor::new(v, &Device::Cpu)?;
            tensors.push((n.to_string(), QTensor::quantize(&t, GgmlDType::F32)?));
        }
        let mut meta: Vec<(String, Value)> = c.metadata.into_iter().collect();
        meta.push((
            "phi3.rope.scaling.original_context_length".into(),
            Value::U32(16),
        ));
        if let Some(a) = attn {
            meta.push(("phi3.rope.scaling.attn_factor".into(), Value::F32(a)));
        }
        let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensor_refs: Vec<(&str, &QTensor)> =
            tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut out = std::fs::File::create(dir.join(name))?;
        gguf_file::write(&mut out, &meta_refs, &tensor_refs)?;
        Ok(())
    };
    let hf = loader::from_dir(&dir.join("hf"))?;
    let ids = prompt(hf.config.vocab_size);
    let max_len = ids.len() + 8;
    let (ours_hf, _) = model(&hf, false, max_len)?;
    let want = logits(&ours_hf, &ids)?;
    // The multiplier stored, and left to its default (the same from the two contexts).
    let stored = (1.0f64 + 16f64.ln() / 16f64.ln()).sqrt() as f32;
    for (name, attn) in [("stored.gguf", Some(stored)), ("default.gguf", None)] {
        write(name, (&short, &long), attn)?;
        let gguf = loader::from_gguf(&dir.join(name))?;
        let (ours_gguf, _) = model(&gguf, false, max_len)?;
        let err = rel_l2(&logits(&ours_gguf, &ids)?, &want);
        assert!(
            err <= 1e-5,
            "{name}: rel L2 {err:.3e} against the safetensors"
        );
    }
    // Without LongRoPE the logits differ: the test sees the factors.
    let plain = loader::from_gguf(&fixtures.join("phi3.f32.gguf"))?;
    let (ours_plain, _) = model(&plain, false, max_len)?;
    let err = rel_l2(&logits(&ours_plain, &ids)?, &want);
    assert!(err > 1e-3, "the factors changed nothing: rel L2 {err:.3e}");
    // Factors of the wrong width, or not positive, are refused by name.
    write("narrow.gguf", (&[1.0], &[2.0]), None)?;
    let e = loader::from_gguf(&dir.join("narrow.gguf"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rope_factors_short.weight") && e.contains("rotary width"),
        "{e}"
    );
    write("negative.gguf", (&short, &[2.0, -1.0]), None)?;
    let e = loader::from_gguf(&dir.join("negative.gguf"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rope_factors_long.weight") && e.contains("positive"),
        "{e}"
    );
    Ok(())
}

/// Every tensor of a model's store, as (name, tensor) on the host.
fn store_tensors(files: &ModelFiles) -> anyhow::Result<Vec<(String, Tensor)>> {
    let store = loader::load_store_with(files, DType::F32, &Device::Cpu, None, false)?;
    let mut out = Vec::new();
    for unit in store.units() {
        for t in unit.tensors() {
            out.push((t.name.clone(), unit.cpu_tensor(t)?));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Weights written back as a GGUF laid out as their source (`gguf_save::save_like`, what
/// `finetune` does with a GGUF base) load again as the same family, for every architecture:
/// the store's tensors come back exactly (scaled first, so that none is the source's copy;
/// llama's q/k permuted back, Gemma's norms with their 1), the unscaled ones give the source's
/// logits bit for bit, an F16 file stays close, and a tensor with no place in the file is
/// refused by name.
#[test]
fn gguf_save_round_trips_every_family() -> anyhow::Result<()> {
    use candle_offload_models::gguf_save::save_like;
    let dir = fixtures()?;
    let out_dir = scratch("gguf-save");
    for name in FAMILIES {
        let source = dir.join(format!("{name}.f32.gguf"));
        let files = loader::from_gguf(&source)?;
        let tensors = store_tensors(&files)?;
        let scaled: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(n, t)| Ok((n.clone(), (t * 1.5)?)))
            .collect::<anyhow::Result<_>>()?;
        let out = out_dir.join(format!("{name}.gguf"));
        save_like(&source, &scaled, DType::F32, &out)?;
        let back = store_tensors(&loader::from_gguf(&out)?)?;
        assert_eq!(back.len(), scaled.len(), "{name}: tensor count");
        for ((n, want), (m, got)) in scaled.iter().zip(&back) {
            assert_eq!(n, m, "{name}");
            let d = (want - got)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(d == 0.0, "{name}: {n} differs by {d}");
        }
        // Unscaled: the source's logits exactly; through a directory holding the file.
        let sub = out_dir.join(name);
        std::fs::create_dir_all(&sub)?;
        save_like(&source, &tensors, DType::F32, &sub.join("model.gguf"))?;
        let again = loader::from_dir(&sub)?;
        assert_eq!(again.config.family.name(), files.config.family.name());
        let ids = prompt(files.config.vocab_size);
        let (a, _) = model(&files, false, ids.len())?;
        let (b, _) = model(&again, false, ids.len())?;
        let err = rel_l2(&logits(&b, &ids)?, &logits(&a, &ids)?);
        assert!(err == 0.0, "{name}: rel L2 {err:.3e} after the round trip");
        save_like(&source, &tensors, DType::F16, &out)?;
        let (c, _) = model(&loader::from_gguf(&out)?, false, ids.len())?;
        let err = rel_l2(&logits(&c, &ids)?, &logits(&a, &ids)?);
        assert!(err < 1e-2, "{name}: F16 rel L2 {err:.3e}");
    }
    let source = dir.join("llama.f32.gguf");
    let mut extra = store_tensors(&loader::from_gguf(&source)?)?;
    extra.push((
        "model.layers.0.mlp.nonsense.weight".into(),
        Tensor::zeros(4, DType::F32, &Device::Cpu)?,
    ));
    let e = save_like(&source, &extra, DType::F32, &out_dir.join("x.gguf")).unwrap_err();
    assert!(e.to_string().contains("nonsense"), "{e}");
    assert!(
        !out_dir.join("x.gguf").exists(),
        "a refused save wrote a file"
    );
    Ok(())
}

/// A Llama 3.1-style GGUF, whose RoPE scaling is the tensor `rope_freqs.weight` as llama.cpp's
/// converter computes it from `rope_scaling` (a divisor per rotated pair), gives the logits of
/// the safetensors checkpoint configured with that `rope_scaling`; without the tensor they
/// differ.
#[test]
fn llama3_rope_freqs_gguf_equals_safetensors() -> anyhow::Result<()> {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    let fixtures = fixtures()?;
    let dir = scratch("ropefreqs");
    std::fs::create_dir_all(dir.join("hf"))?;
    // Llama 3 scaling over the fixture's 4 rotated pairs (head_dim 8, base 10000): wavelengths
    // 6.3, 63, 628 and 6283 against 64 / 1 and 64 / 4: one pair kept, one smoothed, two scaled.
    let (factor, low, high, original) = (8.0f64, 1.0f64, 4.0f64, 64.0f64);
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("llama/config.json"))?)?;
    cfg["rope_scaling"] = serde_json::json!({
        "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
        "high_freq_factor": high, "original_max_position_embeddings": original as u64,
    });
    std::fs::write(dir.join("hf/config.json"), cfg.to_string())?;
    std::fs::copy(
        fixtures.join("llama/model.safetensors"),
        dir.join("hf/model.safetensors"),
    )?;
    let hf = loader::from_dir(&dir.join("hf"))?;
    let (head_dim, theta) = (hf.config.head_dim, f64::from(hf.config.rope_theta));
    // The converter's rope_freqs (LlamaModel.generate_extra_tensors).
    let freqs: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| {
            let freq = 1.0 / theta.powf(i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let (low_wavelen, high_wavelen) = (original / low, original / high);
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor as f32
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect();
    assert!(
        freqs.iter().any(|&f| f > 1.0 && f < 8.0),
        "{freqs:?}: no smoothed pair"
    );
    let src = fixtures.join("llama.f32.gguf");
    let mut f = std::fs::File::open(&src)?;
    let c = gguf_file::Content::read(&mut f)?;
    let mut tensors = Vec::new();
    for n in c.tensor_infos.keys() {
        tensors.push((n.clone(), c.tensor(&mut f, n, &Device::Cpu)?));
    }
    let t = Tensor::new(freqs.as_slice(), &Device::Cpu)?;
    tensors.push((
        "rope_freqs.weight".into(),
        QTensor::quantize(&t, GgmlDType::F32)?,
    ));
    let meta: Vec<(String, Value)> = c.metadata.into_iter().collect();
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(
        &mut std::fs::File::create(dir.join("freqs.gguf"))?,
        &meta_refs,
        &tensor_refs,
    )?;
    let ids = prompt(hf.config.vocab_size);
    let (ours_hf, _) = model(&hf, false, ids.len())?;
    let want = logits(&ours_hf, &ids)?;
    let gguf = loader::from_gguf(&dir.join("freqs.gguf"))?;
    let (ours_gguf, _) = model(&gguf, false, ids.len())?;
    let err = rel_l2(&logits(&ours_gguf, &ids)?, &want);
    assert!(err <= 1e-5, "rel L2 {err:.3e} against the safetensors");
    let (plain, _) = model(&loader::from_gguf(&src)?, false, ids.len())?;
    let err = rel_l2(&logits(&plain, &ids)?, &want);
    assert!(err > 1e-3, "the factors changed nothing: rel L2 {err:.3e}");
    Ok(())
}
