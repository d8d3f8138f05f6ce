//! The offload runtime end to end: offloaded runs equal resident runs under every budget,
//! strategy and policy; the budget holds; evicted units come back bit-identical.

use candle_core::{DType, Device, Module, Tensor};
use candle_offload::{
    ActivePolicy, MemoryLimit, OffloadConfig, OffloadRuntime, OffloadStrategy, PolicyChoice,
    RuntimeError, UnitId,
};

use crate::util::{mlp_store, mlp_weights, run_mlp};

const LAYERS: usize = 6;
const WIDTH: usize = 32;

fn reference(device: &Device) -> anyhow::Result<Vec<f32>> {
    let weights = mlp_weights(LAYERS, WIDTH)?;
    let get = |name: &str| {
        weights
            .iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
            .to_device(device)
    };
    let out = run_mlp(LAYERS, WIDTH, device, |i, xs| {
        let lin = candle_nn::Linear::new(
            get(&format!("layers.{i}.weight"))?,
            Some(get(&format!("layers.{i}.bias"))?),
        );
        lin.forward(xs)
    })?;
    Ok(out.flatten_all()?.to_vec1()?)
}

fn offloaded(rt: &OffloadRuntime, steps: usize) -> anyhow::Result<Vec<f32>> {
    let mut last = Vec::new();
    for _ in 0..steps {
        rt.begin_step()?;
        let out = run_mlp(LAYERS, WIDTH, rt.device(), |i, xs| {
            let unit = rt.acquire_layer(i)?;
            let lin = candle_nn::linear(
                WIDTH,
                WIDTH,
                unit.var_builder(DType::F32).pp(format!("layers.{i}")),
            )?;
            lin.forward(xs)
        })?;
        last = out.flatten_all()?.to_vec1()?;
        rt.end_step()?;
    }
    Ok(last)
}

fn offloaded_equals_resident(device: &Device) -> anyhow::Result<()> {
    let expected = reference(device)?;
    let store = mlp_store(LAYERS, WIDTH, device, None)?;
    let layer = store.unit(store.layer_unit(0).unwrap()).bytes();
    for budget_layers in [1u64, 2, 3, 5, 7, 100] {
        for strategy in [
            OffloadStrategy::Minimal,
            OffloadStrategy::Balanced,
            OffloadStrategy::Aggressive,
        ] {
            for policy in [PolicyChoice::Auto, PolicyChoice::Lru] {
                for depth in [0, 1, 3] {
                    let cfg = OffloadConfig {
                        gpu_memory_limit: Some(MemoryLimit::Bytes(budget_layers * layer)),
                        strategy,
                        policy: policy.clone(),
                        prefetch_depth: depth,
                        ..Default::default()
                    };
                    let rt = OffloadRuntime::new(store.clone(), device, &cfg)?;
                    let got = offloaded(&rt, 4)?;
                    assert_eq!(
                        got, expected,
                        "budget {budget_layers} layers, {strategy}, {policy:?}, depth {depth}"
                    );
                    let stats = rt.stats()?;
                    assert!(
                        stats.peak_resident_bytes <= budget_layers * layer,
                        "over budget: {stats:?}"
                    );
                    assert!(stats.resident_bytes <= stats.weight_capacity_bytes);
                }
            }
        }
    }
    Ok(())
}
test_device!(
    offloaded_equals_resident,
    offloaded_equals_resident_cpu,
    offloaded_equals_resident_gpu
);

fn schedule_is_learned_and_beats_lru(device: &Device) -> anyhow::Result<()> {
    let store = mlp_store(LAYERS, WIDTH, device, None)?;
    let layer = store.unit(store.layer_unit(0).unwrap()).bytes();
    let run = |policy: PolicyChoice| -> anyhow::Result<candle_offload::OffloadStats> {
        let cfg = OffloadConfig {
            gpu_memory_limit: Some(MemoryLimit::Bytes(4 * layer)),
            policy,
            prefetch_depth: 0,
            ..Default::default()
        };
        let rt = OffloadRuntime::new(store.clone(), device, &cfg)?;
        offloaded(&rt, 10)?;
        Ok(rt.stats()?)
    };
    let lru = run(PolicyChoice::Lru)?;
    let auto = run(PolicyChoice::Auto)?;
    assert_eq!(
        lru.misses(),
        60,
        "LRU misses every access of a cyclic sweep"
    );
    assert_eq!(auto.policy, ActivePolicy::Schedule { period: LAYERS });
    assert!(
        auto.misses() < 40,
        "schedule policy misses {}",
        auto.misses()
    );
    // Belady on a sweep of 6 with room for 4 rotates the resident set: 2 or 3 fetches a
    // sweep (2.4 on average), where a fixed resident set would need 3 and LRU 6.
    let last = auto.last_step.unwrap().fetches;
    assert!((2..=3).contains(&last), "{last} fetches in the last sweep");
    Ok(())
}
test_device!(
    schedule_is_learned_and_beats_lru,
    schedule_is_learned_cpu,
    schedule_is_learned_gpu
);

fn evicted_units_come_back_bit_identical(device: &Device) -> anyhow::Result<()> {
    let store = mlp_store(LAYERS, WIDTH, device, Some(DType::F16))?;
    let layer = store.unit(UnitId(1)).bytes();
    let cfg = OffloadConfig {
        gpu_memory_limit: Some(MemoryLimit::Bytes(2 * layer)),
        policy: PolicyChoice::Lru,
        prefetch_depth: 0,
        ..Default::default()
    };
    let rt = OffloadRuntime::new(store.clone(), device, &cfg)?;
    let read = |i: usize| -> anyhow::Result<Vec<u8>> {
        let unit = rt.acquire_layer(i)?;
        let t = unit
            .get(&format!("layers.{i}.weight"))?
            .to_device(&Device::Cpu)?;
        Ok(t.flatten_all()?
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect())
    };
    for round in 0..3 {
        for i in 0..LAYERS {
            let (u, meta) = store.tensor(&format!("layers.{i}.weight")).unwrap();
            assert_eq!(
                &read(i)?[..],
                &*store.unit(u).tensor_bytes(meta),
                "round {round}, layer {i}"
            );
        }
    }
    let stats = rt.stats()?;
    assert!(stats.units.iter().map(|u| u.evictions).sum::<u64>() >= 2 * LAYERS as u64);
    Ok(())
}
test_device!(
    evicted_units_come_back_bit_identical,
    bit_identical_cpu,
    bit_identical_gpu
);

#[test]
fn budget_too_small_is_refused_with_the_missing_mib() -> anyhow::Result<()> {
    let store = mlp_store(2, 512, &Device::Cpu, None)?; // 1 MiB + 2 KiB per layer
    let cfg = OffloadConfig {
        gpu_memory_limit: Some(MemoryLimit::Bytes(1 << 20)),
        ..Default::default()
    };
    let err = OffloadRuntime::new(store.clone(), &Device::Cpu, &cfg).unwrap_err();
    assert!(
        matches!(
            err,
            candle_offload::Error::BudgetTooSmall { missing_mib: 1, .. }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("MiB are missing"), "{err}");

    let cfg = OffloadConfig {
        gpu_memory_limit: Some(MemoryLimit::Bytes(8 << 20)),
        reserve_bytes: 7 << 20,
        ..Default::default()
    };
    let err = OffloadRuntime::new(store.clone(), &Device::Cpu, &cfg).unwrap_err();
    assert!(err.to_string().contains("reservation (7 MiB)"), "{err}");

    let cfg = OffloadConfig {
        prefetch_depth: 4,
        ..Default::default()
    };
    assert!(OffloadRuntime::new(store, &Device::Cpu, &cfg)
        .unwrap_err()
        .to_string()
        .contains("prefetch_depth"));
    Ok(())
}

#[test]
fn in_use_units_are_never_evicted_and_no_room_is_an_error() -> anyhow::Result<()> {
    let store = mlp_store(3, 32, &Device::Cpu, None)?;
    let layer = store.unit(UnitId(1)).bytes();
    let cfg = OffloadConfig {
        gpu_memory_limit: Some(MemoryLimit::Bytes(2 * layer)),
        prefetch_depth: 0,
        ..Default::default()
    };
    let rt = OffloadRuntime::new(store, &Device::Cpu, &cfg)?;
    let a = rt.acquire_layer(0)?;
    let b = rt.acquire_layer(1)?;
    let e = rt.acquire_layer(2).unwrap_err();
    assert!(
        matches!(
            RuntimeError::from_candle(&e),
            Some(RuntimeError::BudgetExhausted { unit, .. }) if unit == "layers.2"
        ),
        "{e:?}"
    );
    let err = e.to_string();
    assert!(err.contains("budget") && err.contains("in use"), "{err}");
    // Unknown units, by name, by layer and by id.
    for e in [
        rt.acquire_named("layers.99").unwrap_err(),
        rt.acquire_layer(99).unwrap_err(),
        rt.acquire(UnitId(99)).unwrap_err(),
    ] {
        assert!(
            matches!(
                RuntimeError::from_candle(&e),
                Some(RuntimeError::Unknown { .. })
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("99"), "{e}");
    }
    drop(a);
    let c = rt.acquire_layer(2)?;
    assert_eq!(b.get("layers.1.bias")?.dims(), [32]);
    drop((b, c));
    let summary = rt.memory_summary()?;
    assert!(
        summary.contains("memory summary") && summary.contains("misses"),
        "{summary}"
    );
    Ok(())
}

#[test]
fn cuda_device_without_cuda_build_is_a_clear_error() {
    if cfg!(feature = "cuda") {
        return;
    }
    // A CPU build cannot even make a CUDA device; the typed error is for callers that try.
    let err = Device::new_cuda(0).unwrap_err().to_string();
    assert!(err.to_lowercase().contains("cuda"), "{err}");
}

#[test]
fn varbuilder_checks_shapes_and_converts_dtypes() -> anyhow::Result<()> {
    let store = mlp_store(1, 8, &Device::Cpu, Some(DType::F16))?;
    let rt = OffloadRuntime::new(store, &Device::Cpu, &OffloadConfig::default())?;
    let unit = rt.acquire_layer(0)?;
    let vb = unit.var_builder(DType::F32);
    assert_eq!(vb.get((8, 8), "layers.0.weight")?.dtype(), DType::F32);
    assert!(vb.get((8, 9), "layers.0.weight").is_err());
    assert!(vb.get(8, "layers.0.missing").is_err());
    assert!(vb.contains_tensor("layers.0.bias"));
    let zeros = Tensor::zeros(8, DType::F32, &Device::Cpu)?;
    assert_eq!(
        vb.get(8, "layers.0.bias")?
            .broadcast_mul(&zeros)?
            .sum_all()?
            .to_scalar::<f32>()?,
        0.0
    );
    Ok(())
}

mod props {
    //! Property test of the runtime on the CPU: under random access sequences and budgets,
    //! every acquired unit holds exactly the store's bytes and the budget is never exceeded.
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn refetched_units_are_bit_identical_and_within_budget(
            accesses in prop::collection::vec(0usize..LAYERS, 1..60),
            budget_layers in 1u64..5,
            depth in 0usize..3,
            lru in any::<bool>(),
        ) {
            let store = mlp_store(LAYERS, 8, &Device::Cpu, Some(DType::F16)).unwrap();
            let layer = store.unit(store.layer_unit(0).unwrap()).bytes();
            let cfg = OffloadConfig {
                gpu_memory_limit: Some(MemoryLimit::Bytes(budget_layers * layer)),
                policy: if lru { PolicyChoice::Lru } else { PolicyChoice::Auto },
                prefetch_depth: depth,
                ..Default::default()
            };
            let rt = OffloadRuntime::new(store.clone(), &Device::Cpu, &cfg).unwrap();
            for &i in &accesses {
                let unit = rt.acquire_layer(i).unwrap();
                for name in [format!("layers.{i}.weight"), format!("layers.{i}.bias")] {
                    let (u, meta) = store.tensor(&name).unwrap();
                    let t = unit.get(&name).unwrap().flatten_all().unwrap().to_vec1::<half::f16>().unwrap();
                    let bytes: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
                    prop_assert_eq!(&bytes[..], &*store.unit(u).tensor_bytes(meta));
                }
                drop(unit);
                let stats = rt.stats().unwrap();
                prop_assert!(stats.resident_bytes <= budget_layers * layer);
            }
        }
    }
}

#[test]
fn a_refused_allocation_evicts_idle_units_and_retries_once() -> anyhow::Result<()> {
    let store = mlp_store(LAYERS, WIDTH, &Device::Cpu, None)?;
    let layer = store.unit(store.layer_unit(0).unwrap()).bytes();
    let cfg = OffloadConfig {
        gpu_memory_limit: Some(MemoryLimit::Bytes(4 * layer)),
        policy: PolicyChoice::Lru,
        prefetch_depth: 0,
        ..Default::default()
    };
    let rt = OffloadRuntime::new(store, &Device::Cpu, &cfg)?;
    for i in 0..3 {
        drop(rt.acquire_layer(i)?);
    }
    // One refusal: the idle layers go and the retry succeeds.
    rt.inject_fetch_failures(1)?;
    let unit = rt.acquire_layer(3)?;
    assert_eq!(unit.get("layers.3.bias")?.dims(), [WIDTH]);
    let stats = rt.stats()?;
    assert_eq!(
        stats.units.iter().filter(|u| u.resident).count(),
        1,
        "only the retried unit is left"
    );
    drop(unit);
    // Two refusals: an error naming the unit, the budget and what is resident; nothing is lost.
    drop(rt.acquire_layer(0)?);
    let held = rt.acquire_layer(1)?;
    rt.inject_fetch_failures(2)?;
    let e = rt.acquire_layer(4).unwrap_err();
    assert!(
        matches!(
            RuntimeError::from_candle(&e),
            Some(RuntimeError::FetchFailed { unit, resident, .. })
                if unit == "layers.4" && resident.iter().any(|r| r == "layers.1")
        ),
        "{e:?}"
    );
    let err = e.to_string();
    assert!(
        err.contains("layers.4")
            && err.contains("budget")
            && err.contains("resident")
            && err.contains("layers.1"),
        "{err}"
    );
    drop(held);
    let unit = rt.acquire_layer(4)?;
    assert_eq!(unit.get("layers.4.weight")?.dims(), [WIDTH, WIDTH]);
    Ok(())
}

#[test]
fn failed_fetches_never_change_results() -> anyhow::Result<()> {
    let expected = reference(&Device::Cpu)?;
    let store = mlp_store(LAYERS, WIDTH, &Device::Cpu, None)?;
    let layer = store.unit(store.layer_unit(0).unwrap()).bytes();
    let order: Vec<UnitId> = (0..LAYERS).map(|i| store.layer_unit(i).unwrap()).collect();
    for failures in 1..4 {
        let cfg = OffloadConfig {
            gpu_memory_limit: Some(MemoryLimit::Bytes(3 * layer)),
            policy: PolicyChoice::Schedule(order.clone()),
            prefetch_depth: 1,
            ..Default::default()
        };
        let rt = OffloadRuntime::new(store.clone(), &Device::Cpu, &cfg)?;
        offloaded(&rt, 2)?;
        // Injected refusals hit prefetches (warned, fetched on demand later) and demand
        // fetches (retried after evicting idle units).
        rt.inject_fetch_failures(failures)?;
        assert_eq!(offloaded(&rt, 3)?, expected, "{failures} injected failures");
    }
    Ok(())
}

/// `update_weights` rewrites the host copy and drops the device copy (kept units too): the
/// next acquire sees the new values. Units in use, unknown names and wrong shapes are refused,
/// and nothing is written when one value is refused.
fn updated_weights_are_seen_next_time(device: &Device) -> anyhow::Result<()> {
    let store = mlp_store(LAYERS, WIDTH, device, None)?;
    let rt = OffloadRuntime::new(
        store.clone(),
        device,
        &OffloadConfig {
            keep: vec!["layers.0".into()],
            ..Default::default()
        },
    )?;
    let read = |name: &str| -> anyhow::Result<Vec<f32>> {
        let unit = rt.acquire_named(name.rsplit_once('.').unwrap().0)?;
        Ok(unit.get(name)?.flatten_all()?.to_vec1()?)
    };
    let before = read("layers.0.bias")?;
    let new = Tensor::full(0.25f32, WIDTH, device)?;
    // Refused: a unit in use; an unknown tensor; a shape that differs. Nothing changes.
    {
        let _guard = rt.acquire_named("layers.0")?;
        let e = rt
            .update_weights(&[("layers.0.bias".into(), new.clone())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("in use"), "{e}");
    }
    let e = rt
        .update_weights(&[("layers.9.bias".into(), new.clone())])
        .unwrap_err();
    assert!(
        matches!(
            RuntimeError::from_candle(&e),
            Some(RuntimeError::Unknown { what: "tensor", .. })
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("layers.9.bias"), "{e}");
    let e = rt
        .update_weights(&[
            ("layers.1.bias".into(), new.clone()),
            (
                "layers.0.bias".into(),
                Tensor::zeros(3, DType::F32, device)?,
            ),
        ])
        .unwrap_err()
        .to_string();
    assert!(e.contains("shape"), "{e}");
    assert_eq!(read("layers.0.bias")?, before);
    // Accepted: the kept unit's device copy is dropped and fetched again with the new values.
    let misses = |rt: &OffloadRuntime| -> anyhow::Result<u64> {
        Ok(rt
            .stats()?
            .units
            .iter()
            .find(|u| u.name == "layers.0")
            .unwrap()
            .misses)
    };
    let m0 = misses(&rt)?;
    rt.update_weights(&[("layers.0.bias".into(), new.to_dtype(DType::F16)?)])?;
    assert_eq!(read("layers.0.bias")?, vec![0.25f32; WIDTH]);
    assert_eq!(misses(&rt)?, m0 + 1, "the kept unit was fetched again");
    let (u, meta) = store.tensor("layers.0.bias").unwrap();
    let bytes = store.unit(u).tensor_bytes(meta).to_vec();
    assert_eq!(&bytes[..4], &0.25f32.to_le_bytes());
    Ok(())
}
test_device!(
    updated_weights_are_seen_next_time,
    updated_weights_are_seen_next_time_cpu,
    updated_weights_are_seen_next_time_gpu
);

/// A runtime that serves some units (a pipeline stage's) counts only those in its budget and
/// refuses to acquire the others.
#[test]
fn a_stage_serves_only_its_units() -> anyhow::Result<()> {
    let device = Device::Cpu;
    let store = mlp_store(LAYERS, WIDTH, &device, None)?;
    let layer = store.unit(store.layer_unit(0).unwrap()).bytes();
    // A budget of exactly two layers: the whole model's sweep must stream through it (one
    // spare layer for copies in flight), a stage of two layers fits entirely and never
    // fetches twice.
    let sweep =
        |units: Option<Vec<String>>, layers: &[usize]| -> anyhow::Result<(OffloadRuntime, u64)> {
            let rt = OffloadRuntime::new(
                store.clone(),
                &device,
                &OffloadConfig {
                    gpu_memory_limit: Some(MemoryLimit::Bytes(2 * layer)),
                    units,
                    policy: PolicyChoice::Schedule(
                        layers
                            .iter()
                            .map(|&l| store.layer_unit(l).unwrap())
                            .collect(),
                    ),
                    ..Default::default()
                },
            )?;
            for _ in 0..3 {
                for &l in layers {
                    rt.acquire_layer(l)?;
                }
            }
            let fetches = rt.stats()?.total.fetches;
            Ok((rt, fetches))
        };
    let all: Vec<usize> = (0..LAYERS).collect();
    let (_, whole) = sweep(None, &all)?;
    let (rt, stage) = sweep(Some(vec!["layers.2".into(), "layers.3".into()]), &[2, 3])?;
    assert_eq!(stage, 2, "a stage that fits fetches each layer once");
    assert!(
        whole > 2 * LAYERS as u64,
        "the whole model streams through the same budget ({whole} fetches)"
    );
    // Served units outside the schedule (a host layer a prompt runs here) take no spare room
    // from a schedule that fits: its layers are fetched once, and the outsider when used.
    let served = ["layers.1", "layers.2", "layers.3"]
        .map(String::from)
        .to_vec();
    let (outside, fetches) = sweep(Some(served), &[2, 3])?;
    assert_eq!(fetches, 2, "the schedule that fits streams nothing");
    for l in [1, 2, 3, 2, 3] {
        outside.acquire_layer(l)?;
    }
    assert_eq!(
        outside.stats()?.total.fetches,
        4,
        "the outsider evicts one layer, then is the next victim (the schedule's layers stay)"
    );
    let e = rt.acquire_layer(4).unwrap_err();
    assert!(
        matches!(
            RuntimeError::from_candle(&e),
            Some(RuntimeError::NotServed { unit, .. }) if unit == "layers.4"
        ),
        "{e:?}"
    );
    let e = e.to_string();
    assert!(e.contains("layers.4") && e.contains("another stage"), "{e}");
    // Nor may it rewrite another stage's weights (that stage's resident copy would go stale):
    // refused, and nothing is written, not even the values of its own units.
    let bytes = |name: &str| {
        let (u, meta) = rt.store().tensor(name).unwrap();
        rt.store().unit(u).tensor_bytes(meta).to_vec()
    };
    let (before2, before4) = (bytes("layers.2.bias"), bytes("layers.4.bias"));
    let new = Tensor::full(0.5f32, WIDTH, &device)?;
    let e = rt
        .update_weights(&[
            ("layers.2.bias".into(), new.clone()),
            ("layers.4.bias".into(), new),
        ])
        .unwrap_err();
    assert!(
        matches!(
            RuntimeError::from_candle(&e),
            Some(RuntimeError::NotServed { unit, .. }) if unit == "layers.4"
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("not served by the runtime"), "{e}");
    assert_eq!(bytes("layers.2.bias"), before2);
    assert_eq!(bytes("layers.4.bias"), before4);
    let e = OffloadRuntime::new(
        store,
        &device,
        &OffloadConfig {
            units: Some(vec!["layers.77".into()]),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("layers.77"), "{e}");
    Ok(())
}
