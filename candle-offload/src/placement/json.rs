//! Device maps as JSON: written pretty-printed, read back with errors that name the file and
//! the JSON path of the offending field (`devices[1].budget_bytes`).

use std::path::Path;

use super::types::{DeviceMap, PlacementError, Result};

impl DeviceMap {
    /// The map as pretty-printed JSON (what `--device-map plan.json` reads back).
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| PlacementError::InvalidRequest {
            field: "device_map".into(),
            reason: format!("cannot be written as JSON: {e}"),
        })
    }

    /// Reads a map from JSON text; `source_name` names it in errors, which also name the
    /// offending field as a JSON path (`devices[1].first_layer`). The map still has to be
    /// checked against the model with [`validate`](Self::validate).
    pub fn from_json(text: &str, source_name: &str) -> Result<Self> {
        let invalid = |field: String, reason: String| PlacementError::InvalidDeviceMap {
            map: source_name.to_string(),
            field,
            reason,
        };
        let mut de = serde_json::Deserializer::from_str(text);
        let mut map: DeviceMap = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let field = field_of(e.path(), e.inner());
            invalid(field, e.into_inner().to_string())
        })?;
        de.end()
            .map_err(|e| invalid("device map".to_string(), e.to_string()))?;
        map.source = Some(source_name.to_string());
        Ok(map)
    }

    /// Reads a map from a JSON file (see [`from_json`](Self::from_json)).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| PlacementError::File {
            path: path.into(),
            reason: format!("cannot read the device map: {e}"),
        })?;
        Self::from_json(&text, &path.display().to_string())
    }
}

/// The JSON path of the field an error is about: where it happened, and for a missing field
/// the field itself (serde reports those at the object that lacks them, and names the field
/// only in its message).
fn field_of(path: &serde_path_to_error::Path, e: &serde_json::Error) -> String {
    let at = path.to_string();
    let missing = e
        .to_string()
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(field, _)| field.to_string());
    match (at.as_str(), missing) {
        (".", None) => "device map".to_string(),
        (".", Some(field)) => field,
        (at, Some(field)) => format!("{at}.{field}"),
        (at, None) => at.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::placement::testutil::*;

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
        // A bad field deep in the map is named by its JSON path; so is a wrong residency.
        let e = DeviceMap::from_json(
            r#"{ "devices": [
                { "ordinal": 0, "first_layer": 0, "layer_count": 1 },
                { "ordinal": 1, "first_layer": 1, "layer_count": 1, "budget_bytes": -5 }
            ] }"#,
            "plan.json",
        )
        .unwrap_err();
        match &e {
            PlacementError::InvalidDeviceMap { map, field, .. } => {
                assert_eq!(
                    (map.as_str(), field.as_str()),
                    ("plan.json", "devices[1].budget_bytes")
                )
            }
            other => panic!("{other:?}"),
        }
        let e = DeviceMap::from_json(
            r#"{ "devices": [], "units": [ { "name": "a", "device": 0, "residency": "gone" } ] }"#,
            "plan.json",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("units[0].residency"), "{e}");
        // Not JSON at all, or trailing text: the map as a whole, with the line.
        for bad in ["{ \"devices\": [ ", "{ \"devices\": [] } x"] {
            let e = DeviceMap::from_json(bad, "plan.json")
                .unwrap_err()
                .to_string();
            assert!(e.contains("plan.json") && e.contains("line 1"), "{e}");
        }
        let e = DeviceMap::load(Path::new("/nonexistent/plan.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/plan.json"), "{e}");
    }
}
