//! A candle-nn `VarBuilder` backend over an acquired unit's tensors.
//!
//! A `VarBuilder` alone cannot offload: models call `vb.get` once in `load` and own the
//! tensors afterwards. So the pattern is to build a block from the unit's `VarBuilder` right
//! before it runs and drop it right after (building is only `Arc` clones):
//!
//! ```text
//! let g = rt.acquire_layer(i)?;
//! let block = Block::load(g.var_builder(dtype).pp(format!("model.layers.{i}")), &cfg)?;
//! xs = block.forward(&xs)?;
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::Init;

use crate::diag::device_label;

/// Serves `vb.get` from the dense tensors of one acquired unit.
#[derive(Debug, Clone)]
pub struct UnitBackend {
    tensors: Arc<HashMap<String, Tensor>>,
    quantized: Arc<HashMap<String, GgmlDType>>,
}

impl UnitBackend {
    /// A backend over these tensors, keyed by full checkpoint name.
    pub fn new(tensors: Arc<HashMap<String, Tensor>>) -> Self {
        Self {
            tensors,
            quantized: Arc::default(),
        }
    }

    /// Names the unit's GGML-quantized tensors, which a `VarBuilder` cannot serve: asking for
    /// one is then an error that says so, instead of "cannot find tensor".
    pub fn with_quantized(mut self, quantized: Arc<HashMap<String, GgmlDType>>) -> Self {
        self.quantized = quantized;
        self
    }
}

impl SimpleBackend for UnitBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let Some(t) = self.tensors.get(name) else {
            if let Some(g) = self.quantized.get(name) {
                candle_core::bail!(
                    "tensor {name} is stored as GGML {g:?} blocks, which a VarBuilder cannot \
                     serve: use UnitGuard::get_quantized or UnitGuard::qmatmul"
                );
            }
            return Err(candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }
            .bt());
        };
        if !t.device().same_device(dev) {
            candle_core::bail!(
                "tensor {name} is on {}, not on {}",
                device_label(t.device()),
                device_label(dev)
            );
        }
        if t.dtype() == dtype {
            Ok(t.clone())
        } else {
            t.to_dtype(dtype)
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}
