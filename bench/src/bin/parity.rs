//! Logit parity of our model families (LLaMA, Qwen3, Phi-3, Gemma 1/2/3: whichever `config.json` names)
//! with HF transformers on random-weight checkpoints that `scripts/hf_reference.py` writes:
//! relative L2 error of the logits of every position (F32, F16, BF16), and 32 greedy tokens (F32,
//! with our KV cache), run through the offload runtime with a budget that holds only part of the
//! model.
//!
//! F32 must be within 1e-4. F16 and BF16 are compared with transformers' F32 logits too, and
//! must be within 2e-2 or within 1.25 times the distance of transformers' own run in that dtype
//! (a random-weight model can amplify half-precision rounding past 2e-2 in both).
//!
//! Run with: `python3 scripts/hf_reference.py refs && cargo run --release --features cuda
//! -p candle-offload-bench --bin parity -- refs/* --json-out parity.json`

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use candle_offload::{MemoryLimit, OffloadConfig, OffloadRuntime, PolicyChoice};
use candle_offload_models::generation::generate;
use candle_offload_models::{loader, Llama};
use candle_transformers::generation::LogitsProcessor;
use clap::Parser;

/// Compares our logits and greedy tokens with transformers' on reference checkpoints.
#[derive(Parser, Debug)]
struct Args {
    /// Directories written by scripts/hf_reference.py.
    dirs: Vec<PathBuf>,
    /// Run on the CPU.
    #[arg(long)]
    cpu: bool,
    /// Share of the weights the budget holds (the rest is streamed).
    #[arg(long, default_value_t = 0.5)]
    budget_share: f64,
    /// Write the results as JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// More logging (-v, -vv).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[derive(serde::Deserialize)]
struct Reference {
    input_ids: Vec<u32>,
    logits_f32: Vec<Vec<f32>>,
    logits_f16: Vec<Vec<f32>>,
    logits_bf16: Vec<Vec<f32>>,
    greedy_f32: Vec<u32>,
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn main() -> Result<()> {
    let args = Args::parse();
    candle_offload_suite::init_tracing(args.verbose);
    let device = candle_offload_suite::device(args.cpu, 0)?;
    let mut records = Vec::new();
    let mut all_ok = true;
    for dir in &args.dirs {
        let reference: Reference = serde_json::from_str(
            &std::fs::read_to_string(dir.join("reference.json"))
                .with_context(|| format!("{}", dir.display()))?,
        )?;
        let files = loader::from_dir(dir)?;
        let cfg = files.config.clone();
        let ids = Tensor::new(reference.input_ids.as_slice(), &device)?.unsqueeze(0)?;
        let max_len = reference.input_ids.len() + reference.greedy_f32.len();
        for (dtype, expected, tol) in [
            (DType::F32, &reference.logits_f32, 1e-4),
            (DType::F16, &reference.logits_f32, 2e-2),
            (DType::BF16, &reference.logits_f32, 2e-2),
        ] {
            let store = Arc::new(loader::load_store(&files, dtype, &device, None)?);
            let budget = (store.total_bytes() as f64 * args.budget_share) as u64;
            let reserve = cfg.reserve_bytes(reference.input_ids.len(), max_len, dtype);
            let rt = OffloadRuntime::new(
                store.clone(),
                &device,
                &OffloadConfig {
                    gpu_memory_limit: Some(MemoryLimit::Bytes(budget + reserve)),
                    reserve_bytes: reserve,
                    policy: PolicyChoice::Schedule(Llama::schedule(&store, &cfg)),
                    prefetch_depth: 1,
                    ..Default::default()
                },
            )?;
            let model = Llama::builder(cfg.clone(), rt.store().clone())
                .runtime(rt.clone())
                .dtype(dtype)
                .max_len(max_len)
                .source_path(files.weights_path())
                .build()?;
            let logits = model.forward_all(&ids)?.squeeze(0)?.to_vec2::<f32>()?;
            let ours: Vec<f32> = logits.concat();
            let theirs: Vec<f32> = expected.concat();
            let err = rel_l2(&ours, &theirs);
            let same_dtype_ref = match dtype {
                DType::F16 => Some(&reference.logits_f16),
                DType::BF16 => Some(&reference.logits_bf16),
                _ => None,
            };
            let err_vs_same_dtype = same_dtype_ref.map(|r| rel_l2(&ours, &r.concat()));
            // How far transformers itself lands from its F32 logits in this dtype.
            let transformers_own_err = same_dtype_ref.map(|r| rel_l2(&r.concat(), &theirs));
            let tol = transformers_own_err.map_or(tol, |own| f64::max(tol, 1.25 * own));
            let greedy = if dtype == DType::F32 {
                let mut sampler = LogitsProcessor::new(0, None, None);
                let (tokens, _) = generate(
                    &model,
                    &reference.input_ids,
                    reference.greedy_f32.len(),
                    &mut sampler,
                    &[],
                    |_| Ok(()),
                )?;
                Some(tokens)
            } else {
                None
            };
            let greedy_match = greedy.as_ref().map(|g| *g == reference.greedy_f32);
            let ok = err <= tol && greedy_match.unwrap_or(true);
            all_ok &= ok;
            let stats = rt.stats()?;
            println!(
                "{:<12} {:?}: rel L2 {err:.2e} (tolerance {tol:.1e}){}{} — {} fetches, {}",
                dir.file_name().unwrap_or_default().to_string_lossy(),
                dtype,
                err_vs_same_dtype.map_or(String::new(), |e| format!(
                    ", vs transformers in the same dtype {e:.2e}"
                )),
                greedy_match.map_or(String::new(), |m| format!(
                    ", greedy 32 tokens {}",
                    if m { "identical" } else { "DIFFER" }
                )),
                stats.total.fetches,
                if ok { "ok" } else { "FAIL" }
            );
            records.push(serde_json::json!({
                "model": dir.file_name().unwrap_or_default().to_string_lossy(),
                "dtype": format!("{dtype:?}"),
                "rel_l2_vs_transformers_f32": err,
                "rel_l2_vs_transformers_same_dtype": err_vs_same_dtype,
                "transformers_same_dtype_rel_l2_vs_its_f32": transformers_own_err,
                "tolerance": tol,
                "greedy_tokens_identical": greedy_match,
                "ours_greedy": greedy,
                "transformers_greedy": (dtype == DType::F32).then_some(&reference.greedy_f32),
                "budget_share": args.budget_share,
                "fetches": stats.total.fetches,
                "ok": ok,
            }));
        }
    }
    if let Some(path) = &args.json_out {
        candle_offload_suite::write_results(
            path,
            "parity",
            &device,
            serde_json::Value::Array(records),
        )?;
    }
    anyhow::ensure!(all_ok, "parity check failed");
    Ok(())
}
