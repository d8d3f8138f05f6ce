//! llama.cpp as the peer of `bench_generate`: its `llama-bench` run on the same GGUF file in
//! the same process, at the most layers on the GPU (`-ngl`, or for a mixture of experts the
//! fewest layers with experts on the CPU, `-ncmoe`) whose device peak, measured from outside
//! less the idle CUDA context, stays within each budget.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use candle_offload::diag::{self, PeakMemorySampler};

/// llama.cpp's llama-bench on the same GGUF file, in this process's run.
#[derive(Debug, Clone)]
pub struct LlamaCpp {
    /// The `llama-bench` binary.
    pub bench: PathBuf,
    /// The GGUF file, the same as ours.
    pub model: PathBuf,
    /// The GPU both run on, whose memory is sampled.
    pub device: candle_core::Device,
    /// The device memory the idle CUDA context holds, bytes (not counted in a peak).
    pub context_bytes: u64,
    /// The model's decoder layers.
    pub layers: u32,
    /// Search `-ncmoe` (experts on the CPU) at `-ngl 99 -fa 1` instead of `-ngl`.
    pub moe: bool,
    /// The search's first guess at each budget, in order (`--llamacpp-layers-hint`).
    pub hints: Vec<u32>,
}

/// llama.cpp's figures at one budget and prompt length.
#[derive(Debug, Clone)]
pub struct LlamaCppRecord {
    /// The budget (`None`: the whole GPU).
    pub budget_bytes: Option<u64>,
    /// The prompt's length.
    pub prompt_len: usize,
    /// Its `-ngl` (with `--llamacpp-moe`, 99: every layer).
    pub ngl: u32,
    /// Layers whose experts run on the CPU (`--llamacpp-moe`).
    pub ncmoe: Option<u32>,
    /// Its device peak less the idle CUDA context, bytes.
    pub peak_bytes: u64,
    /// Each llama-bench test's result.
    pub runs: Vec<LlamaCppRun>,
}

/// One llama-bench test: `prompt` tokens processed or `gen` generated, after `depth` tokens
/// already in its context, at `tokens_per_s`.
#[derive(Debug, Clone, Copy)]
pub struct LlamaCppRun {
    /// Prompt tokens processed (0 for a decode test).
    pub prompt: usize,
    /// Tokens generated (0 for a prefill test).
    pub gen: usize,
    /// Tokens already in the context.
    pub depth: usize,
    /// Its mean rate.
    pub tokens_per_s: f64,
}

impl LlamaCppRecord {
    /// Its prefill of the prompt from an empty context, as ours is timed.
    pub fn prefill(&self) -> Option<f64> {
        self.find(|r| r.prompt == self.prompt_len && r.gen == 0 && r.depth == 0)
    }

    /// Its decode after `depth` tokens in its context.
    pub fn decode_at(&self, depth: usize) -> Option<f64> {
        self.find(|r| r.prompt == 0 && r.gen > 0 && r.depth == depth)
    }

    fn find(&self, test: impl Fn(&LlamaCppRun) -> bool) -> Option<f64> {
        self.runs.iter().find(|r| test(r)).map(|r| r.tokens_per_s)
    }
}

impl LlamaCpp {
    /// What a probe's count places on the GPU: `-ngl n`, or with `moe` every layer and the
    /// experts of all but the first `layers - n` (`-ncmoe`).
    fn placement(&self, n: u32) -> Vec<String> {
        if self.moe {
            let cpu = self.layers.saturating_sub(n);
            ["-ngl", "99", "-fa", "1", "-ncmoe", &cpu.to_string()]
                .map(String::from)
                .to_vec()
        } else {
            vec!["-ngl".into(), n.to_string()]
        }
    }

    /// One llama-bench run at `ngl` ([`placement`](Self::placement)): its tests, and the
    /// device memory it took at its peak (less the idle CUDA context), sampled from outside.
    fn run(
        &self,
        ngl: u32,
        prompts: &[usize],
        gen: usize,
        depths: &[usize],
        reps: u32,
    ) -> Result<(Vec<LlamaCppRun>, u64)> {
        let before = diag::device_used_bytes(&self.device)?;
        let sampler = PeakMemorySampler::start(&self.device, Duration::from_millis(2))?;
        let list = |v: &[usize]| {
            v.iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let out = std::process::Command::new(&self.bench)
            .args(["-m", &self.model.to_string_lossy()])
            .args(self.placement(ngl))
            .args([
                "-p",
                &list(prompts),
                "-n",
                &gen.to_string(),
                "-d",
                &list(depths),
            ])
            .args([
                "-r",
                &reps.to_string(),
                "-t",
                &threads.to_string(),
                "-o",
                "jsonl",
            ])
            .output()
            .with_context(|| format!("running {}", self.bench.display()))?;
        let peak = sampler.stop();
        if !out.status.success() {
            anyhow::bail!(
                "{} {} failed: {}",
                self.bench.display(),
                self.placement(ngl).join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let mut runs = Vec::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if line.trim().is_empty() {
                continue;
            }
            let r: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("llama-bench: {line}"))?;
            let field = |k: &str| r[k].as_u64().map(|v| v as usize);
            if let (Some(prompt), Some(gen), Some(tokens_per_s)) =
                (field("n_prompt"), field("n_gen"), r["avg_ts"].as_f64())
            {
                runs.push(LlamaCppRun {
                    prompt,
                    gen,
                    depth: field("n_depth").unwrap_or(0),
                    tokens_per_s,
                });
            }
        }
        let used = peak
            .saturating_sub(before)
            .saturating_sub(self.context_bytes);
        Ok((runs, used))
    }

    /// For each budget (`None`: everything on the GPU) and prompt length, the most layers whose
    /// probe peak (the larger of a prefill of that prompt and a decode of `gen` tokens after
    /// it, each run once) fits it, then the measurement there: the prompt's
    /// prefill from an empty context, and `gen` tokens decoded after the prompt's length of
    /// context (llama-bench's `-d`) as ours are, and from an empty one for reference.
    pub fn measure(
        &self,
        budgets: &[Option<u64>],
        prompts: &[usize],
        gen: usize,
        reps: u32,
    ) -> Result<Vec<LlamaCppRecord>> {
        // The layers and the output head; with `moe`, the layers whose experts are on the GPU.
        let all = if self.moe {
            self.layers
        } else {
            self.layers + 1
        };
        let mut out = Vec::new();
        // Each budget's answer at the prompt length before: the next one's first guess (a
        // longer prompt's context takes a little more), ahead of `hints`.
        let mut found: Vec<Option<u32>> = vec![None; budgets.len()];
        for &prompt in prompts {
            // Each `-ngl` is probed once per prompt length, whichever budgets ask for it.
            let mut probes: std::collections::BTreeMap<u32, u64> = Default::default();
            let mut peak_at = |ngl: u32| -> Result<u64> {
                if let Some(p) = probes.get(&ngl) {
                    return Ok(*p);
                }
                // Both timed runs: the prefill, and the decode after the prompt's context,
                // which holds more (llama.cpp rounds its context up: 7B Q4_K_M at 4 GiB,
                // `-ngl 32`: 4054 MiB for the prompt, 4184 decoding after it).
                let (_, prefill) = self.run(ngl, &[prompt], 0, &[0], 1)?;
                let (_, decode) = self.run(ngl, &[0], gen, &[prompt], 1)?;
                let p = prefill.max(decode);
                println!(
                    "llama.cpp probe -ngl {ngl} -p {prompt}: {} MiB; -n {gen} -d {prompt}: {} MiB",
                    prefill >> 20,
                    decode >> 20
                );
                probes.insert(ngl, p);
                Ok(p)
            };
            for (i, &budget) in budgets.iter().enumerate() {
                let ngl = match budget {
                    None => all,
                    Some(b) => {
                        let hint = found[i].or(self.hints.get(i).copied());
                        let n = most_layers_within(all, b, hint, &mut peak_at)?;
                        found[i] = Some(n);
                        n
                    }
                };
                // Two runs, so that no test's context is longer than our run's: the prefill
                // from an empty context, then the decode after the prompt's length of context
                // and, for reference, from an empty one (`-p 0`: no prefill test).
                let (mut runs, prefill_peak) = self.run(ngl, &[prompt], 0, &[0], reps)?;
                let (decode, decode_peak) = self.run(ngl, &[0], gen, &[0, prompt], reps)?;
                runs.extend(decode);
                let peak_bytes = prefill_peak.max(decode_peak);
                println!(
                    "llama.cpp -ngl {ngl} (budget {}, prompt {prompt}): {runs:?}, peak {} MiB",
                    budget.map_or("none".into(), |b| format!("{} MiB", b >> 20)),
                    peak_bytes >> 20
                );
                out.push(LlamaCppRecord {
                    budget_bytes: budget,
                    prompt_len: prompt,
                    ngl: if self.moe { 99 } else { ngl },
                    ncmoe: self.moe.then(|| self.layers - ngl),
                    peak_bytes,
                    runs,
                });
            }
        }
        Ok(out)
    }
}

/// The largest `n` in `0..=all` whose `peak_at(n)` is within `budget` (0 when none is). Peaks
/// grow with `n`, nearly linearly (a layer's bytes each), so each probe is placed where the line
/// through the bracket's ends crosses the budget: two or three probes instead of a bisection's
/// six. A `hint` (an earlier run's answer, usually right or one off) is probed first, with its
/// neighbours: the count above it where it fits (and the one above that where that fits too),
/// the count below it where it does not. The search then starts from the bracket those probes
/// leave, probing 0 or `all` only where no probe fell on that side.
fn most_layers_within(
    all: u32,
    budget: u64,
    hint: Option<u32>,
    peak_at: &mut impl FnMut(u32) -> Result<u64>,
) -> Result<u32> {
    let mut known = std::collections::BTreeMap::new();
    let mut probe = |n: u32, known: &mut std::collections::BTreeMap<u32, u64>| -> Result<u64> {
        if let Some(&p) = known.get(&n) {
            return Ok(p);
        }
        let p = peak_at(n)?;
        known.insert(n, p);
        Ok(p)
    };
    if let Some(h) = hint.filter(|&h| h < all) {
        if probe(h, &mut known)? <= budget {
            for n in h + 1..=(h + 2).min(all) {
                if probe(n, &mut known)? > budget {
                    return Ok(n - 1);
                }
            }
        } else if h == 0 || probe(h - 1, &mut known)? <= budget {
            return Ok(h.saturating_sub(1));
        }
    }
    // The bracket: peak(lo) fits (or lo == 0 and nothing fits); peak(hi) does not.
    let fitting = known.iter().rev().find(|(_, p)| **p <= budget);
    let (mut lo, mut p_lo) = match fitting {
        Some((&n, &p)) => (n, p),
        None => {
            let p = probe(0, &mut known)?;
            if p > budget {
                return Ok(0);
            }
            (0, p)
        }
    };
    let over = known.iter().find(|(&n, &p)| n > lo && p > budget);
    let (mut hi, mut p_hi) = match over {
        Some((&n, &p)) => (n, p),
        None => {
            let p = probe(all, &mut known)?;
            if p <= budget {
                return Ok(all);
            }
            (all, p)
        }
    };
    while hi - lo > 1 {
        let frac = budget.saturating_sub(p_lo) as f64 / p_hi.saturating_sub(p_lo).max(1) as f64;
        let guess = lo + (frac * (hi - lo) as f64).round() as u32;
        let mid = guess.clamp(lo + 1, hi - 1);
        let p = probe(mid, &mut known)?;
        if p <= budget {
            (lo, p_lo) = (mid, p);
        } else {
            (hi, p_hi) = (mid, p);
        }
    }
    Ok(lo)
}

#[cfg(test)]
mod tests {
    use super::most_layers_within;

    /// The answer and the counts probed, for peaks of `base + step * n` MiB.
    fn search(all: u32, budget: u64, hint: Option<u32>, base: u64, step: u64) -> (u32, Vec<u32>) {
        let mut probed = Vec::new();
        let got = most_layers_within(all, budget, hint, &mut |n| {
            probed.push(n);
            Ok(base + step * u64::from(n))
        })
        .unwrap();
        (got, probed)
    }

    #[test]
    fn the_layers_search_finds_the_most_that_fit_with_or_without_a_hint() {
        // 100 + 10 n within 165: n = 6.
        for hint in [
            None,
            Some(0),
            Some(3),
            Some(5),
            Some(6),
            Some(7),
            Some(9),
            Some(48),
        ] {
            assert_eq!(search(48, 165, hint, 100, 10).0, 6, "hint {hint:?}");
        }
        let (_, probed) = search(48, 165, Some(6), 100, 10);
        assert_eq!(probed, [6, 7], "a right hint takes two probes");
        let (_, probed) = search(48, 165, Some(7), 100, 10);
        assert_eq!(probed, [7, 6], "one too many: two probes");
        let (_, probed) = search(48, 165, Some(5), 100, 10);
        assert_eq!(probed, [5, 6, 7], "one too few: three probes");
        // Off by more, the search goes on from the bracket the hint's probes left.
        let (got, probed) = search(48, 165, Some(20), 100, 10);
        assert_eq!(got, 6);
        assert!(!probed.contains(&48), "{probed:?}");
        let (got, probed) = search(48, 165, Some(2), 100, 10);
        assert_eq!(got, 6);
        assert!(!probed.contains(&0), "{probed:?}");
        // Every answer agrees with the search without a hint, at every budget.
        for budget in (50..700).step_by(7) {
            let want = search(48, budget, None, 100, 10).0;
            for hint in 0..=48 {
                assert_eq!(
                    search(48, budget, Some(hint), 100, 10).0,
                    want,
                    "{budget} {hint}"
                );
            }
        }
        // All fit, none fits.
        for hint in [None, Some(0), Some(20), Some(48)] {
            assert_eq!(search(48, 10_000, hint, 100, 10).0, 48, "hint {hint:?}");
            assert_eq!(search(48, 50, hint, 100, 10).0, 0, "hint {hint:?}");
        }
    }
}
