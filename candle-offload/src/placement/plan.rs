//! The placement planners: sequential and balanced device maps under per-device budgets, and
//! the refusal with the MiB each device is missing. Pure; property tests against a brute force.

use std::collections::HashMap;
use std::ops::Range;

use super::types::{
    DeviceBudget, DeviceMap, DevicePlacement, PlacementError, PlacementMode, PlacementRequest,
    Residency, Result, UnitPlacement,
};
use crate::budget::mib_ceil;
use crate::plan::{OffloadStrategy, WeightNeed, MAX_PREFETCH_DEPTH};

/// Places the layers of `req` on its devices, or says how many MiB each device is missing.
///
/// See the [module documentation](crate::placement) for the modes and for when a placement is
/// refused ([`PlacementError::Impossible`]). Malformed requests (no device, no layer, a device listed
/// twice, a unit name used twice, a prefetch depth over [`MAX_PREFETCH_DEPTH`]) are refused with
/// [`PlacementError::InvalidRequest`].
pub fn plan_placement(req: &PlacementRequest<'_>) -> Result<DeviceMap> {
    let m = Model::new(req)?;
    let counts = match req.mode {
        PlacementMode::Sequential => sequential(&m)?.0,
        PlacementMode::Balanced => balanced(&m)?,
    };
    m.build(Some(req.mode), &counts, None)
}

/// A checked request, with the layer sizes at hand.
pub(super) struct Model<'r, 'a> {
    req: &'r PlacementRequest<'a>,
    sizes: Vec<u64>,
    pre_bytes: u64,
    post_bytes: u64,
}

/// How a stage would hold its layers.
#[derive(Debug, Clone, Copy)]
struct StageFit {
    streams: bool,
    depth: usize,
    resident_bytes: u64,
}

/// Marks layers resident in order while they fit in `free` bytes.
fn first_fit(sizes: &[u64], mut free: u64) -> Vec<bool> {
    sizes
        .iter()
        .map(|&s| {
            let fits = s <= free;
            if fits {
                free -= s;
            }
            fits
        })
        .collect()
}

/// How `dev` would hold `kept` bytes of kept units and the layers `sizes`, or `None` when it
/// cannot (the reservation, the kept units and the largest layer exceed the budget).
fn fit_stage(dev: &DeviceBudget, kept: u64, sizes: &[u64], depth_req: usize) -> Option<StageFit> {
    let need = WeightNeed::new(sizes, kept);
    if !dev.fits(need.minimum()) {
        return None;
    }
    let room = dev.budget().weight_bytes();
    if need.all() <= room {
        return Some(StageFit {
            streams: false,
            depth: depth_req,
            resident_bytes: need.evictable,
        });
    }
    let depth = need.depth_that_fits(room, depth_req)?;
    let free = room - need.floor(depth);
    let resident_bytes = sizes
        .iter()
        .zip(first_fit(sizes, free))
        .filter(|(_, r)| *r)
        .map(|(&s, _)| s)
        .sum();
    Some(StageFit {
        streams: true,
        depth,
        resident_bytes,
    })
}

/// Which path the sequential planner took (for tests of its fill order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SeqPath {
    /// Everything resident.
    Resident,
    /// One device streams the tail.
    OneStreamer,
    /// Searched among all assignments.
    Search,
}

impl<'r, 'a> Model<'r, 'a> {
    pub(super) fn new(req: &'r PlacementRequest<'a>) -> Result<Self> {
        let bad = |field: &str, reason: String| PlacementError::InvalidRequest {
            field: field.to_string(),
            reason,
        };
        if req.devices.is_empty() {
            return Err(bad("devices", "no device to place the model on".into()));
        }
        if req.layers.is_empty() {
            return Err(bad("layers", "the model has no layer to place".into()));
        }
        if req.prefetch_depth > MAX_PREFETCH_DEPTH {
            return Err(bad(
                "prefetch_depth",
                format!("{} is more than {MAX_PREFETCH_DEPTH}", req.prefetch_depth),
            ));
        }
        for (i, d) in req.devices.iter().enumerate() {
            if req.devices[..i].iter().any(|e| e.ordinal == d.ordinal) {
                return Err(bad("devices", format!("GPU {} is listed twice", d.ordinal)));
            }
        }
        let mut names = HashMap::new();
        for (name, _) in req.pre.iter().chain(req.layers).chain(req.post) {
            if names.insert(name.as_str(), ()).is_some() {
                return Err(bad(
                    "units",
                    format!("the unit name {name:?} is used twice"),
                ));
            }
        }
        let total = |units: &[(String, u64)]| units.iter().fold(0u64, |a, u| a.saturating_add(u.1));
        Ok(Self {
            req,
            sizes: req.layers.iter().map(|l| l.1).collect(),
            pre_bytes: total(req.pre),
            post_bytes: total(req.post),
        })
    }

    pub(super) fn n(&self) -> usize {
        self.sizes.len()
    }

    /// Kept bytes of a stage running layers `start..end`.
    pub(super) fn kept_bytes(&self, start: usize, end: usize) -> u64 {
        let pre = if start == 0 { self.pre_bytes } else { 0 };
        let post = if end == self.n() { self.post_bytes } else { 0 };
        pre.saturating_add(post)
    }

    pub(super) fn is_pre(&self, name: &str) -> bool {
        self.req.pre.iter().any(|(n, _)| n == name)
    }

    pub(super) fn layer_name(&self, layer: usize) -> String {
        format!("layer {layer} ({})", self.req.layers[layer].0)
    }

    pub(super) fn describe_layers(&self, r: Range<usize>) -> String {
        if r.len() == 1 {
            format!("{} is", self.layer_name(r.start))
        } else {
            format!(
                "layers {}..{} ({} to {}) are",
                r.start,
                r.end,
                self.req.layers[r.start].0,
                self.req.layers[r.end - 1].0
            )
        }
    }

    /// Every unit in execution order: name, bytes, layer index (for layers).
    pub(super) fn units(&self) -> impl Iterator<Item = (&'a str, u64, Option<usize>)> + '_ {
        let req = self.req;
        req.pre
            .iter()
            .map(|(n, b)| (n.as_str(), *b, None))
            .chain(
                req.layers
                    .iter()
                    .enumerate()
                    .map(|(i, (n, b))| (n.as_str(), *b, Some(i))),
            )
            .chain(req.post.iter().map(|(n, b)| (n.as_str(), *b, None)))
    }

    /// Each device's layers, from per-device counts that sum to the number of layers.
    pub(super) fn ranges(&self, counts: &[usize]) -> Vec<Range<usize>> {
        let mut start = 0;
        counts
            .iter()
            .map(|&c| {
                let r = start..start + c;
                start += c;
                r
            })
            .collect()
    }

    /// The device position of every unit (as [`Self::units`] lists them).
    pub(super) fn owners(&self, counts: &[usize]) -> Vec<usize> {
        let first = counts.iter().position(|&c| c > 0).unwrap_or(0);
        let last = counts.iter().rposition(|&c| c > 0).unwrap_or(0);
        let mut owners = vec![first; self.req.pre.len()];
        for (pos, &c) in counts.iter().enumerate() {
            owners.extend(std::iter::repeat_n(pos, c));
        }
        owners.extend(std::iter::repeat_n(last, self.req.post.len()));
        owners
    }

    /// What the stage running layers `r` needs for its weights.
    pub(super) fn stage_need(&self, r: Range<usize>) -> WeightNeed {
        WeightNeed::new(&self.sizes[r.clone()], self.kept_bytes(r.start, r.end))
    }

    /// What a stage must hold, for messages.
    pub(super) fn stage_needs(&self, dev: &DeviceBudget, r: Range<usize>) -> String {
        let kept = self.kept_bytes(r.start, r.end);
        let (largest_idx, largest) = self.sizes[r.clone()]
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|&(i, s)| (s, std::cmp::Reverse(i)))
            .map_or((r.start, 0), |(i, s)| (r.start + i, s));
        format!(
            "GPU {} (budget {} MiB) runs layers {}..{} and must hold its reservation ({} MiB), \
             its kept units ({} MiB) and its largest layer, {} ({} MiB)",
            dev.ordinal,
            dev.budget_bytes >> 20,
            r.start,
            r.end,
            mib_ceil(dev.reserve_bytes),
            mib_ceil(kept),
            self.req.layers[largest_idx].0,
            mib_ceil(largest)
        )
    }

    /// The refusal for per-device counts whose stages are not all possible.
    pub(super) fn impossible(&self, counts: &[usize]) -> PlacementError {
        let mut per_device = Vec::new();
        let mut reasons = Vec::new();
        for (dev, r) in self.req.devices.iter().zip(self.ranges(counts)) {
            let missing = if r.is_empty() {
                0
            } else {
                dev.missing(self.stage_need(r.clone()).minimum())
            };
            if missing > 0 {
                reasons.push(self.stage_needs(dev, r));
            }
            per_device.push((dev.ordinal, mib_ceil(missing)));
        }
        PlacementError::Impossible {
            mode: self.req.mode,
            per_device,
            reason: reasons.join("; "),
        }
    }

    /// The contiguous assignment that needs the fewest bytes added to budgets (zero when one is
    /// possible), as per-device counts, and those bytes.
    pub(super) fn cheapest_fix(&self) -> (Vec<usize>, u64) {
        let (n, dc) = (self.n(), self.req.devices.len());
        // cost[p][i]: placing layers i.. on devices p..; choice: where device p's range ends.
        let mut cost = vec![vec![u64::MAX; n + 1]; dc + 1];
        let mut choice = vec![vec![0usize; n + 1]; dc + 1];
        cost[dc][n] = 0;
        for p in (0..dc).rev() {
            let dev = &self.req.devices[p];
            cost[p][n] = 0;
            choice[p][n] = n;
            let (here, later) = cost.split_at_mut(p + 1);
            let (here, next) = (&mut here[p], &later[0]);
            for i in (0..n).rev() {
                let (mut best, mut best_j) = (next[i], i);
                let mut largest = 0u64;
                for (j, &rest) in next.iter().enumerate().skip(i + 1) {
                    largest = largest.max(self.sizes[j - 1]);
                    if rest == u64::MAX {
                        continue;
                    }
                    let need = WeightNeed {
                        kept: self.kept_bytes(i, j),
                        largest,
                        evictable: 0,
                    };
                    let miss = dev.missing(need.minimum());
                    let total = miss.saturating_add(rest);
                    if total <= best {
                        (best, best_j) = (total, j);
                    }
                }
                here[i] = best;
                choice[p][i] = best_j;
            }
        }
        let mut counts = Vec::with_capacity(dc);
        let mut i = 0;
        for row in choice.iter().take(dc) {
            let j = row[i];
            counts.push(j - i);
            i = j;
        }
        (counts, cost[0][0])
    }

    /// How many layers from `start` device `dev` can hold resident.
    pub(super) fn resident_run(&self, dev: &DeviceBudget, start: usize) -> usize {
        let n = self.n();
        let mut sum = if start == 0 { self.pre_bytes } else { 0 };
        let mut k = 0;
        while start + k < n {
            let next = sum.saturating_add(self.sizes[start + k]);
            let post = if start + k + 1 == n {
                self.post_bytes
            } else {
                0
            };
            if !dev.fits(next.saturating_add(post)) {
                break;
            }
            sum = next;
            k += 1;
        }
        k
    }

    /// Among all contiguous assignments with possible stages, the one with the most resident
    /// bytes (ties: earlier devices take more layers).
    pub(super) fn search(&self) -> Option<Vec<usize>> {
        let (n, dc) = (self.n(), self.req.devices.len());
        let mut best: Vec<Vec<Option<(u64, usize)>>> = vec![vec![None; n + 1]; dc + 1];
        best[dc][n] = Some((0, n));
        for p in (0..dc).rev() {
            let dev = &self.req.devices[p];
            best[p][n] = Some((0, n));
            let (here, later) = best.split_at_mut(p + 1);
            let (here, next) = (&mut here[p], &later[0]);
            for i in (0..n).rev() {
                let mut cur = next[i].map(|(r, _)| (r, i));
                for (j, entry) in next.iter().enumerate().skip(i + 1) {
                    let Some((rest, _)) = *entry else {
                        continue;
                    };
                    let kept = self.kept_bytes(i, j);
                    let Some(fit) =
                        fit_stage(dev, kept, &self.sizes[i..j], self.req.prefetch_depth)
                    else {
                        continue;
                    };
                    let total = rest.saturating_add(fit.resident_bytes);
                    if cur.is_none_or(|(c, _)| total >= c) {
                        cur = Some((total, j));
                    }
                }
                here[i] = cur;
            }
        }
        let mut counts = Vec::with_capacity(dc);
        let mut i = 0;
        for row in best.iter().take(dc) {
            let (_, j) = row[i]?;
            counts.push(j - i);
            i = j;
        }
        Some(counts)
    }

    /// Per-device counts of the map for `counts`, with capacities from [`plan_capacity`].
    pub(super) fn build(
        &self,
        mode: Option<PlacementMode>,
        counts: &[usize],
        source: Option<String>,
    ) -> Result<DeviceMap> {
        let req = self.req;
        let n = self.n();
        let first = counts.iter().position(|&c| c > 0).unwrap_or(0);
        let last = counts.iter().rposition(|&c| c > 0).unwrap_or(0);
        let mut devices = Vec::with_capacity(counts.len());
        let mut layer_residency = vec![Residency::Streamed; n];
        for (pos, (dev, r)) in req.devices.iter().zip(self.ranges(counts)).enumerate() {
            let mut placed = DevicePlacement {
                ordinal: dev.ordinal,
                budget_bytes: dev.budget_bytes,
                reserve_bytes: dev.reserve_bytes,
                first_layer: r.start,
                layer_count: r.len(),
                kept: Vec::new(),
                resident_layers: 0,
                streams: false,
                prefetch_depth: 0,
                weight_capacity: 0,
            };
            if !r.is_empty() {
                if pos == first {
                    placed.kept.extend(req.pre.iter().map(|u| u.0.clone()));
                }
                if pos == last {
                    placed.kept.extend(req.post.iter().map(|u| u.0.clone()));
                }
                let sizes = &self.sizes[r.clone()];
                let need = self.stage_need(r.clone());
                // Split as `plan_capacity` splits one device's budget (strategy minimal).
                let Some(cap) = need.plan(
                    dev.budget().weight_bytes(),
                    OffloadStrategy::Minimal,
                    req.prefetch_depth,
                ) else {
                    return Err(self.impossible(counts));
                };
                if !cap.fits_entirely && cap.prefetch_depth < req.prefetch_depth {
                    tracing::warn!(
                        gpu = dev.ordinal,
                        asked = req.prefetch_depth,
                        depth = cap.prefetch_depth,
                        "budget too small for the prefetch depth asked; using less"
                    );
                }
                placed.streams = !cap.fits_entirely;
                placed.prefetch_depth = cap.prefetch_depth;
                placed.weight_capacity = cap.weight_capacity;
                let resident = if placed.streams {
                    first_fit(
                        sizes,
                        cap.weight_capacity
                            .saturating_sub(need.floor(cap.prefetch_depth)),
                    )
                } else {
                    vec![true; sizes.len()]
                };
                for (i, res) in r.clone().zip(resident) {
                    if res {
                        placed.resident_layers += 1;
                        layer_residency[i] = Residency::Resident;
                    }
                }
            }
            devices.push(placed);
        }
        let owners = self.owners(counts);
        let units = self
            .units()
            .zip(owners)
            .map(|((name, bytes, layer), pos)| UnitPlacement {
                name: name.to_string(),
                bytes,
                device: req.devices[pos].ordinal,
                residency: layer.map_or(Residency::Kept, |i| layer_residency[i]),
            })
            .collect();
        Ok(DeviceMap {
            mode,
            prefetch_depth: req.prefetch_depth,
            devices,
            units,
            decode_share_bytes: 0,
            source,
        })
    }
}

/// Sequential counts per device, and the path taken.
fn sequential(m: &Model<'_, '_>) -> Result<(Vec<usize>, SeqPath)> {
    let (fix, missing) = m.cheapest_fix();
    if missing > 0 {
        return Err(m.impossible(&fix));
    }
    let (n, devices) = (m.n(), m.req.devices);
    let dc = devices.len();
    // Resident fill, device after device.
    let mut counts = vec![0usize; dc];
    let mut starts = vec![0usize; dc];
    let mut i = 0;
    for (p, dev) in devices.iter().enumerate() {
        starts[p] = i;
        let k = m.resident_run(dev, i);
        counts[p] = k;
        i += k;
    }
    if i == n {
        return Ok((counts, SeqPath::Resident));
    }
    // One device streams the tail: the last with layers, later ones, then earlier ones.
    let candidates: Vec<usize> = match counts.iter().rposition(|&c| c > 0) {
        Some(l) => (l..dc).chain((0..l).rev()).collect(),
        None => (0..dc).collect(),
    };
    for full_depth in [true, false] {
        for &s in &candidates {
            let start = starts[s];
            let kept = m.kept_bytes(start, n);
            let Some(fit) = fit_stage(&devices[s], kept, &m.sizes[start..], m.req.prefetch_depth)
            else {
                continue;
            };
            if full_depth && fit.streams && fit.depth < m.req.prefetch_depth {
                continue;
            }
            let mut out = counts.clone();
            out[s] = n - start;
            for c in &mut out[s + 1..] {
                *c = 0;
            }
            return Ok((out, SeqPath::OneStreamer));
        }
    }
    match m.search() {
        Some(counts) => Ok((counts, SeqPath::Search)),
        None => Err(m.impossible(&fix)),
    }
}

/// Balanced counts per device.
fn balanced(m: &Model<'_, '_>) -> Result<Vec<usize>> {
    let (n, dc) = (m.n(), m.req.devices.len());
    let counts: Vec<usize> = (0..dc).map(|p| n / dc + usize::from(p < n % dc)).collect();
    let possible = m.req.devices.iter().zip(m.ranges(&counts)).all(|(dev, r)| {
        r.is_empty()
            || fit_stage(
                dev,
                m.kept_bytes(r.start, r.end),
                &m.sizes[r],
                m.req.prefetch_depth,
            )
            .is_some()
    });
    if possible {
        Ok(counts)
    } else {
        Err(m.impossible(&counts))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::placement::testutil::*;
    use crate::plan::plan_capacity;

    /// Brute force: whether some contiguous assignment (all of them for sequential, the
    /// balanced one for balanced) has only possible stages.
    fn brute_possible(c: &Case) -> bool {
        let n = c.layers.len();
        let d = c.devices.len();
        let pre: u64 = c.pre.iter().map(|u| u.1).sum();
        let post: u64 = c.post.iter().map(|u| u.1).sum();
        let ok = |counts: &[usize]| {
            let mut start = 0;
            counts.iter().zip(&c.devices).all(|(&k, dev)| {
                let r = start..start + k;
                start += k;
                if r.is_empty() {
                    return true;
                }
                let mut need = c.layers[r.clone()].iter().map(|u| u.1).max().unwrap();
                if r.start == 0 {
                    need += pre;
                }
                if r.end == n {
                    need += post;
                }
                dev.reserve_bytes + need <= dev.budget_bytes
            })
        };
        match c.mode {
            PlacementMode::Balanced => {
                let counts: Vec<usize> = (0..d).map(|p| n / d + usize::from(p < n % d)).collect();
                ok(&counts)
            }
            PlacementMode::Sequential => {
                // Every composition of n into d parts.
                fn rec(
                    left: usize,
                    parts: usize,
                    acc: &mut Vec<usize>,
                    f: &dyn Fn(&[usize]) -> bool,
                ) -> bool {
                    if parts == 1 {
                        acc.push(left);
                        let r = f(acc);
                        acc.pop();
                        return r;
                    }
                    for k in 0..=left {
                        acc.push(k);
                        let r = rec(left - k, parts - 1, acc, f);
                        acc.pop();
                        if r {
                            return true;
                        }
                    }
                    false
                }
                rec(n, d, &mut Vec::new(), &ok)
            }
        }
    }

    /// Checks the invariants every map must have, for `c`.
    fn check_map(c: &Case, map: &DeviceMap) -> std::result::Result<(), TestCaseError> {
        let n = c.layers.len();
        prop_assert_eq!(map.devices.len(), c.devices.len());
        // Ranges tile the layers in device order.
        let mut cursor = 0;
        for (d, b) in map.devices.iter().zip(&c.devices) {
            prop_assert_eq!(d.ordinal, b.ordinal);
            prop_assert_eq!(d.first_layer, cursor);
            cursor += d.layer_count;
        }
        prop_assert_eq!(cursor, n);
        // Units: each once, in order, on the device of its range.
        let names: Vec<&str> = c
            .pre
            .iter()
            .chain(&c.layers)
            .chain(&c.post)
            .map(|u| u.0.as_str())
            .collect();
        let got: Vec<&str> = map.units.iter().map(|u| u.name.as_str()).collect();
        prop_assert_eq!(got, names);
        let stages = map.stages();
        prop_assert!(!stages.is_empty());
        let (first, last) = (stages[0].0, stages[stages.len() - 1].0);
        for (i, u) in map.units.iter().enumerate() {
            if i < c.pre.len() {
                prop_assert_eq!(u.device, first);
                prop_assert_eq!(u.residency, Residency::Kept);
            } else if i < c.pre.len() + n {
                prop_assert_eq!(Some(u.device), map.device_of_layer(i - c.pre.len()));
                prop_assert!(u.residency != Residency::Kept);
            } else {
                prop_assert_eq!(u.device, last);
                prop_assert_eq!(u.residency, Residency::Kept);
            }
        }
        // Never over a budget.
        for (d, b) in map.devices.iter().zip(&c.devices) {
            let mine: Vec<&UnitPlacement> =
                map.units.iter().filter(|u| u.device == d.ordinal).collect();
            if d.layer_count == 0 {
                prop_assert!(mine.is_empty() && d.kept.is_empty() && !d.streams);
                continue;
            }
            let kept: u64 = mine
                .iter()
                .filter(|u| u.residency == Residency::Kept)
                .map(|u| u.bytes)
                .sum();
            let resident: u64 = mine
                .iter()
                .filter(|u| u.residency == Residency::Resident)
                .map(|u| u.bytes)
                .sum();
            let resident_count = mine
                .iter()
                .filter(|u| u.residency == Residency::Resident)
                .count();
            prop_assert_eq!(resident_count, d.resident_layers);
            let largest = c.layers[d.layers()].iter().map(|u| u.1).max().unwrap();
            let floor = if d.streams {
                largest * (d.prefetch_depth as u64 + 1)
            } else {
                0
            };
            prop_assert!(d.streams == (d.resident_layers < d.layer_count) || largest == 0);
            prop_assert!(b.reserve_bytes + kept + resident + floor <= b.budget_bytes);
            prop_assert!(kept + resident + floor <= d.weight_capacity);
            prop_assert!(b.reserve_bytes + d.weight_capacity <= b.budget_bytes);
            prop_assert!(d.prefetch_depth <= c.depth);
        }
        Ok(())
    }

    fn arb_case() -> impl Strategy<Value = Case> {
        (
            proptest::collection::vec(1u64..3 * MIB, 0..=2),
            prop_oneof![
                (1u64..4 * MIB, 1usize..=8).prop_map(|(s, n)| vec![s; n]),
                proptest::collection::vec(0u64..4 * MIB, 1..=8),
                // Small layers and a few large ones: where one streaming device is not enough.
                proptest::collection::vec(
                    prop_oneof![3 => 1u64..MIB / 2, 1 => 3 * MIB..6 * MIB],
                    1..=8
                ),
            ],
            proptest::collection::vec(0u64..3 * MIB, 0..=2),
            proptest::collection::vec((0u64..24 * MIB, 0u64..2 * MIB), 1..=4),
            prop_oneof![
                Just(PlacementMode::Sequential),
                Just(PlacementMode::Balanced)
            ],
            0usize..=3,
        )
            .prop_map(|(pre, layers, post, devs, mode, depth)| Case {
                pre: named("pre", &pre),
                layers: named("layers", &layers),
                post: named("post", &post),
                devices: devs
                    .iter()
                    .enumerate()
                    .map(|(i, &(b, r))| DeviceBudget::new(3 - i, b, r))
                    .collect(),
                mode,
                depth,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn plans_are_sound_and_refused_only_when_impossible(c in arb_case()) {
            let req = c.req();
            let possible = brute_possible(&c);
            match plan_placement(&req) {
                Ok(map) => {
                    prop_assert!(possible, "planned an impossible case: {map}");
                    check_map(&c, &map)?;
                    if c.mode == PlacementMode::Balanced {
                        let counts: Vec<usize> = map.devices.iter().map(|d| d.layer_count).collect();
                        let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                        prop_assert!(hi - lo <= 1);
                        prop_assert!(counts.windows(2).all(|w| w[0] >= w[1]));
                    }
                    // JSON round trip, and a planned map validates to itself.
                    let back = DeviceMap::from_json(&map.to_json().unwrap(), "t.json").unwrap();
                    prop_assert_eq!(&back, &map);
                    prop_assert_eq!(back.validate(&req).unwrap(), map);
                }
                Err(PlacementError::Impossible { per_device, .. }) => {
                    prop_assert!(!possible);
                    prop_assert!(per_device.iter().any(|&(_, m)| m > 0));
                    // Adding what is reported makes it possible.
                    let mut bigger = c;
                    for (d, (ordinal, mib)) in bigger.devices.iter_mut().zip(&per_device) {
                        prop_assert_eq!(d.ordinal, *ordinal);
                        d.budget_bytes += mib * MIB;
                    }
                    let map = plan_placement(&bigger.req());
                    prop_assert!(map.is_ok(), "still refused: {:?}", map.err());
                    check_map(&bigger, &map.unwrap())?;
                }
                Err(other) => prop_assert!(false, "unexpected error {other}"),
            }
        }

        #[test]
        fn sequential_fills_earlier_devices_first(mut c in arb_case()) {
            c.mode = PlacementMode::Sequential;
            let req = c.req();
            let Ok(m) = Model::new(&req) else { return Ok(()) };
            let Ok((counts, path)) = sequential(&m) else { return Ok(()) };
            if path == SeqPath::Search {
                return Ok(());
            }
            let map = m.build(Some(c.mode), &counts, None).unwrap();
            let n = c.layers.len();
            let pre: u64 = c.pre.iter().map(|u| u.1).sum();
            let post: u64 = c.post.iter().map(|u| u.1).sum();
            let later_resident = |p: usize| map.devices[p + 1..].iter().any(|d| d.resident_layers > 0);
            for (p, d) in map.devices.iter().enumerate() {
                if d.streams || !later_resident(p) {
                    continue;
                }
                // Full: it could not also hold the next layer resident.
                let next = d.layers().end;
                prop_assert!(next < n);
                let mut need: u64 = c.layers[d.first_layer..=next].iter().map(|u| u.1).sum();
                if d.first_layer == 0 {
                    need += pre;
                }
                if next + 1 == n {
                    need += post;
                }
                let b = &c.devices[p];
                prop_assert!(b.reserve_bytes + need > b.budget_bytes, "GPU {} is not full: {}", d.ordinal, map);
            }
            // At most one device streams.
            prop_assert!(map.devices.iter().filter(|d| d.streams).count() <= 1);
        }

        #[test]
        fn one_device_is_plan_capacity(c in arb_case()) {
            let c = Case { devices: c.devices[..1].to_vec(), ..c };
            let req = c.req();
            let sizes: Vec<u64> = c.layers.iter().map(|u| u.1).collect();
            let kept: u64 = c.pre.iter().chain(&c.post).map(|u| u.1).sum();
            let cap = plan_capacity("cuda:0", c.devices[0].budget(), &sizes, kept, OffloadStrategy::Minimal, c.depth);
            match (plan_placement(&req), cap) {
                (Ok(map), Ok(cap)) => {
                    let d = &map.devices[0];
                    prop_assert_eq!(d.layer_count, c.layers.len());
                    prop_assert_eq!(d.weight_capacity, cap.weight_capacity);
                    prop_assert_eq!(d.prefetch_depth, cap.prefetch_depth);
                    prop_assert_eq!(d.streams, !cap.fits_entirely);
                }
                (Err(PlacementError::Impossible { per_device, .. }), Err(crate::error::Error::BudgetTooSmall { missing_mib, .. })) => {
                    prop_assert_eq!(per_device, vec![(c.devices[0].ordinal, missing_mib)]);
                }
                (a, b) => prop_assert!(false, "disagree: {:?} vs {:?}", a.map(|m| m.to_string()), b),
            }
        }
    }

    #[test]
    fn a_middle_device_streams_when_the_last_cannot() {
        // GPU 1 can hold the head beside the small last layer, but not beside a large one:
        // no single device can stream the tail, so GPU 0 streams the two large layers.
        let c = Case {
            pre: Vec::new(),
            layers: named("layers", &[24 * MIB, 24 * MIB, MIB]),
            post: named("post", &[17 * MIB]),
            devices: vec![
                DeviceBudget::new(0, 26 * MIB, MIB),
                DeviceBudget::new(1, 53 * MIB, 13 * MIB),
            ],
            mode: PlacementMode::Sequential,
            depth: 1,
        };
        let req = c.req();
        let m = Model::new(&req).unwrap();
        assert_eq!(sequential(&m).unwrap().1, SeqPath::Search);
        let map = plan_placement(&req).unwrap();
        assert_eq!(map.stages(), vec![(0, 0..2), (1, 2..3)]);
        let (d0, d1) = (&map.devices[0], &map.devices[1]);
        assert!(d0.streams && d0.prefetch_depth == 0 && d0.resident_layers == 0);
        assert!(!d1.streams && d1.resident_layers == 1);
    }

    #[test]
    fn llama7b_on_two_4gib_and_two_6gib_cards_all_resident() {
        let c = llama7b(
            &[(4096, 600), (4096, 600), (6144, 600), (6144, 600)],
            PlacementMode::Sequential,
            1,
        );
        let map = plan_placement(&c.req()).unwrap();
        let counts: Vec<usize> = map.devices.iter().map(|d| d.layer_count).collect();
        // (4096-600-250)/386 = 8, 3496/386 = 9, 5544/386 = 14, and the last layer with the head.
        assert_eq!(counts, [8, 9, 14, 1]);
        assert!(map.devices.iter().all(|d| !d.streams));
        assert_eq!(map.devices[0].kept, ["model.embed_tokens"]);
        assert_eq!(map.devices[3].kept, ["model.norm", "lm_head"]);
        assert_eq!(
            map.stages(),
            vec![(0, 0..8), (1, 8..17), (2, 17..31), (3, 31..32)]
        );
        assert_eq!(map.device_of_layer(16), Some(1));
        assert_eq!(map.device_of_layer(32), None);
        assert_eq!(map.streamed_bytes(), 0);
        let text = map.to_string();
        assert!(text.contains("17..31"), "{text}");

        let c = Case {
            mode: PlacementMode::Balanced,
            ..c
        };
        let map = plan_placement(&c.req()).unwrap();
        let counts: Vec<usize> = map.devices.iter().map(|d| d.layer_count).collect();
        assert_eq!(counts, [8, 8, 8, 8]);
        assert!(map.devices.iter().all(|d| !d.streams));
        assert_eq!(map.devices[0].weight_capacity, (250 + 8 * 386) * MIB);
    }

    #[test]
    fn llama7b_on_two_4gib_cards_streams_through_the_second() {
        let c = llama7b(&[(4096, 600), (4096, 600)], PlacementMode::Sequential, 1);
        let map = plan_placement(&c.req()).unwrap();
        println!("{map}");
        let (d0, d1) = (&map.devices[0], &map.devices[1]);
        assert_eq!(
            (d0.layer_count, d0.resident_layers, d0.streams),
            (8, 8, false)
        );
        // 3496 - 250 (head) - 2 x 386 (floor at depth 1) = 2474 MiB: 6 resident layers.
        assert_eq!(
            (d1.layers(), d1.resident_layers, d1.streams),
            (8..32, 6, true)
        );
        assert_eq!(d1.prefetch_depth, 1);
        assert_eq!(d1.weight_capacity, 3496 * MIB);
        assert_eq!(map.streamed_bytes(), 18 * 386 * MIB);

        let c = Case {
            mode: PlacementMode::Balanced,
            ..c
        };
        let map = plan_placement(&c.req()).unwrap();
        assert_eq!(map.stages(), vec![(0, 0..16), (1, 16..32)]);
        // 3496 - 250 - 772 = 2474 on each: 6 resident, 10 streamed.
        assert!(map
            .devices
            .iter()
            .all(|d| d.streams && d.resident_layers == 6 && d.streamed_layers() == 10));
    }

    #[test]
    fn a_tiny_budget_is_refused_with_the_missing_mib() {
        let c = llama7b(&[(512, 600), (1024, 600)], PlacementMode::Sequential, 1);
        let e = plan_placement(&c.req()).unwrap_err();
        let msg = e.to_string();
        // Cheapest: everything on GPU 1, which must hold 600 + 250 + 250 + 386 = 1486 MiB.
        match &e {
            PlacementError::Impossible { per_device, .. } => {
                assert_eq!(per_device, &[(0, 0), (1, 462)])
            }
            other => panic!("{other:?}"),
        }
        assert!(
            msg.contains("GPU 0 needs 0 MiB more, GPU 1 needs 462 MiB more"),
            "{msg}"
        );
        assert!(msg.contains("model.layers.0"), "{msg}");

        let c = Case {
            mode: PlacementMode::Balanced,
            ..c
        };
        match plan_placement(&c.req()).unwrap_err() {
            // GPU 0: 600 + 250 + 386 - 512; GPU 1: 600 + 250 + 386 - 1024.
            PlacementError::Impossible { per_device, .. } => {
                assert_eq!(per_device, [(0, 724), (1, 212)])
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn refuses_malformed_requests() {
        let c = llama7b(&[(4096, 0)], PlacementMode::Sequential, 4);
        let e = plan_placement(&c.req()).unwrap_err();
        assert!(e.to_string().contains("prefetch_depth"), "{e}");
        let c = llama7b(&[(4096, 0), (4096, 0)], PlacementMode::Sequential, 1);
        let twice = [c.devices[0], c.devices[0]];
        let e = plan_placement(&PlacementRequest {
            devices: &twice,
            ..c.req()
        })
        .unwrap_err();
        assert!(e.to_string().contains("listed twice"), "{e}");
        let e = plan_placement(&PlacementRequest {
            devices: &[],
            ..c.req()
        })
        .unwrap_err();
        assert!(e.to_string().contains("devices"), "{e}");
        let e = plan_placement(&PlacementRequest {
            layers: &[],
            ..c.req()
        })
        .unwrap_err();
        assert!(e.to_string().contains("layers"), "{e}");
    }
}
