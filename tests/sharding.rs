//! Layer sharding: a model run as a pipeline over several devices (CPU devices here, GPUs on
//! the GPU machine) gives the same logits and greedy tokens as one device, for planned and
//! hand-written device maps; impossible plans are refused before anything loads.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_offload::placement::{DeviceMap, PlacementMode};
use candle_offload::MemoryLimit;
use candle_offload_models::generation::generate;
use candle_offload_models::llama::{DeviceMapChoice, HiddenTransfer};
use candle_offload_models::loader;
use candle_offload_models::{DeviceMapRequest, Llama, OffloadSettings};
use candle_transformers::generation::LogitsProcessor;

use crate::util::{scratch, Scratch};

const PROMPT: [u32; 7] = [5, 17, 42, 3, 99, 64, 8];

fn outputs(model: &Llama) -> anyhow::Result<(Vec<f32>, Vec<u32>)> {
    let ids = Tensor::new(&PROMPT, model.runtime().device())?.unsqueeze(0)?;
    let logits = model.forward_all(&ids)?.flatten_all()?.to_vec1::<f32>()?;
    let mut sampler = LogitsProcessor::new(0, None, None);
    let (tokens, _) = generate(model, &PROMPT, 10, &mut sampler, &[], |_| Ok(()))?;
    Ok((logits, tokens))
}

/// A fresh temporary directory holding the tiny LLaMA checkpoint (tied embeddings or not).
fn tiny_llama_dir(tag: &str, tied: bool) -> anyhow::Result<Scratch> {
    let dir = scratch(tag);
    crate::models::write_tiny_llama(&dir, tied, false)?;
    Ok(dir)
}

/// Sharded over `devices` (planned sequentially under tight budgets, balanced, and from a
/// saved map) equals the single-device model exactly, with either way of moving hidden states.
pub fn sharded_equals_single_device(devices: &[Device]) -> anyhow::Result<()> {
    for tied in [false, true] {
        let dir = tiny_llama_dir(&format!("shard-{tied}-{}", devices.len()), tied)?;
        let files = loader::from_dir(&dir)?;
        let cfg = files.config.clone();
        let store = Arc::new(loader::load_store(&files, DType::F32, &devices[0], None)?);
        let max_len = PROMPT.len() + 10;
        let settings = OffloadSettings::default();
        let single = Llama::builder(&files, store.clone())
            .device(&devices[0])
            .dtype(DType::F32)
            .prompt_len(PROMPT.len())
            .max_len(max_len)
            .settings(settings.clone())
            .build()?;
        let (want_logits, want_tokens) = outputs(&single)?;
        drop(single);

        let units = Llama::placement_units(&cfg, DType::F32);
        let layer = units.layers[0].1;
        let embed = units.pre[0].1;
        let reserve = cfg.reserve_bytes(PROMPT.len(), max_len, DType::F32);
        // Each device: its reservation, the embeddings (or the head), and about two layers.
        let tight = MemoryLimit::Bytes(reserve + embed + 2 * layer + layer / 2);
        let mut saved: Option<DeviceMap> = None;
        for (what, choice, limit) in [
            (
                "sequential",
                DeviceMapChoice::Mode(PlacementMode::Sequential),
                Some(tight),
            ),
            (
                "balanced",
                DeviceMapChoice::Mode(PlacementMode::Balanced),
                None,
            ),
        ] {
            let map = Llama::plan_devices(
                &cfg,
                &DeviceMapRequest {
                    devices,
                    limits: &[limit],
                    dtype: DType::F32,
                    prompt_len: PROMPT.len(),
                    max_len,
                    choice: &choice,
                    prefetch_depth: 1,
                },
            )?;
            let stages = map.stages().iter().filter(|(_, r)| !r.is_empty()).count();
            assert!(stages >= 2, "{what} tied {tied}: one stage only\n{map}");
            for transfer in [HiddenTransfer::Device, HiddenTransfer::Host] {
                let mut model = Llama::builder(&files, store.clone())
                    .devices(devices)
                    .device_map(DeviceMapChoice::Planned(map.clone()))
                    .dtype(DType::F32)
                    .max_len(max_len)
                    .settings(settings.clone())
                    .build()?;
                model.set_hidden_transfer(transfer);
                let (logits, tokens) = outputs(&model)?;
                let ctx = format!("{what}, {transfer:?}, tied {tied}\n{map}");
                assert_eq!(logits, want_logits, "logits: {ctx}");
                assert_eq!(tokens, want_tokens, "greedy tokens: {ctx}");
                assert!(model.transfer_totals().copies >= stages as u64 - 1, "{ctx}");
                // The last pass was a decode step: every stage gave the prompt's share of its
                // reservation to weights.
                assert!(map.decode_share_bytes > 0, "{ctx}");
                let planned = map.devices.iter().filter(|d| d.layer_count > 0);
                for ((rt, _), d) in model.stages().into_iter().zip(planned) {
                    assert_eq!(
                        rt.budget().reserve_bytes + map.decode_share_bytes,
                        d.reserve_bytes,
                        "{ctx}"
                    );
                }
                for (rt, layers) in model.stages() {
                    let st = rt.stats()?;
                    assert!(st.peak_resident_bytes <= st.weight_capacity_bytes, "{ctx}");
                    // A stage only ever fetches its own layers.
                    for u in st.units.iter().filter(|u| u.misses > 0) {
                        if let Some(l) = u.name.strip_prefix("model.layers.") {
                            let l: usize = l.parse()?;
                            assert!(layers.contains(&l), "{ctx}: {} on stage {layers:?}", u.name);
                        }
                    }
                }
            }
            saved = Some(map);
        }
        // A map written to JSON and read back (as --device-map plan.json does) plans the same.
        let map = saved.expect("planned");
        let text = map.to_json()?;
        let back = DeviceMap::from_json(&text, "plan.json")?;
        let replanned = Llama::plan_devices(
            &cfg,
            &DeviceMapRequest {
                devices,
                limits: &[None],
                dtype: DType::F32,
                prompt_len: PROMPT.len(),
                max_len,
                choice: &DeviceMapChoice::Map(back),
                prefetch_depth: 1,
            },
        )?;
        assert_eq!(replanned.stages(), map.stages());
    }
    Ok(())
}

#[test]
fn sharded_equals_single_device_cpu() -> anyhow::Result<()> {
    sharded_equals_single_device(&[Device::Cpu, Device::Cpu, Device::Cpu])
}

/// Every pair of GPUs of the machine (skipped, saying so, with fewer than two).
#[cfg(feature = "cuda")]
#[test]
fn sharded_equals_single_device_gpus() -> anyhow::Result<()> {
    let n = candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()? as usize;
    if n < 2 {
        eprintln!("sharded_equals_single_device_gpus: skipped, {n} GPU(s)");
        return Ok(());
    }
    let devices = [
        Device::new_cuda_with_stream(0)?,
        Device::new_cuda_with_stream(1)?,
    ];
    for peer in [true, false] {
        let access = candle_offload::diag::set_peer_access(&devices, peer)?;
        eprintln!("peer access {peer}: {access:?}");
        sharded_equals_single_device(&devices)?;
    }
    Ok(())
}

/// Budgets too small for any placement are refused before loading, with the MiB missing.
#[test]
fn impossible_plans_are_refused() -> anyhow::Result<()> {
    let dir = tiny_llama_dir("shard-refuse", false)?;
    let files = loader::from_dir(&dir)?;
    let devices = [Device::Cpu, Device::Cpu];
    for mode in [PlacementMode::Sequential, PlacementMode::Balanced] {
        let e = Llama::plan_devices(
            &files.config,
            &DeviceMapRequest {
                devices: &devices,
                limits: &[Some(MemoryLimit::Bytes(1 << 20))],
                dtype: DType::F32,
                prompt_len: 7,
                max_len: 20,
                choice: &DeviceMapChoice::Mode(mode),
                prefetch_depth: 1,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("MiB"), "{mode}: {e}");
    }
    let e = Llama::plan_devices(
        &files.config,
        &DeviceMapRequest {
            devices: &devices,
            limits: &[None, None, None],
            dtype: DType::F32,
            prompt_len: 7,
            max_len: 20,
            choice: &DeviceMapChoice::Mode(PlacementMode::Balanced),
            prefetch_depth: 1,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("3 limits for 2 devices"), "{e}");
    Ok(())
}

/// Host layers (llama.cpp's split): the first layers and the embeddings on the CPU, the rest
/// and the head on `device`. On the CPU a split at two layers is the same model bit for bit;
/// on a GPU `auto` under a budget that holds about two layers beside the head puts the others
/// on the host, streams nothing, and agrees with the GPU-only model; no host layers under that
/// budget keeps an untied embedding table on the host and agrees too.
fn host_layers_equal_device_only(device: &Device) -> anyhow::Result<()> {
    use candle_offload_models::HostLayers;
    for tied in [false, true] {
        let dir = tiny_llama_dir(&format!("host-layers-{tied}-{}", device.is_cuda()), tied)?;
        let files = loader::from_dir(&dir)?;
        let cfg = files.config.clone();
        let n = cfg.num_hidden_layers;
        let store = Arc::new(loader::load_store(&files, DType::F32, device, None)?);
        let max_len = 24;
        let build = |settings: &OffloadSettings, host| {
            Llama::builder(&files, store.clone())
                .device(device)
                .dtype(DType::F32)
                .prompt_len(PROMPT.len())
                .max_len(max_len)
                .settings(settings.clone())
                .host_layers(host)
                .build()
        };
        // A prompt longer than a decode step runs the host layers on the device, then decode
        // steps on the host (their KV caches move between them).
        let long: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 100).collect();
        let long_tokens = |model: &Llama| -> anyhow::Result<Vec<u32>> {
            let mut sampler = LogitsProcessor::new(0, None, None);
            Ok(generate(model, &long, 8, &mut sampler, &[], |_| Ok(()))?.0)
        };
        let settings = OffloadSettings::default();
        let single = build(&settings, HostLayers::None)?;
        assert_eq!(single.host_layer_count(), 0);
        let (want_logits, want_tokens) = outputs(&single)?;
        let want_long = long_tokens(&single)?;
        drop(single);
        // The largest difference from the device-only logits, and their largest magnitude.
        let max_err = |logits: &[f32]| -> (f32, f32) {
            let err = logits
                .iter()
                .zip(&want_logits)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            (
                err,
                want_logits.iter().map(|v| v.abs()).fold(0f32, f32::max),
            )
        };
        let e = build(&settings, HostLayers::Count(n + 1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("host_layers") && e.contains(&format!("{n} layers")),
            "{e}"
        );

        // A budget that holds about two layers beside the head (and the reservation).
        let units = Llama::placement_units(&cfg, DType::F32);
        let layer = units.layers[0].1;
        let head = units.post.iter().map(|u| u.1).sum::<u64>();
        let reserve = Llama::reserve_bytes(
            &cfg,
            &store,
            device,
            PROMPT.len(),
            max_len,
            DType::F32,
            &Default::default(),
        );
        let limited = OffloadSettings {
            gpu_memory_limit: Some(MemoryLimit::Bytes(reserve + head + 2 * layer + layer / 2)),
            ..Default::default()
        };
        // The device's step that `spread:auto` weighs: one layer, timed there.
        let s = Llama::layer_step_seconds(
            &cfg,
            &store,
            DType::F32,
            device,
            PROMPT.len(),
            &Default::default(),
        )?;
        assert!(s > 0.0 && s < 1.0, "{s} s on {device:?}");
        let mut cases = Vec::new();
        if device.is_cpu() {
            assert_eq!(build(&settings, HostLayers::Auto)?.host_layer_count(), 0);
            let auto = build(&settings, HostLayers::SpreadAuto)?;
            assert_eq!(auto.host_layer_count(), 0);
            // A CPU device runs every layer itself: `spread:auto` times nothing.
            assert_eq!(auto.spread_auto_layer_steps(), None);
            drop(auto);
            // The host's rate that `spread:auto` weighs: one layer's step, timed.
            let s = Llama::host_layer_seconds(
                &cfg,
                &store,
                DType::F32,
                PROMPT.len(),
                &Default::default(),
            )?;
            assert!(s > 0.0 && s < 1.0, "{s} s");
            cases.push((build(&settings, HostLayers::Count(2))?, "count 2", false));
            // Spread: host and device layers alternate, the hidden state crossing each time.
            cases.push((build(&settings, HostLayers::Spread(2))?, "spread 2", false));
            // The head on the host too (a head of its own only: a tied one is refused).
            if tied {
                let e = build(&settings, HostLayers::SpreadWithHead(2))
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("host_layers") && e.contains("tied"), "{e}");
            } else {
                let m = build(&settings, HostLayers::SpreadWithHead(2))?;
                cases.push((m, "spread 2+head", false));
            }
            // What `auto` builds on a GPU: the minimal strategy under the budget.
            let minimal = OffloadSettings {
                strategy: candle_offload::OffloadStrategy::Minimal,
                ..limited.clone()
            };
            let split = build(&minimal, HostLayers::Count(n - 2))?;
            cases.push((split, "count n-2 under a budget", true));
            let split = build(&minimal, HostLayers::Spread(n - 2))?;
            cases.push((split, "spread n-2 under a budget", true));
        } else {
            // Under a budget that streams, `spread:auto` times a layer on each side.
            let auto = build(&limited, HostLayers::SpreadAuto)?;
            let steps = auto
                .spread_auto_layer_steps()
                .expect("timed under a budget");
            assert!(steps.host_s > 0.0 && steps.device_s > 0.0, "{steps:?}");
            drop(auto);
            cases.push((build(&limited, HostLayers::Auto)?, "auto", true));
            // Two layers on the host, spread; the device streams what its budget does not hold.
            cases.push((build(&limited, HostLayers::Spread(2))?, "spread 2", false));
            if !tied {
                let m = build(&limited, HostLayers::SpreadWithHead(2))?;
                cases.push((m, "spread 2+head", false));
            }
            // No host layer under a budget the model does not fit whole: the device streams
            // its layers, and an embedding table of its own stays on the host (tied, it is the
            // head, which the device keeps).
            let none = build(&limited, HostLayers::None)?;
            assert_eq!(none.host_layer_count(), 0);
            let stages = none.stages();
            if tied {
                assert_eq!(stages.len(), 1, "tied");
            } else {
                assert_eq!(stages.len(), 2, "untied");
                assert!(stages[0].0.device().is_cpu());
                assert!(stages[0].1.is_empty(), "{:?}", stages[0].1);
                assert!(stages[1].0.device().is_cuda());
                assert_eq!(stages[1].1, 0..n);
            }
            let (logits, tokens) = outputs(&none)?;
            let (err, scale) = max_err(&logits);
            assert!(err <= 1e-4 * scale.max(1.0), "none, tied {tied}: {err}");
            assert_eq!(tokens, want_tokens, "none, tied {tied}");
            assert_eq!(long_tokens(&none)?, want_long, "none, tied {tied}, long");
            drop(none);
        }
        for (model, ctx, budgeted) in cases {
            let host = model.host_layer_count();
            assert!(
                host > 0 && host < n,
                "{ctx}, tied {tied}: {host} host layers of {n}"
            );
            let stages = model.stages();
            assert_eq!(stages.len(), 2);
            let set = if ctx.starts_with("spread") {
                HostLayers::Spread(host).host_set(host, n)
            } else {
                HostLayers::Count(host).host_set(host, n)
            };
            assert_eq!(set.iter().filter(|&&b| b).count(), host);
            let first = set.iter().position(|&b| b).unwrap_or(0);
            let end = set.iter().rposition(|&b| b).map_or(0, |l| l + 1);
            assert_eq!(stages[0].1, first..end, "{ctx}");
            if ctx.starts_with("spread") {
                assert!(
                    !set[0],
                    "{ctx}: the first layer of a spread split is on the device"
                );
            }
            assert!(stages[0].0.device().is_cpu());
            assert_eq!(model.head_on_host(), ctx.ends_with("+head"), "{ctx}");
            // The GPU stage runs the fused ops by default, the host stage Candle's.
            let gpu_fused = (!device.is_cpu()).then_some(true);
            assert_eq!(model.fused_on_gpus(), gpu_fused, "{ctx}");
            let (logits, tokens) = outputs(&model)?;
            if device.is_cpu() {
                assert_eq!(logits, want_logits, "{ctx}, tied {tied}");
            } else {
                let (err, scale) = max_err(&logits);
                assert!(
                    err <= 1e-4 * scale.max(1.0),
                    "{ctx}, tied {tied}: {err} of {scale}"
                );
            }
            if budgeted {
                // The device stage holds its layers: each was fetched once and never evicted
                // (the host layers it also serves, for prompts, are not in its schedule and
                // need no room held back for streaming).
                let st = stages[1].0.stats()?;
                for u in st
                    .units
                    .iter()
                    .filter(|u| u.name.starts_with("model.layers."))
                {
                    assert!(
                        u.misses <= 1 && u.evictions == 0,
                        "{ctx}, tied {tied}: {u:?}"
                    );
                }
            }
            assert_eq!(tokens, want_tokens, "{ctx}, tied {tied}");
            assert_eq!(
                long_tokens(&model)?,
                want_long,
                "{ctx}, tied {tied}, long prompt"
            );
            // The host's runs were timed: every decode step ran the host layers (and the
            // head, where it is on the host) there.
            let t = model.host_totals();
            assert!(
                t.layer_steps >= host as u64 && t.layer_seconds > 0.0,
                "{ctx}, tied {tied}: {t:?}"
            );
            assert_eq!(t.head_steps > 0, model.head_on_host(), "{ctx}: {t:?}");
            let mean = t.layer_step_s().expect("host layer steps");
            assert!(mean > 0.0 && mean < 1.0, "{ctx}: {t:?}");
        }
    }
    Ok(())
}

test_device!(
    host_layers_equal_device_only,
    host_layers_equal_device_only_cpu,
    host_layers_equal_device_only_gpu
);

/// A near fit: every unit but the (untied) embedding table fits beside the decode step's
/// reservation, so on a GPU the table stays on the host, a host stage of no layers, and the
/// GPU's stage captures its decode step as a CUDA graph from the looked-up rows (copied where
/// the graph reads them before each launch). The greedy tokens equal the eager model's over
/// 32 steps and two generations; nearly every decode step is replayed. On the CPU the model is
/// one stage and the tokens agree as well.
fn near_fit_replays_from_the_looked_up_rows(device: &Device) -> anyhow::Result<()> {
    use candle_offload_models::HostLayers;
    let dir = tiny_llama_dir(&format!("near-fit-graph-{}", device.is_cuda()), false)?;
    let files = loader::from_dir(&dir)?;
    let cfg = files.config.clone();
    let store = Arc::new(loader::load_store(&files, DType::F32, device, None)?);
    let new = 32;
    let max_len = PROMPT.len() + new;
    let embed = store
        .unit(
            store
                .unit_id("model.embed_tokens")
                .expect("an embedding unit"),
        )
        .bytes();
    let all = store.total_bytes();
    let decode = Llama::reserve_bytes(
        &cfg,
        &store,
        device,
        1,
        max_len,
        DType::F32,
        &Default::default(),
    );
    let build = |limit: Option<u64>, host: HostLayers| {
        let settings = OffloadSettings {
            gpu_memory_limit: limit.map(MemoryLimit::Bytes),
            ..Default::default()
        };
        Llama::builder(&files, store.clone())
            .device(device)
            .dtype(DType::F32)
            .prompt_len(PROMPT.len())
            .max_len(max_len)
            .settings(settings.clone())
            .host_layers(host)
            .build()
    };
    let tokens = |m: &Llama| -> anyhow::Result<Vec<u32>> {
        let mut sampler = LogitsProcessor::new(0, None, None);
        Ok(generate(m, &PROMPT, new, &mut sampler, &[], |_| Ok(()))?.0)
    };
    let eager = build(None, HostLayers::SpreadAuto)?;
    eager.set_graphs(false);
    let want = tokens(&eager)?;
    let near = build(Some(decode + all - embed / 2), HostLayers::SpreadAuto)?;
    assert_eq!(near.host_layer_count(), 0);
    // Host layers (in front, spread, spread with the head): each run of GPU layers replays
    // a graph of its own between the host's runs.
    for host in [
        HostLayers::Count(2),
        HostLayers::Spread(2),
        HostLayers::SpreadWithHead(2),
    ] {
        let m = build(None, host)?;
        assert_eq!(tokens(&m)?, want, "{host:?}");
        let stats = m.graph_stats();
        if device.is_cuda() {
            assert_eq!(stats.captures, 1, "{host:?}: {stats:?}");
            assert_eq!(stats.replays, new as u64 - 2, "{host:?}: {stats:?}");
        }
    }
    assert_eq!(tokens(&near)?, want, "first generation");
    assert_eq!(tokens(&near)?, want, "second generation");
    let stats = near.graph_stats();
    if device.is_cuda() {
        let stages = near.stages();
        assert_eq!(stages.len(), 2, "the table on the host");
        assert!(stages[0].0.device().is_cpu() && stages[0].1.is_empty());
        assert!(stats.captures >= 1, "{stats:?}");
        let steps = 2 * (new as u64 - 1);
        assert_eq!(
            stats.captures + stats.replays + stats.eager_steps,
            steps,
            "{stats:?}"
        );
        assert!(stats.replays + 6 >= steps, "{stats:?}");
    } else {
        assert_eq!(near.stages().len(), 1);
        assert_eq!(
            (stats.captures, stats.replays, stats.eager_steps),
            (0, 0, 0)
        );
    }
    Ok(())
}

test_device!(
    near_fit_replays_from_the_looked_up_rows,
    near_fit_replays_from_the_looked_up_rows_cpu,
    near_fit_replays_from_the_looked_up_rows_gpu
);
