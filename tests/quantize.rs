//! Quantize on load: tiny random safetensors checkpoints quantized to each `--quantize` type
//! run with their projections as GGML blocks, close to the dense model; the cached GGUF is
//! reused, rebuilt when the source changes, never left half-written; a GGUF input is refused.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{DType, Device, Tensor};
use candle_offload::{HostStore, MemoryLimit, StoreConfig};
use candle_offload_models::loader::{self, ModelFiles, Weights};
use candle_offload_models::quantize::{CacheState, QuantizeOptions};
use candle_offload_models::{Llama, ModelError};
use rand::Rng as _;

use crate::models::{write_tiny, Tiny};
use crate::util::scratch;

/// A random LLaMA whose rows are whole blocks of the K types (256): hidden 256, intermediate
/// 512, 2 layers, GQA, untied head.
fn write_wide_llama(dir: &Path) -> anyhow::Result<()> {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": false,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 101, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
    });
    std::fs::write(dir.join("config.json"), config.to_string())?;
    let cfg = candle_offload_models::Config::from_json_file(&dir.join("config.json"))?;
    let mut rng = candle_offload_suite::rng(11);
    let mut tensors = HashMap::new();
    for (name, shape) in cfg.expected_tensors() {
        let n: usize = shape.iter().product();
        let norm = name.ends_with("norm.weight");
        let values: Vec<f32> = (0..n)
            .map(|_| {
                let r = rng.random_range(-0.5f32..0.5);
                if norm {
                    1.0 + 0.1 * r
                } else {
                    0.1 * r
                }
            })
            .collect();
        tensors.insert(name, Tensor::from_vec(values, shape, &Device::Cpu)?);
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    Ok(())
}

/// The logits of `store`'s model on a fixed prompt, offloaded on the CPU (two layers' room).
fn logits(files: &ModelFiles, store: HostStore) -> anyhow::Result<Vec<f32>> {
    let dev = Device::Cpu;
    let layer = store.unit(store.layer_unit(0).expect("layer 0")).bytes();
    let settings = candle_offload_models::OffloadSettings {
        gpu_memory_limit: Some(MemoryLimit::Bytes(
            files.config.reserve_bytes(8, 16, DType::F32) + 2 * layer + (8 << 20),
        )),
        ..Default::default()
    };
    let model = Llama::builder(files, Arc::new(store))
        .device(&dev)
        .dtype(DType::F32)
        .prompt_len(8)
        .max_len(16)
        .settings(settings.clone())
        .build()?;
    let ids = Tensor::new(&[[3u32, 17, 42, 5, 77, 8, 91, 23]], &dev)?;
    Ok(model.forward_all(&ids)?.flatten_all()?.to_vec1::<f32>()?)
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den).sqrt()
}

/// The cache file's tensors, every one dequantized to F32: the reference the quantized
/// matmuls are held to.
fn dequantized_store(files: &ModelFiles, gguf: &Path) -> anyhow::Result<HostStore> {
    let mut f = std::fs::File::open(gguf)?;
    let c = gguf_file::Content::read(&mut f)?;
    let mut tensors = Vec::new();
    for name in c.tensor_infos.keys() {
        let t = c
            .tensor(&mut f, name, &Device::Cpu)?
            .dequantize(&Device::Cpu)?;
        tensors.push((name.clone(), t));
    }
    let cfg = StoreConfig {
        grouping: files.config.layout().grouping(),
        ..Default::default()
    };
    Ok(HostStore::from_tensors(&tensors, &cfg, &Device::Cpu)?)
}

fn opts() -> QuantizeOptions<'static> {
    QuantizeOptions {
        threads: Some(2),
        ..Default::default()
    }
}

/// Every `--quantize` type (K types on rows of 256, the others on the tiny LLaMA and Phi-3):
/// the projections become GGML blocks multiplied as blocks, whose logits stay within 2e-2
/// (relative L2) of the same blocks dequantized and run densely, and near the original
/// dense model.
#[test]
fn quantize_on_load_matches_the_dense_model() -> anyhow::Result<()> {
    let tiny = Tiny::Llama {
        tied: false,
        bias: false,
    };
    let cases: [(Option<Tiny>, GgmlDType, f64); 6] = [
        (Some(tiny), GgmlDType::Q8_0, 2e-2),
        (Some(tiny), GgmlDType::Q4_0, 2e-1),
        (Some(Tiny::Phi3), GgmlDType::Q4_0, 2e-1),
        (None, GgmlDType::Q6K, 5e-2),
        (None, GgmlDType::Q5K, 1e-1),
        (None, GgmlDType::Q4K, 2e-1),
    ];
    for (kind, ty, dense_bound) in cases {
        let tag = format!("{}-{ty:?}", kind.map_or("wide".into(), Tiny::tag));
        let dir = scratch(&format!("match-{tag}"));
        match kind {
            Some(k) => write_tiny(&dir, k)?,
            None => write_wide_llama(&dir)?,
        }
        let files = loader::from_dir(&dir)?;
        let (store, cached) =
            loader::quantized_store(&files, ty, DType::F32, &Device::Cpu, None, &opts())?;
        assert_eq!(cached.state, CacheState::Built, "{tag}");
        let layers = files.config.num_hidden_layers;
        let per_layer = if kind == Some(Tiny::Phi3) { 4 } else { 7 };
        // Every layer projection, and the head where the checkpoint has its own.
        let untied = store.tensor("lm_head.weight").is_some();
        let n = cached.quantized_tensors;
        assert_eq!(n, per_layer * layers + usize::from(untied), "{tag}");
        assert_eq!(store.ggml_tensor_count(), n, "{tag}");
        assert_eq!(cached.requantized, n, "{tag}");
        assert_eq!(cached.path.parent(), Some(&*dir), "{tag}");
        let q = logits(&files, store)?;
        let dq = logits(&files, dequantized_store(&files, &cached.path)?)?;
        let dense = logits(
            &files,
            loader::load_store(&files, DType::F32, &Device::Cpu, None)?,
        )?;
        let (vs_dq, vs_dense) = (rel_l2(&q, &dq), rel_l2(&q, &dense));
        eprintln!("{tag}: rel L2 {vs_dq:.2e} vs dequantized, {vs_dense:.2e} vs dense");
        assert!(vs_dq < 2e-2 && vs_dq > 0.0, "{tag}: vs dequantized {vs_dq}");
        assert!(vs_dense < dense_bound, "{tag}: vs dense {vs_dense}");
    }
    Ok(())
}

/// The second load reads the cache and quantizes nothing (same logits, bit for bit); another
/// type is another file; a changed source is detected and rebuilt.
#[test]
fn quantized_cache_is_reused_and_rebuilt_when_the_source_changes() -> anyhow::Result<()> {
    let dir = scratch("cache");
    write_tiny(
        &dir,
        Tiny::Llama {
            tied: true,
            bias: false,
        },
    )?;
    let files = loader::from_dir(&dir)?;
    let load = |ty| loader::quantized_store(&files, ty, DType::F32, &Device::Cpu, None, &opts());
    let (first, c1) = load(GgmlDType::Q8_0)?;
    assert_eq!(c1.state, CacheState::Built);
    assert!(c1.requantized > 0);
    let (second, c2) = load(GgmlDType::Q8_0)?;
    assert_eq!(c2.state, CacheState::Hit);
    assert_eq!(c2.requantized, 0);
    assert_eq!(c2.path, c1.path);
    let l1 = logits(&files, first)?;
    assert_eq!(l1, logits(&files, second)?);

    let (_, c3) = load(GgmlDType::Q4_0)?;
    assert_eq!(c3.state, CacheState::Built);
    assert_ne!(c3.path, c1.path);
    assert_eq!(load(GgmlDType::Q8_0)?.1.state, CacheState::Hit);

    // New weights of the same shapes (the header is the same): size equal, mtime later.
    let st = dir.join("model.safetensors");
    let tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&st, &Device::Cpu)?
        .into_iter()
        .map(|(n, t)| Ok((n, t.affine(0.5, 0.0)?)))
        .collect::<candle_core::Result<_>>()?;
    let modified = std::fs::metadata(&st)?.modified()?;
    candle_core::safetensors::save(&tensors, &st)?;
    std::fs::File::options()
        .write(true)
        .open(&st)?
        .set_modified(modified + std::time::Duration::from_secs(10))?;
    let (third, c4) = load(GgmlDType::Q8_0)?;
    match &c4.state {
        CacheState::Rebuilt { reason } => assert!(reason.contains("source"), "{reason}"),
        other => panic!("expected a rebuild, got {other:?}"),
    }
    assert!(c4.requantized > 0);
    assert_ne!(logits(&files, third)?, l1);
    assert_eq!(load(GgmlDType::Q8_0)?.1.state, CacheState::Hit);

    // A damaged cache file (cut short) is rebuilt, not read.
    let len = std::fs::metadata(&c4.path)?.len();
    std::fs::File::options()
        .write(true)
        .open(&c4.path)?
        .set_len(len - 100)?;
    match load(GgmlDType::Q8_0)?.1.state {
        CacheState::Rebuilt { reason } => assert!(reason.contains("truncated"), "{reason}"),
        other => panic!("expected a rebuild, got {other:?}"),
    }
    Ok(())
}

/// A quantization that stops part way (cancelled from the progress callback after three
/// tensors) leaves neither a cache file nor its temporary file; the next load builds it.
#[test]
fn interrupted_quantize_leaves_no_cache_file() -> anyhow::Result<()> {
    let dir = scratch("interrupt");
    write_tiny(&dir, Tiny::Gemma)?;
    let files = loader::from_dir(&dir)?;
    // The temporary file is there while tensors are written: the cancellation is mid-write.
    let saw_partial = std::sync::atomic::AtomicBool::new(false);
    let cancel = |p: &candle_offload_models::quantize::Progress<'_>| {
        if p.done >= 3 {
            let partial = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"));
            saw_partial.fetch_or(partial, std::sync::atomic::Ordering::SeqCst);
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    let cancelling = QuantizeOptions {
        threads: Some(2),
        progress: Some(&cancel),
        ..Default::default()
    };
    let err = loader::quantized_store(
        &files,
        GgmlDType::Q8_0,
        DType::F32,
        &Device::Cpu,
        None,
        &cancelling,
    )
    .expect_err("cancelled");
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert!(saw_partial.into_inner(), "no temporary file while writing");
    let left: Vec<String> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    assert!(
        left.iter().all(|n| !n.contains("gguf")),
        "left behind: {left:?}"
    );
    let (_, cached) = loader::quantized_store(
        &files,
        GgmlDType::Q8_0,
        DType::F32,
        &Device::Cpu,
        None,
        &opts(),
    )?;
    assert_eq!(cached.state, CacheState::Built);
    Ok(())
}

/// A GGUF input is already quantized: one error naming the file. Rows that are not whole
/// blocks of the type (64 elements, K types' blocks are 256) stay dense.
#[test]
fn quantize_refuses_gguf_and_keeps_uneven_rows_dense() -> anyhow::Result<()> {
    let dir = scratch("refuse");
    write_tiny(
        &dir,
        Tiny::Llama {
            tied: false,
            bias: false,
        },
    )?;
    let files = loader::from_dir(&dir)?;
    let gguf = dir.join("model.Q4_0.gguf");
    let as_gguf = ModelFiles {
        weights: Weights::Gguf(gguf.clone()),
        ..files.clone()
    };
    let err = loader::quantized_store(
        &as_gguf,
        GgmlDType::Q4_0,
        DType::F32,
        &Device::Cpu,
        None,
        &opts(),
    )
    .expect_err("a GGUF is refused");
    assert!(matches!(err, ModelError::File { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("model.Q4_0.gguf") && msg.contains("already quantized"),
        "{msg}"
    );

    let (store, cached) = loader::quantized_store(
        &files,
        GgmlDType::Q4K,
        DType::F32,
        &Device::Cpu,
        None,
        &opts(),
    )?;
    assert_eq!(store.ggml_tensor_count(), 0);
    assert_eq!(cached.quantized_tensors, 0);
    let dense = loader::load_store(&files, DType::F32, &Device::Cpu, None)?;
    assert_eq!(logits(&files, store)?, logits(&files, dense)?);
    Ok(())
}
