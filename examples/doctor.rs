//! The doctor: checks the driver, the GPU's architecture against the kernels compiled in,
//! memory, pinning and the locked-memory limit, the PCIe link, and the host-to-device rates,
//! and says plainly what would fail. A CPU-only build runs it too and says what is missing.
//!
//! Run with: `cargo run --release --features cuda --example doctor` (`--json` for a script).

use anyhow::Result;
use candle_offload::doctor::{self, Severity};
use clap::Parser;

/// Examines this machine for candle-offload.
#[derive(Parser, Debug)]
struct Args {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Skip the copy-rate measurement.
    #[arg(long)]
    no_measure: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    let verbose = args.verbose > 0;
    candle_offload_suite::report::exit_code(run(args), verbose)
}

fn run(args: Args) -> Result<()> {
    let report = doctor::examine(
        args.device,
        !args.no_measure,
        &candle_offload_suite::dist::nccl_search_dirs(|k| std::env::var(k).ok()),
    );
    if args.json {
        let d = report.device.as_ref();
        let json = serde_json::json!({
            "cuda_compiled": report.cuda_compiled,
            "gpu": d.map(|d| serde_json::json!({
                "name": d.name, "ordinal": d.ordinal,
                "compute_capability": format!("{}.{}", d.compute_capability.0, d.compute_capability.1),
                "total_bytes": d.total_bytes, "free_bytes": d.free_bytes,
                "driver_cuda": d.driver_cuda_version.map(|v| v.to_string()),
                "built_for_cuda": d.built_for_cuda.map(|v| v.to_string()),
                "compiled_arch": d.compiled_arch,
            })),
            "device_error": report.device_error,
            "memlock_limit_bytes": report.memlock_limit,
            "pinning_works": report.pinning_works,
            "pcie": report.pcie.as_ref().map(|p| serde_json::json!({
                "generation": p.generation, "width": p.width,
                "max_generation": p.max_generation, "max_width": p.max_width,
            })),
            "pinned_gbps": report.pinned_gbps,
            "pageable_gbps": report.pageable_gbps,
            "context_memory_bytes": report.context_memory.iter().map(|(what, b)| serde_json::json!({
                "step": what, "bytes": b,
            })).collect::<Vec<_>>(),
            "nccl": serde_json::json!({
                "found": report.nccl.found.as_ref().map(|n| serde_json::json!({
                    "path": n.path,
                    "version": format!("{}.{}.{}", n.version.0, n.version.1, n.version.2),
                    "on_loader_path": n.on_loader_path,
                })),
                "tried": report.nccl.tried.iter().map(|(c, e)| serde_json::json!({
                    "candidate": c, "error": e,
                })).collect::<Vec<_>>(),
            }),
            "verdicts": report.verdicts.iter().map(|v| serde_json::json!({
                "severity": format!("{:?}", v.severity), "message": v.message,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        print!("{report}");
    }
    if report
        .verdicts
        .iter()
        .any(|v| v.severity == Severity::Error)
    {
        std::process::exit(1);
    }
    Ok(())
}
