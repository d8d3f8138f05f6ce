//! How much of the budget weights get: the offload strategies, as a pure function.
//!
//! The budget minus the caller's reservation is the room for weights. Of that room:
//! - the floor is what streaming needs: kept units plus `depth + 1` of the largest unit (the one
//!   in use and `depth` in flight);
//! - the ceiling is the room, or the whole model if it is smaller.
//!
//! The seed's strategies pick a point between them: `minimal` offloading takes the ceiling
//! (fastest), `aggressive` the floor (least device memory, everything else streamed),
//! `balanced` the midpoint. A budget below the floor at depth 0 is refused with the MiB missing;
//! a budget that only fits a shallower prefetch gets the deepest depth that fits.

use crate::budget::{human_bytes, Budget};
use crate::error::{Error, Result};

pub mod spread;

/// How much of the model stays on the device (the seed's `memory.offload_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadStrategy {
    /// Offload as little as possible: fill the budget with weights (fastest).
    #[default]
    Minimal,
    /// Use half of the room above the streaming floor.
    Balanced,
    /// Offload as much as possible: keep only what streaming needs (least memory).
    Aggressive,
}

keyword_enum!(OffloadStrategy, "offload_strategy", Error, [Error::InvalidConfig], {
    Minimal => "minimal",
    Balanced => "balanced",
    Aggressive => "aggressive",
});

/// The deepest prefetch the runtime and the placement planner accept.
pub const MAX_PREFETCH_DEPTH: usize = 3;

/// The budget rule, once: what the weights of one device (a runtime, a pipeline stage) need.
///
/// A device streams its evictable units one at a time, so it must hold its kept units plus its
/// largest evictable unit; at prefetch depth `d` it holds `d` more of the largest in flight. With
/// the caller's reservation that is the smallest budget ([`min_budget`](Self::min_budget)); the
/// room above it goes to the strategy ([`plan`](Self::plan)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WeightNeed {
    /// Bytes of the units that never leave the device.
    pub kept: u64,
    /// The largest evictable unit, in bytes.
    pub largest: u64,
    /// All evictable units together, in bytes.
    pub evictable: u64,
}

impl WeightNeed {
    /// The need of evictable units of `unit_bytes` beside `kept` bytes of kept units.
    pub fn new(unit_bytes: &[u64], kept: u64) -> Self {
        Self {
            kept,
            largest: unit_bytes.iter().copied().max().unwrap_or(0),
            evictable: unit_bytes.iter().fold(0u64, |a, &b| a.saturating_add(b)),
        }
    }

    /// The streaming floor at prefetch depth `depth`: the kept units, the unit in use and
    /// `depth` more of the largest in flight.
    pub fn floor(&self, depth: usize) -> u64 {
        self.kept
            .saturating_add(self.largest.saturating_mul(depth as u64 + 1))
    }

    /// What must fit at the least: the floor at depth 0 (kept units and the largest unit).
    pub fn minimum(&self) -> u64 {
        self.floor(0)
    }

    /// Every unit at once.
    pub fn all(&self) -> u64 {
        self.kept.saturating_add(self.evictable)
    }

    /// The smallest budget that holds `reserve` bytes of reservation and the floor at `depth`.
    pub fn min_budget(&self, reserve: u64, depth: usize) -> u64 {
        reserve.saturating_add(self.floor(depth))
    }

    /// The deepest prefetch depth up to `asked` whose floor fits in `room` bytes for weights;
    /// `None` when not even the floor at depth 0 fits.
    pub fn depth_that_fits(&self, room: u64, asked: usize) -> Option<usize> {
        if self.minimum() > room {
            return None;
        }
        let spare = room - self.kept;
        Some(match spare.checked_div(self.largest) {
            // spare >= largest here, so the quotient is at least 1.
            Some(q) => asked.min(usize::try_from(q - 1).unwrap_or(usize::MAX)),
            None => asked,
        })
    }

    /// Splits `room` bytes for weights by `strategy` at the deepest depth up to `asked` that
    /// fits; `None` when not even the floor at depth 0 fits.
    pub fn plan(&self, room: u64, strategy: OffloadStrategy, asked: usize) -> Option<CapacityPlan> {
        let depth = self.depth_that_fits(room, asked)?;
        let total = self.all();
        let ceiling = room.min(total);
        let floor = self.floor(depth).min(ceiling);
        let weight_capacity = match strategy {
            OffloadStrategy::Minimal => ceiling,
            OffloadStrategy::Aggressive => floor,
            OffloadStrategy::Balanced => floor + (ceiling - floor) / 2,
        };
        Some(CapacityPlan {
            weight_capacity,
            prefetch_depth: depth,
            fits_entirely: weight_capacity >= total,
        })
    }
}

/// How many of a model's first decoder layers run on the host CPU so that the others stay
/// resident on a device (llama.cpp's `-ngl` split, decided from bytes): the smallest `h` with
/// `fixed + per_layer_reserve · (n − h) + Σ layers[h..] ≤ budget`, where `layers` are the
/// layers' device bytes in order, `fixed` what the device holds whatever the split (its kept
/// units and the reservation that does not grow with its layers) and `per_layer_reserve` the
/// reservation each device layer adds (its KV cache). `None` when not even `h = n` fits.
/// Pure; the device runs no layer that would have to be streamed.
pub fn host_layer_split(
    layers: &[u64],
    fixed: u64,
    per_layer_reserve: u64,
    budget: u64,
) -> Option<usize> {
    let n = layers.len();
    // Device bytes with layers h.. on the device, from h = n down: the first h that does not
    // fit ends the search (the need only grows as h falls).
    let mut need = fixed;
    if need > budget {
        return None;
    }
    let mut h = n;
    while h > 0 {
        let next = need
            .saturating_add(layers[h - 1])
            .saturating_add(per_layer_reserve);
        if next > budget {
            break;
        }
        need = next;
        h -= 1;
    }
    Some(h)
}

/// How many host layers to spread over a model whose layers do not all fit a device, for
/// spread placement ([`spread_host_set`]): with `h` host layers
/// placed evenly between the device's, the device keeps what its budget leaves after
/// `fixed`, the reservation of its `n − h` layers (`per_layer_reserve` each) and `slots`
/// streaming slots of its largest layer, and streams the rest of its layers every step. The
/// layers run one after another, the device's (`rates.device_layer_s` each) and the host's
/// (`rates.host_bytes_per_s` over their bytes), while the copies (`rates.link_bytes_per_s`
/// over the streamed bytes) overlap both, so a step costs about the larger of the two plus
/// [`SPREAD_OVERLAP_LOSS`] of the smaller (the part the overlap loses). Returns the `h`
/// with the smallest such cost (the fewest on ties; 0 when every layer fits the device),
/// `None` when the device cannot hold even `fixed`. Pure.
pub fn spread_host_split(
    layers: &[u64],
    fixed: u64,
    per_layer_reserve: u64,
    budget: u64,
    slots: usize,
    rates: &SplitRates,
) -> Option<usize> {
    // A head of no bytes never goes to the host (the two placements cost the same).
    spread_host_split_at(layers, fixed, 0, per_layer_reserve, budget, slots, rates).map(|(h, _)| h)
}

/// [`spread_host_split`] that may also place the output head on the host, as llama.cpp does
/// below `-ngl` = layers + 1: `fixed` includes the head's `head` bytes, which the host would
/// then read every step (at `rates.host_bytes_per_s`, like a host layer) while the device gets
/// their room for layers. Returns the host layer count and whether the head goes to the host:
/// the cheaper of the two placements by [`spread_host_split`]'s cost, the head staying on the
/// device on ties and whenever every layer fits beside it. A device layer may take less time
/// in a split that streams nothing (`rates.resident_device_layer_s`: a model replays such a
/// decode step from a CUDA graph, and one that streams runs it eagerly). Pure.
pub fn spread_host_split_at(
    layers: &[u64],
    fixed: u64,
    head: u64,
    per_layer_reserve: u64,
    budget: u64,
    slots: usize,
    rates: &SplitRates,
) -> Option<(usize, bool)> {
    spread_host_choice(&spread_host_prices(
        layers,
        fixed,
        head,
        per_layer_reserve,
        budget,
        slots,
        rates,
    ))
}

/// The split [`spread_host_split_at`] takes from the splits [`spread_host_prices`] lists: no
/// host layer where every layer fits the device beside the head; otherwise the cheapest, the
/// fewest host layers among equal prices and the head on the device on ties. `None` where
/// nothing is listed. Pure.
pub fn spread_host_choice(prices: &[SplitPrice]) -> Option<(usize, bool)> {
    let fits = prices
        .iter()
        .any(|p| !p.host_head && p.host_layers == 0 && p.streamed_bytes == 0);
    if fits {
        return Some((0, false));
    }
    // The first of the cheapest (the list runs from the fewest host layers).
    let cheapest = |head: bool| {
        prices.iter().filter(|p| p.host_head == head).fold(
            None::<&SplitPrice>,
            |best, p| match best {
                Some(b) if p.cost_s < b.cost_s => Some(p),
                None => Some(p),
                kept => kept,
            },
        )
    };
    match (cheapest(false), cheapest(true)) {
        (Some(d), Some(h)) if h.cost_s < d.cost_s => Some((h.host_layers, true)),
        (Some(d), _) => Some((d.host_layers, false)),
        (None, Some(h)) => Some((h.host_layers, true)),
        (None, None) => None,
    }
}

/// The rates [`spread_host_split_at`] weighs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitRates {
    /// Bytes a second the host reads its layers' (and head's) weights at, computing them.
    pub host_bytes_per_s: f64,
    /// Bytes a second the link copies streamed layers at.
    pub link_bytes_per_s: f64,
    /// Seconds of one device layer's decode step in a split that streams.
    pub device_layer_s: f64,
    /// Seconds of one device layer's decode step in a split that streams nothing.
    pub resident_device_layer_s: f64,
}

impl SplitRates {
    /// Rates with a device layer as fast in a split that streams nothing as in one that
    /// streams.
    pub fn even(host_bytes_per_s: f64, link_bytes_per_s: f64, device_layer_s: f64) -> Self {
        Self {
            host_bytes_per_s,
            link_bytes_per_s,
            device_layer_s,
            resident_device_layer_s: device_layer_s,
        }
    }
}

/// The share of the shorter of a split's compute and copies that does not hide behind the
/// longer. Streaming from host memory while the host computes slows both: the host's layers
/// read their weights from the same memory the copies read (measured: docs/tuning.md).
pub const SPREAD_OVERLAP_LOSS: f64 = 0.3;

/// What a split that streams nothing takes beyond its priced compute, as a share of it. Its
/// host layers run slower in the decode step than the layers timed to price them, in every
/// split; in splits that stream, [`SPREAD_OVERLAP_LOSS`], fitted on them, carries that too
/// (measured: docs/tuning.md).
pub const RESIDENT_SPLIT_LOSS: f64 = 0.15;

/// The price of a split whose compute and copies take `compute_s` and `copies_s` seconds: the
/// larger plus [`SPREAD_OVERLAP_LOSS`] of the smaller, or for a split that copies nothing its
/// compute and [`RESIDENT_SPLIT_LOSS`] of it ([`SplitPrice::cost_s`]).
pub fn split_cost(compute_s: f64, copies_s: f64) -> f64 {
    if copies_s > 0.0 {
        compute_s.max(copies_s) + SPREAD_OVERLAP_LOSS * compute_s.min(copies_s)
    } else {
        compute_s * (1.0 + RESIDENT_SPLIT_LOSS)
    }
}

/// One spread split as [`spread_host_split_at`] prices it ([`spread_host_prices`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitPrice {
    /// Layers on the host, spread as [`spread_host_set`] places them.
    pub host_layers: usize,
    /// The output head is on the host too.
    pub host_head: bool,
    /// Bytes the host reads a step (its layers, and the head where it has it).
    pub host_bytes: u64,
    /// Bytes the link streams a step.
    pub streamed_bytes: u64,
    /// Seconds of the step's compute: the device's layers and the host's bytes.
    pub compute_s: f64,
    /// Seconds of the step's copies.
    pub copies_s: f64,
    /// The price ([`split_cost`]): the larger of the two plus [`SPREAD_OVERLAP_LOSS`] of the
    /// smaller; with no copies, the compute plus [`RESIDENT_SPLIT_LOSS`] of it.
    pub cost_s: f64,
}

/// Every spread split of `layers` with the host also reading `host_extra` bytes a step (the
/// head, where it goes there) that the budget can hold, fewest host layers first, priced.
fn spread_candidates(
    layers: &[u64],
    fixed: u64,
    host_extra: u64,
    per_layer_reserve: u64,
    budget: u64,
    slots: usize,
    rates: &SplitRates,
) -> Vec<SplitPrice> {
    let n = layers.len();
    if fixed > budget {
        return Vec::new();
    }
    let mut out = Vec::new();
    for h in 0..=n {
        let on_host = spread_host_set(h, n);
        let (mut host, mut device, mut largest) = (host_extra, 0u64, 0u64);
        for (l, &b) in layers.iter().enumerate() {
            if on_host[l] {
                host += b;
            } else {
                device += b;
                largest = largest.max(b);
            }
        }
        let reserve = fixed.saturating_add(per_layer_reserve.saturating_mul((n - h) as u64));
        let Some(room) = budget.checked_sub(reserve) else {
            continue;
        };
        let streamed = if device <= room {
            0
        } else {
            // Streaming needs its slots; what is left holds layers for good.
            let kept = room.saturating_sub(largest.saturating_mul(slots as u64));
            device - kept.min(device)
        };
        let layer_s = if streamed == 0 {
            rates.resident_device_layer_s
        } else {
            rates.device_layer_s
        };
        let compute = layer_s * (n - h) as f64 + host as f64 / rates.host_bytes_per_s;
        let copies = streamed as f64 / rates.link_bytes_per_s;
        let price = SplitPrice {
            host_layers: h,
            host_head: host_extra > 0,
            host_bytes: host,
            streamed_bytes: streamed,
            compute_s: compute,
            copies_s: copies,
            cost_s: split_cost(compute, copies),
        };
        // Every candidate's price, to set against measured steps (`RUST_LOG=
        // candle_offload::plan=debug`, or [`spread_host_prices`]).
        tracing::debug!(
            host_layers = h,
            host_head = price.host_head,
            host_bytes = host,
            streamed_bytes = streamed,
            compute_ms = compute * 1e3,
            copies_ms = copies * 1e3,
            cost_ms = price.cost_s * 1e3,
            "spread split priced"
        );
        out.push(price);
    }
    out
}

/// Every split [`spread_host_split_at`] weighs with the same arguments, with its price: the
/// head on the device, then (for a head of any bytes) on the host, each fewest host layers
/// first; splits the budget cannot hold are left out. For setting the prices against
/// measured steps. Pure.
pub fn spread_host_prices(
    layers: &[u64],
    fixed: u64,
    head: u64,
    per_layer_reserve: u64,
    budget: u64,
    slots: usize,
    rates: &SplitRates,
) -> Vec<SplitPrice> {
    let mut out = spread_candidates(layers, fixed, 0, per_layer_reserve, budget, slots, rates);
    let head = head.min(fixed);
    if head > 0 {
        out.extend(spread_candidates(
            layers,
            fixed - head,
            head,
            per_layer_reserve,
            budget,
            slots,
            rates,
        ));
    }
    out
}

/// Which units a device keeps for good, at their own device sizes, when its weights do not
/// all fit and some units take more room streaming than staying (GGML layers of mixed block
/// types, padded to one size per position so that they free and allocate alike as they
/// stream; see [`HostUnit::resident_bytes`](crate::store::HostUnit::resident_bytes)).
///
/// `own[u]` and `streaming[u]` are unit `u`'s bytes staying and streaming; `sweep` the units
/// that may stay, in the order they are first used; `kept` the bytes the device already keeps;
/// `capacity` its bytes for weights and `depth` its prefetch depth. The units that stay are the
/// longest prefix of the sweep whose own sizes, beside the kept bytes and `depth + 1` slots of
/// the largest streaming size among the units after it, fit in `capacity`; the rest stream in
/// those slots. Pure.
pub fn staying_units(
    own: &[u64],
    streaming: &[u64],
    sweep: &[usize],
    kept: u64,
    capacity: u64,
    depth: usize,
) -> Vec<bool> {
    let n = own.len().min(streaming.len());
    let mut first = Vec::new();
    let mut seen = vec![false; n];
    for &u in sweep {
        if u < n && !seen[u] {
            seen[u] = true;
            first.push(u);
        }
    }
    let slots = depth as u64 + 1;
    // The longest prefix of the sweep that fits beside the slots of the units after it.
    let fits = |k: usize| {
        let staying = first[..k]
            .iter()
            .fold(kept, |a, &u| a.saturating_add(own[u]));
        let slot = first[k..].iter().map(|&u| streaming[u]).max().unwrap_or(0);
        staying.saturating_add(slot.saturating_mul(slots)) <= capacity
    };
    let k = (0..=first.len()).rev().find(|&k| fits(k)).unwrap_or(0);
    let mut stays = vec![false; n];
    for &u in &first[..k] {
        stays[u] = true;
    }
    stays
}

/// Which of `n` layers run on the host when `h` are spread evenly over them: layer `l` when
/// `l · h / n` steps up at `l` (so the first runs on the device unless all are on the host,
/// and the last on the host whenever any is). Pure.
pub fn spread_host_set(h: usize, n: usize) -> Vec<bool> {
    let h = h.min(n);
    (0..n).map(|l| (l + 1) * h / n > l * h / n).collect()
}

/// The outcome of [`plan_capacity`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacityPlan {
    /// Bytes the residency cache may fill (resident plus in flight).
    pub weight_capacity: u64,
    /// Prefetch depth that fits (at most the one asked for).
    pub prefetch_depth: usize,
    /// True when every unit fits at once (nothing is streamed in steady state).
    pub fits_entirely: bool,
}

/// Splits `budget` between weights and streaming.
///
/// `unit_bytes` are the sizes of the units that may be evicted; `kept` are the bytes of the
/// units that never leave the device. `device` names the device in
/// errors.
pub fn plan_capacity(
    device: &str,
    budget: Budget,
    unit_bytes: &[u64],
    kept: u64,
    strategy: OffloadStrategy,
    prefetch_depth: usize,
) -> Result<CapacityPlan> {
    let largest_idx = unit_bytes
        .iter()
        .copied()
        .enumerate()
        .max_by_key(|&(_, b)| b)
        .map_or(0, |(i, _)| i);
    let what = if kept > 0 {
        format!(
            "the kept units ({}) and the largest unit (#{largest_idx})",
            human_bytes(kept)
        )
    } else {
        format!("the largest unit (#{largest_idx})")
    };
    plan_capacity_for(
        device,
        budget,
        &WeightNeed::new(unit_bytes, kept),
        &what,
        strategy,
        prefetch_depth,
    )
}

/// [`plan_capacity`] for a need already measured; `what` names the kept units and the largest
/// unit in the refusal.
pub(crate) fn plan_capacity_for(
    device: &str,
    budget: Budget,
    need: &WeightNeed,
    what: &str,
    strategy: OffloadStrategy,
    prefetch_depth: usize,
) -> Result<CapacityPlan> {
    budget.check_fits(device, what, need.minimum())?;
    // Fits: the reservation and the minimum are within the limit, so the room holds the minimum.
    let Some(plan) = need.plan(budget.weight_bytes(), strategy, prefetch_depth) else {
        return Err(budget.too_small(device, what, need.minimum()));
    };
    if plan.prefetch_depth < prefetch_depth {
        tracing::warn!(
            asked = prefetch_depth,
            depth = plan.prefetch_depth,
            "budget too small for the prefetch depth asked; using less"
        );
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn even(host: f64, link: f64, dev: f64) -> SplitRates {
        SplitRates::even(host, link, dev)
    }

    const MIB: u64 = 1 << 20;

    fn budget(limit_mib: u64, reserve_mib: u64) -> Budget {
        Budget {
            limit_bytes: limit_mib * MIB,
            reserve_bytes: reserve_mib * MIB,
        }
    }

    #[test]
    fn strategies_order_the_capacity() {
        let units = vec![100 * MIB; 10];
        let cap = |s| plan_capacity("d", budget(800, 100), &units, 0, s, 2).unwrap();
        let (min, bal, agg) = (
            cap(OffloadStrategy::Minimal),
            cap(OffloadStrategy::Balanced),
            cap(OffloadStrategy::Aggressive),
        );
        assert_eq!(min.weight_capacity, 700 * MIB);
        assert_eq!(agg.weight_capacity, 300 * MIB);
        assert_eq!(bal.weight_capacity, 500 * MIB);
        assert!(!min.fits_entirely);
    }

    #[test]
    fn a_model_that_fits_is_not_padded() {
        let p = plan_capacity(
            "d",
            budget(8000, 0),
            &[MIB; 4],
            0,
            OffloadStrategy::Minimal,
            2,
        )
        .unwrap();
        assert_eq!(p.weight_capacity, 4 * MIB);
        assert!(p.fits_entirely);
    }

    #[test]
    fn depth_shrinks_to_fit_and_too_small_is_refused() {
        let units = vec![100 * MIB; 10];
        let p = plan_capacity("d", budget(250, 0), &units, 0, OffloadStrategy::Minimal, 3).unwrap();
        assert_eq!(p.prefetch_depth, 1);
        let e = plan_capacity(
            "cuda:0",
            budget(150, 80),
            &units,
            0,
            OffloadStrategy::Minimal,
            1,
        )
        .unwrap_err();
        assert!(e.to_string().contains("30 MiB are missing"), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn the_depth_that_fits_is_the_deepest_floor_within_the_room(
            sizes in proptest::collection::vec(0u64..1000, 0..6),
            kept in 0u64..2000,
            room in 0u64..6000,
            asked in 0usize..=MAX_PREFETCH_DEPTH,
        ) {
            let need = WeightNeed::new(&sizes, kept);
            let by_search = (0..=asked).rev().find(|&d| need.floor(d) <= room);
            proptest::prop_assert_eq!(need.depth_that_fits(room, asked), by_search);
            proptest::prop_assert_eq!(need.min_budget(7, 0), 7 + need.minimum());
            if let Some(p) = need.plan(room, OffloadStrategy::Aggressive, asked) {
                proptest::prop_assert!(p.weight_capacity <= room);
                proptest::prop_assert!(p.weight_capacity >= need.floor(p.prefetch_depth).min(need.all()));
            }
        }
    }

    #[test]
    fn parses_strategies() {
        assert_eq!(
            "Balanced".parse::<OffloadStrategy>().unwrap(),
            OffloadStrategy::Balanced
        );
        assert!("fast"
            .parse::<OffloadStrategy>()
            .unwrap_err()
            .to_string()
            .contains("offload_strategy"));
    }

    /// A small deterministic generator for the brute-force and property loops.
    fn lcg(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        }
    }

    #[test]
    fn host_layer_split_is_the_smallest_that_fits() {
        // Brute force over small cases: the split is the smallest h whose device share fits.
        let mut next = lcg(7);
        for _ in 0..2000 {
            let n = (next() % 7) as usize;
            let layers: Vec<u64> = (0..n).map(|_| 1 + next() % 50).collect();
            let fixed = next() % 40;
            let per = next() % 5;
            let budget = next() % 300;
            let fits =
                |h: usize| fixed + per * (n - h) as u64 + layers[h..].iter().sum::<u64>() <= budget;
            let want = (0..=n).find(|&h| fits(h));
            assert_eq!(
                host_layer_split(&layers, fixed, per, budget),
                want,
                "{layers:?} {fixed} {per} {budget}"
            );
        }
        assert_eq!(host_layer_split(&[10, 10], 0, 0, 20), Some(0));
        assert_eq!(host_layer_split(&[10, 10], 0, 0, 19), Some(1));
        assert_eq!(host_layer_split(&[10, 10], 21, 0, 20), None);
        assert_eq!(host_layer_split(&[], 5, 1, 5), Some(0));
    }

    #[test]
    fn units_stay_at_their_own_size_while_the_streaming_slots_fit() {
        // Four layers of 100 own and 130 streaming bytes, 50 kept, room for 400, depth 0:
        // two stay (50 + 200 + 130 for the slot = 380), a third would leave no slot.
        let own = [100; 4];
        let streaming = [130; 4];
        let stays = staying_units(&own, &streaming, &[0, 1, 2, 3], 50, 400, 0);
        assert_eq!(stays, [true, true, false, false]);
        // Room for all at their own sizes: all stay, no slot needed.
        let stays = staying_units(&own, &streaming, &[0, 1, 2, 3], 50, 450, 0);
        assert_eq!(stays, [true; 4]);
        // Depth 1 takes two slots: one unit stays (100 + 260), two would not (200 + 260).
        let stays = staying_units(&own, &streaming, &[2, 0, 1, 3], 0, 380, 1);
        assert_eq!(stays, [false, false, true, false]);
        // A unit outside the sweep never stays.
        let stays = staying_units(&own, &streaming, &[2, 0], 0, 380, 1);
        assert_eq!(stays, [true, false, true, false]);
    }

    proptest::proptest! {
        #[test]
        fn staying_units_always_leave_the_streaming_slots(
            units in proptest::collection::vec((1u64..500, 0u64..200), 1..12),
            kept in 0u64..500,
            capacity in 0u64..4000,
            depth in 0usize..3,
            rotate in 0usize..12,
        ) {
            let own: Vec<u64> = units.iter().map(|u| u.0).collect();
            let streaming: Vec<u64> = units.iter().map(|u| u.0 + u.1).collect();
            let n = own.len();
            let mut sweep: Vec<usize> = (0..n).collect();
            sweep.rotate_left(rotate % n);
            sweep.push(sweep[0]);
            let stays = staying_units(&own, &streaming, &sweep, kept, capacity, depth);
            let staying: u64 = (0..n).filter(|&u| stays[u]).map(|u| own[u]).sum();
            let slot = (0..n).filter(|&u| !stays[u]).map(|u| streaming[u]).max().unwrap_or(0);
            if stays.iter().any(|&s| s) {
                proptest::prop_assert!(kept + staying + slot * (depth as u64 + 1) <= capacity);
            }
            // The longest prefix: one more unit staying would leave no room for the slots.
            let first: Vec<usize> = sweep[..n].to_vec();
            let k = first.iter().take_while(|&&u| stays[u]).count();
            proptest::prop_assert_eq!(stays.iter().filter(|&&s| s).count(), k);
            if k < n {
                let more: u64 = first[..=k].iter().map(|&u| own[u]).sum();
                let slot = first[k + 1..].iter().map(|&u| streaming[u]).max().unwrap_or(0);
                proptest::prop_assert!(kept + more + slot * (depth as u64 + 1) > capacity);
            }
        }
    }

    /// A split that streams nothing may run its device layers faster (replayed from a graph):
    /// the 7B Q4_K_M shape at 4 GiB, prompt 512 (measured: 2 host layers and the head, 0.52 GB
    /// streamed a token, 15.5 ms a step), priced with the measured rates but a
    /// faster link (70 GB/s: at 55 the overlap's loss alone takes it to a resident split),
    /// streams with one host layer at equal rates and takes three and streams nothing once
    /// resident layers cost 0.6 of an eager one; the eager rates are `SplitRates::even`'s.
    #[test]
    fn a_split_that_streams_nothing_may_run_its_layers_faster() {
        let mib = 1u64 << 20;
        let layers = [118 * mib; 32];
        let (head, kept_besides, per_layer) = (103 * mib, 0, 8 * mib + mib / 2);
        // Beside the head: the decode reservation's base, two layers' KV cache passing through.
        let fixed = head + kept_besides + 300 * mib + 2 * per_layer;
        let budget = 4096 * mib;
        let eager = SplitRates {
            host_bytes_per_s: 118.0 * mib as f64 / 2.1e-3,
            link_bytes_per_s: 70e9,
            device_layer_s: 0.194e-3,
            resident_device_layer_s: 0.194e-3,
        };
        let at = |rates: &SplitRates| {
            spread_host_split_at(&layers, fixed, head, per_layer, budget, 3, rates)
        };
        let (h, on_host) = at(&eager).unwrap();
        assert_eq!(
            eager,
            SplitRates::even(eager.host_bytes_per_s, 70e9, 0.194e-3)
        );
        let replayed = SplitRates {
            resident_device_layer_s: 0.6 * 0.194e-3,
            ..eager
        };
        let (h2, on_host2) = at(&replayed).unwrap();
        // What the device holds for a split: the layers it runs and its reservation.
        let need = |h: usize, on_host: bool| {
            let device: u64 = (0..32)
                .filter(|&l| !spread_host_set(h, 32)[l])
                .map(|l| layers[l])
                .sum();
            device + fixed - if on_host { head } else { 0 } + per_layer * (32 - h) as u64
        };
        // Resident now: the device holds every layer it runs.
        assert!(
            need(h2, on_host2) <= budget,
            "{h2} host layers, head on the host: {on_host2}"
        );
        assert!(h2 >= h, "{h} -> {h2}");
        // And the streaming split it replaced did stream.
        assert!(need(h, on_host) > budget, "{h} host layers must stream");
    }

    /// Splits as `spread:auto` recorded them (host layers, head on the host, compute and copies
    /// in ms), priced by `cost` over seconds; the streamed bytes at 55 GB/s.
    fn priced(
        measured: &[(usize, bool, f64, f64)],
        cost: &dyn Fn(f64, f64) -> f64,
    ) -> Vec<SplitPrice> {
        measured
            .iter()
            .map(|&(h, head, c, l)| SplitPrice {
                host_layers: h,
                host_head: head,
                host_bytes: 0,
                streamed_bytes: (l * 55e6) as u64,
                compute_s: c * 1e-3,
                copies_s: l * 1e-3,
                cost_s: cost(c * 1e-3, l * 1e-3),
            })
            .collect()
    }

    /// The splits `spread:auto` priced for a 13B Q8_0 at 12 GiB with a 512-token prompt
    /// (measured: `benches/results/2026-12-03/2026-12-03-stop44-13b-q8_0-8-12gib-7b58879-h200.json`;
    /// host layers, head on the host, compute and copies in ms). Priced as the larger of the
    /// two, the choice is three host layers and the head, streaming 1.01 GB a step, measured at
    /// 32.9 ms (0.89x llama.cpp). With the overlap's loss it is four and the head, streaming
    /// nothing, measured at 27.5 ms (0.985x).
    #[test]
    fn the_overlaps_loss_keeps_a_measured_13b_split_resident() {
        #[rustfmt::skip]
        let measured: [(usize, bool, f64, f64); 16] = [
            (0, false, 7.29, 45.16), (1, false, 12.06, 38.81), (2, false, 16.83, 32.45),
            (3, false, 21.6, 26.1), (4, false, 26.37, 19.74), (5, false, 28.59, 0.0),
            (6, false, 33.43, 0.0), (7, false, 38.28, 0.0),
            (0, true, 9.85, 41.98), (1, true, 14.62, 35.63), (2, true, 19.39, 29.27),
            (3, true, 24.16, 22.92), (4, true, 26.3, 0.0), (5, true, 31.15, 0.0),
            (6, true, 35.99, 0.0), (7, true, 40.83, 0.0),
        ];
        let list = |cost: &dyn Fn(f64, f64) -> f64| priced(&measured, cost);
        assert_eq!(spread_host_choice(&list(&f64::max)), Some((3, true)));
        assert_eq!(spread_host_choice(&list(&split_cost)), Some((4, true)));
    }

    /// The splits `spread:auto` priced for a 7B Q8_0 at 4 GiB with a 64-token prompt
    /// (measured: `benches/results/2026-12-04/2026-12-04-stop51-spread-resident-loss-9e01ec2-h200.json`;
    /// host layers, head on the host, compute and copies in ms; the neighbours of the two that
    /// ran). Without [`RESIDENT_SPLIT_LOSS`] the choice is 14 host layers and the head, nothing
    /// streaming, measured at 44.6 ms a step (0.96x llama.cpp). With it, ten and the head,
    /// streaming, measured at 37.4-38.0 ms.
    #[test]
    fn a_split_that_streams_nothing_pays_its_measured_loss() {
        #[rustfmt::skip]
        let measured: [(usize, bool, f64, f64); 16] = [
            (8, false, 20.84, 35.52), (9, false, 22.94, 31.60), (10, false, 25.03, 27.68),
            (11, false, 27.13, 23.76), (12, false, 29.23, 19.84), (13, false, 31.32, 15.92),
            (14, false, 33.42, 12.00), (15, false, 34.65, 0.0),
            (8, true, 22.28, 32.99), (9, true, 24.38, 29.08), (10, true, 26.47, 25.16),
            (11, true, 28.57, 21.24), (12, true, 30.67, 17.32), (13, true, 32.76, 13.40),
            (14, true, 33.95, 0.0), (15, true, 36.09, 0.0),
        ];
        let list = |cost: &dyn Fn(f64, f64) -> f64| priced(&measured, cost);
        // The price before it: a split that copies nothing costs its compute.
        let without = |c: f64, l: f64| if l > 0.0 { split_cost(c, l) } else { c };
        assert_eq!(spread_host_choice(&list(&without)), Some((14, true)));
        assert_eq!(spread_host_choice(&list(&split_cost)), Some((10, true)));
    }

    #[test]
    fn the_head_goes_to_the_host_only_when_that_is_cheaper() {
        let gb = 1_000_000_000u64;
        let split = |layers: &[u64], fixed, head, budget, host, dev| {
            spread_host_split_at(layers, fixed, head, 0, budget, 2, &even(host, 55e9, dev))
        };
        // Everything fits beside the head: nothing moves.
        assert_eq!(
            split(&[gb; 4], gb, gb / 4, 5 * gb, 50e9, 1e-3),
            Some((0, false))
        );
        // Nothing fits even without the head.
        assert_eq!(split(&[gb; 4], 6 * gb, gb / 4, 5 * gb, 50e9, 1e-3), None);
        // The layers fit without the head, which is half a layer: the host reads the head
        // (10 ms) rather than a layer (20 ms).
        assert_eq!(
            split(&[gb; 4], 2 * gb, gb / 2, 5 * gb + gb / 2, 50e9, 1e-3),
            Some((0, true))
        );
        // A head as large as a layer: the host reads as much either way, and the device keeps
        // the head and runs one layer fewer.
        assert_eq!(
            split(&[gb; 4], 2 * gb, gb, 5 * gb, 50e9, 1e-3),
            Some((1, false))
        );
        // The 7B F16 shape at 12 GiB (32 layers of 0.405 GB, a 0.262 GB head among 0.685 GB
        // held besides; host 80 GB/s, a device layer 0.3 ms): with the head on the device two
        // layers go to the host (19.1 ms a step; one would stream 1.17 GB, 21.2 ms and 14.4
        // of compute: 25.5). With the head on the host, one layer computes in 17.6 ms but
        // streams 0.9 GB (16.4 ms: 22.6), so the two layers stay cheaper. On a link twice as
        // fast, the head alone goes to the host (12.9 ms of compute, 11.9 of copies: 16.4).
        let layers = [405_000_000u64; 32];
        let (fixed, head, budget) = (685_000_000u64, 262_000_000u64, 12_885_000_000u64);
        assert_eq!(
            spread_host_split(&layers, fixed, 0, budget, 2, &even(80e9, 55e9, 0.3e-3)),
            Some(2)
        );
        assert_eq!(
            split(&layers, fixed, head, budget, 80e9, 0.3e-3),
            Some((2, false))
        );
        assert_eq!(
            spread_host_split_at(
                &layers,
                fixed,
                head,
                0,
                budget,
                2,
                &even(80e9, 110e9, 0.3e-3)
            ),
            Some((0, true))
        );
        // A host far slower than the link: the head stays, and the device streams.
        assert_eq!(
            split(&layers, fixed, head, budget, 0.1e9, 0.3e-3),
            Some((0, false))
        );
        // Never worse than the split without the head's choice, by the same cost model.
        let mut next = lcg(5);
        for _ in 0..2000 {
            let n = (next() % 10) as usize;
            let layers = vec![1 + next() % 50; n];
            let (fixed, budget) = (next() % 60, next() % 400);
            let head = next() % (fixed + 1);
            let (host, dev) = (1.0 + (next() % 100) as f64, (next() % 20) as f64 / 10.0);
            let rates = even(host, 30.0, dev);
            let plain = spread_host_split(&layers, fixed, 0, budget, 1, &rates);
            let with = spread_host_split_at(&layers, fixed, head, 0, budget, 1, &rates);
            if plain.is_some() {
                assert!(with.is_some());
            }
            if plain == Some(0) && fixed + layers.iter().sum::<u64>() <= budget {
                assert_eq!(with, Some((0, false)));
            }
            if let Some((h, false)) = with {
                assert_eq!(Some(h), plain, "{layers:?} {fixed} {head} {budget}");
            }
        }
    }

    /// `spread_host_prices` lists what `spread_host_split_at` weighs: the chosen split is the
    /// cheapest listed (the head on the device on ties), every listed split fits the budget, and
    /// the 13B Q8_0 shape's prices add up as the cost model says.
    #[test]
    fn spread_prices_are_what_the_split_weighs() {
        let mut next = lcg(23);
        for _ in 0..2000 {
            let n = (next() % 10) as usize;
            let layers: Vec<u64> = (0..n).map(|_| 1 + next() % 40).collect();
            let (fixed, head, per, budget) = (next() % 60, next() % 20, next() % 4, next() % 300);
            let slots = (next() % 3) as usize;
            let rates = SplitRates {
                host_bytes_per_s: 1.0 + (next() % 50) as f64,
                link_bytes_per_s: 1.0 + (next() % 50) as f64,
                device_layer_s: (next() % 10) as f64 / 10.0,
                resident_device_layer_s: (next() % 10) as f64 / 20.0,
            };
            let chosen = spread_host_split_at(&layers, fixed, head, per, budget, slots, &rates);
            let prices = spread_host_prices(&layers, fixed, head, per, budget, slots, &rates);
            assert_eq!(
                chosen.is_some(),
                !prices.is_empty(),
                "{layers:?} {fixed} {budget}"
            );
            for p in &prices {
                let reserve = if p.host_head {
                    fixed - head.min(fixed)
                } else {
                    fixed
                } + per * (n - p.host_layers) as u64;
                assert!(reserve <= budget);
                let (c, l) = (p.compute_s, p.copies_s);
                if p.streamed_bytes > 0 {
                    assert_eq!(p.cost_s, c.max(l) + SPREAD_OVERLAP_LOSS * c.min(l));
                } else {
                    assert_eq!(l, 0.0);
                    assert_eq!(p.cost_s, c * (1.0 + RESIDENT_SPLIT_LOSS));
                }
                assert_eq!(p.cost_s, split_cost(c, l));
            }
            let Some((h, on_host)) = chosen else {
                continue;
            };
            let pick = prices
                .iter()
                .find(|p| (p.host_layers, p.host_head) == (h, on_host && head.min(fixed) > 0))
                .expect("the chosen split is listed");
            let fits_whole = prices
                .iter()
                .any(|p| p.host_layers == 0 && !p.host_head && p.streamed_bytes == 0);
            if !fits_whole {
                let least = prices
                    .iter()
                    .map(|p| p.cost_s)
                    .fold(f64::INFINITY, f64::min);
                assert_eq!(pick.cost_s, least, "{layers:?} {fixed} {head} {budget}");
            }
        }
        // 40 layers of 0.345 GB, 1.3 GB held besides, head 0.17 GB, 4 GiB.
        let layer = 345_000_000u64;
        let rates = SplitRates {
            host_bytes_per_s: 61e9,
            link_bytes_per_s: 55e9,
            device_layer_s: 0.5e-3,
            resident_device_layer_s: 0.5e-3,
        };
        let prices = spread_host_prices(
            &[layer; 40],
            1_300_000_000,
            170_000_000,
            0,
            4 << 30,
            2,
            &rates,
        );
        let p = prices
            .iter()
            .find(|p| p.host_layers == 17 && p.host_head)
            .expect("listed");
        assert_eq!(p.host_bytes, 17 * layer + 170_000_000);
        let compute = 23.0 * 0.5e-3 + p.host_bytes as f64 / 61e9;
        assert!((p.compute_s - compute).abs() < 1e-12);
        assert!((p.copies_s - p.streamed_bytes as f64 / 55e9).abs() < 1e-12);
    }

    #[test]
    fn spread_host_split_balances_host_and_link() {
        let gb = 1_000_000_000u64;
        // Everything fits: no host layer.
        assert_eq!(
            spread_host_split(&[gb; 4], 0, 0, 4 * gb, 2, &even(1e9, 1e9, 0.0)),
            Some(0)
        );
        assert_eq!(
            spread_host_split(&[gb; 4], 5 * gb, 0, 4 * gb, 2, &even(1e9, 1e9, 0.0)),
            None
        );
        // The 13B Q8_0 shape at 4 GiB as measured (40 layers of 0.345 GB, ~1.3 GB held
        // besides, host 61 GB/s, link 55 GB/s): about half of what does not fit goes to the host.
        let layer = 345_000_000u64;
        let kv = 3_300_000u64;
        let dev = 0.5e-3;
        let split = |host| {
            spread_host_split(
                &[layer; 40],
                1_300_000_000,
                kv,
                4 << 30,
                2,
                &even(host, 55e9, dev),
            )
        };
        let h = split(61e9).expect("fits");
        assert!((15..=20).contains(&h), "{h}");
        // A host much slower than the link: few host layers; much faster: more.
        let (slow, fast) = (split(5e9), split(500e9));
        assert!(
            slow.unwrap() < h && fast.unwrap() > h,
            "{slow:?} {h} {fast:?}"
        );
        // The device's own time counts: 40 layers of 0.19 GB, 0.48 GB of them streamed
        // (8.7 ms at 55 GB/s) behind 10.8 ms of device compute, a host layer 4.2 ms. A host
        // layer would only add to the compute: none. Blind to the device's time, it would
        // take some (as `spread:auto` did measured on a 13B Q4_K_M at 8 GiB: 65.8 tok/s
        // against 72.7 with none).
        let (layer, fixed, budget) = (190_000_000u64, 600_000_000, 8_100_000_000);
        let split =
            |dev| spread_host_split(&[layer; 40], fixed, 0, budget, 2, &even(45e9, 55e9, dev));
        assert_eq!(split(0.27e-3), Some(0));
        assert!(split(0.0).unwrap() > 0);
        // Equal layers: a faster host never takes fewer layers (its time per layer only
        // falls; the link's part only falls as layers leave the device).
        let mut next = lcg(11);
        for _ in 0..2000 {
            let n = (next() % 12) as usize;
            let layers = vec![1 + next() % 50; n];
            let (fixed, per, budget) = (next() % 40, next() % 5, next() % 400);
            let slots = (next() % 3) as usize;
            let link = 1.0 + (next() % 100) as f64;
            let (slow, fast) = (1.0 + (next() % 100) as f64, 1.0 + (next() % 100) as f64);
            let (slow, fast) = (slow.min(fast), slow.max(fast));
            let dev = (next() % 20) as f64 / 10.0;
            let split = |host| {
                spread_host_split(&layers, fixed, per, budget, slots, &even(host, link, dev))
            };
            let (a, b) = (split(slow), split(fast));
            assert_eq!(a.is_some(), fixed <= budget);
            assert!(
                a <= b,
                "{layers:?} {fixed} {per} {budget} {slots} {slow} {fast} {link}"
            );
            // Whatever fits whole takes no host layer.
            if fixed + (per + layers.first().copied().unwrap_or(0)) * n as u64 <= budget {
                assert_eq!(a, Some(0));
            }
        }
        // Spread sets: h layers, evenly apart.
        for n in 0..30 {
            for h in 0..=n {
                assert_eq!(spread_host_set(h, n).iter().filter(|&&b| b).count(), h);
            }
        }
    }
}
