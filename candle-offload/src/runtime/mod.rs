//! The offload runtime: a host store, a budgeted residency cache and a copy engine, behind
//! one `acquire`/`release` API that is the same on a CPU and on a GPU.
//!
//! ```text
//! acquire(u):  cache.acquire(u) ─► evict victims (copy stream waits on their last use, frees)
//!                               └► fetch u if absent (alloc + H2D on the copy stream, `ready`)
//!              compute waits on ready[u]
//!              start the planned fetches that can start now (Belady's plan, <= depth+1 ahead)
//! ... caller enqueues kernels that read u's tensors on the compute stream ...
//! drop(guard): last_use[u] recorded on compute; cache.release(u)
//! ```
//!
//! Units in the disk tier add a hop in front of the copy: after each acquire, the next
//! [`READ_AHEAD_UNITS`](fetch::READ_AHEAD_UNITS) disk units the plan will fetch are read from
//! their file into host memory by reader threads (`sys::ReadPool`), so that their fetch (the
//! copy, or on the CPU the unit's tensors) finds the bytes read.
//!
//! The files, by concern: `config.rs` the settings, `start.rs` the steps of
//! [`OffloadRuntime::new`], `sizes.rs` the units' device sizes and the weights' need (planning,
//! no device), `shared.rs` the state behind the handle, `fetch.rs` and `upload.rs` bringing
//! units in, `evict.rs` taking them out, `guard.rs` the pinned unit handed out, `weights.rs`
//! its tensors, `graph.rs` captured steps, `stats.rs` what a runtime reports, `error.rs` its
//! typed failures.

mod config;
mod error;
mod evict;
mod fetch;
mod graph;
mod guard;
mod shared;
mod sizes;
mod start;
mod stats;
#[cfg(test)]
mod testutil;
mod upload;
mod weights;

pub use config::OffloadConfig;
pub use error::RuntimeError;
pub use graph::StepGraph;
pub use guard::UnitGuard;
pub use shared::OffloadRuntime;
pub use stats::LeakReport;
