//! The model flags `generate` and `serve` share (model, tokenizer, dtype, device, budget,
//! host layers, quantization, LoRA, offload settings), and the steps that load a model with
//! them: the memory settings, the tokenizer, then the store and the model.
//!
//! The pipeline flags (`--devices`, device maps) stay with `generate`, which plans the map
//! and passes it to [`LoadArgs::build`].

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device};
use candle_offload::placement::DeviceMap;
use candle_offload::{MemoryLimit, OffloadStrategy, PolicyChoice, Settings, Tuning};
use candle_offload_models::batching;
use candle_offload_models::llama::DeviceMapChoice;
use candle_offload_models::loader::{self, ModelFiles};
use candle_offload_models::quantize;
use candle_offload_models::{HostLayers, Llama, OffloadSettings, Tokenizer};
use clap::builder::PossibleValuesParser;
use clap::ValueEnum;

use crate::flags;

/// `--policy`: the model's own layer sweep, or one of the library's learned policies.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Policy {
    /// Belady over the model's layer sweep (the default for generation).
    Schedule,
    /// Least recently used.
    Lru,
}

/// The flags that say which model to load and how.
#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    #[command(flatten)]
    pub model: crate::ModelArgs,
    /// The tokenizer: a tokenizer.json, or a GGUF file whose vocabulary to use. Overrides the
    /// model's tokenizer.json and the tokenizer stored in a GGUF model (which is otherwise
    /// rebuilt from its metadata: SentencePiece `llama` and byte-level BPE `gpt2`).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Compute dtype: f32, f16 or bf16 (default: f16 on a GPU, f32 on the CPU).
    #[arg(long, value_parser = flags::float_dtype)]
    pub dtype: Option<DType>,
    /// Dequantize a GGUF file's quantized weights to dense ones. By default they stay GGML
    /// blocks: the layer projections and the head are multiplied as blocks, embedding rows
    /// dequantized on lookup, on the CPU and the GPU.
    #[arg(long)]
    pub dequantize: bool,
    /// On the CPU, quantize the activations to 8-bit blocks before each quantized matmul, as
    /// llama.cpp does (its arithmetic and greedy tokens; integer dot products). By default the
    /// blocks multiply F32 activations and give what the dequantized model gives.
    #[arg(long, conflicts_with = "dequantize")]
    pub q8_activations: bool,
    /// On a GPU, run the Candle op compositions instead of the library's fused ops (attention
    /// over the KV cache, one-pass projections, RMSNorm with the residual add, SiLU · mul,
    /// RoPE of q and k): the decode step as it was before them, for comparison. The CPU runs
    /// the compositions anyway.
    #[arg(long)]
    pub unfused: bool,
    /// Keep a GGUF file's quantized weights as GGML blocks: the default, accepted for older
    /// command lines.
    #[arg(long, hide = true, conflicts_with = "dequantize")]
    pub quantized: bool,
    /// Quantize a safetensors model's layer projections to this GGML type on load and
    /// multiply them as blocks, on the CPU or the GPU. The result is cached as a GGUF next to the
    /// model (`candle-offload.<type>.gguf`), so later runs read that file instead.
    #[arg(long, value_name = "TYPE", conflicts_with_all = ["quantized", "dequantize"],
          value_parser = PossibleValuesParser::new(quantize::TYPES.map(|(n, _)| n)))]
    pub quantize: Option<String>,
    /// A LoRA adapter directory (PEFT's `adapter_config.json` and `adapter_model.safetensors`),
    /// run unmerged beside the frozen weights (dense or GGML blocks); no host layers then.
    #[arg(long, value_name = "DIR")]
    pub lora: Option<PathBuf>,
    /// With `--lora`: fold the adapter into the weights before running (dense weights in their
    /// dtype; GGML blocks dequantized, merged and quantized again, with the error that adds).
    #[arg(long, requires = "lora")]
    pub merge: bool,
    /// Run on the CPU.
    #[arg(long)]
    pub cpu: bool,
    /// GPU ordinal (one device).
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Run the first decoder layers on the host CPU instead of streaming them to the GPU
    /// (llama.cpp's split): `auto` (the fewest that let the GPU hold the rest, none when the
    /// model fits), a count, `spread:N` (N layers spread evenly, so that the CPU computes while
    /// the GPU's copy stream brings the streamed layers in between), `spread:auto` (a count
    /// that balances the layers' compute, one layer timed on this CPU and on the GPU, against
    /// the link's copies, and whether the output head runs on the CPU too, as llama.cpp's
    /// `-ngl` below the layer count + 1 places it; the default: none when the model fits or
    /// runs on the CPU), `spread:N+head` (N spread layers and the head on the CPU), or `none`
    /// (stream what does not fit).
    #[arg(long, default_value = "spread:auto")]
    pub host_layers: HostLayers,
    /// Offload weights to host memory (with the budget below, or the free GPU memory).
    #[arg(long)]
    pub offload: bool,
    /// GPU memory budget: GiB (`3.5`), or `3.5GiB`, `3GB`, `50%`; with --devices one per
    /// device (`4,6`) or one for all. Implies --offload.
    #[arg(long, allow_hyphen_values = true)]
    pub gpu_memory_limit: Option<String>,
    /// Host memory for the weights: GiB (`12`), `12GiB`, or a share of RAM (`50%`); a
    /// model's layers past it (safetensors or GGUF) stay in the file and are read from disk on
    /// every fetch. Default: 3/4 of RAM (or `memory.max_cpu_memory` in --config).
    #[arg(long)]
    pub cpu_memory_limit: Option<String>,
    /// How weights reach the GPU: `explicit` (copied from pinned host memory on a copy
    /// stream, the default; streams what does not fit) or `managed` (CUDA Unified Memory,
    /// migrated to the GPU by prefetch before first use; only for a model that fits the budget,
    /// and a GPU with concurrent managed access).
    #[arg(long, default_value = "explicit")]
    pub engine: String,
    /// How much stays resident: minimal, balanced or aggressive offloading.
    #[arg(long)]
    pub offload_strategy: Option<OffloadStrategy>,
    /// Eviction policy.
    #[arg(long, value_enum, default_value = "schedule")]
    pub policy: Policy,
    /// Copies that may run ahead of their victims' release (0 moves the fewest bytes, at most
    /// 3).
    #[arg(long, default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(0..=candle_offload::MAX_PREFETCH_DEPTH as u64))]
    pub prefetch_depth: u64,
    /// A mixture-of-experts model's expert cache on the GPU: `lru`, `lfu` (least frequently
    /// used, each use counting half after 256 accesses of its layer) or `lfu:HALF_LIFE`.
    #[arg(long, default_value = "lru")]
    pub expert_policy: candle_offload::experts::ExpertPolicy,
    /// Where a mixture-of-experts model's experts missing from the GPU's cache run: `auto`
    /// (on a GPU, when the budget does not hold every expert, each layer's missing experts
    /// split between the host CPU and fetches over the link, as a cost model prices them; where
    /// every expert of GGML blocks fits, a cache of them all, fetched with the load, so that
    /// the GPU chooses a decode row's experts unless --expert-route host), `on` (the same, on
    /// any device), `fetch` (the cache as for `on`, every missing expert fetched, none on the
    /// host CPU) or `off` (no expert cache: every one fetched as any other weight).
    #[arg(long, default_value = "auto")]
    pub expert_split: candle_offload::experts::ExpertSplit,
    /// In a decode step, prefetch the experts the next mixture-of-experts layer's router picks
    /// for the current layer's input (on by default; `--expert-prefetch false` turns it off).
    #[arg(long, num_args = 0..=1, default_value_t = true, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub expert_prefetch: bool,
    /// With --expert-prefetch, how many of the next mixture-of-experts layers a decode step
    /// guesses for (each router on the current layer's input).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
    pub expert_guess_layers: u16,
    /// Who chooses a mixture-of-experts decode row's experts on a GPU with an expert cache:
    /// `auto` (the device while the cache's recent hit rate makes its misses, read from host
    /// memory over the link, cheaper than the host's wait a layer for the choice), `host`
    /// (read back each layer; missing experts split between the host CPU and the link) or
    /// `device` (always the device, where the experts' blocks allow it).
    #[arg(long, default_value = "auto")]
    pub expert_route: candle_offload::experts::ExpertRoute,
    /// Which experts a decode step on the device route read from host memory the expert cache
    /// takes a slot for: `always`, or `repeat` (only one missed before among its layer's last
    /// misses, as many as the layer has slots: a one-off expert is not also copied).
    #[arg(long, default_value = "always")]
    pub expert_admit: candle_offload::experts::ExpertAdmission,
    /// How a mixture-of-experts model's expert cache spreads its slots over the layers:
    /// `spread` (as many in every layer) or `layers` (whole layers, the last first, as
    /// llama.cpp's `--n-cpu-moe` places them; the rest of the experts on the host CPU).
    #[arg(long, default_value = "spread")]
    pub expert_slots: candle_offload::experts::ExpertSlots,
    /// Settings file (YAML): `memory.offload_strategy`, `memory.max_gpu_memory`,
    /// `memory.max_cpu_memory` and a `tuning:` section (docs/tuning.md).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

/// The memory settings and tuning of a run, from the settings file, the environment and
/// the flags.
#[derive(Debug, Clone)]
pub struct MemoryPlan {
    /// The settings file's, with the flags over it.
    pub settings: Settings,
    /// The performance choices (fitted to the model when it is built).
    pub tuning: Tuning,
    /// The offload strategy, if any was asked for.
    pub strategy: Option<OffloadStrategy>,
    /// The budget of the first device.
    pub limit: Option<MemoryLimit>,
    /// One budget per device, as `--gpu-memory-limit` gave them (empty: none given).
    pub limits: Vec<MemoryLimit>,
}

/// Where and how [`LoadArgs::build`] builds the model.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    /// The device (the first stage's, with a device map).
    pub device: &'a Device,
    /// A pipeline's device map and its devices.
    pub device_map: Option<(&'a DeviceMap, &'a [Device])>,
    /// A rank's share of a multi-process pipeline: the split over the ranks
    /// ([`candle_offload_models::CausalLm::plan_ranks`]) and the transport; only this rank's
    /// units are loaded, on `device`.
    pub rank: Option<(&'a DeviceMap, Arc<dyn candle_offload::dist::Transport>)>,
    /// The compute dtype.
    pub dtype: DType,
    /// The longest prompt pass (rows of one forward pass).
    pub prompt_len: usize,
    /// Positions a sequence may reach.
    pub max_len: usize,
    /// Device bytes to keep beyond the model's own reservation (another batch's KV caches).
    pub extra_reserve: u64,
}

/// Sets `RAYON_NUM_THREADS` (when unset) to the thread count Candle picks, before any thread
/// starts. Candle 0.11.1 asks for that count on every dense CPU matmul, and where the kernel
/// exposes no `cpu_capacity` (most VMs) it counts physical cores by reading `/proc/cpuinfo`
/// each time: some 60 reads per decode step, a quarter of a 135M model's step on 2 cores.
/// With the variable set it reads the variable instead; the count is the same.
pub fn pin_cpu_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

impl LoadArgs {
    /// The settings file, the tuning (the environment's overrides over the file's over this
    /// host's defaults) and the GPU budgets for `devices`.
    pub fn memory(&self, devices: &[Device]) -> Result<MemoryPlan> {
        let settings = match &self.config {
            Some(p) => Settings::from_file(p)?,
            None => Settings::default(),
        };
        // Performance choices: the defaults for this host, the settings file's `tuning:` over
        // them, the environment's overrides over both (docs/tuning.md).
        // Fitted to the host once the weights say whether the model is a mixture of experts.
        let mut tuning = crate::tuning_env::tuning_from_env(settings.tuning.unwrap_or_default());
        if self.q8_activations {
            tuning.kernels.cpu_q8_activations = true;
        }
        let (mut strategy, mut limit) = (settings.offload_strategy, settings.max_gpu_memory);
        let mut limits = Vec::new();
        if let Some(s) = &self.gpu_memory_limit {
            for part in s.split(',') {
                limits.push(MemoryLimit::parse("--gpu-memory-limit", part)?);
            }
            if limits.len() > 1 && limits.len() != devices.len() {
                bail!(
                    "--gpu-memory-limit has {} values for {} device(s): give one, or one per --devices entry",
                    limits.len(),
                    devices.len()
                );
            }
            limit = limits.first().copied();
        }
        if self.offload_strategy.is_some() {
            strategy = self.offload_strategy;
        }
        let on_cpu = devices.first().is_none_or(Device::is_cpu);
        if limit.is_none() && (self.offload || strategy.is_some()) && !on_cpu {
            limit = Some(MemoryLimit::FractionOfDevice(0.9));
        }
        Ok(MemoryPlan {
            settings,
            tuning,
            strategy,
            limit,
            limits,
        })
    }

    /// The compute dtype on `device`: `--dtype`, else F32 on the CPU and F16 on a GPU.
    pub fn dtype_on(&self, device: &Device) -> DType {
        match self.dtype {
            Some(d) => d,
            None if device.is_cpu() => DType::F32,
            None => DType::F16,
        }
    }

    /// [`build`](Self::build) for continuous batching (`serve`,
    /// [`candle_offload_models::batching::Batcher`]) on one `device`: sequences of up to `ctx`
    /// positions, steps of up to [`batching::STEP_TOKENS`] rows, and on a GPU the batch's KV
    /// caches (`kv_bytes` in all) reserved beside the weights, less the one sequence's the
    /// model reserves itself; the whole head computed, as requests mix greedy and sampled
    /// decoding. `rank`: a rank's share of a multi-process pipeline (the split over the ranks
    /// and the transport); `None`: the whole model.
    pub fn build_batched(
        &self,
        files: &ModelFiles,
        plan: &MemoryPlan,
        device: &Device,
        ctx: usize,
        kv_bytes: u64,
        rank: Option<(&DeviceMap, Arc<dyn candle_offload::dist::Transport>)>,
    ) -> Result<Llama> {
        let dtype = self.dtype_on(device);
        let per_seq = files.config.kv_cache_bytes(ctx, dtype);
        let model = self.build(
            files,
            plan,
            &Target {
                device,
                device_map: None,
                rank,
                dtype,
                prompt_len: batching::STEP_TOKENS.min(ctx),
                max_len: ctx,
                extra_reserve: if device.is_cpu() {
                    0
                } else {
                    kv_bytes.saturating_sub(per_seq)
                },
            },
        )?;
        model.set_greedy_head(false);
        Ok(model)
    }

    /// The model's tokenizer (or `--tokenizer`'s).
    pub fn tokenizer(&self, files: &ModelFiles) -> Result<Tokenizer> {
        candle_offload_models::tokenizer::load(files, self.tokenizer.as_deref()).map_err(|e| {
            match &self.tokenizer {
                Some(_) => anyhow!("--tokenizer: {e}"),
                None => e.into(),
            }
        })
    }

    /// Loads the weights of `files` (quantized on load, with a LoRA adapter, as the flags
    /// say), builds the model on `target`, and copies its resident weights in; says on
    /// stderr what it did.
    pub fn build(
        &self,
        files: &ModelFiles,
        plan: &MemoryPlan,
        target: &Target<'_>,
    ) -> Result<Llama> {
        let cfg = files.config.clone();
        let device = target.device;
        let t0 = std::time::Instant::now();
        let host_memory_limit = match &self.cpu_memory_limit {
            Some(s) => Some(MemoryLimit::parse("--cpu-memory-limit", s)?),
            None => plan.settings.max_cpu_memory,
        };
        let engine: candle_offload::EngineKind = self
            .engine
            .parse()
            .map_err(|e| anyhow!("--engine {}: {e}", self.engine))?;
        // A CPU runtime keeps its own copy of every unit it fetches (all of them, once): the
        // store reads each from the model's file instead of holding a second copy, unless a
        // host cap, quantization on load or an adapter asks for the store's own.
        let file_backed = device.is_cpu()
            && host_memory_limit.is_none()
            && self.quantize.is_none()
            && self.lora.is_none();
        let store_cfg = candle_offload::StoreConfig {
            dtype: Some(target.dtype),
            host_memory_limit,
            engine,
            disk_reads: plan.tuning.disk,
            file_backed,
            // Through the page cache: a second run reads it from memory, as an mmap would.
            disk_page_cache: file_backed,
            only_units: target.rank.as_ref().and_then(|(map, t)| {
                let layers = map.devices.get(t.rank())?.layers();
                Some(Llama::rank_units(&cfg, layers))
            }),
            ..Default::default()
        };
        let store = match &self.quantize {
            Some(name) => {
                let ty = quantize::parse_type(name)
                    .ok_or_else(|| anyhow!("--quantize {name}: not a quantize type"))?;
                Arc::new(quantize_on_load(files, ty, &store_cfg, device)?)
            }
            None => Arc::new(loader::load_store_config(
                files,
                &store_cfg,
                device,
                !self.dequantize,
            )?),
        };
        let mut host_layers_choice = self.host_layers;
        let mut adapters = None;
        let store = match &self.lora {
            None => store,
            Some(dir) => {
                let a = candle_offload_models::lora::peft::load(dir, &cfg, device)?;
                eprintln!(
                    "LoRA adapter {}: {} modules, {} parameters",
                    dir.display(),
                    a.modules().len(),
                    a.parameter_count()
                );
                if self.merge {
                    let t = std::time::Instant::now();
                    let merge_cfg = candle_offload::StoreConfig {
                        grouping: cfg.layout().grouping(),
                        ..store_cfg.clone()
                    };
                    let (merged, report) = candle_offload_models::lora::merge::merge_store(
                        &store, &a, &merge_cfg, device,
                    )?;
                    eprintln!(
                        "merged in {:.1} s: {} dense weights, {} re-quantized (the largest error \
                         re-quantizing added: rel L2 {:.3e})",
                        t.elapsed().as_secs_f64(),
                        report.dense,
                        report.requantized.len(),
                        report.max_requant_rel_l2()
                    );
                    drop(store);
                    Arc::new(merged)
                } else {
                    if host_layers_choice != HostLayers::None {
                        eprintln!("LoRA unmerged: no host layers (--host-layers ignored)");
                        host_layers_choice = HostLayers::None;
                    }
                    adapters = Some(Arc::new(a));
                    store
                }
            }
        };
        let blocks = store.ggml_tensor_count();
        eprintln!(
            "weights: {:.2} GiB in {} units ({:.2} GiB pinned, {blocks} tensors as GGML blocks), loaded in {:.1} s",
            store.total_bytes() as f64 / 2f64.powi(30),
            store.units().len(),
            store.pinned_bytes() as f64 / 2f64.powi(30),
            t0.elapsed().as_secs_f64()
        );
        let experts = store
            .units()
            .iter()
            .any(|u| u.tensors().iter().any(|t| t.name.contains(".experts.")));
        let tuning = plan.tuning.fitted_to_model(experts);
        let policy = match self.policy {
            Policy::Schedule => PolicyChoice::Auto,
            Policy::Lru => PolicyChoice::Lru,
        };
        let settings = OffloadSettings {
            gpu_memory_limit: plan.limit,
            strategy: plan.strategy.unwrap_or_default(),
            prefetch_depth: self.prefetch_depth as usize,
            policy,
            tuning,
            reserve_bytes: target.extra_reserve,
            experts: candle_offload::experts::ExpertOptions::new(
                self.expert_policy,
                self.expert_split,
            )
            .with_prefetch(self.expert_prefetch)
            .with_guess_layers(usize::from(self.expert_guess_layers))
            .with_route(self.expert_route)
            .with_admission(self.expert_admit)
            .with_slots(self.expert_slots),
            ..Default::default()
        };
        if target.rank.is_some() && host_layers_choice != HostLayers::None {
            // A rank runs its layers on its own device.
            host_layers_choice = HostLayers::None;
        }
        let mut model = match (&target.rank, target.device_map) {
            (Some((map, transport)), _) => Llama::builder(files, store)
                .rank(device, map, transport.clone())
                .dtype(target.dtype)
                .max_len(target.max_len)
                .settings(settings)
                .build()?,
            (None, Some((map, devices))) => Llama::builder(files, store)
                .devices(devices)
                .device_map(DeviceMapChoice::Planned(map.clone()))
                .dtype(target.dtype)
                .max_len(target.max_len)
                .settings(settings)
                .build()?,
            (None, None) => Llama::builder(files, store)
                .device(device)
                .dtype(target.dtype)
                .prompt_len(target.prompt_len)
                .max_len(target.max_len)
                .settings(settings)
                .host_layers(host_layers_choice)
                .build()?,
        };
        model.set_adapters(adapters)?;
        if self.unfused {
            model.set_fused(false);
        }
        if let Some(x) = model.expert_stats() {
            let n = x.experts_per_layer;
            let cached = match self.expert_slots {
                candle_offload::experts::ExpertSlots::Layers => format!(
                    "every expert of {} layers and {} of the next",
                    x.slots.iter().filter(|&&s| s == n).count(),
                    x.slots
                        .iter()
                        .copied()
                        .find(|&s| s > 0 && s < n)
                        .unwrap_or(0),
                ),
                candle_offload::experts::ExpertSlots::Spread => format!(
                    "{} of {n} experts per layer",
                    x.slots.iter().copied().max().unwrap_or(0)
                ),
            };
            eprintln!(
                "experts: dense part {:.2} GiB on the GPU; {cached} cached there ({:.1} MiB \
                 each, {:?}); the others on {} CPU threads or fetched",
                x.dense_bytes as f64 / 2f64.powi(30),
                x.expert_bytes as f64 / 2f64.powi(20),
                self.expert_policy,
                tuning.threads(),
            );
        }
        // The weights that stay resident are copied in now, with the load, not in the prompt's
        // step (llama.cpp, too, has its weights in place before it times a prompt).
        let t_warm = std::time::Instant::now();
        let warmed = model.warm_up()?;
        if warmed > 0 {
            // Over every stage (a host stage's layers too); a GPU's copies may still be finishing.
            eprintln!(
                "resident: {:.2} GiB fetched before the prompt in {:.2} s",
                warmed as f64 / 2f64.powi(30),
                t_warm.elapsed().as_secs_f64()
            );
        }
        let host_layers = model.host_layer_count();
        if host_layers > 0 {
            let which = match self.host_layers {
                HostLayers::Spread(_) | HostLayers::SpreadAuto | HostLayers::SpreadWithHead(_) => {
                    "spread over the model"
                }
                _ => "the first ones",
            };
            eprintln!("host layers: {host_layers} decoder layers ({which}) run on the CPU");
        }
        if model.head_on_host() {
            eprintln!("host head: the final norm and the output head run on the CPU");
        }
        Ok(model)
    }
}

/// `--quantize`: the store of `files` with its projections quantized to `ty`, from the cached
/// GGUF or quantized now under a progress bar.
fn quantize_on_load(
    files: &ModelFiles,
    ty: candle_core::quantized::GgmlDType,
    cfg: &candle_offload::StoreConfig,
    device: &Device,
) -> Result<candle_offload::HostStore> {
    let style = indicatif::ProgressStyle::with_template(
        "quantizing {bar:30} {binary_bytes}/{binary_total_bytes} [{elapsed_precise}<{eta_precise}] {wide_msg}",
    )
    .map_err(|e| anyhow!("progress bar template: {e}"))?;
    let bar: std::sync::OnceLock<indicatif::ProgressBar> = std::sync::OnceLock::new();
    let progress = |p: &quantize::Progress<'_>| {
        let b = bar
            .get_or_init(|| indicatif::ProgressBar::new(p.total_bytes).with_style(style.clone()));
        b.set_position(p.done_bytes);
        b.set_message(p.tensor.to_string());
        std::ops::ControlFlow::Continue(())
    };
    let opts = quantize::QuantizeOptions {
        progress: Some(&progress),
        ..Default::default()
    };
    let (store, cached) = quantize::load_store_config(files, ty, cfg, device, &opts)?;
    if let Some(b) = bar.get() {
        b.finish_and_clear();
    }
    let how = match &cached.state {
        quantize::CacheState::Hit => "read from the cache".to_string(),
        quantize::CacheState::Built => format!("{} tensors quantized", cached.requantized),
        quantize::CacheState::Rebuilt { reason } => format!(
            "{} tensors quantized again (the cache was {reason})",
            cached.requantized
        ),
        other => format!("{other:?}"),
    };
    eprintln!(
        "quantized weights ({}): {}, {how}",
        quantize::type_name(ty).unwrap_or("?"),
        cached.path.display()
    );
    Ok(store)
}
