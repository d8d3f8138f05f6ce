//! A ragged step: several sequences, each with its own KV cache and position, in one forward
//! pass. Their new positions (a decode token, or a chunk of a prompt) are the rows of one
//! batch that runs together through every weight (so a layer's weights are read, or fetched,
//! once for all of them) and apart only in the attention, each over its own cache
//! ([`DecoderBlock::forward_ragged`](crate::DecoderBlock::forward_ragged)). This is what
//! continuous batching ([`crate::batching`]) runs.

use std::ops::Range;

use candle_core::{Result, Tensor};

use super::model::{CausalLm, Stage};
use crate::family::{Hidden, RaggedSegment, StepCtx};
use crate::layers::{Cache, Masks};

/// One sequence of a ragged step: its new tokens and its cache (which holds its earlier
/// positions and receives these).
#[derive(Debug)]
pub struct RaggedSeq<'a> {
    /// The sequence's id, the same at every step (a batcher's request id): the other ranks of
    /// a multi-process run keep their caches of it by this id.
    pub id: u64,
    /// The new tokens (at least one).
    pub tokens: Vec<u32>,
    /// The sequence's KV cache.
    pub cache: &'a mut Cache,
}

/// What every layer of a ragged pass reads of its sequences: each one's rows and position,
/// and for a captured decode step each layer's caches and positions on the device, I64
/// (layers, sequences, 3).
#[derive(Clone, Copy)]
struct RaggedPass<'a> {
    segs: &'a [RaggedSegment],
    tables: Option<&'a Tensor>,
}

impl CausalLm {
    /// Logits (sequences, vocab) in f32 of each sequence's last new position, after one
    /// forward pass over all of `seqs`' new tokens, each at the positions after its cache's.
    /// One sequence runs as [`forward`](Self::forward) does (the same passes, CUDA graphs
    /// included); several run eagerly, with host layers where the model has them (a step of
    /// more than [`HOST_STEP_ROWS`](super::HOST_STEP_ROWS) rows that reads a prompt runs them on the GPU, as a
    /// prompt does).
    pub fn forward_ragged(&self, seqs: &mut [RaggedSeq<'_>]) -> Result<Tensor> {
        if seqs.is_empty() {
            candle_core::bail!("a ragged step of no sequences");
        }
        if let Some(i) = seqs.iter().position(|s| s.tokens.is_empty()) {
            candle_core::bail!("sequence {i} of a ragged step has no new tokens");
        }
        if self.link.is_some() {
            return self.rank_ragged(seqs);
        }
        let device = self.stages[0].rt.device().clone();
        if let [one] = seqs {
            let n = one.tokens.len();
            let ids = Tensor::from_vec(one.tokens.clone(), (1, n), &device)?;
            return self.forward(&ids, one.cache.len(), one.cache);
        }
        let max_len = self.stages[0].rope.max_len();
        let mut segs = Vec::with_capacity(seqs.len());
        for (i, s) in seqs.iter().enumerate() {
            let seg = RaggedSegment {
                len: s.tokens.len(),
                index_pos: s.cache.len(),
            };
            if seg.index_pos + seg.len > max_len {
                candle_core::bail!(
                    "sequence {i}: position {} is past the {max_len} positions this model was \
                     set up for",
                    seg.index_pos + seg.len
                );
            }
            segs.push(seg);
        }
        // Every sequence decoding: replayed from a CUDA graph where one applies.
        if let Some(logits) = self.ragged_graph_step(seqs)? {
            return Ok(logits);
        }
        let rows: usize = segs.iter().map(|s| s.len).sum();
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let ids = Tensor::from_vec(ids, (1, rows), &device)?;
        let mut caches: Vec<&mut Cache> = seqs.iter_mut().map(|s| &mut *s.cache).collect();
        let _span = tracing::debug_span!("llama.forward_ragged", seqs = segs.len(), rows).entered();
        candle_offload::kernels::pool::on_cpu_step_pool(&device, rows, || {
            let xs = self.ragged_decoder(&ids, &segs, &mut caches, None)?;
            self.ragged_head(&xs, &segs)
        })
    }

    /// The logits (sequences, vocab) of each sequence's last row of a ragged step's rows `xs`
    /// (1, rows, hidden).
    pub(super) fn ragged_head(&self, xs: &Tensor, segs: &[RaggedSegment]) -> Result<Tensor> {
        let last: Vec<u32> = segs
            .iter()
            .scan(0usize, |end, s| {
                *end += s.len;
                Some(*end as u32 - 1)
            })
            .collect();
        let last = Tensor::new(last, xs.device())?;
        self.head(&xs.index_select(&last, 1)?)?.squeeze(0)
    }

    /// [`decoder`](Self::decoder) for a ragged step; with `tables` (a captured decode step),
    /// each layer's caches and positions read on the device from its row of them, I64
    /// (layers, sequences, 3).
    pub(super) fn ragged_decoder(
        &self,
        ids: &Tensor,
        segs: &[RaggedSegment],
        caches: &mut [&mut Cache],
        tables: Option<&Tensor>,
    ) -> Result<Tensor> {
        let xs = self.embed_rows(ids)?;
        self.ragged_layers(xs, segs, caches, tables)
    }

    /// The layers of a ragged step over the rows `xs` (1, rows, hidden): every stage of this
    /// process's model.
    pub(super) fn ragged_layers(
        &self,
        xs: Tensor,
        segs: &[RaggedSegment],
        caches: &mut [&mut Cache],
        tables: Option<&Tensor>,
    ) -> Result<Tensor> {
        let rows = xs.dim(1)?;
        let prompt = segs.iter().any(|s| s.len > 1);
        self.run_stages(
            xs,
            &self.stages[0],
            prompt,
            rows,
            |stage, layers, xs, on_gpu| {
                let pass = RaggedPass { segs, tables };
                self.run_ragged_segment(stage, layers, xs, pass, caches, on_gpu)
            },
        )
    }

    /// [`run_segment`](Self::run_segment) for a ragged step.
    fn run_ragged_segment(
        &self,
        stage: &Stage,
        layers: Range<usize>,
        xs: &Tensor,
        RaggedPass { segs, tables }: RaggedPass<'_>,
        caches: &mut [&mut Cache],
        prompt_on_gpu: bool,
    ) -> Result<Tensor> {
        let device = stage.rt.device();
        let first = &self.stages[0];
        let host_run = (std::ptr::eq(stage, first) && !self.on_host.is_empty())
            .then(|| (std::time::Instant::now(), layers.len()));
        let mut hidden = Hidden::Whole(xs.to_dtype(stage.dtype)?);
        // Each sequence's attention makes its own masks; the blocks read none of these.
        let masks = Masks::new(xs.dim(1)?, 0, device);
        let experts = self.stage_experts(stage);
        let fused = self.stage_fused(stage);
        let units = self.layout.experts.is_some().then_some(experts.units());
        for l in layers {
            let table = tables.map(|t| t.get(l)).transpose()?;
            let ctx = StepCtx {
                index_pos: 0,
                rope: &stage.rope,
                masks: &masks,
                fused,
                pos_dev: None,
                ragged_table: table.as_ref(),
                experts: units,
            };
            if !self.on_host.is_empty() {
                for c in caches.iter_mut() {
                    c.place(l, device, stage.dtype)?;
                }
            }
            let unit = stage.rt.acquire(self.units.layer(l)?)?;
            let block = self.layer_block(&unit, l, stage.dtype)?;
            let _span = tracing::trace_span!("llama.layer", l).entered();
            let mut kvs: Vec<_> = caches.iter_mut().map(|c| &mut c.kvs[l]).collect();
            hidden = block.0.forward_ragged(hidden, &ctx, segs, &mut kvs)?;
            if prompt_on_gpu && self.on_host[l] {
                for c in caches.iter_mut() {
                    c.place(l, first.rt.device(), first.dtype)?;
                }
            }
        }
        let out = hidden.into_tensor()?;
        if let Some((t0, n)) = host_run {
            self.add_host_time(n, t0.elapsed().as_secs_f64());
        }
        Ok(out)
    }
}
