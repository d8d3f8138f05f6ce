//! One inference step's attention over a KV cache, whatever the step ([`AttentionStep`]): it
//! chooses its kernel once, in [`AttentionStep::new`], from the device, the dtype, the new
//! positions, the scoring, the padding and the [`KernelTuning`] (the decode kernel, the
//! prompt's flash kernel, or the composition), and runs it with the output projection after
//! it. The model code calls one op and knows nothing of the kernels' forms.

use candle_core::{DType, Result, Tensor};

use crate::attention::decode::{
    decode_attention, decode_attention_at, decode_attention_padded, decode_attention_q8,
};
use crate::attention::dims::{RaggedDims, ATTENTION_MAX_HEAD_DIM};
use crate::attention::prompt::{prompt_attention, prompt_attention_supported};
use crate::linear::Linear;
use crate::tuning::KernelTuning;

/// The most new positions per step that attention runs through the decode kernel
/// ([`decode_attention`]: decode and short continuations); longer prompts use the prompt
/// kernel or the matmul composition, which are faster there.
pub const DECODE_ATTENTION_MAX_NEW: usize = 8;

/// The masks of a step, as the caller keeps them (made once per pass, shared by the layers).
pub trait StepMasks: std::fmt::Debug {
    /// Each batch row's left padding (empty: none).
    fn pads(&self) -> &[usize];
    /// [`pads`](Self::pads) as u32 on the step's device (what [`decode_attention_padded`]
    /// reads); `None` without padding.
    fn pads_tensor(&self) -> Result<Option<Tensor>>;
    /// The additive mask of a layer with this sliding window ((new, cached), or (batch, 1, new,
    /// cached) for a padded batch); `None` when nothing needs hiding.
    fn mask(&self, window: Option<usize>) -> Result<Option<Tensor>>;
}

/// What a step's attention computes, and the step it runs in.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA: fewer; MQA: one).
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Scores are divided by this.
    pub score_div: f64,
    /// Soft-capping of the scores before the mask (`cap · tanh(s / cap)`).
    pub softcap: Option<f64>,
    /// Keys further back than this are hidden (sliding-window layers).
    pub window: Option<usize>,
}

impl AttentionShape {
    /// The sizes a ragged decode step of this attention runs with
    /// ([`crate::attention::ragged_decode_attention`]; it has no soft cap, as the decode
    /// kernel has none).
    pub fn ragged_dims(&self) -> RaggedDims {
        RaggedDims {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            scale: 1.0 / self.score_div,
            window: self.window,
        }
    }
}

/// The kernel an [`AttentionStep`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttentionKernel {
    /// [`decode_attention`] over the cache's views (its padded, device-position and 8-bit
    /// forms as the step needs): q (batch, heads, new, head_dim).
    Decode,
    /// [`prompt_attention`], one flash-attention kernel over the cache's views.
    Prompt,
    /// The composition: grouped-query matmuls in F32, the soft cap, the mask and the softmax.
    Composition,
}

/// The step an attention runs in, the same for every layer of a pass.
#[derive(Debug, Clone, Copy)]
pub struct StepInfo<'a> {
    /// Positions already cached before the new ones.
    pub index_pos: usize,
    /// The step's fused ops (and the decode kernels) on.
    pub fused: bool,
    /// A captured step's position, read on the device (one u32).
    pub pos: Option<&'a Tensor>,
    /// The pass's masks and padding.
    pub masks: &'a dyn StepMasks,
    /// The kernel choices.
    pub tuning: &'a KernelTuning,
}

/// One inference step's attention in one layer: its shape, the step and the kernel chosen.
#[derive(Debug, Clone, Copy)]
pub struct AttentionStep<'a> {
    shape: AttentionShape,
    new: usize,
    step: StepInfo<'a>,
    kernel: AttentionKernel,
}

impl<'a> AttentionStep<'a> {
    /// The attention of `q` (batch, new, heads · head_dim, as the projection gives it) in
    /// `step`. Its kernel: the decode kernel for at most [`DECODE_ATTENTION_MAX_NEW`] new
    /// positions of a fused step (or a CPU step of one position), without a soft cap, and a
    /// padded batch's only past every row's padding with a head dim the kernel takes; else the
    /// prompt kernel without a soft cap, window or padding where
    /// [`prompt_attention_supported`]; else the composition.
    pub fn new(shape: AttentionShape, q: &Tensor, step: StepInfo<'a>) -> Result<Self> {
        let new = q.dim(1)?;
        let device = q.device();
        let pads = step.masks.pads();
        let cpu_step = device.is_cpu() && new == 1;
        let padded_decode =
            pads.iter().all(|&p| p <= step.index_pos) && shape.head_dim <= ATTENTION_MAX_HEAD_DIM;
        let decode = (step.fused || cpu_step)
            && shape.softcap.is_none()
            && new <= DECODE_ATTENTION_MAX_NEW
            && (pads.is_empty() || padded_decode);
        let kernel = if decode {
            AttentionKernel::Decode
        } else if shape.softcap.is_none()
            && shape.window.is_none()
            && pads.is_empty()
            && prompt_attention_supported(device, q.dtype(), shape.head_dim, step.tuning)
        {
            AttentionKernel::Prompt
        } else {
            AttentionKernel::Composition
        };
        Ok(Self {
            shape,
            new,
            step,
            kernel,
        })
    }

    /// The kernel it runs.
    pub fn kernel(&self) -> AttentionKernel {
        self.kernel
    }

    /// Whether the caller hands q, k and v over as the fused step's RoPE-into-the-cache kernel
    /// writes them (a fused decode step: [`crate::rope::rope_qk_cache`]).
    pub fn rotates_into_cache(&self) -> bool {
        self.step.fused && self.kernel == AttentionKernel::Decode
    }

    /// The attention of q (batch, heads, new, head_dim) over the cache's k and v (batch, kv
    /// heads, cached, head_dim), then `out`, the output projection, on its rows: by the
    /// chosen kernel, the decode kernel writing its rows quantized where `out` takes them so
    /// ([`Linear::takes_quantized_x`]). A captured step runs the decode kernel only, else
    /// fails.
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, out: &Linear) -> Result<Tensor> {
        let decode = self.kernel == AttentionKernel::Decode;
        // The decode kernel also quantizes its rows for the output projection.
        // q is (batch, heads, new, head_dim): the projection's rows are batch · new.
        let q8 = decode && out.takes_quantized_x(q.dim(0)? * q.dim(2)?);
        let rows = self.rows(q, k, v, q8)?;
        out.forward_with(&rows, decode && self.step.fused)
    }

    /// The attention's rows (batch, new, heads · head_dim) in q's dtype, before any output
    /// projection: [`forward`](Self::forward) without it (a ragged step's sequences attend
    /// one by one, and their rows go through the projection together).
    pub fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        self.rows(q, k, v, false)
    }

    /// The attention's rows by the chosen kernel; with `q8` (the decode kernel only) flat
    /// and quantized as the output projection takes them.
    fn rows(&self, q: &Tensor, k: &Tensor, v: &Tensor, q8: bool) -> Result<Tensor> {
        let masks = self.step.masks;
        if self.step.pos.is_some() && !self.rotates_into_cache() {
            candle_core::bail!(
                "this attention (soft-capping, a new position in a row's padding or unfused \
                 ops) cannot run in a captured step"
            );
        }
        let s = &self.shape;
        let b = q.dim(0)?;
        let hidden = s.n_heads * s.head_dim;
        match self.kernel {
            AttentionKernel::Decode => {
                // One kernel over the cache's views: no repeat, cast, copy, mask or softmax.
                let scale = 1.0 / s.score_div;
                let pads = masks.pads_tensor()?;
                let y = match (self.step.pos, pads) {
                    // Read on the device, so that each replay of a graph runs at its own.
                    (Some(pos), pads) => {
                        decode_attention_at(q, k, v, scale, s.window, pos, pads.as_ref(), q8)?
                    }
                    // Each row's padding is left out by the kernel itself.
                    (None, Some(pads)) => {
                        decode_attention_padded(q, k, v, scale, s.window, &pads, q8)?
                    }
                    (None, None) if q8 => decode_attention_q8(q, k, v, scale, s.window)?,
                    (None, None) => decode_attention(q, k, v, scale, s.window)?,
                };
                // With `q8` the rows come flat already (and their quantized copy is kept for
                // this very tensor); otherwise (b, new, heads, head_dim).
                if q8 {
                    Ok(y)
                } else {
                    y.reshape((b, self.new, hidden))
                }
            }
            AttentionKernel::Prompt => {
                // One flash-attention kernel over the cache's views: no F32 copies, no score
                // matrix, no mask or softmax launches.
                let y = prompt_attention(q, k, v, 1.0 / s.score_div, self.step.tuning)?;
                y.reshape((b, self.new, hidden))
            }
            AttentionKernel::Composition => self.composition(q, k, v, masks.mask(s.window)?),
        }
    }

    /// Grouped-query attention without repeating k and v: the `rep` query heads of each kv
    /// head are rows of one matmul against that head's keys, read from the cache's views as
    /// they are; scores, softmax and the weighted sum in F32, as the reference implementations
    /// do. Returns (batch, new, heads · head_dim) in q's dtype.
    ///
    /// On the CPU a long prompt runs in blocks of query rows ([`cpu_prompt_block`] rows),
    /// each against the keys up to its last row's position only (the mask is causal: later
    /// ones are masked out), so that the scores of a block stay small enough to reuse their
    /// memory and the masked half of a prompt's scores is never computed. A key left out
    /// would have added an exact zero to each sum, so the rows are those of one block.
    fn composition(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<Tensor>,
    ) -> Result<Tensor> {
        let s = &self.shape;
        let (b, seq_len) = (q.dim(0)?, self.new);
        let kv_len = k.dim(2)?;
        let in_dtype = q.dtype();
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let block = cpu_prompt_block(kv_len, s.n_heads);
        let y = match &mask {
            Some(m) if q.device().is_cpu() && seq_len > block && kv_len >= seq_len => {
                let mut parts = Vec::with_capacity(seq_len.div_ceil(block));
                for i0 in (0..seq_len).step_by(block) {
                    let n = block.min(seq_len - i0);
                    // Keys up to the block's last row's position.
                    let hi = kv_len - seq_len + i0 + n;
                    let m = if m.rank() == 4 {
                        m.narrow(2, i0, n)?.narrow(3, 0, hi)?
                    } else {
                        m.narrow(0, i0, n)?.narrow(1, 0, hi)?
                    };
                    let qb = q.narrow(2, i0, n)?;
                    let (kb, vb) = (k.narrow(2, 0, hi)?, v.narrow(2, 0, hi)?);
                    parts.push(self.attend_rows(&qb, &kb, &vb, Some(m))?);
                }
                Tensor::cat(&parts, 2)?
            }
            _ => self.attend_rows(&q, &k, &v, mask)?,
        };
        y.to_dtype(in_dtype)?
            .transpose(1, 2)?
            .reshape((b, seq_len, s.n_heads * s.head_dim))
    }

    /// [`composition`](Self::composition)'s arithmetic for q (batch, heads, rows, head_dim)
    /// against k and v (batch, kv heads, keys, head_dim), all F32, with `mask` (rows, keys)
    /// or (batch, 1, rows, keys): (batch, heads, rows, head_dim) F32.
    fn attend_rows(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<Tensor>,
    ) -> Result<Tensor> {
        let s = &self.shape;
        let (b, rows, kv_len) = (q.dim(0)?, q.dim(2)?, k.dim(2)?);
        let rep = s.n_heads / s.n_kv_heads;
        let q = q
            .contiguous()?
            .reshape((b, s.n_kv_heads, rep * rows, s.head_dim))?;
        let att = (q.matmul(&k.t()?)? / s.score_div)?;
        let att = match s.softcap {
            Some(cap) => ((&att / cap)?.tanh()? * cap)?,
            None => att,
        };
        let att = match mask {
            Some(m) => {
                // (rows, kv_len) or (b, 1, rows, kv_len) against (b, kv heads, rep, rows, kv_len).
                let m = if m.rank() == 4 { m.unsqueeze(1)? } else { m };
                att.reshape((b, s.n_kv_heads, rep, rows, kv_len))?
                    .broadcast_add(&m)?
                    .reshape((b, s.n_kv_heads, rep * rows, kv_len))?
            }
            None => att,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        att.matmul(v)?.reshape((b, s.n_heads, rows, s.head_dim))
    }
}

/// Bytes of F32 scores a block of a CPU prompt's query rows may take (all heads): below
/// glibc's largest threshold for mapping an allocation of its own (32 MiB), so that each
/// block's scores reuse the memory the block before freed instead of faulting in new pages.
pub const CPU_PROMPT_BLOCK_BYTES: usize = 16 << 20;

/// Query rows per block of a CPU prompt's attention over `kv_len` keys with `n_heads` query
/// heads: as many as [`CPU_PROMPT_BLOCK_BYTES`] of scores hold, at least 16.
pub fn cpu_prompt_block(kv_len: usize, n_heads: usize) -> usize {
    (CPU_PROMPT_BLOCK_BYTES / (4 * kv_len.max(1) * n_heads.max(1))).max(16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::LinearWeight;
    use candle_core::Device;

    /// Masks of a step without a sliding window: each row's padding, the causal mask of `new`
    /// positions after `index_pos`.
    #[derive(Debug)]
    struct TestMasks {
        pads: Vec<usize>,
        new: usize,
        index_pos: usize,
    }

    impl StepMasks for TestMasks {
        fn pads(&self) -> &[usize] {
            &self.pads
        }

        fn pads_tensor(&self) -> Result<Option<Tensor>> {
            if self.pads.is_empty() {
                return Ok(None);
            }
            let pads: Vec<u32> = self.pads.iter().map(|&p| p as u32).collect();
            Ok(Some(Tensor::new(pads, &Device::Cpu)?))
        }

        fn mask(&self, _window: Option<usize>) -> Result<Option<Tensor>> {
            let kv = self.index_pos + self.new;
            let m: Vec<f32> = (0..self.new)
                .flat_map(|i| {
                    (0..kv).map(move |j| {
                        if j > self.index_pos + i {
                            f32::NEG_INFINITY
                        } else {
                            0.0
                        }
                    })
                })
                .collect();
            Ok(Some(Tensor::from_vec(m, (self.new, kv), &Device::Cpu)?))
        }
    }

    /// A CPU tensor of `shape` with `sin(i * step + seed)` at flat index `i`.
    fn ramp(shape: (usize, usize, usize, usize), step: f32, seed: f32) -> Result<Tensor> {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        let v: Vec<f32> = (0..n).map(|i| (i as f32 * step + seed).sin()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
    }

    fn shape(head_dim: usize, softcap: Option<f64>) -> AttentionShape {
        AttentionShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim,
            score_div: (head_dim as f64).sqrt(),
            softcap,
            window: None,
        }
    }

    fn kernel(
        shape: AttentionShape,
        new: usize,
        index_pos: usize,
        pads: &[usize],
        fused: bool,
    ) -> Result<AttentionKernel> {
        let tuning = KernelTuning::default();
        let masks = TestMasks {
            pads: pads.to_vec(),
            new,
            index_pos,
        };
        let q = Tensor::zeros((1, new, 4 * shape.head_dim), DType::F32, &Device::Cpu)?;
        let info = StepInfo {
            index_pos,
            fused,
            pos: None,
            masks: &masks,
            tuning: &tuning,
        };
        Ok(AttentionStep::new(shape, &q, info)?.kernel())
    }

    /// The choice the models' attention made: the decode kernel for a fused step of at most 8
    /// new positions or a CPU step of one, not with a soft cap, and a padded batch's only past
    /// every row's padding with a head dim the kernel takes; else (on the CPU, where there is
    /// no prompt kernel) the composition.
    #[test]
    fn chooses_the_kernel_the_models_chose() -> Result<()> {
        use AttentionKernel::{Composition, Decode};
        let plain = shape(64, None);
        assert_eq!(kernel(plain, 1, 5, &[], true)?, Decode);
        assert_eq!(kernel(plain, 8, 5, &[], true)?, Decode);
        assert_eq!(kernel(plain, 9, 5, &[], true)?, Composition);
        assert_eq!(kernel(plain, 1, 5, &[], false)?, Decode);
        assert_eq!(kernel(plain, 2, 5, &[], false)?, Composition);
        assert_eq!(kernel(shape(64, Some(50.0)), 1, 5, &[], true)?, Composition);
        assert_eq!(kernel(plain, 1, 3, &[3, 0], true)?, Decode);
        assert_eq!(kernel(plain, 1, 2, &[3, 0], true)?, Composition);
        assert_eq!(kernel(shape(512, None), 1, 3, &[3, 0], true)?, Composition);
        assert_eq!(kernel(shape(512, None), 1, 3, &[], true)?, Decode);
        Ok(())
    }

    /// The decode kernel and the composition give the same rows through the output projection.
    #[test]
    fn decode_and_composition_agree() -> Result<()> {
        let (d, new, index_pos) = (32, 2, 5);
        let cached = index_pos + new;
        let dev = Device::Cpu;
        let ramp = |shape, seed| ramp(shape, 0.71, seed);
        let q = ramp((1, 4, new, d), 0.1)?;
        let k = ramp((1, 2, cached, d), 0.2)?;
        let v = ramp((1, 2, cached, d), 0.3)?;
        let w = ramp((1, 1, 8, 4 * d), 0.4)?.squeeze(0)?.squeeze(0)?;
        let out = Linear::new(LinearWeight::Dense(w), None, KernelTuning::default());
        let tuning = KernelTuning::default();
        let masks = TestMasks {
            pads: Vec::new(),
            new,
            index_pos,
        };
        let rows = Tensor::zeros((1, new, 4 * d), DType::F32, &dev)?;
        let step = |fused| -> Result<AttentionStep<'_>> {
            let info = StepInfo {
                index_pos,
                fused,
                pos: None,
                masks: &masks,
                tuning: &tuning,
            };
            AttentionStep::new(shape(d, None), &rows, info)
        };
        let (decode, composition) = (step(true)?, step(false)?);
        assert_eq!(decode.kernel(), AttentionKernel::Decode);
        assert_eq!(composition.kernel(), AttentionKernel::Composition);
        let a = decode.forward(&q, &k, &v, &out)?;
        let b = composition.forward(&q, &k, &v, &out)?;
        assert_eq!(a.dims(), &[1, new, 8]);
        let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "{diff}");
        Ok(())
    }

    /// A CPU prompt longer than a block of rows ([`cpu_prompt_block`]) runs in blocks, each
    /// against the keys up to its last row: the rows of the whole composition in one block,
    /// with and without a soft cap.
    #[test]
    fn a_long_cpu_prompt_runs_in_blocks_as_in_one() -> Result<()> {
        let (d, new, index_pos) = (16, 1000, 200);
        let cached = index_pos + new;
        assert!(
            cpu_prompt_block(cached, 4) < new,
            "one block would take it all"
        );
        let dev = Device::Cpu;
        let ramp = |shape, seed| ramp(shape, 0.37, seed);
        let q = ramp((1, 4, new, d), 0.1)?;
        let k = ramp((1, 2, cached, d), 0.2)?;
        let v = ramp((1, 2, cached, d), 0.3)?;
        let tuning = KernelTuning::default();
        let masks = TestMasks {
            pads: Vec::new(),
            new,
            index_pos,
        };
        let rows = Tensor::zeros((1, new, 4 * d), DType::F32, &dev)?;
        for softcap in [None, Some(5.0)] {
            let info = StepInfo {
                index_pos,
                fused: false,
                pos: None,
                masks: &masks,
                tuning: &tuning,
            };
            let step = AttentionStep::new(shape(d, softcap), &rows, info)?;
            assert_eq!(step.kernel(), AttentionKernel::Composition);
            let blocks = step.attend(&q, &k, &v)?;
            let whole = step
                .attend_rows(&q, &k, &v, masks.mask(None)?)?
                .transpose(1, 2)?
                .reshape((1, new, 4 * d))?;
            let diff = (blocks - whole)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-6, "{softcap:?}: {diff}");
        }
        Ok(())
    }
}
