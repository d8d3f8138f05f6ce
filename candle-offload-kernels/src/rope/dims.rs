//! The sizes the RoPE kernel works with, shared by the op and its CUDA launch.

use candle_core::{Layout, Result};

/// The op's name in errors.
pub(crate) const ROPE_QK: &str = "rope-qk";

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
    pub(crate) fn of(q: &Layout, k: &Layout, cs: &Layout) -> Result<Self> {
        let (b, t, hq, d) = q.shape().dims4()?;
        let (kb, kt, hk, kd) = k.shape().dims4()?;
        let (ct, width) = cs.shape().dims2()?;
        if (kb, kt, kd) != (b, t, d) || ct != t || width % 2 != 0 || width > d {
            candle_core::bail!(
                "{}: q {:?}, k {:?} and table {:?} do not fit together",
                ROPE_QK,
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
