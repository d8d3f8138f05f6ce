//! Causal self-attention as one Candle custom op with its own backward (FlashAttention-2).
//!
//! [`flash_attention`] computes `softmax(q kᵀ · scale + causal mask) v` for q (b, h, t, d) and
//! k, v (b, hkv, t, d) with `h % hkv == 0` (GQA, MQA: query head `i` reads kv head
//! `i / (h / hkv)`), without repeating k and v and without a (t, t) score matrix: the scores,
//! softmax and sums are F32 whatever the inputs' dtype, and the output is in q's dtype.
//!
//! The forward pass also computes each query row's log-sum-exp `L` (F32, (b, h, t)); the op
//! instance, which Candle keeps in the graph for the backward pass, holds it in a
//! `Mutex<Option<Tensor>>` filled by the forward pass. The backward pass recomputes the
//! probabilities `P = exp(S·scale − L)` tile by tile from q, k and `L`, with
//! `D = rowsum(dO ∘ O)`, `dV = Pᵀ dO`, `dS = P ∘ (dP − D)` (`dP = dO Vᵀ`), `dK = scale · dSᵀ Q`
//! and `dQ = scale · dS K`; dK and dV are summed over the query heads of each kv head. Its
//! kernel gives the three gradients as one F32 buffer (dq, then dk, then dv), cast to q's
//! dtype.
//!
//! On the CPU direct loops compute it (F32, F16, BF16; one rayon task per head, per kv head
//! in the backward pass). On a GPU `kernels/flash.cu` and `kernels/flash_f32.cu` have FlashAttention-2 kernels with a head
//! width of 64 or 128: on tensor cores for F16 and BF16 (the forward on `mma.sync` or WMMA,
//! [`FlashForward`]; the backward on WMMA), and on the FP32 cores for F32 (SIMT FMA, no TF32,
//! one forward kernel whatever [`FlashForward`] says; [`FLASH_GPU_F32`] turns them off). Other
//! widths there take [`flash_attention_composite`], the Candle composition the op is checked
//! against.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor, D};
use rayon::prelude::*;

use crate::util::check_dtypes;

/// The op's sizes: batch, query heads, kv heads, sequence, head width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AttnDims {
    pub b: usize,
    pub h: usize,
    pub hkv: usize,
    pub t: usize,
    pub d: usize,
}

impl AttnDims {
    /// As the GPU launchers take them.
    #[cfg(feature = "cuda")]
    fn sizes(&self) -> [usize; 5] {
        [self.b, self.h, self.hkv, self.t, self.d]
    }

    fn q_len(&self) -> usize {
        self.b * self.h * self.t * self.d
    }

    fn kv_len(&self) -> usize {
        self.b * self.hkv * self.t * self.d
    }

    /// Query heads per kv head.
    fn rep(&self) -> usize {
        self.h / self.hkv
    }
}

/// Which GPU kernel computes the forward pass (one kernel computes the backward; the CPU has
/// one loop for each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlashForward {
    /// `mma.sync` m16n8k16 with every accumulator in registers (FlashAttention-2's layout),
    /// only the Q tile and double-buffered K and V tiles (`cp.async`) in shared memory: the
    /// default, the faster of the two (docs/tuning.md, prompt attention).
    #[default]
    Mma,
    /// WMMA 16x16x16 fragments, with S, P and the O accumulator staged in shared memory: the
    /// first version, kept as a second implementation to check the first against.
    Wmma,
}

/// Head widths the GPU kernels exist for.
pub const FLASH_GPU_HEAD_DIMS: [usize; 2] = [64, 128];

/// Whether F32 inputs take the GPU's F32 kernels (FP32 cores); `false` sends them to
/// [`flash_attention_composite`] there (the trainer then takes its composed attention).
pub const FLASH_GPU_F32: bool = true;

/// Whether [`flash_attention`] runs its own kernel for inputs of `dtype` with head width
/// `head_dim` on `device` (always on the CPU; F16, BF16 or, with [`FLASH_GPU_F32`], F32 with a
/// width in [`FLASH_GPU_HEAD_DIMS`] on a GPU); otherwise it computes
/// [`flash_attention_composite`].
pub fn flash_attention_supported(device: &Device, dtype: DType, head_dim: usize) -> bool {
    match device {
        Device::Cpu => true,
        Device::Cuda(_) => {
            cfg!(feature = "cuda")
                && match dtype {
                    DType::F16 | DType::BF16 => true,
                    DType::F32 => FLASH_GPU_F32,
                    _ => false,
                }
                && FLASH_GPU_HEAD_DIMS.contains(&head_dim)
        }
        _ => false,
    }
}

/// The forward op: O from q, k, v; the log-sum-exp kept for the backward pass.
struct FlashAttn {
    dims: AttnDims,
    scale: f32,
    /// The GPU forward kernel (the CPU has one loop).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    forward: FlashForward,
    /// Each query row's log-sum-exp (F32, (b, h, t)), filled by the forward pass.
    lse: Mutex<Option<Tensor>>,
}

impl FlashAttn {
    const NAME: &'static str = "flash-attention";
}

/// The contiguous part of a CPU float buffer as F32.
fn cpu_f32(s: &CpuStorage, l: &Layout, op: &str) -> Result<Vec<f32>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: input has to be contiguous")
    };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].to_vec(),
        CpuStorage::F16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        other => candle_core::bail!("{op}: unsupported dtype {:?}", other.dtype()),
    })
}

/// F32 values as a CPU buffer of `dtype`.
fn cpu_of(v: Vec<f32>, dtype: DType, op: &str) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::F16 => CpuStorage::F16(v.into_iter().map(half::f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        other => candle_core::bail!("{op}: unsupported dtype {other:?}"),
    })
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// q, k and v of a CPU op as F32 vectors, their lengths checked against `dims`.
fn cpu_qkv(
    op: &str,
    dims: &AttnDims,
    q: (&CpuStorage, &Layout),
    k: (&CpuStorage, &Layout),
    v: (&CpuStorage, &Layout),
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (q, k, v) = (
        cpu_f32(q.0, q.1, op)?,
        cpu_f32(k.0, k.1, op)?,
        cpu_f32(v.0, v.1, op)?,
    );
    check_lens(op, dims, q.len(), k.len(), v.len())?;
    Ok((q, k, v))
}

/// Checks that the three buffers have the lengths `dims` gives.
fn check_lens(op: &str, dims: &AttnDims, q: usize, k: usize, v: usize) -> Result<()> {
    if q != dims.q_len() || k != dims.kv_len() || v != dims.kv_len() {
        candle_core::bail!("{op}: buffers of {q}, {k} and {v} elements do not match {dims:?}");
    }
    Ok(())
}

/// The forward pass on F32 values: (O, L), one rayon task per head.
fn flash_fwd_cpu(
    dims: &AttnDims,
    scale: f32,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let AttnDims { h, t, d, .. } = *dims;
    let rep = dims.rep();
    let mut out = vec![0f32; q.len()];
    let mut lse = vec![0f32; dims.b * h * t];
    out.par_chunks_mut(t * d)
        .zip(lse.par_chunks_mut(t))
        .enumerate()
        .for_each(|(head, (out, lse))| {
            let (bi, hi) = (head / h, head % h);
            let kv = (bi * dims.hkv + hi / rep) * t * d;
            let q = &q[head * t * d..][..t * d];
            let mut s = vec![0f32; t];
            for i in 0..t {
                let qi = &q[i * d..][..d];
                let mut m = f32::NEG_INFINITY;
                for (j, sj) in s[..=i].iter_mut().enumerate() {
                    *sj = dot(qi, &k[kv + j * d..][..d]) * scale;
                    m = m.max(*sj);
                }
                let o = &mut out[i * d..][..d];
                let mut l = 0f32;
                for (j, sj) in s[..=i].iter().enumerate() {
                    let p = (sj - m).exp();
                    l += p;
                    for (oe, ve) in o.iter_mut().zip(&v[kv + j * d..][..d]) {
                        *oe += p * ve;
                    }
                }
                o.iter_mut().for_each(|x| *x /= l);
                lse[i] = m + l.ln();
            }
        });
    (out, lse)
}

/// The backward pass on F32 values: dq, dk, dv in one buffer. One rayon task per kv head: it
/// owns that head's dk and dv and the dq of its group's query heads.
fn flash_bwd_cpu(
    dims: &AttnDims,
    scale: f32,
    (q, k, v): (&[f32], &[f32], &[f32]),
    o: &[f32],
    g: &[f32],
    lse: &[f32],
) -> Vec<f32> {
    let AttnDims { h, hkv, t, d, .. } = *dims;
    let rep = dims.rep();
    let (nq, nkv) = (dims.q_len(), dims.kv_len());
    let mut all = vec![0f32; nq + 2 * nkv];
    let (dq, rest) = all.split_at_mut(nq);
    let (dk, dv) = rest.split_at_mut(nkv);
    dq.par_chunks_mut(rep * t * d)
        .zip(dk.par_chunks_mut(t * d))
        .zip(dv.par_chunks_mut(t * d))
        .enumerate()
        .for_each(|(kvh, ((dq, dk), dv))| {
            let (bi, gi) = (kvh / hkv, kvh % hkv);
            let (kh, vh) = (&k[kvh * t * d..][..t * d], &v[kvh * t * d..][..t * d]);
            for r in 0..rep {
                let head = bi * h + gi * rep + r;
                let dq = &mut dq[r * t * d..][..t * d];
                for i in 0..t {
                    let row = (head * t + i) * d;
                    let (qi, gi) = (&q[row..][..d], &g[row..][..d]);
                    let di = dot(gi, &o[row..][..d]);
                    let li = lse[head * t + i];
                    for j in 0..=i {
                        let kj = &kh[j * d..][..d];
                        let p = (dot(qi, kj) * scale - li).exp();
                        let dp = dot(gi, &vh[j * d..][..d]);
                        let ds = p * (dp - di) * scale;
                        for (x, y) in dv[j * d..][..d].iter_mut().zip(gi) {
                            *x += p * y;
                        }
                        for (x, y) in dk[j * d..][..d].iter_mut().zip(qi) {
                            *x += ds * y;
                        }
                        for (x, y) in dq[i * d..][..d].iter_mut().zip(kj) {
                            *x += ds * y;
                        }
                    }
                }
            }
        });
    all
}

impl candle_core::CustomOp3 for FlashAttn {
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
        let op = Self::NAME;
        let (q, k, v) = cpu_qkv(op, &self.dims, (s1, l1), (s2, l2), (s3, l3))?;
        let (out, lse) = flash_fwd_cpu(&self.dims, self.scale, &q, &k, &v);
        let AttnDims { b, h, t, .. } = self.dims;
        let lse = Tensor::from_vec(lse, (b, h, t), &Device::Cpu)?;
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok((cpu_of(out, s1.dtype(), op)?, l1.shape().clone()))
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
        let (out, lse) = crate::attention::flash_cuda::flash_attn_fwd(
            self.dims.sizes(),
            self.forward == FlashForward::Wmma,
            self.scale,
            (s1, l1),
            (s2, l2),
            (s3, l3),
        )?;
        let AttnDims { b, h, t, .. } = self.dims;
        let lse = Tensor::from_storage(
            Storage::Cuda(lse),
            (b, h, t),
            candle_core::op::BackpropOp::none(),
            false,
        );
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self
            .lse
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("{}: backward before forward", Self::NAME))
            })?;
        let dims = self.dims;
        let bwd = FlashAttnBwd {
            dims,
            scale: self.scale,
            out: aligned(res)?,
            dout: aligned(&grad.to_dtype(q.dtype())?.contiguous()?)?,
            lse,
        };
        let all = q.apply_op3_no_bwd(k, v, &bwd)?;
        let (nq, nkv) = (dims.q_len(), dims.kv_len());
        let AttnDims { b, h, hkv, t, d } = dims;
        let dq = all.narrow(0, 0, nq)?.reshape((b, h, t, d))?;
        let dk = all.narrow(0, nq, nkv)?.reshape((b, hkv, t, d))?;
        let dv = all.narrow(0, nq + nkv, nkv)?.reshape((b, hkv, t, d))?;
        let cast = |x: Tensor, like: &Tensor| x.to_dtype(like.dtype());
        Ok((Some(cast(dq, q)?), Some(cast(dk, k)?), Some(cast(dv, v)?)))
    }
}

/// The backward op over q, k, v (its inputs) and the forward's output, the output's gradient
/// and the log-sum-exp (held here): dq, dk, dv as one F32 buffer.
struct FlashAttnBwd {
    dims: AttnDims,
    scale: f32,
    out: Tensor,
    dout: Tensor,
    lse: Tensor,
}

impl FlashAttnBwd {
    const NAME: &'static str = "flash-attention-bwd";
}

impl candle_core::CustomOp3 for FlashAttnBwd {
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
        let op = Self::NAME;
        let (q, k, v) = cpu_qkv(op, &self.dims, (s1, l1), (s2, l2), (s3, l3))?;
        let host = |t: &Tensor| -> Result<Vec<f32>> {
            let (s, l) = t.storage_and_layout();
            match &*s {
                Storage::Cpu(s) => cpu_f32(s, l, op),
                _ => candle_core::bail!("{op}: saved tensors are not on the CPU"),
            }
        };
        let (o, g, lse) = (host(&self.out)?, host(&self.dout)?, host(&self.lse)?);
        if o.len() != q.len() || g.len() != q.len() || lse.len() * self.dims.d != q.len() {
            candle_core::bail!("{op}: saved tensors do not match q");
        }
        let all = flash_bwd_cpu(&self.dims, self.scale, (&q, &k, &v), &o, &g, &lse);
        let n = all.len();
        Ok((CpuStorage::F32(all), Shape::from(n)))
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
        let op = Self::NAME;
        let (os, ol) = self.out.storage_and_layout();
        let (gs, gl) = self.dout.storage_and_layout();
        let (ls, ll) = self.lse.storage_and_layout();
        let (Storage::Cuda(os), Storage::Cuda(gs), Storage::Cuda(ls)) = (&*os, &*gs, &*ls) else {
            candle_core::bail!("{op}: saved tensors are not on the GPU")
        };
        let all = crate::attention::flash_cuda::flash_attn_bwd(
            self.dims.sizes(),
            self.scale,
            [(s1, l1), (s2, l2), (s3, l3), (os, ol), (gs, gl)],
            (ls, ll),
        )?;
        let n = self.dims.q_len() + 2 * self.dims.kv_len();
        Ok((all, Shape::from(n)))
    }
}

/// `x` contiguous and starting at a multiple of 8 elements in its buffer (16 bytes for F16 and
/// BF16, 32 for F32), as the GPU kernels' vector loads need; copied when it is not.
fn aligned(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    if x.layout().start_offset().is_multiple_of(8) {
        Ok(x)
    } else {
        x.copy()
    }
}

/// Causal self-attention `softmax(q kᵀ · scale + causal mask) v` with gradients for q, k and
/// v: q (b, h, t, d), k and v (b, hkv, t, d) with `h % hkv == 0` (query head `i` attends with
/// kv head `i / (h / hkv)`; dk and dv sum over those heads), one float dtype for all three.
/// Row `i` attends to keys `0..=i`. Scores, softmax and sums in F32; the output in q's dtype.
/// Where no kernel exists ([`flash_attention_supported`]) or a size is 0 it computes
/// [`flash_attention_composite`].
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    flash_attention_with(q, k, v, scale, FlashForward::default())
}

/// [`flash_attention`] with the forward pass's GPU kernel chosen (the CPU ignores it).
pub fn flash_attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    forward: FlashForward,
) -> Result<Tensor> {
    let op = FlashAttn::NAME;
    let dims = attn_dims(op, q, k, v, scale)?;
    if dims.q_len() == 0 || !flash_attention_supported(q.device(), q.dtype(), dims.d) {
        return flash_attention_composite(q, k, v, scale);
    }
    aligned(q)?.apply_op3(
        &aligned(k)?,
        &aligned(v)?,
        FlashAttn {
            dims,
            scale,
            forward,
            lse: Mutex::new(None),
        },
    )
}

/// What [`flash_attention_forward`] keeps for [`flash_attention_backward`]: the sizes, the
/// scale and each query row's log-sum-exp.
pub struct FlashState {
    op: FlashAttn,
}

impl std::fmt::Debug for FlashState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlashState")
            .field("dims", &self.op.dims)
            .field("scale", &self.op.scale)
            .finish_non_exhaustive()
    }
}

/// [`flash_attention`]'s forward pass outside Candle's graph, for blocks that compute their
/// own backward pass: the output and what [`flash_attention_backward`] needs. Only where a
/// kernel exists ([`flash_attention_supported`]) and no size is 0; an error otherwise.
pub fn flash_attention_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
) -> Result<(Tensor, FlashState)> {
    let name = FlashAttn::NAME;
    let dims = attn_dims(name, q, k, v, scale)?;
    if dims.q_len() == 0 || !flash_attention_supported(q.device(), q.dtype(), dims.d) {
        candle_core::bail!(
            "{name}: no kernel for {:?} {:?} with head width {} (flash_attention_supported)",
            q.device().location(),
            q.dtype(),
            dims.d
        );
    }
    let op = FlashAttn {
        dims,
        scale,
        forward: FlashForward::default(),
        lse: Mutex::new(None),
    };
    let out = aligned(q)?.apply_op3_no_bwd(&aligned(k)?, &aligned(v)?, &op)?;
    Ok((out, FlashState { op }))
}

/// [`flash_attention`]'s backward pass outside Candle's graph: `(dq, dk, dv)` in q's dtype
/// for the output's gradient `dout`, from the forward pass's inputs, its output `out` and its
/// `state`.
pub fn flash_attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
    state: &FlashState,
) -> Result<(Tensor, Tensor, Tensor)> {
    use candle_core::CustomOp3;
    let name = FlashAttn::NAME;
    if attn_dims(name, q, k, v, state.op.scale)? != state.op.dims
        || out.shape() != q.shape()
        || dout.shape() != q.shape()
    {
        candle_core::bail!(
            "{name}: backward with q {:?}, out {:?}, dout {:?} for a forward pass of {:?}",
            q.shape(),
            out.shape(),
            dout.shape(),
            state.op.dims
        );
    }
    let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
    match state.op.bwd(&q, &k, &v, out, dout)? {
        (Some(dq), Some(dk), Some(dv)) => Ok((dq, dk, dv)),
        _ => candle_core::bail!("{name}: backward gave no gradient"),
    }
}

/// Checks the inputs of either attention function and gives their sizes.
fn attn_dims(op: &str, q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<AttnDims> {
    check_dtypes(op, &[q, k, v])?;
    let (b, h, t, d) = q.dims4()?;
    let (kb, hkv, kt, kd) = k.dims4()?;
    if k.shape() != v.shape() || kb != b || kt != t || kd != d || hkv == 0 || h % hkv != 0 {
        candle_core::bail!(
            "{op}: q {:?}, k {:?}, v {:?}: want q (b, h, t, d) and k, v (b, hkv, t, d) with h a \
             multiple of hkv",
            q.shape(),
            k.shape(),
            v.shape()
        );
    }
    if !scale.is_finite() {
        candle_core::bail!("{op}: scale {scale} is not finite");
    }
    if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
        candle_core::bail!("{op}: q, k and v are on different devices");
    }
    Ok(AttnDims { b, h, hkv, t, d })
}

/// The composition [`flash_attention`] replaces, differentiable: k and v repeated to q's
/// heads, then in F32 `q kᵀ · scale`, the causal mask, softmax and the weighted sum of v, cast
/// back to q's dtype.
pub fn flash_attention_composite(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    let op = "flash-attention-composite";
    let AttnDims { b, h, hkv, t, d } = attn_dims(op, q, k, v, scale)?;
    let rep = h / hkv;
    let repeat = |x: &Tensor| -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?;
        if rep == 1 {
            return Ok(x);
        }
        x.unsqueeze(2)?
            .expand((b, hkv, rep, t, d))?
            .reshape((b, h, t, d))
    };
    let (k, v) = (repeat(k)?, repeat(v)?);
    // cuBLAS takes each matrix with unit stride in its rows: strided views are copied.
    let q32 = q.to_dtype(DType::F32)?.contiguous()?;
    let att = (q32.matmul(&k.t()?.contiguous()?)? * f64::from(scale))?;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), q.device())?;
    let att = att.broadcast_add(&mask)?;
    let att = candle_nn::ops::softmax(&att, D::Minus1)?;
    att.matmul(&v.contiguous()?)?.to_dtype(q.dtype())
}
