//! Half-rotated RoPE of q and k in one launch ([`rope_qk`]), read in the projections'
//! (batch, seq, heads, head_dim) layout and written as (batch, heads, seq, head_dim), so the
//! transposes and copies before Candle's `rope` go too; and the same straight into a KV cache
//! ([`rope_qk_cache`], [`rope_qk_cache_at`]), also with q's and k's per-head RMSNorms first
//! ([`QkNorm`]: Qwen3's `q_norm` and `k_norm`), in the same one launch on a GPU.

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor, WithDType, D};

use crate::rope::dims::{RopeDims, ROPE_QK};
use crate::util::{check_dtypes, check_position, contiguous, cpu_dispatch3, f32_of, of_f32};

#[derive(Debug, Clone, Copy)]
struct RopeQk;

impl RopeQk {
    const NAME: &'static str = ROPE_QK;
}

fn rope_qk_cpu<T: WithDType>(
    q: &[T],
    k: &[T],
    cs: &[T],
    (ql, kl, csl): (&Layout, &Layout, &Layout),
) -> Result<Vec<T>> {
    let dims = RopeDims::of(ql, kl, csl)?;
    let (q, k, cs) = (
        contiguous(q, ql, RopeQk::NAME)?,
        contiguous(k, kl, RopeQk::NAME)?,
        contiguous(cs, csl, RopeQk::NAME)?,
    );
    let RopeDims {
        b,
        t,
        d,
        rot_half: half,
        ..
    } = dims;
    let mut out = Vec::with_capacity(dims.out_len());
    for (src, h) in [(q, dims.hq), (k, dims.hk)] {
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    let head = &src[((bi * t + ti) * h + hi) * d..][..d];
                    let row = &cs[ti * 2 * half..][..2 * half];
                    for (i, &x) in head.iter().enumerate() {
                        let y = if i < 2 * half {
                            let j = if i < half { i } else { i - half };
                            let (x1, x2) = (f32_of(head[j]), f32_of(head[j + half]));
                            let (c, s) = (f32_of(row[j]), f32_of(row[half + j]));
                            if i < half {
                                x1 * c - x2 * s
                            } else {
                                x2 * c + x1 * s
                            }
                        } else {
                            f32_of(x)
                        };
                        out.push(of_f32(y));
                    }
                }
            }
        }
    }
    Ok(out)
}

impl candle_core::CustomOp3 for RopeQk {
    fn name(&self) -> &'static str {
        Self::NAME
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
        let n = RopeDims::of(l1, l2, l3)?.out_len();
        let out = cpu_dispatch3!(Self::NAME, s1, s2, s3, rope_qk_cpu, (l1, l2, l3));
        Ok((out, Shape::from(n)))
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
        let dims = RopeDims::of(l1, l2, l3)?;
        let out = crate::rope::cuda::rope_qk(dims, (s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, Shape::from(dims.out_len())))
    }
}

/// The table [`rope_qk`] reads: for each position, the cos of each rotated pair, then its sin
/// (`cos` and `sin` of shape (positions, pairs), joined on the last dim). Build it once with the
/// cos/sin tables and narrow it to the positions of each step.
pub fn rope_table(cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Tensor::cat(&[cos, sin], D::Minus1)?.contiguous()
}

/// Half-rotated RoPE (as `candle_nn::rotary_emb::rope`, the GPT-NeoX / LLaMA layout) of `q`
/// (batch, seq, q_heads, head_dim) and `k` (batch, seq, kv_heads, head_dim) in one pass, given
/// the [`rope_table`] rows of their positions (seq, 2 · pairs). Returns q as (batch, q_heads,
/// seq, head_dim) and k as (batch, kv_heads, seq, head_dim), both contiguous. A table with fewer
/// pairs than `head_dim / 2` rotates the first `2 · pairs` dims of each head and passes the rest
/// through (partial rotary).
pub fn rope_qk(q: &Tensor, k: &Tensor, table: &Tensor) -> Result<(Tensor, Tensor)> {
    check_dtypes(RopeQk::NAME, &[q, k, table])?;
    let (q, k, table) = (q.contiguous()?, k.contiguous()?, table.contiguous()?);
    let dims = RopeDims::of(q.layout(), k.layout(), table.layout())?;
    let RopeDims {
        b, t, hq, hk, d, ..
    } = dims;
    if dims.out_len() == 0 {
        return rope_qk_unfused(&q, &k, &table);
    }
    let out = q.apply_op3_no_bwd(&k, &table, &RopeQk)?;
    let nq = b * hq * t * d;
    Ok((
        out.narrow(0, 0, nq)?.reshape((b, hq, t, d))?,
        out.narrow(0, nq, b * hk * t * d)?.reshape((b, hk, t, d))?,
    ))
}

/// [`rope_qk`] for a decode step into a KV cache: q (b, t, hq, d) and k (b, t, hk, d) rotated
/// by `table`'s t rows as there, q returned as (b, hq, t, d), and k with v (b, t, hk, d)
/// unrotated written into positions `pos..pos + t` of `k_cache` and `v_cache`, contiguous
/// buffers (b, hk, cap, d) that are changed in place. With `norm`, q's and k's per-head norms
/// ([`QkNorm`]) are applied before the rotation. On a GPU one kernel, in place of the norms,
/// `rope_qk` and the cache's two copies; elsewhere that composition ([`QkNorm::apply`],
/// `rope_qk`, then `slice_set`).
pub fn rope_qk_cache(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    caches: (&Tensor, &Tensor),
    pos: usize,
    norm: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    rope_qk_cache_with(q, k, v, table, caches, pos, None, norm)
}

/// The per-head RMSNorms of q and k applied before their RoPE (Qwen3's `q_norm` and
/// `k_norm`): each head's row `x` becomes `x / sqrt(mean(x²) + eps) · w`, computed in F32 and
/// rounded to the row's dtype (as Candle's `rms_norm` writes it), with `q` and `k` the weights
/// (head_dim elements each, of q's dtype).
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a> {
    /// q's norm weight (head_dim).
    pub q: &'a Tensor,
    /// k's norm weight (head_dim).
    pub k: &'a Tensor,
    /// Added to the mean of squares.
    pub eps: f64,
}

impl QkNorm<'_> {
    /// q (b, t, hq, d) and k (b, t, hk, d) normed per head by Candle's `rms_norm` (what the
    /// GPU's one launch folds in).
    pub fn apply(&self, q: &Tensor, k: &Tensor) -> Result<(Tensor, Tensor)> {
        let eps = self.eps as f32;
        Ok((
            candle_nn::ops::rms_norm(&q.contiguous()?, self.q, eps)?,
            candle_nn::ops::rms_norm(&k.contiguous()?, self.k, eps)?,
        ))
    }
}

/// [`rope_qk_cache`] at the position held on the device by `pos` (one u32: the positions
/// already cached), with `table` the whole table (a row for every position, as
/// [`rope_table`] makes it): what a decode step captured in a CUDA graph launches, so that
/// each replay writes `pos`'s current value and the kernel reads it. On a GPU the kernel reads
/// `pos` itself (a position whose rows do not fit the cache or the table writes nothing; the
/// caller checks it); elsewhere `pos` is read to the host and [`rope_qk_cache`] runs.
pub fn rope_qk_cache_at(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    caches: (&Tensor, &Tensor),
    pos: &Tensor,
    norm: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    check_position(RopeQk::NAME, pos, q)?;
    if q.device().is_cuda() {
        return rope_qk_cache_with(q, k, v, table, caches, 0, Some(pos), norm);
    }
    let p = pos.flatten_all()?.to_vec1::<u32>()?[0] as usize;
    rope_qk_cache(q, k, v, &table.narrow(0, p, q.dim(1)?)?, caches, p, norm)
}

/// [`rope_qk_cache`], or with `pos_dev` [`rope_qk_cache_at`] on a GPU.
#[allow(clippy::too_many_arguments)]
fn rope_qk_cache_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    (k_cache, v_cache): (&Tensor, &Tensor),
    pos: usize,
    pos_dev: Option<&Tensor>,
    norm: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    check_dtypes(RopeQk::NAME, &[q, k, v, table, k_cache, v_cache])?;
    if let Some(n) = &norm {
        check_dtypes(RopeQk::NAME, &[q, n.q, n.k])?;
    }
    if v.dims() != k.dims() {
        candle_core::bail!(
            "{}: v {:?} is not shaped as k {:?}",
            RopeQk::NAME,
            v.dims(),
            k.dims()
        );
    }
    for c in [k_cache, v_cache] {
        if !c.is_contiguous() || c.rank() != 4 {
            candle_core::bail!(
                "{}: a cache {:?} has to be a contiguous (b, heads, positions, d) buffer",
                RopeQk::NAME,
                c.dims()
            );
        }
    }
    if q.device().is_cuda() {
        #[cfg(feature = "cuda")]
        return rope_qk_cache_launch([q, k, v, table, k_cache, v_cache], pos, pos_dev, norm);
    }
    if pos_dev.is_some() {
        candle_core::bail!("{}: a device position off the GPU", RopeQk::NAME);
    }
    let (q, k) = match norm {
        Some(n) => n.apply(q, k)?,
        None => (q.clone(), k.clone()),
    };
    let (q, k) = rope_qk(&q, &k, table)?;
    k_cache.slice_set(&k, 2, pos)?;
    v_cache.slice_set(&v.transpose(1, 2)?.contiguous()?, 2, pos)?;
    Ok(q)
}

/// [`rope_qk_cache`]'s kernel, for its operands `[q, k, v, table, k_cache, v_cache]` as it
/// checked them.
#[cfg(feature = "cuda")]
fn rope_qk_cache_launch(
    [q, k, v, table, k_cache, v_cache]: [&Tensor; 6],
    pos: usize,
    pos_dev: Option<&Tensor>,
    norm: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    use candle_core::Storage;
    let (q, k, v, table) = (
        q.contiguous()?,
        k.contiguous()?,
        v.contiguous()?,
        table.contiguous()?,
    );
    // The table's shape is checked against q's rows; from a device position it holds more.
    let rows = match pos_dev {
        Some(_) => table.narrow(0, 0, q.dim(1)?)?,
        None => table.clone(),
    };
    let dims = RopeDims::of(q.layout(), k.layout(), rows.layout())?;
    let pos_guard = pos_dev.map(|p| p.contiguous()).transpose()?;
    let pos_guard = pos_guard.as_ref().map(|p| p.storage_and_layout());
    let pos_dev = pos_guard
        .as_ref()
        .map(|g| crate::cuda::on_gpu(RopeQk::NAME, g))
        .transpose()?;
    let weights = match &norm {
        Some(n) => Some((n.q.contiguous()?, n.k.contiguous()?)),
        None => None,
    };
    let norm_guards = weights
        .as_ref()
        .map(|(qw, kw)| (qw.storage_and_layout(), kw.storage_and_layout()));
    let norm_dev = match (&norm_guards, &norm) {
        (Some((qw, kw)), Some(n)) => Some(crate::rope::cuda::NormOnDevice {
            q: crate::cuda::on_gpu(RopeQk::NAME, qw)?,
            k: crate::cuda::on_gpu(RopeQk::NAME, kw)?,
            eps: n.eps as f32,
        }),
        _ => None,
    };
    let out = {
        let guards = [&q, &k, &v, &table, k_cache, v_cache].map(|t| t.storage_and_layout());
        let cuda = guards
            .iter()
            .map(|g| crate::cuda::on_gpu(RopeQk::NAME, g))
            .collect::<Result<Vec<_>>>()?;
        crate::rope::cuda::rope_qk_cache(
            dims, cuda[0], cuda[1], cuda[2], cuda[3], cuda[4], cuda[5], pos, pos_dev, norm_dev,
        )?
    };
    let (b, t, hq, d) = q.dims4()?;
    Ok(Tensor::from_storage(
        Storage::Cuda(out),
        (b, hq, t, d),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// The Candle composition [`rope_qk`] replaces: transpose each of q and k to (batch, heads,
/// seq, head_dim), make it contiguous and apply `candle_nn::rotary_emb::rope` (to the rotated
/// dims only, under partial rotary).
pub fn rope_qk_unfused(q: &Tensor, k: &Tensor, table: &Tensor) -> Result<(Tensor, Tensor)> {
    let half = table.dim(1)? / 2;
    let cos = table.narrow(1, 0, half)?.contiguous()?;
    let sin = table.narrow(1, half, half)?.contiguous()?;
    let one = |x: &Tensor| -> Result<Tensor> {
        let x = x.transpose(1, 2)?;
        let width = x.dim(D::Minus1)?;
        if 2 * half >= width {
            return candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin);
        }
        let rotated = candle_nn::rotary_emb::rope(
            &x.narrow(D::Minus1, 0, 2 * half)?.contiguous()?,
            &cos,
            &sin,
        )?;
        let pass = x
            .narrow(D::Minus1, 2 * half, width - 2 * half)?
            .contiguous()?;
        Tensor::cat(&[rotated, pass], D::Minus1)
    };
    Ok((one(q)?, one(k)?))
}
