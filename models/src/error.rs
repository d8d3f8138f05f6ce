//! Typed errors of model loading: every one names the file (or hub id) and the problem.

use std::path::PathBuf;

/// What can go wrong while resolving, reading or validating a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file that is missing, unreadable or malformed.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A config field that is missing or out of range.
    #[error("{}: field `{field}`: {reason}", path.display())]
    Config {
        /// The config file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An architecture this crate does not implement.
    #[error("{}: unsupported architecture {name:?} (supported: {supported})", path.display())]
    UnknownArchitecture {
        /// The config file.
        path: PathBuf,
        /// The architecture or model type named there.
        name: String,
        /// What is supported.
        supported: String,
    },
    /// A tensor with the wrong shape or dtype, or one that is missing.
    #[error("{}: tensor {tensor}: {reason}", path.display())]
    Tensor {
        /// The weights file (or directory).
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The model could not be found or downloaded.
    #[error("model {id:?}: {reason}")]
    Source {
        /// The hub id or path asked for.
        id: String,
        /// Why it could not be had.
        reason: String,
    },
    /// From the offload runtime (budget, store).
    #[error(transparent)]
    Offload(#[from] candle_offload::Error),
    /// From the transport between the ranks of a multi-process run.
    #[error(transparent)]
    Dist(#[from] candle_offload::dist::DistError),
    /// From device placement (a device map that does not fit, or a malformed one).
    #[error(transparent)]
    Placement(#[from] candle_offload::PlacementError),
    /// From Candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    pub(crate) fn file(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Self {
        Self::File {
            path: path.into(),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn config(
        path: impl Into<PathBuf>,
        field: &str,
        reason: impl std::fmt::Display,
    ) -> Self {
        Self::Config {
            path: path.into(),
            field: field.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// `Result` with [`ModelError`].
pub type Result<T> = std::result::Result<T, ModelError>;
