//! Linear layers: the one linear op of the kernels crate
//! ([`candle_offload::kernels::linear::Linear`]: dense or GGML weights, on any device, which
//! chooses its kernel itself from the device, the weight's format, the rows and the tuning),
//! loaded dense from a `VarBuilder`, and the training form of a candle-nn layer.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use candle_offload::KernelTuning;

pub use candle_offload::kernels::linear::{Linear, LinearWeight, LoraAdapter};

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
    Ok(Linear::from_candle(&l, tuning))
}

/// `l` on `xs`: its training form ([`Linear::forward_train`]) when `train`, else inference
/// ([`Linear::forward_with`], the decode kernels with `fused`).
pub(super) fn run(l: &Linear, xs: &Tensor, train: bool, fused: bool) -> Result<Tensor> {
    if train {
        l.forward_train(xs)
    } else {
        l.forward_with(xs, fused)
    }
}

/// A candle-nn linear layer on (batch, seq, in) as one (batch·seq, in) matmul, for training:
/// the weight gradient is then one GEMM, where `Linear::forward` broadcasts the weight over the
/// batch and its backward pass materializes and sums a gradient per sequence.
pub fn linear_2d(l: &candle_nn::Linear, xs: &Tensor) -> Result<Tensor> {
    let (b, t, d) = xs.dims3()?;
    let y = xs.reshape((b * t, d))?.matmul(&l.weight().t()?)?;
    let y = match l.bias() {
        Some(bias) => y.broadcast_add(bias)?,
        None => y,
    };
    y.reshape((b, t, ()))
}
