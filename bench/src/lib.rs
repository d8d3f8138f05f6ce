//! Helpers of the benchmark harnesses (the binaries in src/bin/ and the cargo benches): the
//! link baseline measured before a benchmark starts, medians, reproducible prompts, result files
//! that carry the peer's output, and a sampling profiler of the host. Device selection, logging
//! and the provenance of a record come from the suite's helpers (`candle_offload_suite`).

use std::path::Path;

pub mod llamacpp;

use candle_core::Device;

/// What a benchmark measures of the machine before it starts: the device memory the CUDA
/// context already holds, and the raw host-to-device copy rates (1 GiB copies) that are the
/// link's ceiling. Zero on a CPU.
#[derive(Debug, Clone, Copy, Default)]
pub struct LinkBaseline {
    /// Device memory in use right after start (the context), bytes.
    pub context_bytes: u64,
    /// Median pinned host-to-device rate, GB/s.
    pub raw_pinned_gbps: f64,
    /// Median pageable host-to-device rate, GB/s (when asked for).
    pub raw_pageable_gbps: f64,
}

/// Measures the [`LinkBaseline`] of `device`; the pageable rate only with `pageable`.
pub fn link_baseline(device: &Device, pageable: bool) -> candle_core::Result<LinkBaseline> {
    if device.is_cpu() {
        return Ok(LinkBaseline::default());
    }
    let context_bytes = candle_offload::diag::device_used_bytes(device)?;
    let raw_pinned_gbps = candle_offload::diag::measure_h2d_gbps(device, 1 << 30, true, 7)?;
    let raw_pageable_gbps = if pageable {
        candle_offload::diag::measure_h2d_gbps(device, 1 << 30, false, 3)?
    } else {
        0.0
    };
    Ok(LinkBaseline {
        context_bytes,
        raw_pinned_gbps,
        raw_pageable_gbps,
    })
}

/// The host's memory read rate in GB/s: every available thread sums its share of a buffer of
/// `bytes`, the best of `reps` passes after one to touch the pages. What a decode step that
/// reads host memory (host layers, host experts, copies over the link) cannot beat.
pub fn host_read_gbps(bytes: usize, reps: usize) -> f64 {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let words = (bytes / 8).max(threads);
    let buf: Vec<u64> = (0..words as u64).collect();
    let chunk = words.div_ceil(threads);
    let mut best = 0.0f64;
    for _ in 0..reps.max(1) + 1 {
        let t0 = std::time::Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let parts: Vec<_> = buf
                .chunks(chunk)
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            parts
                .into_iter()
                .map(|p| p.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((words * 8) as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// The median of `v` (the upper one for an even count); 0 when empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The GGML block type a benchmark flag names: q4_0, q4_1, q5_0, q5_1, q8_0, q4_k or q6_k.
pub fn ggml_type(name: &str) -> anyhow::Result<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType as T;
    Ok(match name {
        "q4_0" => T::Q4_0,
        "q4_1" => T::Q4_1,
        "q5_0" => T::Q5_0,
        "q5_1" => T::Q5_1,
        "q8_0" => T::Q8_0,
        "q4_k" => T::Q4K,
        "q6_k" => T::Q6K,
        _ => anyhow::bail!("--types: unknown type {name:?}"),
    })
}

/// Median seconds of `f` over `reps` runs after two untimed, each run between two
/// synchronizations of `device` (a kernel's time with its launch).
pub fn time_synced<T>(
    device: &Device,
    reps: usize,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    device.synchronize()?;
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = std::time::Instant::now();
        let out = f()?;
        device.synchronize()?;
        v.push(t.elapsed().as_secs_f64());
        drop(out);
    }
    Ok(median(v))
}

/// `n` pseudo-random token ids below `vocab` from `seed` (benchmark prompts: reproducible, no
/// tokenizer needed).
pub fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    use rand::Rng as _;
    let mut rng = candle_offload_suite::rng(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// [`candle_offload_suite::write_results`] with the peer's own output (measured in the same
/// run) under `peer`.
pub fn write_results_with_peer(
    path: &Path,
    benchmark: &str,
    device: &Device,
    records: serde_json::Value,
    peer: Option<serde_json::Value>,
) -> anyhow::Result<()> {
    let mut doc = candle_offload_suite::results_document(benchmark, device, records);
    if let Some(p) = peer {
        doc["peer"] = p;
    }
    candle_offload_suite::write_json(path, &doc)
}

/// A sampling profiler of this process's host threads (`pprof`, SIGPROF at a fixed rate), for
/// the GPU machine, which has no `perf`: where the host spends a step while the GPU waits.
/// Built with the `host-profile` feature; without it, [`HostProfile::start`] says so.
pub struct HostProfile {
    #[cfg(feature = "host-profile")]
    guard: pprof::ProfilerGuard<'static>,
    #[cfg(not(feature = "host-profile"))]
    _unbuilt: (),
}

impl std::fmt::Debug for HostProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostProfile").finish_non_exhaustive()
    }
}

impl HostProfile {
    /// Creates `dir`, the `--host-profile` directory the profiles will be written to, then
    /// [`start`](Self::start)s sampling.
    pub fn start_in(dir: &std::path::Path, hz: i32) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--host-profile {}: cannot create", dir.display()))?;
        Self::start(hz)
    }

    /// Starts sampling every thread's stack `hz` times per second of CPU time.
    pub fn start(hz: i32) -> anyhow::Result<Self> {
        #[cfg(feature = "host-profile")]
        {
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(hz)
                .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                .build()
                .map_err(|e| anyhow::anyhow!("host profiler: {e}"))?;
            Ok(Self { guard })
        }
        #[cfg(not(feature = "host-profile"))]
        {
            let _ = hz;
            anyhow::bail!("this binary was built without the `host-profile` feature")
        }
    }

    /// Stops sampling; writes the stacks in the folded format (`thread;outer;...;leaf count`,
    /// what flame-graph tools read) to `path` and returns the `top` functions by inclusive
    /// samples of the busiest thread, as `[name, samples, share]` rows.
    pub fn finish(self, path: &std::path::Path, top: usize) -> anyhow::Result<serde_json::Value> {
        #[cfg(feature = "host-profile")]
        {
            use std::collections::{HashMap, HashSet};
            use std::io::Write;
            let report = self
                .guard
                .report()
                .build()
                .map_err(|e| anyhow::anyhow!("host profiler report: {e}"))?;
            drop(self.guard);
            let mut lines = Vec::new();
            let mut per_thread: HashMap<String, isize> = HashMap::new();
            for (frames, &count) in &report.data {
                let thread = frames.thread_name_or_id();
                *per_thread.entry(thread.clone()).or_default() += count;
                let names: Vec<String> = frames
                    .frames
                    .iter()
                    .rev()
                    .flat_map(|f| f.iter().rev().map(|s| s.name()))
                    .collect();
                lines.push((thread, names, count));
            }
            let mut out = std::io::BufWriter::new(
                std::fs::File::create(path)
                    .map_err(|e| anyhow::anyhow!("{}: cannot create: {e}", path.display()))?,
            );
            for (thread, names, count) in &lines {
                writeln!(out, "{thread};{} {count}", names.join(";"))?;
            }
            out.flush()?;
            let busiest = per_thread
                .iter()
                .max_by_key(|(_, &n)| n)
                .map(|(t, _)| t.clone())
                .unwrap_or_default();
            let total = per_thread.get(&busiest).copied().unwrap_or(0).max(1);
            let mut inclusive: HashMap<&str, isize> = HashMap::new();
            for (thread, names, count) in &lines {
                if *thread != busiest {
                    continue;
                }
                let distinct: HashSet<&str> = names.iter().map(String::as_str).collect();
                for n in distinct {
                    *inclusive.entry(n).or_default() += count;
                }
            }
            let mut rows: Vec<_> = inclusive.into_iter().collect();
            rows.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
            Ok(serde_json::json!({
                "thread": busiest,
                "samples": total,
                "threads": per_thread,
                "top_inclusive": rows
                    .into_iter()
                    .take(top)
                    .map(|(n, c)| serde_json::json!([n, c, c as f64 / total as f64]))
                    .collect::<Vec<_>>(),
            }))
        }
        #[cfg(not(feature = "host-profile"))]
        {
            let _ = (path, top);
            anyhow::bail!("this binary was built without the `host-profile` feature")
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn random_tokens_are_seeded() {
        let a = super::random_tokens(64, 101, 7);
        assert_eq!(a, super::random_tokens(64, 101, 7));
        assert_ne!(a, super::random_tokens(64, 101, 8));
        assert!(a.iter().all(|&t| t < 101));
    }

    #[test]
    fn median_takes_the_upper_middle() {
        assert_eq!(super::median(vec![]), 0.0);
        assert_eq!(super::median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(vec![4.0, 1.0, 3.0, 2.0]), 3.0);
    }
}
