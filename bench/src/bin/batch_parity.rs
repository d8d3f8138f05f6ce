//! Greedy tokens of requests run alone against the same requests in one continuous batch
//! ([`Batcher`]), on one device: how many tokens agree, where they first differ, and there the
//! logit margin of the request's own run between its token and the batch's (top-1 minus the
//! batch's choice): the check of batched serving on a GPU, whose batched kernels differ from a
//! single sequence's, so that a difference is either a near-tie or a fault.
//!
//! Run with: `cargo run --release --features cuda -p candle-offload-bench --bin batch_parity --
//! --model M.gguf --requests 8 --new-tokens 32 --json-out parity.json` (the prompts are seeded
//! random token ids, as the random GGUFs' placeholder vocabularies need; end tokens ignored).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use candle_offload_models::batching::{
    BatchOptions, Batcher, SamplingParams, SeqEvent, SeqRequest,
};
use candle_offload_models::Llama;
use candle_offload_suite::load::{pin_cpu_thread_count, LoadArgs};
use clap::Parser;

/// Compares requests' greedy tokens alone and in one batch.
#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    load: LoadArgs,
    /// Requests, all in the batch at once.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Greedy tokens per request.
    #[arg(long, default_value_t = 32)]
    new_tokens: usize,
    /// Prompt lengths, drawn uniformly from this range (token ids).
    #[arg(long, default_value_t = 64)]
    min_prompt: usize,
    #[arg(long, default_value_t = 512)]
    max_prompt: usize,
    /// Token ids drawn from [100, id_high) (default: the vocabulary).
    #[arg(long)]
    id_high: Option<u32>,
    /// The prompts' seed.
    #[arg(long, default_value_t = 57)]
    seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn main() -> Result<()> {
    pin_cpu_thread_count();
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    if args.requests == 0 || args.new_tokens == 0 || args.min_prompt == 0 {
        bail!("--requests, --new-tokens and --min-prompt must be at least 1");
    }
    if args.min_prompt > args.max_prompt {
        bail!(
            "--min-prompt {} is above --max-prompt {}",
            args.min_prompt,
            args.max_prompt
        );
    }
    let device = candle_offload_suite::device(args.load.cpu, args.load.device)?;
    let plan = args.load.memory(std::slice::from_ref(&device))?;
    let files = args.load.model.resolve()?;
    let cfg = files.config.clone();
    let dtype = args.load.dtype_on(&device);
    let ctx = args.max_prompt + args.new_tokens;
    let kv_bytes = cfg.kv_cache_bytes(ctx, dtype) * args.requests as u64;
    // As `serve` builds it; its whole head is what the margins read.
    let model = Arc::new(
        args.load
            .build_batched(&files, &plan, &device, ctx, kv_bytes, None)?,
    );
    let high = args.id_high.unwrap_or(cfg.vocab_size as u32).max(101);
    let prompts = prompts(&args, high);
    let request = |p: &Vec<u32>| SeqRequest {
        prompt: p.clone(),
        max_new_tokens: args.new_tokens,
        sampling: SamplingParams::default(),
        end_tokens: Vec::new(),
    };
    let opts = |running| BatchOptions::new(&model, running, ctx);
    // Alone: one request at a time through a batcher, as a server with one request runs it.
    let mut alone = Vec::with_capacity(prompts.len());
    for p in &prompts {
        let mut b = Batcher::new(model.clone(), opts(1));
        alone.push(drain(&mut b, &[request(p)])?.remove(0));
    }
    let mut b = Batcher::new(model.clone(), opts(args.requests));
    let reqs: Vec<SeqRequest> = prompts.iter().map(request).collect();
    let batched = drain(&mut b, &reqs)?;
    let mut rows = Vec::new();
    let mut agreeing = 0;
    for (i, p) in prompts.iter().enumerate() {
        let (a, t) = (&alone[i], &batched[i]);
        let first = a.iter().zip(t).position(|(x, y)| x != y);
        let margin = match first {
            Some(k) => Some(margin_at(&model, &device, p, &a[..k], a[k], t[k])?),
            None => {
                agreeing += 1;
                None
            }
        };
        println!(
            "request {i}: prompt {}, {} tokens agree{}",
            p.len(),
            first.unwrap_or(a.len()),
            match (first, margin) {
                (Some(k), Some((m, top))) => format!(
                    ", then alone {} against {} (margin {m:.4} of a top logit {top:.2})",
                    a[k], t[k]
                ),
                _ => String::new(),
            }
        );
        rows.push(serde_json::json!({
            "prompt_len": p.len(),
            "agreeing_tokens": first.unwrap_or(a.len()),
            "first_difference": first,
            "alone": a,
            "batched": t,
            "margin": margin.map(|(m, _)| m),
            "top_logit": margin.map(|(_, t)| t),
        }));
    }
    println!(
        "{agreeing} of {} requests agree over all {} tokens",
        prompts.len(),
        args.new_tokens
    );
    if let Some(path) = &args.json_out {
        candle_offload_suite::write_results(
            path,
            "batch_parity",
            &device,
            serde_json::json!({
                "dtype": format!("{dtype:?}"),
                "new_tokens": args.new_tokens,
                "requests": rows,
                "agreeing_requests": agreeing,
                "definitions": {
                    "margin": "at the first difference, the request's own (alone) logits: its \
                               token's logit minus the batch's token's, from one pass over the \
                               prompt and a decode step per token that agreed (as the alone run \
                               computed them: negative only where that run's own logits are not \
                               reproduced)",
                },
            }),
        )?;
    }
    Ok(())
}

/// The seeded prompts: lengths uniform in the range, ids uniform in [100, high).
fn prompts(args: &Args, high: u32) -> Vec<Vec<u32>> {
    let mut s = args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let span = (args.max_prompt - args.min_prompt + 1) as u64;
    (0..args.requests)
        .map(|_| {
            let n = args.min_prompt + (next() % span) as usize;
            (0..n)
                .map(|_| 100 + (next() % (high as u64 - 100)) as u32)
                .collect()
        })
        .collect()
}

/// Every request's tokens, in the order given, after running them to the end.
fn drain(b: &mut Batcher, reqs: &[SeqRequest]) -> Result<Vec<Vec<u32>>> {
    for (id, r) in reqs.iter().enumerate() {
        if let Err(e) = b.submit(id as u64, r.clone()) {
            bail!("request {id}: {e}");
        }
    }
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    while !b.is_idle() {
        for (id, e) in b.step()? {
            if let SeqEvent::Token(t) = e {
                got.entry(id).or_default().push(t);
            }
        }
    }
    Ok((0..reqs.len() as u64)
        .map(|id| got.remove(&id).unwrap_or_default())
        .collect())
}

/// The margin between `ours` and `theirs` in the logits after `prompt` and `agreed`, run alone
/// as the alone run ran them (one pass over the prompt, then one decode step per agreed
/// token, so that the same kernels compute them), and the top logit there.
fn margin_at(
    model: &Llama,
    device: &candle_core::Device,
    prompt: &[u32],
    agreed: &[u32],
    ours: u32,
    theirs: u32,
) -> Result<(f32, f32)> {
    let mut cache = model.new_cache();
    let x = Tensor::new(prompt, device)?.unsqueeze(0)?;
    let mut logits = model.forward(&x, 0, &mut cache)?;
    for (i, &t) in agreed.iter().enumerate() {
        let x = Tensor::new(&[t], device)?.unsqueeze(0)?;
        logits = model.forward(&x, prompt.len() + i, &mut cache)?;
    }
    let logits = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    Ok((logits[ours as usize] - logits[theirs as usize], top))
}
