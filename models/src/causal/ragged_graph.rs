//! Ragged decode steps replayed from a CUDA graph: a continuous batch's steps in which every
//! sequence decodes one token, each over its own KV cache, captured once for a set of
//! sequences and replayed while the same sequences decode (`graph.rs` does the same for one
//! sequence or a padded batch of one cache). Off by default
//! ([`CausalLm::set_ragged_graphs`], `Tuning::ragged_graphs`).
//!
//! What changes between replays lives in device buffers the graph reads: the sequences'
//! tokens, and per layer each sequence's cache addresses and position (the table
//! [`candle_offload::kernels::attention::ragged_decode_attention_at`] reads), written before
//! each launch; the attention splits the keys for the largest capacity, which bounds every
//! position a replay brings. A graph is replayed only for the same sequences (the same cache
//! buffers, in the same order), each with room for its next position, while the units
//! resident at its capture stay; otherwise it is captured again. Where it cannot apply (host
//! layers or head, several devices, weights that stream, a prompt chunk in the step, a block
//! that cannot read the positions on the device, a failed capture) the step runs eagerly.

use std::sync::atomic::Ordering;

use candle_core::{DType, Result, Tensor};
use candle_offload::kernels::attention::{ragged_seq_table, set_ragged_positions, RaggedDecodeSeq};

use super::graph_state::RaggedCaptured;
use super::model::CausalLm;
use super::ragged::RaggedSeq;
use crate::family::RaggedSegment;

impl CausalLm {
    /// Whether ragged decode steps (several sequences, each with its own KV cache) are
    /// captured as CUDA graphs and replayed, where [`graphs`](Self::graphs) are on too (off by
    /// default: [`candle_offload::Tuning::ragged_graphs`]). Switching it on again also retries
    /// a capture that failed.
    pub fn set_ragged_graphs(&self, on: bool) {
        self.graphs.ragged_on.store(on, Ordering::Relaxed);
        if let Ok(mut st) = self.graphs.state.lock() {
            st.ragged_refused = None;
            if !on {
                st.ragged = None;
            }
        }
    }

    /// Whether ragged decode steps are captured ([`set_ragged_graphs`](Self::set_ragged_graphs)).
    pub fn ragged_graphs(&self) -> bool {
        self.graphs.ragged_on.load(Ordering::Relaxed)
    }

    /// The logits (sequences, vocab) of a ragged step in which every one of `seqs` decodes one
    /// token, replayed from the captured graph or captured now; `None` where no graph applies
    /// (the caller then runs the step eagerly; nothing has changed).
    pub(super) fn ragged_graph_step(&self, seqs: &mut [RaggedSeq<'_>]) -> Result<Option<Tensor>> {
        let n = seqs.len();
        if !self.graphs()
            || !self.ragged_graphs()
            || n < 2
            || seqs.iter().any(|s| s.tokens.len() != 1)
        {
            return Ok(None);
        }
        let stage = &self.stages[0];
        let on_host = self.on_host.contains(&true) || self.head_on_host;
        if self.stages.len() != 1 || !stage.rt.device().is_cuda() || on_host {
            return Ok(None);
        }
        let mut st =
            self.graphs.state.lock().map_err(|_| {
                candle_core::Error::Msg("the graph state's lock is poisoned".into())
            })?;
        if let Some(why) = &st.ragged_refused {
            let why = format!("an earlier ragged capture failed: {why}");
            return Ok(st.eager(why));
        }
        if !self.stage_fused(stage) {
            return Ok(st.eager("the fused ops are off".into()));
        }
        if let Some(p) = stage.phase {
            stage.rt.set_reserve_bytes(p.decode)?;
        }
        // Every sequence's caches allocated, at its position, with room for one more.
        let layers = self.cfg.num_hidden_layers;
        let max_len = stage.rope.max_len();
        let mut kv = Vec::with_capacity(n * layers);
        let mut positions = Vec::with_capacity(n);
        for s in seqs.iter() {
            let pos = s.cache.len();
            let room = pos < max_len
                && s.cache
                    .kvs
                    .iter()
                    .all(|c| c.k_buffer().is_some() && c.len() == pos && c.capacity() > pos);
            if !room {
                return Ok(st.eager("a sequence's KV cache is not allocated, or full".into()));
            }
            kv.extend(s.cache.kvs.iter().map(|c| c.k_buffer().map(Tensor::id)));
            positions.push(pos);
        }
        let ids: Vec<u32> = seqs.iter().map(|s| s.tokens[0]).collect();
        let device = stage.rt.device();
        if let Some(c) = st.ragged.as_mut().filter(|c| c.kv == kv) {
            // The same caches: only the positions move.
            set_ragged_positions(&mut c.table, &positions)?;
            c.ids
                .slice_set(&Tensor::from_vec(ids.clone(), (1, n), device)?, 0, 0)?;
            let table = Tensor::from_vec(c.table.clone(), (layers, n, 3), device)?;
            c.tables.slice_set(&table, 0, 0)?;
            if stage.rt.replay_step(&c.graph)? {
                for s in seqs.iter_mut() {
                    for c in &mut s.cache.kvs {
                        c.replayed(1);
                    }
                }
                let logits = c.logits.copy()?;
                st.stats.ragged_replays += 1;
                return Ok(Some(logits));
            }
            tracing::debug!("units moved since the capture: capturing the ragged step again");
        }
        let mut table = Vec::with_capacity(layers * n * 3);
        for l in 0..layers {
            let mut list = Vec::with_capacity(n);
            for (s, &pos) in seqs.iter().zip(&positions) {
                let Some((k_cache, v_cache)) = s.cache.kvs[l].buffers() else {
                    return Ok(st.eager("a sequence's KV cache is not allocated".into()));
                };
                list.push(RaggedDecodeSeq {
                    k_cache,
                    v_cache,
                    pos,
                });
            }
            table.extend(ragged_seq_table(&list)?);
        }
        // An old graph may still run: the driver frees an executable graph in flight only when
        // it completes, and its buffers are freed in the stream's order.
        st.ragged = None;
        if !stage.rt.all_resident()? {
            return Ok(st.eager("weights stream (not every unit is resident)".into()));
        }
        let _span = tracing::debug_span!("llama.capture_ragged", sequences = n).entered();
        let ids = Tensor::from_vec(ids, (1, n), device)?;
        let tables = Tensor::from_vec(table.clone(), (layers, n, 3), device)?;
        let logits = Tensor::zeros((n, self.cfg.vocab_size), DType::F32, device)?;
        let segs: Vec<RaggedSegment> = positions
            .iter()
            .map(|&index_pos| RaggedSegment { len: 1, index_pos })
            .collect();
        let mut caches: Vec<&mut crate::layers::Cache> =
            seqs.iter_mut().map(|s| &mut *s.cache).collect();
        // Run twice (a warm-up, then captured): each run starts from the same positions.
        let captured = stage.rt.capture_step(|| {
            rewind(&mut caches, &positions);
            let xs = self.ragged_decoder(&ids, &segs, &mut caches, Some(&tables))?;
            let out = self.head(&xs)?.squeeze(0)?;
            logits.slice_set(&out, 0, 0)
        });
        let graph = match captured {
            Ok((graph, ())) => graph,
            Err(e) => {
                // The step runs eagerly from the positions it started at.
                rewind(&mut caches, &positions);
                let why = e.to_string();
                st.ragged_refused = Some(why.clone());
                return Ok(st.eager(format!("the ragged capture failed: {why}")));
            }
        };
        // The capture ran nothing: its first launch computes this step.
        if !stage.rt.replay_step(&graph)? {
            candle_core::bail!("units moved between the ragged capture and its first launch");
        }
        let out = logits.copy()?;
        st.stats.ragged_captures += 1;
        st.ragged = Some(RaggedCaptured {
            graph,
            kv,
            ids,
            tables,
            table,
            logits,
        });
        Ok(Some(out))
    }
}

/// Each sequence's caches back to its position before the step (`positions`, one a cache).
fn rewind(caches: &mut [&mut crate::layers::Cache], positions: &[usize]) {
    for (c, &pos) in caches.iter_mut().zip(positions) {
        for kv in &mut c.kvs {
            kv.rewind(pos);
        }
    }
}
