//! Several processes running one model: the [`Transport`] between ranks (`transport.rs`) and
//! its two implementations, [`TcpTransport`] (`tcp.rs`) and [`NcclTransport`] (`nccl.rs`).
//!
//! A transport joins `world_size` processes (ranks `0..world_size`) at a rendezvous (rank 0
//! listens on `MASTER_ADDR:MASTER_PORT`, the others connect, retrying until the timeout) and
//! then carries tensors from one rank to another (a small header with dtype and shape, then the
//! bytes), small values broadcast from one rank (token ids, a JSON plan), and barriers. Every
//! receive has a deadline: a peer that never came, died or went silent is a [`DistError`]
//! naming its rank and what was awaited, within the timeout, never a hang. A heartbeat thread
//! tells every peer this rank is alive, so that a peer whose process or host died is noticed
//! even while nothing else is sent.
//!
//! `net.rs` is the OS-level socket code (rendezvous, frames, readers, heartbeat); it speaks in
//! bytes and imports nothing from the crate but [`DistError`] (`error.rs`). `wire.rs` turns
//! tensors into frames and back.
//!
//! [`NcclTransport`] implements the same trait between GPUs: `send_tensor`/`recv_tensor` as
//! NCCL send/recv on the device buffers (NCCL opened at run time), everything else (the
//! rendezvous that passes NCCL's unique id, small values, barriers, the heartbeat) over a
//! [`TcpTransport`] it holds (its calls into NCCL are `sys`'s). Every rank must use the same:
//! the hello at the rendezvous says which ([`TensorPath`]).

mod error;
mod nccl;
mod net;
mod tcp;
mod transport;
mod wire;

pub use error::{DistError, Result};
pub use nccl::NcclTransport;
pub use net::{free_port, NetConfig, TensorPath};
pub use tcp::TcpTransport;
pub use transport::{broadcast_json, broadcast_tokens, gather_json, Transport};

#[cfg(test)]
mod tests;
