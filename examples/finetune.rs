//! Fine-tunes a LLaMA-family model on a text file with AdamW, on a GPU too small for it if
//! need be: autocast (F16 with loss scaling, or BF16), gradient checkpointing, and weights
//! offloaded to host memory. Writes a directory that `examples/generate` loads.
//!
//! Run with: `cargo run --release --example finetune -- --steps 3 --seq-len 32 --output /tmp/ft`
//! (SmolLM2-135M-Instruct on the bundled sample text, `examples/data/sample.txt`), then
//! `cargo run --release --example generate -- --model /tmp/ft`. On a GPU, e.g.
//! `--features cuda ... --model DIR --data corpus.txt --autocast bf16 --checkpoint-segments 5`,
//! or with `--offload --gpu-memory-limit 4` for a model that does not fit.
//!
//! The text is tokenized whole (no special tokens added) and cut into windows of
//! `--seq-len + 1` tokens, each overlapping the next by one token; a batch takes
//! `--batch-size` windows in an order shuffled from `--seed` (every window once per epoch);
//! inputs are a window's first `--seq-len` tokens, targets its last `--seq-len`. The learning
//! rate is constant.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::ParamsAdamW;
use candle_offload::diag::{self, PeakMemorySampler};
use candle_offload::{MemoryLimit, Precision};
use candle_offload_models::loader::{self, ModelFiles, Weights};
use candle_offload_models::{TrainSettings, Trainer, IGNORE_TARGET};
use candle_offload_suite::flags;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom as _;

/// The sample text used when `--data` is not given.
const SAMPLE: &str = include_str!("data/sample.txt");
const SAMPLE_NAME: &str = "examples/data/sample.txt (bundled)";

/// Fine-tunes a LLaMA-family model on a text file (AdamW, constant learning rate).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    model: candle_offload_suite::ModelArgs,
    /// UTF-8 text to train on, or chat JSONL (a `.jsonl` file of `{"messages": [{"role": ..,
    /// "content": ..}, ..]}` lines), rendered with the model's chat template, the loss only on
    /// the assistants' tokens. Default: the bundled sample, examples/data/sample.txt.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Optimizer steps (1 or more).
    #[arg(long, default_value_t = 100, value_parser = flags::at_least_one)]
    steps: usize,
    /// Sequences per step (1 or more).
    #[arg(long, default_value_t = 1, value_parser = flags::at_least_one)]
    batch_size: usize,
    /// Tokens per sequence (1 or more, at most the model's context).
    #[arg(long, default_value_t = 256, value_parser = flags::at_least_one)]
    seq_len: usize,
    /// AdamW learning rate (constant, above 0).
    #[arg(long, default_value_t = 1e-4, value_parser = flags::positive, allow_hyphen_values = true)]
    lr: f64,
    /// AdamW weight decay (decoupled, 0 or more).
    #[arg(long, default_value_t = 0.0, value_parser = flags::non_negative, allow_hyphen_values = true)]
    weight_decay: f64,
    /// Matmul precision: f16 (with dynamic loss scaling), bf16, or off (F32). Default: bf16
    /// on a GPU, off on the CPU. Master weights and optimizer state are always F32.
    #[arg(long)]
    autocast: Option<Precision>,
    /// Checkpointed segments over the decoder layers; 0 turns checkpointing off. Default: 0,
    /// or one segment per layer with --offload.
    #[arg(long)]
    checkpoint_segments: Option<usize>,
    /// GPU memory budget for offloaded training: GiB (`3.5`), or `3.5GiB`, `3GB`, `50%`.
    /// Implies --offload.
    #[arg(long)]
    gpu_memory_limit: Option<String>,
    /// Keep master weights and AdamW state in host memory and stream the weights to the GPU
    /// (needs checkpointing). Without --gpu-memory-limit the budget is 90% of the GPU.
    #[arg(long)]
    offload: bool,
    /// Offload prefetch depth.
    #[arg(long, default_value_t = 1)]
    prefetch_depth: usize,
    /// Directory to write the fine-tuned model to (created if missing).
    #[arg(long, default_value = "finetuned")]
    output: PathBuf,
    /// Dtype of the saved weights: f32, f16 or bf16. Default: the source checkpoint's float
    /// dtype (safetensors), f16 for a GGUF source.
    #[arg(long, value_parser = flags::float_dtype)]
    save_dtype: Option<DType>,
    /// Seed of the batch order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run Candle's composite ops and candle-nn's AdamW instead of the fused kernels (the
    /// same numbers within rounding; for comparison).
    #[arg(long)]
    unfused: bool,
    /// Write the per-step losses (with the run's settings, commit and machine) to this JSON.
    #[arg(long)]
    losses_json: Option<PathBuf>,
    /// Train LoRA adapters on the frozen base instead of every weight; the adapter is saved in
    /// PEFT's format (`adapter_config.json`, `adapter_model.safetensors`) to --output. The base
    /// is served under --gpu-memory-limit (resident where it fits, streamed otherwise).
    #[arg(long)]
    lora: bool,
    /// LoRA rank.
    #[arg(long, default_value_t = 8, requires = "lora", value_parser = flags::at_least_one)]
    lora_rank: usize,
    /// LoRA alpha (the update is scaled by alpha / rank).
    #[arg(long, default_value_t = 16.0, requires = "lora", value_parser = flags::positive)]
    lora_alpha: f64,
    /// Dropout on the adapters' input.
    #[arg(long, default_value_t = 0.0, requires = "lora", value_parser = flags::dropout)]
    lora_dropout: f64,
    /// Modules to adapt, comma-separated: HF module names (`q_proj`, `qkv_proj`) or the short
    /// `q,k,v,o,gate,up,down` (and `qkv`, `gate_up`, `all`). Default: every projection.
    #[arg(long, value_delimiter = ',', requires = "lora")]
    lora_targets: Option<Vec<String>>,
    /// Start from this saved adapter (PEFT's files) instead of a fresh one, and from the AdamW
    /// state saved beside it where there is one.
    #[arg(long, value_name = "DIR", requires = "lora")]
    lora_resume: Option<PathBuf>,
    /// With --lora: quantize the base on load to this GGML type (QLoRA), its blocks kept as
    /// blocks; a GGUF base keeps its own blocks without it.
    #[arg(long, value_name = "TYPE", requires = "lora")]
    quantize: Option<String>,
    /// Run on the CPU.
    #[arg(long)]
    cpu: bool,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

/// Windows of `seq_len + 1` tokens, or chat examples (inputs and targets of `seq_len`
/// tokens each, the untrained targets [`IGNORE_TARGET`]), served in batches in a seeded order.
struct Batches {
    ids: Vec<u32>,
    examples: Vec<(Vec<u32>, Vec<u32>)>,
    seq_len: usize,
    order: Vec<usize>,
    cursor: usize,
    rng: rand::rngs::StdRng,
}

impl Batches {
    fn new(ids: Vec<u32>, seq_len: usize, seed: u64) -> Self {
        let windows = (ids.len() - 1) / seq_len;
        let mut rng = candle_offload_suite::rng(seed);
        let mut order: Vec<usize> = (0..windows).collect();
        order.shuffle(&mut rng);
        Self {
            ids,
            examples: Vec::new(),
            seq_len,
            order,
            cursor: 0,
            rng,
        }
    }

    /// Chat examples, each already `seq_len` inputs and targets.
    fn chat(examples: Vec<(Vec<u32>, Vec<u32>)>, seq_len: usize, seed: u64) -> Self {
        let mut rng = candle_offload_suite::rng(seed);
        let mut order: Vec<usize> = (0..examples.len()).collect();
        order.shuffle(&mut rng);
        Self {
            ids: Vec::new(),
            examples,
            seq_len,
            order,
            cursor: 0,
            rng,
        }
    }

    fn windows(&self) -> usize {
        self.order.len()
    }

    /// Inputs and targets, (batch, seq_len) each.
    fn next(&mut self, batch: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let s = self.seq_len;
        let (mut inputs, mut targets) = (Vec::with_capacity(batch * s), Vec::new());
        for _ in 0..batch {
            if self.cursor == self.order.len() {
                self.order.shuffle(&mut self.rng);
                self.cursor = 0;
            }
            let at = self.order[self.cursor];
            self.cursor += 1;
            if let Some((i, t)) = self.examples.get(at) {
                inputs.extend_from_slice(i);
                targets.extend_from_slice(t);
                continue;
            }
            let start = at * s;
            let w = &self.ids[start..start + s + 1];
            inputs.extend_from_slice(&w[..s]);
            targets.extend_from_slice(&w[1..]);
        }
        Ok((
            Tensor::from_vec(inputs, (batch, s), device)?,
            Tensor::from_vec(targets, (batch, s), device)?,
        ))
    }
}

/// The dtype of the first float tensor in the first safetensors file of `files`.
fn source_float_dtype(files: &ModelFiles) -> Option<DType> {
    let Weights::Safetensors(paths) = &files.weights else {
        return None;
    };
    let mut f = std::fs::File::open(paths.first()?).ok()?;
    let mut len = [0u8; 8];
    std::io::Read::read_exact(&mut f, &mut len).ok()?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return None;
    }
    let mut header = vec![0u8; len as usize];
    std::io::Read::read_exact(&mut f, &mut header).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&header).ok()?;
    v.as_object()?
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .find_map(|(_, t)| flags::float_dtype(t.get("dtype")?.as_str()?).ok())
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        _ => "float32",
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / 2f64.powi(30)
}

/// Reads `--data` (or the bundled sample); the name to use in messages.
fn read_text(data: Option<&Path>) -> Result<(String, String)> {
    let Some(path) = data else {
        return Ok((SAMPLE.to_string(), SAMPLE_NAME.to_string()));
    };
    let name = path.display().to_string();
    if path.is_dir() {
        bail!("--data {name}: is a directory, expected a UTF-8 text file");
    }
    let bytes = std::fs::read(path).map_err(|e| anyhow!("--data {name}: cannot read: {e}"))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow!(
            "--data {name}: not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })?;
    if text.trim().is_empty() {
        bail!("--data {name}: is empty (no text to train on)");
    }
    Ok((text, name))
}

/// Writes the fine-tuned model to `dir`, laid out as the base: a GGUF base as `model.gguf`
/// with the base's metadata and tensor names (its tokenizer and chat template inside); a
/// safetensors base in the HF layout. `loader::from_dir` reads both. Returns what it wrote.
fn save(
    dir: &Path,
    trainer: &Trainer,
    files: &ModelFiles,
    tokenizer: &candle_offload_models::Tokenizer,
    dtype: DType,
) -> Result<&'static str> {
    let at = |f: &str| dir.join(f);
    if let Weights::Gguf(source) = &files.weights {
        let weights = trainer.weights(dtype)?;
        candle_offload_models::gguf_save::save_like(source, &weights, dtype, &at("model.gguf"))?;
        return Ok("model.gguf");
    }
    trainer
        .save_safetensors(&at("model.safetensors"), dtype)
        .with_context(|| format!("cannot write {}", at("model.safetensors").display()))?;
    let cfg = trainer.config();
    let mut config = cfg.to_hf_json();
    config["torch_dtype"] = dtype_name(dtype).into();
    let write_json = |name: &str, v: &serde_json::Value| -> Result<()> {
        let p = at(name);
        std::fs::write(&p, serde_json::to_string_pretty(v)? + "\n")
            .map_err(|e| anyhow!("cannot write {}: {e}", p.display()))
    };
    write_json("config.json", &config)?;
    tokenizer.save(dir)?;
    let token_text = |given: &Option<String>, id: Option<u32>| {
        given
            .clone()
            .or_else(|| id.and_then(|i| tokenizer.id_to_token(i)))
    };
    let mut tc = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_position_embeddings,
    });
    if let Some(b) = token_text(&files.special_tokens.bos, cfg.bos_token_id) {
        tc["bos_token"] = b.into();
    }
    if let Some(e) = token_text(
        &files.special_tokens.eos,
        cfg.eos_token_ids.first().copied(),
    ) {
        tc["eos_token"] = e.into();
    }
    if let Some(t) = &files.chat_template {
        tc["chat_template"] = t.clone().into();
    }
    write_json("tokenizer_config.json", &tc)?;
    Ok("config.json, model.safetensors, tokenizer.json, tokenizer_config.json")
}

/// The LoRA trainer of `--lora`: the base loaded with its blocks kept (or quantized on load
/// with `--quantize`), dense weights in the compute dtype, and a fresh adapter (or
/// `--lora-resume`'s).
fn lora_trainer(
    args: &Args,
    files: &ModelFiles,
    device: &Device,
    settings: &TrainSettings,
) -> Result<Trainer> {
    use candle_offload_models::lora::{self, Adapters, LoraConfig};
    use candle_offload_models::quantize;
    let store_cfg = candle_offload::StoreConfig {
        dtype: Some(candle_offload::Autocast::new(settings.precision).compute_dtype()),
        ..Default::default()
    };
    let store = match &args.quantize {
        Some(name) => {
            let ty = quantize::parse_type(name)
                .ok_or_else(|| anyhow!("--quantize {name}: not a quantize type"))?;
            quantize::load_store_config(files, ty, &store_cfg, device, &Default::default())?.0
        }
        None => loader::load_store_config(files, &store_cfg, device, true)?,
    };
    let adapters = match &args.lora_resume {
        Some(dir) => lora::peft::load(dir, &files.config, device)?,
        None => {
            let target_modules = match &args.lora_targets {
                None => lora::DEFAULT_TARGETS
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
                Some(list) => {
                    let mut out = Vec::new();
                    for t in list {
                        match lora::target_alias(t).as_slice() {
                            [] => out.push(t.clone()),
                            names => out.extend(names.iter().map(|s| s.to_string())),
                        }
                    }
                    out
                }
            };
            let config = LoraConfig {
                r: args.lora_rank,
                alpha: args.lora_alpha,
                dropout: args.lora_dropout as f32,
                target_modules,
                base_model_name_or_path: Some(files.origin.clone()),
                ..Default::default()
            };
            Adapters::init(config, &files.config, device, args.seed)
                .map_err(|e| anyhow!("--lora-targets: {e}"))?
        }
    };
    eprintln!(
        "LoRA: {} modules, {:.2} M adapter parameters, base {} GGML tensors",
        adapters.modules().len(),
        adapters.parameter_count() as f64 / 1e6,
        store.ggml_tensor_count()
    );
    Ok(Trainer::lora(
        files.config.clone(),
        std::sync::Arc::new(store),
        adapters,
        device,
        settings,
    )?)
}

/// Batches of windows of `text`'s tokens.
fn text_batches(
    text: &str,
    data_name: &str,
    tokenizer: &candle_offload_models::Tokenizer,
    seq_len: usize,
    seed: u64,
    t0: Instant,
) -> Result<Batches> {
    let ids = tokenizer
        .encode(text, false)
        .map_err(|e| anyhow!("--data {data_name}: cannot tokenize: {e}"))?;
    if ids.len() < seq_len + 1 {
        bail!(
            "--data {data_name}: has {} tokens; --seq-len {} needs at least {} (one window of \
             inputs plus the next-token target): give more text or lower --seq-len",
            ids.len(),
            seq_len,
            seq_len + 1
        );
    }
    let n_tokens = ids.len();
    let batches = Batches::new(ids, seq_len, seed);
    eprintln!(
        "data: {data_name}: {n_tokens} tokens, {} windows of {}+1, tokenized in {:.2} s",
        batches.windows(),
        seq_len,
        t0.elapsed().as_secs_f64()
    );
    Ok(batches)
}

/// Chat JSONL (`{"messages": [{"role": .., "content": ..}, ..]}` a line) as training
/// examples: each conversation rendered with the model's chat template, tokenized piece by
/// piece, cut or padded to `seq_len + 1` tokens; only the assistants' tokens are targets.
fn chat_examples(
    text: &str,
    data_name: &str,
    template: &candle_offload_models::ChatTemplate,
    tokenizer: &candle_offload_models::Tokenizer,
    seq_len: usize,
) -> Result<Vec<(Vec<u32>, Vec<u32>)>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("--data {data_name}: line {}", n + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: not JSON", at()))?;
        let msgs = v["messages"]
            .as_array()
            .ok_or_else(|| anyhow!("{}: no \"messages\" list", at()))?;
        let mut messages = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            let (Some(role), Some(content)) = (m["role"].as_str(), m["content"].as_str()) else {
                bail!(
                    "{}: messages[{i}] needs string \"role\" and \"content\"",
                    at()
                );
            };
            messages.push((role.to_string(), content.to_string()));
        }
        if !messages.iter().any(|(r, _)| r == "assistant") {
            bail!("{}: no assistant message to train on", at());
        }
        let mut ids = Vec::new();
        let mut trained = Vec::new();
        for (piece, train) in template.training_pieces(&messages).with_context(at)? {
            let t = tokenizer
                .encode(piece.as_str(), false)
                .map_err(|e| anyhow!("{}: cannot tokenize: {e}", at()))?;
            trained.extend(std::iter::repeat_n(train, t.len()));
            ids.extend(t);
        }
        ids.truncate(seq_len + 1);
        trained.truncate(seq_len + 1);
        let mut inputs: Vec<u32> = ids[..ids.len() - 1].to_vec();
        let mut targets: Vec<u32> = ids[1..]
            .iter()
            .zip(&trained[1..])
            .map(|(&id, &t)| if t { id } else { IGNORE_TARGET })
            .collect();
        inputs.resize(seq_len, 0);
        targets.resize(seq_len, IGNORE_TARGET);
        if targets.iter().all(|&t| t == IGNORE_TARGET) {
            eprintln!(
                "{}: no assistant token within --seq-len {seq_len}; skipped",
                at()
            );
            continue;
        }
        out.push((inputs, targets));
    }
    if out.is_empty() {
        bail!("--data {data_name}: no conversation to train on");
    }
    Ok(out)
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    let verbose = args.verbose > 0;
    candle_offload_suite::report::exit_code(run(args), verbose)
}

fn run(args: Args) -> Result<()> {
    // Cheap checks first (the numbers and names are checked as clap parses them): bad flags
    // fail before a model is loaded.
    let mut limit = args
        .gpu_memory_limit
        .as_deref()
        .map(|s| MemoryLimit::parse("--gpu-memory-limit", s))
        .transpose()?;
    let offload = args.offload || args.gpu_memory_limit.is_some();
    if offload && args.checkpoint_segments == Some(0) {
        bail!(
            "--offload (or --gpu-memory-limit) needs checkpointing: --checkpoint-segments must \
             be at least 1 (its default with --offload is one segment per layer)"
        );
    }
    if args.output.exists() && !args.output.is_dir() {
        bail!(
            "--output {}: exists and is not a directory",
            args.output.display()
        );
    }
    let (text, data_name) = read_text(args.data.as_deref())?;

    let device = candle_offload_suite::device(args.cpu, args.device)?;
    let gpu = !device.is_cpu();
    let precision = args
        .autocast
        .unwrap_or(if gpu { Precision::BF16 } else { Precision::F32 });
    if offload && limit.is_none() && gpu {
        limit = Some(MemoryLimit::FractionOfDevice(0.9));
    }

    // The model, resolved as `generate` resolves it.
    let files = args.model.resolve()?;
    if let (Ok(src), Ok(out)) = (
        std::fs::canonicalize(&files.origin),
        std::fs::canonicalize(&args.output),
    ) {
        if src == out {
            bail!(
                "--output {}: is the model's own directory; choose another",
                args.output.display()
            );
        }
    }
    let cfg = files.config.clone();
    if args.seq_len > cfg.max_position_embeddings {
        bail!(
            "--seq-len {} is longer than the model's context (max_position_embeddings {})",
            args.seq_len,
            cfg.max_position_embeddings
        );
    }
    if let Some(n) = args.checkpoint_segments {
        if n > cfg.num_hidden_layers {
            bail!(
                "--checkpoint-segments {n}: the model has {} layers; give at most one segment per \
                 layer",
                cfg.num_hidden_layers
            );
        }
    }
    let save_dtype = args
        .save_dtype
        .or_else(|| source_float_dtype(&files))
        .unwrap_or(DType::F16);

    // The data.
    let t0 = Instant::now();
    let tokenizer = loader::load_tokenizer(&files)?;
    let is_jsonl = args
        .data
        .as_deref()
        .and_then(Path::extension)
        .is_some_and(|e| e == "jsonl");
    let mut batches = if is_jsonl {
        let template = files.chat_template.clone().ok_or_else(|| {
            anyhow!(
                "--data {data_name}: chat data needs the model's chat template, and it has none"
            )
        })?;
        let template = candle_offload_models::ChatTemplate::new(
            template,
            files.special_tokens.bos.clone(),
            files.special_tokens.eos.clone(),
        );
        let examples = chat_examples(&text, &data_name, &template, &tokenizer, args.seq_len)?;
        let trained: usize = examples
            .iter()
            .map(|(_, t)| t.iter().filter(|&&x| x != IGNORE_TARGET).count())
            .sum();
        eprintln!(
            "data: {data_name}: {} conversations, {trained} trained tokens (the prompts' \
             masked), in {:.2} s",
            examples.len(),
            t0.elapsed().as_secs_f64()
        );
        Batches::chat(examples, args.seq_len, args.seed)
    } else {
        text_batches(&text, &data_name, &tokenizer, args.seq_len, args.seed, t0)?
    };

    // The trainer.
    let segments =
        args.checkpoint_segments
            .unwrap_or(if offload { cfg.num_hidden_layers } else { 0 });
    let settings = TrainSettings {
        precision,
        checkpoint_segments: segments,
        offload,
        gpu_memory_limit: limit,
        prefetch_depth: args.prefetch_depth,
        adamw: ParamsAdamW {
            lr: args.lr,
            weight_decay: args.weight_decay,
            ..Default::default()
        },
        batch_size: args.batch_size,
        seq_len: args.seq_len,
        head_chunks: None,
        loss_chunk_tokens: None,
        fused: !args.unfused,
        hand_backward: true,
        event_tracking: false,
        tuning: candle_offload_suite::tuning_env::tuning_from_env(Default::default())
            .fitted_to_host(),
    };
    let t0 = Instant::now();
    let mut trainer = if args.lora {
        lora_trainer(&args, &files, &device, &settings)?
    } else {
        Trainer::from_files(&files, &device, &settings)?
    };
    if let Some(dir) = &args.lora_resume {
        if trainer.load_optimizer(dir)? {
            eprintln!(
                "resumed AdamW's state from {}",
                dir.join(candle_offload_models::OPTIMIZER_FILE).display()
            );
        }
    }
    eprintln!(
        "trainer: {:.1} M parameters, autocast {precision}, {} checkpoint segments, {}, \
         built in {:.1} s",
        trainer.parameter_count() as f64 / 1e6,
        segments,
        if args.lora {
            "LoRA adapters on a frozen base"
        } else if offload {
            "masters offloaded to host memory"
        } else {
            "masters on the device"
        },
        t0.elapsed().as_secs_f64()
    );
    if let Some(rt) = trainer.runtime() {
        tracing::info!("{}", rt.memory_summary()?);
    }

    // Training.
    let baseline = if gpu {
        diag::device_used_bytes(&device)?
    } else {
        0
    };
    let sampler = if gpu {
        Some(PeakMemorySampler::start(&device, Duration::from_millis(5))?)
    } else {
        None
    };
    let pb = ProgressBar::new(args.steps as u64);
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:20} {pos}/{len} [{elapsed_precise}<{eta_precise}] {wide_msg}",
        )
        .map_err(|e| anyhow!("progress bar template: {e}"))?,
    );
    let log_every = (args.steps / 20).max(1);
    // MFU against the GPU's dense BF16 peak, where the table knows the GPU.
    let flops_per_token = match trainer.adapters() {
        Some(a) => cfg.lora_train_flops_per_token(args.seq_len, a.forward_flops_per_token() as f64),
        None => cfg.train_flops_per_token(args.seq_len),
    };
    let peak_flops = candle_offload_suite::dense_bf16_peak_flops(&device);
    let mut losses = Vec::with_capacity(args.steps);
    let (mut ema, mut tokens, mut streamed) = (0f32, 0usize, 0u64);
    let mut after_first = Duration::ZERO;
    let t_train = Instant::now();
    for step in 0..args.steps {
        let (inputs, targets) = batches.next(args.batch_size, &device)?;
        let t0 = Instant::now();
        if let Some(rt) = trainer.runtime() {
            rt.begin_step()?;
        }
        let report = trainer.step(&inputs, &targets)?;
        device.synchronize()?;
        if let Some(rt) = trainer.runtime() {
            rt.end_step()?;
            streamed += rt.stats()?.last_step.map_or(0, |s| s.bytes);
        }
        let dt = t0.elapsed();
        if step > 0 {
            after_first += dt;
        }
        tokens += report.tokens;
        ema = if step == 0 {
            report.loss
        } else {
            0.9 * ema + 0.1 * report.loss
        };
        losses.push(report.loss);
        let mut msg = format!(
            "loss {:.4} (ema {ema:.4}) | {:.0} tok/s",
            report.loss,
            report.tokens as f64 / dt.as_secs_f64()
        );
        let tokens_now = report.tokens as f64;
        if let Some(m) =
            candle_offload_suite::mfu(flops_per_token, tokens_now, dt.as_secs_f64(), peak_flops)
        {
            msg += &format!(" | MFU {:.1}%", 100.0 * m);
        }
        if gpu {
            msg += &format!(" | mem {:.2} GiB", gib(diag::device_used_bytes(&device)?));
        }
        if precision.needs_loss_scaling() {
            msg += &format!(" | scale {}", trainer.scaler().scale());
        }
        if !report.outcome.applied() {
            msg += " | skipped";
        }
        tracing::info!(step = step + 1, "{msg}");
        pb.set_message(msg.clone());
        pb.inc(1);
        if pb.is_hidden() && ((step + 1) % log_every == 0 || step + 1 == args.steps) {
            eprintln!("step {}/{}: {msg}", step + 1, args.steps);
        }
    }
    pb.finish_and_clear();
    let train_s = t_train.elapsed().as_secs_f64();
    let peak = sampler.map(|s| s.stop().saturating_sub(baseline));

    // Saving.
    let t0 = Instant::now();
    std::fs::create_dir_all(&args.output)
        .map_err(|e| anyhow!("--output {}: cannot create: {e}", args.output.display()))?;
    let written = if args.lora {
        trainer.save_adapter(&args.output)?;
        "adapter"
    } else {
        save(&args.output, &trainer, &files, &tokenizer, save_dtype)?
    };
    let save_s = t0.elapsed().as_secs_f64();

    // Summary.
    let n = losses.len();
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let smoothed = if n >= 10 {
        format!(
            " (mean of the first/last 5: {:.4} -> {:.4})",
            mean(&losses[..5]),
            mean(&losses[n - 5..])
        )
    } else {
        String::new()
    };
    println!(
        "trained {n} steps of {} x {} tokens in {train_s:.1} s: loss {:.4} -> {:.4}{smoothed}",
        args.batch_size,
        args.seq_len,
        losses[0],
        losses[n - 1],
    );
    let steady = if n > 1 {
        format!(
            "; {:.1} tokens/s after the first step",
            ((n - 1) * args.batch_size * args.seq_len) as f64 / after_first.as_secs_f64()
        )
    } else {
        String::new()
    };
    println!(
        "throughput: {:.1} tokens/s{steady}; steps skipped by the loss scaler: {}; segments \
         recomputed: {}",
        tokens as f64 / train_s,
        trainer.scaler().skipped_steps(),
        trainer.recomputed_segments()
    );
    if let Some(p) = peak {
        println!("peak device memory while training: {:.2} GiB", gib(p));
    }
    if offload {
        println!(
            "streamed to the device: {:.2} GB per step",
            streamed as f64 / n as f64 / 1e9
        );
    }
    if args.lora {
        println!(
            "saved the LoRA adapter to {} in {save_s:.1} s; try: cargo run --release --example \
             generate -- --model {} --lora {}",
            args.output.display(),
            files.origin,
            args.output.display()
        );
    } else {
        println!(
            "saved {} ({} weights: {written}) in {save_s:.1} s; try: cargo run --release \
             --example generate -- --model {}",
            args.output.display(),
            dtype_name(save_dtype),
            args.output.display()
        );
    }
    if let Some(path) = &args.losses_json {
        let record = serde_json::json!({
            "model": files.origin,
            "fused": !args.unfused,
            "precision": precision.to_string(),
            "checkpoint_segments": segments,
            "offload": offload,
            "lora": args.lora.then(|| serde_json::json!({
                "rank": args.lora_rank,
                "alpha": args.lora_alpha,
                "targets": trainer.adapters().map(|a| a.config().target_modules.clone()),
                "quantize": args.quantize,
                "parameters": trainer.parameter_count(),
            })),
            "steps": n,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "seed": args.seed,
            "train_s": train_s,
            "tokens_per_s": tokens as f64 / train_s,
            "model_flops_per_token": flops_per_token,
            "mfu": candle_offload_suite::mfu(flops_per_token, tokens as f64, train_s, peak_flops),
            "losses": losses,
        });
        candle_offload_suite::write_results(
            path,
            "finetune",
            &device,
            serde_json::json!([record]),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
