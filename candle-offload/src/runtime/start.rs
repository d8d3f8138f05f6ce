//! Starting a runtime ([`OffloadRuntime::new`]), step by step: check the configuration, size the
//! CPU pool, make the engine, resolve the budget, size the units and plan the weights' capacity,
//! check the managed units against it, build the residency cache, start the read-ahead threads.

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};

use candle_core::Device;

use super::config::OffloadConfig;
use super::fetch::READ_THREADS;
use super::shared::{Engine, OffloadRuntime, Shared, State};
use super::sizes::UnitSizes;
use crate::budget::{human_bytes, Budget};
use crate::cache::{ResidencyCache, UnitId};
use crate::diag::device_label;
use crate::error::{Error, Result};
use crate::plan::CapacityPlan;
use crate::store::{HostStore, TierKind};
use crate::sys::{CudaEngine, ReadPool};
use crate::tuning::Tuning;

impl OffloadRuntime {
    /// Starts a runtime for `store` on `device`. Refuses a budget that cannot hold the largest
    /// unit (plus kept units) and the reservation, saying how many MiB are missing.
    ///
    /// On a GPU, create the device with [`Device::new_cuda_with_stream`] so that every thread
    /// uses the same compute stream (candle-internals.md H6).
    pub fn new(store: Arc<HostStore>, device: &Device, cfg: &OffloadConfig) -> Result<Self> {
        cfg.validate()?;
        size_cpu_pool(&cfg.tuning);
        let engine = Engine::for_device(device, cfg)?;
        let name = device_label(device);
        let budget = resolve_budget(&engine, &name, cfg)?;
        let sizes = UnitSizes::new(&store, budget, cfg)?;
        let resize = sizes.resize(&store, &name, cfg);
        let (plan, spare_depth) = resize.plan(budget)?;
        check_managed(&store, device, &name, &sizes, &plan, cfg)?;
        let stays = sizes.stays(plan.fits_entirely);
        let mut cache = ResidencyCache::new(&sizes.bytes, plan.weight_capacity, cfg.policy.clone())
            .with_prefetch_depth(spare_depth);
        for &u in &sizes.keep {
            cache.set_keep(u, true);
        }
        tracing::info!(
            device = %name,
            budget = budget.limit_bytes,
            capacity = plan.weight_capacity,
            depth = plan.prefetch_depth,
            strategy = %cfg.strategy,
            "offload runtime ready"
        );
        let read_pool = start_read_pool(&store, &sizes.served);
        let n = sizes.bytes.len();
        let UnitSizes {
            served, own_size, ..
        } = sizes;
        Ok(Self {
            shared: Arc::new(Shared {
                tuning: cfg.tuning,
                read_pool,
                device: device.clone(),
                store,
                engine,
                limit_bytes: budget.limit_bytes,
                reserve: AtomicU64::new(budget.reserve_bytes),
                prefetch_depth: AtomicUsize::new(plan.prefetch_depth),
                resize,
                trainable: cfg.trainable,
                served,
                own_size,
                stays,
                state: Mutex::new(State::new(cache, n)),
            }),
        })
    }
}

/// Asks the CPU matmul pool for the threads `tuning` wants; the pool is sized once per
/// process, so a later runtime asking for another count gets a warning.
fn size_cpu_pool(tuning: &Tuning) {
    let threads = tuning.threads();
    let pool = candle_offload_kernels::pool::ask_threads(threads);
    if pool != threads {
        tracing::warn!(
            "the CPU matmul pool has {pool} threads (sized by an earlier runtime), not the \
             {threads} this one's tuning asks for"
        );
    }
}

impl Engine {
    /// The engine for `device`: the CPU fallback, or a GPU's copy engine; Metal is refused.
    fn for_device(device: &Device, cfg: &OffloadConfig) -> Result<Self> {
        Ok(match device {
            Device::Cpu => Engine::Cpu,
            Device::Cuda(_) => Engine::Cuda(CudaEngine::new(
                device,
                cfg.event_tracking,
                cfg.tuning.weight_pool,
            )?),
            Device::Metal(_) => {
                return Err(Error::InvalidConfig {
                    field: "device".into(),
                    reason: "Metal is not supported".into(),
                })
            }
        })
    }
}

/// The budget on the device `name`: the configured limit (a share resolved against the GPU's
/// total memory), or without one the GPU's free memory (no limit of our own on a CPU), with the
/// configured reservation.
fn resolve_budget(engine: &Engine, name: &str, cfg: &OffloadConfig) -> Result<Budget> {
    let total = match engine {
        Engine::Cuda(e) => Some(e.mem_get_info()?),
        Engine::Cpu => None,
    };
    let limit = match (&cfg.gpu_memory_limit, total) {
        (Some(l), t) => l.resolve(name, t.map(|(_, total)| total))?,
        (None, Some((free, _))) => free,
        (None, None) => u64::MAX / 4,
    };
    Ok(Budget {
        limit_bytes: limit,
        reserve_bytes: cfg.reserve_bytes,
    })
}

/// Refuses served units in managed memory that this runtime cannot serve: trainable ones,
/// ones whose memory belongs to another GPU, and any that would stream.
///
/// Managed units may not stream: once the driver has migrated a page to the GPU it keeps the
/// device memory after migrating the page back, so a managed model that streams grows the
/// device's use to its whole size whatever the budget (ARCHITECTURE.md, invariants). Managed
/// memory therefore only serves what fits in the capacity.
fn check_managed(
    store: &HostStore,
    device: &Device,
    name: &str,
    sizes: &UnitSizes,
    plan: &CapacityPlan,
    cfg: &OffloadConfig,
) -> Result<()> {
    // The served managed units: (bytes, the GPU their memory belongs to).
    let managed_units: Vec<(u64, usize)> = (0..sizes.bytes.len())
        .filter(|&i| sizes.served[i])
        .filter_map(|i| {
            let ordinal = store.unit(UnitId(i)).buffer().managed()?.ordinal();
            Some((sizes.bytes[i], ordinal))
        })
        .collect();
    let managed: u64 = managed_units.iter().map(|&(bytes, _)| bytes).sum();
    if managed > 0 && cfg.trainable {
        return Err(Error::InvalidConfig {
            field: "engine".into(),
            reason: "the managed engine is for inference: trainable weights would be \
                     written in place in the store's managed memory"
                .into(),
        });
    }
    let gpu = match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => Some(gpu_id),
        _ => None,
    };
    if let Some(&(_, other)) = managed_units.iter().find(|&&(_, o)| Some(o) != gpu) {
        return Err(Error::InvalidConfig {
            field: "engine".into(),
            reason: format!(
                "the store's managed memory belongs to cuda:{other}, not {name}: a managed \
                 store serves only the GPU it was built for (no pipelines over several \
                 GPUs; use the explicit engine)"
            ),
        });
    }
    if managed > 0 && !plan.fits_entirely {
        return Err(Error::InvalidConfig {
            field: "engine".into(),
            reason: format!(
                "the managed engine cannot stream: its {} of weights do not fit the {} \
                 this budget leaves for weights on {name}, and the CUDA driver keeps the \
                 device memory of every page it has migrated to the GPU, even after \
                 migrating it back, so streaming would exceed the budget; use the \
                 explicit engine (the default) or a budget that holds the model",
                human_bytes(managed),
                human_bytes(plan.weight_capacity),
            ),
        });
    }
    Ok(())
}

/// Reader threads for the read-ahead of the disk units among the `served` ones (`None` when
/// none is on disk, or when the threads cannot start: disk units are then read when fetched).
fn start_read_pool(store: &HostStore, served: &[bool]) -> Option<ReadPool> {
    let serves_disk =
        (0..served.len()).any(|i| served[i] && store.unit(UnitId(i)).tier() == TierKind::Disk);
    if !serves_disk {
        return None;
    }
    match ReadPool::new(READ_THREADS) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the read-ahead threads; disk units are read when fetched");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::super::config::OffloadConfig;
    use super::super::shared::OffloadRuntime;
    use crate::store::{HostStore, RawTensorSpec, StoreConfig};

    #[test]
    fn the_budget_counts_padded_quantized_units() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let q = QTensor::quantize(&Tensor::randn(0f32, 1., (16, 256), &dev)?, GgmlDType::Q4K)?;
        let blocks = q.data()?.into_owned();
        let specs: Vec<RawTensorSpec> = (0..3)
            .map(|l| RawTensorSpec {
                name: format!("model.layers.{l}.w"),
                format: GgmlDType::Q4K.into(),
                shape: q.shape().clone(),
            })
            .collect();
        let store = HostStore::from_raw(&specs, &StoreConfig::default(), &dev, |_, _, dst| {
            dst.copy_from_slice(&blocks);
            Ok(())
        })?;
        let unit = store.units()[0].bytes();
        assert_eq!(unit as usize, blocks.len() + 2 * 144);
        let store = Arc::new(store);
        // One byte short of the padded unit is refused; the padded size is enough.
        let cfg = |limit| OffloadConfig {
            gpu_memory_limit: Some(crate::budget::MemoryLimit::Bytes(limit)),
            prefetch_depth: 0,
            ..Default::default()
        };
        assert!(OffloadRuntime::new(store.clone(), &dev, &cfg(unit - 1)).is_err());
        let rt = OffloadRuntime::new(store, &dev, &cfg(unit))?;
        for _ in 0..2 {
            for l in 0..3 {
                let g = rt.acquire_layer(l)?;
                assert_eq!(
                    &*g.get_quantized(&format!("model.layers.{l}.w"))?.data()?,
                    &blocks[..]
                );
            }
        }
        assert_eq!(rt.stats()?.peak_resident_bytes, unit);
        Ok(())
    }
}
