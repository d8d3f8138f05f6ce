//! AdamW over F32 variables, as candle-nn's `AdamW` computes it: fused into one kernel launch
//! per step on a GPU ([`FusedAdamW`]), one multi-threaded pass over host memory on the CPU
//! ([`HostAdamW`]).

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
mod fused;
mod host;

pub use fused::FusedAdamW;
pub use host::{HostAdamW, Moments};
