//! A prompt's routing on the host CPU: for the Qwen3-30B-A3B router shape (128 experts, top 8,
//! renormalised) and `--tokens` rows of logits, uniform or skewed (a Zipf law of exponent 1
//! added to the logits, as `scripts/gguf_random_moe.py`'s skewed router makes the popular
//! experts' logits larger), the time of
//! - every row through `route_row` on one thread (what a layer did before `route_rows`);
//! - `route_rows`: the rows in chunks over the CPU kernels' worker threads;
//! - `group_by_expert` over the routes.
//!
//! Each is the median of `--reps` runs. It needs no GPU; the GPU machine's host is where it
//! matters (a prompt's layer waits for its routing there).
//!
//! Run with: `cargo bench -p candle-offload-bench --bench routing -- --json-out routing.json`.

use std::path::PathBuf;

use anyhow::Result;
use candle_core::Device;
use candle_offload_bench::time_synced;
use candle_offload_models::layers::{group_by_expert, route_row, route_rows, Routing};
use clap::Parser;
use rand::Rng as _;

/// Times a prompt's routing on the host by row count and routing.
#[derive(Parser, Debug)]
struct Args {
    /// Prompt rows (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "64,512")]
    tokens: Vec<usize>,
    /// Routings (comma-separated): uniform, skewed.
    #[arg(long, value_delimiter = ',', default_value = "uniform,skewed")]
    routings: Vec<String>,
    /// Experts in the layer.
    #[arg(long, default_value_t = 128)]
    experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    /// Timed runs of each (the median is kept), after two untimed.
    #[arg(long, default_value_t = 50)]
    reps: usize,
    /// Write the records here (JSON).
    #[arg(long)]
    json_out: Option<PathBuf>,
    // `cargo bench` passes `--bench` to every bench binary.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut rng = rand::rng();
    let routing = Routing {
        experts: args.experts,
        top_k: args.top_k,
        renormalize: true,
    };
    let mut records = Vec::new();
    println!(
        "{:>6} {:>8} {:>12} {:>12} {:>12}",
        "rows", "routing", "serial ms", "pooled ms", "group ms"
    );
    for &rows in &args.tokens {
        for name in &args.routings {
            let skew = match name.as_str() {
                "uniform" => false,
                "skewed" => true,
                other => anyhow::bail!("--routings: unknown routing {other:?}"),
            };
            let logits: Vec<f32> = (0..rows * args.experts)
                .map(|i| {
                    let zipf = if skew {
                        -((1 + i % args.experts) as f32).ln()
                    } else {
                        0.0
                    };
                    rng.random_range(-1.0f32..1.0) + zipf
                })
                .collect();
            // On the CPU the device's synchronization is a no-op: each run's wall time.
            let cpu = Device::Cpu;
            let serial = time_synced(&cpu, args.reps, || {
                Ok(logits
                    .chunks(args.experts)
                    .map(|r| route_row(r, routing))
                    .collect::<Vec<_>>())
            })?;
            let pooled = time_synced(&cpu, args.reps, || {
                Ok(route_rows(
                    &logits,
                    args.experts,
                    (0, args.experts),
                    routing,
                ))
            })?;
            let routes = route_rows(&logits, args.experts, (0, args.experts), routing);
            let group = time_synced(&cpu, args.reps, || Ok(group_by_expert(&routes)))?;
            println!(
                "{rows:>6} {name:>8} {:>12.3} {:>12.3} {:>12.3}",
                serial * 1e3,
                pooled * 1e3,
                group * 1e3
            );
            records.push(serde_json::json!({
                "rows": rows,
                "routing": name,
                "experts": args.experts,
                "top_k": args.top_k,
                "threads": candle_offload::kernels::pool::threads(),
                "serial_s": serial,
                "pooled_s": pooled,
                "group_s": group,
            }));
        }
    }
    if let Some(path) = &args.json_out {
        candle_offload_suite::write_results(
            path,
            "routing",
            &Device::Cpu,
            serde_json::Value::Array(records),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
