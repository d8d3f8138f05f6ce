//! The CUDA launches of the flash attentions (`kernels/flash.cu` for F16 and BF16,
//! `kernels/flash_f32.cu` for F32): the training forward and backward, and a prompt's attention
//! over a KV cache's strided views.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaView, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{CudaDevice, DType, Layout, Result};

use crate::cuda::{
    by_dtype, load, storage_view as view, strided_kv, to_u32, view_of, Elem, Module, FLASH,
    FLASH_F32,
};

/// Threads per block of the attention kernels (`FA_FWD_WARPS`, `FA_BWD_WARPS` and, for F32,
/// `FA32_THREADS` in kernels/flash.cu) and the rows and keys of their tiles (`FA_BM`, `FA_BN`).
const FA_FWD_THREADS: u32 = 4 * 32;
const FA_BWD_THREADS: u32 = 8 * 32;
const FA32_THREADS: u32 = 256;
const FA_TILE: usize = 64;

/// The sizes of an attention call: batch, query heads, kv heads, sequence, head width.
pub(crate) type AttnSizes = [usize; 5];

/// Dynamic shared memory of the attention kernels for head width `d`: the forward
/// (`FaSmem<D>::fwd`, or `::fwd_wmma` for the WMMA forward) and the backward (`::bwd`) in
/// kernels/flash.cu.
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
/// kernels/flash_f32.cu): the forward (`::fwd`: Q, K then P, V) and the backward (`::bwd`: K, V,
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

/// The module of the flash kernels for `T`: `kernels/flash_f32.cu` for F32, `kernels/flash.cu`
/// for F16 and BF16.
fn flash_module<T: Elem>() -> Module {
    if T::DTYPE == DType::F32 {
        FLASH_F32
    } else {
        FLASH
    }
}

/// The kernel `{name}_d{d}_{dtype}` with its dynamic shared memory allowed up to `smem` bytes.
fn fa_load<T: Elem>(dev: &CudaDevice, name: &str, d: usize, smem: u32) -> Result<CudaFunction> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
    if d != 64 && d != 128 {
        candle_core::bail!("flash-attention: no kernel for head width {d}");
    }
    let func = load::<T>(dev, flash_module::<T>(), &format!("{name}_d{d}"))?;
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
        // T*, T*, float*, uint32_t h, uint32_t hkv, uint32_t t, float)` in kernels/flash.cu (flash_f32.cu for F32); q
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
    /// (`strided_kv`), and its head stride, where its rows are contiguous,
    /// its batches `hkv` heads apart and it starts and its heads lie 16-byte aligned.
    fn cache<'a, T: Elem>(
        s: &'a CudaStorage,
        l: &Layout,
        [b, hkv, tk, d]: [usize; 4],
        what: &str,
    ) -> Result<(CudaView<'a, T>, u64)> {
        let (view, [sb, sh, sr]) = strided_kv(
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
        // kernels/flash.cu; q and out hold b·h·t·d elements; k and v reach (b·hkv − 1)·kstride
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
        let prep = load::<T>(dev, flash_module::<T>(), "flash_attn_bwd_prep")?;
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
        // uint32_t rows, uint32_t d)` in kernels/flash.cu (flash_f32.cu for F32); o and dO hold rows·d elements and
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
        // float* dv, uint32_t h, uint32_t hkv, uint32_t t, float)` in kernels/flash.cu (flash_f32.cu); q and
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
