//! The generation loop: prefill, then one token at a time with the KV cache, streaming text
//! as it is decoded, with prefill and decode timings.

use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_transformers::generation::LogitsProcessor;

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
    sampler: &mut LogitsProcessor,
    eos: &[u32],
    mut on_token: impl FnMut(u32) -> candle_core::Result<()>,
) -> candle_core::Result<(Vec<u32>, GenerationStats)> {
    if prompt.is_empty() {
        candle_core::bail!("the prompt is empty");
    }
    let device: &Device = model.runtime().device();
    let mut cache = model.new_cache();
    let mut out = Vec::new();
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut input = Tensor::new(prompt, device)?.unsqueeze(0)?;
    let mut pos = 0;
    let mut decode_start = None;
    for step in 0..max_new_tokens {
        model.begin_step()?;
        let logits = model.forward(&input, pos, &mut cache)?;
        pos += input.dim(1)?;
        let next = sampler.sample(&logits.squeeze(0)?)?;
        model.end_step()?;
        if step == 0 {
            stats.prefill_s = t0.elapsed().as_secs_f64();
            decode_start = Some(Instant::now());
        }
        out.push(next);
        on_token(next)?;
        if eos.contains(&next) {
            break;
        }
        input = Tensor::new(&[next], device)?.unsqueeze(0)?;
    }
    stats.generated_tokens = out.len();
    stats.decode_s = decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    Ok((out, stats))
}

/// Decodes tokens incrementally, yielding text only once it is complete UTF-8 and stable.
#[derive(Debug)]
pub struct TokenStream<'a> {
    tokenizer: &'a tokenizers::Tokenizer,
    tokens: Vec<u32>,
    prev: usize,
    current: usize,
}

impl<'a> TokenStream<'a> {
    /// A stream over `tokenizer`.
    pub fn new(tokenizer: &'a tokenizers::Tokenizer) -> Self {
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
            .map_err(|e| candle_core::Error::Msg(format!("cannot decode: {e}")))
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
