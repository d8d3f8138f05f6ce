//! Streaming benchmark of the offload runtime: decoder layers shaped like a 7B LLaMA layer in
//! fp16 (~386 MiB each), swept again and again (like decode) under several GPU budgets, each
//! layer followed by a compute step that reads every weight (batch-1 matvecs). In the same run
//! it measures the machine's raw pinned host-to-device rate, the link ceiling.
//!
//! Per budget it reports bytes streamed per sweep, sweep time, achieved GB/s, link efficiency
//! (achieved over raw pinned) and the peak device memory measured outside the allocator
//! (`cuMemGetInfo`, polled), minus the CUDA context's own footprint measured at start.
//!
//! Run with: `cargo bench -p candle-offload-bench --features cuda --bench streaming --
//! --json-out streaming.json`.
//! Without CUDA it runs a small CPU version (`--layers 4 --hidden 256` by default there).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use candle_core::{DType, Shape, Tensor};
use candle_offload::diag::{self, PeakMemorySampler};
use candle_offload::{
    ActivePolicy, HostStore, MemoryLimit, OffloadConfig, OffloadRuntime, PolicyChoice, StoreConfig,
    TensorSpec,
};
use candle_offload_bench::median;
use clap::Parser;
use rand::Rng as _;

/// Streams LLaMA-shaped layers through a budget and measures the link efficiency.
#[derive(Parser, Debug)]
struct Args {
    /// Budgets in GiB (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "4,8,12")]
    budgets: Vec<f64>,
    /// Number of layers (default 32 on a GPU, 4 on the CPU).
    #[arg(long)]
    layers: Option<usize>,
    /// Hidden size (default 4096 on a GPU, 256 on the CPU).
    #[arg(long)]
    hidden: Option<usize>,
    /// MLP intermediate size (default 11008 on a GPU, 688 on the CPU).
    #[arg(long)]
    intermediate: Option<usize>,
    /// Measured sweeps per budget.
    #[arg(long, default_value_t = 6)]
    sweeps: usize,
    /// Warm-up sweeps per budget (the schedule is learned in the first two).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Prefetch depths to run (comma-separated): 0 moves the fewest bytes, each step more
    /// buys overlap with compute.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
    depths: Vec<usize>,
    /// Reservation for activations and workspace inside the budget, MiB.
    #[arg(long, default_value_t = 256)]
    reserve_mib: u64,
    /// Run on the CPU.
    #[arg(long)]
    cpu: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn layer_specs(layers: usize, hidden: usize, inter: usize) -> Vec<TensorSpec> {
    let mut specs = Vec::new();
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        let mut add = |name: &str, shape: &[usize]| {
            specs.push(TensorSpec {
                name: format!("{p}.{name}"),
                dtype: DType::F16,
                shape: Shape::from(shape),
            })
        };
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            add(&format!("self_attn.{proj}.weight"), &[hidden, hidden]);
        }
        add("mlp.gate_proj.weight", &[inter, hidden]);
        add("mlp.up_proj.weight", &[inter, hidden]);
        add("mlp.down_proj.weight", &[hidden, inter]);
        add("input_layernorm.weight", &[hidden]);
        add("post_attention_layernorm.weight", &[hidden]);
    }
    specs
}

/// Small, finite f16 values, tiled from one random block (fast to write 12 GiB).
fn fill(dst: &mut [u8]) {
    let mut block = vec![0u8; 1 << 20];
    let mut rng = candle_offload_suite::rng(0x9e37_79b9);
    for c in block.chunks_exact_mut(2) {
        let v = half::f16::from_f32(rng.random_range(-1000i32..=1000) as f32 * 1e-5);
        c.copy_from_slice(&v.to_le_bytes());
    }
    for chunk in dst.chunks_mut(block.len()) {
        chunk.copy_from_slice(&block[..chunk.len()]);
    }
}

/// A compute step that reads every weight of a layer: one batch-1 matvec per matrix and a
/// scale by each norm vector. Returns a scalar that depends on all of them.
fn layer_step(unit: &candle_offload::UnitGuard, inputs: &Inputs) -> candle_core::Result<Tensor> {
    let mut acc: Option<Tensor> = None;
    for w in unit.tensors().values() {
        let y = match w.dims() {
            [_, cols] if *cols == inputs.hidden => inputs.x_hidden.matmul(&w.t()?)?,
            [_, _] => inputs.x_inter.matmul(&w.t()?)?,
            _ => inputs.x_vec.mul(w)?,
        };
        let s = y.sum_all()?.to_dtype(DType::F32)?;
        acc = Some(match acc {
            None => s,
            Some(a) => (a + s)?,
        });
    }
    acc.ok_or_else(|| candle_core::Error::Msg("empty unit".into()))
}

struct Inputs {
    hidden: usize,
    x_hidden: Tensor,
    x_inter: Tensor,
    x_vec: Tensor,
}

fn main() -> Result<()> {
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    let device = candle_offload_suite::device(args.cpu, 0)?;
    let gpu = !device.is_cpu();
    let layers = args.layers.unwrap_or(if gpu { 32 } else { 4 });
    let hidden = args.hidden.unwrap_or(if gpu { 4096 } else { 256 });
    let inter = args.intermediate.unwrap_or(if gpu { 11008 } else { 688 });

    // The CUDA context's own footprint, right after start, and the link's ceiling.
    let candle_offload_bench::LinkBaseline {
        context_bytes,
        raw_pinned_gbps,
        raw_pageable_gbps,
    } = candle_offload_bench::link_baseline(&device, true)?;
    println!("context {:.0} MiB; raw host->device: pinned {raw_pinned_gbps:.1} GB/s, pageable {raw_pageable_gbps:.1} GB/s",
        context_bytes as f64 / 1048576.0);

    let specs = layer_specs(layers, hidden, inter);
    let t0 = Instant::now();
    let store = Arc::new(HostStore::from_fn(
        &specs,
        &StoreConfig::default(),
        &device,
        |_, _, dst| {
            fill(dst);
            Ok(())
        },
    )?);
    let layer_bytes = store.units()[0].bytes();
    println!(
        "{layers} layers of {:.1} MiB ({:.2} GiB, {:.2} GiB pinned) loaded in {:.1} s",
        layer_bytes as f64 / 1048576.0,
        store.total_bytes() as f64 / 2f64.powi(30),
        store.pinned_bytes() as f64 / 2f64.powi(30),
        t0.elapsed().as_secs_f64()
    );
    let inputs = Inputs {
        hidden,
        x_hidden: Tensor::ones((1, hidden), DType::F16, &device)?.affine(0.01, 0.)?,
        x_inter: Tensor::ones((1, inter), DType::F16, &device)?.affine(0.01, 0.)?,
        x_vec: Tensor::ones(hidden, DType::F16, &device)?,
    };

    let mut records = Vec::new();
    println!("depth budget  resident  bytes/sweep  sweep ms  achieved GB/s  link eff.  peak MiB (budget)  host enqueue ms");
    for (&depth, &gib) in args
        .depths
        .iter()
        .flat_map(|d| args.budgets.iter().map(move |b| (d, b)))
    {
        diag::trim_memory_pool(&device)?;
        let sampler = if gpu {
            Some(PeakMemorySampler::start(
                &device,
                Duration::from_micros(500),
            )?)
        } else {
            None
        };
        let budget = MemoryLimit::gib(gib);
        let budget_bytes = match budget {
            MemoryLimit::Bytes(b) => b,
            MemoryLimit::FractionOfDevice(_) => unreachable!(),
        };
        let cfg = OffloadConfig {
            gpu_memory_limit: Some(budget),
            reserve_bytes: args.reserve_mib << 20,
            prefetch_depth: depth,
            policy: PolicyChoice::Auto,
            ..Default::default()
        };
        let rt = OffloadRuntime::new(store.clone(), &device, &cfg)?;
        let mut sweep_s = Vec::new();
        let mut enqueue_s = Vec::new();
        let mut bytes = Vec::new();
        let mut stall = Vec::new();
        for sweep in 0..args.warmup + args.sweeps {
            rt.begin_step()?;
            let t0 = Instant::now();
            let mut acc = Tensor::zeros((), DType::F32, &device)?;
            for i in 0..layers {
                let unit = rt.acquire_layer(i)?;
                acc = (acc + layer_step(&unit, &inputs)?)?;
            }
            let enq = t0.elapsed().as_secs_f64();
            let v = acc.to_scalar::<f32>()?; // one host sync per sweep, like sampling a token
            let dt = t0.elapsed().as_secs_f64();
            rt.end_step()?;
            ensure!(v.is_finite(), "non-finite result {v}");
            if sweep >= args.warmup {
                let step = rt.stats()?.last_step.unwrap_or_default();
                sweep_s.push(dt);
                enqueue_s.push(enq);
                bytes.push(step.bytes as f64);
                stall.push(step.stall_s);
            }
        }
        rt.synchronize()?;
        let stats = rt.stats()?;
        let peak_device_bytes = sampler
            .map(|s| s.stop().saturating_sub(context_bytes))
            .unwrap_or(0);
        let sweep = median(sweep_s);
        let bytes_per_sweep = median(bytes);
        let achieved = bytes_per_sweep / sweep / 1e9;
        let eff = if raw_pinned_gbps > 0.0 {
            achieved / raw_pinned_gbps
        } else {
            0.0
        };
        let resident_layers = stats.units.iter().filter(|u| u.resident).count();
        println!(
            "{depth:>5} {gib:>5.1}  {resident_layers:>4}/{layers:<3}  {:>9.2} GB  {:>8.2}  {achieved:>13.2}  {eff:>9.3}  {:>8.0} ({:>6.0})  {:>12.2}",
            bytes_per_sweep / 1e9,
            sweep * 1e3,
            peak_device_bytes as f64 / 1048576.0,
            budget_bytes as f64 / 1048576.0,
            median(enqueue_s.clone()) * 1e3
        );
        records.push(serde_json::json!({
            "budget_gib": gib,
            "budget_bytes": budget_bytes,
            "reserve_bytes": args.reserve_mib << 20,
            "peak_device_bytes": peak_device_bytes,
            "context_bytes": context_bytes,
            "peak_within_budget": peak_device_bytes <= budget_bytes,
            "layers": layers,
            "layer_bytes": layer_bytes,
            "resident_layers_at_end": resident_layers,
            "weight_capacity_bytes": stats.weight_capacity_bytes,
            "prefetch_depth": stats.prefetch_depth,
            "policy": match stats.policy { ActivePolicy::Lru => "lru".to_string(), ActivePolicy::Schedule { period } => format!("schedule/{period}") },
            "bytes_per_sweep": bytes_per_sweep as u64,
            "layers_streamed_per_sweep": bytes_per_sweep / layer_bytes as f64,
            "sweep_s": sweep,
            "host_enqueue_s": median(enqueue_s),
            "stall_s_per_sweep": median(stall),
            "achieved_gbps": achieved,
            "raw_pinned_gbps": raw_pinned_gbps,
            "raw_pageable_gbps": raw_pageable_gbps,
            "link_efficiency": eff,
            "sweeps_measured": args.sweeps,
        }));
        drop(rt);
    }
    if let Some(path) = &args.json_out {
        candle_offload_suite::write_results(
            path,
            "streaming",
            &device,
            serde_json::Value::Array(records),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
