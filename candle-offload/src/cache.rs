//! Residency bookkeeping: which units are on the device, what to evict, what to fetch next.
//!
//! This module is pure (no device, no tensors): [`ResidencyCache`] is told about accesses and
//! answers with the evictions and fetches that the runtime then carries out on a device. That
//! keeps the policy testable in milliseconds against reference models (see the property tests).
//!
//! Two policies:
//! - **LRU**, for irregular reuse: evict the least recently used unit that is not in use.
//! - **Schedule** (Belady over a known periodic access order): evict the unit whose next use
//!   lies furthest in the future. On inference's cyclic sweep `0..N-1, 0..N-1, ...` LRU misses
//!   on every access once fewer than `N` units fit; the schedule policy is optimal there and
//!   on any other periodic order (training's forward-then-backward zig-zag included). Prefetch
//!   follows the schedule and obeys "do no harm": a unit is fetched ahead of time only by
//!   evicting units whose next use comes after it.
//!
//! With [`PolicyChoice::Auto`] the cache starts with LRU and switches to the schedule policy as
//! soon as it has seen the same access order twice in a row; it falls back to LRU when the
//! order breaks.

use std::collections::VecDeque;
use std::fmt;

/// Index of a unit (a group of tensors fetched and evicted together) in its store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnitId(pub usize);

impl fmt::Display for UnitId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// How the cache chooses victims.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PolicyChoice {
    /// LRU until a periodic access order is seen twice, then the schedule policy (default).
    #[default]
    Auto,
    /// Always LRU.
    Lru,
    /// The schedule policy with an order given up front (one period of accesses), e.g.
    /// `0..n_layers` for a decoder's forward sweep.
    Schedule(Vec<UnitId>),
}

/// Which policy is in force right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivePolicy {
    /// Least recently used.
    Lru,
    /// Belady over a periodic schedule of this many accesses.
    Schedule {
        /// Accesses per period.
        period: usize,
    },
}

/// What the runtime must do to serve an access or a prefetch: evict these (in order), then
/// fetch `fetch` if set.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Transfer {
    /// Units to drop from the device first.
    pub evict: Vec<UnitId>,
    /// The unit to bring to the device, if it is not there yet.
    pub fetch: Option<UnitId>,
}

/// Why an access could not be served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheError {
    /// The unit index is out of range.
    UnknownUnit(UnitId),
    /// Not enough evictable bytes: units in use (or kept) hold the rest of the capacity.
    NoRoom {
        /// The unit asked for.
        unit: UnitId,
        /// Its size.
        needed: u64,
        /// The capacity for weights.
        capacity: u64,
        /// Bytes held by units that cannot be evicted now.
        unevictable: u64,
    },
}

impl fmt::Display for CacheError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownUnit(u) => write!(f, "unknown unit {u}"),
            Self::NoRoom {
                unit,
                needed,
                capacity,
                unevictable,
            } => write!(
                f,
                "no room for unit {unit} ({needed} B): {unevictable} B of the {capacity} B weight \
                 capacity are held by units in use or kept resident"
            ),
        }
    }
}

impl std::error::Error for CacheError {}

#[derive(Debug, Clone)]
struct Entry {
    bytes: u64,
    present: bool,
    pins: u32,
    keep: bool,
    last_use: u64,
}

/// A learned or given periodic access order.
#[derive(Debug, Clone)]
struct Schedule {
    order: Vec<UnitId>,
    /// For each unit, the sorted positions at which it occurs in `order`.
    positions: Vec<Vec<usize>>,
    /// Position in `order` of the most recent access.
    pos: usize,
    /// Given by the user (kept when the order breaks) rather than learned.
    fixed: bool,
}

impl Schedule {
    fn new(order: Vec<UnitId>, n_units: usize, pos: usize, fixed: bool) -> Self {
        let mut positions = vec![Vec::new(); n_units];
        for (i, u) in order.iter().enumerate() {
            if let Some(p) = positions.get_mut(u.0) {
                p.push(i);
            }
        }
        Self {
            order,
            positions,
            pos,
            fixed,
        }
    }

    fn period(&self) -> usize {
        self.order.len()
    }

    /// Accesses from the current position until `u` is used again (1 = the next access);
    /// `usize::MAX` for a unit that is not in the schedule.
    fn distance(&self, u: UnitId) -> usize {
        let period = self.period();
        match self.positions.get(u.0) {
            Some(ps) if !ps.is_empty() => ps
                .iter()
                .map(|&q| {
                    let d = (q + period - self.pos) % period;
                    if d == 0 {
                        period
                    } else {
                        d
                    }
                })
                .min()
                .unwrap_or(usize::MAX),
            _ => usize::MAX,
        }
    }

    /// The unit `k` accesses ahead of the current position.
    fn ahead(&self, k: usize) -> UnitId {
        self.order[(self.pos + k) % self.period()]
    }

    /// Moves to the access of `u`; false if `u` is not the next expected access.
    fn advance(&mut self, u: UnitId) -> bool {
        let next = (self.pos + 1) % self.period();
        if self.order[next] == u {
            self.pos = next;
            return true;
        }
        // Resynchronise a given schedule at the nearest later occurrence of `u`.
        if self.fixed {
            if let Some(ps) = self.positions.get(u.0).filter(|ps| !ps.is_empty()) {
                let period = self.period();
                let q = *ps
                    .iter()
                    .min_by_key(|&&q| (q + period - next) % period)
                    .expect("non-empty");
                self.pos = q;
            }
        }
        false
    }
}

/// Finds the shortest period `P` such that the last `2P` accesses are one order repeated.
#[derive(Debug, Clone)]
struct PatternDetector {
    history: VecDeque<UnitId>,
    max_period: usize,
}

impl PatternDetector {
    fn new(max_period: usize) -> Self {
        Self {
            history: VecDeque::new(),
            max_period,
        }
    }

    fn push(&mut self, u: UnitId) {
        if self.history.len() == 2 * self.max_period {
            self.history.pop_front();
        }
        self.history.push_back(u);
    }

    /// The repeated order, rotated so that it ends with the latest access.
    fn detect(&self) -> Option<Vec<UnitId>> {
        let h = &self.history;
        let n = h.len();
        let last = *h.back()?;
        // Candidate periods: distances back to earlier occurrences of the latest access.
        for p in 2..=n / 2 {
            if h[n - 1 - p] != last {
                continue;
            }
            if (0..p).all(|i| h[n - 1 - i] == h[n - 1 - i - p]) {
                return Some(h.range(n - p..).copied().collect());
            }
        }
        None
    }
}

/// Counters per unit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnitCounters {
    /// Accesses that found the unit on the device (or already on its way there).
    pub hits: u64,
    /// Accesses that had to fetch it.
    pub misses: u64,
    /// Fetches issued ahead of use.
    pub prefetches: u64,
    /// Times it was evicted.
    pub evictions: u64,
}

/// Device-agnostic residency state of a set of units under a byte capacity.
#[derive(Debug, Clone)]
pub struct ResidencyCache {
    capacity: u64,
    used: u64,
    entries: Vec<Entry>,
    clock: u64,
    auto: bool,
    schedule: Option<Schedule>,
    detector: PatternDetector,
    counters: Vec<UnitCounters>,
}

impl ResidencyCache {
    /// A cache of units with the given sizes under `capacity` bytes, nothing present yet.
    pub fn new(unit_bytes: &[u64], capacity: u64, policy: PolicyChoice) -> Self {
        let n = unit_bytes.len();
        let (auto, schedule) = match policy {
            PolicyChoice::Auto => (true, None),
            PolicyChoice::Lru => (false, None),
            PolicyChoice::Schedule(order) if order.is_empty() => (false, None),
            PolicyChoice::Schedule(order) => {
                let last = order.len() - 1;
                (false, Some(Schedule::new(order, n, last, true)))
            }
        };
        Self {
            capacity,
            used: 0,
            entries: unit_bytes
                .iter()
                .map(|&bytes| Entry {
                    bytes,
                    present: false,
                    pins: 0,
                    keep: false,
                    last_use: 0,
                })
                .collect(),
            clock: 0,
            auto,
            schedule,
            detector: PatternDetector::new(n.clamp(2, 4096) * 2),
            counters: vec![UnitCounters::default(); n],
        }
    }

    /// The byte capacity for weights.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of the units present (resident or on their way).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Number of units.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there are no units.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Size of a unit.
    pub fn unit_bytes(&self, u: UnitId) -> u64 {
        self.entries[u.0].bytes
    }

    /// Whether the unit is on the device (or on its way).
    pub fn is_present(&self, u: UnitId) -> bool {
        self.entries.get(u.0).is_some_and(|e| e.present)
    }

    /// Whether the unit is pinned by an access in progress.
    pub fn in_use(&self, u: UnitId) -> bool {
        self.entries.get(u.0).is_some_and(|e| e.pins > 0)
    }

    /// The units present, in index order.
    pub fn present_units(&self) -> Vec<UnitId> {
        (0..self.entries.len())
            .map(UnitId)
            .filter(|&u| self.is_present(u))
            .collect()
    }

    /// Hit/miss counters of a unit.
    pub fn counters(&self, u: UnitId) -> UnitCounters {
        self.counters[u.0]
    }

    /// The policy in force.
    pub fn active_policy(&self) -> ActivePolicy {
        match &self.schedule {
            Some(s) => ActivePolicy::Schedule { period: s.period() },
            None => ActivePolicy::Lru,
        }
    }

    /// Marks a unit as kept: never chosen as a victim (embeddings, the output head).
    pub fn set_keep(&mut self, u: UnitId, keep: bool) {
        self.entries[u.0].keep = keep;
    }

    fn check(&self, u: UnitId) -> Result<(), CacheError> {
        if u.0 < self.entries.len() {
            Ok(())
        } else {
            Err(CacheError::UnknownUnit(u))
        }
    }

    /// Starts an access: pins `u` until [`release`](Self::release) and says what to move.
    pub fn acquire(&mut self, u: UnitId) -> Result<Transfer, CacheError> {
        self.check(u)?;
        self.observe(u);
        let transfer = if self.entries[u.0].present {
            self.counters[u.0].hits += 1;
            Transfer::default()
        } else {
            let evict = self.make_room(u, None)?;
            self.counters[u.0].misses += 1;
            self.admit(u);
            Transfer {
                evict,
                fetch: Some(u),
            }
        };
        self.clock += 1;
        let e = &mut self.entries[u.0];
        e.pins += 1;
        e.last_use = self.clock;
        Ok(transfer)
    }

    /// Ends an access begun with [`acquire`](Self::acquire).
    pub fn release(&mut self, u: UnitId) {
        if let Some(e) = self.entries.get_mut(u.0) {
            e.pins = e.pins.saturating_sub(1);
        }
    }

    /// Fetches `u` ahead of use if that harms nothing: under the schedule policy only units used
    /// after `u` are evicted for it; under LRU only when it fits by evicting idle units.
    /// Returns `None` when `u` is present already or no room can be made.
    pub fn prefetch(&mut self, u: UnitId) -> Option<Transfer> {
        if self.check(u).is_err() || self.entries[u.0].present {
            return None;
        }
        let limit = self.schedule.as_ref().map(|s| s.distance(u));
        let evict = self.make_room(u, limit).ok()?;
        self.counters[u.0].prefetches += 1;
        self.admit(u);
        // Counts as recently used, so LRU does not pick it before its first use.
        self.clock += 1;
        self.entries[u.0].last_use = self.clock;
        Some(Transfer {
            evict,
            fetch: Some(u),
        })
    }

    /// The next `depth` units of the schedule after the current access (empty under LRU).
    pub fn upcoming(&self, depth: usize) -> Vec<UnitId> {
        match &self.schedule {
            Some(s) => {
                let mut out = Vec::new();
                for k in 1..=depth.min(s.period()) {
                    let u = s.ahead(k);
                    if !out.contains(&u) {
                        out.push(u);
                    }
                }
                out
            }
            None => Vec::new(),
        }
    }

    /// Drops every unit that is not in use or kept (e.g. to shrink before a big allocation).
    pub fn evict_idle(&mut self) -> Vec<UnitId> {
        let victims: Vec<UnitId> = (0..self.entries.len())
            .map(UnitId)
            .filter(|&u| {
                let e = &self.entries[u.0];
                e.present && e.pins == 0 && !e.keep
            })
            .collect();
        for &v in &victims {
            self.remove(v);
        }
        victims
    }

    /// Undoes a fetch that failed on the device: the unit is absent and unpinned again.
    pub fn abort(&mut self, u: UnitId) {
        if let Some(e) = self.entries.get_mut(u.0) {
            if e.present {
                e.present = false;
                self.used -= e.bytes;
            }
            e.pins = 0;
        }
    }

    fn admit(&mut self, u: UnitId) {
        let e = &mut self.entries[u.0];
        debug_assert!(!e.present);
        e.present = true;
        self.used += e.bytes;
        debug_assert!(self.used <= self.capacity);
    }

    fn remove(&mut self, v: UnitId) {
        let e = &mut self.entries[v.0];
        debug_assert!(e.present && e.pins == 0);
        e.present = false;
        self.used -= e.bytes;
        self.counters[v.0].evictions += 1;
    }

    /// Chooses and removes victims until `u` fits. With `harm_limit = Some(d)`, only units whose
    /// next use is further than `d` accesses away may go (prefetch's "do no harm").
    fn make_room(
        &mut self,
        u: UnitId,
        harm_limit: Option<usize>,
    ) -> Result<Vec<UnitId>, CacheError> {
        let needed = self.entries[u.0].bytes;
        let no_room = |this: &Self| {
            let unevictable = this
                .entries
                .iter()
                .filter(|e| e.present && (e.pins > 0 || e.keep))
                .map(|e| e.bytes)
                .sum();
            CacheError::NoRoom {
                unit: u,
                needed,
                capacity: this.capacity,
                unevictable,
            }
        };
        if needed > self.capacity {
            return Err(no_room(self));
        }
        if self.used + needed <= self.capacity {
            return Ok(Vec::new());
        }
        // Rank the evictable units, best victim first: under the schedule the furthest next
        // use, under LRU (and among ties) the oldest last use.
        let mut candidates: Vec<(u64, u64, UnitId)> = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if !e.present || e.pins > 0 || e.keep || i == u.0 {
                continue;
            }
            let v = UnitId(i);
            let nearness = match &self.schedule {
                Some(s) => {
                    let d = s.distance(v);
                    if harm_limit.is_some_and(|limit| d <= limit) {
                        continue;
                    }
                    u64::MAX - d as u64
                }
                None => 0,
            };
            candidates.push((nearness, e.last_use, v));
        }
        candidates.sort_unstable();
        let free_after: u64 = candidates
            .iter()
            .map(|&(_, _, v)| self.entries[v.0].bytes)
            .sum();
        if self.capacity - self.used + free_after < needed {
            return Err(no_room(self));
        }
        let mut victims = Vec::new();
        for (_, _, v) in candidates {
            if self.used + needed <= self.capacity {
                break;
            }
            self.remove(v);
            victims.push(v);
        }
        Ok(victims)
    }

    /// Feeds an access to the schedule (advance or drop it) and to the pattern detector.
    fn observe(&mut self, u: UnitId) {
        if let Some(s) = &mut self.schedule {
            if s.advance(u) || s.fixed {
                return;
            }
            tracing::debug!(unit = u.0, "access order broke the schedule; back to LRU");
            self.schedule = None;
        }
        if !self.auto {
            return;
        }
        self.detector.push(u);
        if let Some(order) = self.detector.detect() {
            tracing::debug!(
                period = order.len(),
                "periodic access order found; schedule policy"
            );
            let last = order.len() - 1;
            self.schedule = Some(Schedule::new(order, self.entries.len(), last, false));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[usize]) -> Vec<UnitId> {
        v.iter().map(|&i| UnitId(i)).collect()
    }

    #[test]
    fn lru_misses_everything_on_a_cyclic_sweep_and_schedule_does_not() {
        let sizes = vec![1; 8];
        let mut lru = ResidencyCache::new(&sizes, 4, PolicyChoice::Lru);
        let mut sched = ResidencyCache::new(
            &sizes,
            4,
            PolicyChoice::Schedule(ids(&[0, 1, 2, 3, 4, 5, 6, 7])),
        );
        let (mut lru_miss, mut sched_miss) = (0, 0);
        for _ in 0..10 {
            for i in 0..8 {
                let u = UnitId(i);
                lru_miss += usize::from(lru.acquire(u).unwrap().fetch.is_some());
                lru.release(u);
                sched_miss += usize::from(sched.acquire(u).unwrap().fetch.is_some());
                sched.release(u);
            }
        }
        assert_eq!(lru_miss, 80);
        assert!(sched_miss < 60, "{sched_miss}");
    }

    #[test]
    fn auto_detects_a_sweep_and_a_zigzag() {
        let sizes = vec![1; 4];
        let mut c = ResidencyCache::new(&sizes, 2, PolicyChoice::Auto);
        for _ in 0..2 {
            for i in 0..4 {
                c.acquire(UnitId(i)).unwrap();
                c.release(UnitId(i));
            }
        }
        assert_eq!(c.active_policy(), ActivePolicy::Schedule { period: 4 });
        assert_eq!(c.upcoming(2), ids(&[0, 1]));
        // Breaking the order falls back to LRU.
        c.acquire(UnitId(2)).unwrap();
        c.release(UnitId(2));
        assert_eq!(c.active_policy(), ActivePolicy::Lru);

        let mut z = ResidencyCache::new(&sizes, 2, PolicyChoice::Auto);
        let zig = [0, 1, 2, 3, 3, 2, 1, 0];
        for _ in 0..2 {
            for &i in &zig {
                z.acquire(UnitId(i)).unwrap();
                z.release(UnitId(i));
            }
        }
        assert_eq!(z.active_policy(), ActivePolicy::Schedule { period: 8 });
    }

    #[test]
    fn in_use_units_are_not_evicted_and_no_room_is_an_error() {
        let mut c = ResidencyCache::new(&[2, 2, 2], 4, PolicyChoice::Lru);
        c.acquire(UnitId(0)).unwrap();
        c.acquire(UnitId(1)).unwrap();
        let e = c.acquire(UnitId(2)).unwrap_err();
        assert!(
            matches!(e, CacheError::NoRoom { unevictable: 4, .. }),
            "{e:?}"
        );
        c.release(UnitId(0));
        let t = c.acquire(UnitId(2)).unwrap();
        assert_eq!(t.evict, ids(&[0]));
    }

    #[test]
    fn prefetch_does_no_harm() {
        // Schedule 0,1,2,3; capacity 2. At 0 (in use), prefetching 1 may not evict 0.
        let mut c = ResidencyCache::new(&[1; 4], 2, PolicyChoice::Schedule(ids(&[0, 1, 2, 3])));
        c.acquire(UnitId(0)).unwrap();
        assert_eq!(c.prefetch(UnitId(1)).unwrap().fetch, Some(UnitId(1)));
        // 2 would have to evict 0 (in use) or 1 (needed sooner): refused.
        assert_eq!(c.prefetch(UnitId(2)), None);
        c.release(UnitId(0));
        assert_eq!(c.acquire(UnitId(1)).unwrap(), Transfer::default());
        // Now 0 is used furthest away: 2 may replace it.
        assert_eq!(c.prefetch(UnitId(2)).unwrap().evict, ids(&[0]));
    }
}

#[cfg(test)]
mod proptests {
    //! The cache against simple reference models.
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[derive(Debug, Clone)]
    enum Op {
        Acquire(usize),
        Release(usize),
        Prefetch(usize),
    }

    fn ops(n: usize) -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec(
            prop_oneof![
                3 => (0..n).prop_map(Op::Acquire),
                2 => (0..n).prop_map(Op::Release),
                1 => (0..n).prop_map(Op::Prefetch),
            ],
            1..200,
        )
    }

    /// Reference LRU: present units in recency order, oldest first.
    #[derive(Default)]
    struct RefLru {
        order: VecDeque<usize>,
        pins: HashMap<usize, u32>,
        used: u64,
    }

    use std::collections::HashMap;

    impl RefLru {
        fn touch(&mut self, u: usize) {
            self.order.retain(|&x| x != u);
            self.order.push_back(u);
        }
        /// Victims (oldest idle first) to fit `need`, or None.
        fn victims(&self, sizes: &[u64], cap: u64, u: usize) -> Option<Vec<usize>> {
            let mut used = self.used;
            let mut out = Vec::new();
            for &v in &self.order {
                if used + sizes[u] <= cap {
                    break;
                }
                if self.pins.get(&v).copied().unwrap_or(0) == 0 && v != u {
                    used -= sizes[v];
                    out.push(v);
                }
            }
            (used + sizes[u] <= cap).then_some(out)
        }
        fn apply(&mut self, sizes: &[u64], victims: &[usize], u: usize) {
            for v in victims {
                self.order.retain(|x| x != v);
                self.used -= sizes[*v];
            }
            self.used += sizes[u];
            self.touch(u);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn invariants_hold_and_lru_matches_the_reference(
            sizes in prop::collection::vec(1u64..6, 1..10),
            extra in 0u64..20,
            ops in ops(10),
        ) {
            let n = sizes.len();
            let cap = sizes.iter().max().unwrap() + extra;
            let mut c = ResidencyCache::new(&sizes, cap, PolicyChoice::Lru);
            let mut r = RefLru::default();
            for op in ops {
                match op {
                    Op::Acquire(u) if u < n => {
                        let before: HashSet<usize> = (0..n).filter(|&v| c.in_use(UnitId(v))).collect();
                        let present = c.is_present(UnitId(u));
                        let expected = if present { Some(vec![]) } else { r.victims(&sizes, cap, u) };
                        match c.acquire(UnitId(u)) {
                            Ok(t) => {
                                let got: Vec<usize> = t.evict.iter().map(|v| v.0).collect();
                                prop_assert_eq!(Some(got.clone()), expected, "victims of {}", u);
                                for v in &got {
                                    prop_assert!(!before.contains(v), "evicted {} while in use", v);
                                }
                                prop_assert_eq!(t.fetch.is_some(), !present);
                                if present { r.touch(u) } else { r.apply(&sizes, &got, u) }
                                *r.pins.entry(u).or_default() += 1;
                            }
                            Err(CacheError::NoRoom { .. }) => prop_assert_eq!(expected, None),
                            Err(e) => prop_assert!(false, "{e}"),
                        }
                    }
                    Op::Release(u) if u < n => {
                        if r.pins.get(&u).copied().unwrap_or(0) > 0 {
                            c.release(UnitId(u));
                            *r.pins.get_mut(&u).unwrap() -= 1;
                        }
                    }
                    Op::Prefetch(u) if u < n => {
                        let present = c.is_present(UnitId(u));
                        let expected = if present { None } else { r.victims(&sizes, cap, u) };
                        let got = c.prefetch(UnitId(u)).map(|t| t.evict.iter().map(|v| v.0).collect::<Vec<_>>());
                        prop_assert_eq!(&got, &expected);
                        if let Some(v) = got { r.apply(&sizes, &v, u) }
                    }
                    _ => {}
                }
                // Invariants after every step.
                prop_assert!(c.used() <= cap, "used {} > capacity {}", c.used(), cap);
                let sum: u64 = c.present_units().iter().map(|&u| sizes[u.0]).sum();
                prop_assert_eq!(sum, c.used());
                prop_assert_eq!(c.used(), r.used);
                for u in 0..n {
                    if c.in_use(UnitId(u)) { prop_assert!(c.is_present(UnitId(u))); }
                }
            }
        }

        #[test]
        fn schedule_policy_equals_belady(
            n in 2usize..12,
            period_extra in 0usize..6,
            cap_frac in 0.0f64..1.0,
            seed in prop::collection::vec(0usize..1000, 20),
            sweeps in 2usize..6,
        ) {
            // A periodic order: every unit once, plus a few repeats, in a shuffled order.
            let mut order: Vec<usize> = (0..n).collect();
            for (i, s) in seed.iter().enumerate().take(period_extra) { order.insert(s % (order.len() + 1), (s + i) % n); }
            for i in (1..order.len()).rev() { order.swap(i, seed[i % seed.len()] % (i + 1)); }
            let cap = 1 + ((n - 1) as f64 * cap_frac) as u64; // 1..n units of size 1
            let seq: Vec<usize> = (0..sweeps).flat_map(|_| order.iter().copied()).collect();

            let schedule = order.iter().map(|&u| UnitId(u)).collect();
            let mut c = ResidencyCache::new(&vec![1; n], cap, PolicyChoice::Schedule(schedule));
            let mut ours = 0;
            for &u in &seq {
                ours += usize::from(c.acquire(UnitId(u)).unwrap().fetch.is_some());
                c.release(UnitId(u));
            }
            prop_assert_eq!(ours, belady(&seq, cap as usize));
        }

        #[test]
        fn prefetch_costs_at_most_the_slots_it_uses(
            n in 3usize..16,
            cap in 2usize..16,
            depth in 1usize..3,
        ) {
            prop_assume!(cap < n && cap > depth);
            let order: Vec<UnitId> = (0..n).map(UnitId).collect();
            let mut c = ResidencyCache::new(&vec![1; n], cap as u64, PolicyChoice::Schedule(order));
            let sweeps = 8;
            let mut fetches = 0;
            for _ in 0..sweeps {
                for u in 0..n {
                    let t = c.acquire(UnitId(u)).unwrap();
                    fetches += usize::from(t.fetch.is_some());
                    for next in c.upcoming(depth) {
                        fetches += usize::from(c.prefetch(next).is_some());
                    }
                    c.release(UnitId(u));
                }
            }
            let seq: Vec<usize> = (0..sweeps).flat_map(|_| 0..n).collect();
            prop_assert!(fetches <= belady(&seq, cap - depth) + depth, "{} > Belady({})", fetches, cap - depth);
        }
    }

    /// Reference Belady (OPT) misses for unit-size items: evict the item used furthest ahead.
    fn belady(seq: &[usize], cap: usize) -> usize {
        let mut cache: Vec<usize> = Vec::new();
        let mut misses = 0;
        for (t, &x) in seq.iter().enumerate() {
            if cache.contains(&x) {
                continue;
            }
            misses += 1;
            if cache.len() == cap {
                let next = |y: usize| {
                    seq[t + 1..]
                        .iter()
                        .position(|&z| z == y)
                        .unwrap_or(usize::MAX)
                };
                let (i, _) = cache
                    .iter()
                    .enumerate()
                    .max_by_key(|&(_, &y)| next(y))
                    .unwrap();
                cache.swap_remove(i);
            }
            cache.push(x);
        }
        misses
    }
}
