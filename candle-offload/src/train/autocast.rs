//! Autocast: which dtype each kind of op computes in.
//!
//! There is no dispatcher in Candle to intercept ops, so autocast is a policy the model code
//! consults at the few places where dtypes change: weights of matmuls are served in the compute
//! dtype ([`AutocastBackend`] casts the F32 master on the way out, a differentiable cast), the
//! activations entering a matmul are cast to it ([`Autocast::to_compute`]), and everything
//! numerically delicate (the residual stream, norms, softmax, the loss) runs in F32
//! ([`Autocast::to_f32`]). This mirrors `torch.autocast`: matmul outputs are half precision,
//! the residual add promotes back to F32.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, TensorId};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};

/// The compute precision of a training run (`--autocast f16|bf16|off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything in F32 (autocast off).
    #[default]
    F32,
    /// Matmuls in F16; needs loss scaling ([`GradScaler`](super::GradScaler)).
    F16,
    /// Matmuls in BF16; F32's range, so no loss scaling.
    BF16,
}

impl Precision {
    /// The dtype matmuls run in.
    pub fn compute_dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::BF16 => DType::BF16,
        }
    }

    /// Whether gradients risk underflowing without loss scaling (F16).
    pub fn needs_loss_scaling(self) -> bool {
        self == Self::F16
    }
}

keyword_enum!(Precision, "autocast", crate::Error, [crate::Error::InvalidConfig], {
    F32 => "off" | "f32" | "fp32" | "none",
    F16 => "f16" | "fp16" | "half",
    BF16 => "bf16",
});

/// The autocast policy: master weights and delicate ops in F32, matmuls in the compute dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Autocast {
    precision: Precision,
}

impl Autocast {
    /// A policy computing matmuls in `precision`.
    pub fn new(precision: Precision) -> Self {
        Self { precision }
    }

    /// The precision.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The dtype of matmul weights and of the activations between matmuls.
    pub fn compute_dtype(&self) -> DType {
        self.precision.compute_dtype()
    }

    /// The dtype of master weights, norms, softmax, the residual stream and the loss.
    pub fn f32_dtype(&self) -> DType {
        DType::F32
    }

    /// `xs` in the compute dtype (a no-op when it already is).
    pub fn to_compute(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        xs.to_dtype(self.compute_dtype())
    }

    /// `xs` in F32 (a no-op when it already is).
    pub fn to_f32(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        xs.to_dtype(DType::F32)
    }

    /// A `VarBuilder` over F32 masters in `vars` that serves tensors in the compute dtype by
    /// default; ask for F32 (`vb.set_dtype(DType::F32)`) where a weight feeds a norm.
    pub fn var_builder(&self, vars: &VarMap, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(
            Box::new(AutocastBackend::new(vars.clone())),
            self.compute_dtype(),
            device.clone(),
        )
    }

    /// [`var_builder`](Self::var_builder) that also records in `origins` which master each
    /// served tensor was cast from, for blocks that compute their own backward pass and hand
    /// the gradient of a served weight back ([`CastOrigins::master_of`]).
    pub fn var_builder_recording(
        &self,
        vars: &VarMap,
        device: &Device,
        origins: &CastOrigins,
    ) -> VarBuilder<'static> {
        let mut backend = AutocastBackend::new(vars.clone());
        backend.origins = Some(origins.clone());
        VarBuilder::from_backend(Box::new(backend), self.compute_dtype(), device.clone())
    }
}

/// Which F32 master each tensor an [`AutocastBackend`] served was cast from, by tensor id:
/// shared, cheap to clone, cleared by its owner (a training step) when the served tensors are
/// gone.
#[derive(Clone, Default)]
pub struct CastOrigins {
    map: Arc<Mutex<HashMap<TensorId, Tensor>>>,
}

impl fmt::Debug for CastOrigins {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.map.lock().map(|m| m.len()).unwrap_or(0);
        write!(f, "CastOrigins({n} tensors)")
    }
}

impl CastOrigins {
    fn lock(&self) -> candle_core::Result<std::sync::MutexGuard<'_, HashMap<TensorId, Tensor>>> {
        self.map
            .lock()
            .map_err(|_| candle_core::Error::Msg("cast origins poisoned".into()))
    }

    fn record(&self, served: &Tensor, master: &Tensor) -> candle_core::Result<()> {
        self.lock()?.insert(served.id(), master.clone());
        Ok(())
    }

    /// The master `served` was cast from (itself where no cast was needed), if it was served
    /// through a backend recording here.
    pub fn master_of(&self, served: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(self.lock()?.get(&served.id()).cloned())
    }

    /// Forgets every tensor.
    pub fn clear(&self) -> candle_core::Result<()> {
        self.lock()?.clear();
        Ok(())
    }
}

/// A `VarBuilder` backend over F32 master variables that casts each weight to the dtype asked
/// for, with a differentiable cast, so the gradient of the cast copy flows to the master.
#[derive(Clone)]
pub struct AutocastBackend {
    vars: VarMap,
    origins: Option<CastOrigins>,
}

impl fmt::Debug for AutocastBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.vars.data().lock().map(|d| d.len()).unwrap_or(0);
        write!(f, "AutocastBackend({n} variables)")
    }
}

impl AutocastBackend {
    /// A backend over `vars` (F32 masters, created by `VarMap` initialisation or loaded).
    pub fn new(vars: VarMap) -> Self {
        Self {
            vars,
            origins: None,
        }
    }
}

impl SimpleBackend for AutocastBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let master = self.vars.get(s, name, init, DType::F32, dev)?;
        let served = master.to_dtype(dtype)?;
        if let Some(o) = &self.origins {
            o.record(&served, &master)?;
        }
        Ok(served)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        let data = self
            .vars
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("variable map poisoned".into()))?;
        let var = data.get(name).ok_or_else(|| {
            candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }
            .bt()
        })?;
        let served = var.as_tensor().to_dtype(dtype)?;
        if let Some(o) = &self.origins {
            o.record(&served, var.as_tensor())?;
        }
        Ok(served)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.vars
            .data()
            .lock()
            .map(|d| d.contains_key(name))
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_parses_and_refuses() {
        assert_eq!("bf16".parse::<Precision>().unwrap(), Precision::BF16);
        assert_eq!("FP16".parse::<Precision>().unwrap(), Precision::F16);
        assert_eq!("off".parse::<Precision>().unwrap(), Precision::F32);
        let e = "f8".parse::<Precision>().unwrap_err().to_string();
        assert!(e.contains("autocast") && e.contains("f8"), "{e}");
    }

    #[test]
    fn gradients_reach_the_f32_master_through_the_cast() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let vars = VarMap::new();
        let ac = Autocast::new(Precision::F16);
        let vb = ac.var_builder(&vars, &dev);
        let w = vb.get_with_hints((2, 3), "w", Init::Const(0.5))?;
        assert_eq!(w.dtype(), DType::F16);
        let x = Tensor::ones((4, 3), DType::F16, &dev)?;
        let loss = ac.to_f32(&x.matmul(&w.t()?)?)?.sum_all()?;
        let grads = loss.backward()?;
        let master = vars.data().lock().unwrap().get("w").unwrap().clone();
        let g = grads
            .get(master.as_tensor())
            .expect("gradient on the master");
        assert_eq!(g.dtype(), DType::F32);
        assert_eq!(g.to_vec2::<f32>()?, vec![vec![4f32; 3]; 2]);
        Ok(())
    }
}
