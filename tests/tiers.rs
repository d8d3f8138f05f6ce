//! Storage tiers under a host-memory cap: a tiny safetensors model whose last layers stay in
//! the file (the disk tier) gives the same logits, bit for bit, as the model held in memory;
//! caps that cannot work and files that change under the store are clear errors.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_offload::telemetry::ReadAheadStats;
use candle_offload::{
    EngineKind, HostStore, MemoryLimit, OffloadConfig, OffloadRuntime, StoreConfig, TierKind,
};
use candle_offload_models::loader::{self, ModelFiles};
use candle_offload_models::Llama;

use crate::models::{write_tiny, Tiny};
use crate::util::{scratch, Scratch};

fn tiny(tag: &str) -> anyhow::Result<(Scratch, ModelFiles)> {
    let dir = scratch(tag);
    write_tiny(
        &dir,
        Tiny::Llama {
            tied: false,
            bias: false,
        },
    )?;
    let files = loader::from_dir(&dir)?;
    Ok((dir, files))
}

/// Host bytes of each unit of a store (its layout's length).
fn unit_lens(store: &HostStore) -> Vec<u64> {
    store
        .units()
        .iter()
        .map(|u| {
            u.tensors()
                .iter()
                .map(|t| (t.offset + t.nbytes) as u64)
                .max()
                .unwrap_or(0)
        })
        .collect()
}

fn store(
    files: &ModelFiles,
    dtype: DType,
    device: &Device,
    host: Option<u64>,
    pinned: Option<u64>,
) -> anyhow::Result<HostStore> {
    let cfg = StoreConfig {
        dtype: Some(dtype),
        host_memory_limit: host.map(MemoryLimit::Bytes),
        pinned_cap_bytes: pinned,
        ..Default::default()
    };
    Ok(loader::load_store_config(files, &cfg, device, false)?)
}

/// The model over `store` with a weight budget of `budget` bytes (`None`: all resident).
fn model(
    files: &ModelFiles,
    store: HostStore,
    device: &Device,
    dtype: DType,
    budget: Option<u64>,
) -> anyhow::Result<(Llama, OffloadRuntime)> {
    let rt = OffloadRuntime::new(
        Arc::new(store),
        device,
        &OffloadConfig {
            gpu_memory_limit: budget.map(MemoryLimit::Bytes),
            reserve_bytes: 0,
            ..Default::default()
        },
    )?;
    let m = Llama::builder(files, rt.store().clone())
        .runtime(rt.clone())
        .dtype(dtype)
        .max_len(32)
        .build()?;
    Ok((m, rt))
}

fn logits(m: &Llama, device: &Device) -> candle_core::Result<Vec<f32>> {
    let ids = Tensor::new(&[5u32, 17, 42, 3, 99, 64, 8], device)?.unsqueeze(0)?;
    m.forward_all(&ids)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
}

/// A file-backed store (what a CPU run asks for) leaves every unit in the file, holds nothing
/// in host memory, and gives the logits of the store held in memory, in the file's F32 and
/// converted to F16 on every read.
#[test]
fn a_file_backed_store_reads_every_unit_from_its_file() -> anyhow::Result<()> {
    let device = Device::Cpu;
    let (_dir, files) = tiny("file-backed")?;
    for dtype in [DType::F32, DType::F16] {
        let full = store(&files, dtype, &device, None, None)?;
        let names: Vec<String> = full.units().iter().map(|u| u.name().to_string()).collect();
        let (m, _) = model(&files, full, &device, dtype, None)?;
        let want = logits(&m, &device)?;
        drop(m);
        let cfg = StoreConfig {
            dtype: Some(dtype),
            file_backed: true,
            ..Default::default()
        };
        let backed = loader::load_store_config(&files, &cfg, &device, false)?;
        assert_eq!(backed.disk_units(), names, "{dtype:?}");
        assert_eq!(backed.pinned_bytes() + backed.pageable_bytes(), 0);
        let (m, _) = model(&files, backed, &device, dtype, None)?;
        assert_eq!(logits(&m, &device)?, want, "{dtype:?}");
    }
    Ok(())
}

/// With a host cap that leaves the last two of four layers in the file (and, on a GPU, a
/// pinned cap of one unit, so that pinned, pageable and disk units all take part), the logits
/// equal those of the model held in memory, resident and streamed under a tight budget, with
/// the file's F32 kept (F32) and converted on every read (F16).
fn disk_tier_equals_resident(device: &Device) -> anyhow::Result<()> {
    let (_dir, files) = tiny(&format!("eq-{}", device.is_cpu()))?;
    for dtype in [DType::F32, DType::F16] {
        let full = store(&files, dtype, device, None, None)?;
        assert_eq!(full.disk_bytes(), 0, "{dtype:?}");
        let lens = unit_lens(&full);
        let n = lens.len();
        let names: Vec<String> = full.units().iter().map(|u| u.name().to_string()).collect();
        assert_eq!(&names[n - 2..], ["model.layers.2", "model.layers.3"]);
        let cap: u64 = lens[..n - 2].iter().sum();
        let layer = full.units().iter().map(|u| u.bytes()).max().unwrap();
        let (m, _) = model(&files, full, device, dtype, None)?;
        let want = logits(&m, device)?;
        drop(m);

        let capped = store(&files, dtype, device, Some(cap), Some(lens[0]))?;
        assert_eq!(capped.disk_units(), ["model.layers.2", "model.layers.3"]);
        assert_eq!(capped.disk_bytes(), lens[n - 2] + lens[n - 1]);
        assert_eq!(capped.host_limit_bytes(), Some(cap));
        assert!(capped.pinned_bytes() + capped.pageable_bytes() <= cap);
        let tiers: Vec<TierKind> = capped.units().iter().map(|u| u.tier()).collect();
        let mut expect = vec![TierKind::Pageable; n];
        expect[n - 2] = TierKind::Disk;
        expect[n - 1] = TierKind::Disk;
        if !device.is_cpu() {
            expect[0] = TierKind::Pinned;
        }
        assert_eq!(tiers, expect, "{dtype:?}");
        drop(capped);

        for budget in [None, Some(2 * layer)] {
            let capped = store(&files, dtype, device, Some(cap), Some(lens[0]))?;
            let (m, rt) = model(&files, capped, device, dtype, budget)?;
            // Twice: streamed, the disk layers are read again after their eviction.
            for pass in 0..2 {
                let got = logits(&m, device)?;
                assert_eq!(got, want, "{dtype:?}, budget {budget:?}, pass {pass}");
            }
            let stats = rt.stats()?;
            assert_eq!(stats.disk_units, ["model.layers.2", "model.layers.3"]);
            let disk_misses: Vec<u64> = stats.units[n - 2..].iter().map(|u| u.misses).collect();
            let expect = if budget.is_some() { 2 } else { 1 };
            assert_eq!(
                disk_misses,
                [expect, expect],
                "{dtype:?}, budget {budget:?}"
            );
        }
    }
    Ok(())
}
test_device!(
    disk_tier_equals_resident,
    tiers_disk_equals_resident_cpu,
    tiers_disk_equals_resident_gpu
);

/// The managed engine (Unified Memory, pages migrated by prefetch) gives the explicit
/// engine's logits bit for bit, twice, with the model resident, and again after every unit
/// was evicted (migrated back to the host) and fetched again; each unit counts whole 2 MiB
/// granules, and the device memory the driver reports grows by no more than the model. A
/// budget that would make managed units stream is refused, naming the engine (the driver
/// keeps the device memory of pages it migrated back: streaming would pass the budget).
#[cfg(feature = "cuda")]
#[test]
fn tiers_managed_engine_equals_explicit_gpu() -> anyhow::Result<()> {
    let device = Device::new_cuda_with_stream(0)?;
    let (_dir, files) = tiny("managed")?;
    let managed = |dtype| -> anyhow::Result<HostStore> {
        let cfg = StoreConfig {
            dtype: Some(dtype),
            engine: EngineKind::Managed,
            ..Default::default()
        };
        Ok(loader::load_store_config(&files, &cfg, &device, false)?)
    };
    for dtype in [DType::F32, DType::F16] {
        let (m, _) = model(
            &files,
            store(&files, dtype, &device, None, None)?,
            &device,
            dtype,
            None,
        )?;
        let want = logits(&m, &device)?;
        drop(m);
        let s = managed(dtype)?;
        assert!(s.units().iter().all(|u| u.tier() == TierKind::Managed));
        assert!(s
            .units()
            .iter()
            .all(|u| u.bytes() % (2 << 20) == 0 && u.bytes() > 0));
        assert_eq!(s.pinned_bytes(), 0);
        assert!(s.managed_bytes() > 0);
        let layer = s.units().iter().map(|u| u.bytes()).max().unwrap();
        drop(s);
        candle_offload::diag::trim_memory_pool(&device)?;
        let before = candle_offload::diag::device_used_bytes(&device)?;
        let s = managed(dtype)?;
        let total = s.total_bytes();
        let (m, rt) = model(&files, s, &device, dtype, None)?;
        for pass in 0..2 {
            let got = logits(&m, &device)?;
            assert_eq!(got, want, "{dtype:?}, pass {pass}");
        }
        let stats = rt.stats()?;
        assert!(
            stats.summary().contains("Unified Memory"),
            "{}",
            stats.summary()
        );
        assert_eq!(
            stats.misses(),
            stats.units.len() as u64,
            "resident: {stats:?}"
        );
        device.synchronize()?;
        let grew = candle_offload::diag::device_used_bytes(&device)?.saturating_sub(before);
        // The weights' pages, what the forward pass allocates, and the driver's own memory for
        // managed allocations on this GPU (measured: 160 MiB in all for 14 MiB of weights);
        // a managed model that streamed would hold far more (13 GB for the 7B at 4 GiB).
        assert!(
            grew <= total + (256 << 20),
            "device memory grew by {grew} for {total} of weights"
        );
        // Evicted (pages migrated back to the host) and fetched again: the same logits.
        let fetches = |s: &candle_offload::OffloadStats| -> u64 {
            s.units.iter().map(|u| u.misses + u.prefetches).sum()
        };
        rt.evict_all()?;
        assert_eq!(logits(&m, &device)?, want, "{dtype:?}, after evict_all");
        // Each unit fetched once more (on demand or ahead of its use).
        assert_eq!(
            fetches(&rt.stats()?),
            fetches(&stats) + stats.units.len() as u64
        );
        drop((m, rt));
        let e = model(&files, managed(dtype)?, &device, dtype, Some(2 * layer))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("engine") && e.contains("cannot stream"), "{e}");
    }
    Ok(())
}

/// Off a GPU, or in a build without CUDA, the managed engine is an error naming it.
#[test]
fn tiers_managed_engine_off_a_gpu_is_an_error_naming_it() -> anyhow::Result<()> {
    let (_dir, files) = tiny("managed-cpu")?;
    let cfg = StoreConfig {
        engine: EngineKind::Managed,
        ..Default::default()
    };
    let e = loader::load_store_config(&files, &cfg, &Device::Cpu, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("managed") && e.contains("engine"), "{e}");
    assert_eq!("managed".parse::<EngineKind>()?, EngineKind::Managed);
    assert_eq!("Explicit".parse::<EngineKind>()?, EngineKind::Explicit);
    let e = "sideways".parse::<EngineKind>().unwrap_err().to_string();
    assert!(e.contains("engine") && e.contains("sideways"), "{e}");
    Ok(())
}

#[test]
fn tiers_caps_that_cannot_work_are_errors_naming_the_field() -> anyhow::Result<()> {
    let (_dir, files) = tiny("cap")?;
    // Smaller than one unit.
    let e = store(&files, DType::F32, &Device::Cpu, Some(1000), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("host_memory_limit") && e.contains("largest unit"),
        "{e}"
    );
    // Past the cap with no file to stay in (a store built from tensors).
    let tensors = crate::util::mlp_weights(3, 16)?;
    let cfg = StoreConfig {
        host_memory_limit: Some(MemoryLimit::Bytes(2048)),
        ..Default::default()
    };
    let e = HostStore::from_tensors(&tensors, &cfg, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("host_memory_limit") && e.contains("no checkpoint file"),
        "{e}"
    );
    // The same cap with room for all of it is fine.
    let cfg = StoreConfig {
        host_memory_limit: Some(MemoryLimit::Bytes(1 << 20)),
        ..Default::default()
    };
    assert_eq!(
        HostStore::from_tensors(&tensors, &cfg, &Device::Cpu)?.disk_bytes(),
        0
    );
    Ok(())
}

/// A model whose disk layers' file changes under it: `change` alters the file, and the next
/// forward pass must fail naming the file (never panic, never run on other weights).
fn changed_file_fails(tag: &str, change: impl FnOnce(&Path) -> anyhow::Result<()>) -> String {
    let run = || -> anyhow::Result<String> {
        let (dir, files) = tiny(tag)?;
        let full = store(&files, DType::F32, &Device::Cpu, None, None)?;
        let lens = unit_lens(&full);
        let cap: u64 = lens[..lens.len() - 2].iter().sum();
        let capped = store(&files, DType::F32, &Device::Cpu, Some(cap), None)?;
        let (m, _) = model(&files, capped, &Device::Cpu, DType::F32, None)?;
        change(&dir.join("model.safetensors"))?;
        let e = logits(&m, &Device::Cpu)
            .expect_err("a changed file must fail")
            .to_string();
        Ok(e)
    };
    run().unwrap()
}

#[test]
fn tiers_a_file_that_shrank_or_changed_is_an_error_naming_it() {
    let e = changed_file_fails("shrank", |p| {
        let f = std::fs::OpenOptions::new().write(true).open(p)?;
        let len = f.metadata()?.len();
        f.set_len(len / 2)?;
        Ok(())
    });
    assert!(
        e.contains("model.safetensors") && e.contains("changed size") && e.contains("layers.2"),
        "{e}"
    );
    let e = changed_file_fails("changed", |p| {
        use std::io::{Seek, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(p)?;
        let len = f.metadata()?.len();
        f.seek(std::io::SeekFrom::Start(len - 8))?;
        f.write_all(&[0u8; 8])?;
        // A distinct modification time, whatever the file system's clock granularity.
        f.set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000))?;
        Ok(())
    });
    assert!(
        e.contains("model.safetensors") && e.contains("modified") && e.contains("layers.2"),
        "{e}"
    );
}

/// The summary and the doctor report the host side: the cap, what was pinned, what stayed on
/// disk, the machine's RAM and the locked-memory limit.
#[test]
fn tiers_summary_reports_host_memory_and_disk_units() -> anyhow::Result<()> {
    let (_dir, files) = tiny("summary")?;
    let full = store(&files, DType::F32, &Device::Cpu, None, None)?;
    let lens = unit_lens(&full);
    let cap: u64 = lens[..lens.len() - 1].iter().sum();
    let capped = store(&files, DType::F32, &Device::Cpu, Some(cap), None)?;
    let (m, rt) = model(&files, capped, &Device::Cpu, DType::F32, None)?;
    let logits_direct = logits(&m, &Device::Cpu)?;
    let s = rt.memory_summary()?;
    let host = s.lines().find(|l| l.contains("host ")).unwrap_or_default();
    assert!(
        host.contains("pinned")
            && host.contains("on disk")
            && host.contains(&format!("cap {}", candle_offload::human_bytes(cap))),
        "{s}"
    );
    let machine = s
        .lines()
        .find(|l| l.contains("machine"))
        .unwrap_or_default();
    assert!(machine.contains("locked-memory limit"), "{s}");
    if candle_offload::diag::host_memory().is_some() {
        assert!(
            machine.contains("RAM") && machine.contains("available"),
            "{s}"
        );
        let doctor = candle_offload::doctor::examine(0, false, &[]).to_string();
        assert!(doctor.contains("host RAM"), "{doctor}");
    }
    let disk = s
        .lines()
        .find(|l| l.trim_start().starts_with("disk"))
        .unwrap_or_default();
    // O_DIRECT where the temporary directory's file system allows it, the page cache
    // otherwise; the summary says which.
    let direct = !rt.store().disk_direct_units().is_empty();
    let how = if direct {
        "with O_DIRECT"
    } else {
        "through the page cache"
    };
    assert!(
        disk.contains("1 unit") && disk.contains("model.layers.3") && disk.contains(how),
        "{s}"
    );
    // Asked for the page cache, it is used.
    let cfg = StoreConfig {
        dtype: Some(DType::F32),
        host_memory_limit: Some(MemoryLimit::Bytes(cap)),
        disk_page_cache: true,
        ..Default::default()
    };
    let cached = loader::load_store_config(&files, &cfg, &Device::Cpu, false)?;
    assert_eq!(cached.disk_units(), ["model.layers.3"]);
    assert!(cached.disk_direct_units().is_empty());
    let (m, rt2) = model(&files, cached, &Device::Cpu, DType::F32, None)?;
    assert_eq!(logits(&m, &Device::Cpu)?, logits_direct);
    let s2 = rt2.memory_summary()?;
    assert!(s2.contains("through the page cache"), "{s2}");
    let ahead = s
        .lines()
        .find(|l| l.trim_start().starts_with("read-ahead"))
        .unwrap_or_default();
    assert!(
        ahead.contains("2 units ahead") && ahead.contains("disk fetches"),
        "{s}"
    );
    Ok(())
}

/// A GGUF's store on the CPU with the store's dtype and a host cap.
fn gguf_store(
    files: &ModelFiles,
    dtype: DType,
    host: Option<u64>,
    keep_blocks: bool,
) -> anyhow::Result<HostStore> {
    gguf_store_on(files, dtype, &Device::Cpu, host, None, keep_blocks)
}

/// A GGUF's store for `device` with the store's dtype, a host cap and a pinned cap.
fn gguf_store_on(
    files: &ModelFiles,
    dtype: DType,
    device: &Device,
    host: Option<u64>,
    pinned: Option<u64>,
    keep_blocks: bool,
) -> anyhow::Result<HostStore> {
    let cfg = StoreConfig {
        dtype: Some(dtype),
        host_memory_limit: host.map(MemoryLimit::Bytes),
        pinned_cap_bytes: pinned,
        ..Default::default()
    };
    Ok(loader::load_store_config(files, &cfg, device, keep_blocks)?)
}

const GGUF_PROMPT: [u32; 6] = [3, 17, 42, 5, 77, 8];

/// What a GGUF run gives: the prompt's logits, the greedy tokens, the fetches of each layer
/// unit and the read-ahead's counters.
struct GgufRun {
    logits: Vec<f32>,
    tokens: Vec<u32>,
    fetches: Vec<u64>,
    read_ahead: Option<ReadAheadStats>,
}

/// The prompt's logits and 5 greedy tokens after it on `dev`, with room for `layers` layer
/// units in the budget (`None`: everything resident).
fn gguf_run(
    files: &ModelFiles,
    store: HostStore,
    dev: &Device,
    dtype: DType,
    layers: Option<u64>,
) -> anyhow::Result<GgufRun> {
    use candle_offload_models::generation::generate;
    let max_len = GGUF_PROMPT.len() + 5;
    let limit = layers.map(|n| {
        crate::quantized::streaming_budget(
            &files.config,
            &store,
            dev,
            (GGUF_PROMPT.len(), max_len),
            dtype,
            n,
        )
    });
    // Streamed runs stream by strategy, not only by budget: under `minimal` this 2-layer model
    // with room for one fits whole on a GPU when its blocks stay quantized (a resident stage
    // reserves one unit less of the workspace allowance).
    let strategy = if layers.is_some() {
        candle_offload::OffloadStrategy::Aggressive
    } else {
        candle_offload::OffloadStrategy::Minimal
    };
    let settings = candle_offload_models::OffloadSettings {
        gpu_memory_limit: limit.map(MemoryLimit::Bytes),
        strategy,
        ..Default::default()
    };
    let store = Arc::new(store);
    let model = Llama::builder(files, store.clone())
        .device(dev)
        .dtype(dtype)
        .prompt_len(GGUF_PROMPT.len())
        .max_len(max_len)
        .settings(settings.clone())
        .build()?;
    let ids = Tensor::new(&GGUF_PROMPT, dev)?.unsqueeze(0)?;
    let logits = model
        .forward_all(&ids)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let mut sampler = candle_transformers::generation::LogitsProcessor::new(0, None, None);
    let (tokens, _) = generate(&model, &GGUF_PROMPT, 5, &mut sampler, &[], |_| Ok(()))?;
    let stats = model.runtime().stats()?;
    let fetches = (0..files.config.num_hidden_layers)
        .map(|l| {
            let u = &stats.units[store.layer_unit(l).unwrap().0];
            u.misses + u.prefetches
        })
        .collect();
    Ok(GgufRun {
        logits,
        tokens,
        fetches,
        read_ahead: stats.read_ahead,
    })
}

/// A GGUF whose layers stay in the file under a host cap of one unit gives the logits and
/// greedy tokens of the same GGUF held in memory, bit for bit, resident and streamed: dense
/// (F16 and F32 projections, converted on read to the store's dtype or read as they are, q/k
/// rows unpermuted row run by row run), quantized blocks kept as they are (Q8_0, Q4_0), and
/// quantized blocks dequantized on every read (Q4_K without `keep_blocks`). On a GPU the
/// pinned cap is one unit, so pinned, pageable and disk units all take part, and the disk
/// units cross both hops (read ahead, then the staging ring).
fn gguf_disk_equals_resident(dev: &Device) -> anyhow::Result<()> {
    use candle_core::quantized::GgmlDType as G;
    let dir = scratch(&format!("gguf-{}", dev.is_cpu()));
    let cases = [
        (G::F16, false, DType::F32),
        (G::F16, false, DType::F16),
        (G::F32, false, DType::F16),
        (G::Q8_0, true, DType::F32),
        (G::Q4_0, true, DType::F32),
        (G::Q4K, false, DType::F32),
    ];
    for (ty, keep, dtype) in cases {
        let case = format!("{ty:?}, keep blocks {keep}, {dtype:?}");
        let path = dir.join(format!("{ty:?}-{keep}-{dtype:?}.gguf"));
        crate::quantized::write_random_llama_gguf(&path, 7, |_| ty)?;
        let files = loader::from_gguf(&path)?;
        let full = gguf_store_on(&files, dtype, dev, None, None, keep)?;
        assert_eq!(full.disk_bytes(), 0, "{case}");
        let blocks = full.ggml_tensor_count();
        assert_eq!(blocks > 0, keep, "{case}");
        let lens = unit_lens(&full);
        let largest = lens.iter().copied().max().unwrap();
        let want = gguf_run(&files, full, dev, dtype, None)?;
        assert_eq!(want.read_ahead, None, "no disk units, no read-ahead");
        for layers in [None, Some(1)] {
            let capped = gguf_store_on(&files, dtype, dev, Some(largest), Some(lens[0]), keep)?;
            if !dev.is_cpu() {
                assert!(capped.pinned_bytes() > 0 && capped.pageable_bytes() > 0);
            }
            assert_eq!(
                capped.disk_units(),
                ["model.layers.0", "model.layers.1"],
                "{case}"
            );
            assert_eq!(capped.ggml_tensor_count(), blocks, "{case}");
            let got = gguf_run(&files, capped, dev, dtype, layers)?;
            let fetches = &got.fetches;
            // Disk fetches find their bytes read ahead (or wait for them), except those before
            // any read-ahead started: the logits compared below came through it.
            let ahead = got.read_ahead.expect("disk units are read ahead");
            assert_eq!(ahead.disk_fetches, fetches.iter().sum::<u64>(), "{case}");
            assert!(
                ahead.ready + ahead.waited >= 1
                    && ahead.ready + ahead.waited <= ahead.disk_fetches
                    && ahead.issued >= ahead.ready + ahead.waited,
                "{case}: {ahead:?}"
            );
            assert_eq!(got.logits, want.logits, "{case}, {layers:?} layers");
            assert_eq!(got.tokens, want.tokens, "{case}, {layers:?} layers");
            // Streamed, every pass reads the layers from the file again.
            let once = layers.is_none();
            assert!(
                fetches.iter().all(|&f| (f == 1) == once && f >= 1),
                "{case}: fetches {fetches:?}"
            );
        }
    }
    Ok(())
}
test_device!(
    gguf_disk_equals_resident,
    tiers_gguf_disk_equals_resident_cpu,
    tiers_gguf_disk_equals_resident_gpu
);

/// A GGUF's disk layers whose file shrinks or changes under the model: the next forward pass
/// fails naming the file and the unit.
#[test]
fn tiers_a_gguf_that_shrank_or_changed_is_an_error_naming_it() -> anyhow::Result<()> {
    let dir = scratch("gguf-changed");
    for (tag, shrink) in [("shrank", true), ("changed", false)] {
        let path = dir.join(format!("{tag}.gguf"));
        crate::quantized::write_random_llama_gguf(&path, 3, |_| {
            candle_core::quantized::GgmlDType::Q8_0
        })?;
        let files = loader::from_gguf(&path)?;
        let largest = unit_lens(&gguf_store(&files, DType::F32, None, true)?)
            .into_iter()
            .max()
            .unwrap();
        let capped = gguf_store(&files, DType::F32, Some(largest), true)?;
        assert_eq!(capped.disk_units().len(), 2);
        let (m, _) = model(&files, capped, &Device::Cpu, DType::F32, None)?;
        {
            use std::io::{Seek, Write};
            let mut f = std::fs::OpenOptions::new().write(true).open(&path)?;
            let len = f.metadata()?.len();
            if shrink {
                f.set_len(len / 2)?;
            } else {
                f.seek(std::io::SeekFrom::Start(len - 8))?;
                f.write_all(&[0u8; 8])?;
                f.set_modified(
                    std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000),
                )?;
            }
        }
        let e = logits(&m, &Device::Cpu)
            .expect_err("a changed file must fail")
            .to_string();
        let why = if shrink { "changed size" } else { "modified" };
        assert!(
            e.contains(&format!("{tag}.gguf")) && e.contains(why) && e.contains("layers.0"),
            "{e}"
        );
    }
    Ok(())
}

/// Quantize on load under a host cap: the cached GGUF's last layers stay in it (Q8_0 blocks
/// read as they are, the F32 norms converted on every read for an F16 store), with the
/// logits of the same cache held in memory, bit for bit.
#[test]
fn tiers_quantize_on_load_keeps_its_last_layers_in_the_cache_file() -> anyhow::Result<()> {
    use candle_core::quantized::GgmlDType;
    use candle_offload_models::quantize::{self, QuantizeOptions};
    let (dir, files) = tiny("quantize")?;
    let opts = QuantizeOptions {
        threads: Some(2),
        cache_dir: Some(&dir),
        ..Default::default()
    };
    for dtype in [DType::F32, DType::F16] {
        let cfg = |host: Option<u64>| StoreConfig {
            dtype: Some(dtype),
            host_memory_limit: host.map(MemoryLimit::Bytes),
            ..Default::default()
        };
        let (full, _) =
            quantize::load_store_config(&files, GgmlDType::Q8_0, &cfg(None), &Device::Cpu, &opts)?;
        assert!(full.ggml_tensor_count() > 0 && full.disk_bytes() == 0);
        let lens = unit_lens(&full);
        let n = lens.len();
        let cap: u64 = lens[..n - 2].iter().sum();
        let (m, _) = model(&files, full, &Device::Cpu, dtype, None)?;
        let want = logits(&m, &Device::Cpu)?;
        let (capped, cached) = quantize::load_store_config(
            &files,
            GgmlDType::Q8_0,
            &cfg(Some(cap)),
            &Device::Cpu,
            &opts,
        )?;
        assert_eq!(cached.state, quantize::CacheState::Hit);
        assert_eq!(capped.disk_units(), ["model.layers.2", "model.layers.3"]);
        let (m, _) = model(&files, capped, &Device::Cpu, dtype, Some(2 * lens[n - 1]))?;
        for pass in 0..2 {
            assert_eq!(logits(&m, &Device::Cpu)?, want, "{dtype:?}, pass {pass}");
        }
    }
    Ok(())
}
