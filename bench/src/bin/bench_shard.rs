//! Layer-sharding benchmark: decode of a LLaMA checkpoint split over two GPUs with per-GPU
//! budgets, against one GPU with the same total budget and with the smaller one, in the same
//! run: decode tokens/s, bytes streamed per token, time spent moving hidden states between
//! GPUs per token, the peak device memory of each GPU measured outside the allocator against
//! its budget, and whether every configuration produces the same greedy tokens (two GPUs with
//! peer access on and off, and through the host).
//!
//! Run with: `cargo run --release --features cuda -p candle-offload-bench --bin bench_shard --
//! --model-dir DIR --configs 1x4,1x12,2x4,2x6 --json-out shard.json`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_offload::diag::{self, PeakMemorySampler};
use candle_offload::placement::PlacementMode;
use candle_offload::MemoryLimit;
use candle_offload_bench::median;
use candle_offload_models::llama::{argmax, DeviceMapChoice, HiddenTransfer};
use candle_offload_models::{loader, DeviceMapRequest, Llama, OffloadSettings};
use clap::Parser;

/// Measures decode of a checkpoint sharded over GPUs.
#[derive(Parser, Debug)]
struct Args {
    /// The checkpoint (HF layout).
    #[arg(long)]
    model_dir: PathBuf,
    /// Configurations `<GPUs>x<GiB per GPU>`; `2x6` is two GPUs with 6 GiB each.
    #[arg(long, value_delimiter = ',', default_value = "1x4,1x12,2x4,2x6")]
    configs: Vec<String>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// Decode steps measured (median).
    #[arg(long, default_value_t = 24)]
    new_tokens: usize,
    /// Decode steps measured again with the hidden-state moves timed (synchronizing).
    #[arg(long, default_value_t = 8)]
    timed_tokens: usize,
    /// Placement mode for the multi-GPU configurations: `sequential` or `balanced`.
    #[arg(long, default_value = "sequential")]
    device_map: PlacementMode,
    /// Write the results as JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

/// One greedy decode step: the token after `token` at position `pos`.
fn decode_one(
    model: &Llama,
    device: &candle_core::Device,
    token: u32,
    pos: usize,
    cache: &mut candle_offload_models::Cache,
) -> candle_core::Result<u32> {
    argmax(&model.forward(&Tensor::new(&[token], device)?.unsqueeze(0)?, pos, cache)?)
}

/// One configuration: how many GPUs, how much each, and how hidden states move.
#[derive(Debug, Clone)]
struct Setup {
    name: String,
    gpus: usize,
    gib: f64,
    peer: bool,
    transfer: HiddenTransfer,
}

fn parse_config(s: &str) -> Result<Setup> {
    let (n, gib) = s
        .split_once('x')
        .with_context(|| format!("--configs: {s:?} is not <GPUs>x<GiB>, e.g. 2x6"))?;
    let gpus: usize = n.parse().with_context(|| format!("--configs: {s:?}"))?;
    let gib: f64 = gib.parse().with_context(|| format!("--configs: {s:?}"))?;
    if gpus == 0 || gib <= 0.0 {
        bail!("--configs: {s:?} needs at least one GPU and a positive budget");
    }
    Ok(Setup {
        name: s.to_string(),
        gpus,
        gib,
        peer: true,
        transfer: HiddenTransfer::Device,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    let mut setups = args
        .configs
        .iter()
        .map(|c| parse_config(c))
        .collect::<Result<Vec<_>>>()?;
    // The widest multi-GPU configuration again with peer access off, and through the host.
    if let Some(wide) = setups.iter().rfind(|s| s.gpus > 1).cloned() {
        setups.push(Setup {
            name: format!("{}-no-peer", wide.name),
            peer: false,
            ..wide.clone()
        });
        setups.push(Setup {
            name: format!("{}-host-staged", wide.name),
            transfer: HiddenTransfer::Host,
            ..wide
        });
    }
    let n_gpus = setups.iter().map(|s| s.gpus).max().unwrap_or(1);
    let devices = (0..n_gpus)
        .map(|i| candle_offload_suite::device(false, i))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let context_bytes = devices
        .iter()
        .map(|d| {
            diag::trim_memory_pool(d)?;
            diag::device_used_bytes(d)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mode = args.device_map;

    let files = loader::from_dir(&args.model_dir)?;
    let cfg = files.config.clone();
    let dtype = DType::F16;
    let t0 = Instant::now();
    let store = Arc::new(loader::load_store(&files, dtype, &devices[0], None)?);
    println!(
        "{}: {:.2} GiB ({:.2} GiB pinned) loaded in {:.1} s",
        files.origin,
        store.total_bytes() as f64 / 2f64.powi(30),
        store.pinned_bytes() as f64 / 2f64.powi(30),
        t0.elapsed().as_secs_f64()
    );
    let prompt = candle_offload_bench::random_tokens(args.prompt_len, cfg.vocab_size, 2654435761);
    let max_len = args.prompt_len + args.new_tokens + args.timed_tokens + 4;

    let mut records = Vec::new();
    let mut reference_tokens: Option<(String, Vec<u32>)> = None;
    let mut by_name = std::collections::HashMap::new();
    println!(
        "config            tok/s  streamed/token  move s/token  step s   peak MiB per GPU (budget)"
    );
    for setup in &setups {
        let used = &devices[..setup.gpus];
        for d in used {
            diag::trim_memory_pool(d)?;
        }
        let access = diag::set_peer_access(used, setup.peer)?;
        let limit = MemoryLimit::Bytes((setup.gib * 2f64.powi(30)) as u64);
        let map = Llama::plan_devices(
            &cfg,
            &DeviceMapRequest {
                devices: used,
                limits: &[Some(limit)],
                dtype,
                prompt_len: args.prompt_len,
                max_len,
                choice: &DeviceMapChoice::Mode(mode),
                prefetch_depth: 1,
            },
        )?;
        print!("{map}");
        let mut model = Llama::builder(&files, store.clone())
            .devices(used)
            .device_map(DeviceMapChoice::Planned(map.clone()))
            .dtype(dtype)
            .max_len(max_len)
            .settings(OffloadSettings::default())
            .build()?;
        model.set_hidden_transfer(setup.transfer);
        let first = used[0].clone();
        // Warm-up: JIT-compiles kernels and fills the caches.
        {
            let mut cache = model.new_cache();
            let l = model.forward(
                &Tensor::new(&prompt[..8], &first)?.unsqueeze(0)?,
                0,
                &mut cache,
            )?;
            let t = argmax(&l)?;
            decode_one(&model, &first, t, 8, &mut cache)?;
        }
        let samplers = used
            .iter()
            .map(|d| PeakMemorySampler::start(d, Duration::from_micros(500)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut cache = model.new_cache();
        model.begin_step()?;
        let logits = model.forward(
            &Tensor::new(prompt.as_slice(), &first)?.unsqueeze(0)?,
            0,
            &mut cache,
        )?;
        let mut next = argmax(&logits)?;
        model.end_step()?;
        let mut tokens = vec![next];
        let mut times = Vec::new();
        let mut bytes = Vec::new();
        let mut pos = args.prompt_len;
        for _ in 0..args.new_tokens {
            model.begin_step()?;
            let t0 = Instant::now();
            next = decode_one(&model, &first, next, pos, &mut cache)?;
            times.push(t0.elapsed().as_secs_f64());
            model.end_step()?;
            pos += 1;
            tokens.push(next);
            let mut b = 0u64;
            for (rt, _) in model.stages() {
                b += rt.stats()?.last_step.map_or(0, |s| s.bytes);
            }
            bytes.push(b as f64);
        }
        // Again with each move of the hidden state timed (both GPUs synchronized around it).
        let before = model.transfer_totals();
        model.time_transfers(true);
        let mut move_times = Vec::new();
        for _ in 0..args.timed_tokens {
            let t = model.transfer_totals();
            next = decode_one(&model, &first, next, pos, &mut cache)?;
            pos += 1;
            tokens.push(next);
            move_times.push(model.transfer_totals().seconds - t.seconds);
        }
        model.time_transfers(false);
        let after = model.transfer_totals();
        let move_s_mean = (after.seconds - before.seconds) / args.timed_tokens.max(1) as f64;
        let move_s_per_token = median(move_times.clone());
        let move_bytes_per_token = (after.bytes - before.bytes) / args.timed_tokens.max(1) as u64;
        let peaks: Vec<u64> = samplers
            .into_iter()
            .zip(&context_bytes)
            .map(|(s, &c)| s.stop().saturating_sub(c))
            .collect();
        let step_s = median(times);
        let tps = 1.0 / step_s;
        let streamed = median(bytes) as u64;
        let same = match &reference_tokens {
            None => {
                reference_tokens = Some((setup.name.clone(), tokens.clone()));
                true
            }
            Some((_, want)) => *want == tokens,
        };
        let per_device: Vec<serde_json::Value> = map
            .devices
            .iter()
            .zip(&peaks)
            .map(|(d, &peak)| {
                serde_json::json!({
                    "ordinal": d.ordinal,
                    "layers": [d.first_layer, d.first_layer + d.layer_count],
                    "budget_bytes": d.budget_bytes,
                    "reserve_bytes": d.reserve_bytes,
                    "peak_device_bytes": peak,
                    "peak_within_budget": peak <= d.budget_bytes,
                    "resident_layers": d.resident_layers,
                    "streamed_layers": d.streamed_layers(),
                })
            })
            .collect();
        println!(
            "{:<16} {tps:>6.2}  {:>11.2} GB  {move_s_per_token:>12.6}  {step_s:>6.4}   {}",
            setup.name,
            streamed as f64 / 1e9,
            map.devices
                .iter()
                .zip(&peaks)
                .map(|(d, p)| format!("{} ({})", p >> 20, d.budget_bytes >> 20))
                .collect::<Vec<_>>()
                .join(", ")
        );
        by_name.insert(setup.name.clone(), tps);
        records.push(serde_json::json!({
            "config": setup.name,
            "gpus": setup.gpus,
            "gib_per_gpu": setup.gib,
            "peer_access": setup.peer,
            "peer_access_available": access.iter().all(|&(_, _, ok)| ok),
            "hidden_transfer": format!("{:?}", setup.transfer),
            "device_map": serde_json::from_str::<serde_json::Value>(&map.to_json()?)?,
            "prompt_len": args.prompt_len,
            "decode_tokens_per_s": tps,
            "decode_step_s_median": step_s,
            "streamed_bytes_per_token": streamed,
            "activation_transfer_s_per_token": move_s_per_token,
            "activation_transfer_s_per_token_mean": move_s_mean,
            "activation_transfer_s_each_token": move_times,
            "activation_transfer_bytes_per_token": move_bytes_per_token,
            "activation_transfer_fraction_of_step": move_s_per_token / step_s,
            "devices": per_device,
            "greedy_tokens": tokens,
            "same_tokens_as": reference_tokens.as_ref().map(|(n, _)| n.clone()),
            "same_tokens": same,
        }));
        drop(model);
    }
    // Two GPUs at 6 GiB each against one at 12 GiB (same total).
    let ratio = |two: &str, one: &str| Some(by_name.get(two)? / by_name.get(one)?);
    let summary = serde_json::json!({
        "two_gpu_vs_one_gpu_same_total": ratio("2x6", "1x12"),
        "two_gpu_4_vs_one_gpu_4": ratio("2x4", "1x4"),
        "all_same_tokens": records.iter().all(|r| r["same_tokens"] == true),
    });
    println!("{summary}");
    if let Some(path) = &args.json_out {
        let results = serde_json::json!({ "configs": records, "summary": summary });
        candle_offload_bench::write_results_with_peer(path, "shard", &devices[0], results, None)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
