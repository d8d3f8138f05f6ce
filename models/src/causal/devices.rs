//! A model over several devices as a pipeline (layer sharding): its units as the placement
//! planner sizes them, the device map planned before any weight is loaded (or written by hand
//! and checked), and one offload runtime per device that runs a layer, each with its own
//! budget, reservation, copy stream and schedule over the shared host store.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};
use candle_offload::placement::{
    plan_placement, DeviceBudget, DeviceMap, PlacementMode, PlacementRequest,
};
use candle_offload::{HostStore, MemoryLimit, OffloadRuntime, UnitId};

use super::model::CausalLm;
use super::reserve::{declare_reservation, device_budget, stage_config, OffloadSettings};
use crate::error::ModelError;
use crate::family::Config;

/// The planner's name for the output head of an HF-layout model with tied embeddings (the
/// embedding matrix, kept a second time on the last stage); see
/// [`Layout::tied_head_name`](crate::Layout::tied_head_name).
pub const TIED_HEAD: &str = "model.embed_tokens (tied output head)";

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

/// How [`CausalLm::plan_devices`] (and a builder over several devices,
/// [`CausalLmBuilder::device_map`](crate::CausalLmBuilder::device_map)) decides the device map.
#[derive(Debug, Clone)]
pub enum DeviceMapChoice {
    /// Planned in this mode (`--device-map sequential|balanced`).
    Mode(PlacementMode),
    /// Given (`--device-map plan.json`), checked against the model and budgets.
    Map(DeviceMap),
    /// Planned already ([`CausalLm::plan_devices`]'s answer, printed or saved before the
    /// weights load): used as it is.
    Planned(DeviceMap),
}

impl Default for DeviceMapChoice {
    /// Planned in the default mode ([`PlacementMode::default`]).
    fn default() -> Self {
        Self::Mode(PlacementMode::default())
    }
}

/// What [`CausalLm::plan_devices`] plans a device map for.
#[derive(Debug, Clone, Copy)]
pub struct DeviceMapRequest<'a> {
    /// The devices, in pipeline order.
    pub devices: &'a [Device],
    /// The per-device budgets (`None`: the memory free on a GPU, no limit on a CPU); a single
    /// entry applies to every device.
    pub limits: &'a [Option<MemoryLimit>],
    /// The weights' dtype.
    pub dtype: DType,
    /// The longest prompt: each device reserves the activations of a pass of this many rows.
    pub prompt_len: usize,
    /// The positions in all: each device reserves its own layers' KV cache for this many.
    pub max_len: usize,
    /// A mode, a map written by hand (checked against the model and budgets), or a map
    /// planned already.
    pub choice: &'a DeviceMapChoice,
    /// The prefetch depth each device streams at.
    pub prefetch_depth: usize,
}

impl CausalLm {
    /// The units of a model of `cfg` with weights in `dtype`, for placement: `(pre, layers,
    /// post)` with their bytes, computed from the configuration alone (nothing is loaded). With
    /// tied embeddings the output head is the embedding matrix again, listed in `post` under
    /// [`Layout::tied_head_name`](crate::Layout::tied_head_name) (the last stage keeps its own
    /// copy).
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

    /// Plans which of the request's devices runs which layers of a model of `cfg`, before any
    /// weight is loaded: each device reserves the activations for prompts of `prompt_len`
    /// tokens and the KV cache of its own layers for `max_len` positions, within its limit
    /// ([`DeviceMapRequest`]). A map planned already ([`DeviceMapChoice::Planned`]) comes back
    /// as it is.
    pub fn plan_devices(
        cfg: &Config,
        request: &DeviceMapRequest<'_>,
    ) -> Result<DeviceMap, ModelError> {
        let DeviceMapRequest {
            devices,
            limits,
            choice,
            ..
        } = *request;
        if let DeviceMapChoice::Planned(map) = choice {
            return Ok(map.clone());
        }
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
        let mut budgets = Vec::with_capacity(devices.len());
        for (i, dev) in devices.iter().enumerate() {
            let limit = limits.get(i).or(limits.first()).copied().flatten();
            budgets.push((device_ordinal(dev, i), device_budget(dev, limit)?));
        }
        Self::plan_budgets(cfg, &budgets, request)
    }

    /// [`plan_devices`](Self::plan_devices) over budgets already resolved: `(ordinal, bytes)`
    /// per device in pipeline order (a multi-process run's ranks, each of which resolved its
    /// own). The request's `devices` and `limits` are not used.
    pub(super) fn plan_budgets(
        cfg: &Config,
        budgets: &[(usize, u64)],
        request: &DeviceMapRequest<'_>,
    ) -> Result<DeviceMap, ModelError> {
        let DeviceMapRequest {
            dtype,
            prompt_len,
            max_len,
            choice,
            prefetch_depth,
            ..
        } = *request;
        if let DeviceMapChoice::Planned(map) = choice {
            return Ok(map.clone());
        }
        let units = Self::placement_units(cfg, dtype);
        let reserve = cfg.reserve_bytes(prompt_len, max_len, dtype);
        let kv_all = cfg.kv_cache_bytes(max_len, dtype).min(reserve);
        let kv_per_layer = kv_all / cfg.num_hidden_layers.max(1) as u64;
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
                    DeviceMapChoice::Map(_) | DeviceMapChoice::Planned(_) => {
                        PlacementMode::Sequential
                    }
                },
                prefetch_depth,
            };
            match choice {
                DeviceMapChoice::Mode(_) => plan_placement(&req),
                DeviceMapChoice::Map(map) | DeviceMapChoice::Planned(map) => map.validate(&req),
            }
        };
        // First with every device reserving the whole KV cache (always enough), then with each
        // reserving only its own layers' share, kept if every device still has what it needs.
        let full = plan(&request(&vec![reserve; budgets.len()]))?;
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
}

/// A model over its weights in `store`, run as a pipeline over `devices` as `map` says (from
/// [`CausalLm::plan_devices`]): `settings` gives the strategy, depth and policy (its memory
/// limit is the map's business); `source` names the weights in errors.
#[derive(Clone)]
pub(super) struct Pipeline<'a> {
    pub(super) cfg: &'a Config,
    pub(super) store: &'a Arc<HostStore>,
    pub(super) devices: &'a [Device],
    pub(super) map: &'a DeviceMap,
    pub(super) dtype: DType,
    pub(super) max_len: usize,
    pub(super) settings: &'a OffloadSettings,
    pub(super) source: &'a Path,
    /// The layers the map's devices run: every layer, or a rank's share of a multi-process
    /// run (`ranks.rs`).
    pub(super) span: std::ops::Range<usize>,
}

impl Pipeline<'_> {
    /// One offload runtime per device with a layer, each with its own budget, reservation,
    /// copy stream and schedule, over the shared store.
    pub(super) fn build(&self) -> Result<CausalLm, ModelError> {
        let Pipeline {
            cfg,
            store,
            devices,
            map,
            dtype,
            max_len,
            settings,
            source,
            ref span,
        } = *self;
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
            served.extend(layers.clone().flat_map(|l| layout.units_of(l)));
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
        let mut model =
            CausalLm::assemble_span(cfg.clone(), stages, span.clone(), dtype, max_len, source)?;
        model.reserve_by_phase(map.decode_share_bytes);
        model.device_map = Some(map.clone());
        Ok(model)
    }
}

/// The ordinal a device map uses for `device`: the GPU's, or the position for a CPU.
pub(super) fn device_ordinal(device: &Device, position: usize) -> usize {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
        _ => position,
    }
}
