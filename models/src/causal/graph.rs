//! Decode steps replayed from a CUDA graph: a single-GPU model whose units are all resident
//! captures its first eligible decode step (every kernel, allocation and free of the layers and
//! the head) once, then launches the whole step with one call per token. The host's ~260
//! launches of a 7B step (as long as the GPU's work; docs/tuning.md, graphs) become one.
//!
//! What changes between replays lives in device buffers the graph reads: the token ids, the
//! position and a padded batch's left padding per row (`inputs`, written before each launch),
//! which the RoPE/KV-cache kernel and the decode attention read on the device
//! ([`candle_offload::kernels::rope::rope_qk_cache_at`], [`candle_offload::kernels::attention::decode_attention_at`]);
//! the logits land in a buffer allocated before the capture and are copied out after each
//! launch. A graph is replayed only while the units resident at its capture stay
//! ([`candle_offload::OffloadRuntime::replay_step`]), for the same batch size, padded or not,
//! and the same KV buffers; otherwise it is captured again. A model whose host stage only looks
//! the embeddings up (a near fit on one device) captures its GPU stage: the rows are looked up
//! on the host before each launch and copied where the graph reads them. A model with host
//! layers or a host head captures each run of GPU layers as a graph of its own, the host parts
//! running eagerly between launches (`pipeline_step`). Where a graph cannot apply (a prompt,
//! weights that stream, host layers, a pipeline, a new position inside a row's padding, an
//! attention the kernels do not cover, a failed capture) the step runs eagerly, and a debug
//! message says why.

use std::sync::atomic::Ordering;

use candle_core::{DType, Result, Tensor, TensorId};

use super::experts::StageExperts;
use super::forward::StepInputs;
use super::graph_state::{Captured, DeviceInputs, GpuRun, GraphStats, Pipeline, State};
use super::model::{CausalLm, Stage};
use crate::layers::Cache;

impl CausalLm {
    /// Whether single-token decode steps of a resident single-GPU model are captured once as
    /// a CUDA graph and replayed (default on). Switching it on again also retries a capture
    /// that failed.
    pub fn set_graphs(&self, on: bool) {
        self.graphs.on.store(on, Ordering::Relaxed);
        if let Ok(mut st) = self.graphs.state.lock() {
            st.refused = None;
            if !on {
                st.captured = None;
                st.pipeline = None;
            }
        }
    }

    /// Whether graph replay is on ([`set_graphs`](Self::set_graphs)).
    pub fn graphs(&self) -> bool {
        self.graphs.on.load(Ordering::Relaxed)
    }

    /// Captures, replays and eager steps so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs
            .state
            .lock()
            .map(|s| s.stats.clone())
            .unwrap_or_default()
    }

    /// The logits (batch, vocab) of the decode step `input_ids` (batch, 1) at `index_pos`,
    /// with `pads` as [`forward_batch`](Self::forward_batch) takes them, replayed from the
    /// captured graph or captured now; `None` where no graph applies (the caller then runs
    /// the step eagerly; nothing has changed).
    pub(super) fn graph_step(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        pads: &[usize],
        cache: &mut Cache,
    ) -> Result<Option<Tensor>> {
        let (batch, seq_len) = input_ids.dims2()?;
        let pads = if pads.iter().all(|&p| p == 0) {
            &[][..]
        } else {
            pads
        };
        // A host stage that only looks the embeddings up (a near fit, as llama.cpp keeps its
        // table on the host): the graph runs the GPU's stage from the looked-up rows.
        let host_embed = self.stages.len() == 2
            && self.stages[0].rt.device().is_cpu()
            && !self.on_host.contains(&true)
            && !self.head_on_host;
        // Host layers or a host head in front of one GPU: a graph per run of GPU layers.
        let host_pipeline = self.stages.len() == 2
            && self.stages[0].rt.device().is_cpu()
            && (self.on_host.contains(&true) || self.head_on_host);
        let stage = &self.stages[usize::from(host_embed || host_pipeline)];
        if !self.graphs() || seq_len != 1 || !stage.rt.device().is_cuda() {
            return Ok(None);
        }
        let mut st =
            self.graphs.state.lock().map_err(|_| {
                candle_core::Error::Msg("the graph state's lock is poisoned".into())
            })?;
        // An expert tier: a captured step routes every sparse layer's row on the device,
        // through the tier's table, which the tier keeps true between launches.
        let experts = self.stage_experts(stage);
        if let StageExperts::Split(tier) = &experts {
            if host_pipeline || batch != 1 {
                return Ok(st.eager(
                    "the experts of a batch, or beside host layers, are routed on the host".into(),
                ));
            }
            if let Err(why) = tier.begin_graph_step()? {
                tier.end_graph_step(false, false)?;
                return Ok(st.eager(why));
            }
            let captures = st.stats.captures;
            let out = self.resident_step(&mut st, host_embed, input_ids, index_pos, pads, cache);
            tier.end_graph_step(matches!(out, Ok(Some(_))), st.stats.captures > captures)?;
            return out;
        }
        if host_pipeline {
            return self.pipeline_step(&mut st, input_ids, index_pos, pads, cache);
        }
        self.resident_step(&mut st, host_embed, input_ids, index_pos, pads, cache)
    }

    /// [`graph_step`](Self::graph_step) of a model whose GPU stage runs every layer and the
    /// head (with `host_embed`, the second of two stages, the first only looking the
    /// embeddings up); `pads` empty where none pads.
    fn resident_step(
        &self,
        st: &mut State,
        host_embed: bool,
        input_ids: &Tensor,
        index_pos: usize,
        pads: &[usize],
        cache: &mut Cache,
    ) -> Result<Option<Tensor>> {
        let batch = input_ids.dim(0)?;
        let stage = &self.stages[usize::from(host_embed)];
        if self.on_host.contains(&true) || self.head_on_host {
            return Ok(st.eager("layers or the output head run on the host".into()));
        }
        if self.stages.len() > 1 && !host_embed {
            return Ok(st.eager("the layers run as a pipeline of several devices".into()));
        }
        // Looked up outside the graph, before the launch (nothing on the GPU yet).
        let rows = if host_embed {
            Some(self.embed_rows(input_ids)?.to_dtype(stage.dtype)?)
        } else {
            None
        };
        if !self.stage_fused(stage) {
            return Ok(st.eager("the fused ops are off".into()));
        }
        // The kernel leaves a row's padding out only for new positions past it (as the eager
        // step decides; see `padded_decode`).
        if st.refused.is_none() && pads.iter().any(|&p| p > index_pos) {
            return Ok(st.eager("the new position lies inside a row's padding".into()));
        }
        let padded = !pads.is_empty();
        let kv = match capture_preconditions(st.refused.as_deref(), stage, cache, index_pos)? {
            Ok(kv) => kv,
            Err(why) => return Ok(st.eager(why)),
        };
        if let Some(c) = st
            .captured
            .as_ref()
            .filter(|c| c.batch == batch && c.padded == padded && c.kv == kv)
        {
            write_inputs(&c.inputs, input_ids, index_pos, pads)?;
            if let (Some(buf), Some(rows)) = (&c.hidden, &rows) {
                buf.slice_set(&rows.to_device(buf.device())?, 0, 0)?;
            }
            if stage.rt.replay_step(&c.graph)? {
                for kv in &mut cache.kvs {
                    kv.replayed(1);
                }
                let logits = c.logits.copy()?;
                st.stats.replays += 1;
                return Ok(Some(logits));
            }
            tracing::debug!("units moved since the capture: capturing the decode step again");
        }
        // An old graph may still run: the driver frees an executable graph in flight only when
        // it completes, and its buffers are freed in the stream's order.
        st.captured = None;
        // Checked here, not before each replay: a replay needs only the residency generation
        // of its capture (`replay_step`), which any arrival or eviction changes.
        if !stage.rt.all_resident()? {
            return Ok(st.eager("weights stream (not every unit is resident)".into()));
        }
        let _span = tracing::debug_span!("llama.capture", batch, index_pos).entered();
        let device = stage.rt.device();
        let inputs = Tensor::zeros(
            batch + 1 + if padded { batch } else { 0 },
            DType::U32,
            device,
        )?;
        let logits = Tensor::zeros((batch, self.cfg.vocab_size), DType::F32, device)?;
        write_inputs(&inputs, input_ids, index_pos, pads)?;
        let hidden = match &rows {
            Some(rows) => Some(rows.to_device(device)?.contiguous()?.copy()?),
            None => None,
        };
        let on_device = DeviceInputs {
            pos: inputs.narrow(0, batch, 1)?,
            pads: if padded {
                Some(inputs.narrow(0, batch + 1, batch)?)
            } else {
                None
            },
            hidden: hidden.clone(),
        };
        let lens: Vec<usize> = cache.kvs.iter().map(|kv| kv.len()).collect();
        // Run twice (a warm-up, then captured): each run starts from the same positions.
        let captured = stage.rt.capture_step(|| {
            for (kv, &len) in cache.kvs.iter_mut().zip(&lens) {
                kv.rewind(len);
            }
            let ids = inputs.narrow(0, 0, batch)?.reshape((batch, 1))?;
            let xs = self.decoder(&ids, index_pos, pads, Some(&on_device), cache)?;
            let out = self.head(&xs)?.squeeze(1)?;
            logits.slice_set(&out, 0, 0)
        });
        let graph = match captured {
            Ok((graph, ())) => graph,
            Err(e) => {
                // The step runs eagerly from the positions it started at (a warm-up that ran
                // wrote this step's keys and values, which the eager step writes again).
                for (kv, len) in cache.kvs.iter_mut().zip(lens) {
                    kv.rewind(len);
                }
                let why = e.to_string();
                st.refused = Some(why.clone());
                return Ok(st.eager(format!("the capture failed: {why}")));
            }
        };
        // The capture ran nothing: its first launch computes this step.
        if !stage.rt.replay_step(&graph)? {
            candle_core::bail!("units moved between the capture and its first launch");
        }
        let out = logits.copy()?;
        st.stats.captures += 1;
        st.captured = Some(Captured {
            graph,
            batch,
            padded,
            inputs,
            logits,
            kv,
            hidden,
        });
        Ok(Some(out))
    }
}

impl CausalLm {
    /// [`graph_step`](Self::graph_step) for a model with host layers or a host head in front
    /// of one GPU: the embeddings, the host runs and a host head run eagerly; each run of GPU
    /// layers is captured once as a graph of its own (from a buffer the hidden state is copied
    /// into, to one it is copied out of) and replayed at later steps. Where a run's units
    /// moved since its capture, the rest of the step runs eagerly and the next captures again.
    /// The GPU's head runs eagerly after the last run (two kernels).
    fn pipeline_step(
        &self,
        st: &mut State,
        input_ids: &Tensor,
        index_pos: usize,
        pads: &[usize],
        cache: &mut Cache,
    ) -> Result<Option<Tensor>> {
        let (batch, _) = input_ids.dims2()?;
        let gpu = &self.stages[1];
        if !pads.is_empty() {
            return Ok(st.eager("a padded batch with host layers".into()));
        }
        if !self.stage_fused(gpu) {
            return Ok(st.eager("the fused ops are off".into()));
        }
        let kv = match capture_preconditions(st.refused.as_deref(), gpu, cache, index_pos)? {
            Ok(kv) => kv,
            Err(why) => return Ok(st.eager(why)),
        };
        let step = StepInputs {
            seq_len: 1,
            index_pos,
            pads: &[],
            on_device: None,
        };
        let replay = st
            .pipeline
            .take()
            .filter(|c| c.batch == batch && c.kv == kv);
        // The units the GPU's runs acquire (it also serves the host layers, for prompts).
        let run_units: Vec<candle_offload::UnitId> = self
            .segments
            .iter()
            .filter(|(s, _)| *s == 1)
            .flat_map(|(_, layers)| layers.clone().filter_map(|l| self.units.layers[l]))
            .collect();
        if replay.is_none() && !gpu.rt.resident_all_of(run_units.iter().copied())? {
            return Ok(st.eager("weights stream (not every unit is resident)".into()));
        }
        let _span = tracing::debug_span!("llama.pipeline_graphs", batch, index_pos).entered();
        let dev = gpu.rt.device();
        let (inputs, mut runs) = match replay {
            Some(c) => {
                write_inputs(&c.inputs, input_ids, index_pos, &[])?;
                (c.inputs, Some(c.runs))
            }
            None => {
                let inputs = Tensor::zeros(batch + 1, DType::U32, dev)?;
                write_inputs(&inputs, input_ids, index_pos, &[])?;
                (inputs, None)
            }
        };
        let capturing = runs.is_none();
        let on_device = DeviceInputs {
            pos: inputs.narrow(0, batch, 1)?,
            pads: None,
            hidden: None,
        };
        let mut captured: Vec<Option<GpuRun>> = Vec::new();
        // Set once a graph cannot launch or a capture fails: the rest runs eagerly.
        let mut eager: Option<String> = None;
        let mut xs = self.embed_rows(input_ids)?;
        for (i, (s, layers)) in self.segments.iter().enumerate() {
            let stage = &self.stages[*s];
            if !xs.device().same_device(stage.rt.device()) {
                xs = self.move_hidden(&xs, stage.rt.device())?;
            }
            if *s == 0 || eager.is_some() {
                xs = self.run_segment(stage, layers.clone(), &xs, step, cache, false)?;
                captured.push(None);
                continue;
            }
            if let Some(run) = runs
                .as_mut()
                .and_then(|r| r.get_mut(i))
                .and_then(Option::take)
            {
                run.input
                    .slice_set(&xs.to_dtype(run.input.dtype())?.to_device(dev)?, 0, 0)?;
                if gpu.rt.replay_step(&run.graph)? {
                    for l in layers.clone() {
                        cache.kvs[l].replayed(1);
                    }
                    xs = run.output.clone();
                    captured.push(Some(run));
                    continue;
                }
                eager = Some("units moved since the capture".into());
                xs = self.run_segment(stage, layers.clone(), &xs, step, cache, false)?;
                captured.push(None);
                continue;
            }
            if !capturing {
                candle_core::bail!("a GPU run of the pipeline has no graph");
            }
            let input = xs
                .to_dtype(gpu.dtype)?
                .to_device(dev)?
                .contiguous()?
                .copy()?;
            let output = input.zeros_like()?;
            let lens: Vec<usize> = layers.clone().map(|l| cache.kvs[l].len()).collect();
            // Run twice (a warm-up, then captured): each run starts from the same positions.
            let graph = gpu.rt.capture_step_of(&run_units, || {
                for (l, &len) in layers.clone().zip(&lens) {
                    cache.kvs[l].rewind(len);
                }
                let h = self.run_segment(
                    gpu,
                    layers.clone(),
                    &input,
                    StepInputs {
                        on_device: Some(&on_device),
                        ..step
                    },
                    cache,
                    false,
                )?;
                output.slice_set(&h, 0, 0)
            });
            match graph {
                Ok((graph, ())) => {
                    // The capture ran nothing: its first launch computes this run.
                    if !gpu.rt.replay_step(&graph)? {
                        candle_core::bail!("units moved between the capture and its first launch");
                    }
                    xs = output.clone();
                    captured.push(Some(GpuRun {
                        graph,
                        input,
                        output,
                    }));
                }
                Err(e) => {
                    for (l, len) in layers.clone().zip(lens) {
                        cache.kvs[l].rewind(len);
                    }
                    let why = e.to_string();
                    st.refused = Some(why.clone());
                    eager = Some(format!("the capture failed: {why}"));
                    xs = self.run_segment(gpu, layers.clone(), &input, step, cache, false)?;
                    captured.push(None);
                }
            }
        }
        let last = &self.stages[self.stages.len() - 1];
        if !self.head_on_host && !xs.device().same_device(last.rt.device()) {
            xs = self
                .move_hidden(&xs, last.rt.device())?
                .to_dtype(last.dtype)?;
        }
        let logits = self.head(&xs)?.squeeze(1)?;
        match eager {
            Some(why) => {
                st.eager(why);
            }
            None => {
                if capturing {
                    st.stats.captures += 1;
                } else {
                    st.stats.replays += 1;
                }
                st.pipeline = Some(Pipeline {
                    batch,
                    kv,
                    inputs,
                    runs: captured,
                });
            }
        }
        Ok(Some(logits))
    }
}

/// What every capture checks and sets up first: that no earlier capture failed (`refused`),
/// the decode phase's reservation (it may evict, and it synchronises, which a capture cannot),
/// as the eager step would set it, and a KV cache allocated with room at `index_pos`.
/// `Ok(Err(reason))` where the step has to run eagerly; otherwise the KV buffers' ids, which a
/// replay must find unchanged.
fn capture_preconditions(
    refused: Option<&str>,
    stage: &Stage,
    cache: &Cache,
    index_pos: usize,
) -> Result<std::result::Result<Vec<Option<TensorId>>, String>> {
    if let Some(why) = refused {
        return Ok(Err(format!("an earlier capture failed: {why}")));
    }
    if let Some(p) = stage.phase {
        stage.rt.set_reserve_bytes(p.decode)?;
    }
    let room = index_pos < stage.rope.max_len()
        && cache
            .kvs
            .iter()
            .all(|kv| kv.k_buffer().is_some() && kv.len() == index_pos && kv.capacity() > kv.len());
    if !room {
        return Ok(Err(
            "the KV cache is not allocated, or full, at this position".into(),
        ));
    }
    Ok(Ok(cache
        .kvs
        .iter()
        .map(|kv| kv.k_buffer().map(Tensor::id))
        .collect()))
}

/// Writes the step's token ids, position and padding counts (none when `pads` is empty) where
/// the graph reads them.
fn write_inputs(
    inputs: &Tensor,
    input_ids: &Tensor,
    index_pos: usize,
    pads: &[usize],
) -> Result<()> {
    let ids = input_ids
        .flatten_all()?
        .to_dtype(DType::U32)?
        .to_device(inputs.device())?;
    let n = ids.dim(0)?;
    let pos = u32::try_from(index_pos)
        .map_err(|_| candle_core::Error::Msg(format!("position {index_pos} exceeds u32")))?;
    let mut tail = vec![pos];
    for &p in pads {
        tail.push(
            u32::try_from(p)
                .map_err(|_| candle_core::Error::Msg(format!("padding {p} exceeds u32")))?,
        );
    }
    inputs.slice_set(&ids, 0, 0)?;
    inputs.slice_set(&Tensor::new(tail, inputs.device())?, 0, n)
}
