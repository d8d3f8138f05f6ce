//! Units leaving the device: evictions, a change of the reservation beside the weights, and
//! rewriting weights in the host store.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use candle_core::Tensor;

use super::error::RuntimeError;
use super::shared::{Engine, OffloadRuntime, Resident, State};
use crate::budget::Budget;
use crate::cache::UnitId;
use crate::diag::device_label;
use crate::history::EventKind;

impl OffloadRuntime {
    /// Evicts `v`; with `recycle`, its quantized buffers go to `st.spare_blocks` for the next
    /// fetch, instead of back to the pool.
    pub(super) fn drop_unit(
        &self,
        st: &mut State,
        v: UnitId,
        reason: &'static str,
        recycle: bool,
    ) -> candle_core::Result<()> {
        let Some(Resident { mut weights, sync }) = st.resident[v.0].take() else {
            return Ok(());
        };
        if !st.indirect[v.0] {
            st.generation += 1;
        }
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

    /// Evicts `unit` now if it is on the device and not in use, kept or not: for a caller
    /// with a residency policy of its own over some units (a mixture-of-experts layer's expert
    /// cache choosing its victim). Returns whether it was evicted.
    pub fn evict_unit(&self, unit: UnitId) -> candle_core::Result<bool> {
        self.check_served(unit)?;
        let mut st = self.state()?;
        if !st.cache.invalidate(unit) {
            return Ok(false);
        }
        self.drop_unit(&mut st, unit, "evicted by its owner", true)?;
        Ok(true)
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
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::Device;

    use super::super::config::OffloadConfig;
    use super::super::shared::OffloadRuntime;
    use super::super::testutil::zero_layers;
    use crate::cache::{PolicyChoice, UnitId};
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
                gpu_memory_limit: Some(crate::budget::MemoryLimit::Bytes(4 * unit)),
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
}
