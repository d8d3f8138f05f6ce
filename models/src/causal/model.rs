//! The model itself: [`CausalLm`], its pipeline stages and units, what it counts while it runs
//! (hidden-state transfers, the host's share of the steps), and its accessors and switches.
//! How it is built is in `builder.rs` (and `host.rs`, `devices.rs`), how it runs in
//! `forward.rs` and `graph.rs`.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Result};
use candle_offload::placement::DeviceMap;
use candle_offload::plan::spread::LayerSteps;
use candle_offload::{OffloadRuntime, UnitId};

use super::graph_state::Graphs;
use crate::error::ModelError;
use crate::family::Config;
use crate::family::{DecoderBlock, Family, Layout};
use crate::layers::Rope;

/// The units of a model in the runtimes' (shared) store; `None` for those a rank of a
/// multi-process run does not hold (another rank's layers, embeddings or head).
#[derive(Debug, Clone)]
pub(super) struct Units {
    pub(super) embed: Option<UnitId>,
    pub(super) layers: Vec<Option<UnitId>>,
    pub(super) norm: Option<UnitId>,
    pub(super) head: Option<UnitId>,
}

impl Units {
    /// `unit`, or an error naming what this process does not hold.
    fn held(unit: Option<UnitId>, what: &str) -> Result<UnitId> {
        unit.ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{what} is another rank's: this one does not hold it"
            ))
        })
    }

    /// The unit of decoder layer `l`.
    pub(super) fn layer(&self, l: usize) -> Result<UnitId> {
        Self::held(self.layers.get(l).copied().flatten(), &format!("layer {l}"))
    }

    /// The embeddings' unit.
    pub(super) fn embed(&self) -> Result<UnitId> {
        Self::held(self.embed, "the embeddings")
    }

    /// The final norm's unit.
    pub(super) fn norm(&self) -> Result<UnitId> {
        Self::held(self.norm, "the final norm")
    }

    /// The output head's unit.
    pub(super) fn head(&self) -> Result<UnitId> {
        Self::held(self.head, "the output head")
    }
}

/// A rank's place in a multi-process pipeline (`ranks.rs`), kept by its model.
#[derive(Debug, Clone)]
pub(super) struct RankLink {
    pub(super) transport: std::sync::Arc<dyn candle_offload::dist::Transport>,
    /// It runs the embeddings (rank 0).
    pub(super) first: bool,
    /// It runs the final norm and the head, and samples (the last rank).
    pub(super) last: bool,
    /// On rank 0 under a batcher: the sequences that ended since the last step, for the next
    /// step's plan ([`CausalLm::release_sequence`]).
    pub(super) ended: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
}

/// One pipeline stage: a device's runtime and the contiguous layers it runs.
#[derive(Debug)]
pub(super) struct Stage {
    pub(super) rt: OffloadRuntime,
    pub(super) rope: Rope,
    pub(super) layers: Range<usize>,
    /// The compute dtype on this stage (the model's, but F32 for host layers of GGML blocks).
    pub(super) dtype: DType,
    /// The runtime's reservation while a prompt runs and while decoding (`None`: fixed).
    pub(super) phase: Option<PhaseReserve>,
}

/// A stage's reservation by phase: a pass of many rows (a prompt) needs its activations, a
/// decode step one row's; the KV cache and workspaces are the same in both. Decode gives the
/// prompt's room to weights ([`OffloadRuntime::set_reserve_bytes`]), so that a model that
/// streams at a long prompt's reservation streams less, or nothing, while it decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PhaseReserve {
    pub(super) prompt: u64,
    pub(super) decode: u64,
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
pub(super) struct BuiltBlock(
    pub(super) Box<dyn DecoderBlock>,
    pub(super) usize,
    pub(super) DType,
);

/// A causal LM of any [`Family`] whose weights come from one [`OffloadRuntime`] per device:
/// one device is the single-GPU path; several run the layers as a pipeline (layer sharding).
#[derive(Debug)]
pub struct CausalLm {
    pub(super) cfg: Config,
    pub(super) family: Arc<dyn Family>,
    pub(super) layout: Layout,
    pub(super) dtype: DType,
    pub(super) stages: Vec<Stage>,
    pub(super) units: Units,
    pub(super) transfer: HiddenTransfer,
    /// `None`: fused on each GPU stage, not on the CPU ([`set_fused`](Self::set_fused)).
    pub(super) fused: Option<bool>,
    /// Per layer, whether it runs on the host stage in front of the device (empty without host
    /// layers; [`CausalLmBuilder::host_layers`](crate::CausalLmBuilder::host_layers)).
    pub(super) on_host: Vec<bool>,
    /// The order a step runs the layers in: stage index and layers, one entry per stage, or
    /// with spread host layers ([`HostLayers::Spread`](crate::HostLayers::Spread)) alternating
    /// runs of host and GPU layers.
    pub(super) segments: Vec<(usize, Range<usize>)>,
    /// What `spread:auto` timed to choose the host layers
    /// ([`spread_auto_layer_steps`](Self::spread_auto_layer_steps)).
    pub(super) layer_steps: Option<LayerSteps>,
    /// The splits `spread:auto` weighed ([`spread_auto_prices`](Self::spread_auto_prices)).
    pub(super) split_prices: Vec<candle_offload::SplitPrice>,
    /// The final norm and the output head run on the first stage (the host) instead of the
    /// last ([`head_on_host`](Self::head_on_host)).
    pub(super) head_on_host: bool,
    /// Prompts run in passes of at most this many rows ([`prompt_chunk`](Self::prompt_chunk)).
    pub(super) prompt_chunk: Option<usize>,
    /// Only the largest logit is used ([`set_greedy_head`](Self::set_greedy_head)).
    pub(super) greedy_head: std::sync::atomic::AtomicBool,
    pub(super) timing: std::sync::atomic::AtomicBool,
    pub(super) totals: std::sync::Mutex<TransferTotals>,
    /// The host's share of the steps ([`host_totals`](Self::host_totals)).
    pub(super) host_totals: std::sync::Mutex<HostTotals>,
    /// Decode steps replayed from a CUDA graph ([`set_graphs`](Self::set_graphs)).
    pub(super) graphs: Graphs,
    /// The device map of a pipeline over several devices ([`device_map`](Self::device_map)).
    pub(super) device_map: Option<DeviceMap>,
    /// LoRA adapters every layer's projections run with ([`set_adapters`](Self::set_adapters)).
    pub(super) adapters: Option<Arc<crate::lora::Adapters>>,
    /// This process's place in a multi-process pipeline (`None`: the model is whole here).
    pub(super) link: Option<RankLink>,
    /// The expert cache and host CPU beside the stage of this index (a mixture-of-experts
    /// model whose experts the device's budget does not hold).
    pub(super) expert_tier: Option<(usize, super::experts::ExpertTier)>,
    /// The expert units' ids in the store (none for a dense model).
    pub(super) expert_ids: super::experts::ExpertIds,
}

impl CausalLm {
    /// The model run as a pipeline over `stages`: each runtime (one per device, all over the
    /// same host store) runs a contiguous range of layers, the ranges in order and covering
    /// every layer; the first stage also runs the embeddings, the last the final norm and the
    /// output head. Every tensor is checked (present, shape, float dtype) before anything runs;
    /// `source` names the weights in errors. Every way of building ends here.
    pub(super) fn assemble(
        cfg: Config,
        stages: Vec<(OffloadRuntime, Range<usize>)>,
        dtype: DType,
        max_len: usize,
        source: &std::path::Path,
    ) -> std::result::Result<Self, ModelError> {
        let n = cfg.num_hidden_layers;
        Self::assemble_span(cfg, stages, 0..n, dtype, max_len, source)
    }

    /// [`assemble`](Self::assemble) of the layers `span` only (a rank of a multi-process
    /// run): the stages cover `span`; the embeddings are checked and held where it starts at
    /// layer 0, the final norm and the head where it ends at the last layer.
    pub(super) fn assemble_span(
        cfg: Config,
        stages: Vec<(OffloadRuntime, Range<usize>)>,
        span: Range<usize>,
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
        let mut next = span.start;
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
        if next != span.end || span.end > cfg.num_hidden_layers {
            return Err(ModelError::Config {
                path: source.into(),
                field: "stages".into(),
                reason: format!(
                    "the stages run layers {}..{next}, {} of the model's {}",
                    span.start,
                    if span.start == 0 {
                        "not all".to_string()
                    } else {
                        format!("not the range {span:?}")
                    },
                    cfg.num_hidden_layers
                ),
            });
        }
        let layout = cfg.layout();
        let (first_rank, last_rank) = (span.start == 0, span.end == cfg.num_hidden_layers);
        // The units this process holds: its layers, the embeddings where it starts, the final
        // norm and the head where it ends.
        let mut held: Vec<String> = span.clone().flat_map(|l| layout.units_of(l)).collect();
        if first_rank {
            held.push(layout.embed.clone());
        }
        if last_rank {
            held.push(layout.norm.clone());
            held.push(layout.head_unit().to_string());
        }
        for (name, shape) in cfg.expected_tensors() {
            if !held.contains(&layout.unit_of(&name)) {
                continue;
            }
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
        let held_unit = |name: &str, held: bool| held.then(|| unit(name)).transpose();
        let units = Units {
            embed: held_unit(&layout.embed, first_rank)?,
            layers: (0..cfg.num_hidden_layers)
                .map(|l| held_unit(&layout.layer(l), span.contains(&l)))
                .collect::<std::result::Result<_, _>>()?,
            norm: held_unit(&layout.norm, last_rank)?,
            head: held_unit(layout.head_unit(), last_rank)?,
        };
        let expert_ids = super::experts::ExpertIds::new(&layout, &store);
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
        let tuning = stages.first().map(|s| s.rt.tuning());
        let graphs = Graphs::new(
            tuning.is_none_or(|t| t.graphs),
            tuning.is_some_and(|t| t.ragged_graphs),
        );
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
            device_map: None,
            adapters: None,
            link: None,
            expert_tier: None,
            expert_ids,
        })
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

    /// The experts a step on `stage` acquires (see `experts.rs`).
    pub(super) fn stage_experts<'a>(
        &'a self,
        stage: &'a Stage,
    ) -> super::experts::StageExperts<'a> {
        use super::experts::{RuntimeExperts, SplitExperts, StageExperts};
        let device = RuntimeExperts {
            rt: &stage.rt,
            layout: &self.layout,
            ids: &self.expert_ids,
            dtype: stage.dtype,
        };
        match &self.expert_tier {
            Some((i, tier)) if std::ptr::eq(&self.stages[*i], stage) => {
                StageExperts::Split(SplitExperts { device, tier })
            }
            _ => StageExperts::Runtime(device),
        }
    }

    /// What the expert cache did so far: hits and misses per layer, experts resident, fetched
    /// and computed on the host, the host bytes they took. `None` for a model without one (a
    /// dense model, or one whose experts all fit the device).
    pub fn expert_stats(&self) -> Option<super::experts::ExpertStats> {
        self.expert_tier.as_ref().map(|(_, t)| t.stats())
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
    /// layers, [`HostLayers::Spread`](crate::HostLayers::Spread), the span from its first layer
    /// to its last).
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

    /// Whether inference uses the fused ops of `candle_offload::ops` where a block can: RMSNorm
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

    pub(super) fn stage_fused(&self, stage: &Stage) -> bool {
        // On a GPU the fused kernels are faster; on the CPU Candle's multi-threaded ops beat
        // their loops.
        self.fused.unwrap_or_else(|| stage.rt.device().is_cuda())
    }

    /// How many decoder layers run on the host CPU in front of the device (0 unless the
    /// model was built with host layers,
    /// [`CausalLmBuilder::host_layers`](crate::CausalLmBuilder::host_layers)).
    pub fn host_layer_count(&self) -> usize {
        self.on_host.iter().filter(|&&b| b).count()
    }

    /// Fetches, on every stage, the units that stay there for good
    /// ([`OffloadRuntime::warm_up`]), and an expert tier's host copies of the experts, so that
    /// the first steps compute instead of copying weights; returns the bytes fetched.
    pub fn warm_up(&self) -> Result<u64> {
        let mut bytes = 0;
        for stage in &self.stages {
            bytes += stage.rt.warm_up()?;
        }
        if let Some((i, _)) = &self.expert_tier {
            if let super::experts::StageExperts::Split(tier) = self.stage_experts(&self.stages[*i])
            {
                bytes += tier.warm_up()?;
            }
        }
        Ok(bytes)
    }

    /// Whether the final norm and the output head run on the host CPU
    /// ([`HostLayers::SpreadWithHead`](crate::HostLayers::SpreadWithHead), or
    /// [`HostLayers::SpreadAuto`](crate::HostLayers::SpreadAuto)'s choice).
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

    /// Runs every layer with LoRA `adapters` beside its frozen weights, unmerged (`None`:
    /// without). Set before the first forward pass: a resident layer keeps the block it built.
    /// The adapters are checked against the model's layers; host layers are refused (their
    /// blocks are built with the model).
    pub fn set_adapters(
        &mut self,
        adapters: Option<Arc<crate::lora::Adapters>>,
    ) -> std::result::Result<(), crate::ModelError> {
        if let Some(a) = &adapters {
            let invalid = |reason: String| crate::ModelError::Config {
                path: "<adapter>".into(),
                field: "lora".into(),
                reason,
            };
            a.check(&self.cfg).map_err(invalid)?;
            if self.on_host.iter().any(|&h| h) {
                return Err(invalid(
                    "LoRA adapters with host layers are not supported yet".into(),
                ));
            }
        }
        self.adapters = adapters;
        Ok(())
    }

    /// The LoRA adapters the layers run with.
    pub fn adapters(&self) -> Option<&Arc<crate::lora::Adapters>> {
        self.adapters.as_ref()
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
    pub(super) fn add_host_time(&self, layers: usize, seconds: f64) {
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

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// What [`HostLayers::SpreadAuto`](crate::HostLayers::SpreadAuto) timed when this model was
    /// built, to choose its host layers (`None` for other choices, and where it timed nothing:
    /// on a CPU device, or a model that fits).
    pub fn spread_auto_layer_steps(&self) -> Option<LayerSteps> {
        self.layer_steps
    }

    /// Every split [`HostLayers::SpreadAuto`](crate::HostLayers::SpreadAuto) weighed when this
    /// model was built, with the price it gave each ([`candle_offload::spread_host_prices`];
    /// the chosen one is [`host_layer_count`](Self::host_layer_count) with
    /// [`head_on_host`](Self::head_on_host)), to set against measured steps; empty where it
    /// weighed none (the same cases as
    /// [`spread_auto_layer_steps`](Self::spread_auto_layer_steps)).
    pub fn spread_auto_prices(&self) -> &[candle_offload::SplitPrice] {
        &self.split_prices
    }

    /// The family.
    pub fn family(&self) -> &Arc<dyn Family> {
        &self.family
    }

    /// The unit names.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The device map a pipeline over several devices was built with
    /// ([`CausalLmBuilder::devices`](crate::CausalLmBuilder::devices)), or the split over the
    /// ranks of a multi-process run (one device per rank, its ordinal the rank;
    /// [`CausalLmBuilder::rank`](crate::CausalLmBuilder::rank)); `None` on one device.
    pub fn device_map(&self) -> Option<&DeviceMap> {
        self.device_map.as_ref()
    }
}
