//! The offload runtime: a host store, a budgeted residency cache and a copy engine, behind
//! one `acquire`/`release` API that is the same on a CPU and on a GPU.
//!
//! ```text
//! acquire(u):  cache.acquire(u) ─► evict victims (copy stream waits on their last use, frees)
//!                               └► fetch u if absent (alloc + H2D on the copy stream, `ready`)
//!              compute waits on ready[u]
//!              start the planned fetches that can start now (Belady's plan, <= depth+1 ahead)
//! ... caller enqueues kernels that read u's tensors on the compute stream ...
//! drop(guard): last_use[u] recorded on compute; cache.release(u)
//! ```
//!
//! Units in the disk tier add a hop in front of the copy: after each acquire, the next
//! [`READ_AHEAD_UNITS`] disk units the plan will fetch are read from their file into host
//! memory by reader threads (`sys::ReadPool`), so that their fetch (the copy, or on the CPU the
//! unit's tensors) finds the bytes read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::budget::{Budget, MemoryLimit};
use crate::cache::{CacheError, PolicyChoice, ResidencyCache, Transfer, UnitId};
use crate::diag::device_label;
use crate::error::{Error, Result};
use crate::history::{EventKind, MemoryEvent, MemoryHistory};
use crate::plan::{
    plan_capacity_for, CapacityPlan, OffloadStrategy, WeightNeed, MAX_PREFETCH_DEPTH,
};
use crate::runtime_error::RuntimeError;
use crate::store::{HostStore, HostUnit, TierKind, WeightFormat};
use crate::sys::{
    CudaEngine, DeviceLayout, DeviceWeight, ReadAhead, SpareUse, UnitSync, UploadItem,
};
use crate::telemetry::{OffloadStats, ReadAheadStats, Telemetry, Timings, UnitStats};
use crate::tuning::Tuning;
use crate::varbuilder::UnitBackend;

/// Settings of an [`OffloadRuntime`].
#[derive(Debug, Clone)]
pub struct OffloadConfig {
    /// The device memory limit (the seed's `max_gpu_memory`, `--gpu-memory-limit`). `None`:
    /// no limit of our own on a CPU; on a GPU, the memory free when the runtime starts.
    pub gpu_memory_limit: Option<MemoryLimit>,
    /// Bytes the caller keeps inside the limit for activations, KV cache and workspace.
    pub reserve_bytes: u64,
    /// How much of the model stays resident (the seed's `offload_strategy`).
    pub strategy: OffloadStrategy,
    /// Victim selection; `Auto` learns the access order.
    pub policy: PolicyChoice,
    /// Copies that may run ahead of their victims' release, 0 to [`MAX_PREFETCH_DEPTH`]. Each
    /// step of depth keeps one largest unit of the budget free for copies in flight: 0 moves
    /// the fewest bytes, more hides copies behind more compute. 1 by default (docs/tuning.md);
    /// 2 keeps the link busiest.
    pub prefetch_depth: usize,
    /// Units (by name) that never leave the device once fetched.
    pub keep: Vec<String>,
    /// Fetched tensors are autograd leaves (`is_variable`), so a backward pass computes
    /// gradients for them (training with offloaded weights). Off for inference, where a
    /// variable would make every op record its graph.
    pub trainable: bool,
    /// The units this runtime serves, by name (a pipeline stage's share of a model whose store
    /// several runtimes share); `None`: every unit of the store. Only these count in the
    /// budget and may be acquired.
    pub units: Option<Vec<String>>,
    /// cudarc's per-buffer event tracking on this GPU's CUDA context (off by default). Once a
    /// second stream exists, cudarc records an event for every buffer a kernel reads or writes
    /// and makes the next user wait on it: two or three driver calls per argument per launch.
    /// The runtime orders its copy stream with its own events (ARCHITECTURE.md, hazard table),
    /// so a single-device model is safe without it, and decodes faster (docs/tuning.md).
    /// `false` turns it off for the whole context from then on (cudarc has no per-stream
    /// switch): an application that runs its own streams on the same device sets `true`.
    /// Pipelines over several GPUs and training keep it: the device-to-device hidden-state copy
    /// relies on it. Ignored on the CPU.
    pub event_tracking: bool,
    /// The reservation of the phase this runtime spends most of its passes in, where lower than
    /// `reserve_bytes` (a model's decode steps, after a prompt that needs room for its
    /// activations; see [`set_reserve_bytes`](OffloadRuntime::set_reserve_bytes)). When every
    /// served unit fits beside it, each unit takes its own device size, without the streaming
    /// padding: the prompt then streams what its activations leave no room for, and the
    /// steady phase holds every unit. `None`: `reserve_bytes`.
    pub steady_reserve_bytes: Option<u64>,
    /// The performance choices ([`Tuning`]): the ops' kernels (read by the code built over
    /// this runtime, [`OffloadRuntime::tuning`]), the CPU pool's threads, the weight pool.
    pub tuning: Tuning,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self {
            gpu_memory_limit: None,
            reserve_bytes: 0,
            strategy: OffloadStrategy::Minimal,
            policy: PolicyChoice::Auto,
            prefetch_depth: 1,
            keep: Vec::new(),
            trainable: false,
            units: None,
            event_tracking: false,
            steady_reserve_bytes: None,
            tuning: Tuning::default(),
        }
    }
}

/// How weights reach the device.
#[derive(Debug)]
enum Engine {
    /// CPU tensors copied out of the host store (the fallback that runs everywhere).
    Cpu,
    /// A GPU with its copy stream.
    Cuda(CudaEngine),
}

/// A fetched unit's tensors, by full name: dense ones as Candle tensors, GGML ones as Candle
/// quantized tensors (`QTensor`, ready for `QMatMul`). Cloning shares them.
#[derive(Debug, Clone, Default)]
struct Weights {
    dense: Arc<HashMap<String, Tensor>>,
    quantized: Arc<HashMap<String, Arc<QTensor>>>,
    /// The GGML type of each quantized tensor (for the `VarBuilder`'s messages).
    quantized_formats: Arc<HashMap<String, GgmlDType>>,
    /// What a user built from these tensors ([`UnitGuard::derived`]); dropped with them.
    derived: Arc<Mutex<Derived>>,
}

/// [`UnitGuard::derived`]'s slot: one value of any type.
#[derive(Default)]
struct Derived(Option<Arc<dyn std::any::Any + Send + Sync>>);

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Derived(Some)"
        } else {
            "Derived(None)"
        })
    }
}

impl Weights {
    fn new(
        dense: HashMap<String, Tensor>,
        quantized: HashMap<String, (GgmlDType, Arc<QTensor>)>,
    ) -> Self {
        let quantized_formats = quantized
            .iter()
            .map(|(n, (g, _))| (n.clone(), *g))
            .collect();
        Self {
            dense: Arc::new(dense),
            quantized: Arc::new(quantized.into_iter().map(|(n, (_, q))| (n, q)).collect()),
            quantized_formats: Arc::new(quantized_formats),
            derived: Arc::default(),
        }
    }

    /// Whether anything outside the runtime still holds these tensors.
    fn is_shared(&self) -> bool {
        Arc::strong_count(&self.dense) > 1 || Arc::strong_count(&self.quantized) > 1
    }

    /// Takes the quantized tensors that nothing else holds, for their buffers to take another
    /// unit's blocks (`CudaEngine::upload`); what a user derived from them is dropped first,
    /// and tensors still held elsewhere stay (and are freed with these weights).
    fn take_unique_blocks(&mut self) -> Vec<QTensor> {
        if self.is_shared() || self.quantized.is_empty() {
            return Vec::new();
        }
        if Arc::strong_count(&self.derived) == 1 {
            if let Ok(mut d) = self.derived.lock() {
                d.0 = None;
            }
        }
        let Some(map) = Arc::get_mut(&mut self.quantized) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut kept = HashMap::new();
        for (name, q) in map.drain() {
            match Arc::try_unwrap(q) {
                Ok(q) => out.push(q),
                Err(q) => {
                    kept.insert(name, q);
                }
            }
        }
        *map = kept;
        out
    }
}

#[derive(Debug)]
struct Resident {
    weights: Weights,
    sync: Option<UnitSync>,
}

#[derive(Debug)]
struct Recording {
    start: std::time::Instant,
    baseline: Option<u64>,
    /// The reservation when recording started.
    reserve: u64,
    events: Vec<MemoryEvent>,
}

#[derive(Debug)]
struct State {
    cache: ResidencyCache,
    resident: Vec<Option<Resident>>,
    retired: Vec<UnitSync>,
    telemetry: Telemetry,
    history: Option<Recording>,
    #[cfg(feature = "fault-injection")]
    injected_failures: u32,
    reservation_parts: Vec<(String, u64)>,
    /// Disk units with a read-ahead issued and not yet used by their fetch.
    read_ahead: Vec<UnitId>,
    /// Graph capture ([`OffloadRuntime::capture_step`]) under way: units are neither moved
    /// nor waited for, and their uses record no events (an event recorded inside a capture
    /// cannot be waited on outside it).
    capturing: bool,
    /// The quantized tensors of evicted units, whose buffers the next fetch's blocks take
    /// where they match (it frees the others first). The cache no longer counts them, but
    /// they hold only memory it freed and has not given out since: resident units and these
    /// together stay within the weights' capacity. Emptied (freed) whenever the reservation
    /// changes and by [`OffloadRuntime::evict_all`].
    spare_blocks: Vec<QTensor>,
    /// An upload freed spare buffers whose room no new buffer took back
    /// ([`OffloadRuntime::trim_if_pending`]).
    trim_pending: bool,
    /// Bumped whenever a unit arrives or leaves: a captured step holds the addresses of the
    /// units resident at its capture and may replay only while this is unchanged.
    generation: u64,
    /// A captured step was replayed: units' `last_use` events predate work on the compute
    /// stream, so an eviction records a fresh one first (hazard H19).
    replayed: bool,
}

#[derive(Debug)]
struct Shared {
    device: Device,
    store: Arc<HostStore>,
    engine: Engine,
    /// The budget's limit; the reservation is `reserve` (it may change at run time).
    limit_bytes: u64,
    reserve: AtomicU64,
    prefetch_depth: AtomicUsize,
    /// What a change of the reservation plans the weights' capacity from.
    resize: Resize,
    trainable: bool,
    served: Vec<bool>,
    /// Per unit: it stays on the device for good, at its own size
    /// ([`HostUnit::resident_bytes`]) rather than its streaming size ([`HostUnit::bytes`]).
    own_size: Vec<bool>,
    /// Per unit: it stays on the device once fetched (kept, or every served unit when they
    /// all fit the weights' capacity); what [`OffloadRuntime::warm_up`] fetches.
    stays: Vec<bool>,
    state: Mutex<State>,
    /// Reader threads for the disk units' read-ahead (`None`: no disk units served).
    read_pool: Option<crate::sys::ReadPool>,
    /// The configuration's performance choices.
    tuning: Tuning,
}

impl Shared {
    /// Whether this runtime's device is a GPU.
    fn engine_is_cuda(&self) -> bool {
        matches!(self.engine, Engine::Cuda(_))
    }

    /// The device bytes unit `u` takes in this runtime: its own size when it stays for good,
    /// its streaming size otherwise.
    fn size_of(&self, u: UnitId) -> u64 {
        let unit = self.store.unit(u);
        if self.own_size.get(u.0).copied().unwrap_or(false) {
            unit.resident_bytes()
        } else {
            unit.bytes()
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Read-ahead bytes live in the store, which may outlive this runtime.
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for u in st.read_ahead.drain(..) {
            self.store.unit(u).buffer().end_read_ahead();
        }
    }
}

/// What [`OffloadRuntime::set_reserve_bytes`] plans a new capacity from: the weights' need
/// and the settings the runtime started with.
#[derive(Debug)]
struct Resize {
    device: String,
    need: WeightNeed,
    /// Names the kept units and the largest unit in a refusal.
    what: String,
    strategy: OffloadStrategy,
    asked_depth: usize,
    /// The bytes of the units a steady sweep holds: at a capacity that holds them no copy runs
    /// ahead of its victim, so no spare room is kept for one.
    steady: u64,
}

impl Resize {
    /// The weights' capacity and the cache's prefetch depth under `budget`.
    fn plan(&self, budget: Budget) -> Result<(CapacityPlan, usize)> {
        let plan = plan_capacity_for(
            &self.device,
            budget,
            &self.need,
            &self.what,
            self.strategy,
            self.asked_depth,
        )?;
        let spare = if self.steady <= plan.weight_capacity {
            0
        } else {
            plan.prefetch_depth
        };
        Ok((plan, spare))
    }
}

/// Weights in host memory, brought to the device on demand under a memory budget.
///
/// Cloning is cheap and shares the runtime.
#[derive(Debug, Clone)]
pub struct OffloadRuntime {
    shared: Arc<Shared>,
}

/// A decode step captured as a CUDA graph by [`OffloadRuntime::capture_step`] and launched by
/// [`OffloadRuntime::replay_step`], valid while the units resident at its capture stay.
#[derive(Debug)]
pub struct StepGraph {
    graph: crate::sys::StepGraph,
    /// The runtime's residency generation at the capture.
    generation: u64,
}

/// Disk units read ahead of their fetch at a time (each staged whole in host memory until its
/// fetch): two, so that one is being read while the fetch of the one before uses its bytes.
pub(crate) const READ_AHEAD_UNITS: usize = 2;

/// Reader threads for read-ahead: one per unit read ahead.
const READ_THREADS: usize = READ_AHEAD_UNITS;

/// Which units stay on the device for good at their own sizes
/// ([`HostUnit::resident_bytes`]), when some stream larger ([`HostUnit::bytes`]: layers of
/// mixed block types padded alike). All units of the steady state (the kept units and, under a
/// schedule, the units it sweeps; otherwise every served unit) when they fit at their own sizes
/// beside the `steady` phase's reservation: nothing is replaced then, and a served unit outside
/// the schedule (a host layer a prompt runs on the device) keeps its padded size and streams
/// through whatever room the prompt leaves. Otherwise the kept units and, when the policy is a
/// schedule that every other served unit is in, the ones [`staying_units`](crate::staying_units)
/// chooses along it. A unit that streams keeps its padded size: the driver's pool then serves
/// each incoming unit from the one it replaces.
///
/// The flag says whether the steady state fits at its own sizes (the first case): its units may
/// then still be evicted (for a prompt's activations) and fetched again; in the second case
/// the units that stay are kept for good.
fn staying(
    budget: Budget,
    steady: Budget,
    streaming: &[u64],
    own: &[u64],
    served: &[bool],
    keep: &[UnitId],
    cfg: &OffloadConfig,
) -> (Vec<bool>, bool) {
    let n = streaming.len();
    let mut stays = vec![false; n];
    if (0..n).all(|i| !served[i] || own[i] == streaming[i]) {
        return (stays, false);
    }
    let kept = |u: usize| keep.contains(&UnitId(u));
    let plan_under = |budget: Budget, need: &WeightNeed| {
        need.plan(budget.weight_bytes(), cfg.strategy, cfg.prefetch_depth)
    };
    let plan = |need: &WeightNeed| plan_under(budget, need);
    // The steady state's units: under a schedule, the kept units and the ones it sweeps (the
    // others come only with prompts); otherwise every served unit.
    let steady_units: Vec<bool> = match &cfg.policy {
        PolicyChoice::Schedule(order) => {
            let mut s: Vec<bool> = (0..n).map(|i| served[i] && kept(i)).collect();
            for u in order {
                if u.0 < n && served[u.0] {
                    s[u.0] = true;
                }
            }
            s
        }
        _ => served.to_vec(),
    };
    let own_need = weight_need(|i| own[i], &steady_units, keep);
    if plan_under(steady, &own_need).is_some_and(|p| p.fits_entirely) {
        return (steady_units, true);
    }
    for &u in keep {
        if u.0 < n {
            stays[u.0] = true;
        }
    }
    let PolicyChoice::Schedule(order) = &cfg.policy else {
        return (stays, false);
    };
    let mut sweep = Vec::new();
    let mut seen = vec![false; n];
    for u in order {
        if u.0 < n && served[u.0] && !kept(u.0) && !seen[u.0] {
            seen[u.0] = true;
            sweep.push(u.0);
        }
    }
    // A served unit outside the sweep streams now and then, replacing whichever unit is the
    // victim then: every unit keeps its streaming size.
    if (0..n).any(|i| served[i] && !kept(i) && !seen[i]) {
        return (stays, false);
    }
    let need = weight_need(
        |i| if kept(i) { own[i] } else { streaming[i] },
        served,
        keep,
    );
    let Some(p) = plan(&need) else {
        return (stays, false);
    };
    let chosen = crate::plan::staying_units(
        own,
        streaming,
        &sweep,
        need.kept,
        p.weight_capacity,
        p.prefetch_depth,
    );
    for (s, c) in stays.iter_mut().zip(chosen) {
        *s |= c;
    }
    (stays, false)
}

/// What the served units need of a device at `size(i)` bytes each: the units in `keep` never
/// leave it, the others may be evicted.
fn weight_need(size: impl Fn(usize) -> u64, served: &[bool], keep: &[UnitId]) -> WeightNeed {
    let kept = |i: usize| keep.contains(&UnitId(i));
    let served = || (0..served.len()).filter(|&i| served[i]);
    let evictable: Vec<u64> = served().filter(|&i| !kept(i)).map(&size).collect();
    WeightNeed::new(&evictable, served().filter(|&i| kept(i)).map(&size).sum())
}

fn lock_err<T>(_: T) -> candle_core::Error {
    candle_core::Error::Msg("offload runtime state poisoned by an earlier panic".into())
}

impl OffloadRuntime {
    /// Starts a runtime for `store` on `device`. Refuses a budget that cannot hold the largest
    /// unit (plus kept units) and the reservation, saying how many MiB are missing.
    ///
    /// On a GPU, create the device with [`Device::new_cuda_with_stream`] so that every thread
    /// uses the same compute stream (candle-internals.md H6).
    pub fn new(store: Arc<HostStore>, device: &Device, cfg: &OffloadConfig) -> Result<Self> {
        if cfg.prefetch_depth > MAX_PREFETCH_DEPTH {
            return Err(Error::InvalidConfig {
                field: "prefetch_depth".into(),
                reason: format!("{} is more than {MAX_PREFETCH_DEPTH}", cfg.prefetch_depth),
            });
        }
        cfg.tuning.validate().map_err(|e| Error::InvalidConfig {
            field: format!("tuning.{}", e.key),
            reason: e.reason,
        })?;
        let threads = cfg.tuning.threads();
        let pool = candle_offload_kernels::pool::ask_threads(threads);
        if pool != threads {
            tracing::warn!(
                "the CPU matmul pool has {pool} threads (sized by an earlier runtime), not the \
                 {threads} this one's tuning asks for"
            );
        }
        let engine = match device {
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
        };
        let name = device_label(device);
        let total = match &engine {
            Engine::Cuda(e) => Some(e.mem_get_info()?),
            Engine::Cpu => None,
        };
        let limit = match (&cfg.gpu_memory_limit, total) {
            (Some(l), t) => l.resolve(&name, t.map(|(_, total)| total))?,
            (None, Some((free, _))) => free,
            (None, None) => u64::MAX / 4,
        };
        let budget = Budget {
            limit_bytes: limit,
            reserve_bytes: cfg.reserve_bytes,
        };
        let mut unit_bytes = store.unit_bytes();
        let mut own_bytes = store.resident_unit_bytes();
        let mut served = vec![true; unit_bytes.len()];
        if let Some(names) = &cfg.units {
            served = vec![false; unit_bytes.len()];
            for name in names {
                let id = store.unit_id(name).ok_or_else(|| Error::Unknown {
                    what: "unit",
                    name: name.clone(),
                })?;
                served[id.0] = true;
            }
            // Units of other runtimes take no room here and are never acquired.
            for ((b, o), &s) in unit_bytes.iter_mut().zip(&mut own_bytes).zip(&served) {
                if !s {
                    (*b, *o) = (0, 0);
                }
            }
        }
        let mut keep_ids = Vec::new();
        for name in &cfg.keep {
            keep_ids.push(store.unit_id(name).ok_or_else(|| Error::Unknown {
                what: "unit",
                name: name.clone(),
            })?);
        }
        // Units that stay for good take their own sizes, without the streaming padding; when
        // not every unit fits, the ones that stay are kept from then on.
        let steady = Budget {
            reserve_bytes: cfg
                .steady_reserve_bytes
                .map_or(budget.reserve_bytes, |r| r.min(budget.reserve_bytes)),
            ..budget
        };
        let (own_size, steady_fits) = staying(
            budget,
            steady,
            &unit_bytes,
            &own_bytes,
            &served,
            &keep_ids,
            cfg,
        );
        for (i, &own) in own_size.iter().enumerate() {
            if own {
                unit_bytes[i] = own_bytes[i];
                if !steady_fits && !keep_ids.contains(&UnitId(i)) {
                    keep_ids.push(UnitId(i));
                }
            }
        }
        // Kept units are counted once, in `kept`; the largest of the others must fit beside them.
        let need = weight_need(|i| unit_bytes[i], &served, &keep_ids);
        let kept = need.kept;
        let largest = (0..unit_bytes.len())
            .filter(|i| served[*i] && !keep_ids.contains(&UnitId(*i)))
            .max_by_key(|&i| unit_bytes[i]);
        let what = match largest {
            Some(i) if kept > 0 => format!(
                "the kept units ({}) and the largest other unit, {} ({})",
                crate::budget::human_bytes(kept),
                store.unit(UnitId(i)).name(),
                crate::budget::human_bytes(unit_bytes[i])
            ),
            Some(i) => format!("the largest unit, {}", store.unit(UnitId(i)).name()),
            None => format!("the kept units ({})", crate::budget::human_bytes(kept)),
        };
        // With an order given up front, what must fit is the units in it: a unit served but
        // outside the order (a host layer that a prompt runs here, see the models crate) is
        // fetched only now and then, and is the first victim when it is. A model whose steady
        // sweep fits needs no spare room for copies ahead of their victims.
        let steady = match &cfg.policy {
            PolicyChoice::Schedule(order) if !order.is_empty() => {
                let mut counted = vec![false; unit_bytes.len()];
                let mut steady = kept;
                for u in order {
                    if u.0 < counted.len() && served[u.0] && !counted[u.0] && !keep_ids.contains(u)
                    {
                        counted[u.0] = true;
                        steady = steady.saturating_add(unit_bytes[u.0]);
                    }
                }
                steady
            }
            _ => need.all(),
        };
        let resize = Resize {
            device: name.clone(),
            need,
            what,
            strategy: cfg.strategy,
            asked_depth: cfg.prefetch_depth,
            steady,
        };
        let (plan, spare_depth) = resize.plan(budget)?;
        // Managed units may not stream: once the driver has migrated a page to the GPU it keeps
        // the device memory after migrating the page back, so a managed model that streams
        // grows the device's use to its whole size whatever the budget (ARCHITECTURE.md,
        // invariants). Managed memory therefore only serves what fits in the capacity.
        // The served managed units: (bytes, the GPU their memory belongs to).
        let managed_units: Vec<(u64, usize)> = (0..unit_bytes.len())
            .filter(|&i| served[i])
            .filter_map(|i| {
                let ordinal = store.unit(UnitId(i)).buffer().managed()?.ordinal();
                Some((unit_bytes[i], ordinal))
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
                    crate::budget::human_bytes(managed),
                    crate::budget::human_bytes(plan.weight_capacity),
                ),
            });
        }
        let stays: Vec<bool> = (0..unit_bytes.len())
            .map(|i| served[i] && (plan.fits_entirely || keep_ids.contains(&UnitId(i))))
            .collect();
        let mut cache = ResidencyCache::new(&unit_bytes, plan.weight_capacity, cfg.policy.clone())
            .with_prefetch_depth(spare_depth);
        for &u in &keep_ids {
            cache.set_keep(u, true);
        }
        tracing::info!(
            device = %name,
            budget = limit,
            capacity = plan.weight_capacity,
            depth = plan.prefetch_depth,
            strategy = %cfg.strategy,
            "offload runtime ready"
        );
        let n = unit_bytes.len();
        let serves_disk =
            (0..n).any(|i| served[i] && store.unit(UnitId(i)).tier() == TierKind::Disk);
        let read_pool = if serves_disk {
            match crate::sys::ReadPool::new(READ_THREADS) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start the read-ahead threads; disk units are read when fetched");
                    None
                }
            }
        } else {
            None
        };
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
                state: Mutex::new(State {
                    cache,
                    resident: (0..n).map(|_| None).collect(),
                    retired: Vec::new(),
                    telemetry: Telemetry::new(),
                    history: None,
                    #[cfg(feature = "fault-injection")]
                    injected_failures: 0,
                    reservation_parts: Vec::new(),
                    read_ahead: Vec::new(),
                    capturing: false,
                    spare_blocks: Vec::new(),
                    trim_pending: false,
                    generation: 0,
                    replayed: false,
                }),
            }),
        })
    }

    /// The device weights are brought to.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// The host store.
    pub fn store(&self) -> &Arc<HostStore> {
        &self.shared.store
    }

    /// The performance choices this runtime was configured with
    /// ([`OffloadConfig::tuning`]): what the layers built over it pass to the ops.
    pub fn tuning(&self) -> &Tuning {
        &self.shared.tuning
    }

    /// The resolved budget.
    pub fn budget(&self) -> Budget {
        Budget {
            limit_bytes: self.shared.limit_bytes,
            reserve_bytes: self.shared.reserve.load(Ordering::Relaxed),
        }
    }

    /// The prefetch depth in force.
    pub fn prefetch_depth(&self) -> usize {
        self.shared.prefetch_depth.load(Ordering::Relaxed)
    }

    fn state(&self) -> candle_core::Result<MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(lock_err)
    }

    /// Brings `unit` to the device (if it is not there) and pins it until the guard drops.
    /// Compute-stream work enqueued after this call sees the unit's weights; then the next
    /// units of the learned or given schedule are prefetched.
    pub fn acquire(&self, unit: UnitId) -> candle_core::Result<UnitGuard> {
        let _span = tracing::debug_span!("offload.acquire", unit = unit.0).entered();
        self.check_served(unit)?;
        let mut st = self.state()?;
        let transfer = st
            .cache
            .acquire(unit)
            .map_err(|e| self.cache_error(unit, e))?;
        let mut transfer = transfer;
        if transfer.fetch.is_none() && st.resident[unit.0].is_none() {
            // Admitted by a prefetch whose copy failed earlier: fetch it now.
            transfer.fetch = Some(unit);
        }
        if let Err(e) = self.carry_out(&mut st, &transfer, "miss") {
            st.cache.release(unit);
            return Err(e);
        }
        let capturing = st.capturing;
        let Some(resident) = st.resident[unit.0].as_mut() else {
            st.cache.release(unit);
            candle_core::bail!(
                "unit {} is not on the device after its fetch",
                self.shared.store.unit(unit).name()
            );
        };
        if let (Engine::Cuda(engine), Some(sync)) = (&self.shared.engine, resident.sync.as_mut()) {
            if !capturing {
                engine.wait_ready(sync)?;
            } else if !engine.is_ready(sync)? {
                let name = self.shared.store.unit(unit).name().to_string();
                st.cache.release(unit);
                candle_core::bail!(
                    "unit {name} is still being copied: a captured step needs every unit ready"
                );
            }
        }
        let weights = resident.weights.clone();
        self.log(&mut st, EventKind::Acquire, Some(unit), 0, "", None);
        // Reads of the disk units the planned fetches take next start first (several fetches
        // starting at once then read their files in parallel), and the window is topped up
        // past them once they have started.
        self.read_ahead(&mut st);
        self.start_planned(
            &mut st,
            self.shared.prefetch_depth.load(Ordering::Relaxed) + 1,
        );
        self.read_ahead(&mut st);
        Ok(UnitGuard {
            rt: self.clone(),
            unit,
            weights,
        })
    }

    /// [`acquire`](Self::acquire) by unit name (`model.layers.3`).
    pub fn acquire_named(&self, name: &str) -> candle_core::Result<UnitGuard> {
        let id = self
            .shared
            .store
            .unit_id(name)
            .ok_or_else(|| RuntimeError::Unknown {
                what: "unit",
                name: name.to_string(),
            })?;
        self.acquire(id)
    }

    /// [`acquire`](Self::acquire) of the unit of decoder layer `idx`.
    pub fn acquire_layer(&self, idx: usize) -> candle_core::Result<UnitGuard> {
        let id = self
            .shared
            .store
            .layer_unit(idx)
            .ok_or_else(|| RuntimeError::Unknown {
                what: "layer unit",
                name: idx.to_string(),
            })?;
        self.acquire(id)
    }

    /// Under the schedule policy, starts every planned fetch that can start now, up to
    /// `max_ahead` ahead of their use (the acquire path keeps only `prefetch_depth + 1` ahead).
    /// For a device that is about to idle, such as a pipeline stage whose layers have run for
    /// this token: its copy stream then works while the other stages compute. Victims are only
    /// units not needed before the fetched one, so nothing is moved twice. Returns the number
    /// of fetches started.
    pub fn prefetch_ahead(&self, max_ahead: usize) -> candle_core::Result<usize> {
        let mut st = self.state()?;
        self.read_ahead(&mut st);
        let n = self.start_planned(&mut st, max_ahead);
        self.read_ahead(&mut st);
        Ok(n)
    }

    /// Starts reading the next [`READ_AHEAD_UNITS`] disk units of the plan's fetches (those
    /// not started yet) from their files, and drops read-aheads the plan no longer fetches
    /// next, so that at most that many units are staged at a time.
    fn read_ahead(&self, st: &mut State) {
        let Some(pool) = &self.shared.read_pool else {
            return;
        };
        let store = &self.shared.store;
        let want: Vec<UnitId> = st
            .cache
            .upcoming_fetches(usize::MAX)
            .into_iter()
            .filter(|u| self.shared.served[u.0] && store.unit(*u).tier() == TierKind::Disk)
            .take(READ_AHEAD_UNITS)
            .collect();
        st.read_ahead.retain(|u| {
            let keep = want.contains(u);
            if !keep {
                store.unit(*u).buffer().end_read_ahead();
            }
            keep
        });
        for u in want {
            if !st.read_ahead.contains(&u) && store.unit(u).buffer().read_ahead(pool) {
                st.read_ahead.push(u);
                st.telemetry.read_ahead.issued += 1;
            }
        }
    }

    /// Starts the schedule's planned fetches, up to `max_ahead` ahead of their use; returns
    /// how many. A failed prefetch fails nothing: the unit is fetched again when needed.
    fn start_planned(&self, st: &mut State, max_ahead: usize) -> usize {
        if st.capturing {
            return 0;
        }
        let planned = st.cache.prefetch_planned(max_ahead);
        let n = planned.len();
        for t in planned {
            if let Err(e) = self.carry_out(st, &t, "prefetch") {
                tracing::warn!(error = %e, "prefetch failed; the unit will be fetched on demand");
            }
        }
        n
    }

    /// Fetches every served unit that stays on the device for good (the kept ones, or every
    /// served unit when they all fit the weights' capacity) and is not there yet, so that a
    /// model's first step finds them there: the copies that step would make (a whole CPU
    /// model's tensors copied out of the store, a resident GPU model's uploads, started on the
    /// copy stream) happen now, as part of loading. Units that stream are left to the steps.
    /// Returns the bytes fetched.
    pub fn warm_up(&self) -> candle_core::Result<u64> {
        let _span = tracing::debug_span!("offload.warm_up").entered();
        let mut bytes = 0;
        for i in 0..self.shared.served.len() {
            if self.shared.stays[i] && self.prefetch(UnitId(i))? {
                bytes += self.shared.size_of(UnitId(i));
            }
        }
        Ok(bytes)
    }

    /// Hints that `unit` will be needed soon: fetches it if that evicts nothing needed sooner.
    /// Returns whether a fetch was issued.
    pub fn prefetch(&self, unit: UnitId) -> candle_core::Result<bool> {
        self.check_served(unit)?;
        let mut st = self.state()?;
        match st.cache.prefetch(unit) {
            Some(t) => {
                self.carry_out(&mut st, &t, "prefetch")?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn check_served(&self, unit: UnitId) -> candle_core::Result<()> {
        match self.shared.served.get(unit.0) {
            Some(true) => Ok(()),
            Some(false) => Err(RuntimeError::NotServed {
                unit: self.shared.store.unit(unit).name().to_string(),
                device: device_label(&self.shared.device),
            }
            .into()),
            None => Err(RuntimeError::Unknown {
                what: "unit",
                name: unit.to_string(),
            }
            .into()),
        }
    }

    fn release(&self, unit: UnitId) -> candle_core::Result<()> {
        let mut st = self.state()?;
        let capturing = st.capturing;
        if let (
            Engine::Cuda(engine),
            Some(Resident {
                sync: Some(sync), ..
            }),
        ) = (&self.shared.engine, st.resident[unit.0].as_mut())
        {
            if !capturing {
                engine.record_last_use(sync)?;
            }
        }
        st.cache.release(unit);
        Ok(())
    }

    fn cache_error(&self, unit: UnitId, e: CacheError) -> candle_core::Error {
        let budget = self.budget();
        let unit = match self.shared.served.get(unit.0) {
            Some(_) => self.shared.store.unit(unit).name().to_string(),
            None => unit.to_string(),
        };
        match e {
            CacheError::UnknownUnit(_) => RuntimeError::Unknown {
                what: "unit",
                name: unit,
            },
            cause => RuntimeError::BudgetExhausted {
                device: device_label(&self.shared.device),
                unit,
                budget_mib: budget.limit_bytes >> 20,
                reserve_mib: budget.reserve_bytes >> 20,
                cause,
            },
        }
        .into()
    }

    /// Evicts and fetches as the cache decided. A failed fetch is rolled back in the cache; an
    /// allocation the driver refuses is retried once after evicting every idle unit.
    fn carry_out(
        &self,
        st: &mut State,
        t: &Transfer,
        reason: &'static str,
    ) -> candle_core::Result<()> {
        if st.capturing && (t.fetch.is_some() || !t.evict.is_empty()) {
            candle_core::bail!(
                "a captured step cannot move units (every unit has to stay resident)"
            );
        }
        for &v in &t.evict {
            self.drop_unit(st, v, "victim", true)?;
        }
        let Some(u) = t.fetch else { return Ok(()) };
        let unit = self.shared.store.unit(u);
        let size = self.shared.size_of(u);
        let _span =
            tracing::debug_span!("offload.fetch", unit = unit.name(), bytes = size).entered();
        let started = std::time::Instant::now();
        if unit.tier() == TierKind::Disk {
            let r = &mut st.telemetry.read_ahead;
            r.disk_fetches += 1;
            match unit.buffer().read_ahead_state() {
                ReadAhead::Ready => r.ready += 1,
                ReadAhead::InFlight => r.waited += 1,
                ReadAhead::None => {}
            }
        }
        self.trim_if_pending(st)?;
        let uploaded = self.attempt_upload(st, u);
        // Its read-ahead (if any) has served this fetch, or failed it: free the bytes.
        if let Some(k) = st.read_ahead.iter().position(|&r| r == u) {
            st.read_ahead.swap_remove(k);
            unit.buffer().end_read_ahead();
        }
        let uploaded = match uploaded {
            Ok(x) => Ok(x),
            Err(first) => {
                // The driver refused (or the copy failed): make room and try once more.
                let idle = st.cache.evict_idle_except(Some(u));
                tracing::warn!(unit = unit.name(), error = %first, evicted = idle.len(), "fetch failed; evicting idle units and retrying once");
                for v in idle {
                    self.drop_unit(st, v, "idle", true)?;
                }
                self.attempt_upload(st, u).map_err(|second| {
                    let budget = self.budget();
                    let resident: Vec<&str> = st
                        .cache
                        .present_units()
                        .into_iter()
                        .filter(|&r| r != u)
                        .map(|r| self.shared.store.unit(r).name())
                        .collect();
                    candle_core::Error::from(RuntimeError::FetchFailed {
                        unit: unit.name().to_string(),
                        unit_mib: size.div_ceil(1 << 20),
                        error: second.to_string(),
                        first_error: first.to_string(),
                        budget_mib: budget.limit_bytes >> 20,
                        reserve_mib: budget.reserve_bytes >> 20,
                        resident_mib: st.cache.used().saturating_sub(size) >> 20,
                        resident: resident.into_iter().map(str::to_string).collect(),
                    })
                })
            }
        };
        let (weights, sync) = match uploaded {
            Ok(x) => x,
            Err(e) => {
                st.cache.abort(u);
                return Err(e);
            }
        };
        st.telemetry.fetched(size);
        if matches!(self.shared.engine, Engine::Cpu) {
            st.telemetry.timings(Timings {
                copy_s: Some(started.elapsed().as_secs_f64()),
                stall_s: 0.0,
            });
        }
        st.resident[u.0] = Some(Resident { weights, sync });
        st.generation += 1;
        self.log(st, EventKind::Fetch, Some(u), size, reason, None);
        let used = st.cache.used();
        st.telemetry.peak_resident = st.telemetry.peak_resident.max(used);
        Ok(())
    }

    /// Before a fetch, where an upload freed evicted buffers whose room no new buffer took back
    /// ([`SpareUse::stranded`]): waits for the device and gives the weight pool's freed memory
    /// back to the driver.
    ///
    /// The pool serves an allocation from a freed block of the size it needs; a freed block of
    /// another size stays mapped beside the new one. Units of one size take evicted buffers as
    /// they are, and a buffer freed for a tensor of another block type but the same padded
    /// size (layers of mixed block types streaming alike) comes straight back out of the pool;
    /// own sizes mixed with padded ones do not: a stage keeping its layers at their own sizes
    /// while a prompt streamed padded host layers through it (GGML layers of mixed block
    /// types) held more than it used and went over its budget. Trimming after every unmatched
    /// free instead synced several times a decode step where Q6_K and Q4_K layers alternate at
    /// one size (docs/tuning.md).
    fn trim_if_pending(&self, st: &mut State) -> candle_core::Result<()> {
        if !st.trim_pending {
            return Ok(());
        }
        st.trim_pending = false;
        if matches!(self.shared.engine, Engine::Cuda(_)) {
            crate::sys::trim_weight_pool(&self.shared.device)?;
            st.telemetry.trimmed();
            tracing::debug!("weight pool trimmed before a fetch");
        }
        Ok(())
    }

    /// One upload attempt, failing instead while injected faults remain.
    fn attempt_upload(
        &self,
        st: &mut State,
        u: UnitId,
    ) -> candle_core::Result<(Weights, Option<UnitSync>)> {
        #[cfg(feature = "fault-injection")]
        if st.injected_failures > 0 {
            st.injected_failures -= 1;
            candle_core::bail!(
                "injected fault: the allocation was refused (as CUDA_ERROR_OUT_OF_MEMORY would be)"
            );
        }
        let (weights, sync, spares) = self.upload(u, &mut st.spare_blocks)?;
        st.telemetry.reused(spares.taken);
        // The spares it did not take were freed; where no new buffer took their room back at
        // their sizes, the pool keeps it (`trim_if_pending`).
        st.trim_pending |= spares.stranded;
        Ok((weights, sync))
    }

    /// For testing fault handling: the next `n` fetches fail as if the driver had refused
    /// their allocation. Only with the `fault-injection` feature (for tests, off by default).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fetch_failures(&self, n: u32) -> candle_core::Result<()> {
        self.state()?.injected_failures = n;
        Ok(())
    }

    /// Uploads `u`, its GGML blocks into `spare`'s buffers where they match (taken out of it),
    /// and says what it did with the others ([`SpareUse`]).
    fn upload(
        &self,
        u: UnitId,
        spare: &mut Vec<QTensor>,
    ) -> candle_core::Result<(Weights, Option<UnitSync>, SpareUse)> {
        let unit = self.shared.store.unit(u);
        match &self.shared.engine {
            Engine::Cpu => Ok((self.cpu_weights(unit)?, None, SpareUse::default())),
            Engine::Cuda(engine) => {
                let items: Vec<UploadItem<'_>> = unit
                    .tensors()
                    .iter()
                    .map(|t| UploadItem {
                        name: &t.name,
                        range: t.offset..t.offset + t.nbytes,
                        shape: &t.shape,
                        layout: match t.format {
                            WeightFormat::Dense(d) => DeviceLayout::Dense(d),
                            WeightFormat::Ggml(ggml) => DeviceLayout::Blocks {
                                ggml,
                                device_len: if self.shared.own_size[u.0] {
                                    t.own_device_bytes
                                } else {
                                    t.device_bytes
                                },
                            },
                        },
                    })
                    .collect();
                // The read lock keeps `update_weights` out while the copies are enqueued.
                let tier = unit.buffer();
                let (uploaded, sync, spares) =
                    engine.upload(unit.name(), &**tier, &items, self.shared.trainable, spare)?;
                let mut dense = HashMap::with_capacity(unit.tensors().len());
                let mut quantized = HashMap::new();
                for (t, w) in unit.tensors().iter().zip(uploaded) {
                    match (w, t.format) {
                        (DeviceWeight::Dense(x), _) => {
                            dense.insert(t.name.clone(), x);
                        }
                        (DeviceWeight::Blocks(q), WeightFormat::Ggml(g)) => {
                            quantized.insert(t.name.clone(), (g, Arc::new(*q)));
                        }
                        (DeviceWeight::Blocks(_), f) => {
                            candle_core::bail!("tensor {}: {f} uploaded as blocks", t.name)
                        }
                    }
                }
                Ok((Weights::new(dense, quantized), Some(sync), spares))
            }
        }
    }

    /// The CPU "fetch": dense tensors and quantized tensors copied out of the host store.
    fn cpu_weights(&self, unit: &HostUnit) -> candle_core::Result<Weights> {
        let mut dense = HashMap::with_capacity(unit.tensors().len());
        let mut quantized = HashMap::new();
        for t in unit.tensors() {
            match t.format {
                WeightFormat::Dense(_) => {
                    let mut tensor = unit.cpu_tensor(t)?;
                    if self.shared.trainable {
                        tensor = candle_core::Var::from_tensor(&tensor)?.into_inner();
                    }
                    dense.insert(t.name.clone(), tensor);
                }
                WeightFormat::Ggml(g) => {
                    let q = Arc::new(unit.cpu_qtensor(t)?);
                    quantized.insert(t.name.clone(), (g, q));
                }
            }
        }
        Ok(Weights::new(dense, quantized))
    }

    /// Evicts `v`; with `recycle`, its quantized buffers go to `st.spare_blocks` for the next
    /// fetch, instead of back to the pool.
    fn drop_unit(
        &self,
        st: &mut State,
        v: UnitId,
        reason: &'static str,
        recycle: bool,
    ) -> candle_core::Result<()> {
        let Some(Resident { mut weights, sync }) = st.resident[v.0].take() else {
            return Ok(());
        };
        st.generation += 1;
        self.log(
            st,
            EventKind::Evict,
            Some(v),
            self.shared.size_of(v),
            reason,
            None,
        );
        tracing::debug!(unit = self.shared.store.unit(v).name(), "evict");
        if weights.is_shared() {
            tracing::warn!(
                unit = self.shared.store.unit(v).name(),
                "an evicted unit's tensors are still referenced; its memory is freed only when they drop"
            );
        }
        match (&self.shared.engine, sync) {
            (Engine::Cuda(engine), Some(mut sync)) => {
                if st.replayed {
                    // Replays used the unit without recording its use: after all of them.
                    engine.record_last_use(&mut sync)?;
                }
                let blocks = !weights.quantized.is_empty();
                let spare = if recycle {
                    weights.take_unique_blocks()
                } else {
                    Vec::new()
                };
                // After the eviction's waits: the copy stream has waited for the last use.
                engine.evict(weights, &sync, blocks)?;
                st.spare_blocks.extend(spare);
                if let Some(t) = engine.harvest(&mut sync) {
                    st.telemetry.timings(t);
                }
                if !sync.is_settled() {
                    st.retired.push(sync);
                }
            }
            _ => drop(weights),
        }
        Ok(())
    }

    /// Collects the device timings of completed copies and waits (never blocks).
    fn harvest(&self, st: &mut State) {
        let Engine::Cuda(engine) = &self.shared.engine else {
            return;
        };
        let mut timings = Vec::new();
        for r in st.resident.iter_mut().flatten() {
            if let Some(sync) = r.sync.as_mut() {
                timings.extend(engine.harvest(sync));
            }
        }
        st.retired.retain_mut(|sync| {
            timings.extend(engine.harvest(sync));
            !sync.is_settled()
        });
        for t in timings {
            st.telemetry.timings(t);
        }
    }

    fn log(
        &self,
        st: &mut State,
        kind: EventKind,
        unit: Option<UnitId>,
        bytes: u64,
        reason: &'static str,
        device_used_bytes: Option<u64>,
    ) {
        let resident_bytes = st.cache.used();
        if let Some(rec) = st.history.as_mut() {
            rec.events.push(MemoryEvent {
                t_s: rec.start.elapsed().as_secs_f64(),
                kind,
                unit: unit.map(|u| self.shared.store.unit(u).name().to_string()),
                bytes,
                reason,
                resident_bytes,
                device_used_bytes,
            });
        }
    }

    /// Starts (or stops) recording every fetch, eviction and step with time, bytes, unit and
    /// reason; on a GPU, step markers carry the device memory measured outside the allocator.
    pub fn record_history(&self, on: bool) -> candle_core::Result<()> {
        let baseline = match (&self.shared.engine, on) {
            (Engine::Cuda(e), true) => Some(e.mem_get_info().map(|(free, total)| total - free)?),
            _ => None,
        };
        let mut st = self.state()?;
        let reserve = self.budget().reserve_bytes;
        st.history = on.then(|| Recording {
            start: std::time::Instant::now(),
            baseline,
            reserve,
            events: Vec::new(),
        });
        Ok(())
    }

    /// Changes the reservation beside the weights to `reserve` bytes, between passes: a model
    /// reserves its prompt's activations while a prompt runs and gives that room to weights
    /// while it decodes. The budget's limit stays; the weights' capacity is planned again as
    /// at the start (refused when the reservation leaves no room for the largest unit). A
    /// smaller capacity evicts idle units first (refused when units in use hold more). Either
    /// way the device waits for its work and the memory pool returns what it caches unused to
    /// the driver, so that blocks freed in one phase's shapes do not add to the next one's
    /// peak (the budget is measured outside the allocator). Nothing happens when the
    /// reservation is unchanged.
    pub fn set_reserve_bytes(&self, reserve: u64) -> candle_core::Result<()> {
        let old = self.budget();
        if reserve == old.reserve_bytes {
            return Ok(());
        }
        let _span = tracing::debug_span!("offload.set_reserve", reserve).entered();
        let budget = Budget {
            limit_bytes: old.limit_bytes,
            reserve_bytes: reserve,
        };
        let (plan, spare) = self
            .shared
            .resize
            .plan(budget)
            .map_err(candle_core::Error::wrap)?;
        {
            let mut st = self.state()?;
            let victims = st
                .cache
                .set_capacity(plan.weight_capacity, spare)
                .map_err(|cause| {
                    candle_core::Error::from(RuntimeError::BudgetExhausted {
                        device: device_label(&self.shared.device),
                        unit: "(a reservation change)".into(),
                        budget_mib: budget.limit_bytes >> 20,
                        reserve_mib: reserve >> 20,
                        cause,
                    })
                })?;
            for v in victims {
                self.drop_unit(&mut st, v, "reserve", false)?;
            }
            // The room evicted units' buffers held may go to the new reservation.
            st.spare_blocks.clear();
            self.shared.reserve.store(reserve, Ordering::Relaxed);
            self.log(&mut st, EventKind::Reserve, None, reserve, "reserve", None);
            self.shared
                .prefetch_depth
                .store(plan.prefetch_depth, Ordering::Relaxed);
        }
        tracing::debug!(
            reserve,
            capacity = plan.weight_capacity,
            depth = plan.prefetch_depth,
            "reservation changed"
        );
        if let Engine::Cuda(e) = &self.shared.engine {
            e.synchronize()?;
            crate::sys::trim_memory_pool(&self.shared.device)?;
        }
        Ok(())
    }

    /// Names the parts of the reservation (KV cache, activations, ...) for the memory history
    /// and its timeline; the parts should add up to `reserve_bytes`.
    pub fn declare_reservation(&self, parts: &[(&str, u64)]) -> candle_core::Result<()> {
        self.state()?.reservation_parts = parts.iter().map(|(n, b)| (n.to_string(), *b)).collect();
        Ok(())
    }

    /// The history recorded so far (`None` when not recording).
    pub fn history(&self) -> candle_core::Result<Option<MemoryHistory>> {
        let st = self.state()?;
        Ok(st.history.as_ref().map(|rec| MemoryHistory {
            device: device_label(&self.shared.device),
            budget_bytes: self.budget().limit_bytes,
            reserve_bytes: rec.reserve,
            weight_capacity_bytes: st.cache.capacity(),
            baseline_device_bytes: rec.baseline,
            reservation_parts: st.reservation_parts.clone(),
            events: rec.events.clone(),
        }))
    }

    fn step_marker(&self, st: &mut State, kind: EventKind) -> candle_core::Result<()> {
        if st.history.is_some() {
            let used = match &self.shared.engine {
                Engine::Cuda(e) => Some(e.mem_get_info().map(|(free, total)| total - free)?),
                Engine::Cpu => None,
            };
            self.log(st, kind, None, 0, "", used);
        }
        Ok(())
    }

    /// Leak-check mode: runs `step` `steps` times and fails as soon as, after `warmup` steps,
    /// the resident weights, the pinned host bytes, or (on a GPU) the device memory measured
    /// outside the allocator differ from their values after warm-up by more than
    /// `tolerance_bytes` (resident and pinned bytes must match exactly).
    pub fn leak_check(
        &self,
        steps: usize,
        warmup: usize,
        tolerance_bytes: u64,
        mut step: impl FnMut(usize) -> candle_core::Result<()>,
    ) -> candle_core::Result<LeakReport> {
        let measure = |rt: &Self| -> candle_core::Result<(u64, u64, Option<u64>)> {
            let s = rt.stats()?;
            let used = rt.device_memory()?.map(|(free, total)| total - free);
            Ok((s.resident_bytes, s.pinned_bytes, used))
        };
        let mut baseline = None;
        let mut max_drift = 0u64;
        for i in 0..steps {
            step(i)?;
            self.synchronize()?;
            let now = measure(self)?;
            match baseline {
                None if i + 1 >= warmup => baseline = Some(now),
                None => {}
                Some((resident, pinned, used)) => {
                    let drift = now.2.zip(used).map_or(0, |(a, b)| a.abs_diff(b));
                    max_drift = max_drift.max(drift);
                    if now.0 != resident || now.1 != pinned || drift > tolerance_bytes {
                        candle_core::bail!(
                            "leak check failed at step {i}: resident weights {} -> {} B, pinned {} -> {} B, \
                             device memory moved {drift} B (tolerance {tolerance_bytes} B)",
                            resident,
                            now.0,
                            pinned,
                            now.1
                        );
                    }
                }
            }
        }
        Ok(LeakReport {
            steps,
            warmup,
            max_device_drift_bytes: max_drift,
        })
    }

    /// Starts a step (a token, a training step) for the per-step counters.
    pub fn begin_step(&self) -> candle_core::Result<()> {
        let mut st = self.state()?;
        self.harvest(&mut st);
        st.telemetry.begin_step();
        self.step_marker(&mut st, EventKind::StepBegin)
    }

    /// Ends a step. Call it after the step's results reached the host (a sampled token), so
    /// that its copies have completed and their device timings can be read.
    pub fn end_step(&self) -> candle_core::Result<()> {
        let mut st = self.state()?;
        self.harvest(&mut st);
        st.telemetry.end_step();
        self.step_marker(&mut st, EventKind::StepEnd)
    }

    /// Whether every unit this runtime serves is on its device with its copies done: what
    /// [`capture_step`](Self::capture_step) needs (a fully resident model after its first
    /// pass). Always false off the GPU.
    pub fn all_resident(&self) -> candle_core::Result<bool> {
        let served = self.shared.served.iter().enumerate().filter(|(_, s)| **s);
        self.resident_all_of(served.map(|(u, _)| UnitId(u)))
    }

    /// [`all_resident`](Self::all_resident) for `units` only (a capture of part of a step,
    /// whose runtime also serves units it does not run). Always false off the GPU.
    pub fn resident_all_of(
        &self,
        units: impl IntoIterator<Item = UnitId>,
    ) -> candle_core::Result<bool> {
        let Engine::Cuda(engine) = &self.shared.engine else {
            return Ok(false);
        };
        let st = self.state()?;
        for UnitId(u) in units {
            match st.resident.get(u).and_then(Option::as_ref) {
                Some(Resident {
                    sync: Some(sync), ..
                }) if engine.is_ready(sync)? => {}
                _ => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Captures the GPU work `f` enqueues (a decode step: its acquires, kernels and
    /// allocations) into a CUDA graph: [`replay_step`](Self::replay_step) runs it, as often as
    /// wanted, with one launch. `f` runs twice: once eagerly (a warm-up whose work is done, so
    /// `f` must give the same result when repeated), then captured, when nothing runs. While
    /// it runs, acquires neither move nor wait for units and record no uses: every unit has to
    /// be resident and ready ([`all_resident`](Self::all_resident)), or the capture is
    /// refused. `f` must leave nothing it allocated alive when it returns (write results into
    /// buffers allocated before), and everything the graph should read anew at each replay
    /// (token ids, the position) must live in such buffers too. An error from `f`, or a
    /// capture the driver refuses, is returned after the capture ended; the stream then runs
    /// as before.
    pub fn capture_step<R>(
        &self,
        f: impl FnMut() -> candle_core::Result<R>,
    ) -> candle_core::Result<(StepGraph, R)> {
        if self.shared.engine_is_cuda() && !self.all_resident()? {
            candle_core::bail!("a captured step needs every unit resident and ready");
        }
        self.capture_resident(f)
    }

    /// [`capture_step`](Self::capture_step) of work that acquires only `units` (each resident
    /// and ready, or the capture is refused), on a runtime that serves others too (a GPU
    /// stage that also serves host layers for prompts, capturing one run of its own layers).
    pub fn capture_step_of<R>(
        &self,
        units: &[UnitId],
        f: impl FnMut() -> candle_core::Result<R>,
    ) -> candle_core::Result<(StepGraph, R)> {
        if self.shared.engine_is_cuda() && !self.resident_all_of(units.iter().copied())? {
            candle_core::bail!("a captured run needs its units resident and ready");
        }
        self.capture_resident(f)
    }

    /// The capture behind [`capture_step`](Self::capture_step), once residency is checked.
    fn capture_resident<R>(
        &self,
        mut f: impl FnMut() -> candle_core::Result<R>,
    ) -> candle_core::Result<(StepGraph, R)> {
        let _span = tracing::debug_span!("offload.capture").entered();
        let Engine::Cuda(engine) = &self.shared.engine else {
            candle_core::bail!(
                "CUDA graphs need a GPU runtime, not {}",
                device_label(&self.shared.device)
            );
        };
        let generation = {
            let mut st = self.state()?;
            st.capturing = true;
            // From now on uses go unrecorded: evictions record a fresh last use (H19).
            st.replayed = true;
            st.generation
        };
        // The hand-over slot's buffer was allocated before: it must not be freed inside.
        candle_offload_kernels::forget_handover();
        let out = engine.capture(|| {
            let r = f();
            candle_offload_kernels::forget_handover();
            r
        });
        let mut st = self.state()?;
        st.capturing = false;
        let (graph, r) = out?;
        if st.generation != generation {
            candle_core::bail!("units moved while the step was captured");
        }
        drop(st);
        // The graph keeps one step's activations in memory of its own from its first launch;
        // the blocks earlier eager steps left cached in the pool go back to the driver, so the
        // two do not add up at the peak.
        engine.synchronize()?;
        crate::sys::trim_memory_pool(&self.shared.device)?;
        Ok((StepGraph { graph, generation }, r))
    }

    /// Launches `graph` on the device's compute stream (after everything enqueued there
    /// before) and returns true; returns false, launching nothing, when a unit arrived or
    /// left since the capture (the graph would read freed weights: capture again).
    pub fn replay_step(&self, graph: &StepGraph) -> candle_core::Result<bool> {
        let Engine::Cuda(engine) = &self.shared.engine else {
            candle_core::bail!("CUDA graphs need a GPU runtime");
        };
        let mut st = self.state()?;
        if st.generation != graph.generation {
            return Ok(false);
        }
        st.replayed = true;
        engine.replay(&graph.graph)?;
        Ok(true)
    }

    /// Waits for all copies and compute of this runtime's device to finish.
    pub fn synchronize(&self) -> candle_core::Result<()> {
        match &self.shared.engine {
            Engine::Cuda(e) => e.synchronize(),
            Engine::Cpu => Ok(()),
        }
    }

    /// Rewrites weights in the host store (after an optimizer step on host masters, say):
    /// waits for every copy in flight, drops the device copies of the units touched (kept ones
    /// too; they come back on their next use) and writes the new values, converted to the
    /// store's dtype. `values` are `(tensor name, value)`; a unit in use is refused, as is an
    /// unknown name, a unit this runtime does not serve ([`RuntimeError::NotServed`]) or a
    /// shape that differs from the stored one. Nothing is written when one value is refused.
    pub fn update_weights(&self, values: &[(String, Tensor)]) -> candle_core::Result<()> {
        let _span =
            tracing::debug_span!("offload.update_weights", tensors = values.len()).entered();
        let store = &self.shared.store;
        let mut by_unit: HashMap<UnitId, Vec<(&crate::store::TensorMeta, &Tensor)>> =
            HashMap::new();
        for (name, value) in values {
            let (u, meta) = store.tensor(name).ok_or_else(|| RuntimeError::Unknown {
                what: "tensor",
                name: name.clone(),
            })?;
            // Another stage's unit: writing it would change that stage's host copy behind
            // its resident one.
            self.check_served(u)?;
            by_unit.entry(u).or_default().push((meta, value));
        }
        let mut st = self.state()?;
        for &u in by_unit.keys() {
            if st.cache.in_use(u) {
                candle_core::bail!(
                    "cannot update {} while it is in use (a guard for it is alive)",
                    store.unit(u).name()
                );
            }
        }
        self.synchronize()?;
        for &u in by_unit.keys() {
            if st.cache.invalidate(u) {
                self.drop_unit(&mut st, u, "updated", false)?;
            }
        }
        drop(st);
        for (u, vals) in by_unit {
            store.unit(u).write(&vals)?;
        }
        Ok(())
    }

    /// Drops every unit that is not in use or kept.
    pub fn evict_all(&self) -> candle_core::Result<()> {
        let mut st = self.state()?;
        for v in st.cache.evict_idle() {
            self.drop_unit(&mut st, v, "evict_all", false)?;
        }
        st.spare_blocks.clear();
        st.trim_pending = true;
        Ok(())
    }

    /// Free and total memory of the device as the driver reports them (`None` on a CPU).
    pub fn device_memory(&self) -> candle_core::Result<Option<(u64, u64)>> {
        match &self.shared.engine {
            Engine::Cuda(e) => e.mem_get_info().map(Some),
            Engine::Cpu => Ok(None),
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> candle_core::Result<OffloadStats> {
        let mut st = self.state()?;
        self.harvest(&mut st);
        let store = &self.shared.store;
        let units = store
            .units()
            .iter()
            .enumerate()
            .map(|(i, u)| {
                let c = st.cache.counters(UnitId(i));
                UnitStats {
                    name: u.name().to_string(),
                    bytes: self.shared.size_of(UnitId(i)),
                    hits: c.hits,
                    misses: c.misses,
                    prefetches: c.prefetches,
                    evictions: c.evictions,
                    resident: st.cache.is_present(UnitId(i)),
                }
            })
            .collect();
        Ok(OffloadStats {
            device: device_label(&self.shared.device),
            budget_bytes: self.budget().limit_bytes,
            reserve_bytes: self.budget().reserve_bytes,
            weight_capacity_bytes: st.cache.capacity(),
            resident_bytes: st.cache.used(),
            peak_resident_bytes: st.telemetry.peak_resident,
            spare_bytes: st
                .spare_blocks
                .iter()
                .map(|q| q.storage_size_in_bytes() as u64)
                .sum(),
            pinned_bytes: store.pinned_bytes(),
            pageable_bytes: store.pageable_bytes(),
            managed_bytes: store.managed_bytes(),
            disk_bytes: store.disk_bytes(),
            disk_units: store.disk_units().into_iter().map(String::from).collect(),
            disk_direct_units: store
                .disk_direct_units()
                .into_iter()
                .map(String::from)
                .collect(),
            read_ahead: self.shared.read_pool.as_ref().map(|p| ReadAheadStats {
                threads: p.threads(),
                units_ahead: READ_AHEAD_UNITS,
                // The read-aheads in flight and the one spare buffer the pool keeps.
                staging_bound_bytes: (READ_AHEAD_UNITS as u64 + 1)
                    * store
                        .units()
                        .iter()
                        .filter(|u| u.tier() == TierKind::Disk)
                        .map(|u| u.buffer().len() as u64)
                        .max()
                        .unwrap_or(0),
                ..st.telemetry.read_ahead
            }),
            host_limit_bytes: store.host_limit_bytes(),
            host_memory: crate::diag::host_memory(),
            memlock_limit: crate::diag::memlock_limit(),
            prefetch_depth: self.shared.prefetch_depth.load(Ordering::Relaxed),
            policy: st.cache.active_policy(),
            steps: st.telemetry.steps,
            total: st.telemetry.total,
            last_step: st.telemetry.last_step,
            units,
        })
    }

    /// The printable summary (the seed's `memory_summary()`).
    pub fn memory_summary(&self) -> candle_core::Result<String> {
        Ok(self.stats()?.summary())
    }
}

/// What a passed [`OffloadRuntime::leak_check`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeakReport {
    /// Steps run.
    pub steps: usize,
    /// Steps before the baseline was taken.
    pub warmup: usize,
    /// The largest move of the device memory after warm-up (0 on a CPU).
    pub max_device_drift_bytes: u64,
}

/// A unit pinned on the device; its weights stay valid while the guard lives.
///
/// Dense tensors come out as `Tensor`s ([`get`](Self::get), [`tensors`](Self::tensors),
/// [`var_builder`](Self::var_builder)); GGML-quantized ones as `QTensor`s
/// ([`get_quantized`](Self::get_quantized), [`qmatmul`](Self::qmatmul)). Asking for a tensor
/// in the other form is an error naming the tensor and its format.
///
/// Dropping the guard records the unit's last use on the compute stream: build modules from
/// it, run them, and drop them before (or with) the guard.
#[derive(Debug)]
pub struct UnitGuard {
    rt: OffloadRuntime,
    unit: UnitId,
    weights: Weights,
}

impl UnitGuard {
    /// The unit.
    pub fn unit(&self) -> UnitId {
        self.unit
    }

    /// The performance choices of the runtime the unit came from ([`OffloadRuntime::tuning`]).
    pub fn tuning(&self) -> &Tuning {
        self.rt.tuning()
    }

    /// One of the unit's dense tensors by full name.
    pub fn get(&self, name: &str) -> candle_core::Result<Tensor> {
        if let Some(t) = self.weights.dense.get(name) {
            return Ok(t.clone());
        }
        if let Some(g) = self.weights.quantized_formats.get(name) {
            candle_core::bail!(
                "tensor {name} is stored as GGML {g:?} blocks, not as a dense tensor: use \
                 UnitGuard::get_quantized or UnitGuard::qmatmul"
            );
        }
        Err(candle_core::Error::CannotFindTensor {
            path: name.to_string(),
        }
        .bt())
    }

    /// All of the unit's dense tensors by full name.
    pub fn tensors(&self) -> &HashMap<String, Tensor> {
        &self.weights.dense
    }

    /// The names and GGML types of the unit's quantized tensors.
    pub fn quantized_tensors(&self) -> &HashMap<String, GgmlDType> {
        &self.weights.quantized_formats
    }

    /// One of the unit's GGML-quantized tensors by full name, on the runtime's device.
    pub fn get_quantized(&self, name: &str) -> candle_core::Result<Arc<QTensor>> {
        match self.weights.quantized.get(name) {
            Some(q) => Ok(q.clone()),
            None if self.weights.dense.contains_key(name) => {
                let dtype = self.weights.dense[name].dtype();
                candle_core::bail!(
                    "tensor {name} is a dense {dtype:?} tensor, not GGML blocks: use \
                     UnitGuard::get (or wrap it in QMatMul::Tensor)"
                )
            }
            None => Err(candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }
            .bt()),
        }
    }

    /// A `QMatMul` over one of the unit's GGML-quantized tensors (its weight, `[out, in]`).
    pub fn qmatmul(&self, name: &str) -> candle_core::Result<QMatMul> {
        QMatMul::from_arc(self.get_quantized(name)?)
    }

    /// A value built from this unit's tensors (a model's layer, say): `make` builds it the
    /// first time it is asked for while the unit is resident, and later guards of the same
    /// residency get that very value back, without building it again (a decode step then
    /// looks up no tensor by name). It is kept beside the unit's tensors and dropped with them
    /// when the unit leaves the device, so a unit fetched again builds it anew. One value per
    /// unit: asking for another type builds and keeps that one instead.
    ///
    /// The value should hold only the unit's own tensors (clones share their memory): anything
    /// else it allocates on the device stays allocated, outside the budget, for as long as
    /// the unit does.
    pub fn derived<T: std::any::Any + Send + Sync>(
        &self,
        make: impl FnOnce() -> candle_core::Result<T>,
    ) -> candle_core::Result<Arc<T>> {
        let mut slot =
            self.weights.derived.lock().map_err(|_| {
                candle_core::Error::Msg("a unit's derived value was poisoned".into())
            })?;
        if let Some(v) = slot.0.clone().and_then(|v| v.downcast::<T>().ok()) {
            return Ok(v);
        }
        let v = Arc::new(make()?);
        slot.0 = Some(v.clone());
        Ok(v)
    }

    /// A `VarBuilder` over the unit's dense tensors, rooted at the checkpoint's top level, so
    /// that existing candle-nn and candle-transformers `load(vb.pp("model.layers.3"), &cfg)`
    /// code runs unchanged. Tensors of another dtype than `dtype` are converted on the device.
    /// Asking it for a quantized tensor is an error that says so.
    pub fn var_builder(&self, dtype: DType) -> VarBuilder<'static> {
        VarBuilder::from_backend(
            Box::new(
                UnitBackend::new(self.weights.dense.clone())
                    .with_quantized(self.weights.quantized_formats.clone()),
            ),
            dtype,
            self.rt.shared.device.clone(),
        )
    }
}

impl Drop for UnitGuard {
    fn drop(&mut self) {
        if let Err(e) = self.rt.release(self.unit) {
            tracing::error!(unit = self.unit.0, error = %e, "releasing an offloaded unit failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{DType, Device, Module, Shape, Tensor};

    use super::*;
    use crate::store::{RawTensorSpec, StoreConfig, WeightFormat};

    /// A store with one layer holding a quantized matrix (raw blocks of `q`) and a dense
    /// vector, and a runtime over it on the CPU.
    fn runtime_with(q: &QTensor) -> anyhow::Result<OffloadRuntime> {
        let blocks = q.data()?.into_owned();
        let specs = [
            RawTensorSpec {
                name: "model.layers.0.proj.weight".into(),
                format: WeightFormat::Ggml(q.dtype()),
                shape: q.shape().clone(),
            },
            RawTensorSpec {
                name: "model.layers.0.norm.weight".into(),
                format: WeightFormat::Dense(DType::F32),
                shape: Shape::from(4),
            },
        ];
        let store = HostStore::from_raw(
            &specs,
            &StoreConfig::default(),
            &Device::Cpu,
            |s, f, dst| {
                if f.is_quantized() {
                    dst.copy_from_slice(&blocks);
                } else {
                    assert_eq!(f, WeightFormat::Dense(DType::F32), "{}", s.name);
                    for (i, c) in dst.chunks_mut(4).enumerate() {
                        c.copy_from_slice(&(i as f32).to_le_bytes());
                    }
                }
                Ok(())
            },
        )?;
        Ok(OffloadRuntime::new(
            Arc::new(store),
            &Device::Cpu,
            &OffloadConfig::default(),
        )?)
    }

    #[test]
    fn warm_up_fetches_what_stays_and_nothing_else() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let build = |limit: Option<u64>, keep: Vec<String>| -> anyhow::Result<OffloadRuntime> {
            let store = zero_layers(4, 256, &dev)?;
            Ok(OffloadRuntime::new(
                Arc::new(store),
                &dev,
                &OffloadConfig {
                    gpu_memory_limit: limit.map(crate::MemoryLimit::Bytes),
                    prefetch_depth: 0,
                    keep,
                    ..Default::default()
                },
            )?)
        };
        // Everything fits: every unit is fetched now, and a sweep fetches nothing more.
        let rt = build(None, Vec::new())?;
        let unit = rt.store().units()[0].bytes();
        assert_eq!(rt.warm_up()?, 4 * unit);
        assert_eq!(rt.stats()?.resident_bytes, 4 * unit);
        let fetched = rt.stats()?.total.fetches;
        for l in 0..4 {
            drop(rt.acquire_layer(l)?);
        }
        assert_eq!(rt.stats()?.total.fetches, fetched);
        // A second warm-up has nothing to do.
        assert_eq!(rt.warm_up()?, 0);
        // Two of four fit: only the kept unit is fetched; the others stream as steps need them.
        let rt = build(Some(2 * unit), vec!["model.layers.2".into()])?;
        assert_eq!(rt.warm_up()?, unit);
        assert_eq!(rt.stats()?.resident_bytes, unit);
        Ok(())
    }

    #[test]
    fn acquired_quantized_weights_match_candle_bit_for_bit() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q8_0, GgmlDType::Q4K] {
            let w = Tensor::randn(0f32, 1., (64, 512), &dev)?;
            let q = QTensor::quantize(&w, dtype)?;
            let reference = QMatMul::from_qtensor(QTensor::quantize(&w, dtype)?)?;
            let rt = runtime_with(&q)?;

            let unit = rt.store().unit(rt.store().layer_unit(0).unwrap());
            let (_, meta) = rt.store().tensor("model.layers.0.proj.weight").unwrap();
            assert_eq!(meta.format, WeightFormat::Ggml(dtype));
            assert_eq!(meta.nbytes, q.storage_size_in_bytes());
            let padding = 512 / dtype.block_size() * dtype.type_size();
            assert_eq!(meta.device_bytes, meta.nbytes + padding, "{dtype:?}");
            assert_eq!(unit.bytes(), (meta.device_bytes + 16) as u64);

            let g = rt.acquire_layer(0)?;
            let name = "model.layers.0.proj.weight";
            let got = g.get_quantized(name)?;
            assert_eq!(got.dtype(), dtype);
            assert_eq!(got.shape().dims(), [64, 512]);
            assert_eq!(&*got.data()?, &*q.data()?);
            let x = Tensor::randn(0f32, 1., (3, 512), &dev)?;
            let ours = g.qmatmul(name)?.forward(&x)?.to_vec2::<f32>()?;
            let theirs = reference.forward(&x)?.to_vec2::<f32>()?;
            assert_eq!(ours, theirs, "{dtype:?}");

            // The dense tensor of the same unit is a plain tensor.
            let norm = g.get("model.layers.0.norm.weight")?;
            assert_eq!(norm.to_vec1::<f32>()?, [0., 1., 2., 3.]);
            assert_eq!(g.quantized_tensors().get(name), Some(&dtype));
            assert!(!g.tensors().contains_key(name));
        }
        Ok(())
    }

    #[test]
    fn asking_for_the_wrong_form_is_a_clear_error() -> anyhow::Result<()> {
        let w = Tensor::randn(0f32, 1., (8, 32), &Device::Cpu)?;
        let rt = runtime_with(&QTensor::quantize(&w, GgmlDType::Q8_0)?)?;
        let g = rt.acquire_layer(0)?;
        let q = "model.layers.0.proj.weight";
        let e = g.get(q).unwrap_err().to_string();
        assert!(
            e.contains(q) && e.contains("Q8_0") && e.contains("get_quantized"),
            "{e}"
        );
        let e = g
            .get_quantized("model.layers.0.norm.weight")
            .unwrap_err()
            .to_string();
        assert!(e.contains("norm.weight") && e.contains("dense F32"), "{e}");
        let e = match g.var_builder(DType::F32).get((8, 32), q) {
            Ok(_) => panic!("a VarBuilder served a quantized tensor"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("GGML Q8_0 blocks"), "{e}");
        assert!(g.get_quantized("model.layers.0.missing").is_err());
        drop(g);
        let e = rt
            .update_weights(&[(q.to_string(), w.clone())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("quantized weights are not rewritten"), "{e}");
        Ok(())
    }

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
            gpu_memory_limit: Some(crate::MemoryLimit::Bytes(limit)),
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

    /// A store of `layers` layers, each one F32 vector `model.layers.{l}.w` of `len` zeros.
    fn zero_layers(layers: usize, len: usize, dev: &Device) -> anyhow::Result<HostStore> {
        let specs: Vec<RawTensorSpec> = (0..layers)
            .map(|l| RawTensorSpec {
                name: format!("model.layers.{l}.w"),
                format: WeightFormat::Dense(DType::F32),
                shape: Shape::from(len),
            })
            .collect();
        Ok(HostStore::from_raw(
            &specs,
            &StoreConfig::default(),
            dev,
            |_, _, dst| {
                dst.fill(0);
                Ok(())
            },
        )?)
    }

    #[test]
    fn a_smaller_reservation_gives_its_room_to_weights_and_a_larger_one_takes_it_back(
    ) -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let store = zero_layers(4, 256, &dev)?;
        let unit = store.units()[0].bytes();
        let order: Vec<UnitId> = (0..4).map(|l| store.layer_unit(l).unwrap()).collect();
        // Room for two units beside a prompt's reservation, for all four beside decode's.
        let prompt = 2 * unit;
        let rt = OffloadRuntime::new(
            Arc::new(store),
            &dev,
            &OffloadConfig {
                gpu_memory_limit: Some(crate::MemoryLimit::Bytes(4 * unit)),
                reserve_bytes: prompt,
                prefetch_depth: 0,
                policy: PolicyChoice::Schedule(order),
                ..Default::default()
            },
        )?;
        let sweep = |n: usize| -> anyhow::Result<u64> {
            let before = rt.stats()?.total.fetches;
            for _ in 0..n {
                for l in 0..4 {
                    drop(rt.acquire_layer(l)?);
                }
            }
            Ok(rt.stats()?.total.fetches - before)
        };
        assert_eq!(rt.stats()?.weight_capacity_bytes, 2 * unit);
        sweep(1)?;
        assert!(sweep(1)? >= 2, "two units cannot stay");

        rt.set_reserve_bytes(0)?;
        let st = rt.stats()?;
        assert_eq!((st.reserve_bytes, st.weight_capacity_bytes), (0, 4 * unit));
        sweep(1)?;
        assert_eq!(sweep(2)?, 0, "every unit stays beside decode's reservation");
        assert_eq!(rt.stats()?.resident_bytes, 4 * unit);

        // Back to the prompt's: idle units go until two fit, and the budget still holds.
        rt.set_reserve_bytes(prompt)?;
        let st = rt.stats()?;
        assert_eq!(st.weight_capacity_bytes, 2 * unit);
        assert!(st.resident_bytes <= 2 * unit, "{}", st.resident_bytes);
        sweep(1)?;
        assert!(rt.stats()?.resident_bytes <= 2 * unit);

        // Units in use cannot be evicted: a reservation that needs their room is refused, and
        // one that leaves no room for the largest unit is refused by the plan.
        let held = (rt.acquire_layer(0)?, rt.acquire_layer(1)?);
        let e = rt.set_reserve_bytes(3 * unit).unwrap_err().to_string();
        assert!(e.contains("cannot shrink"), "{e}");
        assert_eq!(rt.budget().reserve_bytes, prompt);
        drop(held);
        rt.set_reserve_bytes(3 * unit)?;
        assert_eq!(rt.stats()?.resident_bytes, unit);
        let e = rt.set_reserve_bytes(4 * unit + 1).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
        assert_eq!(rt.budget().reserve_bytes, 3 * unit);
        Ok(())
    }

    #[test]
    fn a_cpu_runtime_captures_no_step() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let rt = OffloadRuntime::new(
            Arc::new(zero_layers(2, 64, &dev)?),
            &dev,
            &OffloadConfig::default(),
        )?;
        for i in 0..2 {
            drop(rt.acquire_layer(i)?);
        }
        assert!(
            !rt.all_resident()?,
            "only a GPU runtime holds units a graph can read"
        );
        let mut ran = false;
        let err = rt
            .capture_step(|| {
                ran = true;
                Ok(())
            })
            .unwrap_err();
        assert!(err.to_string().contains("GPU runtime"), "{err}");
        assert!(!ran, "nothing runs when the capture is refused");
        Ok(())
    }

    #[test]
    fn a_derived_value_lives_as_long_as_the_residency() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let store = zero_layers(2, 64, &dev)?;
        let unit = store.units()[0].bytes();
        // Room for one unit: acquiring the other evicts it.
        let rt = OffloadRuntime::new(
            Arc::new(store),
            &dev,
            &OffloadConfig {
                gpu_memory_limit: Some(crate::MemoryLimit::Bytes(unit)),
                prefetch_depth: 0,
                ..Default::default()
            },
        )?;
        let built = std::cell::Cell::new(0);
        let derive = |g: &UnitGuard| {
            g.derived(|| {
                built.set(built.get() + 1);
                Ok((built.get(), g.get("model.layers.0.w")?))
            })
        };
        let first = derive(&rt.acquire_layer(0)?)?;
        let again = derive(&rt.acquire_layer(0)?)?;
        assert!(Arc::ptr_eq(&first, &again), "kept while resident");
        assert_eq!(built.get(), 1);
        // Another type replaces it.
        let other = rt.acquire_layer(0)?.derived(|| Ok("other"))?;
        assert_eq!(*other, "other");
        // Evicted and fetched again: built anew, and a failing build keeps nothing.
        drop(rt.acquire_layer(1)?);
        assert_eq!(rt.stats()?.resident_bytes, unit);
        let g = rt.acquire_layer(0)?;
        assert!(g.derived::<u8>(|| candle_core::bail!("no")).is_err());
        let fresh = derive(&g)?;
        assert_eq!((fresh.0, built.get()), (2, 2));
        assert!(!Arc::ptr_eq(&first, &fresh));
        Ok(())
    }

    /// An evicted unit's quantized buffers are offered for reuse only where nothing else holds
    /// them: what was derived from them is dropped first; a tensor a caller still holds, or
    /// weights still shared, stay.
    #[test]
    fn only_unshared_blocks_are_taken_for_reuse() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let q = |seed: f32| -> anyhow::Result<Arc<QTensor>> {
            let t = Tensor::full(seed, (4, 64), &dev)?;
            Ok(Arc::new(QTensor::quantize(&t, GgmlDType::Q8_0)?))
        };
        let weights = |held: &[Arc<QTensor>]| {
            let map = held
                .iter()
                .enumerate()
                .map(|(i, q)| (format!("w{i}"), (GgmlDType::Q8_0, q.clone())))
                .collect();
            Weights::new(HashMap::new(), map)
        };
        // Derived values hold clones: dropped first, then both are taken.
        let (a, b) = (q(1.0)?, q(2.0)?);
        let mut w = weights(&[a, b]);
        let kept: Vec<_> = w.quantized.values().cloned().collect();
        w.derived.lock().unwrap().0 = Some(Arc::new(kept));
        assert_eq!(w.take_unique_blocks().len(), 2);
        assert!(w.quantized.is_empty());
        // A tensor held elsewhere stays with the weights.
        let (a, held) = (q(1.0)?, q(3.0)?);
        let mut w = weights(&[a, held.clone()]);
        let taken = w.take_unique_blocks();
        assert_eq!(taken.len(), 1);
        assert_eq!(w.quantized.len(), 1);
        assert!(Arc::ptr_eq(w.quantized.values().next().unwrap(), &held));
        // Shared weights (a guard's clone) give nothing.
        let mut w = weights(&[q(1.0)?]);
        let guard = w.clone();
        assert!(w.take_unique_blocks().is_empty());
        assert_eq!(guard.quantized.len(), 1);
        Ok(())
    }
}
