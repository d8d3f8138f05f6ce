//! Smoke test of a build on a machine: the device, a matmul checked against the CPU, and a
//! weight unit copied from pinned host memory to the GPU on the runtime's copy stream, timed.
//!
//! Run with: `cargo run --release -p candle-offload-bench --bin smoke -- --json-out smoke.json`
//! (`--features cuda` for the GPU; without it, everything runs on the CPU).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_offload::{
    diag, HostStore, MemoryLimit, OffloadConfig, OffloadRuntime, StoreConfig, TensorSpec,
};
use clap::Parser;

/// Checks a build on this machine and prints what it measured.
#[derive(Parser, Debug)]
struct Args {
    /// Run on the CPU even in a CUDA build.
    #[arg(long)]
    cpu: bool,
    /// Size of the unit copied from pinned memory, MiB.
    #[arg(long, default_value_t = 1024)]
    copy_mib: usize,
    /// Also measure the seed's Unified Memory table (plain copy, UM, UM with prefetch) for
    /// this many MiB of data (GPU only; the seed's rows are about 600 MB).
    #[arg(long)]
    um_table_mib: Option<usize>,
    /// Write the results as JSON here.
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
    let mut out = serde_json::Map::new();

    // 1. The device.
    match diag::device_info(&device) {
        Ok(info) => {
            println!(
                "device: {} (cuda:{}), compute capability {}.{}, {:.1} GiB total, {:.1} GiB free",
                info.name,
                info.ordinal,
                info.compute_capability.0,
                info.compute_capability.1,
                info.total_bytes as f64 / 2f64.powi(30),
                info.free_bytes as f64 / 2f64.powi(30)
            );
            println!(
                "driver supports CUDA {}, built for CUDA {} / sm_{}",
                info.driver_cuda_version
                    .map_or("?".into(), |v| v.to_string()),
                info.built_for_cuda.map_or("?".into(), |v| v.to_string()),
                info.compiled_arch.as_deref().unwrap_or("?")
            );
        }
        Err(e) => println!(
            "device: {} ({e})",
            candle_offload::diag::device_label(&device)
        ),
    }

    // 2. A matmul, checked against the CPU.
    let a = Tensor::randn(0f32, 1., (256, 512), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1., (512, 128), &Device::Cpu)?;
    let expected = a.matmul(&b)?;
    let t0 = Instant::now();
    let got = a
        .to_device(&device)?
        .matmul(&b.to_device(&device)?)?
        .to_device(&Device::Cpu)?;
    let matmul_s = t0.elapsed().as_secs_f64();
    let max_err = (got - &expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
    // TF32 is off by default in candle, so f32 GEMM agrees closely with the CPU.
    println!("matmul 256x512 @ 512x128 f32: max |gpu - cpu| = {max_err:.2e} ({matmul_s:.3} s incl. first-use set-up)");
    if max_err > 1e-3 {
        bail!("matmul differs from the CPU by {max_err}");
    }
    out.insert("matmul_max_abs_err".into(), max_err.into());

    // 3. One unit from (pinned) host memory through the runtime's copy stream.
    let n = args.copy_mib << 19; // f16 elements
    let spec = TensorSpec {
        name: "unit.weight".into(),
        dtype: DType::F16,
        shape: Shape::from(n),
    };
    let t0 = Instant::now();
    let store = HostStore::from_fn(&[spec], &StoreConfig::default(), &device, |_, _, dst| {
        for (i, chunk) in dst.chunks_exact_mut(2).enumerate() {
            chunk.copy_from_slice(&half::f16::from_f32((i % 1024) as f32 / 1024.0).to_le_bytes());
        }
        Ok(())
    })
    .context("building the host store")?;
    let load_s = t0.elapsed().as_secs_f64();
    let pinned = store.pinned_bytes() > 0;
    let bytes = store.total_bytes();
    let rt = OffloadRuntime::new(
        Arc::new(store),
        &device,
        &OffloadConfig {
            gpu_memory_limit: Some(MemoryLimit::Bytes(bytes + (64 << 20))),
            ..Default::default()
        },
    )?;
    let mut copy_rates = Vec::new();
    for _ in 0..5 {
        rt.evict_all()?;
        rt.begin_step()?;
        let unit = rt.acquire_named("unit")?;
        let sum = unit
            .get("unit.weight")?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        drop(unit);
        rt.synchronize()?;
        rt.end_step()?;
        let expected = (0..1024).map(|i| i as f32 / 1024.0).sum::<f32>() * (n / 1024) as f32;
        if (sum - expected).abs() > expected * 1e-3 {
            bail!("the copied unit sums to {sum}, expected {expected}");
        }
        if let Some(step) = rt.stats()?.last_step {
            copy_rates.push(step.copy_gbps());
        }
    }
    let copy_gbps = candle_offload_bench::median(copy_rates);
    println!(
        "copy stream: {} MiB from {} host memory at {copy_gbps:.1} GB/s (median of 5; store built in {load_s:.2} s)",
        args.copy_mib,
        if pinned { "pinned" } else { "pageable" }
    );
    out.insert("unit_copy_mib".into(), args.copy_mib.into());
    out.insert("unit_copy_pinned".into(), pinned.into());
    out.insert("unit_copy_gbps".into(), copy_gbps.into());

    if !device.is_cpu() {
        let raw_pinned = diag::measure_h2d_gbps(&device, args.copy_mib << 20, true, 5)?;
        let raw_pageable = diag::measure_h2d_gbps(&device, args.copy_mib << 20, false, 3)?;
        println!("raw host->device: pinned {raw_pinned:.1} GB/s, pageable {raw_pageable:.1} GB/s");
        out.insert("raw_pinned_gbps".into(), raw_pinned.into());
        out.insert("raw_pageable_gbps".into(), raw_pageable.into());
    }
    print!("{}", rt.memory_summary()?);
    if let Some(mib) = args.um_table_mib {
        let rows =
            diag::unified_memory_table(&device, mib << 20).context("the Unified Memory table")?;
        println!("Unified Memory table ({mib} MiB of F32 read by a GPU sum; the seed's rows in brackets):");
        let seed = [Some((1204, 15.2)), Some((612, 18.7)), Some((604, 16.1))];
        let mut json = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            let (mb, ms) = seed.get(i).copied().flatten().unzip();
            println!(
                "  {:<34} device {:>6} MiB  host {:>6} MiB  {:>8.2} ms{}{}",
                r.name,
                r.device_bytes >> 20,
                r.host_bytes >> 20,
                r.seconds * 1e3,
                r.enqueue_seconds.map_or(String::new(), |e| format!(
                    " (the prefetch call returned after {:.2} ms)",
                    e * 1e3
                )),
                mb.zip(ms).map_or(String::new(), |(mb, ms)| format!(
                    "   (seed: {mb} MB, {ms} ms)"
                ))
            );
            json.push(serde_json::json!({
                "name": r.name,
                "device_bytes": r.device_bytes,
                "host_bytes": r.host_bytes,
                "seconds": r.seconds,
                "enqueue_seconds": r.enqueue_seconds,
                "seed_mb": mb,
                "seed_ms": ms,
            }));
        }
        out.insert("um_table".into(), serde_json::Value::Array(json));
    }
    if let Some(path) = &args.json_out {
        candle_offload_suite::write_results(
            path,
            "smoke",
            &device,
            serde_json::Value::Object(out),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
