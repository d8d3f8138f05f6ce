//! Training benchmark: peak device memory and step time of AdamW steps on a 1B-shaped LLaMA
//! (hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632, vocab 32000; batch 4 x
//! 1024 tokens) for {no checkpointing, one segment per layer, sqrt(L) segments} x {F32, F16
//! autocast, BF16 autocast}, and with offloaded weights under a 4 GiB budget. Merges the
//! PyTorch peer's figures (`scripts/train_peer.py`, same shapes and configurations) and derives
//! the activation memory reduction, the checkpointing overhead and the ratio to PyTorch.
//!
//! Run with: `cargo run --release --features cuda -p candle-offload-bench --bin bench_train --
//! --peer train_peer.json --json-out train.json`; a CPU smoke run with tiny shapes: `cargo run
//! --release -p candle-offload-bench --bin bench_train -- --cpu --layers 2 --hidden 64 --heads 4
//! --kv-heads 2 --intermediate 96 --vocab 101 --batch-size 1 --seq-len 16`.
//!
//! Memory is measured from outside the allocator (`cuMemGetInfo` polled every millisecond on
//! another thread) relative to a baseline read before each configuration, after the memory
//! pool was trimmed: `peak_device_bytes` is what the configuration used at its peak,
//! `static_bytes` what stays after the trainer is built (F32 masters and AdamW state; for
//! offloaded runs the resident weights), `grad_bytes` 4 bytes per parameter (resident runs:
//! the F32 gradients of a step; offloaded runs keep them on the host: 0), and
//! `activation_bytes = peak - static - grads`: activations, recomputed segments, backward and
//! optimizer temporaries, and allocator slack. The results file is rewritten after every
//! configuration, so a run cut short keeps what it measured.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::ParamsAdamW;
use candle_offload::diag::{self, PeakMemorySampler};
use candle_offload::{MemoryLimit, Precision};
use candle_offload_bench::median;
use candle_offload_models::{Config, TrainPhase, TrainSettings, Trainer};
use clap::Parser;
use serde_json::{json, Value};

const DEFAULT_CONFIGS: &str = "none-f32,layer-f32,sqrt-f32,none-f16,layer-f16,sqrt-f16,\
                               none-bf16,layer-bf16,sqrt-bf16,offload-4gib-bf16,offload-4gib-f16";

/// Measures training steps of a LLaMA shape under checkpointing, autocast and offloading.
#[derive(Parser, Debug)]
struct Args {
    /// Configurations, comma-separated: `{none,layer,sqrt}-{f32,f16,bf16}` (checkpointing:
    /// none, one segment per layer, round(sqrt(layers)) segments), and
    /// `offload[-<N>gib]-{f32,f16,bf16}` (offloaded weights, one segment per layer, budget N
    /// GiB or --budget-gib), and `lora[-<type>][-<N>gib]-{f32,f16,bf16}` (LoRA adapters of
    /// --lora-rank on every projection of a frozen random base, dense or quantized to a GGML
    /// type such as `q4_k` (QLoRA), one segment per layer, resident or under an N GiB budget).
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_CONFIGS)]
    configs: Vec<String>,
    /// Timed steps per resident configuration (median).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Timed steps per offloaded configuration (the optimizer runs on the host: slow).
    #[arg(long, default_value_t = 2)]
    offload_steps: usize,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Decoder layers.
    #[arg(long, default_value_t = 22)]
    layers: usize,
    /// Model width.
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    /// MLP width.
    #[arg(long, default_value_t = 5632)]
    intermediate: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    /// GPU budget of `offload-<precision>` configurations, GiB.
    #[arg(long, default_value_t = 4.0)]
    budget_gib: f64,
    /// AdamW learning rate (the peer uses 1e-5).
    #[arg(long, default_value_t = 1e-5)]
    lr: f64,
    /// Run on the CPU (tiny shapes: a smoke test; no memory figures).
    #[arg(long)]
    cpu: bool,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Skip the configurations not started within this many seconds of the start (recorded
    /// as skipped), so that a run under a time limit still writes its results.
    #[arg(long)]
    max_seconds: Option<f64>,
    /// One more step per configuration after the timed ones (not in the timings), under a CUDA
    /// profiler's capture (`ncu --profile-from-start off`), with a `profile_mark` kernel at
    /// each phase boundary (forward 0, backward 1, optimizer 2, end 3): what
    /// scripts/kernel_breakdown.py's `train` reads.
    #[arg(long)]
    profile_capture: bool,
    /// Before the configurations, time the host's cost of a Candle op on this device: this
    /// many launches each of a 256-element add, a 256-element zeros and a 64x64 matmul, the
    /// device synchronized once after each batch (GPU time is negligible at these sizes), so
    /// each figure is the host time one op costs (recorded as `op_overhead_us`).
    #[arg(long)]
    op_overhead: Option<usize>,
    /// Sample the host's stacks (`pprof`) over each configuration's timed steps and write them
    /// to DIR/<config>.folded (flame-graph input); the busiest thread's top functions go into
    /// the results as `host_profile`. Needs a build with the `host-profile` feature.
    #[arg(long, value_name = "DIR")]
    host_profile: Option<PathBuf>,
    /// Poll the device's memory from outside the allocator every this many milliseconds during
    /// the steps (the `*_driver` peaks); 0 turns the poller off (those peaks are then not
    /// measured), to see what the polling costs the step.
    #[arg(long, default_value_t = 1)]
    sampler_ms: u64,
    /// Every decoder op in Candle's graph (`TrainSettings::hand_backward` off): the step
    /// before the hand-written block backward pass, for a comparison in one run.
    #[arg(long)]
    graph_backward: bool,
    /// Keep cudarc's per-buffer event tracking on in resident configurations
    /// (`TrainSettings::event_tracking`; the trainer turns it off by default).
    #[arg(long)]
    event_tracking: bool,
    /// LoRA rank of the `lora-*` configurations (alpha = 2·rank, every projection targeted).
    #[arg(long, default_value_t = 16)]
    lora_rank: usize,
    /// The peer's JSON (scripts/train_peer.py, or scripts/lora_peer.py for `lora-*`), measured
    /// in the same run.
    #[arg(long)]
    peer: Option<PathBuf>,
    /// Write the results as JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Ckpt {
    None,
    Layer,
    Sqrt,
}

impl Ckpt {
    fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Layer => "per-layer",
            Self::Sqrt => "sqrt",
        }
    }

    fn segments(self, layers: usize) -> usize {
        match self {
            Self::None => 0,
            Self::Layer => layers,
            Self::Sqrt => ((layers as f64).sqrt().round() as usize).max(1),
        }
    }
}

/// One configuration to measure.
#[derive(Debug, Clone)]
struct Bench {
    name: String,
    precision: Precision,
    label: &'static str,
    ckpt: Ckpt,
    /// Offloaded (LoRA: the frozen base served), with this budget in GiB.
    offload_gib: Option<f64>,
    /// LoRA on a frozen base, of GGML blocks of this type or dense (`None` inside).
    lora: Option<Option<candle_core::quantized::GgmlDType>>,
}

fn parse_config(s: &str, default_budget: f64) -> Result<Bench> {
    let bad = |why: &str| {
        anyhow!(
            "--configs: {s:?} {why}; expected {{none,layer,sqrt}}-{{f32,f16,bf16}} or \
             offload[-<N>gib]-{{f32,f16,bf16}}"
        )
    };
    let parts: Vec<&str> = s.trim().split('-').collect();
    if parts.first() == Some(&"lora") && parts.len() >= 2 {
        let prec = parts[parts.len() - 1];
        let precision: Precision = prec.parse().map_err(|_| bad("has an unknown precision"))?;
        let (mut quant, mut budget) = (None, None);
        for m in &parts[1..parts.len() - 1] {
            if let Some(n) = m.strip_suffix("gib") {
                budget = Some(
                    n.parse::<f64>()
                        .ok()
                        .filter(|g| g.is_finite() && *g > 0.0)
                        .ok_or_else(|| bad("has a budget that is not <N>gib"))?,
                );
            } else {
                quant = Some(
                    candle_offload_models::quantize::parse_type(m)
                        .ok_or_else(|| bad("has an unknown GGML type"))?,
                );
            }
        }
        return Ok(Bench {
            name: s.trim().to_string(),
            precision,
            label: precision.compute_dtype().as_str(),
            ckpt: Ckpt::Layer,
            offload_gib: budget,
            lora: Some(quant),
        });
    }
    let (head, mid, prec) = match parts.as_slice() {
        [h, p] => (*h, None, *p),
        [h, m, p] => (*h, Some(*m), *p),
        _ => return Err(bad("is not a configuration")),
    };
    let precision: Precision = prec.parse().map_err(|_| bad("has an unknown precision"))?;
    let label = precision.compute_dtype().as_str();
    let (ckpt, offload_gib) = match (head, mid) {
        ("none", None) => (Ckpt::None, None),
        ("layer", None) => (Ckpt::Layer, None),
        ("sqrt", None) => (Ckpt::Sqrt, None),
        ("offload", None) => (Ckpt::Layer, Some(default_budget)),
        ("offload", Some(m)) => {
            let gib: f64 = m
                .strip_suffix("gib")
                .and_then(|n| n.parse().ok())
                .filter(|g: &f64| g.is_finite() && *g > 0.0)
                .ok_or_else(|| bad("has a budget that is not <N>gib"))?;
            (Ckpt::Layer, Some(gib))
        }
        _ => return Err(bad("has an unknown checkpointing mode")),
    };
    Ok(Bench {
        name: s.trim().to_string(),
        precision,
        label,
        ckpt,
        offload_gib,
        lora: None,
    })
}

/// Random bytes for a large frozen base without drawing every weight: one pool of
/// normal(0, 0.02) values, kept in each format the store asks for, and each tensor a copy of
/// the pool from a random start (in whole blocks for GGML types), wrapping around. Drawing and
/// quantizing a 7B base weight by weight takes minutes on one core; a step's time does not
/// depend on the values.
struct WeightPool {
    values: Tensor,
    bytes: std::collections::HashMap<candle_offload::WeightFormat, Vec<u8>>,
    rng: rand::rngs::StdRng,
}

impl WeightPool {
    /// `n` values (a multiple of 4096); `seed` places the tensors in the pool.
    fn new(n: usize, seed: u64) -> candle_core::Result<Self> {
        use rand::SeedableRng as _;
        Ok(Self {
            values: Tensor::randn(0f32, 0.02, (n / 4096, 4096), &Device::Cpu)?,
            bytes: Default::default(),
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        })
    }

    /// Fills `dst`, a whole tensor in `format`, from the pool.
    fn fill(
        &mut self,
        format: candle_offload::WeightFormat,
        dst: &mut [u8],
    ) -> candle_core::Result<()> {
        use rand::Rng as _;
        let unit = format.block_bytes();
        let pool = match self.bytes.entry(format) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let bytes = match (format.ggml_dtype(), format.dense_dtype()) {
                    (Some(q), _) => candle_core::quantized::QTensor::quantize(&self.values, q)?
                        .data()?
                        .into_owned(),
                    (None, Some(dtype)) => {
                        candle_offload::store::tensor_to_bytes(&self.values.to_dtype(dtype)?)?
                    }
                    (None, None) => candle_core::bail!("no random fill for {format}"),
                };
                e.insert(bytes)
            }
        };
        let mut at = self.rng.random_range(0..pool.len() / unit) * unit;
        let mut done = 0;
        while done < dst.len() {
            let n = (dst.len() - done).min(pool.len() - at);
            dst[done..done + n].copy_from_slice(&pool[at..at + n]);
            done += n;
            at = 0;
        }
        Ok(())
    }
}

/// A LoRA trainer of `row`'s base: random weights of `cfg` (normal(0, 0.02), norms one) in
/// the compute dtype, the decoder layers' matrices as GGML blocks of `quant` where given, and
/// adapters of `rank` on every projection (B random, so that the update is not zero).
fn lora_trainer(
    cfg: &Config,
    quant: Option<candle_core::quantized::GgmlDType>,
    rank: usize,
    device: &Device,
    settings: &TrainSettings,
) -> Result<Trainer> {
    use candle_offload::{HostStore, RawTensorSpec, StoreConfig, WeightFormat};
    use candle_offload_models::lora::{Adapters, LoraConfig};
    let layout = cfg.layout();
    let specs: Vec<RawTensorSpec> = cfg
        .expected_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let blocks = shape.len() == 2 && name.starts_with(&layout.layer_prefix);
            RawTensorSpec {
                format: match quant {
                    Some(q) if blocks => WeightFormat::Ggml(q),
                    _ => WeightFormat::Dense(candle_core::DType::F32),
                },
                name,
                shape: shape.into(),
            }
        })
        .collect();
    let store_cfg = StoreConfig {
        dtype: Some(settings.precision.compute_dtype()),
        grouping: layout.grouping(),
        ..Default::default()
    };
    // `format` is how the store keeps the tensor: blocks as specified, dense ones in the
    // compute dtype.
    let mut pool = WeightPool::new(1 << 24, 0)?;
    let store = HostStore::from_raw(&specs, &store_cfg, device, |spec, format, dst| {
        if spec.shape.dims().len() == 1 {
            let ones = Tensor::ones(spec.shape.dims(), candle_core::DType::F32, &Device::Cpu)
                .and_then(|t| match format {
                    WeightFormat::Dense(dtype) => t.to_dtype(dtype),
                    other => Err(candle_core::Error::Msg(format!("a norm as {other}"))),
                })
                .and_then(|t| candle_offload::store::tensor_to_bytes(&t))?;
            dst.copy_from_slice(&ones);
            return Ok(());
        }
        Ok(pool.fill(format, dst)?)
    })?;
    let config = LoraConfig {
        r: rank,
        alpha: 2.0 * rank as f64,
        ..Default::default()
    };
    let init = Adapters::init(config.clone(), cfg, &Device::Cpu, 0).map_err(|e| anyhow!(e))?;
    let tensors = init
        .modules()
        .iter()
        .map(|(p, m)| {
            let b = Tensor::randn(0f32, 0.01, m.b.shape(), &Device::Cpu)?;
            Ok((p.clone(), (m.a.as_tensor().clone(), b)))
        })
        .collect::<Result<_>>()?;
    let adapters = Adapters::from_tensors(config, tensors, &Device::Cpu)?;
    Ok(Trainer::lora(
        cfg.clone(),
        Arc::new(store),
        adapters,
        device,
        settings,
    )?)
}

/// The model shape from the flags, through the same parser as a `config.json`.
fn shape_config(args: &Args) -> Result<Config> {
    for (flag, v) in [
        ("--layers", args.layers),
        ("--hidden", args.hidden),
        ("--heads", args.heads),
        ("--kv-heads", args.kv_heads),
        ("--intermediate", args.intermediate),
        ("--vocab", args.vocab),
        ("--batch-size", args.batch_size),
        ("--seq-len", args.seq_len),
    ] {
        if v == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    if !args.hidden.is_multiple_of(args.heads) {
        bail!(
            "--hidden {} is not a multiple of --heads {}",
            args.hidden,
            args.heads
        );
    }
    let text = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.seq_len.max(2048),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
    })
    .to_string();
    Ok(Config::from_json_str(
        &text,
        Path::new("<bench_train shape flags>"),
    )?)
}

/// Deterministic token ids: `batch` rows of `seq + 1`.
fn batch(cfg: &Config, b: usize, s: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let ids =
        candle_offload_bench::random_tokens(b * (s + 1), cfg.vocab_size, 0x2545_F491_4F6C_DD1D);
    let all = Tensor::from_vec(ids, (b, s + 1), device)?;
    Ok((
        all.narrow(1, 0, s)?.contiguous()?,
        all.narrow(1, 1, s)?.contiguous()?,
    ))
}

fn used(device: &Device) -> Result<u64> {
    if device.is_cpu() {
        return Ok(0);
    }
    diag::trim_memory_pool(device)?;
    Ok(diag::device_used_bytes(device)?)
}

/// Runs one configuration; its record.
/// Host microseconds per Candle op on `device`: `n` launches each of a few tiny ops, timed
/// from the first launch to the end of one synchronization after the batch.
fn op_overhead_us(device: &Device, n: usize) -> Result<Value> {
    let a = Tensor::ones(256, candle_core::DType::F32, device)?;
    let m = Tensor::ones((64, 64), candle_core::DType::F32, device)?;
    let mut out = serde_json::Map::new();
    type Op<'a> = Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>;
    let ops: [(&str, Op); 3] = [
        ("add_256", Box::new(|| &a + &a)),
        ("zeros_256", Box::new(|| a.zeros_like())),
        ("matmul_64", Box::new(|| m.matmul(&m))),
    ];
    for (name, op) in ops {
        op()?;
        device.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..n {
            op()?;
        }
        device.synchronize()?;
        let us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!("op overhead: {name} {us:.1} us per op ({n} ops)");
        out.insert(name.into(), us.into());
    }
    Ok(Value::Object(out))
}

/// What the trainer's phase observer records: the device synchronized and the time taken at
/// each phase boundary of a step, and the profiler's capture around an armed step.
#[derive(Default)]
struct PhaseClock {
    marks: Vec<(TrainPhase, Instant)>,
    capture: bool,
}

impl PhaseClock {
    /// Forward, backward and optimizer seconds of the step just ended.
    fn split(&self) -> Option<[f64; 3]> {
        let at = |p| self.marks.iter().find(|(q, _)| *q == p).map(|(_, t)| *t);
        let (f, b, o, d) = (
            at(TrainPhase::Forward)?,
            at(TrainPhase::Backward)?,
            at(TrainPhase::Optimizer)?,
            at(TrainPhase::Done)?,
        );
        Some([
            (b - f).as_secs_f64(),
            (o - b).as_secs_f64(),
            (d - o).as_secs_f64(),
        ])
    }
}

/// Synchronizes `device` at every phase boundary and records the time; on an armed step also
/// opens the profiler's capture at the forward pass, marks each boundary with a kernel and
/// closes the capture at the end.
fn phase_observer(
    device: &Device,
    clock: Arc<Mutex<PhaseClock>>,
) -> candle_offload_models::PhaseObserver {
    let device = device.clone();
    Box::new(move |phase| {
        let mut c = clock
            .lock()
            .map_err(|_| candle_core::Error::Msg("phase clock poisoned".into()))?;
        device.synchronize()?;
        if c.capture {
            if phase == TrainPhase::Forward {
                diag::profiler_capture(&device, true)?;
            }
            let code = match phase {
                TrainPhase::Forward => 0,
                TrainPhase::Backward => 1,
                TrainPhase::Optimizer => 2,
                _ => 3,
            };
            diag::profile_mark(&device, code)?;
            if phase == TrainPhase::Done {
                device.synchronize()?;
                diag::profiler_capture(&device, false)?;
            }
        }
        if phase == TrainPhase::Forward {
            c.marks.clear();
        }
        c.marks.push((phase, Instant::now()));
        Ok(())
    })
}

fn run_one(
    b: &Bench,
    cfg: &Config,
    args: &Args,
    device: &Device,
    context_bytes: u64,
) -> Result<Value> {
    let gpu = !device.is_cpu();
    let segments = b.ckpt.segments(cfg.num_hidden_layers);
    let budget_bytes = b.offload_gib.map(|g| (g * 2f64.powi(30)) as u64);
    let settings = TrainSettings {
        precision: b.precision,
        checkpoint_segments: segments,
        offload: b.offload_gib.is_some() && b.lora.is_none(),
        gpu_memory_limit: budget_bytes.map(MemoryLimit::Bytes),
        prefetch_depth: 1,
        adamw: ParamsAdamW {
            lr: args.lr,
            ..Default::default()
        },
        batch_size: args.batch_size,
        seq_len: args.seq_len,
        head_chunks: None,
        loss_chunk_tokens: None,
        fused: true,
        hand_backward: !args.graph_backward,
        event_tracking: args.event_tracking,
        tuning: candle_offload_suite::tuning_env::tuning_from_env(Default::default())
            .fitted_to_host(),
    };
    let baseline = used(device)?;
    // The pool's in-use high-water mark, reset to what is in use now (then read back: that).
    let in_use_now = |reset_first: bool| -> Result<u64> {
        if !gpu {
            return Ok(0);
        }
        if reset_first {
            diag::pool_peak_used_bytes(device, true)?;
        }
        Ok(diag::pool_peak_used_bytes(device, false)?)
    };
    let alloc_base = in_use_now(true)?;
    let t0 = Instant::now();
    let mut trainer = match b.lora {
        Some(quant) => lora_trainer(cfg, quant, args.lora_rank, device, &settings)?,
        None => Trainer::random(cfg.clone(), device, &settings)?,
    };
    let build_s = t0.elapsed().as_secs_f64();
    let static_driver = used(device)?.saturating_sub(baseline);
    let static_bytes = in_use_now(true)?.saturating_sub(alloc_base);
    let sampler = if gpu && args.sampler_ms > 0 {
        Some(PeakMemorySampler::start(
            device,
            Duration::from_millis(args.sampler_ms),
        )?)
    } else {
        None
    };
    let params = trainer.parameter_count() as u64;
    let (inputs, targets) = batch(cfg, args.batch_size, args.seq_len, device)?;
    let timed = if b.offload_gib.is_some() {
        args.offload_steps
    } else {
        args.steps
    };
    let clock = Arc::new(Mutex::new(PhaseClock::default()));
    trainer.set_phase_observer(Some(phase_observer(device, clock.clone())));
    let mut phase_s: [Vec<f64>; 3] = Default::default();
    let (mut times, mut losses, mut streamed) = (Vec::new(), Vec::new(), Vec::new());
    let profiled = usize::from(args.profile_capture && gpu);
    let (mut host_profile, mut host_top) = (None, None);
    for i in 0..args.warmup + timed + profiled {
        if let Some(rt) = trainer.runtime() {
            rt.begin_step()?;
        }
        let armed = i == args.warmup + timed;
        if i == args.warmup {
            if let Some(dir) = &args.host_profile {
                host_profile = Some(candle_offload_bench::HostProfile::start_in(dir, 997)?);
            }
        }
        clock
            .lock()
            .map_err(|_| anyhow!("phase clock poisoned"))?
            .capture = armed;
        let t0 = Instant::now();
        let report = trainer.step(&inputs, &targets)?;
        device.synchronize()?;
        let dt = t0.elapsed().as_secs_f64();
        if let Some(rt) = trainer.runtime() {
            rt.end_step()?;
            if i >= args.warmup && !armed {
                streamed.push(rt.stats()?.last_step.map_or(0.0, |s| s.bytes as f64));
            }
        }
        // The host profile covers the timed steps exactly.
        if i + 1 == args.warmup + timed {
            if let (Some(p), Some(dir)) = (host_profile.take(), &args.host_profile) {
                host_top = Some(p.finish(&dir.join(format!("{}.folded", b.name)), 60)?);
            }
        }
        if armed {
            continue;
        }
        losses.push(report.loss);
        if i >= args.warmup {
            times.push(dt);
            let split = clock
                .lock()
                .map_err(|_| anyhow!("phase clock poisoned"))?
                .split();
            if let Some(split) = split {
                for (all, s) in phase_s.iter_mut().zip(split) {
                    all.push(s);
                }
            }
        }
        tracing::info!(config = %b.name, step = i, loss = report.loss, s = dt, "step");
    }
    trainer.set_phase_observer(None);
    let raw_peak = sampler.map(|s| s.stop());
    let peak_driver = raw_peak.map_or(0, |p| p.saturating_sub(baseline));
    let peak = in_use_now(false)?.saturating_sub(alloc_base);
    // Forward and backward alone (no optimizer step): the memory checkpointing acts on,
    // without the optimizer's temporaries.
    let mut fwd_bwd_peak = None;
    let mut fwd_bwd_peak_driver = None;
    if b.offload_gib.is_none() {
        let sampler = if gpu {
            used(device)?;
            in_use_now(true)?;
            Some(PeakMemorySampler::start(device, Duration::from_millis(1))?)
        } else {
            None
        };
        let (_, grads) = trainer.loss_and_grads(&inputs, &targets)?;
        device.synchronize()?;
        fwd_bwd_peak = gpu
            .then(|| in_use_now(false))
            .transpose()?
            .map(|p| p.saturating_sub(alloc_base));
        drop(grads);
        fwd_bwd_peak_driver = sampler.map(|s| s.stop().saturating_sub(baseline));
    }
    let grad_bytes = if b.offload_gib.is_some() && b.lora.is_none() {
        0
    } else {
        4 * params
    };
    let activation_bytes = if gpu {
        Some(peak.saturating_sub(static_bytes + grad_bytes))
    } else {
        None
    };
    let step_s = median(times.clone());
    let tokens = (args.batch_size * args.seq_len) as f64;
    let flops_per_token = match trainer.adapters() {
        Some(a) => cfg.lora_train_flops_per_token(args.seq_len, a.forward_flops_per_token() as f64),
        None => cfg.train_flops_per_token(args.seq_len),
    };
    let peak_flops = candle_offload_suite::dense_bf16_peak_flops(device);
    let lora_rec = b.lora.map(|quant| {
        json!({
            "rank": args.lora_rank,
            "alpha": 2 * args.lora_rank,
            "targets": candle_offload_models::lora::DEFAULT_TARGETS,
            "base": quant.and_then(candle_offload_models::quantize::type_name).unwrap_or(b.label),
            "budget_gib": b.offload_gib,
        })
    });
    let mut rec = json!({
        "lora": lora_rec,
        "config": b.name,
        "precision": b.label,
        "checkpointing": b.ckpt.name(),
        "checkpoint_segments": segments,
        "offload": b.offload_gib.is_some() && b.lora.is_none(),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "parameters": params,
        "build_s": build_s,
        "step_s": step_s,
        "step_s_all": times,
        "forward_s": median(phase_s[0].clone()),
        "backward_s": median(phase_s[1].clone()),
        "optimizer_s": median(phase_s[2].clone()),
        "profile_captured": args.profile_capture && gpu,
        "host_profile": host_top,
        "sampler_ms": if gpu { Some(args.sampler_ms) } else { None },
        "hand_backward": !args.graph_backward,
        "event_tracking": args.event_tracking || b.offload_gib.is_some(),
        "tokens_per_s": if step_s > 0.0 { tokens / step_s } else { 0.0 },
        "model_flops_per_token": flops_per_token,
        "dense_bf16_peak_flops": peak_flops,
        "mfu": candle_offload_suite::mfu(flops_per_token, tokens, step_s, peak_flops),
        "losses": losses,
        "final_loss": losses.last(),
        "skipped_steps": trainer.scaler().skipped_steps(),
        "loss_scale": trainer.scaler().scale(),
        "recomputed_segments": trainer.recomputed_segments(),
        "baseline_device_bytes": gpu.then_some(baseline),
        "peak_device_bytes": gpu.then_some(peak),
        "peak_device_bytes_driver": gpu.then_some(peak_driver),
        "static_bytes": gpu.then_some(static_bytes),
        "static_bytes_driver": gpu.then_some(static_driver),
        "grad_bytes": grad_bytes,
        "activation_bytes": activation_bytes,
        "fwd_bwd_peak_bytes": fwd_bwd_peak,
        "fwd_bwd_peak_bytes_driver": fwd_bwd_peak_driver,
        "fwd_bwd_extra_bytes": fwd_bwd_peak.map(|p| p.saturating_sub(static_bytes)),
        "error": null,
    });
    if let (Some(rt), Some(budget)) = (trainer.runtime(), budget_bytes) {
        let st = rt.stats()?;
        let over_context = raw_peak.map(|p| p.saturating_sub(context_bytes));
        rec["budget_bytes"] = budget.into();
        rec["peak_over_context_bytes"] = over_context.into();
        rec["budget_holds"] = (peak <= budget).into();
        rec["budget_holds_driver"] = over_context.map(|p| p <= budget).into();
        rec["streamed_bytes_per_step"] = (median(streamed) as u64).into();
        rec["runtime"] = json!({
            "reserve_bytes": st.reserve_bytes,
            "weight_capacity_bytes": st.weight_capacity_bytes,
            "peak_resident_bytes": st.peak_resident_bytes,
            "pinned_bytes": st.pinned_bytes,
            "fetches": st.total.fetches,
            "bytes": st.total.bytes,
            "copy_gbps": st.total.copy_gbps(),
            "stall_s": st.total.stall_s,
            "steps": st.steps,
        });
    }
    drop(trainer);
    drop((inputs, targets));
    if b.offload_gib.is_some() && gpu {
        // The link's raw pinned rate, for the step's ideal (see `derive`).
        rec["raw_pinned_h2d_gbps"] = diag::measure_h2d_gbps(device, 256 << 20, true, 5)?.into();
    }
    Ok(rec)
}

fn mib(v: &Value) -> String {
    v.as_u64().map_or("-".into(), |b| (b >> 20).to_string())
}

fn num(v: &Value, digits: usize) -> String {
    v.as_f64().map_or("-".into(), |x| format!("{x:.digits$}"))
}

/// Adds the derived figures: per checkpointed configuration against `none` of its precision,
/// per configuration against the peer, per offloaded one against the resident per-layer run.
fn derive(records: &mut [Value], peer: Option<&Value>) {
    let find = |recs: &[Value], name: &str| -> Option<Value> {
        recs.iter()
            .find(|r| r["config"] == name && r["error"].is_null())
            .cloned()
    };
    let peer_rec = |name: &str| -> Option<Value> {
        peer?["results"]
            .as_array()?
            .iter()
            .find(|r| r["config"] == name && r["error"].is_null())
            .cloned()
    };
    let snapshot = records.to_vec();
    for r in records.iter_mut() {
        if !r["error"].is_null() {
            continue;
        }
        let name = r["config"].as_str().unwrap_or_default().to_string();
        let prec = r["precision"].as_str().unwrap_or_default().to_string();
        let offload = r["offload"].as_bool().unwrap_or(false);
        if r["checkpointing"] != "none" && !offload {
            if let Some(none) = find(&snapshot, &format!("none-{prec}")) {
                let (a0, a1) = (
                    none["activation_bytes"].as_f64(),
                    r["activation_bytes"].as_f64(),
                );
                if let (Some(a0), Some(a1)) = (a0, a1) {
                    if a1 > 0.0 {
                        r["activation_memory_reduction"] = (a0 / a1).into();
                        r["meets_activation_target"] = (a0 / a1 >= 3.0).into();
                    }
                }
                if let (Some(p0), Some(p1)) = (
                    none["peak_device_bytes"].as_f64(),
                    r["peak_device_bytes"].as_f64(),
                ) {
                    if p1 > 0.0 {
                        r["peak_memory_reduction"] = (p0 / p1).into();
                    }
                }
                if let (Some(e0), Some(e1)) = (
                    none["fwd_bwd_extra_bytes"].as_f64(),
                    r["fwd_bwd_extra_bytes"].as_f64(),
                ) {
                    if e1 > 0.0 {
                        r["fwd_bwd_memory_reduction"] = (e0 / e1).into();
                    }
                }
                if let (Some(t0), Some(t1)) = (none["step_s"].as_f64(), r["step_s"].as_f64()) {
                    if t0 > 0.0 {
                        r["checkpoint_overhead"] = (t1 / t0 - 1.0).into();
                        r["meets_overhead_target"] = (t1 / t0 - 1.0 <= 0.4).into();
                    }
                }
            }
        }
        if offload {
            if let Some(res) = find(&snapshot, &format!("layer-{prec}")) {
                if let (Some(t0), Some(t1)) = (res["step_s"].as_f64(), r["step_s"].as_f64()) {
                    if t0 > 0.0 {
                        r["slowdown_vs_resident"] = (t1 / t0).into();
                    }
                }
                // The offloaded step's ideal: the bytes it streams at the link's raw pinned
                // rate, plus the GPU compute of the same step with resident weights (forward
                // and backward of `layer-<precision>`, checkpointed the same way, same run),
                // plus the host optimizer as measured here.
                let parts = (
                    r["streamed_bytes_per_step"].as_f64(),
                    r["raw_pinned_h2d_gbps"].as_f64(),
                    res["forward_s"].as_f64(),
                    res["backward_s"].as_f64(),
                    r["optimizer_s"].as_f64(),
                    r["step_s"].as_f64(),
                );
                if let (Some(bytes), Some(gbps), Some(f), Some(b), Some(o), Some(step)) = parts {
                    if gbps > 0.0 {
                        let ideal = bytes / (gbps * 1e9) + f + b + o;
                        r["offload_step_ideal_s"] = ideal.into();
                        r["offload_step_vs_ideal"] = (step / ideal).into();
                        r["meets_offload_ideal_target"] = (step / ideal <= 1.5).into();
                    }
                }
            }
        }
        if !r["lora"].is_null() {
            // LoRA: against PEFT (scripts/lora_peer.py) where both hold the base; under a
            // budget, against the ideal: the bytes streamed at the link's raw pinned rate plus
            // the step of the same base resident (the row without the budget, same run).
            if let Some(p) = peer_rec(&name) {
                if let (Some(ours), Some(theirs)) = (r["step_s"].as_f64(), p["step_s"].as_f64()) {
                    if theirs > 0.0 {
                        r["step_time_vs_peft"] = (ours / theirs).into();
                        r["meets_peft_target"] = (ours / theirs <= 1.1).into();
                    }
                }
                r["peft"] = p;
            }
            if !r["budget_bytes"].is_null() {
                r["peak_within_budget"] = r["budget_holds_driver"].clone();
                let resident: Vec<&str> = name.split('-').filter(|m| !m.ends_with("gib")).collect();
                if let Some(res) = find(&snapshot, &resident.join("-")) {
                    let parts = (
                        r["streamed_bytes_per_step"].as_f64(),
                        r["raw_pinned_h2d_gbps"].as_f64(),
                        res["step_s"].as_f64(),
                        r["step_s"].as_f64(),
                    );
                    if let (Some(bytes), Some(gbps), Some(compute), Some(step)) = parts {
                        if gbps > 0.0 {
                            let ideal = bytes / (gbps * 1e9) + compute;
                            r["lora_step_ideal_s"] = ideal.into();
                            r["step_vs_ideal"] = (step / ideal).into();
                            r["meets_ideal_target"] = (step / ideal <= 1.5).into();
                        }
                    }
                }
            }
            continue;
        }
        if let Some(p) = peer_rec(&name) {
            r["pytorch"] = p.clone();
            if let (Some(ours), Some(theirs)) = (r["step_s"].as_f64(), p["step_s"].as_f64()) {
                if theirs > 0.0 {
                    r["step_time_vs_pytorch"] = (ours / theirs).into();
                    r["meets_pytorch_target"] = (ours / theirs <= 1.3).into();
                }
            }
        }
    }
}

/// The derived figures of every configuration, one line each.
fn summary(records: &[Value]) -> Value {
    const KEYS: [&str; 15] = [
        "step_s",
        "forward_s",
        "backward_s",
        "optimizer_s",
        "mfu",
        "offload_step_vs_ideal",
        "peak_device_bytes",
        "activation_memory_reduction",
        "fwd_bwd_memory_reduction",
        "checkpoint_overhead",
        "step_time_vs_pytorch",
        "slowdown_vs_resident",
        "budget_holds",
        "budget_holds_driver",
        "error",
    ];
    records
        .iter()
        .map(|r| {
            let mut o = serde_json::Map::new();
            o.insert("config".into(), r["config"].clone());
            for k in KEYS {
                if !r[k].is_null() {
                    o.insert(k.into(), r[k].clone());
                }
            }
            Value::Object(o)
        })
        .collect()
}

fn print_table(records: &[Value]) {
    let row = |c: [String; 13]| {
        println!(
            "{:<18} {:>7} {:>7} {:>6} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>8} {:>8} {:>8}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12]
        )
    };
    row([
        "config",
        "step s",
        "tok/s",
        "MFU %",
        "peak MiB",
        "static",
        "act MiB",
        "act red",
        "fb red",
        "ckpt +%",
        "torch s",
        "vs torch",
        "torch MiB",
    ]
    .map(String::from));
    for r in records {
        if let Some(e) = r["error"].as_str() {
            println!("{:<18} error: {e}", r["config"].as_str().unwrap_or("?"));
            continue;
        }
        row([
            r["config"].as_str().unwrap_or("?").to_string(),
            num(&r["step_s"], 3),
            num(&r["tokens_per_s"], 0),
            r["mfu"]
                .as_f64()
                .map_or("-".into(), |m| format!("{:.1}", m * 100.0)),
            mib(&r["peak_device_bytes"]),
            mib(&r["static_bytes"]),
            mib(&r["activation_bytes"]),
            num(&r["activation_memory_reduction"], 2),
            num(&r["fwd_bwd_memory_reduction"], 2),
            r["checkpoint_overhead"]
                .as_f64()
                .map_or("-".into(), |o| format!("{:.0}%", o * 100.0)),
            num(&r["pytorch"]["step_s"], 3),
            num(&r["step_time_vs_pytorch"], 2),
            mib(&r["pytorch"]["peak_device_bytes"]),
        ]);
        println!(
            "{:<18} forward {} s, backward {} s, optimizer {} s",
            "",
            num(&r["forward_s"], 3),
            num(&r["backward_s"], 3),
            num(&r["optimizer_s"], 3)
        );
        if let Some(b) = r["budget_bytes"].as_u64() {
            println!(
                "{:<18} budget {} MiB, peak over the CUDA context {} MiB: {}; streamed {:.1} MB \
                 per step",
                "",
                b >> 20,
                mib(&r["peak_over_context_bytes"]),
                match r["budget_holds_driver"].as_bool() {
                    Some(true) => "holds",
                    Some(false) => "EXCEEDED",
                    None => "not measured",
                },
                r["streamed_bytes_per_step"].as_f64().unwrap_or(0.0) / 1e6
            );
            if let Some(x) = r["offload_step_vs_ideal"].as_f64() {
                println!(
                    "{:<18} step vs its ideal {x:.2} (ideal {} s)",
                    "",
                    num(&r["offload_step_ideal_s"], 2)
                );
            }
        }
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    if args.steps == 0 || args.offload_steps == 0 {
        bail!("--steps and --offload-steps must be at least 1");
    }
    if !(args.budget_gib.is_finite() && args.budget_gib > 0.0) {
        bail!("--budget-gib must be a positive number of GiB");
    }
    let benches = args
        .configs
        .iter()
        .filter(|s| !s.trim().is_empty())
        .map(|s| parse_config(s, args.budget_gib))
        .collect::<Result<Vec<_>>>()?;
    if benches.is_empty() {
        bail!("--configs: no configuration given");
    }
    let cfg = shape_config(&args)?;
    let peer: Option<Value> = match &args.peer {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("--peer {}: cannot read", p.display()))?;
            Some(
                serde_json::from_str(&text)
                    .with_context(|| format!("--peer {}: not valid JSON", p.display()))?,
            )
        }
        None => None,
    };
    let device = candle_offload_suite::device(args.cpu, args.device)?;
    let gpu = !device.is_cpu();
    let context_bytes = if gpu {
        diag::device_used_bytes(&device)?
    } else {
        0
    };
    println!(
        "shape: {} layers, hidden {}, {} heads ({} KV), intermediate {}, vocab {}; batch {} x {} tokens; {}",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
        args.batch_size,
        args.seq_len,
        if gpu {
            format!("CUDA context {} MiB", context_bytes >> 20)
        } else {
            "on the CPU: no memory figures".into()
        }
    );

    // Load every kernel module and create the BLAS handles before the first baseline.
    if gpu {
        let tiny = Config::from_json_str(
            &json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 101, "tie_word_embeddings": false})
            .to_string(),
            Path::new("<warm-up shape>"),
        )?;
        for precision in [Precision::F32, Precision::F16, Precision::BF16] {
            let s = TrainSettings {
                precision,
                checkpoint_segments: 1,
                batch_size: 1,
                seq_len: 16,
                ..Default::default()
            };
            let mut t = Trainer::random(tiny.clone(), &device, &s)?;
            let (i, o) = batch(&tiny, 1, 16, &device)?;
            t.step(&i, &o)?;
        }
        device.synchronize()?;
    }

    let op_overhead = match args.op_overhead {
        Some(n) => Some(op_overhead_us(&device, n.max(1))?),
        None => None,
    };

    // The peer's figures count only if it measured the same shapes.
    let peer_for_ratios = peer.as_ref().filter(|p| {
        let same = [
            ("hidden_size", cfg.hidden_size),
            ("num_hidden_layers", cfg.num_hidden_layers),
            ("num_attention_heads", cfg.num_attention_heads),
            ("num_key_value_heads", cfg.num_key_value_heads),
            ("intermediate_size", cfg.intermediate_size),
            ("vocab_size", cfg.vocab_size),
            ("batch_size", args.batch_size),
            ("seq_len", args.seq_len),
        ]
        .iter()
        .all(|(k, v)| p["shape"][*k].as_u64() == Some(*v as u64))
            // A LoRA peer (scripts/lora_peer.py) names its rank too.
            && p["shape"]["lora_rank"]
                .as_u64()
                .is_none_or(|r| r == args.lora_rank as u64);
        if !same {
            eprintln!(
                "warning: --peer measured other shapes ({}); its figures are kept but not compared",
                p["shape"]
            );
        }
        same
    });
    let shape = json!({
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "optimizer": format!("AdamW lr {} (candle-nn defaults otherwise)", args.lr),
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "timed_steps_offloaded": args.offload_steps,
        "context_bytes": context_bytes,
    });
    let definitions = json!({
        "forward_s": "median over the timed steps of the forward pass and loss, the device synchronized at the phase's start and end (Trainer::set_phase_observer); backward_s: the backward pass with its recomputes (offloaded: and the gradients' trip to the host); optimizer_s: unscaling, AdamW and (offloaded) the write-back of the updated weights",
        "offload_step_vs_ideal": "step_s over its ideal: streamed_bytes_per_step at raw_pinned_h2d_gbps (pinned host-to-device, measured after the configuration) + forward_s + backward_s of layer-<precision> (resident weights, same checkpointing, same run) + this run's optimizer_s",
        "peak_device_bytes": "the driver memory pool's high-water mark of memory in use (CU_MEMPOOL_ATTR_USED_MEM_HIGH; Candle and the runtime allocate from it) during the steps (warm-up included), minus what was in use before the configuration: the analogue of the peer's torch.cuda.max_memory_allocated",
        "peak_device_bytes_driver": "max of cuMemGetInfo used bytes, polled every 1 ms from another thread during the steps, minus the used bytes just before (memory pool trimmed): includes the pool's cached free blocks, which the pool keeps (release threshold raised) rather than returning",
        "static_bytes": "memory in use (pool) after the trainer is built minus before: F32 masters and AdamW state (offloaded: resident weights)",
        "grad_bytes": "4 bytes per parameter for resident runs (F32 gradients); 0 for offloaded runs, whose gradients go to the host per segment",
        "activation_bytes": "peak_device_bytes - static_bytes - grad_bytes: activations, recomputed segments, backward and optimizer temporaries, allocator slack",
        "activation_memory_reduction": "activation_bytes without checkpointing over activation_bytes with it, same precision",
        "fwd_bwd_peak_bytes": "resident runs: the peak as for peak_device_bytes over one extra forward and backward pass without an optimizer step (Trainer::loss_and_grads), pool trimmed first",
        "fwd_bwd_extra_bytes": "fwd_bwd_peak_bytes - static_bytes: activations, recomputed segments and the gradients present at that peak, without the optimizer's temporaries",
        "fwd_bwd_memory_reduction": "fwd_bwd_extra_bytes without checkpointing over fwd_bwd_extra_bytes with it, same precision",
        "peak_memory_reduction": "peak_device_bytes without checkpointing over peak_device_bytes with it, same precision",
        "checkpoint_overhead": "step_s with checkpointing over step_s without, minus 1, same precision",
        "step_time_vs_pytorch": "our step_s over PyTorch's step_s in the same configuration (scripts/train_peer.py)",
        "step_s": "median wall time of the timed steps (forward, backward, unscale, AdamW), device synchronised after each",
        "mfu": "model_flops_per_token (6 per matmul parameter plus 12 x layers x heads x head_dim x seq_len) times tokens per step, over step_s, over the GPU's dense BF16 peak (null where unknown), in every precision",
        "budget_holds": "offloaded runs: peak used bytes minus the CUDA context measured at start <= budget_bytes",
        "sqrt_segments": "round(sqrt(layers)) segments, lengths differing by at most one, every segment checkpointed",
    });
    let targets = json!({
        "activation_memory_reduction_min": 3.0,
        "checkpoint_overhead_max": 0.4,
        "step_time_vs_pytorch_max": 1.3,
        "budget": "peak within the offload budget, measured outside the allocator \
                   (budget_holds_driver)",
        "offload_step_vs_ideal_max": 1.5,
    });
    let write = |records: &[Value]| -> Result<()> {
        if let Some(path) = &args.json_out {
            candle_offload_bench::write_results_with_peer(
                path,
                "train",
                &device,
                json!({
                    "op_overhead_us": op_overhead,
                    "shape": shape,
                    "definitions": definitions,
                    "targets": targets,
                    "summary": summary(records),
                    "configs": records,
                }),
                peer.clone(),
            )?;
        }
        Ok(())
    };

    let mut records: Vec<Value> = Vec::new();
    let t_all = Instant::now();
    for b in &benches {
        let elapsed = t_all.elapsed().as_secs_f64();
        eprintln!("== {} ({elapsed:.0} s so far)", b.name);
        if args.max_seconds.is_some_and(|m| elapsed > m) {
            records.push(json!({"config": b.name, "precision": b.label,
                "checkpointing": b.ckpt.name(), "offload": b.offload_gib.is_some(),
                "error": format!("skipped: --max-seconds reached after {elapsed:.0} s")}));
            write(&records)?;
            continue;
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_one(b, &cfg, &args, &device, context_bytes)
        }));
        let rec = match outcome {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => json!({"config": b.name, "precision": b.label,
                "checkpointing": b.ckpt.name(), "offload": b.offload_gib.is_some(),
                "error": format!("{e:#}")}),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into());
                json!({"config": b.name, "precision": b.label,
                    "checkpointing": b.ckpt.name(), "offload": b.offload_gib.is_some(),
                    "error": format!("panicked: {msg}")})
            }
        };
        if let Some(e) = rec["error"].as_str() {
            eprintln!("{}: {e}", b.name);
        }
        records.push(rec);
        derive(&mut records, peer_for_ratios);
        write(&records)?;
    }
    print_table(&records);
    if let Some(p) = &args.json_out {
        println!("wrote {}", p.display());
    }
    Ok(())
}
