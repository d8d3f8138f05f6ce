//! Host layers in front of one device (llama.cpp's `-ngl` split): how many layers the host
//! CPU runs, as the model's [`HostLayers`] choice asks and as the planning code decides from
//! the units' sizes and (for `spread:auto`) the steps timed here
//! ([`candle_offload::plan::spread`]); the model of a host stage and a device stage, or of the
//! device alone when the host runs nothing.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_offload::plan::spread::{
    self, HostLayers, HostSplit, LayerSteps, SplitError, SplitSizes, SpreadMeasures,
    PASS_THROUGH_LAYERS,
};
use candle_offload::{HostStore, OffloadConfig, OffloadRuntime, Tuning, UnitId};

use super::model::CausalLm;
use super::reserve::{declare_reservation, phase_reserves, stage_config, OnDevice, DECODE_ROWS};
use crate::error::ModelError;
use crate::family::Config;
use crate::family::{StepCtx, UnitWeights};
use crate::layers::{Cache, Masks};

/// The weight bytes [`CausalLm::host_layer_seconds`] goes round, so that its steps read their
/// weights from memory: more than three times a large last-level cache.
const HOST_TIMING_BYTES: u64 = 1 << 30;

/// The link rate an expert tier on a CPU device (the tests' split, where no link exists)
/// prices fetches at, bytes a second.
const EXPERT_TIER_CPU_LINK_BYTES_PER_S: f64 = 10e9;

/// The fewest largest units of room an expert tier keeps beside its cache for a prompt's
/// streamed experts (where the prefetch depth keeps any): one computing while the next one's
/// copy lands.
const EXPERT_STREAM_DEPTH: usize = 2;

/// A host split that cannot be made, as the configuration error it is.
fn invalid(e: SplitError) -> ModelError {
    candle_offload::Error::InvalidConfig {
        field: "host_layers".into(),
        reason: e.to_string(),
    }
    .into()
}

impl OnDevice<'_> {
    /// The model on this device with `host`'s layers (and the embeddings) on the host CPU, as
    /// [`host_split`](Self::host_split) decides: a pipeline of a CPU stage, which keeps its
    /// units in host memory as CPU tensors (copied once, on first use, then resident), and a
    /// GPU stage under the settings' budget that reserves the KV cache of its own layers and
    /// two layers' more (a host layer's cache passing through while a prompt runs on the GPU).
    /// The hidden state crosses to the GPU once per decode step; with no host layer this is
    /// [`single`](Self::single), except that a model which does not fit the budget whole
    /// beside its whole prompt keeps an embedding table of its own on the host (a CPU stage of
    /// no layers), as llama.cpp does, so that the GPU's room goes to layers and to the
    /// prompt's passes.
    pub(super) fn with_host(&self, host: HostLayers) -> Result<CausalLm, ModelError> {
        let OnDevice {
            cfg,
            store,
            device,
            dtype,
            prompt_len,
            max_len,
            settings,
            source,
        } = *self;
        let split = self.host_split(host)?;
        let (h, steps, head_on_host) = (split.layers, split.steps, split.head_on_host);
        let prices = split.prices;
        // The table's place is decided beside the whole prompt's reservation: a model that fits
        // only beside a decode step's would otherwise keep the table on the GPU and run its
        // prompt in passes or streaming (no room for passes beside the table, so layers
        // stream every token; docs/tuning.md, host steps and prompt passes).
        let rows = prompt_len.max(DECODE_ROWS);
        if h == 0 && !head_on_host && !self.embed_on_host(rows)? {
            let mut model = self.single()?;
            model.layer_steps = steps;
            model.split_prices = prices;
            return Ok(model);
        }
        let n = cfg.num_hidden_layers;
        let on_host = host.host_set(h, n);
        let gpu_layers = || (0..n).filter(|&l| !on_host[l]);
        let layout = cfg.layout();
        let mut host_units = vec![layout.embed.clone()];
        host_units.extend(
            (0..n)
                .filter(|&l| on_host[l])
                .flat_map(|l| layout.units_of(l)),
        );
        if head_on_host {
            host_units.push(layout.norm.clone());
            host_units.push(layout.head_unit().to_string());
        }
        host_units.retain(|u| store.unit_id(u).is_some());
        let cpu = OffloadRuntime::new(
            store.clone(),
            &Device::Cpu,
            &OffloadConfig {
                keep: host_units.clone(),
                units: Some(host_units),
                tuning: settings.tuning,
                ..Default::default()
            },
        )?;
        // The final norm and the head, unless the host runs them.
        let mut keep = Vec::new();
        if !head_on_host {
            keep.push(layout.norm.clone());
            keep.push(layout.head_unit().to_string());
        }
        keep.retain(|u| store.unit_id(u).is_some());
        // The GPU also serves the host layers, for prompts (streamed through its free room,
        // evicted first: they are not in its schedule), whose KV cache it holds one layer at a
        // time before handing it to the host.
        let mut served = keep.clone();
        served.extend((0..n).flat_map(|l| layout.units_of(l)));
        // Its own layers' KV cache and two layers' more (a host layer's, for prompts).
        let kv_layers = (n - h + PASS_THROUGH_LAYERS).min(n) as u64;
        let at = |rows| {
            let (base, per_layer) = self.host_stage_reserve(rows);
            (base + per_layer * kv_layers, per_layer * kv_layers)
        };
        let kv = at(prompt_len).1;
        // Only the embeddings on the host: a GPU stage that holds every other unit reserves as
        // a resident one does; with host layers, prompts stream those layers through it.
        let (reserve, share, chunk) = phase_reserves(
            |rows| at(rows).0,
            self.resident_saving(),
            prompt_len,
            |rows| self.pass_slack(rows),
            |rows, slack| {
                if h > 0 {
                    return Ok(false);
                }
                let (need, budget) = self.whole_bytes(rows, false)?;
                Ok(need.saturating_sub(slack) <= budget)
            },
        )?;
        let order = || {
            let mut order: Vec<UnitId> = gpu_layers()
                .filter_map(|l| store.unit_id(&layout.layer(l)))
                .collect();
            for k in &keep {
                if let Some(u) = store.unit_id(k) {
                    if !order.contains(&u) {
                        order.push(u);
                    }
                }
            }
            order
        };
        let mut stage = stage_config(settings, reserve, keep.clone(), order, Some(served))?;
        stage.steady_reserve_bytes = Some(stage.reserve_bytes.saturating_sub(share));
        if host == HostLayers::Auto {
            // The split assumed the GPU keeps every layer it runs: a strategy that holds back
            // room for streaming would stream some of them again.
            stage.strategy = candle_offload::OffloadStrategy::Minimal;
        }
        // The hidden state reaches the GPU through a host-to-device copy on the compute
        // stream, which needs no event of cudarc's (ARCHITECTURE.md, hazard H7).
        stage.event_tracking = settings.event_tracking;
        let gpu = OffloadRuntime::new(store.clone(), device, &stage)?;
        declare_reservation(&gpu, kv, reserve, settings.reserve_bytes)?;
        let mut model = CausalLm::assemble(
            cfg.clone(),
            vec![(cpu, 0..h), (gpu, h..n)],
            dtype,
            max_len,
            source,
        )?;
        // The runs of host layers (stage 0) and GPU layers (stage 1) in layer order: the two
        // ranges `assemble` set when the host layers come first, alternating runs when spread.
        let mut segments: Vec<(usize, Range<usize>)> = Vec::new();
        for (l, &host) in on_host.iter().enumerate() {
            let stage = usize::from(!host);
            match segments.last_mut() {
                Some((s, r)) if *s == stage => r.end = l + 1,
                _ => segments.push((stage, l..l + 1)),
            }
        }
        for (i, stage) in model.stages.iter_mut().enumerate() {
            let mine = segments.iter().filter(|(s, _)| *s == i).map(|(_, r)| r);
            let start = mine.clone().map(|r| r.start).min().unwrap_or(n);
            stage.layers = start..mine.map(|r| r.end).max().unwrap_or(n);
        }
        model.segments = segments;
        model.on_host = on_host.clone();
        model.layer_steps = steps;
        model.split_prices = prices;
        model.head_on_host = head_on_host;
        model.reserve_by_phase(share);
        model.prompt_chunk = chunk;
        // GGML blocks on the host multiply F32 activations (`cpu_quant`, and Candle's CPU
        // quantized matmul takes nothing else); dense host layers keep the model's dtype.
        let mut on_cpu: Vec<String> = (0..n)
            .filter(|&l| on_host[l])
            .map(|l| layout.layer(l))
            .collect();
        if head_on_host {
            on_cpu.push(layout.head_unit().to_string());
        }
        let blocks = on_cpu.iter().any(|u| {
            store
                .unit_id(u)
                .is_some_and(|id| store.unit(id).has_quantized())
        });
        if blocks && dtype != DType::F32 {
            // The positions `assemble` set up (clamped to the model's), as the GPU stage has.
            let max_len = model.stages[1].rope.max_len();
            let rope = model
                .family
                .rope(&model.cfg, max_len, DType::F32, &Device::Cpu)?;
            let first = &mut model.stages[0];
            first.dtype = DType::F32;
            first.rope = rope;
        }
        Ok(model)
    }

    /// The model on this device with no host layers: the budget reserves the KV cache and
    /// activations for prompts of `prompt_len` tokens and `max_len` positions in all (a long
    /// prompt in passes where the model holds every unit beside a pass but not beside the whole
    /// prompt), the non-layer units stay resident, and the policy follows the model's sweep
    /// unless the settings name another.
    pub(super) fn single(&self) -> Result<CausalLm, ModelError> {
        let OnDevice {
            cfg,
            store,
            device,
            dtype,
            prompt_len,
            max_len,
            settings,
            source,
        } = *self;
        let (reserve, share, chunk) = phase_reserves(
            |rows| self.reserve(rows),
            self.resident_saving(),
            prompt_len,
            |rows| self.pass_slack(rows),
            |rows, slack| {
                let (need, budget) = self.whole_bytes(rows, true)?;
                Ok(need.saturating_sub(slack) <= budget)
            },
        )?;
        let kv = cfg.kv_cache_bytes(max_len, dtype).min(reserve);
        let n = cfg.num_hidden_layers;
        let layout = cfg.layout();
        // A mixture-of-experts model's experts beside the dense part: what the decode step's
        // reservation leaves of the budget (the tier's slots are sized on the runtime's
        // capacity below).
        let expert_ids = super::experts::ExpertIds::new(&layout, store);
        let tier = layout.experts.is_some() && {
            let (dense, budget) = self.whole_bytes(DECODE_ROWS, true)?;
            let room = budget.saturating_sub(dense);
            super::experts::ExpertTier::wanted(settings.experts, &expert_ids, store, device, room)
        };
        let mut keep = CausalLm::kept_units(store, cfg);
        if tier {
            // The dense layers stay: the tier's cache makes the room its experts take.
            keep.extend((0..n).map(|l| layout.layer(l)));
        }
        let mut stage = stage_config(
            settings,
            reserve,
            keep,
            || CausalLm::schedule(store, cfg),
            None,
        )?;
        stage.steady_reserve_bytes = Some(stage.reserve_bytes.saturating_sub(share));
        let rt = OffloadRuntime::new(store.clone(), device, &stage)?;
        declare_reservation(&rt, kv, reserve, settings.reserve_bytes)?;
        let tier = if tier {
            let link_bytes_per_s = if device.is_cuda() {
                candle_offload::diag::measure_h2d_gbps(device, 64 << 20, true, 3)? * 1e9
            } else {
                // No link: the host's own copy rate stands for it.
                EXPERT_TIER_CPU_LINK_BYTES_PER_S
            };
            // The weights' capacity while a prompt runs (the smallest of the phases), less the
            // kept units and, unless every expert fits beside them (no copy is then ever in
            // flight past the cache), the room the runtime's cache keeps for copies in flight:
            // the prefetch depth times its largest unit that is not kept.
            let capacity = rt.stats()?.weight_capacity_bytes;
            let kept_ids: std::collections::HashSet<_> = stage
                .keep
                .iter()
                .filter_map(|name| store.unit_id(name))
                .collect();
            let kept: u64 = kept_ids.iter().map(|&id| store.unit(id).bytes()).sum();
            let units: Vec<_> = expert_ids.units().collect();
            let experts: u64 = units.iter().map(|&id| store.unit(id).bytes()).sum();
            let room = capacity.saturating_sub(kept);
            let (spare, stream_depth) = if room >= experts || settings.prefetch_depth == 0 {
                (0, 0)
            } else {
                let largest_evictable = (0..store.units().len())
                    .map(candle_offload::UnitId)
                    .filter(|id| !kept_ids.contains(id))
                    .map(|id| store.unit(id).bytes())
                    .max()
                    .unwrap_or(0);
                let depth = settings.prefetch_depth.max(EXPERT_STREAM_DEPTH);
                ((depth as u64).saturating_mul(largest_evictable), depth)
            };
            // A captured decode step reads the experts only through the tier's table.
            rt.set_indirect(units)?;
            Some(super::experts::ExpertTier::new(
                settings.experts,
                &layout,
                &expert_ids,
                store,
                super::experts::TierSizing {
                    room: room.saturating_sub(spare),
                    dense: kept,
                    stream_depth: if spare > 0 { stream_depth } else { 0 },
                    link_bytes_per_s,
                },
                settings,
            )?)
        } else {
            None
        };
        let mut model = CausalLm::assemble(cfg.clone(), vec![(rt, 0..n)], dtype, max_len, source)?;
        model.reserve_by_phase(share);
        model.prompt_chunk = chunk;
        model.expert_tier = tier.map(|t| (0, t));
        Ok(model)
    }

    /// How many layers [`with_host`](Self::with_host) runs on the host for `host`, and whether
    /// the head goes too: a count as given ([`spread::fixed_split`]); for
    /// [`HostLayers::Auto`], [`spread::auto_split`] over the layers' device bytes, with the
    /// output head, the final norm and the reservation on the GPU (the KV cache of its own
    /// layers and two layers' more for a host layer's cache passing through); for
    /// [`HostLayers::SpreadAuto`], [`spread::spread_auto_split`] over the same sizes and the
    /// steps timed here ([`spread_measures`](Self::spread_measures)). Both take none when the
    /// whole model (embeddings included) fits, and none on a CPU device. The split is planned
    /// for the decode step's reservation (a prompt streams through the room its activations
    /// take), so it does not depend on the prompt's length.
    pub(super) fn host_split(&self, host: HostLayers) -> Result<HostSplit, ModelError> {
        let n = self.cfg.num_hidden_layers;
        let layout = self.cfg.layout();
        if let Some(split) = spread::fixed_split(host, n, layout.head.is_some()).map_err(invalid)? {
            return Ok(split);
        }
        if self.device.is_cpu() {
            return Ok(HostSplit::default());
        }
        let budget = self.budget()?;
        // Own sizes: what units that stay take on the device (`runtime::staying`) and what
        // the host reads; GGML layers of mixed block types stream padded, larger (the
        // streaming slots the split counts take the own sizes too, a little short then).
        let layers: Vec<u64> = (0..n).map(|l| self.own_bytes(&layout.layer(l))).collect();
        // Planned for the decode step (`DECODE_ROWS`): a prompt streams through the room its
        // activations take (planned at the prompt's reservation, a model that holds every unit
        // while decoding would stream layers every token; docs/tuning.md, host steps and
        // prompt passes).
        let rows = DECODE_ROWS;
        let (base, per_layer) = self.host_stage_reserve(rows);
        let reserve = base.saturating_add(self.settings.reserve_bytes);
        let head = layout.head.as_deref().map_or(0, |h| self.own_bytes(h));
        let mut kept = self.own_bytes(&layout.norm) + head;
        if self.fits_whole(rows)? {
            return Ok(HostSplit::default());
        }
        // Nor where every unit but the embedding table fits: with no host layer the table
        // stays on the host (`embed_on_host`) and the GPU holds the rest, as `with_host` builds
        // it (the split holds back two layers' KV cache for host layers, and would take host
        // layers such a model does not need).
        if self.embed_on_host(rows)? {
            let (need, budget) = self.whole_bytes(rows, false)?;
            if need <= budget {
                return Ok(HostSplit::default());
            }
        }
        // Tied embeddings: the GPU keeps the head, which is the embedding matrix.
        if layout.head.is_none() {
            kept += self.own_bytes(&layout.embed);
        }
        let sizes = SplitSizes {
            layers,
            kept,
            // A head of its own may go to the host too (a tied one is the embedding table,
            // which the GPU keeps).
            head,
            reserve,
            kv_per_layer: per_layer,
            budget,
            slots: self.settings.prefetch_depth + 1,
        };
        if host != HostLayers::SpreadAuto {
            return spread::auto_split(&sizes).map_err(invalid);
        }
        // The streamed layers' copies overlap the host's layers: balance the two rates,
        // measured here.
        let measured = self.spread_measures()?;
        let rates = spread::spread_rates(&sizes, &measured);
        let split = spread::spread_auto_split(&sizes, &measured);
        tracing::info!(
            host_gbps = rates.host_bytes_per_s / 1e9,
            link_gbps = rates.link_bytes_per_s / 1e9,
            device_layer_ms = measured.steps.device_s * 1e3,
            split = ?split.as_ref().ok().map(|s| (s.layers, s.head_on_host)),
            "spread host layers"
        );
        split.map_err(invalid)
    }

    /// What [`HostLayers::SpreadAuto`] weighs, measured on this machine: a layer's decode step
    /// on the host CPU ([`CausalLm::host_layer_seconds`]) and on the device
    /// ([`CausalLm::layer_step_seconds`]), each at half the context (a generation that fills it
    /// averages that), and the link's host-to-device rate.
    fn spread_measures(&self) -> Result<SpreadMeasures, ModelError> {
        let OnDevice {
            cfg,
            store,
            device,
            dtype,
            max_len,
            settings,
            ..
        } = *self;
        let context = max_len / 2;
        let host_s = CausalLm::host_layer_seconds(cfg, store, dtype, context, &settings.tuning)?;
        let device_s =
            CausalLm::layer_step_seconds(cfg, store, dtype, device, context, &settings.tuning)?;
        let link = candle_offload::diag::measure_h2d_gbps(device, 64 << 20, true, 3)? * 1e9;
        Ok(SpreadMeasures {
            steps: LayerSteps { host_s, device_s },
            link_bytes_per_s: link,
            // A split that streams nothing replays its decode step from a graph (`graph`), a
            // faster step than the eager one timed here.
            graphs: settings.tuning.graphs,
        })
    }
}

impl CausalLm {
    /// Seconds one decode step of a decoder layer takes on the host CPU after `context` cached
    /// positions, from CPU copies of the first layers' units in `store`, in the dtype a host
    /// stage computes in (F32 for GGML blocks): the host's rate that
    /// [`HostLayers::SpreadAuto`] weighs against the link's.
    ///
    /// The steps go round as many layers as hold 1 GiB (`HOST_TIMING_BYTES`; all of a smaller
    /// model), so that each reads its weights from memory, as a host stage's sweep does, and
    /// not from the CPU's last-level cache (docs/tuning.md, timing a host layer). Host layers
    /// still run slower while decoding than timed here, beside copies
    /// ([`candle_offload::plan::SPREAD_OVERLAP_LOSS`]) and without
    /// ([`candle_offload::plan::RESIDENT_SPLIT_LOSS`]); the split's price charges both.
    pub fn host_layer_seconds(
        cfg: &Config,
        store: &Arc<HostStore>,
        dtype: DType,
        context: usize,
        tuning: &Tuning,
    ) -> Result<f64, ModelError> {
        let layout = cfg.layout();
        let mut bytes = 0u64;
        let mut count = 0;
        while count < cfg.num_hidden_layers && bytes < HOST_TIMING_BYTES {
            bytes += store
                .unit_id(&layout.layer(count))
                .map_or(0, |id| store.unit(id).host_bytes());
            count += 1;
        }
        Self::layers_step_seconds(cfg, store, dtype, &Device::Cpu, context, count, tuning)
    }

    /// Seconds one decode step of the first decoder layer takes on `device` with its weights
    /// there (a copy of its unit in `store`) after `context` cached positions (zeros),
    /// computing as a stage there does: F32 for GGML blocks on the CPU and on the thread pool a
    /// decode step runs on ([`candle_offload::kernels::pool::on_cpu_step_pool`]), `dtype` and the
    /// fused kernels on a GPU. The fastest of seven after a warm-up, the device synchronized
    /// around each. [`HostLayers::SpreadAuto`] weighs the GPU's against the host's
    /// ([`host_layer_seconds`](Self::host_layer_seconds), which goes round several layers).
    pub fn layer_step_seconds(
        cfg: &Config,
        store: &Arc<HostStore>,
        dtype: DType,
        device: &Device,
        context: usize,
        tuning: &Tuning,
    ) -> Result<f64, ModelError> {
        Self::layers_step_seconds(cfg, store, dtype, device, context, 1, tuning)
    }

    /// [`layer_step_seconds`](Self::layer_step_seconds) over the first `count` layers in turn:
    /// the mean of a round's steps, the fastest of seven rounds after a warm-up round.
    fn layers_step_seconds(
        cfg: &Config,
        store: &Arc<HostStore>,
        dtype: DType,
        device: &Device,
        context: usize,
        count: usize,
        tuning: &Tuning,
    ) -> Result<f64, ModelError> {
        let layout = cfg.layout();
        let names: Vec<String> = (0..count.max(1)).map(|l| layout.layer(l)).collect();
        let mut ids = Vec::with_capacity(names.len());
        for name in &names {
            let Some(id) = store.unit_id(name) else {
                return Err(ModelError::Tensor {
                    path: name.clone().into(),
                    tensor: name.clone(),
                    reason: "no unit holds it".into(),
                });
            };
            ids.push(id);
        }
        let dtype = if device.is_cpu() && ids.iter().any(|&id| store.unit(id).has_quantized()) {
            DType::F32
        } else {
            dtype
        };
        // The layers and their experts (units of their own in a mixture-of-experts model).
        let served: Vec<String> = (0..names.len()).flat_map(|l| layout.units_of(l)).collect();
        let rt = OffloadRuntime::new(
            store.clone(),
            device,
            &OffloadConfig {
                keep: served.clone(),
                units: Some(served),
                tuning: *tuning,
                ..Default::default()
            },
        )?;
        let mut units = Vec::with_capacity(ids.len());
        let mut blocks = Vec::with_capacity(ids.len());
        for (l, (&id, name)) in ids.iter().zip(&names).enumerate() {
            let unit = rt.acquire(id)?;
            blocks.push(cfg.family.block(
                cfg,
                UnitWeights::new(unit.var_builder(dtype), Some(&unit)).pp(name),
                l,
                dtype,
            )?);
            units.push(unit);
        }
        let rope = cfg.family.rope(cfg, context + 2, dtype, device)?;
        let masks = Masks::padded(1, context, &[], device);
        let ids = super::experts::ExpertIds::new(&layout, store);
        let experts = super::experts::RuntimeExperts {
            rt: &rt,
            layout: &layout,
            ids: &ids,
            dtype,
        };
        let ctx = StepCtx {
            index_pos: context,
            rope: &rope,
            masks: &masks,
            fused: device.is_cuda(),
            pos_dev: None,
            ragged_table: None,
            experts: layout.experts.is_some().then_some(&experts as _),
        };
        let xs = Tensor::zeros((1, 1, cfg.hidden_size), dtype, device)?;
        // The cached positions each step attends over (a decode step after a prompt of
        // `context` tokens reads them all).
        let mut cache = Cache::new(blocks.len(), context + 1);
        if context > 0 {
            let kv = Tensor::zeros(
                (1, cfg.num_key_value_heads, context, cfg.head_dim),
                dtype,
                device,
            )?;
            for kvs in &mut cache.kvs {
                kvs.append(&kv, &kv)?;
            }
        }
        // The fastest of seven rounds (after one to warm up): a step timed while the host's
        // memory is busy elsewhere can take twice as long.
        let mut best = f64::INFINITY;
        for round in 0..8 {
            let mut total = 0.0;
            for (block, kvs) in blocks.iter().zip(cache.kvs.iter_mut()) {
                kvs.rewind(context);
                device.synchronize()?;
                let t0 = std::time::Instant::now();
                candle_offload::kernels::pool::on_cpu_step_pool(device, 1, || {
                    block.forward(&xs, &ctx, kvs)
                })?;
                device.synchronize()?;
                total += t0.elapsed().as_secs_f64();
            }
            if round > 0 {
                best = best.min(total / blocks.len() as f64);
            }
        }
        Ok(best.max(1e-9))
    }
}
