//! Runs `TinyLm` three ways and compares the logits of every decode step bit for bit: as the
//! application wrote it (resident, plain candle-nn), offloaded through the glue under a budget
//! that holds two of its layers, and as a pipeline over two devices. Shared by the example and
//! the integration test.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_offload::{HostStore, MemoryLimit, PlacementMode, StoreConfig};
use candle_offload_models::{CausalLm, DeviceMapChoice, KvCache, OffloadSettings};

use super::glue;
use super::model::{TinyConfig, TinyLm};

/// What [`run`] saw.
#[derive(Debug)]
pub struct Comparison {
    /// Tokens decoded (greedy), after the prompt.
    pub tokens: Vec<u32>,
    /// Steps where the offloaded logits equalled the resident ones bit for bit.
    pub offloaded_equal: usize,
    /// Steps where the two-device logits equalled the resident ones bit for bit (`None`:
    /// no second device).
    pub sharded_equal: Option<usize>,
    /// Steps compared (prefill + decode).
    pub steps: usize,
    /// Layer fetches of the offloaded run (more than the layer count: it streamed).
    pub layer_fetches: u64,
    /// The offloaded run's budget and the peak bytes of weights it held.
    pub budget_bytes: u64,
    pub peak_resident_bytes: u64,
    /// The two-device run's stages: (device, first layer, layer count, streams).
    pub device_map: Vec<(usize, usize, usize, bool)>,
}

/// Random weights as a checkpoint holds them (norm weights 1, biases and matrices small).
pub fn weights(c: &TinyConfig, dev: &Device) -> candle_core::Result<Vec<(String, Tensor)>> {
    c.tensors()
        .into_iter()
        .map(|(name, shape)| {
            let t = if name.contains("norm") && name.ends_with(".weight") {
                Tensor::ones(shape, DType::F32, dev)?
            } else {
                Tensor::randn(0f32, 0.08, shape, dev)?
            };
            Ok((name, t))
        })
        .collect()
}

/// Greedy-decodes `steps` tokens after `prompt` with all three and compares; the pipeline runs
/// over `dev` and `second` (two CPU "devices" may be the same CPU; two GPUs must differ) and
/// is skipped without a second device.
pub fn run(
    c: &TinyConfig,
    dev: &Device,
    second: Option<&Device>,
    prompt: &[u32],
    steps: usize,
) -> anyhow::Result<Comparison> {
    let tensors = weights(c, dev)?;
    let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
    let resident = TinyLm::load(candle_nn::VarBuilder::from_tensors(map, DType::F32, dev), c)?;

    // The glue: the runtime's config, a store grouped by the family's layout, the model.
    let cfg = glue::config(c);
    let grouping = cfg.layout().grouping();
    let store_cfg = StoreConfig {
        grouping,
        ..Default::default()
    };
    let store = Arc::new(HostStore::from_tensors(&tensors, &store_cfg, dev)?);
    let layer = store
        .unit(store.unit_id("layers.0").expect("layer unit"))
        .bytes();
    let kept: u64 = ["tok_embeddings", "norm", "output"]
        .iter()
        .filter_map(|u| store.unit_id(u))
        .map(|u| store.unit(u).bytes())
        .sum();
    let budget = cfg.reserve_bytes(prompt.len(), c.max_len, DType::F32) + kept + 2 * layer;
    let settings = OffloadSettings {
        gpu_memory_limit: Some(MemoryLimit::Bytes(budget)),
        ..Default::default()
    };
    let (n, max) = (prompt.len(), c.max_len);
    // The model over the store, named `<tinylm>` in errors about its weights.
    let builder = || {
        CausalLm::builder(&cfg, store.clone())
            .source_path("<tinylm>")
            .settings(settings.clone())
            .dtype(DType::F32)
            .prompt_len(n)
            .max_len(max)
    };
    // The comparison is bit for bit, so the head runs Candle's matmul as the application's
    // model does: on a GPU the runtime's fused one-row kernel (on by default there) rounds
    // differently, within the tolerance its own tests check.
    let mut offloaded = builder().device(dev).build()?;
    offloaded.set_fused(false);
    let sharded = match second {
        Some(second) => {
            let mut model = builder()
                .devices(&[dev.clone(), second.clone()])
                .device_map(DeviceMapChoice::Mode(PlacementMode::Balanced))
                .build()?;
            model.set_fused(false);
            Some(model)
        }
        None => None,
    };

    let mut kvs: Vec<KvCache> = (0..c.layers).map(|_| KvCache::new(c.max_len)).collect();
    let mut cache_o = offloaded.new_cache();
    let mut cache_s = sharded.as_ref().map(|s| s.new_cache());
    let (mut input, mut pos) = (prompt.to_vec(), 0);
    let mut out = Comparison {
        tokens: Vec::new(),
        offloaded_equal: 0,
        sharded_equal: sharded.is_some().then_some(0),
        steps: 0,
        layer_fetches: 0,
        budget_bytes: budget,
        peak_resident_bytes: 0,
        device_map: sharded
            .iter()
            .filter_map(|m| m.device_map())
            .flat_map(|p| &p.devices)
            .map(|d| (d.ordinal, d.first_layer, d.layer_count, d.streams))
            .collect(),
    };
    for _ in 0..=steps {
        let ids = Tensor::new(input.as_slice(), dev)?.unsqueeze(0)?;
        let want = resident
            .forward(&ids, pos, &mut kvs)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let got_o = offloaded
            .forward(&ids, pos, &mut cache_o)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        out.offloaded_equal += usize::from(got_o == want);
        if let (Some(model), Some(cache), Some(equal)) =
            (&sharded, cache_s.as_mut(), out.sharded_equal.as_mut())
        {
            let got = model
                .forward(&ids, pos, cache)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            *equal += usize::from(got == want);
        }
        out.steps += 1;
        let next = (0..want.len())
            .max_by(|&a, &b| want[a].total_cmp(&want[b]))
            .unwrap_or(0) as u32;
        out.tokens.push(next);
        pos += input.len();
        input = vec![next];
    }
    out.tokens.pop();
    let stats = offloaded.runtime().stats()?;
    out.layer_fetches = stats
        .units
        .iter()
        .filter(|u| u.name.starts_with("layers."))
        .map(|u| u.misses + u.prefetches)
        .sum();
    out.peak_resident_bytes = stats.peak_resident_bytes;
    Ok(out)
}
