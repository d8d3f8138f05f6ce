//! A mixture-of-experts decode row whose experts the device chooses ([`ExpertTable`]): the
//! router's logits go to a kernel that takes their top k, looks the chosen experts up in a
//! table of where each expert's blocks are (its slot on the device, or its host copy in
//! page-locked memory, which the device reads through its mapped address) and hands them to
//! the grouped kernels of [`qexperts_row`](crate::linear::qexperts_row), which read them from
//! the device. The host never waits for the choice: it reads the chosen experts back later
//! ([`ExpertTable::chosen`]), to count hits and fetch what was missing, while the device goes
//! on. The table is the caller's to keep true ([`ExpertTable::set`]).

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Result, Tensor};

pub use crate::linear::routed_shape::{ExpertAddrs, RoutedShape, ROUTED_MAX_EXPERTS};
use crate::linear::MAX_GROUP_EXPERTS;

/// The device address of a quantized tensor's blocks on a GPU.
pub fn qtensor_addr(q: &QTensor) -> Result<u64> {
    imp::qtensor_addr(q)
}

/// Per layer of a model, where each expert's blocks are, and the device's choice of experts
/// for the last row each layer routed. See the module docs.
#[derive(Debug)]
pub struct ExpertTable {
    inner: imp::Table,
    layers: usize,
    experts: usize,
}

impl ExpertTable {
    /// A table of `layers` layers of `experts` experts each on `device` (a GPU), every
    /// address 0 until [`set`](Self::set).
    pub fn new(device: &Device, layers: usize, experts: usize) -> Result<Self> {
        if experts == 0 || experts > ROUTED_MAX_EXPERTS {
            candle_core::bail!(
                "expert table: {experts} experts a layer (the routing kernel takes 1 to \
                 {ROUTED_MAX_EXPERTS})"
            );
        }
        Ok(Self {
            inner: imp::Table::new(device, layers, experts)?,
            layers,
            experts,
        })
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Experts a layer.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Enqueues on the device's stream: each `(layer, expert, addresses)`'s entry set. A
    /// routed row enqueued before reads the old addresses, one after the new ones.
    pub fn set(&self, entries: &[(usize, usize, ExpertAddrs)]) -> Result<()> {
        for &(l, e, _) in entries {
            if l >= self.layers || e >= self.experts {
                candle_core::bail!(
                    "expert table: no entry for layer {l} expert {e} ({} layers of {} experts)",
                    self.layers,
                    self.experts
                );
            }
        }
        self.inner.set(self.experts, entries)
    }

    /// `Σ_e weight_e · down_e(silu(gate_e · x) · (up_e · x))` over the top `shape.top_k`
    /// experts of `logits` (1, experts) F32, weighted as `route_row` weighs them, for the
    /// row `x` (…, hidden) of `layer`, each expert's blocks where the table says: x's shape
    /// and dtype. The chosen experts can be read with [`chosen`](Self::chosen). The caller
    /// checked [`RoutedShape::fits`].
    pub fn forward(
        &self,
        layer: usize,
        x: &Tensor,
        logits: &Tensor,
        shape: &RoutedShape,
    ) -> Result<Tensor> {
        if layer >= self.layers {
            candle_core::bail!("expert table: no layer {layer} ({} layers)", self.layers);
        }
        if logits.elem_count() != self.experts || logits.dtype() != DType::F32 {
            candle_core::bail!(
                "expert table: layer {layer}'s router gives {:?} {:?} logits for {} experts",
                logits.shape(),
                logits.dtype(),
                self.experts
            );
        }
        self.inner.forward(layer, self.experts, x, logits, shape)
    }

    /// A captured step that routes rows through this table was launched (after it on the
    /// device's stream): [`chosen`](Self::chosen) waits for it from now on. A row routed
    /// eagerly needs no call.
    pub fn replayed(&self) -> Result<()> {
        self.inner.record_copied()
    }

    /// The experts the last [`forward`](Self::forward) of `layer` chose, in expert order:
    /// waits until the device has written them (for a captured step's rows, once
    /// [`replayed`](Self::replayed) says it was launched).
    pub fn chosen(&self, layer: usize, top_k: usize) -> Result<Vec<u32>> {
        if layer >= self.layers {
            candle_core::bail!("expert table: no layer {layer} ({} layers)", self.layers);
        }
        self.inner.chosen(layer, top_k.min(MAX_GROUP_EXPERTS))
    }
}

#[cfg(feature = "cuda")]
use super::routed_cuda as imp;

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::{ExpertAddrs, RoutedShape};
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Result, Tensor};

    const NO_CUDA: &str = "the device's expert routing needs a build with `--features cuda`";

    #[derive(Debug)]
    pub(super) struct Table;

    impl Table {
        pub(super) fn new(_: &Device, _: usize, _: usize) -> Result<Self> {
            candle_core::bail!("{NO_CUDA}")
        }
        pub(super) fn set(&self, _: usize, _: &[(usize, usize, ExpertAddrs)]) -> Result<()> {
            candle_core::bail!("{NO_CUDA}")
        }
        pub(super) fn forward(
            &self,
            _: usize,
            _: usize,
            _: &Tensor,
            _: &Tensor,
            _: &RoutedShape,
        ) -> Result<Tensor> {
            candle_core::bail!("{NO_CUDA}")
        }
        pub(super) fn chosen(&self, _: usize, _: usize) -> Result<Vec<u32>> {
            candle_core::bail!("{NO_CUDA}")
        }
        pub(super) fn record_copied(&self) -> Result<()> {
            candle_core::bail!("{NO_CUDA}")
        }
    }

    pub(super) fn qtensor_addr(_: &QTensor) -> Result<u64> {
        candle_core::bail!("{NO_CUDA}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::KernelTuning;
    use candle_core::quantized::GgmlDType;

    #[test]
    fn a_table_refuses_bad_sizes_and_a_cpu_row_never_fits() -> Result<()> {
        assert!(ExpertTable::new(&Device::Cpu, 2, 0).is_err());
        assert!(ExpertTable::new(&Device::Cpu, 2, ROUTED_MAX_EXPERTS + 1).is_err());
        let shape = RoutedShape {
            gate: GgmlDType::Q8_0,
            down: GgmlDType::Q8_0,
            hidden: 64,
            inter: 32,
            top_k: 2,
            renormalize: true,
        };
        let x = Tensor::zeros((1, 64), DType::F32, &Device::Cpu)?;
        assert!(!shape.fits(&x, &KernelTuning::default())?);
        Ok(())
    }
}
