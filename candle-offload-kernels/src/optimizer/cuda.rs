//! The CUDA launch of the multi-tensor AdamW (`kernels/optimizer.cu`): every parameter of a
//! step in one launch (per 65,535 tensors), updated in place with its flat moments.

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Result};

use crate::cuda::{load_named, view_of, ELEMWISE_BLOCK, OPTIMIZER};

/// One tensor of a multi-tensor AdamW step: parameter, gradient, and the offset of its moments
/// in the flat moment buffers; all F32 and contiguous.
pub(crate) struct AdamItem<'a> {
    /// The parameter, updated in place.
    pub param: (&'a CudaStorage, &'a Layout),
    /// Its gradient.
    pub grad: (&'a CudaStorage, &'a Layout),
    /// Where its moments start in the flat buffers.
    pub offset: usize,
}

/// Most tensors one launch takes (the grid's y extent).
const ADAM_MAX_TENSORS: usize = 65_535;

/// One AdamW step over `items` in one launch (per 65,535 tensors): the parameters and the flat
/// moment buffers `m` and `v` (F32, contiguous) are updated in place. `scalars` are the
/// kernel's float arguments in order: lr, 1 - lr·wd, β1, 1 - β1, β2, 1 - β2, the two bias
/// corrections 1 / (1 - βᵗ), eps.
pub(crate) fn adamw_multi(
    items: &[AdamItem<'_>],
    (m, ml): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    scalars: [f32; 10],
) -> Result<()> {
    let Some(first) = items.first() else {
        return Ok(());
    };
    let dev = &first.param.0.device;
    let func = load_named(dev, OPTIMIZER, "adamw_multi_f32")?;
    let stream = dev.cuda_stream();
    let mv = view_of::<f32>(m, ml, "first moments")?;
    let vv = view_of::<f32>(v, vl, "second moments")?;
    if mv.len() != vv.len() {
        candle_core::bail!("adamw: moment buffers of {} and {}", mv.len(), vv.len());
    }
    let (m_ptr, _m_rec) = mv.device_ptr(&stream);
    let (v_ptr, _v_rec) = vv.device_ptr(&stream);
    for batch in items.chunks(ADAM_MAX_TENSORS) {
        let mut views = Vec::with_capacity(batch.len());
        for it in batch {
            let pv = view_of::<f32>(it.param.0, it.param.1, "parameter")?;
            let gv = view_of::<f32>(it.grad.0, it.grad.1, "gradient")?;
            let n = pv.len();
            if gv.len() != n || it.offset + n > mv.len() {
                candle_core::bail!(
                    "adamw: parameter of {n}, gradient of {}, moments at {} of {}",
                    gv.len(),
                    it.offset,
                    mv.len()
                );
            }
            views.push((pv, gv, it.offset));
        }
        let mut table = Vec::with_capacity(5 * batch.len());
        let mut records = Vec::with_capacity(2 * batch.len());
        let mut longest = 0usize;
        for (pv, gv, offset) in &views {
            let n = pv.len();
            let (p_ptr, p_rec) = pv.device_ptr(&stream);
            let (g_ptr, g_rec) = gv.device_ptr(&stream);
            let at = (offset * 4) as u64;
            table.extend_from_slice(&[p_ptr, g_ptr, m_ptr + at, v_ptr + at, n as u64]);
            records.push(p_rec);
            records.push(g_rec);
            longest = longest.max(n);
        }
        if longest == 0 {
            continue;
        }
        let table = dev.clone_htod(&table)?;
        let cfg = LaunchConfig {
            grid_dim: (
                longest.div_ceil(ELEMWISE_BLOCK as usize).clamp(1, 1 << 12) as u32,
                batch.len() as u32,
                1,
            ),
            block_dim: (ELEMWISE_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(&table);
        for x in &scalars {
            b.arg(x);
        }
        // SAFETY: the arguments match `adamw_multi_f32(const uint64_t*, float ×10)` in
        // kernels/optimizer.cu. The table, on the device (copied on this stream before the
        // launch), holds 5 entries per tensor of this batch (gridDim.y = batch length):
        // the addresses of its parameter and gradient views (n f32 each, checked above), of
        // its moments at `offset` in the flat buffers (offset + n ≤ their length, checked
        // above), and n; the kernel touches indices below n of each. The parameter and
        // moments are written through addresses taken from shared borrows: the buffers are
        // kept alive by those borrows until the launch is queued, every reader and writer of
        // resident masters and of the optimizer's moments is on this same stream (so the
        // launch is ordered after earlier ops and before later ones), and no host code
        // reads that device memory directly. Parameter, gradient and moments are distinct
        // buffers (the caller passes a gradient that is not its parameter).
        unsafe { b.launch(cfg) }.w()?;
        drop(records);
    }
    Ok(())
}
