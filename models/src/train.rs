//! Fine-tuning a model of any [`Family`] whose blocks have a training path, on a small GPU:
//! autocast, loss scaling, checkpointing and offloaded weights, wired together.
//!
//! The [`Trainer`] owns F32 master weights and an AdamW optimizer. Where they live depends on
//! [`TrainSettings::offload`]:
//! - resident (the default): masters, gradients and optimizer state on the device; autocast
//!   serves each weight to the forward pass as a differentiable cast of its master;
//! - offloaded: masters and optimizer state in host memory (ZeRO-Offload style); the device
//!   sees compute-dtype copies streamed by an [`OffloadRuntime`] under the memory budget, as
//!   autograd leaves. Every segment's weight gradients leave the device as soon as its
//!   backward pass ends (the checkpoint's gradient sink), are summed in F32 on the host, the
//!   optimizer (`HostAdamW`, fused and multi-threaded) steps there, and the updated weights are
//!   written back into the host store.
//!   Checkpointing is required: a plain backward pass would hold every layer's weights.
//!
//! Memory on the device is kept down three ways besides checkpointing: attention runs over
//! checkpointed groups of heads (one group's score matrix at a time), and the output head and
//! loss run over checkpointed chunks of tokens (one chunk's logits at a time).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, TensorId, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use candle_offload::kernels::optimizer::{FusedAdamW, HostAdamW};
use candle_offload::kernels::{loss, norm};
use candle_offload::train::{segment_ranges, CastOrigins};
use candle_offload::{
    Autocast, Checkpointer, GradScaler, GradScalerConfig, MemoryLimit, OffloadConfig,
    OffloadRuntime, OffloadStrategy, PolicyChoice, Precision, StoreConfig, UnitGuard,
};

use crate::causal::CausalLm;
use crate::config::Config;
use crate::error::ModelError;
use crate::family::{Family, Layout, TrainCtx, UnitWeights, WeightGradSink};
use crate::layers::{Masks, Rope};

/// How a [`Trainer`] computes and where it keeps the weights.
#[derive(Debug, Clone)]
pub struct TrainSettings {
    /// Matmul precision (`--autocast`); F16 turns the loss scaler on.
    pub precision: Precision,
    /// Checkpointed segments over the decoder layers; 0 turns checkpointing off.
    pub checkpoint_segments: usize,
    /// Masters and optimizer state in host memory, weights streamed (`--offload`).
    pub offload: bool,
    /// Device budget for offloaded weights plus the training reservation
    /// ([`OffloadConfig::gpu_memory_limit`]).
    pub gpu_memory_limit: Option<MemoryLimit>,
    /// Offload prefetch depth ([`OffloadConfig::prefetch_depth`]).
    pub prefetch_depth: usize,
    /// AdamW hyper-parameters.
    pub adamw: ParamsAdamW,
    /// Batch size the reservation is planned for.
    pub batch_size: usize,
    /// Sequence length the reservation (and the RoPE tables) are planned for.
    pub seq_len: usize,
    /// Attention head groups; `None`: enough that one group's scores stay under 64 MiB.
    pub head_chunks: Option<usize>,
    /// Tokens per output-head chunk; `None`: enough that one chunk's logits stay under
    /// 128 MiB.
    pub loss_chunk_tokens: Option<usize>,
    /// The fused training ops of `candle_offload::kernels` (`norm`, `activation`): RMSNorm and SwiGLU with their
    /// own backward kernels, the softmax cross-entropy without an F32 probability matrix,
    /// causal attention as `kernels::attention::flash_attention` (no score matrix, no head groups), and
    /// [`FusedAdamW`] for masters on a GPU (default). `false`: the Candle compositions and
    /// candle-nn's `AdamW`.
    pub fused: bool,
    /// With `fused` and resident weights: decoder blocks that have a hand-written backward
    /// pass (the plain pre-norm block: RMSNorm, flash attention, SwiGLU) use it, one node in
    /// Candle's graph per layer instead of one per op, which Candle's backward walk would
    /// each give a zeroed buffer and an add (default). `false`: every op in Candle's graph.
    pub hand_backward: bool,
    /// Resident weights on a GPU: keep cudarc's per-buffer event tracking on. Off (default),
    /// the trainer turns it off for the device's context while it lives (one stream carries
    /// the whole step: hazard H15 in ARCHITECTURE.md) and restores it when dropped; keep it on
    /// where something else uses this GPU on another stream meanwhile.
    pub event_tracking: bool,
    /// The performance choices of the offloaded runtime ([`candle_offload::Tuning`]).
    pub tuning: candle_offload::Tuning,
}

impl Default for TrainSettings {
    fn default() -> Self {
        Self {
            precision: Precision::F32,
            checkpoint_segments: 0,
            offload: false,
            // The runtime's own defaults: one source for each offload setting.
            gpu_memory_limit: OffloadConfig::default().gpu_memory_limit,
            prefetch_depth: OffloadConfig::default().prefetch_depth,
            adamw: ParamsAdamW {
                lr: 1e-4,
                weight_decay: 0.0,
                ..Default::default()
            },
            batch_size: 1,
            seq_len: 256,
            head_chunks: None,
            loss_chunk_tokens: None,
            fused: true,
            hand_backward: true,
            event_tracking: false,
            tuning: candle_offload::Tuning::default(),
        }
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy)]
pub struct StepReport {
    /// Mean cross-entropy of the batch (before scaling).
    pub loss: f32,
    /// Applied, or skipped by the loss scaler.
    pub outcome: candle_offload::train::StepOutcome,
    /// Target tokens in the batch that count (not [`IGNORE_TARGET`]).
    pub tokens: usize,
}

/// Where a training step is, as [`Trainer::set_phase_observer`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TrainPhase {
    /// The forward pass and the loss are about to run.
    Forward,
    /// The backward pass (recomputes included) is about to run.
    Backward,
    /// Unscaling, the optimizer and (offloaded) the write-back are about to run.
    Optimizer,
    /// The step has ended.
    Done,
}

/// Called at each [`TrainPhase`] boundary of [`Trainer::step`] (profilers: device
/// synchronization and timing, capture markers).
pub type PhaseObserver = Box<dyn FnMut(TrainPhase) -> Result<()> + Send>;

enum Source {
    Resident(VarMap),
    Offloaded(OffloadRuntime),
    /// A frozen base under LoRA adapters: its weights (dense, or GGML blocks in the decoder
    /// layers) served by a runtime under the budget, resident or streamed, never updated.
    Frozen(OffloadRuntime),
}

/// Everything the forward pass (and its recomputes) needs; shared with checkpoint closures.
struct Core {
    cfg: Config,
    family: Arc<dyn Family>,
    layout: Layout,
    autocast: Autocast,
    device: Device,
    rope: Rope,
    head_chunks: usize,
    loss_chunk: usize,
    fused: bool,
    /// [`TrainSettings::hand_backward`].
    hand_backward: bool,
    /// Which master each weight served to the forward pass was cast from (resident).
    origins: CastOrigins,
    /// Where blocks with a hand-written backward pass hand their weights' gradients, during a
    /// step's backward pass (`None` outside one, or where blocks must use Candle's graph).
    weight_grads: Mutex<Option<WeightGradSink>>,
    /// Weight gradients handed over through `weight_grads` in the last backward pass.
    hand_grads: Arc<AtomicUsize>,
    source: Source,
    /// Offload guards of the segment running now; released when the next one starts.
    held: Mutex<Vec<UnitGuard>>,
    /// Offloaded weights on the device by tensor id, to route their gradients to masters.
    leaf_names: Mutex<HashMap<TensorId, String>>,
    /// Offloaded runs: F32 gradients on the host, by tensor name.
    host_grads: Mutex<HashMap<String, Tensor>>,
    /// The page-locked staging of their device-to-host copies.
    host_staging: Mutex<candle_offload::train::HostGradients>,
    /// The previous step's host sums, which only the trainer still holds after its optimizer
    /// step: the next step writes its first contributions into them rather than allocating
    /// (and faulting in) gigabytes of new host memory every step.
    spare_grads: Mutex<HashMap<String, Tensor>>,
    /// LoRA adapters on a frozen base ([`Trainer::lora`]): the only trained weights.
    adapters: Option<Arc<crate::lora::Adapters>>,
}

fn poisoned<T>(_: T) -> candle_core::Error {
    candle_core::Error::Msg("trainer state poisoned by an earlier panic".into())
}

impl Core {
    /// A `VarBuilder` over the unit `prefix` (acquired and held when offloaded), serving the
    /// compute dtype by default.
    fn vb(&self, prefix: &str) -> Result<VarBuilder<'static>> {
        match &self.source {
            Source::Resident(vars) => {
                Ok(self
                    .autocast
                    .var_builder_recording(vars, &self.device, &self.origins))
            }
            Source::Frozen(rt) => {
                let guard = rt.acquire_named(prefix)?;
                let vb = guard.var_builder(self.autocast.compute_dtype());
                self.held.lock().map_err(poisoned)?.push(guard);
                Ok(vb)
            }
            Source::Offloaded(rt) => {
                let guard = rt.acquire_named(prefix)?;
                let vb = guard.var_builder(self.autocast.compute_dtype());
                let mut names = self.leaf_names.lock().map_err(poisoned)?;
                for (name, t) in guard.tensors() {
                    names.insert(t.id(), name.clone());
                }
                self.held.lock().map_err(poisoned)?.push(guard);
                Ok(vb)
            }
        }
    }

    fn release_held(&self) -> Result<()> {
        self.held.lock().map_err(poisoned)?.clear();
        Ok(())
    }

    /// Token embeddings, F32.
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let _span = tracing::trace_span!("train.embed").entered();
        let vb = self.vb(&self.layout.embed)?.to_dtype(DType::F32);
        self.family
            .embed(&self.cfg, UnitWeights::dense(vb), ids)?
            .to_dtype(DType::F32)
    }

    fn layer(&self, l: usize, xs: &Tensor, masks: &Masks) -> Result<Tensor> {
        let _span = tracing::trace_span!("train.layer", l).entered();
        let prefix = self.layout.layer(l);
        let ctx = TrainCtx {
            rope: &self.rope,
            masks,
            compute: self.autocast.compute_dtype(),
            head_chunks: self.head_chunks,
            fused: self.fused,
            weight_grads: self.weight_grads.lock().map_err(poisoned)?.clone(),
            frozen_base: matches!(self.source, Source::Frozen(_)),
        };
        if let Source::Frozen(rt) = &self.source {
            // The unit's blocks stay blocks; each projection gets its adapter.
            let guard = rt.acquire_named(&prefix)?;
            let out = {
                let weights = UnitWeights::new(
                    guard.var_builder(self.autocast.compute_dtype()),
                    Some(&guard),
                )
                .with_adapters(self.adapters.clone())
                .pp(&prefix);
                let block = self.family.block(&self.cfg, weights, l, DType::F32)?;
                block.forward_train(xs, &ctx)
            };
            self.held.lock().map_err(poisoned)?.push(guard);
            return out;
        }
        let weights = UnitWeights::dense(self.vb(&prefix)?.pp(&prefix));
        let block = self.family.block(&self.cfg, weights, l, DType::F32)?;
        block.forward_train(xs, &ctx)
    }

    /// Summed cross-entropy of `xs` (tokens, hidden) against `targets` (tokens).
    /// `mask` (tokens, F32 0 or 1): which targets count (`None`: all); an ignored target's id
    /// must be a valid one (it is multiplied by 0).
    fn head_loss_sum(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let _span = tracing::trace_span!("train.head_loss").entered();
        let (v, h) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let norm = self.family.final_norm(
            &self.cfg,
            self.vb(&self.layout.norm)?.pp(&self.layout.norm),
            DType::F32,
        )?;
        let name = self.layout.head_unit();
        let w = self.vb(name)?.get((v, h), &format!("{name}.weight"))?;
        let sink = self.weight_grads.lock().map_err(poisoned)?.clone();
        // A frozen head (LoRA) goes through Candle's graph, which computes no weight gradient.
        if let (Some(sink), Some((nw, eps)), false, None) = (
            sink,
            norm.rms_parts(),
            self.family.finishes_logits(&self.cfg),
            &self.adapters,
        ) {
            if self.fused && nw.dtype() == xs.dtype() && xs.rank() == 2 {
                return self.head_loss_by_hand(xs, targets, mask, (nw, eps), &w, sink);
            }
        }
        let xs = norm
            .forward_train(xs, self.fused)?
            .to_dtype(self.autocast.compute_dtype())?;
        let logits = xs.matmul(&w.t()?)?;
        // The fused loss reads F16/BF16 logits and sums in F32 itself: no F32 copy of the
        // logits, nor of their gradient, unless the family changes them first.
        let logits = if self.fused && !self.family.finishes_logits(&self.cfg) {
            logits
        } else {
            self.family
                .finish_logits(&self.cfg, logits.to_dtype(DType::F32)?)?
        };
        let rows = if self.fused {
            loss::cross_entropy(&logits, targets)?
        } else {
            loss::cross_entropy_composite(&logits, targets)?
        };
        match mask {
            Some(m) => (rows * m)?.sum_all(),
            None => rows.sum_all(),
        }
    }

    /// [`head_loss_sum`](Self::head_loss_sum) as one graph node with its backward pass by
    /// hand (final RMSNorm, the head's matmul, the fused loss): each gradient written once,
    /// the head's and the norm's handed to `sink`, where Candle's walk would zero and add a
    /// buffer the head's size at every op between the loss and the master.
    fn head_loss_by_hand(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mask: Option<&Tensor>,
        (norm_w, eps): (&Tensor, f64),
        w: &Tensor,
        sink: WeightGradSink,
    ) -> Result<Tensor> {
        let _span = tracing::trace_span!("train.head_loss.by_hand").entered();
        let cd = self.autocast.compute_dtype();
        let (x, nw, wd) = (xs.detach(), norm_w.detach(), w.detach());
        let hc = norm::rms_norm(&x, &nw, eps)?.to_dtype(cd)?;
        let logits = hc.matmul(&wd.t()?)?;
        let rows = loss::cross_entropy(&logits, targets)?;
        let loss = match mask {
            Some(m) => (rows * m)?.sum_all()?,
            None => rows.sum_all()?,
        };
        if !xs.track_op() {
            return Ok(loss);
        }
        let saved = Mutex::new(Some((x, hc, logits)));
        let (targets, served_w, served_nw) = (targets.clone(), w.clone(), norm_w.clone());
        let mask = mask.cloned();
        candle_offload::train::grad::with_gradient(xs, loss, move |dloss| {
            let (x, hc, logits) = saved
                .lock()
                .map_err(poisoned)?
                .take()
                .ok_or_else(|| candle_core::Error::Msg("head backward ran twice".into()))?;
            let rows = logits.dim(0)?;
            let dy = dloss.to_dtype(DType::F32)?.broadcast_as(rows)?;
            let dy = match &mask {
                Some(m) => (dy * m)?,
                None => dy.contiguous()?,
            };
            let dlogits = loss::cross_entropy_backward(&logits, &targets, &dy)?;
            drop(logits);
            sink(&served_w, dlogits.t()?.matmul(&hc)?)?;
            drop(hc);
            let dh = dlogits.matmul(&wd)?;
            drop(dlogits);
            let (dx, dnw) = norm::rms_norm_backward(&x, &nw, eps, &dh.to_dtype(x.dtype())?)?;
            sink(&served_nw, dnw)?;
            Ok(dx)
        })
    }

    /// Moves offloaded weights' gradients to the host, summed in F32 by tensor name.
    fn absorb(&self, grads: &GradStore) -> Result<()> {
        let names = self.leaf_names.lock().map_err(poisoned)?;
        let mut host = self.host_grads.lock().map_err(poisoned)?;
        let mut staging = self.host_staging.lock().map_err(poisoned)?;
        let mut spare = self.spare_grads.lock().map_err(poisoned)?;
        for id in grads.get_ids() {
            let (Some(name), Some(g)) = (names.get(id), grads.get_id(*id)) else {
                continue;
            };
            // To the host first through page-locked staging (no F32 copy of the gradient on
            // the device), then converted or added in F32 on every core.
            let sum = match (host.remove(name), spare.remove(name)) {
                (Some(acc), _) => staging.accumulate(Some(acc), g)?,
                (None, Some(buf)) if buf.dims() == g.dims() => staging.overwrite(buf, g)?,
                (None, _) => staging.accumulate(None, g)?,
            };
            host.insert(name.clone(), sum);
        }
        Ok(())
    }
}

/// AdamW where the masters are: the fused multi-tensor one on a GPU (candle-nn's with the
/// fused ops off), the fused host one for masters in host memory (offloaded, or training on
/// the CPU).
#[derive(Debug)]
enum Adam {
    Fused(FusedAdamW),
    Device(AdamW),
    Host(HostAdamW),
}

/// Trains a causal LM of any family with a training path: `step(inputs, targets)` runs
/// forward, backward and AdamW.
pub struct Trainer {
    core: Arc<Core>,
    opt: Adam,
    vars: Vec<Var>,
    names: Vec<String>,
    scaler: GradScaler,
    checkpoint_segments: usize,
    recomputes: usize,
    observer: Option<PhaseObserver>,
    /// Event tracking as it was before this trainer turned it off (resident on a GPU).
    tracking_was: Option<bool>,
}

impl Drop for Trainer {
    fn drop(&mut self) {
        if let Some(was) = self.tracking_was {
            if let Err(e) = candle_offload::train::set_event_tracking(&self.core.device, was) {
                tracing::warn!("could not restore cudarc's event tracking: {e}");
            }
        }
    }
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("precision", &self.core.autocast.precision())
            .field("checkpoint_segments", &self.checkpoint_segments)
            .field("offloaded", &self.runtime().is_some())
            .field("parameters", &self.parameter_count())
            .finish()
    }
}

/// Attention head groups for `batch` sequences of `seq` tokens: 1 when every head's F32
/// scores fit in 64 MiB together, otherwise enough groups that each group's do.
/// The file of AdamW's state beside a saved adapter ([`Trainer::save_adapter`]).
pub const OPTIMIZER_FILE: &str = "optimizer_state.safetensors";

/// A target id that is not trained on (a prompt's token under chat data, padding): its
/// position adds nothing to the loss, and the mean is over the other targets.
pub const IGNORE_TARGET: u32 = u32::MAX;

/// `targets` (tokens, U32) with [`IGNORE_TARGET`]s replaced by 0, the F32 mask of the others
/// (`None` when none is ignored) and how many count.
fn masked_targets(targets: &Tensor) -> Result<(Tensor, Option<Tensor>, usize)> {
    let n = targets.elem_count();
    let ignore = Tensor::full(IGNORE_TARGET, n, targets.device())?;
    let valid = targets.ne(&ignore)?;
    let counted = valid.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? as usize;
    if counted == n {
        return Ok((targets.clone(), None, n));
    }
    let safe = valid.where_cond(targets, &targets.zeros_like()?)?;
    Ok((safe, Some(valid.to_dtype(DType::F32)?), counted))
}

fn head_chunks_for(cfg: &Config, batch: usize, seq: usize) -> usize {
    let per_head = (batch * seq * seq * 4) as u64;
    let all = per_head * cfg.num_attention_heads as u64;
    if all <= 64 << 20 {
        1
    } else {
        (all.div_ceil(64 << 20) as usize).clamp(1, cfg.num_attention_heads)
    }
}

/// Device bytes a LoRA adapter parameter holds while training: its F32 master, its F32
/// gradient, AdamW's two F32 moments, and its copy in the compute dtype that a pass keeps
/// (`LoraAdapter::forget_casts`), counted at F32's 4 bytes whatever that dtype.
pub const ADAPTER_STATE_BYTES_PER_PARAM: u64 = 20;

impl Trainer {
    /// A trainer over `tensors` (checkpoint names, any float dtype, on any device) for a model
    /// of `cfg`, computing on `device`. Every expected tensor must be present with its shape;
    /// `source` names the weights in errors.
    pub fn new(
        cfg: Config,
        tensors: Vec<(String, Tensor)>,
        device: &Device,
        settings: &TrainSettings,
        source: &std::path::Path,
    ) -> std::result::Result<Self, ModelError> {
        let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
        let master_device = if settings.offload {
            Device::Cpu
        } else {
            device.clone()
        };
        if settings.offload && settings.checkpoint_segments == 0 {
            return Err(ModelError::Config {
                path: source.into(),
                field: "checkpoint_segments".into(),
                reason: "offloaded training needs checkpointing (at least 1 segment): a plain \
                         backward pass holds every layer's weights on the device"
                    .into(),
            });
        }
        let autocast = Autocast::new(settings.precision);
        let varmap = VarMap::new();
        let mut vars = Vec::new();
        let mut names = Vec::new();
        for (name, shape) in cfg.expected_tensors() {
            let t = by_name.remove(&name).ok_or_else(|| ModelError::Tensor {
                path: source.into(),
                tensor: name.clone(),
                reason: "missing".into(),
            })?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::Tensor {
                    path: source.into(),
                    tensor: name,
                    reason: format!("has shape {:?}, the config implies {shape:?}", t.dims()),
                });
            }
            if !t.dtype().is_float() {
                return Err(ModelError::Tensor {
                    path: source.into(),
                    tensor: name,
                    reason: format!("has dtype {:?}, expected a float dtype", t.dtype()),
                });
            }
            let var = Var::from_tensor(&t.to_dtype(DType::F32)?.to_device(&master_device)?)?;
            varmap
                .data()
                .lock()
                .map_err(poisoned)?
                .insert(name.clone(), var.clone());
            vars.push(var);
            names.push(name);
        }
        let source_kind = if settings.offload {
            let compute = autocast.compute_dtype();
            let copies: Vec<(String, Tensor)> = names
                .iter()
                .zip(&vars)
                .map(|(n, v)| Ok((n.clone(), v.as_tensor().to_dtype(compute)?)))
                .collect::<Result<_>>()?;
            let store = Arc::new(candle_offload::HostStore::from_tensors(
                &copies,
                &StoreConfig {
                    grouping: cfg.layout().grouping(),
                    ..Default::default()
                },
                device,
            )?);
            drop(copies);
            let rt = OffloadRuntime::new(
                store.clone(),
                device,
                &OffloadConfig {
                    gpu_memory_limit: settings.gpu_memory_limit,
                    reserve_bytes: cfg.train_reserve_bytes(
                        settings.batch_size,
                        settings.seq_len,
                        settings.checkpoint_segments,
                        compute,
                    ),
                    strategy: OffloadStrategy::Minimal,
                    // Forward then reverse: the most recently used layer is the next one needed.
                    policy: PolicyChoice::Lru,
                    prefetch_depth: settings.prefetch_depth,
                    keep: CausalLm::kept_units(&store, &cfg),
                    trainable: true,
                    units: None,
                    // Not yet measured or reviewed for training's gradient paths.
                    event_tracking: true,
                    steady_reserve_bytes: None,
                    tuning: settings.tuning,
                    ..Default::default()
                },
            )?;
            Source::Offloaded(rt)
        } else {
            // Every step allocates the same activations again: keep them in the pool rather
            // than map their memory afresh after each synchronization.
            candle_offload::diag::keep_pool_memory(device, true)?;
            Source::Resident(varmap)
        };
        Self::assemble(
            cfg,
            settings,
            device,
            source_kind,
            None,
            (names, vars),
            master_device.is_cpu(),
        )
    }

    /// A trainer over the weights of `files` (safetensors or GGUF, dequantized).
    pub fn from_files(
        files: &crate::loader::ModelFiles,
        device: &Device,
        settings: &TrainSettings,
    ) -> std::result::Result<Self, ModelError> {
        let store = crate::loader::load_store(files, DType::F32, &Device::Cpu, Some(0))?;
        let mut tensors = Vec::new();
        for unit in store.units() {
            for t in unit.tensors() {
                tensors.push((t.name.clone(), unit.cpu_tensor(t)?));
            }
        }
        drop(store);
        Self::new(
            files.config.clone(),
            tensors,
            device,
            settings,
            &files.weights_path(),
        )
    }

    /// A randomly initialised model of `cfg` (normal(0, 0.02) matrices, unit norms), created
    /// where the masters live. For benchmarks and tests.
    pub fn random(
        cfg: Config,
        device: &Device,
        settings: &TrainSettings,
    ) -> std::result::Result<Self, ModelError> {
        let at = if settings.offload {
            &Device::Cpu
        } else {
            device
        };
        let tensors = cfg
            .expected_tensors()
            .into_iter()
            .map(|(name, shape)| {
                let t = if shape.len() == 1 {
                    Tensor::ones(shape, DType::F32, at)?
                } else {
                    Tensor::randn(0f32, 0.02, shape, at)?
                };
                Ok((name, t))
            })
            .collect::<Result<Vec<_>>>()?;
        Self::new(
            cfg,
            tensors,
            device,
            settings,
            std::path::Path::new("<random>"),
        )
    }

    /// A trainer of LoRA `adapters` on the frozen base in `store` (the checkpoint's tensors:
    /// dense in any float dtype, or GGML blocks, which stay blocks in the decoder layers:
    /// QLoRA), for a model of `cfg`, computing on `device`. The base is served by an offload
    /// runtime under [`TrainSettings::gpu_memory_limit`] (resident where it fits, streamed
    /// otherwise); only the adapters have gradients, F32 masters (on `device`) and AdamW
    /// state. Blocks outside the decoder layers (embeddings, output head) are dequantized.
    pub fn lora(
        cfg: Config,
        store: Arc<candle_offload::HostStore>,
        adapters: crate::lora::Adapters,
        device: &Device,
        settings: &TrainSettings,
    ) -> std::result::Result<Self, ModelError> {
        adapters.check(&cfg).map_err(|reason| ModelError::Config {
            path: "<adapter>".into(),
            field: "lora".into(),
            reason,
        })?;
        let tensors = adapters
            .modules()
            .iter()
            .map(|(p, m)| {
                (
                    p.clone(),
                    (m.a.as_tensor().clone(), m.b.as_tensor().clone()),
                )
            })
            .collect();
        let adapters = Arc::new(crate::lora::Adapters::from_tensors(
            adapters.config().clone(),
            tensors,
            device,
        )?);
        let autocast = Autocast::new(settings.precision);
        let compute = autocast.compute_dtype();
        let layout = cfg.layout();
        let store_cfg = StoreConfig {
            grouping: layout.grouping(),
            ..Default::default()
        };
        let store =
            crate::lora::merge::frozen_base(store, &layout.layer_prefix, &store_cfg, device)?;
        let rt = OffloadRuntime::new(
            store.clone(),
            device,
            &OffloadConfig {
                gpu_memory_limit: settings.gpu_memory_limit,
                // Besides the activations: the adapters' state on the device, which the
                // budget holds too.
                reserve_bytes: cfg.lora_train_reserve_bytes(
                    settings.batch_size,
                    settings.seq_len,
                    settings.checkpoint_segments,
                    compute,
                ) + adapters.parameter_count() as u64
                    * ADAPTER_STATE_BYTES_PER_PARAM,
                strategy: OffloadStrategy::Minimal,
                policy: PolicyChoice::Lru,
                prefetch_depth: settings.prefetch_depth,
                keep: CausalLm::kept_units(&store, &cfg),
                trainable: false,
                units: None,
                event_tracking: true,
                steady_reserve_bytes: None,
                tuning: settings.tuning,
                ..Default::default()
            },
        )?;
        let params = adapters.named_vars().into_iter().unzip();
        Self::assemble(
            cfg,
            settings,
            device,
            Source::Frozen(rt),
            Some(adapters),
            params,
            device.is_cpu(),
        )
    }

    /// What every constructor makes alike around the trained parameters (`names`, `vars`)
    /// and the weights' `source`: the optimizer (AdamW on the host where `host_masters`), the
    /// head's and the loss's chunks, the rotary tables and the loss scaler; last, for resident
    /// weights on a GPU without [`TrainSettings::event_tracking`], the device's event tracking
    /// turned off (restored when the trainer is dropped).
    fn assemble(
        cfg: Config,
        settings: &TrainSettings,
        device: &Device,
        source: Source,
        adapters: Option<Arc<crate::lora::Adapters>>,
        (names, vars): (Vec<String>, Vec<Var>),
        host_masters: bool,
    ) -> std::result::Result<Self, ModelError> {
        let autocast = Autocast::new(settings.precision);
        let head_chunks = settings
            .head_chunks
            .unwrap_or_else(|| head_chunks_for(&cfg, settings.batch_size, settings.seq_len));
        let loss_chunk = settings
            .loss_chunk_tokens
            .unwrap_or_else(|| ((128usize << 20) / (cfg.vocab_size * 4)).max(64));
        let rope = cfg.family.rope(
            &cfg,
            settings.seq_len.max(1),
            autocast.compute_dtype(),
            device,
        )?;
        let opt = if host_masters {
            Adam::Host(HostAdamW::new(vars.clone(), settings.adamw.clone())?)
        } else if settings.fused {
            Adam::Fused(FusedAdamW::new(vars.clone(), settings.adamw.clone())?)
        } else {
            Adam::Device(AdamW::new(vars.clone(), settings.adamw.clone())?)
        };
        let scaler = if settings.precision.needs_loss_scaling() {
            GradScaler::new(GradScalerConfig::default())
        } else {
            GradScaler::disabled()
        };
        // Last, so that no error after it leaves the context without tracking.
        let tracking_was = match source {
            Source::Resident(_) if !settings.event_tracking && !device.is_cpu() => {
                Some(candle_offload::train::set_event_tracking(device, false)?)
            }
            _ => None,
        };
        Ok(Self {
            tracking_was,
            core: Arc::new(Core {
                family: cfg.family.clone(),
                layout: cfg.layout(),
                cfg,
                autocast,
                device: device.clone(),
                rope,
                head_chunks,
                loss_chunk,
                fused: settings.fused,
                hand_backward: settings.hand_backward,
                origins: CastOrigins::default(),
                weight_grads: Mutex::new(None),
                hand_grads: Arc::new(AtomicUsize::new(0)),
                source,
                held: Mutex::new(Vec::new()),
                leaf_names: Mutex::new(HashMap::new()),
                host_grads: Mutex::new(HashMap::new()),
                host_staging: Mutex::new(candle_offload::train::HostGradients::new()),
                spare_grads: Mutex::new(HashMap::new()),
                adapters,
            }),
            opt,
            vars,
            names,
            scaler,
            checkpoint_segments: settings.checkpoint_segments,
            recomputes: 0,
            observer: None,
        })
    }

    /// The LoRA adapters being trained ([`Trainer::lora`]).
    pub fn adapters(&self) -> Option<&Arc<crate::lora::Adapters>> {
        self.core.adapters.as_ref()
    }

    /// Writes the LoRA adapters in PEFT's format into `dir` (F32), and beside them AdamW's
    /// state ([`OPTIMIZER_FILE`]: the step count and each adapter's moments; not with the
    /// unfused optimizer), which [`load_optimizer`](Self::load_optimizer) reads to resume.
    pub fn save_adapter(&self, dir: &std::path::Path) -> std::result::Result<(), ModelError> {
        let Some(a) = &self.core.adapters else {
            return Err(ModelError::Config {
                path: dir.into(),
                field: "lora".into(),
                reason: "this trainer trains every weight, not LoRA adapters".into(),
            });
        };
        crate::lora::peft::save(a, dir, DType::F32)?;
        if let Adam::Device(_) = self.opt {
            // candle-nn's AdamW keeps its state private: the adapter alone.
            return Ok(());
        }
        let path = dir.join(OPTIMIZER_FILE);
        let (step, moments) = self.moments().map_err(|e| ModelError::file(&path, e))?;
        let mut tensors = HashMap::new();
        tensors.insert(
            "step".to_string(),
            Tensor::new(&[step as i64], &Device::Cpu)?,
        );
        for ((name, var), (m, v)) in self.names.iter().zip(&self.vars).zip(moments) {
            tensors.insert(
                format!("m.{name}"),
                Tensor::from_vec(m, var.shape(), &Device::Cpu)?,
            );
            tensors.insert(
                format!("v.{name}"),
                Tensor::from_vec(v, var.shape(), &Device::Cpu)?,
            );
        }
        candle_core::safetensors::save(&tensors, &path).map_err(|e| ModelError::file(&path, e))
    }

    /// Resumes AdamW's state from `dir`'s [`OPTIMIZER_FILE`] (written by
    /// [`save_adapter`](Self::save_adapter) for the same adapters); `false` when there is none.
    pub fn load_optimizer(
        &mut self,
        dir: &std::path::Path,
    ) -> std::result::Result<bool, ModelError> {
        let path = dir.join(OPTIMIZER_FILE);
        if !path.exists() {
            return Ok(false);
        }
        let t = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| ModelError::file(&path, e))?;
        let bad = |tensor: &str, reason: &str| ModelError::Tensor {
            path: path.clone(),
            tensor: tensor.into(),
            reason: reason.into(),
        };
        let step = t
            .get("step")
            .ok_or_else(|| bad("step", "missing"))?
            .flatten_all()?
            .to_vec1::<i64>()?
            .first()
            .copied()
            .ok_or_else(|| bad("step", "empty"))?;
        let mut moments = Vec::with_capacity(self.vars.len());
        for (name, var) in self.names.iter().zip(&self.vars) {
            let get = |k: String| -> std::result::Result<Vec<f32>, ModelError> {
                let x = t.get(&k).ok_or_else(|| bad(&k, "missing"))?;
                if x.dims() != var.dims() {
                    return Err(bad(&k, "has another shape than the adapter's weight"));
                }
                Ok(x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
            };
            moments.push((get(format!("m.{name}"))?, get(format!("v.{name}"))?));
        }
        let step = usize::try_from(step).map_err(|_| bad("step", "negative"))?;
        match &mut self.opt {
            Adam::Fused(o) => o.set_moments(step, moments)?,
            Adam::Host(o) => o.set_moments(step, moments)?,
            Adam::Device(_) => {
                return Err(bad(
                    "step",
                    "candle-nn's AdamW (the unfused optimizer) cannot resume",
                ))
            }
        }
        Ok(true)
    }

    fn moments(&self) -> Result<(usize, candle_offload::kernels::optimizer::Moments)> {
        match &self.opt {
            Adam::Fused(o) => o.moments(),
            Adam::Host(o) => Ok(o.moments()),
            Adam::Device(_) => {
                candle_core::bail!(
                    "candle-nn's AdamW (the unfused optimizer) keeps its state private"
                )
            }
        }
    }

    /// The model configuration.
    pub fn config(&self) -> &Config {
        &self.core.cfg
    }

    /// The offload runtime, when weights are offloaded.
    pub fn runtime(&self) -> Option<&OffloadRuntime> {
        match &self.core.source {
            Source::Offloaded(rt) | Source::Frozen(rt) => Some(rt),
            Source::Resident(_) => None,
        }
    }

    /// The loss scaler.
    pub fn scaler(&self) -> &GradScaler {
        &self.scaler
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        match &self.opt {
            Adam::Fused(o) => o.learning_rate(),
            Adam::Device(o) => o.learning_rate(),
            Adam::Host(o) => o.learning_rate(),
        }
    }

    /// Sets the learning rate (for a schedule).
    pub fn set_learning_rate(&mut self, lr: f64) {
        match &mut self.opt {
            Adam::Fused(o) => o.set_learning_rate(lr),
            Adam::Device(o) => o.set_learning_rate(lr),
            Adam::Host(o) => o.set_learning_rate(lr),
        }
    }

    /// Number of trainable parameters.
    pub fn parameter_count(&self) -> usize {
        self.vars.iter().map(|v| v.elem_count()).sum()
    }

    /// Segments recomputed in backward passes so far.
    pub fn recomputed_segments(&self) -> usize {
        self.recomputes
    }

    /// The F32 master weights, by checkpoint name.
    pub fn named_parameters(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.names.iter().map(String::as_str).zip(&self.vars)
    }

    /// Mean cross-entropy of `inputs` (batch, seq) predicting `targets` (batch, seq), with
    /// the graph on: the forward pass of a step.
    fn forward_loss(&self, inputs: &Tensor, targets: &Tensor, ck: &Checkpointer) -> Result<Tensor> {
        let core = &self.core;
        let (b, t) = inputs.dims2()?;
        if t > core.rope.max_len() {
            candle_core::bail!(
                "sequence of {t} tokens is longer than the {} the trainer was set up for",
                core.rope.max_len()
            );
        }
        if let Some(adapters) = &core.adapters {
            // The optimizer may have changed them since the last pass.
            adapters.forget_casts();
        }
        let mask = Arc::new(Masks::new(t, 0, &core.device));
        let mut xs = core.embed(inputs)?;
        let n_layers = core.cfg.num_hidden_layers;
        if self.checkpoint_segments == 0 {
            if core.adapters.is_some() && !xs.track_op() {
                // A frozen embedding gives an input without a graph, on which a block that
                // computes its own backward pass builds none: a leaf of its own, as the
                // checkpointer gives each segment.
                xs = candle_core::Var::from_tensor(&xs)?.into_inner();
            }
            for l in 0..n_layers {
                xs = core.layer(l, &xs, &mask)?;
            }
        } else {
            for range in segment_ranges(n_layers, self.checkpoint_segments) {
                let (core, mask) = (core.clone(), mask.clone());
                xs = ck.checkpoint(
                    move |x| {
                        core.release_held()?;
                        let mut x = x.clone();
                        for l in range.clone() {
                            x = core.layer(l, &x, &mask)?;
                        }
                        Ok(x)
                    },
                    &xs,
                )?;
            }
        }
        let h = core.cfg.hidden_size;
        let n = b * t;
        let xs = xs.reshape((n, h))?;
        let targets = targets.flatten_all()?.to_dtype(DType::U32)?;
        let (targets, mask, counted) = masked_targets(&targets)?;
        if counted == 0 {
            candle_core::bail!("every target of the batch is ignored (IGNORE_TARGET)");
        }
        let chunk = core.loss_chunk.clamp(1, n);
        let total = if chunk >= n {
            core.head_loss_sum(&xs, &targets, mask.as_ref())?
        } else {
            let mut parts = Vec::new();
            for start in (0..n).step_by(chunk) {
                let len = chunk.min(n - start);
                let (core, tg) = (core.clone(), targets.narrow(0, start, len)?);
                let m = mask.as_ref().map(|m| m.narrow(0, start, len)).transpose()?;
                parts.push(ck.checkpoint(
                    move |x| {
                        core.release_held()?;
                        core.head_loss_sum(x, &tg, m.as_ref())
                    },
                    &xs.narrow(0, start, len)?,
                )?);
            }
            Tensor::stack(&parts, 0)?.sum_all()?
        };
        total / counted as f64
    }

    /// How many weight gradients the last backward pass computed by hand
    /// ([`TrainSettings::hand_backward`]) rather than through Candle's graph: 0 when no block
    /// took that path.
    pub fn hand_backward_gradients(&self) -> usize {
        self.core.hand_grads.load(Ordering::Relaxed)
    }

    /// Calls `observer` at each phase boundary of every later [`Trainer::step`] (and at the
    /// forward and backward boundaries of [`Trainer::loss_and_grads`]); `None` removes it. An
    /// error from it ends the step with that error.
    pub fn set_phase_observer(&mut self, observer: Option<PhaseObserver>) {
        self.observer = observer;
    }

    fn phase(&mut self, phase: TrainPhase) -> Result<()> {
        match &mut self.observer {
            Some(f) => f(phase),
            None => Ok(()),
        }
    }

    /// Mean loss and the F32 gradients of every master (unscaled), for tests and tools:
    /// one forward and backward pass, no optimizer step.
    pub fn loss_and_grads(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
    ) -> Result<(f32, HashMap<String, Tensor>)> {
        let (loss, grads) = self.backward(inputs, targets, 1.0)?;
        let mut out = HashMap::new();
        for (name, var) in self.names.iter().zip(&self.vars) {
            if let Some(g) = grads.get(var.as_tensor()) {
                out.insert(name.clone(), g.to_dtype(DType::F32)?);
            }
        }
        Ok((loss, out))
    }

    /// Forward and backward of `scale * loss`; gradients keyed by the master variables.
    fn backward(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        scale: f64,
    ) -> Result<(f32, GradStore)> {
        let _span = tracing::debug_span!("train.backward").entered();
        let core = self.core.clone();
        core.leaf_names.lock().map_err(poisoned)?.clear();
        core.host_grads.lock().map_err(poisoned)?.clear();
        let offloaded = matches!(core.source, Source::Offloaded(_));
        let ck = if let Source::Offloaded(rt) = &core.source {
            let sink_core = core.clone();
            // What the plan reserves for activations: the most the pool may keep cached.
            let keep = rt.budget().reserve_bytes;
            Checkpointer::with_sink(Arc::new(move |g: GradStore| {
                sink_core.absorb(&g)?;
                drop(g);
                // The segment's activations are gone: what the pool caches beyond the
                // activations' reserve goes back to the driver, so that blocks freed in one
                // segment's shapes do not add to the next one's peak (the budget is measured
                // outside the allocator), while a steady step maps no memory afresh.
                candle_offload::diag::trim_memory_pool_to(&sink_core.device, keep)
            }))
        } else {
            Checkpointer::new()
        };
        core.origins.clear()?;
        core.hand_grads.store(0, Ordering::Relaxed);
        if !offloaded && core.fused && core.hand_backward {
            // A weight's gradient, from a block's own backward pass, goes to its F32 master
            // through the checkpointer's side store, which `backward` merges. Under LoRA the
            // blocks hand over their adapters' gradients, keyed by the variables themselves
            // (the F32 masters the layers were given); otherwise the served weight's master.
            let adapters: Option<std::collections::HashSet<_>> = core
                .adapters
                .as_ref()
                .map(|_| self.vars.iter().map(|v| v.as_tensor().id()).collect());
            let (origins, side, count) =
                (core.origins.clone(), ck.clone(), core.hand_grads.clone());
            let sink: WeightGradSink = Arc::new(move |served: &Tensor, grad: Tensor| {
                count.fetch_add(1, Ordering::Relaxed);
                let master = match &adapters {
                    Some(ids) => ids.contains(&served.id()).then(|| served.clone()),
                    None => origins.master_of(served)?,
                };
                let master = master.ok_or_else(|| {
                    candle_core::Error::Msg(
                        "a block handed over the gradient of a weight the trainer does not train"
                            .into(),
                    )
                })?;
                side.add_gradient(&master, grad.to_dtype(DType::F32)?)
            });
            *core.weight_grads.lock().map_err(poisoned)? = Some(sink);
        }
        self.phase(TrainPhase::Forward)?;
        let loss = self.forward_loss(inputs, targets, &ck);
        self.phase(TrainPhase::Backward)?;
        let grads = loss.and_then(|loss| {
            let scaled = if scale == 1.0 {
                loss.clone()
            } else {
                loss.affine(scale, 0.)?
            };
            Ok((loss, ck.backward(&scaled)))
        });
        // The sink holds the checkpointer: gone with this step, whatever happened.
        *core.weight_grads.lock().map_err(poisoned)? = None;
        core.origins.clear()?;
        let (loss, grads) = grads?;
        let grads = grads?;
        self.recomputes += ck.recomputed_segments();
        core.release_held()?;
        let loss_value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        if !offloaded {
            return Ok((loss_value, grads));
        }
        core.absorb(&grads)?;
        drop(grads);
        let mut host = core.host_grads.lock().map_err(poisoned)?;
        let mut out = GradStore::default();
        for (name, var) in self.names.iter().zip(&self.vars) {
            if let Some(g) = host.remove(name) {
                out.insert(var.as_tensor(), g);
            }
        }
        Ok((loss_value, out))
    }

    /// One training step on `inputs` (batch, seq) predicting `targets` (batch, seq): forward,
    /// backward (scaled under F16), unscale, AdamW unless a gradient overflowed, and, when
    /// offloaded, the updated weights written back to the host store.
    pub fn step(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<StepReport> {
        let _span = tracing::debug_span!("train.step").entered();
        let scale = self.scaler.scale();
        let (loss, grads) = self.backward(inputs, targets, scale)?;
        self.phase(TrainPhase::Optimizer)?;
        // Offloaded: the host sums, kept for the next step once the optimizer is done with
        // them (it keeps no reference; `loss_and_grads` hands its sums out and keeps none).
        let spares: Vec<(String, Tensor)> = match self.core.source {
            Source::Offloaded(_) => self
                .names
                .iter()
                .zip(&self.vars)
                .filter_map(|(n, v)| grads.get(v.as_tensor()).map(|g| (n.clone(), g.clone())))
                .collect(),
            Source::Resident(_) | Source::Frozen(_) => Vec::new(),
        };
        let outcome = match &mut self.opt {
            Adam::Fused(o) => self.scaler.step_fused(o, &self.vars, grads)?,
            Adam::Device(o) => self.scaler.step_owned(o, &self.vars, grads)?,
            Adam::Host(o) => self.scaler.step_owned(o, &self.vars, grads)?,
        };
        self.core
            .spare_grads
            .lock()
            .map_err(poisoned)?
            .extend(spares);
        if let (Source::Offloaded(rt), true) = (&self.core.source, outcome.applied()) {
            let _span = tracing::debug_span!("train.write_back").entered();
            let values: Vec<(String, Tensor)> = self
                .names
                .iter()
                .zip(&self.vars)
                .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                .collect();
            rt.update_weights(&values)?;
        }
        self.phase(TrainPhase::Done)?;
        Ok(StepReport {
            loss,
            outcome,
            tokens: masked_targets(&targets.flatten_all()?.to_dtype(DType::U32)?)?.2,
        })
    }

    /// The master weights in `dtype` on the host, under their checkpoint names.
    pub fn weights(&self, dtype: DType) -> Result<Vec<(String, Tensor)>> {
        self.names
            .iter()
            .zip(&self.vars)
            .map(|(n, v)| {
                Ok((
                    n.clone(),
                    v.as_tensor().to_dtype(dtype)?.to_device(&Device::Cpu)?,
                ))
            })
            .collect()
    }

    /// Writes the master weights as one safetensors file in `dtype`, under their checkpoint
    /// names.
    pub fn save_safetensors(&self, path: &std::path::Path, dtype: DType) -> Result<()> {
        let tensors: HashMap<String, Tensor> = self.weights(dtype)?.into_iter().collect();
        candle_core::safetensors::save(&tensors, path)
    }
}
