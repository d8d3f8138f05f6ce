//! The generation loop: prefill, then one token at a time with the KV cache, streaming text
//! as it is decoded, with prefill and decode timings; and the same for a batch of prompts at
//! once ([`generate_batch`]), and for a rank of a multi-process pipeline ([`generate_ranks`]).

use std::time::Instant;

use crate::sampling::TokenSampler;
use candle_core::{Device, Tensor};

use crate::llama::Llama;

/// Timings of a generation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationStats {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Seconds for the prompt's forward pass (up to the first token on the host).
    pub prefill_s: f64,
    /// Seconds for the rest.
    pub decode_s: f64,
}

impl GenerationStats {
    /// Prompt tokens per second.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s.max(1e-9)
    }

    /// Generated tokens (after the first) per second.
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_s.max(1e-9)
    }
}

/// Generates up to `max_new_tokens` after `prompt`, stopping at any of `eos`. `on_token` sees
/// each token as soon as it is sampled.
pub fn generate(
    model: &Llama,
    prompt: &[u32],
    max_new_tokens: usize,
    sampler: &mut impl TokenSampler,
    eos: &[u32],
    mut on_token: impl FnMut(u32) -> candle_core::Result<()>,
) -> candle_core::Result<(Vec<u32>, GenerationStats)> {
    if prompt.is_empty() {
        candle_core::bail!("the prompt is empty");
    }
    // A batch of one: no padding, so the same forward passes as `Llama::forward`.
    let (mut out, batch) =
        generate_batch(model, &[prompt], max_new_tokens, sampler, eos, |_, t| {
            on_token(t)
        })?;
    let stats = GenerationStats {
        prompt_tokens: prompt.len(),
        generated_tokens: batch.generated_tokens[0],
        prefill_s: batch.prefill_s,
        decode_s: batch.decode_s,
    };
    Ok((out.pop().unwrap_or_default(), stats))
}

/// [`generate`] on a rank's model of a multi-process pipeline
/// ([`CausalLmBuilder::rank`](crate::CausalLmBuilder::rank)): every rank calls it with the same
/// prompt and settings; the last rank samples each token with its `sampler` (the others' are
/// not used) and sends it to every rank, whose `on_token` sees it. The tokens are the same on
/// every rank. A peer that fails, dies or stays silent past the transport's timeout is an error
/// naming its rank; this rank's own error goes to the others
/// ([`Transport::fail`](candle_offload::dist::Transport::fail)).
pub fn generate_ranks(
    model: &Llama,
    prompt: &[u32],
    max_new_tokens: usize,
    sampler: &mut impl TokenSampler,
    eos: &[u32],
    mut on_token: impl FnMut(u32) -> candle_core::Result<()>,
) -> candle_core::Result<(Vec<u32>, GenerationStats)> {
    if prompt.is_empty() {
        candle_core::bail!("the prompt is empty");
    }
    let t = model
        .transport()
        .ok_or_else(|| candle_core::Error::Msg("not a rank's model".into()))?
        .clone();
    let run = rank_loop(
        model,
        t.as_ref(),
        prompt,
        max_new_tokens,
        sampler,
        eos,
        &mut on_token,
    );
    if let Err(e) = &run {
        // The others learn why this rank stops, instead of only that it left.
        t.fail(&e.to_string());
    }
    run
}

/// [`generate_ranks`]' loop.
fn rank_loop(
    model: &Llama,
    t: &dyn candle_offload::dist::Transport,
    prompt: &[u32],
    max_new_tokens: usize,
    sampler: &mut impl TokenSampler,
    eos: &[u32],
    on_token: &mut impl FnMut(u32) -> candle_core::Result<()>,
) -> candle_core::Result<(Vec<u32>, GenerationStats)> {
    let last = t.world_size() - 1;
    let device: &Device = model.runtime().device();
    let mut cache = model.new_cache();
    let mut input = Tensor::new(prompt, device)?.unsqueeze(0)?;
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut out = Vec::new();
    let (t0, mut decode_start) = (Instant::now(), None);
    let mut pos = 0;
    for step in 0..max_new_tokens {
        model.begin_step()?;
        let logits = model.rank_step(&input, pos, &mut cache)?;
        pos += input.dim(1)?;
        let mine = match logits {
            Some(l) => vec![sampler.sample_token(&l.get(0)?)?],
            None => Vec::new(),
        };
        model.end_step()?;
        let got = candle_offload::dist::broadcast_tokens(t, last, &mine)?;
        let &[token] = got.as_slice() else {
            candle_core::bail!("rank {last} sent {} tokens for one step", got.len());
        };
        if step == 0 {
            stats.prefill_s = t0.elapsed().as_secs_f64();
            decode_start = Some(Instant::now());
        }
        out.push(token);
        on_token(token)?;
        if eos.contains(&token) {
            break;
        }
        input = Tensor::new(&[token], device)?.unsqueeze(0)?;
    }
    stats.generated_tokens = out.len();
    stats.decode_s = decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    Ok((out, stats))
}

/// Timings of a batch generation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BatchStats {
    /// Tokens in each prompt.
    pub prompt_tokens: Vec<usize>,
    /// Tokens generated for each sequence (up to and including its end-of-sequence token).
    pub generated_tokens: Vec<usize>,
    /// Seconds for the padded prompts' forward pass (up to the first tokens on the host).
    pub prefill_s: f64,
    /// Seconds for the decode steps after it.
    pub decode_s: f64,
    /// Decode steps after the first token (each produces one token per unfinished sequence).
    pub decode_steps: usize,
}

impl BatchStats {
    /// Tokens generated after the first ones, over all sequences, per second of decoding.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let tokens: usize = self
            .generated_tokens
            .iter()
            .map(|n| n.saturating_sub(1))
            .sum();
        tokens as f64 / self.decode_s.max(1e-9)
    }

    /// Decode steps per second: the rate each sequence advances at while it is unfinished.
    pub fn decode_tokens_per_s_per_sequence(&self) -> f64 {
        self.decode_steps as f64 / self.decode_s.max(1e-9)
    }
}

/// Generates up to `max_new_tokens` after each of `prompts` at once, as one batch: the
/// prompts are left-padded to the longest and every step runs one forward pass for all of
/// them ([`Llama::forward_batch`]), so a weight sweep serves every sequence. A sequence stops
/// at any of `eos` (later steps still compute its row, whose tokens are dropped); the loop ends
/// when all have stopped. Greedy decoding gives each sequence the tokens it gets alone (within
/// floating-point rounding of the batched matmuls). `sampler` samples the rows in order, and
/// `on_token(row, token)` sees each kept token as soon as it is sampled.
///
/// The model's budget reserve is sized for one sequence: for a batch on a GPU, add
/// [`Config::batch_reserve_bytes`](crate::Config::batch_reserve_bytes) to
/// `OffloadSettings::reserve_bytes` when building it.
pub fn generate_batch(
    model: &Llama,
    prompts: &[&[u32]],
    max_new_tokens: usize,
    sampler: &mut impl TokenSampler,
    eos: &[u32],
    mut on_token: impl FnMut(usize, u32) -> candle_core::Result<()>,
) -> candle_core::Result<(Vec<Vec<u32>>, BatchStats)> {
    if prompts.is_empty() {
        candle_core::bail!("no prompts");
    }
    if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
        candle_core::bail!("prompt {i} is empty");
    }
    let device: &Device = model.runtime().device();
    let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    let pads: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
    let padded: Vec<u32> = prompts
        .iter()
        .zip(&pads)
        .flat_map(|(p, &pad)| std::iter::repeat_n(p[0], pad).chain(p.iter().copied()))
        .collect();
    let b = prompts.len();
    let mut cache = model.new_cache();
    let mut out = vec![Vec::new(); b];
    let mut done = vec![false; b];
    let mut stats = BatchStats {
        prompt_tokens: prompts.iter().map(|p| p.len()).collect(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut input = Tensor::from_vec(padded, (b, longest), device)?;
    let mut pos = 0;
    let mut decode_start = None;
    for step in 0..max_new_tokens {
        model.begin_step()?;
        let logits = model.forward_batch(&input, pos, &pads, &mut cache)?;
        pos += input.dim(1)?;
        let mut next = Vec::with_capacity(b);
        for r in 0..b {
            next.push(sampler.sample_token(&logits.get(r)?)?);
        }
        model.end_step()?;
        if step == 0 {
            stats.prefill_s = t0.elapsed().as_secs_f64();
            decode_start = Some(Instant::now());
        } else {
            stats.decode_steps += 1;
        }
        for (r, &t) in next.iter().enumerate() {
            if !done[r] {
                out[r].push(t);
                on_token(r, t)?;
                done[r] = eos.contains(&t);
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
        input = Tensor::from_vec(next, (b, 1), device)?;
    }
    stats.generated_tokens = out.iter().map(Vec::len).collect();
    stats.decode_s = decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    Ok((out, stats))
}

/// Decodes tokens incrementally, yielding text only once it is complete UTF-8 and stable.
#[derive(Debug)]
pub struct TokenStream<'a> {
    tokenizer: &'a crate::Tokenizer,
    tokens: Vec<u32>,
    prev: usize,
    current: usize,
}

impl<'a> TokenStream<'a> {
    /// A stream over `tokenizer`.
    pub fn new(tokenizer: &'a crate::Tokenizer) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            prev: 0,
            current: 0,
        }
    }

    fn decode(&self, tokens: &[u32]) -> candle_core::Result<String> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }

    /// Adds a token; returns the new text, if any is ready.
    pub fn next_token(&mut self, token: u32) -> candle_core::Result<Option<String>> {
        let prev_text = if self.tokens.is_empty() {
            String::new()
        } else {
            self.decode(&self.tokens[self.prev..self.current])?
        };
        self.tokens.push(token);
        let text = self.decode(&self.tokens[self.prev..])?;
        if text.len() > prev_text.len() && !text.ends_with('\u{fffd}') {
            let new = text[prev_text.len()..].to_string();
            self.prev = self.current;
            self.current = self.tokens.len();
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }

    /// Whatever text is still held back.
    pub fn rest(&self) -> candle_core::Result<Option<String>> {
        let prev_text = if self.tokens.is_empty() {
            String::new()
        } else {
            self.decode(&self.tokens[self.prev..self.current])?
        };
        let text = self.decode(&self.tokens[self.prev..])?;
        Ok((text.len() > prev_text.len()).then(|| text[prev_text.len()..].to_string()))
    }
}
