//! The family-neutral offloaded causal LM: every model family runs through this one file.
//!
//! Every weight lives in the runtime's host store. Each forward pass acquires the units in
//! order (embeddings, each decoder layer, the final norm, the output head, as the family's
//! [`Layout`] names them), builds each block through the [`Family`] from the unit's
//! `VarBuilder` right before it runs, and releases the unit right after, so the runtime can
//! stream what does not fit the budget. The KV cache stays on the device; the budget reserves
//! room for it. One device is the single-GPU path; several run the layers as a pipeline
//! (layer sharding), each device with its own runtime, budget, copy stream and schedule over
//! one shared host store.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, D};
use candle_offload::placement::{
    plan_placement, DeviceBudget, DeviceMap, PlacementMode, PlacementRequest,
};
use candle_offload::{
    KernelTuning, MemoryLimit, OffloadConfig, OffloadRuntime, PolicyChoice, Tuning, UnitId,
};

use crate::config::Config;
use crate::error::ModelError;
use crate::family::{Family, Hidden, Layout, StepCtx, UnitWeights};
use crate::layers::{Cache, Masks, Rope};

mod graph;
pub use graph::GraphStats;

/// The units of a model in the runtimes' (shared) store.
#[derive(Debug, Clone)]
struct Units {
    embed: UnitId,
    layers: Vec<UnitId>,
    norm: UnitId,
    head: UnitId,
}

/// How [`CausalLm::offloaded`] places a model's weights: the runtime's own settings.
///
/// The model fills in what it knows: it adds its KV cache and activations to `reserve_bytes`
/// (which then means extra room the caller keeps), adds its non-layer units to `keep`, and
/// replaces [`PolicyChoice::Auto`] by Belady over its own sweep. `units` is the pipeline's to
/// set and must be `None`.
pub type OffloadSettings = OffloadConfig;

/// One pipeline stage: a device's runtime and the contiguous layers it runs.
#[derive(Debug)]
struct Stage {
    rt: OffloadRuntime,
    rope: Rope,
    layers: Range<usize>,
    /// The compute dtype on this stage (the model's, but F32 for host layers of GGML blocks).
    dtype: DType,
    /// The runtime's reservation while a prompt runs and while decoding (`None`: fixed).
    phase: Option<PhaseReserve>,
}

/// A stage's reservation by phase: a pass of many rows (a prompt) needs its activations, a
/// decode step one row's; the KV cache and workspaces are the same in both. Decode gives the
/// prompt's room to weights ([`OffloadRuntime::set_reserve_bytes`]), so that a model that
/// streams at a long prompt's reservation streams less, or nothing, while it decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PhaseReserve {
    prompt: u64,
    decode: u64,
}

/// How hidden states cross from one stage's GPU to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HiddenTransfer {
    /// A device-to-device copy (peer-to-peer where peer access is on; otherwise the driver
    /// stages it), ordered after the producing kernels by an event.
    #[default]
    Device,
    /// Through host memory: copied down, then up (a fallback for setups where GPU-to-GPU
    /// copies fail).
    Host,
}

/// How many decoder layers run on the host CPU in front of a GPU (llama.cpp's `-ngl` split):
/// the first layers and the embeddings run on the CPU from their host memory, the rest, the
/// final norm and the output head on the GPU. Decode reads each host layer's weights at the
/// host's memory bandwidth instead of streaming them over PCIe
/// ([`CausalLm::offloaded_with_host`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostLayers {
    /// None: layers that do not fit the budget are streamed to the GPU (an embedding table of
    /// the model's own then stays on the host).
    #[default]
    None,
    /// This many (0 to the number of layers).
    Count(usize),
    /// The fewest that let the GPU hold the others resident, so that nothing streams.
    Auto,
    /// This many, spread evenly over the layers instead of the first ones (`spread:N`): while
    /// the CPU runs a host layer, the GPU's copy stream brings the next streamed layer, so
    /// that host compute and PCIe transfers overlap when both are needed (a model too large
    /// for the budget even with the host's share of it).
    Spread(usize),
    /// Spread, with the count chosen so that the layers' compute and the link's copies
    /// balance (`spread:auto`): [`candle_offload::spread_host_split`] over the layers' bytes,
    /// one layer's step timed on the host and on the GPU
    /// ([`CausalLm::layer_step_seconds`]) and the link's rate measured; none when the model
    /// fits the budget, and none on a CPU device. It also weighs putting the output head
    /// (with the final norm) on the host, as llama.cpp's `-ngl` below the layer count + 1 does
    /// ([`candle_offload::spread_host_split_with_head`]): the host then reads the head's bytes
    /// every step and the GPU has their room for layers.
    SpreadAuto,
    /// [`Spread`](Self::Spread) with the output head and the final norm on the host too
    /// (`spread:N+head`); for models with a head of their own (not tied to the embeddings).
    SpreadWithHead(usize),
}

/// One decoder layer's decode step, timed on the host CPU and on the GPU
/// ([`CausalLm::layer_step_seconds`]): what [`HostLayers::SpreadAuto`] weighs against the link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSteps {
    /// Seconds on the host CPU.
    pub host_s: f64,
    /// Seconds on the GPU.
    pub device_s: f64,
}

/// Where [`CausalLm::host_split`] puts the work: host layers, and whether the head goes too.
#[derive(Debug, Clone, Default)]
struct HostSplit {
    layers: usize,
    head_on_host: bool,
    /// What [`HostLayers::SpreadAuto`] timed (`None` where it timed nothing).
    steps: Option<LayerSteps>,
    /// Every split [`HostLayers::SpreadAuto`] weighed, priced (empty where it weighed none).
    prices: Vec<candle_offload::SplitPrice>,
}

impl std::str::FromStr for HostLayers {
    type Err = String;

    /// `auto`, `none`, a count, or `spread:` and a count or `auto`; `spread:N+head` also puts
    /// the output head on the host.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let count = |n: &str| {
            n.trim().parse::<usize>().map_err(|_| {
                format!("{s:?} is not a layer count, `spread:` and a count, `auto` or `none`")
            })
        };
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            "spread:auto" => Ok(Self::SpreadAuto),
            t => match t.strip_prefix("spread:") {
                Some(n) => match n.trim().strip_suffix("+head") {
                    Some(n) => count(n).map(Self::SpreadWithHead),
                    None => count(n).map(Self::Spread),
                },
                None => count(t).map(Self::Count),
            },
        }
    }
}

impl HostLayers {
    /// Which of `n` layers run on the host when `h` do: the first `h`, or for
    /// [`Spread`](Self::Spread) and [`SpreadAuto`](Self::SpreadAuto) `h` evenly apart
    /// ([`candle_offload::spread_host_set`]).
    pub fn host_set(&self, h: usize, n: usize) -> Vec<bool> {
        match self {
            Self::Spread(_) | Self::SpreadAuto | Self::SpreadWithHead(_) => {
                candle_offload::spread_host_set(h, n)
            }
            _ => (0..n).map(|l| l < h.min(n)).collect(),
        }
    }
}

/// Time and bytes spent moving hidden states between stages.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TransferTotals {
    /// Copies made.
    pub copies: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds from the copy's start until the destination had it (measured only while
    /// [`CausalLm::time_transfers`] is on, which synchronizes both devices around each copy).
    pub seconds: f64,
}

/// Wall time the host CPU spent on its share of the steps of a model with host layers or a
/// host head, in front of a GPU ([`CausalLm::host_totals`]): what `spread:auto`'s timing at
/// build ([`CausalLm::spread_auto_layer_steps`]) predicts, measured while the model runs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostTotals {
    /// Layer steps run on the host (a step of `n` host layers counts `n`).
    pub layer_steps: u64,
    /// Seconds those took, from the hidden state on the host to its output there.
    pub layer_seconds: f64,
    /// Steps of the output head (with the final norm) on the host.
    pub head_steps: u64,
    /// Seconds those took.
    pub head_seconds: f64,
}

impl HostTotals {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &HostTotals) -> HostTotals {
        HostTotals {
            layer_steps: self.layer_steps.saturating_sub(earlier.layer_steps),
            layer_seconds: self.layer_seconds - earlier.layer_seconds,
            head_steps: self.head_steps.saturating_sub(earlier.head_steps),
            head_seconds: self.head_seconds - earlier.head_seconds,
        }
    }

    /// Mean seconds of a host layer's step (`None` before any).
    pub fn layer_step_s(&self) -> Option<f64> {
        (self.layer_steps > 0).then(|| self.layer_seconds / self.layer_steps as f64)
    }

    /// Mean seconds of the host head's step (`None` before any).
    pub fn head_step_s(&self) -> Option<f64> {
        (self.head_steps > 0).then(|| self.head_seconds / self.head_steps as f64)
    }
}

/// A decoder layer built from a unit (`CausalLm::layer_block`): the block, its layer and dtype.
struct BuiltBlock(Box<dyn crate::family::DecoderBlock>, usize, DType);

/// A causal LM of any [`Family`] whose weights come from one [`OffloadRuntime`] per device:
/// one device is the single-GPU path; several run the layers as a pipeline (layer sharding).
#[derive(Debug)]
pub struct CausalLm {
    cfg: Config,
    family: Arc<dyn Family>,
    layout: Layout,
    dtype: DType,
    stages: Vec<Stage>,
    units: Units,
    transfer: HiddenTransfer,
    /// `None`: fused on each GPU stage, not on the CPU ([`set_fused`](Self::set_fused)).
    fused: Option<bool>,
    /// Per layer, whether it runs on the host stage in front of the device (empty without host
    /// layers; [`from_store_with_host`](Self::from_store_with_host)).
    on_host: Vec<bool>,
    /// The order a step runs the layers in: stage index and layers, one entry per stage, or
    /// with spread host layers ([`HostLayers::Spread`]) alternating runs of host and GPU layers.
    segments: Vec<(usize, Range<usize>)>,
    /// What `spread:auto` timed to choose the host layers ([`spread_auto_layer_steps`](Self::spread_auto_layer_steps)).
    layer_steps: Option<LayerSteps>,
    /// The splits `spread:auto` weighed ([`spread_auto_prices`](Self::spread_auto_prices)).
    split_prices: Vec<candle_offload::SplitPrice>,
    /// The final norm and the output head run on the first stage (the host) instead of the
    /// last ([`head_on_host`](Self::head_on_host)).
    head_on_host: bool,
    /// Prompts run in passes of at most this many rows ([`prompt_chunk`](Self::prompt_chunk)).
    prompt_chunk: Option<usize>,
    /// Only the largest logit is used ([`set_greedy_head`](Self::set_greedy_head)).
    greedy_head: std::sync::atomic::AtomicBool,
    timing: std::sync::atomic::AtomicBool,
    totals: std::sync::Mutex<TransferTotals>,
    /// The host's share of the steps ([`host_totals`](Self::host_totals)).
    host_totals: std::sync::Mutex<HostTotals>,
    /// Decode steps replayed from a CUDA graph ([`set_graphs`](Self::set_graphs)).
    graphs: graph::Graphs,
}

impl CausalLm {
    /// The model of `cfg` over the weights in `rt`'s store, computing in `dtype`, with RoPE
    /// tables for `max_len` positions. Every tensor is checked (present, shape, float dtype)
    /// before anything runs; `source` names the weights in errors.
    pub fn new(
        cfg: Config,
        rt: OffloadRuntime,
        dtype: DType,
        max_len: usize,
        source: &std::path::Path,
    ) -> std::result::Result<Self, ModelError> {
        let n = cfg.num_hidden_layers;
        Self::sharded(cfg, vec![(rt, 0..n)], dtype, max_len, source)
    }

    /// The model run as a pipeline over `stages`: each runtime (one per device, all over the
    /// same host store) runs a contiguous range of layers, the ranges in order and covering
    /// every layer; the first stage also runs the embeddings, the last the final norm and the
    /// output head. Checks as [`new`](Self::new) does.
    pub fn sharded(
        cfg: Config,
        stages: Vec<(OffloadRuntime, Range<usize>)>,
        dtype: DType,
        max_len: usize,
        source: &std::path::Path,
    ) -> std::result::Result<Self, ModelError> {
        let Some((first, _)) = stages.first() else {
            return Err(ModelError::Config {
                path: source.into(),
                field: "devices".into(),
                reason: "no stage to run the model on".into(),
            });
        };
        let store = first.store().clone();
        let mut next = 0;
        for (i, (rt, range)) in stages.iter().enumerate() {
            if !std::sync::Arc::ptr_eq(rt.store(), &store) {
                return Err(ModelError::Config {
                    path: source.into(),
                    field: format!("stages[{i}]"),
                    reason: "every stage must share one host store".into(),
                });
            }
            if range.start != next || range.end < range.start {
                return Err(ModelError::Config {
                    path: source.into(),
                    field: format!("stages[{i}]"),
                    reason: format!(
                        "layers {}..{} do not continue from layer {next}",
                        range.start, range.end
                    ),
                });
            }
            next = range.end;
        }
        if next != cfg.num_hidden_layers {
            return Err(ModelError::Config {
                path: source.into(),
                field: "stages".into(),
                reason: format!(
                    "the stages run layers 0..{next}, the model has {}",
                    cfg.num_hidden_layers
                ),
            });
        }
        let layout = cfg.layout();
        for (name, shape) in cfg.expected_tensors() {
            let (_, meta) = store.tensor(&name).ok_or_else(|| ModelError::Tensor {
                path: source.into(),
                tensor: name.clone(),
                reason: "missing".into(),
            })?;
            if meta.shape.dims() != shape.as_slice() {
                return Err(ModelError::Tensor {
                    path: source.into(),
                    tensor: name,
                    reason: format!(
                        "has shape {:?}, the config implies {:?}",
                        meta.shape.dims(),
                        shape
                    ),
                });
            }
            if !meta.dtype.is_float() {
                return Err(ModelError::Tensor {
                    path: source.into(),
                    tensor: name,
                    reason: format!("has dtype {:?}, expected a float dtype", meta.dtype),
                });
            }
        }
        let unit = |name: &str| {
            store.unit_id(name).ok_or_else(|| ModelError::Tensor {
                path: source.into(),
                tensor: name.to_string(),
                reason: "no unit holds it".into(),
            })
        };
        let units = Units {
            embed: unit(&layout.embed)?,
            layers: (0..cfg.num_hidden_layers)
                .map(|l| unit(&layout.layer(l)))
                .collect::<std::result::Result<_, _>>()?,
            norm: unit(&layout.norm)?,
            head: unit(layout.head_unit())?,
        };
        let max_len = max_len.min(cfg.max_position_embeddings).max(1);
        let family = cfg.family.clone();
        let segments = stages
            .iter()
            .enumerate()
            .map(|(i, (_, r))| (i, r.clone()))
            .collect();
        let stages = stages
            .into_iter()
            .map(|(rt, layers)| {
                let rope = family.rope(&cfg, max_len, dtype, rt.device())?;
                Ok(Stage {
                    rt,
                    rope,
                    layers,
                    dtype,
                    phase: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let graphs = graph::Graphs::new(stages.first().is_none_or(|s| s.rt.tuning().graphs));
        Ok(Self {
            cfg,
            family,
            layout,
            dtype,
            stages,
            units,
            transfer: HiddenTransfer::Device,
            fused: None,
            on_host: Vec::new(),
            segments,
            layer_steps: None,
            split_prices: Vec::new(),
            head_on_host: false,
            prompt_chunk: None,
            greedy_head: std::sync::atomic::AtomicBool::new(false),
            timing: std::sync::atomic::AtomicBool::new(false),
            totals: std::sync::Mutex::new(TransferTotals::default()),
            host_totals: std::sync::Mutex::new(HostTotals::default()),
            graphs,
        })
    }

    /// The model of `files` over its weights in `store`, offloaded on `device` under `settings`:
    /// the budget reserves the KV cache and activations for prompts of `prompt_len` tokens and
    /// `max_len` positions in all, the non-layer units stay resident, and the policy follows the
    /// model's sweep unless `settings` names another.
    pub fn offloaded(
        files: &crate::loader::ModelFiles,
        store: std::sync::Arc<candle_offload::HostStore>,
        device: &Device,
        dtype: DType,
        prompt_len: usize,
        max_len: usize,
        settings: &OffloadSettings,
    ) -> std::result::Result<Self, ModelError> {
        Self::offloaded_with_host(
            files,
            store,
            device,
            dtype,
            prompt_len,
            max_len,
            settings,
            HostLayers::None,
        )
    }

    /// The device bytes [`from_store`](Self::from_store) reserves beside the weights on
    /// `device`: [`Config::reserve_bytes`] (without the composition's attention buffers where
    /// every layer's prompt attention runs as one kernel: [`Config::reserve_bytes_with`]),
    /// plus Candle's quantized-matmul workspaces ([`Config::quantized_matmul_bytes`]) on a GPU
    /// when `store` holds GGML blocks. A budget meant to hold some units computes from this.
    ///
    /// `tuning`: the ops' choices the model will run with (its settings' [`Tuning`]'s kernels).
    pub fn reserve_bytes(
        cfg: &Config,
        store: &candle_offload::HostStore,
        device: &Device,
        prompt_len: usize,
        max_len: usize,
        dtype: DType,
        tuning: &KernelTuning,
    ) -> u64 {
        let kernel = Self::prompt_attention_kernel(cfg, device, dtype, tuning);
        let reserve = cfg.reserve_bytes_with(prompt_len, max_len, dtype, kernel);
        if device.is_cuda() && store.ggml_tensor_count() > 0 {
            reserve + cfg.quantized_matmul_bytes(prompt_len, tuning)
        } else {
            reserve
        }
    }

    /// What a stage that streams nothing may leave out of a prompt pass's reservation of `rows`
    /// rows: on a GPU, the allowance for the pool's fragmentation
    /// ([`Config::fragmentation_bytes`]), since the passes' activations are then the only
    /// allocations and come alike pass after pass (a 7B Q4_0 at 4 GiB, prompt 512, then runs
    /// passes of 256 instead of 171); nothing on a CPU, whose budget is the accounting alone.
    fn pass_slack(
        cfg: &Config,
        device: &Device,
        rows: usize,
        max_len: usize,
        dtype: DType,
        tuning: &KernelTuning,
    ) -> u64 {
        if !device.is_cuda() {
            return 0;
        }
        let kernel = Self::prompt_attention_kernel(cfg, device, dtype, tuning);
        cfg.fragmentation_bytes(rows, max_len, dtype, kernel)
    }

    /// Whether every layer's prompt attention runs as one kernel on `device` in `dtype`
    /// ([`candle_offload::kernels::attention::prompt_attention`]): plain causal layers and a supported head
    /// width, what the reservations count its buffers for.
    fn prompt_attention_kernel(
        cfg: &Config,
        device: &Device,
        dtype: DType,
        tuning: &KernelTuning,
    ) -> bool {
        cfg.family.plain_attention(cfg)
            && candle_offload::kernels::attention::prompt_attention_supported(
                device,
                dtype,
                cfg.head_dim,
                tuning,
            )
    }

    /// A stage's reservation while a prompt runs, what it gives to weights while decoding (the
    /// `share` of [`reserve_by_phase`](Self::reserve_by_phase): the prompt's activations and
    /// its rows' quantized-matmul buffers, which a decode step does not need) and the prompt's
    /// pass size
    /// ([`prompt_chunk`](Self::prompt_chunk)), from `at(rows)`, the reservation for a pass of
    /// `rows` before [`resident_saving`](Self::resident_saving), and `fits(rows)`, whether every
    /// unit of the stage fits at its own size beside it less the saving:
    /// - every unit fits beside the whole prompt's: that reservation, less the saving;
    /// - beside a pass of fewer rows (at least [`MIN_PROMPT_CHUNK`]): the most such rows, whose
    ///   reservation, less the saving and less `slack(rows)` (the allowance for fragmentation,
    ///   [`pass_slack`](Self::pass_slack), which `fits(rows, slack)` discounts too), the stage
    ///   keeps, and prompts run in passes of that many rows, so that nothing streams;
    /// - otherwise the whole prompt's reservation, and the stage streams. (Where every unit fits
    ///   only beside a decode step's, the units keep their own sizes and stay while decoding,
    ///   `OffloadConfig::steady_reserve_bytes`; the saving is not taken there: units evicted
    ///   for the prompt's activations and fetched again leave part of the pool unused, and the
    ///   peak can pass the budget.)
    fn phase_reserves(
        at: impl Fn(usize) -> u64,
        saving: u64,
        prompt_len: usize,
        slack: impl Fn(usize) -> u64,
        mut fits: impl FnMut(usize, u64) -> std::result::Result<bool, ModelError>,
    ) -> std::result::Result<(u64, u64, Option<usize>), ModelError> {
        let share = |rows| at(rows).saturating_sub(at(DECODE_ROWS));
        if fits(prompt_len, 0)? {
            return Ok((at(prompt_len) - saving, share(prompt_len), None));
        }
        let mut pass_fits = |rows| fits(rows, slack(rows));
        if prompt_len > MIN_PROMPT_CHUNK && pass_fits(MIN_PROMPT_CHUNK)? {
            // The most rows that fit: fits(lo) holds, fits(hi) does not.
            let (mut lo, mut hi) = (MIN_PROMPT_CHUNK, prompt_len);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if pass_fits(mid)? {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            let pass = at(lo).saturating_sub(slack(lo)).max(at(DECODE_ROWS));
            let share = pass - at(DECODE_ROWS);
            return Ok((pass - saving, share, Some(lo)));
        }
        Ok((at(prompt_len), share(prompt_len), None))
    }

    /// Lets every stage that reserves room give `share` bytes of it (see
    /// [`phase_reserves`](Self::phase_reserves)) to weights while decoding ([`PhaseReserve`]); the
    /// stages start in the prompt's phase.
    fn reserve_by_phase(&mut self, share: u64) {
        for stage in &mut self.stages {
            let prompt = stage.rt.budget().reserve_bytes;
            let decode = prompt.saturating_sub(share);
            stage.phase = (decode < prompt).then_some(PhaseReserve { prompt, decode });
        }
    }

    /// [`offloaded`](Self::offloaded) for any configuration and store (an application's own
    /// model and weights); `source` names the weights in errors.
    #[allow(clippy::too_many_arguments)]
    pub fn from_store(
        cfg: &Config,
        store: Arc<candle_offload::HostStore>,
        device: &Device,
        dtype: DType,
        prompt_len: usize,
        max_len: usize,
        settings: &OffloadSettings,
        source: &std::path::Path,
    ) -> std::result::Result<Self, ModelError> {
        let cfg = cfg.clone();
        let (reserve, share, chunk) = Self::phase_reserves(
            |rows| {
                Self::reserve_bytes(
                    &cfg,
                    &store,
                    device,
                    rows,
                    max_len,
                    dtype,
                    &settings.tuning.kernels,
                )
            },
            Self::resident_saving(&store, device, settings),
            prompt_len,
            |rows| Self::pass_slack(&cfg, device, rows, max_len, dtype, &settings.tuning.kernels),
            |rows, slack| {
                let (need, budget) =
                    Self::whole_bytes(&cfg, &store, device, dtype, rows, max_len, settings, true)?;
                Ok(need.saturating_sub(slack) <= budget)
            },
        )?;
        let kv = cfg.kv_cache_bytes(max_len, dtype).min(reserve);
        let mut stage = stage_config(
            settings,
            reserve,
            Self::kept_units(&store, &cfg),
            || Self::schedule(&store, &cfg),
            None,
        )?;
        stage.steady_reserve_bytes = Some(stage.reserve_bytes.saturating_sub(share));
        let rt = OffloadRuntime::new(store.clone(), device, &stage)?;
        declare_reservation(&rt, kv, reserve, settings.reserve_bytes)?;
        let mut model = Self::new(cfg, rt, dtype, max_len, source)?;
        model.reserve_by_phase(share);
        model.prompt_chunk = chunk;
        Ok(model)
    }

    /// [`offloaded`](Self::offloaded) with the first layers on the host CPU (see
    /// [`HostLayers`]); when the split gives no host layer (always for
    /// [`HostLayers::Auto`] on a CPU device), the same model as
    /// [`offloaded`](Self::offloaded).
    #[allow(clippy::too_many_arguments)]
    pub fn offloaded_with_host(
        files: &crate::loader::ModelFiles,
        store: std::sync::Arc<candle_offload::HostStore>,
        device: &Device,
        dtype: DType,
        prompt_len: usize,
        max_len: usize,
        settings: &OffloadSettings,
        host: HostLayers,
    ) -> std::result::Result<Self, ModelError> {
        let source = files.weights_path();
        Self::from_store_with_host(
            &files.config,
            store,
            device,
            dtype,
            prompt_len,
            max_len,
            settings,
            host,
            &source,
        )
    }

    /// How many layers [`from_store_with_host`](Self::from_store_with_host) runs on the host
    /// for `host` on `device` under `settings`' budget: [`HostLayers::Auto`] takes
    /// [`candle_offload::host_layer_split`] over the layers' device bytes, with the output
    /// head, the final norm and the reservation on the GPU (the KV cache of its own layers and
    /// two layers' more for a host layer's cache passing through), and 0 when the whole model
    /// (embeddings included) fits. The split is planned for the decode step's reservation
    /// (a prompt streams through the room its activations take), so it does not depend on the
    /// prompt's length.
    pub fn host_layers_for(
        cfg: &Config,
        store: &Arc<candle_offload::HostStore>,
        device: &Device,
        dtype: DType,
        max_len: usize,
        settings: &OffloadSettings,
        host: HostLayers,
    ) -> std::result::Result<usize, ModelError> {
        Self::host_split(cfg, store, device, dtype, max_len, settings, host).map(|s| s.layers)
    }

    /// [`host_layers_for`](Self::host_layers_for), with whether the head goes to the host and
    /// the layer steps [`HostLayers::SpreadAuto`] timed to choose.
    #[allow(clippy::too_many_arguments)]
    fn host_split(
        cfg: &Config,
        store: &Arc<candle_offload::HostStore>,
        device: &Device,
        dtype: DType,
        max_len: usize,
        settings: &OffloadSettings,
        host: HostLayers,
    ) -> std::result::Result<HostSplit, ModelError> {
        let n = cfg.num_hidden_layers;
        let mut steps = None;
        let mut prices = Vec::new();
        let mut head_on_host = false;
        let invalid = |reason: String| -> ModelError {
            candle_offload::Error::InvalidConfig {
                field: "host_layers".into(),
                reason,
            }
            .into()
        };
        let count = match host {
            HostLayers::None => 0,
            HostLayers::Count(h) | HostLayers::Spread(h) | HostLayers::SpreadWithHead(h)
                if h > n =>
            {
                return Err(invalid(format!(
                    "{h} host layers, but the model has {n} layers"
                )))
            }
            HostLayers::SpreadWithHead(_) if cfg.layout().head.is_none() => {
                return Err(invalid(
                    "`+head`: this model's output head is its embedding matrix (tied), which \
                     the GPU keeps"
                        .into(),
                ))
            }
            HostLayers::SpreadWithHead(h) => {
                head_on_host = true;
                h
            }
            HostLayers::Count(h) | HostLayers::Spread(h) => h,
            HostLayers::Auto | HostLayers::SpreadAuto => {
                if device.is_cpu() {
                    return Ok(HostSplit::default());
                }
                let budget = device_budget(device, settings.gpu_memory_limit)?;
                // Own sizes: what units that stay take on the device (`runtime::staying`) and
                // what the host reads; GGML layers of mixed block types stream padded, larger
                // (the streaming slots below take the own sizes too, a little short then).
                let bytes = |name: &str| {
                    store
                        .unit_id(name)
                        .map_or(0, |id| store.unit(id).resident_bytes())
                };
                let layout = cfg.layout();
                let layers: Vec<u64> = (0..n).map(|l| bytes(&layout.layer(l))).collect();
                // Planned for the decode step (`DECODE_ROWS`): a prompt streams through the
                // room its activations take (planned at the prompt's reservation, a model that
                // holds every unit while decoding would stream layers every token;
                // docs/tuning.md, host steps and prompt passes).
                let rows = DECODE_ROWS;
                let (base, per_layer) = Self::host_stage_reserve(
                    cfg,
                    store,
                    device,
                    rows,
                    max_len,
                    dtype,
                    &settings.tuning,
                );
                let base = base.saturating_add(settings.reserve_bytes);
                let mut kept = bytes(&layout.norm);
                if let Some(h) = &layout.head {
                    kept += bytes(h);
                }
                if Self::fits_whole(cfg, store, device, dtype, rows, max_len, settings)? {
                    return Ok(HostSplit::default());
                }
                // Nor where every unit but the embedding table fits: with no host layer the
                // table stays on the host (`embed_on_host`) and the GPU holds the rest, as
                // `from_store_with_host` builds it (the split below holds back two layers' KV
                // cache for host layers, and would take host layers such a model does not
                // need).
                if Self::embed_on_host(cfg, store, device, dtype, rows, max_len, settings)? {
                    let (need, budget) = Self::whole_bytes(
                        cfg, store, device, dtype, rows, max_len, settings, false,
                    )?;
                    if need <= budget {
                        return Ok(HostSplit::default());
                    }
                }
                // Tied embeddings: the GPU keeps the head, which is the embedding matrix.
                if layout.head.is_none() {
                    kept += bytes(&layout.embed);
                }
                // Each GPU layer adds its KV cache; two more layers' pass through
                // (host_stage_reserve).
                let fixed = base + 2 * per_layer + kept;
                let split = if host == HostLayers::SpreadAuto {
                    // The streamed layers' copies overlap the host's layers: balance the two
                    // rates, measured here (a layer's step on this CPU; the link's copies).
                    // At half the context: a generation that fills it averages that.
                    let context = max_len / 2;
                    let host_s =
                        Self::host_layer_seconds(cfg, store, dtype, context, &settings.tuning)?;
                    let host_rate = layers.first().copied().unwrap_or(0) as f64 / host_s;
                    let device_s = Self::layer_step_seconds(
                        cfg,
                        store,
                        dtype,
                        device,
                        context,
                        &settings.tuning,
                    )?;
                    let link_rate =
                        candle_offload::diag::measure_h2d_gbps(device, 64 << 20, true, 3)? * 1e9;
                    let slots = settings.prefetch_depth + 1;
                    // A head of its own may go to the host too (a tied one is the embedding
                    // table, which the GPU keeps).
                    let head = layout.head.as_deref().map_or(0, bytes);
                    // A split that streams nothing replays its decode step from a graph
                    // (`graph`), a faster step than the eager one timed here.
                    let resident_s = if settings.tuning.graphs {
                        device_s * GRAPH_REPLAY_FRACTION
                    } else {
                        device_s
                    };
                    let rates = candle_offload::SplitRates {
                        host_bytes_per_s: host_rate,
                        link_bytes_per_s: link_rate,
                        device_layer_s: device_s,
                        resident_device_layer_s: resident_s,
                    };
                    prices = candle_offload::spread_host_prices(
                        &layers, fixed, head, per_layer, budget, slots, &rates,
                    );
                    let split = candle_offload::spread_host_choice(&prices);
                    steps = Some(LayerSteps { host_s, device_s });
                    tracing::info!(
                        host_gbps = host_rate / 1e9,
                        link_gbps = link_rate / 1e9,
                        device_layer_ms = device_s * 1e3,
                        ?split,
                        "spread host layers"
                    );
                    head_on_host = split.is_some_and(|(_, on_host)| on_host);
                    split.map(|(h, _)| h)
                } else {
                    candle_offload::host_layer_split(&layers, fixed, per_layer, budget)
                };
                split.ok_or_else(|| {
                    invalid(format!(
                        "the output head, final norm and reservation take {} MiB, more than \
                         the GPU budget ({} MiB)",
                        fixed >> 20,
                        budget >> 20
                    ))
                })?
            }
        };
        Ok(HostSplit {
            layers: count,
            head_on_host,
            steps,
            prices,
        })
    }

    /// Whether every unit of the model fits `device`'s budget at its own size beside a
    /// resident stage's reservation ([`resident_saving`](Self::resident_saving)): nothing would
    /// stream and nothing needs the host.
    #[allow(clippy::too_many_arguments)]
    fn fits_whole(
        cfg: &Config,
        store: &candle_offload::HostStore,
        device: &Device,
        dtype: DType,
        prompt_len: usize,
        max_len: usize,
        settings: &OffloadSettings,
    ) -> std::result::Result<bool, ModelError> {
        let (need, budget) = Self::whole_bytes(
            cfg, store, device, dtype, prompt_len, max_len, settings, true,
        )?;
        Ok(need <= budget)
    }

    /// The device bytes every unit of the model takes at its own size (the embedding table only
    /// with `embed`) beside a resident stage's reservation: [`reserve_bytes`](Self::reserve_bytes)
    /// with the KV cache of every layer, less [`resident_saving`](Self::resident_saving), plus
    /// the caller's extra room; and `device`'s budget.
    #[allow(clippy::too_many_arguments)]
    fn whole_bytes(
        cfg: &Config,
        store: &candle_offload::HostStore,
        device: &Device,
        dtype: DType,
        prompt_len: usize,
        max_len: usize,
        settings: &OffloadSettings,
        embed: bool,
    ) -> std::result::Result<(u64, u64), ModelError> {
        let budget = device_budget(device, settings.gpu_memory_limit)?;
        let n = cfg.num_hidden_layers;
        let layout = cfg.layout();
        let reserve = Self::reserve_bytes(
            cfg,
            store,
            device,
            prompt_len,
            max_len,
            dtype,
            &settings.tuning.kernels,
        ) - Self::resident_saving(store, device, settings);
        let own = |name: &str| {
            store
                .unit_id(name)
                .map_or(0, |id| store.unit(id).resident_bytes())
        };
        let need = reserve.saturating_add(settings.reserve_bytes)
            + if embed { own(&layout.embed) } else { 0 }
            + own(&layout.norm)
            + layout.head.as_deref().map_or(0, own)
            + (0..n).map(|l| own(&layout.layer(l))).sum::<u64>();
        Ok((need, budget))
    }

    /// The part of the workspace allowance in [`Config::reserve_bytes`] that a GPU stage of GGML
    /// blocks needs only while it streams, for the pool's fragmentation by buffers fetched and
    /// evicted: one unit's size, at most 96 of the allowance's 256 MiB (docs/tuning.md). A
    /// stage that holds every unit it runs reserves that much less. Dense weights (cuBLAS's
    /// workspaces) keep the whole allowance, and so do the strategies that stream what would
    /// fit (`balanced`, `aggressive`).
    fn resident_saving(
        store: &candle_offload::HostStore,
        device: &Device,
        settings: &OffloadSettings,
    ) -> u64 {
        let minimal = settings.strategy == candle_offload::OffloadStrategy::Minimal;
        if minimal && device.is_cuda() && store.ggml_tensor_count() > 0 {
            let unit = store.units().iter().map(|u| u.bytes()).max().unwrap_or(0);
            unit.min(96 << 20)
        } else {
            0
        }
    }

    /// Whether a model with no host layers still looks its embeddings up on the host, as
    /// llama.cpp always does: on a GPU, with an output head of its own (tied embeddings are the
    /// head, which the GPU keeps), when the model does not fit the budget whole
    /// ([`fits_whole`](Self::fits_whole)). The table then takes no device memory (70 MiB of a
    /// 7B Q4_K_M, 250 MiB in F16) and a decode step copies one row of the hidden state up.
    #[allow(clippy::too_many_arguments)]
    fn embed_on_host(
        cfg: &Config,
        store: &candle_offload::HostStore,
        device: &Device,
        dtype: DType,
        prompt_len: usize,
        max_len: usize,
        settings: &OffloadSettings,
    ) -> std::result::Result<bool, ModelError> {
        let layout = cfg.layout();
        Ok(device.is_cuda()
            && layout.head.is_some()
            && store.unit_id(&layout.embed).is_some()
            && !Self::fits_whole(cfg, store, device, dtype, prompt_len, max_len, settings)?)
    }

    /// What [`HostLayers::SpreadAuto`] timed when this model was built, to choose its host
    /// layers (`None` for other choices, and where it timed nothing: on a CPU device, or a
    /// model that fits).
    pub fn spread_auto_layer_steps(&self) -> Option<LayerSteps> {
        self.layer_steps
    }

    /// Every split [`HostLayers::SpreadAuto`] weighed when this model was built, with the price
    /// it gave each ([`candle_offload::spread_host_prices`]; the chosen one is
    /// [`host_layer_count`](Self::host_layer_count) with [`head_on_host`](Self::head_on_host)),
    /// to set against measured steps; empty where it weighed none (the same cases as
    /// [`spread_auto_layer_steps`](Self::spread_auto_layer_steps)).
    pub fn spread_auto_prices(&self) -> &[candle_offload::SplitPrice] {
        &self.split_prices
    }

    /// Seconds one decode step of a decoder layer takes on the host CPU after `context` cached
    /// positions, from CPU copies of the first layers' units in `store`, in the dtype a host
    /// stage computes in (F32 for GGML blocks): the host's rate that
    /// [`HostLayers::SpreadAuto`] weighs against the link's.
    ///
    /// The steps go round as many layers as hold 1 GiB (`HOST_TIMING_BYTES`; all of a smaller
    /// model), so that each reads its weights from memory, as a host stage's sweep does, and
    /// not from the CPU's last-level cache (docs/tuning.md, timing a host layer). Host layers
    /// still run slower while decoding than timed here, beside copies
    /// ([`candle_offload::plan::SPREAD_OVERLAP_LOSS`]) and without
    /// ([`candle_offload::plan::RESIDENT_SPLIT_LOSS`]); the split's price charges both.
    pub fn host_layer_seconds(
        cfg: &Config,
        store: &Arc<candle_offload::HostStore>,
        dtype: DType,
        context: usize,
        tuning: &Tuning,
    ) -> std::result::Result<f64, ModelError> {
        let layout = cfg.layout();
        let mut bytes = 0u64;
        let mut count = 0;
        while count < cfg.num_hidden_layers && bytes < HOST_TIMING_BYTES {
            bytes += store
                .unit_id(&layout.layer(count))
                .map_or(0, |id| store.unit(id).host_bytes());
            count += 1;
        }
        Self::layers_step_seconds(cfg, store, dtype, &Device::Cpu, context, count, tuning)
    }

    /// Seconds one decode step of the first decoder layer takes on `device` with its weights
    /// there (a copy of its unit in `store`) after `context` cached positions (zeros),
    /// computing as a stage there does: F32 for GGML blocks on the CPU and on the thread pool a
    /// decode step runs on ([`candle_offload::kernels::pool::on_cpu_step_pool`]), `dtype` and the
    /// fused kernels on a GPU. The fastest of seven after a warm-up, the device synchronized
    /// around each. [`HostLayers::SpreadAuto`] weighs the GPU's against the host's
    /// ([`host_layer_seconds`](Self::host_layer_seconds), which goes round several layers).
    pub fn layer_step_seconds(
        cfg: &Config,
        store: &Arc<candle_offload::HostStore>,
        dtype: DType,
        device: &Device,
        context: usize,
        tuning: &Tuning,
    ) -> std::result::Result<f64, ModelError> {
        Self::layers_step_seconds(cfg, store, dtype, device, context, 1, tuning)
    }

    /// [`layer_step_seconds`](Self::layer_step_seconds) over the first `count` layers in turn:
    /// the mean of a round's steps, the fastest of seven rounds after a warm-up round.
    fn layers_step_seconds(
        cfg: &Config,
        store: &Arc<candle_offload::HostStore>,
        dtype: DType,
        device: &Device,
        context: usize,
        count: usize,
        tuning: &Tuning,
    ) -> std::result::Result<f64, ModelError> {
        let layout = cfg.layout();
        let names: Vec<String> = (0..count.max(1)).map(|l| layout.layer(l)).collect();
        let mut ids = Vec::with_capacity(names.len());
        for name in &names {
            let Some(id) = store.unit_id(name) else {
                return Err(ModelError::Tensor {
                    path: name.clone().into(),
                    tensor: name.clone(),
                    reason: "no unit holds it".into(),
                });
            };
            ids.push(id);
        }
        let dtype = if device.is_cpu() && ids.iter().any(|&id| store.unit(id).has_quantized()) {
            DType::F32
        } else {
            dtype
        };
        let rt = OffloadRuntime::new(
            store.clone(),
            device,
            &OffloadConfig {
                keep: names.clone(),
                units: Some(names.clone()),
                tuning: *tuning,
                ..Default::default()
            },
        )?;
        let mut units = Vec::with_capacity(ids.len());
        let mut blocks = Vec::with_capacity(ids.len());
        for (l, (&id, name)) in ids.iter().zip(&names).enumerate() {
            let unit = rt.acquire(id)?;
            blocks.push(cfg.family.block(
                cfg,
                UnitWeights::new(unit.var_builder(dtype), Some(&unit)).pp(name),
                l,
                dtype,
            )?);
            units.push(unit);
        }
        let rope = cfg.family.rope(cfg, context + 2, dtype, device)?;
        let masks = Masks::padded(1, context, &[], device);
        let ctx = StepCtx {
            index_pos: context,
            rope: &rope,
            masks: &masks,
            fused: device.is_cuda(),
            pos_dev: None,
        };
        let xs = Tensor::zeros((1, 1, cfg.hidden_size), dtype, device)?;
        // The cached positions each step attends over (a decode step after a prompt of
        // `context` tokens reads them all).
        let mut cache = Cache::new(blocks.len(), context + 1);
        if context > 0 {
            let kv = Tensor::zeros(
                (1, cfg.num_key_value_heads, context, cfg.head_dim),
                dtype,
                device,
            )?;
            for kvs in &mut cache.kvs {
                kvs.append(&kv, &kv)?;
            }
        }
        // The fastest of seven rounds (after one to warm up): a step timed while the host's
        // memory is busy elsewhere can take twice as long.
        let mut best = f64::INFINITY;
        for round in 0..8 {
            let mut total = 0.0;
            for (block, kvs) in blocks.iter().zip(cache.kvs.iter_mut()) {
                kvs.rewind(context);
                device.synchronize()?;
                let t0 = std::time::Instant::now();
                candle_offload::kernels::pool::on_cpu_step_pool(device, 1, || {
                    block.forward(&xs, &ctx, kvs)
                })?;
                device.synchronize()?;
                total += t0.elapsed().as_secs_f64();
            }
            if round > 0 {
                best = best.min(total / blocks.len() as f64);
            }
        }
        Ok(best.max(1e-9))
    }

    /// The parts of a GPU stage's reservation behind host layers:
    /// [`reserve_bytes`](Self::reserve_bytes) without its KV cache (for a decode step of GGML
    /// blocks, less up to [`QUANTIZED_DECODE_WORKSPACE_SAVING`] where the GPU keeps long-lived
    /// buffers apart), and one layer's KV cache. The stage reserves the caches of its own
    /// layers and of two more (a host layer's cache passing through while a prompt runs: its
    /// copy and the new buffer), at most the whole model's; the split plans with the same parts.
    fn host_stage_reserve(
        cfg: &Config,
        store: &candle_offload::HostStore,
        device: &Device,
        prompt_len: usize,
        max_len: usize,
        dtype: DType,
        tuning: &candle_offload::Tuning,
    ) -> (u64, u64) {
        let k = &tuning.kernels;
        let mut reserve = Self::reserve_bytes(cfg, store, device, prompt_len, max_len, dtype, k);
        if prompt_len <= DECODE_ROWS
            && device.is_cuda()
            && store.ggml_tensor_count() > 0
            && tuning.weight_pool
            && candle_offload::diag::has_long_lived_pool(device).unwrap_or(false)
        {
            // What the separate pool saves grows with the prompt's activations that no longer
            // fragment it (see the constant): a quarter of the longest prompt's share.
            let prompt = Self::reserve_bytes(cfg, store, device, max_len, max_len, dtype, k);
            let saving =
                (prompt.saturating_sub(reserve) / 4).min(QUANTIZED_DECODE_WORKSPACE_SAVING);
            reserve = reserve.saturating_sub(saving);
        }
        let kv_all = cfg.kv_cache_bytes(max_len, dtype).min(reserve);
        (
            reserve - kv_all,
            kv_all / cfg.num_hidden_layers.max(1) as u64,
        )
    }

    /// [`from_store`](Self::from_store) with the first layers (and the embeddings) on the host
    /// CPU, as [`host_layers_for`](Self::host_layers_for) decides: a pipeline of a CPU stage,
    /// which keeps its units in host memory as CPU tensors (copied once, on first use, then
    /// resident), and a GPU stage under `settings`' budget that reserves the KV cache of its
    /// own layers and two layers' more (a host layer's cache passing through while a prompt
    /// runs on the GPU). The hidden state crosses to the GPU once per decode step; with no
    /// host layer this is [`from_store`](Self::from_store), except that a model which does not
    /// fit the budget whole beside its whole prompt keeps an embedding table of its own on the
    /// host (a CPU stage of no layers), as llama.cpp does, so that the GPU's room goes to
    /// layers and to the prompt's passes.
    #[allow(clippy::too_many_arguments)]
    pub fn from_store_with_host(
        cfg: &Config,
        store: Arc<candle_offload::HostStore>,
        device: &Device,
        dtype: DType,
        prompt_len: usize,
        max_len: usize,
        settings: &OffloadSettings,
        host: HostLayers,
        source: &std::path::Path,
    ) -> std::result::Result<Self, ModelError> {
        let split = Self::host_split(cfg, &store, device, dtype, max_len, settings, host)?;
        let (h, steps, head_on_host) = (split.layers, split.steps, split.head_on_host);
        let prices = split.prices;
        // The table's place is decided beside the whole prompt's reservation: a model that fits
        // only beside a decode step's would otherwise keep the table on the GPU and run its
        // prompt in passes or streaming (no room for passes beside the table, so layers
        // stream every token; docs/tuning.md, host steps and prompt passes).
        let rows = prompt_len.max(DECODE_ROWS);
        if h == 0
            && !head_on_host
            && !Self::embed_on_host(cfg, &store, device, dtype, rows, max_len, settings)?
        {
            let mut model = Self::from_store(
                cfg, store, device, dtype, prompt_len, max_len, settings, source,
            )?;
            model.layer_steps = steps;
            model.split_prices = prices;
            return Ok(model);
        }
        let n = cfg.num_hidden_layers;
        let on_host = host.host_set(h, n);
        let gpu_layers = || (0..n).filter(|&l| !on_host[l]);
        let layout = cfg.layout();
        let mut host_units = vec![layout.embed.clone()];
        host_units.extend((0..n).filter(|&l| on_host[l]).map(|l| layout.layer(l)));
        if head_on_host {
            host_units.push(layout.norm.clone());
            host_units.push(layout.head_unit().to_string());
        }
        host_units.retain(|u| store.unit_id(u).is_some());
        let cpu = OffloadRuntime::new(
            store.clone(),
            &Device::Cpu,
            &OffloadConfig {
                keep: host_units.clone(),
                units: Some(host_units),
                tuning: settings.tuning,
                ..Default::default()
            },
        )?;
        // The final norm and the head, unless the host runs them.
        let mut keep = Vec::new();
        if !head_on_host {
            keep.push(layout.norm.clone());
            keep.push(layout.head_unit().to_string());
        }
        keep.retain(|u| store.unit_id(u).is_some());
        // The GPU also serves the host layers, for prompts (streamed through its free room,
        // evicted first: they are not in its schedule), whose KV cache it holds one layer at a
        // time before handing it to the host.
        let mut served = keep.clone();
        served.extend((0..n).map(|l| layout.layer(l)));
        // Its own layers' KV cache and two layers' more (a host layer's, for prompts).
        let kv_layers = (n - h + 2).min(n) as u64;
        let at = |rows| {
            let (base, per_layer) = Self::host_stage_reserve(
                cfg,
                &store,
                device,
                rows,
                max_len,
                dtype,
                &settings.tuning,
            );
            (base + per_layer * kv_layers, per_layer * kv_layers)
        };
        let kv = at(prompt_len).1;
        // Only the embeddings on the host: a GPU stage that holds every other unit reserves as
        // a resident one does; with host layers, prompts stream those layers through it.
        let (reserve, share, chunk) = Self::phase_reserves(
            |rows| at(rows).0,
            Self::resident_saving(&store, device, settings),
            prompt_len,
            |rows| Self::pass_slack(cfg, device, rows, max_len, dtype, &settings.tuning.kernels),
            |rows, slack| {
                if h > 0 {
                    return Ok(false);
                }
                let (need, budget) =
                    Self::whole_bytes(cfg, &store, device, dtype, rows, max_len, settings, false)?;
                Ok(need.saturating_sub(slack) <= budget)
            },
        )?;
        let order = || {
            let mut order: Vec<UnitId> = gpu_layers()
                .filter_map(|l| store.unit_id(&layout.layer(l)))
                .collect();
            for k in &keep {
                if let Some(u) = store.unit_id(k) {
                    if !order.contains(&u) {
                        order.push(u);
                    }
                }
            }
            order
        };
        let mut stage = stage_config(settings, reserve, keep.clone(), order, Some(served))?;
        stage.steady_reserve_bytes = Some(stage.reserve_bytes.saturating_sub(share));
        if host == HostLayers::Auto {
            // The split assumed the GPU keeps every layer it runs: a strategy that holds back
            // room for streaming would stream some of them again.
            stage.strategy = candle_offload::OffloadStrategy::Minimal;
        }
        // The hidden state reaches the GPU through a host-to-device copy on the compute
        // stream, which needs no event of cudarc's (ARCHITECTURE.md, hazard H7).
        stage.event_tracking = settings.event_tracking;
        let gpu = OffloadRuntime::new(store.clone(), device, &stage)?;
        declare_reservation(&gpu, kv, reserve, settings.reserve_bytes)?;
        let mut model = Self::sharded(
            cfg.clone(),
            vec![(cpu, 0..h), (gpu, h..n)],
            dtype,
            max_len,
            source,
        )?;
        // The runs of host layers (stage 0) and GPU layers (stage 1) in layer order: the two
        // ranges `sharded` set when the host layers come first, alternating runs when spread.
        let mut segments: Vec<(usize, Range<usize>)> = Vec::new();
        for (l, &host) in on_host.iter().enumerate() {
            let stage = usize::from(!host);
            match segments.last_mut() {
                Some((s, r)) if *s == stage => r.end = l + 1,
                _ => segments.push((stage, l..l + 1)),
            }
        }
        for (i, stage) in model.stages.iter_mut().enumerate() {
            let mine = segments.iter().filter(|(s, _)| *s == i).map(|(_, r)| r);
            let start = mine.clone().map(|r| r.start).min().unwrap_or(n);
            stage.layers = start..mine.map(|r| r.end).max().unwrap_or(n);
        }
        model.segments = segments;
        model.on_host = on_host.clone();
        model.layer_steps = steps;
        model.split_prices = prices;
        model.head_on_host = head_on_host;
        model.reserve_by_phase(share);
        model.prompt_chunk = chunk;
        // GGML blocks on the host multiply F32 activations (`cpu_quant`, and Candle's CPU
        // quantized matmul takes nothing else); dense host layers keep the model's dtype.
        let mut on_cpu: Vec<String> = (0..n)
            .filter(|&l| on_host[l])
            .map(|l| layout.layer(l))
            .collect();
        if head_on_host {
            on_cpu.push(layout.head_unit().to_string());
        }
        let blocks = on_cpu.iter().any(|u| {
            store
                .unit_id(u)
                .is_some_and(|id| store.unit(id).has_quantized())
        });
        if blocks && dtype != DType::F32 {
            // The positions `sharded` set up (clamped to the model's), as the GPU stage has.
            let max_len = model.stages[1].rope.max_len();
            let rope = model
                .family
                .rope(&model.cfg, max_len, DType::F32, &Device::Cpu)?;
            let first = &mut model.stages[0];
            first.dtype = DType::F32;
            first.rope = rope;
        }
        Ok(model)
    }

    /// The units of a model of `cfg` with weights in `dtype`, for placement: `(pre, layers,
    /// post)` with their bytes, computed from the configuration alone (nothing is loaded).
    /// With tied embeddings the output head is the embedding matrix again, listed in `post`
    /// under [`Layout::tied_head_name`] (the last stage keeps its own copy).
    pub fn placement_units(cfg: &Config, dtype: DType) -> PlacementUnits {
        let layout = cfg.layout();
        let mut sizes: std::collections::HashMap<String, u64> = Default::default();
        for (name, shape) in cfg.expected_tensors() {
            let unit = layout.unit_of(&name);
            let bytes = shape.iter().product::<usize>() * dtype.size_in_bytes();
            *sizes.entry(unit).or_default() += bytes as u64;
        }
        let size = |n: &str| sizes.get(n).copied().unwrap_or(0);
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| {
                let n = layout.layer(l);
                let b = size(&n);
                (n, b)
            })
            .collect();
        let head = match &layout.head {
            None => (layout.tied_head_name(), size(&layout.embed)),
            Some(h) => (h.clone(), size(h)),
        };
        PlacementUnits {
            pre: vec![(layout.embed.clone(), size(&layout.embed))],
            layers,
            post: vec![(layout.norm.clone(), size(&layout.norm)), head],
        }
    }

    /// Plans which of `devices` runs which layers, before any weight is loaded: `limits` are
    /// the per-device budgets (`None`: the memory free on a GPU, no limit on a CPU; a single
    /// entry applies to every device), each device reserves the activations for prompts of
    /// `prompt_len` tokens and the KV cache of its own layers for `max_len` positions.
    /// `choice` is a mode or a map written by hand (checked against the model and budgets).
    #[allow(clippy::too_many_arguments)]
    pub fn plan_devices(
        cfg: &Config,
        dtype: DType,
        devices: &[Device],
        limits: &[Option<MemoryLimit>],
        prompt_len: usize,
        max_len: usize,
        choice: &DeviceMapChoice,
        prefetch_depth: usize,
    ) -> std::result::Result<DeviceMap, ModelError> {
        if devices.is_empty() {
            return Err(candle_offload::Error::InvalidConfig {
                field: "devices".into(),
                reason: "no device given".into(),
            }
            .into());
        }
        if limits.len() > 1 && limits.len() != devices.len() {
            return Err(candle_offload::Error::InvalidConfig {
                field: "gpu_memory_limit".into(),
                reason: format!(
                    "{} limits for {} devices: give one limit, or one per device",
                    limits.len(),
                    devices.len()
                ),
            }
            .into());
        }
        let units = Self::placement_units(cfg, dtype);
        let reserve = cfg.reserve_bytes(prompt_len, max_len, dtype);
        let kv_all = cfg.kv_cache_bytes(max_len, dtype).min(reserve);
        let kv_per_layer = kv_all / cfg.num_hidden_layers.max(1) as u64;
        let mut budgets = Vec::with_capacity(devices.len());
        for (i, dev) in devices.iter().enumerate() {
            let limit = limits.get(i).or(limits.first()).copied().flatten();
            budgets.push((device_ordinal(dev, i), device_budget(dev, limit)?));
        }
        let request = |reserves: &[u64]| {
            budgets
                .iter()
                .zip(reserves)
                .map(|(&(ordinal, budget), &r)| DeviceBudget::new(ordinal, budget, r))
                .collect::<Vec<_>>()
        };
        let plan = |devs: &[DeviceBudget]| {
            let req = PlacementRequest {
                pre: &units.pre,
                layers: &units.layers,
                post: &units.post,
                devices: devs,
                mode: match choice {
                    DeviceMapChoice::Mode(m) => *m,
                    DeviceMapChoice::Map(_) => PlacementMode::Sequential,
                },
                prefetch_depth,
            };
            match choice {
                DeviceMapChoice::Mode(_) => plan_placement(&req),
                DeviceMapChoice::Map(map) => map.validate(&req),
            }
        };
        // First with every device reserving the whole KV cache (always enough), then with each
        // reserving only its own layers' share, kept if every device still has what it needs.
        let full = plan(&request(&vec![reserve; devices.len()]))?;
        let shares: Vec<u64> = full
            .devices
            .iter()
            .map(|d| reserve - kv_all + kv_per_layer * d.layer_count as u64)
            .collect();
        // What each device's runtime gives to weights while decoding (see `PhaseReserve`).
        let decode_share = reserve.saturating_sub(cfg.reserve_bytes(1, max_len, dtype));
        if let Ok(mut tight) = plan(&request(&shares)) {
            let enough = tight
                .devices
                .iter()
                .zip(&shares)
                .all(|(d, &r)| reserve - kv_all + kv_per_layer * d.layer_count as u64 <= r);
            if enough {
                tight.decode_share_bytes = decode_share;
                return Ok(tight);
            }
        }
        let mut full = full;
        full.decode_share_bytes = decode_share;
        Ok(full)
    }

    /// The model over its weights in `store`, run as a pipeline over `devices` as `map` says
    /// (from [`plan_devices`](Self::plan_devices)): one offload runtime per device with a
    /// layer, each with its own budget, reservation, copy stream and schedule. `settings`
    /// gives the strategy, depth and policy (its memory limit is the map's business).
    pub fn offloaded_sharded(
        files: &crate::loader::ModelFiles,
        store: std::sync::Arc<candle_offload::HostStore>,
        devices: &[Device],
        map: &DeviceMap,
        dtype: DType,
        max_len: usize,
        settings: &OffloadSettings,
    ) -> std::result::Result<Self, ModelError> {
        let source = files.weights_path();
        let cfg = &files.config;
        Self::sharded_from_store(cfg, store, devices, map, dtype, max_len, settings, &source)
    }

    /// [`offloaded_sharded`](Self::offloaded_sharded) for any configuration and store (an
    /// application's own model and weights); `source` names the weights in errors.
    #[allow(clippy::too_many_arguments)]
    pub fn sharded_from_store(
        cfg: &Config,
        store: Arc<candle_offload::HostStore>,
        devices: &[Device],
        map: &DeviceMap,
        dtype: DType,
        max_len: usize,
        settings: &OffloadSettings,
        source: &std::path::Path,
    ) -> std::result::Result<Self, ModelError> {
        let cfg = cfg.clone();
        let layout = cfg.layout();
        let tied = layout.tied_head_name();
        let real = |n: &str| {
            if n == tied {
                layout.embed.clone()
            } else {
                n.to_string()
            }
        };
        let mut stages = Vec::new();
        for (i, dp) in map.devices.iter().enumerate() {
            if dp.layer_count == 0 {
                continue;
            }
            let device = devices
                .iter()
                .enumerate()
                .find(|(j, d)| device_ordinal(d, *j) == dp.ordinal)
                .map(|(_, d)| d.clone())
                .ok_or_else(|| candle_offload::Error::InvalidConfig {
                    field: format!("devices[{i}]"),
                    reason: format!(
                        "the device map names device {}, which was not given",
                        dp.ordinal
                    ),
                })?;
            let mut keep: Vec<String> = Vec::new();
            for k in dp.kept.iter().map(|k| real(k)) {
                if !keep.contains(&k) && store.unit_id(&k).is_some() {
                    keep.push(k);
                }
            }
            let layers = dp.layers();
            let mut served = keep.clone();
            served.extend(layers.clone().map(|l| layout.layer(l)));
            let order = || {
                let mut order: Vec<UnitId> = Vec::new();
                if keep.contains(&layout.embed) && layers.start == 0 {
                    order.extend(store.unit_id(&layout.embed));
                }
                for l in layers.clone() {
                    order.extend(store.unit_id(&layout.layer(l)));
                }
                for k in &keep {
                    if *k != layout.embed || layout.head.is_none() {
                        if let Some(u) = store.unit_id(k) {
                            if !order.contains(&u) {
                                order.push(u);
                            }
                        }
                    }
                }
                order
            };
            let mut stage = stage_config(
                settings,
                dp.reserve_bytes,
                keep.clone(),
                order,
                Some(served),
            )?;
            stage.gpu_memory_limit = Some(MemoryLimit::Bytes(dp.budget_bytes));
            stage.prefetch_depth = dp.prefetch_depth;
            let rt = OffloadRuntime::new(store.clone(), &device, &stage)?;
            let kv = cfg.kv_cache_bytes(max_len, dtype) / cfg.num_hidden_layers.max(1) as u64
                * dp.layer_count as u64;
            declare_reservation(&rt, kv, dp.reserve_bytes, settings.reserve_bytes)?;
            stages.push((rt, layers));
        }
        let mut model = Self::sharded(cfg, stages, dtype, max_len, source)?;
        model.reserve_by_phase(map.decode_share_bytes);
        Ok(model)
    }

    /// The order in which a forward pass acquires units (for a given schedule policy).
    pub fn schedule(store: &candle_offload::HostStore, cfg: &Config) -> Vec<UnitId> {
        let layout = cfg.layout();
        let mut out = Vec::new();
        out.extend(store.unit_id(&layout.embed));
        for l in 0..cfg.num_hidden_layers {
            out.extend(store.unit_id(&layout.layer(l)));
        }
        out.extend(store.unit_id(&layout.norm));
        out.extend(store.unit_id(layout.head_unit()));
        out
    }

    /// The units outside the decoder layers (embeddings, final norm, output head), which every
    /// forward pass uses. Keeping them resident leaves only equal-sized layers to stream, so
    /// the device allocator reuses every freed layer exactly and never fragments.
    pub fn kept_units(store: &candle_offload::HostStore, cfg: &Config) -> Vec<String> {
        let layout = cfg.layout();
        let mut out = vec![layout.embed.clone(), layout.norm.clone()];
        out.extend(layout.head.clone());
        out.retain(|u| store.unit_id(u).is_some());
        out
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The runtime of the first stage that runs layers (the only one on a single device; the
    /// device's where only the embeddings stay on the host).
    pub fn runtime(&self) -> &OffloadRuntime {
        let stage = self.stages.iter().find(|s| !s.layers.is_empty());
        &stage.unwrap_or(&self.stages[0]).rt
    }

    /// Every stage's runtime with the layers it runs, in pipeline order (with spread host
    /// layers, [`HostLayers::Spread`], the span from its first layer to its last).
    pub fn stages(&self) -> Vec<(&OffloadRuntime, Range<usize>)> {
        self.stages
            .iter()
            .map(|s| (&s.rt, s.layers.clone()))
            .collect()
    }

    /// Starts a step on every stage's runtime (see [`OffloadRuntime::begin_step`]).
    pub fn begin_step(&self) -> Result<()> {
        self.stages.iter().try_for_each(|s| s.rt.begin_step())
    }

    /// Ends a step on every stage's runtime.
    pub fn end_step(&self) -> Result<()> {
        self.stages.iter().try_for_each(|s| s.rt.end_step())
    }

    /// How hidden states move between stages (default: device to device).
    pub fn set_hidden_transfer(&mut self, how: HiddenTransfer) {
        self.transfer = how;
    }

    /// Whether inference uses the fused ops of `candle_offload::kernels` where a block can: RMSNorm
    /// with the residual add, SiLU · mul, RoPE of q and k, attention over the KV cache for steps
    /// of at most [`DECODE_ATTENTION_MAX_NEW`](crate::layers::DECODE_ATTENTION_MAX_NEW) new
    /// positions, and dense projections of at most 8 rows as one weight pass. Default: on for
    /// each stage on a GPU (each is one kernel of ours there, and faster), off for a stage on
    /// the CPU, where Candle's multi-threaded ops beat the ops' loops. This sets every stage.
    pub fn set_fused(&mut self, on: bool) {
        self.fused = Some(on);
    }

    /// Whether every stage runs the fused ops (see [`set_fused`](Self::set_fused)).
    pub fn fused(&self) -> bool {
        self.stages.iter().all(|s| self.stage_fused(s))
    }

    /// Whether every stage on a GPU runs the fused ops (a host stage in front runs Candle's);
    /// `None` for a model with no stage on a GPU.
    pub fn fused_on_gpus(&self) -> Option<bool> {
        let mut gpu = self.stages.iter().filter(|s| !s.rt.device().is_cpu());
        let first = gpu.next()?;
        Some(self.stage_fused(first) && gpu.all(|s| self.stage_fused(s)))
    }

    fn stage_fused(&self, stage: &Stage) -> bool {
        // On a GPU the fused kernels are faster; on the CPU Candle's multi-threaded ops beat
        // their loops.
        self.fused.unwrap_or_else(|| stage.rt.device().is_cuda())
    }

    /// How many decoder layers run on the host CPU in front of the device (0 unless the
    /// model was built with [`offloaded_with_host`](Self::offloaded_with_host)).
    pub fn host_layer_count(&self) -> usize {
        self.on_host.iter().filter(|&&b| b).count()
    }

    /// Fetches, on every stage, the units that stay there for good
    /// ([`OffloadRuntime::warm_up`]), so that the first step (the prompt) computes instead of
    /// copying weights; returns the bytes fetched.
    pub fn warm_up(&self) -> Result<u64> {
        let mut bytes = 0;
        for stage in &self.stages {
            bytes += stage.rt.warm_up()?;
        }
        Ok(bytes)
    }

    /// Whether the final norm and the output head run on the host CPU
    /// ([`HostLayers::SpreadWithHead`], or [`HostLayers::SpreadAuto`]'s choice).
    pub fn head_on_host(&self) -> bool {
        self.head_on_host
    }

    /// The most rows a prompt's pass runs (`None`: the whole prompt in one pass): set where the
    /// model holds every unit beside the activations of this many rows but not beside a whole
    /// prompt's (a near fit), so that [`forward`](Self::forward) runs a longer prompt in passes
    /// of this many rows and nothing streams, rather than evicting weights for one pass's
    /// activations and fetching them again. Batches share the rows.
    pub fn prompt_chunk(&self) -> Option<usize> {
        self.prompt_chunk
    }

    /// Tells the model that its caller takes only the largest logit of each step (greedy
    /// decoding, as `generate --temperature 0`; off by default). A one-row step whose output
    /// head is Q8_0 blocks on the CPU then screens the head with 8-bit activations and
    /// recomputes only the rows that could be the largest
    /// ([`candle_offload::kernels::linear::cpu_quant::forward_greedy`]): the largest logit and its token are
    /// exactly those of the full product, the other logits lower than it but not exact. Off,
    /// every logit is exact (what sampling at a temperature needs).
    pub fn set_greedy_head(&self, on: bool) {
        self.greedy_head
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`set_greedy_head`](Self::set_greedy_head).
    pub fn greedy_head(&self) -> bool {
        self.greedy_head.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Measures each move of hidden states between stages, synchronizing both devices around
    /// it (a small cost per stage boundary; off by default).
    pub fn time_transfers(&self, on: bool) {
        self.timing.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Moves of hidden states between stages so far.
    pub fn transfer_totals(&self) -> TransferTotals {
        self.totals.lock().map(|t| *t).unwrap_or_default()
    }

    /// The host CPU's share of the steps so far, for a model with host layers or a host head
    /// in front of a GPU (zero otherwise): always measured (a clock read around each host run).
    pub fn host_totals(&self) -> HostTotals {
        self.host_totals.lock().map(|t| *t).unwrap_or_default()
    }

    /// Adds a host run of `layers` layers (0: the head) that took `seconds`.
    fn add_host_time(&self, layers: usize, seconds: f64) {
        if let Ok(mut t) = self.host_totals.lock() {
            if layers == 0 {
                t.head_steps += 1;
                t.head_seconds += seconds;
            } else {
                t.layer_steps += layers as u64;
                t.layer_seconds += seconds;
            }
        }
    }

    fn move_hidden(&self, xs: &Tensor, to: &Device) -> Result<Tensor> {
        let _span = tracing::debug_span!("llama.move_hidden").entered();
        let timing = self.timing.load(std::sync::atomic::Ordering::Relaxed);
        let bytes = (xs.elem_count() * xs.dtype().size_in_bytes()) as u64;
        let start = if timing {
            xs.device().synchronize()?;
            Some(std::time::Instant::now())
        } else {
            None
        };
        let out = match self.transfer {
            HiddenTransfer::Device => xs.contiguous()?.to_device(to)?,
            HiddenTransfer::Host => xs.to_device(&Device::Cpu)?.to_device(to)?,
        };
        let seconds = match start {
            Some(t0) => {
                to.synchronize()?;
                t0.elapsed().as_secs_f64()
            }
            None => 0.0,
        };
        if let Ok(mut t) = self.totals.lock() {
            t.copies += 1;
            t.bytes += bytes;
            t.seconds += seconds;
        }
        Ok(out)
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// A fresh KV cache for the positions this model was set up for.
    pub fn new_cache(&self) -> Cache {
        Cache::new(self.cfg.num_hidden_layers, self.stages[0].rope.max_len())
    }

    /// Logits (batch, vocab) in f32 for the last position of `input_ids` (batch, seq), whose
    /// first token sits at position `index_pos` (the number of tokens already in `cache`).
    pub fn forward(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        self.forward_batch(input_ids, index_pos, &[], cache)
    }

    /// [`forward`](Self::forward) for a batch of left-padded sequences: row r of `input_ids`
    /// (batch, seq) begins with `pads[r]` padding positions (any token id) that no position
    /// attends to; `pads` empty means no padding. Every row must hold at least one token by
    /// the end of this pass. Returns the logits of each row's last position, (batch, vocab).
    /// With padding, a prompt's attention runs as the masked composition; decode steps, whose
    /// new positions lie past every row's padding, take the decode attention kernel, which
    /// leaves each row's padding out (and replay from a CUDA graph like unpadded ones). The
    /// KV cache from [`new_cache`](Self::new_cache) takes any batch size. A model with a
    /// [`prompt_chunk`](Self::prompt_chunk) runs a longer pass as several, each of that many
    /// positions over the batch (the first, with padding, reaching every row's first token).
    pub fn forward_batch(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        pads: &[usize],
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let (batch, seq_len) = input_ids.dims2()?;
        let rows = self.prompt_chunk.map_or(seq_len, |c| (c / batch).max(1));
        if seq_len <= rows || (!pads.is_empty() && pads.len() != batch) {
            return self.forward_pass(input_ids, index_pos, pads, cache);
        }
        // A near fit: passes of at most `rows` positions, each within the reservation.
        let rows = even_pass_rows(seq_len, rows);
        let first = pads
            .iter()
            .map(|&p| (p + 1).saturating_sub(index_pos))
            .fold(rows, usize::max)
            .min(seq_len);
        let mut logits =
            self.forward_pass(&input_ids.narrow(1, 0, first)?, index_pos, pads, cache)?;
        for start in (first..seq_len).step_by(rows) {
            let n = rows.min(seq_len - start);
            let ids = input_ids.narrow(1, start, n)?;
            logits = self.forward_pass(&ids, index_pos + start, pads, cache)?;
        }
        Ok(logits)
    }

    /// [`forward_batch`](Self::forward_batch) as one pass.
    fn forward_pass(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        pads: &[usize],
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let _span = tracing::debug_span!("llama.forward", index_pos).entered();
        let (batch, seq_len) = input_ids.dims2()?;
        if !pads.is_empty() && pads.len() != batch {
            candle_core::bail!("{} padding counts for a batch of {batch}", pads.len());
        }
        if let Some(&p) = pads.iter().find(|&&p| p >= index_pos + seq_len) {
            candle_core::bail!(
                "a row of {} positions is all padding ({p})",
                index_pos + seq_len
            );
        }
        candle_offload::kernels::pool::on_cpu_step_pool(
            self.runtime().device(),
            batch * seq_len,
            || {
                if let Some(logits) = self.graph_step(input_ids, index_pos, pads, cache)? {
                    return Ok(logits);
                }
                let xs = self.decoder(input_ids, index_pos, pads, None, cache)?;
                self.head(&xs.narrow(1, seq_len - 1, 1)?)?.squeeze(1)
            },
        )
    }

    /// Logits (batch, seq, vocab) in f32 for every position of `input_ids`, from position 0
    /// with a fresh KV cache (for parity tests).
    pub fn forward_all(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        let xs = self.decoder(
            input_ids,
            0,
            &[],
            None,
            &mut Cache::new(self.cfg.num_hidden_layers, seq_len),
        )?;
        self.head(&xs)
    }

    /// Decoder layer `l` built from its acquired unit in `dtype`. Where the unit's dense
    /// tensors already have that dtype (the block then holds nothing but the unit's tensors),
    /// it is built once per residency and kept with the unit (`UnitGuard::derived`): a resident
    /// model's decode step builds no layer and looks up no tensor by name. Otherwise (tensors
    /// converted on use, whose copies should not outlive the step) it is built each time.
    fn layer_block(
        &self,
        unit: &candle_offload::UnitGuard,
        l: usize,
        dtype: DType,
    ) -> Result<Arc<BuiltBlock>> {
        let build = || -> Result<BuiltBlock> {
            let _span = tracing::trace_span!("llama.block", l).entered();
            let weights = UnitWeights::new(unit.var_builder(dtype), Some(unit));
            let block = self
                .family
                .block(&self.cfg, weights.pp(self.layout.layer(l)), l, dtype)?;
            Ok(BuiltBlock(block, l, dtype))
        };
        if !unit.tensors().values().all(|t| t.dtype() == dtype) {
            return Ok(Arc::new(build()?));
        }
        let kept = unit.derived(build)?;
        if (kept.1, kept.2) == (l, dtype) {
            return Ok(kept);
        }
        Ok(Arc::new(build()?))
    }

    /// Embeddings and every decoder layer, each acquired from its stage's runtime as it runs;
    /// the hidden state moves to the next stage's device at each stage boundary. `on_device`:
    /// `index_pos` and `pads` also held on the device, for a step being captured ([`graph`]).
    fn decoder(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        pads: &[usize],
        on_device: Option<&graph::DeviceInputs>,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        for stage in &self.stages {
            if let Some(p) = stage.phase {
                let reserve = if seq_len > 1 { p.prompt } else { p.decode };
                stage.rt.set_reserve_bytes(reserve)?;
            }
        }
        let first = &self.stages[0];
        if index_pos + seq_len > first.rope.max_len() {
            candle_core::bail!(
                "position {} is past the {} positions this model was set up for",
                index_pos + seq_len,
                first.rope.max_len()
            );
        }
        let last = &self.stages[self.stages.len() - 1];
        // A captured step of a model whose host stage only looks the embeddings up starts
        // from the looked-up rows, already on the GPU ([`graph`]).
        let (mut xs, mut at) = match on_device.and_then(|d| d.hidden.clone()) {
            Some(rows) => (rows, last),
            None => (self.embed_rows(input_ids)?, first),
        };
        // With host layers, a step of more rows than a decode step (a prompt) runs every layer
        // on the GPU, the host layers streamed through its runtime, as llama.cpp copies its
        // CPU layers to the GPU for large batches; each host layer's KV cache then moves to
        // the host right after the layer.
        let (batch, _) = input_ids.dims2()?;
        let prompt_on_gpu =
            !self.on_host.is_empty() && seq_len > 1 && batch * seq_len > HOST_STEP_ROWS;
        let plan: Vec<(&Stage, Range<usize>)> = if prompt_on_gpu {
            vec![(last, 0..self.cfg.num_hidden_layers)]
        } else {
            self.segments
                .iter()
                .map(|(s, r)| (&self.stages[*s], r.clone()))
                .collect()
        };
        let runs = plan.len();
        for (i, (stage, layers)) in plan.into_iter().enumerate() {
            if !std::ptr::eq(at, stage) {
                xs = self.move_hidden(&xs, stage.rt.device())?;
                at = stage;
            }
            xs = self.run_segment(
                stage,
                layers,
                &xs,
                (seq_len, index_pos, pads),
                on_device,
                cache,
                prompt_on_gpu,
            )?;
            if i + 1 < runs || !std::ptr::eq(stage, last) {
                // This stage idles while another computes (a later stage, or the host's next
                // run of spread layers): its copy stream fetches what it needs next, into its
                // free room (nothing on a host stage, which keeps its units).
                stage.rt.prefetch_ahead(usize::MAX)?;
            }
        }
        // Spread host layers can end on the host: the head runs on the last stage, unless it
        // runs on the host ([`head`](Self::head) moves the hidden state there).
        if !std::ptr::eq(at, last) && !self.head_on_host {
            xs = self
                .move_hidden(&xs, last.rt.device())?
                .to_dtype(last.dtype)?;
        }
        Ok(xs)
    }

    /// The decoder `layers` on `stage` over `xs` (already on its device): `(seq_len,
    /// index_pos, pads)` of the step, `on_device` for a step being captured ([`graph`]),
    /// `prompt_on_gpu` where a prompt runs host layers here (their KV cache then returns to
    /// the host after each). Returns the hidden state, whole, in the stage's dtype.
    #[allow(clippy::too_many_arguments)]
    fn run_segment(
        &self,
        stage: &Stage,
        layers: Range<usize>,
        xs: &Tensor,
        (seq_len, index_pos, pads): (usize, usize, &[usize]),
        on_device: Option<&graph::DeviceInputs>,
        cache: &mut Cache,
        prompt_on_gpu: bool,
    ) -> Result<Tensor> {
        let device = stage.rt.device();
        let first = &self.stages[0];
        // The host stage's runs (a model with host layers; on a CPU device the other stage
        // is on the CPU too, and not counted).
        let host_run = (std::ptr::eq(stage, first) && !self.on_host.is_empty())
            .then(|| (std::time::Instant::now(), layers.len()));
        // The layers pass the hidden state on split where they can (the residual add left
        // to the next layer's norm kernel); it is whole again between stages.
        let mut hidden = Hidden::Whole(xs.to_dtype(stage.dtype)?);
        let mut masks = Masks::padded(seq_len, index_pos, pads, device);
        if let Some(counts) = on_device.and_then(|d| d.pads.clone()) {
            masks = masks.with_pads_tensor(counts);
        }
        let ctx = StepCtx {
            index_pos,
            rope: &stage.rope,
            masks: &masks,
            fused: self.stage_fused(stage),
            pos_dev: on_device.map(|d| &d.pos),
        };
        for l in layers {
            if !self.on_host.is_empty() {
                cache.place(l, device, stage.dtype)?;
            }
            let unit = stage.rt.acquire(self.units.layers[l])?;
            let block = self.layer_block(&unit, l, stage.dtype)?;
            let _span = tracing::trace_span!("llama.layer", l).entered();
            hidden = block.0.forward_hidden(hidden, &ctx, &mut cache.kvs[l])?;
            if prompt_on_gpu && self.on_host[l] {
                cache.place(l, first.rt.device(), first.dtype)?;
            }
        }
        let out = hidden.into_tensor()?;
        if let Some((t0, n)) = host_run {
            self.add_host_time(n, t0.elapsed().as_secs_f64());
        }
        Ok(out)
    }

    /// The embedding rows of `input_ids`, looked up on the first stage, in the model's dtype
    /// (the looked-up rows, not the table, are converted).
    fn embed_rows(&self, input_ids: &Tensor) -> Result<Tensor> {
        let first = &self.stages[0];
        let unit = first.rt.acquire(self.units.embed)?;
        self.family.embed(
            &self.cfg,
            UnitWeights::new(unit.var_builder(self.dtype), Some(&unit)),
            &input_ids.to_device(first.rt.device())?,
        )
    }

    /// The final norm and the output head, logits in f32: on the last stage (`xs` in its
    /// dtype), or on the host stage with [`head_on_host`](Self::head_on_host) (`xs` on either
    /// stage, moved to the host here).
    fn head(&self, xs: &Tensor) -> Result<Tensor> {
        let (vocab, hidden) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let last = &self.stages[self.stages.len() - 1];
        // The stage that runs the head, and `xs` there in its dtype.
        let (stage, xs) = if self.head_on_host {
            // The GPU idles through the host's head: its copy stream starts the next step's
            // fetches now.
            last.rt.prefetch_ahead(usize::MAX)?;
            let host = &self.stages[0];
            // Already there when the step's last layer ran on the host.
            let xs = if xs.device().same_device(host.rt.device()) {
                xs.clone()
            } else {
                self.move_hidden(xs, host.rt.device())?
            };
            let xs = xs.to_dtype(host.dtype)?;
            (host, xs)
        } else {
            (last, xs.clone())
        };
        let xs = &xs;
        let rt = &stage.rt;
        // The host's share of the step, where it runs the head.
        let t0 = self.head_on_host.then(std::time::Instant::now);
        let xs = {
            let unit = rt.acquire(self.units.norm)?;
            self.family
                .final_norm(
                    &self.cfg,
                    unit.var_builder(stage.dtype).pp(&self.layout.norm),
                    stage.dtype,
                )?
                .forward(xs)?
        };
        // The head's weight (the embedding matrix when tied), multiplied as GGML blocks when
        // the unit holds it quantized.
        let logits = {
            let unit = rt.acquire(self.units.head)?;
            let w = UnitWeights::new(unit.var_builder(stage.dtype), Some(&unit))
                .pp(self.layout.head_unit());
            let tuning = unit.tuning().kernels;
            match w.quantized("weight", &[vocab, hidden])? {
                Some(q) => {
                    let screened = if self.greedy_head() {
                        candle_offload::kernels::linear::cpu_quant::forward_greedy(
                            &q, &xs, &tuning,
                        )?
                    } else {
                        None
                    };
                    match screened {
                        Some(logits) => logits,
                        None => crate::layers::Linear::Quantized {
                            weight: candle_core::quantized::QMatMul::from_arc(q)?,
                            bias: None,
                            tuning,
                        }
                        .forward_step(&xs, self.stage_fused(stage))?,
                    }
                }
                None => {
                    let m = w.vb().get((vocab, hidden), "weight")?;
                    crate::layers::Linear::Dense(candle_nn::Linear::new(m, None), tuning)
                        .forward_step(&xs, self.stage_fused(stage))?
                }
            }
        }
        .to_dtype(DType::F32)?;
        if let Some(t0) = t0 {
            self.add_host_time(0, t0.elapsed().as_secs_f64());
        }
        // The GPU idles until the next step reaches it (sampling, and the earlier stages
        // with host layers or a pipeline): its copy stream starts the next step's fetches now.
        if self.stages.len() > 1 && !self.head_on_host {
            rt.prefetch_ahead(usize::MAX)?;
        }
        self.family.finish_logits(&self.cfg, logits)
    }

    /// The family.
    pub fn family(&self) -> &Arc<dyn Family> {
        &self.family
    }

    /// The unit names.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
}

/// The most rows (batch × new positions) of a step that runs host layers on the host; larger
/// steps of more than one new position (prompts) run them on the GPU. Decode steps stay on
/// the host whatever the batch.
pub const HOST_STEP_ROWS: usize = 8;

/// The rows of a decode step (batch 1): where a model spends its passes, so what it places
/// (host layers, the embedding table, what stays resident) is planned at this reservation; a
/// prompt streams what its activations leave no room for.
const DECODE_ROWS: usize = 1;

/// A GPU layer's decode step replayed from a CUDA graph, over the same step run eagerly (what
/// [`CausalLm::layer_step_seconds`] times), for `spread:auto` to price splits that stream
/// nothing (measured: docs/tuning.md).
const GRAPH_REPLAY_FRACTION: f64 = 0.6;

/// The weight bytes [`CausalLm::host_layer_seconds`] goes round, so that its steps read their
/// weights from memory: more than three times a large last-level cache.
const HOST_TIMING_BYTES: u64 = 1 << 30;

/// Of [`Config::reserve_bytes`]'s 256 MiB allowance for workspaces and fragmentation, what a
/// decode step of GGML blocks on a GPU leaves unused where weights and KV caches live in a
/// pool apart from activations (`candle_offload::diag::long_lived`): the step runs the
/// library's own kernels (no GEMM workspace beyond what the prompt already made, which stays
/// counted), and a prompt's freed activations no longer leave chunks held around a cache
/// buffer. A prompt keeps the whole allowance: the share that goes to weights while decoding
/// ([`CausalLm::reserve_by_phase`]) takes this too.
///
/// Only a stage behind host layers plans with it (`host_stage_reserve`), and there at most a
/// quarter of what the longest prompt reserves beyond a decode step: the fragmentation the
/// separate pool avoids comes from the prompt's activations, so a short prompt saves little.
///
/// Whether a model fits whole, or keeps its embeddings on the host, is still decided with the
/// whole allowance: with the saving there, a resident model can take its embedding table onto
/// the GPU and pass its budget (measured: docs/tuning.md, workspace saved).
const QUANTIZED_DECODE_WORKSPACE_SAVING: u64 = 128 << 20;

/// The fewest rows a prompt's pass is cut to ([`CausalLm::prompt_chunk`]): below this a pass
/// runs the quantized matmuls' few-row kernels, which read the weights once per 8 rows.
pub const MIN_PROMPT_CHUNK: usize = 32;

/// The rows of each pass when `seq_len` positions run in passes of at most `max_rows`: the
/// fewest passes, of even length (512 under 170: four of 128, not three of 170 and one of 2),
/// so that each is as long as those passes allow (the prompt GEMM of
/// [`candle_offload::kernels::gemm::qlinear_prefill`] starts at a row count). Pure.
fn even_pass_rows(seq_len: usize, max_rows: usize) -> usize {
    let max_rows = max_rows.max(1);
    seq_len.div_ceil(seq_len.div_ceil(max_rows).max(1)).max(1)
}

/// The planner's name for the output head of an HF-layout model with tied embeddings (the
/// embedding matrix, kept a second time on the last stage); see [`Layout::tied_head_name`].
pub const TIED_HEAD: &str = "model.embed_tokens (tied output head)";

/// The runtime settings of one stage: the caller's `settings` with the model's reservation
/// added, its units kept, and (for [`PolicyChoice::Auto`]) Belady over `order`.
fn stage_config(
    settings: &OffloadSettings,
    reserve: u64,
    mut keep: Vec<String>,
    order: impl FnOnce() -> Vec<UnitId>,
    units: Option<Vec<String>>,
) -> std::result::Result<OffloadConfig, ModelError> {
    if settings.units.is_some() {
        return Err(candle_offload::Error::InvalidConfig {
            field: "units".into(),
            reason: "a model decides which units each stage serves; leave `units` unset".into(),
        }
        .into());
    }
    for k in &settings.keep {
        if !keep.contains(k) {
            keep.push(k.clone());
        }
    }
    let policy = match &settings.policy {
        PolicyChoice::Auto => PolicyChoice::Schedule(order()),
        other => other.clone(),
    };
    Ok(OffloadConfig {
        reserve_bytes: reserve + settings.reserve_bytes,
        policy,
        keep,
        // A pipeline stage's hidden states cross devices through Candle's device-to-device
        // copy, which is ordered only by cudarc's event tracking.
        event_tracking: settings.event_tracking || units.is_some(),
        units,
        ..settings.clone()
    })
}

/// Names the reservation's parts for the memory history: the KV cache, the activations and
/// workspace, and the caller's extra room.
fn declare_reservation(rt: &OffloadRuntime, kv: u64, reserve: u64, extra: u64) -> Result<()> {
    let kv = kv.min(reserve);
    let mut parts = vec![
        ("KV cache", kv),
        ("activations and workspace", reserve - kv),
    ];
    if extra > 0 {
        parts.push(("caller's reservation", extra));
    }
    rt.declare_reservation(&parts)
}

/// A model's units as the placement planner takes them.
#[derive(Debug, Clone)]
pub struct PlacementUnits {
    /// Before the layers: the embeddings.
    pub pre: Vec<(String, u64)>,
    /// The decoder layers, in order.
    pub layers: Vec<(String, u64)>,
    /// After the layers: the final norm and the output head.
    pub post: Vec<(String, u64)>,
}

/// How [`CausalLm::plan_devices`] decides the device map.
#[derive(Debug, Clone)]
pub enum DeviceMapChoice {
    /// Planned in this mode (`--device-map sequential|balanced`).
    Mode(PlacementMode),
    /// Given (`--device-map plan.json`), checked against the model and budgets.
    Map(DeviceMap),
}

/// The bytes `limit` gives `device` (resolved against a GPU's total memory); without a limit,
/// the memory free on a GPU, no limit of ours on a CPU.
fn device_budget(
    device: &Device,
    limit: Option<MemoryLimit>,
) -> std::result::Result<u64, ModelError> {
    let name = candle_offload::diag::device_label(device);
    let info = if device.is_cpu() {
        None
    } else {
        Some(candle_offload::diag::device_info(device)?)
    };
    Ok(match (limit, info) {
        (Some(l), info) => l.resolve(&name, info.map(|i| i.total_bytes))?,
        (None, Some(info)) => info.free_bytes,
        (None, None) => u64::MAX / 4,
    })
}

/// The ordinal a device map uses for `device`: the GPU's, or the position for a CPU.
fn device_ordinal(device: &Device, position: usize) -> usize {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
        _ => position,
    }
}

/// Greedy argmax of logits (batch 1).
pub fn argmax(logits: &Tensor) -> Result<u32> {
    logits.flatten_all()?.argmax(D::Minus1)?.to_scalar::<u32>()
}

#[cfg(test)]
mod tests {
    use super::{even_pass_rows, CausalLm, HostLayers, DECODE_ROWS, MIN_PROMPT_CHUNK};

    /// A near fit sizes its passes with the slack left out of both the check and the
    /// reservation it keeps; the whole prompt's check takes none, and a prompt that fits whole
    /// keeps its whole reservation.
    #[test]
    fn near_fit_passes_leave_the_slack_out() {
        let at = |rows: usize| 1000 + 10 * rows as u64;
        let slack = |rows: usize| 4 * rows as u64;
        let run = |budget: u64, slack: &dyn Fn(usize) -> u64| {
            CausalLm::phase_reserves(at, 7, 512, slack, |rows, s| {
                Ok(at(rows).saturating_sub(s) <= budget)
            })
            .unwrap()
        };
        let budget = at(189) + 5;
        let (reserve, share, chunk) = run(budget, &|_| 0);
        assert_eq!(
            (reserve, share, chunk),
            (at(189) - 7, at(189) - at(DECODE_ROWS), Some(189))
        );
        let (reserve, share, chunk) = run(budget, &slack);
        // 1000 + 6 rows <= 2895: 315 rows.
        let pass = at(315) - slack(315);
        assert_eq!(
            (reserve, share, chunk),
            (pass - 7, pass - at(DECODE_ROWS), Some(315))
        );
        // The whole prompt: no slack taken, even where the slack would make it fit.
        let budget = at(512) - slack(512);
        let (reserve, _, chunk) = run(budget, &slack);
        assert_eq!(chunk, Some(511));
        assert!(reserve < at(512) - 7);
        let (reserve, share, chunk) = run(at(512), &slack);
        assert_eq!(
            (reserve, share, chunk),
            (at(512) - 7, at(512) - at(DECODE_ROWS), None)
        );
    }

    proptest::proptest! {
        /// For any reservation growing with the rows faster than its slack, the passes are
        /// the most rows whose reservation less the slack fits, the kept reservation is that
        /// (never below a decode step's) and fits the budget, and the whole prompt is checked
        /// without the slack; what is given back while decoding leaves a decode step's.
        #[test]
        fn near_fit_passes_are_the_most_that_fit(
            base in 0u64..1 << 30,
            per_row in 1u64..1 << 20,
            slack_share in 0u64..100,
            saving in 0u64..1 << 20,
            prompt_len in 1usize..2048,
            budget in 0u64..(1 << 31),
        ) {
            let at = |rows: usize| base + saving + per_row * rows as u64;
            let slack = |rows: usize| per_row * slack_share / 100 * rows as u64;
            let fits = |rows: usize, s: u64| at(rows) - saving - s <= budget;
            let (reserve, share, chunk) = CausalLm::phase_reserves(
                at,
                saving,
                prompt_len,
                slack,
                |rows, s| Ok(fits(rows, s)),
            )
            .unwrap();
            let decode = at(DECODE_ROWS) - saving;
            match chunk {
                None if fits(prompt_len, 0) => {
                    proptest::prop_assert_eq!(reserve, at(prompt_len) - saving);
                }
                None => {
                    // Streams: no pass of MIN_PROMPT_CHUNK rows fits either.
                    proptest::prop_assert!(
                        prompt_len <= MIN_PROMPT_CHUNK
                            || !fits(MIN_PROMPT_CHUNK, slack(MIN_PROMPT_CHUNK))
                    );
                    // A stage that streams takes no resident saving.
                    proptest::prop_assert_eq!(reserve, at(prompt_len));
                    proptest::prop_assert_eq!(reserve - share, at(DECODE_ROWS));
                    return Ok(());
                }
                Some(rows) => {
                    proptest::prop_assert!(!fits(prompt_len, 0));
                    proptest::prop_assert!((MIN_PROMPT_CHUNK..prompt_len).contains(&rows));
                    proptest::prop_assert!(fits(rows, slack(rows)));
                    let more = rows + 1;
                    proptest::prop_assert!(more == prompt_len || !fits(more, slack(more)));
                    let pass = (at(rows) - slack(rows)).max(at(DECODE_ROWS));
                    proptest::prop_assert_eq!(reserve, pass - saving);
                    proptest::prop_assert!(reserve >= decode && reserve <= budget.max(decode));
                }
            }
            proptest::prop_assert_eq!(reserve + saving - share, at(DECODE_ROWS));
        }
    }

    #[test]
    fn passes_are_even_and_fewest() {
        // (positions, most rows a pass) -> rows a pass
        for (n, max, want) in [
            (512, 170, 128),
            (512, 202, 171),
            (512, 184, 171),
            (512, 512, 512),
            (512, 600, 512),
            (513, 512, 257),
            (100, 32, 25),
            (7, 1, 1),
            (1, 0, 1),
        ] {
            let rows = even_pass_rows(n, max);
            assert_eq!(rows, want, "{n} positions under {max}");
            assert!(rows <= max.max(1), "{n} under {max}: {rows} rows");
            // No more passes than the fewest that fit.
            assert_eq!(n.div_ceil(rows), n.div_ceil(max.max(1)), "{n} under {max}");
        }
    }

    #[test]
    fn host_layers_parse_and_place() {
        assert_eq!("spread:3".parse::<HostLayers>(), Ok(HostLayers::Spread(3)));
        assert_eq!(" 3 ".parse::<HostLayers>(), Ok(HostLayers::Count(3)));
        assert_eq!("auto".parse::<HostLayers>(), Ok(HostLayers::Auto));
        assert_eq!(
            "spread:auto".parse::<HostLayers>(),
            Ok(HostLayers::SpreadAuto)
        );
        assert_eq!(
            "spread:2+head".parse::<HostLayers>(),
            Ok(HostLayers::SpreadWithHead(2))
        );
        let e = "spread:x".parse::<HostLayers>().unwrap_err();
        assert!(e.contains("spread:x"), "{e}");
        let e = "spread:x+head".parse::<HostLayers>().unwrap_err();
        assert!(e.contains("spread:x+head"), "{e}");
        let on = |v: Vec<bool>| -> Vec<usize> { (0..v.len()).filter(|&l| v[l]).collect() };
        assert_eq!(on(HostLayers::Count(3).host_set(3, 8)), [0, 1, 2]);
        assert_eq!(on(HostLayers::Spread(4).host_set(4, 8)), [1, 3, 5, 7]);
        assert_eq!(
            on(HostLayers::SpreadWithHead(4).host_set(4, 8)),
            [1, 3, 5, 7]
        );
        assert_eq!(on(HostLayers::SpreadAuto.host_set(4, 8)), [1, 3, 5, 7]);
        assert_eq!(on(HostLayers::Spread(3).host_set(3, 8)), [2, 5, 7]);
        assert_eq!(on(HostLayers::Spread(8).host_set(8, 8)).len(), 8);
        assert!(on(HostLayers::Spread(0).host_set(0, 8)).is_empty());
    }
}
