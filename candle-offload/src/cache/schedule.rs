//! The access order the schedule policy plans over: a periodic order, given or learned
//! ([`PatternDetector`] finds the shortest one the latest accesses repeat), and how far away
//! each unit's next use is in it ([`Schedule::distance`]).

use std::collections::VecDeque;

use super::UnitId;

/// A learned or given periodic access order.
#[derive(Debug, Clone)]
pub(super) struct Schedule {
    pub(super) order: Vec<UnitId>,
    /// For each unit, the sorted positions at which it occurs in `order`.
    pub(super) positions: Vec<Vec<usize>>,
    /// Position in `order` of the most recent access.
    pub(super) pos: usize,
    /// Given by the user (kept when the order breaks) rather than learned.
    pub(super) fixed: bool,
}

impl Schedule {
    pub(super) fn new(order: Vec<UnitId>, n_units: usize, pos: usize, fixed: bool) -> Self {
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

    pub(super) fn period(&self) -> usize {
        self.order.len()
    }

    /// Accesses from the current position until `u` is used again (1 = the next access);
    /// `usize::MAX` for a unit that is not in the schedule.
    pub(super) fn distance(&self, u: UnitId) -> usize {
        self.distance_from(self.pos, u)
    }

    /// Accesses after schedule index `idx` until `u` is used again (`period` if only at `idx`).
    pub(super) fn distance_from(&self, idx: usize, u: UnitId) -> usize {
        let period = self.period();
        match self.positions.get(u.0) {
            Some(ps) if !ps.is_empty() => ps
                .iter()
                .map(|&q| {
                    let d = (q + period - idx % period) % period;
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

    /// Moves to the access of `u`; false if `u` is not the next expected access.
    pub(super) fn advance(&mut self, u: UnitId) -> bool {
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
pub(super) struct PatternDetector {
    history: VecDeque<UnitId>,
    max_period: usize,
}

impl PatternDetector {
    pub(super) fn new(max_period: usize) -> Self {
        Self {
            history: VecDeque::new(),
            max_period,
        }
    }

    pub(super) fn push(&mut self, u: UnitId) {
        if self.history.len() == 2 * self.max_period {
            self.history.pop_front();
        }
        self.history.push_back(u);
    }

    /// The repeated order, rotated so that it ends with the latest access.
    pub(super) fn detect(&self) -> Option<Vec<UnitId>> {
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
