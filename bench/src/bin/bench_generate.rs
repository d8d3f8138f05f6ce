//! Generation benchmark: prefill time and decode tokens/s, batch 1, of a LLaMA checkpoint under
//! several GPU budgets and prompt lengths, with the bytes streamed per token against the raw
//! pinned host-to-device rate measured in the same run, and the peak device memory measured
//! outside the allocator. Merges accelerate's figures if given (scripts/accelerate_peer.py), and
//! runs llama.cpp's llama-bench on the same GGUF file in the same process (`--llamacpp-bin`):
//! for each budget and prompt length, the most layers (`-ngl`) whose measured device peak at that
//! prompt, less the idle CUDA context, stays within the budget; its prefill of the prompt from an
//! empty context, and its decode after the prompt's length of context (`-d`), as ours decodes.
//!
//! Run with: `cargo run --release --features cuda -p candle-offload-bench --bin bench_generate --
//! --model-dir DIR --budgets 4,8,12,full --prompt-lens 64,512 --peer accelerate.json --json-out
//! generate.json`;
//! for a GGUF file, `--model-dir FILE.gguf [--quantized] --llamacpp-bin LLAMA_CPP_BUILD/bin`.
#![recursion_limit = "256"] // the records' `serde_json::json!` literal

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use candle_offload::diag::{self, PeakMemorySampler};
use candle_offload::{MemoryLimit, Tuning};
use candle_offload_bench::llamacpp::{LlamaCpp, LlamaCppRecord};
use candle_offload_bench::median;
use candle_offload_models::llama::argmax;
use candle_offload_models::{loader, quantize, HostLayers, Llama, OffloadSettings};
use clap::Parser;

/// Measures prefill and decode of a checkpoint under GPU budgets.
#[derive(Parser, Debug)]
struct Args {
    /// The checkpoint: an HF-layout directory or a GGUF file.
    #[arg(long)]
    model_dir: PathBuf,
    /// Keep a GGUF file's quantized weights as GGML blocks (streamed and multiplied as they
    /// are); by default they are dequantized to F16.
    #[arg(long)]
    quantized: bool,
    /// Quantize a safetensors checkpoint on load to this GGML type (q8_0, q6_k, q5_k, q4_k,
    /// q4_0), through the library's cached GGUF next to the model, and keep the blocks.
    #[arg(long, conflicts_with = "quantized")]
    quantize: Option<String>,
    /// The model's name for the records' `model` (default: the checkpoint's path).
    #[arg(long)]
    model_name: Option<String>,
    /// A mixture-of-experts benchmark file's router (`uniform`, `skewed`), for the records.
    #[arg(long)]
    routing: Option<String>,
    /// What the weights are, for the records (default: the file or directory name).
    #[arg(long)]
    weights: Option<String>,
    /// Run llama.cpp's llama-bench from this directory on the same GGUF file, next to ours.
    #[arg(long)]
    llamacpp_bin: Option<PathBuf>,
    /// A mixture-of-experts model: llama.cpp keeps every layer on the GPU (`-ngl 99 -fa 1`)
    /// and its budget search moves the experts of the first layers to the CPU (`-ncmoe N`,
    /// the fewest that fit) instead of whole layers.
    #[arg(long)]
    llamacpp_moe: bool,
    /// A mixture-of-experts model's expert cache policy: `lru`, `lfu` or `lfu:HALF_LIFE`.
    #[arg(long, default_value = "lru")]
    expert_policy: candle_offload::experts::ExpertPolicy,
    /// Where missing experts run: `auto`, `on`, `fetch` or `off` (`OffloadConfig::experts`).
    #[arg(long, default_value = "auto")]
    expert_split: candle_offload::experts::ExpertSplit,
    /// Prefetch the next layer's guessed experts in decode steps (`ExpertOptions::prefetch`;
    /// on by default, `--expert-prefetch false` turns it off).
    #[arg(long, num_args = 0..=1, default_value_t = true, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    expert_prefetch: bool,
    /// With --expert-prefetch, the mixture-of-experts layers ahead a decode step guesses for.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
    expert_guess_layers: u16,
    /// Who chooses a decode row's experts: `auto`, `host` or `device` (`ExpertOptions::route`).
    #[arg(long, default_value = "auto")]
    expert_route: candle_offload::experts::ExpertRoute,
    /// Which experts a decode step read from host memory the cache admits: `always` or
    /// `repeat` (`ExpertOptions::admission`).
    #[arg(long, default_value = "always")]
    expert_admit: candle_offload::experts::ExpertAdmission,
    /// How the expert cache's slots spread over the layers: `spread` or `layers`
    /// (`ExpertOptions::slots`).
    #[arg(long, default_value = "spread")]
    expert_slots: candle_offload::experts::ExpertSlots,
    /// Run a decode row's routed experts one by one instead of through the grouped kernels
    /// (`KernelTuning::grouped_experts` off).
    #[arg(long)]
    per_expert: bool,
    /// llama-bench repetitions per measured configuration.
    #[arg(long, default_value_t = 2)]
    llamacpp_reps: u32,
    /// llama.cpp's layer count to try first at each budget, in `--budgets`' order (its `-ngl`;
    /// with `--llamacpp-moe`, the layers whose experts stay on the GPU: the layers less
    /// `-ncmoe`), from an earlier run: two probes confirm it (it fits, one more does not)
    /// instead of the search's four or five, each a load of the whole file; one off costs two
    /// or three, and the search goes on from further off. After the first prompt length, a
    /// budget's answer there is the next length's first guess.
    #[arg(long, value_delimiter = ',')]
    llamacpp_layers_hint: Vec<u32>,
    /// How often the peak-memory sampler polls the driver's free memory during the timed part,
    /// in microseconds; 0 runs without it (no peak recorded), to see what polling costs.
    #[arg(long, default_value_t = 500)]
    sampler_us: u64,
    /// Budgets in GiB, or `full` (no limit: everything on the GPU).
    #[arg(long, value_delimiter = ',', default_value = "4,8,12,full")]
    budgets: Vec<String>,
    /// Prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "64,512")]
    prompt_lens: Vec<usize>,
    /// Decode steps measured (median).
    #[arg(long, default_value_t = 16)]
    new_tokens: usize,
    /// The token each single-sequence decode step is fed (`--batch` rows stay greedy):
    /// `greedy` (the last step's argmax), `random` (a
    /// fixed pseudo-random sequence, as llama-bench's generation test feeds) or `auto` (random
    /// for a mixture-of-experts model, whose routing, and so its expert cache's hits, follows
    /// the tokens: a random-weight model's greedy output repeats a few tokens, which a cache
    /// holds and llama.cpp's static placement cannot use; greedy otherwise).
    #[arg(long, default_value = "auto")]
    decode_tokens: DecodeTokens,
    /// Decoder layers run on the host CPU in front of the GPU, per configuration: `none`
    /// (stream what does not fit), `auto` (the fewest that let the GPU hold the rest), a
    /// count, `spread:N`, `spread:N+head` (the output head on the host too) or `spread:auto`;
    /// several (comma-separated) run each budget once per entry.
    #[arg(long, value_delimiter = ',', default_value = "none")]
    host_layers: Vec<HostLayers>,
    /// Prefetch depths to run (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    depths: Vec<usize>,
    /// Run on the CPU.
    #[arg(long)]
    cpu: bool,
    /// Weights and compute dtype: f32, f16 or bf16 (default: f16 on a GPU, f32 on the CPU).
    #[arg(long)]
    dtype: Option<String>,
    /// Turn cudarc's per-buffer event tracking on (`OffloadConfig::event_tracking`, off by
    /// default).
    #[arg(long)]
    event_tracking: bool,
    /// Multiply GGML blocks on the CPU against 8-bit quantized activations with integer dot
    /// products, as llama.cpp does (`Tuning::kernels.cpu_q8_activations`; host layers, --cpu).
    #[arg(long)]
    q8_activations: bool,
    /// Run the Candle compositions instead of the fused ops (`CausalLm::set_fused`, on by
    /// default on a GPU).
    #[arg(long)]
    unfused: bool,
    /// Decode every step eagerly: no CUDA graph capture and replay (`CausalLm::set_graphs`,
    /// on by default; it applies to single-sequence decode steps of a resident GPU model).
    #[arg(long)]
    no_graphs: bool,
    /// After each configuration's single-sequence run, decode this many left-padded prompts
    /// at once (lengths prompt-len, prompt-len − 1, …) and report tokens/s in total and per
    /// sequence; the budget's reserve then includes the batch (`Config::batch_reserve_bytes`).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Open the CUDA profiler's capture around the timed decode steps only, for a profiler
    /// started with `--profile-from-start off` (scripts/kernel_breakdown.py decode runs ncu so).
    #[arg(long)]
    profile_decode: bool,
    /// Sample the host threads' stacks during the timed decode steps (a build with the
    /// `host-profile` feature of this crate): one folded-stack file per configuration in this
    /// directory, and each thread's samples and the busiest thread's top functions in the record.
    #[arg(long)]
    host_profile: Option<PathBuf>,
    /// Host memory for the weights (GiB, `12GiB`, `50%`): the layers past it stay in the
    /// checkpoint file and are read from disk on every fetch (`StoreConfig::host_memory_limit`).
    #[arg(long)]
    cpu_memory_limit: Option<String>,
    /// Read the disk tier through the page cache instead of O_DIRECT.
    #[arg(long)]
    disk_page_cache: bool,
    /// How weights reach the GPU: explicit (copies from pinned memory) or managed (Unified
    /// Memory, migrated by prefetch).
    #[arg(long, default_value = "explicit")]
    engine: String,
    /// The disk's raw sequential read rate in GB/s, measured in the same run outside this
    /// binary (a plain large-block read of the checkpoint), for `disk_efficiency`.
    #[arg(long)]
    raw_disk_gbps: Option<f64>,
    /// What the page cache held when this ran (`cold`, `warm`), for the records.
    #[arg(long)]
    cache_state: Option<String>,
    /// The peer's JSON (scripts/accelerate_peer.py), measured in the same run.
    #[arg(long)]
    peer: Option<PathBuf>,
    /// Write the results as JSON here (rewritten after each configuration, so that a run cut
    /// short keeps the rows it finished).
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn main() -> Result<()> {
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    let device = candle_offload_suite::device(args.cpu, 0)?;
    // The defaults for this host with the environment's overrides (docs/tuning.md), and
    // --q8-activations.
    let mut tuning =
        candle_offload_suite::tuning_env::tuning_from_env(Tuning::default()).fitted_to_host();
    if args.per_expert {
        tuning.kernels.grouped_experts = false;
    }
    if args.q8_activations {
        tuning.kernels.cpu_q8_activations = true;
    }
    // What a record calls an override: a choice other than this host's default.
    let defaults = Tuning::for_host();
    let changed = |differs: bool, value: String| differs.then_some(value);
    let gpu = !device.is_cpu();
    let candle_offload_bench::LinkBaseline {
        context_bytes,
        raw_pinned_gbps,
        ..
    } = candle_offload_bench::link_baseline(&device, false)?;
    let peer: Option<serde_json::Value> = match &args.peer {
        Some(p) => Some(serde_json::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("{}", p.display()))?,
        )?),
        None => None,
    };

    let files = if args.model_dir.is_file() {
        loader::from_gguf(&args.model_dir)?
    } else {
        loader::from_dir(&args.model_dir)?
    };
    let cfg = files.config.clone();
    let dtype = match args.dtype.as_deref() {
        None if gpu => DType::F16,
        None => DType::F32,
        Some("f32") => DType::F32,
        Some("f16") => DType::F16,
        Some("bf16") => DType::BF16,
        Some(other) => anyhow::bail!("--dtype {other}: expected f32, f16 or bf16"),
    };
    let t0 = Instant::now();
    let engine: candle_offload::EngineKind = args.engine.parse()?;
    let store_cfg = candle_offload::StoreConfig {
        dtype: Some(dtype),
        host_memory_limit: args
            .cpu_memory_limit
            .as_deref()
            .map(|s| MemoryLimit::parse("--cpu-memory-limit", s))
            .transpose()?,
        disk_page_cache: args.disk_page_cache,
        engine,
        disk_reads: tuning.disk,
        ..Default::default()
    };
    let store = Arc::new(match &args.quantize {
        Some(name) => {
            let ty = quantize::parse_type(name).with_context(|| {
                format!(
                    "--quantize {name:?}: not one of {}",
                    quantize::TYPES.map(|(n, _)| n).join(", ")
                )
            })?;
            let opts = quantize::QuantizeOptions::default();
            let (store, cached) =
                quantize::load_store_config(&files, ty, &store_cfg, &device, &opts)?;
            println!(
                "quantized on load: {} ({:?})",
                cached.path.display(),
                cached.state
            );
            store
        }
        None => loader::load_store_config(&files, &store_cfg, &device, args.quantized)?,
    });
    // Disk units by name, with the bytes a fetch of each reads (its host layout, not its
    // device size: they differ for GGUF's padded blocks).
    let disk_units: std::collections::HashMap<String, u64> = store
        .units()
        .iter()
        .filter(|u| u.tier() == candle_offload::TierKind::Disk)
        .map(|u| (u.name().to_string(), u.host_bytes()))
        .collect();
    let weights = args.weights.clone().unwrap_or_else(|| {
        let stem = args.model_dir.file_stem().unwrap_or_default();
        stem.to_string_lossy().into_owned()
    });
    let load_s = t0.elapsed().as_secs_f64();
    println!(
        "{}: {:.2} GiB ({:.2} GiB pinned) loaded in {load_s:.1} s; raw pinned {raw_pinned_gbps:.1} GB/s; context {} MiB",
        files.origin,
        store.total_bytes() as f64 / 2f64.powi(30),
        store.pinned_bytes() as f64 / 2f64.powi(30),
        context_bytes >> 20
    );
    let llamacpp = match &args.llamacpp_bin {
        Some(bin) if gpu => {
            let budgets: Vec<Option<u64>> = args
                .budgets
                .iter()
                .map(|b| match b.as_str() {
                    "full" => Ok(None),
                    b => MemoryLimit::parse("--budgets", b)?
                        .resolve("gpu", None)
                        .map(Some)
                        .map_err(anyhow::Error::from),
                })
                .collect::<Result<_>>()?;
            let lc = LlamaCpp {
                bench: bin.join("llama-bench"),
                model: args.model_dir.clone(),
                device: device.clone(),
                context_bytes,
                layers: cfg.num_hidden_layers as u32,
                moe: args.llamacpp_moe,
                hints: args.llamacpp_layers_hint.clone(),
            };
            lc.measure(
                &budgets,
                &args.prompt_lens,
                args.new_tokens,
                args.llamacpp_reps,
            )?
        }
        Some(_) => anyhow::bail!("--llamacpp-bin needs a GPU"),
        None => Vec::new(),
    };
    let prompt_of = |len: usize| {
        candle_offload_bench::random_tokens(len, cfg.vocab_size, len as u64 * 2654435761 + 1)
    };
    // The tokens a decode fed at random reads, one per step; `None`: greedy.
    let decode_feed = match args.decode_tokens {
        DecodeTokens::Greedy => false,
        DecodeTokens::Random => true,
        DecodeTokens::Auto => cfg.layout().experts.is_some(),
    }
    .then(|| candle_offload_bench::random_tokens(args.new_tokens, cfg.vocab_size, 7919));

    // The host's memory read rate, for the physical bound of what reads host memory every
    // token (a mixture-of-experts model's host experts and fetches): measured once, on the
    // first record that has an expert cache.
    let host_read_gbps = std::cell::OnceCell::new();
    let mut records = Vec::new();
    // The results file (when asked for), written whole from the records so far.
    let write_json = |records: &[serde_json::Value]| -> Result<()> {
        if let Some(path) = &args.json_out {
            candle_offload_bench::write_results_with_peer(
                path,
                "generate",
                &device,
                serde_json::Value::Array(records.to_vec()),
                peer.clone(),
            )?;
        }
        Ok(())
    };
    println!("prompt budget depth  prefill s  decode tok/s  streamed/token  link ceiling  peak MiB (budget)  accelerate tok/s  speed-up");
    let mut configs = Vec::new();
    for &prompt_len in &args.prompt_lens {
        for budget in &args.budgets {
            for &depth in &args.depths {
                for &host in &args.host_layers {
                    let first = depth == args.depths[0] && host == args.host_layers[0];
                    if budget != "full" || first {
                        configs.push((prompt_len, budget.clone(), depth, host));
                    }
                }
            }
        }
    }
    {
        for (prompt_len, budget, depth, host) in configs {
            let budget = &budget;
            diag::trim_memory_pool(&device)?;
            let limit = match budget.as_str() {
                "full" => None,
                b => Some(MemoryLimit::parse("--budgets", b)?),
            };
            let max_len = prompt_len + args.new_tokens + 2;
            let settings = OffloadSettings {
                gpu_memory_limit: limit,
                prefetch_depth: depth,
                event_tracking: args.event_tracking,
                reserve_bytes: cfg.batch_reserve_bytes(args.batch, prompt_len, max_len, dtype),
                tuning,
                experts: candle_offload::experts::ExpertOptions::new(
                    args.expert_policy,
                    args.expert_split,
                )
                .with_prefetch(args.expert_prefetch)
                .with_guess_layers(usize::from(args.expert_guess_layers))
                .with_route(args.expert_route)
                .with_admission(args.expert_admit)
                .with_slots(args.expert_slots),
                ..Default::default()
            };
            let mut model = Llama::builder(&files, store.clone())
                .device(&device)
                .dtype(dtype)
                .prompt_len(prompt_len)
                .max_len(max_len)
                .settings(settings.clone())
                .host_layers(host)
                .build()?;
            if args.unfused {
                model.set_fused(false);
            }
            if args.no_graphs {
                model.set_graphs(false);
            }
            let host_layers = model.host_layer_count();
            // What the device's stage (the last: host layers and embeddings run in a CPU stage
            // before it) reserves, less the batch's extra room: a resident stage of GGML blocks
            // less than `Llama::reserve_bytes`, a stage behind host layers its own layers' KV.
            let reserve = model
                .stages()
                .last()
                .map_or(0, |(rt, _)| rt.budget().reserve_bytes)
                .saturating_sub(settings.reserve_bytes);
            // What `spread:auto` timed to choose (one layer's step on the host and the GPU), and
            // the splits it priced, this one among them.
            let layer_steps = model.spread_auto_layer_steps();
            let prices = model.spread_auto_prices();
            let chosen_price = prices
                .iter()
                .find(|p| (p.host_layers, p.host_head) == (host_layers, model.head_on_host()));
            let price_json = |p: &candle_offload::SplitPrice| {
                serde_json::json!({
                    "host_layers": p.host_layers,
                    "host_head": p.host_head,
                    "host_bytes": p.host_bytes,
                    "streamed_bytes": p.streamed_bytes,
                    "compute_s": p.compute_s,
                    "copies_s": p.copies_s,
                    "cost_s": p.cost_s,
                })
            };
            if host_layers > 0 || model.head_on_host() {
                let head = if model.head_on_host() {
                    " and the output head"
                } else {
                    ""
                };
                println!("        {host_layers} layers{head} on the host CPU ({host:?})");
                if let Some(p) = chosen_price {
                    println!(
                        "        priced at {:.1} ms a step (compute {:.1} ms, copies {:.1} ms)",
                        p.cost_s * 1e3,
                        p.compute_s * 1e3,
                        p.copies_s * 1e3
                    );
                }
            }
            if let Some(rows) = model.prompt_chunk() {
                println!("        the prompt runs in passes of {rows} rows (a near fit)");
            }
            // The GPU's runtime (the last stage's; the only one without host layers).
            let rt = model
                .stages()
                .last()
                .map(|(rt, _)| (*rt).clone())
                .expect("a stage");
            // What stays is copied in with the load, as `generate` does (a mixture-of-experts
            // model's host copies of its experts among it).
            model.warm_up()?;
            {
                // Before each configuration is timed: the first use of each kernel JIT-compiles
                // its PTX (and cuBLAS loads its kernels for each new shape: the measured prompt
                // length, not a shorter one, which decode-step kernels would serve), and a new
                // model's first sweep uploads every unit that then stays resident (13.5 GB of
                // F16 at the full budget, ~0.25 s). llama-bench times its prompts with the
                // weights already on the GPU; so do we.
                let mut cache = model.new_cache();
                let l = model.forward(
                    &Tensor::new(&prompt_of(prompt_len)[..], &device)?.unsqueeze(0)?,
                    0,
                    &mut cache,
                )?;
                argmax(&l)?;
                argmax(&model.forward(
                    &Tensor::new(&[1u32], &device)?.unsqueeze(0)?,
                    prompt_len,
                    &mut cache,
                )?)?;
            }
            let sampler = if gpu && args.sampler_us > 0 {
                Some(PeakMemorySampler::start(
                    &device,
                    Duration::from_micros(args.sampler_us),
                )?)
            } else {
                None
            };
            // The driver pool's high-water marks over the timed part: in use, and held (in use,
            // kept free, or lost to fragmentation). The reserved mark starts at what the pool
            // holds now, warm-up included.
            if gpu {
                candle_offload::diag::pool_peak_used_bytes(&device, true)?;
                candle_offload::diag::pool_peak_reserved_bytes(&device, true)?;
            }
            let prompt = prompt_of(prompt_len);
            let mut cache = model.new_cache();
            let experts_before_prompt = model.expert_stats();
            model.begin_step()?;
            let t0 = Instant::now();
            let logits = model.forward(
                &Tensor::new(prompt.as_slice(), &device)?.unsqueeze(0)?,
                0,
                &mut cache,
            )?;
            // When the host had enqueued the prompt's work (the argmax below waits for the GPU):
            // near `prefill_s`, the host's launches pace the prompt; well under it, the GPU does.
            let prefill_enqueue_s = t0.elapsed().as_secs_f64();
            let mut next = argmax(&logits)?;
            let prefill_s = t0.elapsed().as_secs_f64();
            model.end_step()?;
            let experts_after_prompt = model.expert_stats();
            // The prompt's marks, then the decode's from here (which phase reached the peak).
            let prefill_peaks = if gpu {
                Some((
                    sampler
                        .as_ref()
                        .map(|s| s.peak().saturating_sub(context_bytes)),
                    candle_offload::diag::pool_peak_used_bytes(&device, true)?,
                    candle_offload::diag::pool_peak_reserved_bytes(&device, true)?,
                ))
            } else {
                None
            };
            if let Some(s) = &sampler {
                s.reset(diag::device_used_bytes(&device)?);
            }
            let before_decode = rt.stats()?.total;
            let mut times = Vec::new();
            let mut host_times = Vec::new();
            let mut bytes = Vec::new();
            let disk_fetched = |rt: &candle_offload::OffloadRuntime| -> Result<u64> {
                Ok(rt
                    .stats()?
                    .units
                    .iter()
                    .filter_map(|u| Some((u.misses + u.prefetches) * disk_units.get(&u.name)?))
                    .sum())
            };
            let disk_before = disk_fetched(&rt)?;
            let host_before = model.host_totals();
            let experts_before = model.expert_stats();
            let decode_t0 = Instant::now();
            if args.profile_decode {
                candle_offload::diag::profiler_capture(&device, true)?;
            }
            let host_profile = match &args.host_profile {
                Some(dir) => Some(candle_offload_bench::HostProfile::start_in(dir, 997)?),
                None => None,
            };
            for i in 0..args.new_tokens {
                model.begin_step()?;
                let t0 = Instant::now();
                let token = decode_feed.as_ref().map_or(next, |f| f[i]);
                let logits = model.forward(
                    &Tensor::new(&[token], &device)?.unsqueeze(0)?,
                    prompt_len + i,
                    &mut cache,
                )?;
                // The host's share: the forward returns once every kernel is queued (or once
                // the host waited for the device inside it); the argmax then waits for the GPU.
                host_times.push(t0.elapsed().as_secs_f64());
                next = argmax(&logits)?;
                times.push(t0.elapsed().as_secs_f64());
                model.end_step()?;
                bytes.push(rt.stats()?.last_step.map_or(0.0, |s| s.bytes as f64));
            }
            let decode_wall_s = decode_t0.elapsed().as_secs_f64();
            let host_top = match (host_profile, &args.host_profile) {
                (Some(p), Some(dir)) => {
                    let name = format!("{weights}-{budget}-p{prompt_len}-d{depth}-{host:?}")
                        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "_");
                    Some(p.finish(&dir.join(format!("{name}.folded")), 40)?)
                }
                _ => None,
            };
            // The host's share of the timed steps, and one host layer timed again as
            // `spread:auto` timed it at build (what it predicted, against what ran).
            let host_run = model.host_totals().since(&host_before);
            let host_retimed_s = match host_run.layer_step_s() {
                Some(_) => Some(candle_offload_models::CausalLm::host_layer_seconds(
                    model.config(),
                    &store,
                    model.dtype(),
                    prompt_len + args.new_tokens / 2,
                    &tuning,
                )?),
                None => None,
            };
            let after_decode = rt.stats()?.total;
            // The expert tier over the timed decode steps.
            let experts = match (experts_before, model.expert_stats()) {
                (Some(a), Some(b)) => {
                    let read = *host_read_gbps
                        .get_or_init(|| candle_offload_bench::host_read_gbps(1 << 30, 3));
                    let mut x = expert_fields(&a, &b, args.new_tokens, read);
                    // The timed prompt's fields beside the decode steps'.
                    let prompt = prompt_expert_fields(
                        experts_before_prompt.as_ref(),
                        experts_after_prompt.as_ref(),
                        prompt_len,
                        read,
                    );
                    if let (serde_json::Value::Object(o), serde_json::Value::Object(p)) =
                        (&mut x, prompt)
                    {
                        o.extend(p);
                    }
                    Some(x)
                }
                _ => None,
            };
            let reused = after_decode.reused_buffers - before_decode.reused_buffers;
            let decode_trims = after_decode.pool_trims - before_decode.pool_trims;
            // The device stage's reservation and weight capacity while decoding (a model gives
            // the prompt's activations to weights then: `CausalLm`'s phase reservation).
            let decode_stats = match model.stages().last() {
                Some((rt, _)) => Some(rt.stats()?),
                None => None,
            };
            let disk_per_token =
                (disk_fetched(&rt)? - disk_before) as f64 / args.new_tokens.max(1) as f64;
            if args.profile_decode {
                candle_offload::diag::profiler_capture(&device, false)?;
            }
            let host_s = median(host_times);
            // Over the prompt and the decode.
            let pool_peaks = match prefill_peaks {
                Some((_, used, held)) => Some((
                    candle_offload::diag::pool_peak_used_bytes(&device, false)?.max(used),
                    candle_offload::diag::pool_peak_reserved_bytes(&device, false)?.max(held),
                )),
                None => None,
            };
            let peak = sampler.map(|s| {
                let decode = s.stop().saturating_sub(context_bytes);
                decode.max(prefill_peaks.and_then(|p| p.0).unwrap_or(0))
            });
            // Each step's time too: a mixture-of-experts step's varies with its misses and route.
            let step_times = times.clone();
            let step_s = median(times);
            let streamed = median(bytes);
            let batch = if args.batch > 1 {
                Some(batch_decode(
                    &model,
                    &device,
                    args.batch,
                    prompt_len,
                    args.new_tokens,
                    gpu,
                    &prompt_of,
                )?)
            } else {
                None
            };
            if let Some(b) = &batch {
                println!(
                    "        batch of {}: decode {:.2} tok/s in total, {:.2} per sequence (step {:.2} ms){}",
                    args.batch,
                    args.batch as f64 / b.step_s,
                    1.0 / b.step_s,
                    b.step_s * 1e3,
                    if gpu {
                        format!(", peak {} MiB", b.peak.saturating_sub(context_bytes) >> 20)
                    } else {
                        String::new()
                    }
                );
            }
            let ceiling_s = if raw_pinned_gbps > 0.0 {
                streamed / (raw_pinned_gbps * 1e9)
            } else {
                0.0
            };
            let budget_bytes = limit
                .map(|l| l.resolve("gpu", rt.device_memory().ok().flatten().map(|(_, t)| t)))
                .transpose()?;
            let lc_rec = llamacpp
                .iter()
                .find(|r| r.budget_bytes == budget_bytes && r.prompt_len == prompt_len);
            let ngl = lc_rec.map(|r| r.ngl);
            let ncmoe = lc_rec.and_then(|r| r.ncmoe);
            // Both decode after the prompt: its decode at the prompt's depth is the peer figure.
            let lc_decode = lc_rec.and_then(|r| r.decode_at(prompt_len));
            let lc_decode_empty = lc_rec.and_then(|r| r.decode_at(0));
            let lc_prefill = lc_rec.and_then(LlamaCppRecord::prefill);
            let lc_peak = lc_rec.map(|r| r.peak_bytes);
            let peer_rec = peer.as_ref().and_then(|p| {
                p["results"]
                    .as_array()?
                    .iter()
                    .find(|r| r["budget"] == budget.as_str() && r["prompt_len"] == prompt_len)
                    .cloned()
            });
            let acc_tps = peer_rec
                .as_ref()
                .and_then(|r| r["decode_tokens_per_s"].as_f64());
            let tps = 1.0 / step_s;
            // Disk: bytes read per token over the decode's wall time, and against the raw rate.
            let disk_read_gbps = disk_per_token * args.new_tokens as f64 / decode_wall_s / 1e9;
            let disk_efficiency = args
                .raw_disk_gbps
                .filter(|_| disk_per_token > 0.0)
                .map(|raw| disk_per_token / (raw * 1e9) / step_s);
            if disk_per_token > 0.0 {
                println!(
                    "        disk: {:.2} GB read per token, {disk_read_gbps:.2} GB/s{}",
                    disk_per_token / 1e9,
                    disk_efficiency.map_or(String::new(), |e| format!(
                        ", {e:.2} of the raw rate's time per token"
                    ))
                );
            }
            println!(
                "{prompt_len:>6} {budget:>6} {depth:>5}  {prefill_s:>9.3}  {tps:>12.2}  {:>11.2} GB  {:>12.3}  {:>8} ({:>6})  {:>16}  {:>8}",
                streamed / 1e9,
                ceiling_s / step_s,
                peak.map_or("-".into(), |p| (p >> 20).to_string()),
                budget_bytes.map_or("none".into(), |b| (b >> 20).to_string()),
                acc_tps.map_or("-".into(), |a| format!("{a:.2}")),
                acc_tps.map_or("-".into(), |a| format!("{:.1}x", tps / a)),
            );
            if let Some((used, held)) = pool_peaks {
                println!(
                    "        pool: {} MiB in use at most, {} MiB held",
                    used >> 20,
                    held >> 20
                );
            }
            if let Some((dev_peak, used, held)) = prefill_peaks {
                println!(
                    "        prompt: peak {} MiB, pool {} MiB in use at most, {} held, enqueued in {:.2} of {:.2} ms; decode: {:.1} buffers reused a token",
                    dev_peak.map_or("-".into(), |p| (p >> 20).to_string()),
                    used >> 20,
                    held >> 20,
                    prefill_enqueue_s * 1e3,
                    prefill_s * 1e3,
                    reused as f64 / args.new_tokens.max(1) as f64
                );
            }
            if host_run.layer_steps + host_run.head_steps > 0 {
                let ms = |s: Option<f64>| s.map_or("-".into(), |s| format!("{:.2} ms", s * 1e3));
                println!(
                    "        host: {} a layer while decoding ({} timed alone now, {} at build), the head {}",
                    ms(host_run.layer_step_s()),
                    ms(host_retimed_s),
                    ms(layer_steps.map(|s| s.host_s)),
                    ms(host_run.head_step_s())
                );
            }
            if let Some(l) = lc_decode {
                println!(
                    "        llama.cpp -ngl {}: decode {l:.2} tok/s ({:.2}x ours over theirs), prefill {} tok/s (ours {:.1})",
                    ngl.unwrap_or(0),
                    tps / l,
                    lc_prefill.map_or("-".into(), |p| format!("{p:.1}")),
                    prompt_len as f64 / prefill_s
                );
            }
            records.push(serde_json::json!({
                "model": args.model_name.clone().unwrap_or_else(|| files.origin.clone()),
                "model_path": files.origin,
                "routing": args.routing,
                "weights": weights,
                "quantized_blocks": args.quantized || args.quantize.is_some(),
                "quantize_on_load": args.quantize,
                "prefill_tokens_per_s": prompt_len as f64 / prefill_s,
                "llamacpp_ngl": ngl,
                "llamacpp_ncmoe": ncmoe,
                "llamacpp_peak_device_bytes": lc_peak,
                "llamacpp_decode_tokens_per_s": lc_decode,
                "llamacpp_decode_depth": lc_decode.map(|_| prompt_len),
                "llamacpp_decode_tokens_per_s_empty_context": lc_decode_empty,
                "llamacpp_prefill_tokens_per_s": lc_prefill,
                "vs_llamacpp": lc_decode.map(|l| tps / l),
                "prefill_vs_llamacpp": lc_prefill.map(|l| prompt_len as f64 / prefill_s / l),
                "prompt_len": prompt_len,
                "budget": budget,
                "budget_bytes": budget_bytes,
                "reserve_bytes": reserve,
                "decode_reserve_bytes": decode_stats.as_ref().map(|s| s.reserve_bytes),
                "decode_weight_capacity_bytes": decode_stats.as_ref().map(|s| s.weight_capacity_bytes),
                "decode_resident_bytes": decode_stats.as_ref().map(|s| s.resident_bytes),
                "peak_device_bytes": peak,
                "sampler_period_us": (gpu && args.sampler_us > 0).then_some(args.sampler_us),
                "pool_peak_used_bytes": pool_peaks.map(|p| p.0),
                "pool_peak_reserved_bytes": pool_peaks.map(|p| p.1),
                "prefill_peak_device_bytes": prefill_peaks.and_then(|p| p.0),
                "prefill_pool_peak_used_bytes": prefill_peaks.map(|p| p.1),
                "prefill_pool_peak_reserved_bytes": prefill_peaks.map(|p| p.2),
                "decode_reused_buffers_per_token": reused as f64 / args.new_tokens.max(1) as f64,
                "decode_pool_trims": decode_trims,
                "pool_trims_total": rt.stats()?.total.pool_trims,
                "context_bytes": context_bytes,
                "peak_within_budget": budget_bytes.zip(peak).map(|(b, p)| p <= b),
                "prefill_s": prefill_s,
                "prefill_enqueue_s": prefill_enqueue_s,
                "decode_step_s_median": step_s,
                "decode_step_s": step_times,
                "decode_tokens_per_s": tps,
                "decode_host_forward_s_median": host_s,
                "store_load_s": load_s,
                "store_bytes": store.total_bytes(),
                "batch": args.batch,
                "batch_decode_step_s_median": batch.as_ref().map(|b| b.step_s),
                "batch_decode_tokens_per_s_total": batch.as_ref().map(|b| args.batch as f64 / b.step_s),
                "batch_decode_tokens_per_s_per_sequence": batch.as_ref().map(|b| 1.0 / b.step_s),
                "batch_peak_device_bytes": batch.as_ref().map(|b| b.peak.saturating_sub(context_bytes)),
                "streamed_bytes_per_token": streamed as u64,
                "raw_pinned_gbps": raw_pinned_gbps,
                "link_ceiling_tokens_per_s": if ceiling_s > 0.0 { Some(1.0 / ceiling_s) } else { None },
                "link_ceiling_fraction": if step_s > 0.0 { ceiling_s / step_s } else { 0.0 },
                "prefetch_depth": depth,
                "event_tracking": args.event_tracking,
                "fused": model.fused(),
                "accelerate_decode_tokens_per_s": acc_tps,
                "accelerate_prefill_s": peer_rec.as_ref().and_then(|r| r["prefill_s"].as_f64()),
                "accelerate_peak_gpu_bytes_torch": peer_rec.as_ref().and_then(|r| r["peak_gpu_bytes_torch"].as_u64()),
                "speedup_vs_accelerate": acc_tps.map(|a| tps / a),
            }));
            let graph_stats = model.graph_stats();
            println!(
                "  graphs {}: {} captured, {} replayed, {} eager{}",
                if model.graphs() { "on" } else { "off" },
                graph_stats.captures,
                graph_stats.replays,
                graph_stats.eager_steps,
                graph_stats
                    .last_reason
                    .as_deref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            );
            // The storage tiers' fields (one `json!` would pass the macro's recursion limit).
            let tiers = serde_json::json!({
                "engine": engine.to_string(),
                "host_layers_choice": format!("{host:?}"),
                "host_layer_step_s": layer_steps.map(|s| s.host_s),
                // Measured while decoding (mean over the timed steps), and timed again alone.
                "decode_host_layer_s": host_run.layer_step_s(),
                "decode_host_head_s": host_run.head_step_s(),
                "host_layer_step_s_after_decode": host_retimed_s,
                "device_layer_step_s": layer_steps.map(|s| s.device_s),
                // `spread:auto`'s price of the split it chose (seconds a decode step) and of
                // every split it weighed, to set against `decode_step_s_median`.
                "spread_price_s": chosen_price.map(|p| p.cost_s),
                "spread_prices": prices.iter().map(price_json).collect::<Vec<_>>(),
                "host_layers": host_layers,
                "host_head": model.head_on_host(),
                "prompt_chunk": model.prompt_chunk(),
                // `fused` is every stage's; with host layers the CPU stage runs Candle's ops.
                "fused_on_gpus": model.fused_on_gpus(),
                // Every performance choice this run made, as the library took it.
                "tuning": tuning,
                "cpu_q8_activations": tuning.kernels.cpu_q8_activations,
                "grouped_experts": tuning.kernels.grouped_experts,
                "cpu_kquants": tuning.kernels.cpu_kquants,
                // Choices other than this host's defaults (`None`: the default).
                "weight_pool_env": changed(
                    tuning.weight_pool != defaults.weight_pool,
                    tuning.weight_pool.to_string()
                ),
                "cpu_threads_env": tuning.cpu_threads.map(|n| n.to_string()),
                "cpu_prefetch_bytes_env": changed(
                    tuning.kernels.cpu_prefetch_bytes != defaults.kernels.cpu_prefetch_bytes,
                    tuning.kernels.cpu_prefetch_bytes.to_string()
                ),
                "host_profile": host_top,
                "prefill_gemm": tuning.kernels.prefill_gemm,
                // The fewest prompt rows the GEMM takes, for every block type.
                "prefill_gemm_min_rows": tuning.kernels.prefill_gemm_min_rows,
                "prefill_gemm_min_rows_env": changed(
                    tuning.kernels.prefill_gemm_min_rows != defaults.kernels.prefill_gemm_min_rows,
                    tuning.kernels.prefill_gemm_min_rows.to_string()
                ),
                // "default" where every block type runs its default variant, else "forced".
                "qlinear_variant": if tuning.kernels.qlinear == defaults.kernels.qlinear {
                    "default"
                } else {
                    "forced"
                },
                // The K-quant kernel's switch (Q4_K, Q6_K).
                "qlinear_k": tuning.kernels.qlinear_k,
                "qlinear_k_rows": tuning.kernels.qlinear_k_rows,
                // The variant each GGML block type ran.
                "qlinear_variants": tuning.kernels.qlinear.entries()
                    .map(|(t, v)| (format!("{t:?}"), v.name()))
                    .into_iter()
                    .collect::<std::collections::BTreeMap<_, _>>(),
                "host_budget_bytes": store.host_limit_bytes(),
                "peak_host_pinned_bytes": store.pinned_bytes(),
                "host_disk_bytes": store.disk_bytes(),
                "disk_page_cache": args.disk_page_cache,
                "cache_state": args.cache_state,
                "disk_bytes_per_token": disk_per_token as u64,
                "disk_read_gbps": disk_read_gbps,
                "raw_disk_gbps": args.raw_disk_gbps,
                "disk_efficiency": disk_efficiency,
                // The read shape's overrides, where set (the library's defaults otherwise).
                "disk_threads_env": changed(
                    tuning.disk.threads != defaults.disk.threads,
                    tuning.disk.threads.to_string()
                ),
                "disk_piece_mib_env": changed(
                    tuning.disk.piece_mib != defaults.disk.piece_mib,
                    tuning.disk.piece_mib.to_string()
                ),
                "accelerate_page_cache_dropped": peer_rec.as_ref().and_then(|r| r["page_cache_dropped"].as_str().map(String::from)),
                // CUDA graph replay of decode steps (over this configuration's runs).
                "graphs": model.graphs(),
                "graph_captures": graph_stats.captures,
                "graph_replays": graph_stats.replays,
                "graph_eager_steps": graph_stats.eager_steps,
                "graph_last_reason": graph_stats.last_reason,
                "expert_policy": format!("{:?}", args.expert_policy),
                "expert_prefetch": args.expert_prefetch,
                "expert_guess_layers": args.expert_guess_layers,
                "expert_split": format!("{:?}", args.expert_split),
                "expert_route": args.expert_route.to_string(),
                "expert_slots": args.expert_slots.to_string(),
                "expert_admission": args.expert_admit.to_string(),
                "decode_tokens": if decode_feed.is_some() { "random" } else { "greedy" },
            });
            if let (Some(rec), serde_json::Value::Object(t)) =
                (records.last_mut().and_then(|r| r.as_object_mut()), tiers)
            {
                rec.extend(t);
            }
            if let (Some(rec), Some(serde_json::Value::Object(x))) =
                (records.last_mut().and_then(|r| r.as_object_mut()), experts)
            {
                if let Some(bound) = x
                    .get("physical_bound_tokens_per_s")
                    .and_then(|b| b.as_f64())
                {
                    println!(
                        "        experts: hit rate {:.1}%, per token {:.1} resident, {:.1} fetched, {:.1} on the host, {:.1} read by the device from host memory ({:.1} layers routed there), {:.2} GB read from host memory; bound {bound:.1} tok/s",
                        100.0 * x["expert_hit_rate"].as_f64().unwrap_or(0.0),
                        x["experts_resident_per_token"].as_f64().unwrap_or(0.0),
                        x["experts_fetched_per_token"].as_f64().unwrap_or(0.0),
                        x["experts_on_host_per_token"].as_f64().unwrap_or(0.0),
                        x["experts_mapped_per_token"].as_f64().unwrap_or(0.0),
                        x["expert_layers_routed_on_device_per_token"].as_f64().unwrap_or(0.0),
                        x["host_bytes_per_token"].as_f64().unwrap_or(0.0) / 1e9,
                    );
                }
                if let Some(used) = x.get("prefill_experts_used").and_then(|u| u.as_u64()) {
                    let bound = |k: &str| {
                        x.get(k)
                            .and_then(|b| b.as_f64())
                            .map_or("none".to_string(), |b| format!("{b:.0} tok/s"))
                    };
                    println!(
                        "        prompt's experts: {used} used ({} resident, {} fetched, {} streamed, {} on the host), {:.2} GB past the cache; bound {} (host reads), {} (link)",
                        x["prefill_experts_resident"],
                        x["prefill_experts_fetched"],
                        x["prefill_experts_streamed"],
                        x["prefill_experts_on_host"],
                        x["prefill_bytes_past_the_cache"].as_f64().unwrap_or(0.0) / 1e9,
                        bound("prefill_physical_bound_tokens_per_s"),
                        bound("prefill_link_bound_tokens_per_s"),
                    );
                }
                rec.extend(x);
            }
            drop(model);
            drop(rt);
            // Rewritten after every configuration: a run stopped by a time limit keeps the
            // rows it finished.
            write_json(&records)?;
        }
    }
    if let Some(path) = &args.json_out {
        if records.is_empty() {
            write_json(&records)?;
        }
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The expert tier's record fields over `tokens` decode steps, from its stats before and
/// after them: the hit rate, experts resident, fetched and computed on the host per token,
/// the host bytes read per token, and the physical bound those bytes put on decode at the
/// host's memory read rate (`host_read_gbps`, measured in the same run).
fn expert_fields(
    a: &candle_offload_models::ExpertStats,
    b: &candle_offload_models::ExpertStats,
    tokens: usize,
    host_read_gbps: f64,
) -> serde_json::Value {
    let n = tokens.max(1) as f64;
    let per_layer: Vec<Option<f64>> = a
        .layers
        .iter()
        .zip(&b.layers)
        .map(|(x, y)| {
            let (h, m) = (y.hits - x.hits, y.misses - x.misses);
            (h + m > 0).then(|| h as f64 / (h + m) as f64)
        })
        .collect();
    let host_bytes = (b.host_bytes - a.host_bytes) as f64 / n;
    serde_json::json!({
        "expert_hit_rate": hit_rate_between(a, b),
        "expert_hit_rate_per_layer": per_layer,
        "expert_slots_per_layer": b.slots.iter().copied().max().unwrap_or(0),
        "expert_slots_by_layer": b.slots,
        "experts_per_layer": b.experts_per_layer,
        "expert_bytes": b.expert_bytes,
        "expert_dense_bytes": b.dense_bytes,
        "experts_resident_per_token": (b.resident - a.resident) as f64 / n,
        "experts_fetched_per_token": (b.fetched - a.fetched) as f64 / n,
        "experts_streamed_per_token": (b.streamed - a.streamed) as f64 / n,
        "experts_prefetched_per_token": (b.prefetched - a.prefetched) as f64 / n,
        "experts_declined_per_token": (b.declined - a.declined) as f64 / n,
        "experts_prefetch_used_per_token": (b.prefetch_used - a.prefetch_used) as f64 / n,
        "experts_on_host_per_token": (b.on_host - a.on_host) as f64 / n,
        "experts_on_host_per_token_by_layer": a
            .on_host_by_layer
            .iter()
            .zip(&b.on_host_by_layer)
            .map(|(x, y)| (y - x) as f64 / n)
            .collect::<Vec<_>>(),
        "experts_mapped_per_token": (b.mapped - a.mapped) as f64 / n,
        "expert_layers_routed_on_device_per_token": (b.device_routed - a.device_routed) as f64 / n,
        "expert_whole_layers_routed_on_device_per_token":
            (b.whole_routed - a.whole_routed) as f64 / n,
        "expert_route_step_s_host": b.route_step_s[0],
        "expert_route_step_s_device": b.route_step_s[1],
        "host_bytes_per_token": host_bytes,
        "expert_host_bytes_per_s": b.host_bytes_per_s,
        "expert_host_row_bytes_per_s": b.host_row_bytes_per_s,
        "expert_link_bytes_per_s": b.link_bytes_per_s,
        "expert_stream_enqueue_s": b.stream_enqueue_s,
        "host_read_gbps": host_read_gbps,
        "physical_bound_tokens_per_s": (host_bytes > 0.0).then(|| host_read_gbps * 1e9 / host_bytes),
    })
}

/// The expert cache's hit rate between its stats `a` and the later `b` (0 without accesses).
fn hit_rate_between(
    a: &candle_offload_models::ExpertStats,
    b: &candle_offload_models::ExpertStats,
) -> f64 {
    let ((h0, m0), (h1, m1)) = (a.totals(), b.totals());
    let (hits, misses) = (h1 - h0, m1 - m0);
    if hits + misses > 0 {
        hits as f64 / (hits + misses) as f64
    } else {
        0.0
    }
}

/// The expert tier's record fields over a timed prompt of `prompt_len` rows, from its stats
/// before and after it: the experts it used (each layer's distinct experts, summed over the
/// layers) by where they ran, its hit rate, the host bytes of its misses, and two bounds on its
/// speed from the experts the budget cannot hold (the bytes of the used experts past the
/// cache's slots, whatever the policy): each such byte read once from host memory at the
/// host's read rate (`prefill_physical_bound_tokens_per_s`), or carried once over the link at
/// the rate the tier measured (`prefill_link_bound_tokens_per_s`). `Null` without both stats.
fn prompt_expert_fields(
    a: Option<&candle_offload_models::ExpertStats>,
    b: Option<&candle_offload_models::ExpertStats>,
    prompt_len: usize,
    host_read_gbps: f64,
) -> serde_json::Value {
    let (Some(a), Some(b)) = (a, b) else {
        return serde_json::Value::Null;
    };
    let used = (b.resident + b.fetched + b.streamed + b.on_host)
        - (a.resident + a.fetched + a.streamed + a.on_host);
    let slots: u64 = b.slots.iter().map(|&s| s as u64).sum();
    let past = used.saturating_sub(slots) as f64 * b.expert_bytes as f64;
    let bound = |rate: f64| (past > 0.0 && rate > 0.0).then(|| prompt_len as f64 * rate / past);
    serde_json::json!({
        "prefill_experts_used": used,
        "prefill_experts_resident": b.resident - a.resident,
        "prefill_experts_fetched": b.fetched - a.fetched,
        "prefill_experts_streamed": b.streamed - a.streamed,
        "prefill_experts_on_host": b.on_host - a.on_host,
        "prefill_expert_hit_rate": hit_rate_between(a, b),
        "prefill_host_bytes": b.host_bytes - a.host_bytes,
        "prefill_bytes_past_the_cache": past,
        "prefill_physical_bound_tokens_per_s": bound(host_read_gbps * 1e9),
        "prefill_link_bound_tokens_per_s": bound(b.link_bytes_per_s),
    })
}

/// One batch-decode measurement.
struct BatchRun {
    /// Median seconds per decode step (one token for every sequence).
    step_s: f64,
    /// Device peak during it (0 on the CPU).
    peak: u64,
}

/// Decodes `batch` left-padded prompts (row r: `prompt_len - r` tokens, at least 1) together,
/// `new_tokens` greedy steps after the prefill.
#[allow(clippy::too_many_arguments)]
fn batch_decode(
    model: &Llama,
    device: &candle_core::Device,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
    gpu: bool,
    prompt_of: &dyn Fn(usize) -> Vec<u32>,
) -> Result<BatchRun> {
    let sampler = if gpu {
        Some(PeakMemorySampler::start(
            device,
            Duration::from_micros(500),
        )?)
    } else {
        None
    };
    let pads: Vec<usize> = (0..batch).map(|r| r.min(prompt_len - 1)).collect();
    let ids: Vec<u32> = pads
        .iter()
        .flat_map(|&pad| std::iter::repeat_n(1u32, pad).chain(prompt_of(prompt_len - pad)))
        .collect();
    let mut cache = model.new_cache();
    let rows = |l: &Tensor| -> Result<Vec<u32>> {
        Ok(l.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?)
    };
    model.begin_step()?;
    let logits = model.forward_batch(
        &Tensor::from_vec(ids, (batch, prompt_len), device)?,
        0,
        &pads,
        &mut cache,
    )?;
    let mut next = rows(&logits)?;
    model.end_step()?;
    let mut times = Vec::new();
    for i in 0..new_tokens {
        model.begin_step()?;
        let t0 = Instant::now();
        let logits = model.forward_batch(
            &Tensor::from_vec(next, (batch, 1), device)?,
            prompt_len + i,
            &pads,
            &mut cache,
        )?;
        next = rows(&logits)?;
        times.push(t0.elapsed().as_secs_f64());
        model.end_step()?;
    }
    Ok(BatchRun {
        step_s: median(times),
        peak: sampler.map(|s| s.stop()).unwrap_or(0),
    })
}

/// What a decode step is fed ([`Args::decode_tokens`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DecodeTokens {
    /// Random for a mixture-of-experts model, greedy otherwise.
    Auto,
    /// The last step's argmax.
    Greedy,
    /// A fixed pseudo-random sequence.
    Random,
}
