//! How a [`HostStore`](crate::HostStore) is built: [`StoreConfig`], with the grouping of
//! tensors into units ([`UnitGrouping`]), the engine the weights are laid out for
//! ([`EngineKind`]) and the host-memory cap ([`resolve_host_limit`]).

use candle_core::DType;

use crate::budget::{human_bytes, MemoryLimit};
use crate::error::{Error, Result};

/// How tensor names map to units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitGrouping {
    /// Prefixes followed by a layer index: `model.layers.` makes `model.layers.7` a unit.
    pub layer_prefixes: Vec<String>,
    /// Inside a layer, infixes followed by an expert index that make each expert of a
    /// mixture-of-experts layer a unit of its own: with `mlp.experts.`, the tensors
    /// `model.layers.7.mlp.experts.5.*` are the unit `model.layers.7.mlp.experts.5` (a unit
    /// of no layer index), the rest of the layer stays the unit `model.layers.7`.
    pub expert_infixes: Vec<String>,
}

impl Default for UnitGrouping {
    /// The decoder-layer prefixes of the HF LLaMA family, GPT-2 style and GGUF (`blk.N`).
    fn default() -> Self {
        Self {
            layer_prefixes: [
                "model.layers.",
                "layers.",
                "transformer.h.",
                "model.decoder.layers.",
                "blk.",
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            expert_infixes: Vec::new(),
        }
    }
}

impl UnitGrouping {
    /// Groups by these prefixes (each followed by a layer index).
    pub fn by_prefixes<S: AsRef<str>>(prefixes: &[S]) -> Self {
        Self {
            layer_prefixes: prefixes.iter().map(|p| p.as_ref().to_string()).collect(),
            expert_infixes: Vec::new(),
        }
    }

    /// The same grouping with each expert under one of `infixes` (after the layer index and
    /// its dot, followed by the expert index) a unit of its own.
    pub fn with_experts<S: AsRef<str>>(mut self, infixes: &[S]) -> Self {
        self.expert_infixes = infixes.iter().map(|p| p.as_ref().to_string()).collect();
        self
    }

    /// The unit a tensor belongs to, and for layer units the layer index.
    pub fn unit_of(&self, tensor: &str) -> (String, Option<usize>) {
        for p in &self.layer_prefixes {
            if let Some(rest) = tensor.strip_prefix(p.as_str()) {
                let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
                let after = &rest[digits.len()..];
                if !digits.is_empty() && (after.is_empty() || after.starts_with('.')) {
                    if let Some(expert) = self.expert_of(&after[after.len().min(1)..]) {
                        return (format!("{p}{digits}.{expert}"), None);
                    }
                    if let Ok(idx) = digits.parse() {
                        return (format!("{p}{digits}"), Some(idx));
                    }
                }
            }
        }
        match tensor.rsplit_once('.') {
            Some((module, _)) => (module.to_string(), None),
            None => (tensor.to_string(), None),
        }
    }

    /// `mlp.experts.5` of `mlp.experts.5.gate_proj.weight` (a name inside a layer) when an
    /// expert infix starts it and a dot follows the expert index.
    fn expert_of<'a>(&self, in_layer: &'a str) -> Option<&'a str> {
        self.expert_infixes.iter().find_map(|infix| {
            let rest = in_layer.strip_prefix(infix.as_str())?;
            let n = rest.chars().take_while(|c| c.is_ascii_digit()).count();
            (n > 0 && rest[n..].starts_with('.')).then(|| &in_layer[..infix.len() + n])
        })
    }
}

/// Settings of a [`HostStore`](crate::HostStore).
#[derive(Debug, Clone, Default)]
pub struct StoreConfig {
    /// Convert floating-point tensors to this dtype on load (usually the compute dtype, which
    /// also halves the bytes moved for an F32 checkpoint run in F16). `None` keeps each dtype.
    pub dtype: Option<DType>,
    /// At most this many bytes of page-locked host memory; `None` for no cap.
    pub pinned_cap_bytes: Option<u64>,
    /// At most this much host memory (pinned and pageable together) for the weights: a size,
    /// or a share (`%`) of the machine's RAM. Units past it stay in their checkpoint file and
    /// are read from it on every fetch (the disk tier: safetensors, and stores built with
    /// [`HostStore::from_raw_in_files`](crate::HostStore::from_raw_in_files), such as a GGUF's). `None` is the
    /// default, 3/4 of the machine's RAM ([`default_host_limit`]). A cap smaller than the
    /// largest unit is refused.
    pub host_memory_limit: Option<MemoryLimit>,
    /// How tensor names map to units.
    pub grouping: UnitGrouping,
    /// Read the disk tier through the page cache even where the file system allows O_DIRECT.
    /// By default (false) disk units are read with O_DIRECT where it works (the page cache
    /// cannot hold what did not fit under the cap anyway, and copying through it costs a
    /// copy and evicts other files), falling back to the page cache with one warning naming
    /// the file; the summary says which.
    pub disk_page_cache: bool,
    /// How weights reach the GPU: copied from host memory (the default), or migrated in
    /// managed (Unified) memory.
    pub engine: EngineKind,
    /// How the disk tier cuts its reads ([`crate::Tuning::disk`]).
    pub disk_reads: crate::tuning::DiskTuning,
    /// Only the units of these names are loaded, the checkpoint's other tensors left unread
    /// (a rank of a multi-process run loads its own layers); `None`: every unit.
    pub only_units: Option<Vec<String>>,
    /// Every unit that can stay in its checkpoint file does (the disk tier), whatever the
    /// host cap; the others are held in host memory as usual. For a runtime that keeps its
    /// own copy of every unit it fetches, as the CPU's does, the store's would be a second.
    pub file_backed: bool,
}

/// How the store's weights reach the GPU (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum EngineKind {
    /// Units in page-locked (or pageable) host memory, copied into device buffers on the copy
    /// stream.
    #[default]
    Explicit,
    /// Units in CUDA managed memory preferring the host, migrated to the GPU with a prefetch
    /// on the copy stream before use and back after last use, following the same plan and
    /// budget (the seed's Unified Memory). Each unit's device footprint is its size rounded
    /// up to 2 MiB. GPU only, and only for models that fit the budget: the driver keeps the
    /// device memory of pages it migrated back, so a runtime whose managed units would stream
    /// is refused. Quantized blocks are still copied (Candle's quantized storage cannot point
    /// into memory it did not allocate).
    Managed,
}

keyword_enum!(EngineKind, "engine", crate::Error, [crate::Error::InvalidConfig], {
    Explicit => "explicit" | "copy",
    Managed => "managed" | "um" | "unified",
});

/// The host-memory cap when none is given: 3/4 of the machine's RAM. The quarter left is for
/// the OS and other programs, the activations and KV cache (on the CPU engine they live in
/// host memory too), and the page cache that the disk tier reads through; on a 16 GiB laptop
/// that is 4 GiB.
pub fn default_host_limit(total_ram_bytes: u64) -> u64 {
    total_ram_bytes / 4 * 3
}

/// The host-memory cap in bytes for `limit` on a machine with `total_ram_bytes` of RAM (`None`
/// when unknown): `None` for no cap (the default where the RAM is unknown). A share of RAM
/// needs the RAM; a size larger than the RAM is refused.
pub fn resolve_host_limit(
    limit: Option<MemoryLimit>,
    total_ram_bytes: Option<u64>,
) -> Result<Option<u64>> {
    let err = |reason: String| Error::InvalidConfig {
        field: "host_memory_limit".into(),
        reason,
    };
    match (limit, total_ram_bytes) {
        (None, total) => Ok(total.map(default_host_limit)),
        (Some(MemoryLimit::Bytes(b)), Some(total)) if b > total => Err(err(format!(
            "{} is more than the machine's RAM ({})",
            human_bytes(b),
            human_bytes(total)
        ))),
        (Some(MemoryLimit::Bytes(b)), _) => Ok(Some(b)),
        (Some(MemoryLimit::FractionOfDevice(f)), Some(total)) => {
            Ok(Some((total as f64 * f) as u64))
        }
        (Some(MemoryLimit::FractionOfDevice(f)), None) => Err(err(format!(
            "a share of RAM ({}%) needs /proc/meminfo; give a size such as 8GiB instead",
            f * 100.0
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn groups_by_layer_prefix_and_module() {
        let g = UnitGrouping::default();
        assert_eq!(
            g.unit_of("model.layers.12.mlp.up_proj.weight"),
            ("model.layers.12".into(), Some(12))
        );
        assert_eq!(g.unit_of("blk.3.attn_q.weight"), ("blk.3".into(), Some(3)));
        assert_eq!(
            g.unit_of("model.embed_tokens.weight"),
            ("model.embed_tokens".into(), None)
        );
        assert_eq!(g.unit_of("lm_head.weight"), ("lm_head".into(), None));
        assert_eq!(
            g.unit_of("model.layers.x.weight"),
            ("model.layers.x".into(), None)
        );
        assert_eq!(g.unit_of("scale"), ("scale".into(), None));
        // Experts stay in their layer's unit unless asked.
        assert_eq!(
            g.unit_of("model.layers.2.mlp.experts.5.up_proj.weight").0,
            "model.layers.2"
        );
    }

    #[test]
    fn experts_are_units_of_their_own() {
        let g = UnitGrouping::by_prefixes(&["model.layers."])
            .with_experts(&["mlp.experts.", "block_sparse_moe.experts."]);
        assert_eq!(
            g.unit_of("model.layers.2.mlp.experts.15.up_proj.weight"),
            ("model.layers.2.mlp.experts.15".into(), None)
        );
        assert_eq!(
            g.unit_of("model.layers.0.block_sparse_moe.experts.3.w1.weight"),
            ("model.layers.0.block_sparse_moe.experts.3".into(), None)
        );
        // The router, and fused stacks of all experts, stay with the layer.
        for t in [
            "model.layers.2.mlp.gate.weight",
            "model.layers.2.mlp.experts.gate_up_proj",
            "model.layers.2.mlp.experts.7",
            "model.layers.2.self_attn.q_proj.weight",
        ] {
            assert_eq!(g.unit_of(t), ("model.layers.2".into(), Some(2)), "{t}");
        }
    }

    #[test]
    fn host_limits_default_to_three_quarters_of_ram_and_name_their_field() {
        let gib = 1u64 << 30;
        assert_eq!(default_host_limit(16 * gib), 12 * gib);
        assert_eq!(
            resolve_host_limit(None, Some(16 * gib)).unwrap(),
            Some(12 * gib)
        );
        assert_eq!(resolve_host_limit(None, None).unwrap(), None);
        assert_eq!(
            resolve_host_limit(Some(MemoryLimit::FractionOfDevice(0.5)), Some(16 * gib)).unwrap(),
            Some(8 * gib)
        );
        assert_eq!(
            resolve_host_limit(Some(MemoryLimit::Bytes(gib)), None).unwrap(),
            Some(gib)
        );
        for (limit, ram) in [
            (MemoryLimit::Bytes(32 * gib), Some(16 * gib)),
            (MemoryLimit::FractionOfDevice(0.5), None),
        ] {
            let e = resolve_host_limit(Some(limit), ram)
                .unwrap_err()
                .to_string();
            assert!(e.contains("host_memory_limit"), "{e}");
        }
    }
}
