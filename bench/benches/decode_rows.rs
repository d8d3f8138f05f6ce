//! A decode step's quantized projections on a GPU by the number of rows (sequences in a
//! batched step): for the Llama-3-8B projection shapes (q/k/v in one launch, o, gate and up
//! with SwiGLU in one launch, down), GGML block types and rows, the time of
//! - each GPU decode-kernel variant given by `--variants` (`v3`: x quantized by every block of
//!   threads; `v4`: x quantized once by a launch before; `v2`: floats), through
//!   `linear::qlinear_small_multi`, `qlinear_small` and `qlinear_silu_mul`, what a model runs;
//! - `mmvq`: Candle's quantized matmul on F32 x (its MMVQ kernels up to 8 rows), what
//!   `KernelTuning::qlinear_small_rows` sends the rows above it to.
//!
//! Each is the median of `--reps` runs between device synchronizations, with the GPU set up as a
//! model runs it (cudarc's per-buffer event tracking off, freed memory kept in the stream's
//! pool). Per type and rows it also sums a pass over every layer's projections, and gives the
//! time of r rows over one row's: the serving batcher's step cost by its sequences.
//!
//! Run with: `cargo bench -p candle-offload-bench --features cuda --bench decode_rows --
//! --json-out rows.json`. It needs a GPU.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{ensure, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_offload::kernels::linear;
use candle_offload::kernels::tuning::{QlinearVariant, QlinearVariants};
use candle_offload::KernelTuning;
use candle_offload_bench::{ggml_type, time_synced as time};
use clap::Parser;

/// Times the GPU decode kernels of quantized projections by the rows of x.
#[derive(Parser, Debug)]
struct Args {
    /// GGML block types (comma-separated): q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q6_k.
    #[arg(long, value_delimiter = ',', default_value = "q4_k,q6_k")]
    types: Vec<String>,
    /// Rows of x (comma-separated, 1 to 8).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,6,8")]
    rows: Vec<usize>,
    /// The library's kernel variants to time (comma-separated): v1, v2, v2r2, v2r4, v3, v4.
    #[arg(long, value_delimiter = ',', default_value = "v3,v4")]
    variants: Vec<String>,
    /// Timed runs of each op (the median is kept), after two untimed.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// x's dtype on the GPU: f16, bf16 or f32.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

/// One layer's projection weights of a type (Llama-3-8B: hidden 4096, 8 key/value heads of 128,
/// intermediate 14336).
struct Layer {
    q: Arc<QTensor>,
    k: Arc<QTensor>,
    v: Arc<QTensor>,
    o: Arc<QTensor>,
    gate: Arc<QTensor>,
    up: Arc<QTensor>,
    down: Arc<QTensor>,
}

impl Layer {
    const HIDDEN: usize = 4096;
    const KV: usize = 1024;
    const INTERMEDIATE: usize = 14336;
    const LAYERS: usize = 32;

    fn new(t: GgmlDType, device: &Device) -> Result<Self> {
        let w = |n: usize, k: usize| -> Result<Arc<QTensor>> {
            let w = Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu)?;
            Ok(Arc::new(QTensor::quantize_onto(&w, t, device)?))
        };
        let (h, kv, i) = (Self::HIDDEN, Self::KV, Self::INTERMEDIATE);
        Ok(Self {
            q: w(h, h)?,
            k: w(kv, h)?,
            v: w(kv, h)?,
            o: w(h, h)?,
            gate: w(i, h)?,
            up: w(i, h)?,
            down: w(h, i)?,
        })
    }

    /// The seconds of (q/k/v, o, gate-up, down) through the library's kernels under `tuning`.
    fn library(
        &self,
        device: &Device,
        reps: usize,
        x: &Tensor,
        xi: &Tensor,
        tuning: &KernelTuning,
    ) -> Result<[f64; 4]> {
        let qkv = time(device, reps, || {
            Ok(linear::qlinear_small_multi(
                x,
                &[&*self.q, &*self.k, &*self.v],
                tuning,
            )?)
        })?;
        let o = time(device, reps, || {
            Ok(linear::qlinear_small(x, &self.o, tuning)?)
        })?;
        let gu = time(device, reps, || {
            Ok(linear::qlinear_silu_mul(x, &self.gate, &self.up, tuning)?)
        })?;
        let down = time(device, reps, || {
            Ok(linear::qlinear_small(xi, &self.down, tuning)?)
        })?;
        Ok([qkv, o, gu, down])
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.reps > 0, "--reps must be at least 1");
    ensure!(
        args.rows.iter().all(|&r| (1..=8).contains(&r)),
        "--rows: each from 1 to 8"
    );
    let dtype = match args.dtype.as_str() {
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        d => anyhow::bail!("--dtype: {d:?} is not f16, bf16 or f32"),
    };
    let variants = args
        .variants
        .iter()
        .map(|v| {
            QlinearVariant::parse(v).ok_or_else(|| anyhow::anyhow!("--variants: unknown {v:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let device = Device::new_cuda(args.gpu)
        .map_err(|e| anyhow::anyhow!("decode_rows needs a GPU (a build with cuda): {e}"))?;
    // One stream, no offload runtime: tracking may go (train::set_event_tracking's contract).
    candle_offload::train::set_event_tracking(&device, false)?;
    candle_offload::diag::keep_pool_memory(&device, true)?;
    let mut records = Vec::new();
    for name in &args.types {
        let qtype = ggml_type(name)?;
        let layer = Layer::new(qtype, &device)?;
        // Candle's quantized matmuls of the same weights (its MMVQ kernels take F32 x).
        let candle = [
            &layer.q,
            &layer.k,
            &layer.v,
            &layer.o,
            &layer.gate,
            &layer.up,
            &layer.down,
        ]
        .map(|w| QMatMul::from_arc(w.clone()));
        let candle = candle
            .into_iter()
            .collect::<candle_core::Result<Vec<_>>>()?;
        // Seconds of one layer pass per op name and rows: (name, rows) -> seconds.
        let mut ones: Vec<(String, f64)> = Vec::new();
        for &rows in &args.rows {
            let x = Tensor::randn(0f32, 1.0, (rows, Layer::HIDDEN), &Device::Cpu)?
                .to_device(&device)?;
            let xi = Tensor::randn(0f32, 1.0, (rows, Layer::INTERMEDIATE), &Device::Cpu)?
                .to_device(&device)?;
            let (xd, xid) = (x.to_dtype(dtype)?, xi.to_dtype(dtype)?);
            let mut ops: Vec<(String, [f64; 4])> = Vec::new();
            for &v in &variants {
                let mut t = KernelTuning::default();
                t.qlinear = QlinearVariants::all(v);
                ops.push((
                    v.name().to_string(),
                    layer.library(&device, args.reps, &xd, &xid, &t)?,
                ));
            }
            let [q, k, v, o, g, u, d] = [0, 1, 2, 3, 4, 5, 6].map(|i| &candle[i]);
            let qkv = time(&device, args.reps, || {
                Ok((q.forward(&x)?, k.forward(&x)?, v.forward(&x)?))
            })?;
            let ot = time(&device, args.reps, || Ok(o.forward(&x)?))?;
            let gu = time(&device, args.reps, || {
                Ok(candle_nn::ops::silu(&g.forward(&x)?)?.mul(&u.forward(&x)?)?)
            })?;
            let dt = time(&device, args.reps, || Ok(d.forward(&xi)?))?;
            ops.push(("mmvq".to_string(), [qkv, ot, gu, dt]));
            for (op, s) in &ops {
                let layer_s: f64 = s.iter().sum();
                let pass = layer_s * Layer::LAYERS as f64;
                let one = if rows == 1 {
                    ones.push((op.clone(), pass));
                    pass
                } else {
                    ones.iter()
                        .find(|(n, _)| n == op)
                        .map_or(f64::NAN, |(_, p)| *p)
                };
                println!(
                    "{name} rows {rows} {op}: qkv {:.1} us, o {:.1}, gate-up {:.1}, down {:.1}; \
                     a pass of {} layers {:.3} ms ({:.2}x one row's)",
                    s[0] * 1e6,
                    s[1] * 1e6,
                    s[2] * 1e6,
                    s[3] * 1e6,
                    Layer::LAYERS,
                    pass * 1e3,
                    pass / one
                );
                records.push(serde_json::json!({
                    "type": name, "rows": rows, "op": op, "dtype": args.dtype,
                    "qkv_s": s[0], "o_s": s[1], "gate_up_s": s[2], "down_s": s[3],
                    "pass_layers": Layer::LAYERS, "pass_s": pass, "pass_over_one_row": pass / one,
                }));
            }
        }
    }
    if let Some(path) = &args.json_out {
        candle_offload_suite::write_results(
            path,
            "decode_rows",
            &device,
            serde_json::Value::Array(records),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
