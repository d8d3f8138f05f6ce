//! `x · wᵀ` for a decode step's few rows of GGML-block weights ([`qlinear_small`], its q/k/v
//! form [`qlinear_small_multi`] and its SwiGLU form [`qlinear_silu_mul`]): the blocks
//! dequantized in registers, x in its float type or quantized to 8 bits, by one of the CUDA
//! kernel's variants per block type ([`KernelTuning::qlinear`]); Q4_K's and Q6_K's super-blocks
//! have kernels of their own ([`KernelTuning::qlinear_k`]).

use candle_core::quantized::QTensor;
use candle_core::{DType, Result, Tensor, D};

use crate::activation::silu_mul;
use crate::handover::prequantized_of;
use crate::linear::blocks::{is_qlinear_k_type, qlinear_small_type};
use crate::linear::small::split_multi;
use crate::tuning::KernelTuning;
use crate::util::{check_dtypes, LINEAR_SMALL_MAX_ROWS};

const QLINEAR_SMALL: &str = "qlinear-small";

/// Whether the GGML-block kernel takes `x` and `ws`: x (F32, F16 or BF16) and the weights on
/// a GPU, at most 8 rows, one block type the kernel has (Q4_K and Q6_K only when
/// [`KernelTuning::qlinear_k`] is on), every weight (n, k) with k = x's width, a multiple of the type's block (32 elements,
/// 256 for the K-quants).
pub fn qlinear_small_fits(x: &Tensor, ws: &[&QTensor], tuning: &KernelTuning) -> Result<bool> {
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k.max(1);
    let Some(first) = ws.first() else {
        return Ok(false);
    };
    Ok(x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && rows > 0
        && rows <= tuning.qlinear_small_rows.min(LINEAR_SMALL_MAX_ROWS)
        && k.is_multiple_of(first.dtype().block_size())
        && qlinear_small_type(first.dtype()).is_some()
        && (!is_qlinear_k_type(first.dtype()) || tuning.qlinear_k)
        && ws.iter().all(|w| {
            w.dtype() == first.dtype()
                && w.device().is_cuda()
                && w.shape().dims().len() == 2
                && w.shape().dims()[1] == k
        }))
}

/// Runs the GGML-block CUDA kernel on x (rows, k): its one output buffer as a flat tensor
/// without a gradient (see [`linear_small_launch`]).
#[cfg(feature = "cuda")]
fn qlinear_small_launch(
    x: &Tensor,
    ws: &[&QTensor],
    silu: bool,
    pre: Option<Tensor>,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    Ok(qlinear_small_launch_q8(x, ws, silu, pre, false, tuning)?.0)
}

/// [`qlinear_small_launch`], with `q8_out` also the output quantized for variant 4
/// (`cuda::qlinear_small`'s conditions).
#[cfg(feature = "cuda")]
fn qlinear_small_launch_q8(
    x: &Tensor,
    ws: &[&QTensor],
    silu: bool,
    pre: Option<Tensor>,
    q8_out: bool,
    tuning: &KernelTuning,
) -> Result<(Tensor, Option<candle_core::CudaStorage>)> {
    use candle_core::Storage;
    let rows = x.dim(0)?;
    let x = if crate::util::aligned16(x.layout(), x.dtype()) && x.is_contiguous() {
        x.clone()
    } else {
        x.force_contiguous()?
    };
    let cols: usize = if silu {
        ws[0].shape().dims()[0]
    } else {
        ws.iter().map(|w| w.shape().dims()[0]).sum()
    };
    let out = {
        let (xs, xl) = x.storage_and_layout();
        let Storage::Cuda(xs) = &*xs else {
            candle_core::bail!("{QLINEAR_SMALL}: x is not on a GPU")
        };
        let pre = pre.as_ref().map(|p| p.storage_and_layout());
        let pre = match pre.as_ref().map(|(s, _)| &**s) {
            Some(Storage::Cuda(p)) => Some(p),
            _ => None,
        };
        crate::linear::cuda::qlinear_small((xs, xl), ws, silu, pre, q8_out, tuning)?
    };
    let (out, yq) = out;
    Ok((
        Tensor::from_storage(
            Storage::Cuda(out),
            rows * cols,
            candle_core::op::BackpropOp::none(),
            false,
        ),
        yq,
    ))
}

#[cfg(not(feature = "cuda"))]
fn qlinear_small_launch(
    _x: &Tensor,
    _ws: &[&QTensor],
    _silu: bool,
    _pre: Option<Tensor>,
    _tuning: &KernelTuning,
) -> Result<Tensor> {
    candle_core::bail!("{QLINEAR_SMALL}: needs a build with `--features cuda`")
}

/// `x · wᵀ` for a weight of GGML blocks (out, in) and an `x` (…, in): on a GPU, for at most 8
/// rows and a block type the kernels have ([`qlinear_small_fits`]: blocks of 32 elements, and
/// Q4_K / Q6_K when [`KernelTuning::qlinear_k`] is on), one pass over the blocks that
/// dequantizes them in registers and multiplies them by every row in F32; otherwise the
/// composition ([`qlinear_small_unfused`]). The result has x's dtype.
pub fn qlinear_small(x: &Tensor, w: &QTensor, tuning: &KernelTuning) -> Result<Tensor> {
    Ok(qlinear_small_multi(x, &[w], tuning)?.remove(0))
}

/// [`qlinear_small`] for two or three weights that read the same `x` (q, k and v), in one
/// launch on a GPU, each result contiguous.
pub fn qlinear_small_multi(
    x: &Tensor,
    ws: &[&QTensor],
    tuning: &KernelTuning,
) -> Result<Vec<Tensor>> {
    if ws.is_empty() || ws.len() > 3 {
        candle_core::bail!("{QLINEAR_SMALL}: 1 to 3 weights, not {}", ws.len());
    }
    check_dtypes(QLINEAR_SMALL, &[x])?;
    if !qlinear_small_fits(x, ws, tuning)? {
        return ws.iter().map(|w| qlinear_small_unfused(x, w)).collect();
    }
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k;
    let flat = qlinear_small_launch(
        &x.reshape((rows, k))?,
        ws,
        false,
        prequantized_of(x),
        tuning,
    )?;
    let ns: Vec<usize> = ws.iter().map(|w| w.shape().dims()[0]).collect();
    split_multi(x, &flat, &ns)
}

/// `silu(x · gateᵀ) · (x · upᵀ)` for weights of GGML blocks: one launch on a GPU
/// ([`qlinear_small_fits`]); otherwise [`qlinear_small_unfused`] twice and [`silu_mul`].
pub fn qlinear_silu_mul(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    qlinear_silu_mul_with(x, gate, up, false, tuning)
}

/// [`qlinear_silu_mul`] for an output that goes next into a GGML-block matmul of variant 4 (the
/// down projection): on a GPU, where gate and up run variant 4's kernel for blocks of 32 and
/// their width is a multiple of 32, the kernel also writes its output quantized, and
/// [`qlinear_small`] given this very tensor (by its id, as after [`rms_norm_residual_q8`](crate::norm::rms_norm_residual_q8)) reads
/// it instead of quantizing it in a launch of its own. The values equal
/// [`qlinear_silu_mul`]'s, and the next matmul's, bit for bit.
pub fn qlinear_silu_mul_q8(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    qlinear_silu_mul_with(x, gate, up, true, tuning)
}

fn qlinear_silu_mul_with(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    q8: bool,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    check_dtypes(QLINEAR_SMALL, &[x])?;
    if gate.shape() != up.shape() {
        candle_core::bail!(
            "{QLINEAR_SMALL}: gate {:?} and up {:?} differ in shape",
            gate.shape(),
            up.shape()
        );
    }
    if !qlinear_small_fits(x, &[gate, up], tuning)? {
        return silu_mul(
            &qlinear_small_unfused(x, gate)?,
            &qlinear_small_unfused(x, up)?,
        );
    }
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k;
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("x has a last dim") = gate.shape().dims()[0];
    #[cfg(feature = "cuda")]
    {
        let n = gate.shape().dims()[0];
        if q8
            && tuning.qlinear_variant_at(gate.dtype(), rows) == crate::tuning::QlinearVariant::V4
            && !is_qlinear_k_type(gate.dtype())
            && n.is_multiple_of(32)
        {
            let (y, yq) = qlinear_small_launch_q8(
                &x.reshape((rows, k))?,
                &[gate, up],
                true,
                prequantized_of(x),
                true,
                tuning,
            )?;
            let y = y.reshape(dims)?;
            if let Some(yq) = yq {
                crate::handover::prequantized::remember(&y, yq, rows, n);
            }
            return Ok(y);
        }
    }
    let _ = q8;
    qlinear_small_launch(
        &x.reshape((rows, k))?,
        &[gate, up],
        true,
        prequantized_of(x),
        tuning,
    )?
    .reshape(dims)
}

/// The composition [`qlinear_small`] replaces: Candle's quantized matmul (`QMatMul`'s) on x
/// in F32, cast back to x's dtype. Candle's CPU dot products of some types take blocks in
/// pairs and panic on an odd count per row; those rows are dequantized and multiplied densely.
pub fn qlinear_small_unfused(x: &Tensor, w: &QTensor) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let k = x.dim(D::Minus1)?;
    let odd_blocks = (k / w.dtype().block_size()) % 2 == 1;
    let y = if w.device().is_cpu() && odd_blocks {
        x32.broadcast_matmul(&w.dequantize(&w.device())?.t()?)?
    } else {
        x32.apply_op1_no_bwd(w)?
    };
    y.to_dtype(x.dtype())
}
