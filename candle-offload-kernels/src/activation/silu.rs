//! `silu(gate) · up`, the elementwise part of a SwiGLU MLP, in one pass ([`silu_mul`]), for
//! inference (no gradient).

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor, WithDType};

use crate::util::{check_dtypes, contiguous, cpu_dispatch2, f32_of, of_f32};

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
        let out = crate::activation::cuda::silu_mul((s1, l1), (s2, l2))?;
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
