//! Fused decode ops as Candle custom ops, usable from any candle-nn code: each replaces a short
//! chain of Candle ops (and their kernel launches) by one pass over the data.
//!
//! - [`rms_norm_residual`]: the pre-norm residual step, `sum = x + residual` and
//!   `rmsnorm(sum) · weight`, in one kernel.
//! - [`silu_mul`]: `silu(gate) · up` (the SwiGLU MLP's elementwise part).
//! - [`rope_qk`]: half-rotated RoPE of q and k in one launch, read in the projections'
//!   (batch, seq, heads, head_dim) layout and written as (batch, heads, seq, head_dim), so the
//!   transposes and copies before Candle's `rope` go too.
//!
//! On a CUDA device they run the project's own kernels (`kernels/ops.cu`, compiled to PTX at
//! build time); on the CPU a direct loop computes the same thing. The `*_unfused` functions are
//! the Candle compositions each op is checked against. All take F32, F16 or BF16 (one dtype for
//! every input), accumulate in F32, accept any last-dim size, and make non-contiguous inputs
//! contiguous. They are for inference: no gradient flows through them.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType, D};

/// Refuses dtypes the kernels do not exist for, and mixed dtypes.
fn check_dtypes(op: &str, ts: &[&Tensor]) -> Result<DType> {
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
fn contiguous<'a, T>(s: &'a [T], l: &Layout, op: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("{op}: input has to be contiguous"),
    }
}

fn f32_of<T: WithDType>(v: T) -> f32 {
    v.to_f64() as f32
}

fn of_f32<T: WithDType>(v: f32) -> T {
    T::from_f64(v as f64)
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

#[derive(Debug, Clone, Copy)]
struct RmsNormResidual {
    eps: f32,
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
        let out = crate::sys::kernels::rms_norm_residual(self.eps, (s1, l1), (s2, l2), (s3, l3))?;
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
        return rms_norm_residual_unfused(x, residual, weight, eps);
    }
    let out = x.contiguous()?.apply_op3_no_bwd(
        &residual.contiguous()?,
        &weight.contiguous()?,
        &RmsNormResidual { eps: eps as f32 },
    )?;
    Ok((out.get(0)?, out.get(1)?))
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
        let ls = (l1, l2);
        let out = match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => CpuStorage::F32(silu_mul_cpu(a, b, ls)?),
            (CpuStorage::F16(a), CpuStorage::F16(b)) => CpuStorage::F16(silu_mul_cpu(a, b, ls)?),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => CpuStorage::BF16(silu_mul_cpu(a, b, ls)?),
            (a, _) => candle_core::bail!("{}: unsupported dtype {:?}", Self::NAME, a.dtype()),
        };
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
