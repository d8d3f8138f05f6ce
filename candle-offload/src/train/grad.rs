//! Ops whose gradient is supplied rather than derived op by op.
//!
//! Candle's backward computes a gradient for every operand of every op, constants included:
//! adding a causal mask of shape (T, T) to scores of shape (B, H, T, T) reduces the scores'
//! gradient over B and H to produce the mask's gradient, and RoPE's `x * cos + rot(x) * sin`
//! does the same for its tables, in every layer, for gradients nobody reads. Here the value is
//! computed with ordinary ops on a detached input and attached to the graph by a custom op
//! whose backward applies a given closed form to the incoming gradient (one output-sized copy,
//! as for checkpoints).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Storage, Tensor};

/// A tensor whose value is `value` and whose gradient with respect to `xs` is `backward(grad)`.
/// `value` must have been computed from `xs` without a graph (from `xs.detach()`).
pub fn with_gradient<F>(xs: &Tensor, value: Tensor, backward: F) -> candle_core::Result<Tensor>
where
    F: Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
{
    if !xs.track_op() {
        return Ok(value);
    }
    attach_precomputed(
        xs,
        value,
        "supplied-gradient",
        Arc::new(move |_, g| backward(g).map(Some)),
    )
}

/// `xs + constant` (broadcast) with no gradient for the constant: the gradient passes through.
pub fn add_constant(xs: &Tensor, constant: &Tensor) -> candle_core::Result<Tensor> {
    let value = xs.detach().broadcast_add(constant)?;
    with_gradient(xs, value, |g| Ok(g.clone()))
}

/// Rotary embedding (the rotate-half layout of `candle_nn::rotary_emb::rope`) of `xs` (batch,
/// heads, seq, head_dim) with tables `cos`, `sin` (seq, head_dim / 2), differentiable in `xs`
/// only, with the backward pass in closed form: the rotation by -θ.
pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let (_, _, seq_len, _) = xs.dims4()?;
    let (cos, sin) = (
        cos.narrow(0, 0, seq_len)?.contiguous()?,
        sin.narrow(0, 0, seq_len)?.contiguous()?,
    );
    let value = candle_nn::rotary_emb::rope(&xs.detach().contiguous()?, &cos, &sin)?;
    with_gradient(xs, value, move |g| rope_backward(g, &cos, &sin))
}

/// The backward pass of [`rope`] outside Candle's graph: `g` (batch, heads, seq, head_dim)
/// rotated back by the tables' angles (`sin` negated), for blocks that compute their own. The
/// rotation by θ is orthogonal: its adjoint is the rotation by -θ, one rope kernel.
pub fn rope_backward(g: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let (_, _, seq_len, _) = g.dims4()?;
    let cos = cos.narrow(0, 0, seq_len)?.contiguous()?;
    let neg_sin = sin.narrow(0, 0, seq_len)?.neg()?;
    candle_nn::rotary_emb::rope(&g.contiguous()?, &cos, &neg_sin)
}

/// The backward pass of a [`Precomputed`] node: `(input, incoming gradient)` to the input's
/// gradient.
pub(crate) type PrecomputedBackward =
    Arc<dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Option<Tensor>> + Send + Sync>;

/// A graph node on `xs` whose value is `value` (computed beforehand, without a graph) and
/// whose backward pass is `backward`: what checkpoints and supplied gradients are made of.
/// Its forward hands out a copy of the value and then forgets it, so only the node's own
/// copy stays alive.
pub(crate) fn attach_precomputed(
    xs: &Tensor,
    value: Tensor,
    name: &'static str,
    backward: PrecomputedBackward,
) -> candle_core::Result<Tensor> {
    // The CPU forward copies the whole storage: hand it a value that starts at offset 0.
    let value = if value.is_contiguous() && value.layout().start_offset() == 0 {
        value
    } else {
        value.copy()?
    };
    xs.apply_op1(Precomputed {
        name,
        value: Mutex::new(Some(value)),
        backward,
    })
}

struct Precomputed {
    name: &'static str,
    value: Mutex<Option<Tensor>>,
    backward: PrecomputedBackward,
}

impl Precomputed {
    fn take(&self) -> candle_core::Result<Tensor> {
        self.value
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{}: value poisoned", self.name)))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: forward ran twice", self.name)))
    }
}

impl CustomOp1 for Precomputed {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = self.take()?;
        let (storage, layout) = v.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.clone(), layout.shape().clone())),
            _ => candle_core::bail!("{}: the value is not on the input's device", self.name),
        }
    }

    // Candle's dummy CUDA storage stands in without the `cuda` feature (no value is ever on
    // a GPU then, so this never runs).
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let v = self.take()?;
        let (storage, layout) = v.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("{}: the value is not on the input's device", self.name),
        }
    }

    fn bwd(&self, xs: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        (self.backward)(xs, grad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn grad_of(
        f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
        x: &Var,
        w: &Tensor,
    ) -> Vec<f32> {
        let y = f(x.as_tensor()).unwrap();
        let g = (y * w).unwrap().sum_all().unwrap().backward().unwrap();
        g.get(x.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn rope_matches_candles_differentiable_rope() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1., (2, 3, 5, 8), &dev)?;
        let w = Tensor::randn(0f32, 1., (2, 3, 5, 8), &dev)?;
        let theta = Tensor::randn(0f32, 1., (5, 4), &dev)?;
        let (cos, sin) = (theta.cos()?, theta.sin()?);
        let ours = rope(x.as_tensor(), &cos, &sin)?;
        let reference = candle_nn::rotary_emb::rope_slow(x.as_tensor(), &cos, &sin)?;
        let diff = (ours - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "value differs by {diff}");
        let a = grad_of(|x| rope(x, &cos, &sin), &x, &w);
        let b = grad_of(|x| candle_nn::rotary_emb::rope_slow(x, &cos, &sin), &x, &w);
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-5, "{p} vs {q}");
        }
        Ok(())
    }

    #[test]
    fn constants_get_no_gradient_and_inputs_pass_it_through() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1., (2, 3, 4), &dev)?;
        let c = Tensor::randn(0f32, 1., (3, 4), &dev)?;
        let w = Tensor::randn(0f32, 1., (2, 3, 4), &dev)?;
        let y = add_constant(x.as_tensor(), &c)?;
        assert_eq!(
            y.to_vec3::<f32>()?,
            x.as_tensor().broadcast_add(&c)?.to_vec3::<f32>()?
        );
        let g = (y * &w)?.sum_all()?.backward()?;
        assert!(g.get(&c).is_none(), "the constant got a gradient");
        assert_eq!(
            g.get(x.as_tensor()).unwrap().to_vec3::<f32>()?,
            w.to_vec3::<f32>()?
        );
        Ok(())
    }
}
