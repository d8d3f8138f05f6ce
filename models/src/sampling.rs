//! Sampling the next token where the logits are, so that on a GPU only the token id crosses to
//! the host: greedy (argmax), temperature and nucleus (top-p), with seeded, device-independent
//! randomness.
//!
//! Candle's `LogitsProcessor` copies the whole logits row to the host and, for top-p, sorts
//! the vocabulary there on every token (32k entries for a LLaMA 2 vocabulary, 128 KiB over the
//! link and a host sort, while the GPU waits). [`DeviceSampler`] does it with tensor ops on the
//! logits' device:
//!
//! - **Top-p without a sort.** Candle's CUDA sort holds a whole row in shared memory and cannot
//!   sort a vocabulary that size. The nucleus is instead `{i : p_i ≥ τ}` for the largest τ whose
//!   kept mass `Σ_{p_j ≥ τ} p_j` still reaches `top_p`, and τ is found by a search that tries 64
//!   thresholds at once in each of 4 rounds (one (64, vocab) comparison and sum per round, no
//!   host round trip), narrowing [0, max p] by 64⁴. That is the sort-based nucleus exactly,
//!   except for tokens whose probabilities lie within max p / 64⁴ (6e-8 of max p) of the
//!   threshold ([`top_p_mask`]).
//! - **Sampling by the Gumbel-max trick.** `argmax(logits / T + g)` over the nucleus, with
//!   `g = -ln(-ln u)` for uniform `u`, draws a token with probability `softmax(logits / T)`
//!   restricted to the nucleus and renormalised. The uniforms come from a seeded generator on
//!   the host and are uploaded (an asynchronous copy, nothing waits for it), so a seed gives
//!   the same tokens on every device for the same logits.

use candle_core::{DType, Result, Tensor, D};
use rand::{Rng as _, SeedableRng as _};

/// Thresholds tried at once in each round of the top-p search.
const CANDIDATES: usize = 64;
/// Rounds of the top-p search: the threshold is found within max p / 64⁴.
const ROUNDS: usize = 4;

/// The nucleus of `probs` (vocab,) F32 probabilities summing to 1: 1 for every token of the
/// smallest set of most probable tokens whose mass reaches `top_p`, 0 elsewhere (U8, on
/// `probs`'s device), computed without a sort (see the module docs for its precision).
pub fn top_p_mask(probs: &Tensor, top_p: f64) -> Result<Tensor> {
    if !(top_p > 0.0 && top_p <= 1.0) {
        candle_core::bail!("top-p {top_p} is outside (0, 1]");
    }
    let probs = probs.to_dtype(DType::F32)?;
    if top_p >= 1.0 {
        return probs.ones_like()?.to_dtype(DType::U8);
    }
    let dev = probs.device();
    let steps = Tensor::arange(0u32, CANDIDATES as u32, dev)?
        .to_dtype(DType::F32)?
        .affine(1.0 / CANDIDATES as f64, 0.0)?;
    let row = probs.unsqueeze(0)?;
    // Invariant: the mass kept at `lo` reaches top_p; at `hi` it does not (or hi is past the
    // largest probability).
    let mut lo = Tensor::zeros(1, DType::F32, dev)?;
    // Just above the largest probability (softmax makes it positive): nothing is kept there.
    let mut hi = probs.max_keepdim(0)?.affine(1.0 + 1e-6, 0.0)?;
    for _ in 0..ROUNDS {
        // lo + (hi - lo) · s for s in 0, 1/64, …, 63/64.
        let taus = steps
            .broadcast_mul(&(&hi - &lo)?)?
            .broadcast_add(&lo)?
            .unsqueeze(1)?;
        let kept = row
            .broadcast_ge(&taus)?
            .to_dtype(DType::F32)?
            .broadcast_mul(&row)?
            .sum(1)?;
        // The candidates are increasing and the kept mass decreasing: the last one that still
        // reaches top_p is the count of those that do, minus one (the first always does).
        let reach = kept
            .ge(top_p)?
            .to_dtype(DType::F32)?
            .sum_keepdim(0)?
            .maximum(1.0)?;
        let last = (reach.affine(1.0, -1.0)?).to_dtype(DType::U32)?;
        let taus = taus.squeeze(1)?;
        let new_lo = taus.index_select(&last, 0)?;
        let width = (&hi - &lo)?.affine(1.0 / CANDIDATES as f64, 0.0)?;
        hi = (&new_lo + width)?.minimum(&hi)?;
        lo = new_lo;
    }
    probs.broadcast_ge(&lo)
}

/// Picks the next token from a row of logits: Candle's `LogitsProcessor` (on the host) or
/// [`DeviceSampler`] (where the logits are).
pub trait TokenSampler {
    /// The next token from `logits` (vocab,).
    fn sample_token(&mut self, logits: &Tensor) -> Result<u32>;
}

impl TokenSampler for candle_transformers::generation::LogitsProcessor {
    fn sample_token(&mut self, logits: &Tensor) -> Result<u32> {
        self.sample(logits)
    }
}

impl<S: TokenSampler + ?Sized> TokenSampler for Box<S> {
    fn sample_token(&mut self, logits: &Tensor) -> Result<u32> {
        (**self).sample_token(logits)
    }
}

impl TokenSampler for DeviceSampler {
    fn sample_token(&mut self, logits: &Tensor) -> Result<u32> {
        self.sample(logits)
    }
}

/// The sort-based nucleus on the host, the definition [`top_p_mask`] computes without a sort:
/// the most probable tokens, in order, until their mass (summed in F64) reaches `top_p`. For
/// checks; it sorts the whole vocabulary.
pub fn top_p_mask_sorted(probs: &[f32], top_p: f64) -> Vec<bool> {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let mut keep = vec![false; probs.len()];
    let mut mass = 0f64;
    for i in order {
        keep[i] = true;
        mass += probs[i] as f64;
        if mass >= top_p {
            break;
        }
    }
    keep
}

/// Draws next tokens from logits on their own device; see the module docs.
#[derive(Debug)]
pub struct DeviceSampler {
    temperature: Option<f64>,
    top_p: Option<f64>,
    rng: rand::rngs::StdRng,
}

impl DeviceSampler {
    /// Greedy when `temperature` is `None` or 0; otherwise samples `softmax(logits /
    /// temperature)`, restricted to the top-`top_p` nucleus when given, from a generator seeded
    /// with `seed`.
    pub fn new(seed: u64, temperature: Option<f64>, top_p: Option<f64>) -> Result<Self> {
        if let Some(t) = temperature {
            if !(t >= 0.0 && t.is_finite()) {
                candle_core::bail!("temperature {t} is not a finite number ≥ 0");
            }
        }
        if let Some(p) = top_p {
            if !(p > 0.0 && p <= 1.0) {
                candle_core::bail!("top-p {p} is outside (0, 1]");
            }
        }
        Ok(Self {
            temperature: temperature.filter(|&t| t > 0.0),
            top_p: top_p.filter(|&p| p < 1.0),
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        })
    }

    /// Greedy: [`sample`](Self::sample) takes the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_none()
    }

    /// The next token from `logits` (vocab,) or (1, vocab): the argmax, or a draw. Only the
    /// chosen id is copied to the host.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let logits = match logits.rank() {
            2 => logits.squeeze(0)?,
            _ => logits.clone(),
        };
        let logits = logits.to_dtype(DType::F32)?;
        let Some(t) = self.temperature else {
            return logits.argmax(D::Minus1)?.to_scalar::<u32>();
        };
        let scaled = (logits / t)?;
        let vocab = scaled.dim(0)?;
        let u: Vec<f32> = (0..vocab)
            .map(|_| self.rng.random_range(f32::MIN_POSITIVE..1.0))
            .collect();
        let u = Tensor::from_vec(u, vocab, scaled.device())?;
        let gumbel = u.log()?.neg()?.log()?.neg()?;
        let mut scores = (scaled.clone() + gumbel)?;
        if let Some(p) = self.top_p {
            let probs = candle_nn::ops::softmax_last_dim(&scaled)?;
            let keep = top_p_mask(&probs, p)?;
            let out = Tensor::full(f32::NEG_INFINITY, vocab, scaled.device())?;
            scores = keep.where_cond(&scores, &out)?;
        }
        scores.argmax(D::Minus1)?.to_scalar::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use candle_core::Device;

    fn random_logits(n: usize, seed: u64, spread: f32) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-spread..spread)).collect()
    }

    #[test]
    fn top_p_mask_is_the_sorted_nucleus() -> Result<()> {
        let dev = Device::Cpu;
        for (seed, (n, spread)) in [(10, 1.0), (1000, 4.0), (32000, 8.0), (7, 0.1)]
            .into_iter()
            .enumerate()
        {
            let logits = Tensor::from_vec(random_logits(n, seed as u64, spread), n, &dev)?;
            let probs = candle_nn::ops::softmax_last_dim(&logits)?;
            let p: Vec<f32> = probs.to_vec1()?;
            let all: Vec<u8> = top_p_mask(&probs, 1.0)?.to_vec1()?;
            assert!(all.iter().all(|&k| k == 1), "top-p 1 keeps every token");
            for top_p in [0.05, 0.5, 0.9, 0.99] {
                let got: Vec<u8> = top_p_mask(&probs, top_p)?.to_vec1()?;
                let want = top_p_mask_sorted(&p, top_p);
                let diff = got
                    .iter()
                    .zip(&want)
                    .filter(|(g, w)| (**g == 1) != **w)
                    .count();
                assert_eq!(diff, 0, "n {n}, top-p {top_p}: {diff} tokens differ");
            }
        }
        Ok(())
    }

    #[test]
    fn draws_follow_the_distribution_and_stay_in_the_nucleus() -> Result<()> {
        let dev = Device::Cpu;
        let probs = [0.5f32, 0.25, 0.15, 0.07, 0.03];
        let logits = Tensor::from_vec(probs.iter().map(|p| p.ln()).collect(), 5, &dev)?;
        let draws = 4000;
        let count = |sampler: &mut DeviceSampler| -> Result<Vec<usize>> {
            let mut c = vec![0; 5];
            for _ in 0..draws {
                c[sampler.sample(&logits)? as usize] += 1;
            }
            Ok(c)
        };
        let c = count(&mut DeviceSampler::new(1, Some(1.0), None)?)?;
        for (i, (&k, &p)) in c.iter().zip(&probs).enumerate() {
            let sd = (draws as f32 * p * (1.0 - p)).sqrt();
            let dev = (k as f32 - draws as f32 * p).abs();
            assert!(
                dev < 4.0 * sd,
                "token {i}: {k} draws, expected {}",
                draws as f32 * p
            );
        }
        // Top-p 0.8: the nucleus is {0, 1, 2} (0.9 ≥ 0.8), renormalised.
        let c = count(&mut DeviceSampler::new(2, Some(1.0), Some(0.8))?)?;
        assert_eq!(&c[3..], &[0, 0], "{c:?}");
        let share = c[0] as f32 / draws as f32;
        assert!((share - 0.5 / 0.9).abs() < 0.03, "{c:?}");
        // Greedy, and the same seed gives the same draws.
        assert_eq!(DeviceSampler::new(3, None, Some(0.5))?.sample(&logits)?, 0);
        assert_eq!(DeviceSampler::new(3, Some(0.0), None)?.sample(&logits)?, 0);
        let seq = |seed| -> Result<Vec<u32>> {
            let mut s = DeviceSampler::new(seed, Some(0.7), Some(0.95))?;
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(seq(9)?, seq(9)?);
        assert_ne!(seq(9)?, seq(10)?);
        Ok(())
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(DeviceSampler::new(0, Some(-1.0), None).is_err());
        assert!(DeviceSampler::new(0, Some(f64::NAN), None).is_err());
        assert!(DeviceSampler::new(0, Some(1.0), Some(0.0)).is_err());
        assert!(DeviceSampler::new(0, Some(1.0), Some(1.5)).is_err());
    }
}
