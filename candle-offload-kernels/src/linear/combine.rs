//! A prompt's expert outputs back in their rows' order ([`combine_rows`]): each row's routed
//! copies, computed in expert order, weighted and summed into the row.

use candle_core::{DType, Result, Tensor};

/// Marks an unused slot of [`combine_rows`]'s table (a row routed to fewer experts here).
pub const NO_SLOT: u32 = u32::MAX;

/// `out[t] = Σ_j weights[t·k + j] · y[slots[t·k + j]]` for every row t of `slots.len() / k`:
/// `y` (copies, hidden) in F32, F16 or BF16, `slots` k rows of y per row ([`NO_SLOT`] for
/// none), `weights` theirs. The result is (rows, hidden) in y's dtype, summed in F32 in slot
/// order and rounded once. On a GPU the table goes up in one copy and the sum is one launch,
/// a thread per column of a row (where `index_add` has one thread per column walk every copy
/// of the layer in turn). Errors for a y of another rank or dtype, tables of other lengths,
/// or a slot past y's rows.
pub fn combine_rows(y: &Tensor, slots: &[u32], weights: &[f32], k: usize) -> Result<Tensor> {
    let (copies, hidden) = y.dims2()?;
    if k == 0 || !slots.len().is_multiple_of(k) || weights.len() != slots.len() {
        candle_core::bail!(
            "combine_rows: {} slots and {} weights are not rows of {k}",
            slots.len(),
            weights.len()
        );
    }
    if !matches!(y.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("combine_rows: y is {:?}", y.dtype());
    }
    if let Some((i, s)) = slots
        .iter()
        .enumerate()
        .find(|&(_, &s)| s != NO_SLOT && s as usize >= copies)
    {
        candle_core::bail!(
            "combine_rows: slot {s} of row {} past y's {copies} rows",
            i / k
        );
    }
    let rows = slots.len() / k;
    if rows == 0 || hidden == 0 || copies == 0 {
        return Tensor::zeros((rows, hidden), y.dtype(), y.device());
    }
    if y.device().is_cuda() {
        return launch(y, slots, weights, (rows, k, hidden));
    }
    compose(y, slots, weights, k)
}

/// [`combine_rows`] in Candle's ops: absent slots given weight 0 and row 0, each row's copies
/// gathered, weighted in F32 and summed in slot order.
fn compose(y: &Tensor, slots: &[u32], weights: &[f32], k: usize) -> Result<Tensor> {
    let rows = slots.len() / k;
    let at: Vec<u32> = slots
        .iter()
        .map(|&s| if s == NO_SLOT { 0 } else { s })
        .collect();
    let w: Vec<f32> = slots
        .iter()
        .zip(weights)
        .map(|(&s, &w)| if s == NO_SLOT { 0.0 } else { w })
        .collect();
    let dev = y.device();
    let picked = y
        .index_select(&Tensor::from_vec(at, rows * k, dev)?, 0)?
        .to_dtype(DType::F32)?
        .reshape((rows, k, ()))?;
    let w = Tensor::from_vec(w, (rows, k, 1), dev)?;
    picked.broadcast_mul(&w)?.sum(1)?.to_dtype(y.dtype())
}

#[cfg(feature = "cuda")]
fn launch(
    y: &Tensor,
    slots: &[u32],
    weights: &[f32],
    dims: (usize, usize, usize),
) -> Result<Tensor> {
    let (rows, _, hidden) = dims;
    let out = {
        let (ys, yl) = y.storage_and_layout();
        let candle_core::Storage::Cuda(ys) = &*ys else {
            candle_core::bail!("combine_rows: y is not on a GPU");
        };
        super::combine_cuda::combine_rows((ys, yl), slots, weights, dims)?
    };
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(out),
        (rows, hidden),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

#[cfg(not(feature = "cuda"))]
fn launch(
    _y: &Tensor,
    _slots: &[u32],
    _weights: &[f32],
    _dims: (usize, usize, usize),
) -> Result<Tensor> {
    candle_core::bail!("combine_rows: needs a build with `--features cuda`")
}
