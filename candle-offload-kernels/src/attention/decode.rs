//! Causal (and sliding-window) attention of a decode step's few new positions over a KV cache
//! ([`decode_attention`]): GQA/MQA, read straight from the cache's strided views, with no
//! repeat, cast, contiguous copy, mask or separate softmax; also for a left-padded batch, at a
//! position read on the device (a step replayed from a CUDA graph), and writing its rows
//! quantized for the output projection's variant-4 matmul.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType};

use crate::attention::dims::{AttentionDims, ATTENTION_MAX_HEAD_DIM, DECODE_ATTENTION};
use crate::util::{
    check_dtypes, check_position, contiguous, cpu_dispatch3, f32_of, of_f32, LINEAR_SMALL_MAX_ROWS,
};

#[derive(Debug, Clone, Copy)]
struct DecodeAttention {
    scale: f32,
    /// 0: no sliding window.
    window: u32,
}

impl DecodeAttention {
    const NAME: &'static str = DECODE_ATTENTION;
}

/// Element `(bi, hi, pos, 0)` of a (b, h, positions, d) view with the last dim contiguous.
fn kv_row<'a, T>(s: &'a [T], l: &Layout, bi: usize, hi: usize, pos: usize, d: usize) -> &'a [T] {
    let st = l.stride();
    &s[l.start_offset() + bi * st[0] + hi * st[1] + pos * st[2]..][..d]
}

/// `Σ a_i · b_i` in eight independent partial sums (which the compiler keeps in one vector
/// register), then the rest: a decode step's attention scores on the CPU.
fn dot_f32<T: WithDType>(a: &[f32], b: &[T]) -> f32 {
    let mut part = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (a8.remainder(), b8.remainder());
    for (ca, cb) in a8.zip(b8) {
        for i in 0..8 {
            part[i] += ca[i] * f32_of(cb[i]);
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(&x, &y)| x * f32_of(y)).sum();
    part.iter().sum::<f32>() + tail
}

fn decode_attention_cpu<T: WithDType>(
    q: &[T],
    k: &[T],
    v: &[T],
    (ql, kl, vl): (&Layout, &Layout, &Layout),
    (op, pads): (DecodeAttention, &[u32]),
) -> Result<Vec<T>> {
    let dims = AttentionDims::of(ql, kl, vl)?;
    if kl.stride()[3] != 1 || vl.stride()[3] != 1 {
        candle_core::bail!(
            "{}: k and v need a contiguous last dim",
            DecodeAttention::NAME
        );
    }
    let q = contiguous(q, ql, DecodeAttention::NAME)?;
    let AttentionDims {
        b: _,
        hq,
        hk,
        tq,
        kv_len,
        d,
    } = dims;
    let mut out = vec![of_f32::<T>(0.0); dims.out_len()];
    // Output row c (of d values) is query head c % hq of query position (c / hq) % tq of batch
    // row c / (hq * tq). Rows are shared out between this thread and the CPU matmul pool's
    // workers, which spin between a decode step's matmuls, once the step is large enough.
    let rows = out.len() / d.max(1);
    let work = rows * kv_len * d;
    let tasks = if work >= 1 << 15 {
        crate::pool::threads().min(rows).max(1)
    } else {
        1
    };
    let rows_per_task = rows.div_ceil(tasks);
    crate::pool::for_each_chunk_mut(&mut out, rows_per_task * d, |task, chunk| {
        let mut scores = vec![0f32; kv_len];
        let mut acc = vec![0f32; d];
        let mut qs = vec![0f32; d];
        for (r, orow) in chunk.chunks_exact_mut(d).enumerate() {
            let c = task * rows_per_task + r;
            let (h, qi, bi) = (c % hq, (c / hq) % tq, c / (hq * tq));
            let kvh = h / (hq / hk);
            let qrow = &q[((bi * hq + h) * tq + qi) * d..][..d];
            let pos = kv_len - tq + qi;
            let lo = match op.window {
                0 => 0,
                w => (pos + 1).saturating_sub(w as usize),
            };
            // Left padding: keys before the row's first token are not tokens; a query inside
            // the padding sees only itself.
            let lo = match pads.get(bi).map(|&p| p as usize) {
                Some(p) if pos < p => pos,
                Some(p) => lo.max(p),
                None => lo,
            };
            for (x, &a) in qs.iter_mut().zip(qrow) {
                *x = f32_of(a) * op.scale;
            }
            let mut max = f32::NEG_INFINITY;
            for (j, sc) in (lo..=pos).zip(scores.iter_mut()) {
                *sc = dot_f32(&qs, kv_row(k, kl, bi, kvh, j, d));
                max = max.max(*sc);
            }
            let mut total = 0f32;
            acc.iter_mut().for_each(|a| *a = 0.0);
            let n = pos + 1 - lo;
            crate::activation::exp_shifted_in_place(&mut scores[..n], max);
            for (j, &p) in (lo..=pos).zip(scores.iter()) {
                total += p;
                for (a, &x) in acc.iter_mut().zip(kv_row(v, vl, bi, kvh, j, d)) {
                    *a += p * f32_of(x);
                }
            }
            for (o, &a) in orow.iter_mut().zip(&acc) {
                *o = of_f32(a / total);
            }
        }
    });
    Ok(out)
}

/// [`DecodeAttention`] as a custom op, with the slot of [`decode_attention_q8`].
#[derive(Debug)]
struct DecodeAttentionOp {
    params: DecodeAttention,
    /// Per batch row, the left padding positions, for the CPU loop (empty: none).
    pads: Vec<u32>,
    /// The padding counts on the GPU, for the kernel.
    #[cfg(feature = "cuda")]
    pads_dev: Option<Tensor>,
    /// `Some`: the CUDA kernel also writes the output rows quantized for variant 4 and leaves
    /// their buffer here.
    #[cfg(feature = "cuda")]
    q8: Option<std::cell::RefCell<Option<candle_core::CudaStorage>>>,
    /// The cached positions read on the device ([`decode_attention_at`]).
    #[cfg(feature = "cuda")]
    pos: Option<Tensor>,
}

impl candle_core::CustomOp3 for DecodeAttentionOp {
    fn name(&self) -> &'static str {
        DecodeAttention::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = AttentionDims::of(l1, l2, l3)?;
        let out = cpu_dispatch3!(
            DecodeAttention::NAME,
            s1,
            s2,
            s3,
            decode_attention_cpu,
            (l1, l2, l3),
            (self.params, &self.pads[..])
        );
        Ok((out, Shape::from((dims.b, dims.tq, dims.hq, dims.d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = AttentionDims::of(l1, l2, l3)?;
        let [pos, pads] =
            [&self.pos, &self.pads_dev].map(|t| t.as_ref().map(|t| t.storage_and_layout()));
        let pos = pos
            .as_ref()
            .map(|g| crate::cuda::on_gpu(self.name(), g))
            .transpose()?;
        let pads = pads
            .as_ref()
            .map(|g| crate::cuda::on_gpu(self.name(), g))
            .transpose()?;
        let (out, xq) = crate::attention::cuda::decode_attention(
            dims,
            self.params.scale,
            self.params.window,
            (s1, l1),
            (s2, l2),
            (s3, l3),
            self.q8.is_some(),
            pos,
            pads,
        )?;
        if let Some(slot) = &self.q8 {
            *slot.borrow_mut() = xq;
        }
        Ok((out, Shape::from((dims.b, dims.tq, dims.hq, dims.d))))
    }
}

/// Causal attention of `q` (batch, q_heads, new, head_dim) over the first positions of a KV
/// cache `k`, `v` (batch, kv_heads, cached, head_dim), the new positions being the last `new`
/// of the `cached` ones, in one pass: scores `scale · q·k` and their softmax in F32, GQA/MQA
/// (q head h reads kv head h / (q_heads / kv_heads)), and with `window` Some(w) a key at j is
/// seen by the query at position p only when p < j + w (Mistral's sliding window). `k` and `v`
/// may be strided views (a narrowed preallocated cache) as long as their last dim is
/// contiguous; nothing is copied. Returns (batch, new, q_heads, head_dim), so that a reshape
/// gives the (batch, new, hidden) the output projection reads. Built for decode (few new
/// positions); it computes any `new` ≤ `cached` correctly. Head dims above 256 use the
/// composition ([`decode_attention_unfused`]).
pub fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    decode_attention_with(q, k, v, scale, window, false, None, None)
}

/// [`decode_attention`] (with `q8`: [`decode_attention_q8`]) for a batch of left-padded
/// sequences: `pads` (u32, one per batch row, on q's device; made once per pass, not per
/// layer) says how many of row r's first positions are padding, which no query attends to (a
/// query inside the padding sees only itself), as `Masks::padded` masks them in the models'
/// composition. For decode steps of a padded batch, whose new positions all lie past the
/// padding. Head dims above 256 are refused (the caller keeps its masked composition).
pub fn decode_attention_padded(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
    pads: &Tensor,
    q8: bool,
) -> Result<Tensor> {
    decode_attention_with(q, k, v, scale, window, q8, None, Some(pads))
}

/// [`decode_attention`] (with `q8`: [`decode_attention_q8`]) over the positions of `k` and `v`
/// that `pos` says are cached: `pos` holds one u32 on the device, the positions cached before
/// the new ones, and `k`, `v` are views of the whole cache (every position a replay may
/// reach). What a decode step captured in a CUDA graph launches: each replay writes `pos`'s
/// current value and the kernel reads `pos + new` keys (at most the views' length). On a GPU
/// the kernel's key ranges are set by the views' length, so every replay launches the same
/// grid; elsewhere `pos` is read to the host and the plain op runs on the narrowed views.
/// `pads`: a padded batch's left padding per row, as [`decode_attention_padded`] takes it (a
/// device tensor too, so a replay may read other counts).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_at(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
    pos: &Tensor,
    pads: Option<&Tensor>,
    q8: bool,
) -> Result<Tensor> {
    check_position(DecodeAttention::NAME, pos, q)?;
    if q.device().is_cuda() {
        return decode_attention_with(q, k, v, scale, window, q8, Some(pos), pads);
    }
    let p = pos.flatten_all()?.to_vec1::<u32>()?[0] as usize;
    let n = p + q.dim(2)?;
    let (k, v) = (k.narrow(2, 0, n)?, v.narrow(2, 0, n)?);
    decode_attention_with(q, &k, &v, scale, window, q8, None, pads)
}

/// [`decode_attention`] reshaped to (batch, new, q_heads · head_dim), the rows the output
/// projection reads, for a projection of GGML blocks under variant 4 ([`QlinearVariant::V4`](crate::QlinearVariant::V4)):
/// on a GPU, for at most 8 rows and a head dim that is a multiple of 32, the kernel also writes
/// those rows quantized, and [`qlinear_small`](crate::linear::qlinear_small) given this very tensor (by its id, as after
/// [`rms_norm_residual_q8`](crate::norm::rms_norm_residual_q8)) reads them instead of quantizing them in a launch of its own. The
/// values equal [`decode_attention`]'s, and the projection's, bit for bit.
pub fn decode_attention_q8(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    decode_attention_with(q, k, v, scale, window, true, None, None)
}

/// [`decode_attention`], or with `q8` [`decode_attention_q8`] (the reshaped rows, whose
/// quantized copy is remembered for that very tensor), with `pos` from a device position
/// ([`decode_attention_at`], GPU only) and `pads` the batch rows' left padding
/// ([`decode_attention_padded`]).
#[allow(clippy::too_many_arguments)]
fn decode_attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
    q8: bool,
    pos: Option<&Tensor>,
    pads: Option<&Tensor>,
) -> Result<Tensor> {
    check_dtypes(DecodeAttention::NAME, &[q, k, v])?;
    let dims = AttentionDims::of(q.layout(), k.layout(), v.layout())?;
    let window = match window {
        None => 0,
        Some(0) => candle_core::bail!("{}: a window of 0 positions", DecodeAttention::NAME),
        Some(w) => u32::try_from(w).unwrap_or(u32::MAX),
    };
    let flat = |y: Tensor| -> Result<Tensor> {
        if q8 {
            y.reshape((dims.b, dims.tq, dims.hq * dims.d))
        } else {
            Ok(y)
        }
    };
    let plain = dims.d > ATTENTION_MAX_HEAD_DIM || dims.out_len() == 0;
    if pos.is_some() && (plain || !q.device().is_cuda()) {
        candle_core::bail!(
            "{}: no kernel reads a device position for {dims:?} on {:?}",
            DecodeAttention::NAME,
            q.device()
        );
    }
    if let Some(p) = pads {
        if p.dtype() != DType::U32 || p.dims() != [dims.b] || plain {
            candle_core::bail!(
                "{}: padding counts {:?} {:?} for {dims:?} (one u32 per batch row, head dims \
                 up to {})",
                DecodeAttention::NAME,
                p.dtype(),
                p.dims(),
                ATTENTION_MAX_HEAD_DIM
            );
        }
    }
    // The CPU loop reads the counts on the host; the CUDA kernel from the tensor.
    let pads_host = match pads {
        Some(p) if !q.device().is_cuda() => p.to_vec1::<u32>()?,
        _ => Vec::new(),
    };
    if plain {
        let window = (window > 0).then_some(window as usize);
        return flat(decode_attention_unfused(q, k, v, scale, window)?);
    }
    let last_dim_contiguous = |t: &Tensor| -> Result<Tensor> {
        if t.stride()[3] == 1 {
            Ok(t.clone())
        } else {
            t.contiguous()
        }
    };
    let params = DecodeAttention {
        scale: scale as f32,
        window,
    };
    let rows = dims.b * dims.tq;
    // Where the kernel also quantizes the rows: a GPU, a decode step's rows, blocks of 32.
    let hand_over = q8
        && q.device().is_cuda()
        && dims.d.is_multiple_of(32)
        && (1..=LINEAR_SMALL_MAX_ROWS).contains(&rows);
    let op = DecodeAttentionOp {
        params,
        pads: pads_host,
        #[cfg(feature = "cuda")]
        pads_dev: pads
            .filter(|_| q.device().is_cuda())
            .map(|p| p.contiguous())
            .transpose()?,
        #[cfg(feature = "cuda")]
        q8: hand_over.then(|| std::cell::RefCell::new(None)),
        #[cfg(feature = "cuda")]
        pos: pos.cloned(),
    };
    let y = flat(q.contiguous()?.apply_op3_no_bwd(
        &last_dim_contiguous(k)?,
        &last_dim_contiguous(v)?,
        &op,
    )?)?;
    #[cfg(feature = "cuda")]
    if let Some(xq) = op.q8.and_then(std::cell::RefCell::into_inner) {
        crate::handover::prequantized::remember(&y, xq, rows, dims.hq * dims.d);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = hand_over;
    Ok(y)
}

/// The Candle composition [`decode_attention`] replaces (the model's attention before it): k
/// and v repeated to the q heads and made contiguous, q, k and v cast to F32, `q·kᵀ · scale`,
/// the causal / sliding-window mask added, softmax, the weighted sum, cast back, and transposed
/// to (batch, new, q_heads, head_dim).
pub fn decode_attention_unfused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    let dims = AttentionDims::of(q.layout(), k.layout(), v.layout())?;
    let AttentionDims {
        b,
        hq,
        hk,
        tq,
        kv_len,
        d,
    } = dims;
    let repeat = |t: &Tensor| -> Result<Tensor> {
        let rep = hq / hk;
        if rep == 1 {
            return t.contiguous();
        }
        t.unsqueeze(2)?
            .expand((b, hk, rep, kv_len, d))?
            .reshape((b, hq, kv_len, d))
    };
    let dtype = q.dtype();
    let (q32, k32, v32) = (
        q.to_dtype(DType::F32)?,
        repeat(k)?.to_dtype(DType::F32)?,
        repeat(v)?.to_dtype(DType::F32)?,
    );
    let att = (q32.matmul(&k32.t()?)? * scale)?;
    let mask: Vec<f32> = (0..tq)
        .flat_map(|i| {
            let pos = kv_len - tq + i;
            (0..kv_len).map(move |j| {
                let outside = window.is_some_and(|w| pos >= j + w);
                if j > pos || outside {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (tq, kv_len), q.device())?;
    let att = candle_nn::ops::softmax_last_dim(&att.broadcast_add(&mask)?)?;
    att.matmul(&v32)?
        .to_dtype(dtype)?
        .transpose(1, 2)?
        .contiguous()
}
