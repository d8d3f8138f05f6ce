//! What the routed kernels take ([`ExpertTable`](super::routed::ExpertTable)): where an
//! expert's blocks are, and the shape every routed expert of a layer shares.

use candle_core::quantized::GgmlDType;
use candle_core::{Result, Tensor};

use crate::linear::experts::grouped_fits;
use crate::linear::MAX_GROUP_EXPERTS;
use crate::tuning::KernelTuning;

/// The device addresses of one expert's gate, up and down blocks.
pub type ExpertAddrs = [u64; 3];

/// The most experts a layer of an [`ExpertTable`](super::routed::ExpertTable) may have (`MOE_ROUTE_MAX_EXPERTS` in
/// kernels/moe.cu).
pub const ROUTED_MAX_EXPERTS: usize = 256;

/// What every routed expert of a layer is: its projections' block types and widths, and how
/// the router's logits choose among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutedShape {
    /// The gate and up projections' block type (`(inter, hidden)` each).
    pub gate: GgmlDType,
    /// The down projection's block type (`(hidden, inter)`).
    pub down: GgmlDType,
    /// Model width.
    pub hidden: usize,
    /// Expert MLP width.
    pub inter: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The chosen experts' probabilities divided by their sum.
    pub renormalize: bool,
}

impl RoutedShape {
    /// Whether the routed kernels take experts of this shape on a row `x`: the grouped
    /// kernels' types and widths ([`qexperts_row_fits`](crate::linear::qexperts_row_fits)'s),
    /// at most [`MAX_GROUP_EXPERTS`] experts a token, x one row (F32, F16 or BF16) on a GPU.
    pub fn fits(&self, x: &Tensor, tuning: &KernelTuning) -> Result<bool> {
        Ok((1..=MAX_GROUP_EXPERTS).contains(&self.top_k)
            && grouped_fits(x, (self.gate, self.down), (self.hidden, self.inter), tuning)?)
    }
}
