//! GPU-only tests, run on the GPU machine (`test-integration cuda::`): the copy stream racing
//! a busy compute stream must never change what kernels read.

use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};
use candle_offload::{
    HostStore, MemoryLimit, OffloadConfig, OffloadRuntime, PolicyChoice, StoreConfig, TensorSpec,
};

const UNITS: usize = 6;
const TENSORS: usize = 3;
const ELEMS: usize = 4 << 20; // 16 MiB of f32 per tensor

fn value(unit: usize, tensor: usize, i: usize) -> f32 {
    ((unit * 131 + tensor * 17 + i * 7) % 1009) as f32 - 504.0
}

/// Fills `model.layers.{u}.w{t}` with `value(u, t, i)`.
fn fill(spec: &TensorSpec, dst: &mut [u8]) -> candle_offload::Result<()> {
    let (u, t) = spec.name["model.layers.".len()..]
        .split_once(".w")
        .expect("model.layers.{u}.w{t}");
    let (u, t): (usize, usize) = (
        u.parse().expect("unit index"),
        t.parse().expect("tensor index"),
    );
    for (i, c) in dst.chunks_exact_mut(4).enumerate() {
        c.copy_from_slice(&value(u, t, i).to_le_bytes());
    }
    Ok(())
}

/// Long matmul chains keep the compute stream busy while units are fetched and evicted on the
/// copy stream; every read of a unit (a kernel, and `to_dtype`, which bypasses cudarc's own
/// tracking) must see exactly the host bytes. Results stay on the GPU until checked, so the
/// host runs far ahead of the device and a missing event would show.
#[test]
fn copy_stream_races_a_busy_compute_stream() -> anyhow::Result<()> {
    let device = Device::new_cuda_with_stream(0)?;
    let iters: usize = std::env::var("RACE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let specs: Vec<TensorSpec> = (0..UNITS)
        .flat_map(|u| {
            (0..TENSORS).map(move |t| TensorSpec {
                name: format!("model.layers.{u}.w{t}"),
                dtype: DType::F32,
                shape: Shape::from(ELEMS),
            })
        })
        .collect();
    let store = Arc::new(HostStore::from_fn(
        &specs,
        &StoreConfig::default(),
        &device,
        |spec, _, dst| fill(spec, dst),
    )?);
    assert!(
        store.pinned_bytes() > 0,
        "the store should be pinned on a GPU"
    );
    let unit_bytes = store.units()[0].bytes();
    let expected: Vec<Vec<Tensor>> = (0..UNITS)
        .map(|u| {
            (0..TENSORS)
                .map(|t| {
                    Tensor::from_vec(
                        (0..ELEMS).map(|i| value(u, t, i)).collect::<Vec<_>>(),
                        ELEMS,
                        &Device::Cpu,
                    )
                })
                .collect::<candle_core::Result<Vec<_>>>()
        })
        .collect::<candle_core::Result<_>>()?;
    let big = Tensor::randn(0f32, 1e-2, (2048, 2048), &device)?;

    for (policy, depth) in [
        (PolicyChoice::Lru, 0),
        (PolicyChoice::Lru, 2),
        (PolicyChoice::Auto, 3),
    ] {
        let cfg = OffloadConfig {
            gpu_memory_limit: Some(MemoryLimit::Bytes(unit_bytes * 5 / 2 + (256 << 20))),
            reserve_bytes: 256 << 20,
            policy: policy.clone(),
            prefetch_depth: depth,
            ..Default::default()
        };
        let rt = OffloadRuntime::new(store.clone(), &device, &cfg)?;
        let mut pending: Vec<(usize, Tensor, Tensor)> = Vec::new();
        let mut busy = big.clone();
        for it in 0..iters {
            for _ in 0..4 {
                busy = busy.matmul(&big)?;
            }
            // Mostly a cyclic sweep (so Auto learns it), sometimes a jump.
            let u = if it % 11 == 10 {
                (it * 7) % UNITS
            } else {
                it % UNITS
            };
            let unit = rt.acquire_layer(u)?;
            let t = it % TENSORS;
            let w = unit.get(&format!("model.layers.{u}.w{t}"))?;
            let via_kernel = w.affine(1.0, 0.0)?;
            let via_cast = w.to_dtype(DType::F64)?;
            drop(unit);
            pending.push((u * TENSORS + t, via_kernel, via_cast));
            if pending.len() == 24 || it + 1 == iters {
                for (k, a, b) in pending.drain(..) {
                    let want = &expected[k / TENSORS][k % TENSORS];
                    let diff_a = (a.to_device(&Device::Cpu)? - want)?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    let diff_b = (b.to_dtype(DType::F32)?.to_device(&Device::Cpu)? - want)?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    assert!(
                        diff_a == 0.0 && diff_b == 0.0,
                        "{policy:?} depth {depth} iter {it}: unit {} differs",
                        k / TENSORS
                    );
                }
            }
        }
        let stats = rt.stats()?;
        assert!(
            stats.total.fetches as usize > iters / 2,
            "the test must actually stream: {stats:?}"
        );
        assert!(stats.peak_resident_bytes <= stats.weight_capacity_bytes);
        let _ = busy.sum_all()?.to_scalar::<f32>()?;
    }
    Ok(())
}

/// Past the pinned-memory cap the store keeps units in pageable memory and the runtime copies
/// them through its pinned staging ring: the weights must still arrive bit-identical.
#[test]
fn pageable_units_go_through_the_staging_ring() -> anyhow::Result<()> {
    let device = Device::new_cuda_with_stream(0)?;
    let n = 5 << 20; // 20 MiB of f32 per unit: several 8 MiB staging chunks
    let specs: Vec<TensorSpec> = (0..4)
        .map(|u| TensorSpec {
            name: format!("model.layers.{u}.w0"),
            dtype: DType::F32,
            shape: Shape::from(n),
        })
        .collect();
    let cfg = StoreConfig {
        pinned_cap_bytes: Some((n * 4) as u64 + 4096),
        ..Default::default()
    };
    let store = Arc::new(HostStore::from_fn(
        &specs,
        &cfg,
        &device,
        |spec, _, dst| fill(spec, dst),
    )?);
    assert!(
        store.pinned_bytes() > 0 && store.pageable_bytes() > 0,
        "one unit pinned, the rest pageable"
    );
    let unit_bytes = store.units()[0].bytes();
    let rt = OffloadRuntime::new(
        store,
        &device,
        &OffloadConfig {
            gpu_memory_limit: Some(MemoryLimit::Bytes(2 * unit_bytes)),
            prefetch_depth: 0,
            ..Default::default()
        },
    )?;
    for round in 0..3 {
        for u in 0..4 {
            let unit = rt.acquire_layer(u)?;
            let got = unit
                .get(&format!("model.layers.{u}.w0"))?
                .to_device(&Device::Cpu)?
                .to_vec1::<f32>()?;
            assert!(
                got.iter().enumerate().all(|(i, &x)| x == value(u, 0, i)),
                "round {round}, unit {u}"
            );
        }
    }
    assert!(rt.stats()?.pageable_bytes > 0);
    Ok(())
}
