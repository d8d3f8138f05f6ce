//! Test cases shared by the placement tests: named units, a request builder, a 7B-shaped model.

use std::fmt;

use super::plan::plan_placement;
use super::types::{DeviceBudget, DeviceMap, PlacementMode, PlacementRequest};

pub(super) const MIB: u64 = 1 << 20;

/// Units `prefix.0`, `prefix.1`, ... of the given sizes.
pub(super) fn named(prefix: &str, sizes: &[u64]) -> Vec<(String, u64)> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &b)| (format!("{prefix}.{i}"), b))
        .collect()
}

/// A placement request that owns its units and devices.
pub(super) struct Case {
    pub(super) pre: Vec<(String, u64)>,
    pub(super) layers: Vec<(String, u64)>,
    pub(super) post: Vec<(String, u64)>,
    pub(super) devices: Vec<DeviceBudget>,
    pub(super) mode: PlacementMode,
    pub(super) depth: usize,
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
    pub(super) fn req(&self) -> PlacementRequest<'_> {
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
pub(super) fn llama7b(devices: &[(u64, u64)], mode: PlacementMode, depth: usize) -> Case {
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

/// A 7B on 4, 4 and 6 GiB cards, planned sequentially.
pub(super) fn planned() -> (Case, DeviceMap) {
    let c = llama7b(
        &[(4096, 600), (4096, 600), (6144, 600)],
        PlacementMode::Sequential,
        1,
    );
    let map = plan_placement(&c.req()).unwrap();
    (c, map)
}
