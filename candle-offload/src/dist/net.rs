//! The OS-level socket code of the TCP transport: the rendezvous (rank 0 listens at the master
//! address, the others connect, retrying until the timeout; rank 0 checks the world size and
//! the ranks, then sends every rank the others' addresses and each pair connects, a full mesh),
//! framed messages (a kind byte, a length, the bytes), one reader thread per peer that hands
//! frames to a channel and notices a closed or silent connection, and a heartbeat thread.
//! Every receive has a deadline. It speaks in bytes and [`DistError`] only and imports nothing
//! else from the crate.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::error::DistError;

/// The first bytes of every hello: the protocol and its version.
const MAGIC: &[u8; 8] = b"COFFDST2";
/// The most bytes a frame may carry (a hidden state of a long prompt is well under this).
const MAX_FRAME: u64 = 1 << 36;
/// How often a waiting accept or connect looks again.
const POLL: Duration = Duration::from_millis(20);

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Kind {
    /// Nothing: the peer is alive.
    Heartbeat = 0,
    /// Small values (token ids, JSON).
    Bytes = 1,
    /// A tensor: its header, then its bytes.
    Tensor = 2,
    /// A barrier's arrival or release.
    Barrier = 3,
    /// The peer is leaving in order.
    Goodbye = 4,
    /// The rendezvous: the table of addresses, or a refusal.
    Table = 5,
    /// The rendezvous refused this rank (the payload says why).
    Refused = 6,
    /// The peer failed (the payload is its error) and is leaving.
    Failed = 7,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0 => Self::Heartbeat,
            1 => Self::Bytes,
            2 => Self::Tensor,
            3 => Self::Barrier,
            4 => Self::Goodbye,
            5 => Self::Table,
            6 => Self::Refused,
            7 => Self::Failed,
            _ => return None,
        })
    }

    /// What a frame of this kind is, for messages.
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Heartbeat => "a heartbeat",
            Self::Bytes => "a message",
            Self::Tensor => "a tensor",
            Self::Barrier => "a barrier",
            Self::Goodbye => "a goodbye",
            Self::Table => "the rendezvous's table",
            Self::Refused => "a refusal",
            Self::Failed => "its failure",
        }
    }
}

/// How a rank joins the others.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// How many ranks there are.
    pub world_size: usize,
    /// Rank 0's address (`MASTER_ADDR`), a host name or an IP.
    pub master_addr: String,
    /// Rank 0's port (`MASTER_PORT`).
    pub master_port: u16,
    /// How long any wait lasts at most: the rendezvous, each receive.
    pub timeout: Duration,
    /// How often each rank tells every peer it is alive; a peer silent for five of these (at
    /// most the timeout) is taken for dead.
    pub heartbeat: Duration,
    /// How tensors travel between the ranks: every rank must say the same, or rank 0 refuses
    /// it at the rendezvous.
    pub tensors: TensorPath,
}

/// How a transport carries tensors between ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TensorPath {
    /// Through the TCP connections, via host memory ([`TcpTransport`](super::TcpTransport)).
    #[default]
    Tcp,
    /// NCCL between GPUs ([`NcclTransport`](super::NcclTransport)).
    Nccl,
}

impl TensorPath {
    fn code(self) -> u8 {
        match self {
            Self::Tcp => 0,
            Self::Nccl => 1,
        }
    }

    fn name(code: u8) -> &'static str {
        match code {
            0 => "TCP",
            1 => "NCCL",
            _ => "an unknown path",
        }
    }
}

impl NetConfig {
    /// `rank` of `world_size` with rank 0 at `master_addr:master_port`, waits of at most
    /// `timeout`, a heartbeat every second (or a tenth of the timeout, if shorter).
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
        timeout: Duration,
    ) -> Self {
        Self {
            rank,
            world_size,
            master_addr: master_addr.into(),
            master_port,
            timeout,
            heartbeat: Duration::from_secs(1).min(timeout / 10),
            tensors: TensorPath::Tcp,
        }
    }

    /// How long a peer may stay silent before it is taken for dead.
    fn silence(&self) -> Duration {
        (self.heartbeat * 5).min(self.timeout).max(POLL)
    }

    fn master(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }

    fn check(&self) -> Result<(), DistError> {
        let bad = |field: &str, reason: String| DistError::InvalidConfig {
            field: field.into(),
            reason,
        };
        if self.world_size == 0 {
            return Err(bad("world_size", "must be at least 1".into()));
        }
        if self.rank >= self.world_size {
            return Err(bad(
                "rank",
                format!(
                    "{} is not below the world size {}",
                    self.rank, self.world_size
                ),
            ));
        }
        if self.timeout.is_zero() {
            return Err(bad("timeout", "must be above 0".into()));
        }
        if self.master_addr.trim().is_empty() {
            return Err(bad("master_addr", "is empty".into()));
        }
        Ok(())
    }
}

/// What a peer's reader thread hands over.
enum Incoming {
    Frame(Kind, Vec<u8>),
    Lost(String),
    /// The peer failed with this error.
    Failed(String),
}

/// One connection to a peer.
struct Peer {
    /// Shared with the heartbeat thread, so that frames never interleave.
    writer: Arc<Mutex<TcpStream>>,
    inbox: Mutex<Receiver<Incoming>>,
    /// Why the connection is gone, once it is.
    lost: Mutex<Option<String>>,
    /// The error the peer said it failed with, as soon as its reader reads it (a send that
    /// finds the connection gone reports it).
    failed: Arc<Mutex<Option<String>>>,
    /// Why the connection is gone, as soon as its reader sees it (a wait outside the socket,
    /// such as one on NCCL, asks [`Mesh::check`]).
    gone: Arc<Mutex<Option<String>>>,
    reader: Option<JoinHandle<()>>,
}

/// Every rank connected to every other, with a reader per peer and a heartbeat.
pub struct Mesh {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    peers: Vec<Option<Peer>>,
    stop: Arc<AtomicBool>,
    heartbeat: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Writes one frame: kind, length, the parts.
fn write_frame(s: &mut TcpStream, kind: Kind, parts: &[&[u8]]) -> std::io::Result<()> {
    let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
    let mut head = [0u8; 9];
    head[0] = kind as u8;
    head[1..].copy_from_slice(&len.to_le_bytes());
    s.write_all(&head)?;
    for p in parts {
        s.write_all(p)?;
    }
    s.flush()
}

/// Reads one frame (the socket's read timeout applies).
fn read_frame(s: &mut TcpStream) -> std::io::Result<(Kind, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head)?;
    let kind = Kind::from_u8(head[0]).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unknown frame kind {}", head[0]),
        )
    })?;
    let len = u64::from_le_bytes(head[1..].try_into().unwrap_or_default());
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes"),
        ));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data)?;
    Ok((kind, data))
}

/// A hello: magic, rank, world size, the port this rank listens on for its peers, the code of
/// its [`TensorPath`].
fn hello(rank: usize, world_size: usize, port: u16, tensors: TensorPath) -> Vec<u8> {
    let mut b = MAGIC.to_vec();
    b.extend((rank as u64).to_le_bytes());
    b.extend((world_size as u64).to_le_bytes());
    b.extend(port.to_le_bytes());
    b.push(tensors.code());
    b
}

/// A hello as read: rank, world size, port, tensor path's code.
type Hello = (usize, usize, u16, u8);

/// Reads a hello, within `timeout`.
fn read_hello(s: &mut TcpStream, timeout: Duration) -> std::io::Result<Hello> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(timeout))?;
    let mut b = [0u8; 27];
    s.read_exact(&mut b)?;
    if &b[..8] != MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a candle-offload rank (or another protocol version)",
        ));
    }
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
    let port = u16::from_le_bytes([b[24], b[25]]);
    Ok((word(8) as usize, word(16) as usize, port, b[26]))
}

/// A socket set up for frames: no Nagle delay, writes bounded by `timeout`.
fn tune(s: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_nonblocking(false)?;
    s.set_write_timeout(Some(timeout))
}

/// Accepts connections on `listener` until `deadline`, calling `take` on each with its peer
/// address; stops when `take` says every awaited peer is in (`Ok(true)`).
fn accept_until(
    listener: &TcpListener,
    deadline: Instant,
    mut take: impl FnMut(TcpStream, SocketAddr) -> Result<bool, DistError>,
) -> Result<bool, DistError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| DistError::Rendezvous {
            addr: format!("{:?}", listener.local_addr().ok()),
            reason: e.to_string(),
        })?;
    loop {
        match listener.accept() {
            Ok((s, addr)) => {
                if take(s, addr)? {
                    return Ok(true);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Ok(false);
                }
                std::thread::sleep(POLL);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(DistError::Rendezvous {
                    addr: format!("{:?}", listener.local_addr().ok()),
                    reason: e.to_string(),
                })
            }
        }
    }
}

/// Connects to `addr`, retrying until `deadline`; `rank` and `what` name the peer in errors.
fn connect_until(
    addr: &str,
    deadline: Instant,
    timeout: Duration,
    rank: usize,
) -> Result<TcpStream, DistError> {
    let mut last = String::from("no address");
    loop {
        let addrs: Vec<SocketAddr> = match addr.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                last = e.to_string();
                Vec::new()
            }
        };
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now()).max(POLL);
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(2))) {
                Ok(s) => return Ok(s),
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() >= deadline {
            return Err(DistError::Timeout {
                rank,
                awaited: format!("a connection to {addr} ({last})"),
                timeout,
            });
        }
        std::thread::sleep(POLL * 5);
    }
}

impl Mesh {
    /// Joins the other ranks as `cfg` says, within its timeout.
    pub fn connect(cfg: &NetConfig) -> Result<Self, DistError> {
        cfg.check()?;
        let deadline = Instant::now() + cfg.timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
        if cfg.world_size > 1 {
            if cfg.rank == 0 {
                Self::rendezvous_master(cfg, deadline, &mut streams)?;
            } else {
                Self::rendezvous_peer(cfg, deadline, &mut streams)?;
            }
        }
        Self::start(cfg, streams)
    }

    /// Rank 0: accepts every other rank, checks them, sends each the table of addresses.
    fn rendezvous_master(
        cfg: &NetConfig,
        deadline: Instant,
        streams: &mut [Option<TcpStream>],
    ) -> Result<(), DistError> {
        let master = cfg.master();
        let listener = TcpListener::bind(&master).map_err(|e| DistError::Rendezvous {
            addr: master.clone(),
            reason: format!("cannot listen: {e}"),
        })?;
        let mut ports: Vec<Option<SocketAddr>> = vec![None; cfg.world_size];
        let n = cfg.world_size;
        let all = accept_until(&listener, deadline, |mut s, addr| {
            let left = deadline.saturating_duration_since(Instant::now()).max(POLL);
            // A connection that says nothing in time is not a rank: drop it and go on.
            let Ok((rank, world, port, tensors)) = read_hello(&mut s, left) else {
                return Ok(false);
            };
            let refuse = |s: &mut TcpStream, reason: String| {
                write_frame(s, Kind::Refused, &[reason.as_bytes()]).ok();
                DistError::Protocol { rank, reason }
            };
            if world != n {
                return Err(refuse(
                    &mut s,
                    format!("joined with world size {world}, rank 0 has {n}"),
                ));
            }
            if tensors != cfg.tensors.code() {
                return Err(refuse(
                    &mut s,
                    format!(
                        "joined carrying tensors over {}, rank 0 over {}",
                        TensorPath::name(tensors),
                        TensorPath::name(cfg.tensors.code())
                    ),
                ));
            }
            if rank == 0 || rank >= n {
                return Err(refuse(
                    &mut s,
                    format!("rank {rank} cannot join: the ranks that connect are 1..{n}"),
                ));
            }
            if streams[rank].is_some() {
                return Err(refuse(&mut s, format!("rank {rank} joined twice")));
            }
            tune(&s, cfg.timeout).map_err(|e| DistError::PeerLost {
                rank,
                awaited: "the rendezvous".into(),
                reason: e.to_string(),
            })?;
            ports[rank] = Some(SocketAddr::new(addr.ip(), port));
            streams[rank] = Some(s);
            Ok(streams.iter().skip(1).all(Option::is_some))
        })?;
        if !all {
            let missing: Vec<String> = (1..n)
                .filter(|&r| streams[r].is_none())
                .map(|r| r.to_string())
                .collect();
            return Err(DistError::Timeout {
                rank: (1..n).find(|&r| streams[r].is_none()).unwrap_or(1),
                awaited: format!(
                    "its connection at the rendezvous on {master} (rank(s) {} never came)",
                    missing.join(", ")
                ),
                timeout: cfg.timeout,
            });
        }
        let table: String = ports
            .iter()
            .enumerate()
            .filter_map(|(r, a)| a.map(|a| format!("{r} {a}\n")))
            .collect();
        for (rank, s) in streams.iter_mut().enumerate().skip(1) {
            if let Some(s) = s {
                write_frame(s, Kind::Table, &[table.as_bytes()]).map_err(|e| {
                    DistError::PeerLost {
                        rank,
                        awaited: "the rendezvous's table to be sent".into(),
                        reason: e.to_string(),
                    }
                })?;
            }
        }
        Ok(())
    }

    /// A rank above 0: connects to rank 0, reads the table, connects to the ranks below it
    /// and accepts those above.
    fn rendezvous_peer(
        cfg: &NetConfig,
        deadline: Instant,
        streams: &mut [Option<TcpStream>],
    ) -> Result<(), DistError> {
        let (rank, n) = (cfg.rank, cfg.world_size);
        let master = cfg.master();
        let mut s = connect_until(&master, deadline, cfg.timeout, 0)?;
        let lost0 = |e: std::io::Error| DistError::PeerLost {
            rank: 0,
            awaited: "the rendezvous's table".into(),
            reason: e.to_string(),
        };
        tune(&s, cfg.timeout).map_err(lost0)?;
        let local = s.local_addr().map_err(lost0)?.ip();
        let listener =
            TcpListener::bind(SocketAddr::new(local, 0)).map_err(|e| DistError::Rendezvous {
                addr: format!("{local}:0"),
                reason: format!("cannot listen for the other ranks: {e}"),
            })?;
        let port = listener.local_addr().map_err(lost0)?.port();
        s.write_all(&hello(rank, n, port, cfg.tensors))
            .map_err(lost0)?;
        let left = deadline.saturating_duration_since(Instant::now()).max(POLL);
        s.set_read_timeout(Some(left)).map_err(lost0)?;
        let (kind, data) = read_frame(&mut s).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => DistError::Timeout {
                rank: 0,
                awaited: "the rendezvous's table (are all ranks started?)".into(),
                timeout: cfg.timeout,
            },
            _ => lost0(e),
        })?;
        if kind == Kind::Refused {
            return Err(DistError::Protocol {
                rank: 0,
                reason: format!(
                    "rank 0 refused rank {rank}: {}",
                    String::from_utf8_lossy(&data)
                ),
            });
        }
        if kind != Kind::Table {
            return Err(DistError::Protocol {
                rank: 0,
                reason: format!("sent {} instead of the rendezvous's table", kind.name()),
            });
        }
        let mut addrs: Vec<Option<SocketAddr>> = vec![None; n];
        for line in String::from_utf8_lossy(&data).lines() {
            let mut parts = line.split(' ');
            let r = parts.next().and_then(|r| r.parse::<usize>().ok());
            let a = parts.next().and_then(|a| a.parse::<SocketAddr>().ok());
            if let (Some(r), Some(a)) = (r, a) {
                if r < n {
                    addrs[r] = Some(a);
                }
            }
        }
        streams[0] = Some(s);
        // Connect to the ranks below this one (rank 0's connection is made)...
        for (peer, slot) in addrs.iter().enumerate().take(rank).skip(1) {
            let a = slot.ok_or_else(|| DistError::Protocol {
                rank: 0,
                reason: format!("the rendezvous's table has no address for rank {peer}"),
            })?;
            let mut p = connect_until(&a.to_string(), deadline, cfg.timeout, peer)?;
            let lost = |e: std::io::Error| DistError::PeerLost {
                rank: peer,
                awaited: "the mesh's connection".into(),
                reason: e.to_string(),
            };
            tune(&p, cfg.timeout).map_err(lost)?;
            p.write_all(&hello(rank, n, 0, cfg.tensors)).map_err(lost)?;
            streams[peer] = Some(p);
        }
        // ...and accept those above.
        if rank + 1 < n {
            let all = accept_until(&listener, deadline, |mut p, _| {
                let left = deadline.saturating_duration_since(Instant::now()).max(POLL);
                let Ok((peer, world, _, _)) = read_hello(&mut p, left) else {
                    return Ok(false);
                };
                if world != n || peer <= rank || peer >= n || streams[peer].is_some() {
                    return Err(DistError::Protocol {
                        rank: peer,
                        reason: format!(
                            "rank {peer} of world size {world} connected to rank {rank} \
                             unexpectedly"
                        ),
                    });
                }
                tune(&p, cfg.timeout).map_err(|e| DistError::PeerLost {
                    rank: peer,
                    awaited: "the mesh's connection".into(),
                    reason: e.to_string(),
                })?;
                streams[peer] = Some(p);
                Ok(streams.iter().skip(rank + 1).all(Option::is_some))
            })?;
            if !all {
                let peer = (rank + 1..n).find(|&r| streams[r].is_none()).unwrap_or(n);
                return Err(DistError::Timeout {
                    rank: peer,
                    awaited: format!("its connection to rank {rank}"),
                    timeout: cfg.timeout,
                });
            }
        }
        Ok(())
    }

    /// The readers and the heartbeat over the connected `streams`.
    fn start(cfg: &NetConfig, streams: Vec<Option<TcpStream>>) -> Result<Self, DistError> {
        let stop = Arc::new(AtomicBool::new(false));
        let silence = cfg.silence();
        let mut peers = Vec::with_capacity(streams.len());
        let mut writers: Vec<Arc<Mutex<TcpStream>>> = Vec::new();
        for (rank, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                peers.push(None);
                continue;
            };
            let lost = |e: std::io::Error| DistError::PeerLost {
                rank,
                awaited: "the mesh to start".into(),
                reason: e.to_string(),
            };
            let mut reader = s.try_clone().map_err(lost)?;
            reader.set_read_timeout(Some(silence)).map_err(lost)?;
            let (tx, rx) = mpsc::channel();
            let stop_r = stop.clone();
            let failed = Arc::new(Mutex::new(None));
            let gone = Arc::new(Mutex::new(None));
            let (failed_r, gone_r) = (failed.clone(), gone.clone());
            let handle = std::thread::Builder::new()
                .name(format!("dist-reader-{rank}"))
                .spawn(move || read_loop(&mut reader, &tx, &stop_r, silence, &failed_r, &gone_r))
                .map_err(lost)?;
            let writer = Arc::new(Mutex::new(s));
            writers.push(writer.clone());
            peers.push(Some(Peer {
                writer,
                inbox: Mutex::new(rx),
                lost: Mutex::new(None),
                failed,
                gone,
                reader: Some(handle),
            }));
        }
        let heartbeat = if writers.is_empty() {
            None
        } else {
            let stop_h = stop.clone();
            let every = cfg.heartbeat.max(POLL);
            Some(
                std::thread::Builder::new()
                    .name("dist-heartbeat".into())
                    .spawn(move || {
                        while !stop_h.load(Ordering::Relaxed) {
                            for w in &writers {
                                if let Ok(mut w) = w.lock() {
                                    write_frame(&mut w, Kind::Heartbeat, &[]).ok();
                                }
                            }
                            let t0 = Instant::now();
                            while t0.elapsed() < every && !stop_h.load(Ordering::Relaxed) {
                                std::thread::sleep(POLL.min(every));
                            }
                        }
                    })
                    .map_err(|e| DistError::InvalidConfig {
                        field: "heartbeat".into(),
                        reason: format!("cannot start its thread: {e}"),
                    })?,
            )
        };
        Ok(Self {
            rank: cfg.rank,
            world_size: cfg.world_size,
            timeout: cfg.timeout,
            peers,
            stop,
            heartbeat,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks there are.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// How long a receive waits at most.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn peer(&self, rank: usize) -> Result<&Peer, DistError> {
        self.peers
            .get(rank)
            .and_then(Option::as_ref)
            .ok_or_else(|| DistError::InvalidConfig {
                field: "rank".into(),
                reason: format!(
                    "rank {} has no peer {rank} (world size {})",
                    self.rank, self.world_size
                ),
            })
    }

    /// Sends `parts` as one frame of `kind` to `to`.
    pub(super) fn send(&self, to: usize, kind: Kind, parts: &[&[u8]]) -> Result<(), DistError> {
        let peer = self.peer(to)?;
        let lost = |reason: String| DistError::PeerLost {
            rank: to,
            awaited: format!("{} to be sent", kind.name()),
            reason,
        };
        if let Some(reason) = peer.lost.lock().ok().and_then(|l| l.clone()) {
            return Err(lost(reason));
        }
        let mut w = peer
            .writer
            .lock()
            .map_err(|_| lost("its writer was poisoned".into()))?;
        let failed = |peer: &Peer| peer.failed.lock().ok().and_then(|f| f.clone());
        if let Some(reason) = failed(peer) {
            return Err(DistError::Remote { rank: to, reason });
        }
        write_frame(&mut w, kind, parts).map_err(|e| {
            // A peer that failed said why before it closed: its reader has it, or will in a
            // moment.
            let t0 = Instant::now();
            while t0.elapsed() < POLL * 10 {
                if let Some(reason) = failed(peer) {
                    return DistError::Remote { rank: to, reason };
                }
                std::thread::sleep(POLL / 4);
            }
            lost(broken(&e))
        })
    }

    /// The next frame from `from`, which must be of `kind`, within the timeout; `awaited`
    /// says what it is for errors.
    pub(super) fn recv(
        &self,
        from: usize,
        kind: Kind,
        awaited: &str,
    ) -> Result<Vec<u8>, DistError> {
        let peer = self.peer(from)?;
        let lost = |reason: String| DistError::PeerLost {
            rank: from,
            awaited: awaited.to_string(),
            reason,
        };
        if let Some(reason) = peer.lost.lock().ok().and_then(|l| l.clone()) {
            return Err(lost(reason));
        }
        let inbox = peer
            .inbox
            .lock()
            .map_err(|_| lost("its inbox was poisoned".into()))?;
        let got = inbox.recv_timeout(self.timeout);
        let reason = match got {
            Ok(Incoming::Frame(k, data)) if k == kind => return Ok(data),
            Ok(Incoming::Frame(k, _)) => {
                return Err(DistError::Protocol {
                    rank: from,
                    reason: format!("sent {} while {awaited} was awaited", k.name()),
                })
            }
            Ok(Incoming::Lost(reason)) => reason,
            Ok(Incoming::Failed(reason)) => {
                if let Ok(mut l) = peer.lost.lock() {
                    *l = Some(format!("it failed: {reason}"));
                }
                return Err(DistError::Remote { rank: from, reason });
            }
            Err(RecvTimeoutError::Disconnected) => "its connection is closed".to_string(),
            Err(RecvTimeoutError::Timeout) => {
                return Err(DistError::Timeout {
                    rank: from,
                    awaited: awaited.to_string(),
                    timeout: self.timeout,
                })
            }
        };
        if let Ok(mut l) = peer.lost.lock() {
            *l = Some(reason.clone());
        }
        Err(lost(reason))
    }

    /// Whether `peer` is still there, without waiting: an error if it failed (and said why),
    /// its connection is gone, or it fell silent; `awaited` says what for, in the error.
    pub(super) fn check(&self, peer: usize, awaited: &str) -> Result<(), DistError> {
        let p = self.peer(peer)?;
        let get = |m: &Mutex<Option<String>>| m.lock().ok().and_then(|g| g.clone());
        if let Some(reason) = get(&p.failed) {
            return Err(DistError::Remote { rank: peer, reason });
        }
        if let Some(reason) = get(&p.lost).or_else(|| get(&p.gone)) {
            return Err(DistError::PeerLost {
                rank: peer,
                awaited: awaited.to_string(),
                reason,
            });
        }
        Ok(())
    }

    /// Tells every peer that this rank failed with `reason` (best effort: a peer already gone
    /// is skipped); each then fails its wait on this rank with it.
    pub fn fail(&self, reason: &str) {
        for peer in self.peers.iter().flatten() {
            if let Ok(mut w) = peer.writer.lock() {
                write_frame(&mut w, Kind::Failed, &[reason.as_bytes()]).ok();
            }
        }
    }

    /// Closes every connection without a goodbye, as a process that dies does (for tests of
    /// what its peers see); sends and receives fail from then on.
    #[doc(hidden)]
    pub fn abort(&self) {
        self.stop.store(true, Ordering::Relaxed);
        for peer in self.peers.iter().flatten() {
            if let Ok(mut l) = peer.lost.lock() {
                *l = Some("this rank aborted".into());
            }
            if let Ok(w) = peer.writer.lock() {
                w.shutdown(std::net::Shutdown::Both).ok();
            }
        }
    }

    fn close(&mut self, goodbye: bool) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.heartbeat.take() {
            h.join().ok();
        }
        for peer in self.peers.iter_mut().flatten() {
            if let Ok(mut w) = peer.writer.lock() {
                if goodbye {
                    write_frame(&mut w, Kind::Goodbye, &[]).ok();
                }
                w.shutdown(std::net::Shutdown::Both).ok();
            }
            if let Some(h) = peer.reader.take() {
                h.join().ok();
            }
        }
    }
}

impl Drop for Mesh {
    /// Says goodbye to every peer and closes the connections.
    fn drop(&mut self) {
        self.close(true);
    }
}

/// A peer's reader: frames to `tx` until the connection closes, goes silent for `silence`, or
/// the mesh stops; heartbeats only prove the peer alive.
fn read_loop(
    s: &mut TcpStream,
    tx: &Sender<Incoming>,
    stop: &AtomicBool,
    silence: Duration,
    failed: &Mutex<Option<String>>,
    gone: &Mutex<Option<String>>,
) {
    let leave = |reason: String| {
        if let Ok(mut g) = gone.lock() {
            *g = Some(reason.clone());
        }
        tx.send(Incoming::Lost(reason)).ok();
    };
    loop {
        match read_frame(s) {
            Ok((Kind::Heartbeat, _)) => {}
            Ok((Kind::Failed, data)) => {
                let reason = String::from_utf8_lossy(&data).into_owned();
                if let Ok(mut f) = failed.lock() {
                    *f = Some(reason.clone());
                }
                tx.send(Incoming::Failed(reason)).ok();
                return;
            }
            Ok((Kind::Goodbye, _)) => {
                leave("it left (it ended, or failed)".into());
                return;
            }
            Ok((kind, data)) => {
                if tx.send(Incoming::Frame(kind, data)).is_err() {
                    return;
                }
            }
            Err(e) => {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let reason = match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                        "no heartbeat for {:.1} s: it hangs or its host is unreachable",
                        silence.as_secs_f64()
                    ),
                    std::io::ErrorKind::UnexpectedEof => {
                        "its connection closed without a goodbye: the process died".into()
                    }
                    _ => broken(&e),
                };
                leave(reason);
                return;
            }
        }
    }
}

/// What a failed read or write of a peer's connection says about the peer.
fn broken(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("its connection stalled ({e}): it hangs or its host is unreachable")
        }
        _ => format!("its connection broke ({e}): the process died"),
    }
}

/// A free port on the loopback interface (for tests and single-host runs).
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((IpAddr::from([127, 0, 0, 1]), 0))?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(rank: usize, world: usize, port: u16, timeout_ms: u64) -> NetConfig {
        let mut c = NetConfig::new(
            rank,
            world,
            "127.0.0.1",
            port,
            Duration::from_millis(timeout_ms),
        );
        c.heartbeat = Duration::from_millis(50);
        c
    }

    /// `world` meshes, one per thread, joined.
    fn mesh(world: usize, timeout_ms: u64) -> Vec<Mesh> {
        let port = free_port().unwrap();
        let handles: Vec<_> = (0..world)
            .map(|r| std::thread::spawn(move || Mesh::connect(&cfg(r, world, port, timeout_ms))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    }

    #[test]
    fn frames_cross_a_full_mesh() {
        let m = mesh(3, 5000);
        for (a, from) in m.iter().enumerate() {
            for b in (0..3).filter(|&b| b != a) {
                from.send(b, Kind::Bytes, &[&[a as u8, b as u8]]).unwrap();
            }
        }
        for (b, to) in m.iter().enumerate() {
            for a in (0..3).filter(|&a| a != b) {
                let got = to.recv(a, Kind::Bytes, "a test message").unwrap();
                assert_eq!(got, vec![a as u8, b as u8]);
            }
        }
    }

    #[test]
    fn a_frame_of_another_kind_is_an_error_naming_the_peer() {
        let m = mesh(2, 5000);
        m[1].send(0, Kind::Barrier, &[]).unwrap();
        let e = m[0].recv(1, Kind::Tensor, "a hidden state").unwrap_err();
        assert_eq!(e.peer(), Some(1));
        assert!(e.to_string().contains("a hidden state"), "{e}");
    }

    #[test]
    fn a_silent_peer_is_taken_for_dead() {
        // A peer that joins and then says nothing, not even heartbeats.
        let port = free_port().unwrap();
        let master = std::thread::spawn(move || Mesh::connect(&cfg(0, 2, port, 3000)));
        let mut s = connect_until(
            &format!("127.0.0.1:{port}"),
            Instant::now() + Duration::from_secs(3),
            Duration::from_secs(3),
            0,
        )
        .unwrap();
        s.write_all(&hello(1, 2, 1, TensorPath::Tcp)).unwrap();
        let m = master.join().unwrap().unwrap();
        let t0 = Instant::now();
        let e = m.recv(1, Kind::Tensor, "a hidden state").unwrap_err();
        // Silence is five heartbeats (250 ms), well within the 3 s timeout.
        assert!(
            t0.elapsed() < Duration::from_millis(2500),
            "{:?}",
            t0.elapsed()
        );
        assert!(matches!(e, DistError::PeerLost { rank: 1, .. }), "{e}");
        assert!(e.to_string().contains("heartbeat"), "{e}");
        drop(s);
    }
}
