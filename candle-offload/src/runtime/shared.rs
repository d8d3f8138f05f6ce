//! The runtime's state: [`OffloadRuntime`] is a handle on [`Shared`] (what is fixed at the start
//! and the [`State`] behind its lock), and its plain accessors.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::quantized::QTensor;
use candle_core::Device;

use super::sizes::Resize;
use super::weights::Weights;
use crate::budget::Budget;
use crate::cache::{ResidencyCache, UnitId};
use crate::history::MemoryEvent;
use crate::store::HostStore;
use crate::sys::{CudaEngine, UnitSync};
use crate::telemetry::Telemetry;
use crate::tuning::Tuning;

/// How weights reach the device.
#[derive(Debug)]
pub(super) enum Engine {
    /// CPU tensors copied out of the host store (the fallback that runs everywhere).
    Cpu,
    /// A GPU with its copy stream.
    Cuda(CudaEngine),
}

#[derive(Debug)]
pub(super) struct Resident {
    pub(super) weights: Weights,
    pub(super) sync: Option<UnitSync>,
}

#[derive(Debug)]
pub(super) struct Recording {
    pub(super) start: std::time::Instant,
    pub(super) baseline: Option<u64>,
    /// The reservation when recording started.
    pub(super) reserve: u64,
    pub(super) events: Vec<MemoryEvent>,
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) cache: ResidencyCache,
    pub(super) resident: Vec<Option<Resident>>,
    pub(super) retired: Vec<UnitSync>,
    pub(super) telemetry: Telemetry,
    pub(super) history: Option<Recording>,
    #[cfg(feature = "fault-injection")]
    pub(super) injected_failures: u32,
    pub(super) reservation_parts: Vec<(String, u64)>,
    /// Disk units with a read-ahead issued and not yet used by their fetch.
    pub(super) read_ahead: Vec<UnitId>,
    /// Graph capture ([`OffloadRuntime::capture_step`]) under way: units are neither moved
    /// nor waited for, and their uses record no events (an event recorded inside a capture
    /// cannot be waited on outside it).
    pub(super) capturing: bool,
    /// The quantized tensors of evicted units, whose buffers the next fetch's blocks take
    /// where they match (it frees the others first). The cache no longer counts them, but
    /// they hold only memory it freed and has not given out since: resident units and these
    /// together stay within the weights' capacity. Emptied (freed) whenever the reservation
    /// changes and by [`OffloadRuntime::evict_all`].
    pub(super) spare_blocks: Vec<QTensor>,
    /// An upload freed spare buffers whose room no new buffer took back
    /// ([`OffloadRuntime::trim_if_pending`]).
    pub(super) trim_pending: bool,
    /// Bumped whenever a unit arrives or leaves, except an indirect one: a captured step
    /// holds the addresses of the units resident at its capture and may replay only while
    /// this is unchanged.
    pub(super) generation: u64,
    /// Per unit: a captured step reads it only through addresses its caller keeps true
    /// outside the graph ([`OffloadRuntime::set_indirect`]).
    pub(super) indirect: Vec<bool>,
    /// A captured step was replayed: units' `last_use` events predate work on the compute
    /// stream, so an eviction records a fresh one first (hazard H19).
    pub(super) replayed: bool,
}

impl State {
    /// The state of a runtime starting with `cache` over `units` units, none of them resident.
    pub(super) fn new(cache: ResidencyCache, units: usize) -> Self {
        Self {
            cache,
            resident: (0..units).map(|_| None).collect(),
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
            indirect: vec![false; units],
            replayed: false,
        }
    }
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) device: Device,
    pub(super) store: Arc<HostStore>,
    pub(super) engine: Engine,
    /// The budget's limit; the reservation is `reserve` (it may change at run time).
    pub(super) limit_bytes: u64,
    pub(super) reserve: AtomicU64,
    pub(super) prefetch_depth: AtomicUsize,
    /// What a change of the reservation plans the weights' capacity from.
    pub(super) resize: Resize,
    pub(super) trainable: bool,
    pub(super) served: Vec<bool>,
    /// Per unit: it stays on the device for good, at its own size
    /// ([`HostUnit::resident_bytes`](crate::store::HostUnit::resident_bytes)) rather than its
    /// streaming size ([`HostUnit::bytes`](crate::store::HostUnit::bytes)).
    pub(super) own_size: Vec<bool>,
    /// Per unit: it stays on the device once fetched (kept, or every served unit when they
    /// all fit the weights' capacity); what [`OffloadRuntime::warm_up`] fetches.
    pub(super) stays: Vec<bool>,
    pub(super) state: Mutex<State>,
    /// Reader threads for the disk units' read-ahead (`None`: no disk units served).
    pub(super) read_pool: Option<crate::sys::ReadPool>,
    /// The configuration's performance choices.
    pub(super) tuning: Tuning,
}

impl Shared {
    /// Whether this runtime's device is a GPU.
    pub(super) fn engine_is_cuda(&self) -> bool {
        matches!(self.engine, Engine::Cuda(_))
    }

    /// The device bytes unit `u` takes in this runtime: its own size when it stays for good,
    /// its streaming size otherwise.
    pub(super) fn size_of(&self, u: UnitId) -> u64 {
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

/// Weights in host memory, brought to the device on demand under a memory budget.
///
/// Cloning is cheap and shares the runtime.
#[derive(Debug, Clone)]
pub struct OffloadRuntime {
    pub(super) shared: Arc<Shared>,
}

fn lock_err<T>(_: T) -> candle_core::Error {
    candle_core::Error::Msg("offload runtime state poisoned by an earlier panic".into())
}

impl OffloadRuntime {
    /// The device weights are brought to.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// The host store.
    pub fn store(&self) -> &Arc<HostStore> {
        &self.shared.store
    }

    /// The performance choices this runtime was configured with
    /// ([`OffloadConfig::tuning`](crate::OffloadConfig::tuning)): what the layers built over it
    /// pass to the ops.
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

    /// Whether `other` is this runtime (a clone of it).
    pub(super) fn same_as(&self, other: &OffloadRuntime) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    pub(super) fn state(&self) -> candle_core::Result<MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(lock_err)
    }

    /// Waits for all copies and compute of this runtime's device to finish.
    pub fn synchronize(&self) -> candle_core::Result<()> {
        match &self.shared.engine {
            Engine::Cuda(e) => e.synchronize(),
            Engine::Cpu => Ok(()),
        }
    }

    /// Free and total memory of the device as the driver reports them (`None` on a CPU).
    pub fn device_memory(&self) -> candle_core::Result<Option<(u64, u64)>> {
        match &self.shared.engine {
            Engine::Cuda(e) => e.mem_get_info().map(Some),
            Engine::Cpu => Ok(None),
        }
    }
}
