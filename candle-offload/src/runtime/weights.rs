//! A fetched unit's tensors ([`Weights`]), shared by the runtime and the guards handed out for
//! the unit, with the slot for what a user derived from them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;

/// A fetched unit's tensors, by full name: dense ones as Candle tensors, GGML ones as Candle
/// quantized tensors (`QTensor`, ready for `QMatMul`). Cloning shares them.
#[derive(Debug, Clone, Default)]
pub(super) struct Weights {
    pub(super) dense: Arc<HashMap<String, Tensor>>,
    pub(super) quantized: Arc<HashMap<String, Arc<QTensor>>>,
    /// The GGML type of each quantized tensor (for the `VarBuilder`'s messages).
    pub(super) quantized_formats: Arc<HashMap<String, GgmlDType>>,
    /// What a user built from these tensors
    /// ([`UnitGuard::derived`](crate::UnitGuard::derived)); dropped with them.
    pub(super) derived: Arc<Mutex<Derived>>,
}

/// [`UnitGuard::derived`](crate::UnitGuard::derived)'s slot: one value of any type.
#[derive(Default)]
pub(super) struct Derived(pub(super) Option<Arc<dyn std::any::Any + Send + Sync>>);

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Derived(Some)"
        } else {
            "Derived(None)"
        })
    }
}

impl Weights {
    pub(super) fn new(
        dense: HashMap<String, Tensor>,
        quantized: HashMap<String, (GgmlDType, Arc<QTensor>)>,
    ) -> Self {
        let quantized_formats = quantized
            .iter()
            .map(|(n, (g, _))| (n.clone(), *g))
            .collect();
        Self {
            dense: Arc::new(dense),
            quantized: Arc::new(quantized.into_iter().map(|(n, (_, q))| (n, q)).collect()),
            quantized_formats: Arc::new(quantized_formats),
            derived: Arc::default(),
        }
    }

    /// Whether anything outside the runtime still holds these tensors.
    pub(super) fn is_shared(&self) -> bool {
        Arc::strong_count(&self.dense) > 1 || Arc::strong_count(&self.quantized) > 1
    }

    /// Takes the quantized tensors that nothing else holds, for their buffers to take another
    /// unit's blocks (`CudaEngine::upload`); what a user derived from them is dropped first,
    /// and tensors still held elsewhere stay (and are freed with these weights).
    pub(super) fn take_unique_blocks(&mut self) -> Vec<QTensor> {
        if self.is_shared() || self.quantized.is_empty() {
            return Vec::new();
        }
        if Arc::strong_count(&self.derived) == 1 {
            if let Ok(mut d) = self.derived.lock() {
                d.0 = None;
            }
        }
        let Some(map) = Arc::get_mut(&mut self.quantized) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut kept = HashMap::new();
        for (name, q) in map.drain() {
            match Arc::try_unwrap(q) {
                Ok(q) => out.push(q),
                Err(q) => {
                    kept.insert(name, q);
                }
            }
        }
        *map = kept;
        out
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    /// An evicted unit's quantized buffers are offered for reuse only where nothing else holds
    /// them: what was derived from them is dropped first; a tensor a caller still holds, or
    /// weights still shared, stay.
    #[test]
    fn only_unshared_blocks_are_taken_for_reuse() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let q = |seed: f32| -> anyhow::Result<Arc<QTensor>> {
            let t = Tensor::full(seed, (4, 64), &dev)?;
            Ok(Arc::new(QTensor::quantize(&t, GgmlDType::Q8_0)?))
        };
        let weights = |held: &[Arc<QTensor>]| {
            let map = held
                .iter()
                .enumerate()
                .map(|(i, q)| (format!("w{i}"), (GgmlDType::Q8_0, q.clone())))
                .collect();
            Weights::new(HashMap::new(), map)
        };
        // Derived values hold clones: dropped first, then both are taken.
        let (a, b) = (q(1.0)?, q(2.0)?);
        let mut w = weights(&[a, b]);
        let kept: Vec<_> = w.quantized.values().cloned().collect();
        w.derived.lock().unwrap().0 = Some(Arc::new(kept));
        assert_eq!(w.take_unique_blocks().len(), 2);
        assert!(w.quantized.is_empty());
        // A tensor held elsewhere stays with the weights.
        let (a, held) = (q(1.0)?, q(3.0)?);
        let mut w = weights(&[a, held.clone()]);
        let taken = w.take_unique_blocks();
        assert_eq!(taken.len(), 1);
        assert_eq!(w.quantized.len(), 1);
        assert!(Arc::ptr_eq(w.quantized.values().next().unwrap(), &held));
        // Shared weights (a guard's clone) give nothing.
        let mut w = weights(&[q(1.0)?]);
        let guard = w.clone();
        assert!(w.take_unique_blocks().is_empty());
        assert_eq!(guard.quantized.len(), 1);
        Ok(())
    }
}
