//! The gated MLP, `down(act(gate(x)) · up(x))` (SwiGLU, GeGLU; separate or fused gate/up):
//! gate, up and the activation in one kernel on a decode step where they can.

use candle_core::{Result, Tensor, D};

use super::linear::{run, Linear};
use crate::family::UnitWeights;

/// The gate's activation in a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU: LLaMA, Phi-3).
    Silu,
    /// GELU, tanh approximation (GeGLU: Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// Exact GELU (erf; HF `gelu`).
    Gelu,
}

impl Activation {
    /// From an HF `hidden_act` / `hidden_activation` name.
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Self::Silu),
            "gelu_pytorch_tanh" | "gelu_tanh" | "gelu_new" | "gelu_fast" => Some(Self::GeluTanh),
            "gelu" => Some(Self::Gelu),
            _ => None,
        }
    }

    fn apply(self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Silu => candle_nn::ops::silu(xs),
            Self::GeluTanh => xs.gelu(),
            Self::Gelu => xs.gelu_erf(),
        }
    }
}

#[derive(Debug)]
pub(super) enum GateUp {
    Separate { gate: Linear, up: Linear },
    Fused(Linear),
}

/// `down(act(gate(x)) · up(x))`.
#[derive(Debug)]
pub struct GatedMlp {
    pub(super) gate_up: GateUp,
    pub(super) down: Linear,
    pub(super) act: Activation,
    pub(super) intermediate: usize,
}

impl GatedMlp {
    /// `gate_proj`, `up_proj` and `down_proj` under `w`, each dense or quantized as the unit
    /// holds it.
    pub fn load(
        w: UnitWeights<'_>,
        hidden: usize,
        intermediate: usize,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self {
            gate_up: GateUp::Separate {
                gate: w.pp("gate_proj").linear(hidden, intermediate, false)?,
                up: w.pp("up_proj").linear(hidden, intermediate, false)?,
            },
            down: w.pp("down_proj").linear(intermediate, hidden, false)?,
            act,
            intermediate,
        })
    }

    /// As [`load`](Self::load) with other names for gate, up and down (Mixtral's experts:
    /// `w1`, `w3`, `w2`).
    pub fn load_named(
        w: UnitWeights<'_>,
        [gate, up, down]: [&str; 3],
        hidden: usize,
        intermediate: usize,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self {
            gate_up: GateUp::Separate {
                gate: w.pp(gate).linear(hidden, intermediate, false)?,
                up: w.pp(up).linear(hidden, intermediate, false)?,
            },
            down: w.pp(down).linear(intermediate, hidden, false)?,
            act,
            intermediate,
        })
    }

    /// From dense tensors: `gate_up` (2·intermediate, hidden), gate rows first, and `down`
    /// (hidden, intermediate), such as one expert's views of fused expert stacks.
    pub fn from_fused_tensors(
        gate_up: Tensor,
        down: Tensor,
        intermediate: usize,
        act: Activation,
        tuning: candle_offload::KernelTuning,
    ) -> Result<Self> {
        Ok(Self {
            gate_up: GateUp::Fused(Linear::from_candle(
                &candle_nn::Linear::new(gate_up, None),
                tuning,
            )),
            down: Linear::from_candle(&candle_nn::Linear::new(down, None), tuning),
            act,
            intermediate,
        })
    }

    /// One fused `fused` projection (rows: gate, then up) and `down_proj` under `w` (Phi-3).
    pub fn load_fused(
        w: UnitWeights<'_>,
        fused: &str,
        hidden: usize,
        intermediate: usize,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self {
            gate_up: GateUp::Fused(w.pp(fused).linear(hidden, 2 * intermediate, false)?),
            down: w.pp("down_proj").linear(intermediate, hidden, false)?,
            act,
            intermediate,
        })
    }

    /// The projection that reads its input (the gate, or the fused gate/up).
    pub(super) fn first(&self) -> &Linear {
        match &self.gate_up {
            GateUp::Separate { gate, .. } => gate,
            GateUp::Fused(l) => l,
        }
    }

    fn run(&self, xs: &Tensor, train: bool, fused: bool) -> Result<Tensor> {
        if let (false, true, Activation::Silu, GateUp::Separate { gate, up }) =
            (train, fused, self.act, &self.gate_up)
        {
            // Gate, up and SiLU · mul in one kernel where the linear op has one for them.
            if let Some(x) = Linear::silu_gate_up(xs, gate, up, Some(&self.down))? {
                return run(&self.down, &x, train, fused);
            }
        }
        let (gate, up) = match &self.gate_up {
            GateUp::Separate { gate, up } if !train => {
                let mut ys = Linear::forward_each(xs, &[gate, up], fused)?.into_iter();
                let mut next = || ys.next().expect("two outputs");
                (next(), next())
            }
            GateUp::Separate { gate, up } => {
                (run(gate, xs, train, fused)?, run(up, xs, train, fused)?)
            }
            GateUp::Fused(l) => {
                let both = run(l, xs, train, fused)?;
                let i = self.intermediate;
                (both.narrow(D::Minus1, 0, i)?, both.narrow(D::Minus1, i, i)?)
            }
        };
        // Views of a fused gate/up projection would need copies first: those stay unfused
        // in inference (training's op copies them; its backward needs them contiguous anyway).
        let silu = fused && self.act == Activation::Silu;
        let x = if silu && train {
            candle_offload::kernels::activation::swiglu(&gate, &up)?
        } else if silu && gate.is_contiguous() && up.is_contiguous() {
            candle_offload::kernels::activation::silu_mul(&gate, &up)?
        } else {
            (self.act.apply(&gate)? * up)?
        };
        run(&self.down, &x, train, fused)
    }

    /// Inference.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.run(xs, false, false)
    }

    /// Inference with SiLU · up as one fused op ([`candle_offload::kernels::activation::silu_mul`]) where the
    /// activation is SiLU and gate and up are separate projections (otherwise as
    /// [`forward`](Self::forward)).
    pub fn forward_fused(&self, xs: &Tensor) -> Result<Tensor> {
        self.run(xs, false, true)
    }

    /// Training: each projection one 2-D matmul (see [`linear_2d`](super::linear_2d)), the
    /// activation composed of Candle ops.
    pub fn forward_train(&self, xs: &Tensor) -> Result<Tensor> {
        self.run(xs, true, false)
    }

    /// Training with SiLU · up as one op with its own backward kernel
    /// ([`candle_offload::kernels::activation::swiglu`]) where the activation is SiLU (otherwise as
    /// [`forward_train`](Self::forward_train)).
    pub fn forward_train_fused(&self, xs: &Tensor) -> Result<Tensor> {
        self.run(xs, true, true)
    }
}
