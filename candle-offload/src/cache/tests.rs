//! The residency cache's unit tests: policies, prefetch and counters on small traces.

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

/// Units outside a given schedule (a mixture-of-experts model's experts between its
/// layers) are served without re-planning: the layer sweep keeps its plan, and hits on
/// them cost no plan at all (one re-plan per access made every expert acquire of a
/// 6,000-unit model cost ~13 µs).
#[test]
fn units_outside_the_schedule_keep_its_plan() {
    // Units 0-3 the schedule's layers, 4-7 experts; room for the layers and two experts.
    let sizes = vec![1; 8];
    let mut c = ResidencyCache::new(&sizes, 6, PolicyChoice::Schedule(ids(&[0, 1, 2, 3])));
    let (mut layer_fetches, mut expert_fetches) = (0, 0);
    for _ in 0..20 {
        for l in 0..4 {
            layer_fetches += usize::from(c.acquire(UnitId(l)).unwrap().fetch.is_some());
            c.release(UnitId(l));
            for e in [4, 5] {
                let t = c.acquire(UnitId(e)).unwrap();
                assert!(
                    t.evict.iter().all(|v| v.0 >= 4),
                    "an expert evicted a layer: {t:?}"
                );
                expert_fetches += usize::from(t.fetch.is_some());
                c.release(UnitId(e));
            }
            for t in c.prefetch_planned(1) {
                assert!(t.fetch.is_some_and(|u| u.0 < 4), "{t:?}");
                layer_fetches += 1;
            }
        }
    }
    assert_eq!((layer_fetches, expert_fetches), (4, 2));
    assert!(c.replans <= 2, "{} re-plans for 240 accesses", c.replans);
    // A third expert takes an expert's room, not a layer's, and the plan stays.
    let before = c.replans;
    let t = c.acquire(UnitId(6)).unwrap();
    c.release(UnitId(6));
    assert_eq!(t.fetch, Some(UnitId(6)));
    assert!(
        t.evict.iter().all(|v| v.0 >= 4) && t.evict.len() == 1,
        "{t:?}"
    );
    for l in 0..4 {
        assert!(c.acquire(UnitId(l)).unwrap().fetch.is_none());
        c.release(UnitId(l));
    }
    assert_eq!(c.replans, before);
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
    let started = c.prefetch_planned(2);
    assert!(!started.is_empty() && started.len() <= 2, "{started:?}");
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
fn a_kept_unit_larger_than_the_others_leaves_room_to_plan() {
    // An embedding-like unit (5) is kept; layers (1 each) stream with one spare slot.
    let sizes = [5, 1, 1, 1, 1, 1];
    let order = ids(&[0, 1, 2, 3, 4, 5]);
    let mut c =
        ResidencyCache::new(&sizes, 8, PolicyChoice::Schedule(order)).with_prefetch_depth(1);
    c.set_keep(UnitId(0), true);
    let mut fetches = 0;
    for _ in 0..20 {
        for u in 0..6 {
            fetches += usize::from(c.acquire(UnitId(u)).unwrap().fetch.is_some());
            fetches += c.prefetch_planned(2).len();
            assert!(c.used() <= 8);
            c.release(UnitId(u));
        }
    }
    // The plan has 8 - 1 (spare) - 5 (kept) = 2 slots for 5 layers: Belady moves
    // 5 * (5 - 2) / 4 = 3.75 per sweep on average.
    assert!(fetches <= 20 * 4 + 6, "{fetches}");
    assert!(c.is_present(UnitId(0)));
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
