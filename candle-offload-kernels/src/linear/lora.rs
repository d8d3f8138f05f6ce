//! LoRA beside a frozen linear layer ([`LoraAdapter`]): `y = x·Wᵀ + b + scale·B·(A·dropout(x))`
//! with A (r, in) and B (out, r); and the training form of a frozen GGML-block weight
//! ([`quantized_train`]): differentiable in x only, the blocks multiplied as blocks in the
//! forward pass and, in the backward pass to x, read one weight at a time in the gradient's
//! dtype (16-bit on a GPU), never kept.

use std::sync::{Arc, Mutex};

use candle_core::quantized::QMatMul;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, D};

/// A low-rank update of one linear layer: `scale · B·(A·dropout(x))`. A and B are whatever
/// tensors the caller holds (a trainer's F32 masters as variables, so that Candle's autograd
/// gives their gradients; an adapter read from a file); they are cast to x's dtype where they
/// are used (a differentiable cast: the gradient reaches the master in its own dtype).
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: f32,
    /// A and `scale`·B detached in the dtype and on the device the untracked passes last
    /// used ([`forget_casts`](Self::forget_casts) drops them when A or B change); shared by
    /// clones, which hold the same A and B.
    casts: Arc<Mutex<Option<Casts>>>,
}

/// [`LoraAdapter`]'s detached factors in one dtype on one device.
#[derive(Debug)]
struct Casts {
    dtype: DType,
    device: candle_core::DeviceLocation,
    a: Tensor,
    b_scaled: Tensor,
}

impl LoraAdapter {
    /// An adapter of `a` (r, in) and `b` (out, r), scaled by `scale` (alpha / r, or
    /// alpha / √r for rsLoRA), with `dropout` on its input while training.
    pub fn new(a: Tensor, b: Tensor, scale: f64, dropout: f32) -> Result<Self> {
        let (r, _) = a.dims2()?;
        let (_, rb) = b.dims2()?;
        if r != rb {
            candle_core::bail!(
                "LoRA: A has rank {r} ({:?}) but B has {rb} ({:?})",
                a.dims(),
                b.dims()
            );
        }
        if !(0.0..1.0).contains(&dropout) {
            candle_core::bail!("LoRA: dropout {dropout} is not in [0, 1)");
        }
        Ok(Self {
            a,
            b,
            scale,
            dropout,
            casts: Arc::new(Mutex::new(None)),
        })
    }

    /// Drops the detached copies the untracked passes keep ([`add_delta_untracked`],
    /// [`backward`]): a trainer calls it before a pass after its optimizer changed A or B.
    ///
    /// [`add_delta_untracked`]: Self::add_delta_untracked
    /// [`backward`]: Self::backward
    pub fn forget_casts(&self) {
        if let Ok(mut c) = self.casts.lock() {
            *c = None;
        }
    }

    /// A (r, in).
    pub fn a(&self) -> &Tensor {
        &self.a
    }

    /// B (out, r).
    pub fn b(&self) -> &Tensor {
        &self.b
    }

    /// The scale of the update.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The dropout on the adapter's input while training.
    pub fn dropout(&self) -> f32 {
        self.dropout
    }

    /// The rank r.
    pub fn rank(&self) -> usize {
        self.a.dim(0).unwrap_or(0)
    }

    /// Input and output widths (in, out).
    pub fn dims(&self) -> (usize, usize) {
        (self.a.dim(1).unwrap_or(0), self.b.dim(0).unwrap_or(0))
    }

    /// `scale · B·(A·dropout(x))` for `xs` (…, in), in xs's dtype, shaped (…, out); dropout
    /// only when `train`. The rows are multiplied as one (rows, in) matrix, so that A's and
    /// B's gradients are one GEMM each.
    pub fn delta(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let dims = xs.dims().to_vec();
        let width = xs.dim(D::Minus1)?;
        let rows = xs.elem_count() / width.max(1);
        let x = xs.reshape((rows, width))?;
        let x = if train && self.dropout > 0.0 {
            candle_nn::ops::dropout(&x, self.dropout)?
        } else {
            x
        };
        let a = self.a.to_device(x.device())?.to_dtype(x.dtype())?;
        let b = self.b.to_device(x.device())?.to_dtype(x.dtype())?;
        let y = x
            .matmul(&a.t()?)?
            .matmul(&b.t()?)?
            .affine(self.scale, 0.0)?;
        let mut out = dims;
        if let Some(last) = out.last_mut() {
            *last = self.b.dim(0)?;
        }
        y.reshape(out)
    }

    /// `y + scale · B·(A·x)` for `x` (rows, in) and the base layer's output `y` (rows, out),
    /// without a graph (A and B detached, cast to x's dtype; no dropout): the forward pass of
    /// a block that computes its own backward pass. On a GPU, with y in x's dtype, the second
    /// product is accumulated into y's own buffer ([`crate::gemm::add_matmul_t`]), so `y` must
    /// be a tensor the caller alone holds.
    pub fn add_delta_untracked(&self, y: Tensor, x: &Tensor) -> Result<Tensor> {
        let (a, b_scaled) = self.factors_as(x)?;
        crate::gemm::add_matmul_t(y, &x.matmul(&a.t()?)?, &b_scaled)
    }

    /// The backward pass of [`add_delta_untracked`](Self::add_delta_untracked)'s update for the output's
    /// gradient `dy` (rows, out), with `dx_base` (rows, in, in x's dtype), the frozen
    /// weight's share of x's gradient, which the adapter's share is added to (on a GPU in
    /// its own buffer: the caller alone holds it): x's whole gradient, and A's and B's
    /// gradients in F32. With s the scale, `d(x·Aᵀ) = s·dy·B`, `dx = dx_base + d(x·Aᵀ)·A`,
    /// `dA = d(x·Aᵀ)ᵀ·x`, `dB = s·dyᵀ·(x·Aᵀ)`.
    pub fn backward(
        &self,
        x: &Tensor,
        dy: &Tensor,
        dx_base: Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (a, b_scaled) = self.factors_as(x)?;
        let dy = dy.to_dtype(x.dtype())?;
        let xa = x.matmul(&a.t()?)?;
        let db = dy.t()?.matmul(&xa)?.affine(self.scale, 0.0)?;
        let dxa = dy.matmul(&b_scaled)?;
        let da = dxa.t()?.matmul(x)?;
        let dx = crate::gemm::add_matmul(dx_base.to_dtype(x.dtype())?, &dxa, &a)?;
        Ok((dx, da.to_dtype(DType::F32)?, db.to_dtype(DType::F32)?))
    }

    /// A and `scale`·B detached, on x's device in x's dtype: kept from the last call in the
    /// same dtype and device until [`forget_casts`](Self::forget_casts).
    fn factors_as(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let poisoned = |_| candle_core::Error::Msg("LoRA factors poisoned".into());
        let mut casts = self.casts.lock().map_err(poisoned)?;
        let location = x.device().location();
        if let Some(c) = casts.as_ref() {
            if c.dtype == x.dtype() && c.device == location {
                return Ok((c.a.clone(), c.b_scaled.clone()));
            }
        }
        let cast = |t: &Tensor| t.detach().to_device(x.device())?.to_dtype(x.dtype());
        let a = cast(&self.a)?;
        let b_scaled = cast(&self.b.affine(self.scale, 0.0)?)?;
        *casts = Some(Casts {
            dtype: x.dtype(),
            device: location,
            a: a.clone(),
            b_scaled: b_scaled.clone(),
        });
        Ok((a, b_scaled))
    }

    /// The update as a dense weight, `scale · B·A` (out, in) in F32: what merging adds to the
    /// base weight.
    pub fn delta_weight(&self) -> Result<Tensor> {
        self.b
            .to_dtype(DType::F32)?
            .matmul(&self.a.to_dtype(DType::F32)?)?
            .affine(self.scale, 0.0)
    }
}

/// `xs · Wᵀ` for a frozen GGML-block (or `QMatMul`-held) weight W (out, in), `xs` (rows, in),
/// differentiable in `xs` only: the value is `value`, computed beforehand from `xs.detach()`
/// by the layer's own kernel (blocks multiplied as blocks); the backward pass gives
/// `grad · W`, W dequantized for that one product in the gradient's dtype (on a GPU the
/// 16-bit rows of [`crate::gemm::dequantize_rows`]) and dropped after it.
pub fn quantized_train(xs: &Tensor, value: Tensor, w: &QMatMul) -> Result<Tensor> {
    if !xs.track_op() {
        return Ok(value);
    }
    let value = if value.is_contiguous() && value.layout().start_offset() == 0 {
        value
    } else {
        value.copy()?
    };
    xs.apply_op1(QuantizedTrain {
        value: Mutex::new(Some(value)),
        w: w.clone(),
    })
}

/// `dy · W` for a frozen GGML-block (or `QMatMul`-held) weight W (out, in): x's gradient for
/// the output's gradient `dy` (rows, out), in dy's dtype, W dequantized for this one product.
pub(crate) fn input_gradient(w: &QMatMul, dy: &Tensor) -> Result<Tensor> {
    dy.matmul(&dense_weight(w, dy.dtype(), dy.device())?)
}

/// W (out, in) as a dense tensor in `dtype` on `device`, for one product.
fn dense_weight(w: &QMatMul, dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    match w {
        QMatMul::QTensor(q) => {
            #[cfg(feature = "cuda")]
            if device.is_cuda() && matches!(dtype, DType::F16 | DType::BF16) {
                let (out, _) = q.shape().dims2()?;
                return crate::gemm::dequantize_rows(q, 0, out, dtype);
            }
            if dtype == DType::F16 {
                q.dequantize_f16(device)
            } else {
                q.dequantize(device)?.to_dtype(dtype)
            }
        }
        QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.to_device(device)?.to_dtype(dtype),
    }
}

/// The graph node of [`quantized_train`].
struct QuantizedTrain {
    value: Mutex<Option<Tensor>>,
    w: QMatMul,
}

impl QuantizedTrain {
    fn take(&self) -> Result<Tensor> {
        self.value
            .lock()
            .map_err(|_| candle_core::Error::Msg("quantized_train: value poisoned".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("quantized_train: forward ran twice".into()))
    }
}

impl CustomOp1 for QuantizedTrain {
    fn name(&self) -> &'static str {
        "quantized-linear-train"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = self.take()?;
        let (storage, layout) = v.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.clone(), layout.shape().clone())),
            _ => candle_core::bail!("quantized_train: the value is not on the input's device"),
        }
    }

    // Candle's dummy CUDA storage stands in without the `cuda` feature (no value is ever on a
    // GPU then, so this never runs).
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let v = self.take()?;
        let (storage, layout) = v.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("quantized_train: the value is not on the input's device"),
        }
    }

    fn bwd(&self, xs: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(input_gradient(&self.w, grad)?.to_dtype(xs.dtype())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::{Linear, LinearWeight};
    use crate::tuning::KernelTuning;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Var};
    use std::sync::Arc;

    fn ramp(shape: (usize, usize), seed: f64, dtype: DType) -> Result<Tensor> {
        let n = shape.0 * shape.1;
        let v: Vec<f64> = (0..n)
            .map(|i| (i as f64 * 0.37 + seed).sin() * 0.5)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> Result<f64> {
        let a = a.to_dtype(DType::F64)?;
        let b = b.to_dtype(DType::F64)?;
        let d = (&a - &b)?.abs()?.max_all()?.to_scalar::<f64>()?;
        let m = b.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-12);
        Ok(d / m)
    }

    struct Case {
        x: Var,
        a: Var,
        b: Var,
        probe: Tensor,
    }

    fn case(dtype: DType, (rows, k, n, r): (usize, usize, usize, usize)) -> Result<Case> {
        Ok(Case {
            x: Var::from_tensor(&ramp((rows, k), 0.1, dtype)?)?,
            a: Var::from_tensor(&ramp((r, k), 1.3, dtype)?)?,
            b: Var::from_tensor(&ramp((n, r), 2.9, dtype)?)?,
            probe: ramp((rows, n), 4.2, dtype)?,
        })
    }

    /// Loss `Σ probe ⊙ layer(x)` of a layer with the case's adapter, and its gradients with
    /// respect to x, A and B.
    fn loss_and_grads(
        c: &Case,
        weight: LinearWeight,
        bias: Option<Tensor>,
        scale: f64,
    ) -> Result<(f64, [Tensor; 3])> {
        let adapter =
            LoraAdapter::new(c.a.as_tensor().clone(), c.b.as_tensor().clone(), scale, 0.0)?;
        let l = Linear::new(weight, bias, KernelTuning::default()).with_adapter(Arc::new(adapter));
        let y = l
            .forward_train(&c.x.as_tensor().unsqueeze(0)?)?
            .squeeze(0)?;
        let loss = (y * &c.probe)?.sum_all()?;
        let grads = loss.backward()?;
        let g = |v: &Var| grads.get(v.as_tensor()).cloned().expect("a gradient");
        Ok((
            loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            [g(&c.x), g(&c.a), g(&c.b)],
        ))
    }

    /// In F64, A's and B's gradients equal central finite differences of the loss.
    #[test]
    fn adapter_gradients_match_finite_differences_in_f64() -> Result<()> {
        let c = case(DType::F64, (5, 12, 7, 3))?;
        let w = ramp((7, 12), 0.7, DType::F64)?;
        let bias = ramp((1, 7), 0.2, DType::F64)?.flatten_all()?;
        let scale = 16.0 / 3.0;
        let (_, [_, ga, gb]) = loss_and_grads(
            &c,
            LinearWeight::Dense(w.clone()),
            Some(bias.clone()),
            scale,
        )?;
        let h = 1e-6;
        for (var, grad) in [(&c.a, &ga), (&c.b, &gb)] {
            let base = var.as_tensor().flatten_all()?.to_vec1::<f64>()?;
            let want = grad.flatten_all()?.to_vec1::<f64>()?;
            for i in 0..base.len() {
                let at = |d: f64| -> Result<f64> {
                    let mut v = base.clone();
                    v[i] += d;
                    var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu)?)?;
                    Ok(loss_and_grads(
                        &c,
                        LinearWeight::Dense(w.clone()),
                        Some(bias.clone()),
                        scale,
                    )?
                    .0)
                };
                let fd = (at(h)? - at(-h)?) / (2.0 * h);
                assert!(
                    (fd - want[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                    "element {i}: finite difference {fd}, gradient {}",
                    want[i]
                );
            }
            var.set(&Tensor::from_vec(base, var.shape(), &Device::Cpu)?)?;
        }
        Ok(())
    }

    /// In F32, the adapter's output and x's gradient equal a dense layer of W + scale·B·A, and
    /// A's and B's gradients their closed forms, within 1e-5.
    #[test]
    fn adapter_equals_its_dense_equivalent() -> Result<()> {
        let c = case(DType::F32, (9, 32, 24, 4))?;
        let w = ramp((24, 32), 0.5, DType::F32)?;
        let scale = 2.0;
        let (_, [gx, ga, gb]) = loss_and_grads(&c, LinearWeight::Dense(w.clone()), None, scale)?;
        let adapter =
            LoraAdapter::new(c.a.as_tensor().clone(), c.b.as_tensor().clone(), scale, 0.0)?;
        let merged = (&w + adapter.delta_weight()?)?;
        let x = c.x.as_tensor();
        let lora = Linear::new(
            LinearWeight::Dense(w.clone()),
            None,
            KernelTuning::default(),
        )
        .with_adapter(Arc::new(adapter.clone()));
        let dense = Linear::new(
            LinearWeight::Dense(merged.clone()),
            None,
            KernelTuning::default(),
        );
        assert!(max_rel(&lora.forward(x)?, &dense.forward(x)?)? < 1e-5);
        let want_gx = c.probe.matmul(&merged)?;
        assert!(max_rel(&gx, &want_gx)? < 1e-5);
        // dB = scale · gᵀ·(x·Aᵀ), dA = scale · (g·B)ᵀ·x.
        let want_gb = c
            .probe
            .t()?
            .matmul(&x.matmul(&c.a.as_tensor().t()?)?)?
            .affine(scale, 0.)?;
        let want_ga = c
            .probe
            .matmul(c.b.as_tensor())?
            .t()?
            .matmul(x)?
            .affine(scale, 0.)?;
        assert!(max_rel(&gb, &want_gb)? < 1e-5);
        assert!(max_rel(&ga, &want_ga)? < 1e-5);
        Ok(())
    }

    /// A base of GGML blocks gives the adapter the gradients its dequantized twin gives: the
    /// weights are the same numbers, only the activations' rounding in the blocks' matmul
    /// differs.
    #[test]
    fn quantized_base_gives_its_dequantized_twins_gradients() -> Result<()> {
        let c = case(DType::F32, (6, 256, 32, 8))?;
        let w = ramp((32, 256), 0.9, DType::F32)?;
        for ty in [GgmlDType::Q8_0, GgmlDType::Q4K] {
            let q = Arc::new(QTensor::quantize(&w, ty)?);
            let twin = q.dequantize(&Device::Cpu)?;
            let (lq, gq) =
                loss_and_grads(&c, LinearWeight::Quantized(QMatMul::QTensor(q)), None, 0.5)?;
            let (ld, gd) = loss_and_grads(&c, LinearWeight::Dense(twin), None, 0.5)?;
            assert!(
                (lq - ld).abs() < 1e-2 * (1.0 + ld.abs()),
                "{ty:?}: loss {lq} vs {ld}"
            );
            for (name, (a, b)) in ["x", "A", "B"].iter().zip(gq.iter().zip(&gd)) {
                let rel = max_rel(a, b)?;
                assert!(rel < 1e-2, "{ty:?}: {name}'s gradient differs by {rel}");
            }
            // x's gradient through the blocks is exact: grad·W with W the same numbers.
            let rel = max_rel(&gq[0], &gd[0])?;
            assert!(rel < 1e-5, "{ty:?}: x's gradient differs by {rel}");
        }
        Ok(())
    }

    /// Dropout acts only while training, and a zero B gives the base layer unchanged.
    #[test]
    fn dropout_only_while_training_and_zero_b_is_the_base() -> Result<()> {
        let x = ramp((4, 16), 0.3, DType::F32)?;
        let a = ramp((2, 16), 0.4, DType::F32)?;
        let b = ramp((8, 2), 0.8, DType::F32)?;
        let ad = LoraAdapter::new(a.clone(), b, 1.0, 0.5)?;
        assert_eq!(
            ad.delta(&x, false)?.to_vec2::<f32>()?,
            ad.delta(&x, false)?.to_vec2::<f32>()?
        );
        assert!(max_rel(&ad.delta(&x, true)?, &ad.delta(&x, false)?)? > 1e-3);
        let zero = LoraAdapter::new(
            a,
            Tensor::zeros((8, 2), DType::F32, &Device::Cpu)?,
            1.0,
            0.0,
        )?;
        let w = ramp((8, 16), 0.1, DType::F32)?;
        let base = Linear::new(
            LinearWeight::Dense(w.clone()),
            None,
            KernelTuning::default(),
        );
        let with = base.clone().with_adapter(Arc::new(zero));
        assert_eq!(
            with.forward(&x)?.to_vec2::<f32>()?,
            base.forward(&x)?.to_vec2::<f32>()?
        );
        assert!(LoraAdapter::new(
            ramp((2, 16), 0.0, DType::F32)?,
            ramp((8, 3), 0.0, DType::F32)?,
            1.0,
            0.0
        )
        .is_err());
        Ok(())
    }
}
