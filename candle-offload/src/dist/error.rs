//! [`DistError`]: why a multi-process run failed: the rendezvous, a peer that did not come, died
//! or fell silent, a frame of the wrong kind or size, a tensor that cannot be sent. Every case
//! that concerns a peer names its rank and what was awaited. It imports nothing from the crate:
//! the socket layer (`net.rs`) returns it.

use std::time::Duration;

/// Why a transport between ranks failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// A launch setting that cannot work (world size 0, a rank out of range, a bad address).
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The setting (`rank`, `world_size`, `master_addr`, ...).
        field: String,
        /// Why.
        reason: String,
    },

    /// A peer did not answer in time: it never came to the rendezvous, or sent nothing.
    #[error("rank {rank}: timed out after {:.1} s waiting for {awaited}", timeout.as_secs_f64())]
    Timeout {
        /// The peer's rank.
        rank: usize,
        /// What was awaited (`its connection at the rendezvous`, `a tensor`, ...).
        awaited: String,
        /// How long was waited.
        timeout: Duration,
    },

    /// A peer's connection was closed or broke, or it stopped sending heartbeats: it died.
    #[error("rank {rank} is gone ({reason}) while waiting for {awaited}")]
    PeerLost {
        /// The peer's rank.
        rank: usize,
        /// What was awaited or being sent.
        awaited: String,
        /// What the socket said.
        reason: String,
    },

    /// A peer joined with settings that disagree with this rank's (another world size, a rank
    /// already taken, another protocol), or sent a frame of the wrong kind.
    #[error("rank {rank}: {reason}")]
    Protocol {
        /// The peer's rank (this rank's own where the peer's is unknown).
        rank: usize,
        /// What was wrong.
        reason: String,
    },

    /// The rendezvous address could not be bound or reached.
    #[error("rendezvous at {addr}: {reason}")]
    Rendezvous {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// What the OS said.
        reason: String,
    },

    /// A peer failed and said why (its own error, sent before it left).
    #[error("rank {rank} failed: {reason}")]
    Remote {
        /// The peer's rank.
        rank: usize,
        /// Its error.
        reason: String,
    },

    /// NCCL could not be loaded, its communicator did not come up in time, or a transfer over
    /// it failed or did not finish in time (the communicator is then aborted).
    #[error("NCCL{}: {reason}", rank.map(|r| format!(", rank {r}")).unwrap_or_default())]
    Nccl {
        /// The peer the transfer was with, where it was with one.
        rank: Option<usize>,
        /// What failed.
        reason: String,
    },

    /// A tensor that cannot be sent or a header that cannot be read as one.
    #[error("tensor from or to rank {rank}: {reason}")]
    Tensor {
        /// The peer's rank.
        rank: usize,
        /// What was wrong.
        reason: String,
    },
}

/// `Result` with a [`DistError`].
pub type Result<T> = std::result::Result<T, DistError>;

impl DistError {
    /// The peer rank this error is about, where it is about one.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Self::Timeout { rank, .. }
            | Self::PeerLost { rank, .. }
            | Self::Protocol { rank, .. }
            | Self::Remote { rank, .. }
            | Self::Tensor { rank, .. } => Some(*rank),
            Self::Nccl { rank, .. } => *rank,
            Self::InvalidConfig { .. } | Self::Rendezvous { .. } => None,
        }
    }
}

impl From<DistError> for candle_core::Error {
    fn from(e: DistError) -> Self {
        candle_core::Error::Msg(e.to_string())
    }
}
