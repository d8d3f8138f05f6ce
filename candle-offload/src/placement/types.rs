//! The types the placement planners, the checks of hand-written maps and the JSON files share:
//! the request ([`PlacementRequest`], [`DeviceBudget`], [`PlacementMode`]), the result
//! ([`DeviceMap`] of [`DevicePlacement`]s and [`UnitPlacement`]s) and [`PlacementError`].

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::budget::Budget;
#[cfg(doc)]
use crate::plan::{plan_capacity, MAX_PREFETCH_DEPTH};

/// Why a device map could not be made, read or checked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// No device map places the model's layers within the devices' budgets (see the
    /// [module documentation](crate::placement) for when exactly a placement is impossible).
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

keyword_enum!(PlacementMode, "device_map", PlacementError, [PlacementError::InvalidRequest], {
    Sequential => "sequential",
    Balanced => "balanced",
});

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
    pub(super) fn fits(&self, bytes: u64) -> bool {
        self.budget().fits(bytes)
    }

    /// Bytes over the budget when the reservation plus `bytes` are placed (zero when they fit).
    pub(super) fn missing(&self, bytes: u64) -> u64 {
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

/// Which device runs which units: the result of [`plan_placement`](super::plan_placement), or
/// a map read from a file and checked with [`DeviceMap::validate`].
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
    /// Bytes of each device's reservation that a decode step does not need (a prompt's
    /// activations), which its runtime gives to weights while decoding; 0 (a hand-written map's
    /// default): the reservation stays as planned.
    #[serde(default)]
    pub decode_share_bytes: u64,
    /// Where it was read from, for messages.
    #[serde(skip)]
    pub(super) source: Option<String>,
}

impl PartialEq for DeviceMap {
    /// Compares the placements; where the maps were read from does not matter.
    fn eq(&self, other: &Self) -> bool {
        self.mode == other.mode
            && self.prefetch_depth == other.prefetch_depth
            && self.devices == other.devices
            && self.units == other.units
            && self.decode_share_bytes == other.decode_share_bytes
    }
}

impl Eq for DeviceMap {}

impl DeviceMap {
    /// Where the map was read from, if it was.
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
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
    if bytes.is_multiple_of(1 << 20) {
        (bytes >> 20).to_string()
    } else {
        format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
