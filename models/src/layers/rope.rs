//! RoPE tables (cos, sin) for a model's positions on one device (with a second, local set for
//! models whose sliding-window layers rotate with their own base, as Gemma 3's), and the
//! rotations that use them: plain, of q and k in one fused kernel, and the differentiable and
//! hand-written training forms.

use candle_core::{DType, Device, Result, Tensor, D};

/// RoPE tables (cos, sin) for positions `0..max_len`, on one device.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// cos and sin side by side per position, as the fused `rope_qk` reads them.
    table: Tensor,
    /// The tables of the layers that rotate with a local base, if the model has any.
    local: Option<Box<Rope>>,
}

impl Rope {
    /// Tables from inverse frequencies (one per pair of rotated dimensions), with cos and sin
    /// multiplied by `scale` (the attention factor of long-context scalings; 1 otherwise).
    pub fn from_inv_freq(
        inv_freq: &[f32],
        max_len: usize,
        scale: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let n = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq.to_vec(), (1, n), device)?;
        let t = Tensor::arange(0u32, max_len as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max_len, 1))?;
        let freqs = t.matmul(&inv_freq)?;
        let (cos, sin) = if scale == 1.0 {
            (freqs.cos()?, freqs.sin()?)
        } else {
            ((freqs.cos()? * scale)?, (freqs.sin()? * scale)?)
        };
        let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        let table = candle_offload::kernels::rope::rope_table(&cos, &sin)?;
        Ok(Self {
            cos,
            sin,
            table,
            local: None,
        })
    }

    /// These tables for the global layers and `local` for the layers that ask for the local
    /// ones ([`for_layer`](Self::for_layer)); both must cover the same positions.
    pub fn with_local(mut self, local: Rope) -> Result<Self> {
        if local.max_len() != self.max_len() {
            candle_core::bail!(
                "local RoPE tables cover {} positions, the global ones {}",
                local.max_len(),
                self.max_len()
            );
        }
        self.local = Some(Box::new(local));
        Ok(self)
    }

    /// The tables a layer rotates with: the local set when `local` and the model has one, these
    /// otherwise.
    pub fn for_layer(&self, local: bool) -> &Rope {
        match &self.local {
            Some(l) if local => l,
            _ => self,
        }
    }

    /// Rotates `x` (batch, heads, seq, head_dim) for positions `index_pos..`. Tables narrower
    /// than the head rotate its first dimensions only (partial rotary, as Phi-4-mini).
    pub fn apply(&self, x: &Tensor, index_pos: usize) -> Result<Tensor> {
        let (_, _, seq_len, _) = x.dims4()?;
        let cos = self.cos.narrow(0, index_pos, seq_len)?;
        let sin = self.sin.narrow(0, index_pos, seq_len)?;
        self.partial(x, |x| {
            candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin)
        })
    }

    /// Rotates `q` (batch, seq, q_heads, head_dim) and `k` (batch, seq, kv_heads, head_dim)
    /// for positions `index_pos..` in one fused kernel ([`candle_offload::kernels::rope::rope_qk`]),
    /// returning them as (batch, heads, seq, head_dim), contiguous: what [`apply`](Self::apply)
    /// gives for each after a transpose.
    pub fn apply_qk(&self, q: &Tensor, k: &Tensor, index_pos: usize) -> Result<(Tensor, Tensor)> {
        candle_offload::kernels::rope::rope_qk(q, k, &self.table_rows(index_pos, q.dim(1)?)?)
    }

    /// The fused table's rows (cos | sin) for positions `index_pos..index_pos + n`.
    pub(super) fn table_rows(&self, index_pos: usize, n: usize) -> Result<Tensor> {
        self.table.narrow(0, index_pos, n)
    }

    /// The columns the tables rotate (twice their width): the whole head unless the rotary
    /// is partial.
    pub fn rotary_width(&self) -> Result<usize> {
        Ok(2 * self.cos.dim(1)?)
    }

    /// Rotates `x` (batch, heads, seq, head_dim) from position 0, the tables as wide as the
    /// head, in one kernel and with no graph: for backward passes written by hand, whose
    /// inverse is [`unrotate_plain`](Self::unrotate_plain).
    pub fn apply_plain(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, seq_len, _) = x.dims4()?;
        candle_nn::rotary_emb::rope(
            &x.contiguous()?,
            &self.cos.narrow(0, 0, seq_len)?,
            &self.sin.narrow(0, 0, seq_len)?,
        )
    }

    /// The gradient of [`apply_plain`](Self::apply_plain)'s input for its output's gradient
    /// `g`: `g` rotated back.
    pub fn unrotate_plain(&self, g: &Tensor) -> Result<Tensor> {
        candle_offload::train::grad::rope_backward(g, &self.cos, &self.sin)
    }

    /// RoPE from position 0 for training: differentiable in `x`, with the tables treated as
    /// constants (no gradient computed for them).
    pub fn apply_diff(&self, x: &Tensor) -> Result<Tensor> {
        self.partial(x, |x| {
            candle_offload::train::grad::rope(&x.contiguous()?, &self.cos, &self.sin)
        })
    }

    fn partial(&self, x: &Tensor, rotate: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let width = x.dim(D::Minus1)?;
        let rotary = 2 * self.cos.dim(1)?;
        if rotary >= width {
            return rotate(x);
        }
        let rotated = rotate(&x.narrow(D::Minus1, 0, rotary)?)?;
        let pass = x.narrow(D::Minus1, rotary, width - rotary)?;
        Tensor::cat(&[rotated, pass.contiguous()?], D::Minus1)
    }

    /// The cos table (positions, rotated pairs).
    pub fn cos(&self) -> &Tensor {
        &self.cos
    }

    /// The sin table (positions, rotated pairs).
    pub fn sin(&self) -> &Tensor {
        &self.sin
    }

    /// cos and sin side by side per position, as the fused `rope_qk` reads them.
    pub(super) fn table(&self) -> &Tensor {
        &self.table
    }

    /// Positions the tables cover.
    pub fn max_len(&self) -> usize {
        self.cos.dim(0).unwrap_or(0)
    }
}
