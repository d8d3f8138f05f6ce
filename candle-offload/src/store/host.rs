//! [`HostStore`]: every unit of a model, placed in host memory (pinned where it can be) up to the
//! host cap and in its checkpoint file past it, and looked up by unit, layer or tensor.

use std::collections::HashMap;
use std::sync::RwLock;

use candle_core::Device;

use super::config::{resolve_host_limit, EngineKind, StoreConfig};
use super::disk::{disk_tier, FileSpan};
use super::format::WeightFormat;
use super::layout::{lay_out, Pending, TensorMeta, UnitLayout};
use super::unit::HostUnit;
use crate::budget::human_bytes;
use crate::cache::UnitId;
use crate::error::{Error, Result};
use crate::sys::{self, HostTier, TierKind};

/// All weights of a model, grouped into units: in host memory up to the host cap, the rest in
/// their checkpoint file.
#[derive(Debug)]
pub struct HostStore {
    units: Vec<HostUnit>,
    unit_index: HashMap<String, UnitId>,
    tensor_index: HashMap<String, (UnitId, usize)>,
    host_limit: Option<u64>,
}

impl HostStore {
    /// Groups `pending` into units, lays each unit out, and places it: in host memory (pinned
    /// where the device and the pinned cap allow, filled by `fill`) while it fits under the
    /// host cap, otherwise in its checkpoint file when `sources` locates every one of its
    /// tensors there (`sources` is empty for stores without a file).
    pub(super) fn build(
        pending: Vec<Pending>,
        cfg: &StoreConfig,
        device: &Device,
        sources: &[Option<FileSpan>],
        mut fill: impl FnMut(usize, WeightFormat, &mut [u8]) -> Result<()>,
    ) -> Result<Self> {
        let layouts = lay_out(&pending, cfg)?;

        let explicit = cfg.host_memory_limit.is_some();
        let host_limit = resolve_host_limit(
            cfg.host_memory_limit,
            crate::diag::host_memory().map(|m| m.total_bytes),
        )?;
        if let (true, Some(cap), Some((name, len))) = (
            explicit,
            host_limit,
            layouts
                .iter()
                .map(|l| (&l.name, l.len as u64))
                .max_by_key(|(_, len)| *len),
        ) {
            if cap < len {
                return Err(Error::InvalidConfig {
                    field: "host_memory_limit".into(),
                    reason: format!(
                        "{} is smaller than the largest unit ({name}, {}): a unit is read into \
                         host memory whole, so the cap must hold at least one",
                        human_bytes(cap),
                        human_bytes(len)
                    ),
                });
            }
        }

        let mut pinner = sys::Pinner::for_device(
            device,
            cfg.pinned_cap_bytes,
            cfg.engine == EngineKind::Managed,
        )?;
        let mut units = Vec::with_capacity(layouts.len());
        let mut unit_index = HashMap::new();
        let mut tensor_index = HashMap::new();
        let mut held = 0u64;
        let mut warned = false;
        for UnitLayout {
            name: unit_name,
            layer,
            members,
            tensors,
            len,
        } in layouts
        {
            let uid = UnitId(units.len());
            // What the unit takes in host memory: managed memory is allocated in granules.
            let host_len = match cfg.engine {
                EngineKind::Managed => sys::managed_alloc_len(len),
                EngineKind::Explicit => len,
            } as u64;
            let fits = host_limit.is_none_or(|cap| held + host_len <= cap);
            let spans: Option<Vec<&FileSpan>> = if fits && !cfg.file_backed {
                None
            } else {
                members
                    .iter()
                    .map(|&i| sources.get(i).and_then(Option::as_ref))
                    .collect()
            };
            let buf: Box<dyn HostTier> = if let Some(spans) = spans {
                Box::new(disk_tier(
                    &unit_name,
                    len,
                    &tensors,
                    &spans,
                    cfg.disk_reads,
                )?)
            } else {
                if !fits {
                    let why = format!(
                        "unit {unit_name} ({}) does not fit under the host cap of {} ({} \
                         already held) and has no checkpoint file to stay in (a store built \
                         from tensors or a fill function has none)",
                        human_bytes(len as u64),
                        human_bytes(host_limit.unwrap_or(0)),
                        human_bytes(held)
                    );
                    if explicit {
                        return Err(Error::InvalidConfig {
                            field: "host_memory_limit".into(),
                            reason: why,
                        });
                    }
                    if !warned {
                        tracing::warn!("{why}: holding it in memory past the default cap");
                        warned = true;
                    }
                }
                held += host_len;
                let mut buf = pinner.alloc(len, &unit_name)?;
                {
                    let kind = buf.kind();
                    let bytes = buf.bytes_mut().ok_or_else(|| Error::InvalidConfig {
                        field: format!("unit {unit_name}"),
                        reason: format!("its {kind} storage cannot be written"),
                    })?;
                    for (t, &i) in tensors.iter().zip(&members) {
                        fill(i, t.format, &mut bytes[t.offset..t.offset + t.nbytes])?;
                    }
                }
                buf
            };
            for (k, t) in tensors.iter().enumerate() {
                tensor_index.insert(t.name.clone(), (uid, k));
            }
            unit_index.insert(unit_name.clone(), uid);
            let sum = |size: fn(&TensorMeta) -> usize| -> u64 {
                match buf.managed() {
                    // Dense tensors' pages migrate in whole granules (up to the allocation's);
                    // blocks are copied into buffers of their own.
                    Some(m) => {
                        let blocks: u64 = tensors
                            .iter()
                            .filter(|t| matches!(t.format, WeightFormat::Ggml(_)))
                            .map(|t| size(t) as u64)
                            .sum();
                        m.device_footprint() as u64 + blocks
                    }
                    None => tensors.iter().map(|t| size(t) as u64).sum(),
                }
            };
            let (bytes, own_bytes) = (sum(|t| t.device_bytes), sum(|t| t.own_device_bytes));
            units.push(HostUnit {
                name: unit_name,
                layer,
                tensors,
                bytes,
                own_bytes,
                buf: RwLock::new(buf),
            });
        }
        let store = Self {
            units,
            unit_index,
            tensor_index,
            host_limit,
        };
        if store.disk_bytes() > 0 {
            tracing::info!(
                held = %human_bytes(store.pinned_bytes() + store.pageable_bytes()),
                cap = %human_bytes(host_limit.unwrap_or(0)),
                disk = %human_bytes(store.disk_bytes()),
                units = %store.disk_units().join(", "),
                direct = %store.disk_direct_units().join(", "),
                "units past the host-memory cap stay in the checkpoint file and are read from it \
                 on every fetch (those listed as direct with O_DIRECT, the others through the \
                 page cache)"
            );
        }
        if store.pageable_bytes() > 0 && !device.is_cpu() {
            tracing::warn!(
                pageable = %human_bytes(store.pageable_bytes()),
                pinned = %human_bytes(store.pinned_bytes()),
                "some weights are not in page-locked memory (cap reached or pinning failed); \
                 their transfers go through the staging ring and are slower"
            );
        }
        Ok(store)
    }

    /// The units, in order (non-layer units first, then layers by index).
    pub fn units(&self) -> &[HostUnit] {
        &self.units
    }

    /// One unit.
    pub fn unit(&self, id: UnitId) -> &HostUnit {
        &self.units[id.0]
    }

    /// Looks a unit up by name.
    pub fn unit_id(&self, name: &str) -> Option<UnitId> {
        self.unit_index.get(name).copied()
    }

    /// The unit of layer `idx`, if one was grouped by a layer prefix.
    pub fn layer_unit(&self, idx: usize) -> Option<UnitId> {
        self.units
            .iter()
            .position(|u| u.layer == Some(idx))
            .map(UnitId)
    }

    /// The unit holding a tensor, and the tensor's metadata.
    pub fn tensor(&self, name: &str) -> Option<(UnitId, &TensorMeta)> {
        self.tensor_index
            .get(name)
            .map(|&(u, k)| (u, &self.units[u.0].tensors[k]))
    }

    /// Sizes of all units in order (the cache's input).
    pub fn unit_bytes(&self) -> Vec<u64> {
        self.units.iter().map(|u| u.bytes).collect()
    }

    /// Every unit's [`HostUnit::resident_bytes`], in unit order.
    pub fn resident_unit_bytes(&self) -> Vec<u64> {
        self.units.iter().map(|u| u.own_bytes).collect()
    }

    /// Total bytes of all units.
    pub fn total_bytes(&self) -> u64 {
        self.units.iter().map(|u| u.bytes).sum()
    }

    /// Bytes in page-locked buffers.
    pub fn pinned_bytes(&self) -> u64 {
        self.units
            .iter()
            .filter(|u| u.is_pinned())
            .map(|u| u.buffer_len() as u64)
            .sum()
    }

    /// How many tensors are held as GGML blocks.
    pub fn ggml_tensor_count(&self) -> usize {
        self.units
            .iter()
            .flat_map(|u| u.tensors())
            .filter(|t| matches!(t.format, WeightFormat::Ggml(_)))
            .count()
    }

    /// Bytes in pageable buffers.
    pub fn pageable_bytes(&self) -> u64 {
        self.tier_bytes(TierKind::Pageable)
    }

    /// Bytes in managed (Unified) memory (the managed engine).
    pub fn managed_bytes(&self) -> u64 {
        self.tier_bytes(TierKind::Managed)
    }

    /// Bytes of the units left in their checkpoint file (their layout's length).
    pub fn disk_bytes(&self) -> u64 {
        self.tier_bytes(TierKind::Disk)
    }

    /// The units left in their checkpoint file, in order.
    pub fn disk_units(&self) -> Vec<&str> {
        self.units
            .iter()
            .filter(|u| u.tier() == TierKind::Disk)
            .map(|u| u.name())
            .collect()
    }

    /// The disk units read with O_DIRECT (the others go through the page cache), in order.
    pub fn disk_direct_units(&self) -> Vec<&str> {
        self.units
            .iter()
            .filter(|u| u.tier() == TierKind::Disk && u.buffer().reads_direct())
            .map(|u| u.name())
            .collect()
    }

    /// The host-memory cap the store was built under, bytes (`None`: no cap).
    pub fn host_limit_bytes(&self) -> Option<u64> {
        self.host_limit
    }

    fn tier_bytes(&self, kind: TierKind) -> u64 {
        self.units
            .iter()
            .filter(|u| u.tier() == kind)
            .map(|u| u.buffer_len() as u64)
            .sum()
    }
}
