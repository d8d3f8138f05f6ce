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
//!   carries out Belady's plan (at the capacity less `depth` spare units) ahead of time: a
//!   planned fetch starts once its victims are no longer needed before it, or earlier into the
//!   spare units while they still are, so it moves what Belady moves and never evicts a unit
//!   that is needed sooner.
//!
//! With [`PolicyChoice::Auto`] the cache starts with LRU and switches to the schedule policy as
//! soon as it has seen the same access order twice in a row; it falls back to LRU when the
//! order breaks.

use std::collections::VecDeque;
use std::fmt;

mod schedule;

use schedule::{PatternDetector, Schedule};

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
    /// The capacity cannot shrink to `capacity`: units in use (or kept) hold more.
    CannotShrink {
        /// The capacity asked for.
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
            Self::CannotShrink {
                capacity,
                unevictable,
            } => write!(
                f,
                "the weight capacity cannot shrink to {capacity} B: units in use or kept \
                 resident hold {unevictable} B"
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

/// A miss of the planned (Belady) run of the schedule: at access `at` (absolute), fetch `unit`
/// after evicting `victims`.
#[derive(Debug, Clone)]
struct Planned {
    at: u64,
    unit: UnitId,
    victims: Vec<UnitId>,
    started: bool,
}

/// Belady's demand paging of the schedule with capacity `capacity - spare`, simulated ahead of
/// the real accesses. The real cache carries out the same misses with the same victims, only
/// earlier where it can: as soon as the victims are no longer needed before the miss, or
/// earlier still into the spare bytes. So it moves exactly what Belady moves at that capacity.
#[derive(Debug, Clone)]
struct Planner {
    present: Vec<bool>,
    used: u64,
    /// Absolute index of the last access planned.
    pos: u64,
    misses: VecDeque<Planned>,
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
    /// Copies that may run ahead of their victims' release (see [`Self::spare`]).
    prefetch_depth: usize,
    /// Absolute index of the current access.
    now: u64,
    planner: Option<Planner>,
    /// Planned victims still needed before their miss: (unit, absolute index of the miss).
    pending: Vec<(UnitId, u64)>,
    /// The largest unit that is not kept, and the kept units' bytes ([`Self::spare`]'s
    /// terms, counted again when a unit's `keep` changes).
    largest_evictable: u64,
    kept_bytes: u64,
    /// Plans started from the real state (what the tests count).
    #[cfg(test)]
    replans: usize,
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
        let mut cache = Self {
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
            prefetch_depth: 0,
            now: 0,
            planner: None,
            pending: Vec::new(),
            largest_evictable: 0,
            kept_bytes: 0,
            #[cfg(test)]
            replans: 0,
        };
        cache.count_kept();
        cache
    }

    /// Counts [`Self::spare`]'s terms over every unit.
    fn count_kept(&mut self) {
        let evictable = self.entries.iter().filter(|e| !e.keep);
        self.largest_evictable = evictable.map(|e| e.bytes).max().unwrap_or(0);
        self.kept_bytes = self
            .entries
            .iter()
            .filter(|e| e.keep)
            .map(|e| e.bytes)
            .sum();
    }

    /// Lets up to `depth` copies run ahead of their victims' release: the plan keeps
    /// `depth` times the largest unit free for them (at most what leaves room for one unit).
    /// Depth 0 moves the fewest bytes; each step of depth buys overlap with compute.
    pub fn with_prefetch_depth(mut self, depth: usize) -> Self {
        self.prefetch_depth = depth;
        self.planner = None;
        self
    }

    /// Bytes the plan leaves free for copies in flight: `depth` times the largest unit that
    /// can be evicted, at most what leaves room for the kept units and one such unit.
    fn spare(&self) -> u64 {
        let (largest, kept) = (self.largest_evictable, self.kept_bytes);
        (largest * self.prefetch_depth as u64).min(self.capacity.saturating_sub(kept + largest))
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
        self.count_kept();
        self.planner = None;
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
        let mut transfer = Transfer::default();
        if self.off_schedule(u) {
            // A unit a given schedule does not hold (a mixture-of-experts model's expert,
            // which its own cache places): served as under LRU, neither advancing the
            // schedule nor counting as one of its accesses, so that the plan stays valid
            // through it.
            if !self.entries[u.0].present {
                transfer.evict = self.make_room(u, None)?;
                transfer.fetch = Some(u);
                self.forget_plan_if_scheduled(&transfer.evict);
            }
        } else {
            self.acquire_scheduled_or_lru(u, &mut transfer)?;
        }
        if transfer.fetch.is_some() {
            self.counters[u.0].misses += 1;
            self.admit(u);
        } else {
            self.counters[u.0].hits += 1;
        }
        self.clock += 1;
        let e = &mut self.entries[u.0];
        e.pins += 1;
        e.last_use = self.clock;
        Ok(transfer)
    }

    /// Drops the plan where `evicted` holds a unit of the schedule: the plan counted on it.
    /// Units outside the schedule come and go without re-planning (a plan that finds less
    /// room than it counted on falls back when its fetch comes, and re-plans then).
    fn forget_plan_if_scheduled(&mut self, evicted: &[UnitId]) {
        if evicted.iter().any(|&v| !self.off_schedule(v)) {
            self.planner = None;
            self.pending.clear();
        }
    }

    /// Whether `u` lies outside a given (fixed) schedule: [`acquire`](Self::acquire) serves
    /// it without the plan.
    fn off_schedule(&self, u: UnitId) -> bool {
        self.schedule
            .as_ref()
            .is_some_and(|s| s.fixed && s.positions.get(u.0).is_none_or(Vec::is_empty))
    }

    /// [`acquire`](Self::acquire)'s choice of what to move for a unit of the schedule (its
    /// plan) or under LRU.
    fn acquire_scheduled_or_lru(
        &mut self,
        u: UnitId,
        transfer: &mut Transfer,
    ) -> Result<(), CacheError> {
        let on_plan = self.observe(u);
        self.now += 1;
        if self.schedule.is_some() {
            if !on_plan || self.planner.is_none() {
                self.replan();
            }
            self.extend_plan();
            transfer.evict = self.evict_free_pending(u);
            let planner = self.planner.as_mut().expect("planned");
            while planner.misses.front().is_some_and(|m| m.at < self.now) {
                planner.misses.pop_front();
            }
            let due = match planner.misses.front() {
                Some(m) if m.at == self.now && m.unit == u => planner.misses.pop_front(),
                _ => None,
            };
            if !self.entries[u.0].present {
                let mut victims = Vec::new();
                if let Some(m) = due {
                    for v in m.victims {
                        let e = &self.entries[v.0];
                        if !e.present {
                            continue;
                        }
                        if e.pins == 0 {
                            self.remove(v);
                            victims.push(v);
                        } else {
                            self.pending.push((v, self.now));
                        }
                    }
                }
                if self.used + self.entries[u.0].bytes > self.capacity {
                    // Reality left the plan (a victim is still in use): fall back, then re-plan.
                    victims.extend(self.make_room(u, None)?);
                    self.planner = None;
                }
                self.pending.retain(|(v, _)| !victims.contains(v));
                transfer.evict.extend(victims);
                transfer.fetch = Some(u);
            }
        } else if !self.entries[u.0].present {
            transfer.evict = self.make_room(u, None)?;
            transfer.fetch = Some(u);
        }
        Ok(())
    }

    /// Under the schedule policy, starts the next planned fetches that can start now: their
    /// victims are no longer needed before the fetched unit (or they wait as pending evictions
    /// while the copy goes into the spare bytes). At most `max_ahead` fetches are started
    /// ahead of their use at any time. Empty under LRU.
    pub fn prefetch_planned(&mut self, max_ahead: usize) -> Vec<Transfer> {
        let mut out = Vec::new();
        if self.schedule.is_none() {
            return out;
        }
        if self.planner.is_none() {
            self.replan();
        }
        self.extend_plan();
        let now = self.now;
        let idx = self.schedule.as_ref().map_or(0, |s| s.pos);
        let planner = self.planner.as_ref().expect("planned");
        let mut ahead = planner
            .misses
            .iter()
            .filter(|m| m.started && m.at > now)
            .count();
        let mut starts = Vec::new();
        let mut used = self.used;
        let mut gone: Vec<UnitId> = Vec::new();
        for (k, m) in planner.misses.iter().enumerate() {
            if m.started || m.at <= now {
                continue;
            }
            if ahead >= max_ahead {
                break;
            }
            let e = &self.entries[m.unit.0];
            if e.present {
                // Fetched by an earlier fallback; nothing to move.
                continue;
            }
            let s = self.schedule.as_ref().expect("schedule");
            let free: Vec<UnitId> = m
                .victims
                .iter()
                .copied()
                .filter(|v| {
                    let ve = &self.entries[v.0];
                    ve.present
                        && ve.pins == 0
                        && !ve.keep
                        && !gone.contains(v)
                        && s.distance_from(idx, *v) as u64 >= m.at - now
                })
                .collect();
            let freed: u64 = free.iter().map(|v| self.entries[v.0].bytes).sum();
            if used - freed + e.bytes > self.capacity {
                break;
            }
            used = used - freed + e.bytes;
            gone.extend(free.iter().copied());
            starts.push((k, free));
            ahead += 1;
        }
        for (k, free) in starts {
            let (unit, at, victims) = {
                let m = &mut self.planner.as_mut().expect("planned").misses[k];
                m.started = true;
                (m.unit, m.at, m.victims.clone())
            };
            for &v in &free {
                self.remove(v);
            }
            for v in victims {
                if !free.contains(&v) && self.entries[v.0].present {
                    self.pending.push((v, at));
                }
            }
            self.counters[unit.0].prefetches += 1;
            self.admit(unit);
            self.clock += 1;
            self.entries[unit.0].last_use = self.clock;
            out.push(Transfer {
                evict: free,
                fetch: Some(unit),
            });
        }
        out
    }

    /// Evicts pending victims that are no longer needed before their planned miss (`current`,
    /// the unit being acquired, is needed now).
    fn evict_free_pending(&mut self, current: UnitId) -> Vec<UnitId> {
        let Some(s) = &self.schedule else {
            return Vec::new();
        };
        let (now, idx) = (self.now, s.pos);
        let mut out = Vec::new();
        let mut keep = Vec::new();
        for (v, at) in std::mem::take(&mut self.pending) {
            let e = &self.entries[v.0];
            if !e.present {
                continue;
            }
            // Free once idle and not needed again before its planned miss (or that miss is due).
            let needed_before_miss = at > now && (s.distance_from(idx, v) as u64) < at - now;
            if v != current && e.pins == 0 && !needed_before_miss {
                out.push(v);
            } else {
                keep.push((v, at));
            }
        }
        for &v in &out {
            self.remove(v);
        }
        self.pending = keep;
        out
    }

    /// Restarts the plan from the real state at the current access.
    fn replan(&mut self) {
        #[cfg(test)]
        {
            self.replans += 1;
        }
        self.pending.clear();
        self.planner = Some(Planner {
            present: self.entries.iter().map(|e| e.present).collect(),
            used: self.used,
            pos: self.now.saturating_sub(1),
            misses: VecDeque::new(),
        });
    }

    /// Plans Belady's misses up to one period past the current access.
    fn extend_plan(&mut self) {
        // A plan that fell behind the accesses (it could not be extended) starts again here.
        if self.planner.as_ref().is_some_and(|p| p.pos + 1 < self.now) {
            self.replan();
        }
        let cap = self.capacity - self.spare();
        let (Some(s), Some(p)) = (&self.schedule, &mut self.planner) else {
            return;
        };
        let period = s.period() as u64;
        while p.pos < self.now + period {
            let a = p.pos + 1;
            let idx = (s.pos + (a - self.now) as usize) % s.period();
            let y = s.order[idx];
            let need = self.entries[y.0].bytes;
            if !p.present[y.0] {
                let mut victims = Vec::new();
                while p.used + need > cap {
                    let v = (0..self.entries.len())
                        .filter(|&v| p.present[v] && v != y.0 && !self.entries[v].keep)
                        .max_by_key(|&v| (s.distance_from(idx, UnitId(v)), std::cmp::Reverse(v)));
                    let Some(v) = v else { break };
                    p.present[v] = false;
                    p.used -= self.entries[v].bytes;
                    victims.push(UnitId(v));
                }
                if p.used + need > cap {
                    // Cannot be planned (kept units fill the plan); demand fetches will cope.
                    return;
                }
                p.present[y.0] = true;
                p.used += need;
                p.misses.push_back(Planned {
                    at: a,
                    unit: y,
                    victims,
                    started: false,
                });
            }
            p.pos = a;
        }
    }

    /// The units the planned schedule fetches next that have not started, in the order it will
    /// fetch them, at most `n` (each once; empty without a schedule): what a slower hop in
    /// front of the copy (reads from disk) can start on before the copy is due.
    pub fn upcoming_fetches(&self, n: usize) -> Vec<UnitId> {
        let mut out: Vec<UnitId> = Vec::new();
        let Some(p) = &self.planner else {
            return out;
        };
        for m in &p.misses {
            if out.len() == n {
                break;
            }
            if !m.started
                && m.at > self.now
                && !self.entries[m.unit.0].present
                && !out.contains(&m.unit)
            {
                out.push(m.unit);
            }
        }
        out
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
        if self.off_schedule(u) {
            self.forget_plan_if_scheduled(&evict);
        } else {
            self.planner = None;
        }
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

    /// Drops every unit that is not in use or kept (e.g. to shrink before a big allocation).
    pub fn evict_idle(&mut self) -> Vec<UnitId> {
        self.evict_idle_except(None)
    }

    /// [`evict_idle`](Self::evict_idle), sparing `except` (a unit being fetched).
    pub fn evict_idle_except(&mut self, except: Option<UnitId>) -> Vec<UnitId> {
        self.planner = None;
        self.pending.clear();
        let victims: Vec<UnitId> = (0..self.entries.len())
            .map(UnitId)
            .filter(|&u| {
                let e = &self.entries[u.0];
                e.present && e.pins == 0 && !e.keep && Some(u) != except
            })
            .collect();
        for &v in &victims {
            self.remove(v);
        }
        victims
    }

    /// Drops `u` if it is present and not in use, even when kept (its host copy changed).
    /// Returns whether it was present.
    pub fn invalidate(&mut self, u: UnitId) -> bool {
        let Some(e) = self.entries.get(u.0) else {
            return false;
        };
        if !e.present || e.pins > 0 {
            return false;
        }
        self.forget_plan_if_scheduled(&[u]);
        self.remove(u);
        true
    }

    /// Undoes a fetch that failed on the device: the unit is absent and unpinned again.
    pub fn abort(&mut self, u: UnitId) {
        self.planner = None;
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

    /// The units that may be evicted now (present, idle, not kept, not `skip`), best victim
    /// first: under the schedule the furthest next use, under LRU (and among ties) the oldest
    /// last use. With `harm_limit = Some(d)`, units whose next use is `d` accesses away or
    /// nearer are left out (prefetch's "do no harm").
    fn ranked_victims(&self, skip: Option<UnitId>, harm_limit: Option<usize>) -> Vec<UnitId> {
        let mut candidates: Vec<(u64, u64, UnitId)> = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if !e.present || e.pins > 0 || e.keep || skip == Some(UnitId(i)) {
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
        candidates.into_iter().map(|(_, _, v)| v).collect()
    }

    /// Changes the byte capacity for weights (the caller's reservation changed, see
    /// `OffloadRuntime::set_reserve_bytes`) and the copies that may run ahead of their victims
    /// at it. Shrinking evicts idle units, the policy's best victims first, until what is
    /// present fits; the evicted units are returned for the caller to free. Refused, with
    /// nothing changed, when the units in use and the kept units alone exceed `capacity`.
    pub fn set_capacity(
        &mut self,
        capacity: u64,
        prefetch_depth: usize,
    ) -> Result<Vec<UnitId>, CacheError> {
        let mut victims = Vec::new();
        if self.used > capacity {
            let ranked = self.ranked_victims(None, None);
            let mut used = self.used;
            for v in ranked {
                if used <= capacity {
                    break;
                }
                used -= self.entries[v.0].bytes;
                victims.push(v);
            }
            if used > capacity {
                return Err(CacheError::CannotShrink {
                    capacity,
                    unevictable: used,
                });
            }
            for &v in &victims {
                self.remove(v);
            }
        }
        self.capacity = capacity;
        self.prefetch_depth = prefetch_depth;
        self.planner = None;
        self.pending.clear();
        Ok(victims)
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
        let candidates = self.ranked_victims(Some(u), harm_limit);
        let free_after: u64 = candidates.iter().map(|v| self.entries[v.0].bytes).sum();
        if self.capacity - self.used + free_after < needed {
            return Err(no_room(self));
        }
        let mut victims = Vec::new();
        for v in candidates {
            if self.used + needed <= self.capacity {
                break;
            }
            self.remove(v);
            victims.push(v);
        }
        Ok(victims)
    }

    /// Feeds an access to the schedule (advance or drop it) and to the pattern detector.
    /// Returns false when the access was not the one the schedule expected.
    fn observe(&mut self, u: UnitId) -> bool {
        if let Some(s) = &mut self.schedule {
            if s.advance(u) {
                return true;
            }
            if s.fixed {
                return false;
            }
            tracing::debug!(unit = u.0, "access order broke the schedule; back to LRU");
            self.schedule = None;
            self.planner = None;
            self.pending.clear();
        }
        if self.auto {
            self.detector.push(u);
            if let Some(order) = self.detector.detect() {
                tracing::debug!(
                    period = order.len(),
                    "periodic access order found; schedule policy"
                );
                let last = order.len() - 1;
                self.schedule = Some(Schedule::new(order, self.entries.len(), last, false));
                self.planner = None;
                return false;
            }
        }
        true
    }
}

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
