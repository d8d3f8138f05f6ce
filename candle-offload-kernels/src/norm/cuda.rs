//! The CUDA launches of the norms (`kernels/norm.cu`, `kernels/norm_train.cu`): the residual
//! RMSNorm of inference, optionally quantizing its rows for variant 4's matmuls, and the training
//! RMSNorm's forward and backward. Inputs are contiguous slices of one float dtype (the ops check
//! both before they get here); every output element is written by the kernel that fills it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaStorage, Map3, WrapErr};
use candle_core::{CudaDevice, Layout, Result, WithDType};

use crate::cuda::{
    arg_or_null, by_dtype, load, per_row, rows_of, storage_view as view_t, to_u32, view, view_of,
    Elem, ELEMWISE_BLOCK, NORM, NORM_TRAIN,
};
use crate::handover::qlinear4_x_bytes;
use crate::util::aligned16;

/// Rows one block of the RMSNorm weight-gradient kernel sums (its partial sums are then
/// summed over the chunks by Candle).
pub(crate) const DW_ROWS_PER_CHUNK: usize = 64;

/// Parts of 8 elements a thread of `rms_norm_residual_vec` holds (RN_PARTS in kernels/norm.cu).
const RMS_NORM_VEC_PARTS: usize = 4;

/// `rms_norm_residual`: (x, residual, weight) → the sums, then the normed rows (2 · x's
/// elements). With `q8` (`rms_norm_residual_q8`; row width a multiple of 32), where the
/// register-resident kernel runs (16-byte aligned rows of at most 32768), also the normed rows
/// quantized as [`qlinear4_quantize_x`] quantizes x, in a buffer of [`qlinear4_x_bytes`] for
/// variant 4's matmuls; elsewhere none (the matmuls then quantize the rows themselves).
pub(crate) fn rms_norm_residual(
    eps: f32,
    (x, xl): (&CudaStorage, &Layout),
    (r, rl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    q8: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    struct K(f32, bool, std::cell::RefCell<Option<CudaSlice<u8>>>);
    impl Map3 for K {
        fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
            &self,
            x: &CudaSlice<T>,
            xl: &Layout,
            r: &CudaSlice<T>,
            rl: &Layout,
            w: &CudaSlice<T>,
            wl: &Layout,
            dev: &CudaDevice,
        ) -> Result<CudaSlice<T>> {
            let el = xl.shape().elem_count();
            let n_cols = wl.shape().elem_count();
            // Rows whose parts of 8 fit the threads of a block (RN_PARTS each), all three
            // inputs 16-byte aligned: the register-resident kernel, with or without xq.
            let vec = n_cols.is_multiple_of(8)
                && n_cols / 8 <= RMS_NORM_VEC_PARTS * 1024
                && [xl, rl, wl].iter().all(|l| aligned16(l, T::DTYPE));
            let name = if vec {
                "rms_norm_residual_vec"
            } else {
                "rms_norm_residual"
            };
            let func = load::<T>(dev, NORM, name)?;
            let (x, r, w) = (
                view(x, xl, "x")?,
                view(r, rl, "residual")?,
                view(w, wl, "weight")?,
            );
            if n_cols == 0 || n_cols != w.len() || !el.is_multiple_of(n_cols) || r.len() != el {
                candle_core::bail!("rms_norm_residual: {el} elements are not rows of {n_cols}");
            }
            if self.1 && !n_cols.is_multiple_of(32) {
                candle_core::bail!("rms_norm_residual: rows of {n_cols} are not blocks of 32");
            }
            let n_rows = to_u32(el / n_cols, "rows")?;
            let n_cols_u = to_u32(n_cols, "row width")?;
            // One block per row: whole warps, at most 1024; a part of 8 elements per thread
            // (up to RN_PARTS) for the register-resident kernel, else about four elements.
            let per_thread = if vec { 8 } else { 4 };
            let block = (n_cols.div_ceil(per_thread).div_ceil(32) * 32).clamp(32, 1024) as u32;
            let cfg = LaunchConfig {
                grid_dim: (n_rows, 1, 1),
                block_dim: (block, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: uninitialised device memory of 2·el elements on the device's stream; the
            // kernel launched next on that stream writes every one of them (each row's sums and
            // normed values) before any later op can read them.
            let out = unsafe { dev.alloc::<T>(2 * el) }?;
            let xq = if self.1 && vec {
                // SAFETY: uninitialised device memory on the device's stream; the kernel
                // launched next writes the quants and the scale and sum of each of the rows'
                // blocks below n_cols / 32 (the padding blocks up to a multiple of 32 stay
                // unwritten, and variant 4's matmuls never read them).
                Some(unsafe { dev.alloc::<u8>(qlinear4_x_bytes(el / n_cols, n_cols)) }?)
            } else {
                None
            };
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&x);
            b.arg(&r);
            b.arg(&w);
            b.arg(&out);
            if vec {
                arg_or_null(&mut b, xq.as_ref());
            }
            b.arg(&n_rows);
            b.arg(&n_cols_u);
            b.arg(&self.0);
            // SAFETY: the arguments match `rms_norm_residual_<dtype>(const T*, const T*,
            // const T*, T*, uint32_t, uint32_t, float)` in kernels/norm.cu in number, order and
            // type, or `rms_norm_residual_vec_<dtype>`, which takes a uint4* xq after out (null:
            // no quantized rows) and runs only where x, residual and weight start 16-byte aligned (out does, from the
            // allocator), n_cols is a multiple of 8 (of 32 with xq, checked above) and its
            // n_cols / 8 parts fit RN_PARTS = 4 a thread of this block (n_cols / 8 ≤ 4096 and
            // the block takes min(1024, the parts rounded up to whole warps) threads), so its
            // 16-byte loads and stores stay aligned and inside each row;
            // x and residual hold n_rows·n_cols elements, weight n_cols and out twice
            // n_rows·n_cols, so every index the kernel forms (row < gridDim.x, col < n_cols) is
            // in bounds; xq (16-byte aligned, from the allocator) holds the n_rows rows of
            // n_cols / 32 blocks rounded up to 32 at 40 bytes each, the extent the kernel
            // writes; blockDim is a multiple of 32 up to 1024, as its block
            // reduction and the quantization's lane groups need.
            unsafe { b.launch(cfg) }.w()?;
            *self.2.borrow_mut() = xq;
            Ok(out)
        }
    }
    let dev = x.device();
    let k = K(eps, q8, std::cell::RefCell::new(None));
    let slice = k.map(&x.slice, xl, &r.slice, rl, &w.slice, wl, dev)?;
    let storage = |slice| CudaStorage {
        slice,
        device: dev.clone(),
    };
    let xq = k.2.into_inner().map(|b| storage(S::U8(b)));
    Ok((storage(slice), xq))
}

/// RMSNorm forward: y = x · rstd(x) · w over rows of w's length.
pub(crate) fn rms_norm_fwd(
    eps: f32,
    (x, xl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        eps: f32,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<CudaStorage> {
        let dev = &x.device;
        let func = load::<T>(dev, NORM_TRAIN, "rms_norm_fwd")?;
        let (xv, wv) = (view_t::<T>(x, xl, "x")?, view_t::<T>(w, wl, "weight")?);
        let (n_rows, n) = rows_of(xv.len(), wv.len(), "rms_norm")?;
        // SAFETY: uninitialised device memory of x's length on the device's stream; the
        // kernel launched next on that stream writes every element (each row's block writes
        // its n values) before any later op can read them.
        let y = unsafe { dev.alloc::<T>(xv.len()) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xv).arg(&wv).arg(&y).arg(&n).arg(&eps);
        // SAFETY: the arguments match `rms_norm_fwd_<dtype>(const T*, const T*, T*, uint32_t,
        // float)` in kernels/norm_train.cu; x and y hold n_rows·n elements and w n, and the kernel
        // indexes row < gridDim.x = n_rows, col < n; blockDim is a multiple of 32 up to 1024,
        // as its block reductions need.
        unsafe { b.launch(per_row(n_rows, n as usize)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }
    by_dtype!("rms_norm", x.dtype(), run(eps, x, xl, w, wl))
}

/// Each row's 1 / sqrt(mean(x²) + eps), F32 (one per row of `width`).
pub(crate) fn rms_rstd(
    eps: f32,
    width: usize,
    (x, xl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(eps: f32, width: usize, x: &CudaStorage, xl: &Layout) -> Result<CudaStorage> {
        let dev = &x.device;
        let func = load::<T>(dev, NORM_TRAIN, "rms_rstd")?;
        let xv = view_t::<T>(x, xl, "x")?;
        let (n_rows, n) = rows_of(xv.len(), width, "rms_norm statistics")?;
        // SAFETY: uninitialised device memory of one f32 per row on the device's stream; the
        // kernel launched next writes every one (thread 0 of each row's block).
        let rstd = unsafe { dev.alloc::<f32>(n_rows as usize) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xv).arg(&rstd).arg(&n).arg(&eps);
        // SAFETY: the arguments match `rms_rstd_<dtype>(const T*, float*, uint32_t, float)` in
        // kernels/norm_train.cu; x holds n_rows·n elements and rstd n_rows; the kernel indexes
        // row < gridDim.x = n_rows, col < n; blockDim is a multiple of 32 up to 1024.
        unsafe { b.launch(per_row(n_rows, n as usize)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(rstd, dev.clone()))
    }
    by_dtype!("rms_norm statistics", x.dtype(), run(eps, width, x, xl))
}

/// RMSNorm backward: dx (x's dtype), each row's rstd recomputed.
pub(crate) fn rms_norm_bwd_dx(
    eps: f32,
    (x, xl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    (g, gl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        eps: f32,
        (x, xl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
        (g, gl): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let dev = &x.device;
        let func = load::<T>(dev, NORM_TRAIN, "rms_norm_bwd_dx")?;
        let (xv, wv, gv) = (
            view_t::<T>(x, xl, "x")?,
            view_t::<T>(w, wl, "weight")?,
            view_t::<T>(g, gl, "gradient")?,
        );
        let (n_rows, n) = rows_of(xv.len(), wv.len(), "rms_norm backward")?;
        if gv.len() != xv.len() {
            candle_core::bail!(
                "rms_norm backward: gradient of {} for x of {}",
                gv.len(),
                xv.len()
            );
        }
        // SAFETY: uninitialised device memory of x's length on the device's stream; the
        // kernel launched next writes every element (each row's block its n values).
        let dx = unsafe { dev.alloc::<T>(xv.len()) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xv).arg(&wv).arg(&gv).arg(&dx).arg(&n).arg(&eps);
        // SAFETY: the arguments match `rms_norm_bwd_dx_<dtype>(const T*, const T*, const T*,
        // T*, uint32_t, float)` in kernels/norm_train.cu; x, g and dx hold n_rows·n elements and w
        // n; the kernel indexes row < gridDim.x = n_rows, col < n; blockDim is a multiple of
        // 32 up to 1024.
        unsafe { b.launch(per_row(n_rows, n as usize)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
    }
    by_dtype!(
        "rms_norm backward",
        x.dtype(),
        run(eps, (x, xl), (w, wl), (g, gl))
    )
}

/// RMSNorm backward, weight part: F32 partial sums of g · x · rstd over chunks of
/// [`DW_ROWS_PER_CHUNK`] rows, (chunks, width).
pub(crate) fn rms_norm_bwd_dw(
    width: usize,
    (x, xl): (&CudaStorage, &Layout),
    (g, gl): (&CudaStorage, &Layout),
    (r, rl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        width: usize,
        (x, xl): (&CudaStorage, &Layout),
        (g, gl): (&CudaStorage, &Layout),
        (r, rl): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let dev = &x.device;
        let func = load::<T>(dev, NORM_TRAIN, "rms_norm_bwd_dw")?;
        let (xv, gv) = (view_t::<T>(x, xl, "x")?, view_t::<T>(g, gl, "gradient")?);
        let rv = view_of::<f32>(r, rl, "rstd")?;
        let (n_rows, n) = rows_of(xv.len(), width, "rms_norm weight gradient")?;
        if gv.len() != xv.len() || rv.len() != n_rows as usize {
            candle_core::bail!("rms_norm weight gradient: buffers do not match x");
        }
        let chunks = (n_rows as usize).div_ceil(DW_ROWS_PER_CHUNK);
        let chunks_u = to_u32(chunks, "row chunks")?;
        if chunks_u > 65_535 {
            candle_core::bail!("rms_norm weight gradient: {n_rows} rows exceed the grid");
        }
        let per_chunk = DW_ROWS_PER_CHUNK as u32;
        // SAFETY: uninitialised device memory of chunks·n f32 on the device's stream; the
        // kernel launched next writes every (chunk, column) element once.
        let partial = unsafe { dev.alloc::<f32>(chunks * width) }?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(ELEMWISE_BLOCK), chunks_u, 1),
            block_dim: (ELEMWISE_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xv).arg(&gv).arg(&rv).arg(&partial);
        b.arg(&n_rows).arg(&n).arg(&per_chunk);
        // SAFETY: the arguments match `rms_norm_bwd_dw_<dtype>(const T*, const T*, const
        // float*, float*, uint32_t n_rows, uint32_t n, uint32_t rows_per_chunk)` in
        // kernels/norm_train.cu; x and g hold n_rows·n elements, rstd n_rows and partial chunks·n;
        // threads past column n return and rows stop at n_rows.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(partial, dev.clone()))
    }
    by_dtype!(
        "rms_norm weight gradient",
        x.dtype(),
        run(width, (x, xl), (g, gl), (r, rl))
    )
}
