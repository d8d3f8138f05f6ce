//! The CUDA launches of RoPE (`kernels/rope.cu`): q and k rotated into a new buffer, or into a
//! KV cache's buffers in place, at a position given on the host or read on the device.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaStorage, Map3, WrapErr};
use candle_core::{CudaDevice, Layout, Result, WithDType};

use crate::cuda::{grid_stride, load, to_u32, u32_view, view, PosOnDevice, ROPE};
use crate::rope::dims::RopeDims;

/// The per-head norms of q and k on the device: their weights (d elements each, of q's dtype)
/// and epsilon.
pub(crate) struct NormOnDevice<'a> {
    pub(crate) q: (&'a CudaStorage, &'a Layout),
    pub(crate) k: (&'a CudaStorage, &'a Layout),
    pub(crate) eps: f32,
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
                    launch_rope::<T>(dev, d, [qp, kp, 0, cp], [op, kout, 0], d.t, 0, 0, d.t, None)
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
/// or another output. The kernel skips a device position past cap - t or cs_rows - t. With
/// `norm` (the q and k norms' weights' addresses, d elements of `T` each, and epsilon), each
/// head's row of q and k is RMS-normed before it rotates (`rope_qk_norm_<dtype>`, a warp a
/// row).
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
    norm: Option<(u64, u64, f32)>,
) -> Result<()> {
    let func = load::<T>(
        dev,
        ROPE,
        if norm.is_some() {
            "rope_qk_norm"
        } else {
            "rope_qk"
        },
    )?;
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
    let Some((qw, kw, eps)) = norm else {
        // SAFETY: the arguments match `rope_qk_<dtype>(const T* q, k, v, cs, T* qout, kout,
        // vout, uint32_t b, t, hq, hk, d, rot_half, cap, pos, const uint32_t *pos_dev, uint32_t
        // cs_rows)` in kernels/rope.cu (device addresses are pointer-sized); the caller
        // guarantees the extents, which are exactly what the kernel's grid-stride loop over
        // the n elements of q, k and v indexes (from a device position it checks itself).
        unsafe { b.launch(grid_stride(n, 1 << 20)) }.w()?;
        return Ok(());
    };
    b.arg(&qw).arg(&kw).arg(&eps);
    // SAFETY: as above, for `rope_qk_norm_<dtype>(..., const T* qw, const T* kw, float eps)`,
    // whose grid-stride loop gives each of the n / d rows of q, k and v a warp (32 threads a
    // row: the launch covers n / d · 32 threads); the caller guarantees qw and kw hold d
    // elements each.
    unsafe { b.launch(grid_stride(n / d.d * 32, 1 << 16)) }.w()?;
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
/// earlier read and before every later one. With `norm` (the q and k norms' weights, d
/// elements each, and epsilon) each head's row of q and k is RMS-normed before it rotates.
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
    norm: Option<NormOnDevice<'_>>,
) -> Result<CudaStorage> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::cuda_backend::CudaStorageSlice as S;
    #[allow(clippy::too_many_arguments)]
    fn run<T: DeviceRepr + WithDType>(
        dev: &CudaDevice,
        d: RopeDims,
        [q, k, v, cs, kc, vc]: [(&CudaSlice<T>, &Layout); 6],
        pos: usize,
        pos_dev: Option<CudaView<'_, u32>>,
        norm: Option<[(&CudaSlice<T>, &Layout); 2]>,
        eps: f32,
    ) -> Result<CudaSlice<T>> {
        let (q, k, v, cs) = (
            view(q.0, q.1, "q")?,
            view(k.0, k.1, "k")?,
            view(v.0, v.1, "v")?,
            view(cs.0, cs.1, "table")?,
        );
        let norm = match norm {
            Some([qw, kw]) => {
                let (qw, kw) = (view(qw.0, qw.1, "q norm")?, view(kw.0, kw.1, "k norm")?);
                if qw.len() != d.d || kw.len() != d.d {
                    candle_core::bail!(
                        "rope_qk: norm weights of {} and {} elements for heads of {}",
                        qw.len(),
                        kw.len(),
                        d.d
                    );
                }
                Some((qw, kw))
            }
            None => None,
        };
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
        let norm_guard = norm
            .as_ref()
            .map(|(qw, kw)| (qw.device_ptr(&stream), kw.device_ptr(&stream)));
        let norm_at = norm_guard
            .as_ref()
            .map(|((qw, _), (kw, _))| (*qw, *kw, eps));
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
            // never overlap, and the addresses differ); pp is 0 or the position's one u32;
            // the norm weights, where given, hold d elements each (checked above).
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
                    norm_at,
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
                match &norm {
                    Some(n) => Some([one(n.q.0, n.q.1)?, one(n.k.0, n.k.1)?]),
                    None => None,
                },
                norm.as_ref().map_or(0.0, |n| n.eps),
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
