//! AdamW for host-memory (CPU) master weights, fused and multi-threaded ([`HostAdamW`]).
//!
//! Offloaded training keeps the F32 masters and the optimizer state in host memory (a small
//! card cannot hold 16 bytes per parameter). Candle's `AdamW` over CPU variables runs about a
//! dozen separate tensor ops per step, each a full pass over the parameters; this one makes
//! one pass over each parameter chunk on every core, with the same arithmetic as candle-nn's
//! `AdamW` (the same f32 operations in the same order, so the same results).
//! It is a `candle_nn::Optimizer`, so it works wherever one is expected (candle-offload's
//! `GradScaler` included).

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, Layout, Var};
use candle_nn::{Optimizer, ParamsAdamW};

/// Fused, multi-threaded AdamW over F32 variables in host memory.
#[derive(Debug)]
pub struct HostAdamW {
    vars: Vec<Var>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    step_t: usize,
    params: ParamsAdamW,
    threads: usize,
}

/// Elements per thread below which a chunk is not split further.
const MIN_CHUNK: usize = 1 << 16;

/// Each variable's first and second AdamW moments (flat F32), in the variables' order.
pub type Moments = Vec<(Vec<f32>, Vec<f32>)>;

impl HostAdamW {
    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// The steps taken and each variable's first and second moments (flat F32), in the
    /// variables' order: what resuming needs besides the variables.
    pub fn moments(&self) -> (usize, Moments) {
        (
            self.step_t,
            self.m.iter().cloned().zip(self.v.iter().cloned()).collect(),
        )
    }

    /// Sets what [`moments`](Self::moments) gives: one pair per variable, each of its size.
    pub fn set_moments(&mut self, step: usize, moments: Moments) -> candle_core::Result<()> {
        check_moments(&self.vars, &moments)?;
        let (m, v) = moments.into_iter().unzip();
        (self.m, self.v, self.step_t) = (m, v, step);
        Ok(())
    }
}

impl Optimizer for HostAdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<Self> {
        for v in &vars {
            if !v.device().is_cpu() || v.dtype() != DType::F32 {
                candle_core::bail!(
                    "HostAdamW updates F32 variables in host memory; got {:?} on {:?}",
                    v.dtype(),
                    v.device()
                );
            }
        }
        let m = vars.iter().map(|v| vec![0f32; v.elem_count()]).collect();
        let v = vars.iter().map(|v| vec![0f32; v.elem_count()]).collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(Self {
            vars,
            m,
            v,
            step_t: 0,
            params,
            threads,
        })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let p = &self.params;
        let (b1, b2) = (p.beta1, p.beta2);
        let k = Coefficients {
            b1: b1 as f32,
            one_minus_b1: (1.0 - b1) as f32,
            b2: b2 as f32,
            one_minus_b2: (1.0 - b2) as f32,
            scale_m: (1.0 / (1.0 - b1.powi(self.step_t as i32))) as f32,
            scale_v: (1.0 / (1.0 - b2.powi(self.step_t as i32))) as f32,
            decay: (1.0 - p.lr * p.weight_decay) as f32,
            eps: p.eps as f32,
            lr: p.lr as f32,
        };
        for ((var, m), v) in self.vars.iter().zip(&mut self.m).zip(&mut self.v) {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g = g.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            // In place: no copy of the weights or the gradient, one pass over each.
            let update = Update {
                k,
                m: std::sync::Mutex::new(m),
                v: std::sync::Mutex::new(v),
                threads: self.threads,
            };
            var.as_tensor().inplace_op2(&g, &update)?;
        }
        Ok(())
    }
}

/// One variable's update, applied in place to its storage with the gradient as the source.
struct Update<'a> {
    k: Coefficients,
    m: std::sync::Mutex<&'a mut Vec<f32>>,
    v: std::sync::Mutex<&'a mut Vec<f32>>,
    threads: usize,
}

impl candle_core::InplaceOp2 for Update<'_> {
    fn name(&self) -> &'static str {
        "host-adamw"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (CpuStorage::F32(theta), CpuStorage::F32(g)) = (s1, s2) else {
            candle_core::bail!("host-adamw: F32 weights and gradients expected");
        };
        let (Some((t0, t1)), Some((g0, g1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("host-adamw: weights and gradient have to be contiguous");
        };
        let (theta, g) = (&mut theta[t0..t1], &g[g0..g1]);
        let mut m = self
            .m
            .lock()
            .map_err(|_| candle_core::Error::Msg("poisoned".into()))?;
        let mut v = self
            .v
            .lock()
            .map_err(|_| candle_core::Error::Msg("poisoned".into()))?;
        if g.len() != theta.len() || m.len() != theta.len() || v.len() != theta.len() {
            candle_core::bail!(
                "host-adamw: {} weights, {} gradients, {} and {} moments",
                theta.len(),
                g.len(),
                m.len(),
                v.len()
            );
        }
        let chunk = theta.len().div_ceil(self.threads).max(MIN_CHUNK);
        let k = self.k;
        std::thread::scope(|s| {
            for (((t, m), v), g) in theta
                .chunks_mut(chunk)
                .zip(m.chunks_mut(chunk))
                .zip(v.chunks_mut(chunk))
                .zip(g.chunks(chunk))
            {
                s.spawn(move || k.apply(t, m, v, g));
            }
        });
        Ok(())
    }
}

#[derive(Clone, Copy)]
struct Coefficients {
    b1: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    scale_m: f32,
    scale_v: f32,
    decay: f32,
    eps: f32,
    lr: f32,
}

impl Coefficients {
    /// candle-nn's AdamW, element by element.
    fn apply(&self, theta: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        for i in 0..theta.len() {
            let gi = g[i];
            let mi = m[i] * self.b1 + gi * self.one_minus_b1;
            let vi = v[i] * self.b2 + gi * gi * self.one_minus_b2;
            m[i] = mi;
            v[i] = vi;
            let adjusted = (mi * self.scale_m) / ((vi * self.scale_v).sqrt() + self.eps);
            theta[i] = theta[i] * self.decay - adjusted * self.lr;
        }
    }
}

/// One pair of moments per variable, each of its size.
pub(crate) fn check_moments(
    vars: &[Var],
    moments: &[(Vec<f32>, Vec<f32>)],
) -> candle_core::Result<()> {
    if moments.len() != vars.len() {
        candle_core::bail!(
            "AdamW state: {} moment pairs for {} variables",
            moments.len(),
            vars.len()
        );
    }
    for (i, (var, (m, v))) in vars.iter().zip(moments).enumerate() {
        if m.len() != var.elem_count() || v.len() != var.elem_count() {
            candle_core::bail!(
                "AdamW state: variable {i} has {} elements, its moments {} and {}",
                var.elem_count(),
                m.len(),
                v.len()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;
    use candle_nn::AdamW;

    /// The same trajectory as candle-nn's AdamW, with weight decay, over several steps and
    /// parameters larger than one chunk.
    #[test]
    fn matches_candle_nn_adamw() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let params = ParamsAdamW {
            lr: 0.01,
            weight_decay: 0.1,
            ..Default::default()
        };
        let init = Tensor::randn(0f32, 1., (3, MIN_CHUNK + 17), &dev)?;
        let (a, b) = (Var::from_tensor(&init)?, Var::from_tensor(&init)?);
        let mut ours = HostAdamW::new(vec![a.clone()], params.clone())?;
        ours.threads = 4;
        let mut theirs = AdamW::new(vec![b.clone()], params)?;
        for step in 0..4 {
            let g = Tensor::randn(0f32, 1., (3, MIN_CHUNK + 17), &dev)?;
            let mut ga = GradStore::default();
            ga.insert(a.as_tensor(), g.clone());
            let mut gb = GradStore::default();
            gb.insert(b.as_tensor(), g);
            ours.step(&ga)?;
            theirs.step(&gb)?;
            let diff = (a.as_tensor() - b.as_tensor())?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff <= 1e-6, "step {step}: max difference {diff}");
        }
        Ok(())
    }

    #[test]
    fn refuses_device_or_half_variables() {
        let v = Var::zeros(4, DType::F16, &Device::Cpu).unwrap();
        let e = HostAdamW::new(vec![v], ParamsAdamW::default()).unwrap_err();
        assert!(e.to_string().contains("F32"), "{e}");
    }
}
