//! Checks a device map written by hand against the model and the devices' budgets, naming the
//! offending field, and completes it as the planner would.

use std::collections::HashMap;

use super::plan::Model;
use super::types::{DeviceMap, PlacementError, PlacementRequest, Result};
use crate::budget::mib_ceil;

impl DeviceMap {
    /// Checks a map (typically written by hand) against the model's units and the devices'
    /// budgets, and returns it re-planned: budgets, kept units, resident counts, depths and
    /// capacities are recomputed from `req`, only the layer ranges are taken from the map.
    ///
    /// Refused with [`PlacementError::InvalidDeviceMap`] naming the field: a device not in
    /// `req`, listed twice or out of `req`'s order; a layer on no device, on two, or past the model's end; in
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::testutil::*;

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
}
