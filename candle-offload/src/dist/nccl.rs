//! [`NcclTransport`]: tensors between GPUs over NCCL's send and receive, everything else (the
//! rendezvous, NCCL's unique id, small values, barriers, the heartbeat, a failing rank's
//! reason) over the [`TcpTransport`] it holds.
//!
//! Nothing waits without a deadline. The communicator is created non-blocking and polled; a
//! transfer is enqueued on the device's stream and its event polled. Each poll also asks the
//! TCP side whether the peer is still there, so a peer whose process died is noticed by its
//! closed connection or missing heartbeat, and a peer that never answers by the timeout. On
//! either, the communicator is aborted (NCCL's kernels waiting on the peer stop) and the error
//! names the peer and what was awaited.
//!
//! A tensor's header (dtype, shape) goes over TCP, then its bytes over NCCL, from and into the
//! memory of this rank's GPU on Candle's stream. A tensor on another device (the host) travels
//! inline over TCP as with [`TcpTransport`].

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

use super::error::{DistError, Result};
use super::net::{Kind, NetConfig, TensorPath};
use super::tcp::TcpTransport;
use super::transport::Transport;
use super::wire;
use crate::sys::{self, CommState, NcclComm, NcclLib, NcclPending, NcclUniqueId};

/// A tensor frame's first byte: its elements follow in the frame.
const INLINE: u8 = 0;
/// A tensor frame's first byte: only its header follows; the elements come over NCCL.
const OVER_NCCL: u8 = 1;
/// How long a wait on NCCL spins before it sleeps between polls: a hidden state's transfer
/// takes tens of microseconds, a sleep at least fifty.
const SPIN: Duration = Duration::from_millis(2);
/// The sleep between polls after [`SPIN`].
const POLL: Duration = Duration::from_micros(100);

/// The [`Transport`] between GPUs over NCCL (loaded at run time, 2.14 or later).
pub struct NcclTransport {
    // First: dropped (finalised) while the peers are still connected.
    comm: Mutex<NcclComm>,
    tcp: TcpTransport,
    device: Device,
    lib: Arc<NcclLib>,
}

impl std::fmt::Debug for NcclTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclTransport")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("device", &self.device)
            .field("nccl", &self.lib)
            .finish()
    }
}

impl NcclTransport {
    /// Joins the other ranks over TCP as `cfg` says (every rank must use this transport: rank
    /// 0 refuses one that carries tensors over TCP), opens NCCL at `library` (a file name for
    /// the loader's search or a path, e.g. what [`find_nccl`](crate::doctor::find_nccl)
    /// found), and creates the communicator of every rank, this one on `device` (a CUDA
    /// device), within `cfg`'s timeout. A rank that fails tells the others why.
    pub fn connect(cfg: &NetConfig, device: &Device, library: &str) -> Result<Self> {
        let mut cfg = cfg.clone();
        cfg.tensors = TensorPath::Nccl;
        let tcp = TcpTransport::connect(&cfg)?;
        match Self::join(&tcp, device, library) {
            Ok((comm, lib)) => Ok(Self {
                comm: Mutex::new(comm),
                tcp,
                device: device.clone(),
                lib,
            }),
            Err(e) => {
                tcp.fail(&e.to_string());
                Err(e)
            }
        }
    }

    fn join(
        tcp: &TcpTransport,
        device: &Device,
        library: &str,
    ) -> Result<(NcclComm, Arc<NcclLib>)> {
        let (rank, world) = (tcp.rank(), tcp.world_size());
        let own = |reason: String| DistError::Nccl { rank: None, reason };
        if !device.is_cuda() {
            return Err(own(format!(
                "rank {rank}: NCCL carries tensors between GPUs; this rank's device is {device:?}"
            )));
        }
        let lib = NcclLib::open(library).map_err(|e| own(format!("rank {rank}: {e}")))?;
        let id = if rank == 0 {
            let id = lib.unique_id().map_err(|e| own(format!("rank 0: {e}")))?;
            tcp.broadcast_bytes(0, &id.to_bytes())?;
            id
        } else {
            let bytes = tcp.broadcast_bytes(0, &[])?;
            NcclUniqueId::from_bytes(&bytes).ok_or_else(|| DistError::Protocol {
                rank: 0,
                reason: format!(
                    "sent {} bytes as NCCL's unique id ({} expected)",
                    bytes.len(),
                    NcclUniqueId::BYTES
                ),
            })?
        };
        sys::nccl_bind(device).map_err(|e| own(format!("rank {rank}: {e}")))?;
        let mut comm =
            NcclComm::start(&lib, world, rank, id).map_err(|e| own(format!("rank {rank}: {e}")))?;
        let deadline = Instant::now() + tcp.timeout();
        let t0 = Instant::now();
        loop {
            match comm.state() {
                Ok(CommState::Ready) => break,
                Ok(CommState::InProgress) => {}
                Err(e) => {
                    comm.abort();
                    return Err(own(format!("rank {rank}: initialisation: {e}")));
                }
            }
            for peer in (0..world).filter(|&p| p != rank) {
                if let Err(e) = tcp.mesh.check(peer, "NCCL's initialisation") {
                    comm.abort();
                    return Err(e);
                }
            }
            if Instant::now() >= deadline {
                comm.abort();
                return Err(own(format!(
                    "rank {rank}: the communicator of {world} ranks was not ready after {:.1} s \
                     (every peer is connected over TCP: NCCL's own connections failed; \
                     NCCL_DEBUG=INFO says why)",
                    tcp.timeout().as_secs_f64()
                )));
            }
            pause(t0);
        }
        tracing::info!(
            rank,
            world,
            nccl = ?lib.version(),
            library = lib.path(),
            "NCCL communicator ready"
        );
        Ok((comm, lib))
    }

    /// The NCCL library this transport loaded: its path and `(major, minor, patch)`.
    pub fn nccl(&self) -> (&str, (u32, u32, u32)) {
        (self.lib.path(), self.lib.version())
    }

    /// Sends `t` to this rank itself over NCCL and returns what arrived (one NCCL group): the
    /// part of a transfer a single GPU can test.
    #[doc(hidden)]
    pub fn loopback(&self, t: &Tensor) -> Result<Tensor> {
        let me = self.rank();
        let t = self.on_device(t, me)?;
        let deadline = Instant::now() + self.timeout();
        let mut comm = self.comm(me)?;
        let (got, pending) = sys::nccl_loopback(&mut comm, &t, deadline)
            .map_err(|e| nccl_failed(&mut comm, me, e))?;
        self.wait(&mut comm, &pending, me, "a tensor sent to itself", deadline)?;
        Ok(got)
    }

    fn comm(&self, peer: usize) -> Result<MutexGuard<'_, NcclComm>> {
        self.comm.lock().map_err(|_| DistError::Nccl {
            rank: Some(peer),
            reason: "the communicator's lock was poisoned by an earlier panic".into(),
        })
    }

    /// `t` on this rank's GPU.
    fn on_device(&self, t: &Tensor, peer: usize) -> Result<Tensor> {
        if t.device().same_device(&self.device) {
            return Ok(t.clone());
        }
        t.to_device(&self.device).map_err(|e| DistError::Tensor {
            rank: peer,
            reason: format!("cannot move it to this rank's GPU: {e}"),
        })
    }

    /// Polls `pending` until it is done, the communicator fails, `peer` is gone, or
    /// `deadline`; aborts the communicator on the last three.
    fn wait(
        &self,
        comm: &mut NcclComm,
        pending: &NcclPending,
        peer: usize,
        awaited: &str,
        deadline: Instant,
    ) -> Result<()> {
        let t0 = Instant::now();
        loop {
            match pending.is_done() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(nccl_failed(comm, peer, e)),
            }
            if let Err(e) = comm.state() {
                comm.abort();
                return Err(DistError::Nccl {
                    rank: Some(peer),
                    reason: format!("{awaited}: {e}"),
                });
            }
            if peer != self.rank() {
                if let Err(e) = self.tcp.mesh.check(peer, awaited) {
                    comm.abort();
                    return Err(e);
                }
            }
            if Instant::now() >= deadline {
                comm.abort();
                return Err(DistError::Timeout {
                    rank: peer,
                    awaited: format!("{awaited} over NCCL"),
                    timeout: self.timeout(),
                });
            }
            pause(t0);
        }
    }
}

/// Spins with yields for [`SPIN`] after `t0`, then sleeps [`POLL`].
fn pause(t0: Instant) {
    if t0.elapsed() < SPIN {
        std::thread::yield_now();
    } else {
        std::thread::sleep(POLL);
    }
}

/// A failed NCCL call: the communicator aborted, the error naming `peer`.
fn nccl_failed(comm: &mut NcclComm, peer: usize, e: impl std::fmt::Display) -> DistError {
    comm.abort();
    DistError::Nccl {
        rank: Some(peer),
        reason: e.to_string(),
    }
}

impl Transport for NcclTransport {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }

    fn world_size(&self) -> usize {
        self.tcp.world_size()
    }

    fn timeout(&self) -> Duration {
        self.tcp.timeout()
    }

    fn send_tensor(&self, to: usize, t: &Tensor) -> Result<()> {
        if !t.device().is_cuda() {
            let (head, bytes) = wire::encode(t, to)?;
            return self
                .tcp
                .mesh
                .send(to, Kind::Tensor, &[&[INLINE], &head, &bytes]);
        }
        let t = self.on_device(t, to)?;
        let head = wire::encode_head(&t, to)?;
        self.tcp
            .mesh
            .send(to, Kind::Tensor, &[&[OVER_NCCL], &head])?;
        let deadline = Instant::now() + self.timeout();
        let mut comm = self.comm(to)?;
        let pending = sys::nccl_send(&mut comm, &t, to, deadline)
            .map_err(|e| nccl_failed(&mut comm, to, e))?;
        self.wait(&mut comm, &pending, to, "the receipt of a tensor", deadline)
    }

    fn recv_tensor(&self, from: usize, device: &Device) -> Result<Tensor> {
        let frame = self.tcp.mesh.recv(from, Kind::Tensor, "a tensor")?;
        let (&path, rest) = frame.split_first().ok_or_else(|| DistError::Tensor {
            rank: from,
            reason: "an empty tensor frame".into(),
        })?;
        match path {
            INLINE => wire::decode(rest, device, from),
            OVER_NCCL => {
                let (dtype, dims, extra) = wire::decode_head(rest, from)?;
                if !extra.is_empty() {
                    return Err(DistError::Tensor {
                        rank: from,
                        reason: format!("a header with {} bytes after it", extra.len()),
                    });
                }
                let deadline = Instant::now() + self.timeout();
                let mut comm = self.comm(from)?;
                let (t, pending) =
                    sys::nccl_recv(&mut comm, dtype, &dims, &self.device, from, deadline)
                        .map_err(|e| nccl_failed(&mut comm, from, e))?;
                self.wait(&mut comm, &pending, from, "a tensor", deadline)?;
                drop(comm);
                if device.same_device(&self.device) {
                    Ok(t)
                } else {
                    t.to_device(device).map_err(|e| DistError::Tensor {
                        rank: from,
                        reason: format!("cannot move it to {device:?}: {e}"),
                    })
                }
            }
            other => Err(DistError::Protocol {
                rank: from,
                reason: format!("a tensor frame of unknown path {other}"),
            }),
        }
    }

    fn send_bytes(&self, to: usize, data: &[u8]) -> Result<()> {
        self.tcp.send_bytes(to, data)
    }

    fn recv_bytes(&self, from: usize) -> Result<Vec<u8>> {
        self.tcp.recv_bytes(from)
    }

    fn barrier(&self) -> Result<()> {
        self.tcp.barrier()
    }

    fn fail(&self, reason: &str) {
        self.tcp.fail(reason);
        if let Ok(mut comm) = self.comm.lock() {
            comm.abort();
        }
    }
}
