//! How a model runs: a forward pass over its stages (embeddings, the runs of decoder layers on
//! each stage, the hidden state moved between them, the final norm and the output head), a
//! long prompt in passes where the model is a near fit, and each layer's block built from its
//! acquired unit. A decode step that a CUDA graph can run goes to `graph.rs` first.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, D};

use super::graph_state::DeviceInputs;
use super::model::{BuiltBlock, CausalLm, HiddenTransfer, Stage};
use crate::family::{Hidden, StepCtx, UnitWeights};
use crate::layers::{Cache, Masks};

/// The most rows (batch × new positions) of a step that runs host layers on the host; larger
/// steps of more than one new position (prompts) run them on the GPU. Decode steps stay on
/// the host whatever the batch.
pub const HOST_STEP_ROWS: usize = 8;

/// What a run of layers needs of its step beside the hidden state: the new positions, where
/// they start, each row's left padding, and for a step being captured ([`graph`](super::graph))
/// the position and padding as the graph reads them on the device.
#[derive(Clone, Copy)]
pub(super) struct StepInputs<'a> {
    pub(super) seq_len: usize,
    pub(super) index_pos: usize,
    pub(super) pads: &'a [usize],
    pub(super) on_device: Option<&'a DeviceInputs>,
}

impl CausalLm {
    pub(super) fn move_hidden(&self, xs: &Tensor, to: &Device) -> Result<Tensor> {
        let _span = tracing::debug_span!("llama.move_hidden").entered();
        let timing = self.timing.load(std::sync::atomic::Ordering::Relaxed);
        let bytes = (xs.elem_count() * xs.dtype().size_in_bytes()) as u64;
        let start = if timing {
            xs.device().synchronize()?;
            Some(std::time::Instant::now())
        } else {
            None
        };
        let out = match self.transfer {
            HiddenTransfer::Device => xs.contiguous()?.to_device(to)?,
            HiddenTransfer::Host => xs.to_device(&Device::Cpu)?.to_device(to)?,
        };
        let seconds = match start {
            Some(t0) => {
                to.synchronize()?;
                t0.elapsed().as_secs_f64()
            }
            None => 0.0,
        };
        if let Ok(mut t) = self.totals.lock() {
            t.copies += 1;
            t.bytes += bytes;
            t.seconds += seconds;
        }
        Ok(out)
    }

    /// A fresh KV cache for the positions this model was set up for.
    pub fn new_cache(&self) -> Cache {
        Cache::new(self.cfg.num_hidden_layers, self.stages[0].rope.max_len())
    }

    /// Logits (batch, vocab) in f32 for the last position of `input_ids` (batch, seq), whose
    /// first token sits at position `index_pos` (the number of tokens already in `cache`).
    pub fn forward(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        self.forward_batch(input_ids, index_pos, &[], cache)
    }

    /// [`forward`](Self::forward) for a batch of left-padded sequences: row r of `input_ids`
    /// (batch, seq) begins with `pads[r]` padding positions (any token id) that no position
    /// attends to; `pads` empty means no padding. Every row must hold at least one token by
    /// the end of this pass. Returns the logits of each row's last position, (batch, vocab).
    /// With padding, a prompt's attention runs as the masked composition; decode steps, whose
    /// new positions lie past every row's padding, take the decode attention kernel, which
    /// leaves each row's padding out (and replay from a CUDA graph like unpadded ones). The
    /// KV cache from [`new_cache`](Self::new_cache) takes any batch size. A model with a
    /// [`prompt_chunk`](Self::prompt_chunk) runs a longer pass as several, each of that many
    /// positions over the batch (the first, with padding, reaching every row's first token).
    pub fn forward_batch(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        pads: &[usize],
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let (batch, seq_len) = input_ids.dims2()?;
        let rows = self.prompt_chunk.map_or(seq_len, |c| (c / batch).max(1));
        if seq_len <= rows || (!pads.is_empty() && pads.len() != batch) {
            return self.forward_pass(input_ids, index_pos, pads, cache);
        }
        // A near fit: passes of at most `rows` positions, each within the reservation.
        let rows = even_pass_rows(seq_len, rows);
        let first = pads
            .iter()
            .map(|&p| (p + 1).saturating_sub(index_pos))
            .fold(rows, usize::max)
            .min(seq_len);
        let mut logits =
            self.forward_pass(&input_ids.narrow(1, 0, first)?, index_pos, pads, cache)?;
        for start in (first..seq_len).step_by(rows) {
            let n = rows.min(seq_len - start);
            let ids = input_ids.narrow(1, start, n)?;
            logits = self.forward_pass(&ids, index_pos + start, pads, cache)?;
        }
        Ok(logits)
    }

    /// [`forward_batch`](Self::forward_batch) as one pass.
    fn forward_pass(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        pads: &[usize],
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let _span = tracing::debug_span!("llama.forward", index_pos).entered();
        if self.link.is_some() {
            candle_core::bail!(
                "this model is one rank's share of a multi-process pipeline: run it with \
                 `rank_step` or `generation::generate_ranks`"
            );
        }
        let (batch, seq_len) = input_ids.dims2()?;
        if !pads.is_empty() && pads.len() != batch {
            candle_core::bail!("{} padding counts for a batch of {batch}", pads.len());
        }
        if let Some(&p) = pads.iter().find(|&&p| p >= index_pos + seq_len) {
            candle_core::bail!(
                "a row of {} positions is all padding ({p})",
                index_pos + seq_len
            );
        }
        candle_offload::kernels::pool::on_cpu_step_pool(
            self.runtime().device(),
            batch * seq_len,
            || {
                if let Some(logits) = self.graph_step(input_ids, index_pos, pads, cache)? {
                    return Ok(logits);
                }
                let xs = self.decoder(input_ids, index_pos, pads, None, cache)?;
                self.head(&xs.narrow(1, seq_len - 1, 1)?)?.squeeze(1)
            },
        )
    }

    /// Logits (batch, seq, vocab) in f32 for every position of `input_ids`, from position 0
    /// with a fresh KV cache (for parity tests).
    pub fn forward_all(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        let xs = self.decoder(
            input_ids,
            0,
            &[],
            None,
            &mut Cache::new(self.cfg.num_hidden_layers, seq_len),
        )?;
        self.head(&xs)
    }

    /// Decoder layer `l` built from its acquired unit in `dtype`. Where the unit's dense
    /// tensors already have that dtype (the block then holds nothing but the unit's tensors),
    /// it is built once per residency and kept with the unit (`UnitGuard::derived`): a resident
    /// model's decode step builds no layer and looks up no tensor by name. Otherwise (tensors
    /// converted on use, whose copies should not outlive the step) it is built each time.
    pub(super) fn layer_block(
        &self,
        unit: &candle_offload::UnitGuard,
        l: usize,
        dtype: DType,
    ) -> Result<Arc<BuiltBlock>> {
        let build = || -> Result<BuiltBlock> {
            let _span = tracing::trace_span!("llama.block", l).entered();
            let weights = UnitWeights::new(unit.var_builder(dtype), Some(unit))
                .with_adapters(self.adapters.clone());
            let block = self
                .family
                .block(&self.cfg, weights.pp(self.layout.layer(l)), l, dtype)?;
            Ok(BuiltBlock(block, l, dtype))
        };
        if !unit.tensors().values().all(|t| t.dtype() == dtype) {
            return Ok(Arc::new(build()?));
        }
        let kept = unit.derived(build)?;
        if (kept.1, kept.2) == (l, dtype) {
            return Ok(kept);
        }
        Ok(Arc::new(build()?))
    }

    /// Embeddings and every decoder layer, each acquired from its stage's runtime as it runs;
    /// the hidden state moves to the next stage's device at each stage boundary. `on_device`:
    /// `index_pos` and `pads` also held on the device, for a step being captured
    /// ([`graph`](super::graph)).
    pub(super) fn decoder(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        pads: &[usize],
        on_device: Option<&DeviceInputs>,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let (batch, seq_len) = input_ids.dims2()?;
        let first = &self.stages[0];
        if index_pos + seq_len > first.rope.max_len() {
            candle_core::bail!(
                "position {} is past the {} positions this model was set up for",
                index_pos + seq_len,
                first.rope.max_len()
            );
        }
        let last = &self.stages[self.stages.len() - 1];
        // A captured step of a model whose host stage only looks the embeddings up starts
        // from the looked-up rows, already on the GPU ([`graph`](super::graph)).
        let (xs, at) = match on_device.and_then(|d| d.hidden.clone()) {
            Some(rows) => (rows, last),
            None => (self.embed_rows(input_ids)?, first),
        };
        let step = StepInputs {
            seq_len,
            index_pos,
            pads,
            on_device,
        };
        self.run_stages(
            xs,
            at,
            seq_len > 1,
            batch * seq_len,
            |stage, layers, xs, on_gpu| self.run_segment(stage, layers, xs, step, cache, on_gpu),
        )
    }

    /// The stages' runs of layers over `xs` (the embedded rows, on stage `at`): each stage's
    /// reservation set for a step of `rows` rows that reads a prompt or not, the hidden state
    /// moved at each stage boundary, `run(stage, layers, xs, prompt_on_gpu)` for each run, and
    /// the result on the stage that runs the head. With host layers, a step of more rows than
    /// a decode step (a prompt) runs every layer on the GPU, the host layers streamed through
    /// its runtime, as llama.cpp copies its CPU layers to the GPU for large batches
    /// (`prompt_on_gpu`: each host layer's KV cache then moves to the host right after it).
    pub(super) fn run_stages<'s>(
        &'s self,
        mut xs: Tensor,
        mut at: &'s Stage,
        prompt: bool,
        rows: usize,
        mut run: impl FnMut(&Stage, Range<usize>, &Tensor, bool) -> Result<Tensor>,
    ) -> Result<Tensor> {
        for stage in &self.stages {
            if let Some(p) = stage.phase {
                stage
                    .rt
                    .set_reserve_bytes(if prompt { p.prompt } else { p.decode })?;
            }
        }
        let last = &self.stages[self.stages.len() - 1];
        let prompt_on_gpu = !self.on_host.is_empty() && prompt && rows > HOST_STEP_ROWS;
        let plan: Vec<(&'s Stage, Range<usize>)> = if prompt_on_gpu {
            vec![(last, 0..self.cfg.num_hidden_layers)]
        } else {
            self.segments
                .iter()
                .map(|(s, r)| (&self.stages[*s], r.clone()))
                .collect()
        };
        let runs = plan.len();
        for (i, (stage, layers)) in plan.into_iter().enumerate() {
            if !std::ptr::eq(at, stage) {
                xs = self.move_hidden(&xs, stage.rt.device())?;
                at = stage;
            }
            xs = run(stage, layers, &xs, prompt_on_gpu)?;
            if i + 1 < runs || !std::ptr::eq(stage, last) {
                // This stage idles while another computes (a later stage, or the host's next
                // run of spread layers): its copy stream fetches what it needs next, into its
                // free room (nothing on a host stage, which keeps its units).
                stage.rt.prefetch_ahead(usize::MAX)?;
            }
        }
        // Spread host layers can end on the host: the head runs on the last stage, unless it
        // runs on the host ([`head`](Self::head) moves the hidden state there).
        if !std::ptr::eq(at, last) && !self.head_on_host {
            xs = self
                .move_hidden(&xs, last.rt.device())?
                .to_dtype(last.dtype)?;
        }
        Ok(xs)
    }

    /// The decoder `layers` on `stage` over `xs` (already on its device) for `step`,
    /// `prompt_on_gpu` where a prompt runs host layers here (their KV cache then returns to
    /// the host after each). Returns the hidden state, whole, in the stage's dtype.
    pub(super) fn run_segment(
        &self,
        stage: &Stage,
        layers: Range<usize>,
        xs: &Tensor,
        step: StepInputs<'_>,
        cache: &mut Cache,
        prompt_on_gpu: bool,
    ) -> Result<Tensor> {
        let StepInputs {
            seq_len,
            index_pos,
            pads,
            on_device,
        } = step;
        let device = stage.rt.device();
        let first = &self.stages[0];
        // The host stage's runs (a model with host layers; on a CPU device the other stage
        // is on the CPU too, and not counted).
        let host_run = (std::ptr::eq(stage, first) && !self.on_host.is_empty())
            .then(|| (std::time::Instant::now(), layers.len()));
        // The layers pass the hidden state on split where they can (the residual add left
        // to the next layer's norm kernel); it is whole again between stages.
        let mut hidden = Hidden::Whole(xs.to_dtype(stage.dtype)?);
        let mut masks = Masks::padded(seq_len, index_pos, pads, device);
        if let Some(counts) = on_device.and_then(|d| d.pads.clone()) {
            masks = masks.with_pads_tensor(counts);
        }
        let experts = self.stage_experts(stage);
        let ctx = StepCtx {
            index_pos,
            rope: &stage.rope,
            masks: &masks,
            fused: self.stage_fused(stage),
            pos_dev: on_device.map(|d| &d.pos),
            ragged_table: None,
            experts: self.layout.experts.is_some().then_some(experts.units()),
        };
        for l in layers {
            if !self.on_host.is_empty() {
                cache.place(l, device, stage.dtype)?;
            }
            let unit = stage.rt.acquire(self.units.layer(l)?)?;
            let block = self.layer_block(&unit, l, stage.dtype)?;
            let _span = tracing::trace_span!("llama.layer", l).entered();
            hidden = block.0.forward_hidden(hidden, &ctx, &mut cache.kvs[l])?;
            if prompt_on_gpu && self.on_host[l] {
                cache.place(l, first.rt.device(), first.dtype)?;
            }
        }
        let out = hidden.into_tensor()?;
        if let Some((t0, n)) = host_run {
            self.add_host_time(n, t0.elapsed().as_secs_f64());
        }
        Ok(out)
    }

    /// The embedding rows of `input_ids`, looked up on the first stage, in the model's dtype
    /// (the looked-up rows, not the table, are converted).
    pub(super) fn embed_rows(&self, input_ids: &Tensor) -> Result<Tensor> {
        let first = &self.stages[0];
        let unit = first.rt.acquire(self.units.embed()?)?;
        self.family.embed(
            &self.cfg,
            UnitWeights::new(unit.var_builder(self.dtype), Some(&unit)),
            &input_ids.to_device(first.rt.device())?,
        )
    }

    /// The final norm and the output head, logits in f32: on the last stage (`xs` in its
    /// dtype), or on the host stage with [`head_on_host`](Self::head_on_host) (`xs` on either
    /// stage, moved to the host here).
    pub(super) fn head(&self, xs: &Tensor) -> Result<Tensor> {
        let (vocab, hidden) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let last = &self.stages[self.stages.len() - 1];
        // The stage that runs the head, and `xs` there in its dtype.
        let (stage, xs) = if self.head_on_host {
            // The GPU idles through the host's head: its copy stream starts the next step's
            // fetches now.
            last.rt.prefetch_ahead(usize::MAX)?;
            let host = &self.stages[0];
            // Already there when the step's last layer ran on the host.
            let xs = if xs.device().same_device(host.rt.device()) {
                xs.clone()
            } else {
                self.move_hidden(xs, host.rt.device())?
            };
            let xs = xs.to_dtype(host.dtype)?;
            (host, xs)
        } else {
            (last, xs.clone())
        };
        let xs = &xs;
        let rt = &stage.rt;
        // The host's share of the step, where it runs the head.
        let t0 = self.head_on_host.then(std::time::Instant::now);
        let xs = {
            let unit = rt.acquire(self.units.norm()?)?;
            self.family
                .final_norm(
                    &self.cfg,
                    unit.var_builder(stage.dtype).pp(&self.layout.norm),
                    stage.dtype,
                )?
                .forward(xs)?
        };
        // The head's weight (the embedding matrix when tied), multiplied as GGML blocks when
        // the unit holds it quantized.
        let logits = {
            let unit = rt.acquire(self.units.head()?)?;
            let w = UnitWeights::new(unit.var_builder(stage.dtype), Some(&unit))
                .pp(self.layout.head_unit());
            let tuning = unit.tuning().kernels;
            match w.quantized("weight", &[vocab, hidden])? {
                Some(q) => {
                    let screened = if self.greedy_head() {
                        candle_offload::kernels::linear::cpu_quant::forward_greedy(
                            &q, &xs, &tuning,
                        )?
                    } else {
                        None
                    };
                    match screened {
                        Some(logits) => logits,
                        None => crate::layers::Linear::new(
                            crate::layers::LinearWeight::Quantized(
                                candle_core::quantized::QMatMul::from_arc(q)?,
                            ),
                            None,
                            tuning,
                        )
                        .forward_with(&xs, self.stage_fused(stage))?,
                    }
                }
                None => {
                    let m = w.vb().get((vocab, hidden), "weight")?;
                    crate::layers::Linear::new(crate::layers::LinearWeight::Dense(m), None, tuning)
                        .forward_with(&xs, self.stage_fused(stage))?
                }
            }
        }
        .to_dtype(DType::F32)?;
        if let Some(t0) = t0 {
            self.add_host_time(0, t0.elapsed().as_secs_f64());
        }
        // The GPU idles until the next step reaches it (sampling, and the earlier stages
        // with host layers or a pipeline): its copy stream starts the next step's fetches now.
        if self.stages.len() > 1 && !self.head_on_host {
            rt.prefetch_ahead(usize::MAX)?;
        }
        self.family.finish_logits(&self.cfg, logits)
    }
}

/// The rows of each pass when `seq_len` positions run in passes of at most `max_rows`: the
/// fewest passes, of even length (512 under 170: four of 128, not three of 170 and one of 2),
/// so that each is as long as those passes allow (the prompt GEMM of
/// [`candle_offload::kernels::gemm::qlinear_prefill`] starts at a row count). Pure.
fn even_pass_rows(seq_len: usize, max_rows: usize) -> usize {
    let max_rows = max_rows.max(1);
    seq_len.div_ceil(seq_len.div_ceil(max_rows).max(1)).max(1)
}

/// Greedy argmax of logits (batch 1).
pub fn argmax(logits: &Tensor) -> Result<u32> {
    logits.flatten_all()?.argmax(D::Minus1)?.to_scalar::<u32>()
}

#[cfg(test)]
mod tests {
    use super::even_pass_rows;

    #[test]
    fn passes_are_even_and_fewest() {
        // (positions, most rows a pass) -> rows a pass
        for (n, max, want) in [
            (512, 170, 128),
            (512, 202, 171),
            (512, 184, 171),
            (512, 512, 512),
            (512, 600, 512),
            (513, 512, 257),
            (100, 32, 25),
            (7, 1, 1),
            (1, 0, 1),
        ] {
            let rows = even_pass_rows(n, max);
            assert_eq!(rows, want, "{n} positions under {max}");
            assert!(rows <= max.max(1), "{n} under {max}: {rows} rows");
            // No more passes than the fewest that fit.
            assert_eq!(n.div_ceil(rows), n.div_ceil(max.max(1)), "{n} under {max}");
        }
    }
}
