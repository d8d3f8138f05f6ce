//! The one way to build a [`CausalLm`]: [`CausalLm::builder`] takes the model (its
//! configuration, from the loader's [`ModelFiles`] or an application's own [`Config`]) and its
//! weights in a host store; the builder's methods say where it runs (one device, with host
//! layers in front where asked; a pipeline over several devices; or runtimes of the caller's
//! own), under which budgets and tuning, in which dtype and for which prompt and context
//! lengths. [`build`](CausalLmBuilder::build) sizes the reservations, plans the split or the
//! device map and makes the runtimes.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device};
use candle_offload::plan::spread::HostLayers;
use candle_offload::{HostStore, MemoryLimit, OffloadRuntime, Tuning};

use super::devices::{DeviceMapChoice, DeviceMapRequest, Pipeline};
use super::model::CausalLm;
use super::reserve::{OffloadSettings, OnDevice};
use crate::error::ModelError;
use crate::family::Config;
use crate::files::ModelFiles;

/// What a model is built from: its configuration, and the path that errors about its weights
/// name. From the loader's [`ModelFiles`] (the weights' path), or from a [`Config`] of an
/// application's own (a placeholder path, until
/// [`CausalLmBuilder::source_path`] names one).
#[derive(Debug, Clone)]
pub struct ModelSource {
    config: Config,
    path: PathBuf,
}

impl ModelSource {
    /// `config`, its weights named `path` in errors.
    pub fn new(config: Config, path: impl Into<PathBuf>) -> Self {
        Self {
            config,
            path: path.into(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }
}

/// What errors name where the weights have no path of their own.
const STORE_PATH: &str = "<host store>";

impl From<Config> for ModelSource {
    fn from(config: Config) -> Self {
        Self::new(config, STORE_PATH)
    }
}

impl From<&Config> for ModelSource {
    fn from(config: &Config) -> Self {
        Self::new(config.clone(), STORE_PATH)
    }
}

impl From<&ModelFiles> for ModelSource {
    fn from(files: &ModelFiles) -> Self {
        Self::new(files.config.clone(), files.weights_path())
    }
}

/// Where the model runs.
#[derive(Debug)]
enum Target {
    /// One device, with host layers in front where asked.
    Device(Device),
    /// A pipeline over several devices.
    Devices(Vec<Device>),
    /// Runtimes of the caller's own, each with the contiguous layers it runs.
    Runtimes(Vec<(OffloadRuntime, Range<usize>)>),
    /// This process's share of a multi-process pipeline.
    Rank(super::ranks::RankTarget),
}

/// Builds a [`CausalLm`] ([`CausalLm::builder`]). Every method has a default: on the CPU, in
/// F32, for the model's whole context (`max_position_embeddings`) and prompts as long, under
/// [`OffloadSettings::default`] (no memory limit of its own: a GPU's free memory), with no host
/// layers. Where the target is set more than once, the last call wins.
#[derive(Debug)]
#[must_use = "a builder does nothing until `build`"]
pub struct CausalLmBuilder {
    source: ModelSource,
    store: Arc<HostStore>,
    target: Target,
    device_map: DeviceMapChoice,
    settings: OffloadSettings,
    budgets: Vec<MemoryLimit>,
    host: HostLayers,
    dtype: DType,
    prompt_len: Option<usize>,
    max_len: Option<usize>,
}

impl CausalLm {
    /// A builder for the model of `source` (the loader's `&ModelFiles`, or a [`Config`]) over
    /// its weights in `store`:
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use candle_core::{DType, Device};
    /// use candle_offload::{MemoryLimit, StoreConfig, Tuning};
    /// use candle_offload_models::{loader, CausalLm, HostLayers};
    ///
    /// let device = Device::new_cuda(0)?;
    /// let files = loader::resolve("HuggingFaceTB/SmolLM2-135M", None, false)?;
    /// let store = loader::load_store_config(&files, &StoreConfig::default(), &device, true)?;
    /// let model = CausalLm::builder(&files, Arc::new(store))
    ///     .device(&device)
    ///     .gpu_memory_limit(MemoryLimit::gib(4.0))
    ///     .host_layers(HostLayers::Auto)
    ///     .tuning(Tuning::for_host())
    ///     .dtype(DType::F16)
    ///     .prompt_len(512)
    ///     .max_len(1024)
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(source: impl Into<ModelSource>, store: Arc<HostStore>) -> CausalLmBuilder {
        CausalLmBuilder {
            source: source.into(),
            store,
            target: Target::Device(Device::Cpu),
            device_map: DeviceMapChoice::default(),
            settings: OffloadSettings::default(),
            budgets: Vec::new(),
            host: HostLayers::None,
            dtype: DType::F32,
            prompt_len: None,
            max_len: None,
        }
    }
}

impl CausalLmBuilder {
    /// The path that errors about the weights name (the loader's weights path for
    /// `&ModelFiles`; a placeholder for a [`Config`]).
    pub fn source_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.source.path = path.into();
        self
    }

    /// Runs on `device` (default: the CPU), with [`host_layers`](Self::host_layers) on the
    /// host CPU in front of it where asked. The budget reserves the KV cache and activations
    /// for prompts of [`prompt_len`](Self::prompt_len) tokens and
    /// [`max_len`](Self::max_len) positions in all, the non-layer units stay resident, and the
    /// policy follows the model's sweep unless the [`settings`](Self::settings) name another.
    pub fn device(mut self, device: &Device) -> Self {
        self.target = Target::Device(device.clone());
        self
    }

    /// Runs as a pipeline over `devices` (layer sharding), as the
    /// [`device_map`](Self::device_map) choice places the layers: one offload runtime per
    /// device with a layer, each with its own budget ([`budgets`](Self::budgets), or the one
    /// [`gpu_memory_limit`](Self::gpu_memory_limit) for all), reservation, copy stream and
    /// schedule. The settings give the strategy, depth and policy.
    pub fn devices(mut self, devices: &[Device]) -> Self {
        self.target = Target::Devices(devices.to_vec());
        self
    }

    /// Runs this process's share of a pipeline over the ranks of `transport`, on `device`:
    /// the layers `map` (from [`CausalLm::plan_ranks`]) gives its rank, the embeddings where
    /// that is rank 0, the final norm and the head where it is the last rank. The store needs
    /// only those units ([`CausalLm::rank_units`]). Run it with
    /// [`generate_ranks`](crate::generation::generate_ranks).
    pub fn rank(
        mut self,
        device: &Device,
        map: &candle_offload::placement::DeviceMap,
        transport: Arc<dyn candle_offload::dist::Transport>,
    ) -> Self {
        self.target = Target::Rank(super::ranks::RankTarget {
            device: device.clone(),
            map: map.clone(),
            transport,
        });
        self
    }

    /// How a pipeline over [`devices`](Self::devices) places its layers (default: planned in
    /// the default mode, [`DeviceMapChoice::default`]); [`DeviceMapChoice::Planned`] takes a
    /// map from [`CausalLm::plan_devices`] as it is.
    pub fn device_map(mut self, choice: DeviceMapChoice) -> Self {
        self.device_map = choice;
        self
    }

    /// Runs on `rt`, a runtime of the caller's own over the same store, used as it is: no
    /// reservation, kept units or policy of the model's (what a test that sets the runtime's
    /// budget itself wants).
    pub fn runtime(self, rt: OffloadRuntime) -> Self {
        let n = self.source.config.num_hidden_layers;
        self.runtimes(vec![(rt, 0..n)])
    }

    /// Runs as a pipeline over runtimes of the caller's own, each over the same store and
    /// running a contiguous range of layers, the ranges in order and covering every layer
    /// (the first stage also runs the embeddings, the last the final norm and the output head).
    pub fn runtimes(mut self, stages: Vec<(OffloadRuntime, Range<usize>)>) -> Self {
        self.target = Target::Runtimes(stages);
        self
    }

    /// The runtime settings the model's runtimes start from ([`OffloadSettings`]: budget,
    /// strategy, prefetch depth, policy, tuning, extra reservation). Replaces the settings
    /// whole: set it before [`gpu_memory_limit`](Self::gpu_memory_limit) and
    /// [`tuning`](Self::tuning).
    pub fn settings(mut self, settings: OffloadSettings) -> Self {
        self.settings = settings;
        self
    }

    /// The device memory the model may use on its device (each device of a pipeline without
    /// [`budgets`](Self::budgets)); the settings' `gpu_memory_limit`. Default: none of its
    /// own, the memory free on a GPU.
    pub fn gpu_memory_limit(mut self, limit: MemoryLimit) -> Self {
        self.settings.gpu_memory_limit = Some(limit);
        self
    }

    /// One budget per device of a pipeline ([`devices`](Self::devices)), in their order; a
    /// single one applies to every device.
    pub fn budgets(mut self, limits: &[MemoryLimit]) -> Self {
        self.budgets = limits.to_vec();
        self
    }

    /// How many layers run on the host CPU in front of the [`device`](Self::device)
    /// ([`HostLayers`]; default none). When the split gives no host layer (always for
    /// [`HostLayers::Auto`] on a CPU device), the model is the device's alone.
    pub fn host_layers(mut self, host: HostLayers) -> Self {
        self.host = host;
        self
    }

    /// The performance choices the runtimes and ops run with (the settings' `tuning`; default
    /// [`Tuning::default`]).
    pub fn tuning(mut self, tuning: Tuning) -> Self {
        self.settings.tuning = tuning;
        self
    }

    /// The compute dtype (default F32).
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// The longest prompt the budget reserves a pass's activations for (default: the whole
    /// context, [`max_len`](Self::max_len)).
    pub fn prompt_len(mut self, tokens: usize) -> Self {
        self.prompt_len = Some(tokens);
        self
    }

    /// The positions in all, prompt and generated tokens: the RoPE tables and the KV cache's
    /// reservation (default: the model's `max_position_embeddings`, which also bounds it).
    pub fn max_len(mut self, positions: usize) -> Self {
        self.max_len = Some(positions);
        self
    }

    /// The model. Every tensor is checked (present, shape, float dtype) before anything runs;
    /// errors about the weights name the [`source_path`](Self::source_path).
    pub fn build(self) -> Result<CausalLm, ModelError> {
        let cfg = &self.source.config;
        let source = self.source.path.as_path();
        let max_len = self.max_len.unwrap_or(cfg.max_position_embeddings);
        let prompt_len = self.prompt_len.unwrap_or(max_len);
        let invalid = |field: &str, reason: String| -> ModelError {
            candle_offload::Error::InvalidConfig {
                field: field.into(),
                reason,
            }
            .into()
        };
        if !matches!(self.target, Target::Device(_)) && self.host != HostLayers::None {
            return Err(invalid(
                "host_layers",
                "host layers run in front of one device; build on one device for them".into(),
            ));
        }
        match self.target {
            Target::Rank(target) => target.build(
                cfg,
                &self.store,
                self.dtype,
                max_len,
                &self.settings,
                source,
            ),
            Target::Runtimes(stages) => {
                if let Some((i, _)) = stages
                    .iter()
                    .enumerate()
                    .find(|(_, (rt, _))| !Arc::ptr_eq(rt.store(), &self.store))
                {
                    return Err(ModelError::Config {
                        path: source.into(),
                        field: format!("stages[{i}]"),
                        reason: "every stage must share the builder's host store".into(),
                    });
                }
                CausalLm::assemble(cfg.clone(), stages, self.dtype, max_len, source)
            }
            Target::Device(device) => {
                let mut settings = self.settings;
                match self.budgets.as_slice() {
                    [] => {}
                    [one] => settings.gpu_memory_limit = Some(*one),
                    more => {
                        return Err(invalid(
                            "gpu_memory_limit",
                            format!("{} budgets for one device: give one", more.len()),
                        ))
                    }
                }
                OnDevice {
                    cfg,
                    store: &self.store,
                    device: &device,
                    dtype: self.dtype,
                    prompt_len,
                    max_len,
                    settings: &settings,
                    source,
                }
                .with_host(self.host)
            }
            Target::Devices(devices) => {
                let limits: Vec<Option<MemoryLimit>> = if self.budgets.is_empty() {
                    vec![self.settings.gpu_memory_limit]
                } else {
                    self.budgets.iter().copied().map(Some).collect()
                };
                let map = CausalLm::plan_devices(
                    cfg,
                    &DeviceMapRequest {
                        devices: &devices,
                        limits: &limits,
                        dtype: self.dtype,
                        prompt_len,
                        max_len,
                        choice: &self.device_map,
                        prefetch_depth: self.settings.prefetch_depth,
                    },
                )?;
                Pipeline {
                    cfg,
                    store: &self.store,
                    devices: &devices,
                    map: &map,
                    dtype: self.dtype,
                    max_len,
                    settings: &self.settings,
                    source,
                    span: 0..cfg.num_hidden_layers,
                }
                .build()
            }
        }
    }
}
