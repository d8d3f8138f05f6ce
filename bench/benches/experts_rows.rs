//! A prompt's mixture-of-experts layer on a GPU, the experts' part: for the Qwen3-30B-A3B
//! layer shape (hidden 2048, expert FFN 768, 128 experts, top 8) and a prompt of `--tokens`
//! rows routed uniformly or by a Zipf law (exponent 1, as `scripts/gguf_random_moe.py`'s
//! skewed router), the time of
//! - `qexperts_rows` (every expert's rows through the grouped kernels, x quantized by every
//!   block of threads or once: `--x-once`), with the experts of at least
//!   `--gemm-min-rows` rows through 16-bit weights and cuBLAS instead (0: none);
//! - the outputs summed back into their rows: `index_add` (what the layer did before) against
//!   `combine_rows`.
//!
//! Each is the median of `--reps` runs between device synchronizations.
//!
//! Run with: `cargo bench -p candle-offload-bench --features cuda --bench experts_rows --
//! --json-out experts.json`. It needs a GPU.

use std::path::PathBuf;

use anyhow::{ensure, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_offload::kernels::linear::{self, QExpertRows};
use candle_offload::KernelTuning;
use candle_offload_bench::time_synced as time;
use clap::Parser;
use rand::Rng as _;

/// Times a prompt's experts on a GPU by routing, kernel and cuBLAS threshold.
#[derive(Parser, Debug)]
struct Args {
    /// Weights: q4_k_m (gate and up Q4_K, down Q6_K) and/or q8_0 (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "q4_k_m,q8_0")]
    weights: Vec<String>,
    /// Routings (comma-separated): uniform, skewed.
    #[arg(long, value_delimiter = ',', default_value = "uniform,skewed")]
    routings: Vec<String>,
    /// Prompt rows.
    #[arg(long, default_value_t = 512)]
    tokens: usize,
    /// `kernels.experts_gemm_min_rows` values to time (comma-separated; 0: no expert through
    /// cuBLAS).
    #[arg(long, value_delimiter = ',', default_value = "0,16,32,64,128")]
    gemm_min_rows: Vec<usize>,
    /// `kernels.experts_rows_x_once` values to time (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "false,true")]
    x_once: Vec<bool>,
    /// Timed runs of each op (the median is kept), after two untimed.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

const HIDDEN: usize = 2048;
const INTER: usize = 768;
const EXPERTS: usize = 128;
const TOP_K: usize = 8;

/// Each token's `TOP_K` distinct experts: uniformly, or by a Zipf law of exponent 1 over a
/// fixed random order of the experts.
fn route(tokens: usize, skewed: bool, seed: u64) -> Vec<Vec<usize>> {
    let mut rng = candle_offload_suite::rng(seed);
    let mut order: Vec<usize> = (0..EXPERTS).collect();
    for i in (1..EXPERTS).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let prior: Vec<f64> = (1..=EXPERTS)
        .map(|r| if skewed { 1.0 / r as f64 } else { 1.0 })
        .collect();
    (0..tokens)
        .map(|_| {
            let mut w = prior.clone();
            let mut picked = Vec::with_capacity(TOP_K);
            for _ in 0..TOP_K {
                let total: f64 = w.iter().sum();
                let mut u = rng.random_range(0.0..total);
                let mut r = 0;
                while r + 1 < EXPERTS && u >= w[r] {
                    u -= w[r];
                    r += 1;
                }
                w[r] = 0.0;
                picked.push(order[r]);
            }
            picked
        })
        .collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.reps > 0 && args.tokens > 0,
        "--reps and --tokens: at least 1"
    );
    let device = Device::new_cuda(args.gpu)
        .map_err(|e| anyhow::anyhow!("experts_rows needs a GPU (a build with cuda): {e}"))?;
    candle_offload::train::set_event_tracking(&device, false)?;
    candle_offload::diag::keep_pool_memory(&device, true)?;
    let mut records = Vec::new();
    for weights in &args.weights {
        let (gt, dt) = match weights.as_str() {
            "q4_k_m" => (GgmlDType::Q4K, GgmlDType::Q6K),
            "q8_0" => (GgmlDType::Q8_0, GgmlDType::Q8_0),
            w => anyhow::bail!("--weights: {w:?} is not q4_k_m or q8_0"),
        };
        let q = |n: usize, k: usize, t: GgmlDType| -> Result<QTensor> {
            let w = Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu)?;
            Ok(QTensor::quantize_onto(&w, t, &device)?)
        };
        let experts: Vec<[QTensor; 3]> = (0..EXPERTS)
            .map(|_| {
                Ok([
                    q(INTER, HIDDEN, gt)?,
                    q(INTER, HIDDEN, gt)?,
                    q(HIDDEN, INTER, dt)?,
                ])
            })
            .collect::<Result<_>>()?;
        for routing in &args.routings {
            let skewed = match routing.as_str() {
                "uniform" => false,
                "skewed" => true,
                r => anyhow::bail!("--routings: {r:?} is not uniform or skewed"),
            };
            let routes = route(args.tokens, skewed, 7);
            // Rows sorted by expert, as the layer sorts them, with each copy's weight.
            let mut by_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); EXPERTS];
            for (t, r) in routes.iter().enumerate() {
                for &e in r {
                    by_expert[e].push((t as u32, 1.0 / TOP_K as f32));
                }
            }
            let used: Vec<usize> = (0..EXPERTS).filter(|&e| !by_expert[e].is_empty()).collect();
            let rows_of: Vec<usize> = used.iter().map(|&e| by_expert[e].len()).collect();
            let mut sorted = rows_of.clone();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            println!(
                "{weights} {routing}: {} experts used, rows per expert max {} median {} min {}",
                used.len(),
                sorted[0],
                sorted[sorted.len() / 2],
                sorted[sorted.len() - 1]
            );
            let ids: Vec<u32> = used
                .iter()
                .flat_map(|&e| by_expert[e].iter().map(|p| p.0))
                .collect();
            let ws: Vec<f32> = used
                .iter()
                .flat_map(|&e| by_expert[e].iter().map(|p| p.1))
                .collect();
            let copies = ids.len();
            let x = Tensor::randn(0f32, 1.0, (args.tokens, HIDDEN), &Device::Cpu)?
                .to_dtype(DType::F16)?
                .to_device(&device)?;
            let ids_t = Tensor::from_vec(ids.clone(), copies, &device)?;
            let ws_t = Tensor::from_vec(ws.clone(), (copies, 1), &device)?.to_dtype(DType::F16)?;
            let xs = x.index_select(&ids_t, 0)?;
            let rows: Vec<QExpertRows<'_>> = used
                .iter()
                .zip(&rows_of)
                .map(|(&e, &rows)| QExpertRows {
                    gate: &experts[e][0],
                    up: &experts[e][1],
                    down: &experts[e][2],
                    rows,
                })
                .collect();
            for &x_once in &args.x_once {
                for &min in &args.gemm_min_rows {
                    let mut t = KernelTuning::default();
                    t.experts_rows_x_once = x_once;
                    t.experts_gemm_min_rows = min;
                    let gemm = rows
                        .iter()
                        .filter(|e| linear::qexperts_rows_gemm_takes(e, &t))
                        .count();
                    let s = time(&device, args.reps, || {
                        Ok(linear::qexperts_rows(&xs, &rows, &t)?)
                    })?;
                    println!(
                        "  experts x_once {x_once} gemm_min_rows {min} ({gemm} experts through \
                         cuBLAS): {:.3} ms",
                        s * 1e3
                    );
                    records.push(serde_json::json!({
                        "weights": weights, "routing": routing, "tokens": args.tokens,
                        "op": "qexperts_rows", "x_once": x_once, "gemm_min_rows": min,
                        "experts_through_gemm": gemm, "experts_used": used.len(),
                        "max_rows": sorted[0], "s": s,
                    }));
                }
            }
            // The outputs back into their rows.
            let y = xs.clone();
            let old = time(&device, args.reps, || {
                let yw = y.broadcast_mul(&ws_t)?;
                Ok(x.zeros_like()?.index_add(&ids_t, &yw, 0)?)
            })?;
            let mut count = vec![0usize; args.tokens];
            let mut slots = vec![linear::NO_SLOT; args.tokens * TOP_K];
            let mut wt = vec![0f32; args.tokens * TOP_K];
            for (p, (&t, &w)) in ids.iter().zip(&ws).enumerate() {
                let t = t as usize;
                slots[t * TOP_K + count[t]] = p as u32;
                wt[t * TOP_K + count[t]] = w;
                count[t] += 1;
            }
            let new = time(&device, args.reps, || {
                Ok(linear::combine_rows(&y, &slots, &wt, TOP_K)?)
            })?;
            println!(
                "  back into rows: index_add {:.3} ms, combine_rows {:.3} ms",
                old * 1e3,
                new * 1e3
            );
            records.push(serde_json::json!({
                "weights": weights, "routing": routing, "tokens": args.tokens,
                "op": "combine", "index_add_s": old, "combine_rows_s": new,
            }));
        }
    }
    if let Some(path) = &args.json_out {
        candle_offload_suite::write_results(
            path,
            "experts_rows",
            &device,
            serde_json::Value::Array(records),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
