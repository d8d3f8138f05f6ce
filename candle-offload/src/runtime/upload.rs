//! One fetch's copy: the unit's tensors uploaded by the GPU engine (into evicted buffers where
//! they fit) or copied out of the host store on the CPU, with the weight pool's trimming and
//! the injected faults of the fault tests.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::QTensor;

use super::shared::{Engine, OffloadRuntime, State};
use super::weights::Weights;
use crate::cache::UnitId;
use crate::store::{HostUnit, WeightFormat};
use crate::sys::{DeviceLayout, DeviceWeight, SpareUse, UnitSync, UploadItem};

impl OffloadRuntime {
    /// Before a fetch, where an upload freed evicted buffers whose room no new buffer took back
    /// ([`SpareUse::stranded`]): waits for the device and gives the weight pool's freed memory
    /// back to the driver.
    ///
    /// The pool serves an allocation from a freed block of the size it needs; a freed block of
    /// another size stays mapped beside the new one. Units of one size take evicted buffers as
    /// they are, and a buffer freed for a tensor of another block type but the same padded
    /// size (layers of mixed block types streaming alike) comes straight back out of the pool;
    /// own sizes mixed with padded ones do not: a stage keeping its layers at their own sizes
    /// while a prompt streamed padded host layers through it (GGML layers of mixed block
    /// types) held more than it used and went over its budget. Trimming after every unmatched
    /// free instead synced several times a decode step where Q6_K and Q4_K layers alternate at
    /// one size (docs/tuning.md).
    pub(super) fn trim_if_pending(&self, st: &mut State) -> candle_core::Result<()> {
        if !st.trim_pending {
            return Ok(());
        }
        st.trim_pending = false;
        if matches!(self.shared.engine, Engine::Cuda(_)) {
            crate::sys::trim_weight_pool(&self.shared.device)?;
            st.telemetry.trimmed();
            tracing::debug!("weight pool trimmed before a fetch");
        }
        Ok(())
    }

    /// One upload attempt, failing instead while injected faults remain.
    pub(super) fn attempt_upload(
        &self,
        st: &mut State,
        u: UnitId,
    ) -> candle_core::Result<(Weights, Option<UnitSync>)> {
        #[cfg(feature = "fault-injection")]
        if st.injected_failures > 0 {
            st.injected_failures -= 1;
            candle_core::bail!(
                "injected fault: the allocation was refused (as CUDA_ERROR_OUT_OF_MEMORY would be)"
            );
        }
        let (weights, sync, spares) = self.upload(u, &mut st.spare_blocks)?;
        st.telemetry.reused(spares.taken);
        // The spares it did not take were freed; where no new buffer took their room back at
        // their sizes, the pool keeps it (`trim_if_pending`).
        st.trim_pending |= spares.stranded;
        Ok((weights, sync))
    }

    /// For testing fault handling: the next `n` fetches fail as if the driver had refused
    /// their allocation. Only with the `fault-injection` feature (for tests, off by default).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fetch_failures(&self, n: u32) -> candle_core::Result<()> {
        self.state()?.injected_failures = n;
        Ok(())
    }

    /// Uploads `u`, its GGML blocks into `spare`'s buffers where they match (taken out of it),
    /// and says what it did with the others ([`SpareUse`]).
    fn upload(
        &self,
        u: UnitId,
        spare: &mut Vec<QTensor>,
    ) -> candle_core::Result<(Weights, Option<UnitSync>, SpareUse)> {
        let unit = self.shared.store.unit(u);
        match &self.shared.engine {
            Engine::Cpu => Ok((self.cpu_weights(unit)?, None, SpareUse::default())),
            Engine::Cuda(engine) => {
                let items: Vec<UploadItem<'_>> = unit
                    .tensors()
                    .iter()
                    .map(|t| UploadItem {
                        name: &t.name,
                        range: t.offset..t.offset + t.nbytes,
                        shape: &t.shape,
                        layout: match t.format {
                            WeightFormat::Dense(d) => DeviceLayout::Dense(d),
                            WeightFormat::Ggml(ggml) => DeviceLayout::Blocks {
                                ggml,
                                device_len: if self.shared.own_size[u.0] {
                                    t.own_device_bytes
                                } else {
                                    t.device_bytes
                                },
                            },
                        },
                    })
                    .collect();
                // The read lock keeps `update_weights` out while the copies are enqueued.
                let tier = unit.buffer();
                let (uploaded, sync, spares) =
                    engine.upload(unit.name(), &**tier, &items, self.shared.trainable, spare)?;
                let mut dense = HashMap::with_capacity(unit.tensors().len());
                let mut quantized = HashMap::new();
                for (t, w) in unit.tensors().iter().zip(uploaded) {
                    match (w, t.format) {
                        (DeviceWeight::Dense(x), _) => {
                            dense.insert(t.name.clone(), x);
                        }
                        (DeviceWeight::Blocks(q), WeightFormat::Ggml(g)) => {
                            quantized.insert(t.name.clone(), (g, Arc::new(*q)));
                        }
                        (DeviceWeight::Blocks(_), f) => {
                            candle_core::bail!("tensor {}: {f} uploaded as blocks", t.name)
                        }
                    }
                }
                Ok((Weights::new(dense, quantized), Some(sync), spares))
            }
        }
    }

    /// The CPU "fetch": dense tensors and quantized tensors copied out of the host store.
    fn cpu_weights(&self, unit: &HostUnit) -> candle_core::Result<Weights> {
        let mut dense = HashMap::with_capacity(unit.tensors().len());
        let mut quantized = HashMap::new();
        for t in unit.tensors() {
            match t.format {
                WeightFormat::Dense(_) => {
                    let mut tensor = unit.cpu_tensor(t)?;
                    if self.shared.trainable {
                        tensor = candle_core::Var::from_tensor(&tensor)?.into_inner();
                    }
                    dense.insert(t.name.clone(), tensor);
                }
                WeightFormat::Ggml(g) => {
                    let q = Arc::new(unit.cpu_qtensor(t)?);
                    quantized.insert(t.name.clone(), (g, q));
                }
            }
        }
        Ok(Weights::new(dense, quantized))
    }
}
