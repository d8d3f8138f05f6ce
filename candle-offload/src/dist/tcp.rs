//! [`TcpTransport`]: every rank connected to every other over TCP; tensors cross through
//! host memory, so it works on any device.

use std::time::Duration;

use candle_core::{Device, Tensor};

use super::error::Result;
use super::net::{Kind, Mesh, NetConfig};
use super::transport::Transport;
use super::wire;

/// The [`Transport`] over TCP sockets: a full mesh of connections, one reader thread per peer,
/// a heartbeat thread. It works on any device (tensors cross through host memory).
#[derive(Debug)]
pub struct TcpTransport {
    pub(super) mesh: Mesh,
}

impl TcpTransport {
    /// Joins the other ranks as `cfg` says, within its timeout: rank 0 listens at the master
    /// address and refuses a rank that comes twice or with another world size; the others
    /// connect, retrying until the timeout.
    pub fn connect(cfg: &NetConfig) -> Result<Self> {
        Ok(Self {
            mesh: Mesh::connect(cfg)?,
        })
    }

    /// Closes every connection without a goodbye, as a process that dies does (what its peers
    /// then see is tested).
    #[doc(hidden)]
    pub fn abort(&self) {
        self.mesh.abort();
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.mesh.rank()
    }

    fn world_size(&self) -> usize {
        self.mesh.world_size()
    }

    fn timeout(&self) -> Duration {
        self.mesh.timeout()
    }

    fn send_tensor(&self, to: usize, t: &Tensor) -> Result<()> {
        let (head, bytes) = wire::encode(t, to)?;
        self.mesh.send(to, Kind::Tensor, &[&head, &bytes])
    }

    fn recv_tensor(&self, from: usize, device: &Device) -> Result<Tensor> {
        let frame = self.mesh.recv(from, Kind::Tensor, "a tensor")?;
        wire::decode(&frame, device, from)
    }

    fn send_bytes(&self, to: usize, data: &[u8]) -> Result<()> {
        self.mesh.send(to, Kind::Bytes, &[data])
    }

    fn recv_bytes(&self, from: usize) -> Result<Vec<u8>> {
        self.mesh.recv(from, Kind::Bytes, "a message")
    }

    fn fail(&self, reason: &str) {
        self.mesh.fail(reason);
    }

    fn barrier(&self) -> Result<()> {
        let n = self.world_size();
        if self.rank() == 0 {
            for r in 1..n {
                self.mesh
                    .recv(r, Kind::Barrier, "its arrival at a barrier")?;
            }
            for r in 1..n {
                self.mesh.send(r, Kind::Barrier, &[])?;
            }
        } else {
            self.mesh.send(0, Kind::Barrier, &[])?;
            self.mesh
                .recv(0, Kind::Barrier, "the release of a barrier")?;
        }
        Ok(())
    }
}
