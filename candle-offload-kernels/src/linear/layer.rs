//! One linear layer, `x · wᵀ + b`, whatever its weight's format and device ([`Linear`]). It
//! chooses its kernel once, in [`Linear::kernel`], from the device, the weight's format, the
//! rows of x and the [`KernelTuning`], and runs it: the model code calls one op and knows
//! nothing of kernel variants. [`Linear::forward_many`] and [`Linear::silu_gate_up`] do the same
//! for the layers a decode step multiplies in one launch (q, k and v; a SwiGLU's gate and up).

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor, D};

use crate::gemm::{prefill_applies, qlinear_prefill};
use crate::linear::lora::{quantized_train, LoraAdapter};
use crate::linear::quantized::{
    qlinear_silu_mul, qlinear_silu_mul_q8, qlinear_small, qlinear_small_fits, qlinear_small_multi,
};
use crate::linear::small::{linear_silu_mul, linear_small, linear_small_multi};
use crate::linear::{cpu_dense, cpu_quant};
use crate::pool::park_idle_workers;
use crate::tuning::{KernelTuning, QlinearVariant};
use crate::util::LINEAR_SMALL_MAX_ROWS;

/// A linear layer's weight (out, in): dense, or Candle's quantized matmul (GGML blocks as the
/// unit holds them, or the dense forms `QMatMul` keeps of some types).
#[derive(Debug, Clone)]
pub enum LinearWeight {
    /// A dense weight, multiplied in its dtype.
    Dense(Tensor),
    /// A quantized weight, multiplied in F32 (x is cast to F32 and the result back).
    Quantized(QMatMul),
}

/// The kernel [`Linear::forward`] runs for a given x.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LinearKernel {
    /// A decode step's rows (at most 8) of a dense weight in x's dtype on a GPU:
    /// [`linear_small`], one bandwidth-bound pass over the weight.
    SmallDense,
    /// A decode step's rows of GGML blocks on a GPU: [`qlinear_small`], in the variant the block
    /// type runs ([`KernelTuning::qlinear`]).
    SmallBlocks(QlinearVariant),
    /// A prompt's rows of GGML blocks on a GPU: 16-bit weights and cuBLAS
    /// ([`qlinear_prefill`](crate::gemm::qlinear_prefill)).
    PrefillGemm,
    /// A decode step's rows of a dense F16/BF16 weight on the CPU: [`cpu_dense::forward`].
    CpuDense,
    /// GGML blocks on the CPU through this crate's SIMD matmul ([`cpu_quant::forward`]: Q4_1,
    /// Q8_0, and the K-quants under [`KernelTuning::cpu_kquants`]); Candle's where it declines.
    CpuBlocks,
    /// Candle's matmul: a dense weight in its dtype, a quantized one in F32.
    Candle,
}

/// A linear layer: its weight, its bias, the kernel choices it runs with, and a LoRA adapter
/// beside its frozen weight where it has one ([`with_adapter`](Self::with_adapter)).
#[derive(Debug, Clone)]
pub struct Linear {
    weight: LinearWeight,
    bias: Option<Tensor>,
    tuning: KernelTuning,
    adapter: Option<Arc<LoraAdapter>>,
}

impl Linear {
    /// A layer of `weight` (out, in) and `bias` (out), run with `tuning`'s kernel choices.
    pub fn new(weight: LinearWeight, bias: Option<Tensor>, tuning: KernelTuning) -> Self {
        Self {
            weight,
            bias,
            tuning,
            adapter: None,
        }
    }

    /// The same layer with `adapter` beside its weight: every forward form adds
    /// `adapter.delta(x)` ([`LoraAdapter::delta`]; dropout only in
    /// [`forward_train`](Self::forward_train)).
    pub fn with_adapter(mut self, adapter: Arc<LoraAdapter>) -> Self {
        self.adapter = Some(adapter);
        self
    }

    /// The LoRA adapter beside the weight, if any.
    pub fn adapter(&self) -> Option<&Arc<LoraAdapter>> {
        self.adapter.as_ref()
    }

    /// A candle-nn `Linear`'s weight and bias, run with `tuning`.
    pub fn from_candle(l: &candle_nn::Linear, tuning: KernelTuning) -> Self {
        Self::new(
            LinearWeight::Dense(l.weight().clone()),
            l.bias().cloned(),
            tuning,
        )
    }

    /// The weight.
    pub fn weight(&self) -> &LinearWeight {
        &self.weight
    }

    /// The bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The kernel choices it runs with.
    pub fn tuning(&self) -> &KernelTuning {
        &self.tuning
    }

    /// The GGML blocks of a quantized weight held as such.
    fn blocks(&self) -> Option<&Arc<QTensor>> {
        match &self.weight {
            LinearWeight::Quantized(QMatMul::QTensor(q)) => Some(q),
            _ => None,
        }
    }

    /// The kernel [`forward`](Self::forward) runs on `xs` (…, in): with `decode_kernels` off,
    /// the GPU's decode-step kernels ([`LinearKernel::SmallDense`],
    /// [`LinearKernel::SmallBlocks`]) are not chosen (the fused ops off).
    pub fn kernel(&self, xs: &Tensor, decode_kernels: bool) -> Result<LinearKernel> {
        let width = xs.dim(D::Minus1)?.max(1);
        let rows = xs.elem_count() / width;
        let gpu = xs.device().is_cuda();
        Ok(match &self.weight {
            LinearWeight::Dense(w) => {
                if decode_kernels && gpu && rows <= LINEAR_SMALL_MAX_ROWS && w.dtype() == xs.dtype()
                {
                    LinearKernel::SmallDense
                } else if cpu_dense::applies(w, xs) {
                    LinearKernel::CpuDense
                } else {
                    LinearKernel::Candle
                }
            }
            LinearWeight::Quantized(_) => match self.blocks() {
                Some(q) if decode_kernels && qlinear_small_fits(xs, &[q], &self.tuning)? => {
                    LinearKernel::SmallBlocks(self.tuning.qlinear_variant_at(q.dtype(), rows))
                }
                Some(q) if prefill_applies(xs, q, &self.tuning) => LinearKernel::PrefillGemm,
                // The CPU matmul itself declines blocks it has no kernel for (and blocks off
                // the CPU): Candle's then.
                Some(_) if xs.device().is_cpu() => LinearKernel::CpuBlocks,
                _ => LinearKernel::Candle,
            },
        })
    }

    /// `xs · wᵀ + b` by the kernel [`kernel`](Self::kernel) chooses (the decode kernels on), in
    /// `xs`'s dtype.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_with(xs, true)
    }

    /// [`forward`](Self::forward), with `decode_kernels` as [`kernel`](Self::kernel) takes it.
    pub fn forward_with(&self, xs: &Tensor, decode_kernels: bool) -> Result<Tensor> {
        let y = match (self.kernel(xs, decode_kernels)?, &self.weight) {
            (LinearKernel::SmallDense, LinearWeight::Dense(w)) => linear_small(xs, w)?,
            (LinearKernel::SmallBlocks(_), _) => {
                qlinear_small(xs, self.expect_blocks()?, &self.tuning)?
            }
            (LinearKernel::PrefillGemm, _) => {
                match qlinear_prefill(xs, self.expect_blocks()?, &self.tuning)? {
                    Some(y) => y,
                    None => self.candle(xs)?,
                }
            }
            (LinearKernel::CpuDense, LinearWeight::Dense(w)) => {
                match cpu_dense::forward(w, xs, &self.tuning)? {
                    Some(y) => y,
                    None => self.candle(xs)?,
                }
            }
            (LinearKernel::CpuBlocks, _) => {
                let x32 = xs.to_dtype(DType::F32)?;
                match cpu_quant::forward(self.expect_blocks()?, &x32, &self.tuning)? {
                    Some(y) => y.to_dtype(xs.dtype())?,
                    None => self.candle(xs)?,
                }
            }
            _ => self.candle(xs)?,
        };
        let y = with_bias(y, self.bias.as_ref())?;
        self.with_delta(y, xs, false)
    }

    /// `y` plus the adapter's update of `xs` (dropout when `train`), `y` without an adapter.
    fn with_delta(&self, y: Tensor, xs: &Tensor, train: bool) -> Result<Tensor> {
        match &self.adapter {
            Some(a) => {
                let d = a.delta(xs, train)?.to_dtype(y.dtype())?;
                y + d
            }
            None => Ok(y),
        }
    }

    /// The blocks of a weight [`kernel`](Self::kernel) chose a kernel of blocks for.
    fn expect_blocks(&self) -> Result<&Arc<QTensor>> {
        match self.blocks() {
            Some(q) => Ok(q),
            None => candle_core::bail!("linear: the weight is not held as GGML blocks"),
        }
    }

    /// `xs · wᵀ` through Candle's matmul, in `xs`'s dtype: the dense weight as it is, the
    /// quantized one in F32; on the CPU, where Candle's matmul runs on more than one thread
    /// (the current rayon pool's), this crate's spinning workers park first, so that they
    /// leave the cores to Candle's threads. On a one-thread pool (a decode step's,
    /// [`crate::pool::on_cpu_step_pool`]) they keep spinning: parked, the next region would
    /// wait for them to wake.
    fn candle(&self, xs: &Tensor) -> Result<Tensor> {
        if xs.device().is_cpu() && rayon::current_num_threads() > 1 {
            park_idle_workers();
        }
        match &self.weight {
            LinearWeight::Dense(w) => candle_nn::Linear::new(w.clone(), None).forward(xs),
            LinearWeight::Quantized(m) => {
                m.forward(&xs.to_dtype(DType::F32)?)?.to_dtype(xs.dtype())
            }
        }
    }

    /// Whether it multiplies GGML blocks on a GPU by `rows` rows of x quantized in a launch of
    /// its own (the decode kernels' variant 4, up to their rows): the op that makes its x (a
    /// norm, the attention, a SwiGLU) can then write x quantized for it
    /// ([`crate::norm::rms_norm_residual_q8`] and the like). A prompt's rows go to other
    /// kernels, which would not read it.
    pub fn takes_quantized_x(&self, rows: usize) -> bool {
        self.blocks().is_some_and(|q| {
            q.device().is_cuda()
                && rows <= self.tuning.qlinear_small_rows.min(LINEAR_SMALL_MAX_ROWS)
                && self.tuning.qlinear_variant_at(q.dtype(), rows) == QlinearVariant::V4
        })
    }

    /// [`forward`](Self::forward) of each layer of `layers` on the same `xs` (q, k and v; gate
    /// and up), in one launch where a decode step's kernels take them all (a GPU, at most 8
    /// rows, no biases, all dense in `xs`'s dtype or all blocks of one type the kernel has),
    /// else the first two in one launch and the rest alone (Q4_K_M keeps v in Q6_K in some
    /// layers); on the CPU, all blocks in one pass of the worker pool
    /// ([`cpu_quant::forward_many`]); otherwise one by one. The results are each layer's
    /// [`forward`](Self::forward), up to the summation order of the kernel that ran.
    pub fn forward_many(xs: &Tensor, layers: &[&Linear]) -> Result<Vec<Tensor>> {
        Self::forward_many_with(xs, layers, true)
    }

    /// [`forward_many`](Self::forward_many), with `decode_kernels` as [`kernel`](Self::kernel)
    /// takes it: off, no launch is shared on a GPU and each layer runs
    /// [`forward_with`](Self::forward_with) off ([`forward_each`](Self::forward_each)).
    pub fn forward_many_with(
        xs: &Tensor,
        layers: &[&Linear],
        decode_kernels: bool,
    ) -> Result<Vec<Tensor>> {
        if decode_kernels && layers.iter().all(|l| l.adapter.is_none()) {
            if let Some(ys) = one_launch(xs, layers)? {
                return Ok(ys);
            }
            if layers.len() > 2 {
                if let Some(OneLaunch::Blocks(ws)) = one_launch_weights(xs, &layers[..2])? {
                    let mut ys = qlinear_small_multi(xs, &ws, layers[0].tuning())?;
                    for l in &layers[2..] {
                        ys.push(l.forward_with(xs, decode_kernels)?);
                    }
                    return Ok(ys);
                }
            }
        }
        Self::forward_each(xs, layers, decode_kernels)
    }

    /// Each layer of `layers` on the same `xs` by its own kernel
    /// ([`forward_with`](Self::forward_with) with `decode_kernels`), except that on the CPU
    /// layers all of GGML blocks run in one pass of the worker pool
    /// ([`cpu_quant::forward_many`]); no launch is shared on a GPU (a GeGLU's gate and up).
    pub fn forward_each(
        xs: &Tensor,
        layers: &[&Linear],
        decode_kernels: bool,
    ) -> Result<Vec<Tensor>> {
        if let Some(ys) = cpu_blocks_many(xs, layers)? {
            return Ok(ys);
        }
        layers
            .iter()
            .map(|l| l.forward_with(xs, decode_kernels))
            .collect()
    }

    /// The training form: x (batch, seq, in) as one (batch·seq, in) matmul against the dense
    /// weight, so that the weight's gradient is one GEMM (a broadcast weight's backward pass
    /// would materialize and sum one per sequence), plus the adapter's update with its
    /// dropout. A quantized weight is frozen: it is multiplied as blocks, differentiable in x
    /// only ([`quantized_train`]), and is refused without an adapter (nothing would train).
    pub fn forward_train(&self, xs: &Tensor) -> Result<Tensor> {
        let (b, t, d) = xs.dims3()?;
        let x2 = xs.reshape((b * t, d))?;
        let y = match &self.weight {
            LinearWeight::Dense(w) => {
                let y = x2.matmul(&w.t()?)?;
                match &self.bias {
                    Some(bias) => y.broadcast_add(bias)?,
                    None => y,
                }
            }
            LinearWeight::Quantized(m) => {
                if self.adapter.is_none() {
                    candle_core::bail!(
                        "quantized weights cannot be trained; load the model dense or train \
                         LoRA adapters on it"
                    )
                }
                let value = self.forward_base(&x2.detach())?;
                with_bias(quantized_train(&x2, value, m)?, self.bias.as_ref())?
            }
        };
        let y = self.with_delta(y, &x2, true)?;
        y.reshape((b, t, ()))
    }

    /// The layer on `x` (rows, in) with its weight frozen and no graph: the base by the kernel
    /// [`kernel`](Self::kernel) chooses with the decode kernels off, the bias, and the
    /// adapter's update ([`LoraAdapter::add_delta_untracked`]); the forward pass of a block that
    /// computes its own backward pass ([`input_gradient`](Self::input_gradient)).
    pub fn forward_frozen(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.detach();
        let y = with_bias(self.forward_base(&x)?, self.bias.as_ref())?;
        match &self.adapter {
            // The base's output is this call's own: the update is added into it.
            Some(a) => a.add_delta_untracked(y, &x),
            None => Ok(y),
        }
    }

    /// The frozen weight's share of x's gradient for the output's gradient `dy` (rows, out):
    /// `dy · W` in dy's dtype, GGML blocks dequantized for this one product (on a GPU, 16-bit
    /// rows) and dropped after it. The adapter's share is [`LoraAdapter::backward`]'s.
    pub fn input_gradient(&self, dy: &Tensor) -> Result<Tensor> {
        match &self.weight {
            LinearWeight::Dense(w) => dy.matmul(&w.detach().to_dtype(dy.dtype())?),
            LinearWeight::Quantized(m) => crate::linear::lora::input_gradient(m, dy),
        }
    }

    /// The base layer without its adapter and bias, by the kernel [`kernel`](Self::kernel)
    /// chooses with the decode kernels off.
    fn forward_base(&self, xs: &Tensor) -> Result<Tensor> {
        let base = Self::new(self.weight.clone(), None, self.tuning);
        base.forward_with(xs, false)
    }

    /// `silu(xs · gateᵀ) · (xs · upᵀ)` in one launch where a decode step's kernels take gate
    /// and up ([`forward_many`](Self::forward_many)'s conditions), the output quantized for
    /// `next` where it [`takes_quantized_x`](Self::takes_quantized_x); `None` elsewhere (the
    /// caller multiplies gate and up by [`forward_many`](Self::forward_many) and applies its
    /// activation).
    pub fn silu_gate_up(
        xs: &Tensor,
        gate: &Linear,
        up: &Linear,
        next: Option<&Linear>,
    ) -> Result<Option<Tensor>> {
        if gate.adapter.is_some() || up.adapter.is_some() {
            return Ok(None);
        }
        let rows = xs.elem_count() / xs.dim(D::Minus1)?.max(1);
        Ok(match one_launch_weights(xs, &[gate, up])? {
            Some(OneLaunch::Dense(ws)) => Some(linear_silu_mul(xs, ws[0], ws[1])?),
            Some(OneLaunch::Blocks(ws)) if next.is_some_and(|n| n.takes_quantized_x(rows)) => {
                Some(qlinear_silu_mul_q8(xs, ws[0], ws[1], gate.tuning())?)
            }
            Some(OneLaunch::Blocks(ws)) => Some(qlinear_silu_mul(xs, ws[0], ws[1], gate.tuning())?),
            None => None,
        })
    }
}

/// `y + b` broadcast over y's rows, the bias cast to y's dtype; `y` itself without a bias.
fn with_bias(y: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?),
        None => Ok(y),
    }
}

/// The weights of layers that a decode step multiplies in one launch.
enum OneLaunch<'a> {
    /// Dense, for [`linear_small_multi`] / [`linear_silu_mul`].
    Dense(Vec<&'a Tensor>),
    /// GGML blocks of one type, for [`qlinear_small_multi`] / [`qlinear_silu_mul`].
    Blocks(Vec<&'a QTensor>),
}

/// The weights of `layers` when a decode step can multiply them in one launch: `xs` on a GPU
/// with at most 8 rows, every layer without bias, and either all dense in `xs`'s dtype or all
/// blocks the quantized kernel takes.
fn one_launch_weights<'a>(xs: &Tensor, layers: &[&'a Linear]) -> Result<Option<OneLaunch<'a>>> {
    let rows = xs.elem_count() / xs.dim(D::Minus1)?.max(1);
    if !xs.device().is_cuda() || rows > LINEAR_SMALL_MAX_ROWS || layers.is_empty() {
        return Ok(None);
    }
    let dense: Option<Vec<_>> = layers
        .iter()
        .map(|l| match (&l.weight, &l.bias) {
            (LinearWeight::Dense(w), None) if w.dtype() == xs.dtype() => Some(w),
            _ => None,
        })
        .collect();
    if let Some(ws) = dense {
        return Ok(Some(OneLaunch::Dense(ws)));
    }
    let blocks: Option<Vec<_>> = layers
        .iter()
        .map(|l| match (l.blocks(), &l.bias) {
            (Some(q), None) => Some(q.as_ref()),
            _ => None,
        })
        .collect();
    Ok(match blocks {
        Some(ws) if qlinear_small_fits(xs, &ws, layers[0].tuning())? => Some(OneLaunch::Blocks(ws)),
        _ => None,
    })
}

/// Every layer of `layers` in one launch, where [`one_launch_weights`] says a decode step can.
fn one_launch(xs: &Tensor, layers: &[&Linear]) -> Result<Option<Vec<Tensor>>> {
    Ok(match one_launch_weights(xs, layers)? {
        Some(OneLaunch::Dense(ws)) => Some(linear_small_multi(xs, &ws)?),
        Some(OneLaunch::Blocks(ws)) => Some(qlinear_small_multi(xs, &ws, layers[0].tuning())?),
        None => None,
    })
}

/// On the CPU, one row of `xs` against several layers of GGML blocks in one pass of the matmul
/// pool ([`cpu_quant::forward_many`]: each output the number [`Linear::forward`] gives), their
/// biases added; `None` where that does not apply.
fn cpu_blocks_many(xs: &Tensor, layers: &[&Linear]) -> Result<Option<Vec<Tensor>>> {
    if !xs.device().is_cpu() || layers.is_empty() || layers.iter().any(|l| l.adapter.is_some()) {
        return Ok(None);
    }
    let Some(ws) = layers
        .iter()
        .map(|l| l.blocks())
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(None);
    };
    let Some(ys) = cpu_quant::forward_many(&ws, xs, layers[0].tuning())? else {
        return Ok(None);
    };
    ys.into_iter()
        .zip(layers)
        .map(|(y, l)| with_bias(y, l.bias.as_ref()))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::Device;

    fn ramp(shape: (usize, usize), seed: f32) -> Result<Tensor> {
        let n = shape.0 * shape.1;
        let v: Vec<f32> = (0..n)
            .map(|i| (i as f32 * 0.37 + seed).sin() * 0.5)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?;
        d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// On the CPU: a dense F16 weight against a decode step's rows takes the dense CPU matmul,
    /// more rows and F32 weights Candle's; GGML blocks take the quantized CPU matmul; every
    /// choice gives the product of the same numbers (the bias added).
    #[test]
    fn chooses_the_cpu_kernels_and_computes_the_product() -> Result<()> {
        let t = KernelTuning::default();
        let (n, k) = (24, 64);
        let w32 = ramp((n, k), 0.3)?;
        let bias = ramp((1, n), 1.7)?.flatten_all()?;
        let x1 = ramp((1, k), 0.9)?;
        let x20 = ramp((20, k), 2.1)?;
        let want = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
            x.matmul(&w.to_dtype(DType::F32)?.t()?)?
                .broadcast_add(&bias)
        };

        let dense16 = Linear::new(
            LinearWeight::Dense(w32.to_dtype(DType::F16)?),
            Some(bias.clone()),
            t,
        );
        let x1h = x1.to_dtype(DType::F16)?;
        assert_eq!(dense16.kernel(&x1h, true)?, LinearKernel::CpuDense);
        let y = dense16.forward(&x1h)?;
        assert_eq!(y.dtype(), DType::F16);
        assert!(max_diff(&y, &want(&x1, &w32.to_dtype(DType::F16)?)?)? < 1e-2);
        let x20h = x20.to_dtype(DType::F16)?;
        assert_eq!(dense16.kernel(&x20h, true)?, LinearKernel::Candle);
        assert!(max_diff(&dense16.forward(&x20h)?, &want(&x20, &w32)?)? < 5e-2);

        let dense32 = Linear::new(LinearWeight::Dense(w32.clone()), Some(bias.clone()), t);
        assert_eq!(dense32.kernel(&x1, true)?, LinearKernel::Candle);
        assert!(max_diff(&dense32.forward(&x1)?, &want(&x1, &w32)?)? < 1e-5);

        let q = Arc::new(QTensor::quantize(&w32, GgmlDType::Q8_0)?);
        let wq = q.dequantize(&Device::Cpu)?;
        let quant = Linear::new(
            LinearWeight::Quantized(QMatMul::QTensor(q)),
            Some(bias.clone()),
            t,
        );
        assert_eq!(quant.kernel(&x1, true)?, LinearKernel::CpuBlocks);
        assert!(!quant.takes_quantized_x(1));
        assert!(max_diff(&quant.forward(&x1)?, &want(&x1, &wq)?)? < 1e-4);
        assert!(max_diff(&quant.forward(&x20)?, &want(&x20, &wq)?)? < 1e-4);
        Ok(())
    }

    /// The kernel the models' own dispatch chose before it moved here (their `Linear`'s
    /// `forward_step(xs, fused)`, which fell back to `forward`), written out as it was: the
    /// reference [`Linear::kernel`] must equal.
    fn models_choice(l: &Linear, xs: &Tensor, fused: bool) -> Result<LinearKernel> {
        let rows = xs.elem_count() / xs.dim(D::Minus1)?.max(1);
        let blocks = match &l.weight {
            LinearWeight::Quantized(QMatMul::QTensor(q)) => Some(q),
            _ => None,
        };
        if fused {
            match (&l.weight, blocks) {
                (LinearWeight::Dense(w), _)
                    if xs.device().is_cuda() && rows <= 8 && w.dtype() == xs.dtype() =>
                {
                    return Ok(LinearKernel::SmallDense)
                }
                (_, Some(q)) if qlinear_small_fits(xs, &[q], &l.tuning)? => {
                    return Ok(LinearKernel::SmallBlocks(
                        l.tuning.qlinear_variant_at(q.dtype(), rows),
                    ))
                }
                _ => {}
            }
        }
        Ok(match (&l.weight, blocks) {
            // `cpu_dense::forward` was tried first: it runs where it applies.
            (LinearWeight::Dense(w), _) if cpu_dense::applies(w, xs) => LinearKernel::CpuDense,
            (LinearWeight::Dense(_), _) => LinearKernel::Candle,
            // `qlinear_prefill` first, then `cpu_quant::forward` (which declines off the CPU).
            (_, Some(q)) if prefill_applies(xs, q, &l.tuning) => LinearKernel::PrefillGemm,
            (_, Some(_)) if xs.device().is_cpu() => LinearKernel::CpuBlocks,
            _ => LinearKernel::Candle,
        })
    }

    /// Over a table of weights (dense F32/F16/BF16, GGML blocks of several types, with and
    /// without bias), x dtypes, rows (a decode step's, a few, a prompt's), the decode kernels
    /// on and off and several tunings, [`Linear::kernel`] chooses what the models chose, and
    /// [`Linear::forward_with`] computes.
    fn choice_table(device: &Device) -> Result<()> {
        let k = 256;
        let w32 = ramp((32, k), 0.6)?.to_device(device)?;
        let bias = ramp((1, 32), 1.1)?.flatten_all()?.to_device(device)?;
        let mut weights = Vec::new();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            weights.push(LinearWeight::Dense(w32.to_dtype(dtype)?));
        }
        for ty in [
            GgmlDType::Q8_0,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ] {
            let q = QTensor::quantize_onto(&w32.to_device(&Device::Cpu)?, ty, device)?;
            weights.push(LinearWeight::Quantized(QMatMul::QTensor(Arc::new(q))));
        }
        let default = KernelTuning::default();
        let mut tunings = vec![default];
        let mut t = default;
        t.prefill_gemm = false;
        t.cpu_kquants = Some(true);
        t.qlinear_k = false;
        tunings.push(t);
        let mut t = default;
        t.cpu_kquants = Some(false);
        t.cpu_q8_activations = !default.cpu_q8_activations;
        t.prefill_gemm_min_rows = 4;
        tunings.push(t);
        let mut cases = 0;
        for w in &weights {
            for b in [None, Some(bias.clone())] {
                for tuning in &tunings {
                    let l = Linear::new(w.clone(), b.clone(), *tuning);
                    for x_dtype in [DType::F32, DType::F16] {
                        for rows in [1, 3, 8, 9, 80] {
                            let x = ramp((rows, k), 0.2)?
                                .to_dtype(x_dtype)?
                                .to_device(device)?
                                .unsqueeze(0)?;
                            for fused in [true, false] {
                                let want = models_choice(&l, &x, fused)?;
                                assert_eq!(
                                    l.kernel(&x, fused)?,
                                    want,
                                    "{w:?} bias {} {tuning:?} {x_dtype:?} {rows} rows, \
                                     decode kernels {fused}",
                                    b.is_some()
                                );
                                // Dense weights of another dtype than x: Candle refuses them.
                                let same_dtype = match w {
                                    LinearWeight::Dense(w) => w.dtype() == x_dtype,
                                    LinearWeight::Quantized(_) => true,
                                };
                                if same_dtype || want == LinearKernel::CpuDense {
                                    let y = l.forward_with(&x, fused)?;
                                    assert_eq!(y.dims(), &[1, rows, 32]);
                                }
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(cases, 8 * 2 * 3 * 2 * 5 * 2);
        Ok(())
    }

    #[test]
    fn chooses_the_kernel_the_models_chose_on_the_cpu() -> Result<()> {
        choice_table(&Device::Cpu)
    }

    /// The same table on a GPU, where there is one.
    #[cfg(feature = "cuda")]
    #[test]
    fn chooses_the_kernel_the_models_chose_on_a_gpu() -> Result<()> {
        match Device::new_cuda(0) {
            Ok(device) => choice_table(&device),
            Err(_) => Ok(()),
        }
    }

    /// Several layers on one x give each layer's own result: blocks in one pass of the CPU
    /// pool, dense ones one by one; and no one-launch SwiGLU off the GPU.
    #[test]
    fn many_layers_give_each_layers_result() -> Result<()> {
        let t = KernelTuning::default();
        let k = 64;
        let x = ramp((1, k), 0.4)?;
        let quantized = |n: usize, seed: f32| -> Result<Linear> {
            let q = QTensor::quantize(&ramp((n, k), seed)?, GgmlDType::Q8_0)?;
            Ok(Linear::new(
                LinearWeight::Quantized(QMatMul::QTensor(Arc::new(q))),
                None,
                t,
            ))
        };
        let (a, b, c) = (
            quantized(32, 0.1)?,
            quantized(16, 0.2)?,
            quantized(16, 0.3)?,
        );
        let many = Linear::forward_many(&x, &[&a, &b, &c])?;
        for (y, l) in many.iter().zip([&a, &b, &c]) {
            assert_eq!(max_diff(y, &l.forward(&x)?)?, 0.0);
        }
        let d = Linear::new(LinearWeight::Dense(ramp((8, k), 0.5)?), None, t);
        let mixed = Linear::forward_many(&x, &[&a, &d])?;
        assert_eq!(max_diff(&mixed[1], &d.forward(&x)?)?, 0.0);
        assert!(Linear::silu_gate_up(&x, &b, &c, None)?.is_none());
        Ok(())
    }
}
