//! The [`Transport`] trait between ranks, and what every transport gets from it: small values
//! broadcast from one rank or gathered on one, token ids and JSON.

use std::time::Duration;

use candle_core::{Device, Tensor};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::error::{DistError, Result};

/// How ranks exchange tensors and small values. Every receive waits at most
/// [`timeout`](Transport::timeout) and names the peer in its error.
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;

    /// How many ranks there are.
    fn world_size(&self) -> usize;

    /// How long a receive waits at most.
    fn timeout(&self) -> Duration;

    /// Sends `t` to rank `to` (bit for bit, with its dtype and shape).
    fn send_tensor(&self, to: usize, t: &Tensor) -> Result<()>;

    /// The next tensor rank `from` sent this rank, on `device`.
    fn recv_tensor(&self, from: usize, device: &Device) -> Result<Tensor>;

    /// Sends small values (token ids, JSON) to rank `to`.
    fn send_bytes(&self, to: usize, data: &[u8]) -> Result<()>;

    /// The next small values rank `from` sent this rank.
    fn recv_bytes(&self, from: usize) -> Result<Vec<u8>>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Tells every peer that this rank failed with `reason`, before it leaves (best effort);
    /// a peer waiting on this rank then fails with [`DistError::Remote`].
    fn fail(&self, reason: &str) {
        let _ = reason;
    }

    /// `data` of rank `root`, on every rank (the others' `data` is not used).
    fn broadcast_bytes(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        if self.rank() == root {
            for r in (0..self.world_size()).filter(|&r| r != root) {
                self.send_bytes(r, data)?;
            }
            Ok(data.to_vec())
        } else {
            self.recv_bytes(root)
        }
    }

    /// Every rank's `data`, in rank order, on rank `root` (empty on the others).
    fn gather_bytes(&self, root: usize, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if self.rank() != root {
            self.send_bytes(root, data)?;
            return Ok(Vec::new());
        }
        (0..self.world_size())
            .map(|r| {
                if r == root {
                    Ok(data.to_vec())
                } else {
                    self.recv_bytes(r)
                }
            })
            .collect()
    }
}

/// Token ids of rank `root`, on every rank.
pub fn broadcast_tokens(t: &dyn Transport, root: usize, ids: &[u32]) -> Result<Vec<u32>> {
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let got = t.broadcast_bytes(root, &bytes)?;
    if got.len() % 4 != 0 {
        return Err(DistError::Protocol {
            rank: root,
            reason: format!("sent {} bytes as token ids", got.len()),
        });
    }
    Ok(got
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// `value` of rank `root` (as JSON), on every rank; the others pass `None`.
pub fn broadcast_json<T: Serialize + DeserializeOwned>(
    t: &dyn Transport,
    root: usize,
    value: Option<&T>,
) -> Result<T> {
    let bytes = match value {
        Some(v) if t.rank() == root => {
            serde_json::to_vec(v).map_err(|e| DistError::InvalidConfig {
                field: "broadcast".into(),
                reason: format!("cannot write the value as JSON: {e}"),
            })?
        }
        _ if t.rank() == root => {
            return Err(DistError::InvalidConfig {
                field: "broadcast".into(),
                reason: format!("rank {root} broadcasts, but has no value"),
            })
        }
        _ => Vec::new(),
    };
    let got = t.broadcast_bytes(root, &bytes)?;
    serde_json::from_slice(&got).map_err(|e| DistError::Protocol {
        rank: root,
        reason: format!("sent JSON that does not read: {e}"),
    })
}

/// Every rank's `value` (as JSON), in rank order, on rank `root` (empty on the others).
pub fn gather_json<T: Serialize + DeserializeOwned>(
    t: &dyn Transport,
    root: usize,
    value: &T,
) -> Result<Vec<T>> {
    let bytes = serde_json::to_vec(value).map_err(|e| DistError::InvalidConfig {
        field: "gather".into(),
        reason: format!("cannot write the value as JSON: {e}"),
    })?;
    t.gather_bytes(root, &bytes)?
        .iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice(b).map_err(|e| DistError::Protocol {
                rank: r,
                reason: format!("sent JSON that does not read: {e}"),
            })
        })
        .collect()
}
