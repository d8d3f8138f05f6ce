//! A model split over the ranks of a multi-process run: every rank resolves its own budget on
//! its own device, rank 0 gathers them (with each rank's idea of the model, which must agree),
//! plans the contiguous layer split with the device-map planner (`devices.rs`, one "device" per
//! rank, its ordinal the rank) and sends the map to the others as JSON, so that every rank
//! knows its layer range. A rank that cannot resolve its budget, or a plan that cannot be made,
//! fails every rank with the reason.

use candle_core::{DType, Device};
use candle_offload::dist::{broadcast_json, gather_json, DistError, Transport};
use candle_offload::placement::DeviceMap;
use candle_offload::MemoryLimit;
use serde::{Deserialize, Serialize};

use super::devices::{DeviceMapChoice, DeviceMapRequest};
use super::model::CausalLm;
use super::reserve::device_budget;
use crate::error::ModelError;
use crate::family::Config;

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
