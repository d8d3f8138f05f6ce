//! Typed failures of a running [`OffloadRuntime`](crate::OffloadRuntime) that callers may want
//! to handle, carried inside the `candle_core::Error` that `acquire` and friends return.
//!
//! Candle 0.11's `Error::Wrapped` holds a `dyn Display`, which cannot be downcast, so a
//! [`RuntimeError`] travels as the custom payload of an `std::io::Error` (kind `Other`) in
//! `candle_core::Error::Io`, whose text is the runtime error's own. [`RuntimeError::from_candle`]
//! finds it again through backtraces, contexts and paths added on the way up.

use crate::cache::CacheError;

/// A failure of a running offload runtime, matchable with [`RuntimeError::from_candle`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The weight capacity has no room for a unit: units in use (or kept) hold the rest.
    #[error(
        "offload budget exhausted on {device} (budget {budget_mib} MiB, reserve {reserve_mib} MiB): {cause}"
    )]
    BudgetExhausted {
        /// The device.
        device: String,
        /// The unit asked for.
        unit: String,
        /// The budget, in MiB.
        budget_mib: u64,
        /// The caller's reservation, in MiB.
        reserve_mib: u64,
        /// What the residency cache saw.
        cause: CacheError,
    },

    /// A fetch failed twice, the second time after every idle unit was evicted (the driver
    /// refused the allocation, or the copy failed). Nothing was changed by it.
    #[error(
        "fetching {unit} ({unit_mib} MiB) failed twice, the second time after evicting every idle \
         unit: {error} (first: {first_error}); budget {budget_mib} MiB with {reserve_mib} MiB \
         reserved, weights resident: {resident_mib} MiB in [{}]",
        resident.join(", ")
    )]
    FetchFailed {
        /// The unit.
        unit: String,
        /// Its size, in MiB.
        unit_mib: u64,
        /// The second failure.
        error: String,
        /// The first failure.
        first_error: String,
        /// The budget, in MiB.
        budget_mib: u64,
        /// The caller's reservation, in MiB.
        reserve_mib: u64,
        /// Weights on the device besides the unit, in MiB.
        resident_mib: u64,
        /// The units on the device besides it.
        resident: Vec<String>,
    },

    /// A unit of the host store that this runtime does not serve (a pipeline stage asked for
    /// another stage's unit; see [`OffloadConfig::units`](crate::OffloadConfig::units)).
    #[error("unit {unit} is not served by the runtime on {device} (it belongs to another stage)")]
    NotServed {
        /// The unit.
        unit: String,
        /// The runtime's device.
        device: String,
    },

    /// A unit, layer or tensor that the host store does not hold.
    #[error("unknown {what} {name:?}")]
    Unknown {
        /// "unit", "layer unit" or "tensor".
        what: &'static str,
        /// The name (or index) asked for.
        name: String,
    },
}

impl RuntimeError {
    /// The runtime error inside `e`, if it carries one (through backtraces, contexts and paths
    /// added to it).
    pub fn from_candle(e: &candle_core::Error) -> Option<&RuntimeError> {
        match e {
            candle_core::Error::Io(io) => io.get_ref()?.downcast_ref::<RuntimeError>(),
            candle_core::Error::WithBacktrace { inner, .. }
            | candle_core::Error::Context { inner, .. }
            | candle_core::Error::WithPath { inner, .. } => Self::from_candle(inner),
            _ => None,
        }
    }
}

impl From<RuntimeError> for candle_core::Error {
    fn from(e: RuntimeError) -> Self {
        candle_core::Error::Io(std::io::Error::other(e)).bt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_found_through_backtraces_contexts_and_paths_and_keeps_its_text() {
        let e = candle_core::Error::from(RuntimeError::NotServed {
            unit: "model.layers.4".into(),
            device: "cuda:1".into(),
        });
        // The text is the runtime error's own (and a backtrace under RUST_BACKTRACE).
        assert!(
            e.to_string().starts_with(
                "unit model.layers.4 is not served by the runtime on cuda:1 (it belongs to another stage)"
            ),
            "{e}"
        );
        let e = e.context("in stage 0").with_path("/x").bt();
        assert!(matches!(
            RuntimeError::from_candle(&e),
            Some(RuntimeError::NotServed { unit, .. }) if unit == "model.layers.4"
        ));
        assert!(RuntimeError::from_candle(&candle_core::Error::Msg("no".into())).is_none());
        let io = candle_core::Error::Io(std::io::Error::other("disk"));
        assert!(RuntimeError::from_candle(&io).is_none());
    }
}
