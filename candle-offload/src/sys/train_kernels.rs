//! Launches of the fused training kernels (`kernels/train.cu`, compiled to PTX by build.rs) on
//! a Candle device's stream, for the custom ops of [`crate::train::fused`] and
//! [`crate::train::attention`].
//!
//! The module is loaded once per device by `CudaDevice::get_or_load_custom_func` under its own
//! name, each kernel's handle is kept once looked up ([`super::kernels::cached_func`]), and
//! every kernel runs on the device's own stream, ordered with every other Candle op.
//! Inputs are contiguous (the ops make them so before they get here) and of one float dtype
//! (targets U32, CE gradients and AdamW buffers F32); every output element is written by the
//! kernel that fills it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
use candle_core::{CudaDevice, DType, Layout, Result, WithDType};

/// build.rs's constants, one per kernel file; this module uses `TRAIN`.
mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// The name Candle caches our module under (one per device).
const MODULE: &str = "candle_offload_train";

/// Threads per block of the elementwise kernels and of the RMSNorm weight-gradient kernel.
const ELEMWISE_BLOCK: u32 = 256;

/// Rows one block of the RMSNorm weight-gradient kernel sums (its partial sums are then
/// summed over the chunks by Candle).
pub(crate) const DW_ROWS_PER_CHUNK: usize = 64;

/// A float element type the kernels exist for.
trait Elem: CudaDType + DeviceRepr + WithDType {}
impl Elem for f32 {}
impl Elem for half::f16 {}
impl Elem for half::bf16 {}

/// Runs `$f::<T>` for the storage's float dtype.
macro_rules! by_dtype {
    ($op:expr, $dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            other => candle_core::bail!("{}: no kernel for {other:?}", $op),
        }
    };
}

fn load_named(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    super::kernels::cached_func(dev, MODULE, ptx::TRAIN, name, None)
}

/// The kernel `{name}_{dtype}` of our module on `dev`.
fn load<T: Elem>(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    super::kernels::cached_func(dev, MODULE, ptx::TRAIN, name, Some(T::DTYPE))
}

/// The contiguous part of `s`'s buffer that `l` covers, as `T`.
fn view<'a, T: Elem>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    let slice = s.as_cuda_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(slice.slice(a..b)),
        None => candle_core::bail!("{what} has to be contiguous"),
    }
}

/// The contiguous part of a buffer of a fixed element type (targets, F32 gradients).
fn view_of<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let slice = s.as_cuda_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(slice.slice(a..b)),
        None => candle_core::bail!("{what} has to be contiguous"),
    }
}

fn to_u32(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{what} {v} exceeds u32")))
}

/// A grid-stride launch over `n` elements (n > 0).
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(ELEMWISE_BLOCK as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ELEMWISE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row of `n_cols`: about four elements per thread, whole warps, 32 to 1024.
fn per_row(n_rows: u32, n_cols: usize) -> LaunchConfig {
    let block = (n_cols.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32;
    LaunchConfig {
        grid_dim: (n_rows, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `(rows, width)` of a buffer of `el` elements whose rows are `width` wide.
fn rows_of(el: usize, width: usize, op: &str) -> Result<(u32, u32)> {
    if width == 0 || el == 0 || !el.is_multiple_of(width) {
        candle_core::bail!("{op}: {el} elements are not rows of {width}");
    }
    Ok((to_u32(el / width, "rows")?, to_u32(width, "row width")?))
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
        let func = load::<T>(dev, "rms_norm_fwd")?;
        let (xv, wv) = (view::<T>(x, xl, "x")?, view::<T>(w, wl, "weight")?);
        let (n_rows, n) = rows_of(xv.len(), wv.len(), "rms_norm")?;
        // SAFETY: uninitialised device memory of x's length on the device's stream; the
        // kernel launched next on that stream writes every element (each row's block writes
        // its n values) before any later op can read them.
        let y = unsafe { dev.alloc::<T>(xv.len()) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xv).arg(&wv).arg(&y).arg(&n).arg(&eps);
        // SAFETY: the arguments match `rms_norm_fwd_<dtype>(const T*, const T*, T*, uint32_t,
        // float)` in kernels/train.cu; x and y hold n_rows·n elements and w n, and the kernel
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
        let func = load::<T>(dev, "rms_rstd")?;
        let xv = view::<T>(x, xl, "x")?;
        let (n_rows, n) = rows_of(xv.len(), width, "rms_norm statistics")?;
        // SAFETY: uninitialised device memory of one f32 per row on the device's stream; the
        // kernel launched next writes every one (thread 0 of each row's block).
        let rstd = unsafe { dev.alloc::<f32>(n_rows as usize) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xv).arg(&rstd).arg(&n).arg(&eps);
        // SAFETY: the arguments match `rms_rstd_<dtype>(const T*, float*, uint32_t, float)` in
        // kernels/train.cu; x holds n_rows·n elements and rstd n_rows; the kernel indexes
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
        let func = load::<T>(dev, "rms_norm_bwd_dx")?;
        let (xv, wv, gv) = (
            view::<T>(x, xl, "x")?,
            view::<T>(w, wl, "weight")?,
            view::<T>(g, gl, "gradient")?,
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
        // T*, uint32_t, float)` in kernels/train.cu; x, g and dx hold n_rows·n elements and w
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
        let func = load::<T>(dev, "rms_norm_bwd_dw")?;
        let (xv, gv) = (view::<T>(x, xl, "x")?, view::<T>(g, gl, "gradient")?);
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
        // kernels/train.cu; x and g hold n_rows·n elements, rstd n_rows and partial chunks·n;
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

/// SwiGLU forward: silu(gate) · up.
pub(crate) fn swiglu_fwd(
    (a, al): (&CudaStorage, &Layout),
    (u, ul): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        a: &CudaStorage,
        al: &Layout,
        u: &CudaStorage,
        ul: &Layout,
    ) -> Result<CudaStorage> {
        let dev = &a.device;
        let func = load::<T>(dev, "swiglu_fwd")?;
        let (av, uv) = (view::<T>(a, al, "gate")?, view::<T>(u, ul, "up")?);
        let n = av.len();
        if uv.len() != n || n == 0 {
            candle_core::bail!("swiglu: gate has {n} elements, up {}", uv.len());
        }
        // SAFETY: uninitialised device memory of n elements on the device's stream; the
        // kernel launched next writes every one of them.
        let out = unsafe { dev.alloc::<T>(n) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&av).arg(&uv).arg(&out).arg(&n);
        // SAFETY: the arguments match `swiglu_fwd_<dtype>(const T*, const T*, T*, size_t)` in
        // kernels/train.cu; all three buffers hold n elements and its grid-stride loop stays
        // below n.
        unsafe { b.launch(elementwise(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_dtype!("swiglu", a.dtype(), run(a, al, u, ul))
}

/// SwiGLU backward: one buffer of 2n, d gate then d up.
pub(crate) fn swiglu_bwd(
    (a, al): (&CudaStorage, &Layout),
    (u, ul): (&CudaStorage, &Layout),
    (g, gl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        (a, al): (&CudaStorage, &Layout),
        (u, ul): (&CudaStorage, &Layout),
        (g, gl): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let dev = &a.device;
        let func = load::<T>(dev, "swiglu_bwd")?;
        let (av, uv, gv) = (
            view::<T>(a, al, "gate")?,
            view::<T>(u, ul, "up")?,
            view::<T>(g, gl, "gradient")?,
        );
        let n = av.len();
        if uv.len() != n || gv.len() != n || n == 0 {
            candle_core::bail!(
                "swiglu backward: buffers of {n}, {} and {}",
                uv.len(),
                gv.len()
            );
        }
        // SAFETY: uninitialised device memory of 2n elements on the device's stream; the
        // kernel launched next writes every one (i and n + i for each i < n).
        let out = unsafe { dev.alloc::<T>(2 * n) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&av).arg(&uv).arg(&gv).arg(&out).arg(&n);
        // SAFETY: the arguments match `swiglu_bwd_<dtype>(const T*, const T*, const T*, T*,
        // size_t)` in kernels/train.cu; gate, up and g hold n elements and out 2n, and its
        // grid-stride loop stays below n.
        unsafe { b.launch(elementwise(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_dtype!("swiglu backward", a.dtype(), run((a, al), (u, ul), (g, gl)))
}

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
        let func = load::<T>(dev, "cross_entropy_fwd")?;
        let xv = view::<T>(x, xl, "logits")?;
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
        // float*, uint32_t)` in kernels/train.cu; logits hold n_rows·v elements, targets and
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
        let func = load::<T>(dev, "cross_entropy_bwd")?;
        let xv = view::<T>(x, xl, "logits")?;
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
        // const float*, T*, uint32_t)` in kernels/train.cu; logits and dx hold n_rows·v
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
    let func = load_named(dev, "adamw_multi_f32")?;
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
        // kernels/train.cu. The table, on the device (copied on this stream before the
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

/// Threads per block of the attention kernels (`FA_FWD_WARPS`, `FA_BWD_WARPS` and, for F32,
/// `FA32_THREADS` in kernels/train.cu) and the rows and keys of their tiles (`FA_BM`, `FA_BN`).
const FA_FWD_THREADS: u32 = 4 * 32;
const FA_BWD_THREADS: u32 = 8 * 32;
const FA32_THREADS: u32 = 256;
const FA_TILE: usize = 64;

/// The sizes of an attention call: batch, query heads, kv heads, sequence, head width.
pub(crate) type AttnSizes = [usize; 5];

/// Dynamic shared memory of the attention kernels for head width `d`: the forward
/// (`FaSmem<D>::fwd`, or `::fwd_wmma` for the WMMA forward) and the backward (`::bwd`) in
/// kernels/train.cu.
fn fa_smem(d: usize, wmma: bool) -> (u32, u32) {
    let (ldt, lds, ldp, ldo) = (d + 8, FA_TILE + 4, FA_TILE + 8, d + 4);
    let tile_t = FA_TILE * ldt * 2;
    let tile_s = FA_TILE * lds * 4;
    let tile_p = FA_TILE * ldp * 2;
    let fwd = if wmma {
        3 * tile_t + tile_s + tile_p + FA_TILE * ldo * 4
    } else {
        5 * tile_t
    };
    let bwd = 4 * tile_t + tile_s + FA_TILE * FA_TILE * 4 + tile_p + 2 * FA_TILE * 4;
    (fwd as u32, bwd as u32)
}

/// Dynamic shared memory of the F32 attention kernels for head width `d` (`Fa32Smem<D>` in
/// kernels/train.cu): the forward (`::fwd`: Q, K then P, V) and the backward (`::bwd`: K, V,
/// Q, dO, P then dS, L and D).
fn fa32_smem(d: usize) -> (u32, u32) {
    let tile = FA_TILE * (d + 4) * 4;
    let tile_p = FA_TILE * (FA_TILE + 4) * 4;
    let fwd = 3 * tile;
    let bwd = 4 * tile + tile_p + 2 * FA_TILE * 4;
    (fwd as u32, bwd as u32)
}

/// The shared memory and threads per block of the attention kernels for `T` and head width
/// `d`: ((forward bytes, threads), (backward bytes, threads)); `wmma` picks the WMMA forward
/// (F16 and BF16; F32 has one forward kernel).
fn fa_config<T: Elem>(d: usize, wmma: bool) -> ((u32, u32), (u32, u32)) {
    if T::DTYPE == DType::F32 {
        let (fwd, bwd) = fa32_smem(d);
        ((fwd, FA32_THREADS), (bwd, FA32_THREADS))
    } else {
        let (fwd, bwd) = fa_smem(d, wmma);
        ((fwd, FA_FWD_THREADS), (bwd, FA_BWD_THREADS))
    }
}

/// The view of an attention input: contiguous, of `len` elements, starting at a multiple of 8
/// elements (the kernels' 16-byte vector loads; the base of a Candle buffer is aligned).
fn fa_view<'a, T: Elem>(
    s: &'a CudaStorage,
    l: &Layout,
    len: usize,
    what: &str,
) -> Result<CudaView<'a, T>> {
    if !l.start_offset().is_multiple_of(8) {
        candle_core::bail!("flash-attention: {what} starts at an unaligned offset");
    }
    let v = view::<T>(s, l, what)?;
    if v.len() != len {
        candle_core::bail!(
            "flash-attention: {what} has {} elements, not {len}",
            v.len()
        );
    }
    Ok(v)
}

/// The kernel `{name}_d{d}_{dtype}` with its dynamic shared memory allowed up to `smem` bytes.
fn fa_load<T: Elem>(dev: &CudaDevice, name: &str, d: usize, smem: u32) -> Result<CudaFunction> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
    if d != 64 && d != 128 {
        candle_core::bail!("flash-attention: no kernel for head width {d}");
    }
    let func = load::<T>(dev, &format!("{name}_d{d}"))?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    Ok(func)
}

/// The grid's y extent for `heads` heads.
fn fa_heads(heads: usize) -> Result<u32> {
    let y = to_u32(heads, "heads")?;
    if y == 0 || y > 65_535 {
        candle_core::bail!("flash-attention: {heads} heads (batch times heads) exceed the grid");
    }
    Ok(y)
}

/// A forward kernel's launch: one block of `threads` per 64 query rows of each of `heads`
/// heads (batch times heads), with `smem` bytes of shared memory.
fn fa_fwd_cfg(t: usize, heads: usize, smem: u32, threads: u32) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (to_u32(t.div_ceil(FA_TILE), "tiles")?, fa_heads(heads)?, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    })
}

/// Causal attention forward: O (q's dtype, (b, h, t, d)) and each row's log-sum-exp (F32,
/// (b, h, t)); for F16 and BF16 with `wmma` the WMMA kernel, otherwise the mma.sync one; for
/// F32 the FP32 kernel (`wmma` ignored).
pub(crate) fn flash_attn_fwd(
    dims: AttnSizes,
    wmma: bool,
    scale: f32,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    fn run<T: Elem>(
        dims: AttnSizes,
        wmma: bool,
        scale: f32,
        (q, ql): (&CudaStorage, &Layout),
        (k, kl): (&CudaStorage, &Layout),
        (v, vl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, CudaStorage)> {
        let dev = &q.device;
        let [b, h, hkv, t, d] = dims;
        let ((smem, threads), _) = fa_config::<T>(d, wmma);
        let name = if wmma && T::DTYPE != DType::F32 {
            "flash_attn_fwd_wmma"
        } else {
            "flash_attn_fwd"
        };
        let func = fa_load::<T>(dev, name, d, smem)?;
        let nq = b * h * t * d;
        let nkv = b * hkv * t * d;
        let qv = fa_view::<T>(q, ql, nq, "q")?;
        let kv = fa_view::<T>(k, kl, nkv, "k")?;
        let vv = fa_view::<T>(v, vl, nkv, "v")?;
        if hkv == 0 || !h.is_multiple_of(hkv) || t == 0 {
            candle_core::bail!("flash-attention: bad sizes {dims:?} (b, h, hkv, t, d)");
        }
        let (h_u, hkv_u, t_u) = (
            to_u32(h, "heads")?,
            to_u32(hkv, "kv heads")?,
            to_u32(t, "t")?,
        );
        let cfg = fa_fwd_cfg(t, b * h, smem, threads)?;
        // SAFETY: uninitialised device memory on the device's stream; the kernel launched next
        // writes every element (each row below t of each head: its d outputs).
        let out = unsafe { dev.alloc::<T>(nq) }?;
        // SAFETY: as above: the kernel writes each row's log-sum-exp.
        let lse = unsafe { dev.alloc::<f32>(b * h * t) }?;
        let stream = dev.cuda_stream();
        let mut bl = stream.launch_builder(&func);
        bl.arg(&qv).arg(&kv).arg(&vv).arg(&out).arg(&lse);
        bl.arg(&h_u).arg(&hkv_u).arg(&t_u).arg(&scale);
        // SAFETY: the arguments match `flash_attn_fwd_d<d>_<dtype>(const T*, const T*, const
        // T*, T*, float*, uint32_t h, uint32_t hkv, uint32_t t, float)` in kernels/train.cu; q
        // and out hold b·h·t·d elements, k and v b·hkv·t·d, lse b·h·t (checked above); the
        // grid is (tiles of 64 rows, b·h), the block size the kernel is written for (128
        // threads, 256 for F32), with the shared memory the kernel's layout takes for this d
        // (allowed on the function above); it reads rows below t and kv head < hkv only, and
        // q, k, v start 16-byte aligned (checked above: 8 elements, 16 or 32 bytes).
        unsafe { bl.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            CudaStorage::wrap_cuda_slice(lse, dev.clone()),
        ))
    }
    by_dtype!(
        "flash-attention",
        q.dtype(),
        run(dims, wmma, scale, (q, ql), (k, kl), (v, vl))
    )
}

/// An inference prompt's causal attention (F16, BF16): O (q's dtype, (b, h, t, d)) for q
/// (b, h, t, d), contiguous, against the `tk` ≥ t cached positions of k and v, views
/// (b, hkv, tk, d) of a KV cache's buffers whose rows are contiguous and whose heads lie
/// `stride[1]` elements apart (batch `stride[0]` = hkv · `stride[1]`); query row i sits at
/// position tk − t + i. [`flash_attn_fwd`]'s mma.sync kernel with that offset, no log-sum-exp.
pub(crate) fn prompt_attn_fwd(
    dims: AttnSizes,
    tk: usize,
    scale: f32,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    /// The cache view's elements from its start to its last row's end
    /// ([`super::kernels::strided_kv`]), and its head stride, where its rows are contiguous,
    /// its batches `hkv` heads apart and it starts and its heads lie 16-byte aligned.
    fn cache<'a, T: Elem>(
        s: &'a CudaStorage,
        l: &Layout,
        [b, hkv, tk, d]: [usize; 4],
        what: &str,
    ) -> Result<(CudaView<'a, T>, u64)> {
        let (view, [sb, sh, sr]) = super::kernels::strided_kv(
            s.as_cuda_slice::<T>()?,
            l,
            tk,
            &format!("prompt-attention: {what}"),
        )?;
        let start = l.start_offset();
        if l.shape().dims() != [b, hkv, tk, d]
            || sr != d as u64
            || sb != hkv as u64 * sh
            || sh < (tk * d) as u64
            || !start.is_multiple_of(8)
            || !sh.is_multiple_of(8)
        {
            candle_core::bail!(
                "prompt-attention: {what} {:?} / {:?} at {start} is not a cache view \
                 (b, {hkv}, {tk}, {d}) with contiguous, 16-byte aligned rows",
                l.shape(),
                l.stride()
            );
        }
        Ok((view, sh))
    }
    fn run<T: Elem>(
        dims: AttnSizes,
        tk: usize,
        scale: f32,
        (q, ql): (&CudaStorage, &Layout),
        (k, kl): (&CudaStorage, &Layout),
        (v, vl): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let dev = &q.device;
        let [b, h, hkv, t, d] = dims;
        if T::DTYPE == DType::F32 || hkv == 0 || !h.is_multiple_of(hkv) || t == 0 || tk < t {
            candle_core::bail!(
                "prompt-attention: no kernel for {:?} with sizes {dims:?} (b, h, hkv, t, d) \
                 and {tk} keys",
                T::DTYPE
            );
        }
        let ((smem, threads), _) = fa_config::<T>(d, false);
        let func = fa_load::<T>(dev, "prompt_attn", d, smem)?;
        let nq = b * h * t * d;
        let qv = fa_view::<T>(q, ql, nq, "q")?;
        let (kv, ks) = cache::<T>(k, kl, [b, hkv, tk, d], "k")?;
        let (vv, vs) = cache::<T>(v, vl, [b, hkv, tk, d], "v")?;
        if ks != vs {
            candle_core::bail!("prompt-attention: k and v lie {ks} and {vs} elements a head apart");
        }
        let (h_u, hkv_u, t_u, tk_u) = (
            to_u32(h, "heads")?,
            to_u32(hkv, "kv heads")?,
            to_u32(t, "t")?,
            to_u32(tk, "keys")?,
        );
        let cfg = fa_fwd_cfg(t, b * h, smem, threads)?;
        // SAFETY: uninitialised device memory on the device's stream; the kernel launched next
        // writes every element (each row below t of each head: its d outputs).
        let out = unsafe { dev.alloc::<T>(nq) }?;
        let stream = dev.cuda_stream();
        let mut bl = stream.launch_builder(&func);
        bl.arg(&qv).arg(&kv).arg(&vv).arg(&out);
        bl.arg(&h_u)
            .arg(&hkv_u)
            .arg(&t_u)
            .arg(&tk_u)
            .arg(&ks)
            .arg(&scale);
        // SAFETY: the arguments match `prompt_attn_d<d>_<dtype>(const T*, const T*, const T*,
        // T*, uint32_t h, uint32_t hkv, uint32_t t, uint32_t tk, uint64_t kstride, float)` in
        // kernels/train.cu; q and out hold b·h·t·d elements; k and v reach (b·hkv − 1)·kstride
        // + tk·d elements from their views' starts (checked above), which is the furthest the
        // kernel reads (kv head < b·hkv, key rows below tk); the grid is (tiles of 64 rows,
        // b·h), the block size the kernel is written for (128 threads), with the shared memory
        // its layout takes for this d (allowed on the function above); q, k and v start
        // 16-byte aligned and k's, v's heads lie a multiple of 8 elements apart (checked).
        unsafe { bl.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_dtype!(
        "prompt-attention",
        q.dtype(),
        run(dims, tk, scale, (q, ql), (k, kl), (v, vl))
    )
}

/// Causal attention backward from q, k, v, O, dO (one dtype) and the forward's log-sum-exp:
/// dq, dk and dv as one F32 buffer, in that order.
pub(crate) fn flash_attn_bwd(
    dims: AttnSizes,
    scale: f32,
    inputs: [(&CudaStorage, &Layout); 5],
    (lse, lsel): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        dims: AttnSizes,
        scale: f32,
        [(q, ql), (k, kl), (v, vl), (o, ol), (g, gl)]: [(&CudaStorage, &Layout); 5],
        (lse, lsel): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let dev = &q.device;
        let [b, h, hkv, t, d] = dims;
        let (_, (smem, threads)) = fa_config::<T>(d, false);
        let func = fa_load::<T>(dev, "flash_attn_bwd", d, smem)?;
        let prep = load::<T>(dev, "flash_attn_bwd_prep")?;
        let nq = b * h * t * d;
        let nkv = b * hkv * t * d;
        let rows = b * h * t;
        let qv = fa_view::<T>(q, ql, nq, "q")?;
        let kv = fa_view::<T>(k, kl, nkv, "k")?;
        let vv = fa_view::<T>(v, vl, nkv, "v")?;
        let ov = fa_view::<T>(o, ol, nq, "output")?;
        let gv = fa_view::<T>(g, gl, nq, "output gradient")?;
        let lv = view_of::<f32>(lse, lsel, "log-sum-exp")?;
        if lv.len() != rows || hkv == 0 || !h.is_multiple_of(hkv) || t == 0 {
            candle_core::bail!("flash-attention backward: bad sizes {dims:?} (b, h, hkv, t, d)");
        }
        let (h_u, hkv_u, t_u) = (
            to_u32(h, "heads")?,
            to_u32(hkv, "kv heads")?,
            to_u32(t, "t")?,
        );
        let (rows_u, d_u) = (to_u32(rows, "rows")?, to_u32(d, "head width")?);
        // F16/BF16: a CTA per query head (GQA's dk and dv added atomically); F32: per kv head.
        let grid_y = fa_heads(if T::DTYPE == DType::F32 {
            b * hkv
        } else {
            b * h
        })?;
        let stream = dev.cuda_stream();

        // SAFETY: uninitialised device memory of one f32 per row; the prep kernel launched
        // next writes every one (one warp or, in F32, one thread per row).
        let dvec = unsafe { dev.alloc::<f32>(rows) }?;
        // One warp per row, one thread per row in F32 (its D is formed in dP's order).
        let rows_per_block = if T::DTYPE == DType::F32 { 256 } else { 8 };
        let cfg = LaunchConfig {
            grid_dim: (rows_u.div_ceil(rows_per_block), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut bl = stream.launch_builder(&prep);
        bl.arg(&ov).arg(&gv).arg(&dvec).arg(&rows_u).arg(&d_u);
        // SAFETY: the arguments match `flash_attn_bwd_prep_<dtype>(const T*, const T*, float*,
        // uint32_t rows, uint32_t d)` in kernels/train.cu; o and dO hold rows·d elements and
        // dvec rows; the grid covers every row (a warp each, a thread each in F32) and warps
        // or threads past the last row return.
        unsafe { bl.launch(cfg) }.w()?;

        // dq (and, under GQA/MQA in F16/BF16, dk and dv) are accumulated with atomics: the
        // whole buffer starts at zero.
        let all = dev.alloc_zeros::<f32>(nq + 2 * nkv)?;
        let (dq, rest) = all.split_at(nq);
        let (dk, dv) = rest.split_at(nkv);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(t.div_ceil(FA_TILE), "tiles")?, grid_y, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut bl = stream.launch_builder(&func);
        bl.arg(&qv).arg(&kv).arg(&vv).arg(&gv).arg(&lv).arg(&dvec);
        bl.arg(&dq).arg(&dk).arg(&dv);
        bl.arg(&h_u).arg(&hkv_u).arg(&t_u).arg(&scale);
        // SAFETY: the arguments match `flash_attn_bwd_d<d>_<dtype>(const T* q, const T* k,
        // const T* v, const T* dout, const float* lse, const float* dvec, float* dq, float* dk,
        // float* dv, uint32_t h, uint32_t hkv, uint32_t t, float)` in kernels/train.cu; q and
        // dO hold b·h·t·d elements, k and v b·hkv·t·d, lse and dvec b·h·t, and dq, dk, dv are
        // disjoint parts of one buffer of b·h·t·d, b·hkv·t·d and b·hkv·t·d f32 (checked and
        // split above); the grid is (tiles of 64 keys, b·h query heads in F16/BF16, b·hkv kv
        // heads in F32, as each kernel indexes blockIdx.y), 256 threads (every dtype), with
        // the shared memory the kernel's layout takes for this d (allowed above); each block
        // writes or adds to the dk and dv rows of its own key tile below t and adds to dq rows
        // below t only; the inputs start 16-byte aligned (checked above), and so do dq, dk and dv
        // (the F32 kernel's float4 stores: their offsets are multiples of d). The dq, dk and dv views are
        // written through shared borrows of a buffer no other code has seen yet.
        unsafe { bl.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(all, dev.clone()))
    }
    by_dtype!(
        "flash-attention backward",
        inputs[0].0.dtype(),
        run(dims, scale, inputs, (lse, lsel))
    )
}
