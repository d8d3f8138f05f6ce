//! SwiGLU for training, `silu(gate) · up` with its own backward pass ([`swiglu`]): gradients
//! for gate and up in one kernel each way.

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor, WithDType};

use crate::util::{check_dtypes, contiguous, cpu_same, f32_of, of_f32, stacked_shape, IntoCpu};

#[derive(Debug, Clone, Copy)]
struct SwiGlu;

impl SwiGlu {
    const NAME: &'static str = "fused-swiglu";
}

fn sigmoid(a: f32) -> f32 {
    1.0 / (1.0 + (-a).exp())
}

fn swiglu_cpu<T: WithDType>(g: &[T], u: &[T], (gl, ul): (&Layout, &Layout)) -> Result<CpuStorage>
where
    Vec<T>: IntoCpu,
{
    let (g, u) = (
        contiguous(g, gl, SwiGlu::NAME)?,
        contiguous(u, ul, SwiGlu::NAME)?,
    );
    let out: Vec<T> = g
        .iter()
        .zip(u)
        .map(|(&g, &u)| {
            let a = f32_of(g);
            of_f32(a * sigmoid(a) * f32_of(u))
        })
        .collect();
    Ok(out.into_cpu())
}

impl candle_core::CustomOp2 for SwiGlu {
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
        let out = cpu_same!(Self::NAME, [s1, s2], swiglu_cpu, |g, u| ((l1, l2)))?;
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
        let out = crate::activation::cuda::swiglu_fwd((s1, l1), (s2, l2))?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let both = gate.apply_op3_no_bwd(up, &grad.contiguous()?, &SwiGluBwd)?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

/// SwiGLU's gradients, stacked: (2, shape…), d gate then d up.
#[derive(Debug, Clone, Copy)]
struct SwiGluBwd;

impl SwiGluBwd {
    const NAME: &'static str = "fused-swiglu-bwd";
}

fn swiglu_bwd_cpu<T: WithDType>(
    a: &[T],
    u: &[T],
    g: &[T],
    (al, ul, gl): (&Layout, &Layout, &Layout),
) -> Result<CpuStorage>
where
    Vec<T>: IntoCpu,
{
    let op = SwiGluBwd::NAME;
    let (a, u, g) = (
        contiguous(a, al, op)?,
        contiguous(u, ul, op)?,
        contiguous(g, gl, op)?,
    );
    let n = a.len();
    let mut out = vec![of_f32::<T>(0.0); 2 * n];
    let (da, du) = out.split_at_mut(n);
    for i in 0..n {
        let (x, s, gi) = (f32_of(a[i]), sigmoid(f32_of(a[i])), f32_of(g[i]));
        da[i] = of_f32(gi * f32_of(u[i]) * s * (1.0 + x * (1.0 - s)));
        du[i] = of_f32(gi * x * s);
    }
    Ok(out.into_cpu())
}

impl candle_core::CustomOp3 for SwiGluBwd {
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
        let out = cpu_same!(Self::NAME, [s1, s2, s3], swiglu_bwd_cpu, |a, u, g| ((
            l1, l2, l3
        )))?;
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
        let out = crate::activation::cuda::swiglu_bwd((s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, stacked_shape(l1)))
    }
}

/// `silu(gate) · up` (the SwiGLU MLP's elementwise part), with gradients for both; `gate` and
/// `up` of one shape and dtype.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_dtypes(SwiGlu::NAME, &[gate, up])?;
    if gate.shape() != up.shape() {
        candle_core::bail!(
            "{}: gate {:?} and up {:?} differ in shape",
            SwiGlu::NAME,
            gate.shape(),
            up.shape()
        );
    }
    if gate.elem_count() == 0 {
        return swiglu_composite(gate, up);
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

/// [`swiglu`]'s backward pass outside Candle's graph, for blocks that compute their own:
/// `(dgate, dup)` for the output's gradient `dy` (one shape and dtype for all three).
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    use candle_core::CustomOp2;
    check_dtypes(SwiGlu::NAME, &[gate, up, dy])?;
    if gate.shape() != up.shape() || gate.shape() != dy.shape() || gate.elem_count() == 0 {
        candle_core::bail!(
            "{}: backward of gate {:?}, up {:?} with dy {:?}",
            SwiGlu::NAME,
            gate.shape(),
            up.shape(),
            dy.shape()
        );
    }
    match SwiGlu.bwd(&gate.contiguous()?, &up.contiguous()?, dy, dy)? {
        (Some(dg), Some(du)) => Ok((dg, du)),
        _ => candle_core::bail!("{}: backward gave no gradient", SwiGlu::NAME),
    }
}

/// The composition [`swiglu`] replaces.
pub fn swiglu_composite(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    candle_nn::ops::silu(gate)? * up
}
