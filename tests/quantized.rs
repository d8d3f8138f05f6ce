//! Quantized GGUF weights of every GGML type the store keeps: random LLaMA checkpoints that the
//! tests quantize themselves and write with llama.cpp's tensor names, loaded with their layer
//! projections kept as blocks (Candle's quantized matmuls) and dequantized (dense F32).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::util::{scratch, Scratch};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_offload::store::WeightFormat;
use candle_offload::{HostStore, MemoryLimit, OffloadStrategy};
use candle_offload_models::generation::{generate, generate_batch};
use candle_offload_models::{loader, Llama, ModelFiles, MIN_PROMPT_CHUNK};
use candle_transformers::generation::LogitsProcessor;
use rand::Rng as _;

/// Every GGML type whose layer projections stay as blocks.
pub const KEPT_TYPES: [GgmlDType; 10] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// The random LLaMA's shape: rows of 256 and 512 elements, whole blocks of every type.
const HIDDEN: usize = 256;
const INTER: usize = 512;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const VOCAB: usize = 128;
const HEAD_DIM: usize = HIDDEN / HEADS;

/// The GGUF tensor the random LLaMA writes last (truncating the file cuts its data).
pub const LAST_TENSOR: &str = "blk.1.ffn_up.weight";

/// llama.cpp's converter's q/k permutation (the loader undoes it).
fn permute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    w.reshape((heads, 2, rows / heads / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

/// What the writer made: the F32 weights under their HF names, and the bytes each quantized
/// projection takes in the file (by GGUF name).
pub struct Written {
    /// HF name and unquantized value of every tensor.
    pub dense: Vec<(String, Tensor)>,
    /// GGUF name of each projection and its bytes in the file.
    pub proj_bytes: HashMap<String, usize>,
}

/// What a tensor of the random LLaMA is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// An embedding or the head: F32.
    Dense,
    /// A norm weight (around 1): F32.
    Norm,
    /// A layer projection, quantized; q/k with their head count, permuted for llama.cpp's rope.
    Proj(Option<usize>),
}

/// Writes a random LLaMA (GQA, untied head) as a GGUF at `path` with llama.cpp's tensor names:
/// each layer projection quantized by the test to `proj(gguf_name)` (q/k permuted the
/// llama.cpp way first), everything else F32.
pub fn write_random_llama_gguf(
    path: &Path,
    seed: u64,
    proj: impl Fn(&str) -> GgmlDType,
) -> anyhow::Result<Written> {
    write_random_llama_gguf_with(path, seed, proj, None)
}

/// [`write_random_llama_gguf`], with `tied_embed`: the token embedding quantized to that type
/// and no `output.weight` (the head is the embedding matrix, as in SmolLM2's GGUF).
pub fn write_random_llama_gguf_with(
    path: &Path,
    seed: u64,
    proj: impl Fn(&str) -> GgmlDType,
    tied_embed: Option<GgmlDType>,
) -> anyhow::Result<Written> {
    use gguf_file::Value;
    let mut rng = candle_offload_suite::rng(seed);
    let mut random = |rows: usize, cols: usize, norm: bool| -> candle_core::Result<Tensor> {
        let scale = 2.0 / (cols as f32).sqrt();
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| {
                let r = rng.random_range(-0.5f32..0.5);
                if norm {
                    1.0 + 0.1 * r
                } else {
                    scale * r
                }
            })
            .collect();
        if rows == 1 {
            Tensor::from_vec(v, cols, &Device::Cpu)
        } else {
            Tensor::from_vec(v, (rows, cols), &Device::Cpu)
        }
    };
    // (GGUF name, HF name, value, what it is).
    let mut tensors: Vec<(String, String, Tensor, Kind)> = vec![
        (
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
            random(VOCAB, HIDDEN, false)?,
            Kind::Dense,
        ),
        (
            "output_norm.weight".into(),
            "model.norm.weight".into(),
            random(1, HIDDEN, true)?,
            Kind::Norm,
        ),
        (
            "output.weight".into(),
            "lm_head.weight".into(),
            random(VOCAB, HIDDEN, false)?,
            Kind::Dense,
        ),
    ];
    if tied_embed.is_some() {
        tensors.retain(|(g, ..)| g != "output.weight");
    }
    let kv = KV_HEADS * HEAD_DIM;
    for l in 0..LAYERS {
        let layer = [
            ("attn_norm", "input_layernorm", 1, HIDDEN, Kind::Norm),
            (
                "attn_q",
                "self_attn.q_proj",
                HIDDEN,
                HIDDEN,
                Kind::Proj(Some(HEADS)),
            ),
            (
                "attn_k",
                "self_attn.k_proj",
                kv,
                HIDDEN,
                Kind::Proj(Some(KV_HEADS)),
            ),
            ("attn_v", "self_attn.v_proj", kv, HIDDEN, Kind::Proj(None)),
            (
                "attn_output",
                "self_attn.o_proj",
                HIDDEN,
                HIDDEN,
                Kind::Proj(None),
            ),
            (
                "ffn_norm",
                "post_attention_layernorm",
                1,
                HIDDEN,
                Kind::Norm,
            ),
            ("ffn_gate", "mlp.gate_proj", INTER, HIDDEN, Kind::Proj(None)),
            ("ffn_down", "mlp.down_proj", HIDDEN, INTER, Kind::Proj(None)),
            ("ffn_up", "mlp.up_proj", INTER, HIDDEN, Kind::Proj(None)),
        ];
        for (g, hf, rows, cols, kind) in layer {
            tensors.push((
                format!("blk.{l}.{g}.weight"),
                format!("model.layers.{l}.{hf}.weight"),
                random(rows, cols, kind == Kind::Norm)?,
                kind,
            ));
        }
    }
    assert_eq!(tensors.last().unwrap().0, LAST_TENSOR);
    let mut written = Written {
        dense: Vec::new(),
        proj_bytes: HashMap::new(),
    };
    let mut qtensors = Vec::new();
    for (g, hf, t, kind) in &tensors {
        let q = match kind {
            Kind::Proj(heads) => {
                let t = match heads {
                    Some(h) => permute(t, *h)?,
                    None => t.clone(),
                };
                let q = QTensor::quantize(&t, proj(g))?;
                written
                    .proj_bytes
                    .insert(g.clone(), q.storage_size_in_bytes());
                q
            }
            Kind::Dense if g == "token_embd.weight" && tied_embed.is_some() => {
                let q = QTensor::quantize(t, tied_embed.expect("checked"))?;
                written
                    .proj_bytes
                    .insert(g.clone(), q.storage_size_in_bytes());
                q
            }
            Kind::Dense | Kind::Norm => QTensor::quantize(t, GgmlDType::F32)?,
        };
        qtensors.push(q);
        written.dense.push((hf.clone(), t.clone()));
    }
    let tokens = Value::Array((0..VOCAB).map(|i| Value::String(format!("t{i}"))).collect());
    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.embedding_length", Value::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Value::U32(INTER as u32)),
        ("llama.block_count", Value::U32(LAYERS as u32)),
        ("llama.attention.head_count", Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("llama.context_length", Value::U32(256)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("tokenizer.ggml.tokens", tokens),
    ];
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let named: Vec<(&str, &QTensor)> = tensors
        .iter()
        .zip(&qtensors)
        .map(|((g, ..), q)| (g.as_str(), q))
        .collect();
    let mut file = std::fs::File::create(path)?;
    gguf_file::write(&mut file, &metadata, &named)?;
    Ok(written)
}

/// Relative L2 distance of `a` from `b`.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den).sqrt()
}

const PROMPT: [u32; 8] = [3, 17, 42, 5, 77, 8, 91, 23];

/// A GPU budget (for `dev`) that holds the model's reservation for a `prompt_len`-token
/// prompt in `max_len` positions, its kept units and `layers` layer units: the rest streams.
pub fn streaming_budget(
    cfg: &candle_offload_models::Config,
    store: &HostStore,
    dev: &Device,
    (prompt_len, max_len): (usize, usize),
    dtype: DType,
    layers: u64,
) -> u64 {
    let layer = store.layer_unit(0).map(|u| store.unit(u).bytes()).unwrap();
    let kept: u64 = Llama::kept_units(store, cfg)
        .iter()
        .filter_map(|n| store.unit_id(n))
        .map(|u| store.unit(u).bytes())
        .sum();
    Llama::reserve_bytes(
        cfg,
        store,
        dev,
        prompt_len,
        max_len,
        dtype,
        &Default::default(),
    ) + kept
        + layers * layer
}

/// Logits of the whole prompt and 6 greedy tokens after it, on the CPU, with `layers` layer
/// units' room in the budget (`None`: no limit, everything resident).
fn run(
    files: &ModelFiles,
    store: Arc<HostStore>,
    layers: Option<u64>,
    strategy: OffloadStrategy,
    depth: usize,
) -> anyhow::Result<(Vec<f32>, Vec<u32>, u64)> {
    let dev = Device::Cpu;
    let limit = layers.map(|n| {
        streaming_budget(
            &files.config,
            &store,
            &dev,
            (PROMPT.len(), PROMPT.len() + 6),
            DType::F32,
            n,
        )
    });
    let (logits, tokens, stats) = run_with_limit(files, store, limit, strategy, depth)?;
    Ok((logits, tokens, stats.total.fetches))
}

/// [`run`] under a budget of `limit` bytes (`None`: no limit), with the runtime's counters.
fn run_with_limit(
    files: &ModelFiles,
    store: Arc<HostStore>,
    limit: Option<u64>,
    strategy: OffloadStrategy,
    depth: usize,
) -> anyhow::Result<(Vec<f32>, Vec<u32>, candle_offload::OffloadStats)> {
    run_on(&Device::Cpu, files, store, limit, strategy, depth)
}

/// [`run_with_limit`] on `dev`.
fn run_on(
    dev: &Device,
    files: &ModelFiles,
    store: Arc<HostStore>,
    limit: Option<u64>,
    strategy: OffloadStrategy,
    depth: usize,
) -> anyhow::Result<(Vec<f32>, Vec<u32>, candle_offload::OffloadStats)> {
    let max_len = PROMPT.len() + 6;
    let settings = candle_offload_models::OffloadSettings {
        gpu_memory_limit: limit.map(MemoryLimit::Bytes),
        strategy,
        prefetch_depth: depth,
        ..Default::default()
    };
    let model = Llama::builder(files, store)
        .device(dev)
        .dtype(DType::F32)
        .prompt_len(PROMPT.len())
        .max_len(max_len)
        .settings(settings.clone())
        .build()?;
    let ids = Tensor::new(&PROMPT, dev)?.unsqueeze(0)?;
    let logits = model.forward_all(&ids)?.flatten_all()?.to_vec1::<f32>()?;
    let mut sampler = LogitsProcessor::new(0, None, None);
    let (tokens, _) = generate(&model, &PROMPT, 6, &mut sampler, &[], |_| Ok(()))?;
    Ok((logits, tokens, model.runtime().stats()?))
}

fn load(files: &ModelFiles, keep: bool) -> anyhow::Result<Arc<HostStore>> {
    Ok(Arc::new(loader::load_store_with(
        files,
        DType::F32,
        &Device::Cpu,
        None,
        keep,
    )?))
}

/// For every kept type: the layer projections stay as blocks of that type, each taking exactly
/// its bytes in the file; the quantized matmuls' logits are within 2e-2 (relative L2) of the
/// same weights dequantized to F32 and run densely.
#[test]
fn every_kept_type_matches_its_dequantized_model() -> anyhow::Result<()> {
    let dir = scratch("types");
    let mut report = Vec::new();
    for t in KEPT_TYPES {
        let path = dir.join(format!("{t:?}.gguf"));
        let written = write_random_llama_gguf(&path, 11, |_| t)?;
        let files = loader::from_gguf(&path)?;
        let kept = load(&files, true)?;
        let dense = load(&files, false)?;
        assert_eq!(kept.ggml_tensor_count(), 7 * LAYERS, "{t:?}");
        assert_eq!(dense.ggml_tensor_count(), 0, "{t:?}");
        // Host bytes of the kept tensors: exactly the file's.
        let mut host = 0;
        for unit in kept.units() {
            for m in unit.tensors() {
                if let WeightFormat::Ggml(g) = m.format {
                    assert_eq!(g, t, "{}", m.name);
                    host += m.nbytes;
                }
            }
        }
        let file: usize = written.proj_bytes.values().sum();
        assert_eq!(host, file, "{t:?}: host bytes of the kept blocks");
        let (q, _, _) = run(&files, kept, None, OffloadStrategy::Minimal, 0)?;
        let (d, _, _) = run(&files, dense, None, OffloadStrategy::Minimal, 0)?;
        let rel = rel_l2(&q, &d);
        // How far the quantization itself moved the model (not asserted: 2-bit types move it far).
        let original = Arc::new(HostStore::from_tensors(
            &written.dense,
            &Default::default(),
            &Device::Cpu,
        )?);
        let (o, _, _) = run(&files, original, None, OffloadStrategy::Minimal, 0)?;
        let from_original = rel_l2(&d, &o);
        report.push(format!(
            "{t:?}: kept vs dequantized {rel:.2e}, dequantized vs unquantized {from_original:.2e}"
        ));
        assert!(rel <= 2e-2 && rel > 0.0, "{t:?}: rel L2 {rel}");
        if t == GgmlDType::Q8_0 {
            // Close to the unquantized model: the q/k permutation was written and undone right.
            assert!(from_original < 2e-2, "Q8_0 vs unquantized: {from_original}");
        }
    }
    eprintln!("{}", report.join("\n"));
    Ok(())
}

/// Offloaded == resident, bit for bit, on the CPU with quantized blocks (a legacy, two K and a
/// 6-bit type): budgets of one and two layers, with and without prefetch.
#[test]
fn quantized_offloaded_equals_resident() -> anyhow::Result<()> {
    let dir = scratch("offload");
    for t in [GgmlDType::Q4_0, GgmlDType::Q4K, GgmlDType::Q6K] {
        let path = dir.join(format!("{t:?}.gguf"));
        write_random_llama_gguf(&path, 5, |_| t)?;
        let files = loader::from_gguf(&path)?;
        let store = load(&files, true)?;
        let (ref_logits, ref_tokens, _) =
            run(&files, store.clone(), None, OffloadStrategy::Minimal, 0)?;
        for layers in [1u64, 2] {
            for strategy in [OffloadStrategy::Minimal, OffloadStrategy::Balanced] {
                for depth in [0, 1] {
                    let what = format!("{t:?}, {layers} layers, {strategy}, depth {depth}");
                    let (logits, tokens, fetches) =
                        run(&files, store.clone(), Some(layers), strategy, depth)?;
                    assert_eq!(logits, ref_logits, "logits: {what}");
                    assert_eq!(tokens, ref_tokens, "greedy tokens: {what}");
                    if layers == 1 {
                        assert!(fetches > 4, "{what}: the model must stream ({fetches})");
                    }
                }
            }
        }
    }
    Ok(())
}

/// A random-weight GGUF whose layers mix block types as a Q4_K_M file's do: layer 0's
/// `attn_v` and `ffn_down` in Q6_K, everything else in Q4_K.
/// A fresh directory `tag` with [`mixed_k_quant_gguf`] of `seed` in it, and its store (blocks
/// kept).
fn mixed_k_store(tag: &str, seed: u64) -> anyhow::Result<(Scratch, ModelFiles, Arc<HostStore>)> {
    let dir = scratch(tag);
    let files = mixed_k_quant_gguf(&dir.join("q4_k_m.gguf"), seed)?;
    let store = load(&files, true)?;
    Ok((dir, files, store))
}

/// The reservation of a CPU model in F32 for passes of `rows` and `max_len` positions.
fn cpu_reserve(files: &ModelFiles, store: &HostStore, rows: usize, max_len: usize) -> u64 {
    Llama::reserve_bytes(
        &files.config,
        store,
        &Device::Cpu,
        rows,
        max_len,
        DType::F32,
        &Default::default(),
    )
}

/// Every unit of `store` at its own (unpadded) device size.
fn own_bytes(store: &HostStore) -> u64 {
    store.units().iter().map(|u| u.resident_bytes()).sum()
}

/// `files` on `dev` in F32 with its first layer on the host, built for passes of `rows` and
/// `max_len` positions under `limit`, fetching nothing ahead.
fn one_host_layer(
    files: &ModelFiles,
    store: &Arc<HostStore>,
    dev: &Device,
    rows: usize,
    max_len: usize,
    limit: Option<u64>,
) -> Result<Llama, candle_offload_models::ModelError> {
    Llama::builder(files, store.clone())
        .device(dev)
        .dtype(DType::F32)
        .prompt_len(rows)
        .max_len(max_len)
        .settings(candle_offload_models::OffloadSettings {
            gpu_memory_limit: limit.map(MemoryLimit::Bytes),
            prefetch_depth: 0,
            ..Default::default()
        })
        .host_layers(candle_offload_models::HostLayers::Count(1))
        .build()
}

fn mixed_k_quant_gguf(path: &Path, seed: u64) -> anyhow::Result<ModelFiles> {
    write_random_llama_gguf(path, seed, |g| {
        let more = g.starts_with("blk.0.") && (g.contains("attn_v") || g.contains("ffn_down"));
        if more {
            GgmlDType::Q6K
        } else {
            GgmlDType::Q4K
        }
    })?;
    Ok(loader::from_gguf(path)?)
}

/// Layers of mixed block types, as a Q4_K_M file has them (layer 0's `attn_v` and `ffn_down` in
/// Q6_K, layer 1's in Q4_K): host memory holds each tensor's own bytes, but both layer units take
/// one device size at each position (so that a streamed layer frees what the next allocates),
/// and the model still streams bit for bit like its resident self.
#[test]
fn mixed_k_quant_layers_take_one_device_size() -> anyhow::Result<()> {
    let (_dir, files, store) = mixed_k_store("mixed-k", 13)?;
    let unit = |l: usize| store.unit(store.layer_unit(l).expect("a layer unit"));
    let (l0, l1) = (unit(0), unit(1));
    assert_eq!(l0.bytes(), l1.bytes(), "one device size per layer");
    assert!(
        l0.host_bytes() > l1.host_bytes(),
        "host memory keeps each type's own bytes ({} and {})",
        l0.host_bytes(),
        l1.host_bytes()
    );
    for (a, b) in l0.tensors().iter().zip(l1.tensors()) {
        assert_eq!(a.device_bytes, b.device_bytes, "{} and {}", a.name, b.name);
        if a.format != b.format {
            assert!(
                b.device_bytes > b.format.device_bytes(b.nbytes),
                "{} is padded",
                b.name
            );
            // Whole blocks of both types: a multiple of 144 and 210.
            assert_eq!(b.device_bytes % 5040, 0, "{}", b.name);
        }
    }
    let (ref_logits, ref_tokens, _) =
        run(&files, store.clone(), None, OffloadStrategy::Minimal, 0)?;
    let (logits, tokens, fetches) = run(&files, store, Some(1), OffloadStrategy::Minimal, 1)?;
    assert_eq!(logits, ref_logits);
    assert_eq!(tokens, ref_tokens);
    assert!(fetches > 4, "the model must stream ({fetches})");
    Ok(())
}

/// The padding that evens out layers of mixed block types is for streaming: under a budget
/// that holds every unit at its own size (and not every unit padded), the runtime gives each
/// unit its own size and fetches each once; the logits and tokens are the resident model's.
/// Under a budget that streams, the layers keep their padded size.
#[test]
fn mixed_k_quant_layers_that_stay_take_their_own_size() -> anyhow::Result<()> {
    let (_dir, files, store) = mixed_k_store("mixed-k-own", 17)?;
    let l1 = store.layer_unit(1).expect("a layer unit");
    let (padded, own) = (store.unit(l1).bytes(), store.unit(l1).resident_bytes());
    assert!(own < padded, "layer 1 is padded ({own} and {padded})");
    let max_len = PROMPT.len() + 6;
    let reserve = cpu_reserve(&files, &store, PROMPT.len(), max_len);
    let all_own = own_bytes(&store);
    assert!(all_own < store.total_bytes());
    let (ref_logits, ref_tokens, _) =
        run_with_limit(&files, store.clone(), None, OffloadStrategy::Minimal, 0)?;
    let limit = Some(reserve + all_own);
    let (logits, tokens, stats) =
        run_with_limit(&files, store.clone(), limit, OffloadStrategy::Minimal, 0)?;
    assert_eq!(logits, ref_logits);
    assert_eq!(tokens, ref_tokens);
    let layer = &stats.units[l1.0];
    assert_eq!(layer.bytes, own, "{}: its own size", layer.name);
    assert_eq!(layer.evictions, 0, "{}", layer.name);
    assert_eq!(
        stats.total.fetches,
        store.units().len() as u64,
        "each unit fetched once"
    );
    // Streaming (room for one layer): the padded size.
    let limit = streaming_budget(
        &files.config,
        &store,
        &Device::Cpu,
        (PROMPT.len(), max_len),
        DType::F32,
        1,
    );
    let (logits, tokens, stats) =
        run_with_limit(&files, store, Some(limit), OffloadStrategy::Minimal, 0)?;
    assert_eq!(logits, ref_logits);
    assert_eq!(tokens, ref_tokens);
    let layer = &stats.units[l1.0];
    assert_eq!(layer.bytes, padded, "{}: streams padded", layer.name);
    assert!(layer.evictions > 0, "{} must stream", layer.name);
    Ok(())
}

/// A budget that holds every unit at its own size beside the decode step's reservation but not
/// beside the prompt's: the units still take their own sizes (none padded), the prompt streams
/// through the room its activations take, and once decoding, the steps fetch nothing; the
/// logits and tokens are the resident model's.
#[test]
fn a_model_that_fits_while_decoding_holds_every_unit_then() -> anyhow::Result<()> {
    let (_dir, files, store) = mixed_k_store("mixed-k-decode-fit", 23)?;
    let max_len = PROMPT.len() + 6;
    let reserve = |rows| cpu_reserve(&files, &store, rows, max_len);
    let all_own = own_bytes(&store);
    assert!(reserve(PROMPT.len()) > reserve(1) + 4096);
    let (ref_logits, ref_tokens, _) =
        run_with_limit(&files, store.clone(), None, OffloadStrategy::Minimal, 0)?;
    let settings = candle_offload_models::OffloadSettings {
        gpu_memory_limit: Some(MemoryLimit::Bytes(reserve(1) + all_own)),
        prefetch_depth: 0,
        ..Default::default()
    };
    let model = Llama::builder(&files, store.clone())
        .device(&Device::Cpu)
        .dtype(DType::F32)
        .prompt_len(PROMPT.len())
        .max_len(max_len)
        .settings(settings.clone())
        .build()?;
    let ids = Tensor::new(&PROMPT, &Device::Cpu)?.unsqueeze(0)?;
    let logits = model.forward_all(&ids)?.flatten_all()?.to_vec1::<f32>()?;
    assert_eq!(logits, ref_logits);
    let after_prompt = model.runtime().stats()?;
    assert!(
        after_prompt.units.iter().any(|u| u.evictions > 0),
        "the prompt must stream"
    );
    let mut fetched = Vec::new();
    let mut sampler = LogitsProcessor::new(0, None, None);
    let (tokens, _) = generate(&model, &PROMPT, 6, &mut sampler, &[], |_| {
        fetched.push(model.runtime().stats()?.total.fetches);
        Ok(())
    })?;
    assert_eq!(tokens, ref_tokens);
    // The first token comes out of the prompt's pass; the decode steps after the second fetch
    // nothing.
    assert!(
        fetched.windows(2).skip(1).all(|w| w[0] == w[1]),
        "fetches after each token: {fetched:?}"
    );
    let stats = model.runtime().stats()?;
    for (u, unit) in stats.units.iter().zip(store.units()) {
        assert_eq!(u.bytes, unit.resident_bytes(), "{}: its own size", u.name);
    }
    Ok(())
}

/// On a GPU, the scene of [`a_stage_behind_host_layers_keeps_its_layers_at_their_own_size`]
/// with whole prompts: the stage keeps layer 1 (Q4_K) at its own size, and each prompt runs the
/// host layer 0 (Q6_K `attn_v` and `ffn_down`, padded) on the device through room for one
/// padded layer, so that the two evict each other. The evicted buffers are of other sizes than
/// the incoming tensors', so the upload frees them, and the next fetch first trims the weight
/// pool (without this a 13B Q4_K_M at 4 GiB held far more than it used: docs/tuning.md). The
/// trims are counted, layer 1 keeps its own size, and the greedy tokens of two prompts are the
/// unlimited model's.
#[cfg(feature = "cuda")]
#[test]
fn unmatched_spares_trim_the_weight_pool_gpu() -> anyhow::Result<()> {
    unmatched_spares_trim_the_weight_pool(&Device::new_cuda_with_stream(0)?)
}

/// The scene of [`unmatched_spares_trim_the_weight_pool_gpu`] on the CPU: the same streaming
/// and outputs (a CPU runtime has no pool to trim).
#[test]
fn unmatched_spares_trim_the_weight_pool_cpu() -> anyhow::Result<()> {
    unmatched_spares_trim_the_weight_pool(&Device::Cpu)
}

fn unmatched_spares_trim_the_weight_pool(dev: &Device) -> anyhow::Result<()> {
    let dev = dev.clone();
    let (_dir, files, store) = mixed_k_store("mixed-k-trim", 31)?;
    let (l0, l1) = (store.layer_unit(0).unwrap(), store.layer_unit(1).unwrap());
    let own = store.unit(l1).resident_bytes();
    assert!(own < store.unit(l1).bytes(), "layer 1 is padded");
    // Longer than a host step (`HOST_STEP_ROWS`): the stage runs the host layer for it.
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 90).collect();
    assert!(prompt.len() > candle_offload_models::HOST_STEP_ROWS);
    let max_len = prompt.len() + 6;
    let build = |limit| one_host_layer(&files, &store, &dev, prompt.len(), max_len, limit);
    // Two prompts, each then decoding (the host layer on the host).
    let run = |model: &Llama| -> anyhow::Result<Vec<Vec<u32>>> {
        let mut out = Vec::new();
        for _ in 0..2 {
            let mut sampler = LogitsProcessor::new(0, None, None);
            out.push(generate(model, &prompt, 6, &mut sampler, &[], |_| Ok(()))?.0);
        }
        Ok(out)
    };
    let stage = |model: &Llama| model.stages().last().unwrap().0.clone();
    let free = build(None)?;
    assert_eq!(free.host_layer_count(), 1);
    // The stage's reservation as built (for prompts; decode steps reserve less).
    let reserve = stage(&free).stats()?.reserve_bytes;
    let want = run(&free)?;
    drop(free);
    let kept: u64 = ["model.norm", "lm_head"]
        .iter()
        .map(|n| store.unit(store.unit_id(n).unwrap()).resident_bytes())
        .sum();
    // Room for one layer padded: layer 1 at its own size fits, and it beside layer 0 does not.
    assert!(own + store.unit(l0).resident_bytes() > store.unit(l0).bytes());
    let model = build(Some(reserve + kept + store.unit(l0).bytes()))?;
    assert_eq!(run(&model)?, want);
    let stats = stage(&model).stats()?;
    let layer = |u: candle_offload::UnitId| {
        let name = store.unit(u).name();
        stats.units.iter().find(|s| s.name == name).unwrap()
    };
    assert_eq!(layer(l1).bytes, own, "layer 1 at its own size");
    assert!(layer(l0).evictions > 0, "the prompts stream layer 0");
    assert!(
        dev.is_cpu() || stats.total.pool_trims > 0,
        "an upload freed spares of other sizes, so a fetch trims ({} tensors reused)",
        stats.total.reused_buffers
    );
    Ok(())
}

/// A device stage behind a host layer serves that layer too (for prompts, outside its schedule),
/// yet keeps the layers it runs at their own sizes when they fit so (`runtime::staying`), rather
/// than charging every layer its padded size (13% more on a 7B Q4_K_M, enough to stream 0.52 GB
/// a token at 4 GiB where the layers fit at their own sizes). A budget
/// for the stage's reservation, its kept units and one padded layer (the host layer streams
/// through it for prompts) holds the stage's layer at its own size (not for good: a prompt may
/// evict it); decode steps fetch nothing, and the logits are the unlimited model's.
#[test]
fn a_stage_behind_host_layers_keeps_its_layers_at_their_own_size() -> anyhow::Result<()> {
    let (_dir, files, store) = mixed_k_store("mixed-k-host", 29)?;
    let (l0, l1) = (store.layer_unit(0).unwrap(), store.layer_unit(1).unwrap());
    let (padded, own) = (store.unit(l1).bytes(), store.unit(l1).resident_bytes());
    assert!(own < padded, "layer 1 is padded ({own} and {padded})");
    let max_len = PROMPT.len() + 1;
    // Built for one row a step, so that every token is a decode step (the host layer on the
    // host) and the reservation has one phase.
    let build = |limit| one_host_layer(&files, &store, &Device::Cpu, 1, max_len, limit);
    let run = |model: &Llama| -> anyhow::Result<(Vec<Vec<f32>>, Vec<u64>)> {
        let mut cache = model.new_cache();
        let (mut logits, mut fetches) = (Vec::new(), Vec::new());
        for (i, &t) in PROMPT.iter().enumerate() {
            let l = model.forward(&Tensor::new(&[[t]], &Device::Cpu)?, i, &mut cache)?;
            logits.push(l.flatten_all()?.to_vec1::<f32>()?);
            let rt = model.stages().last().unwrap().0.clone();
            fetches.push(rt.stats()?.total.fetches);
        }
        Ok((logits, fetches))
    };
    let free = build(None)?;
    assert_eq!(free.host_layer_count(), 1);
    let (want, _) = run(&free)?;
    let rt = free.stages().last().unwrap().0.clone();
    let stats = rt.stats()?;
    // The stage keeps the final norm and the head (the embeddings are looked up on the host).
    let kept: u64 = ["model.norm", "lm_head"]
        .iter()
        .map(|n| store.unit(store.unit_id(n).unwrap()).resident_bytes())
        .sum();
    // Room for one layer padded: the stage's layer at its own size fits, and both layers at
    // theirs do not.
    let limit = stats.reserve_bytes + kept + store.unit(l0).bytes();
    assert!(own + store.unit(l0).resident_bytes() > store.unit(l0).bytes());
    let model = build(Some(limit))?;
    let (got, fetches) = run(&model)?;
    assert_eq!(got, want);
    let rt = model.stages().last().unwrap().0.clone();
    let stats = rt.stats()?;
    let layer = stats
        .units
        .iter()
        .find(|u| u.name == store.unit(l1).name())
        .unwrap();
    assert_eq!(layer.bytes, own, "{}: its own size", layer.name);
    assert!(
        fetches.windows(2).all(|w| w[0] == w[1]),
        "fetches after each step: {fetches:?}"
    );
    Ok(())
}

/// A near fit: every unit fits at its own size beside the activations of a 40-row pass but not
/// beside a whole 96-token prompt's. The model runs prompts in passes of the most rows that fit
/// (`prompt_chunk`), so that nothing is evicted: each unit is fetched once. The logits match
/// the unlimited model's (one pass; the passes change the order of the sums only) and the
/// greedy tokens are the same.
#[test]
fn a_near_fit_runs_its_prompt_in_passes_and_streams_nothing() -> anyhow::Result<()> {
    let (_dir, files, store) = mixed_k_store("near-fit-chunks", 29)?;
    let prompt: Vec<u32> = (0..96).map(|i| (i * 13 % 90) as u32).collect();
    let max_len = prompt.len() + 6;
    let reserve = |rows| cpu_reserve(&files, &store, rows, max_len);
    let all_own = own_bytes(&store);
    let build = |limit: Option<u64>| {
        let settings = candle_offload_models::OffloadSettings {
            gpu_memory_limit: limit.map(MemoryLimit::Bytes),
            prefetch_depth: 0,
            ..Default::default()
        };
        Llama::builder(&files, store.clone())
            .device(&Device::Cpu)
            .dtype(DType::F32)
            .prompt_len(prompt.len())
            .max_len(max_len)
            .settings(settings.clone())
            .build()
    };
    let run = |model: &Llama| -> anyhow::Result<(Vec<f32>, Vec<u32>)> {
        let ids = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let mut cache = model.new_cache();
        let logits = model
            .forward(&ids, 0, &mut cache)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut sampler = LogitsProcessor::new(0, None, None);
        let (tokens, _) = generate(model, &prompt, 6, &mut sampler, &[], |_| Ok(()))?;
        Ok((logits, tokens))
    };
    let whole = build(None)?;
    assert_eq!(whole.prompt_chunk(), None);
    let (ref_logits, ref_tokens) = run(&whole)?;
    let near = build(Some(reserve(40) + all_own))?;
    let chunk = near
        .prompt_chunk()
        .expect("a near fit runs its prompt in passes");
    assert!((40..prompt.len()).contains(&chunk), "{chunk} rows a pass");
    let (logits, tokens) = run(&near)?;
    let rel = rel_l2(&logits, &ref_logits);
    assert!(rel < 1e-5, "logits in passes: rel L2 {rel}");
    assert_eq!(tokens, ref_tokens);
    let stats = near.runtime().stats()?;
    for u in &stats.units {
        assert_eq!(u.evictions, 0, "{}: nothing streams", u.name);
    }
    assert_eq!(
        stats.total.fetches,
        store.units().len() as u64,
        "each unit fetched once"
    );
    // A left-padded batch of two (96 and 61 tokens): passes too, the first reaching the
    // shorter prompt's first token; the greedy tokens are the unlimited model's.
    let batch = |model: &Llama| -> anyhow::Result<Vec<Vec<u32>>> {
        let mut sampler = LogitsProcessor::new(0, None, None);
        let prompts: [&[u32]; 2] = [&prompt, &prompt[35..]];
        Ok(generate_batch(model, &prompts, 6, &mut sampler, &[], |_, _| Ok(()))?.0)
    };
    assert_eq!(batch(&near)?, batch(&whole)?, "a padded batch in passes");
    // One byte short of the fewest rows a pass is cut to: no smaller passes; the whole
    // prompt's reservation, which this budget cannot hold beside a streamed layer.
    let short = build(Some(reserve(MIN_PROMPT_CHUNK) + all_own - 1));
    assert!(
        short.is_err(),
        "passes of fewer than {MIN_PROMPT_CHUNK} rows"
    );
    Ok(())
}

/// A GGUF with a quantized token embedding and no `output.weight` (a tied head, as SmolLM2's):
/// the embedding stays as its blocks (host bytes = the file's), its rows are dequantized on
/// lookup and the head multiplies the same blocks; logits within 2e-2 (relative L2) of the
/// dequantized model, and offloaded == resident bit for bit. Q4_1 and Q8_0 run the library's
/// SIMD CPU matmul, Q4_K Candle's.
#[test]
fn quantized_embedding_and_tied_head() -> anyhow::Result<()> {
    let dir = scratch("tied");
    for (proj, embed) in [
        (GgmlDType::Q4_1, GgmlDType::Q8_0),
        (GgmlDType::Q8_0, GgmlDType::Q4_1),
        (GgmlDType::Q4K, GgmlDType::Q4K),
    ] {
        let what = format!("{proj:?} layers, {embed:?} embedding");
        let path = dir.join(format!("{proj:?}-{embed:?}.gguf"));
        let written = write_random_llama_gguf_with(&path, 9, |_| proj, Some(embed))?;
        let files = loader::from_gguf(&path)?;
        assert!(files.config.tie_word_embeddings, "{what}");
        let kept = load(&files, true)?;
        let dense = load(&files, false)?;
        assert_eq!(kept.ggml_tensor_count(), 7 * LAYERS + 1, "{what}");
        let mut host = 0;
        for unit in kept.units() {
            for m in unit.tensors() {
                if let WeightFormat::Ggml(g) = m.format {
                    let want = if m.name == "model.embed_tokens.weight" {
                        embed
                    } else {
                        proj
                    };
                    assert_eq!(g, want, "{what}: {}", m.name);
                    host += m.nbytes;
                }
            }
        }
        let file: usize = written.proj_bytes.values().sum();
        assert_eq!(host, file, "{what}: host bytes of the kept blocks");
        let (q, q_tokens, _) = run(&files, kept.clone(), None, OffloadStrategy::Minimal, 0)?;
        let (d, _, _) = run(&files, dense, None, OffloadStrategy::Minimal, 0)?;
        let rel = rel_l2(&q, &d);
        eprintln!("{what}: kept vs dequantized rel L2 {rel:.2e}");
        assert!(rel <= 2e-2 && rel > 0.0, "{what}: rel L2 {rel}");
        for depth in [0, 1] {
            let (logits, tokens, fetches) = run(
                &files,
                kept.clone(),
                Some(1),
                OffloadStrategy::Minimal,
                depth,
            )?;
            assert!(fetches > 4, "{what}: the model must stream ({fetches})");
            assert_eq!(logits, q, "{what}, depth {depth}: offloaded logits");
            assert_eq!(tokens, q_tokens, "{what}, depth {depth}: offloaded tokens");
        }
    }
    Ok(())
}

/// Greedy decoding with the screened head (`set_greedy_head`): a Q8_0 tied head on the CPU
/// gives the same greedy tokens over 32 steps, and each step the same largest logit, as the
/// full product; only the other logits may differ (and stay below it).
#[test]
fn the_greedy_head_keeps_every_token() -> anyhow::Result<()> {
    let dir = scratch("greedy-head");
    let path = dir.join("q8-head.gguf");
    write_random_llama_gguf_with(&path, 31, |_| GgmlDType::Q4_1, Some(GgmlDType::Q8_0))?;
    let files = loader::from_gguf(&path)?;
    let store = load(&files, true)?;
    let new = 32;
    let model = Llama::builder(&files, store)
        .device(&Device::Cpu)
        .dtype(DType::F32)
        .prompt_len(PROMPT.len())
        .max_len(PROMPT.len() + new)
        .settings(Default::default())
        .build()?;
    assert!(!model.greedy_head(), "off by default");
    let run = |greedy: bool| -> anyhow::Result<(Vec<u32>, Vec<f32>)> {
        model.set_greedy_head(greedy);
        let mut sampler = LogitsProcessor::new(0, None, None);
        let (tokens, _) = generate(&model, &PROMPT, new, &mut sampler, &[], |_| Ok(()))?;
        let ids = Tensor::new(&PROMPT, &Device::Cpu)?.unsqueeze(0)?;
        let logits = model.forward(&ids, 0, &mut model.new_cache())?;
        Ok((tokens, logits.flatten_all()?.to_vec1::<f32>()?))
    };
    let (want, full) = run(false)?;
    let (got, screened) = run(true)?;
    assert_eq!(got, want, "greedy tokens");
    let max = |v: &[f32]| v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    assert_eq!(max(&screened), max(&full), "the largest logit, bit for bit");
    for (s, f) in screened.iter().zip(&full) {
        assert!(s == f || *s < max(&full));
    }
    Ok(())
}

/// A `tracing` writer into memory.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Q8_1 and Q8_K have no quantized matmul on every backend: their projections are dequantized
/// (none kept), with one warning that names both types and counts the tensors, and the model
/// matches the one loaded dense bit for bit.
#[test]
fn types_without_a_quantized_matmul_are_dequantized_with_one_warning() -> anyhow::Result<()> {
    let dir = scratch("q8");
    let path = dir.join("q8.gguf");
    write_random_llama_gguf(&path, 3, |g| {
        if g.starts_with("blk.0.") {
            GgmlDType::Q8_1
        } else {
            GgmlDType::Q8K
        }
    })?;
    let files = loader::from_gguf(&path)?;
    let out = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(out.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let kept = tracing::subscriber::with_default(subscriber, || load(&files, true))?;
    let text = String::from_utf8(out.0.lock().unwrap().clone())?;
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{text}");
    for needle in ["Q8_1", "Q8_K", "count=14", "blk.0.", "q8.gguf"] {
        assert!(warnings[0].contains(needle), "{needle}: {text}");
    }
    assert_eq!(kept.ggml_tensor_count(), 0);
    let dense = load(&files, false)?;
    let (a, ..) = run(&files, kept, None, OffloadStrategy::Minimal, 0)?;
    let (b, ..) = run(&files, dense, None, OffloadStrategy::Minimal, 0)?;
    assert_eq!(a, b);
    Ok(())
}

/// Host layers of GGML blocks compute in F32 beside a stage in F16; spread, the last layer runs
/// on the host and its F32 hidden state goes back to the last stage's dtype before the head.
/// The logits stay within 2e-2 (relative L2) of the model without host layers, and both
/// placements give the same number of host layers.
#[test]
fn spread_host_layers_of_blocks_beside_a_half_precision_stage() -> anyhow::Result<()> {
    use candle_offload_models::{HostLayers, OffloadSettings};
    let dir = scratch("spread");
    let path = dir.join("q8.gguf");
    write_random_llama_gguf(&path, 9, |_| GgmlDType::Q8_0)?;
    let files = loader::from_gguf(&path)?;
    let store = Arc::new(loader::load_store_with(
        &files,
        DType::F16,
        &Device::Cpu,
        None,
        true,
    )?);
    let logits = |host| -> anyhow::Result<(Vec<f32>, usize)> {
        let model = Llama::builder(&files, store.clone())
            .device(&Device::Cpu)
            .dtype(DType::F16)
            .prompt_len(PROMPT.len())
            .max_len(PROMPT.len() + 4)
            .settings(OffloadSettings::default())
            .host_layers(host)
            .build()?;
        // One position at a time: decode steps, which run the host layers on the host.
        let mut cache = model.new_cache();
        let mut last = Vec::new();
        for (i, &t) in PROMPT.iter().enumerate() {
            last = model
                .forward(&Tensor::new(&[[t]], &Device::Cpu)?, i, &mut cache)?
                .flatten_all()?
                .to_vec1::<f32>()?;
        }
        Ok((last, model.host_layer_count()))
    };
    let (want, none) = logits(HostLayers::None)?;
    assert_eq!(none, 0);
    for host in [
        HostLayers::Spread(1),
        HostLayers::Count(1),
        HostLayers::SpreadWithHead(1),
    ] {
        let (got, h) = logits(host)?;
        assert_eq!(h, 1, "{host:?}");
        let err = rel_l2(&got, &want);
        assert!(err <= 2e-2, "{host:?}: relative L2 {err}");
    }
    Ok(())
}
