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
                Op::Release(u) if u < n && r.pins.get(&u).copied().unwrap_or(0) > 0 => {
                    c.release(UnitId(u));
                    *r.pins.get_mut(&u).unwrap() -= 1;
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
    fn planned_prefetch_moves_what_belady_moves(
        n in 4usize..16,
        cap_raw in 0usize..16,
        depth in 0usize..3,
        sweeps in 2usize..8,
    ) {
        let cap = depth + 1 + cap_raw % (n - depth - 1); // depth < cap < n
        let order: Vec<UnitId> = (0..n).map(UnitId).collect();
        let mut c = ResidencyCache::new(&vec![1; n], cap as u64, PolicyChoice::Schedule(order))
            .with_prefetch_depth(depth);
        let mut fetches = 0;
        // Prefetched units not used yet: those still unused at the end were fetched for
        // accesses past the sequence, which the reference does not see.
        let mut unused: HashSet<usize> = HashSet::new();
        for _ in 0..sweeps {
            for u in 0..n {
                let t = c.acquire(UnitId(u)).unwrap();
                unused.remove(&u);
                fetches += usize::from(t.fetch.is_some());
                for v in &t.evict { unused.remove(&v.0); }
                for p in c.prefetch_planned(depth + 1) {
                    for v in &p.evict { unused.remove(&v.0); }
                    unused.insert(p.fetch.unwrap().0);
                    fetches += 1;
                }
                prop_assert!(c.used() <= cap as u64);
                prop_assert!(c.is_present(UnitId(u)));
                c.release(UnitId(u));
            }
        }
        fetches -= unused.len();
        let seq: Vec<usize> = (0..sweeps).flat_map(|_| 0..n).collect();
        // Never more than Belady at the planned capacity, never less than at the full one
        // (a victim still in use when its miss comes can stay a little longer).
        prop_assert!(fetches <= belady(&seq, cap - depth), "{} > {}", fetches, belady(&seq, cap - depth));
        prop_assert!(fetches >= belady(&seq, cap));
        if depth == 0 {
            prop_assert_eq!(fetches, belady(&seq, cap));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// What `upcoming_fetches` announces is what the cache fetches next, in that order.
    #[test]
    fn upcoming_fetches_are_the_next_fetches(
        n in 4usize..14,
        cap_raw in 0usize..14,
        depth in 0usize..3,
        sweeps in 2usize..6,
        k in 1usize..4,
    ) {
        let cap = depth + 1 + cap_raw % (n - depth - 1);
        let order: Vec<UnitId> = (0..n).map(UnitId).collect();
        let mut c = ResidencyCache::new(&vec![1; n], cap as u64, PolicyChoice::Schedule(order))
            .with_prefetch_depth(depth);
        let mut fetched: Vec<UnitId> = Vec::new();
        let mut announced: Vec<(usize, Vec<UnitId>)> = Vec::new();
        for _ in 0..sweeps {
            for u in 0..n {
                let t = c.acquire(UnitId(u)).unwrap();
                fetched.extend(t.fetch);
                for p in c.prefetch_planned(depth + 1) {
                    fetched.extend(p.fetch);
                }
                let next = c.upcoming_fetches(k);
                prop_assert!(next.len() <= k);
                for v in &next {
                    prop_assert!(!c.is_present(*v), "announced {:?}, already present", v);
                }
                announced.push((fetched.len(), next));
                c.release(UnitId(u));
            }
        }
        for (at, next) in announced {
            let later = &fetched[at..];
            let m = next.len().min(later.len());
            prop_assert_eq!(&next[..m], &later[..m], "announced at fetch {}", at);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A capacity that changes between sweeps (a prompt's reservation, then decode's) keeps
    /// every invariant: what is present fits the capacity of the moment, a shrink is refused
    /// only when the unit in use and the kept units exceed it (and then changes nothing),
    /// and a capacity that holds every unit fetches nothing after one sweep.
    #[test]
    fn capacity_changes_between_and_within_sweeps(
        sizes in prop::collection::vec(1u64..6, 2..10),
        caps in prop::collection::vec(0u64..40, 1..8),
        depth in 0usize..3,
        kept in prop::option::of(0usize..10),
    ) {
        let n = sizes.len();
        let order: Vec<UnitId> = (0..n).map(UnitId).collect();
        let largest = *sizes.iter().max().unwrap();
        let kept = kept.filter(|&k| k < n);
        let kept_bytes = kept.map_or(0, |k| sizes[k]);
        let floor = largest + kept_bytes;
        let mut cap = floor;
        let mut c = ResidencyCache::new(&sizes, cap, PolicyChoice::Schedule(order))
            .with_prefetch_depth(depth);
        if let Some(k) = kept {
            c.set_keep(UnitId(k), true);
        }
        for (i, &raw) in caps.iter().enumerate() {
            // Half the changes happen while a unit is in use, as a prompt starts mid-sweep.
            let held = (i % 2 == 1).then_some(UnitId(i % n));
            if let Some(h) = held {
                c.acquire(h).unwrap();
            }
            let want = raw.max(floor);
            let busy: u64 = (0..n)
                .filter(|&u| c.is_present(UnitId(u)) && (c.in_use(UnitId(u)) || Some(u) == kept))
                .map(|u| sizes[u])
                .sum();
            let before = c.present_units();
            match c.set_capacity(want, depth) {
                Ok(victims) => {
                    prop_assert!(busy <= want);
                    for v in &victims {
                        prop_assert!(before.contains(v) && !c.is_present(*v));
                        prop_assert!(!c.in_use(*v) && Some(v.0) != kept);
                    }
                    cap = want;
                }
                Err(CacheError::CannotShrink { .. }) => {
                    prop_assert!(busy > want);
                    prop_assert_eq!(c.present_units(), before);
                    prop_assert_eq!(c.capacity(), cap);
                }
                Err(e) => prop_assert!(false, "{e}"),
            }
            prop_assert!(c.used() <= c.capacity());
            if let Some(h) = held {
                c.release(h);
            }
            for u in 0..n {
                c.acquire(UnitId(u)).unwrap();
                prop_assert!(c.used() <= cap);
                c.prefetch_planned(depth + 1);
                prop_assert!(c.used() <= cap);
                c.release(UnitId(u));
            }
        }
        let total: u64 = sizes.iter().sum();
        c.set_capacity(total, 0).unwrap();
        for u in 0..n {
            c.acquire(UnitId(u)).unwrap();
            c.release(UnitId(u));
        }
        for u in 0..n {
            let t = c.acquire(UnitId(u)).unwrap();
            prop_assert!(t.fetch.is_none() && t.evict.is_empty(), "unit {} fetched again", u);
            c.release(UnitId(u));
        }
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
