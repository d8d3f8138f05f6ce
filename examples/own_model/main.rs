//! Bring your own model: an application's own decoder (`model.rs`, plain candle-nn, with its own
//! tensor names, LayerNorm, fused q/k/v and a GELU MLP) run offloaded under a budget that holds
//! two of its eight layers, and as a pipeline over two devices, through `glue.rs` alone (a
//! `Family`, a `DecoderBlock` and a `Config`). Every step's logits are compared bit for bit
//! with the application's own resident forward pass; the run fails if any differ.
//!
//! `cargo run --release --example own_model` (CPU; two CPU "devices" for the pipeline), or
//! `--features cuda -- --gpu` (GPU 0, and GPUs 0 and 1 for the pipeline where there are two).

mod demo;
mod glue;
mod model;

use anyhow::{bail, Result};
use clap::Parser;

/// Runs an application-defined decoder resident, offloaded and sharded, and compares them.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Run on the GPU (`--features cuda`).
    #[arg(long)]
    gpu: bool,
    /// Tokens to decode after the prompt.
    #[arg(long, default_value_t = 16)]
    steps: usize,
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
    let (first, second) = if args.gpu {
        let first = candle_core::Device::new_cuda_with_stream(0)?;
        (first, candle_core::Device::new_cuda_with_stream(1).ok())
    } else {
        (candle_core::Device::Cpu, Some(candle_core::Device::Cpu))
    };
    let c = model::TinyConfig {
        vocab: 512,
        hidden: 128,
        layers: 8,
        heads: 4,
        ffn: 384,
        max_len: 64,
    };
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 512).collect();
    let r = demo::run(&c, &first, second.as_ref(), &prompt, args.steps)?;
    println!("tokens: {:?}", r.tokens);
    println!(
        "offloaded: budget {} B, peak weights {} B, {} layer fetches for {} layers",
        r.budget_bytes, r.peak_resident_bytes, r.layer_fetches, c.layers
    );
    for (device, first, count, streams) in &r.device_map {
        let how = if *streams { "streamed" } else { "resident" };
        println!("device {device}: layers {first}..{} ({how})", first + count);
    }
    let two = match r.sharded_equal {
        Some(n) => format!("{n}/{}", r.steps),
        None => "skipped (one GPU)".into(),
    };
    println!(
        "logits equal to the resident model's: offloaded {}/{}, two devices {two}",
        r.offloaded_equal, r.steps
    );
    if r.offloaded_equal != r.steps || r.sharded_equal.is_some_and(|n| n != r.steps) {
        bail!("the offloaded or sharded logits differ from the application's own model");
    }
    Ok(())
}
