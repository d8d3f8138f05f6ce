//! Typed errors for construction and configuration.
//!
//! Code that runs inside a model's `forward` (acquiring a unit, prefetching) returns
//! [`candle_core::Result`] so that callers can use `?` as everywhere in Candle; an
//! [`Error`] converts into a `candle_core::Error` and back out of one without losing its text.
//! This module depends on no other module of the crate but the leaf `sys`, whose errors it
//! converts: device placement has its own error type, [`crate::placement::PlacementError`], as
//! the residency cache has [`crate::cache::CacheError`].

use std::path::PathBuf;

/// Everything that can go wrong while a runtime, a store or a budget is being set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A memory size or budget could not be parsed or is meaningless (zero, negative, NaN).
    #[error("invalid memory size {input:?} for {field}: {reason}")]
    InvalidMemorySize {
        /// The setting that held the value (`--gpu-memory-limit`, `memory.max_gpu_memory`, ...).
        field: String,
        /// The text as given.
        input: String,
        /// Why it was refused.
        reason: String,
    },

    /// The budget cannot hold the largest unit plus the declared reservation.
    #[error(
        "GPU memory budget of {budget_mib} MiB on {device} is too small: it must hold the \
         reservation ({reserve_mib} MiB) plus {needed_what} ({needed_mib} MiB); \
         {missing_mib} MiB are missing"
    )]
    BudgetTooSmall {
        /// The device the budget is for.
        device: String,
        /// The budget, in MiB.
        budget_mib: u64,
        /// The caller's reservation for activations, KV cache and workspace, in MiB.
        reserve_mib: u64,
        /// What else must fit (e.g. "the largest unit model.layers.0").
        needed_what: String,
        /// Its size in MiB.
        needed_mib: u64,
        /// How much is missing, in MiB (rounded up).
        missing_mib: u64,
    },

    /// The budget is larger than the device has memory.
    #[error("GPU memory budget of {budget_mib} MiB is larger than {device}'s {total_mib} MiB")]
    BudgetExceedsDevice {
        /// The device.
        device: String,
        /// The budget, in MiB.
        budget_mib: u64,
        /// The device's total memory, in MiB.
        total_mib: u64,
    },

    /// A configuration value is out of its range.
    #[error("invalid value for {field}: {reason}")]
    InvalidConfig {
        /// The setting.
        field: String,
        /// Why it was refused.
        reason: String,
    },

    /// A unit or tensor name that the store does not hold.
    #[error("unknown {what} {name:?}")]
    Unknown {
        /// "unit" or "tensor".
        what: &'static str,
        /// The name asked for.
        name: String,
    },

    /// A weights file that could not be read or is malformed.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// The operation needs a CUDA build (`--features cuda`).
    #[error("{what} needs a build with `--features cuda`")]
    NotCompiledWithCuda {
        /// What was asked for.
        what: &'static str,
    },

    /// An error from Candle or the CUDA driver.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

impl From<crate::sys::SysError> for Error {
    fn from(e: crate::sys::SysError) -> Self {
        use crate::sys::SysError;
        match e {
            SysError::File { path, reason } => Error::File { path, reason },
            SysError::NotCompiledWithCuda { what } => Error::NotCompiledWithCuda { what },
            SysError::Unsupported { field, reason } => Error::InvalidConfig {
                field: field.into(),
                reason,
            },
            SysError::Candle(e) => Error::Candle(e),
            SysError::Nccl(e) => Error::InvalidConfig {
                field: "nccl".into(),
                reason: e.to_string(),
            },
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
