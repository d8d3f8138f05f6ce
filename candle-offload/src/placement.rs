//! Which GPU runs which layers when several share a model: a pure placement planner.
//!
//! # The model of placement
//! A decoder is a sequence of units in execution order: `pre` units (the embeddings), `N`
//! layers, then `post` units (the final norm, the output head). With several GPUs the model runs
//! as a pipeline: each device gets one **contiguous** range of layers, the ranges follow the
//! order in which the devices are given, so the hidden state crosses between GPUs at most
//! `D - 1` times per forward. The `pre` units are kept resident on the first device that has
//! layers, the `post` units on the last one; a device with no layers holds nothing.
//!
//! On each device (a *stage*) the layers are either resident or streamed from pinned host
//! memory by that device's own offload runtime. A stage's room for weights is its budget minus
//! the reservation the caller declares for it (activations, KV cache, workspace). Its room is
//! split exactly as [`plan_capacity`] splits a single device's budget (strategy `minimal`):
//! - if its kept units and all its layers fit, every layer is resident and nothing streams;
//! - otherwise the stage streams, and needs the streaming floor: its kept units plus
//!   `depth + 1` of its largest layer (the one in use and `depth` in flight), at the deepest
//!   `depth` up to the one asked for that fits. Layers are then marked resident in order while
//!   they fit beside the floor (first fit); the others are streamed.
//!
//! # When a placement is impossible
//! A stage is *possible* when `reserve + kept + largest layer <= budget` (the floor at depth 0,
//! the same test [`plan_capacity`] refuses with). A device map is possible when every device
//! with layers is a possible stage.
//! - [`PlacementMode::Sequential`] is refused exactly when **no** contiguous assignment of the
//!   layers to the devices (in order, some devices possibly empty) has only possible stages.
//!   The error reports, per device, the MiB missing in the assignment that is cheapest to fix
//!   (least bytes added over all devices): adding them makes a placement possible.
//! - [`PlacementMode::Balanced`] fixes the layer counts, so it is refused exactly when one of
//!   its stages is not possible; each device's missing MiB are its own stage's.
//!
//! Missing MiB are what makes a placement possible at prefetch depth 0; a deeper prefetch may
//! want more, and is shallowed per device as [`plan_capacity`] does.
//!
//! # Modes
//! - **Sequential** (`device_map = "sequential"`): GPU 0 takes as many layers as it can hold
//!   resident (with the embeddings), then GPU 1, and so on. Layers that fit nowhere are
//!   streamed through the last device that has layers (its range is extended to the end),
//!   or, when that one cannot stream them, through the first device that can, tried in this
//!   order: later devices, then earlier ones from the nearest (devices after the streaming one
//!   then get nothing). A device that can stream at the depth asked for is preferred to one
//!   that would have to prefetch less. Only when no single device can stream the tail (layers
//!   of very different sizes, or a last device that holds the head beside a small last layer
//!   only), the assignment with the most resident bytes is searched for among all contiguous
//!   ones; there a middle device, or several, may stream.
//! - **Balanced** (`device_map = "balanced"`): layer counts differ by at most one, the first
//!   devices taking the extra layers (with fewer layers than devices, the last ones get none);
//!   each device streams what does not fit in its room.
//!
//! With one device both modes give one stage holding everything, with the capacity and depth
//! [`plan_capacity`] gives for it.
//!
//! A [`DeviceMap`] is printed before any weight is loaded, saved as JSON, and a map written by
//! hand can be checked and completed with [`DeviceMap::validate`].

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::budget::mib_ceil;
use crate::budget::Budget;
#[cfg(any(doc, test))]
use crate::plan::plan_capacity;
use crate::plan::{OffloadStrategy, WeightNeed, MAX_PREFETCH_DEPTH};

/// Why a device map could not be made, read or checked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// No device map places the model's layers within the devices' budgets (see the
    /// [module documentation](self) for when exactly a placement is impossible).
    #[error("no {mode} device map fits: {}; {reason}", missing_list(.per_device))]
    Impossible {
        /// The placement mode asked for.
        mode: PlacementMode,
        /// For each device (its ordinal), the MiB to add to its budget so that a placement
        /// exists; zero for a device that needs nothing more.
        per_device: Vec<(usize, u64)>,
        /// Which device must hold what.
        reason: String,
    },

    /// A device map (given by the user, e.g. `--device-map plan.json`) that is malformed or does
    /// not fit the model or the devices.
    #[error("invalid device map {map}: {field}: {reason}")]
    InvalidDeviceMap {
        /// Where the map came from (its file, or "(in memory)").
        map: String,
        /// The offending field, as a path (`devices[1].first_layer`, `units[4].device`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A malformed request: no device, no layer, a device listed twice, a unit name used twice,
    /// a prefetch depth over [`MAX_PREFETCH_DEPTH`], an unknown mode.
    #[error("invalid value for {field}: {reason}")]
    InvalidRequest {
        /// The field of the request (`devices`, `prefetch_depth`, `device_map`, ...).
        field: String,
        /// Why it was refused.
        reason: String,
    },

    /// A device map file that cannot be read.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// `Result` with a [`PlacementError`].
pub type Result<T> = std::result::Result<T, PlacementError>;

/// "GPU 0 needs 812 MiB more, GPU 1 needs 0 MiB more".
fn missing_list(per_device: &[(usize, u64)]) -> String {
    let parts: Vec<String> = per_device
        .iter()
        .map(|(ordinal, mib)| format!("GPU {ordinal} needs {mib} MiB more"))
        .collect();
    parts.join(", ")
}

/// How layers are spread over the devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlacementMode {
    /// Fill GPU 0 with resident layers, then GPU 1, ...; stream the rest through one device.
    #[default]
    Sequential,
    /// As many layers on each device (within one); each streams what does not fit.
    Balanced,
}

impl FromStr for PlacementMode {
    type Err = PlacementError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sequential" => Ok(Self::Sequential),
            "balanced" => Ok(Self::Balanced),
            other => Err(PlacementError::InvalidRequest {
                field: "device_map".into(),
                reason: format!("{other:?} is not one of sequential, balanced"),
            }),
        }
    }
}

impl fmt::Display for PlacementMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Sequential => "sequential",
            Self::Balanced => "balanced",
        })
    }
}

/// One device's memory, already resolved to bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBudget {
    /// The CUDA ordinal (`cuda:N`).
    pub ordinal: usize,
    /// Everything the runtime and the caller may use on the device.
    pub budget_bytes: u64,
    /// What the caller keeps on it for activations, KV cache and workspace.
    pub reserve_bytes: u64,
}

impl DeviceBudget {
    /// A device budget.
    pub fn new(ordinal: usize, budget_bytes: u64, reserve_bytes: u64) -> Self {
        Self {
            ordinal,
            budget_bytes,
            reserve_bytes,
        }
    }

    /// As a [`Budget`], for [`plan_capacity`] and the runtime.
    pub fn budget(&self) -> Budget {
        Budget {
            limit_bytes: self.budget_bytes,
            reserve_bytes: self.reserve_bytes,
        }
    }

    /// Whether the reservation plus `bytes` of weights fit.
    fn fits(&self, bytes: u64) -> bool {
        self.budget().fits(bytes)
    }

    /// Bytes over the budget when the reservation plus `bytes` are placed (zero when they fit).
    fn missing(&self, bytes: u64) -> u64 {
        self.budget().missing(bytes)
    }
}

/// What to place: the model's units, the devices in pipeline order, the mode and the depth.
#[derive(Debug, Clone, Copy)]
pub struct PlacementRequest<'a> {
    /// Units before the layers (embeddings), `(name, bytes)`; kept on the first stage.
    pub pre: &'a [(String, u64)],
    /// The layers in execution order, `(name, bytes)`.
    pub layers: &'a [(String, u64)],
    /// Units after the layers (final norm, output head); kept on the last stage.
    pub post: &'a [(String, u64)],
    /// The devices, in pipeline order.
    pub devices: &'a [DeviceBudget],
    /// How to spread the layers.
    pub mode: PlacementMode,
    /// Prefetch depth asked for on every streaming device (at most [`MAX_PREFETCH_DEPTH`]).
    pub prefetch_depth: usize,
}

/// Whether a unit stays on its device, or is brought there when used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Residency {
    /// A pre or post unit: loaded once, never evicted.
    Kept,
    /// A layer that stays on its device.
    Resident,
    /// A layer streamed from host memory through its device at every pass.
    #[default]
    Streamed,
}

/// One device's share of a [`DeviceMap`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicePlacement {
    /// The CUDA ordinal.
    pub ordinal: usize,
    /// The device's budget, in bytes.
    #[serde(default)]
    pub budget_bytes: u64,
    /// The caller's reservation on it, in bytes.
    #[serde(default)]
    pub reserve_bytes: u64,
    /// The first layer it runs (for a device without layers, where its range would start).
    pub first_layer: usize,
    /// How many consecutive layers it runs.
    pub layer_count: usize,
    /// The pre and post units it keeps.
    #[serde(default)]
    pub kept: Vec<String>,
    /// How many of its layers stay resident; the others are streamed.
    #[serde(default)]
    pub resident_layers: usize,
    /// Whether it streams layers (and so holds the streaming floor).
    #[serde(default)]
    pub streams: bool,
    /// The prefetch depth its runtime uses (as [`plan_capacity`] gives it).
    #[serde(default)]
    pub prefetch_depth: usize,
    /// Bytes its residency cache may fill (kept, resident and in flight), as [`plan_capacity`]
    /// gives it.
    #[serde(default)]
    pub weight_capacity: u64,
}

impl DevicePlacement {
    /// Its layers, as indices into the model's layers.
    pub fn layers(&self) -> Range<usize> {
        self.first_layer..self.first_layer.saturating_add(self.layer_count)
    }

    /// How many of its layers are streamed.
    pub fn streamed_layers(&self) -> usize {
        self.layer_count.saturating_sub(self.resident_layers)
    }
}

/// Where one unit is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnitPlacement {
    /// The unit's name.
    pub name: String,
    /// Its size in bytes (0 in a hand-written map: not checked).
    #[serde(default)]
    pub bytes: u64,
    /// The ordinal of the device that runs it.
    pub device: usize,
    /// Kept, resident or streamed.
    #[serde(default)]
    pub residency: Residency,
}

/// Which device runs which units: the result of [`plan_placement`], or a map read from a file
/// and checked with [`DeviceMap::validate`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceMap {
    /// The mode that made it (`None` for a map written by hand).
    #[serde(default)]
    pub mode: Option<PlacementMode>,
    /// The prefetch depth asked for.
    #[serde(default)]
    pub prefetch_depth: usize,
    /// Every device, in pipeline order (including those without layers).
    pub devices: Vec<DevicePlacement>,
    /// Every unit in execution order: pre units, layers, post units (may be left out of a
    /// hand-written map).
    #[serde(default)]
    pub units: Vec<UnitPlacement>,
    /// Where it was read from, for messages.
    #[serde(skip)]
    source: Option<String>,
}

impl PartialEq for DeviceMap {
    /// Compares the placements; where the maps were read from does not matter.
    fn eq(&self, other: &Self) -> bool {
        self.mode == other.mode
            && self.prefetch_depth == other.prefetch_depth
            && self.devices == other.devices
            && self.units == other.units
    }
}

impl Eq for DeviceMap {}

/// Places the layers of `req` on its devices, or says how many MiB each device is missing.
///
/// See the [module documentation](self) for the modes and for when a placement is refused
/// ([`PlacementError::Impossible`]). Malformed requests (no device, no layer, a device listed
/// twice, a unit name used twice, a prefetch depth over [`MAX_PREFETCH_DEPTH`]) are refused with
/// [`PlacementError::InvalidRequest`].
pub fn plan_placement(req: &PlacementRequest<'_>) -> Result<DeviceMap> {
    let m = Model::new(req)?;
    let counts = match req.mode {
        PlacementMode::Sequential => sequential(&m)?.0,
        PlacementMode::Balanced => balanced(&m)?,
    };
    m.build(Some(req.mode), &counts, None)
}

impl DeviceMap {
    /// The map as pretty-printed JSON (what `--device-map plan.json` reads back).
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| PlacementError::InvalidRequest {
            field: "device_map".into(),
            reason: format!("cannot be written as JSON: {e}"),
        })
    }

    /// Reads a map from JSON text; `source_name` names it in errors, which also name the
    /// offending field (`devices[1].first_layer`). The map still has to be checked against the
    /// model with [`validate`](Self::validate).
    pub fn from_json(text: &str, source_name: &str) -> Result<Self> {
        match serde_json::from_str::<DeviceMap>(text) {
            Ok(mut map) => {
                map.source = Some(source_name.to_string());
                Ok(map)
            }
            Err(e) => Err(PlacementError::InvalidDeviceMap {
                map: source_name.to_string(),
                field: locate_json_error(text).unwrap_or_else(|| "device map".to_string()),
                reason: e.to_string(),
            }),
        }
    }

    /// Reads a map from a JSON file (see [`from_json`](Self::from_json)).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| PlacementError::File {
            path: path.into(),
            reason: format!("cannot read the device map: {e}"),
        })?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// Where the map was read from, if it was.
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }

    /// Checks a map (typically written by hand) against the model's units and the devices'
    /// budgets, and returns it re-planned: budgets, kept units, resident counts, depths and
    /// capacities are recomputed from `req`, only the layer ranges are taken from the map.
    ///
    /// Refused with [`PlacementError::InvalidDeviceMap`] naming the field: a device not in `req`, listed
    /// twice or out of `req`'s order; a layer on no device, on two, or past the model's end; in
    /// `units` (when given) an unknown or repeated unit, a wrong size, a unit missing, layers of
    /// one device that are not contiguous, or a device that disagrees with the ranges; a device
    /// that cannot hold its reservation, kept units and largest layer (with the MiB missing).
    pub fn validate(&self, req: &PlacementRequest<'_>) -> Result<DeviceMap> {
        let m = Model::new(req)?;
        let what = self
            .source
            .clone()
            .unwrap_or_else(|| "(in memory)".to_string());
        let err = |field: String, reason: String| PlacementError::InvalidDeviceMap {
            map: what.clone(),
            field,
            reason,
        };
        let n = m.n();
        let devices = req.devices;
        let known = || {
            let v: Vec<String> = devices.iter().map(|d| d.ordinal.to_string()).collect();
            v.join(", ")
        };
        let position = |ordinal: usize| devices.iter().position(|d| d.ordinal == ordinal);

        // The devices and their ranges.
        let mut counts = vec![0usize; devices.len()];
        let mut map_index: Vec<Option<usize>> = vec![None; devices.len()];
        let mut previous: Option<(usize, usize)> = None;
        let mut cursor = 0usize;
        for (k, d) in self.devices.iter().enumerate() {
            let pos = position(d.ordinal).ok_or_else(|| {
                err(
                    format!("devices[{k}].ordinal"),
                    format!("GPU {} is not one of the devices ({})", d.ordinal, known()),
                )
            })?;
            if let Some((pk, pp)) = previous {
                if pos == pp {
                    return Err(err(
                        format!("devices[{k}].ordinal"),
                        format!("GPU {} is listed twice (devices[{pk}])", d.ordinal),
                    ));
                }
                if pos < pp {
                    return Err(err(
                        format!("devices[{k}].ordinal"),
                        format!(
                            "GPU {} comes after GPU {} here but before it in the devices' order \
                             ({}); list the devices in that order",
                            d.ordinal,
                            devices[pp].ordinal,
                            known()
                        ),
                    ));
                }
            }
            previous = Some((k, pos));
            map_index[pos] = Some(k);
        }
        for (k, d) in self.devices.iter().enumerate() {
            if d.layer_count == 0 {
                continue;
            }
            let Some(pos) = position(d.ordinal) else {
                continue;
            };
            let end = d
                .first_layer
                .checked_add(d.layer_count)
                .filter(|&e| e <= n)
                .ok_or_else(|| {
                    err(
                        format!("devices[{k}].layer_count"),
                        format!(
                            "{} layers from layer {} go past the model's {n} layers",
                            d.layer_count, d.first_layer
                        ),
                    )
                })?;
            if d.first_layer > cursor {
                return Err(err(
                    format!("devices[{k}].first_layer"),
                    format!(
                        "{} on no device: each layer must be on exactly one",
                        m.describe_layers(cursor..d.first_layer)
                    ),
                ));
            }
            if d.first_layer < cursor {
                return Err(err(
                    format!("devices[{k}].first_layer"),
                    format!(
                        "{} also on an earlier device: each layer must be on exactly one, \
                         in contiguous ranges in device order",
                        m.describe_layers(d.first_layer..cursor.min(end))
                    ),
                ));
            }
            counts[pos] = d.layer_count;
            cursor = end;
        }
        if cursor < n {
            return Err(err(
                "devices".to_string(),
                format!(
                    "{} on no device: each layer must be on exactly one",
                    m.describe_layers(cursor..n)
                ),
            ));
        }

        // Where each unit must be, given the ranges.
        let owners = m.owners(&counts);
        if !self.units.is_empty() {
            let expected: HashMap<&str, (usize, u64, Option<usize>)> = m
                .units()
                .zip(owners.iter())
                .map(|((name, bytes, layer), &pos)| (name, (pos, bytes, layer)))
                .collect();
            let mut seen: HashMap<&str, usize> = HashMap::new();
            let mut last_layer: Option<(usize, usize)> = None; // (layer, device position)
            let mut layer_entries: Vec<(usize, usize, usize)> = Vec::new();
            for (i, u) in self.units.iter().enumerate() {
                let Some(&(_, bytes, layer)) = expected.get(u.name.as_str()) else {
                    return Err(err(
                        format!("units[{i}].name"),
                        format!("{:?} is not a unit of this model", u.name),
                    ));
                };
                if let Some(j) = seen.insert(u.name.as_str(), i) {
                    return Err(err(
                        format!("units[{i}].name"),
                        format!("{:?} is listed twice (also units[{j}])", u.name),
                    ));
                }
                if u.bytes != 0 && u.bytes != bytes {
                    return Err(err(
                        format!("units[{i}].bytes"),
                        format!(
                            "{:?} is {} bytes here but {bytes} bytes in the model",
                            u.name, u.bytes
                        ),
                    ));
                }
                let pos = position(u.device).ok_or_else(|| {
                    err(
                        format!("units[{i}].device"),
                        format!("GPU {} is not one of the devices ({})", u.device, known()),
                    )
                })?;
                if let Some(layer) = layer {
                    layer_entries.push((layer, pos, i));
                }
            }
            layer_entries.sort_unstable();
            for &(layer, pos, i) in &layer_entries {
                if let Some((prev_layer, prev_pos)) = last_layer {
                    if pos < prev_pos {
                        return Err(err(
                            format!("units[{i}].device"),
                            format!(
                                "{} is on GPU {} but {}, before it, is on GPU {}: each GPU \
                                 must run one contiguous range of layers, in device order",
                                m.layer_name(layer),
                                devices[pos].ordinal,
                                m.layer_name(prev_layer),
                                devices[prev_pos].ordinal
                            ),
                        ));
                    }
                }
                last_layer = Some((layer, pos));
            }
            if let Some((name, _, _)) = m.units().find(|(name, _, _)| !seen.contains_key(name)) {
                return Err(err(
                    "units".to_string(),
                    format!("{name:?} is missing: every unit must be listed once"),
                ));
            }
            for (i, u) in self.units.iter().enumerate() {
                let (want, _, layer) = expected[u.name.as_str()];
                if devices[want].ordinal != u.device {
                    let why = match layer {
                        Some(_) => format!(
                            "devices[{}] gives it to GPU {}",
                            map_index[want].unwrap_or(want),
                            devices[want].ordinal
                        ),
                        None => format!(
                            "it is kept on the {} device with layers, GPU {}",
                            if m.is_pre(u.name.as_str()) {
                                "first"
                            } else {
                                "last"
                            },
                            devices[want].ordinal
                        ),
                    };
                    return Err(err(
                        format!("units[{i}].device"),
                        format!("{:?} is on GPU {} here but {why}", u.name, u.device),
                    ));
                }
            }
        }

        // Every stage must be possible.
        for (pos, range) in m.ranges(&counts).into_iter().enumerate() {
            if range.is_empty() {
                continue;
            }
            let dev = &devices[pos];
            let need = m.stage_need(range.clone());
            if !dev.fits(need.minimum()) {
                return Err(err(
                    format!("devices[{}]", map_index[pos].unwrap_or(pos)),
                    format!(
                        "GPU {} needs {} MiB more: {}",
                        dev.ordinal,
                        mib_ceil(dev.missing(need.minimum())),
                        m.stage_needs(dev, range)
                    ),
                ));
            }
        }
        m.build(self.mode, &counts, self.source.clone())
    }

    /// The stages in pipeline order: each device with layers, and its layers.
    pub fn stages(&self) -> Vec<(usize, Range<usize>)> {
        self.devices
            .iter()
            .filter(|d| d.layer_count > 0)
            .map(|d| (d.ordinal, d.layers()))
            .collect()
    }

    /// The ordinal of the device that runs layer `layer`.
    pub fn device_of_layer(&self, layer: usize) -> Option<usize> {
        self.devices
            .iter()
            .find(|d| d.layers().contains(&layer))
            .map(|d| d.ordinal)
    }

    /// The placement of device `ordinal`.
    pub fn device(&self, ordinal: usize) -> Option<&DevicePlacement> {
        self.devices.iter().find(|d| d.ordinal == ordinal)
    }

    /// The placement of the unit named `name`.
    pub fn unit(&self, name: &str) -> Option<&UnitPlacement> {
        self.units.iter().find(|u| u.name == name)
    }

    /// Bytes streamed from host memory per forward pass (every streamed layer once).
    pub fn streamed_bytes(&self) -> u64 {
        self.units
            .iter()
            .filter(|u| u.residency == Residency::Streamed)
            .map(|u| u.bytes)
            .sum()
    }
}

impl fmt::Display for DeviceMap {
    /// A table: one row per device, with its budget, reservation, layers, resident and
    /// streamed counts, kept units and weight capacity.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let layers: usize = self.devices.iter().map(|d| d.layer_count).sum();
        let mode = self
            .mode
            .map_or_else(|| "custom".to_string(), |m| m.to_string());
        writeln!(
            f,
            "device map ({mode}): {layers} layers on {} device(s), prefetch depth {}",
            self.devices.len(),
            self.prefetch_depth
        )?;
        writeln!(
            f,
            "{:>4}  {:>10}  {:>11}  {:>9}  {:>8}  {:>8}  {:>5}  {:>11}  kept",
            "dev",
            "budget MiB",
            "reserve MiB",
            "layers",
            "resident",
            "streamed",
            "depth",
            "weights MiB"
        )?;
        for d in &self.devices {
            let range = if d.layer_count == 0 {
                "-".to_string()
            } else {
                format!("{}..{}", d.first_layer, d.layers().end)
            };
            let kept = if d.kept.is_empty() {
                "-".to_string()
            } else {
                d.kept.join(", ")
            };
            let depth = if d.streams {
                d.prefetch_depth.to_string()
            } else {
                "-".to_string()
            };
            writeln!(
                f,
                "{:>4}  {:>10}  {:>11}  {:>9}  {:>8}  {:>8}  {:>5}  {:>11}  {kept}",
                d.ordinal,
                if d.budget_bytes >= u64::MAX / 8 {
                    "unlimited".to_string()
                } else {
                    mib(d.budget_bytes)
                },
                mib(d.reserve_bytes),
                range,
                d.resident_layers,
                d.streamed_layers(),
                depth,
                mib(d.weight_capacity),
            )?;
        }
        writeln!(
            f,
            "streamed per forward: {} MiB",
            mib(self.streamed_bytes())
        )
    }
}

/// Bytes as MiB for the table: whole when they are, else with one decimal.
fn mib(bytes: u64) -> String {
    if bytes % (1 << 20) == 0 {
        (bytes >> 20).to_string()
    } else {
        format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// A checked request, with the layer sizes at hand.
struct Model<'r, 'a> {
    req: &'r PlacementRequest<'a>,
    sizes: Vec<u64>,
    pre_bytes: u64,
    post_bytes: u64,
}

/// How a stage would hold its layers.
#[derive(Debug, Clone, Copy)]
struct StageFit {
    streams: bool,
    depth: usize,
    resident_bytes: u64,
}

/// Marks layers resident in order while they fit in `free` bytes.
fn first_fit(sizes: &[u64], mut free: u64) -> Vec<bool> {
    sizes
        .iter()
        .map(|&s| {
            let fits = s <= free;
            if fits {
                free -= s;
            }
            fits
        })
        .collect()
}

/// How `dev` would hold `kept` bytes of kept units and the layers `sizes`, or `None` when it
/// cannot (the reservation, the kept units and the largest layer exceed the budget).
fn fit_stage(dev: &DeviceBudget, kept: u64, sizes: &[u64], depth_req: usize) -> Option<StageFit> {
    let need = WeightNeed::new(sizes, kept);
    if !dev.fits(need.minimum()) {
        return None;
    }
    let room = dev.budget().weight_bytes();
    if need.all() <= room {
        return Some(StageFit {
            streams: false,
            depth: depth_req,
            resident_bytes: need.evictable,
        });
    }
    let depth = need.depth_that_fits(room, depth_req)?;
    let free = room - need.floor(depth);
    let resident_bytes = sizes
        .iter()
        .zip(first_fit(sizes, free))
        .filter(|(_, r)| *r)
        .map(|(&s, _)| s)
        .sum();
    Some(StageFit {
        streams: true,
        depth,
        resident_bytes,
    })
}

/// Which path the sequential planner took (for tests of its fill order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SeqPath {
    /// Everything resident.
    Resident,
    /// One device streams the tail.
    OneStreamer,
    /// Searched among all assignments.
    Search,
}

impl<'r, 'a> Model<'r, 'a> {
    fn new(req: &'r PlacementRequest<'a>) -> Result<Self> {
        let bad = |field: &str, reason: String| PlacementError::InvalidRequest {
            field: field.to_string(),
            reason,
        };
        if req.devices.is_empty() {
            return Err(bad("devices", "no device to place the model on".into()));
        }
        if req.layers.is_empty() {
            return Err(bad("layers", "the model has no layer to place".into()));
        }
        if req.prefetch_depth > MAX_PREFETCH_DEPTH {
            return Err(bad(
                "prefetch_depth",
                format!("{} is more than {MAX_PREFETCH_DEPTH}", req.prefetch_depth),
            ));
        }
        for (i, d) in req.devices.iter().enumerate() {
            if req.devices[..i].iter().any(|e| e.ordinal == d.ordinal) {
                return Err(bad("devices", format!("GPU {} is listed twice", d.ordinal)));
            }
        }
        let mut names = HashMap::new();
        for (name, _) in req.pre.iter().chain(req.layers).chain(req.post) {
            if names.insert(name.as_str(), ()).is_some() {
                return Err(bad(
                    "units",
                    format!("the unit name {name:?} is used twice"),
                ));
            }
        }
        let total = |units: &[(String, u64)]| units.iter().fold(0u64, |a, u| a.saturating_add(u.1));
        Ok(Self {
            req,
            sizes: req.layers.iter().map(|l| l.1).collect(),
            pre_bytes: total(req.pre),
            post_bytes: total(req.post),
        })
    }

    fn n(&self) -> usize {
        self.sizes.len()
    }

    /// Kept bytes of a stage running layers `start..end`.
    fn kept_bytes(&self, start: usize, end: usize) -> u64 {
        let pre = if start == 0 { self.pre_bytes } else { 0 };
        let post = if end == self.n() { self.post_bytes } else { 0 };
        pre.saturating_add(post)
    }

    fn is_pre(&self, name: &str) -> bool {
        self.req.pre.iter().any(|(n, _)| n == name)
    }

    fn layer_name(&self, layer: usize) -> String {
        format!("layer {layer} ({})", self.req.layers[layer].0)
    }

    fn describe_layers(&self, r: Range<usize>) -> String {
        if r.len() == 1 {
            format!("{} is", self.layer_name(r.start))
        } else {
            format!(
                "layers {}..{} ({} to {}) are",
                r.start,
                r.end,
                self.req.layers[r.start].0,
                self.req.layers[r.end - 1].0
            )
        }
    }

    /// Every unit in execution order: name, bytes, layer index (for layers).
    fn units(&self) -> impl Iterator<Item = (&'a str, u64, Option<usize>)> + '_ {
        let req = self.req;
        req.pre
            .iter()
            .map(|(n, b)| (n.as_str(), *b, None))
            .chain(
                req.layers
                    .iter()
                    .enumerate()
                    .map(|(i, (n, b))| (n.as_str(), *b, Some(i))),
            )
            .chain(req.post.iter().map(|(n, b)| (n.as_str(), *b, None)))
    }

    /// Each device's layers, from per-device counts that sum to the number of layers.
    fn ranges(&self, counts: &[usize]) -> Vec<Range<usize>> {
        let mut start = 0;
        counts
            .iter()
            .map(|&c| {
                let r = start..start + c;
                start += c;
                r
            })
            .collect()
    }

    /// The device position of every unit (as [`Self::units`] lists them).
    fn owners(&self, counts: &[usize]) -> Vec<usize> {
        let first = counts.iter().position(|&c| c > 0).unwrap_or(0);
        let last = counts.iter().rposition(|&c| c > 0).unwrap_or(0);
        let mut owners = vec![first; self.req.pre.len()];
        for (pos, &c) in counts.iter().enumerate() {
            owners.extend(std::iter::repeat_n(pos, c));
        }
        owners.extend(std::iter::repeat_n(last, self.req.post.len()));
        owners
    }

    /// What the stage running layers `r` needs for its weights.
    fn stage_need(&self, r: Range<usize>) -> WeightNeed {
        WeightNeed::new(&self.sizes[r.clone()], self.kept_bytes(r.start, r.end))
    }

    /// What a stage must hold, for messages.
    fn stage_needs(&self, dev: &DeviceBudget, r: Range<usize>) -> String {
        let kept = self.kept_bytes(r.start, r.end);
        let (largest_idx, largest) = self.sizes[r.clone()]
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|&(i, s)| (s, std::cmp::Reverse(i)))
            .map_or((r.start, 0), |(i, s)| (r.start + i, s));
        format!(
            "GPU {} (budget {} MiB) runs layers {}..{} and must hold its reservation ({} MiB), \
             its kept units ({} MiB) and its largest layer, {} ({} MiB)",
            dev.ordinal,
            dev.budget_bytes >> 20,
            r.start,
            r.end,
            mib_ceil(dev.reserve_bytes),
            mib_ceil(kept),
            self.req.layers[largest_idx].0,
            mib_ceil(largest)
        )
    }

    /// The refusal for per-device counts whose stages are not all possible.
    fn impossible(&self, counts: &[usize]) -> PlacementError {
        let mut per_device = Vec::new();
        let mut reasons = Vec::new();
        for (dev, r) in self.req.devices.iter().zip(self.ranges(counts)) {
            let missing = if r.is_empty() {
                0
            } else {
                dev.missing(self.stage_need(r.clone()).minimum())
            };
            if missing > 0 {
                reasons.push(self.stage_needs(dev, r));
            }
            per_device.push((dev.ordinal, mib_ceil(missing)));
        }
        PlacementError::Impossible {
            mode: self.req.mode,
            per_device,
            reason: reasons.join("; "),
        }
    }

    /// The contiguous assignment that needs the fewest bytes added to budgets (zero when one is
    /// possible), as per-device counts, and those bytes.
    fn cheapest_fix(&self) -> (Vec<usize>, u64) {
        let (n, dc) = (self.n(), self.req.devices.len());
        // cost[p][i]: placing layers i.. on devices p..; choice: where device p's range ends.
        let mut cost = vec![vec![u64::MAX; n + 1]; dc + 1];
        let mut choice = vec![vec![0usize; n + 1]; dc + 1];
        cost[dc][n] = 0;
        for p in (0..dc).rev() {
            let dev = &self.req.devices[p];
            cost[p][n] = 0;
            choice[p][n] = n;
            let (here, later) = cost.split_at_mut(p + 1);
            let (here, next) = (&mut here[p], &later[0]);
            for i in (0..n).rev() {
                let (mut best, mut best_j) = (next[i], i);
                let mut largest = 0u64;
                for (j, &rest) in next.iter().enumerate().skip(i + 1) {
                    largest = largest.max(self.sizes[j - 1]);
                    if rest == u64::MAX {
                        continue;
                    }
                    let need = WeightNeed {
                        kept: self.kept_bytes(i, j),
                        largest,
                        evictable: 0,
                    };
                    let miss = dev.missing(need.minimum());
                    let total = miss.saturating_add(rest);
                    if total <= best {
                        (best, best_j) = (total, j);
                    }
                }
                here[i] = best;
                choice[p][i] = best_j;
            }
        }
        let mut counts = Vec::with_capacity(dc);
        let mut i = 0;
        for row in choice.iter().take(dc) {
            let j = row[i];
            counts.push(j - i);
            i = j;
        }
        (counts, cost[0][0])
    }

    /// How many layers from `start` device `dev` can hold resident.
    fn resident_run(&self, dev: &DeviceBudget, start: usize) -> usize {
        let n = self.n();
        let mut sum = if start == 0 { self.pre_bytes } else { 0 };
        let mut k = 0;
        while start + k < n {
            let next = sum.saturating_add(self.sizes[start + k]);
            let post = if start + k + 1 == n {
                self.post_bytes
            } else {
                0
            };
            if !dev.fits(next.saturating_add(post)) {
                break;
            }
            sum = next;
            k += 1;
        }
        k
    }

    /// Among all contiguous assignments with possible stages, the one with the most resident
    /// bytes (ties: earlier devices take more layers).
    fn search(&self) -> Option<Vec<usize>> {
        let (n, dc) = (self.n(), self.req.devices.len());
        let mut best: Vec<Vec<Option<(u64, usize)>>> = vec![vec![None; n + 1]; dc + 1];
        best[dc][n] = Some((0, n));
        for p in (0..dc).rev() {
            let dev = &self.req.devices[p];
            best[p][n] = Some((0, n));
            let (here, later) = best.split_at_mut(p + 1);
            let (here, next) = (&mut here[p], &later[0]);
            for i in (0..n).rev() {
                let mut cur = next[i].map(|(r, _)| (r, i));
                for (j, entry) in next.iter().enumerate().skip(i + 1) {
                    let Some((rest, _)) = *entry else {
                        continue;
                    };
                    let kept = self.kept_bytes(i, j);
                    let Some(fit) =
                        fit_stage(dev, kept, &self.sizes[i..j], self.req.prefetch_depth)
                    else {
                        continue;
                    };
                    let total = rest.saturating_add(fit.resident_bytes);
                    if cur.is_none_or(|(c, _)| total >= c) {
                        cur = Some((total, j));
                    }
                }
                here[i] = cur;
            }
        }
        let mut counts = Vec::with_capacity(dc);
        let mut i = 0;
        for row in best.iter().take(dc) {
            let (_, j) = row[i]?;
            counts.push(j - i);
            i = j;
        }
        Some(counts)
    }

    /// Per-device counts of the map for `counts`, with capacities from [`plan_capacity`].
    fn build(
        &self,
        mode: Option<PlacementMode>,
        counts: &[usize],
        source: Option<String>,
    ) -> Result<DeviceMap> {
        let req = self.req;
        let n = self.n();
        let first = counts.iter().position(|&c| c > 0).unwrap_or(0);
        let last = counts.iter().rposition(|&c| c > 0).unwrap_or(0);
        let mut devices = Vec::with_capacity(counts.len());
        let mut layer_residency = vec![Residency::Streamed; n];
        for (pos, (dev, r)) in req.devices.iter().zip(self.ranges(counts)).enumerate() {
            let mut placed = DevicePlacement {
                ordinal: dev.ordinal,
                budget_bytes: dev.budget_bytes,
                reserve_bytes: dev.reserve_bytes,
                first_layer: r.start,
                layer_count: r.len(),
                kept: Vec::new(),
                resident_layers: 0,
                streams: false,
                prefetch_depth: 0,
                weight_capacity: 0,
            };
            if !r.is_empty() {
                if pos == first {
                    placed.kept.extend(req.pre.iter().map(|u| u.0.clone()));
                }
                if pos == last {
                    placed.kept.extend(req.post.iter().map(|u| u.0.clone()));
                }
                let sizes = &self.sizes[r.clone()];
                let need = self.stage_need(r.clone());
                // Split as `plan_capacity` splits one device's budget (strategy minimal).
                let Some(cap) = need.plan(
                    dev.budget().weight_bytes(),
                    OffloadStrategy::Minimal,
                    req.prefetch_depth,
                ) else {
                    return Err(self.impossible(counts));
                };
                if !cap.fits_entirely && cap.prefetch_depth < req.prefetch_depth {
                    tracing::warn!(
                        gpu = dev.ordinal,
                        asked = req.prefetch_depth,
                        depth = cap.prefetch_depth,
                        "budget too small for the prefetch depth asked; using less"
                    );
                }
                placed.streams = !cap.fits_entirely;
                placed.prefetch_depth = cap.prefetch_depth;
                placed.weight_capacity = cap.weight_capacity;
                let resident = if placed.streams {
                    first_fit(
                        sizes,
                        cap.weight_capacity
                            .saturating_sub(need.floor(cap.prefetch_depth)),
                    )
                } else {
                    vec![true; sizes.len()]
                };
                for (i, res) in r.clone().zip(resident) {
                    if res {
                        placed.resident_layers += 1;
                        layer_residency[i] = Residency::Resident;
                    }
                }
            }
            devices.push(placed);
        }
        let owners = self.owners(counts);
        let units = self
            .units()
            .zip(owners)
            .map(|((name, bytes, layer), pos)| UnitPlacement {
                name: name.to_string(),
                bytes,
                device: req.devices[pos].ordinal,
                residency: layer.map_or(Residency::Kept, |i| layer_residency[i]),
            })
            .collect();
        Ok(DeviceMap {
            mode,
            prefetch_depth: req.prefetch_depth,
            devices,
            units,
            source,
        })
    }
}

/// Sequential counts per device, and the path taken.
fn sequential(m: &Model<'_, '_>) -> Result<(Vec<usize>, SeqPath)> {
    let (fix, missing) = m.cheapest_fix();
    if missing > 0 {
        return Err(m.impossible(&fix));
    }
    let (n, devices) = (m.n(), m.req.devices);
    let dc = devices.len();
    // Resident fill, device after device.
    let mut counts = vec![0usize; dc];
    let mut starts = vec![0usize; dc];
    let mut i = 0;
    for (p, dev) in devices.iter().enumerate() {
        starts[p] = i;
        let k = m.resident_run(dev, i);
        counts[p] = k;
        i += k;
    }
    if i == n {
        return Ok((counts, SeqPath::Resident));
    }
    // One device streams the tail: the last with layers, later ones, then earlier ones.
    let candidates: Vec<usize> = match counts.iter().rposition(|&c| c > 0) {
        Some(l) => (l..dc).chain((0..l).rev()).collect(),
        None => (0..dc).collect(),
    };
    for full_depth in [true, false] {
        for &s in &candidates {
            let start = starts[s];
            let kept = m.kept_bytes(start, n);
            let Some(fit) = fit_stage(&devices[s], kept, &m.sizes[start..], m.req.prefetch_depth)
            else {
                continue;
            };
            if full_depth && fit.streams && fit.depth < m.req.prefetch_depth {
                continue;
            }
            let mut out = counts.clone();
            out[s] = n - start;
            for c in &mut out[s + 1..] {
                *c = 0;
            }
            return Ok((out, SeqPath::OneStreamer));
        }
    }
    match m.search() {
        Some(counts) => Ok((counts, SeqPath::Search)),
        None => Err(m.impossible(&fix)),
    }
}

/// Balanced counts per device.
fn balanced(m: &Model<'_, '_>) -> Result<Vec<usize>> {
    let (n, dc) = (m.n(), m.req.devices.len());
    let counts: Vec<usize> = (0..dc).map(|p| n / dc + usize::from(p < n % dc)).collect();
    let possible = m.req.devices.iter().zip(m.ranges(&counts)).all(|(dev, r)| {
        r.is_empty()
            || fit_stage(
                dev,
                m.kept_bytes(r.start, r.end),
                &m.sizes[r],
                m.req.prefetch_depth,
            )
            .is_some()
    });
    if possible {
        Ok(counts)
    } else {
        Err(m.impossible(&counts))
    }
}

/// Finds the field of a device map's JSON that does not parse, as a path
/// (`devices[1].first_layer`), when the text is valid JSON.
fn locate_json_error(text: &str) -> Option<String> {
    use serde_json::Value;
    #[derive(Clone, Copy)]
    enum Kind {
        UInt,
        Bool,
        Str,
        StrList,
        Mode,
        Residency,
    }
    fn check(v: &Value, kind: Kind) -> bool {
        match kind {
            Kind::UInt => v.is_u64(),
            Kind::Bool => v.is_boolean(),
            Kind::Str => v.is_string(),
            Kind::StrList => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
            Kind::Mode => {
                v.is_null()
                    || v.as_str()
                        .is_some_and(|s| s == "sequential" || s == "balanced")
            }
            Kind::Residency => v
                .as_str()
                .is_some_and(|s| matches!(s, "kept" | "resident" | "streamed")),
        }
    }
    fn object(v: &Value, path: &str, fields: &[(&str, Kind, bool)]) -> Option<String> {
        let Some(obj) = v.as_object() else {
            return Some(path.to_string());
        };
        for (key, value) in obj {
            match fields.iter().find(|f| f.0 == key) {
                None => return Some(format!("{path}.{key}")),
                Some(&(_, kind, _)) if !check(value, kind) => return Some(format!("{path}.{key}")),
                Some(_) => {}
            }
        }
        fields
            .iter()
            .find(|(key, _, required)| *required && !obj.contains_key(*key))
            .map(|(key, _, _)| format!("{path}.{key}"))
    }
    const DEVICE: &[(&str, Kind, bool)] = &[
        ("ordinal", Kind::UInt, true),
        ("budget_bytes", Kind::UInt, false),
        ("reserve_bytes", Kind::UInt, false),
        ("first_layer", Kind::UInt, true),
        ("layer_count", Kind::UInt, true),
        ("kept", Kind::StrList, false),
        ("resident_layers", Kind::UInt, false),
        ("streams", Kind::Bool, false),
        ("prefetch_depth", Kind::UInt, false),
        ("weight_capacity", Kind::UInt, false),
    ];
    const UNIT: &[(&str, Kind, bool)] = &[
        ("name", Kind::Str, true),
        ("bytes", Kind::UInt, false),
        ("device", Kind::UInt, true),
        ("residency", Kind::Residency, false),
    ];
    let v: Value = serde_json::from_str(text).ok()?;
    let Some(top) = v.as_object() else {
        return Some("device map".to_string());
    };
    for (key, value) in top {
        let item = match key.as_str() {
            "devices" => DEVICE,
            "units" => UNIT,
            "mode" if !check(value, Kind::Mode) => return Some(key.clone()),
            "prefetch_depth" if !check(value, Kind::UInt) => return Some(key.clone()),
            "mode" | "prefetch_depth" => continue,
            _ => return Some(key.clone()),
        };
        let Some(items) = value.as_array() else {
            return Some(key.clone());
        };
        for (i, e) in items.iter().enumerate() {
            if let Some(path) = object(e, &format!("{key}[{i}]"), item) {
                return Some(path);
            }
        }
    }
    if !top.contains_key("devices") {
        return Some("devices".to_string());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn named(prefix: &str, sizes: &[u64]) -> Vec<(String, u64)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &b)| (format!("{prefix}.{i}"), b))
            .collect()
    }

    struct Case {
        pre: Vec<(String, u64)>,
        layers: Vec<(String, u64)>,
        post: Vec<(String, u64)>,
        devices: Vec<DeviceBudget>,
        mode: PlacementMode,
        depth: usize,
    }

    impl fmt::Debug for Case {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            let sizes = |u: &[(String, u64)]| u.iter().map(|x| x.1).collect::<Vec<_>>();
            f.debug_struct("Case")
                .field("pre", &sizes(&self.pre))
                .field("layers", &sizes(&self.layers))
                .field("post", &sizes(&self.post))
                .field(
                    "devices",
                    &self
                        .devices
                        .iter()
                        .map(|d| (d.ordinal, d.budget_bytes, d.reserve_bytes))
                        .collect::<Vec<_>>(),
                )
                .field("mode", &self.mode)
                .field("depth", &self.depth)
                .finish()
        }
    }

    impl Case {
        fn req(&self) -> PlacementRequest<'_> {
            PlacementRequest {
                pre: &self.pre,
                layers: &self.layers,
                post: &self.post,
                devices: &self.devices,
                mode: self.mode,
                prefetch_depth: self.depth,
            }
        }
    }

    /// 7B-shaped: 32 layers of 386 MiB, embeddings and head of 250 MiB each.
    fn llama7b(devices: &[(u64, u64)], mode: PlacementMode, depth: usize) -> Case {
        Case {
            pre: vec![("model.embed_tokens".into(), 250 * MIB)],
            layers: (0..32)
                .map(|i| (format!("model.layers.{i}"), 386 * MIB))
                .collect(),
            post: vec![("model.norm".into(), 0), ("lm_head".into(), 250 * MIB)],
            devices: devices
                .iter()
                .enumerate()
                .map(|(i, &(b, r))| DeviceBudget::new(i, b * MIB, r * MIB))
                .collect(),
            mode,
            depth,
        }
    }

    /// Brute force: whether some contiguous assignment (all of them for sequential, the
    /// balanced one for balanced) has only possible stages.
    fn brute_possible(c: &Case) -> bool {
        let n = c.layers.len();
        let d = c.devices.len();
        let pre: u64 = c.pre.iter().map(|u| u.1).sum();
        let post: u64 = c.post.iter().map(|u| u.1).sum();
        let ok = |counts: &[usize]| {
            let mut start = 0;
            counts.iter().zip(&c.devices).all(|(&k, dev)| {
                let r = start..start + k;
                start += k;
                if r.is_empty() {
                    return true;
                }
                let mut need = c.layers[r.clone()].iter().map(|u| u.1).max().unwrap();
                if r.start == 0 {
                    need += pre;
                }
                if r.end == n {
                    need += post;
                }
                dev.reserve_bytes + need <= dev.budget_bytes
            })
        };
        match c.mode {
            PlacementMode::Balanced => {
                let counts: Vec<usize> = (0..d).map(|p| n / d + usize::from(p < n % d)).collect();
                ok(&counts)
            }
            PlacementMode::Sequential => {
                // Every composition of n into d parts.
                fn rec(
                    left: usize,
                    parts: usize,
                    acc: &mut Vec<usize>,
                    f: &dyn Fn(&[usize]) -> bool,
                ) -> bool {
                    if parts == 1 {
                        acc.push(left);
                        let r = f(acc);
                        acc.pop();
                        return r;
                    }
                    for k in 0..=left {
                        acc.push(k);
                        let r = rec(left - k, parts - 1, acc, f);
                        acc.pop();
                        if r {
                            return true;
                        }
                    }
                    false
                }
                rec(n, d, &mut Vec::new(), &ok)
            }
        }
    }

    /// Checks the invariants every map must have, for `c`.
    fn check_map(c: &Case, map: &DeviceMap) -> std::result::Result<(), TestCaseError> {
        let n = c.layers.len();
        prop_assert_eq!(map.devices.len(), c.devices.len());
        // Ranges tile the layers in device order.
        let mut cursor = 0;
        for (d, b) in map.devices.iter().zip(&c.devices) {
            prop_assert_eq!(d.ordinal, b.ordinal);
            prop_assert_eq!(d.first_layer, cursor);
            cursor += d.layer_count;
        }
        prop_assert_eq!(cursor, n);
        // Units: each once, in order, on the device of its range.
        let names: Vec<&str> = c
            .pre
            .iter()
            .chain(&c.layers)
            .chain(&c.post)
            .map(|u| u.0.as_str())
            .collect();
        let got: Vec<&str> = map.units.iter().map(|u| u.name.as_str()).collect();
        prop_assert_eq!(got, names);
        let stages = map.stages();
        prop_assert!(!stages.is_empty());
        let (first, last) = (stages[0].0, stages[stages.len() - 1].0);
        for (i, u) in map.units.iter().enumerate() {
            if i < c.pre.len() {
                prop_assert_eq!(u.device, first);
                prop_assert_eq!(u.residency, Residency::Kept);
            } else if i < c.pre.len() + n {
                prop_assert_eq!(Some(u.device), map.device_of_layer(i - c.pre.len()));
                prop_assert!(u.residency != Residency::Kept);
            } else {
                prop_assert_eq!(u.device, last);
                prop_assert_eq!(u.residency, Residency::Kept);
            }
        }
        // Never over a budget.
        for (d, b) in map.devices.iter().zip(&c.devices) {
            let mine: Vec<&UnitPlacement> =
                map.units.iter().filter(|u| u.device == d.ordinal).collect();
            if d.layer_count == 0 {
                prop_assert!(mine.is_empty() && d.kept.is_empty() && !d.streams);
                continue;
            }
            let kept: u64 = mine
                .iter()
                .filter(|u| u.residency == Residency::Kept)
                .map(|u| u.bytes)
                .sum();
            let resident: u64 = mine
                .iter()
                .filter(|u| u.residency == Residency::Resident)
                .map(|u| u.bytes)
                .sum();
            let resident_count = mine
                .iter()
                .filter(|u| u.residency == Residency::Resident)
                .count();
            prop_assert_eq!(resident_count, d.resident_layers);
            let largest = c.layers[d.layers()].iter().map(|u| u.1).max().unwrap();
            let floor = if d.streams {
                largest * (d.prefetch_depth as u64 + 1)
            } else {
                0
            };
            prop_assert!(d.streams == (d.resident_layers < d.layer_count) || largest == 0);
            prop_assert!(b.reserve_bytes + kept + resident + floor <= b.budget_bytes);
            prop_assert!(kept + resident + floor <= d.weight_capacity);
            prop_assert!(b.reserve_bytes + d.weight_capacity <= b.budget_bytes);
            prop_assert!(d.prefetch_depth <= c.depth);
        }
        Ok(())
    }

    fn arb_case() -> impl Strategy<Value = Case> {
        (
            proptest::collection::vec(1u64..3 * MIB, 0..=2),
            prop_oneof![
                (1u64..4 * MIB, 1usize..=8).prop_map(|(s, n)| vec![s; n]),
                proptest::collection::vec(0u64..4 * MIB, 1..=8),
                // Small layers and a few large ones: where one streaming device is not enough.
                proptest::collection::vec(
                    prop_oneof![3 => 1u64..MIB / 2, 1 => 3 * MIB..6 * MIB],
                    1..=8
                ),
            ],
            proptest::collection::vec(0u64..3 * MIB, 0..=2),
            proptest::collection::vec((0u64..24 * MIB, 0u64..2 * MIB), 1..=4),
            prop_oneof![
                Just(PlacementMode::Sequential),
                Just(PlacementMode::Balanced)
            ],
            0usize..=3,
        )
            .prop_map(|(pre, layers, post, devs, mode, depth)| Case {
                pre: named("pre", &pre),
                layers: named("layers", &layers),
                post: named("post", &post),
                devices: devs
                    .iter()
                    .enumerate()
                    .map(|(i, &(b, r))| DeviceBudget::new(3 - i, b, r))
                    .collect(),
                mode,
                depth,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn plans_are_sound_and_refused_only_when_impossible(c in arb_case()) {
            let req = c.req();
            let possible = brute_possible(&c);
            match plan_placement(&req) {
                Ok(map) => {
                    prop_assert!(possible, "planned an impossible case: {map}");
                    check_map(&c, &map)?;
                    if c.mode == PlacementMode::Balanced {
                        let counts: Vec<usize> = map.devices.iter().map(|d| d.layer_count).collect();
                        let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                        prop_assert!(hi - lo <= 1);
                        prop_assert!(counts.windows(2).all(|w| w[0] >= w[1]));
                    }
                    // JSON round trip, and a planned map validates to itself.
                    let back = DeviceMap::from_json(&map.to_json().unwrap(), "t.json").unwrap();
                    prop_assert_eq!(&back, &map);
                    prop_assert_eq!(back.validate(&req).unwrap(), map);
                }
                Err(PlacementError::Impossible { per_device, .. }) => {
                    prop_assert!(!possible);
                    prop_assert!(per_device.iter().any(|&(_, m)| m > 0));
                    // Adding what is reported makes it possible.
                    let mut bigger = c;
                    for (d, (ordinal, mib)) in bigger.devices.iter_mut().zip(&per_device) {
                        prop_assert_eq!(d.ordinal, *ordinal);
                        d.budget_bytes += mib * MIB;
                    }
                    let map = plan_placement(&bigger.req());
                    prop_assert!(map.is_ok(), "still refused: {:?}", map.err());
                    check_map(&bigger, &map.unwrap())?;
                }
                Err(other) => prop_assert!(false, "unexpected error {other}"),
            }
        }

        #[test]
        fn sequential_fills_earlier_devices_first(mut c in arb_case()) {
            c.mode = PlacementMode::Sequential;
            let req = c.req();
            let Ok(m) = Model::new(&req) else { return Ok(()) };
            let Ok((counts, path)) = sequential(&m) else { return Ok(()) };
            if path == SeqPath::Search {
                return Ok(());
            }
            let map = m.build(Some(c.mode), &counts, None).unwrap();
            let n = c.layers.len();
            let pre: u64 = c.pre.iter().map(|u| u.1).sum();
            let post: u64 = c.post.iter().map(|u| u.1).sum();
            let later_resident = |p: usize| map.devices[p + 1..].iter().any(|d| d.resident_layers > 0);
            for (p, d) in map.devices.iter().enumerate() {
                if d.streams || !later_resident(p) {
                    continue;
                }
                // Full: it could not also hold the next layer resident.
                let next = d.layers().end;
                prop_assert!(next < n);
                let mut need: u64 = c.layers[d.first_layer..=next].iter().map(|u| u.1).sum();
                if d.first_layer == 0 {
                    need += pre;
                }
                if next + 1 == n {
                    need += post;
                }
                let b = &c.devices[p];
                prop_assert!(b.reserve_bytes + need > b.budget_bytes, "GPU {} is not full: {}", d.ordinal, map);
            }
            // At most one device streams.
            prop_assert!(map.devices.iter().filter(|d| d.streams).count() <= 1);
        }

        #[test]
        fn one_device_is_plan_capacity(c in arb_case()) {
            let c = Case { devices: c.devices[..1].to_vec(), ..c };
            let req = c.req();
            let sizes: Vec<u64> = c.layers.iter().map(|u| u.1).collect();
            let kept: u64 = c.pre.iter().chain(&c.post).map(|u| u.1).sum();
            let cap = plan_capacity("cuda:0", c.devices[0].budget(), &sizes, kept, OffloadStrategy::Minimal, c.depth);
            match (plan_placement(&req), cap) {
                (Ok(map), Ok(cap)) => {
                    let d = &map.devices[0];
                    prop_assert_eq!(d.layer_count, c.layers.len());
                    prop_assert_eq!(d.weight_capacity, cap.weight_capacity);
                    prop_assert_eq!(d.prefetch_depth, cap.prefetch_depth);
                    prop_assert_eq!(d.streams, !cap.fits_entirely);
                }
                (Err(PlacementError::Impossible { per_device, .. }), Err(crate::Error::BudgetTooSmall { missing_mib, .. })) => {
                    prop_assert_eq!(per_device, vec![(c.devices[0].ordinal, missing_mib)]);
                }
                (a, b) => prop_assert!(false, "disagree: {:?} vs {:?}", a.map(|m| m.to_string()), b),
            }
        }
    }

    #[test]
    fn a_middle_device_streams_when_the_last_cannot() {
        // GPU 1 can hold the head beside the small last layer, but not beside a large one:
        // no single device can stream the tail, so GPU 0 streams the two large layers.
        let c = Case {
            pre: Vec::new(),
            layers: named("layers", &[24 * MIB, 24 * MIB, MIB]),
            post: named("post", &[17 * MIB]),
            devices: vec![
                DeviceBudget::new(0, 26 * MIB, MIB),
                DeviceBudget::new(1, 53 * MIB, 13 * MIB),
            ],
            mode: PlacementMode::Sequential,
            depth: 1,
        };
        let req = c.req();
        let m = Model::new(&req).unwrap();
        assert_eq!(sequential(&m).unwrap().1, SeqPath::Search);
        let map = plan_placement(&req).unwrap();
        assert_eq!(map.stages(), vec![(0, 0..2), (1, 2..3)]);
        let (d0, d1) = (&map.devices[0], &map.devices[1]);
        assert!(d0.streams && d0.prefetch_depth == 0 && d0.resident_layers == 0);
        assert!(!d1.streams && d1.resident_layers == 1);
    }

    #[test]
    fn llama7b_on_two_4gib_and_two_6gib_cards_all_resident() {
        let c = llama7b(
            &[(4096, 600), (4096, 600), (6144, 600), (6144, 600)],
            PlacementMode::Sequential,
            1,
        );
        let map = plan_placement(&c.req()).unwrap();
        let counts: Vec<usize> = map.devices.iter().map(|d| d.layer_count).collect();
        // (4096-600-250)/386 = 8, 3496/386 = 9, 5544/386 = 14, and the last layer with the head.
        assert_eq!(counts, [8, 9, 14, 1]);
        assert!(map.devices.iter().all(|d| !d.streams));
        assert_eq!(map.devices[0].kept, ["model.embed_tokens"]);
        assert_eq!(map.devices[3].kept, ["model.norm", "lm_head"]);
        assert_eq!(
            map.stages(),
            vec![(0, 0..8), (1, 8..17), (2, 17..31), (3, 31..32)]
        );
        assert_eq!(map.device_of_layer(16), Some(1));
        assert_eq!(map.device_of_layer(32), None);
        assert_eq!(map.streamed_bytes(), 0);
        let text = map.to_string();
        assert!(text.contains("17..31"), "{text}");

        let c = Case {
            mode: PlacementMode::Balanced,
            ..c
        };
        let map = plan_placement(&c.req()).unwrap();
        let counts: Vec<usize> = map.devices.iter().map(|d| d.layer_count).collect();
        assert_eq!(counts, [8, 8, 8, 8]);
        assert!(map.devices.iter().all(|d| !d.streams));
        assert_eq!(map.devices[0].weight_capacity, (250 + 8 * 386) * MIB);
    }

    #[test]
    fn llama7b_on_two_4gib_cards_streams_through_the_second() {
        let c = llama7b(&[(4096, 600), (4096, 600)], PlacementMode::Sequential, 1);
        let map = plan_placement(&c.req()).unwrap();
        println!("{map}");
        let (d0, d1) = (&map.devices[0], &map.devices[1]);
        assert_eq!(
            (d0.layer_count, d0.resident_layers, d0.streams),
            (8, 8, false)
        );
        // 3496 - 250 (head) - 2 x 386 (floor at depth 1) = 2474 MiB: 6 resident layers.
        assert_eq!(
            (d1.layers(), d1.resident_layers, d1.streams),
            (8..32, 6, true)
        );
        assert_eq!(d1.prefetch_depth, 1);
        assert_eq!(d1.weight_capacity, 3496 * MIB);
        assert_eq!(map.streamed_bytes(), 18 * 386 * MIB);

        let c = Case {
            mode: PlacementMode::Balanced,
            ..c
        };
        let map = plan_placement(&c.req()).unwrap();
        assert_eq!(map.stages(), vec![(0, 0..16), (1, 16..32)]);
        // 3496 - 250 - 772 = 2474 on each: 6 resident, 10 streamed.
        assert!(map
            .devices
            .iter()
            .all(|d| d.streams && d.resident_layers == 6 && d.streamed_layers() == 10));
    }

    #[test]
    fn a_tiny_budget_is_refused_with_the_missing_mib() {
        let c = llama7b(&[(512, 600), (1024, 600)], PlacementMode::Sequential, 1);
        let e = plan_placement(&c.req()).unwrap_err();
        let msg = e.to_string();
        // Cheapest: everything on GPU 1, which must hold 600 + 250 + 250 + 386 = 1486 MiB.
        match &e {
            PlacementError::Impossible { per_device, .. } => {
                assert_eq!(per_device, &[(0, 0), (1, 462)])
            }
            other => panic!("{other:?}"),
        }
        assert!(
            msg.contains("GPU 0 needs 0 MiB more, GPU 1 needs 462 MiB more"),
            "{msg}"
        );
        assert!(msg.contains("model.layers.0"), "{msg}");

        let c = Case {
            mode: PlacementMode::Balanced,
            ..c
        };
        match plan_placement(&c.req()).unwrap_err() {
            // GPU 0: 600 + 250 + 386 - 512; GPU 1: 600 + 250 + 386 - 1024.
            PlacementError::Impossible { per_device, .. } => {
                assert_eq!(per_device, [(0, 724), (1, 212)])
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn refuses_malformed_requests() {
        let c = llama7b(&[(4096, 0)], PlacementMode::Sequential, 4);
        let e = plan_placement(&c.req()).unwrap_err();
        assert!(e.to_string().contains("prefetch_depth"), "{e}");
        let c = llama7b(&[(4096, 0), (4096, 0)], PlacementMode::Sequential, 1);
        let twice = [c.devices[0], c.devices[0]];
        let e = plan_placement(&PlacementRequest {
            devices: &twice,
            ..c.req()
        })
        .unwrap_err();
        assert!(e.to_string().contains("listed twice"), "{e}");
        let e = plan_placement(&PlacementRequest {
            devices: &[],
            ..c.req()
        })
        .unwrap_err();
        assert!(e.to_string().contains("devices"), "{e}");
        let e = plan_placement(&PlacementRequest {
            layers: &[],
            ..c.req()
        })
        .unwrap_err();
        assert!(e.to_string().contains("layers"), "{e}");
    }

    #[test]
    fn parses_modes() {
        assert_eq!(
            " Balanced".parse::<PlacementMode>().unwrap(),
            PlacementMode::Balanced
        );
        assert_eq!(PlacementMode::Sequential.to_string(), "sequential");
        let e = "auto".parse::<PlacementMode>().unwrap_err();
        assert!(e.to_string().contains("device_map"), "{e}");
    }

    fn planned() -> (Case, DeviceMap) {
        let c = llama7b(
            &[(4096, 600), (4096, 600), (6144, 600)],
            PlacementMode::Sequential,
            1,
        );
        let map = plan_placement(&c.req()).unwrap();
        (c, map)
    }

    fn invalid(c: &Case, map: &DeviceMap) -> (String, String) {
        match map.validate(&c.req()).unwrap_err() {
            PlacementError::InvalidDeviceMap { field, reason, .. } => (field, reason),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn validate_rejects_broken_maps_naming_the_field() {
        let (c, map) = planned();
        assert_eq!(map.validate(&c.req()).unwrap(), map);

        // A layer missing.
        let mut m = map.clone();
        m.devices[2].layer_count -= 1;
        let (field, reason) = invalid(&c, &m.clone());
        assert_eq!(field, "devices", "{reason}");
        assert!(reason.contains("model.layers.31"), "{reason}");
        m.units.clear();
        m.devices[1].first_layer += 1;
        m.devices[1].layer_count -= 1;
        let (field, reason) = invalid(&c, &m);
        assert_eq!(field, "devices[1].first_layer", "{reason}");
        assert!(reason.contains("on no device"), "{reason}");

        // A layer on two devices.
        let mut m = map.clone();
        m.devices[1].first_layer -= 1;
        m.devices[1].layer_count += 1;
        let (field, reason) = invalid(&c, &m);
        assert_eq!(field, "devices[1].first_layer");
        assert!(
            reason.contains("model.layers.7 (") || reason.contains("layer 7"),
            "{reason}"
        );

        // A unit listed twice, one unknown, one missing, a wrong size.
        let mut m = map.clone();
        m.units[3] = m.units[2].clone();
        assert_eq!(invalid(&c, &m).0, "units[3].name");
        m.units[3].name = "model.layers.99".into();
        assert_eq!(invalid(&c, &m).0, "units[3].name");
        m.units.remove(3);
        let (field, reason) = invalid(&c, &m);
        assert_eq!(field, "units");
        assert!(reason.contains("model.layers.2"), "{reason}");
        let mut m = map.clone();
        m.units[4].bytes = 1;
        assert_eq!(invalid(&c, &m).0, "units[4].bytes");

        // Layers of one device that are not contiguous.
        let mut m = map.clone();
        m.units[1 + 3].device = 1;
        let (field, reason) = invalid(&c, &m);
        assert_eq!(field, "units[5].device", "{reason}");
        assert!(reason.contains("contiguous"), "{reason}");
        // ... or a unit on another device than the ranges say.
        let mut m = map.clone();
        m.units[1 + 7].device = 1;
        assert_eq!(invalid(&c, &m).0, "units[8].device");
        let mut m = map.clone();
        m.units[0].device = 2;
        let (field, reason) = invalid(&c, &m);
        assert_eq!(field, "units[0].device");
        assert!(reason.contains("first"), "{reason}");

        // Devices unknown, twice, out of order.
        let mut m = map.clone();
        m.devices[1].ordinal = 7;
        assert_eq!(invalid(&c, &m).0, "devices[1].ordinal");
        let mut m = map.clone();
        m.devices.swap(0, 1);
        assert_eq!(invalid(&c, &m).0, "devices[1].ordinal");

        // Over budget: everything on the first 4 GiB card with its head.
        let mut m = map.clone();
        m.units.clear();
        m.devices[0].layer_count = 32;
        m.devices.truncate(1);
        let ok = m.validate(&c.req()).unwrap();
        assert!(ok.devices[0].streams);
        let small = llama7b(&[(1024, 600), (4096, 600), (6144, 600)], c.mode, 1);
        let (field, reason) = invalid(&small, &m);
        assert_eq!(field, "devices[0]");
        assert!(reason.contains("needs 462 MiB more"), "{reason}");
    }

    #[test]
    fn a_hand_written_map_is_completed() {
        let (c, _) = planned();
        let text = r#"{ "devices": [
            { "ordinal": 0, "first_layer": 0, "layer_count": 20 },
            { "ordinal": 2, "first_layer": 20, "layer_count": 12 }
        ] }"#;
        let m = DeviceMap::from_json(text, "plan.json").unwrap();
        assert_eq!(m.source(), Some("plan.json"));
        let full = m.validate(&c.req()).unwrap();
        assert_eq!(full.stages(), vec![(0, 0..20), (2, 20..32)]);
        assert_eq!(full.devices[1].layer_count, 0);
        assert!(full.devices[0].streams && !full.devices[2].streams);
        assert_eq!(full.unit("lm_head").unwrap().device, 2);
        assert!(full.to_string().contains("custom"));

        let e = DeviceMap::from_json(
            r#"{ "devices": [ { "ordinal": 0, "first_layer": "zero", "layer_count": 16 } ] }"#,
            "plan.json",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("plan.json") && e.contains("devices[0].first_layer"),
            "{e}"
        );
        let e = DeviceMap::from_json(
            r#"{ "devices": [ { "ordinal": 0, "layer_count": 1 } ] }"#,
            "p.json",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("devices[0].first_layer"), "{e}");
        let e = DeviceMap::from_json(r#"{ "device": [] }"#, "p.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("p.json: device:"), "{e}");
        let e = DeviceMap::load(Path::new("/nonexistent/plan.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/plan.json"), "{e}");
    }
}
