//! What a runtime tells about itself: the counters ([`OffloadRuntime::stats`]), per-step
//! markers, the memory history and the leak check.

use std::sync::atomic::Ordering;

use super::fetch::READ_AHEAD_UNITS;
use super::shared::{Engine, OffloadRuntime, Recording, State};
use crate::cache::UnitId;
use crate::diag::device_label;
use crate::history::{EventKind, MemoryEvent, MemoryHistory};
use crate::store::TierKind;
use crate::telemetry::{OffloadStats, ReadAheadStats, UnitStats};

impl OffloadRuntime {
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

    pub(super) fn log(
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
