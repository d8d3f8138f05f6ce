//! The CUDA launches of the softmax cross-entropy (`kernels/loss.cu`), forward and backward:
//! one block per row of logits.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Result};

use crate::cuda::{by_dtype, load, per_row, rows_of, storage_view as view_t, view_of, Elem, LOSS};

/// Softmax cross-entropy forward: one F32 loss per row of `vocab` logits.
pub(crate) fn cross_entropy_fwd(
    vocab: usize,
    (x, xl): (&CudaStorage, &Layout),
    (t, tl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        vocab: usize,
        x: &CudaStorage,
        xl: &Layout,
        t: &CudaStorage,
        tl: &Layout,
    ) -> Result<CudaStorage> {
        let dev = &x.device;
        let func = load::<T>(dev, LOSS, "cross_entropy_fwd")?;
        let xv = view_t::<T>(x, xl, "logits")?;
        let tv = view_of::<u32>(t, tl, "targets")?;
        let (n_rows, v) = rows_of(xv.len(), vocab, "cross_entropy")?;
        if tv.len() != n_rows as usize {
            candle_core::bail!("cross_entropy: {} targets for {n_rows} rows", tv.len());
        }
        // SAFETY: uninitialised device memory of one f32 per row on the device's stream; the
        // kernel launched next writes every one (thread 0 of each row's block).
        let loss = unsafe { dev.alloc::<f32>(n_rows as usize) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xv).arg(&tv).arg(&loss).arg(&v);
        // SAFETY: the arguments match `cross_entropy_fwd_<dtype>(const T*, const uint32_t*,
        // float*, uint32_t)` in kernels/loss.cu; logits hold n_rows·v elements, targets and
        // loss n_rows; the kernel reads the target's logit only when target < v.
        unsafe { b.launch(per_row(n_rows, v as usize)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(loss, dev.clone()))
    }
    by_dtype!("cross_entropy", x.dtype(), run(vocab, x, xl, t, tl))
}

/// Softmax cross-entropy backward: d logits (the logits' dtype) from the F32 loss gradient.
pub(crate) fn cross_entropy_bwd(
    vocab: usize,
    (x, xl): (&CudaStorage, &Layout),
    (t, tl): (&CudaStorage, &Layout),
    (g, gl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        vocab: usize,
        (x, xl): (&CudaStorage, &Layout),
        (t, tl): (&CudaStorage, &Layout),
        (g, gl): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let dev = &x.device;
        let func = load::<T>(dev, LOSS, "cross_entropy_bwd")?;
        let xv = view_t::<T>(x, xl, "logits")?;
        let tv = view_of::<u32>(t, tl, "targets")?;
        let gv = view_of::<f32>(g, gl, "loss gradient")?;
        let (n_rows, v) = rows_of(xv.len(), vocab, "cross_entropy backward")?;
        let rows = n_rows as usize;
        if tv.len() != rows || gv.len() != rows {
            candle_core::bail!("cross_entropy backward: buffers do not match the logits");
        }
        // SAFETY: uninitialised device memory of the logits' length on the device's stream;
        // the kernel launched next writes every element (each row's block its v values).
        let dx = unsafe { dev.alloc::<T>(xv.len()) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xv).arg(&tv).arg(&gv).arg(&dx).arg(&v);
        // SAFETY: the arguments match `cross_entropy_bwd_<dtype>(const T*, const uint32_t*,
        // const float*, T*, uint32_t)` in kernels/loss.cu; logits and dx hold n_rows·v
        // elements, targets and g n_rows; the kernel indexes row < gridDim.x = n_rows, col < v.
        unsafe { b.launch(per_row(n_rows, v as usize)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
    }
    by_dtype!(
        "cross_entropy backward",
        x.dtype(),
        run(vocab, (x, xl), (t, tl), (g, gl))
    )
}
