//! Fused decode ops as Candle custom ops, usable from any candle-nn code: each replaces a short
//! chain of Candle ops (and their kernel launches) by one pass over the data.
//!
//! - [`rms_norm_residual`]: the pre-norm residual step, `sum = x + residual` and
//!   `rmsnorm(sum) · weight`, in one kernel.
//! - [`silu_mul`]: `silu(gate) · up` (the SwiGLU MLP's elementwise part).
//! - [`rope_qk`]: half-rotated RoPE of q and k in one launch, read in the projections'
//!   (batch, seq, heads, head_dim) layout and written as (batch, heads, seq, head_dim), so the
//!   transposes and copies before Candle's `rope` go too.
//! - [`decode_attention`]: causal (and sliding-window) attention of a few new positions over a
//!   KV cache, GQA/MQA, read straight from the cache's strided views: no repeat, cast,
//!   contiguous copy, mask or separate softmax.
//! - [`linear_small`]: `x · wᵀ` for at most 8 rows, one bandwidth-bound pass over the weight;
//!   [`linear_small_multi`] does two or three weights (q, k, v) in one launch and
//!   [`linear_silu_mul`] a SwiGLU gate and up with the SiLU · mul, also in one.
//! - [`qlinear_small`], [`qlinear_small_multi`], [`qlinear_silu_mul`]: the same three with
//!   weights of GGML blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, as Candle's quantized CUDA storage
//!   holds them), dequantized in registers; x stays in its float type. Their CUDA kernel
//!   comes in variants of one contract; each block type runs its variant from the tuning
//!   ([`KernelTuning::qlinear`], docs/tuning.md). Two of them ([`QlinearVariant::V3`],
//!   [`QlinearVariant::V4`]) quantize x to 8 bits instead, for integer dot products. Q4_K's
//!   and Q6_K's super-blocks of 256 have kernels of their own, on by default; of the variants
//!   only x's quantization applies to them. With [`KernelTuning::qlinear_k`] off they go
//!   through Candle's quantized matmul instead.
//!
//! On a CUDA device they run the project's own kernels (`kernels/ops.cu`, compiled to PTX at
//! build time); on the CPU a direct loop computes the same thing. The `*_unfused` functions are
//! the Candle compositions each op is checked against. All take F32, F16 or BF16 (one dtype for
//! every input), accumulate in F32, accept any last-dim size, and make non-contiguous inputs
//! contiguous. They are for inference: no gradient flows through them.

use candle_core::backend::BackendStorage;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType, D};

/// Refuses dtypes the kernels do not exist for, and mixed dtypes.
pub(crate) fn check_dtypes(op: &str, ts: &[&Tensor]) -> Result<DType> {
    let dtype = ts[0].dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("{op}: unsupported dtype {dtype:?} (F32, F16 or BF16)");
    }
    if let Some(t) = ts.iter().find(|t| t.dtype() != dtype) {
        candle_core::bail!("{op}: mixed dtypes {dtype:?} and {:?}", t.dtype());
    }
    Ok(dtype)
}

/// The contiguous part of a CPU buffer a layout covers.
pub(crate) fn contiguous<'a, T>(s: &'a [T], l: &Layout, op: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("{op}: input has to be contiguous"),
    }
}

pub(crate) fn f32_of<T: WithDType>(v: T) -> f32 {
    v.to_f64() as f32
}

pub(crate) fn of_f32<T: WithDType>(v: f32) -> T {
    T::from_f64(v as f64)
}

/// Applies `f` to two CPU buffers of one float dtype, giving a new buffer of that dtype.
macro_rules! cpu_dispatch2 {
    ($op:expr, $s1:expr, $s2:expr, $f:ident $(, $arg:expr)*) => {
        match ($s1, $s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => CpuStorage::F32($f(a, b $(, $arg)*)?),
            (CpuStorage::F16(a), CpuStorage::F16(b)) => CpuStorage::F16($f(a, b $(, $arg)*)?),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => CpuStorage::BF16($f(a, b $(, $arg)*)?),
            (a, _) => candle_core::bail!("{}: unsupported dtype {:?}", $op, a.dtype()),
        }
    };
}

/// Whether `l`'s first element of a `dtype` buffer is 16-byte aligned (the vector loads of
/// the linear_small kernel; Candle's device buffers themselves start aligned).
pub(crate) fn aligned16(l: &Layout, dtype: DType) -> bool {
    (l.start_offset() * dtype.size_in_bytes()).is_multiple_of(16)
}

/// Applies `f` to three CPU buffers of one float dtype, giving a new buffer of that dtype.
macro_rules! cpu_dispatch3 {
    ($op:expr, $s1:expr, $s2:expr, $s3:expr, $f:ident $(, $arg:expr)*) => {
        match ($s1, $s2, $s3) {
            (CpuStorage::F32(a), CpuStorage::F32(b), CpuStorage::F32(c)) => {
                CpuStorage::F32($f(a, b, c $(, $arg)*)?)
            }
            (CpuStorage::F16(a), CpuStorage::F16(b), CpuStorage::F16(c)) => {
                CpuStorage::F16($f(a, b, c $(, $arg)*)?)
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(b), CpuStorage::BF16(c)) => {
                CpuStorage::BF16($f(a, b, c $(, $arg)*)?)
            }
            (a, _, _) => candle_core::bail!("{}: unsupported dtype {:?}", $op, a.dtype()),
        }
    };
}

// ---------------------------------------------------------------------------------------------
// RMSNorm with the residual add

#[derive(Debug)]
struct RmsNormResidual {
    eps: f32,
    /// `Some`: the CUDA kernel also writes the normed rows quantized for variant 4
    /// ([`rms_norm_residual_q8`]) and leaves their buffer here.
    #[cfg(feature = "cuda")]
    q8: Option<std::cell::RefCell<Option<candle_core::CudaStorage>>>,
}

impl RmsNormResidual {
    const NAME: &'static str = "rms-norm-residual";
}

/// `out` = all sums, then all normed rows (the layout the CUDA kernel writes).
fn rms_norm_residual_cpu<T: WithDType>(
    x: &[T],
    r: &[T],
    w: &[T],
    (xl, rl, wl): (&Layout, &Layout, &Layout),
    eps: f32,
) -> Result<Vec<T>> {
    let op = RmsNormResidual::NAME;
    let (x, r, w) = (
        contiguous(x, xl, op)?,
        contiguous(r, rl, op)?,
        contiguous(w, wl, op)?,
    );
    let n_cols = w.len();
    let el = x.len();
    let mut out = vec![of_f32::<T>(0.0); 2 * el];
    let (sums, normed) = out.split_at_mut(el);
    let rows = x
        .chunks(n_cols)
        .zip(r.chunks(n_cols))
        .zip(sums.chunks_mut(n_cols).zip(normed.chunks_mut(n_cols)));
    for ((xr, rr), (sr, nr)) in rows {
        let mut acc = 0f32;
        for ((s, &a), &b) in sr.iter_mut().zip(xr).zip(rr) {
            *s = of_f32(f32_of(a) + f32_of(b));
            let v = f32_of(*s);
            acc += v * v;
        }
        let inv = 1.0 / (acc / n_cols as f32 + eps).sqrt();
        for ((n, &s), &g) in nr.iter_mut().zip(sr.iter()).zip(w) {
            *n = of_f32(f32_of(s) * inv * f32_of(g));
        }
    }
    Ok(out)
}

impl candle_core::CustomOp3 for RmsNormResidual {
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
        let out = cpu_dispatch3!(
            Self::NAME,
            s1,
            s2,
            s3,
            rms_norm_residual_cpu,
            (l1, l2, l3),
            self.eps
        );
        Ok((out, stacked_shape(l1)))
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
        let (out, xq) = crate::sys::kernels::rms_norm_residual(
            self.eps,
            (s1, l1),
            (s2, l2),
            (s3, l3),
            self.q8.is_some(),
        )?;
        if let Some(slot) = &self.q8 {
            *slot.borrow_mut() = xq;
        }
        Ok((out, stacked_shape(l1)))
    }
}

/// `(2, dims…)`: the sums, then the normed rows.
fn stacked_shape(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

/// `(x + residual, rmsnorm(x + residual) · weight)` in one pass: the residual add of a pre-norm
/// decoder layer and the norm after it. `x` and `residual` have one shape (any rank ≥ 1), its
/// last dim the length of `weight`; the sum is rounded to the dtype before it is normalized,
/// as the composition ([`rms_norm_residual_unfused`]) does.
pub fn rms_norm_residual(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let op = RmsNormResidual {
        eps: eps as f32,
        #[cfg(feature = "cuda")]
        q8: None,
    };
    rms_norm_residual_with(x, residual, weight, &op)
}

/// [`rms_norm_residual`] through `op` (which may also quantize the normed rows).
fn rms_norm_residual_with(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    op: &RmsNormResidual,
) -> Result<(Tensor, Tensor)> {
    check_dtypes(RmsNormResidual::NAME, &[x, residual, weight])?;
    if x.shape() != residual.shape() {
        candle_core::bail!(
            "{}: x {:?} and residual {:?} differ in shape",
            RmsNormResidual::NAME,
            x.shape(),
            residual.shape()
        );
    }
    let width = x.dim(D::Minus1)?;
    if weight.dims1()? != width {
        candle_core::bail!(
            "{}: weight {:?} does not match the last dim of x {:?}",
            RmsNormResidual::NAME,
            weight.shape(),
            x.shape()
        );
    }
    if x.elem_count() == 0 {
        return rms_norm_residual_unfused(x, residual, weight, f64::from(op.eps));
    }
    let out =
        x.contiguous()?
            .apply_op3_no_bwd(&residual.contiguous()?, &weight.contiguous()?, op)?;
    Ok((out.get(0)?, out.get(1)?))
}

/// [`rms_norm_residual`] for a norm whose rows go next into GGML-block matmuls of variant 4
/// ([`QlinearVariant::V4`], which quantizes x to 8 bits in a launch of its own): on a GPU, for
/// decode rows (at most 8, a width that is a multiple of 32, inputs that start 16-byte aligned,
/// at most 32768 wide), the same kernel also writes the normed rows quantized, and [`qlinear_small_multi`] / [`qlinear_silu_mul`] given that very
/// tensor (by its id; the latest norm's only, per thread) read them instead of quantizing them
/// again. The results equal [`rms_norm_residual`]'s, and the matmuls' theirs, bit for bit.
/// Elsewhere it is [`rms_norm_residual`].
pub fn rms_norm_residual_q8(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    {
        let width = x.dim(D::Minus1)?;
        let rows = x.elem_count() / width.max(1);
        if x.device().is_cuda()
            && width.is_multiple_of(32)
            && (1..=LINEAR_SMALL_MAX_ROWS).contains(&rows)
        {
            let op = RmsNormResidual {
                eps: eps as f32,
                q8: Some(std::cell::RefCell::new(None)),
            };
            let (sum, normed) = rms_norm_residual_with(x, residual, weight, &op)?;
            if let Some(xq) = op.q8.and_then(std::cell::RefCell::into_inner) {
                prequantized::remember(&normed, xq, rows, width);
            }
            return Ok((sum, normed));
        }
    }
    rms_norm_residual(x, residual, weight, eps)
}

/// Rows quantized for variant 4 by the op that wrote them ([`rms_norm_residual_q8`],
/// [`decode_attention_q8`], [`qlinear_silu_mul_q8`]), per thread: the latest such tensor's id
/// and variant 4's buffer of its rows.
#[cfg(feature = "cuda")]
mod prequantized {
    use candle_core::{Storage, Tensor, TensorId};
    use std::cell::RefCell;

    thread_local! {
        static LATEST: RefCell<Option<(TensorId, Tensor)>> = const { RefCell::new(None) };
        pub(super) static FOUND: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    /// Keeps `xq`, the quantized buffer of `normed` (`rows` of `width`), for the matmuls that
    /// take `normed` next (replacing the one kept before).
    pub(super) fn remember(
        normed: &Tensor,
        xq: candle_core::CudaStorage,
        rows: usize,
        width: usize,
    ) {
        let bytes = Tensor::from_storage(
            Storage::Cuda(xq),
            crate::sys::kernels::qlinear4_x_bytes(rows, width),
            candle_core::op::BackpropOp::none(),
            false,
        );
        LATEST.with(|l| *l.borrow_mut() = Some((normed.id(), bytes)));
    }

    /// Drops the kept buffer (a captured step must not end holding memory it allocated).
    pub(super) fn forget() {
        LATEST.with(|l| *l.borrow_mut() = None);
    }

    /// The quantized rows of `x`, if the latest writer on this thread made `x` and them.
    pub(super) fn of(x: &Tensor) -> Option<Tensor> {
        let found = LATEST.with(|l| match &*l.borrow() {
            Some((id, bytes)) if *id == x.id() => Some(bytes.clone()),
            _ => None,
        });
        if found.is_some() {
            FOUND.with(|f| f.set(f.get() + 1));
        }
        found
    }
}

/// Drops the quantized rows this thread keeps for the next matmul ([`rms_norm_residual_q8`]
/// and the other writers of variant 4's buffer); [`crate::OffloadRuntime::capture_step`] calls
/// it before a capture ends, so that the graph leaves no allocation of its own alive.
pub(crate) fn forget_handover() {
    #[cfg(feature = "cuda")]
    prequantized::forget();
}

/// The Candle composition [`rms_norm_residual`] replaces: an add, then Candle's RMSNorm.
pub fn rms_norm_residual_unfused(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let sum = (x + residual)?;
    let normed = candle_nn::ops::rms_norm(&sum, weight, eps as f32)?;
    Ok((sum, normed))
}

// ---------------------------------------------------------------------------------------------
// SiLU · mul

#[derive(Debug, Clone, Copy)]
struct SiluMul;

impl SiluMul {
    const NAME: &'static str = "silu-mul";
}

fn silu_mul_cpu<T: WithDType>(g: &[T], u: &[T], (gl, ul): (&Layout, &Layout)) -> Result<Vec<T>> {
    let (g, u) = (
        contiguous(g, gl, SiluMul::NAME)?,
        contiguous(u, ul, SiluMul::NAME)?,
    );
    Ok(g.iter()
        .zip(u)
        .map(|(&g, &u)| {
            let g = f32_of(g);
            of_f32(g / (1.0 + (-g).exp()) * f32_of(u))
        })
        .collect())
}

impl candle_core::CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = cpu_dispatch2!(Self::NAME, s1, s2, silu_mul_cpu, (l1, l2));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::sys::kernels::silu_mul((s1, l1), (s2, l2))?;
        Ok((out, l1.shape().clone()))
    }
}

/// `silu(gate) · up` in one pass (`gate` and `up` of one shape).
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_dtypes(SiluMul::NAME, &[gate, up])?;
    if gate.shape() != up.shape() {
        candle_core::bail!(
            "{}: gate {:?} and up {:?} differ in shape",
            SiluMul::NAME,
            gate.shape(),
            up.shape()
        );
    }
    if gate.elem_count() == 0 {
        return silu_mul_unfused(gate, up);
    }
    gate.contiguous()?
        .apply_op2_no_bwd(&up.contiguous()?, &SiluMul)
}

/// The Candle composition [`silu_mul`] replaces.
pub fn silu_mul_unfused(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    candle_nn::ops::silu(gate)? * up
}

// ---------------------------------------------------------------------------------------------
// RoPE of q and k

#[derive(Debug, Clone, Copy)]
struct RopeQk;

impl RopeQk {
    const NAME: &'static str = "rope-qk";
}

/// The sizes [`rope_qk`]'s kernel works with, from the layouts of q, k and the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RopeDims {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) hq: usize,
    pub(crate) hk: usize,
    pub(crate) d: usize,
    pub(crate) rot_half: usize,
}

impl RopeDims {
    fn of(q: &Layout, k: &Layout, cs: &Layout) -> Result<Self> {
        let (b, t, hq, d) = q.shape().dims4()?;
        let (kb, kt, hk, kd) = k.shape().dims4()?;
        let (ct, width) = cs.shape().dims2()?;
        if (kb, kt, kd) != (b, t, d) || ct != t || width % 2 != 0 || width > d {
            candle_core::bail!(
                "{}: q {:?}, k {:?} and table {:?} do not fit together",
                RopeQk::NAME,
                q.shape(),
                k.shape(),
                cs.shape()
            );
        }
        Ok(Self {
            b,
            t,
            hq,
            hk,
            d,
            rot_half: width / 2,
        })
    }

    pub(crate) fn out_len(&self) -> usize {
        self.b * self.t * (self.hq + self.hk) * self.d
    }
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
        let out = crate::sys::kernels::rope_qk(dims, (s1, l1), (s2, l2), (s3, l3))?;
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
/// buffers (b, hk, cap, d) that are changed in place. On a GPU one kernel, in place of
/// `rope_qk` and the cache's two copies; elsewhere that composition (`rope_qk`, then
/// `slice_set`).
pub fn rope_qk_cache(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    caches: (&Tensor, &Tensor),
    pos: usize,
) -> Result<Tensor> {
    rope_qk_cache_with(q, k, v, table, caches, pos, None)
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
) -> Result<Tensor> {
    check_position(RopeQk::NAME, pos, q)?;
    if q.device().is_cuda() {
        return rope_qk_cache_with(q, k, v, table, caches, 0, Some(pos));
    }
    let p = pos.flatten_all()?.to_vec1::<u32>()?[0] as usize;
    rope_qk_cache(q, k, v, &table.narrow(0, p, q.dim(1)?)?, caches, p)
}

/// A device position's checks: one u32 on `like`'s device.
fn check_position(op: &str, pos: &Tensor, like: &Tensor) -> Result<()> {
    if pos.dtype() != DType::U32
        || pos.elem_count() != 1
        || !pos.device().same_device(like.device())
    {
        candle_core::bail!(
            "{op}: a position has to be one u32 on {:?}, not {:?} {:?} on {:?}",
            like.device(),
            pos.dtype(),
            pos.dims(),
            pos.device()
        );
    }
    Ok(())
}

/// [`rope_qk_cache`], or with `pos_dev` [`rope_qk_cache_at`] on a GPU.
fn rope_qk_cache_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    (k_cache, v_cache): (&Tensor, &Tensor),
    pos: usize,
    pos_dev: Option<&Tensor>,
) -> Result<Tensor> {
    check_dtypes(RopeQk::NAME, &[q, k, v, table, k_cache, v_cache])?;
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
        return rope_qk_cache_launch([q, k, v, table, k_cache, v_cache], pos, pos_dev);
    }
    if pos_dev.is_some() {
        candle_core::bail!("{}: a device position off the GPU", RopeQk::NAME);
    }
    let (q, k) = rope_qk(q, k, table)?;
    k_cache.slice_set(&k, 2, pos)?;
    v_cache.slice_set(&v.transpose(1, 2)?.contiguous()?, 2, pos)?;
    Ok(q)
}

/// A tensor's storage guard as the CUDA storage a launcher takes, or an error naming `op`.
#[cfg(feature = "cuda")]
fn on_gpu<'a, G: std::ops::Deref<Target = candle_core::Storage>>(
    op: &str,
    (s, l): &'a (G, &'a Layout),
) -> Result<(&'a candle_core::CudaStorage, &'a Layout)> {
    match &**s {
        candle_core::Storage::Cuda(s) => Ok((s, *l)),
        _ => candle_core::bail!("{op}: every operand has to be on the GPU"),
    }
}

/// [`rope_qk_cache`]'s kernel, for its operands `[q, k, v, table, k_cache, v_cache]` as it
/// checked them.
#[cfg(feature = "cuda")]
fn rope_qk_cache_launch(
    [q, k, v, table, k_cache, v_cache]: [&Tensor; 6],
    pos: usize,
    pos_dev: Option<&Tensor>,
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
        .map(|g| on_gpu(RopeQk::NAME, g))
        .transpose()?;
    let out = {
        let guards = [&q, &k, &v, &table, k_cache, v_cache].map(|t| t.storage_and_layout());
        let cuda = guards
            .iter()
            .map(|g| on_gpu(RopeQk::NAME, g))
            .collect::<Result<Vec<_>>>()?;
        crate::sys::kernels::rope_qk_cache(
            dims, cuda[0], cuda[1], cuda[2], cuda[3], cuda[4], cuda[5], pos, pos_dev,
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

// ---------------------------------------------------------------------------------------------
// Decode attention over a KV cache

/// The largest head_dim [`decode_attention`]'s CUDA kernel handles (8 values per lane).
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;

/// The most keys one `decode_attention` block scores (DA_CHUNK in kernels/ops.cu).
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

#[derive(Debug, Clone, Copy)]
struct DecodeAttention {
    scale: f32,
    /// 0: no sliding window.
    window: u32,
}

impl DecodeAttention {
    const NAME: &'static str = "decode-attention";
}

/// The sizes [`decode_attention`]'s kernel works with.
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
    fn of(q: &Layout, k: &Layout, v: &Layout) -> Result<Self> {
        Self::of_op(DecodeAttention::NAME, q, k, v)
    }

    /// [`of`](Self::of) for the op named `op` in the error.
    fn of_op(op: &str, q: &Layout, k: &Layout, v: &Layout) -> Result<Self> {
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
        crate::sys::spin::threads().min(rows).max(1)
    } else {
        1
    };
    let rows_per_task = rows.div_ceil(tasks);
    crate::sys::spin::for_each_chunk_mut(&mut out, rows_per_task * d, |task, chunk| {
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
            for (j, &sc) in (lo..=pos).zip(scores.iter()) {
                let p = (sc - max).exp();
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
        let pos = pos.as_ref().map(|g| on_gpu(self.name(), g)).transpose()?;
        let pads = pads.as_ref().map(|g| on_gpu(self.name(), g)).transpose()?;
        let (out, xq) = crate::sys::kernels::decode_attention(
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
/// projection reads, for a projection of GGML blocks under variant 4 ([`QlinearVariant::V4`]):
/// on a GPU, for at most 8 rows and a head dim that is a multiple of 32, the kernel also writes
/// those rows quantized, and [`qlinear_small`] given this very tensor (by its id, as after
/// [`rms_norm_residual_q8`]) reads them instead of quantizing them in a launch of its own. The
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
        prequantized::remember(&y, xq, rows, dims.hq * dims.d);
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

/// Whether [`prompt_attention`] runs its kernel for inputs of `dtype` with head width `d` on
/// `device`: [`KernelTuning::prompt_attention`], a GPU of a build with CUDA, F16 or BF16, and a width the
/// flash-attention kernels exist for ([`crate::train::attention::FLASH_GPU_HEAD_DIMS`]);
/// elsewhere it computes the composition.
pub fn prompt_attention_supported(
    device: &candle_core::Device,
    dtype: DType,
    d: usize,
    tuning: &KernelTuning,
) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && tuning.prompt_attention
        && matches!(dtype, DType::F16 | DType::BF16)
        && crate::train::attention::FLASH_GPU_HEAD_DIMS.contains(&d)
}

/// A prompt pass's attention as one kernel.
#[derive(Debug)]
struct PromptAttention {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    scale: f32,
}

impl PromptAttention {
    const NAME: &'static str = "prompt-attention";
}

impl candle_core::CustomOp3 for PromptAttention {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        // prompt_attention computes the composition on the CPU instead.
        candle_core::bail!("{}: no CPU kernel", Self::NAME)
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
        let dims = AttentionDims::of_op(Self::NAME, l1, l2, l3)?;
        let out = crate::sys::train_kernels::prompt_attn_fwd(
            [dims.b, dims.hq, dims.hk, dims.tq, dims.d],
            dims.kv_len,
            self.scale,
            (s1, l1),
            (s2, l2),
            (s3, l3),
        )?;
        Ok((out, Shape::from((dims.b, dims.hq, dims.tq, dims.d))))
    }
}

/// Causal attention of a prompt's pass, `q` (batch, q_heads, new, head_dim), over the first
/// positions of a KV cache `k`, `v` (batch, kv_heads, cached, head_dim), the new positions
/// being the last `new` of the `cached` ones: what [`decode_attention`] computes, for passes
/// of many rows. Returns (batch, new, q_heads, head_dim).
///
/// Where [`prompt_attention_supported`], one FlashAttention-2 kernel (the training forward of
/// [`crate::train::flash_attention`], on tensor cores, F32 scores and sums, the probabilities
/// rounded to the inputs' dtype for their product with v) reads k and v from the cache's
/// strided views: no F32 copies of q, k and v, no (new, cached) score matrix, no mask or
/// softmax launches. `k` and `v` must then be views of a cache's buffers (rows contiguous,
/// heads evenly apart, as [`crate::ops::rope_qk_cache`] writes them). Elsewhere it computes
/// [`decode_attention_unfused`] (no window), the composition it replaces.
pub fn prompt_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    let op = PromptAttention::NAME;
    let dtype = check_dtypes(op, &[q, k, v])?;
    let dims = AttentionDims::of_op(op, q.layout(), k.layout(), v.layout())?;
    if dims.out_len() == 0 || !prompt_attention_supported(q.device(), dtype, dims.d, tuning) {
        return decode_attention_unfused(q, k, v, scale, None);
    }
    let op = PromptAttention {
        scale: scale as f32,
    };
    // `contiguous` copies q only where it is not (the kernel reads it row-major).
    q.contiguous()?.apply_op3_no_bwd(k, v, &op)?.transpose(1, 2)
}

// ---------------------------------------------------------------------------------------------
// Linear layers over few rows

/// The most rows [`linear_small`]'s CUDA kernel takes.
pub(crate) const LINEAR_SMALL_MAX_ROWS: usize = 8;

#[derive(Debug, Clone, Copy)]
struct LinearSmall;

impl LinearSmall {
    const NAME: &'static str = "linear-small";
}

fn linear_small_cpu<T: WithDType>(
    x: &[T],
    w: &[T],
    (xl, wl): (&Layout, &Layout),
) -> Result<Vec<T>> {
    let (x, w) = (
        contiguous(x, xl, LinearSmall::NAME)?,
        contiguous(w, wl, LinearSmall::NAME)?,
    );
    let (_, k) = xl.shape().dims2()?;
    let mut out = Vec::with_capacity(x.len() / k.max(1) * w.len() / k.max(1));
    for xr in x.chunks(k) {
        for wr in w.chunks(k) {
            out.push(of_f32(
                xr.iter()
                    .zip(wr)
                    .map(|(&a, &b)| f32_of(a) * f32_of(b))
                    .sum(),
            ));
        }
    }
    Ok(out)
}

impl candle_core::CustomOp2 for LinearSmall {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = cpu_dispatch2!(Self::NAME, s1, s2, linear_small_cpu, (l1, l2));
        Ok((out, Shape::from((l1.dims()[0], l2.dims()[0]))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::sys::kernels::linear_small((s1, l1), &[(s2, l2)], false)?;
        Ok((out, Shape::from((l1.dims()[0], l2.dims()[0]))))
    }
}

/// `x · wᵀ` for a weight `w` (out, in) and an `x` (…, in) of at most 8 rows in all (a decode
/// step): one pass over the weight that multiplies it by every row, F32 accumulation. On a GPU
/// this replaces cuBLAS's split-K GEMM and its reduction kernel (two launches, and a split-K
/// schedule that leaves bandwidth unused at one row) by one bandwidth-bound kernel. Falls back
/// to the composition ([`linear_small_unfused`]) for more rows, an `in` that is not a multiple
/// of 8 or a weight not 16-byte aligned.
pub fn linear_small(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    check_dtypes(LinearSmall::NAME, &[x, w])?;
    let (n, k) = w.dims2()?;
    if x.dim(D::Minus1)? != k {
        candle_core::bail!(
            "{}: x {:?} does not match the weight {:?}",
            LinearSmall::NAME,
            x.shape(),
            w.shape()
        );
    }
    let rows = x.elem_count() / k.max(1);
    let w = w.contiguous()?;
    if rows == 0
        || rows > LINEAR_SMALL_MAX_ROWS
        || !k.is_multiple_of(8)
        || !aligned16(w.layout(), w.dtype())
    {
        return linear_small_unfused(x, &w);
    }
    let mut out_dims = x.dims().to_vec();
    *out_dims.last_mut().expect("x has a last dim") = n;
    // An x that is strided or starts unaligned is copied (≤ 8 rows) to a fresh buffer.
    let x2 = x.reshape((rows, k))?;
    let x2 = if aligned16(x2.layout(), x2.dtype()) && x2.is_contiguous() {
        x2
    } else {
        x2.force_contiguous()?
    };
    x2.apply_op2_no_bwd(&w, &LinearSmall)?.reshape(out_dims)
}

/// Whether [`linear_small_multi`] / [`linear_silu_mul`] can run their one CUDA launch on
/// `x` and `ws`: a GPU, ≤ 8 rows, a width that is a multiple of 8, contiguous weights of x's
/// dtype starting 16-byte aligned.
fn multi_fits(x: &Tensor, ws: &[&Tensor]) -> Result<bool> {
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k.max(1);
    let aligned = |t: &Tensor| t.is_contiguous() && aligned16(t.layout(), t.dtype());
    Ok(x.device().is_cuda()
        && rows > 0
        && rows <= LINEAR_SMALL_MAX_ROWS
        && k.is_multiple_of(8)
        && ws
            .iter()
            .all(|w| w.dtype() == x.dtype() && w.dims().get(1) == Some(&k) && aligned(w)))
}

/// Runs the multi-weight CUDA kernel (see `sys::kernels::linear_small`) on x (rows, k),
/// returning its one output buffer as a flat tensor. Candle's custom ops take at most three
/// tensors, so this reads the storages directly (read locks, as `apply_op3` takes them) and
/// wraps the result as a tensor without a gradient.
#[cfg(feature = "cuda")]
fn linear_small_launch(x: &Tensor, ws: &[&Tensor], silu: bool) -> Result<Tensor> {
    use candle_core::Storage;
    let x = x.force_contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let guards: Vec<_> = ws.iter().map(|w| w.storage_and_layout()).collect();
    let Storage::Cuda(xs) = &*xs else {
        candle_core::bail!("{}: x is not on a GPU", LinearSmall::NAME)
    };
    let mut cw = Vec::with_capacity(ws.len());
    for (g, l) in &guards {
        let Storage::Cuda(s) = &**g else {
            candle_core::bail!("{}: a weight is not on the GPU", LinearSmall::NAME)
        };
        cw.push((s, *l));
    }
    let rows = xl.dims()[0];
    let cols: usize = if silu {
        ws[0].dim(0)?
    } else {
        ws.iter().map(|w| w.dim(0)).sum::<Result<usize>>()?
    };
    let out = crate::sys::kernels::linear_small((xs, xl), &cw, silu)?;
    let n = rows * cols;
    Ok(Tensor::from_storage(
        Storage::Cuda(out),
        n,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

#[cfg(not(feature = "cuda"))]
fn linear_small_launch(_x: &Tensor, _ws: &[&Tensor], _silu: bool) -> Result<Tensor> {
    candle_core::bail!(
        "{}: needs a build with `--features cuda`",
        LinearSmall::NAME
    )
}

/// `x · wᵢᵀ` for two or three weights (out_i, in) that read the same `x` (q, k and v; gate and
/// up): on a GPU, for at most 8 rows, one launch that writes each result contiguous; otherwise
/// one [`linear_small`] per weight.
pub fn linear_small_multi(x: &Tensor, ws: &[&Tensor]) -> Result<Vec<Tensor>> {
    if ws.is_empty() || ws.len() > 3 {
        candle_core::bail!("{}: 1 to 3 weights, not {}", LinearSmall::NAME, ws.len());
    }
    let mut refs = vec![x];
    refs.extend_from_slice(ws);
    check_dtypes(LinearSmall::NAME, &refs)?;
    if !multi_fits(x, ws)? {
        return ws.iter().map(|w| linear_small(x, w)).collect();
    }
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k;
    let flat = linear_small_launch(&x.reshape((rows, k))?, ws, false)?;
    let ns = ws.iter().map(|w| w.dim(0)).collect::<Result<Vec<_>>>()?;
    split_multi(x, &flat, &ns)
}

/// The results of a multi-weight launch: `flat` holds x's rows times each weight's `n`
/// columns, one weight after another; each comes back shaped as x with its last dim `n`.
fn split_multi(x: &Tensor, flat: &Tensor, ns: &[usize]) -> Result<Vec<Tensor>> {
    let rows = x.elem_count() / x.dim(D::Minus1)?;
    let mut out = Vec::with_capacity(ns.len());
    let mut at = 0;
    for &n in ns {
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("x has a last dim") = n;
        out.push(flat.narrow(0, at, rows * n)?.reshape(dims)?);
        at += rows * n;
    }
    Ok(out)
}

/// `silu(x · gateᵀ) · (x · upᵀ)` (a SwiGLU MLP before its down projection): on a GPU, for at
/// most 8 rows, one launch that reads both weights once; otherwise [`linear_small`] twice and
/// [`silu_mul`].
pub fn linear_silu_mul(x: &Tensor, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_dtypes(LinearSmall::NAME, &[x, gate, up])?;
    if gate.shape() != up.shape() {
        candle_core::bail!(
            "{}: gate {:?} and up {:?} differ in shape",
            LinearSmall::NAME,
            gate.shape(),
            up.shape()
        );
    }
    if !multi_fits(x, &[gate, up])? {
        return silu_mul(&linear_small(x, gate)?, &linear_small(x, up)?);
    }
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k;
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("x has a last dim") = gate.dim(0)?;
    linear_small_launch(&x.reshape((rows, k))?, &[gate, up], true)?.reshape(dims)
}

/// The composition [`linear_small`] replaces: `candle_nn::Linear`'s broadcast matmul.
pub fn linear_small_unfused(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.broadcast_matmul(&w.t()?)
}

// ---------------------------------------------------------------------------------------------
// Linear layers over few rows, with weights of GGML blocks

/// The kernel name part of the GGML block types [`qlinear_small`] has a CUDA kernel for: blocks
/// of 32 elements, and Q4_K's and Q6_K's super-blocks of 256 (their own kernel,
/// [`KernelTuning::qlinear_k`]).
pub(crate) fn qlinear_small_type(t: GgmlDType) -> Option<&'static str> {
    Some(match t {
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q4K => "q4_k",
        GgmlDType::Q6K => "q6_k",
        _ => return None,
    })
}

/// Whether `t` is a K-quant type with a kernel of its own (`qlinear_k_small` in kernels/ops.cu,
/// not one of the [`QlinearVariant`]s).
pub(crate) fn is_qlinear_k_type(t: GgmlDType) -> bool {
    matches!(t, GgmlDType::Q4K | GgmlDType::Q6K)
}

const QLINEAR_SMALL: &str = "qlinear-small";

pub use crate::tuning::{KernelTuning, QlinearVariant};
/// Whether the GGML-block kernel takes `x` and `ws`: x (F32, F16 or BF16) and the weights on
/// a GPU, at most 8 rows, one block type the kernel has (Q4_K and Q6_K only when
/// [`KernelTuning::qlinear_k`] is on), every weight (n, k) with k = x's width, a multiple of the type's block (32 elements,
/// 256 for the K-quants).
pub fn qlinear_small_fits(x: &Tensor, ws: &[&QTensor], tuning: &KernelTuning) -> Result<bool> {
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k.max(1);
    let Some(first) = ws.first() else {
        return Ok(false);
    };
    Ok(x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && rows > 0
        && rows <= LINEAR_SMALL_MAX_ROWS
        && k.is_multiple_of(first.dtype().block_size())
        && qlinear_small_type(first.dtype()).is_some()
        && (!is_qlinear_k_type(first.dtype()) || tuning.qlinear_k)
        && ws.iter().all(|w| {
            w.dtype() == first.dtype()
                && w.device().is_cuda()
                && w.shape().dims().len() == 2
                && w.shape().dims()[1] == k
        }))
}

/// Runs the GGML-block CUDA kernel on x (rows, k): its one output buffer as a flat tensor
/// without a gradient (see [`linear_small_launch`]).
#[cfg(feature = "cuda")]
fn qlinear_small_launch(
    x: &Tensor,
    ws: &[&QTensor],
    silu: bool,
    pre: Option<Tensor>,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    Ok(qlinear_small_launch_q8(x, ws, silu, pre, false, tuning)?.0)
}

/// [`qlinear_small_launch`], with `q8_out` also the output quantized for variant 4
/// (`sys::kernels::qlinear_small`'s conditions).
#[cfg(feature = "cuda")]
fn qlinear_small_launch_q8(
    x: &Tensor,
    ws: &[&QTensor],
    silu: bool,
    pre: Option<Tensor>,
    q8_out: bool,
    tuning: &KernelTuning,
) -> Result<(Tensor, Option<candle_core::CudaStorage>)> {
    use candle_core::Storage;
    let rows = x.dim(0)?;
    let x = if aligned16(x.layout(), x.dtype()) && x.is_contiguous() {
        x.clone()
    } else {
        x.force_contiguous()?
    };
    let cols: usize = if silu {
        ws[0].shape().dims()[0]
    } else {
        ws.iter().map(|w| w.shape().dims()[0]).sum()
    };
    let out = {
        let (xs, xl) = x.storage_and_layout();
        let Storage::Cuda(xs) = &*xs else {
            candle_core::bail!("{QLINEAR_SMALL}: x is not on a GPU")
        };
        let pre = pre.as_ref().map(|p| p.storage_and_layout());
        let pre = match pre.as_ref().map(|(s, _)| &**s) {
            Some(Storage::Cuda(p)) => Some(p),
            _ => None,
        };
        crate::sys::kernels::qlinear_small((xs, xl), ws, silu, pre, q8_out, tuning)?
    };
    let (out, yq) = out;
    Ok((
        Tensor::from_storage(
            Storage::Cuda(out),
            rows * cols,
            candle_core::op::BackpropOp::none(),
            false,
        ),
        yq,
    ))
}

#[cfg(not(feature = "cuda"))]
fn qlinear_small_launch(
    _x: &Tensor,
    _ws: &[&QTensor],
    _silu: bool,
    _pre: Option<Tensor>,
    _tuning: &KernelTuning,
) -> Result<Tensor> {
    candle_core::bail!("{QLINEAR_SMALL}: needs a build with `--features cuda`")
}

/// How many times, on this thread, a GGML-block matmul found its x quantized by the op that
/// made it ([`rms_norm_residual_q8`], [`decode_attention_q8`], [`qlinear_silu_mul_q8`]); 0
/// without CUDA. For tests and diagnostics.
pub fn quantized_rows_found() -> u64 {
    #[cfg(feature = "cuda")]
    return prequantized::FOUND.with(|f| f.get());
    #[cfg(not(feature = "cuda"))]
    0
}

/// The rows of `x` quantized by the op that made it ([`rms_norm_residual_q8`] and the like), if
/// it did.
fn prequantized_of(_x: &Tensor) -> Option<Tensor> {
    #[cfg(feature = "cuda")]
    return prequantized::of(_x);
    #[cfg(not(feature = "cuda"))]
    None
}

/// `x · wᵀ` for a weight of GGML blocks (out, in) and an `x` (…, in): on a GPU, for at most 8
/// rows and a block type the kernels have ([`qlinear_small_fits`]: blocks of 32 elements, and
/// Q4_K / Q6_K when [`KernelTuning::qlinear_k`] is on), one pass over the blocks that
/// dequantizes them in registers and multiplies them by every row in F32; otherwise the
/// composition ([`qlinear_small_unfused`]). The result has x's dtype.
pub fn qlinear_small(x: &Tensor, w: &QTensor, tuning: &KernelTuning) -> Result<Tensor> {
    Ok(qlinear_small_multi(x, &[w], tuning)?.remove(0))
}

/// [`qlinear_small`] for two or three weights that read the same `x` (q, k and v), in one
/// launch on a GPU, each result contiguous.
pub fn qlinear_small_multi(
    x: &Tensor,
    ws: &[&QTensor],
    tuning: &KernelTuning,
) -> Result<Vec<Tensor>> {
    if ws.is_empty() || ws.len() > 3 {
        candle_core::bail!("{QLINEAR_SMALL}: 1 to 3 weights, not {}", ws.len());
    }
    check_dtypes(QLINEAR_SMALL, &[x])?;
    if !qlinear_small_fits(x, ws, tuning)? {
        return ws.iter().map(|w| qlinear_small_unfused(x, w)).collect();
    }
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k;
    let flat = qlinear_small_launch(
        &x.reshape((rows, k))?,
        ws,
        false,
        prequantized_of(x),
        tuning,
    )?;
    let ns: Vec<usize> = ws.iter().map(|w| w.shape().dims()[0]).collect();
    split_multi(x, &flat, &ns)
}

/// `silu(x · gateᵀ) · (x · upᵀ)` for weights of GGML blocks: one launch on a GPU
/// ([`qlinear_small_fits`]); otherwise [`qlinear_small_unfused`] twice and [`silu_mul`].
pub fn qlinear_silu_mul(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    qlinear_silu_mul_with(x, gate, up, false, tuning)
}

/// [`qlinear_silu_mul`] for an output that goes next into a GGML-block matmul of variant 4 (the
/// down projection): on a GPU, where gate and up run variant 4's kernel for blocks of 32 and
/// their width is a multiple of 32, the kernel also writes its output quantized, and
/// [`qlinear_small`] given this very tensor (by its id, as after [`rms_norm_residual_q8`]) reads
/// it instead of quantizing it in a launch of its own. The values equal
/// [`qlinear_silu_mul`]'s, and the next matmul's, bit for bit.
pub fn qlinear_silu_mul_q8(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    qlinear_silu_mul_with(x, gate, up, true, tuning)
}

fn qlinear_silu_mul_with(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    q8: bool,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    check_dtypes(QLINEAR_SMALL, &[x])?;
    if gate.shape() != up.shape() {
        candle_core::bail!(
            "{QLINEAR_SMALL}: gate {:?} and up {:?} differ in shape",
            gate.shape(),
            up.shape()
        );
    }
    if !qlinear_small_fits(x, &[gate, up], tuning)? {
        return silu_mul(
            &qlinear_small_unfused(x, gate)?,
            &qlinear_small_unfused(x, up)?,
        );
    }
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k;
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("x has a last dim") = gate.shape().dims()[0];
    #[cfg(feature = "cuda")]
    {
        let n = gate.shape().dims()[0];
        if q8
            && tuning.qlinear_variant(gate.dtype()) == QlinearVariant::V4
            && !is_qlinear_k_type(gate.dtype())
            && n.is_multiple_of(32)
        {
            let (y, yq) = qlinear_small_launch_q8(
                &x.reshape((rows, k))?,
                &[gate, up],
                true,
                prequantized_of(x),
                true,
                tuning,
            )?;
            let y = y.reshape(dims)?;
            if let Some(yq) = yq {
                prequantized::remember(&y, yq, rows, n);
            }
            return Ok(y);
        }
    }
    let _ = q8;
    qlinear_small_launch(
        &x.reshape((rows, k))?,
        &[gate, up],
        true,
        prequantized_of(x),
        tuning,
    )?
    .reshape(dims)
}

pub use crate::tuning::PREFILL_GEMM_MIN_ROWS;
/// The most bytes of F16 weight [`qlinear_prefill`] dequantizes at once: a larger weight goes
/// in slices of whole rows, each multiplied before the next is written, so that a prompt's
/// workspace grows by at most this much ([`prefill_gemm_bytes`]).
pub const PREFILL_GEMM_SLICE_BYTES: usize = 32 << 20;

/// The device bytes [`qlinear_prefill`] holds at once beside x and its output, for `rows` rows
/// of x against a weight of `n` output columns and width `k`: one 16-bit slice of the weight, x
/// in 16 bits and the 16-bit output (each slice's product goes straight into its columns).
/// Zero where it would not run (off, or fewer than [`KernelTuning::prefill_gemm_min_rows`]
/// rows).
pub fn prefill_gemm_bytes(rows: usize, n: usize, k: usize, tuning: &KernelTuning) -> u64 {
    if !tuning.prefill_gemm || rows < tuning.prefill_gemm_min_rows {
        return 0;
    }
    let slice_rows = prefill_slice_rows(n, k);
    (2 * (slice_rows * k + rows * k + rows * n)) as u64
}

/// Weight rows per slice of [`qlinear_prefill`]: as many as fit [`PREFILL_GEMM_SLICE_BYTES`] in
/// F16, a multiple of 64, at least 64, at most `n`.
fn prefill_slice_rows(n: usize, k: usize) -> usize {
    let fit = (PREFILL_GEMM_SLICE_BYTES / (2 * k.max(1))) / 64 * 64;
    fit.max(64).min(n)
}

/// `x · wᵀ` for a prompt's rows on a GPU: w's blocks dequantized a slice of rows at a time and
/// multiplied by x through cuBLAS (F32 accumulation), returned in x's dtype. Both in F16 for F16
/// x; in BF16 for BF16 and F32 x, whose values may exceed F16's range (a model run in F32 for
/// that reason keeps it).
/// `None` where it does not apply: off ([`KernelTuning::prefill_gemm`]), not on a CUDA device,
/// fewer rows than [`KernelTuning::prefill_gemm_min_rows`], or a block type without the dequantizing kernel (Candle's
/// quantized matmul keeps those).
///
/// Candle's quantized matmul quantizes x to 8 bits and runs integer tiles (MMQ). For a long
/// prompt the F16 GEMM on tensor cores is faster, even with the weight written out in F16
/// first, and x keeps its precision (measured: docs/tuning.md, the prompt GEMM).
pub fn qlinear_prefill(x: &Tensor, w: &QTensor, tuning: &KernelTuning) -> Result<Option<Tensor>> {
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k.max(1);
    let applies = tuning.prefill_gemm
        && x.device().is_cuda()
        && rows >= tuning.prefill_gemm_min_rows
        && qlinear_small_type(w.dtype()).is_some()
        && w.shape().rank() == 2;
    if !applies {
        return Ok(None);
    }
    let (n, wk) = w.shape().dims2()?;
    if wk != k {
        candle_core::bail!("qlinear_prefill: x is {k} wide, the weight {wk}");
    }
    let _span = tracing::trace_span!("qlinear_prefill", rows, n, k).entered();
    let dtype = if x.dtype() == DType::F16 {
        DType::F16
    } else {
        DType::BF16
    };
    let xg = x.reshape((rows, k))?.to_dtype(dtype)?.contiguous()?;
    let y = prefill_gemm_run(&xg, w, prefill_slice_rows(n, k))?;
    let mut out = x.dims().to_vec();
    *out.last_mut().expect("x has a last dim") = n;
    Ok(Some(y.to_dtype(x.dtype())?.reshape(out)?))
}

/// x (rows × k, F16 or BF16, contiguous) times wᵀ through `slice_rows` dequantized rows at a
/// time ([`crate::sys::kernels::qlinear_prefill_gemm`]).
#[cfg(feature = "cuda")]
fn prefill_gemm_run(x: &Tensor, w: &QTensor, slice_rows: usize) -> Result<Tensor> {
    let (storage, layout) = x.storage_and_layout();
    let candle_core::Storage::Cuda(xs) = &*storage else {
        candle_core::bail!("qlinear_prefill: x is not on a GPU");
    };
    let y = crate::sys::kernels::qlinear_prefill_gemm(xs, layout, w, slice_rows)?;
    let n = w.shape().dims2()?.0;
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(y),
        (layout.shape().dims2()?.0, n),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

#[cfg(not(feature = "cuda"))]
fn prefill_gemm_run(_x: &Tensor, _w: &QTensor, _slice_rows: usize) -> Result<Tensor> {
    candle_core::bail!("qlinear_prefill: needs a build with `--features cuda`")
}

/// Rows `r0 .. r0 + rows` of `w` as a `dtype` (F16 or BF16) tensor (rows, k), on w's GPU: what
/// [`qlinear_prefill`] multiplies, a slice at a time. GGML's values (scale times quant, less the
/// min, in F32, rounded once). Errors for a weight not on a GPU, a block type without the
/// kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K have it), rows past the weight's, a
/// dtype other than F16 and BF16, or a build without CUDA.
#[cfg(feature = "cuda")]
pub fn dequantize_rows(w: &QTensor, r0: usize, rows: usize, dtype: DType) -> Result<Tensor> {
    let k = w.shape().dims2()?.1;
    let s = crate::sys::kernels::dequantize_rows(w, r0, rows, dtype)?;
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(s),
        (rows, k),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// Rows `r0 .. r0 + rows` of `w` as a `dtype` tensor on w's GPU; this build has no CUDA, so it
/// errors.
#[cfg(not(feature = "cuda"))]
pub fn dequantize_rows(_w: &QTensor, _r0: usize, _rows: usize, _dtype: DType) -> Result<Tensor> {
    candle_core::bail!("dequantize_rows: needs a build with `--features cuda`")
}

/// The composition [`qlinear_small`] replaces: Candle's quantized matmul (`QMatMul`'s) on x
/// in F32, cast back to x's dtype. Candle's CPU dot products of some types take blocks in
/// pairs and panic on an odd count per row; those rows are dequantized and multiplied densely.
pub fn qlinear_small_unfused(x: &Tensor, w: &QTensor) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let k = x.dim(D::Minus1)?;
    let odd_blocks = (k / w.dtype().block_size()) % 2 == 1;
    let y = if w.device().is_cpu() && odd_blocks {
        x32.broadcast_matmul(&w.dequantize(&w.device())?.t()?)?
    } else {
        x32.apply_op1_no_bwd(w)?
    };
    y.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_slices_bound_the_workspace() {
        for k in [32, 256, 4096, 5120, 11008, 13824, 100_000, 1 << 20] {
            for n in [1, 37, 64, 300, 4096, 4200, 11008, 32000] {
                let r = prefill_slice_rows(n, k);
                let at = format!("n {n} k {k}: {r} rows a slice");
                assert!(r >= 1 && r <= n, "{at}");
                assert!(r == n || r.is_multiple_of(64), "{at}");
                // A slice fits the bound unless even 64 rows do not.
                if 2 * 64 * k <= PREFILL_GEMM_SLICE_BYTES {
                    assert!(2 * r * k <= PREFILL_GEMM_SLICE_BYTES, "{at}");
                }
                // The workspace counted covers the slice, x and the output, from the fewest
                // rows the GEMM takes.
                let t = KernelTuning::default();
                for rows in [PREFILL_GEMM_MIN_ROWS, 512] {
                    let bytes = prefill_gemm_bytes(rows, n, k, &t);
                    assert!(bytes >= (2 * (r * k + rows * k + rows * n)) as u64, "{at}");
                }
                assert_eq!(prefill_gemm_bytes(PREFILL_GEMM_MIN_ROWS - 1, n, k, &t), 0);
                let off = KernelTuning {
                    prefill_gemm: false,
                    ..t
                };
                assert_eq!(prefill_gemm_bytes(512, n, k, &off), 0);
            }
        }
    }

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
