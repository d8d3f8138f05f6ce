//! The CUDA launch of [`combine_rows`](super::combine_rows): the slots and weights in one
//! copy, then `moe_combine_<dtype>` (kernels/moe.cu).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Result};

use crate::cuda::{by_dtype, grid_stride, load, storage_view, to_u32, Elem, MOE};

/// y's rows (`(ys, yl)`, contiguous, `copies × hidden`) combined by `slots` and `weights`
/// (`rows · k` each, every slot below y's rows or `NO_SLOT`: checked by the caller) into
/// `rows × hidden`, as `dims = (rows, k, hidden)`.
pub(crate) fn combine_rows(
    (ys, yl): (&CudaStorage, &Layout),
    slots: &[u32],
    weights: &[f32],
    dims: (usize, usize, usize),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        ys: &CudaStorage,
        yl: &Layout,
        slots: &[u32],
        weights: &[f32],
        (rows, k, hidden): (usize, usize, usize),
    ) -> Result<CudaStorage> {
        let dev = &ys.device;
        let y = storage_view::<T>(ys, yl, "y")?;
        if y.len() % hidden != 0 {
            candle_core::bail!(
                "combine_rows: y has {} elements, not rows of {hidden}",
                y.len()
            );
        }
        let stream = dev.cuda_stream();
        // Slots then the weights' bits, in one copy.
        let mut table: Vec<u32> = Vec::with_capacity(2 * slots.len());
        table.extend_from_slice(slots);
        table.extend(weights.iter().map(|w| w.to_bits()));
        let table = stream.clone_htod(&table).w()?;
        let at = table.device_ptr(&stream).0;
        let w_at = at + (4 * slots.len()) as u64;
        let n = rows * hidden;
        // SAFETY: uninitialised device memory of rows·hidden elements on the device's stream;
        // the kernel launched next writes every one.
        let out = unsafe { dev.alloc::<T>(n) }?;
        let func = load::<T>(dev, MOE, "moe_combine")?;
        let (r, kk, h) = (
            to_u32(rows, "rows")?,
            to_u32(k, "slots")?,
            to_u32(hidden, "hidden")?,
        );
        let mut b = stream.launch_builder(&func);
        b.arg(&y)
            .arg(&at)
            .arg(&w_at)
            .arg(&out)
            .arg(&r)
            .arg(&kk)
            .arg(&h);
        // SAFETY: `moe_combine_<dtype>(const T* y, const uint32_t* slots, const float* w, T*
        // out, uint32_t rows, k, h)` in kernels/moe.cu: `at` is the table copied above on this
        // stream (rows·k slots, then rows·k F32 weights at `w_at`), every slot NO_SLOT or below
        // y's rows of h (checked by `combine_rows`); out holds rows·h, which its grid-stride
        // loop stays below.
        unsafe { b.launch(grid_stride(n, 1 << 16)) }.w()?;
        drop(table);
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_dtype!(
        "combine_rows",
        ys.dtype(),
        run(ys, yl, slots, weights, dims)
    )
}
