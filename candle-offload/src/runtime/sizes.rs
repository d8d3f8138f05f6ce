//! How many device bytes each unit takes in a runtime, and what the weights need of its budget:
//! planning over the store's sizes, done once when the runtime starts ([`UnitSizes`]) and again
//! at each change of the reservation ([`Resize`]). Nothing here touches a device.

use crate::budget::{human_bytes, Budget};
use crate::cache::{PolicyChoice, UnitId};
use crate::error::{Error, Result};
use crate::plan::{plan_capacity_for, CapacityPlan, OffloadStrategy, WeightNeed};
use crate::store::HostStore;

use super::config::OffloadConfig;

/// The units a runtime serves, the device bytes each takes there, and the ones never evicted.
#[derive(Debug)]
pub(super) struct UnitSizes {
    /// Device bytes per unit, in unit order: its own size when it stays for good
    /// ([`own_size`](Self::own_size)), its streaming size otherwise, and 0 for a unit this
    /// runtime does not serve (another stage's).
    pub(super) bytes: Vec<u64>,
    /// Per unit: this runtime serves it ([`OffloadConfig::units`]).
    pub(super) served: Vec<bool>,
    /// Per unit: it stays on the device for good at its own size ([`staying`]).
    pub(super) own_size: Vec<bool>,
    /// The units never evicted: the configuration's kept units, and the ones that stay for
    /// good when the steady state does not fit at its own sizes.
    pub(super) keep: Vec<UnitId>,
}

impl UnitSizes {
    /// Sizes the units `cfg` serves under `budget`: units of other runtimes take no room here,
    /// and units that stay for good take their own sizes, without the streaming padding. An
    /// unknown unit name (served or kept) is refused.
    pub(super) fn new(store: &HostStore, budget: Budget, cfg: &OffloadConfig) -> Result<Self> {
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
        Ok(Self {
            bytes: unit_bytes,
            served,
            own_size,
            keep: keep_ids,
        })
    }

    /// What the runtime on `device` plans the weights' capacity from, now and at each change of
    /// the reservation: the served units' need, what a refusal names, and the bytes of the
    /// steady sweep.
    pub(super) fn resize(&self, store: &HostStore, device: &str, cfg: &OffloadConfig) -> Resize {
        let (unit_bytes, served, keep_ids) = (&self.bytes, &self.served, &self.keep);
        // Kept units are counted once, in `kept`; the largest of the others must fit beside them.
        let need = weight_need(|i| unit_bytes[i], served, keep_ids);
        let kept = need.kept;
        let largest = (0..unit_bytes.len())
            .filter(|i| served[*i] && !keep_ids.contains(&UnitId(*i)))
            .max_by_key(|&i| unit_bytes[i]);
        let what = match largest {
            Some(i) if kept > 0 => format!(
                "the kept units ({}) and the largest other unit, {} ({})",
                human_bytes(kept),
                store.unit(UnitId(i)).name(),
                human_bytes(unit_bytes[i])
            ),
            Some(i) => format!("the largest unit, {}", store.unit(UnitId(i)).name()),
            None => format!("the kept units ({})", human_bytes(kept)),
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
        Resize {
            device: device.to_string(),
            need,
            what,
            strategy: cfg.strategy,
            asked_depth: cfg.prefetch_depth,
            steady,
        }
    }

    /// Per unit: it stays on the device once fetched (kept, or served when every served unit
    /// fits the weights' capacity, `fits_entirely`).
    pub(super) fn stays(&self, fits_entirely: bool) -> Vec<bool> {
        (0..self.bytes.len())
            .map(|i| self.served[i] && (fits_entirely || self.keep.contains(&UnitId(i))))
            .collect()
    }
}

/// What [`OffloadRuntime::set_reserve_bytes`](crate::OffloadRuntime::set_reserve_bytes) plans a
/// new capacity from: the weights' need and the settings the runtime started with.
#[derive(Debug)]
pub(super) struct Resize {
    pub(super) device: String,
    pub(super) need: WeightNeed,
    /// Names the kept units and the largest unit in a refusal.
    pub(super) what: String,
    pub(super) strategy: OffloadStrategy,
    pub(super) asked_depth: usize,
    /// The bytes of the units a steady sweep holds: at a capacity that holds them no copy runs
    /// ahead of its victim, so no spare room is kept for one.
    pub(super) steady: u64,
}

impl Resize {
    /// The weights' capacity and the cache's prefetch depth under `budget`.
    pub(super) fn plan(&self, budget: Budget) -> Result<(CapacityPlan, usize)> {
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

/// Which units stay on the device for good at their own sizes
/// ([`HostUnit::resident_bytes`](crate::store::HostUnit::resident_bytes)), when some stream
/// larger ([`HostUnit::bytes`](crate::store::HostUnit::bytes): layers of mixed block types
/// padded alike). All units of the steady state (the kept units and, under a
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
pub(super) fn staying(
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
