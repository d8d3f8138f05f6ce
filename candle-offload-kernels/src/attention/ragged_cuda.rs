//! The CUDA launches of [`super::ragged::ragged_decode_attention`]: `rope_qk_ragged`
//! (kernels/rope.cu) and `decode_attention_ragged` (kernels/attention.cu), reading each
//! sequence's cache addresses, capacity and position from one small table copied to the
//! device per call.

use candle_core::backend::BackendStorage;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    CudaStream, CudaView, DevicePtr, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice as S, WrapErr};
use candle_core::{CudaDevice, Layout, Result, Storage, Tensor};

use super::dims::{attention_splits, ragged_meta, RaggedDecodeSeq, RaggedDims};
use crate::cuda::{
    grid_stride, load, multiprocessors, on_gpu, storage_view, to_u32, view_of, zeroed_counters,
    Elem, ATTENTION, ROPE,
};

/// Warps per block of `decode_attention_ragged` (DA_WARPS in kernels/attention.cu).
const ATTENTION_WARPS: u32 = 8;

/// [`table_of`] for caches of any of the kernels' dtypes, the reads' guards dropped: the
/// table a captured step's replays read (`ragged_seq_table`).
pub(crate) fn seq_table(seqs: &[RaggedDecodeSeq<'_>]) -> Result<Vec<u64>> {
    let what = "ragged_seq_table";
    let guards = cache_guards(seqs);
    let caches = guards
        .iter()
        .map(|g| on_gpu(what, g))
        .collect::<Result<Vec<_>>>()?;
    let Some(first) = caches.first() else {
        return Ok(Vec::new());
    };
    let stream = first.0.device().cuda_stream();
    fn of<T: Elem>(
        caches: &[(&CudaStorage, &Layout)],
        seqs: &[RaggedDecodeSeq<'_>],
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<u64>> {
        let views = cache_views::<T>(caches)?;
        let (table, _guards) = table_of(&views, seqs, stream)?;
        Ok(table)
    }
    match &first.0.slice {
        S::F32(_) => of::<f32>(&caches, seqs, &stream),
        S::F16(_) => of::<half::f16>(&caches, seqs, &stream),
        S::BF16(_) => of::<half::bf16>(&caches, seqs, &stream),
        _ => candle_core::bail!("{what}: caches in F32, F16 or BF16"),
    }
}

/// Every sequence's key and value storage, read-locked, in the order the tables list them.
fn cache_guards<'a>(
    seqs: &'a [RaggedDecodeSeq<'_>],
) -> Vec<(impl std::ops::Deref<Target = Storage> + 'a, &'a Layout)> {
    seqs.iter()
        .flat_map(|s| {
            [
                s.k_cache.storage_and_layout(),
                s.v_cache.storage_and_layout(),
            ]
        })
        .collect()
}

/// The caches' views as `T`.
fn cache_views<'a, T: Elem>(caches: &[(&'a CudaStorage, &Layout)]) -> Result<Vec<CudaView<'a, T>>> {
    caches
        .iter()
        .map(|c| storage_view::<T>(c.0, c.1, "a cache"))
        .collect()
}

/// Each sequence's key and value buffers' addresses (`views`, two a sequence) and
/// (capacity << 32) | position, three u64 a sequence, as the kernels read them; with the
/// guards of those buffers' use on `stream`, which a launch holds until it is queued.
fn table_of<'a, T: Elem>(
    views: &'a [CudaView<'a, T>],
    seqs: &[RaggedDecodeSeq<'_>],
    stream: &'a Arc<CudaStream>,
) -> Result<(Vec<u64>, Vec<SyncOnDrop<'a>>)> {
    let mut table = Vec::with_capacity(3 * seqs.len());
    let mut guards = Vec::with_capacity(2 * seqs.len());
    for (s, pair) in seqs.iter().zip(views.chunks(2)) {
        for view in pair {
            let (p, g) = view.device_ptr(stream);
            table.push(p);
            guards.push(g);
        }
        table.push(ragged_meta(s.k_cache.dim(2)?, s.pos)?);
    }
    Ok((table, guards))
}

/// [`super::ragged::ragged_decode_attention`] on the GPU, for operands it checked; with
/// `on_device` ([`super::ragged::ragged_decode_attention_at`]), the sequences' table read from
/// that I64 (n, 3) tensor and the keys split for the largest capacity.
pub(crate) fn ragged_decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    seqs: &[RaggedDecodeSeq<'_>],
    dims: RaggedDims,
    on_device: Option<&Tensor>,
) -> Result<Tensor> {
    let what = "ragged_decode_attention";
    let (q, k, v, table) = (
        q.contiguous()?,
        k.contiguous()?,
        v.contiguous()?,
        table.contiguous()?,
    );
    let n = seqs.len();
    let guards = [&q, &k, &v, &table].map(|t| t.storage_and_layout());
    let ops = guards
        .iter()
        .map(|g| on_gpu(what, g))
        .collect::<Result<Vec<_>>>()?;
    let cache_guards = cache_guards(seqs);
    let caches = cache_guards
        .iter()
        .map(|g| on_gpu(what, g))
        .collect::<Result<Vec<_>>>()?;
    let dev = ops[0].0.device().clone();
    let on_device = on_device.map(|t| t.contiguous()).transpose()?;
    let table_guard = on_device.as_ref().map(|t| t.storage_and_layout());
    let seq_view = match &table_guard {
        Some(g) => Some(view_of::<i64>(
            on_gpu(what, g)?.0,
            g.1,
            "the sequences' table",
        )?),
        None => None,
    };
    let shape = table.dims2()?;
    let t = &seq_view;
    let out = match &ops[0].0.slice {
        S::F32(_) => S::F32(run::<f32>(&dev, &ops, &caches, seqs, dims, shape, t)?),
        S::F16(_) => S::F16(run::<half::f16>(&dev, &ops, &caches, seqs, dims, shape, t)?),
        S::BF16(_) => S::BF16(run::<half::bf16>(
            &dev, &ops, &caches, seqs, dims, shape, t,
        )?),
        _ => candle_core::bail!("{what}: q in F32, F16 or BF16"),
    };
    let storage = CudaStorage {
        slice: out,
        device: dev,
    };
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        (1, n, dims.n_heads * dims.head_dim),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// The two launches for element type T: returns the attention rows (n, hq, d).
fn run<T: Elem>(
    dev: &CudaDevice,
    ops: &[(&CudaStorage, &Layout)],
    caches: &[(&CudaStorage, &Layout)],
    seqs: &[RaggedDecodeSeq<'_>],
    dims: RaggedDims,
    (table_rows, width): (usize, usize),
    on_device: &Option<CudaView<'_, i64>>,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<T>> {
    let what = "ragged_decode_attention";
    let (n, hq, hk, d) = (seqs.len(), dims.n_heads, dims.n_kv_heads, dims.head_dim);
    let q = storage_view::<T>(ops[0].0, ops[0].1, "q")?;
    let k = storage_view::<T>(ops[1].0, ops[1].1, "k")?;
    let v = storage_view::<T>(ops[2].0, ops[2].1, "v")?;
    let cs = storage_view::<T>(ops[3].0, ops[3].1, "table")?;
    let stream = dev.cuda_stream();
    // Each sequence's key and value addresses and (capacity << 32) | position: built here,
    // or (a captured step) read from the device, where the positions change between replays
    // and the keys are split for the largest capacity.
    let views = cache_views::<T>(caches)?;
    let (table, ptr_guards) = table_of(&views, seqs, &stream)?;
    let mut longest = 0;
    for s in seqs {
        longest = longest.max(if on_device.is_some() {
            s.k_cache.dim(2)?
        } else {
            s.pos + 1
        });
    }
    let host_table = match on_device {
        Some(_) => None,
        None => Some(stream.clone_htod(&table).w()?),
    };
    let (seq_table, _table_guard) = match (on_device, &host_table) {
        (Some(t), _) => t.device_ptr(&stream),
        (None, Some(t)) => t.device_ptr(&stream),
        (None, None) => candle_core::bail!("{what}: no table of the sequences"),
    };
    let [n_u, hq_u, hk_u, d_u, rot_half, cs_rows] =
        [n, hq, hk, d, width / 2, table_rows].map(|v| to_u32(v, "ragged attention dimension"));
    let (n_u, hq_u, hk_u, d_u, rot_half, cs_rows) = (n_u?, hq_u?, hk_u?, d_u?, rot_half?, cs_rows?);
    // SAFETY: uninitialised device memory of n·hq·d elements on the device's stream; the
    // RoPE launch next writes every one (its q part covers them all).
    let q_rot = unsafe { dev.alloc::<T>(n * hq * d) }?;
    {
        let func = load::<T>(dev, ROPE, "rope_qk_ragged")?;
        let mut b = stream.launch_builder(&func);
        b.arg(&q);
        b.arg(&k);
        b.arg(&v);
        b.arg(&cs);
        b.arg(&q_rot);
        b.arg(&seq_table);
        for a in [&n_u, &hq_u, &hk_u, &d_u, &rot_half, &cs_rows] {
            b.arg(a);
        }
        let total = n * (hq + 2 * hk) * d;
        // SAFETY: the arguments match `rope_qk_ragged_<dtype>(const T* q, k, v, cs, T* qout,
        // const uint64_t *seqs, uint32_t n, hq, hk, d, rot_half, cs_rows)` in kernels/rope.cu.
        // q holds n·hq·d elements, k and v n·hk·d each, the table cs_rows rows of 2·rot_half
        // (checked by the caller: q's, k's and v's element counts, the table's shape), q_rot
        // n·hq·d; seqs holds 3 u64 per sequence: two addresses of contiguous caches (1, hk,
        // cap, d) of T (their guards held until after the launches) and cap and a position
        // below cap and cs_rows (checked by the caller, or, for a table on the device, by the
        // caller of each replay; the kernel writes nothing for a position past either), so
        // each write lands inside its cache at (h, pos).
        unsafe { b.launch(grid_stride(total, 1 << 20)) }.w()?;
    }
    let window = match dims.window {
        None => 0,
        Some(0) => candle_core::bail!("{what}: a window of 0 positions"),
        Some(w) => u32::try_from(w).unwrap_or(u32::MAX),
    };
    let rows = n * hq;
    let splits = attention_splits(longest, window, rows, multiprocessors(dev));
    let splits_u = to_u32(splits, "attention splits")?;
    let part = if splits > 1 {
        // SAFETY: uninitialised device memory on the device's stream; the kernel writes every
        // record before the last block of its row reads any.
        Some(unsafe { dev.alloc::<f32>(rows * splits * (d + 2)) }?)
    } else {
        None
    };
    let counters = zeroed_counters(dev, if splits > 1 { rows } else { 0 })?;
    // SAFETY: uninitialised device memory of n·hq·d elements on the device's stream; the
    // kernel launched next writes every one (each (sequence, head) row by its one block or
    // the last of its blocks).
    let out = unsafe { dev.alloc::<T>(n * hq * d) }?;
    {
        let func = load::<T>(dev, ATTENTION, "decode_attention_ragged")?;
        let mut b = stream.launch_builder(&func);
        b.arg(&q_rot);
        b.arg(&seq_table);
        b.arg(&out);
        match &part {
            Some(p) => b.arg(p),
            None => b.arg(&*counters),
        };
        b.arg(&*counters);
        b.arg(&hq_u);
        b.arg(&hk_u);
        b.arg(&d_u);
        let scale = dims.scale as f32;
        b.arg(&scale);
        b.arg(&window);
        b.arg(&splits_u);
        let cfg = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
            grid_dim: (splits_u, hq_u, n_u),
            block_dim: (32 * ATTENTION_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `decode_attention_ragged_<dtype>(const T* q, const
        // uint64_t *seqs, T* out, float *part, uint32_t *counters, uint32_t hq, hk, d, float
        // scale, uint32_t window, uint32_t splits)` in kernels/attention.cu. q_rot and out
        // hold n·hq·d elements (grid z = n sequences, y = hq heads); each sequence's caches
        // hold cap ≥ pos + 1 positions of hk heads of d ≤ 256 (checked by the caller), the
        // keys it reads (positions ≤ pos, kv heads below hk, hq a multiple of hk); splits
        // cut the longest sequence's visible keys (for a table on the device, the largest
        // capacity, which bounds every replay's positions) into ranges of at most the
        // kernel's shared chunk (attention_splits), so every shorter one's too; with splits > 1, part holds
        // rows·splits records of d + 2 floats and counters at least `rows` zeros (each row's
        // last block sets its counter back to 0). The RoPE launch before it on the same
        // stream wrote q_rot and the new keys and values.
        unsafe { b.launch(cfg) }.w()?;
    }
    drop(ptr_guards);
    Ok(out)
}
