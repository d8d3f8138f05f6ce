//! The sizes the decode and prompt attentions work with, how the decode kernel splits a
//! query's keys, and what a ragged decode step is given, shared by the ops and their CUDA
//! launches.

use candle_core::{Layout, Result, Tensor};

/// The decode attention's name in errors.
pub(crate) const DECODE_ATTENTION: &str = "decode-attention";

/// The largest head_dim [`decode_attention`](crate::attention::decode_attention)'s CUDA kernel handles (8 values per lane).
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;

/// The most keys one `decode_attention` block scores (DA_CHUNK in kernels/attention.cu).
const ATTENTION_CHUNK: usize = 256;
/// The fewest keys worth a block of their own: below this, a split's combine costs more
/// than its warps save.
const ATTENTION_MIN_KEYS: usize = 128;

/// How many key ranges `decode_attention` cuts each query's keys into: enough that no block
/// scores more than ATTENTION_CHUNK, and more, down to ATTENTION_MIN_KEYS a range, while the
/// blocks do not fill the device's `sms` multiprocessors once.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn attention_splits(kv_len: usize, window: u32, rows: usize, sms: usize) -> usize {
    let keys = match window as usize {
        0 => kv_len,
        w => kv_len.min(w),
    }
    .max(1);
    let needed = keys.div_ceil(ATTENTION_CHUNK);
    let wanted = keys
        .div_ceil(ATTENTION_MIN_KEYS)
        .min(sms / rows.max(1))
        .max(1);
    needed.max(wanted)
}

/// The sizes [`decode_attention`](crate::attention::decode_attention)'s kernel works with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AttentionDims {
    pub(crate) b: usize,
    pub(crate) hq: usize,
    pub(crate) hk: usize,
    pub(crate) tq: usize,
    pub(crate) kv_len: usize,
    pub(crate) d: usize,
}

impl AttentionDims {
    pub(crate) fn of(q: &Layout, k: &Layout, v: &Layout) -> Result<Self> {
        Self::of_op(DECODE_ATTENTION, q, k, v)
    }

    /// [`of`](Self::of) for the op named `op` in the error.
    pub(crate) fn of_op(op: &str, q: &Layout, k: &Layout, v: &Layout) -> Result<Self> {
        let (b, hq, tq, d) = q.shape().dims4()?;
        let (kb, hk, kv_len, kd) = k.shape().dims4()?;
        if (kb, kd) != (b, d)
            || v.shape() != k.shape()
            || hk == 0
            || !hq.is_multiple_of(hk)
            || tq == 0
            || tq > kv_len
        {
            candle_core::bail!(
                "{op}: q {:?}, k {:?} and v {:?} do not fit together (q (b, q_heads, new, d), \
                 k and v (b, kv_heads, cached ≥ new, d), q_heads a multiple of kv_heads)",
                q.shape(),
                k.shape(),
                v.shape()
            );
        }
        Ok(Self {
            b,
            hq,
            hk,
            tq,
            kv_len,
            d,
        })
    }

    pub(crate) fn out_len(&self) -> usize {
        self.b * self.tq * self.hq * self.d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_splits_bound_each_block_and_fill_the_device_once() {
        let sms = 132;
        for kv in [1, 77, 128, 129, 256, 257, 528, 4096, 100_000] {
            for window in [0u32, 100, 4096] {
                for rows in [1, 8, 32, 64, 1024] {
                    let s = attention_splits(kv, window, rows, sms);
                    let keys = if window == 0 {
                        kv
                    } else {
                        kv.min(window as usize)
                    };
                    let at = format!("kv {kv} window {window} rows {rows}: {s} splits");
                    assert!(s >= 1, "{at}");
                    assert!(keys.div_ceil(s) <= ATTENTION_CHUNK, "{at}");
                    if s > keys.div_ceil(ATTENTION_CHUNK) {
                        // More than needed only while every block has a multiprocessor.
                        assert!(rows * s <= sms, "{at}");
                        assert!(s <= keys.div_ceil(ATTENTION_MIN_KEYS), "{at}");
                    }
                }
            }
        }
        // A 7B decode step (32 heads): one block a head at a short context, four ranges of
        // 132 keys at 528.
        assert_eq!(attention_splits(80, 0, 32, sms), 1);
        assert_eq!(attention_splits(528, 0, 32, sms), 4);
    }
}

/// One sequence of a ragged decode step.
#[derive(Debug, Clone, Copy)]
pub struct RaggedDecodeSeq<'a> {
    /// Its key buffer (1, kv heads, capacity, head_dim), contiguous, written in place.
    pub k_cache: &'a Tensor,
    /// Its value buffer, shaped as the keys'.
    pub v_cache: &'a Tensor,
    /// Positions cached before the new one: where its key and value are written, and the
    /// position its query attends from.
    pub pos: usize,
}

/// The sizes of a ragged decode step's attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RaggedDims {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (a divisor of `n_heads`).
    pub n_kv_heads: usize,
    /// Per-head width (at most [`ATTENTION_MAX_HEAD_DIM`]).
    pub head_dim: usize,
    /// Scores are multiplied by this.
    pub scale: f64,
    /// Keys further back than this are hidden (sliding-window layers).
    pub window: Option<usize>,
}

/// A ragged step's table entry for a sequence's capacity and position, as the kernels read it
/// after the cache addresses: `(capacity << 32) | position`.
pub(crate) fn ragged_meta(capacity: usize, pos: usize) -> Result<u64> {
    let narrow = |v: usize, what: &str| {
        u32::try_from(v)
            .map(u64::from)
            .map_err(|_| candle_core::Error::Msg(format!("ragged step: {what} {v} exceeds u32")))
    };
    Ok((narrow(capacity, "cache positions")? << 32) | narrow(pos, "position")?)
}
