//! Dynamic loss scaling (PyTorch's `GradScaler`) around any `candle_nn::Optimizer`.
//!
//! F16 has five exponent bits: small gradients underflow to zero. The loss is multiplied by a
//! large scale before the backward pass, so gradients are computed scaled up; before the
//! optimizer step they are unscaled in F32. A step whose gradients hold an inf or a NaN (the
//! scale was too large) is skipped and the scale halved; after `growth_interval` good steps in
//! a row it is doubled. The defaults are PyTorch's: initial scale 2^16, growth 2 every 2000
//! good steps, backoff 0.5.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var, D};
use candle_nn::Optimizer;

/// The scaler's settings (PyTorch's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The first scale.
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` good steps in a row.
    pub growth_factor: f64,
    /// Multiplies the scale after a step with an inf or NaN gradient.
    pub backoff_factor: f64,
    /// Good steps in a row before the scale grows.
    pub growth_interval: usize,
    /// When off, the scaler is a pass-through (scale 1, nothing skipped): BF16 and F32 runs.
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// What a scaled step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// Gradients were finite; the optimizer stepped.
    Applied {
        /// The scale after the step (grown if this completed an interval).
        scale: f64,
    },
    /// An inf or NaN gradient: no update, the scale backed off.
    Skipped {
        /// The scale after backing off.
        scale: f64,
    },
}

impl StepOutcome {
    /// Whether the optimizer stepped.
    pub fn applied(&self) -> bool {
        matches!(self, Self::Applied { .. })
    }

    /// The scale after the step.
    pub fn scale(&self) -> f64 {
        match *self {
            Self::Applied { scale } | Self::Skipped { scale } => scale,
        }
    }
}

/// Dynamic loss scaling state.
#[derive(Debug, Clone)]
pub struct GradScaler {
    cfg: GradScalerConfig,
    scale: f64,
    good_steps: usize,
    skipped: u64,
}

impl GradScaler {
    /// A scaler with `cfg`.
    pub fn new(cfg: GradScalerConfig) -> Self {
        let scale = if cfg.enabled { cfg.init_scale } else { 1.0 };
        Self {
            cfg,
            scale,
            good_steps: 0,
            skipped: 0,
        }
    }

    /// A pass-through scaler (for BF16 and F32 runs).
    pub fn disabled() -> Self {
        Self::new(GradScalerConfig {
            enabled: false,
            ..Default::default()
        })
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Whether it scales at all.
    pub fn is_enabled(&self) -> bool {
        self.cfg.enabled
    }

    /// Steps skipped so far.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// Good steps since the last growth or backoff.
    pub fn good_steps(&self) -> usize {
        self.good_steps
    }

    /// `loss` times the scale: call `backward` on this.
    pub fn scale_loss(&self, loss: &Tensor) -> candle_core::Result<Tensor> {
        if self.cfg.enabled {
            loss.affine(self.scale, 0.)
        } else {
            Ok(loss.clone())
        }
    }

    /// The gradients of `vars` divided by the scale, each in its variable's dtype, and
    /// whether they are all finite (one device-to-host read per device for the whole set).
    pub fn unscale(
        &self,
        vars: &[Var],
        grads: &GradStore,
    ) -> candle_core::Result<(GradStore, bool)> {
        let mut copy = GradStore::default();
        for v in vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                copy.insert(v.as_tensor(), g.clone());
            }
        }
        self.unscale_owned(vars, copy)
    }

    /// [`unscale`](Self::unscale) consuming `grads`: each scaled gradient is dropped as soon
    /// as its unscaled copy exists, so the gradients are never held twice.
    pub fn unscale_owned(
        &self,
        vars: &[Var],
        grads: GradStore,
    ) -> candle_core::Result<(GradStore, bool)> {
        self.unscale_inner(vars, grads, false)
    }

    /// [`unscale_owned`](Self::unscale_owned); with `in_place`, F32 host gradients (an
    /// offloaded step's sums) are divided where they are, on every core, in the same pass that
    /// checks them: Candle's CPU ops would take one thread and two passes (seconds for a 1B
    /// model).
    fn unscale_inner(
        &self,
        vars: &[Var],
        mut grads: GradStore,
        in_place: bool,
    ) -> candle_core::Result<(GradStore, bool)> {
        let inv = 1.0 / self.scale;
        let mut out = GradStore::default();
        let mut totals = Totals::default();
        let mut host_finite = true;
        for v in vars {
            let Some(g) = grads.remove(v.as_tensor()) else {
                continue;
            };
            let g = g.to_dtype(v.dtype())?;
            if in_place && self.cfg.enabled {
                if let Some(finite) = super::host_grad::scale_host_in_place(&g, inv as f32)? {
                    host_finite &= finite;
                    out.insert(v.as_tensor(), g);
                    continue;
                }
            }
            let g = if self.cfg.enabled {
                g.affine(inv, 0.)?
            } else {
                g
            };
            totals.add(&g)?;
            out.insert(v.as_tensor(), g);
        }
        drop(grads);
        let finite = host_finite && totals.finite()?;
        Ok((out, finite))
    }

    /// Records a step's verdict: grows the scale after `growth_interval` finite steps in a row,
    /// backs off after a non-finite one.
    pub fn update(&mut self, finite: bool) -> StepOutcome {
        if !self.cfg.enabled {
            return StepOutcome::Applied { scale: 1.0 };
        }
        if finite {
            self.good_steps += 1;
            if self.good_steps >= self.cfg.growth_interval {
                self.scale *= self.cfg.growth_factor;
                self.good_steps = 0;
            }
            StepOutcome::Applied { scale: self.scale }
        } else {
            self.scale *= self.cfg.backoff_factor;
            self.good_steps = 0;
            self.skipped += 1;
            StepOutcome::Skipped { scale: self.scale }
        }
    }

    /// Unscales the gradients of `vars`, steps `opt` if they are finite, and updates the
    /// scale. `grads` come from `scale_loss(loss).backward()`.
    pub fn step<O: Optimizer>(
        &mut self,
        opt: &mut O,
        vars: &[Var],
        grads: &GradStore,
    ) -> candle_core::Result<StepOutcome> {
        let (unscaled, finite) = self.unscale(vars, grads)?;
        if finite {
            opt.step(&unscaled)?;
        }
        Ok(self.update(finite))
    }

    /// [`step_owned`](Self::step_owned) for [`FusedAdamW`](candle_offload_kernels::optimizer::FusedAdamW): the gradients
    /// are checked as they are (one sum per row, no copy) and unscaled inside the optimizer's
    /// kernel ([`FusedAdamW::step_scaled`](candle_offload_kernels::optimizer::FusedAdamW::step_scaled)), so the step makes
    /// no pass of its own to divide them. A gradient finite before the division stays finite
    /// after it while the scale is at least 1, as it is unless many overflows in a row backed
    /// it off below 1. Masters on the host (a CPU run) go through
    /// [`step_owned`](Self::step_owned), whose in-place unscale runs on every core.
    pub fn step_fused(
        &mut self,
        opt: &mut candle_offload_kernels::optimizer::FusedAdamW,
        vars: &[Var],
        grads: GradStore,
    ) -> candle_core::Result<StepOutcome> {
        if !self.cfg.enabled || opt.on_host() {
            return self.step_owned(opt, vars, grads);
        }
        let mut totals = Totals::default();
        for v in vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                totals.add(g)?;
            }
        }
        let finite = totals.finite()?;
        if finite {
            opt.step_scaled(&grads, 1.0 / self.scale)?;
        }
        Ok(self.update(finite))
    }

    /// [`step`](Self::step) consuming `grads` (the scaled gradients are freed while unscaling;
    /// with scaling off they are handed to the optimizer as they are). Contiguous F32 host
    /// gradients are unscaled in place: other handles to the same tensors see the division.
    pub fn step_owned<O: Optimizer>(
        &mut self,
        opt: &mut O,
        vars: &[Var],
        grads: GradStore,
    ) -> candle_core::Result<StepOutcome> {
        if !self.cfg.enabled {
            opt.step(&grads)?;
            return Ok(self.update(true));
        }
        let (unscaled, finite) = self.unscale_inner(vars, grads, true)?;
        if finite {
            opt.step(&unscaled)?;
        }
        Ok(self.update(finite))
    }
}

/// The overflow check's running sums, one per device, so that the verdict costs a single read
/// per device at the end.
#[derive(Default)]
struct Totals(Vec<Tensor>);

impl Totals {
    fn add(&mut self, g: &Tensor) -> candle_core::Result<()> {
        let s = row_sums_total(g)?;
        match self
            .0
            .iter_mut()
            .find(|t| t.device().same_device(s.device()))
        {
            Some(t) => *t = (&*t + s)?,
            None => self.0.push(s),
        }
        Ok(())
    }

    /// Whether every gradient added was finite.
    fn finite(self) -> candle_core::Result<bool> {
        let mut finite = true;
        for t in self.0 {
            finite &= t.to_scalar::<f32>()?.is_finite();
        }
        Ok(finite)
    }
}

/// The sum of every value of `g` in F32, whose non-finiteness is the overflow check: any inf
/// or NaN makes the plain sum inf or NaN (inf - inf is NaN), so one pass without `abs` finds
/// them, and finite values of opposite signs beyond F32's range do not raise a false alarm
/// the way a sum of absolute values would. Rows first: Candle reduces a whole tensor to one
/// value in a single GPU block, which for the embedding's gradient alone took milliseconds;
/// one block per row reads at the memory's rate.
fn row_sums_total(g: &Tensor) -> candle_core::Result<Tensor> {
    let f = g.to_dtype(DType::F32)?;
    if f.rank() >= 2 {
        f.sum(D::Minus1)?.sum_all()
    } else {
        f.sum_all()
    }
}

/// An optimizer with dynamic loss scaling: `backward_step(loss)` scales the loss, runs the
/// backward pass, unscales, and steps unless a gradient overflowed.
#[derive(Debug)]
pub struct ScaledOptimizer<O: Optimizer> {
    opt: O,
    vars: Vec<Var>,
    scaler: GradScaler,
}

impl<O: Optimizer> ScaledOptimizer<O> {
    /// `O` over `vars` with `config`, scaled by `scaler`.
    pub fn new(vars: Vec<Var>, config: O::Config, scaler: GradScaler) -> candle_core::Result<Self> {
        Ok(Self {
            opt: O::new(vars.clone(), config)?,
            vars,
            scaler,
        })
    }

    /// Scales `loss`, back-propagates and steps.
    pub fn backward_step(&mut self, loss: &Tensor) -> candle_core::Result<StepOutcome> {
        let grads = self.scaler.scale_loss(loss)?.backward()?;
        self.step(&grads)
    }

    /// Steps with gradients of the scaled loss (e.g. from a
    /// [`Checkpointer`](super::Checkpointer)'s backward pass).
    pub fn step(&mut self, grads: &GradStore) -> candle_core::Result<StepOutcome> {
        self.scaler.step(&mut self.opt, &self.vars, grads)
    }

    /// The scaler.
    pub fn scaler(&self) -> &GradScaler {
        &self.scaler
    }

    /// The wrapped optimizer.
    pub fn optimizer(&self) -> &O {
        &self.opt
    }

    /// The wrapped optimizer, mutably (to change its learning rate).
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.opt
    }

    /// The variables it updates.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Host gradients unscaled in place: the values tensor ops give, and the same verdict,
    /// for finite gradients and for one inf among them.
    #[test]
    fn in_place_unscale_matches_tensor_ops() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let scaler = GradScaler::new(GradScalerConfig::default());
        for bad in [false, true] {
            let vars = [
                Var::randn(0f32, 1., (300, 7), &dev)?,
                Var::randn(0f32, 1., 70_001, &dev)?,
            ];
            let grads = |bad: bool| -> candle_core::Result<GradStore> {
                let mut g = GradStore::default();
                let mut a: Vec<f32> = (0..2100).map(|i| (i as f32 - 900.0) * 37.5).collect();
                if bad {
                    a[1234] = f32::INFINITY;
                }
                g.insert(vars[0].as_tensor(), Tensor::from_vec(a, (300, 7), &dev)?);
                let b: Vec<f32> = (0..70_001).map(|i| (i % 97) as f32 * 1e3).collect();
                g.insert(vars[1].as_tensor(), Tensor::from_vec(b, 70_001, &dev)?);
                Ok(g)
            };
            let (want, want_ok) = scaler.unscale_inner(&vars, grads(bad)?, false)?;
            let (got, got_ok) = scaler.unscale_inner(&vars, grads(bad)?, true)?;
            assert_eq!(want_ok, !bad);
            assert_eq!(got_ok, want_ok, "verdict with an inf: {bad}");
            for v in &vars {
                let (w, g) = (want.get(v.as_tensor()), got.get(v.as_tensor()));
                let (Some(w), Some(g)) = (w, g) else {
                    panic!("a gradient is missing");
                };
                let (w, g) = (
                    w.flatten_all()?.to_vec1::<f32>()?,
                    g.flatten_all()?.to_vec1::<f32>()?,
                );
                let same = w.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "in-place values differ from affine's");
            }
        }
        Ok(())
    }
}
