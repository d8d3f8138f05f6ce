//! Launches of the project's own CUDA kernels (`kernels/*.cu`, compiled to PTX by build.rs and
//! embedded here) on a Candle device's stream, for the custom ops of [`crate::ops`].
//!
//! Each module is loaded once per device by `CudaDevice::get_or_load_custom_func` (Candle
//! caches it by name), each kernel's handle is looked up once per device and thread
//! ([`cached_func`]), and the kernels run on the device's own stream, ordered with every other
//! Candle op. Inputs are contiguous slices of one float dtype (the ops check both before they
//! get here); every output element is written by the kernel that fills it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaStorage, DeviceId, Map2, Map3, WrapErr};
use candle_core::{CudaDevice, DType, Layout, Result, WithDType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::ops::RopeDims;

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// The name Candle caches our module under (one per device).
const MODULE: &str = "candle_offload_ops";

/// Threads per block of the elementwise kernels.
const ELEMWISE_BLOCK: u32 = 256;

/// Kernel handles already looked up, per thread: (device, module, dtype) to the kernel's root
/// name to its handle.
type FuncKey = (DeviceId, &'static str, Option<DType>);

thread_local! {
    static FUNCS: RefCell<HashMap<FuncKey, HashMap<String, CudaFunction>>> =
        RefCell::new(HashMap::new());
}

/// The kernel `{root}_{dtype}` (or `root` where `dtype` is `None`) of the module `module`
/// (source `ptx`) on `dev`. Candle's `get_or_load_custom_func` takes a lock, formats the name
/// into a C string and asks the driver (`cuModuleGetFunction`) on every call, about once per
/// launch; a decode step launches a hundred and more of ours, so each handle is kept here
/// after its first lookup (a clone is one reference count). Device ids are never reused, so
/// an entry cannot name another device's kernel.
pub(crate) fn cached_func(
    dev: &CudaDevice,
    module: &'static str,
    ptx: &'static str,
    root: &str,
    dtype: Option<DType>,
) -> Result<CudaFunction> {
    let key = (dev.id(), module, dtype);
    let hit = FUNCS.with(|c| c.borrow().get(&key).and_then(|m| m.get(root)).cloned());
    if let Some(f) = hit {
        return Ok(f);
    }
    let name = match dtype {
        Some(d) => format!("{root}_{}", d.as_str()),
        None => root.to_string(),
    };
    let f = dev
        .get_or_load_custom_func(&name, module, ptx)?
        .into_cuda_function();
    FUNCS.with(|c| {
        c.borrow_mut()
            .entry(key)
            .or_default()
            .insert(root.to_string(), f.clone())
    });
    Ok(f)
}

/// The kernel `{name}_{dtype}` of our module on `dev`.
fn load<T: WithDType>(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    if !matches!(T::DTYPE, DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("{name}: no kernel for {:?}", T::DTYPE);
    }
    cached_func(dev, MODULE, ptx::OPS, name, Some(T::DTYPE))
}

/// The contiguous part of `s` that `l` covers.
fn view<'a, T>(s: &'a CudaSlice<T>, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.slice(a..b)),
        None => candle_core::bail!("{what} has to be contiguous"),
    }
}

/// A decode step's position read on the device ([`crate::ops::rope_qk_cache_at`],
/// [`crate::ops::decode_attention_at`]): one u32 element of a contiguous u32 storage.
pub(crate) type PosOnDevice<'a> = Option<(&'a CudaStorage, &'a Layout)>;

/// `buf`'s `n` u32 elements (a device position: 1; padding counts: one per batch row) as a
/// view, checked; `what` names them in the error.
fn u32_view<'a>(buf: PosOnDevice<'a>, n: usize, what: &str) -> Result<Option<CudaView<'a, u32>>> {
    let Some((s, l)) = buf else {
        return Ok(None);
    };
    let v = view(s.as_cuda_slice::<u32>()?, l, what)?;
    if v.len() != n {
        candle_core::bail!("{} {what} on the device, not {n}", v.len());
    }
    Ok(Some(v))
}

fn to_u32(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{what} {v} exceeds u32")))
}

/// The scalar arguments that close every `linear_small` and `qlinear_small` kernel's list,
/// in its order: m, n0, n1, n2, k, silu.
struct SmallDims([u32; 6]);

impl SmallDims {
    fn new(m: usize, ns: [usize; 3], k: usize, silu: bool) -> Result<Self> {
        Ok(Self([
            to_u32(m, "rows")?,
            to_u32(ns[0], "columns")?,
            to_u32(ns[1], "columns")?,
            to_u32(ns[2], "columns")?,
            to_u32(k, "width")?,
            u32::from(silu),
        ]))
    }

    /// Pushes them after the output's argument.
    fn push<'a>(&'a self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>) {
        for v in &self.0 {
            b.arg(v);
        }
    }
}

/// A grid-stride launch over `n` elements (n > 0).
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(ELEMWISE_BLOCK as usize).min(1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ELEMWISE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A kernel's optional buffer (an output, a device position) as its pointer argument: the
/// buffer, or null for none.
fn arg_or_null<'a, B>(
    b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
    buf: Option<&'a B>,
) where
    candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>:
        PushKernelArg<&'a B> + PushKernelArg<&'a u64>,
{
    /// The null device pointer.
    static NULL: u64 = 0;
    match buf {
        Some(buf) => PushKernelArg::<&'a B>::arg(b, buf),
        None => PushKernelArg::<&'a u64>::arg(b, &NULL),
    };
}

/// Parts of 8 elements a thread of `rms_norm_residual_vec` holds (RN_PARTS in kernels/ops.cu).
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
                && [xl, rl, wl]
                    .iter()
                    .all(|l| crate::ops::aligned16(l, T::DTYPE));
            let name = if vec {
                "rms_norm_residual_vec"
            } else {
                "rms_norm_residual"
            };
            let func = load::<T>(dev, name)?;
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
            // const T*, T*, uint32_t, uint32_t, float)` in kernels/ops.cu in number, order and
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

/// Launches the empty `profile_mark(phase)` kernel on `dev`'s stream: a boundary a profiler's
/// kernel list shows in launch order.
pub(crate) fn profile_mark(dev: &CudaDevice, phase: u32) -> Result<()> {
    let func = cached_func(dev, MODULE, ptx::OPS, "profile_mark", None)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&phase);
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the argument matches `profile_mark(uint32_t)` in kernels/ops.cu, which touches
    // no memory.
    unsafe { b.launch(one) }.w()?;
    Ok(())
}

/// `silu_mul`: silu(gate) · up.
pub(crate) fn silu_mul(
    (g, gl): (&CudaStorage, &Layout),
    (u, ul): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    struct K;
    impl Map2 for K {
        fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
            &self,
            g: &CudaSlice<T>,
            gl: &Layout,
            u: &CudaSlice<T>,
            ul: &Layout,
            dev: &CudaDevice,
        ) -> Result<CudaSlice<T>> {
            let func = load::<T>(dev, "silu_mul")?;
            let (g, u) = (view(g, gl, "gate")?, view(u, ul, "up")?);
            let n = g.len();
            if u.len() != n || n == 0 {
                candle_core::bail!("silu_mul: gate has {n} elements, up {}", u.len());
            }
            // SAFETY: uninitialised device memory of n elements on the device's stream; the
            // kernel launched next on that stream writes every one of them.
            let out = unsafe { dev.alloc::<T>(n) }?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&g);
            b.arg(&u);
            b.arg(&out);
            b.arg(&n);
            // SAFETY: the arguments match `silu_mul_<dtype>(const T*, const T*, T*, size_t)` in
            // kernels/ops.cu; gate, up and out hold n elements and the kernel's grid-stride
            // loop touches indices below n only.
            unsafe { b.launch(elementwise(n)) }.w()?;
            Ok(out)
        }
    }
    let dev = g.device();
    let slice = K.map(&g.slice, gl, &u.slice, ul, dev)?;
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// `rope_qk`: q (b, t, hq, d) and k (b, t, hk, d) rotated by a table of t rows of
/// 2·rot_half into one buffer, q as (b, hq, t, d) then k as (b, hk, t, d).
pub(crate) fn rope_qk(
    dims: RopeDims,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (cs, csl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    struct K(RopeDims);
    impl Map3 for K {
        fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
            &self,
            q: &CudaSlice<T>,
            ql: &Layout,
            k: &CudaSlice<T>,
            kl: &Layout,
            cs: &CudaSlice<T>,
            csl: &Layout,
            dev: &CudaDevice,
        ) -> Result<CudaSlice<T>> {
            use candle_core::cuda_backend::cudarc::driver::DevicePtr;
            let d = self.0;
            let (q, k, cs) = (
                view(q, ql, "q")?,
                view(k, kl, "k")?,
                view(cs, csl, "table")?,
            );
            check_rope(d, q.len(), k.len(), None, cs.len())?;
            let nq = d.b * d.t * d.hq * d.d;
            // SAFETY: uninitialised device memory of q's and k's elements on the device's
            // stream; the kernel launched next on that stream writes every one of them (q's nq,
            // then k's as a cache of t positions from 0).
            let out = unsafe { dev.alloc::<T>(d.out_len()) }?;
            {
                let stream = dev.cuda_stream();
                let (qp, _g1) = q.device_ptr(&stream);
                let (kp, _g2) = k.device_ptr(&stream);
                let (cp, _g3) = cs.device_ptr(&stream);
                let (op, _g4) = out.device_ptr(&stream);
                let size = std::mem::size_of::<T>() as u64;
                let kout = op + nq as u64 * size;
                // SAFETY: q, k and the table hold the extents check_rope verified; out holds nq
                // elements for q, then b·hk·t·d for k (cap = t, pos = 0), disjoint from the
                // inputs (a new buffer); no v.
                unsafe {
                    launch_rope::<T>(dev, d, [qp, kp, 0, cp], [op, kout, 0], d.t, 0, 0, d.t)
                }?;
            }
            Ok(out)
        }
    }
    let dev = q.device();
    let slice = K(dims).map(&q.slice, ql, &k.slice, kl, &cs.slice, csl, dev)?;
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// The extents `rope_qk_<dtype>` indexes, for `dims`: q b·t·hq·d, k and v b·t·hk·d, the table
/// t·2·rot_half with 2·rot_half ≤ d.
fn check_rope(d: RopeDims, q: usize, k: usize, v: Option<usize>, cs: usize) -> Result<()> {
    if d.out_len() == 0
        || q != d.b * d.t * d.hq * d.d
        || k != d.b * d.t * d.hk * d.d
        || v.is_some_and(|v| v != k)
        || cs != d.t * 2 * d.rot_half
        || 2 * d.rot_half > d.d
    {
        candle_core::bail!("rope_qk: buffers do not match {d:?}");
    }
    Ok(())
}

/// Launches `rope_qk_<dtype>` on `dev`'s stream over the device addresses `[q, k, v, table]`
/// into `[qout, kout, vout]`, k and v at positions `pos..pos + t` of caches of `cap` positions
/// (v and vout 0: no values). With `pos_dev` (not 0: the address of one u32) the kernel reads
/// the position there instead of `pos`, and the table holds `cs_rows` rows from position 0
/// (otherwise exactly t, the rows of positions pos..pos + t).
///
/// # Safety
/// The addresses are live device memory of `dev`'s context in `T`: the inputs of the extents
/// [`check_rope`] gives for `d` (the table cs_rows ≥ t rows); qout b·hq·t·d writable elements,
/// kout (and vout unless v is 0) b·hk·cap·d, with pos + t ≤ cap; no output overlapping an input
/// or another output. The kernel skips a device position past cap - t or cs_rows - t.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_rope<T: WithDType>(
    dev: &CudaDevice,
    d: RopeDims,
    inputs: [u64; 4],
    outputs: [u64; 3],
    cap: usize,
    pos: usize,
    pos_dev: u64,
    cs_rows: usize,
) -> Result<()> {
    let func = load::<T>(dev, "rope_qk")?;
    let args = [d.b, d.t, d.hq, d.hk, d.d, d.rot_half, cap, pos]
        .map(|v| to_u32(v, "rope dimension"))
        .into_iter()
        .collect::<Result<Vec<u32>>>()?;
    let n = d.out_len()
        + if inputs[2] != 0 {
            d.b * d.t * d.hk * d.d
        } else {
            0
        };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    for p in inputs.iter().chain(outputs.iter()) {
        b.arg(p);
    }
    for a in &args {
        b.arg(a);
    }
    let cs_rows = to_u32(cs_rows, "rope table rows")?;
    b.arg(&pos_dev);
    b.arg(&cs_rows);
    // SAFETY: the arguments match `rope_qk_<dtype>(const T* q, k, v, cs, T* qout, kout, vout,
    // uint32_t b, t, hq, hk, d, rot_half, cap, pos, const uint32_t *pos_dev, uint32_t cs_rows)`
    // in kernels/ops.cu (device addresses are pointer-sized); the caller guarantees the
    // extents, which are exactly what the kernel's grid-stride loop over the n elements of q,
    // k and v indexes (from a device position it checks itself).
    unsafe { b.launch(elementwise(n)) }.w()?;
    Ok(())
}

/// A cache buffer (b, hk, cap, d) for `d`'s keys or values at positions `pos..pos + t`, and cap.
fn cache_view<'a, T>(
    (s, l): (&'a CudaSlice<T>, &Layout),
    d: RopeDims,
    pos: usize,
    what: &str,
) -> Result<(CudaView<'a, T>, usize)> {
    let (cb, ch, cap, cd) = l.shape().dims4()?;
    if (cb, ch, cd) != (d.b, d.hk, d.d) || pos + d.t > cap {
        candle_core::bail!(
            "rope_qk: the {what} cache {:?} has no room for positions {pos}..{} of {d:?}",
            l.shape(),
            pos + d.t
        );
    }
    Ok((view(s, l, what)?, cap))
}

/// `rope_qk` into a KV cache: q and k rotated, q into a new buffer (b, hq, t, d) and k, with v
/// (b, t, hk, d) unrotated, into positions `pos..pos + t` of the caches' buffers (b, hk, cap,
/// d), written in place through their addresses. The caches are shared borrows: their buffers
/// are only touched on the device's one stream, where this launch is ordered after every
/// earlier read and before every later one.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_qk_cache(
    dims: RopeDims,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    (cs, csl): (&CudaStorage, &Layout),
    (kc, kcl): (&CudaStorage, &Layout),
    (vc, vcl): (&CudaStorage, &Layout),
    pos: usize,
    pos_dev: PosOnDevice<'_>,
) -> Result<CudaStorage> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::cuda_backend::CudaStorageSlice as S;
    fn run<T: DeviceRepr + WithDType>(
        dev: &CudaDevice,
        d: RopeDims,
        [q, k, v, cs, kc, vc]: [(&CudaSlice<T>, &Layout); 6],
        pos: usize,
        pos_dev: Option<CudaView<'_, u32>>,
    ) -> Result<CudaSlice<T>> {
        let (q, k, v, cs) = (
            view(q.0, q.1, "q")?,
            view(k.0, k.1, "k")?,
            view(v.0, v.1, "v")?,
            view(cs.0, cs.1, "table")?,
        );
        // From a device position, the whole table (any number of rows ≥ t).
        let row = 2 * d.rot_half;
        let cs_rows = cs.len().checked_div(row).unwrap_or(0);
        let cs_checked = match &pos_dev {
            Some(_) if cs_rows >= d.t && cs_rows * row == cs.len() => d.t * row,
            _ => cs.len(),
        };
        check_rope(d, q.len(), k.len(), Some(v.len()), cs_checked)?;
        let (kc, cap) = cache_view(kc, d, pos, "key")?;
        let (vc, vcap) = cache_view(vc, d, pos, "value")?;
        if cap != vcap {
            candle_core::bail!("rope_qk: key and value caches of {cap} and {vcap} positions");
        }
        // SAFETY: uninitialised device memory of q's elements on the device's stream; the
        // kernel launched next on that stream writes every one of them.
        let qout = unsafe { dev.alloc::<T>(d.b * d.t * d.hq * d.d) }?;
        let stream = dev.cuda_stream();
        let (qp, _g1) = q.device_ptr(&stream);
        let (kp, _g2) = k.device_ptr(&stream);
        let (vp, _g3) = v.device_ptr(&stream);
        let (cp, _g4) = cs.device_ptr(&stream);
        let pos_guard = pos_dev.as_ref().map(|p| p.device_ptr(&stream));
        let pp = pos_guard.as_ref().map_or(0, |(p, _)| *p);
        {
            let (op, _g5) = qout.device_ptr(&stream);
            let (kcp, _g6) = kc.device_ptr(&stream);
            let (vcp, _g7) = vc.device_ptr(&stream);
            if kcp == vcp || [qp, kp, vp].iter().any(|&p| p == kcp || p == vcp) {
                candle_core::bail!("rope_qk: a cache shares its buffer with another operand");
            }
            // SAFETY: the inputs hold the extents check_rope verified (the table cs_rows ≥ t
            // rows); qout is a new buffer of b·hq·t·d; each cache view is contiguous (b, hk,
            // cap, d) with pos + t ≤ cap (checked above; a device position the kernel checks),
            // the key and value caches and the inputs distinct buffers (Candle's storages
            // never overlap, and the addresses differ); pp is 0 or the position's one u32.
            unsafe {
                launch_rope::<T>(
                    dev,
                    d,
                    [qp, kp, vp, cp],
                    [op, kcp, vcp],
                    cap,
                    pos,
                    pp,
                    if pp == 0 { d.t } else { cs_rows },
                )
            }?;
        }
        Ok(qout)
    }
    let dev = q.device();
    fn one<'a, T: candle_core::cuda_backend::CudaDType>(
        s: &'a CudaStorage,
        l: &'a Layout,
    ) -> Result<(&'a CudaSlice<T>, &'a Layout)> {
        Ok((s.as_cuda_slice::<T>()?, l))
    }
    macro_rules! go {
        ($v:ident, $t:ty) => {{
            S::$v(run::<$t>(
                dev,
                dims,
                [
                    one(q, ql)?,
                    one(k, kl)?,
                    one(v, vl)?,
                    one(cs, csl)?,
                    one(kc, kcl)?,
                    one(vc, vcl)?,
                ],
                pos,
                u32_view(pos_dev, 1, "position")?,
            )?)
        }};
    }
    let slice = match &q.slice {
        S::F32(_) => go!(F32, f32),
        S::F16(_) => go!(F16, half::f16),
        S::BF16(_) => go!(BF16, half::bf16),
        _ => candle_core::bail!("rope_qk: unsupported dtype {:?}", q.dtype()),
    };
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// A strided (b, h, positions, d) view of `s` with the last dim contiguous: the slice from its
/// start offset and the batch, head and position strides, after checking that the first
/// `rows` positions of every (batch, head) lie inside `s`.
pub(crate) fn strided_kv<'a, T>(
    s: &'a CudaSlice<T>,
    l: &Layout,
    rows: usize,
    what: &str,
) -> Result<(CudaView<'a, T>, [u64; 3])> {
    let (b, h, _, d) = l.shape().dims4()?;
    let st = l.stride();
    if st[3] != 1 {
        candle_core::bail!("{what}: the last dim has to be contiguous");
    }
    let start = l.start_offset();
    // The end of the last row, for a view of at least one of each (checked first, as the
    // offset counts from 1 of each).
    let nonempty = b > 0 && h > 0 && rows > 0 && d > 0;
    let last = nonempty
        .then(|| start + (b - 1) * st[0] + (h - 1) * st[1] + (rows - 1) * st[2] + d)
        .filter(|&last| last <= s.len());
    let Some(last) = last else {
        candle_core::bail!(
            "{what}: view {:?} / {st:?} does not fit its buffer",
            l.shape()
        );
    };
    Ok((
        s.slice(start..last),
        [st[0], st[1], st[2]].map(|v| v as u64),
    ))
}

/// Warps per block of `decode_attention` (DA_WARPS in kernels/ops.cu).
const ATTENTION_WARPS: u32 = 8;
/// Counters made at least (enough for a decode step's rows of attention, 8 rows of 128 heads,
/// and for the columns of a 131072-wide matmul in groups of 32).
const COUNTERS_MIN: usize = 4096;

/// Makes this thread's completion counters on `dev` before a step is captured, so that the
/// captured kernels use counters allocated outside the graph.
pub(crate) fn prepare_capture(dev: &CudaDevice) -> Result<()> {
    zeroed_counters(dev, COUNTERS_MIN).map(drop)
}

thread_local! {
    /// Counters of finished work for kernels whose last block to finish a piece completes it
    /// (`decode_attention`'s ranges per row, `qlinear4_small`'s columns per group of 32), per
    /// device: zeros between launches (the block that completes a piece sets its counter back).
    /// (An `Rc`: a `CudaSlice`'s clone copies the memory.)
    static COUNTERS: RefCell<HashMap<DeviceId, Rc<CudaSlice<u32>>>> = RefCell::new(HashMap::new());
}

/// At least `rows` (and at least one) zeroed counters on `dev`, kept for later launches: each
/// kernel that counts in them (`decode_attention`'s rows, `qlinear4_small`'s groups of 32
/// columns) sets every counter it used back to 0 before it ends, so that launches in stream
/// order share them.
fn zeroed_counters(dev: &CudaDevice, rows: usize) -> Result<Rc<CudaSlice<u32>>> {
    let have = COUNTERS.with(|c| {
        c.borrow()
            .get(&dev.id())
            .filter(|s| s.len() >= rows.max(1))
            .cloned()
    });
    if let Some(s) = have {
        return Ok(s);
    }
    // Kept past the launch: an allocation inside a captured step would belong to the graph
    // (hazard H19), so a capture that needs more counters than were made before it fails.
    let capturing = dev
        .cuda_stream()
        .capture_status()
        .w()?
        != candle_core::cuda_backend::cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    if capturing {
        candle_core::bail!(
            "{rows} completion counters are needed inside a captured step, more than were made before it"
        );
    }
    let s = Rc::new(dev.alloc_zeros::<u32>(rows.max(COUNTERS_MIN))?);
    COUNTERS.with(|c| c.borrow_mut().insert(dev.id(), s.clone()));
    Ok(s)
}

/// `decode_attention`: q (b, hq, tq, d) contiguous over the first `kv_len` positions of the
/// strided caches k and v (b, hk, ≥ kv_len, d) → (b, tq, hq, d). With `q8` (d a multiple of
/// 32), also the output's b·tq rows of hq·d quantized as [`qlinear4_quantize_x`] quantizes x,
/// in a buffer of [`qlinear4_x_bytes`] for the output projection's variant-4 matmul. With
/// `pos_dev`, kv_len is the views' length and the kernel reads the keys up to that position
/// plus tq.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_attention(
    dims: crate::ops::AttentionDims,
    scale: f32,
    window: u32,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    q8: bool,
    pos_dev: PosOnDevice<'_>,
    pads: PosOnDevice<'_>,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    struct K<'p>(
        crate::ops::AttentionDims,
        f32,
        u32,
        bool,
        std::cell::RefCell<Option<CudaSlice<u8>>>,
        Option<CudaView<'p, u32>>,
        Option<CudaView<'p, u32>>,
    );
    impl Map3 for K<'_> {
        fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
            &self,
            q: &CudaSlice<T>,
            ql: &Layout,
            k: &CudaSlice<T>,
            kl: &Layout,
            v: &CudaSlice<T>,
            vl: &Layout,
            dev: &CudaDevice,
        ) -> Result<CudaSlice<T>> {
            let func = load::<T>(dev, "decode_attention")?;
            let d = self.0;
            let q = view(q, ql, "q")?;
            let (k, ks) = strided_kv(k, kl, d.kv_len, "k")?;
            let (v, vs) = strided_kv(v, vl, d.kv_len, "v")?;
            let n = d.out_len();
            if q.len() != n
                || d.tq == 0
                || d.tq > d.kv_len
                || d.hk == 0
                || !d.hq.is_multiple_of(d.hk)
                || d.d > crate::ops::ATTENTION_MAX_HEAD_DIM
            {
                candle_core::bail!("decode_attention: buffers do not match {d:?}");
            }
            if self.3 && !d.d.is_multiple_of(32) {
                candle_core::bail!("decode_attention: heads of {} are not blocks of 32", d.d);
            }
            let rows = d.b * d.tq * d.hq;
            let splits = crate::ops::attention_splits(d.kv_len, self.2, rows, multiprocessors(dev));
            let [tq, hq, hk, hd, kv_len, splits_u] =
                [d.tq, d.hq, d.hk, d.d, d.kv_len, splits].map(|v| to_u32(v, "attention dimension"));
            let (tq, hq, hk, hd, kv_len, splits_u) = (tq?, hq?, hk?, hd?, kv_len?, splits_u?);
            let cfg = LaunchConfig {
                grid_dim: (tq * splits_u, hq, to_u32(d.b, "batch")?),
                block_dim: (32 * ATTENTION_WARPS, 1, 1),
                shared_mem_bytes: 0,
            };
            // One record (max, sum, d values) per range of each output row, and one counter
            // per row, only where the keys are split.
            let part = if splits > 1 {
                // SAFETY: uninitialised device memory on the device's stream; the kernel
                // writes every record before the last block of its row reads any.
                Some(unsafe { dev.alloc::<f32>(rows * splits * (d.d + 2)) }?)
            } else {
                None
            };
            let counters = zeroed_counters(dev, if splits > 1 { rows } else { 0 })?;
            // SAFETY: uninitialised device memory of n elements on the device's stream; the
            // kernel launched next on that stream writes every one of them (for each (query,
            // head, batch row), its one block or the last of its blocks writes the d values).
            let out = unsafe { dev.alloc::<T>(n) }?;
            let xq = if self.3 {
                // SAFETY: uninitialised device memory on the device's stream; the kernel
                // launched next writes the quants and the scale and sum of every block of the
                // b·tq rows of hq·d / 32 blocks (each head's by the block that writes its
                // values); the padding blocks up to a multiple of 32 per row stay unwritten,
                // and variant 4's matmuls read only blocks below k / 32.
                Some(unsafe { dev.alloc::<u8>(qlinear4_x_bytes(d.b * d.tq, d.hq * d.d)) }?)
            } else {
                None
            };
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&q);
            b.arg(&k);
            b.arg(&v);
            b.arg(&out);
            arg_or_null(&mut b, xq.as_ref());
            // With one split the kernel never touches `part` or `counters`: any valid
            // pointer serves (the counters' buffer, which always exists).
            match &part {
                Some(p) => b.arg(p),
                None => b.arg(&*counters),
            };
            b.arg(&*counters);
            b.arg(&tq);
            b.arg(&hq);
            b.arg(&hk);
            b.arg(&hd);
            b.arg(&kv_len);
            for s in ks.iter().chain(vs.iter()) {
                b.arg(s);
            }
            b.arg(&self.1);
            b.arg(&self.2);
            b.arg(&splits_u);
            arg_or_null(&mut b, self.5.as_ref());
            arg_or_null(&mut b, self.6.as_ref());
            // SAFETY: the arguments match `decode_attention_<dtype>(const T*, const T*,
            // const T*, T*, uint4 *xq (null: none), float *part, uint32_t *counters, uint32_t tq, hq, hk, d, kv_len,
            // uint64_t k strides ×3, v strides ×3, float, uint32_t window, uint32_t splits,
            // const uint32_t *pos_dev, const uint32_t *pads (null: none))` in kernels/ops.cu;
            // pads, when given, holds one u32 per batch row (checked below); q holds b·hq·tq·d
            // elements and out as many; the k and v views end after the last element of
            // position kv_len - 1 of the last (batch, head) (checked by strided_kv), and the
            // kernel reads positions below kv_len only (below min(*pos_dev + tq, kv_len) from a
            // device position, whose one u32 u32_view checked)
            // (1 ≤ tq ≤ kv_len), kv heads below hk (hq a multiple of hk) and d ≤ 256 dims per
            // row (8 per lane); each block scores at most ATTENTION_CHUNK keys (its shared
            // buffer; ops::attention_splits guarantees it); with splits > 1, part holds
            // rows·splits records of d + 2 floats and counters at least `rows` zeros (each
            // row's last block sets its counter back to 0); xq, when given, holds b·tq rows of
            // hq·d / 32 blocks rounded up to 32 at 40 bytes each (16-byte aligned, from the
            // allocator), the extent the row-writing blocks write (d a multiple of 32).
            unsafe { b.launch(cfg) }.w()?;
            *self.4.borrow_mut() = xq;
            Ok(out)
        }
    }
    let dev = q.device();
    let op = K(
        dims,
        scale,
        window,
        q8,
        std::cell::RefCell::new(None),
        u32_view(pos_dev, 1, "position")?,
        u32_view(pads, dims.b, "padding counts (one per batch row)")?,
    );
    let slice = op.map(&q.slice, ql, &k.slice, kl, &v.slice, vl, dev)?;
    let storage = |slice| CudaStorage {
        slice,
        device: dev.clone(),
    };
    let xq = op.4.into_inner().map(|b| storage(S::U8(b)));
    Ok((storage(slice), xq))
}

/// `linear_small`: x (m, k) times up to three weights (n_i, k) in one launch, m ≤ 8, k a
/// multiple of 8, all contiguous and starting 16-byte aligned. Without `silu`: x·w0ᵀ (m, n0),
/// then x·w1ᵀ, then x·w2ᵀ, each contiguous in one buffer; with `silu` (two weights of one
/// shape, gate then up): silu(x·w0ᵀ) · x·w1ᵀ (m, n0).
pub(crate) fn linear_small(
    (x, xl): (&CudaStorage, &Layout),
    ws: &[(&CudaStorage, &Layout)],
    silu: bool,
) -> Result<CudaStorage> {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    fn run<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        dev: &CudaDevice,
        x: &CudaSlice<T>,
        xl: &Layout,
        ws: &[(&CudaSlice<T>, &Layout)],
        silu: bool,
    ) -> Result<CudaSlice<T>> {
        let (m, k) = xl.shape().dims2()?;
        // The kernel instance for at most 1, 2, 4 or 8 rows (its accumulators are registers).
        let bound = m
            .next_power_of_two()
            .clamp(1, crate::ops::LINEAR_SMALL_MAX_ROWS);
        let func = load::<T>(dev, &format!("linear_small_m{bound}"))?;
        let aligned = |l: &Layout| crate::ops::aligned16(l, T::DTYPE);
        let mut ns = [0usize; 3];
        let mut views = Vec::with_capacity(3);
        for (i, (w, wl)) in ws.iter().enumerate() {
            let (n, wk) = wl.shape().dims2()?;
            if wk != k || n == 0 || !aligned(wl) {
                candle_core::bail!(
                    "linear_small: weight {:?} does not fit x {:?}",
                    wl.shape(),
                    xl.shape()
                );
            }
            ns[i] = n;
            views.push(view(w, wl, "weight")?);
        }
        let x = view(x, xl, "x")?;
        if ws.is_empty()
            || ws.len() > 3
            || (silu && (ws.len() != 2 || ns[0] != ns[1]))
            || m == 0
            || m > crate::ops::LINEAR_SMALL_MAX_ROWS
            || k == 0
            || !k.is_multiple_of(8)
            || !aligned(xl)
        {
            candle_core::bail!(
                "linear_small: x {:?} and {} weights do not fit the kernel",
                xl.shape(),
                ws.len()
            );
        }
        let cols = if silu { ns[0] } else { ns.iter().sum() };
        let out_len = m * cols;
        let dims = SmallDims::new(m, ns, k, silu)?;
        let cfg = LaunchConfig {
            grid_dim: (to_u32(cols.div_ceil(4), "blocks")?, 1, 1),
            block_dim: (32 * 4, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: uninitialised device memory of m·cols elements on the device's stream; the
        // kernel launched next on that stream writes every one (lane 0 of each column's warp
        // writes that column for each row r < m).
        let out = unsafe { dev.alloc::<T>(out_len) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&x);
        // Absent weights repeat the first (a valid pointer the kernel never reads: n_i = 0).
        for i in 0..3 {
            b.arg(&views[i.min(views.len() - 1)]);
        }
        b.arg(&out);
        dims.push(&mut b);
        // SAFETY: the arguments match `linear_small_m<M>_<dtype>(const T* x, const T* w0, w1,
        // w2, T* y, uint32_t m, n0, n1, n2, k, silu)` in kernels/ops.cu, M ≥ m; x holds m·k and weight i
        // n_i·k elements (n_i = 0 for absent ones, which are never read), all starting 16-byte
        // aligned with k a multiple of 8, so its 8-element vector loads stay aligned and in
        // bounds; y holds m·cols, the columns it writes (n0 + n1 + n2, or n0 with silu, where
        // n0 = n1); warps past the last column return.
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }
    macro_rules! go {
        ($v:ident) => {{
            let S::$v(xs) = &x.slice else { unreachable!() };
            let mut w = Vec::with_capacity(ws.len());
            for (s, l) in ws {
                match &s.slice {
                    S::$v(v) => w.push((v, *l)),
                    _ => candle_core::bail!("linear_small: mixed dtypes"),
                }
            }
            S::$v(run(&x.device, xs, xl, &w, silu)?)
        }};
    }
    let slice = match &x.slice {
        S::F32(_) => go!(F32),
        S::F16(_) => go!(F16),
        S::BF16(_) => go!(BF16),
        _ => candle_core::bail!("linear_small: unsupported dtype {:?}", x.dtype()),
    };
    Ok(CudaStorage {
        slice,
        device: x.device.clone(),
    })
}

/// The 16-byte vectors of shared memory one warp of `qlinear_small` stages a weight row's
/// blocks in, for blocks of `block_bytes` (`QStage<QT>::VECS` in kernels/ops.cu, which this
/// mirrors): about 2.3 KB of whole blocks, a multiple of 32, plus the alignment slack.
fn qlinear_small_stage_vecs(block_bytes: usize) -> usize {
    let blocks = 2304 / block_bytes / 32 * 32;
    (blocks * block_bytes + 31) / 16 + 1
}

/// [`qlinear_small_stage_vecs`] for variant 2 (`QStage2<QT>::VECS`, per weight row): whole
/// blocks, a multiple of 32 and at least 32, about 1.1 KB, plus the alignment slack.
fn qlinear2_small_stage_vecs(block_bytes: usize) -> usize {
    let blocks = 32 * (1152 / block_bytes / 32).max(1);
    (blocks * block_bytes + 31) / 16 + 1
}

/// Warps per block of threads of the `qlinear_small` kernels (`OPS_WARPS` in kernels/ops.cu).
const QLINEAR_WARPS: usize = 4;

/// Variant 3's dynamic shared memory per block of threads at most: what a launch gets without
/// opting in to more. An SM holds 4 blocks of threads of that much (16 warps); a 7B model's
/// largest decode step, the 4 stages of 4 rows of Q4_0 and k = 11008 of one row of x (352
/// blocks, in one chunk), takes 33 KB, 6 per SM.
const QLINEAR3_SHARED_BYTES: usize = 48 * 1024;

/// Variant 3's bytes per block of 32 elements of one row of x (`XBlock8` and the quants in
/// kernels/ops.cu): 32 quants, the scale and the quants' sum.
const QLINEAR3_X_BLOCK_BYTES: usize = 40;

/// Variant 3's chunk of x (`xblocks`, in blocks of 32 elements, a multiple of 32): all of x's
/// `nb` blocks per row when its `m` rows fit into [`QLINEAR3_SHARED_BYTES`] beside the warps'
/// weight stages (`stage_bytes`), else as many as fit.
fn qlinear3_x_blocks(m: usize, nb: usize, stage_bytes: usize) -> usize {
    let fit = QLINEAR3_SHARED_BYTES.saturating_sub(stage_bytes) / (m * QLINEAR3_X_BLOCK_BYTES);
    nb.next_multiple_of(32).min((fit / 32 * 32).max(32))
}

/// Variant 2's weight rows per warp for the kernel of `bound` rows of x and `cols` output
/// columns (`silu`: columns of gate and of up): 4 where that kernel exists (up to 4 rows of x)
/// and the grid still has at least two blocks of threads per SM, else 2. Variants 3 and 4 ask
/// it up to 2 rows of x (their kernels of 4 rows). The SM count is the
/// first device's asked, read once (a heuristic only: any count gives the same results).
fn qlinear2_rows_per_warp(dev: &CudaDevice, bound: usize, cols: usize, silu: bool) -> usize {
    if bound > 4 {
        return 2;
    }
    let sms = multiprocessors(dev);
    let cols_per_block = QLINEAR_WARPS * if silu { 2 } else { 4 };
    if cols.div_ceil(cols_per_block) >= 2 * sms {
        4
    } else {
        2
    }
}

/// The multiprocessors of the first device asked, read once (for grid heuristics only: any
/// count gives the same results).
fn multiprocessors(dev: &CudaDevice) -> usize {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    static SMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SMS.get_or_init(|| {
        dev.cuda_stream()
            .context()
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |v| v.max(1) as usize)
    })
}

/// Variant 4's bytes per block of 32 elements of one row of x in its buffer (kernels/ops.cu,
/// `qlinear4_quantize_x`): 32 quants, then the scale and the quants' sum (`XBlock8`).
const QLINEAR4_X_BLOCK_BYTES: usize = 40;

/// The bytes of variant 4's buffer of quantized x for m rows of k: k / 32 blocks per row
/// rounded up to a multiple of 32, [`QLINEAR4_X_BLOCK_BYTES`] each.
pub(crate) fn qlinear4_x_bytes(m: usize, k: usize) -> usize {
    m * (k / 32).next_multiple_of(32) * QLINEAR4_X_BLOCK_BYTES
}

/// Variant 4's first launch, `qlinear4_quantize_x_<dtype>`: the m rows of x (m, k) quantized to
/// 8-bit blocks of 32 into a new device buffer for its matmul kernels, k / 32 blocks per row
/// rounded up to a multiple of 32 ([`QLINEAR4_X_BLOCK_BYTES`] each).
fn qlinear4_quantize_x<T: DeviceRepr + WithDType>(
    dev: &CudaDevice,
    x: &CudaView<'_, T>,
    m: usize,
    k: usize,
) -> Result<CudaSlice<u8>> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    if m == 0 || k == 0 || !k.is_multiple_of(32) || x.len() != m * k {
        candle_core::bail!(
            "qlinear_small: x of {} elements is not {m} rows of {k}",
            x.len()
        );
    }
    let nbp = (k / 32).next_multiple_of(32);
    let func = load::<T>(dev, "qlinear4_quantize_x")?;
    // SAFETY: uninitialised device memory on the device's stream; the kernel launched next on
    // that stream writes every byte of it (each of the m·nbp blocks' 32 quants, and its scale
    // and sum, zeros for the blocks past k / 32) before the matmul that reads it.
    let xq = unsafe { dev.alloc::<u8>(qlinear4_x_bytes(m, k)) }?;
    let stream = dev.cuda_stream();
    {
        let (p, _sync) = xq.device_ptr(&stream);
        if !(p as usize).is_multiple_of(16) {
            candle_core::bail!("qlinear_small: the buffer of quantized x is not 16-byte aligned");
        }
    }
    let (m_u, k_u) = (to_u32(m, "rows")?, to_u32(k, "width")?);
    let cfg = LaunchConfig {
        // 128 threads per 32 blocks of a row: the threads cover the m rows' nbp blocks exactly.
        grid_dim: (to_u32(m * nbp / 32, "blocks")?, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&func);
    b.arg(x);
    b.arg(&xq);
    b.arg(&m_u);
    b.arg(&k_u);
    // SAFETY: the arguments match `qlinear4_quantize_x_<dtype>(const T* x, uint4* xq,
    // uint32_t m, uint32_t k)` in kernels/ops.cu; x holds m·k elements, 16-byte aligned (the
    // caller checked its layout), k a multiple of 32, so its 8-element loads of the blocks below
    // k / 32 stay aligned and in bounds; xq, 16-byte aligned, holds m·nbp·40 bytes, the extent
    // the kernel writes (quants at 32 bytes per block, then 8 per block), and the grid of
    // m·nbp/32 blocks of 128 threads gives each thread a row below m.
    unsafe { b.launch(cfg) }.w()?;
    Ok(xq)
}

/// `linear_small` with weights of GGML blocks (`qlinear_small_m<M>_<type>_<dtype>` and the
/// other variants' kernels, the one `tuning` gives the block type):
/// x (m, k) times one to three weights (n_i, k) of one block type, concatenated or (`silu`, two
/// weights) as silu(x·w0ᵀ)·(x·w1ᵀ). The weights' device buffers are Candle's quantized
/// storages, read through their device pointers on the device's stream. Variant 4 launches
/// [`qlinear4_quantize_x`] first, into a buffer freed (in stream order) after the matmul.
///
/// `pre`: x already quantized for variant 4 (by `rms_norm_residual_q8` or another writer of
/// that buffer, from these very rows), used instead of quantizing it again when variant 4 runs.
///
/// `q8_out` (variant 4's kernel for blocks of 32, `silu`, n0 a multiple of 32): the kernel also
/// writes its output quantized as [`qlinear4_quantize_x`] would, in a buffer of
/// [`qlinear4_x_bytes`] for the next variant-4 matmul (the down projection), returned beside it.
pub(crate) fn qlinear_small(
    (x, xl): (&CudaStorage, &Layout),
    ws: &[&candle_core::quantized::QTensor],
    silu: bool,
    pre: Option<&CudaStorage>,
    q8_out: bool,
    tuning: &crate::tuning::KernelTuning,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    type Out<T> = (CudaSlice<T>, Option<CudaSlice<u8>>);
    fn run<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        dev: &CudaDevice,
        (x, xl): (&CudaSlice<T>, &Layout),
        ws: &[&candle_core::quantized::QTensor],
        silu: bool,
        pre: Option<&CudaSlice<u8>>,
        q8_out: bool,
        tuning: &crate::tuning::KernelTuning,
    ) -> Result<Out<T>> {
        let (m, k) = xl.shape().dims2()?;
        let ggml = ws.first().map(|w| w.dtype());
        let qname = ggml.and_then(crate::ops::qlinear_small_type);
        let mut ns = [0usize; 3];
        for (i, w) in ws.iter().enumerate() {
            let (n, wk) = w.shape().dims2()?;
            if wk != k || n == 0 || Some(w.dtype()) != ggml || !w.device().is_cuda() {
                candle_core::bail!(
                    "qlinear_small: weight {:?} of {:?} does not fit x {:?}",
                    w.shape(),
                    w.dtype(),
                    xl.shape()
                );
            }
            ns[i] = n;
        }
        let x = view(x, xl, "x")?;
        let Some(qname) = qname else {
            candle_core::bail!("qlinear_small: no kernel for {ggml:?} blocks")
        };
        if ws.len() > 3
            || (silu && (ws.len() != 2 || ns[0] != ns[1]))
            || m == 0
            || m > crate::ops::LINEAR_SMALL_MAX_ROWS
            || k == 0
            || !k.is_multiple_of(ws[0].dtype().block_size())
            || !crate::ops::aligned16(xl, T::DTYPE)
        {
            candle_core::bail!(
                "qlinear_small: x {:?} and {} weights do not fit the kernel",
                xl.shape(),
                ws.len()
            );
        }
        let bound = m
            .next_power_of_two()
            .clamp(1, crate::ops::LINEAR_SMALL_MAX_ROWS);
        let cols = if silu { ns[0] } else { ns.iter().sum() };
        let block_bytes = ws[0].dtype().type_size();
        // The kernel, the output columns one warp computes, the shared memory of a block of
        // threads and, for variant 3, the chunk of x it quantizes at once (in blocks).
        let variant = tuning.qlinear_variant(ws[0].dtype());
        let kquant = crate::ops::is_qlinear_k_type(ws[0].dtype());
        // Warps a column group (qlinear3ks2_small: 2).
        let mut splits = 1usize;
        let (name, cols_per_warp, shared_bytes, xblocks) = match variant {
            // K-quant blocks converting to floats (every variant but 3 and 4): their own
            // kernel, one column (of gate and up with silu) per warp, or two for Q4_K with
            // `qlinear_k_rows`, no shared memory.
            v if kquant
                && !matches!(
                    v,
                    crate::ops::QlinearVariant::V3 | crate::ops::QlinearVariant::V4
                ) =>
            {
                if tuning.qlinear_k_rows == 2 && bound <= 2 && qname == "q4_k" {
                    (format!("qlinear_k2_small_r2_m{bound}_{qname}"), 2, 0, None)
                } else {
                    (format!("qlinear_k_small_m{bound}_{qname}"), 1, 0, None)
                }
            }
            // One staged row per warp, two (gate and up) with silu.
            crate::ops::QlinearVariant::V1 => (
                format!("qlinear_small_m{bound}_{qname}"),
                1,
                QLINEAR_WARPS
                    * 16
                    * qlinear_small_stage_vecs(block_bytes)
                    * (1 + usize::from(silu)),
                None,
            ),
            // r staged rows per warp: r columns, or r / 2 columns of gate and of up. K-quant
            // blocks under variants 3 and 4 (`qlinear3k`/`qlinear4k`) take the same rows per
            // warp and x's chunks but read their rows unstaged.
            v => {
                use crate::ops::QlinearVariant as V;
                let r = match v {
                    V::V2R2 => 2,
                    // No kernel of 4 rows for more than 4 rows of x.
                    V::V2R4 if bound <= 4 => 4,
                    V::V2R4 => 2,
                    // Variant 3's and 4's kernels of 4 rows take at most 2 rows of x.
                    V::V3 | V::V4 if bound > 2 => 2,
                    _ => qlinear2_rows_per_warp(dev, bound, cols, silu),
                };
                let (stages, kq) = if kquant {
                    (0, "k")
                } else {
                    (
                        QLINEAR_WARPS * 16 * qlinear2_small_stage_vecs(block_bytes) * r,
                        "",
                    )
                };
                let cols_per_warp = if silu { r / 2 } else { r };
                if v == V::V3 {
                    // K-quant blocks up to 2 rows of x: two warps a column group where the grid
                    // is small (qlinear3ks2_small), their sums' static shared memory beside x.
                    splits = if kquant && bound <= 2 {
                        match tuning.qlinear_k_splits {
                            1 => 1,
                            2 => 2,
                            _ if cols.div_ceil(QLINEAR_WARPS * cols_per_warp)
                                < 4 * multiprocessors(dev) =>
                            {
                                2
                            }
                            _ => 1,
                        }
                    } else {
                        1
                    };
                    let sums = (splits - 1) * QLINEAR_WARPS * r * bound * 32 * 4;
                    let xblocks = qlinear3_x_blocks(m, k / 32, stages + sums);
                    let kernel = if splits == 2 {
                        "3ks2".to_string()
                    } else {
                        format!("3{kq}")
                    };
                    (
                        format!("qlinear{kernel}_small_r{r}_m{bound}_{qname}"),
                        cols_per_warp,
                        stages + m * xblocks * QLINEAR3_X_BLOCK_BYTES,
                        Some(to_u32(xblocks, "blocks of x")?),
                    )
                } else {
                    let kernel = if v == V::V4 { "qlinear4" } else { "qlinear2" };
                    (
                        format!("{kernel}{kq}_small_r{r}_m{bound}_{qname}"),
                        cols_per_warp,
                        stages,
                        None,
                    )
                }
            }
        };
        // Variant 4's kernels for blocks of 32 (not qlinear4k) take yq and counters last.
        let v4_blocks = variant == crate::ops::QlinearVariant::V4 && !kquant;
        if q8_out && !(v4_blocks && silu && ns[0].is_multiple_of(32)) {
            candle_core::bail!(
                "qlinear_small: a quantized output needs variant 4, blocks of 32, gate and up, \
                 and a width that is a multiple of 32 ({variant:?}, {ggml:?}, {} columns)",
                ns[0]
            );
        }
        let func = load::<T>(dev, &name)?;
        let dims = SmallDims::new(m, ns, k, silu)?;
        let cfg = LaunchConfig {
            grid_dim: (
                to_u32(cols.div_ceil(QLINEAR_WARPS * cols_per_warp), "blocks")?,
                1,
                1,
            ),
            block_dim: (32 * (QLINEAR_WARPS * splits) as u32, 1, 1),
            shared_mem_bytes: to_u32(shared_bytes, "shared memory")?,
        };
        let stream = dev.cuda_stream();
        // The guards order the stream after the buffers' last writes (the copy stream's
        // upload, where cudarc tracks events) and record this launch's read on drop.
        let mut ptrs = Vec::with_capacity(3);
        let mut guards = Vec::with_capacity(3);
        for w in ws {
            let (p, g) = w.device_ptr_with_guard(&stream)?;
            if !(p as usize).is_multiple_of(16) {
                candle_core::bail!("qlinear_small: a weight's blocks are not 16-byte aligned");
            }
            ptrs.push(p as u64);
            guards.push(g);
        }
        // SAFETY: uninitialised device memory of m·cols elements on the device's stream; the
        // kernel launched next on that stream writes every one (lane 0 of the warp that
        // computes a column writes that column for each row r < m; the grid covers all the
        // columns, cols_per_warp per warp).
        let out = unsafe { dev.alloc::<T>(m * cols) }?;
        // Variant 4: x quantized into a buffer of its own first (unless the norm before it
        // wrote one: `pre`), which the kernel reads instead.
        let own;
        let xq = match (variant == crate::ops::QlinearVariant::V4, pre) {
            (false, _) => None,
            (true, Some(p)) if p.len() == qlinear4_x_bytes(m, k) => Some(p),
            (true, Some(p)) => candle_core::bail!(
                "qlinear_small: {} bytes of quantized x for {m} rows of {k}",
                p.len()
            ),
            (true, None) => {
                own = qlinear4_quantize_x(dev, &x, m, k)?;
                Some(&own)
            }
        };
        // The quantized output and its groups' counters (`q8_out`).
        let yq = if q8_out {
            // SAFETY: uninitialised device memory on the device's stream; the kernel launched
            // next writes the quants and the scale and sum of every block of the m rows of
            // n0 / 32 blocks (each group's by the last warp to store one of its columns); the
            // padding blocks up to a multiple of 32 per row stay unwritten, and variant 4's
            // matmuls read only blocks below k / 32.
            Some(unsafe { dev.alloc::<u8>(qlinear4_x_bytes(m, ns[0])) }?)
        } else {
            None
        };
        let counters = if v4_blocks {
            Some(zeroed_counters(dev, if q8_out { ns[0] / 32 } else { 0 })?)
        } else {
            None
        };
        let mut b = stream.launch_builder(&func);
        match xq {
            Some(xq) => b.arg(xq),
            None => b.arg(&x),
        };
        // Absent weights repeat the first (a valid pointer the kernel never reads: n_i = 0).
        for i in 0..3 {
            b.arg(&ptrs[i.min(ptrs.len() - 1)]);
        }
        b.arg(&out);
        dims.push(&mut b);
        if let Some(xblocks) = &xblocks {
            b.arg(xblocks);
        }
        if let Some(counters) = &counters {
            arg_or_null(&mut b, yq.as_ref());
            b.arg(&**counters);
        }
        // SAFETY: the arguments match `qlinear_small_m<M>_<type>_<dtype>` and
        // `qlinear2_small_r<R>_m<M>_<type>_<dtype>(const T* x, const uint8_t* w0, w1, w2, T* y,
        // uint32_t m, n0, n1, n2, k, silu)` in kernels/ops.cu,
        // `qlinear3_small_r<R>_m<M>_<type>_<dtype>` the same with `uint32_t xblocks` last (a
        // multiple of 32; `qlinear3ks2_small_...` in blocks of 8 warps, whose static shared
        // memory for the sums was left beside x's chunk within the 48 KB), and
        // `qlinear4_small_r<R>_m<M>_<type>_<dtype>` the same as variant 2's with
        // `const uint4* xq` for x and `uint4* yq, uint32_t* counters` last (yq null, or with
        // silu m rows of n0 / 32 blocks rounded up to 32 at 40 bytes, 16-byte aligned, n0 a
        // multiple of 32 and m ≤ 8, and then n0 / 32 zeroed counters, which the kernel sets
        // back to 0), with M ≥ m, every weight of that block type and the
        // shared memory their stages take (QStage / QStage2 mirrored above), for variant 3 with
        // m rows of xblocks blocks of x after them. x holds m·k elements, 16-byte aligned,
        // k a multiple of 32; for variant 4, xq is the buffer qlinear4_quantize_x (or, as
        // `pre`, rms_norm_residual_q8 from the same rows: the ops module matches them by tensor
        // id) filled from it, launched before on this stream, for the m and k passed here (the kernel reads
        // blocks below k / 32 of rows below m, in its extent). Weight i is a live quantized
        // storage of n_i·k elements (n_i = 0 for absent ones, never read), 16-byte aligned,
        // whose rows are k/32 blocks: the kernel
        // reads from the 16-byte boundary at or before a block to the one at or after a row's
        // end, at most 15 bytes past the last row, inside the 512 zeroed padding elements
        // Candle allocates after every quantized buffer. For Q4_K and Q6_K,
        // `qlinear_k_small_m<M>_<type>_<dtype>` and `qlinear_k2_small_r<R>_m<M>_<type>_<dtype>`
        // (R columns a warp, the grid sized for them) have variant 1's arguments; k is a multiple of
        // 256, the rows are k/256 super-blocks of 144 (Q4_K, 16-byte aligned as the buffer is)
        // or 210 bytes (Q6_K, read in 16-bit loads: 2-byte aligned), and the kernel reads
        // inside them only. `qlinear4k_small_r<R>_m<M>_<type>_<dtype>` and
        // `qlinear3k_small_r<R>_m<M>_<type>_<dtype>` (Q4_K, Q6_K) have variant 4's and 3's
        // arguments (xq filled as for variant 4; the shared memory of m rows of xblocks blocks
        // of x), and read those rows the same way, except
        // Q6_K's groups of quant bytes, read in the aligned 4-byte words that hold them: from
        // at most 2 bytes before a group (the buffer starts 16-byte aligned, so that word is in
        // it) to at most 3 past it, still inside its super-block. y holds m·cols elements.
        unsafe { b.launch(cfg) }.w()?;
        drop(guards);
        // A buffer of its own is freed in stream order (at the end of this scope), after the
        // kernel has read it.
        Ok((out, yq))
    }
    let pre = match pre.map(|p| &p.slice) {
        Some(S::U8(p)) => Some(p),
        Some(_) => candle_core::bail!("qlinear_small: quantized x is not a buffer of bytes"),
        None => None,
    };
    fn wrap<T>((out, yq): Out<T>, f: impl Fn(CudaSlice<T>) -> S) -> (S, Option<S>) {
        (f(out), yq.map(S::U8))
    }
    let dev = &x.device;
    let (slice, yq) = match &x.slice {
        S::F32(v) => wrap(run(dev, (v, xl), ws, silu, pre, q8_out, tuning)?, S::F32),
        S::F16(v) => wrap(run(dev, (v, xl), ws, silu, pre, q8_out, tuning)?, S::F16),
        S::BF16(v) => wrap(run(dev, (v, xl), ws, silu, pre, q8_out, tuning)?, S::BF16),
        _ => candle_core::bail!("qlinear_small: unsupported dtype {:?}", x.dtype()),
    };
    let storage = |slice| CudaStorage {
        slice,
        device: dev.clone(),
    };
    Ok((storage(slice), yq.map(storage)))
}

/// A GGML weight on a GPU that `dequant_*` in kernels/ops.cu read: its device, its type's
/// kernel name, its shape (n rows of k) and the bytes of a row.
struct DequantSource {
    dev: CudaDevice,
    qname: &'static str,
    n: usize,
    k: usize,
    row_bytes: usize,
}

fn dequant_source(w: &candle_core::quantized::QTensor, what: &str) -> Result<DequantSource> {
    let (n, k) = w.shape().dims2()?;
    let ggml = w.dtype();
    let Some(qname) = crate::ops::qlinear_small_type(ggml) else {
        candle_core::bail!("{what}: no kernel for {ggml:?}");
    };
    if !k.is_multiple_of(ggml.block_size()) {
        candle_core::bail!("{what}: a {n}x{k} {ggml:?} weight's rows are not whole blocks");
    }
    let candle_core::Device::Cuda(dev) = w.device() else {
        candle_core::bail!("{what}: the weight is not on a GPU");
    };
    Ok(DequantSource {
        dev,
        qname,
        n,
        k,
        row_bytes: k / ggml.block_size() * ggml.type_size(),
    })
}

/// The 16-bit element types the dequantizing kernels write.
trait DequantOut: DeviceRepr + ValidAsZeroBits + Copy + 'static {
    const NAME: &'static str;
    const ONE: Self;
    const ZERO: Self;
}
impl DequantOut for half::f16 {
    const NAME: &'static str = "f16";
    const ONE: Self = half::f16::ONE;
    const ZERO: Self = half::f16::ZERO;
}
impl DequantOut for half::bf16 {
    const NAME: &'static str = "bf16";
    const ONE: Self = half::bf16::ONE;
    const ZERO: Self = half::bf16::ZERO;
}

/// Launches the dequantizing kernel on `stream`: the `rows` rows of `src`'s weight whose first
/// block is at device address `first` (within the weight's buffer, whose read the caller
/// holds a guard of) into `out`'s first rows·k elements.
fn launch_dequant<T: DequantOut>(
    src: &DequantSource,
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    first: u64,
    rows: usize,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    let func = cached_func(
        &src.dev,
        MODULE,
        ptx::OPS,
        &format!("dequant_{}_{}", T::NAME, src.qname),
        None,
    )?;
    if out.len() < rows * src.k {
        candle_core::bail!(
            "dequantize: {} elements out for {rows}x{}",
            out.len(),
            src.k
        );
    }
    // Each thread writes 8 elements (k is a multiple of 32).
    let groups = to_u32(rows * src.k / 8, "parts of 8 elements")?;
    let mut b = stream.launch_builder(&func);
    b.arg(&first);
    b.arg(out);
    b.arg(&groups);
    let cfg = LaunchConfig {
        grid_dim: (groups.div_ceil(ELEMWISE_BLOCK), 1, 1),
        block_dim: (ELEMWISE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `dequant_<f16|bf16>_<type>(const uint8_t* w, T* out,
    // uint32_t groups8)` in kernels/ops.cu, T the element type of `out`. `first` points at the
    // first of `rows` whole rows of the weight's buffer (the callers check r0 + rows <= n and
    // hold the buffer's read guard), and thread g reads only the block holding elements 8g ..
    // 8g + 8 of those rows (a 32-element block, or the 144- or 210-byte super-block of 256 for
    // Q4_K and Q6_K, in 2-byte and byte loads; k is a multiple of the block). It writes those
    // elements of `out`, which holds at least rows·k (checked above) and is 16-byte aligned
    // (the allocator's granularity) for the 16-byte stores.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Rows `r0 .. r0 + rows` of the GGML weight `w` (rows of k elements, a type
/// [`crate::ops::qlinear_small_type`] names) in `dtype` (F16 or BF16), row-major: the
/// dequantizing kernels of kernels/ops.cu, on the device's stream.
pub(crate) fn dequantize_rows(
    w: &candle_core::quantized::QTensor,
    r0: usize,
    rows: usize,
    dtype: DType,
) -> Result<CudaStorage> {
    let what = "dequantize_rows";
    let src = dequant_source(w, what)?;
    if r0 + rows > src.n || rows == 0 {
        candle_core::bail!(
            "{what}: rows {r0}..{} of a {}x{} weight",
            r0 + rows,
            src.n,
            src.k
        );
    }
    fn run<T: DequantOut>(
        w: &candle_core::quantized::QTensor,
        src: &DequantSource,
        r0: usize,
        rows: usize,
    ) -> Result<CudaSlice<T>> {
        let stream = src.dev.cuda_stream();
        // Uninitialised device memory of rows·k elements on the device's stream; the kernel
        // launched next writes every one.
        // SAFETY: written whole by launch_dequant below before anything reads it.
        let mut out = unsafe { src.dev.alloc::<T>(rows * src.k) }?;
        // The guard orders the stream after the weight's upload and records this read on
        // drop.
        let (p, guard) = w.device_ptr_with_guard(&stream)?;
        launch_dequant(
            src,
            &stream,
            p as u64 + (r0 * src.row_bytes) as u64,
            rows,
            &mut out,
        )?;
        drop(guard);
        Ok(out)
    }
    use candle_core::cuda_backend::CudaStorageSlice as S;
    let slice = match dtype {
        DType::F16 => S::F16(run::<half::f16>(w, &src, r0, rows)?),
        DType::BF16 => S::BF16(run::<half::bf16>(w, &src, r0, rows)?),
        _ => candle_core::bail!("{what}: no kernel writes {dtype:?}"),
    };
    Ok(CudaStorage {
        slice,
        device: src.dev.clone(),
    })
}

/// `x · wᵀ` for x (rows × k, F16 or BF16, `x_l` its layout) and the GGML weight `w` (n × k):
/// w dequantized `slice_rows` rows at a time into one buffer, each slice multiplied by cuBLAS
/// straight into its columns of the output (rows × n, x's dtype; F32 accumulation). For
/// [`crate::ops::qlinear_prefill`]: one scratch buffer and one output, no copy of the parts.
pub(crate) fn qlinear_prefill_gemm(
    x: &CudaStorage,
    x_l: &Layout,
    w: &candle_core::quantized::QTensor,
    slice_rows: usize,
) -> Result<CudaStorage> {
    let what = "qlinear_prefill";
    let src = dequant_source(w, what)?;
    let (rows, k) = x_l.shape().dims2()?;
    if k != src.k || slice_rows == 0 || rows == 0 {
        candle_core::bail!(
            "{what}: x {rows}x{k} against a {}x{} weight in slices of {slice_rows}",
            src.n,
            src.k
        );
    }
    let Some((o1, o2)) = x_l.contiguous_offsets() else {
        candle_core::bail!("{what}: x is not contiguous");
    };
    fn run<T: DequantOut>(
        v: &CudaSlice<T>,
        (o1, o2): (usize, usize),
        rows: usize,
        w: &candle_core::quantized::QTensor,
        src: &DequantSource,
        slice_rows: usize,
    ) -> Result<CudaSlice<T>>
    where
        candle_core::cuda_backend::cudarc::cublas::CudaBlas:
            candle_core::cuda_backend::cudarc::cublas::Gemm<T>,
    {
        use candle_core::cuda_backend::cudarc::cublas::{sys::cublasOperation_t as Op, Gemm};
        let (n, k) = (src.n, src.k);
        let x = v.slice(o1..o2);
        let stream = src.dev.cuda_stream();
        let blas = src.dev.cublas_handle();
        let slice_rows = slice_rows.min(n);
        // SAFETY: uninitialised; each slice's launch_dequant below writes the rows the GEMM
        // after it reads.
        let mut part = unsafe { src.dev.alloc::<T>(slice_rows * k) }?;
        // SAFETY: uninitialised; the GEMMs below write every element (their columns r0 .. r0 +
        // r cover 0 .. n, beta 0).
        let mut y = unsafe { src.dev.alloc::<T>(rows * n) }?;
        let (p, guard) = w.device_ptr_with_guard(&stream)?;
        let to = |v: usize| -> Result<i32> {
            i32::try_from(v)
                .map_err(|_| candle_core::Error::Msg(format!("qlinear_prefill: {v} too large")))
        };
        let mut r0 = 0;
        while r0 < n {
            let r = slice_rows.min(n - r0);
            launch_dequant(
                src,
                &stream,
                p as u64 + (r0 * src.row_bytes) as u64,
                r,
                &mut part,
            )?;
            // Column-major, as cuBLAS reads: the slice (r rows of k, row-major) is k × r, x is
            // k × rows, and y (rows × n, row-major) is n × rows with leading dimension n, so
            // yᵀ's rows r0 .. r0 + r are C = sliceᵀ · x, from element r0 on.
            let cfg = candle_core::cuda_backend::cudarc::cublas::GemmConfig {
                transa: Op::CUBLAS_OP_T,
                transb: Op::CUBLAS_OP_N,
                m: to(r)?,
                n: to(rows)?,
                k: to(k)?,
                alpha: T::ONE,
                lda: to(k)?,
                ldb: to(k)?,
                beta: T::ZERO,
                ldc: to(n)?,
            };
            let mut c = y.slice_mut(r0..);
            // SAFETY: A is `part`'s first r·k elements (written by the launch above, ordered
            // before on the same stream), B is x's rows·k, C is y from element r0: cuBLAS
            // writes (j, i) at r0 + j·n + i for i < r, j < rows, at most r0 + (rows − 1)·n +
            // r − 1 < rows·n, within y. All three are on the blas handle's stream (the
            // device's), which `device_ptr` orders.
            unsafe { blas.gemm(cfg, &part.slice(..r * k), &x, &mut c) }.w()?;
            r0 += r;
        }
        drop(guard);
        Ok(y)
    }
    use candle_core::cuda_backend::CudaStorageSlice as S;
    let slice = match &x.slice {
        S::F16(v) => S::F16(run(v, (o1, o2), rows, w, &src, slice_rows)?),
        S::BF16(v) => S::BF16(run(v, (o1, o2), rows, w, &src, slice_rows)?),
        _ => candle_core::bail!("{what}: x is {:?}, not F16 or BF16", x.dtype()),
    };
    Ok(CudaStorage {
        slice,
        device: src.dev.clone(),
    })
}
