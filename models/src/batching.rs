//! Continuous batching: sequences join a running batch at the next step and leave when done,
//! each with its own KV cache and sampler, every step one forward pass over all of them
//! ([`CausalLm::forward_ragged`](crate::CausalLm::forward_ragged)).
//!
//! The policy ([`Batcher::step`]):
//! - **Admission**, first come first served: a waiting sequence starts when fewer than
//!   [`BatchOptions::max_running`] run and its KV cache (its prompt and all its new tokens, the
//!   whole cache it can ever need: [`Batcher::kv_bytes`]) fits beside the running ones' in
//!   [`BatchOptions::kv_limit_bytes`]. It is allocated for those positions when it starts and
//!   freed when it finishes or is cancelled, so a running sequence never waits for memory.
//! - **A step** carries one new token of every decoding sequence, then prompt chunks of the
//!   sequences still reading their prompt, in arrival order, while the step's rows stay within
//!   [`BatchOptions::step_tokens`] (the first prompt chunk always goes, so prompts progress).
//!   A prompt runs in chunks of [`BatchOptions::prompt_chunk`] positions at fixed offsets, so
//!   a sequence's forward passes are the same whatever else runs beside it; decoding
//!   sequences stream a token every step while a long prompt is read.
//! - A sequence **finishes** at one of its end tokens or after its `max_new_tokens`.

use std::collections::VecDeque;
use std::sync::Arc;

use candle_core::{Result, Tensor, D};
use candle_transformers::generation::LogitsProcessor;

use crate::causal::RaggedSeq;
use crate::layers::Cache;
use crate::llama::Llama;
use crate::sampling::{DeviceSampler, TokenSampler};

/// How a [`Batcher`] schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOptions {
    /// Sequences that run at once, at most.
    pub max_running: usize,
    /// Rows (new positions over all sequences) a step carries, at most (beside the first
    /// prompt chunk, which always goes).
    pub step_tokens: usize,
    /// Positions of a prompt per forward pass.
    pub prompt_chunk: usize,
    /// Bytes the running sequences' KV caches may take together.
    pub kv_limit_bytes: u64,
    /// Positions a sequence may reach (its prompt and new tokens): the model's context.
    pub max_len: usize,
}

impl BatchOptions {
    /// `max_running` sequences of up to `max_len` positions each, their whole caches within
    /// the limit, steps of up to [`STEP_TOKENS`] rows, and prompt chunks of what a step has
    /// left beside one token of every other running sequence (at least 64): so a step's rows
    /// stay within [`STEP_TOKENS`] (the rows a server's model reserves for) up to 448 running
    /// sequences, and a prompt of up to that many tokens is read in one pass, as
    /// llama-server reads 512 at once.
    pub fn new(model: &Llama, max_running: usize, max_len: usize) -> Self {
        let per_seq = model.config().kv_cache_bytes(max_len, model.dtype());
        let max_running = max_running.max(1);
        Self {
            max_running,
            step_tokens: STEP_TOKENS,
            prompt_chunk: STEP_TOKENS.saturating_sub(max_running - 1).max(64),
            kv_limit_bytes: per_seq * max_running as u64,
            max_len,
        }
    }
}

/// How a sequence samples its tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Above 0: sample at this temperature; `None` (or 0): greedy.
    pub temperature: Option<f64>,
    /// Nucleus sampling's probability mass, with a temperature.
    pub top_p: Option<f64>,
    /// The seed of this sequence's generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: None,
            top_p: None,
            seed: 299792458,
        }
    }
}

/// A sequence to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRequest {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least one).
    pub max_new_tokens: usize,
    /// How to sample them.
    pub sampling: SamplingParams,
    /// Tokens that end the sequence (sent, then the sequence finishes).
    pub end_tokens: Vec<u32>,
}

/// Rows a step carries at most under [`BatchOptions::new`].
pub const STEP_TOKENS: usize = 512;

/// Positions of [`Batcher::warm_up`]'s long prompt: enough rows for a prompt's own kernels
/// (`kernels::gemm::PREFILL_GEMM_MIN_ROWS` and up, the prompt attention).
pub const PREFILL_WARM_ROWS: usize = 128;

/// Why a request cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_new_tokens` is 0.
    #[error("max_new_tokens must be at least 1")]
    NoNewTokens,
    /// The prompt and new tokens exceed the context.
    #[error(
        "the prompt ({prompt} tokens) and {new} new tokens exceed the context of {max_len} positions"
    )]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens asked for.
        new: usize,
        /// The context.
        max_len: usize,
    },
    /// Its KV cache alone exceeds the batch's KV memory.
    #[error("its KV cache ({needed} bytes) exceeds the KV memory of the batch ({limit} bytes)")]
    NeverFits {
        /// Bytes its cache needs.
        needed: u64,
        /// The limit.
        limit: u64,
    },
    /// A sequence with this id is already known.
    #[error("sequence {0} is already queued or running")]
    DuplicateId(u64),
}

/// What happened to a sequence in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqEvent {
    /// Its next token (an end token too, before [`SeqEvent::Finished`]).
    Token(u32),
    /// It is done and its memory freed.
    Finished(FinishReason),
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced one of its end tokens.
    EndToken,
    /// It reached its `max_new_tokens`.
    Length,
}

/// A [`Batcher`]'s state, for monitoring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchGauges {
    /// Sequences running (reading their prompt or decoding).
    pub running: usize,
    /// Sequences waiting to start.
    pub waiting: usize,
    /// Bytes the running sequences' KV caches hold (reserved for all their positions).
    pub kv_bytes: u64,
    /// The limit on those bytes.
    pub kv_limit_bytes: u64,
    /// Sequences in the last step.
    pub last_batch: usize,
    /// Rows (new positions) of the last step.
    pub last_rows: usize,
    /// Steps run.
    pub steps: u64,
    /// A mixture-of-experts model's expert cache: hits and misses so far (`None` without one).
    pub expert_cache: Option<(u64, u64)>,
}

/// A sequence's sampler: on the device where the logits are (only the id crosses), or the
/// host's `LogitsProcessor`.
enum Sampler {
    Host(Box<LogitsProcessor>),
    Device(Box<DeviceSampler>),
}

impl Sampler {
    fn new(p: &SamplingParams, on_gpu: bool) -> Result<Self> {
        let temperature = p.temperature.filter(|&t| t > 0.0);
        let top_p = temperature.and(p.top_p);
        Ok(if on_gpu {
            Self::Device(Box::new(DeviceSampler::new(p.seed, temperature, top_p)?))
        } else {
            Self::Host(Box::new(LogitsProcessor::new(p.seed, temperature, top_p)))
        })
    }

    fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        match self {
            Self::Host(s) => s.sample_token(logits),
            Self::Device(s) => s.sample_token(logits),
        }
    }

    /// Greedy on the device: the argmax of its row, which a step takes for all such rows
    /// at once.
    fn device_greedy(&self) -> bool {
        matches!(self, Self::Device(s) if s.is_greedy())
    }
}

struct Running {
    id: u64,
    req: SeqRequest,
    cache: Cache,
    kv_bytes: u64,
    /// Prompt positions already in the cache.
    read: usize,
    /// Tokens generated; the last one is the next step's input.
    generated: Vec<u32>,
    sampler: Sampler,
}

impl Running {
    fn decoding(&self) -> bool {
        self.read == self.req.prompt.len()
    }
}

/// Runs sequences as one batch that they join and leave between steps.
pub struct Batcher {
    model: Arc<Llama>,
    opts: BatchOptions,
    waiting: VecDeque<(u64, SeqRequest)>,
    running: Vec<Running>,
    kv_bytes: u64,
    last: (usize, usize),
    steps: u64,
    /// Why the model can no longer step: a step of a multi-process model failed, which leaves
    /// its ranks apart (one may have run the step, another not, or be gone).
    broken: Option<String>,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("opts", &self.opts)
            .field("gauges", &self.gauges())
            .finish()
    }
}

impl Batcher {
    /// A batcher over `model`.
    pub fn new(model: Arc<Llama>, opts: BatchOptions) -> Self {
        Self {
            model,
            opts,
            waiting: VecDeque::new(),
            running: Vec::new(),
            kv_bytes: 0,
            last: (0, 0),
            steps: 0,
            broken: None,
        }
    }

    /// Why the model can no longer step, once a step of a multi-process model failed (every
    /// later step fails with it): a server says so in its health.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// The model.
    pub fn model(&self) -> &Arc<Llama> {
        &self.model
    }

    /// Its options.
    pub fn options(&self) -> &BatchOptions {
        &self.opts
    }

    /// Bytes the KV cache of a sequence of `positions` positions takes.
    pub fn kv_bytes(&self, positions: usize) -> u64 {
        self.model
            .config()
            .kv_cache_bytes(positions, self.model.dtype())
    }

    /// Whether `req` could ever run (it may still wait for room).
    pub fn check(&self, req: &SeqRequest) -> std::result::Result<(), Rejection> {
        if req.prompt.is_empty() {
            return Err(Rejection::EmptyPrompt);
        }
        if req.max_new_tokens == 0 {
            return Err(Rejection::NoNewTokens);
        }
        let positions = req.prompt.len() + req.max_new_tokens;
        if positions > self.opts.max_len {
            return Err(Rejection::TooLong {
                prompt: req.prompt.len(),
                new: req.max_new_tokens,
                max_len: self.opts.max_len,
            });
        }
        let needed = self.kv_bytes(positions);
        if needed > self.opts.kv_limit_bytes {
            return Err(Rejection::NeverFits {
                needed,
                limit: self.opts.kv_limit_bytes,
            });
        }
        Ok(())
    }

    /// Queues `req` as sequence `id`; it starts at a later step.
    pub fn submit(&mut self, id: u64, req: SeqRequest) -> std::result::Result<(), Rejection> {
        self.check(&req)?;
        if self.waiting.iter().any(|(i, _)| *i == id) || self.running.iter().any(|r| r.id == id) {
            return Err(Rejection::DuplicateId(id));
        }
        self.waiting.push_back((id, req));
        Ok(())
    }

    /// Drops sequence `id`, waiting or running, and frees its cache. False if unknown.
    pub fn cancel(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|(w, _)| *w == id) {
            self.waiting.remove(i);
            return true;
        }
        match self.running.iter().position(|r| r.id == id) {
            Some(i) => {
                let r = self.running.remove(i);
                self.kv_bytes -= r.kv_bytes;
                // The other ranks of a multi-process model drop its caches at the next step.
                self.model.release_sequence(id);
                true
            }
            None => false,
        }
    }

    /// Drops every sequence (after a failed step); returns their ids.
    pub fn abort_all(&mut self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.running.drain(..).map(|r| r.id).collect();
        for &id in &ids {
            self.model.release_sequence(id);
        }
        ids.extend(self.waiting.drain(..).map(|(id, _)| id));
        self.kv_bytes = 0;
        ids
    }

    /// Nothing waits or runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// The current state.
    pub fn gauges(&self) -> BatchGauges {
        BatchGauges {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_bytes: self.kv_bytes,
            kv_limit_bytes: self.opts.kv_limit_bytes,
            last_batch: self.last.0,
            last_rows: self.last.1,
            steps: self.steps,
            expert_cache: self.model.expert_stats().map(|s| s.totals()),
        }
    }

    /// Starts the waiting sequences that fit, in order (the first that does not fit waits,
    /// and so do those behind it).
    fn admit(&mut self) -> Result<()> {
        let on_gpu = self.model.runtime().device().is_cuda();
        let sizes: Vec<u64> = self
            .waiting
            .iter()
            .map(|(_, r)| self.kv_bytes(r.prompt.len() + r.max_new_tokens))
            .collect();
        let n = admissible(&sizes, self.running.len(), self.kv_bytes, &self.opts);
        for bytes in sizes.into_iter().take(n) {
            let Some((id, req)) = self.waiting.pop_front() else {
                break;
            };
            let positions = req.prompt.len() + req.max_new_tokens;
            let sampler = Sampler::new(&req.sampling, on_gpu)?;
            self.running.push(Running {
                id,
                cache: Cache::new(self.model.config().num_hidden_layers, positions),
                kv_bytes: bytes,
                read: 0,
                generated: Vec::new(),
                sampler,
                req,
            });
            self.kv_bytes += bytes;
        }
        Ok(())
    }

    /// Runs two short requests through every kind of step a batch takes (a prompt chunk of
    /// [`PREFILL_WARM_ROWS`] positions or the context's room, a short one, decode steps of
    /// one and of both sequences) and drops them: a server calls it before its first request,
    /// as llama-server runs a warm-up pass, so that what the first use of each path costs
    /// once on a GPU (kernel modules loaded, cuBLAS's first GEMMs, the memory pool's growth)
    /// is not in a user's time to first token. Refused unless the batcher is idle; it is
    /// idle again after.
    pub fn warm_up(&mut self) -> Result<()> {
        if !self.is_idle() {
            candle_core::bail!("warm_up: the batcher is serving requests");
        }
        // Two new tokens where the context leaves room (a decode step after the prompt's), one
        // where it leaves less; nothing to warm in a context of one position.
        let new = if self.opts.max_len >= 3 { 2 } else { 1 };
        let Some(room) = self.opts.max_len.checked_sub(new).filter(|&r| r > 0) else {
            return Ok(());
        };
        let long = PREFILL_WARM_ROWS
            .min(self.opts.prompt_chunk)
            .min(room)
            .max(1);
        let short = 4.min(room);
        let _span = tracing::debug_span!("batch.warm_up", long, short).entered();
        let request = |n: usize| SeqRequest {
            // Token 0 exists in every vocabulary.
            prompt: vec![0; n],
            max_new_tokens: new,
            sampling: SamplingParams::default(),
            end_tokens: Vec::new(),
        };
        let ids = [u64::MAX, u64::MAX - 1];
        for (id, n) in ids.into_iter().zip([long, short]) {
            // A request the limits refuse (a KV memory below its cache) is left out: the
            // warm-up never stops a server from starting.
            if let Err(why) = self.submit(id, request(n)) {
                tracing::debug!(%why, positions = n + new, "warm_up: a request left out");
            }
        }
        let mut steps = 0;
        while !self.is_idle() {
            self.step()?;
            steps += 1;
            if steps > 4 * (long + short) {
                self.abort_all();
                candle_core::bail!("warm_up: the requests did not finish");
            }
        }
        self.steps = 0;
        self.last = (0, 0);
        Ok(())
    }

    /// One step: admits what fits, runs one forward pass over the step's sequences, samples
    /// the next token of each that finished its prompt, and retires the finished ones.
    /// Returns what happened to each sequence, in order. Nothing to do: no events.
    pub fn step(&mut self) -> Result<Vec<(u64, SeqEvent)>> {
        self.admit()?;
        let states: Vec<SeqState> = self
            .running
            .iter()
            .map(|r| SeqState {
                prompt_left: r.req.prompt.len() - r.read,
            })
            .collect();
        let plan = plan_step(&states, &self.opts);
        let rows: usize = plan.iter().map(|&(_, n)| n).sum();
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        // The whole step, its sampling (which waits for the device) included.
        let _span = tracing::debug_span!("batch.step", seqs = plan.len(), rows).entered();
        let logits = {
            let mut taken: Vec<Option<&mut Running>> = self.running.iter_mut().map(Some).collect();
            let mut seqs = Vec::with_capacity(plan.len());
            for &(i, n) in &plan {
                let Some(r) = taken[i].take() else {
                    candle_core::bail!("sequence {i} planned twice");
                };
                let tokens: Vec<u32> = if r.decoding() {
                    r.generated.last().copied().into_iter().collect()
                } else {
                    r.req.prompt[r.read..r.read + n].to_vec()
                };
                seqs.push(RaggedSeq {
                    id: r.id,
                    tokens,
                    cache: &mut r.cache,
                });
            }
            if let Some(why) = &self.broken {
                candle_core::bail!("{why}");
            }
            self.model.begin_step()?;
            let logits = match self.model.forward_ragged(&mut seqs) {
                Ok(l) => l,
                Err(e) => {
                    if self.model.transport().is_some() {
                        self.broken = Some(format!("the pipeline of ranks failed: {e}"));
                    }
                    return Err(e);
                }
            };
            self.model.end_step()?;
            logits
        };
        self.steps += 1;
        self.last = (plan.len(), rows);
        // The greedy sequences on the device take their argmax from one launch and one copy
        // for the whole step.
        let greedy = if plan
            .iter()
            .any(|&(i, _)| self.running[i].sampler.device_greedy())
        {
            Some(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
        } else {
            None
        };
        let mut events = Vec::new();
        let mut finished = Vec::new();
        for (k, &(i, n)) in plan.iter().enumerate() {
            let r = &mut self.running[i];
            if !r.decoding() {
                r.read += n;
                if !r.decoding() {
                    // More of the prompt to read: its logits are not used.
                    continue;
                }
            }
            let t = match &greedy {
                Some(ids) if r.sampler.device_greedy() => ids[k],
                _ => r.sampler.sample(&logits.get(k)?)?,
            };
            next_token(r, t, &mut events, &mut finished);
        }
        for id in finished {
            self.cancel(id);
        }
        Ok(events)
    }
}

/// What the step planner needs of a running sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqState {
    /// Prompt positions not yet in its cache (0: it decodes).
    pub prompt_left: usize,
}

/// The sequences of a step and how many new positions each brings, in the order they run:
/// every decoding sequence's one token, then prompt chunks (at most
/// [`BatchOptions::prompt_chunk`] each, in the order of `states`) while the rows stay within
/// [`BatchOptions::step_tokens`]; the first chunk always goes, so that prompts progress even
/// beside many decoding sequences. Pure.
pub fn plan_step(states: &[SeqState], opts: &BatchOptions) -> Vec<(usize, usize)> {
    let mut plan: Vec<(usize, usize)> = states
        .iter()
        .enumerate()
        .filter(|(_, s)| s.prompt_left == 0)
        .map(|(i, _)| (i, 1))
        .collect();
    let mut rows = plan.len();
    let mut first_chunk = true;
    for (i, s) in states.iter().enumerate() {
        if s.prompt_left == 0 {
            continue;
        }
        let n = s.prompt_left.min(opts.prompt_chunk.max(1));
        if !first_chunk && rows + n > opts.step_tokens {
            break;
        }
        plan.push((i, n));
        rows += n;
        first_chunk = false;
    }
    plan
}

/// How many of the waiting sequences (their KV bytes in arrival order) start now, beside
/// `running` sequences holding `kv_bytes`: first come first served, while fewer than
/// [`BatchOptions::max_running`] run and each one's bytes fit under
/// [`BatchOptions::kv_limit_bytes`]; the first that does not fit waits, and so do those behind
/// it. Pure.
pub fn admissible(waiting: &[u64], running: usize, kv_bytes: u64, opts: &BatchOptions) -> usize {
    let mut used = kv_bytes;
    let room = opts.max_running.saturating_sub(running);
    waiting
        .iter()
        .take(room)
        .take_while(|&&b| {
            let fits = used.saturating_add(b) <= opts.kv_limit_bytes;
            if fits {
                used += b;
            }
            fits
        })
        .count()
}

/// Records `t` as sequence `r`'s next token, and whether `r` is done.
fn next_token(r: &mut Running, t: u32, events: &mut Vec<(u64, SeqEvent)>, finished: &mut Vec<u64>) {
    r.generated.push(t);
    events.push((r.id, SeqEvent::Token(t)));
    let reason = if r.req.end_tokens.contains(&t) {
        Some(FinishReason::EndToken)
    } else if r.generated.len() >= r.req.max_new_tokens {
        Some(FinishReason::Length)
    } else {
        None
    };
    if let Some(reason) = reason {
        events.push((r.id, SeqEvent::Finished(reason)));
        finished.push(r.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opts(step_tokens: usize, prompt_chunk: usize) -> BatchOptions {
        BatchOptions {
            max_running: 64,
            step_tokens,
            prompt_chunk,
            kv_limit_bytes: 1000,
            max_len: 4096,
        }
    }

    proptest! {
        /// Every decoding sequence runs each step with one token; prompt chunks follow in
        /// order, each at most a chunk and never more than the prompt left; the rows stay
        /// within the step's unless the first chunk alone exceeds them; at least one prompt
        /// progresses whenever one waits; no sequence runs twice.
        #[test]
        fn steps_keep_decoders_and_bound_rows(
            left in proptest::collection::vec(prop_oneof![Just(0usize), 1usize..700], 0..20),
            step_tokens in 1usize..600,
            chunk in 1usize..300,
        ) {
            let states: Vec<SeqState> = left.iter().map(|&l| SeqState { prompt_left: l }).collect();
            let o = opts(step_tokens, chunk);
            let plan = plan_step(&states, &o);
            let mut seen = std::collections::HashSet::new();
            for &(i, _) in &plan {
                prop_assert!(seen.insert(i), "sequence {} twice", i);
            }
            for (i, s) in states.iter().enumerate() {
                if s.prompt_left == 0 {
                    prop_assert!(plan.contains(&(i, 1)), "decoder {} left out", i);
                }
            }
            let prompts: Vec<(usize, usize)> =
                plan.iter().copied().filter(|&(i, _)| states[i].prompt_left > 0).collect();
            for w in prompts.windows(2) {
                prop_assert!(w[0].0 < w[1].0, "prompt chunks out of order");
            }
            for &(i, n) in &prompts {
                prop_assert!(n >= 1 && n <= chunk && n <= states[i].prompt_left);
            }
            let rows: usize = plan.iter().map(|&(_, n)| n).sum();
            let decoders = plan.len() - prompts.len();
            if prompts.len() > 1 {
                prop_assert!(rows <= step_tokens, "{} rows over {}", rows, step_tokens);
            }
            if states.iter().any(|s| s.prompt_left > 0) {
                prop_assert!(!prompts.is_empty(), "no prompt progressed");
                // The first waiting prompt is the one that goes first.
                let first = states.iter().position(|s| s.prompt_left > 0);
                prop_assert_eq!(Some(prompts[0].0), first);
            }
            prop_assert!(decoders + prompts.len() == plan.len());
        }

        /// Admission is a prefix of the queue, never exceeds the running count or the KV
        /// limit, and stops only where the next one does not fit.
        #[test]
        fn admission_is_fifo_within_limits(
            waiting in proptest::collection::vec(1u64..600, 0..12),
            running in 0usize..6,
            used in 0u64..1000,
            max_running in 1usize..8,
        ) {
            let o = BatchOptions { max_running, ..opts(512, 256) };
            let n = admissible(&waiting, running, used, &o);
            prop_assert!(running + n <= max_running.max(running));
            let taken: u64 = waiting[..n].iter().sum();
            prop_assert!(used + taken <= 1000 || n == 0);
            if n < waiting.len() && running + n < max_running {
                prop_assert!(used + taken + waiting[n] > 1000, "{} left waiting though it fits", n);
            }
        }
    }
}
