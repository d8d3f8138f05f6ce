//! An OpenAI-compatible HTTP server: chat and text completions (streamed or not) from one
//! model, with requests batched continuously (they join the running batch at the next step
//! and leave when done), under the same memory budget and flags as `generate`.
//!
//! Run with: `cargo run --release --example serve` (SmolLM2-135M-Instruct on
//! 127.0.0.1:8080), then e.g. `curl http://127.0.0.1:8080/v1/chat/completions -H
//! 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "Hi"}]}'`.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::Device;
use candle_offload::dist::Transport;
use candle_offload::placement::{DeviceMap, PlacementMode};
use candle_offload::MemoryLimit;
use candle_offload_models::batching::{self, BatchOptions, Batcher};
use candle_offload_models::llama::DeviceMapChoice;
use candle_offload_models::{loader, ChatTemplate, Llama, RankRequest};
use candle_offload_server::{BoxError, Loaded, MemoryProbe, ModelInfo, ServerConfig};
use candle_offload_suite::dist::{DistArgs, Launch};
use candle_offload_suite::flags;
use candle_offload_suite::load::{pin_cpu_thread_count, LoadArgs, MemoryPlan};
use clap::Parser;

/// Serves a LLaMA-family model over an OpenAI-compatible HTTP API (`/v1/chat/completions`,
/// `/v1/completions`, `/v1/models`, `/health`, `/metrics`).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    load: LoadArgs,
    /// Several processes serving one model (`--rank/--world-size`, or torchrun's variables):
    /// rank 0 speaks HTTP and runs the batcher, every step goes down the pipeline of ranks.
    #[command(flatten)]
    dist: DistArgs,
    /// The address to listen on (`0.0.0.0`: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on `/v1/...` (`/health` and `/metrics` stay open).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Allow cross-origin requests from this origin (`*`: any). Off by default.
    #[arg(long, value_name = "ORIGIN")]
    cors: Option<String>,
    /// Sequences that run at once, at most.
    #[arg(long, default_value_t = 8, value_parser = flags::at_least_one)]
    parallel: usize,
    /// Positions per request (prompt and new tokens). Default: the model's context, at most
    /// 4096.
    #[arg(long, value_parser = flags::at_least_one)]
    ctx_size: Option<usize>,
    /// Bytes the running requests' KV caches may take together (`2GiB`, `512MiB`); a request
    /// waits until its cache fits. Default: --parallel caches of --ctx-size positions. On a
    /// GPU it is kept out of the weights' budget.
    #[arg(long, value_name = "SIZE")]
    kv_memory: Option<String>,
    /// Requests that may wait to start beyond the running ones; more get 503 with
    /// Retry-After.
    #[arg(long, default_value_t = candle_offload_server::config::DEFAULT_QUEUE)]
    queue: usize,
    /// The largest request body in bytes; larger ones get 413.
    #[arg(long, default_value_t = candle_offload_server::config::DEFAULT_MAX_BODY_BYTES,
          value_parser = flags::at_least_one)]
    max_body_bytes: usize,
    /// New tokens of a request that gives no max_tokens (less where the context leaves less
    /// room).
    #[arg(long, default_value_t = candle_offload_server::config::DEFAULT_MAX_TOKENS,
          value_parser = flags::at_least_one)]
    max_tokens_default: usize,
    /// The model's name in /v1/models and in requests' `model`. Default: the model file's
    /// (or directory's) name, or the hub id.
    #[arg(long)]
    model_name: Option<String>,
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

/// The served model's default name: the file or directory `--model` names, else the hub id.
fn default_name(model: Option<&str>) -> String {
    match model {
        Some(m) => {
            let p = Path::new(m);
            match p.file_name() {
                Some(f) if p.exists() => f.to_string_lossy().into_owned(),
                _ => m.to_string(),
            }
        }
        None => loader::DEFAULT_MODEL.to_string(),
    }
}

/// Positions per request: `--ctx-size`, else the model's context up to 4096.
fn context(ctx_size: Option<usize>, max_pos: usize) -> Result<usize> {
    match ctx_size {
        Some(n) if n > max_pos => bail!(
            "--ctx-size {n}: more than the model's context (max_position_embeddings {max_pos})"
        ),
        Some(n) => Ok(n),
        None => Ok(max_pos.min(4096)),
    }
}

/// One full sequence's KV cache bytes, and the bytes the running sequences' caches may take
/// together: `--kv-memory`, else `parallel` full sequences.
fn kv_bytes(
    cfg: &candle_offload_models::Config,
    ctx: usize,
    dtype: candle_core::DType,
    kv_memory: Option<u64>,
    parallel: usize,
) -> (u64, u64) {
    let per_seq = cfg.kv_cache_bytes(ctx, dtype);
    (
        per_seq,
        kv_memory.unwrap_or(per_seq.saturating_mul(parallel as u64)),
    )
}

/// What the server's engine thread runs once it listens.
struct Load {
    args: LoadArgs,
    plan: MemoryPlan,
    device: Device,
    parallel: usize,
    ctx_size: Option<usize>,
    kv_memory: Option<u64>,
    /// Rank 0's share of a multi-process pipeline: the split and the transport.
    rank: Option<(DeviceMap, Arc<dyn Transport>)>,
}

impl Load {
    fn run(self) -> Result<Loaded> {
        let files = self.args.model.resolve()?;
        let cfg = files.config.clone();
        let tokenizer = self.args.tokenizer(&files)?;
        let ctx = context(self.ctx_size, cfg.max_position_embeddings)?;
        let (per_seq, kv_limit) = kv_bytes(
            &cfg,
            ctx,
            self.args.dtype_on(&self.device),
            self.kv_memory,
            self.parallel,
        );
        let rank = self.rank.as_ref().map(|(m, t)| (m, t.clone()));
        let model =
            self.args
                .build_batched(&files, &self.plan, &self.device, ctx, kv_limit, rank)?;
        let model = Arc::new(model);
        let mut opts = BatchOptions::new(&model, self.parallel, ctx);
        opts.kv_limit_bytes = kv_limit;
        let mut end_tokens = cfg.eos_token_ids.clone();
        for t in tokenizer.end_of_generation() {
            if !end_tokens.contains(&t) {
                end_tokens.push(t);
            }
        }
        let chat_template = files.chat_template.clone().map(|t| {
            ChatTemplate::new(
                t,
                files.special_tokens.bos.clone(),
                files.special_tokens.eos.clone(),
            )
        });
        if chat_template.is_none() {
            eprintln!(
                "note: the model has no chat template; chat prompts are `role: content` lines"
            );
        }
        let memory: Option<MemoryProbe> = if self.device.is_cuda() {
            let rt = model.runtime().clone();
            Some(Box::new(move || {
                let used = candle_offload::diag::device_used_bytes(rt.device()).ok()?;
                Some((used, rt.budget().limit_bytes))
            }))
        } else {
            None
        };
        eprintln!(
            "serving: {} sequences at once, {ctx} positions each, KV memory {} ({} per full \
             sequence)",
            self.parallel,
            candle_offload::human_bytes(kv_limit),
            candle_offload::human_bytes(per_seq),
        );
        // Every kind of step once before the first request (as llama-server warms up): the
        // first use of each path costs once what no request should wait for.
        let mut batcher = Batcher::new(model, opts);
        let warm = std::time::Instant::now();
        batcher.warm_up()?;
        eprintln!("warmed up in {:.2} s", warm.elapsed().as_secs_f64());
        Ok(Loaded {
            backend: Box::new(batcher),
            info: ModelInfo {
                codec: Arc::new(tokenizer),
                chat_template,
                end_tokens,
                context: ctx,
                vocab_size: cfg.vocab_size,
            },
            max_running: self.parallel,
            memory,
        })
    }
}

fn run(args: Args) -> Result<()> {
    let launch = args.dist.launch(|k| std::env::var(k).ok())?;
    // Under torchrun, LOCAL_RANK is this process's GPU, unless --device names another.
    let ordinal = match launch.as_ref().and_then(|l| l.local_rank) {
        Some(l) if args.load.device == 0 => l,
        _ => args.load.device,
    };
    let device = candle_offload_suite::device(args.load.cpu, ordinal)?;
    let plan = args.load.memory(std::slice::from_ref(&device))?;
    let kv_memory = match &args.kv_memory {
        None => None,
        Some(s) => match MemoryLimit::parse("--kv-memory", s)? {
            MemoryLimit::Bytes(b) if b > 0 => Some(b),
            _ => bail!("--kv-memory {s}: give a size above zero (`2GiB`, `512MiB`), not a share"),
        },
    };
    let rank = match &launch {
        Some(launch) => {
            let (transport, how) = launch.connect(&device)?;
            eprintln!("rank {} of {}: {how}", launch.rank, launch.world_size);
            let split = || -> Result<DeviceMap> {
                let files = args.load.model.resolve()?;
                let ctx = context(args.ctx_size, files.config.max_position_embeddings)?;
                Ok(Llama::plan_ranks(
                    &files.config,
                    transport.as_ref(),
                    &RankRequest {
                        device: &device,
                        limit: plan.limit,
                        dtype: args.load.dtype_on(&device),
                        prompt_len: batching::STEP_TOKENS.min(ctx),
                        max_len: ctx,
                        choice: &DeviceMapChoice::Mode(PlacementMode::Balanced),
                        prefetch_depth: args.load.prefetch_depth as usize,
                    },
                )?)
            };
            let map = split().inspect_err(|e| transport.fail(&format!("{e:#}")))?;
            if launch.rank > 0 {
                return follow(&args, launch, &device, &plan, kv_memory, &map, transport);
            }
            eprint!(
                "ranks: {} (the device column is the rank)\n{map}",
                launch.world_size
            );
            Some((map, transport))
        }
        None => None,
    };
    let stop = rank.as_ref().map(|(_, t)| t.clone());
    let model_name = args
        .model_name
        .clone()
        .unwrap_or_else(|| default_name(args.load.model.model.as_deref()));
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_key: args.api_key.clone(),
        cors_origin: args.cors.clone(),
        queue: args.queue,
        max_body_bytes: args.max_body_bytes,
        max_tokens_default: args.max_tokens_default,
        model_name: model_name.clone(),
        retry_after_s: 1,
    };
    let load = Load {
        args: args.load,
        plan,
        device,
        parallel: args.parallel,
        ctx_size: args.ctx_size,
        kv_memory,
        rank,
    };
    let served = candle_offload_server::run(
        config,
        move || {
            load.run()
                .map_err(|e| -> BoxError { format!("{e:#}").into() })
        },
        |addr| {
            eprintln!(
                "listening on http://{addr} (model `{model_name}`; /health answers 200 once it \
                 is loaded)"
            )
        },
    );
    if let Some(t) = stop {
        // The other ranks leave their loop (or learn why this one failed).
        match &served {
            // A rank already gone was reported by the steps that needed it.
            Ok(()) => {
                if let Err(e) = candle_offload_models::stop_ranks(t.as_ref()) {
                    eprintln!("note: the other ranks were not told to stop: {e}");
                }
            }
            Err(e) => t.fail(&format!("{e:#}")),
        }
    }
    served?;
    Ok(())
}

/// A rank other than 0: its layers, built as rank 0's plan says, follow rank 0's steps until
/// its batcher stops; a failure here tells the others why.
fn follow(
    args: &Args,
    launch: &Launch,
    device: &Device,
    plan: &MemoryPlan,
    kv_memory: Option<u64>,
    map: &DeviceMap,
    transport: Arc<dyn Transport>,
) -> Result<()> {
    let run = || -> Result<u64> {
        let files = args.load.model.resolve()?;
        let ctx = context(args.ctx_size, files.config.max_position_embeddings)?;
        let (_, kv_limit) = kv_bytes(
            &files.config,
            ctx,
            args.load.dtype_on(device),
            kv_memory,
            args.parallel,
        );
        let model = args.load.build_batched(
            &files,
            plan,
            device,
            ctx,
            kv_limit,
            Some((map, transport.clone())),
        )?;
        let layers = map.devices[launch.rank].layers();
        eprintln!(
            "rank {} of {}: layers {}..{} on {}, following rank 0's steps",
            launch.rank,
            launch.world_size,
            layers.start,
            layers.end,
            candle_offload_suite::device_label(device)
        );
        Ok(model.follow_steps()?)
    };
    match run() {
        Ok(steps) => {
            eprintln!("rank {}: rank 0 stopped after {steps} steps", launch.rank);
            Ok(())
        }
        Err(e) => {
            transport.fail(&format!("{e:#}"));
            Err(e)
        }
    }
}
