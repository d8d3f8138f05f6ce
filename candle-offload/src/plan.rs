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

use std::fmt;
use std::str::FromStr;

use crate::budget::{human_bytes, Budget};
use crate::error::{Error, Result};

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

impl FromStr for OffloadStrategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "minimal" => Ok(Self::Minimal),
            "balanced" => Ok(Self::Balanced),
            "aggressive" => Ok(Self::Aggressive),
            other => Err(Error::InvalidConfig {
                field: "offload_strategy".into(),
                reason: format!("{other:?} is not one of minimal, balanced, aggressive"),
            }),
        }
    }
}

impl fmt::Display for OffloadStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Minimal => "minimal",
            Self::Balanced => "balanced",
            Self::Aggressive => "aggressive",
        })
    }
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
    let (largest_idx, largest) = unit_bytes
        .iter()
        .copied()
        .enumerate()
        .max_by_key(|&(_, b)| b)
        .unwrap_or((0, 0));
    let total: u64 = kept + unit_bytes.iter().sum::<u64>();
    let room = budget.weight_bytes();
    let what = if kept > 0 {
        format!(
            "the kept units ({}) and the largest unit (#{largest_idx})",
            human_bytes(kept)
        )
    } else {
        format!("the largest unit (#{largest_idx})")
    };
    budget.check_fits(device, &what, kept + largest)?;
    let mut depth = prefetch_depth;
    while depth > 0 && kept + largest * (depth as u64 + 1) > room {
        depth -= 1;
    }
    if depth < prefetch_depth {
        tracing::warn!(
            asked = prefetch_depth,
            depth,
            "budget too small for the prefetch depth asked; using less"
        );
    }
    let ceiling = room.min(total);
    let floor = (kept + largest * (depth as u64 + 1)).min(ceiling);
    let weight_capacity = match strategy {
        OffloadStrategy::Minimal => ceiling,
        OffloadStrategy::Aggressive => floor,
        OffloadStrategy::Balanced => floor + (ceiling - floor) / 2,
    };
    Ok(CapacityPlan {
        weight_capacity,
        prefetch_depth: depth,
        fits_entirely: weight_capacity >= total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
