//! A prompt's quantized projections on a GPU, piece by piece: for LLaMA 7B and 13B projection
//! shapes, GGML block types and prompt lengths, the time of
//! - `dequant`: `gemm::dequantize_rows` over the whole weight, and the bytes a second it writes;
//! - `gemm`: x (F16) times the weight already in F16 (cuBLAS), the GEMM alone;
//! - `prefill`: `gemm::qlinear_prefill` (slices dequantized, each multiplied into its columns);
//! - `mmq`: Candle's quantized matmul on F32 x (its MMQ kernels), what takes the rows below
//!   `KernelTuning::prefill_gemm_min_rows`.
//!
//! Each is the median of `--reps` runs between device synchronizations, with the GPU set up as a
//! model runs it: cudarc's per-buffer event tracking off and freed memory kept in the stream's
//! pool across synchronizations (`--event-tracking` keeps the tracking, which times
//! `qlinear_prefill` 0.05-0.1 ms a call slower than its dequantization plus GEMM). Per model,
//! type and rows it also sums one pass over every layer's projections (q, k, v, o, gate, up,
//! down), the part of a prompt pass these ops are.
//!
//! Run with: `cargo bench -p candle-offload-bench --features cuda --bench prefill_gemm --
//! --json-out prefill.json`.
//! It needs a GPU.

use std::path::PathBuf;

use anyhow::{ensure, Result};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_offload::kernels::gemm;
use candle_offload_bench::{ggml_type, time_synced as time};
use clap::Parser;

/// Times dequantization, GEMM and Candle's MMQ for a prompt's quantized projections.
#[derive(Parser, Debug)]
struct Args {
    /// Models whose projection shapes to time: 7b, 13b (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "7b,13b")]
    models: Vec<String>,
    /// GGML block types (comma-separated): q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q6_k.
    #[arg(long, value_delimiter = ',', default_value = "q4_0,q8_0,q4_k,q6_k")]
    types: Vec<String>,
    /// Prompt rows (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "64,128,171,256,512")]
    rows: Vec<usize>,
    /// Timed runs of each op (the median is kept), after two untimed.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Keep cudarc's per-buffer event tracking on (the models run with it off).
    #[arg(long)]
    event_tracking: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

/// (hidden, intermediate, layers) of a model name.
fn model_shape(name: &str) -> Result<(usize, usize, usize)> {
    Ok(match name {
        "7b" => (4096, 11008, 32),
        "13b" => (5120, 13824, 40),
        _ => anyhow::bail!("--models: unknown model {name:?} (7b, 13b)"),
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.reps > 0, "--reps must be at least 1");
    let device = Device::new_cuda(args.gpu)
        .map_err(|e| anyhow::anyhow!("prefill_gemm needs a GPU (a build with cuda): {e}"))?;
    // One stream, no offload runtime: tracking may go (train::set_event_tracking's contract).
    candle_offload::train::set_event_tracking(&device, args.event_tracking)?;
    candle_offload::diag::keep_pool_memory(&device, true)?;
    let types = args
        .types
        .iter()
        .map(|t| ggml_type(t))
        .collect::<Result<Vec<_>>>()?;
    let mut records = Vec::new();
    for model in &args.models {
        let (h, i, layers) = model_shape(model)?;
        // (n, k, projections of this shape a layer): q, k, v, o; gate, up; down.
        let shapes = [(h, h, 4usize), (i, h, 2), (h, i, 1)];
        for &qtype in &types {
            // Seconds of one layer's projections, per op and rows.
            let mut layer = vec![[0f64; 4]; args.rows.len()];
            for &(n, k, count) in &shapes {
                let w = Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu)?;
                let w = QTensor::quantize_onto(&w, qtype, &device)?;
                let out_bytes = (2 * n * k) as f64;
                let dq = time(&device, args.reps, || {
                    Ok(gemm::dequantize_rows(&w, 0, n, DType::F16)?)
                })?;
                let wf = gemm::dequantize_rows(&w, 0, n, DType::F16)?;
                let qmm = QMatMul::from_arc(std::sync::Arc::new(w))?;
                let QMatMul::QTensor(wq) = &qmm else {
                    anyhow::bail!("{qtype:?} {n}x{k}: Candle keeps it dequantized")
                };
                for (r, &rows) in args.rows.iter().enumerate() {
                    let x =
                        Tensor::randn(0f32, 1.0, (rows, k), &Device::Cpu)?.to_device(&device)?;
                    let xh = x.to_dtype(DType::F16)?;
                    let gemm = time(&device, args.reps, || Ok(xh.matmul(&wf.t()?)?))?;
                    let t = candle_offload::KernelTuning::default();
                    let prefill = gemm::qlinear_prefill(&xh, wq, &t)?
                        .is_some()
                        .then(|| {
                            time(&device, args.reps, || {
                                Ok(gemm::qlinear_prefill(&xh, wq, &t)?)
                            })
                        })
                        .transpose()?;
                    let mmq = time(&device, args.reps, || Ok(qmm.forward(&x)?))?;
                    let row = [dq, gemm, prefill.unwrap_or(f64::NAN), mmq];
                    for (acc, s) in layer[r].iter_mut().zip(row) {
                        *acc += count as f64 * s;
                    }
                    println!(
                        "{model} {qtype:?} {n}x{k} rows {rows}: dequant {:.3} ms ({:.0} GB/s), \
                         gemm {:.3}, prefill {:.3}, mmq {:.3}",
                        dq * 1e3,
                        out_bytes / dq / 1e9,
                        gemm * 1e3,
                        row[2] * 1e3,
                        mmq * 1e3
                    );
                    records.push(serde_json::json!({
                        "model": model, "type": format!("{qtype:?}"), "n": n, "k": k,
                        "rows": rows, "dequant_s": dq, "dequant_out_gbps": out_bytes / dq / 1e9,
                        "gemm_s": gemm, "prefill_s": prefill, "mmq_s": mmq,
                    }));
                }
            }
            for (r, &rows) in args.rows.iter().enumerate() {
                let pass = layer[r].map(|s| s * layers as f64);
                println!(
                    "{model} {qtype:?} rows {rows}, a pass of {layers} layers: dequant {:.1} ms, \
                     gemm {:.1}, prefill {:.1}, mmq {:.1}",
                    pass[0] * 1e3,
                    pass[1] * 1e3,
                    pass[2] * 1e3,
                    pass[3] * 1e3
                );
                records.push(serde_json::json!({
                    "model": model, "type": format!("{qtype:?}"), "rows": rows,
                    "pass_layers": layers, "pass_dequant_s": pass[0], "pass_gemm_s": pass[1],
                    "pass_prefill_s": pass[2], "pass_mmq_s": pass[3],
                }));
            }
        }
    }
    if let Some(path) = &args.json_out {
        candle_offload_suite::write_results(
            path,
            "prefill_gemm",
            &device,
            serde_json::Value::Array(records),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
