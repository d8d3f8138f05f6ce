//! A decode row through its routed experts ([`qexperts_row`]): each expert a SiLU-gated MLP of
//! GGML blocks, its output weighted by the router, all summed. On a GPU, a few launches for
//! all the experts of the row instead of several per expert: one for every expert's gate and
//! up, one for every down projection and one for the weighted sum, per group of
//! [`MAX_GROUP_EXPERTS`](crate::linear::MAX_GROUP_EXPERTS). Elsewhere, the composition it replaces, expert by expert.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Result, Tensor, D};

use crate::linear::blocks::{is_qlinear_k_type, qlinear_small_type};
use crate::linear::quantized::{qlinear_silu_mul, qlinear_small};
use crate::tuning::KernelTuning;

/// One routed expert of a decode row: its projections and the router's weight for it.
#[derive(Debug, Clone, Copy)]
pub struct QExpert<'a> {
    /// `(inter, hidden)`.
    pub gate: &'a QTensor,
    /// `(inter, hidden)`, gate's block type.
    pub up: &'a QTensor,
    /// `(hidden, inter)`.
    pub down: &'a QTensor,
    /// The expert's weight in the sum.
    pub weight: f32,
}

/// Whether the grouped kernels take `x` and `experts`: [`KernelTuning::grouped_experts`] on,
/// x (F32, F16 or BF16) one row on a GPU,
/// at least one expert, every gate and up of one block type and shape `(inter, hidden)`, every
/// down of one block type and shape `(hidden, inter)`, both types ones the decode kernels have
/// (Q4_K and Q6_K when [`KernelTuning::qlinear_k`] is on), widths multiples of their blocks,
/// every weight on the GPU.
pub fn qexperts_row_fits(
    x: &Tensor,
    experts: &[QExpert<'_>],
    tuning: &KernelTuning,
) -> Result<bool> {
    let Some((types, widths)) = shared_shape(experts.iter().map(|e| [e.gate, e.up, e.down])) else {
        return Ok(false);
    };
    grouped_fits(x, types, widths, tuning)
}

/// The block types `(gate, down)` and widths `(hidden, inter)` that every one of `experts`
/// (gate, up and down) has: each weight on the GPU, every gate and up of one type and shape
/// `(inter, hidden)`, every down of one type and shape `(hidden, inter)`; `None` where they
/// differ, or without experts.
pub(crate) fn shared_shape<'a>(
    experts: impl IntoIterator<Item = [&'a QTensor; 3]>,
) -> Option<((GgmlDType, GgmlDType), (usize, usize))> {
    let mut experts = experts.into_iter().peekable();
    let [gate, _, down] = *experts.peek()?;
    let (gt, dt) = (gate.dtype(), down.dtype());
    let (inter, hidden) = gate.shape().dims2().ok()?;
    experts
        .all(|[g, u, d]| {
            [g, u, d].iter().all(|w| w.device().is_cuda())
                && g.dtype() == gt
                && u.dtype() == gt
                && d.dtype() == dt
                && g.shape().dims() == [inter, hidden]
                && u.shape().dims() == [inter, hidden]
                && d.shape().dims() == [hidden, inter]
        })
        .then_some(((gt, dt), (hidden, inter)))
}

/// Whether the grouped kernels take the row `x` against experts whose gate and up are
/// `(inter, hidden)` blocks of `gate`'s type and whose down is `(hidden, inter)` of `down`'s:
/// [`KernelTuning::grouped_experts`] on, x (F32, F16 or BF16) one row of `hidden` on a GPU,
/// both types ones the decode kernels have (the K-quants when [`KernelTuning::qlinear_k`] is
/// on), widths multiples of their blocks. What [`qexperts_row_fits`] and
/// [`RoutedShape::fits`](crate::linear::RoutedShape::fits) check of the experts' shape.
pub(crate) fn grouped_fits(
    x: &Tensor,
    (gate, down): (GgmlDType, GgmlDType),
    (hidden, inter): (usize, usize),
    tuning: &KernelTuning,
) -> Result<bool> {
    Ok(x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && x.elem_count() == hidden
        && x.dim(D::Minus1)? == hidden
        && types_fit((gate, down), (hidden, inter), tuning))
}

/// What the grouped kernels need of experts whose gate and up are `(inter, hidden)` blocks of
/// `gate`'s type and whose down is `(hidden, inter)` of `down`'s:
/// [`KernelTuning::grouped_experts`] on, both types ones the decode kernels have (the K-quants
/// when [`KernelTuning::qlinear_k`] is on), widths multiples of their blocks.
pub(crate) fn types_fit(
    (gate, down): (GgmlDType, GgmlDType),
    (hidden, inter): (usize, usize),
    tuning: &KernelTuning,
) -> bool {
    let kernel = |t| qlinear_small_type(t).is_some() && (!is_qlinear_k_type(t) || tuning.qlinear_k);
    tuning.grouped_experts
        && kernel(gate)
        && kernel(down)
        && hidden.is_multiple_of(gate.block_size())
        && inter.is_multiple_of(down.block_size())
        && inter.is_multiple_of(32)
}

/// `Σ_e weight_e · down_e(silu(gate_e · x) · (up_e · x))` for one row x (…, hidden): on a
/// GPU where [`qexperts_row_fits`], the grouped kernels (variant 3's arithmetic: x and the
/// SwiGLU's output quantized to 8-bit blocks, integer dot products; the sum in F32, rounded
/// once); otherwise [`qlinear_silu_mul`] and [`qlinear_small`] per expert, each output scaled
/// and added in x's dtype. The result has x's shape and dtype; no experts give zeros.
pub fn qexperts_row(x: &Tensor, experts: &[QExpert<'_>], tuning: &KernelTuning) -> Result<Tensor> {
    crate::util::check_dtypes("qexperts_row", &[x])?;
    if experts.is_empty() {
        return x.zeros_like();
    }
    if !qexperts_row_fits(x, experts, tuning)? {
        let mut out: Option<Tensor> = None;
        for e in experts {
            let y = qlinear_small(&qlinear_silu_mul(x, e.gate, e.up, tuning)?, e.down, tuning)?
                .affine(f64::from(e.weight), 0.0)?;
            out = Some(match out {
                Some(o) => (o + y)?,
                None => y,
            });
        }
        return out.map_or_else(|| x.zeros_like(), Ok);
    }
    launch(x, experts)
}

#[cfg(feature = "cuda")]
fn launch(x: &Tensor, experts: &[QExpert<'_>]) -> Result<Tensor> {
    let hidden = x.dim(D::Minus1)?;
    let x2 = x.reshape((1, hidden))?;
    let x2 = if crate::util::aligned16(x2.layout(), x2.dtype()) && x2.is_contiguous() {
        x2
    } else {
        x2.force_contiguous()?
    };
    let ws: Vec<[&QTensor; 3]> = experts.iter().map(|e| [e.gate, e.up, e.down]).collect();
    let scales: Vec<f32> = experts.iter().map(|e| e.weight).collect();
    let out = {
        let (s, l) = x2.storage_and_layout();
        let candle_core::Storage::Cuda(s) = &*s else {
            candle_core::bail!("qexperts_row: x is not on a GPU")
        };
        crate::linear::cuda::qlinear_experts((s, l), &ws, &scales)?
    };
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(out),
        x.shape().clone(),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

#[cfg(not(feature = "cuda"))]
fn launch(_x: &Tensor, _experts: &[QExpert<'_>]) -> Result<Tensor> {
    candle_core::bail!("qexperts_row: needs a build with `--features cuda`")
}
