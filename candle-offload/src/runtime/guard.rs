//! [`UnitGuard`]: a unit pinned on the device while it lives, handing out its tensors.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use super::shared::OffloadRuntime;
use super::weights::Weights;
use crate::cache::UnitId;
use crate::tuning::Tuning;
use crate::varbuilder::UnitBackend;

/// A unit pinned on the device; its weights stay valid while the guard lives.
///
/// Dense tensors come out as `Tensor`s ([`get`](Self::get), [`tensors`](Self::tensors),
/// [`var_builder`](Self::var_builder)); GGML-quantized ones as `QTensor`s
/// ([`get_quantized`](Self::get_quantized), [`qmatmul`](Self::qmatmul)). Asking for a tensor
/// in the other form is an error naming the tensor and its format.
///
/// Dropping the guard records the unit's last use on the compute stream: build modules from
/// it, run them, and drop them before (or with) the guard.
#[derive(Debug)]
pub struct UnitGuard {
    pub(super) rt: OffloadRuntime,
    pub(super) unit: UnitId,
    pub(super) weights: Weights,
    /// Still acquired: released on drop ([`release_all`](Self::release_all) releases first).
    pub(super) held: bool,
}

impl UnitGuard {
    /// Releases `guards` as their drops would, all those of one runtime under one hold of its
    /// lock with one last-use event on a GPU (the drops record one each). The work of every
    /// one of them must be enqueued before the call, as before a drop.
    pub fn release_all(guards: impl IntoIterator<Item = UnitGuard>) -> candle_core::Result<()> {
        let mut guards: Vec<UnitGuard> = guards.into_iter().collect();
        let mut first = Ok(());
        while let Some(lead) = guards.iter().find(|g| g.held) {
            let rt = lead.rt.clone();
            let mine: Vec<usize> = (0..guards.len())
                .filter(|&i| guards[i].held && guards[i].rt.same_as(&rt))
                .collect();
            let units: Vec<UnitId> = mine.iter().map(|&i| guards[i].unit).collect();
            let released = rt.release_many(&units);
            // Done with, released or not: a drop would fail as this did.
            for &i in &mine {
                guards[i].held = false;
            }
            if first.is_ok() {
                first = released;
            }
        }
        first
    }

    /// The unit.
    pub fn unit(&self) -> UnitId {
        self.unit
    }

    /// The performance choices of the runtime the unit came from ([`OffloadRuntime::tuning`]).
    pub fn tuning(&self) -> &Tuning {
        self.rt.tuning()
    }

    /// One of the unit's dense tensors by full name.
    pub fn get(&self, name: &str) -> candle_core::Result<Tensor> {
        if let Some(t) = self.weights.dense.get(name) {
            return Ok(t.clone());
        }
        if let Some(g) = self.weights.quantized_formats.get(name) {
            candle_core::bail!(
                "tensor {name} is stored as GGML {g:?} blocks, not as a dense tensor: use \
                 UnitGuard::get_quantized or UnitGuard::qmatmul"
            );
        }
        Err(candle_core::Error::CannotFindTensor {
            path: name.to_string(),
        }
        .bt())
    }

    /// All of the unit's dense tensors by full name.
    pub fn tensors(&self) -> &HashMap<String, Tensor> {
        &self.weights.dense
    }

    /// The names and GGML types of the unit's quantized tensors.
    pub fn quantized_tensors(&self) -> &HashMap<String, GgmlDType> {
        &self.weights.quantized_formats
    }

    /// One of the unit's GGML-quantized tensors by full name, on the runtime's device.
    pub fn get_quantized(&self, name: &str) -> candle_core::Result<Arc<QTensor>> {
        match self.weights.quantized.get(name) {
            Some(q) => Ok(q.clone()),
            None if self.weights.dense.contains_key(name) => {
                let dtype = self.weights.dense[name].dtype();
                candle_core::bail!(
                    "tensor {name} is a dense {dtype:?} tensor, not GGML blocks: use \
                     UnitGuard::get (or wrap it in QMatMul::Tensor)"
                )
            }
            None => Err(candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }
            .bt()),
        }
    }

    /// A `QMatMul` over one of the unit's GGML-quantized tensors (its weight, `[out, in]`).
    pub fn qmatmul(&self, name: &str) -> candle_core::Result<QMatMul> {
        QMatMul::from_arc(self.get_quantized(name)?)
    }

    /// A value built from this unit's tensors (a model's layer, say): `make` builds it the
    /// first time it is asked for while the unit is resident, and later guards of the same
    /// residency get that very value back, without building it again (a decode step then
    /// looks up no tensor by name). It is kept beside the unit's tensors and dropped with them
    /// when the unit leaves the device, so a unit fetched again builds it anew. One value per
    /// unit: asking for another type builds and keeps that one instead.
    ///
    /// The value should hold only the unit's own tensors (clones share their memory): anything
    /// else it allocates on the device stays allocated, outside the budget, for as long as
    /// the unit does.
    pub fn derived<T: std::any::Any + Send + Sync>(
        &self,
        make: impl FnOnce() -> candle_core::Result<T>,
    ) -> candle_core::Result<Arc<T>> {
        let mut slot =
            self.weights.derived.lock().map_err(|_| {
                candle_core::Error::Msg("a unit's derived value was poisoned".into())
            })?;
        if let Some(v) = slot.0.clone().and_then(|v| v.downcast::<T>().ok()) {
            return Ok(v);
        }
        let v = Arc::new(make()?);
        slot.0 = Some(v.clone());
        Ok(v)
    }

    /// A `VarBuilder` over the unit's dense tensors, rooted at the checkpoint's top level, so
    /// that existing candle-nn and candle-transformers `load(vb.pp("model.layers.3"), &cfg)`
    /// code runs unchanged. Tensors of another dtype than `dtype` are converted on the device.
    /// Asking it for a quantized tensor is an error that says so.
    pub fn var_builder(&self, dtype: DType) -> VarBuilder<'static> {
        VarBuilder::from_backend(
            Box::new(
                UnitBackend::new(self.weights.dense.clone())
                    .with_quantized(self.weights.quantized_formats.clone()),
            ),
            dtype,
            self.rt.shared.device.clone(),
        )
    }
}

impl Drop for UnitGuard {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        if let Err(e) = self.rt.release(self.unit) {
            tracing::error!(unit = self.unit.0, error = %e, "releasing an offloaded unit failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{DType, Device, Module, Tensor};

    use super::super::config::OffloadConfig;
    use super::super::shared::OffloadRuntime;
    use super::super::testutil::{runtime_with, zero_layers};
    use super::*;
    use crate::store::WeightFormat;
    #[test]
    fn acquired_quantized_weights_match_candle_bit_for_bit() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q8_0, GgmlDType::Q4K] {
            let w = Tensor::randn(0f32, 1., (64, 512), &dev)?;
            let q = QTensor::quantize(&w, dtype)?;
            let reference = QMatMul::from_qtensor(QTensor::quantize(&w, dtype)?)?;
            let rt = runtime_with(&q)?;

            let unit = rt.store().unit(rt.store().layer_unit(0).unwrap());
            let (_, meta) = rt.store().tensor("model.layers.0.proj.weight").unwrap();
            assert_eq!(meta.format, WeightFormat::Ggml(dtype));
            assert_eq!(meta.nbytes, q.storage_size_in_bytes());
            let padding = 512 / dtype.block_size() * dtype.type_size();
            assert_eq!(meta.device_bytes, meta.nbytes + padding, "{dtype:?}");
            assert_eq!(unit.bytes(), (meta.device_bytes + 16) as u64);

            let g = rt.acquire_layer(0)?;
            let name = "model.layers.0.proj.weight";
            let got = g.get_quantized(name)?;
            assert_eq!(got.dtype(), dtype);
            assert_eq!(got.shape().dims(), [64, 512]);
            assert_eq!(&*got.data()?, &*q.data()?);
            let x = Tensor::randn(0f32, 1., (3, 512), &dev)?;
            let ours = g.qmatmul(name)?.forward(&x)?.to_vec2::<f32>()?;
            let theirs = reference.forward(&x)?.to_vec2::<f32>()?;
            assert_eq!(ours, theirs, "{dtype:?}");

            // The dense tensor of the same unit is a plain tensor.
            let norm = g.get("model.layers.0.norm.weight")?;
            assert_eq!(norm.to_vec1::<f32>()?, [0., 1., 2., 3.]);
            assert_eq!(g.quantized_tensors().get(name), Some(&dtype));
            assert!(!g.tensors().contains_key(name));
        }
        Ok(())
    }

    #[test]
    fn asking_for_the_wrong_form_is_a_clear_error() -> anyhow::Result<()> {
        let w = Tensor::randn(0f32, 1., (8, 32), &Device::Cpu)?;
        let rt = runtime_with(&QTensor::quantize(&w, GgmlDType::Q8_0)?)?;
        let g = rt.acquire_layer(0)?;
        let q = "model.layers.0.proj.weight";
        let e = g.get(q).unwrap_err().to_string();
        assert!(
            e.contains(q) && e.contains("Q8_0") && e.contains("get_quantized"),
            "{e}"
        );
        let e = g
            .get_quantized("model.layers.0.norm.weight")
            .unwrap_err()
            .to_string();
        assert!(e.contains("norm.weight") && e.contains("dense F32"), "{e}");
        let e = match g.var_builder(DType::F32).get((8, 32), q) {
            Ok(_) => panic!("a VarBuilder served a quantized tensor"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("GGML Q8_0 blocks"), "{e}");
        assert!(g.get_quantized("model.layers.0.missing").is_err());
        drop(g);
        let e = rt
            .update_weights(&[(q.to_string(), w.clone())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("quantized weights are not rewritten"), "{e}");
        Ok(())
    }

    #[test]
    fn a_derived_value_lives_as_long_as_the_residency() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let store = zero_layers(2, 64, &dev)?;
        let unit = store.units()[0].bytes();
        // Room for one unit: acquiring the other evicts it.
        let rt = OffloadRuntime::new(
            Arc::new(store),
            &dev,
            &OffloadConfig {
                gpu_memory_limit: Some(crate::budget::MemoryLimit::Bytes(unit)),
                prefetch_depth: 0,
                ..Default::default()
            },
        )?;
        let built = std::cell::Cell::new(0);
        let derive = |g: &UnitGuard| {
            g.derived(|| {
                built.set(built.get() + 1);
                Ok((built.get(), g.get("model.layers.0.w")?))
            })
        };
        let first = derive(&rt.acquire_layer(0)?)?;
        let again = derive(&rt.acquire_layer(0)?)?;
        assert!(Arc::ptr_eq(&first, &again), "kept while resident");
        assert_eq!(built.get(), 1);
        // Another type replaces it.
        let other = rt.acquire_layer(0)?.derived(|| Ok("other"))?;
        assert_eq!(*other, "other");
        // Evicted and fetched again: built anew, and a failing build keeps nothing.
        drop(rt.acquire_layer(1)?);
        assert_eq!(rt.stats()?.resident_bytes, unit);
        let g = rt.acquire_layer(0)?;
        assert!(g.derived::<u8>(|| candle_core::bail!("no")).is_err());
        let fresh = derive(&g)?;
        assert_eq!((fresh.0, built.get()), (2, 2));
        assert!(!Arc::ptr_eq(&first, &fresh));
        Ok(())
    }

    #[test]
    fn units_acquired_and_released_together_are_pinned_until_released() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let store = Arc::new(zero_layers(3, 64, &dev)?);
        let unit = store.units()[0].bytes();
        let ids: Vec<UnitId> = (0..3).map(|l| store.layer_unit(l).unwrap()).collect();
        // Room for two units.
        let rt = OffloadRuntime::new(
            store.clone(),
            &dev,
            &OffloadConfig {
                gpu_memory_limit: Some(crate::budget::MemoryLimit::Bytes(2 * unit)),
                prefetch_depth: 0,
                ..Default::default()
            },
        )?;
        let held = rt.acquire_many(&ids[..2])?;
        assert_eq!(held.iter().map(|g| g.unit()).collect::<Vec<_>>(), ids[..2]);
        assert!(rt.acquire(ids[2]).is_err(), "both pinned: no room");
        // Three at once do not fit: the call fails and leaves none of them pinned.
        let other = OffloadRuntime::new(store.clone(), &dev, &OffloadConfig::default())?;
        let mut mixed = Vec::new();
        for g in held.into_iter().zip(other.acquire_many(&ids[..2])?) {
            mixed.extend([g.0, g.1]);
        }
        UnitGuard::release_all(mixed)?;
        assert!(rt.acquire_many(&ids).is_err());
        let g = rt.acquire(ids[2])?;
        drop(g);
        let again = rt.acquire_many(&ids[..2])?;
        drop(again);
        Ok(())
    }
}
