//! A model split over the ranks of a multi-process run: every rank resolves its own budget on
//! its own device, rank 0 gathers them (with each rank's idea of the model, which must agree),
//! plans the contiguous layer split with the device-map planner (`devices.rs`, one "device" per
//! rank, its ordinal the rank) and sends the map to the others as JSON, so that every rank
//! knows its layer range. A rank that cannot resolve its budget, or a plan that cannot be made,
//! fails every rank with the reason.
//!
//! Each rank then builds its share as one stage of a pipeline (`devices.rs`' `Pipeline`) over
//! a store of its own units only, and runs a step as the in-process pipeline runs a stage
//! (`forward.rs`' `run_stages`): the hidden state comes from the previous rank and goes to the
//! next over the transport; the last rank runs the head.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_offload::dist::{broadcast_json, gather_json, DistError, Transport};
use candle_offload::placement::{DeviceMap, DevicePlacement};
use candle_offload::{HostStore, MemoryLimit};
use serde::{Deserialize, Serialize};

use super::devices::{device_ordinal, DeviceMapChoice, DeviceMapRequest, Pipeline};
use super::forward::StepInputs;
use super::model::{CausalLm, RankLink};
use super::reserve::{device_budget, OffloadSettings};
use crate::error::ModelError;
use crate::family::Config;
use crate::layers::Cache;

/// What one rank plans its share with ([`CausalLm::plan_ranks`]).
#[derive(Debug, Clone, Copy)]
pub struct RankRequest<'a> {
    /// This rank's device.
    pub device: &'a Device,
    /// This rank's budget on it (`None`: the memory free on a GPU, no limit on a CPU).
    pub limit: Option<MemoryLimit>,
    /// The weights' dtype.
    pub dtype: DType,
    /// The longest prompt: each rank reserves the activations of a pass of this many rows.
    pub prompt_len: usize,
    /// The positions in all: each rank reserves its own layers' KV cache for this many.
    pub max_len: usize,
    /// A mode, or a map written by hand (one device per rank, ordinals the ranks); rank 0's is
    /// the one used.
    pub choice: &'a DeviceMapChoice,
    /// The prefetch depth each rank streams at.
    pub prefetch_depth: usize,
}

/// What each rank tells rank 0.
#[derive(Debug, Serialize, Deserialize)]
struct RankOffer {
    /// Its budget in bytes, or why it has none.
    budget: Result<u64, String>,
    /// The model as this rank sees it, which must be rank 0's.
    model: String,
}

/// The model's shape as the ranks compare it.
fn model_key(cfg: &Config, dtype: DType) -> String {
    format!(
        "{} layers, hidden size {}, vocabulary {}, {dtype:?}",
        cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    )
}

impl CausalLm {
    /// The layer split of a model of `cfg` over the ranks of `transport`, the same on every
    /// rank: rank 0 plans it from every rank's budget and sends it to the others. The map has
    /// one device per rank, in rank order, its `ordinal` the rank; each rank runs
    /// `map.devices[rank].layers()`. Every rank calls it, within the transport's timeout of
    /// each other.
    pub fn plan_ranks(
        cfg: &Config,
        transport: &dyn Transport,
        request: &RankRequest<'_>,
    ) -> Result<DeviceMap, ModelError> {
        let offer = RankOffer {
            budget: device_budget(request.device, request.limit).map_err(|e| e.to_string()),
            model: model_key(cfg, request.dtype),
        };
        let offers = gather_json(transport, 0, &offer)?;
        let plan: Option<Result<DeviceMap, String>> =
            (transport.rank() == 0).then(|| Self::plan_offers(cfg, &offers, request));
        let plan: Result<DeviceMap, String> = broadcast_json(transport, 0, plan.as_ref())?;
        let map = plan.map_err(|reason| DistError::Remote { rank: 0, reason })?;
        if map.devices.len() != transport.world_size() {
            return Err(DistError::Protocol {
                rank: 0,
                reason: format!(
                    "sent a split over {} ranks, the world size is {}",
                    map.devices.len(),
                    transport.world_size()
                ),
            }
            .into());
        }
        Ok(map)
    }

    /// Rank 0's plan from every rank's offer, or why there is none.
    fn plan_offers(
        cfg: &Config,
        offers: &[RankOffer],
        request: &RankRequest<'_>,
    ) -> Result<DeviceMap, String> {
        let key = model_key(cfg, request.dtype);
        let mut budgets = Vec::with_capacity(offers.len());
        for (rank, offer) in offers.iter().enumerate() {
            if offer.model != key {
                return Err(format!(
                    "rank {rank} has another model ({}) than rank 0 ({key})",
                    offer.model
                ));
            }
            match &offer.budget {
                Ok(b) => budgets.push((rank, *b)),
                Err(e) => return Err(format!("rank {rank} has no budget: {e}")),
            }
        }
        let choice = match request.choice {
            // A map planned elsewhere is checked against these budgets like one written by hand.
            DeviceMapChoice::Planned(map) => DeviceMapChoice::Map(map.clone()),
            other => other.clone(),
        };
        let map = Self::plan_budgets(
            cfg,
            &budgets,
            &DeviceMapRequest {
                devices: &[],
                limits: &[],
                dtype: request.dtype,
                prompt_len: request.prompt_len,
                max_len: request.max_len,
                choice: &choice,
                prefetch_depth: request.prefetch_depth,
            },
        )
        .map_err(|e| e.to_string())?;
        if let Some(d) = map.devices.iter().find(|d| d.layer_count == 0) {
            return Err(format!(
                "the {} split gives rank {} no layer (a rank that only passes the hidden state \
                 on is not supported); use the balanced split, fewer ranks, or smaller budgets",
                map.mode.map_or("given".to_string(), |m| m.to_string()),
                d.ordinal
            ));
        }
        Ok(map)
    }
}

/// What [`CausalLmBuilder::rank`](crate::CausalLmBuilder::rank) builds on.
#[derive(Debug)]
pub(super) struct RankTarget {
    pub(super) device: Device,
    pub(super) map: DeviceMap,
    pub(super) transport: Arc<dyn Transport>,
}

impl RankTarget {
    /// The rank's model: one stage of its layers, built as a pipeline's stage is
    /// ([`Pipeline`]), linked to its neighbours.
    pub(super) fn build(
        self,
        cfg: &Config,
        store: &Arc<HostStore>,
        dtype: DType,
        max_len: usize,
        settings: &OffloadSettings,
        source: &Path,
    ) -> Result<CausalLm, ModelError> {
        let (rank, world) = (self.transport.rank(), self.transport.world_size());
        let place = self
            .map
            .devices
            .get(rank)
            .filter(|_| self.map.devices.len() == world)
            .ok_or_else(|| candle_offload::Error::InvalidConfig {
                field: "device_map".into(),
                reason: format!(
                    "a split over {} ranks, this is rank {rank} of {world}",
                    self.map.devices.len()
                ),
            })?;
        let span = place.layers();
        let mut local = self.map.clone();
        local.devices = vec![DevicePlacement {
            ordinal: device_ordinal(&self.device, 0),
            ..place.clone()
        }];
        let mut model = Pipeline {
            cfg,
            store,
            devices: std::slice::from_ref(&self.device),
            map: &local,
            dtype,
            max_len,
            settings,
            source,
            span: span.clone(),
        }
        .build()?;
        model.device_map = Some(self.map);
        model.link = Some(RankLink {
            transport: self.transport,
            first: span.start == 0,
            last: span.end == cfg.num_hidden_layers,
            ended: Default::default(),
        });
        Ok(model)
    }
}

impl CausalLm {
    /// The units a rank running `layers` of a model of `cfg` loads
    /// ([`StoreConfig::only_units`](candle_offload::StoreConfig::only_units)): its layers
    /// (with their experts' units), the embeddings where `layers` starts at 0, the final norm
    /// and the head where it ends at the last layer.
    pub fn rank_units(cfg: &Config, layers: Range<usize>) -> Vec<String> {
        let layout = cfg.layout();
        let mut out: Vec<String> = layers.clone().flat_map(|l| layout.units_of(l)).collect();
        if layers.start == 0 {
            out.push(layout.embed.clone());
        }
        if layers.end == cfg.num_hidden_layers {
            out.push(layout.norm.clone());
            out.push(layout.head_unit().to_string());
        }
        out.dedup();
        out
    }

    /// The transport of a rank's model ([`CausalLmBuilder::rank`](crate::CausalLmBuilder::rank));
    /// `None` for a model whole in this process.
    pub fn transport(&self) -> Option<&Arc<dyn Transport>> {
        self.link.as_ref().map(|l| &l.transport)
    }

    /// One step of a rank's share of the pipeline over `input_ids` (batch, seq) from position
    /// `index_pos`: the embeddings (rank 0) or the previous rank's hidden state, this rank's
    /// layers (its own KV cache in `cache`), then the hidden state to the next rank, or on the
    /// last rank the logits (batch, vocab) of the last position, in f32. Every rank calls it
    /// with the same ids and position.
    pub fn rank_step(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        cache: &mut Cache,
    ) -> candle_core::Result<Option<Tensor>> {
        let link = self
            .link
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("not a rank's model".into()))?;
        let t = &link.transport;
        let rank = t.rank();
        let (batch, seq_len) = input_ids.dims2()?;
        let stage = &self.stages[0];
        if index_pos + seq_len > stage.rope.max_len() {
            candle_core::bail!(
                "position {} is past the {} positions this model was set up for",
                index_pos + seq_len,
                stage.rope.max_len()
            );
        }
        // The transport waits outside the step's CPU pool (one per process, which ranks run
        // as threads share).
        let received = if link.first {
            None
        } else {
            let xs = t.recv_tensor(rank - 1, stage.rt.device())?;
            if xs.dims() != [batch, seq_len, self.cfg.hidden_size] {
                candle_core::bail!(
                    "rank {}: sent a hidden state of shape {:?}, expected {:?}",
                    rank - 1,
                    xs.dims(),
                    [batch, seq_len, self.cfg.hidden_size]
                );
            }
            Some(xs)
        };
        let out = candle_offload::kernels::pool::on_cpu_step_pool(
            stage.rt.device(),
            batch * seq_len,
            || {
                let xs = match received {
                    Some(xs) => xs,
                    None => self.embed_rows(input_ids)?,
                };
                let step = StepInputs {
                    seq_len,
                    index_pos,
                    pads: &[],
                    on_device: None,
                };
                let xs = self.run_stages(
                    xs,
                    stage,
                    seq_len > 1,
                    batch * seq_len,
                    |stage, layers, xs, on_gpu| {
                        self.run_segment(stage, layers, xs, step, cache, on_gpu)
                    },
                )?;
                if link.last {
                    self.head(&xs.narrow(1, seq_len - 1, 1)?)?.squeeze(1)
                } else {
                    Ok(xs)
                }
            },
        )?;
        if link.last {
            return Ok(Some(out));
        }
        t.send_tensor(rank + 1, &out)?;
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use candle_offload::dist::{free_port, NetConfig, TcpTransport};
    use candle_offload::placement::PlacementMode;

    use super::*;

    fn tiny() -> Config {
        Config::from_json_str(
            r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
            "num_attention_heads":4,"num_hidden_layers":6,"num_key_value_heads":2,
            "vocab_size":256,"rms_norm_eps":1e-5,"max_position_embeddings":64}"#,
            std::path::Path::new("config.json"),
        )
        .unwrap()
    }

    /// Every rank's answer, in rank order, each rank on a thread with its own limit.
    fn plan_on_ranks(
        limits: Vec<Option<MemoryLimit>>,
        mode: PlacementMode,
        cfgs: Vec<Config>,
    ) -> Vec<Result<DeviceMap, ModelError>> {
        let port = free_port().unwrap();
        let world = limits.len();
        let handles: Vec<_> = limits
            .into_iter()
            .zip(cfgs)
            .enumerate()
            .map(|(rank, (limit, cfg))| {
                std::thread::spawn(move || {
                    let net =
                        NetConfig::new(rank, world, "127.0.0.1", port, Duration::from_secs(10));
                    let t = TcpTransport::connect(&net)?;
                    CausalLm::plan_ranks(
                        &cfg,
                        &t,
                        &RankRequest {
                            device: &Device::Cpu,
                            limit,
                            dtype: DType::F32,
                            prompt_len: 16,
                            max_len: 32,
                            choice: &DeviceMapChoice::Mode(mode),
                            prefetch_depth: 1,
                        },
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_rank_0s_split() {
        let maps = plan_on_ranks(vec![None; 3], PlacementMode::Balanced, vec![tiny(); 3]);
        let maps: Vec<DeviceMap> = maps.into_iter().map(Result::unwrap).collect();
        for m in &maps {
            assert_eq!(m, &maps[0]);
        }
        let ranges: Vec<_> = maps[0].devices.iter().map(|d| d.layers()).collect();
        assert_eq!(ranges, vec![0..2, 2..4, 4..6]);
        assert_eq!(maps[0].devices[0].ordinal, 0);
        assert_eq!(maps[0].devices[2].ordinal, 2);
    }

    #[test]
    fn the_split_follows_each_ranks_budget() {
        // Rank 0 can hold the embeddings and about one layer; rank 1 has no limit.
        let cfg = tiny();
        let units = CausalLm::placement_units(&cfg, DType::F32);
        let layer = units.layers[0].1;
        let pre: u64 = units.pre.iter().map(|u| u.1).sum();
        let reserve = cfg.reserve_bytes(16, 32, DType::F32);
        let small = MemoryLimit::Bytes(reserve + pre + layer + layer / 2);
        let maps = plan_on_ranks(
            vec![Some(small), None],
            PlacementMode::Sequential,
            vec![tiny(), tiny()],
        );
        let maps: Vec<DeviceMap> = maps.into_iter().map(Result::unwrap).collect();
        assert_eq!(maps[0], maps[1]);
        let d0 = &maps[0].devices[0];
        assert!(d0.budget_bytes == reserve + pre + layer + layer / 2);
        // Rank 0 runs what fits resident beside its share of the KV cache, rank 1 the rest.
        assert!(d0.layer_count >= 1 && d0.layer_count < 6, "{}", maps[0]);
        assert_eq!(maps[0].devices[1].first_layer, d0.layer_count);
        assert_eq!(maps[0].devices[1].layers().end, 6);
    }

    #[test]
    fn a_rank_with_another_model_or_no_layer_fails_every_rank() {
        let mut other = tiny();
        other.num_hidden_layers = 5;
        let out = plan_on_ranks(vec![None; 2], PlacementMode::Balanced, vec![tiny(), other]);
        for (r, e) in out.iter().enumerate() {
            let e = e.as_ref().unwrap_err().to_string();
            assert!(e.contains("rank 1 has another model"), "rank {r}: {e}");
        }
        // Sequential over unlimited budgets puts every layer on rank 0: refused, on both.
        let out = plan_on_ranks(vec![None; 2], PlacementMode::Sequential, vec![tiny(); 2]);
        for (r, e) in out.iter().enumerate() {
            let e = e.as_ref().unwrap_err().to_string();
            assert!(e.contains("rank 1 no layer"), "rank {r}: {e}");
        }
    }
}
