//! What a model keeps of its CUDA graphs (`graph.rs` captures and replays them): whether they
//! are on, the captured step or the pipeline's captured runs with the buffers they read and
//! write, a capture that failed, and the counts
//! [`CausalLm::graph_stats`](crate::CausalLm::graph_stats) reports.

use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

use candle_core::{Tensor, TensorId};
use candle_offload::StepGraph;

/// What graph replay did so far ([`CausalLm::graph_stats`](crate::CausalLm::graph_stats)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphStats {
    /// Decode steps captured into a graph (each also ran, as that graph's first launch).
    pub captures: u64,
    /// Decode steps replayed from a graph captured earlier.
    pub replays: u64,
    /// Single-token steps on a GPU that ran eagerly while graphs were on (ragged decode steps
    /// too, while their graphs are on).
    pub eager_steps: u64,
    /// Ragged decode steps (several sequences, each with its own cache) captured into a graph.
    pub ragged_captures: u64,
    /// Ragged decode steps replayed from a graph captured earlier.
    pub ragged_replays: u64,
    /// Why the latest eager step could not use a graph.
    pub last_reason: Option<String>,
}

/// The model's graph state.
#[derive(Debug)]
pub(super) struct Graphs {
    pub(super) on: AtomicBool,
    /// Ragged decode steps captured too (off by default).
    pub(super) ragged_on: AtomicBool,
    pub(super) state: Mutex<State>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) captured: Option<Captured>,
    /// The GPU runs of a model with host layers or a host head, captured one graph each.
    pub(super) pipeline: Option<Pipeline>,
    /// A capture failed with this error: not tried again until graphs are switched on anew.
    pub(super) refused: Option<String>,
    /// The captured ragged decode step.
    pub(super) ragged: Option<RaggedCaptured>,
    /// A ragged capture failed with this error: not tried again until switched on anew.
    pub(super) ragged_refused: Option<String>,
    pub(super) stats: GraphStats,
}

/// A decode step of a model with layers or the head on the host, whose GPU runs (the
/// runs of GPU layers between host ones, `CausalLm::segments`) were captured one graph each:
/// the host parts run eagerly between their launches.
#[derive(Debug)]
pub(super) struct Pipeline {
    pub(super) batch: usize,
    /// Each layer's key buffer at the capture.
    pub(super) kv: Vec<Option<TensorId>>,
    /// u32 (batch + 1): the token ids (which no graph reads) and the position.
    pub(super) inputs: Tensor,
    /// Per entry of the model's segments: the GPU run's graph (`None` for a host run).
    pub(super) runs: Vec<Option<GpuRun>>,
}

/// One captured run of GPU layers: its graph reads the hidden state from `input` and leaves
/// it in `output`, both (batch, 1, hidden) in the GPU stage's dtype.
#[derive(Debug)]
pub(super) struct GpuRun {
    pub(super) graph: StepGraph,
    pub(super) input: Tensor,
    pub(super) output: Tensor,
}

/// What a captured step reads on the device instead of the host: views of its `inputs`.
#[derive(Debug)]
pub(super) struct DeviceInputs {
    /// One u32: the positions cached before this step.
    pub(super) pos: Tensor,
    /// u32 (batch): each row's left padding, for a padded batch.
    pub(super) pads: Option<Tensor>,
    /// (batch, 1, hidden) in the GPU stage's dtype: the embedding rows, looked up on the host
    /// before each launch, where the host stage does nothing else.
    pub(super) hidden: Option<Tensor>,
}

/// One captured step and the buffers it reads and writes.
#[derive(Debug)]
pub(super) struct Captured {
    pub(super) graph: StepGraph,
    pub(super) batch: usize,
    /// Captured for a padded batch (the attention reads the counts in `inputs`).
    pub(super) padded: bool,
    /// u32 (batch + 1, and batch more when padded): the token ids, the position, then the
    /// padding counts.
    pub(super) inputs: Tensor,
    /// f32 (batch, vocab).
    pub(super) logits: Tensor,
    /// Each layer's key buffer at the capture.
    pub(super) kv: Vec<Option<TensorId>>,
    /// Where the graph reads the embedding rows (`DeviceInputs::hidden`).
    pub(super) hidden: Option<Tensor>,
}

/// One captured ragged decode step: its sequences' caches and the buffers it reads and writes.
#[derive(Debug)]
pub(super) struct RaggedCaptured {
    pub(super) graph: StepGraph,
    /// Every sequence's key buffer of every layer at the capture, sequence by sequence.
    pub(super) kv: Vec<Option<TensorId>>,
    /// u32 (1, sequences): each sequence's token.
    pub(super) ids: Tensor,
    /// I64 (layers, sequences, 3): each layer's caches and each sequence's position
    /// (`kernels::attention::ragged_seq_table`).
    pub(super) tables: Tensor,
    /// `tables` as last written, on the host: a replay changes only the positions.
    pub(super) table: Vec<i64>,
    /// f32 (sequences, vocab).
    pub(super) logits: Tensor,
}

impl Graphs {
    /// A model's graphs, on or off as its tuning says ([`candle_offload::Tuning::graphs`],
    /// [`candle_offload::Tuning::ragged_graphs`]).
    pub(super) fn new(on: bool, ragged: bool) -> Self {
        Self {
            on: AtomicBool::new(on),
            ragged_on: AtomicBool::new(ragged),
            state: Mutex::new(State::default()),
        }
    }
}

impl State {
    pub(super) fn eager(&mut self, why: String) -> Option<Tensor> {
        if self.stats.last_reason.as_deref() != Some(&why) {
            tracing::debug!(reason = %why, "decoding eagerly (no CUDA graph)");
        }
        self.stats.eager_steps += 1;
        self.stats.last_reason = Some(why);
        None
    }
}
