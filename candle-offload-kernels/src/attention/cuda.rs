//! The CUDA launch of the decode attention (`kernels/attention.cu`): q contiguous, k and v
//! strided views of a KV cache, the keys split into ranges across blocks where they are many,
//! optionally the output rows quantized for the next matmul.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaStorage, Map3, WrapErr};
use candle_core::{CudaDevice, Layout, Result, WithDType};

use crate::attention::dims::{attention_splits, AttentionDims, ATTENTION_MAX_HEAD_DIM};
use crate::cuda::{
    arg_or_null, load, multiprocessors, strided_kv, to_u32, u32_view, view, zeroed_counters,
    PosOnDevice, ATTENTION,
};
use crate::handover::qlinear4_x_bytes;

/// Warps per block of `decode_attention` (DA_WARPS in kernels/attention.cu).
const ATTENTION_WARPS: u32 = 8;

/// `decode_attention`: q (b, hq, tq, d) contiguous over the first `kv_len` positions of the
/// strided caches k and v (b, hk, ≥ kv_len, d) → (b, tq, hq, d). With `q8` (d a multiple of
/// 32), also the output's b·tq rows of hq·d quantized as [`qlinear4_quantize_x`] quantizes x,
/// in a buffer of [`qlinear4_x_bytes`] for the output projection's variant-4 matmul. With
/// `pos_dev`, kv_len is the views' length and the kernel reads the keys up to that position
/// plus tq.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_attention(
    dims: AttentionDims,
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
        AttentionDims,
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
            let func = load::<T>(dev, ATTENTION, "decode_attention")?;
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
                || d.d > ATTENTION_MAX_HEAD_DIM
            {
                candle_core::bail!("decode_attention: buffers do not match {d:?}");
            }
            if self.3 && !d.d.is_multiple_of(32) {
                candle_core::bail!("decode_attention: heads of {} are not blocks of 32", d.d);
            }
            let rows = d.b * d.tq * d.hq;
            let splits = attention_splits(d.kv_len, self.2, rows, multiprocessors(dev));
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
            // const uint32_t *pos_dev, const uint32_t *pads (null: none))` in kernels/attention.cu;
            // pads, when given, holds one u32 per batch row (checked below); q holds b·hq·tq·d
            // elements and out as many; the k and v views end after the last element of
            // position kv_len - 1 of the last (batch, head) (checked by strided_kv), and the
            // kernel reads positions below kv_len only (below min(*pos_dev + tq, kv_len) from a
            // device position, whose one u32 u32_view checked)
            // (1 ≤ tq ≤ kv_len), kv heads below hk (hq a multiple of hk) and d ≤ 256 dims per
            // row (8 per lane); each block scores at most ATTENTION_CHUNK keys (its shared
            // buffer; dims::attention_splits guarantees it); with splits > 1, part holds
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
