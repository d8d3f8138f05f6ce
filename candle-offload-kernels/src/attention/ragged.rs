//! A ragged decode step's attention ([`ragged_decode_attention`]): several sequences, one new
//! position each, each with its own KV cache, in two launches for all of them (RoPE with the
//! caches' writes, then the attention) where running them one by one launches a handful of
//! kernels per sequence and layer.

use candle_core::{DType, Result, Tensor};

use crate::attention::decode::decode_attention;
use crate::attention::dims::{ragged_meta, RaggedDecodeSeq, RaggedDims, ATTENTION_MAX_HEAD_DIM};
use crate::rope::rope_qk_cache;

/// The attention rows (1, n, heads · head_dim) of n sequences' new positions: q (1, n,
/// heads · head_dim), k and v (1, n, kv heads · head_dim) as the projections give them, row i
/// sequence i's; q and k rotated by `table` (a row per position, as
/// [`crate::rope::rope_table`] makes it) at each sequence's position, k and v written into its
/// cache there, and each query attending over its cache's positions up to its own. The same as
/// [`rope_qk_cache`] then [`decode_attention`] for each sequence, which is what runs off the
/// GPU; on it, one kernel for every sequence's RoPE and writes and one for every attention.
pub fn ragged_decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    seqs: &[RaggedDecodeSeq<'_>],
    dims: RaggedDims,
) -> Result<Tensor> {
    check(q, k, v, table, seqs, dims)?;
    let (n, hq, d) = (seqs.len(), dims.n_heads, dims.head_dim);
    let hk = dims.n_kv_heads;
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return crate::attention::ragged_cuda::ragged_decode_attention(
            q, k, v, table, seqs, dims, None,
        );
    }
    let mut outs = Vec::with_capacity(n);
    for (i, s) in seqs.iter().enumerate() {
        let row = |t: &Tensor, heads: usize| {
            t.reshape((n, heads, d))?
                .narrow(0, i, 1)?
                .reshape((1, 1, heads, d))
        };
        let qr = rope_qk_cache(
            &row(q, hq)?,
            &row(k, hk)?,
            &row(v, hk)?,
            &table.narrow(0, s.pos, 1)?,
            (s.k_cache, s.v_cache),
            s.pos,
            None,
        )?;
        let seen = |c: &Tensor| c.narrow(2, 0, s.pos + 1);
        outs.push(decode_attention(
            &qr,
            &seen(s.k_cache)?,
            &seen(s.v_cache)?,
            dims.scale,
            dims.window,
        )?);
    }
    Tensor::cat(&outs, 1)?.reshape((1, n, hq * d))
}

/// [`ragged_decode_attention`] with each sequence's caches and position read on the device
/// from `on_device`, I64 (n, 3) as [`ragged_seq_table`] makes it, not from `seqs` (whose
/// caches give only what is checked: shapes, dtypes, capacities): what a captured decode step
/// launches, so that each replay reads the positions written before it. The keys are split
/// for the largest capacity, which bounds every position a replay may bring (the caller checks
/// each one against its cache before writing the table). GPU only.
pub fn ragged_decode_attention_at(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    seqs: &[RaggedDecodeSeq<'_>],
    dims: RaggedDims,
    on_device: &Tensor,
) -> Result<Tensor> {
    check(q, k, v, table, seqs, dims)?;
    if on_device.dtype() != DType::I64 || on_device.dims() != [seqs.len(), 3] {
        candle_core::bail!(
            "ragged_decode_attention_at: the sequences' table is {:?} {:?}, not I64 ({}, 3)",
            on_device.dtype(),
            on_device.dims(),
            seqs.len()
        );
    }
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && on_device.device().same_device(q.device()) {
        return crate::attention::ragged_cuda::ragged_decode_attention(
            q,
            k,
            v,
            table,
            seqs,
            dims,
            Some(on_device),
        );
    }
    candle_core::bail!("ragged_decode_attention_at: a table on the device is read on a GPU only")
}

/// The table [`ragged_decode_attention_at`] reads: for each sequence, its key and value
/// buffers' device addresses and (capacity << 32) | position, as I64 (bit for bit the u64 the
/// kernels read). GPU caches only.
pub fn ragged_seq_table(seqs: &[RaggedDecodeSeq<'_>]) -> Result<Vec<i64>> {
    #[cfg(feature = "cuda")]
    if seqs.iter().all(|s| s.k_cache.device().is_cuda()) {
        let table = crate::attention::ragged_cuda::seq_table(seqs)?;
        return Ok(table.into_iter().map(|v| v as i64).collect());
    }
    let _ = seqs;
    candle_core::bail!("ragged_seq_table: the caches are not on a GPU")
}

/// `table` ([`ragged_seq_table`]'s, for one layer or for several one after another, each
/// listing the same sequences) with each sequence's position set to `positions`' (one a
/// sequence), the caches and capacities kept: what a captured step's next replay reads.
pub fn set_ragged_positions(table: &mut [i64], positions: &[usize]) -> Result<()> {
    let n = positions.len();
    if n == 0 || !table.len().is_multiple_of(3 * n) {
        candle_core::bail!(
            "set_ragged_positions: a table of {} entries for {n} sequences",
            table.len()
        );
    }
    for (entry, &pos) in table.chunks_mut(3).zip(positions.iter().cycle()) {
        let capacity = (entry[2] as u64 >> 32) as usize;
        entry[2] = ragged_meta(capacity, pos)? as i64;
    }
    Ok(())
}

/// The checks [`ragged_decode_attention`] makes of its operands.
fn check(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    seqs: &[RaggedDecodeSeq<'_>],
    dims: RaggedDims,
) -> Result<()> {
    let what = "ragged_decode_attention";
    let n = seqs.len();
    let RaggedDims {
        n_heads: hq,
        n_kv_heads: hk,
        head_dim: d,
        ..
    } = dims;
    if n == 0 || hk == 0 || !hq.is_multiple_of(hk) || d == 0 || d > ATTENTION_MAX_HEAD_DIM {
        candle_core::bail!("{what}: {n} sequences of {dims:?}");
    }
    if q.elem_count() != n * hq * d || k.elem_count() != n * hk * d || v.dims() != k.dims() {
        candle_core::bail!(
            "{what}: q {:?}, k {:?}, v {:?} for {n} rows of {dims:?}",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let (table_rows, width) = table.dims2()?;
    if width == 0 || width % 2 != 0 || width > d {
        candle_core::bail!("{what}: a RoPE table {:?} for heads of {d}", table.dims());
    }
    for (i, s) in seqs.iter().enumerate() {
        let (b, h, cap, cd) = s.k_cache.dims4()?;
        let ok = (b, h, cd) == (1, hk, d)
            && s.v_cache.dims() == s.k_cache.dims()
            && s.k_cache.is_contiguous()
            && s.v_cache.is_contiguous()
            && s.pos < cap
            && s.pos < table_rows
            && [
                s.k_cache.dtype(),
                s.v_cache.dtype(),
                k.dtype(),
                v.dtype(),
                table.dtype(),
            ]
            .iter()
            .all(|&t| t == q.dtype());
        if !ok {
            candle_core::bail!(
                "{what}: sequence {i}'s caches {:?}/{:?} ({:?}) at position {} do not take a \
                 row of {hk} heads of {d} ({:?}; table of {table_rows} positions)",
                s.k_cache.dims(),
                s.v_cache.dims(),
                s.k_cache.dtype(),
                s.pos,
                q.dtype()
            );
        }
    }
    Ok(())
}
