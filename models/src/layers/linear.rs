//! A linear layer whose weight is dense or GGML blocks, as its unit holds it, and the kernel
//! each multiplies with: one row or a few on a GPU through the library's kernels, a prompt's
//! rows through the prompt GEMM, the CPU's rows through the library's SIMD matmuls, anything
//! else through Candle; several projections of one input in one launch where they can.

use candle_core::quantized::QMatMul;
use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use candle_offload::KernelTuning;

/// A linear layer with or without bias, dense from `vb`, run with `tuning`'s kernels.
pub fn linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
    tuning: KernelTuning,
) -> Result<Linear> {
    let l = if bias {
        candle_nn::linear(in_dim, out_dim, vb)?
    } else {
        candle_nn::linear_no_bias(in_dim, out_dim, vb)?
    };
    Ok(Linear::Dense(l, tuning))
}

/// A linear layer whose weight is dense (a Candle `Linear`) or GGML-quantized (a `QMatMul` over
/// the blocks as the unit holds them), as [`UnitWeights::linear`](crate::UnitWeights::linear)
/// finds it, with the kernel choices it runs with (the runtime's
/// [`candle_offload::Tuning::kernels`]).
#[derive(Debug, Clone)]
pub enum Linear {
    /// A dense weight.
    Dense(candle_nn::Linear, KernelTuning),
    /// Quantized blocks, multiplied as they are; the bias, if any, dense.
    Quantized {
        /// The matmul over the blocks.
        weight: QMatMul,
        /// The bias.
        bias: Option<Tensor>,
        /// The kernel choices.
        tuning: KernelTuning,
    },
}

impl Linear {
    /// The kernel choices it runs with.
    pub fn tuning(&self) -> &KernelTuning {
        match self {
            Self::Dense(_, t) | Self::Quantized { tuning: t, .. } => t,
        }
    }

    /// `xs · wᵀ + b`; a quantized weight computes in F32 and returns `xs`'s dtype (a prompt's
    /// rows on a GPU: in 16 bits through cuBLAS, [`candle_offload::kernels::gemm::qlinear_prefill`]). A
    /// dense F16/BF16 weight against at most [`candle_offload::kernels::linear::cpu_dense::MAX_ROWS`] rows on the
    /// CPU (a decode step) goes through [`candle_offload::kernels::linear::cpu_dense::forward`] (F32
    /// accumulation, each weight read once, on every core); anything else (F32 weights too)
    /// through Candle's matmul.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(l, t) => {
                match candle_offload::kernels::linear::cpu_dense::forward(l.weight(), xs, t)? {
                    Some(y) => with_bias(y, l.bias()),
                    None => {
                        before_candle_matmul(xs);
                        l.forward(xs)
                    }
                }
            }
            Self::Quantized {
                weight,
                bias,
                tuning,
            } => {
                let blocks = match weight {
                    QMatMul::QTensor(q) => Some(q),
                    _ => None,
                };
                // A prompt's rows on a GPU: 16-bit weights and cuBLAS (see qlinear_prefill).
                let gemm = match blocks {
                    Some(q) => candle_offload::kernels::gemm::qlinear_prefill(xs, q, tuning)?,
                    None => None,
                };
                let y = match gemm {
                    Some(y) => y,
                    None => quantized_in_f32(weight, blocks, xs, tuning)?,
                };
                with_bias(y, bias.as_ref())
            }
        }
    }

    /// Inference; with `fused`, a dense weight against at most 8 rows (a decode step) on a GPU
    /// goes through [`candle_offload::kernels::linear::linear_small`] (one bandwidth-bound kernel instead
    /// of cuBLAS's split-K GEMM and its reduction).
    ///
    /// Quantized weights of a block type the kernel has go through
    /// [`candle_offload::kernels::linear::qlinear_small`] the same way (dequantized in registers; variants 3
    /// and 4 quantize x to 8 bits). The output head uses this too.
    pub fn forward_step(&self, xs: &Tensor, fused: bool) -> Result<Tensor> {
        if !fused {
            return self.forward(xs);
        }
        let (y, bias) = match self {
            Self::Dense(l, _) => {
                let width = xs.dim(D::Minus1)?.max(1);
                let rows = xs.elem_count() / width;
                if !(xs.device().is_cuda() && rows <= 8 && l.weight().dtype() == xs.dtype()) {
                    return self.forward(xs);
                }
                (
                    candle_offload::kernels::linear::linear_small(xs, l.weight())?,
                    l.bias(),
                )
            }
            Self::Quantized {
                weight: QMatMul::QTensor(q),
                bias,
                tuning,
            } if candle_offload::kernels::linear::qlinear_small_fits(xs, &[q], tuning)? => (
                candle_offload::kernels::linear::qlinear_small(xs, q, tuning)?,
                bias.as_ref(),
            ),
            Self::Quantized { .. } => return self.forward(xs),
        };
        with_bias(y, bias)
    }

    /// [`forward_train`](Self::forward_train) when `train`, else [`forward`](Self::forward).
    pub fn run(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.run_with(xs, train, false)
    }

    /// [`forward_train`](Self::forward_train) when `train`, else
    /// [`forward_step`](Self::forward_step) with `fused`.
    pub fn run_with(&self, xs: &Tensor, train: bool, fused: bool) -> Result<Tensor> {
        if train {
            self.forward_train(xs)
        } else {
            self.forward_step(xs, fused)
        }
    }

    /// The training form (see [`linear_2d`]); quantized weights have none.
    pub fn forward_train(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(l, _) => linear_2d(l, xs),
            Self::Quantized { .. } => {
                candle_core::bail!("quantized weights cannot be trained; load the model dense")
            }
        }
    }
}

/// The weights of layers that a decode step multiplies in one launch.
pub(super) enum OneLaunch<'a> {
    /// Dense, for [`candle_offload::kernels::linear::linear_small_multi`] /
    /// [`candle_offload::kernels::linear::linear_silu_mul`].
    Dense(Vec<&'a Tensor>),
    /// GGML blocks of one type, for [`candle_offload::kernels::linear::qlinear_small_multi`] /
    /// [`candle_offload::kernels::linear::qlinear_silu_mul`].
    Blocks(Vec<&'a candle_core::quantized::QTensor>),
}

/// Before a matmul through Candle (its CPU matmuls run on a pool of threads of its own): on
/// the CPU, the library's matmul workers park instead of spinning beside it.
fn before_candle_matmul(xs: &Tensor) {
    if xs.device().is_cpu() {
        candle_offload::kernels::pool::park_idle_workers();
    }
}

/// On the CPU, one row of `xs` against several projections of GGML blocks in one pass of the
/// matmul pool ([`candle_offload::kernels::linear::cpu_quant::forward_many`]: each output the number
/// [`Linear::forward`] gives), their biases added; `None` where that does not apply.
pub(super) fn cpu_blocks_many(xs: &Tensor, ls: &[&Linear]) -> Result<Option<Vec<Tensor>>> {
    if !xs.device().is_cpu() {
        return Ok(None);
    }
    let ws: Option<Vec<_>> = ls
        .iter()
        .map(|l| match l {
            Linear::Quantized {
                weight: QMatMul::QTensor(q),
                ..
            } => Some(q),
            _ => None,
        })
        .collect();
    let Some(ws) = ws else {
        return Ok(None);
    };
    let Some(ys) =
        candle_offload::kernels::linear::cpu_quant::forward_many(&ws, xs, ls[0].tuning())?
    else {
        return Ok(None);
    };
    ys.into_iter()
        .zip(ls)
        .map(|(y, l)| match l {
            Linear::Quantized { bias, .. } => with_bias(y, bias.as_ref()),
            Linear::Dense(..) => Ok(y),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// `xs · wᵀ` for a quantized weight in F32, returned in `xs`'s dtype: Q4_1 and Q8_0 blocks
/// (`blocks`, the weight's) on the CPU through the library's SIMD matmul, otherwise Candle's.
fn quantized_in_f32(
    weight: &QMatMul,
    blocks: Option<&std::sync::Arc<candle_core::quantized::QTensor>>,
    xs: &Tensor,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    let x32 = xs.to_dtype(DType::F32)?;
    let fast = match blocks {
        Some(q) => candle_offload::kernels::linear::cpu_quant::forward(q, &x32, tuning)?,
        None => None,
    };
    let y = match fast {
        Some(y) => y,
        None => {
            before_candle_matmul(&x32);
            weight.forward(&x32)?
        }
    };
    y.to_dtype(xs.dtype())
}

/// `y + b` broadcast over y's rows, the bias cast to y's dtype; `y` itself without a bias.
fn with_bias(y: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?),
        None => Ok(y),
    }
}

/// The weights of `ls` when a decode step can multiply them in one launch: `xs` on a GPU with
/// at most 8 rows, every layer without bias, and either all dense in `xs`'s dtype or all
/// blocks the quantized kernel takes.
pub(super) fn one_launch_weights<'a>(
    xs: &Tensor,
    ls: &[&'a Linear],
) -> Result<Option<OneLaunch<'a>>> {
    let rows = xs.elem_count() / xs.dim(D::Minus1)?.max(1);
    if !xs.device().is_cuda() || rows > 8 {
        return Ok(None);
    }
    let dense: Option<Vec<_>> = ls
        .iter()
        .map(|l| match l {
            Linear::Dense(d, _) if d.bias().is_none() && d.weight().dtype() == xs.dtype() => {
                Some(d.weight())
            }
            _ => None,
        })
        .collect();
    if let Some(ws) = dense {
        return Ok(Some(OneLaunch::Dense(ws)));
    }
    let blocks: Option<Vec<_>> = ls
        .iter()
        .map(|l| match l {
            Linear::Quantized {
                weight: QMatMul::QTensor(q),
                bias: None,
                ..
            } => Some(q.as_ref()),
            _ => None,
        })
        .collect();
    Ok(match blocks {
        Some(ws)
            if candle_offload::kernels::linear::qlinear_small_fits(xs, &ws, ls[0].tuning())? =>
        {
            Some(OneLaunch::Blocks(ws))
        }
        _ => None,
    })
}

/// Whether `l` multiplies GGML blocks by x quantized in a launch of its own (the decode
/// kernels' variant 4): a norm right before it then quantizes its rows instead
/// ([`candle_offload::kernels::norm::rms_norm_residual_q8`]).
pub(super) fn takes_quantized_x(l: &Linear) -> bool {
    match l {
        Linear::Quantized {
            weight: QMatMul::QTensor(q),
            tuning,
            ..
        } => {
            q.device().is_cuda()
                && tuning.qlinear_variant(q.dtype()) == candle_offload::QlinearVariant::V4
        }
        _ => false,
    }
}

/// A linear layer on (batch, seq, in) as one (batch·seq, in) matmul, for training: the weight
/// gradient is then one GEMM, where `Linear::forward` broadcasts the weight over the batch and
/// its backward pass materializes and sums a gradient per sequence.
pub fn linear_2d(l: &candle_nn::Linear, xs: &Tensor) -> Result<Tensor> {
    let (b, t, d) = xs.dims3()?;
    let y = xs.reshape((b * t, d))?.matmul(&l.weight().t()?)?;
    let y = match l.bias() {
        Some(bias) => y.broadcast_add(bias)?,
        None => y,
    };
    y.reshape((b, t, ()))
}
