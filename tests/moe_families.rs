//! Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers: tiny random
//! checkpoints and transformers' own logits for them (`tests/fixtures/moe_families.tar.xz`,
//! written by `scripts/moe_fixtures.py`), in every expert layout (one tensor per expert, and the
//! fused stacks transformers 5 holds), resident and offloaded with each expert a unit; GGUF
//! files made by llama.cpp's converter give the safetensors logits, and the experts of a Q8_0
//! file, sliced out of their stacks, are the stack's blocks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use candle_offload::{MemoryLimit, OffloadConfig, OffloadRuntime, PolicyChoice};
use candle_offload_models::generation::generate;
use candle_offload_models::loader::{self, ModelFiles};
use candle_offload_models::{Llama, OffloadSettings};
use candle_transformers::generation::LogitsProcessor;

const VOCAB: usize = 300;

/// The fixtures, unpacked once per archive version and shared by every test and run (read
/// only: a test that writes files makes a scratch directory of its own).
fn fixtures() -> anyhow::Result<PathBuf> {
    static DIR: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    crate::util::unpacked_fixture("moe_families", &DIR)
}

/// The host store of `files` in F32 for `device`, GGML blocks kept as blocks where
/// `keep_blocks`.
fn f32_store(
    files: &ModelFiles,
    device: &Device,
    keep_blocks: bool,
) -> anyhow::Result<Arc<candle_offload::HostStore>> {
    Ok(Arc::new(loader::load_store_with(
        files,
        DType::F32,
        device,
        None,
        keep_blocks,
    )?))
}

/// Our model of `files` in F32: resident, or offloaded under a budget of a third of the
/// weights (experts and layers then stream, LRU).
fn model(files: &ModelFiles, keep_blocks: bool, offload: bool) -> anyhow::Result<Llama> {
    let store = f32_store(files, &Device::Cpu, keep_blocks)?;
    let limit = offload.then(|| {
        let layer = store
            .layer_unit(0)
            .map(|u| store.unit(u).bytes())
            .unwrap_or(0);
        MemoryLimit::Bytes(store.total_bytes() / 3 + 2 * layer)
    });
    let rt = OffloadRuntime::new(
        store.clone(),
        &Device::Cpu,
        &OffloadConfig {
            gpu_memory_limit: limit,
            policy: PolicyChoice::Lru,
            ..Default::default()
        },
    )?;
    Ok(Llama::builder(files.config.clone(), rt.store().clone())
        .runtime(rt)
        .dtype(DType::F32)
        .max_len(64)
        .source_path(files.weights_path())
        .build()?)
}

fn prompt() -> Vec<u32> {
    (0..24u32).map(|i| (i * 37 + 11) % VOCAB as u32).collect()
}

/// Logits of the prompt's last 8 positions, (8 · vocab) flattened.
fn logits(model: &Llama) -> anyhow::Result<Vec<f32>> {
    let t = Tensor::new(prompt().as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let all = model.forward_all(&t)?.squeeze(0)?;
    Ok(all.narrow(0, 16, 8)?.flatten_all()?.to_vec1::<f32>()?)
}

fn reference(dir: &Path) -> anyhow::Result<Vec<f32>> {
    let bytes = std::fs::read(dir.join("logits.f32"))?;
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Asserts that logits `a` are within `rel` of `b`'s scale (its largest magnitude, at least 1)
/// of `b`, naming `what` where not.
fn assert_close_to_scale(a: &Tensor, b: &Tensor, rel: f32, what: &str) -> anyhow::Result<()> {
    let (a, b) = (
        a.flatten_all()?.to_vec1::<f32>()?,
        b.flatten_all()?.to_vec1::<f32>()?,
    );
    let d = diff_to_scale(&a, &b);
    assert!(d <= rel, "{what}: max |Δ| / scale {d}");
    Ok(())
}

/// The largest difference of `a` from `b` over `b`'s scale (its largest magnitude, at least 1).
fn diff_to_scale(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
    max_abs(a, b) / scale
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

#[test]
fn moe_logits_equal_transformers_in_every_layout() -> anyhow::Result<()> {
    let dir = fixtures()?;
    for (name, family, expert_unit) in [
        (
            "mixtral",
            "mixtral",
            Some("model.layers.1.block_sparse_moe.experts.3"),
        ),
        ("mixtral_fused", "mixtral", None),
        (
            "qwen3_moe",
            "qwen3_moe",
            Some("model.layers.0.mlp.experts.2"),
        ),
        (
            "qwen3_moe_mixed",
            "qwen3_moe",
            Some("model.layers.2.mlp.experts.0"),
        ),
        ("qwen3_moe_mixed_fused", "qwen3_moe", None),
        (
            "qwen2_moe",
            "qwen2_moe",
            Some("model.layers.1.mlp.experts.1"),
        ),
    ] {
        let files = loader::from_dir(&dir.join(name))?;
        assert_eq!(files.config.family.name(), family);
        let want = reference(&dir.join(name))?;
        for offload in [false, true] {
            let m = model(&files, false, offload)?;
            let got = logits(&m)?;
            let d = max_abs(&got, &want);
            assert!(d <= 1e-4, "{name} offload={offload}: max |Δ| {d}");
            let store = m.runtime().store().clone();
            // Per-expert checkpoints: each expert a unit; fused stacks stay with the layer.
            match expert_unit {
                Some(u) => assert!(store.unit_id(u).is_some(), "{name}: no unit {u}"),
                None => assert!(store.unit_id("model.layers.0.mlp.experts.0").is_none()),
            }
            if offload && expert_unit.is_some() {
                // Experts were evicted and fetched again.
                let s = m.runtime().stats()?;
                let evicted: u64 = s
                    .units
                    .iter()
                    .filter(|u| u.name.contains(".experts."))
                    .map(|u| u.evictions)
                    .sum();
                assert!(evicted > 0, "{name}: nothing streamed");
            }
        }
    }
    // The middle layer of the mixed checkpoint is dense: no experts there.
    let files = loader::from_dir(&dir.join("qwen3_moe_mixed"))?;
    let layout = files.config.layout();
    assert!(layout.experts_of(1).is_empty());
    assert_eq!(layout.experts_of(2).len(), 4);
    Ok(())
}

#[test]
fn moe_gguf_equals_safetensors_and_slices_experts() -> anyhow::Result<()> {
    let dir = fixtures()?;
    for name in ["mixtral", "qwen3_moe", "qwen2_moe"] {
        let st = loader::from_dir(&dir.join(name))?;
        let want = logits(&model(&st, false, false)?)?;
        let f32_gguf = loader::from_gguf(&dir.join(format!("{name}.f32.gguf")))?;
        assert_eq!(f32_gguf.config.family.name(), st.config.family.name());
        let got = logits(&model(&f32_gguf, false, true)?)?;
        let r = rel_l2(&got, &want);
        assert!(r <= 1e-5, "{name}: F32 GGUF rel L2 {r}");

        // Q8_0: the blocks kept, each expert's sliced out of its stack.
        let path = dir.join(format!("{name}.q8_0.gguf"));
        let q8 = loader::from_gguf(&path)?;
        let m = model(&q8, true, false)?;
        let got = logits(&m)?;
        let r = rel_l2(&got, &want);
        assert!(r <= 0.05, "{name}: Q8_0 GGUF rel L2 {r}");
        let rt = m.runtime();
        let mut file = std::fs::File::open(&path)?;
        let content = gguf_file::Content::read(&mut file)?;
        for (stack, proj) in [
            ("ffn_gate_exps", "gate_proj"),
            ("ffn_down_exps", "down_proj"),
        ] {
            let whole = content
                .tensor(&mut file, &format!("blk.1.{stack}.weight"), &Device::Cpu)?
                .dequantize(&Device::Cpu)?;
            for e in 0..4 {
                let unit = rt.acquire_named(&format!("model.layers.1.mlp.experts.{e}"))?;
                let q =
                    unit.get_quantized(&format!("model.layers.1.mlp.experts.{e}.{proj}.weight"))?;
                assert_eq!(format!("{:?}", q.dtype()), "Q8_0");
                let ours = q.dequantize(&Device::Cpu)?;
                let theirs = whole.get(e)?;
                let d = (ours - theirs)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert_eq!(d, 0.0, "{name} {stack} expert {e}");
            }
        }
        let mut sampler = LogitsProcessor::new(0, None, None);
        let (tokens, _) = generate(&m, &prompt()[..6], 4, &mut sampler, &[], |_| Ok(()))?;
        assert_eq!(tokens.len(), 4);
    }
    Ok(())
}

/// A ragged step of mixture-of-experts layers (experts as units, offloaded under a budget):
/// two sequences, one reading its prompt in two chunks while the other decodes, give each the
/// logits it gets alone.
#[test]
fn moe_ragged_steps_equal_each_sequence_alone() -> anyhow::Result<()> {
    let dir = fixtures()?;
    for name in ["mixtral", "qwen3_moe"] {
        let files = loader::from_dir(&dir.join(name))?;
        let m = model(&files, false, true)?;
        let p = prompt();
        let steps: [[&[u32]; 2]; 3] = [[&p[..9], &p[3..7]], [&[17], &p[7..20]], [&[23], &[5]]];
        let mut caches = [m.new_cache(), m.new_cache()];
        let mut got = [Vec::new(), Vec::new()];
        for step in &steps {
            let [a, b] = &mut caches;
            let mut seqs = [
                candle_offload_models::RaggedSeq {
                    id: 0,
                    tokens: step[0].to_vec(),
                    cache: a,
                },
                candle_offload_models::RaggedSeq {
                    id: 1,
                    tokens: step[1].to_vec(),
                    cache: b,
                },
            ];
            let logits = m.forward_ragged(&mut seqs)?;
            for (i, g) in got.iter_mut().enumerate() {
                g.push(logits.get(i)?.to_vec1::<f32>()?);
            }
        }
        for (i, g) in got.iter().enumerate() {
            let mut cache = m.new_cache();
            for (k, step) in steps.iter().enumerate() {
                let ids = Tensor::new(step[i], &Device::Cpu)?.unsqueeze(0)?;
                let want = m.forward(&ids, cache.len(), &mut cache)?.squeeze(0)?;
                let d = max_abs(&g[k], &want.to_vec1::<f32>()?);
                assert!(d <= 1e-4, "{name}, sequence {i}, step {k}: max |Δ| {d}");
            }
        }
    }
    Ok(())
}

/// `files`' model on `device` with the expert tier (`experts`) under a budget of the dense
/// part, the reservation of a 64-token prompt, a largest unit's room for copies in flight and
/// half of the experts. GGML blocks stay blocks where `keep_blocks`.
fn half_experts_model(
    files: &ModelFiles,
    device: &Device,
    keep_blocks: bool,
    experts: candle_offload::experts::ExpertOptions,
) -> anyhow::Result<Llama> {
    share_of_experts_model(files, device, keep_blocks, experts, 0.5)
}

/// [`half_experts_model`] with a budget for `share` of the experts.
fn share_of_experts_model(
    files: &ModelFiles,
    device: &Device,
    keep_blocks: bool,
    experts: candle_offload::experts::ExpertOptions,
    share: f64,
) -> anyhow::Result<Llama> {
    let store = f32_store(files, device, keep_blocks)?;
    let is_expert = |name: &str| name.contains(".experts.");
    let sizes = |experts: bool| {
        let units = store.units().iter();
        units
            .filter(move |u| is_expert(u.name()) == experts)
            .map(|u| u.bytes())
    };
    let (all_experts, dense) = (sizes(true).sum::<u64>(), sizes(false).sum::<u64>());
    let largest_expert = sizes(true).max().unwrap_or(0);
    let build = |budget: u64| {
        let settings = OffloadSettings {
            gpu_memory_limit: Some(MemoryLimit::Bytes(budget)),
            reserve_bytes: 0,
            experts,
            ..Default::default()
        };
        Llama::builder(files, store.clone())
            .device(device)
            .settings(settings)
            .dtype(DType::F32)
            .max_len(64)
            .prompt_len(64)
            .build()
    };
    // The weights' room wanted: the dense part, half of the experts and a copy in flight. What
    // of a budget the runtime keeps for itself depends on the device and the budget, so the
    // budget is corrected by the capacity each build reports (at most the whole model's).
    let want = dense + (all_experts as f64 * share) as u64 + largest_expert;
    let reserve = Llama::reserve_bytes(
        &files.config,
        &store,
        device,
        64,
        64,
        DType::F32,
        &Default::default(),
    );
    let mut budget = want + reserve;
    let mut m = build(budget)?;
    for _ in 0..4 {
        let capacity = m.runtime().stats()?.weight_capacity_bytes;
        if capacity == want {
            break;
        }
        budget = (budget + want).saturating_sub(capacity);
        m = build(budget)?;
    }
    let s = m.expert_stats().expect("the tier is on");
    anyhow::ensure!(
        s.slots.iter().any(|&n| n > 0) && s.slots.iter().any(|&n| n < s.experts_per_layer),
        "a budget of {budget} bytes for {share} of the experts holds none or all: {s:?}"
    );
    Ok(m)
}

/// A GGUF's whole model on `device` under `settings`: F32, 64 positions, its blocks kept
/// as they are stored.
fn gguf_model(
    files: &ModelFiles,
    device: &Device,
    settings: OffloadSettings,
) -> anyhow::Result<Llama> {
    let store = f32_store(files, device, true)?;
    Ok(Llama::builder(files, store)
        .device(device)
        .settings(settings)
        .dtype(DType::F32)
        .max_len(64)
        .build()?)
}

/// The expert tier, forced on (on the CPU, the split where no GPU is): a budget that holds the
/// dense part and a few experts per layer splits each layer's routed experts between the
/// cache, fetches (evicting the policy's victim) and the host CPU, and the logits stay
/// transformers' under both policies; every path is taken and the counters add up. With the
/// split's fetch side alone (`ExpertSplit::Fetch`) no expert runs on the host. With the next
/// layer's experts guessed and prefetched, the decode steps' logits are the same.
fn moe_expert_tier_splits_and_keeps_the_logits(device: &Device) -> anyhow::Result<()> {
    use candle_offload::experts::{ExpertOptions, ExpertPolicy, ExpertSlots, ExpertSplit};
    let dir = fixtures()?;
    // A prompt's experts, with more rows each than the host reads at once, stream where no
    // slot is free.
    let mut streamed = false;
    let mut prefetched = false;
    for name in ["mixtral", "qwen3_moe_mixed", "qwen2_moe"] {
        let files = loader::from_dir(&dir.join(name))?;
        let want = reference(&dir.join(name))?;
        let (lfu, spread) = (ExpertPolicy::Lfu { half_life: 64.0 }, ExpertSlots::Spread);
        for (policy, prefetch, split, guess, slots) in [
            (ExpertPolicy::Lru, false, ExpertSplit::On, 1, spread),
            (lfu, false, ExpertSplit::On, 1, spread),
            (ExpertPolicy::Lru, true, ExpertSplit::On, 1, spread),
            (
                ExpertPolicy::Lru,
                true,
                ExpertSplit::On,
                1,
                ExpertSlots::Layers,
            ),
            (ExpertPolicy::Lru, false, ExpertSplit::Fetch, 1, spread),
            (ExpertPolicy::Lru, true, ExpertSplit::Fetch, 1, spread),
            (ExpertPolicy::Lru, true, ExpertSplit::Fetch, 2, spread),
        ] {
            // Whole layers under a budget for three quarters of the experts: the last layer
            // holds all of its experts, the layer before it part of them.
            let share = if slots == ExpertSlots::Layers {
                0.75
            } else {
                0.5
            };
            let m = share_of_experts_model(
                &files,
                device,
                false,
                ExpertOptions::new(policy, split)
                    .with_prefetch(prefetch)
                    .with_guess_layers(guess)
                    .with_slots(slots),
                share,
            )?;
            assert!(m.warm_up()? > 0, "the host's copies of the experts");
            for pass in 0..2 {
                let t = Tensor::new(prompt().as_slice(), device)?.unsqueeze(0)?;
                let all = m.forward_all(&t)?.squeeze(0)?;
                let got = all.narrow(0, 16, 8)?.flatten_all()?.to_vec1::<f32>()?;
                let d = max_abs(&got, &want);
                assert!(
                    d <= 1e-4,
                    "{name} {policy:?} on {device:?}, pass {pass}: max |Δ| {d}"
                );
            }
            // Decode steps (where the next layer's experts are prefetched, when on) give the
            // logits of the same steps without the tier.
            let plain = model(&files, false, false)?;
            let (mut c1, mut c2) = (m.new_cache(), plain.new_cache());
            let p = prompt();
            let ids = Tensor::new(&p[..20], device)?.unsqueeze(0)?;
            m.forward(&ids, 0, &mut c1)?;
            plain.forward(
                &Tensor::new(&p[..20], &Device::Cpu)?.unsqueeze(0)?,
                0,
                &mut c2,
            )?;
            for (k, &t) in p[20..].iter().enumerate() {
                let a = m.forward(&Tensor::new(&[t], device)?.unsqueeze(0)?, 20 + k, &mut c1)?;
                let b = plain.forward(
                    &Tensor::new(&[t], &Device::Cpu)?.unsqueeze(0)?,
                    20 + k,
                    &mut c2,
                )?;
                let d = max_abs(
                    &a.flatten_all()?.to_vec1::<f32>()?,
                    &b.flatten_all()?.to_vec1::<f32>()?,
                );
                assert!(
                    d <= 1e-4,
                    "{name} {policy:?} prefetch {prefetch}, decode step {k}: max |Δ| {d}"
                );
            }
            let s = m.expert_stats().expect("the split is on");
            // A guess's missing experts are split as a step's are (with the host CPU beside
            // the link, a lone one stays for the host), and never evict each other: a layer
            // of one slot holding one of them takes none.
            if !prefetch {
                assert_eq!(s.prefetched, 0, "{name}: {s:?}");
            }
            prefetched |= s.prefetched > 0;
            assert!(s.prefetch_used <= s.prefetched, "{name}: {s:?}");
            let x = files.config.layout().experts.expect("experts");
            let count = x.count;
            let sparse_slots: Vec<usize> = (s.slots.iter().zip(&x.sparse))
                .filter(|(_, &sparse)| sparse)
                .map(|(&n, _)| n)
                .collect();
            if slots == ExpertSlots::Layers {
                // Whole layers from the last, the rest in the next one down, none below.
                assert_eq!(sparse_slots.last(), Some(&count), "{name}: {:?}", s.slots);
                assert!(
                    sparse_slots.windows(2).all(|w| w[0] == 0 || w[1] == count),
                    "{name}: slots {:?} of {count}",
                    s.slots
                );
                // A layer with a slot for every expert fetches each miss, which then stays:
                // none is computed on the host, no expert misses twice there, none is evicted.
                for (l, c) in s.layers.iter().enumerate() {
                    if s.slots[l] >= count {
                        assert!(
                            s.on_host_by_layer[l] == 0
                                && c.misses <= count as u64
                                && c.evictions == 0,
                            "{name}: whole layer {l}: {c:?}, {} on the host",
                            s.on_host_by_layer[l]
                        );
                    }
                }
                assert!(s.on_host > 0, "{name}: the layers without slots: {s:?}");
            } else {
                assert!(
                    sparse_slots.iter().all(|&n| n > 0 && n < count),
                    "{name}: slots {:?} of {count}",
                    s.slots
                );
            }
            assert!(
                s.resident > 0 && s.fetched > 0,
                "{name} {policy:?} {split:?}: {s:?}"
            );
            assert_eq!(
                s.on_host > 0,
                split == ExpertSplit::On,
                "{name} {policy:?} {split:?}: {s:?}"
            );
            let hits: u64 = s.layers.iter().map(|c| c.hits).sum();
            let misses: u64 = s.layers.iter().map(|c| c.misses).sum();
            assert_eq!(hits, s.resident, "{s:?}");
            assert_eq!(misses, s.fetched + s.streamed + s.on_host, "{s:?}");
            streamed |= s.streamed > 0;
            assert!(s.hit_rate() > 0.0 && s.hit_rate() < 1.0);
            for (l, c) in s.layers.iter().enumerate() {
                assert!(c.evictions <= c.misses, "layer {l}: {c:?}");
                if s.slots[l] == 0 {
                    assert_eq!(c.hits, 0, "layer {l} has no slots");
                }
            }
        }
    }
    assert!(streamed, "no expert streamed");
    assert!(prefetched, "no guessed expert prefetched");
    Ok(())
}

test_device!(
    moe_expert_tier_splits_and_keeps_the_logits,
    moe_expert_tier_splits_and_keeps_the_logits_cpu,
    moe_expert_tier_splits_and_keeps_the_logits_gpu
);

/// The host's two rates for missing experts, the split's prices, each come from its own
/// steps: a decode miss's read from decode placements, a prompt's expert of many rows from
/// prompts' (a prompt's host experts compute many rows in the time a decode row reads their
/// weights once). A rate sampled from the other kind of step mispriced every later step of
/// this one. Through the prompt the decode rate stays the starting one (the link's) and the
/// prompt's is measured; decode steps that run experts on the host measure theirs and leave
/// the prompt's alone. GPU only: on a CPU device the host's experts run in the device's own
/// pass, and no rate is measured.
#[cfg(feature = "cuda")]
#[test]
fn moe_host_rates_come_from_their_own_steps_gpu() -> anyhow::Result<()> {
    use candle_offload::experts::{ExpertOptions, ExpertPolicy, ExpertRoute, ExpertSplit};
    use candle_offload::kernels::linear::cpu_quant::KQUANT_MAX_ROWS;
    let device = &Device::new_cuda_with_stream(0)?;
    let dir = fixtures()?;
    let files = loader::from_gguf(&dir.join("qwen3_moe.q8_0.gguf"))?;
    let options =
        ExpertOptions::new(ExpertPolicy::Lru, ExpertSplit::On).with_route(ExpertRoute::Host);
    let m = half_experts_model(&files, device, true, options)?;
    let mut cache = m.new_cache();
    let p = prompt();
    m.forward(&Tensor::new(&p[..12], device)?.unsqueeze(0)?, 0, &mut cache)?;
    let s = m.expert_stats().expect("the tier is on");
    anyhow::ensure!(
        s.host_bytes_per_s == s.link_bytes_per_s,
        "the prompt's host experts priced a decode read: {s:?}"
    );
    let start = s.link_bytes_per_s * KQUANT_MAX_ROWS as f64;
    anyhow::ensure!(
        s.on_host > 0 && s.host_row_bytes_per_s != start && s.host_row_bytes_per_s > 0.0,
        "the prompt's host experts measured no rate of their own: {s:?}"
    );
    for (k, &t) in p[12..].iter().enumerate() {
        m.forward(
            &Tensor::new(&[t], device)?.unsqueeze(0)?,
            12 + k,
            &mut cache,
        )?;
    }
    let d = m.expert_stats().expect("the tier is on");
    anyhow::ensure!(
        d.on_host > s.on_host,
        "no decode miss ran on the host: {d:?}"
    );
    anyhow::ensure!(
        d.host_bytes_per_s != d.link_bytes_per_s && d.host_bytes_per_s > 0.0,
        "the decode steps' host experts measured no rate: {d:?}"
    );
    anyhow::ensure!(
        d.host_row_bytes_per_s == s.host_row_bytes_per_s,
        "the decode steps priced a prompt's rows: {d:?}"
    );
    Ok(())
}

/// A Q8_0 GGUF's decode steps with a row's experts through the grouped kernels (the default;
/// on a GPU `kernels::linear::qexperts_row`'s launches) give the logits of the same steps with
/// each expert's own decode matmuls (`KernelTuning::grouped_experts` off): the same arithmetic
/// but for the weighted sum's rounding, so within 1e-3 of the logits' scale in F32.
fn moe_grouped_decode_equals_each_expert(device: &Device) -> anyhow::Result<()> {
    let dir = fixtures()?;
    for name in ["mixtral", "qwen3_moe", "qwen2_moe"] {
        let files = loader::from_gguf(&dir.join(format!("{name}.q8_0.gguf")))?;
        let build = |grouped: bool| -> anyhow::Result<Llama> {
            // No expert tier: a decode row's experts routed on the host (the device's choice
            // takes the grouped kernels only).
            let mut settings = OffloadSettings {
                experts: candle_offload::experts::ExpertOptions::new(
                    Default::default(),
                    candle_offload::experts::ExpertSplit::Off,
                ),
                ..Default::default()
            };
            settings.tuning.kernels.grouped_experts = grouped;
            gguf_model(&files, device, settings)
        };
        let (a, b) = (build(true)?, build(false)?);
        let (mut ca, mut cb) = (a.new_cache(), b.new_cache());
        let p = prompt();
        let ids = Tensor::new(&p[..12], device)?.unsqueeze(0)?;
        a.forward(&ids, 0, &mut ca)?;
        b.forward(&ids, 0, &mut cb)?;
        for (k, &t) in p[12..].iter().enumerate() {
            let ids = Tensor::new(&[t], device)?.unsqueeze(0)?;
            let x = a.forward(&ids, 12 + k, &mut ca)?;
            let y = b.forward(&ids, 12 + k, &mut cb)?;
            assert_close_to_scale(&x, &y, 1e-3, &format!("{name} on {device:?}, step {k}"))?;
        }
    }
    Ok(())
}

test_device!(
    moe_grouped_decode_equals_each_expert,
    moe_grouped_decode_equals_each_expert_cpu,
    moe_grouped_decode_equals_each_expert_gpu
);

/// Decode steps of a Q8_0 GGUF under a budget that holds half of its experts, every missing
/// expert fetched: on a GPU each fetch writes its blocks into the buffers of the expert it
/// evicted (all of one shape), so no decode step trims the weight pool (a trim waits for the
/// device), and the logits stay those of the whole model on the same device (the same kernels:
/// a GPU's quantized matmuls round their activations, a CPU's do not).
fn moe_expert_fetches_reuse_evicted_buffers(device: &Device) -> anyhow::Result<()> {
    use candle_offload::experts::{ExpertOptions, ExpertPolicy, ExpertRoute, ExpertSplit};
    let dir = fixtures()?;
    let files = loader::from_gguf(&dir.join("qwen3_moe.q8_0.gguf"))?;
    // The host routes each row, so that every miss is fetched before its use.
    let m = half_experts_model(
        &files,
        device,
        true,
        ExpertOptions::new(ExpertPolicy::Lru, ExpertSplit::Fetch).with_route(ExpertRoute::Host),
    )?;
    let whole = gguf_model(&files, device, OffloadSettings::default())?;
    let (mut c1, mut c2) = (m.new_cache(), whole.new_cache());
    let p = prompt();
    m.forward(&Tensor::new(&p[..12], device)?.unsqueeze(0)?, 0, &mut c1)?;
    whole.forward(&Tensor::new(&p[..12], device)?.unsqueeze(0)?, 0, &mut c2)?;
    let before = m.runtime().stats()?.total;
    let fetched_before = m.expert_stats().expect("the tier is on").fetched;
    for (k, &t) in p[12..].iter().enumerate() {
        let a = m.forward(&Tensor::new(&[t], device)?.unsqueeze(0)?, 12 + k, &mut c1)?;
        let b = whole.forward(&Tensor::new(&[t], device)?.unsqueeze(0)?, 12 + k, &mut c2)?;
        assert_close_to_scale(&a, &b, 1e-4, &format!("step {k} on {device:?}"))?;
    }
    let after = m.runtime().stats()?.total;
    let fetched = m.expert_stats().expect("the tier is on").fetched - fetched_before;
    assert!(fetched > 0, "no expert was fetched in the decode steps");
    if device.is_cuda() {
        assert_eq!(
            after.pool_trims - before.pool_trims,
            0,
            "decode steps trimmed the weight pool ({fetched} experts fetched)"
        );
        // Fetches into free slots allocate; the others take their victims' buffers.
        assert!(
            after.reused_buffers > before.reused_buffers,
            "{} buffers reused for {fetched} fetched experts",
            after.reused_buffers - before.reused_buffers
        );
    }
    Ok(())
}

test_device!(
    moe_expert_fetches_reuse_evicted_buffers,
    moe_expert_fetches_reuse_evicted_buffers_cpu,
    moe_expert_fetches_reuse_evicted_buffers_gpu
);

/// Decode steps of Q8_0 GGUFs under a budget that holds half of their experts, each row's
/// experts chosen by the device (`ExpertRoute::Device`: its misses read from their host
/// copies, fetched afterwards for the next steps), give the logits of the same steps routed
/// on the host with every miss fetched first (the same grouped kernels over the same blocks),
/// within 1e-4 of their scale; the counters add up, and no decode step trims the weight pool.
/// On a CPU the device route is never taken.
fn moe_device_route_equals_the_host_route(device: &Device) -> anyhow::Result<()> {
    use candle_offload::experts::{ExpertOptions, ExpertPolicy, ExpertRoute, ExpertSplit};
    let dir = fixtures()?;
    for name in ["qwen3_moe", "mixtral", "qwen2_moe"] {
        let files = loader::from_gguf(&dir.join(format!("{name}.q8_0.gguf")))?;
        let options = ExpertOptions::new(ExpertPolicy::Lru, ExpertSplit::Fetch);
        let on_device = half_experts_model(
            &files,
            device,
            true,
            options.with_route(ExpertRoute::Device),
        )?;
        let on_host =
            half_experts_model(&files, device, true, options.with_route(ExpertRoute::Host))?;
        let (mut c1, mut c2) = (on_device.new_cache(), on_host.new_cache());
        let p = prompt();
        let ids = Tensor::new(&p[..12], device)?.unsqueeze(0)?;
        on_device.forward(&ids, 0, &mut c1)?;
        on_host.forward(&ids, 0, &mut c2)?;
        let before = on_device.runtime().stats()?.total;
        for (k, &t) in p[12..].iter().enumerate() {
            let ids = Tensor::new(&[t], device)?.unsqueeze(0)?;
            let a = on_device.forward(&ids, 12 + k, &mut c1)?;
            let b = on_host.forward(&ids, 12 + k, &mut c2)?;
            assert_close_to_scale(&a, &b, 1e-4, &format!("{name} step {k} on {device:?}"))?;
        }
        // One more step reads the last one's choices back.
        let ids = Tensor::new(&[p[0]], device)?.unsqueeze(0)?;
        on_device.forward(&ids, p.len(), &mut c1)?;
        let after = on_device.runtime().stats()?.total;
        let s = on_device.expert_stats().expect("the tier is on");
        let h = on_host.expert_stats().expect("the tier is on");
        assert_eq!(h.device_routed, 0, "{name}: {h:?}");
        for x in [&s, &h] {
            let (hits, misses) = x.totals();
            assert_eq!(hits, x.resident, "{name}: {x:?}");
            assert_eq!(
                misses,
                x.fetched + x.streamed + x.on_host + x.mapped,
                "{name}: {x:?}"
            );
        }
        if device.is_cuda() {
            assert!(
                s.device_routed > 0 && s.mapped > 0 && s.resident > 0,
                "{name}: {s:?}"
            );
            assert!(
                s.prefetched > 0,
                "{name}: no miss fetched afterwards: {s:?}"
            );
            assert_eq!(
                after.pool_trims - before.pool_trims,
                0,
                "{name}: decode steps routed on the device trimmed the weight pool"
            );
            // From the second decode step on, each is one launch of a captured graph.
            let g = on_device.graph_stats();
            assert!(g.captures >= 1 && g.replays > 0, "{name}: {g:?}");
            assert_eq!(on_host.graph_stats().replays, 0, "{name}: host route");
        } else {
            assert_eq!(s.device_routed, 0, "{name}: {s:?}");
        }
    }
    Ok(())
}

test_device!(
    moe_device_route_equals_the_host_route,
    moe_device_route_equals_the_host_route_cpu,
    moe_device_route_equals_the_host_route_gpu
);

/// A cache in whole layers (`ExpertSlots::Layers`) under a budget for one layer's experts
/// and part of the other's: in the steps the host routes (`ExpertRoute::Host`, and `Auto`'s
/// host steps), the layer with every expert resident is routed on the device (its rows read
/// nothing from host memory) and the other on the host. Each decode step's logits are set
/// against the plain model's (no tier, every expert on the device): their largest difference
/// is at most 4 times the largest of the same steps with the slots spread (no layer whole,
/// every layer routed on the host), plus 1e-4, of the logits' scale. Where the host and the
/// device compute alike (a CPU) that is within about 1e-4; on a GPU the host's experts
/// (activations quantized to Q8_0) differ from the device kernels' by about 1% of the scale
/// at a step (0.9% seen on an H100) in either model, while a wrong or stale expert moves the
/// logits by a good part of their scale.
fn moe_whole_layers_route_on_the_device(device: &Device) -> anyhow::Result<()> {
    use candle_offload::experts::{
        ExpertOptions, ExpertPolicy, ExpertRoute, ExpertSlots, ExpertSplit,
    };
    let dir = fixtures()?;
    for name in ["qwen3_moe", "mixtral"] {
        let files = loader::from_gguf(&dir.join(format!("{name}.q8_0.gguf")))?;
        let options = ExpertOptions::new(ExpertPolicy::Lru, ExpertSplit::On);
        let build = |route, slots| {
            let o = options.with_route(route).with_slots(slots);
            share_of_experts_model(&files, device, true, o, 0.75)
        };
        let spread = build(ExpertRoute::Host, ExpertSlots::Spread)?;
        let spread_warm = spread.warm_up()?;
        let plain = OffloadSettings {
            experts: ExpertOptions::new(ExpertPolicy::Lru, ExpertSplit::Off),
            ..Default::default()
        };
        let plain = gguf_model(&files, device, plain)?;
        assert!(
            plain.expert_stats().is_none(),
            "{name}: the plain model has a tier"
        );
        for route in [ExpertRoute::Host, ExpertRoute::Auto] {
            let layers = build(route, ExpertSlots::Layers)?;
            // The host's copies of a whole layer's experts are never read: not made; its
            // experts are fetched to the device instead, so that it never misses.
            let warm = layers.warm_up()?;
            assert!(warm > 0 && spread_warm > 0, "{name}: {warm} {spread_warm}");
            let models = [&layers, &spread, &plain];
            let mut caches = models.map(|m| m.new_cache());
            let p = prompt();
            let ids = Tensor::new(&p[..12], device)?.unsqueeze(0)?;
            for (m, c) in models.iter().zip(&mut caches) {
                m.forward(&ids, 0, c)?;
            }
            // Each step's largest difference from the plain model against its logits' scale,
            // for the whole layers' model and the spread one, asserted after the last step so
            // that a failure shows them all.
            let (mut whole, mut spread_seen) = (Vec::new(), Vec::new());
            for (k, &t) in p[12..].iter().chain(&p[..12]).enumerate() {
                let ids = Tensor::new(&[t], device)?.unsqueeze(0)?;
                let mut logits = Vec::with_capacity(3);
                for (m, c) in models.iter().zip(&mut caches) {
                    let x = m.forward(&ids, 12 + k, c)?;
                    logits.push(x.flatten_all()?.to_vec1::<f32>()?);
                }
                whole.push(diff_to_scale(&logits[0], &logits[2]));
                spread_seen.push(diff_to_scale(&logits[1], &logits[2]));
            }
            let worst = |v: &[f32]| v.iter().copied().fold(0f32, f32::max);
            assert!(
                worst(&whole) <= 4.0 * worst(&spread_seen) + 1e-4,
                "{name} {route} on {device:?}: each step's max |Δ| / scale from the plain \
                 model, whole layers {whole:?}, spread {spread_seen:?}"
            );
            let [c1, c2, _] = &mut caches;
            // One more step reads the last one's choices back.
            let ids = Tensor::new(&[p[0]], device)?.unsqueeze(0)?;
            layers.forward(&ids, 12 + p.len(), c1)?;
            spread.forward(&ids, 12 + p.len(), c2)?;
            let s = layers.expert_stats().expect("the tier is on");
            let h = spread.expert_stats().expect("the tier is on");
            let n = s.experts_per_layer;
            assert!(
                s.slots.contains(&n) && s.slots.iter().any(|&x| x < n),
                "{name}: slots {:?}",
                s.slots
            );
            assert!(h.slots.iter().all(|&x| x < n), "{name}: {:?}", h.slots);
            assert_eq!(h.device_routed + h.whole_routed, 0, "{name}: {h:?}");
            assert!(h.on_host > 0 && s.on_host > 0, "{name}: {s:?} {h:?}");
            // The whole layer's experts were all fetched with the load: none missed, none
            // computed on the host.
            for (l, &slots) in s.slots.iter().enumerate() {
                if slots >= n {
                    assert_eq!(s.on_host_by_layer[l], 0, "{name} {route} layer {l}: {s:?}");
                    let c = &s.layers[l];
                    assert!(
                        c.misses == 0 && c.hits > 0,
                        "{name} {route} layer {l}: {c:?}"
                    );
                }
            }
            if device.is_cuda() {
                // `auto` may route every step on the device (then no host step routes a
                // whole layer there).
                if route == ExpertRoute::Host {
                    assert!(s.whole_routed > 0, "{name} {route}: {s:?}");
                }
                assert!(s.whole_routed <= s.device_routed, "{name} {route}: {s:?}");
            } else {
                assert_eq!(s.device_routed + s.whole_routed, 0, "{name}: {s:?}");
            }
        }
    }
    Ok(())
}

test_device!(
    moe_whole_layers_route_on_the_device,
    moe_whole_layers_route_on_the_device_cpu,
    moe_whole_layers_route_on_the_device_gpu
);

/// A tier on Q8_0 GGUFs whose experts all fit the device (`ExpertSplit::On`, and `Fetch`,
/// with no limit and with a limit that holds every expert; and the default, `Auto`, which
/// gives one on a GPU unless the route is the host's): the prompt's logits, then each decode
/// step's, are the plain model's (no tier) within 1e-4 of their scale, on the host route and
/// on the device's, with and without the next layer's guesses and with graphs off. Every
/// sparse layer has a slot for each of its experts (the room the runtime keeps for copies in
/// flight is not taken from the cache where no copy can pass it), so that the host CPU
/// computes none: its F32 activations would differ from the GPU kernels' rounded ones. The
/// default's variants are warmed up as `generate` loads them: every expert fetched with the
/// load, none missed by the steps. Every variant runs before the assertion, and the message
/// lists each one's first difference.
fn moe_all_fit_tier_equals_the_plain_model(device: &Device) -> anyhow::Result<()> {
    use candle_offload::experts::{ExpertOptions, ExpertPolicy, ExpertRoute, ExpertSplit};
    let dir = fixtures()?;
    let mut report = Vec::new();
    let mut failed = false;
    for name in ["qwen3_moe", "qwen2_moe"] {
        let files = loader::from_gguf(&dir.join(format!("{name}.q8_0.gguf")))?;
        let plain = OffloadSettings {
            experts: ExpertOptions::new(ExpertPolicy::Lru, ExpertSplit::Off),
            ..Default::default()
        };
        let plain = gguf_model(&files, device, plain)?;
        assert!(plain.expert_stats().is_none(), "{name}: split off, a tier");
        let host_route = OffloadSettings {
            experts: ExpertOptions::default().with_route(ExpertRoute::Host),
            ..Default::default()
        };
        let host_route = gguf_model(&files, device, host_route)?;
        assert!(
            host_route.expert_stats().is_none(),
            "{name}: the host route, a tier"
        );
        drop(host_route);
        // A limit that holds the whole model and its reservation, with room to spare.
        let store = f32_store(&files, device, true)?;
        let fits = store.total_bytes()
            + Llama::reserve_bytes(
                &files.config,
                &store,
                device,
                64,
                64,
                DType::F32,
                &Default::default(),
            )
            + (64 << 20);
        let variants = [
            (
                "on/host",
                ExpertSplit::On,
                ExpertRoute::Host,
                true,
                None,
                true,
            ),
            (
                "on/device",
                ExpertSplit::On,
                ExpertRoute::Device,
                true,
                None,
                true,
            ),
            (
                "on/device/no-guess",
                ExpertSplit::On,
                ExpertRoute::Device,
                false,
                None,
                true,
            ),
            (
                "on/device/no-graphs",
                ExpertSplit::On,
                ExpertRoute::Device,
                true,
                None,
                false,
            ),
            (
                "on/auto",
                ExpertSplit::On,
                ExpertRoute::Auto,
                true,
                None,
                true,
            ),
            (
                "fetch/device",
                ExpertSplit::Fetch,
                ExpertRoute::Device,
                true,
                None,
                true,
            ),
            (
                "fetch/device/limit",
                ExpertSplit::Fetch,
                ExpertRoute::Device,
                true,
                Some(fits),
                true,
            ),
            (
                "on/device/limit",
                ExpertSplit::On,
                ExpertRoute::Device,
                true,
                Some(fits),
                true,
            ),
            (
                "auto/auto",
                ExpertSplit::Auto,
                ExpertRoute::Auto,
                true,
                None,
                true,
            ),
            (
                "auto/device",
                ExpertSplit::Auto,
                ExpertRoute::Device,
                true,
                None,
                true,
            ),
        ];
        for (what, split, route, guess, limit, graphs) in variants {
            let default = split == ExpertSplit::Auto;
            let settings = OffloadSettings {
                experts: ExpertOptions::new(ExpertPolicy::Lru, split)
                    .with_route(route)
                    .with_prefetch(guess),
                gpu_memory_limit: limit.map(MemoryLimit::Bytes),
                ..Default::default()
            };
            let tiered = gguf_model(&files, device, settings)?;
            if default && !device.is_cuda() {
                assert!(
                    tiered.expert_stats().is_none(),
                    "{name} {what}: a tier on a CPU"
                );
                continue;
            }
            if default {
                assert!(
                    tiered.warm_up()? > 0,
                    "{name} {what}: nothing fetched with the load"
                );
            }
            tiered.set_graphs(graphs);
            plain.set_graphs(graphs);
            let (mut c1, mut c2) = (tiered.new_cache(), plain.new_cache());
            let p = prompt();
            let ids = Tensor::new(&p[..12], device)?.unsqueeze(0)?;
            let mut steps = vec![(
                tiered.forward(&ids, 0, &mut c1)?,
                plain.forward(&ids, 0, &mut c2)?,
            )];
            for (k, &t) in p[12..].iter().enumerate() {
                let ids = Tensor::new(&[t], device)?.unsqueeze(0)?;
                steps.push((
                    tiered.forward(&ids, 12 + k, &mut c1)?,
                    plain.forward(&ids, 12 + k, &mut c2)?,
                ));
            }
            let mut first = None;
            for (k, (a, b)) in steps.iter().enumerate() {
                let (a, b) = (
                    a.flatten_all()?.to_vec1::<f32>()?,
                    b.flatten_all()?.to_vec1::<f32>()?,
                );
                let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
                let d = max_abs(&a, &b) / scale;
                if d > 1e-4 && first.is_none() {
                    first = Some((k, d));
                }
            }
            let s = tiered.expert_stats();
            let g = tiered.graph_stats();
            let line = format!(
                "{name} {what}: {} | slots {:?} resident {} fetched {} mapped {} routed on the \
                 device {} | graphs {g:?}",
                match first {
                    None => "equal".to_string(),
                    Some((0, d)) => format!("prompt off by {d:.2e} of the scale"),
                    Some((k, d)) => format!("step {} off by {d:.2e} of the scale", k - 1),
                },
                s.as_ref().map(|s| s.slots.clone()),
                s.as_ref().map_or(0, |s| s.resident),
                s.as_ref().map_or(0, |s| s.fetched),
                s.as_ref().map_or(0, |s| s.mapped),
                s.as_ref().map_or(0, |s| s.device_routed),
            );
            eprintln!("{line}");
            failed |= first.is_some();
            report.push(line);
            let s = s.unwrap_or_else(|| panic!("{name} {what}: the tier asked for is off"));
            let count = files.config.layout().experts.expect("experts").count;
            assert!(
                s.slots.iter().all(|&n| n == 0 || n == count),
                "{name} {what}: slots {:?} of {count}",
                s.slots
            );
            if default {
                assert_eq!(
                    s.totals().1,
                    0,
                    "{name} {what}: misses after the load: {s:?}"
                );
                assert!(s.device_routed > 0, "{name} {what}: {s:?}");
            }
        }
        plain.set_graphs(true);
    }
    assert!(!failed, "on {device:?}:\n{}", report.join("\n"));
    Ok(())
}

test_device!(
    moe_all_fit_tier_equals_the_plain_model,
    moe_all_fit_tier_equals_the_plain_model_cpu,
    moe_all_fit_tier_equals_the_plain_model_gpu
);

/// `--quantize` on a mixture-of-experts checkpoint: each expert's projections quantized to
/// Q8_0 on load (through the cached GGUF beside a copy of the checkpoint), each expert still a
/// unit of its own, the logits near transformers' (relative L2 ≤ 5e-2, as the Q8_0 GGUFs).
#[test]
fn moe_quantize_on_load_keeps_experts_as_units() -> anyhow::Result<()> {
    use candle_core::quantized::GgmlDType;
    use candle_offload_models::quantize::QuantizeOptions;
    let dir = fixtures()?;
    for (name, expert) in [
        ("mixtral", "model.layers.1.block_sparse_moe.experts.2"),
        ("qwen3_moe", "model.layers.0.mlp.experts.3"),
        ("qwen2_moe", "model.layers.1.mlp.experts.0"),
    ] {
        let copy = crate::util::scratch(&format!("moe-quantize-{name}"));
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(dir.join(name).join(f), copy.join(f))?;
        }
        let files = loader::from_dir(&copy)?;
        let opts = QuantizeOptions {
            threads: Some(2),
            ..Default::default()
        };
        let (store, _) = loader::quantized_store(
            &files,
            GgmlDType::Q8_0,
            DType::F32,
            &Device::Cpu,
            None,
            &opts,
        )?;
        let store = Arc::new(store);
        let unit = store
            .unit_id(expert)
            .map(|u| store.unit(u))
            .unwrap_or_else(|| panic!("{name}: no unit {expert}"));
        assert!(
            unit.tensors()
                .iter()
                .all(|t| format!("{}", t.format).contains("Q8_0")),
            "{name}: {expert} is not Q8_0 blocks"
        );
        let rt = OffloadRuntime::new(store.clone(), &Device::Cpu, &OffloadConfig::default())?;
        let m = Llama::builder(files.config.clone(), store)
            .runtime(rt)
            .dtype(DType::F32)
            .max_len(64)
            .source_path(files.weights_path())
            .build()?;
        let r = rel_l2(&logits(&m)?, &reference(&dir.join(name))?);
        assert!(r <= 5e-2, "{name}: Q8_0 on load, rel L2 {r}");
    }
    Ok(())
}

/// A prompt's mixture-of-experts layer holds every row's routed copies (top k a row) through
/// their experts, in F32: the reservation counts at least their inputs, outputs, gates, ups
/// and products, for all-sparse and mixed layouts alike, growing with the rows.
#[test]
fn moe_reservation_counts_the_routed_copies() -> anyhow::Result<()> {
    let dir = fixtures()?;
    for name in ["mixtral", "qwen3_moe_mixed", "qwen2_moe"] {
        let files = loader::from_dir(&dir.join(name))?;
        let cfg = &files.config;
        let field = |k: &str| -> anyhow::Result<u64> {
            cfg.extra
                .get(k)
                .and_then(|v| v.as_u64())
                .ok_or_else(|| anyhow::anyhow!("{name}: no {k}"))
        };
        let top_k = field("num_experts_per_tok")?;
        let expert = match field("moe_intermediate_size") {
            Ok(w) => w,
            Err(_) => field("intermediate_size")?,
        };
        let h = cfg.hidden_size as u64;
        for rows in [64usize, 512] {
            let got = cfg.family.mlp_activation_bytes(cfg, rows, DType::F32);
            let copies = rows as u64 * top_k;
            let least = copies * (2 * h + 3 * expert) * 4;
            assert!(got >= least, "{name} at {rows} rows: {got} < {least}");
        }
        let (a, b) = (
            cfg.reserve_bytes(64, 512, DType::F32),
            cfg.reserve_bytes(512, 512, DType::F32),
        );
        assert!(b > a, "{name}: {a} at 64 rows, {b} at 512");
    }
    Ok(())
}
