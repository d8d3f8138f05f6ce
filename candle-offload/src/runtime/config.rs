//! [`OffloadConfig`]: the settings an [`OffloadRuntime`](crate::OffloadRuntime) starts with,
//! and their validation.

use crate::budget::MemoryLimit;
use crate::cache::PolicyChoice;
use crate::error::{Error, Result};
use crate::experts::ExpertOptions;
use crate::plan::{OffloadStrategy, MAX_PREFETCH_DEPTH};
use crate::tuning::Tuning;

/// Settings of an [`OffloadRuntime`](crate::OffloadRuntime).
#[derive(Debug, Clone)]
pub struct OffloadConfig {
    /// The device memory limit (the seed's `max_gpu_memory`, `--gpu-memory-limit`). `None`:
    /// no limit of our own on a CPU; on a GPU, the memory free when the runtime starts.
    pub gpu_memory_limit: Option<MemoryLimit>,
    /// Bytes the caller keeps inside the limit for activations, KV cache and workspace.
    pub reserve_bytes: u64,
    /// How much of the model stays resident (the seed's `offload_strategy`).
    pub strategy: OffloadStrategy,
    /// Victim selection; `Auto` learns the access order.
    pub policy: PolicyChoice,
    /// Copies that may run ahead of their victims' release, 0 to [`MAX_PREFETCH_DEPTH`]. Each
    /// step of depth keeps one largest unit of the budget free for copies in flight: 0 moves
    /// the fewest bytes, more hides copies behind more compute. 1 by default (docs/tuning.md);
    /// 2 keeps the link busiest.
    pub prefetch_depth: usize,
    /// Units (by name) that never leave the device once fetched.
    pub keep: Vec<String>,
    /// Fetched tensors are autograd leaves (`is_variable`), so a backward pass computes
    /// gradients for them (training with offloaded weights). Off for inference, where a
    /// variable would make every op record its graph.
    pub trainable: bool,
    /// The units this runtime serves, by name (a pipeline stage's share of a model whose store
    /// several runtimes share); `None`: every unit of the store. Only these count in the
    /// budget and may be acquired.
    pub units: Option<Vec<String>>,
    /// cudarc's per-buffer event tracking on this GPU's CUDA context (off by default). Once a
    /// second stream exists, cudarc records an event for every buffer a kernel reads or writes
    /// and makes the next user wait on it: two or three driver calls per argument per launch.
    /// The runtime orders its copy stream with its own events (ARCHITECTURE.md, hazard table),
    /// so a single-device model is safe without it, and decodes faster (docs/tuning.md).
    /// `false` turns it off for the whole context from then on (cudarc has no per-stream
    /// switch): an application that runs its own streams on the same device sets `true`.
    /// Pipelines over several GPUs and training keep it: the device-to-device hidden-state copy
    /// relies on it. Ignored on the CPU.
    pub event_tracking: bool,
    /// The reservation of the phase this runtime spends most of its passes in, where lower than
    /// `reserve_bytes` (a model's decode steps, after a prompt that needs room for its
    /// activations; see [`set_reserve_bytes`](crate::OffloadRuntime::set_reserve_bytes)). When every
    /// served unit fits beside it, each unit takes its own device size, without the streaming
    /// padding: the prompt then streams what its activations leave no room for, and the
    /// steady phase holds every unit. `None`: `reserve_bytes`.
    pub steady_reserve_bytes: Option<u64>,
    /// The performance choices ([`Tuning`]): the ops' kernels (read by the code built over
    /// this runtime, [`OffloadRuntime::tuning`](crate::OffloadRuntime::tuning)), the CPU
    /// pool's threads, the weight pool.
    pub tuning: Tuning,
    /// A mixture-of-experts model's expert cache: its policy, and whether missing experts run
    /// on the host CPU ([`crate::experts`]). Read by the model built over this runtime.
    pub experts: ExpertOptions,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self {
            gpu_memory_limit: None,
            reserve_bytes: 0,
            strategy: OffloadStrategy::Minimal,
            policy: PolicyChoice::Auto,
            prefetch_depth: 1,
            keep: Vec::new(),
            trainable: false,
            units: None,
            event_tracking: false,
            steady_reserve_bytes: None,
            tuning: Tuning::default(),
            experts: ExpertOptions::default(),
        }
    }
}

impl OffloadConfig {
    /// Refuses values out of their range: a prefetch depth past [`MAX_PREFETCH_DEPTH`], a
    /// tuning value its own validation refuses (named `tuning.<key>`).
    pub(super) fn validate(&self) -> Result<()> {
        if self.prefetch_depth > MAX_PREFETCH_DEPTH {
            return Err(Error::InvalidConfig {
                field: "prefetch_depth".into(),
                reason: format!("{} is more than {MAX_PREFETCH_DEPTH}", self.prefetch_depth),
            });
        }
        self.tuning.validate().map_err(|e| Error::InvalidConfig {
            field: format!("tuning.{}", e.key),
            reason: e.reason,
        })
    }
}
