//! PyTorch AdamW (decoupled weight decay, bias correction; candle-nn's `ParamsAdamW`) over F32
//! variables, fused ([`FusedAdamW`]): on a GPU one kernel launch (`kernels/optimizer.cu`)
//! steps every parameter with a gradient, its moments kept in two flat F32 buffers on the
//! device; on the CPU it is [`HostAdamW`].

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};

use crate::optimizer::host::{HostAdamW, Moments};

/// PyTorch AdamW (decoupled weight decay, bias correction; candle-nn's `ParamsAdamW`) over F32
/// variables, fused: on a GPU one kernel launch steps every parameter with a gradient, its
/// moments kept in two flat F32 buffers on the device; on the CPU it is
/// [`HostAdamW`]. The arithmetic is candle-nn's `AdamW`, operation by
/// operation in F32, so the trajectories agree to rounding.
#[derive(Debug)]
pub struct FusedAdamW {
    state: AdamState,
    params: ParamsAdamW,
    step_t: usize,
}

#[derive(Debug)]
enum AdamState {
    Host(HostAdamW),
    Device {
        vars: Vec<Var>,
        /// Where each variable's moments start in `m` and `v`.
        offsets: Vec<usize>,
        m: Tensor,
        v: Tensor,
    },
}

impl FusedAdamW {
    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// The steps taken and each variable's first and second moments (flat F32, copied to the
    /// host), in the variables' order ([`HostAdamW::moments`]).
    pub fn moments(&self) -> Result<(usize, Moments)> {
        match &self.state {
            AdamState::Host(o) => Ok(o.moments()),
            AdamState::Device {
                vars,
                offsets,
                m,
                v,
                ..
            } => {
                let mut out = Vec::with_capacity(vars.len());
                for (var, &at) in vars.iter().zip(offsets) {
                    let n = var.elem_count();
                    out.push((
                        m.narrow(0, at, n)?.to_vec1::<f32>()?,
                        v.narrow(0, at, n)?.to_vec1::<f32>()?,
                    ));
                }
                Ok((self.step_t, out))
            }
        }
    }

    /// Sets what [`moments`](Self::moments) gives: one pair per variable, each of its size.
    pub fn set_moments(&mut self, step: usize, moments: Moments) -> Result<()> {
        match &mut self.state {
            AdamState::Host(o) => o.set_moments(step, moments)?,
            AdamState::Device { vars, m, v, .. } => {
                crate::optimizer::host::check_moments(vars, &moments)?;
                let (ms, vs): (Vec<Vec<f32>>, Vec<Vec<f32>>) = moments.into_iter().unzip();
                let device = m.device().clone();
                *m = Tensor::new(ms.concat(), &device)?;
                *v = Tensor::new(vs.concat(), &device)?;
            }
        }
        self.step_t = step;
        Ok(())
    }

    /// Whether the masters and moments live in host memory (`HostAdamW` underneath).
    pub fn on_host(&self) -> bool {
        matches!(self.state, AdamState::Host(_))
    }

    /// An AdamW step on `grads` times `grad_scale`, the scaling done as the kernel reads each
    /// gradient (PyTorch's unscale-in-the-step for a loss scaled by `1 / grad_scale`): no pass
    /// of its own over the gradients. `step` is `step_scaled(grads, 1.0)`, exactly.
    pub fn step_scaled(&mut self, grads: &GradStore, grad_scale: f64) -> Result<()> {
        let (vars, offsets, m, v) = match &mut self.state {
            AdamState::Host(o) => {
                if grad_scale == 1.0 {
                    return o.step(grads);
                }
                let mut scaled = GradStore::default();
                for &id in grads.get_ids() {
                    if let Some(g) = grads.get_id(id) {
                        scaled.insert_id(id, g.affine(grad_scale, 0.)?);
                    }
                }
                return o.step(&scaled);
            }
            AdamState::Device {
                vars,
                offsets,
                m,
                v,
            } => (vars, offsets, m, v),
        };
        self.step_t += 1;
        let p = &self.params;
        let t = self.step_t as i32;
        // The kernel's scalars as candle-nn's tensor ops round them (f64, then f32): lr,
        // 1 - lr·wd, β1, 1 - β1, β2, 1 - β2, the bias corrections 1 / (1 - βᵗ), eps, and the
        // gradients' factor.
        let scalars = [
            p.lr,
            1.0 - p.lr * p.weight_decay,
            p.beta1,
            1.0 - p.beta1,
            p.beta2,
            1.0 - p.beta2,
            1.0 / (1.0 - p.beta1.powi(t)),
            1.0 / (1.0 - p.beta2.powi(t)),
            p.eps,
            grad_scale,
        ]
        .map(|x| x as f32);
        let mut items = Vec::new();
        for (var, &offset) in vars.iter().zip(offsets.iter()) {
            if let Some(g) = grads.get(var) {
                if g.dims() != var.dims() {
                    candle_core::bail!(
                        "FusedAdamW: gradient {:?} for a variable {:?}",
                        g.shape(),
                        var.shape()
                    );
                }
                let g = g.to_dtype(DType::F32)?.contiguous()?;
                items.push((var.as_tensor().clone(), g, offset));
            }
        }
        device::adamw_step(&items, m, v, scalars)
    }
}

impl Optimizer for FusedAdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let Some(first) = vars.first() else {
            return Ok(Self {
                state: AdamState::Host(HostAdamW::new(vars, params.clone())?),
                params,
                step_t: 0,
            });
        };
        let device = first.device().clone();
        for v in &vars {
            if v.dtype() != DType::F32 || !v.device().same_device(&device) {
                candle_core::bail!(
                    "FusedAdamW updates F32 variables on one device; got {:?} on {:?} beside {:?}",
                    v.dtype(),
                    v.device(),
                    device
                );
            }
        }
        let state = if device.is_cpu() {
            AdamState::Host(HostAdamW::new(vars, params.clone())?)
        } else if device.is_cuda() {
            let mut offsets = Vec::with_capacity(vars.len());
            let mut total = 0;
            for v in &vars {
                offsets.push(total);
                total += v.elem_count();
            }
            AdamState::Device {
                m: Tensor::zeros(total, DType::F32, &device)?,
                v: Tensor::zeros(total, DType::F32, &device)?,
                vars,
                offsets,
            }
        } else {
            candle_core::bail!("FusedAdamW: no kernel for {device:?}")
        };
        Ok(Self {
            state,
            params,
            step_t: 0,
        })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_scaled(grads, 1.0)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
        if let AdamState::Host(o) = &mut self.state {
            o.set_learning_rate(lr);
        }
    }
}

/// The multi-tensor launch (the one place that needs the CUDA build).
#[cfg(feature = "cuda")]
mod device {
    use candle_core::{Result, Storage, Tensor};

    use crate::optimizer::cuda as k;

    /// Steps `(parameter, F32 contiguous gradient, moment offset)` in one launch.
    pub(super) fn adamw_step(
        items: &[(Tensor, Tensor, usize)],
        m: &Tensor,
        v: &Tensor,
        scalars: [f32; 10],
    ) -> Result<()> {
        let (ms, ml) = m.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (Storage::Cuda(ms), Storage::Cuda(vs)) = (&*ms, &*vs) else {
            candle_core::bail!("FusedAdamW: moments are not on the GPU")
        };
        let guards: Vec<_> = items
            .iter()
            .map(|(p, g, o)| (p.storage_and_layout(), g.storage_and_layout(), *o))
            .collect();
        let mut list = Vec::with_capacity(guards.len());
        for ((ps, pl), (gs, gl), offset) in &guards {
            let (Storage::Cuda(ps), Storage::Cuda(gs)) = (&**ps, &**gs) else {
                candle_core::bail!("FusedAdamW: a parameter or gradient is not on the GPU")
            };
            list.push(k::AdamItem {
                param: (ps, pl),
                grad: (gs, gl),
                offset: *offset,
            });
        }
        k::adamw_multi(&list, (ms, ml), (vs, vl), scalars)
    }
}

#[cfg(not(feature = "cuda"))]
mod device {
    use candle_core::{Result, Tensor};

    /// Without CUDA there are no device variables to step (`FusedAdamW::new` refuses them).
    pub(super) fn adamw_step(
        _items: &[(Tensor, Tensor, usize)],
        _m: &Tensor,
        _v: &Tensor,
        _scalars: [f32; 10],
    ) -> Result<()> {
        candle_core::bail!("FusedAdamW on a GPU needs a build with `--features cuda`")
    }
}
