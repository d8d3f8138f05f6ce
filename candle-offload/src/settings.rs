//! The seed's settings file (`config.yaml`):
//!
//! ```yaml
//! memory:
//!   offload_strategy: balanced   # minimal | balanced | aggressive
//!   max_gpu_memory: 3GB          # or 3.5 (GiB), 3.5GiB, 50%
//!   max_cpu_memory: 12GiB        # host memory for weights: a size or a share of RAM
//! tuning:                        # optional: any field of `Tuning` (docs/tuning.md)
//!   kernels:
//!     prefill_gemm_min_rows: 128
//!   graphs: false
//! ```
//!
//! Unknown keys are refused, so a typo is an error rather than a silently ignored setting.

use std::path::Path;

use crate::budget::MemoryLimit;
use crate::error::{Error, Result};
use crate::plan::OffloadStrategy;
use crate::tuning::Tuning;

/// What a settings file sets (each `None` when absent).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Settings {
    /// `memory.offload_strategy`.
    pub offload_strategy: Option<OffloadStrategy>,
    /// `memory.max_gpu_memory`.
    pub max_gpu_memory: Option<MemoryLimit>,
    /// `memory.max_cpu_memory`: the host store's cap
    /// ([`StoreConfig::host_memory_limit`](crate::StoreConfig::host_memory_limit)).
    pub max_cpu_memory: Option<MemoryLimit>,
    /// `tuning`: performance choices over [`Tuning::default`] (each field optional).
    pub tuning: Option<Tuning>,
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    memory: MemorySection,
    tuning: Option<Tuning>,
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct MemorySection {
    offload_strategy: Option<String>,
    max_gpu_memory: Option<serde_norway::Value>,
    max_cpu_memory: Option<serde_norway::Value>,
}

impl Settings {
    /// Reads and validates a settings file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::File {
            path: path.into(),
            reason: format!("cannot read: {e}"),
        })?;
        Self::from_yaml(&text, path)
    }

    /// Parses the text of a settings file; `path` names it in errors.
    pub fn from_yaml(text: &str, path: &Path) -> Result<Self> {
        let file = |reason: String| Error::File {
            path: path.into(),
            reason,
        };
        let de = serde_norway::Deserializer::from_str(text);
        let cfg: FileConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let at = e.path().to_string();
            let inner = e.into_inner();
            if at == "." || at.is_empty() {
                file(format!("not a valid settings file: {inner}"))
            } else {
                file(format!("not a valid settings file: {at}: {inner}"))
            }
        })?;
        if let Some(t) = &cfg.tuning {
            t.validate()
                .map_err(|e| file(format!("tuning.{}: {}", e.key, e.reason)))?;
        }
        let offload_strategy = cfg
            .memory
            .offload_strategy
            .map(|s| s.parse::<OffloadStrategy>())
            .transpose()
            .map_err(|e| file(format!("memory.offload_strategy: {e}")))?;
        let size = |field: &str, value: Option<serde_norway::Value>| match value {
            None => Ok(None),
            Some(serde_norway::Value::Number(n)) => {
                Ok(Some(MemoryLimit::parse(field, &n.to_string())?))
            }
            Some(serde_norway::Value::String(s)) => Ok(Some(MemoryLimit::parse(field, &s)?)),
            Some(other) => Err(file(format!(
                "{field}: expected a size such as 3GB, got {other:?}"
            ))),
        };
        let max_gpu_memory = size("memory.max_gpu_memory", cfg.memory.max_gpu_memory)?;
        let max_cpu_memory = size("memory.max_cpu_memory", cfg.memory.max_cpu_memory)?;
        Ok(Self {
            offload_strategy,
            max_gpu_memory,
            max_cpu_memory,
            tuning: cfg.tuning,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_seeds_keys() {
        let s = Settings::from_yaml(
            "memory:\n  offload_strategy: balanced\n  max_gpu_memory: 3GB\n",
            Path::new("c.yaml"),
        )
        .unwrap();
        assert_eq!(s.offload_strategy, Some(OffloadStrategy::Balanced));
        assert_eq!(s.max_gpu_memory, Some(MemoryLimit::Bytes(3_000_000_000)));
        let s =
            Settings::from_yaml("memory:\n  max_gpu_memory: 3.5\n", Path::new("c.yaml")).unwrap();
        assert_eq!(s.max_gpu_memory, Some(MemoryLimit::gib(3.5)));
        let s = Settings::from_yaml(
            "memory:\n  max_cpu_memory: 50%\n  max_gpu_memory: 2\n",
            Path::new("c.yaml"),
        )
        .unwrap();
        assert_eq!(s.max_cpu_memory, Some(MemoryLimit::FractionOfDevice(0.5)));
        assert_eq!(s.max_gpu_memory, Some(MemoryLimit::gib(2.0)));
        assert_eq!(
            Settings::from_yaml("", Path::new("c.yaml")).unwrap(),
            Settings::default()
        );
        let s = Settings::from_yaml(
            "tuning:\n  kernels:\n    prefill_gemm_min_rows: 128\n  graphs: false\n",
            Path::new("c.yaml"),
        )
        .unwrap();
        let t = s.tuning.unwrap();
        assert_eq!(t.kernels.prefill_gemm_min_rows, 128);
        assert!(!t.graphs && t.weight_pool);
    }

    #[test]
    fn bad_files_name_the_file_or_field() {
        let p = Path::new("/etc/c.yaml");
        for (text, needle) in [
            (
                "memory:\n  offload_strategy: sideways\n",
                "offload_strategy",
            ),
            ("memory:\n  max_gpu_memory: -3GB\n", "memory.max_gpu_memory"),
            (
                "memory:\n  max_gpu_memory: [1, 2]\n",
                "memory.max_gpu_memory",
            ),
            ("memory:\n  max_gpu_mem: 3GB\n", "/etc/c.yaml"),
            ("memory:\n  max_cpu_memory: lots\n", "memory.max_cpu_memory"),
            (
                "memory:\n  max_cpu_memory: {a: 1}\n",
                "memory.max_cpu_memory",
            ),
            ("not: [valid", "/etc/c.yaml"),
            ("tuning:\n  graph: false\n", "tuning"),
            (
                "tuning:\n  kernels:\n    qlinear_k_rows: 3\n",
                "tuning.kernels.qlinear_k_rows",
            ),
            (
                "tuning:\n  kernels:\n    qlinear:\n      q8_0: v7\n",
                "tuning.kernels.qlinear.q8_0",
            ),
        ] {
            let e = Settings::from_yaml(text, p).unwrap_err().to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }
}
