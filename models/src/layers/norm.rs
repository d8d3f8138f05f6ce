//! Normalisation layers: RMSNorm (plain, and Gemma's `1 + w` computed in F32) and LayerNorm,
//! for inference and in their differentiable and fused training forms.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::VarBuilder;

/// A normalisation layer: RMSNorm (with `offset` 1 the weight is applied as `1 + w` in F32,
/// as Gemma does) or LayerNorm.
#[derive(Debug, Clone)]
pub struct Norm {
    kind: NormKind,
    f32_compute: bool,
}

#[derive(Debug, Clone)]
enum NormKind {
    Rms(candle_nn::RmsNorm),
    Layer(candle_nn::LayerNorm),
}

impl Norm {
    /// RMSNorm: `weight` of width `size` from `vb`, in `dtype`.
    pub fn load(size: usize, eps: f64, offset: f64, vb: VarBuilder, dtype: DType) -> Result<Self> {
        if offset == 0.0 {
            return Ok(Self {
                kind: NormKind::Rms(candle_nn::rms_norm(size, eps, vb.to_dtype(dtype))?),
                f32_compute: false,
            });
        }
        Self::load_f32(size, eps, offset, vb)
    }

    /// RMSNorm computed in F32 whatever the input's dtype, its weight applied as `offset + w`
    /// (Gemma: offset 1 for HF checkpoints; 0 for GGUF files, whose converter adds the 1).
    pub fn load_f32(size: usize, eps: f64, offset: f64, vb: VarBuilder) -> Result<Self> {
        let w = vb.to_dtype(DType::F32).get(size, "weight")?;
        let w = if offset == 0.0 { w } else { (w + offset)? };
        Ok(Self {
            kind: NormKind::Rms(candle_nn::RmsNorm::new(w, eps)),
            f32_compute: true,
        })
    }

    /// LayerNorm: `weight` and `bias` of width `size` from `vb`, in `dtype`.
    pub fn layer_norm(size: usize, eps: f64, vb: VarBuilder, dtype: DType) -> Result<Self> {
        Ok(Self {
            kind: NormKind::Layer(candle_nn::layer_norm(size, eps, vb.to_dtype(dtype))?),
            f32_compute: false,
        })
    }

    fn run(&self, xs: &Tensor, diff: bool) -> Result<Tensor> {
        let dtype = xs.dtype();
        let x = if self.f32_compute {
            xs.to_dtype(DType::F32)?
        } else {
            xs.clone()
        };
        let y = match (&self.kind, diff) {
            (NormKind::Rms(n), false) => n.forward(&x)?,
            (NormKind::Rms(n), true) => n.forward_diff(&x)?,
            (NormKind::Layer(n), false) => n.forward(&x)?,
            (NormKind::Layer(n), true) => layer_norm_diff(n, &x)?,
        };
        if self.f32_compute {
            y.to_dtype(dtype)
        } else {
            Ok(y)
        }
    }

    /// Inference (Candle's fused kernels).
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.run(xs, false)
    }

    /// The weight and epsilon of a plain RMSNorm that computes in the weight's dtype (what
    /// [`candle_offload::kernels::norm::rms_norm_residual`] can replace); `None` for LayerNorm and for
    /// Gemma's `1 + w` norms computed in F32.
    pub fn rms_parts(&self) -> Option<(&Tensor, f64)> {
        match &self.kind {
            NormKind::Rms(n) if !self.f32_compute => Some((n.weight(), n.eps())),
            _ => None,
        }
    }

    /// Differentiable (training; Candle's fused kernels cut the gradient): the composition.
    pub fn forward_diff(&self, xs: &Tensor) -> Result<Tensor> {
        self.run(xs, true)
    }

    /// Differentiable, an RMSNorm as one op with its own backward kernels
    /// ([`candle_offload::kernels::norm::rms_norm`]); LayerNorm, and weights in another dtype than the
    /// input, as [`forward_diff`](Self::forward_diff).
    pub fn forward_train_fused(&self, xs: &Tensor) -> Result<Tensor> {
        let NormKind::Rms(n) = &self.kind else {
            return self.forward_diff(xs);
        };
        let dtype = xs.dtype();
        let x = if self.f32_compute {
            xs.to_dtype(DType::F32)?
        } else {
            xs.clone()
        };
        if n.weight().dtype() != x.dtype() {
            return self.forward_diff(xs);
        }
        let y = candle_offload::kernels::norm::rms_norm(&x, n.weight(), n.eps())?;
        if self.f32_compute {
            y.to_dtype(dtype)
        } else {
            Ok(y)
        }
    }

    /// Training: [`forward_train_fused`](Self::forward_train_fused) with `fused`, otherwise
    /// [`forward_diff`](Self::forward_diff).
    pub fn forward_train(&self, xs: &Tensor, fused: bool) -> Result<Tensor> {
        if fused {
            self.forward_train_fused(xs)
        } else {
            self.forward_diff(xs)
        }
    }
}

/// LayerNorm from differentiable ops (the composition Candle's fused kernel replaces).
fn layer_norm_diff(n: &candle_nn::LayerNorm, x: &Tensor) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let y = centered.broadcast_div(&(var + n.eps())?.sqrt()?)?;
    let y = y.broadcast_mul(n.weight())?;
    match n.bias() {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}
