//! Bringing units to the device: [`acquire`](OffloadRuntime::acquire) and its planned
//! prefetches, the disk units' read-ahead, and carrying out what the residency cache decided.

use std::sync::atomic::Ordering;

use super::error::RuntimeError;
use super::guard::UnitGuard;
use super::shared::{Engine, OffloadRuntime, Resident, State};
use super::weights::Weights;
use crate::cache::{CacheError, Transfer, UnitId};
use crate::diag::device_label;
use crate::history::EventKind;
use crate::store::TierKind;
use crate::sys::ReadAhead;
use crate::telemetry::Timings;

/// Disk units read ahead of their fetch at a time (each staged whole in host memory until its
/// fetch): two, so that one is being read while the fetch of the one before uses its bytes.
pub(super) const READ_AHEAD_UNITS: usize = 2;

/// Reader threads for read-ahead: one per unit read ahead.
pub(super) const READ_THREADS: usize = READ_AHEAD_UNITS;

impl OffloadRuntime {
    /// Brings `unit` to the device (if it is not there) and pins it until the guard drops.
    /// Compute-stream work enqueued after this call sees the unit's weights; then the next
    /// units of the learned or given schedule are prefetched.
    pub fn acquire(&self, unit: UnitId) -> candle_core::Result<UnitGuard> {
        let mut guards = self.acquire_many(&[unit])?;
        Ok(guards.pop().expect("one guard for one unit"))
    }

    /// [`acquire`](Self::acquire) of every unit of `units` at once, under one hold of the
    /// runtime's lock, the planned prefetches started once after them; the guards in
    /// `units`' order. On an error, none stays acquired.
    pub fn acquire_many(&self, units: &[UnitId]) -> candle_core::Result<Vec<UnitGuard>> {
        let _span = tracing::debug_span!("offload.acquire", units = units.len()).entered();
        for &unit in units {
            self.check_served(unit)?;
        }
        let mut st = self.state()?;
        let mut weights = Vec::with_capacity(units.len());
        for (i, &unit) in units.iter().enumerate() {
            match self.pin(&mut st, unit) {
                Ok(w) => weights.push(w),
                Err(e) => {
                    for &u in &units[..i] {
                        st.cache.release(u);
                    }
                    return Err(e);
                }
            }
        }
        // Reads of the disk units the planned fetches take next start first (several fetches
        // starting at once then read their files in parallel), and the window is topped up
        // past them once they have started.
        self.read_ahead(&mut st);
        self.start_planned(
            &mut st,
            self.shared.prefetch_depth.load(Ordering::Relaxed) + 1,
        );
        self.read_ahead(&mut st);
        drop(st);
        Ok(units
            .iter()
            .zip(weights)
            .map(|(&unit, weights)| UnitGuard {
                rt: self.clone(),
                unit,
                weights,
                held: true,
            })
            .collect())
    }

    /// Pins `unit` on the device, fetching it if it is not there, and makes compute-stream
    /// work enqueued after this wait for its copy: its weights. Released again on an error.
    fn pin(&self, st: &mut State, unit: UnitId) -> candle_core::Result<Weights> {
        let transfer = st
            .cache
            .acquire(unit)
            .map_err(|e| self.cache_error(unit, e))?;
        let mut transfer = transfer;
        if transfer.fetch.is_none() && st.resident[unit.0].is_none() {
            // Admitted by a prefetch whose copy failed earlier: fetch it now.
            transfer.fetch = Some(unit);
        }
        if let Err(e) = self.carry_out(st, &transfer, "miss") {
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
            let waited = if !capturing {
                engine.wait_ready(sync).map(|()| true)
            } else {
                engine.is_ready(sync)
            };
            match waited {
                Ok(true) => {}
                Ok(false) => {
                    let name = self.shared.store.unit(unit).name().to_string();
                    st.cache.release(unit);
                    candle_core::bail!(
                        "unit {name} is still being copied: a captured step needs every unit ready"
                    );
                }
                Err(e) => {
                    st.cache.release(unit);
                    return Err(e);
                }
            }
        }
        let weights = resident.weights.clone();
        self.log(st, EventKind::Acquire, Some(unit), 0, "", None);
        Ok(weights)
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

    /// Whether `unit` is on the device or on its way there (a fetch started).
    pub fn is_present(&self, unit: UnitId) -> candle_core::Result<bool> {
        self.check_served(unit)?;
        Ok(self.state()?.cache.is_present(unit))
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

    pub(super) fn check_served(&self, unit: UnitId) -> candle_core::Result<()> {
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

    pub(super) fn release(&self, unit: UnitId) -> candle_core::Result<()> {
        self.release_many(&[unit])
    }

    /// Releases `units` (each acquired once more than released) under one hold of the lock,
    /// with one last-use event for all of them on a GPU: their work must all be enqueued
    /// before the call.
    pub(super) fn release_many(&self, units: &[UnitId]) -> candle_core::Result<()> {
        let mut st = self.state()?;
        if let (Engine::Cuda(engine), false) = (&self.shared.engine, st.capturing) {
            let mut at = None;
            for &unit in units {
                if let Some(Resident {
                    sync: Some(sync), ..
                }) = st.resident[unit.0].as_mut()
                {
                    engine.share_last_use(&mut at, sync)?;
                }
            }
        }
        for &unit in units {
            st.cache.release(unit);
        }
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
        if !st.indirect[u.0] {
            st.generation += 1;
        }
        self.log(st, EventKind::Fetch, Some(u), size, reason, None);
        let used = st.cache.used();
        st.telemetry.peak_resident = st.telemetry.peak_resident.max(used);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::Device;

    use super::super::config::OffloadConfig;
    use super::super::shared::OffloadRuntime;
    use super::super::testutil::zero_layers;
    #[test]
    fn warm_up_fetches_what_stays_and_nothing_else() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let build = |limit: Option<u64>, keep: Vec<String>| -> anyhow::Result<OffloadRuntime> {
            let store = zero_layers(4, 256, &dev)?;
            Ok(OffloadRuntime::new(
                Arc::new(store),
                &dev,
                &OffloadConfig {
                    gpu_memory_limit: limit.map(crate::budget::MemoryLimit::Bytes),
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
}
