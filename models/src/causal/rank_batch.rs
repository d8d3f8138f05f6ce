//! Continuous batching over the ranks of a multi-process run: rank 0 runs the batcher (and,
//! under `serve`, speaks HTTP); every step goes down the pipeline as a plan and a hidden state.
//!
//! A step's plan ([`RankStep::Step`]) names each sequence by its id (the batcher's request
//! id), with its new rows, its first position and the positions its cache is for, and the
//! sequences that ended since the last step. Each rank keeps the KV caches of its own layers
//! by id: it makes one for an id it has not seen and drops the ended ones. Rank 0 embeds the
//! step's tokens and runs its layers; each rank takes the plan and the hidden state from the
//! one before, passes the plan on, runs its layers; the last runs the head on each sequence's
//! last row and sends the logits back to rank 0, which samples. [`RankStep::Stop`] ends the
//! other ranks' loop ([`CausalLm::follow_steps`]).

use std::collections::HashMap;

use candle_core::{Result, Tensor};
use candle_offload::dist::Transport;
use serde::{Deserialize, Serialize};

use super::model::CausalLm;
use super::ragged::RaggedSeq;
use crate::family::RaggedSegment;
use crate::layers::Cache;

/// What rank 0 sends down the pipeline before each step's hidden state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RankStep {
    /// A ragged step.
    Step {
        /// The step's sequences, in the order of its rows.
        seqs: Vec<StepSeq>,
        /// Sequences that ended since the last step: their caches go.
        ended: Vec<u64>,
    },
    /// The batcher stopped: the other ranks leave their loop.
    Stop,
}

/// One sequence of a [`RankStep::Step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepSeq {
    /// The sequence's id (the batcher's request id).
    pub id: u64,
    /// Its new rows in this step.
    pub rows: usize,
    /// The position of its first new row (its cache's length before the step).
    pub index_pos: usize,
    /// The positions its cache is for (its prompt and its new tokens at most).
    pub positions: usize,
}

impl CausalLm {
    /// [`forward_ragged`](Self::forward_ragged) on rank 0 of a multi-process run: the plan and
    /// the hidden state of this rank's layers to the next rank, the logits (sequences, vocab)
    /// back from the last.
    pub(super) fn rank_ragged(&self, seqs: &mut [RaggedSeq<'_>]) -> Result<Tensor> {
        let link = self
            .link
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("not a rank's model".into()))?;
        let t = link.transport.as_ref();
        if !link.first {
            candle_core::bail!(
                "rank {}: only rank 0 runs the batcher; the others follow its steps",
                t.rank()
            );
        }
        let plan = RankStep::Step {
            seqs: seqs
                .iter()
                .map(|s| StepSeq {
                    id: s.id,
                    rows: s.tokens.len(),
                    index_pos: s.cache.len(),
                    positions: s.cache.capacity(),
                })
                .collect(),
            ended: std::mem::take(
                &mut *link
                    .ended
                    .lock()
                    .map_err(|_| candle_core::Error::Msg("the ended list is poisoned".into()))?,
            ),
        };
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let device = self.stages[0].rt.device().clone();
        let ids = Tensor::from_vec(ids.clone(), (1, ids.len()), &device)?;
        let mut caches: Vec<&mut Cache> = seqs.iter_mut().map(|s| &mut *s.cache).collect();
        let out = self.rank_pass(t, &plan, Some(&ids), &mut caches)?;
        match out {
            Some(logits) => Ok(logits),
            None => Ok(t.recv_tensor(t.world_size() - 1, &device)?),
        }
    }

    /// Hands the id of a sequence that ended (finished or cancelled) to the next step's
    /// plan, so that the other ranks drop its caches; nothing for a model whole in this
    /// process.
    pub fn release_sequence(&self, id: u64) {
        if let Some(link) = &self.link {
            if let Ok(mut e) = link.ended.lock() {
                e.push(id);
            }
        }
    }

    /// Tells the other ranks that rank 0's batcher stopped ([`follow_steps`](Self::follow_steps)
    /// returns on each); nothing for a model whole in this process or a rank other than 0.
    pub fn stop_ranks(&self) -> Result<()> {
        match &self.link {
            Some(link) if link.first && !link.last => {
                send_plan(link.transport.as_ref(), &RankStep::Stop)
            }
            _ => Ok(()),
        }
    }

    /// A rank other than 0 under a batching rank 0: runs each step rank 0 sends down the
    /// pipeline over this rank's layers, its sequences' caches kept by id, until
    /// [`RankStep::Stop`]. Returns the number of steps run.
    pub fn follow_steps(&self) -> Result<u64> {
        let link = self
            .link
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("not a rank's model".into()))?;
        let t = link.transport.as_ref();
        if link.first {
            candle_core::bail!("rank 0 runs the batcher: it has no steps to follow");
        }
        let mut caches: HashMap<u64, Cache> = HashMap::new();
        let layers = self.cfg.num_hidden_layers;
        let mut steps = 0u64;
        loop {
            let bytes = t.recv_bytes(t.rank() - 1)?;
            let plan: RankStep = serde_json::from_slice(&bytes).map_err(|e| {
                candle_core::Error::Msg(format!(
                    "rank {}: sent a step plan that does not read: {e}",
                    t.rank() - 1
                ))
            })?;
            let seqs: &[StepSeq] = match &plan {
                RankStep::Stop => {
                    if !link.last {
                        send_plan(t, &plan)?;
                    }
                    return Ok(steps);
                }
                RankStep::Step { seqs, ended } => {
                    for id in ended {
                        caches.remove(id);
                    }
                    for s in seqs {
                        caches
                            .entry(s.id)
                            .or_insert_with(|| Cache::new(layers, s.positions));
                    }
                    seqs
                }
            };
            // The step's caches in its rows' order (an id twice in one step is refused).
            let mut by_id: HashMap<u64, &mut Cache> =
                caches.iter_mut().map(|(id, c)| (*id, c)).collect();
            let mut ordered = Vec::with_capacity(seqs.len());
            for s in seqs {
                let c = by_id.remove(&s.id).ok_or_else(|| {
                    candle_core::Error::Msg(format!("sequence {} twice in one step", s.id))
                })?;
                ordered.push(c);
            }
            if let Some(logits) = self.rank_pass(t, &plan, None, &mut ordered)? {
                t.send_tensor(0, &logits)?;
            }
            steps += 1;
        }
    }

    /// One rank's share of a ragged step: the plan on to the next rank, the rows (rank 0:
    /// embedded from `ids`; the others: from the rank before) through this rank's layers,
    /// then the hidden state on to the next rank, or on the last rank the logits of each
    /// sequence's last row (returned).
    fn rank_pass(
        &self,
        t: &dyn Transport,
        plan: &RankStep,
        ids: Option<&Tensor>,
        caches: &mut [&mut Cache],
    ) -> Result<Option<Tensor>> {
        let RankStep::Step { seqs, .. } = plan else {
            candle_core::bail!("a step's pass without a step");
        };
        let rank = t.rank();
        let last = rank + 1 == t.world_size();
        let segs: Vec<RaggedSegment> = seqs
            .iter()
            .map(|s| RaggedSegment {
                len: s.rows,
                index_pos: s.index_pos,
            })
            .collect();
        if let Some(i) = seqs.iter().position(|s| s.rows == 0) {
            candle_core::bail!("sequence {} of a step has no new rows", seqs[i].id);
        }
        let rows: usize = segs.iter().map(|s| s.len).sum();
        let stage = &self.stages[0];
        let max_len = stage.rope.max_len();
        if let Some(s) = segs.iter().find(|s| s.index_pos + s.len > max_len) {
            candle_core::bail!(
                "position {} is past the {max_len} positions this model was set up for",
                s.index_pos + s.len
            );
        }
        if !last {
            send_plan(t, plan)?;
        }
        let xs = match ids {
            Some(ids) => self.embed_rows(ids)?,
            None => {
                let xs = t.recv_tensor(rank - 1, stage.rt.device())?;
                if xs.dims() != [1, rows, self.cfg.hidden_size] {
                    candle_core::bail!(
                        "rank {}: sent a hidden state of shape {:?}, expected {:?}",
                        rank - 1,
                        xs.dims(),
                        [1, rows, self.cfg.hidden_size]
                    );
                }
                xs
            }
        };
        let out = candle_offload::kernels::pool::on_cpu_step_pool(stage.rt.device(), rows, || {
            let xs = self.ragged_layers(xs, &segs, caches, None)?;
            if !last {
                return Ok(xs);
            }
            self.ragged_head(&xs, &segs)
        })?;
        if last {
            return Ok(Some(out));
        }
        t.send_tensor(rank + 1, &out)?;
        Ok(None)
    }
}

/// [`CausalLm::stop_ranks`] over the transport alone (a server's rank 0 once its model is
/// gone): rank 0 sends [`RankStep::Stop`] down the pipeline; nothing on the other ranks.
pub fn stop_ranks(t: &dyn Transport) -> Result<()> {
    if t.rank() == 0 && t.world_size() > 1 {
        send_plan(t, &RankStep::Stop)?;
    }
    Ok(())
}

fn send_plan(t: &dyn Transport, plan: &RankStep) -> Result<()> {
    let bytes = serde_json::to_vec(plan)
        .map_err(|e| candle_core::Error::Msg(format!("a step plan as JSON: {e}")))?;
    Ok(t.send_bytes(t.rank() + 1, &bytes)?)
}
