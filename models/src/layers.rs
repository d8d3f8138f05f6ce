//! Building blocks shared by the model families: RoPE tables, the KV cache, causal and
//! sliding-window masks, RMSNorm (plain and Gemma's `1 + w`), self-attention (separate or fused
//! q/k/v, GQA/MQA, optional logit soft-capping and sliding window) with its training path, the
//! gated MLP (SwiGLU, GeGLU; separate or fused gate/up), and the pre-norm decoder block that
//! LLaMA, Phi-3 and Gemma 1/2 are all instances of.
//!
//! A family file picks and names these pieces (`vb.pp(..)` names mirror its checkpoint keys);
//! nothing here knows a tensor name beyond what the caller passes in.

use std::sync::Mutex;

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use candle_offload::kernels::attention::{flash_attention, flash_attention_supported};
use candle_offload::KernelTuning;

use crate::config::Config;
use crate::family::{DecoderBlock, Hidden, StepCtx, TrainCtx, UnitWeights};

mod by_hand;

/// RoPE tables (cos, sin) for positions `0..max_len`, on one device.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// cos and sin side by side per position, as the fused `rope_qk` reads them.
    table: Tensor,
}

impl Rope {
    /// The tables of `cfg` (base `rope_theta`, Llama 3 scaling where configured).
    pub fn new(cfg: &Config, max_len: usize, dtype: DType, device: &Device) -> Result<Self> {
        Self::from_inv_freq(&cfg.rope_inv_freq(), max_len, 1.0, dtype, device)
    }

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
        Ok(Self { cos, sin, table })
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
    fn table_rows(&self, index_pos: usize, n: usize) -> Result<Tensor> {
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

    /// Positions the tables cover.
    pub fn max_len(&self) -> usize {
        self.cos.dim(0).unwrap_or(0)
    }
}

/// One layer's keys and values: buffers (batch, kv heads, positions, head_dim) allocated for
/// the whole context on first use (so that decoding does not grow, copy or fragment them),
/// and how many positions they hold. `append` is candle-nn's `KvCache::append` (a model of
/// its own can take this cache as it would take that one); `append_rotated` is the fused
/// decode step's way in: RoPE and both writes in one kernel on a GPU
/// ([`candle_offload::kernels::rope::rope_qk_cache`]).
#[derive(Debug, Clone)]
pub struct KvCache {
    /// The key and value buffers, once allocated.
    bufs: Option<(Tensor, Tensor)>,
    len: usize,
    /// Positions the buffers get when first allocated, and what they grow by when full.
    max_len: usize,
}

impl KvCache {
    /// An empty cache for `max_len` positions (it grows by as many if more come).
    pub fn new(max_len: usize) -> Self {
        Self {
            bufs: None,
            len: 0,
            max_len: max_len.max(1),
        }
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the buffers hold (allocated or not).
    pub fn capacity(&self) -> usize {
        self.bufs
            .as_ref()
            .and_then(|(k, _)| k.dim(2).ok())
            .unwrap_or(self.max_len)
    }

    /// The keys' whole buffer, once allocated.
    pub fn k_buffer(&self) -> Option<&Tensor> {
        self.bufs.as_ref().map(|(k, _)| k)
    }

    /// The cached keys (b, kv heads, len, head_dim): a view of the buffer.
    pub fn k(&self) -> Result<Option<Tensor>> {
        self.bufs
            .as_ref()
            .map(|(k, _)| k.narrow(2, 0, self.len))
            .transpose()
    }

    /// The cached values, as [`k`](Self::k).
    pub fn v(&self) -> Result<Option<Tensor>> {
        self.bufs
            .as_ref()
            .map(|(_, v)| v.narrow(2, 0, self.len))
            .transpose()
    }

    /// The buffers, with room for `t` more positions of `(b, heads, d)` in `like`'s dtype and
    /// device: allocated (zeros) on first use, grown by `max_len` positions while they are
    /// full. On an error the cache is as it was.
    fn make_room(
        &mut self,
        (b, heads, d): (usize, usize, usize),
        t: usize,
        like: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        // In the GPU's pool for long-lived buffers: the first append comes in the middle of
        // a prompt's activations, whose memory the buffers would otherwise keep held.
        let alloc = |n| {
            candle_offload::diag::long_lived(like.device(), || {
                Tensor::zeros((b, heads, n, d), like.dtype(), like.device())
            })
        };
        let (mut k, mut v) = match &self.bufs {
            Some(kv) => kv.clone(),
            None => {
                let n = self.max_len.max(t);
                (alloc(n)?, alloc(n)?)
            }
        };
        while self.len + t > k.dim(2)? {
            k = Tensor::cat(&[&k, &alloc(self.max_len)?], 2)?;
            v = Tensor::cat(&[&v, &alloc(self.max_len)?], 2)?;
        }
        self.bufs = Some((k.clone(), v.clone()));
        Ok((k, v))
    }

    /// `t` more positions written into the buffers `(k, v)`: every cached position's keys and
    /// values (views).
    fn advance(&mut self, t: usize, (k, v): (Tensor, Tensor)) -> Result<(Tensor, Tensor)> {
        self.len += t;
        Ok((k.narrow(2, 0, self.len)?, v.narrow(2, 0, self.len)?))
    }

    /// Appends `k` and `v` (b, kv heads, t, head_dim) and returns every cached position's
    /// keys and values (views of the buffers).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, heads, t, d) = k.dims4()?;
        let (kb, vb) = self.make_room((b, heads, d), t, k)?;
        kb.slice_set(k, 2, self.len)?;
        vb.slice_set(v, 2, self.len)?;
        self.advance(t, (kb, vb))
    }

    /// The fused step's append: q and k (b, t, heads, head_dim, as the projections give them)
    /// rotated by `rope` for positions `index_pos..`, k and v (b, t, kv heads, head_dim)
    /// written into the buffers at the cache's end. Returns q rotated (b, heads, t, head_dim)
    /// and every cached position's keys and values.
    pub fn append_rotated(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: &Rope,
        index_pos: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, heads, d) = k.dims4()?;
        let (kb, vb) = self.make_room((b, heads, d), t, k)?;
        let table = rope.table_rows(index_pos, t)?;
        let q =
            candle_offload::kernels::rope::rope_qk_cache(q, k, v, &table, (&kb, &vb), self.len)?;
        let (k, v) = self.advance(t, (kb, vb))?;
        Ok((q, k, v))
    }

    /// [`append_rotated`](Self::append_rotated) at the position `pos` holds on the device (one
    /// u32, which must equal [`len`](Self::len): a captured decode step, whose replays each
    /// write their own), for a cache whose buffers already have room for `t` more positions.
    /// Returns q rotated and the buffers' whole keys and values: the attention reads as many
    /// positions as `pos` says ([`candle_offload::kernels::attention::decode_attention_at`]).
    pub fn append_rotated_at(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: &Rope,
        pos: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let t = k.dim(1)?;
        let Some((kb, vb)) = self
            .bufs
            .clone()
            .filter(|_| self.len + t <= self.capacity())
        else {
            candle_core::bail!(
                "a captured step needs the cache allocated with room for {} positions",
                self.len + t
            );
        };
        let q =
            candle_offload::kernels::rope::rope_qk_cache_at(q, k, v, &rope.table, (&kb, &vb), pos)?;
        self.len += t;
        Ok((q, kb, vb))
    }

    /// Counts `t` positions that a replayed step wrote into the buffers (the host's record of
    /// what the device holds).
    pub(crate) fn replayed(&mut self, t: usize) {
        self.len += t;
    }

    /// Forgets the positions after the first `len` (a capture that failed: nothing ran).
    pub(crate) fn rewind(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// Per-layer key/value cache, on the device, allocated once for the whole context (so that
/// decoding does not grow, copy or fragment it).
#[derive(Debug, Clone)]
pub struct Cache {
    pub(crate) kvs: Vec<KvCache>,
}

impl Cache {
    /// An empty cache for `n_layers` layers and up to `max_len` positions.
    pub fn new(n_layers: usize, max_len: usize) -> Self {
        Self {
            kvs: (0..n_layers).map(|_| KvCache::new(max_len)).collect(),
        }
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.kvs.first().map_or(0, KvCache::len)
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Moves layer `l`'s keys and values to `device` in `dtype` where they are elsewhere (a
    /// host layer's cache between the GPU, which runs prompts, and the host, which runs
    /// decode steps); nothing to do for an empty cache or one already there.
    pub(crate) fn place(&mut self, l: usize, device: &Device, dtype: DType) -> Result<()> {
        let kv = &mut self.kvs[l];
        // `k` and `v` are views of buffers sized for the whole context: cut and convert them
        // where they are, so that only the cached positions cross (a view's `to_device` copies
        // its whole storage), and let the views go before the new buffers are allocated.
        // Checked on the buffer, not on views of it: this runs before every host layer.
        match kv.k_buffer() {
            Some(data) if !(data.device().same_device(device) && data.dtype() == dtype) => {}
            _ => return Ok(()),
        }
        let moved = {
            let (Some(k), Some(v)) = (kv.k()?, kv.v()?) else {
                return Ok(());
            };
            let cross = |t: Tensor| t.to_dtype(dtype)?.contiguous()?.to_device(device);
            (cross(k)?, cross(v)?)
        };
        let cap = kv.capacity();
        *kv = KvCache::new(cap);
        kv.append(&moved.0, &moved.1)?;
        Ok(())
    }
}

/// The causal mask (F32, 0 or -inf) for `seq_len` new positions after `index_pos` cached ones.
pub fn causal_mask(seq_len: usize, index_pos: usize, device: &Device) -> Result<Tensor> {
    window_mask(seq_len, index_pos, None, device)
}

/// The causal mask, also hiding keys `window` or more positions behind the query when a
/// sliding window is given (query `i` sees key `j` when `j <= i` and `i - j < window`, as in
/// transformers).
pub fn window_mask(
    seq_len: usize,
    index_pos: usize,
    window: Option<usize>,
    device: &Device,
) -> Result<Tensor> {
    let kv_len = index_pos + seq_len;
    let mask: Vec<f32> = (0..seq_len)
        .flat_map(|i| {
            let q = index_pos + i;
            (0..kv_len).map(move |j| {
                let outside = window.is_some_and(|w| q >= j + w);
                if j > q || outside {
                    f32::NEG_INFINITY
                } else {
                    0.
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (seq_len, kv_len), device)
}

/// The masks of one forward pass on one device, built on first use and shared by its layers
/// (one per distinct sliding window).
#[derive(Debug)]
pub struct Masks {
    seq_len: usize,
    index_pos: usize,
    /// Left padding per batch row (positions `..pads[r]` of row r are not tokens); empty: none.
    pads: Vec<usize>,
    device: Device,
    built: Mutex<Vec<(Option<usize>, Option<Tensor>)>>,
    /// `pads` as a u32 tensor on `device`, made on first use.
    pads_tensor: std::sync::OnceLock<Tensor>,
}

impl Masks {
    /// Masks for `seq_len` new positions after `index_pos` cached ones.
    pub fn new(seq_len: usize, index_pos: usize, device: &Device) -> Self {
        Self::padded(seq_len, index_pos, &[], device)
    }

    /// [`new`](Self::new) for a batch whose row r starts with `pads[r]` padding positions
    /// (left-padded prompts of different lengths): no position attends to a row's padding,
    /// except a padding position to itself (so that its own, unused, output stays finite).
    /// Rows keep the padded positions for RoPE: attention scores depend only on the distance
    /// between two positions, so a row's shift by its padding changes nothing.
    pub fn padded(seq_len: usize, index_pos: usize, pads: &[usize], device: &Device) -> Self {
        let pads = if pads.iter().any(|&p| p > 0) {
            pads.to_vec()
        } else {
            Vec::new()
        };
        Self {
            seq_len,
            index_pos,
            pads,
            device: device.clone(),
            built: Mutex::new(Vec::new()),
            pads_tensor: std::sync::OnceLock::new(),
        }
    }

    /// These masks with the counts [`pads_tensor`](Self::pads_tensor) gives already made: a
    /// captured step's, which live in the graph's inputs so that each replay reads its own.
    pub fn with_pads_tensor(self, counts: Tensor) -> Self {
        if self.is_padded() {
            let _ = self.pads_tensor.set(counts);
        }
        self
    }

    /// Whether some row has padding (the masks are then per row: (batch, 1, new, cached)).
    pub fn is_padded(&self) -> bool {
        !self.pads.is_empty()
    }

    /// Per batch row, its left padding positions (empty: no padding).
    pub fn pads(&self) -> &[usize] {
        &self.pads
    }

    /// [`pads`](Self::pads) as a u32 tensor on this pass's device (what
    /// [`candle_offload::kernels::attention::decode_attention_padded`] reads), made once and shared by the
    /// layers; `None` without padding.
    pub fn pads_tensor(&self) -> Result<Option<Tensor>> {
        if self.pads.is_empty() {
            return Ok(None);
        }
        if let Some(t) = self.pads_tensor.get() {
            return Ok(Some(t.clone()));
        }
        let counts = self
            .pads
            .iter()
            .map(|&p| u32::try_from(p).unwrap_or(u32::MAX))
            .collect::<Vec<_>>();
        let t = Tensor::new(counts, &self.device)?;
        Ok(Some(self.pads_tensor.get_or_init(|| t).clone()))
    }

    /// Whether [`get(None)`](Self::get) is the plain causal mask of a fresh sequence (no
    /// cached positions, no padding): query `i` sees keys `0..=i`.
    pub fn is_plain_causal(&self) -> bool {
        self.index_pos == 0 && !self.is_padded()
    }

    /// The mask for a layer with this sliding window (`None`: plain causal); `None` when
    /// nothing needs hiding (one new position that sees every cached one).
    pub fn get(&self, window: Option<usize>) -> Result<Option<Tensor>> {
        let mut built = self.built.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, m)) = built.iter().find(|(w, _)| *w == window) {
            return Ok(m.clone());
        }
        let kv_len = self.index_pos + self.seq_len;
        if self.is_padded() {
            let base = window_mask(self.seq_len, self.index_pos, window, &Device::Cpu)?
                .to_vec2::<f32>()?;
            let mut rows = Vec::with_capacity(self.pads.len() * self.seq_len * kv_len);
            for &pad in &self.pads {
                for (i, row) in base.iter().enumerate() {
                    let q = self.index_pos + i;
                    rows.extend(row.iter().enumerate().map(|(j, &m)| {
                        if j < pad && j != q {
                            f32::NEG_INFINITY
                        } else if j < pad {
                            0.0
                        } else {
                            m
                        }
                    }));
                }
            }
            let mask = Tensor::from_vec(
                rows,
                (self.pads.len(), 1, self.seq_len, kv_len),
                &self.device,
            )?;
            built.push((window, Some(mask.clone())));
            return Ok(Some(mask));
        }
        let needed = self.seq_len > 1 || window.is_some_and(|w| kv_len > w);
        let mask = if needed {
            Some(window_mask(
                self.seq_len,
                self.index_pos,
                window,
                &self.device,
            )?)
        } else {
            None
        };
        built.push((window, mask.clone()));
        Ok(mask)
    }
}

/// Looks `ids` up in the embedding matrix `{unit}.weight` (vocab, hidden) of `vb`.
pub fn embed_lookup(cfg: &Config, unit: &str, w: &UnitWeights<'_>, ids: &Tensor) -> Result<Tensor> {
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let w = w.pp(unit);
    if let Some(q) = w.quantized("weight", &[vocab, hidden])? {
        return q.embedding(ids)?.to_dtype(w.vb().dtype());
    }
    let m = w.vb().get((vocab, hidden), "weight")?;
    candle_nn::Embedding::new(m, hidden).forward(ids)
}

/// A linear layer with or without bias, dense from `vb`, run with `tuning`'s kernels.
pub fn linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
    tuning: KernelTuning,
) -> Result<Linear> {
    let l = if bias {
        candle_nn::linear(in_dim, out_dim, vb)?
    } else {
        candle_nn::linear_no_bias(in_dim, out_dim, vb)?
    };
    Ok(Linear::Dense(l, tuning))
}

/// The most new positions per step that attention runs through the fused
/// [`candle_offload::kernels::attention::decode_attention`] kernel (decode and short continuations); longer
/// prompts use the matmul composition, which is faster there.
pub const DECODE_ATTENTION_MAX_NEW: usize = 8;

/// A linear layer whose weight is dense (a Candle `Linear`) or GGML-quantized (a `QMatMul`
/// over the blocks as the unit holds them), as [`UnitWeights::linear`] finds it, with the
/// kernel choices it runs with (the runtime's [`candle_offload::Tuning::kernels`]).
#[derive(Debug, Clone)]
pub enum Linear {
    /// A dense weight.
    Dense(candle_nn::Linear, KernelTuning),
    /// Quantized blocks, multiplied as they are; the bias, if any, dense.
    Quantized {
        /// The matmul over the blocks.
        weight: QMatMul,
        /// The bias.
        bias: Option<Tensor>,
        /// The kernel choices.
        tuning: KernelTuning,
    },
}

impl Linear {
    /// The kernel choices it runs with.
    pub fn tuning(&self) -> &KernelTuning {
        match self {
            Self::Dense(_, t) | Self::Quantized { tuning: t, .. } => t,
        }
    }

    /// `xs · wᵀ + b`; a quantized weight computes in F32 and returns `xs`'s dtype (a prompt's
    /// rows on a GPU: in 16 bits through cuBLAS, [`candle_offload::kernels::gemm::qlinear_prefill`]). A
    /// dense F16/BF16 weight against at most [`candle_offload::kernels::linear::cpu_dense::MAX_ROWS`] rows on the
    /// CPU (a decode step) goes through [`candle_offload::kernels::linear::cpu_dense::forward`] (F32
    /// accumulation, each weight read once, on every core); anything else (F32 weights too)
    /// through Candle's matmul.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(l, t) => {
                match candle_offload::kernels::linear::cpu_dense::forward(l.weight(), xs, t)? {
                    Some(y) => with_bias(y, l.bias()),
                    None => {
                        before_candle_matmul(xs);
                        l.forward(xs)
                    }
                }
            }
            Self::Quantized {
                weight,
                bias,
                tuning,
            } => {
                let blocks = match weight {
                    QMatMul::QTensor(q) => Some(q),
                    _ => None,
                };
                // A prompt's rows on a GPU: 16-bit weights and cuBLAS (see qlinear_prefill).
                let gemm = match blocks {
                    Some(q) => candle_offload::kernels::gemm::qlinear_prefill(xs, q, tuning)?,
                    None => None,
                };
                let y = match gemm {
                    Some(y) => y,
                    None => quantized_in_f32(weight, blocks, xs, tuning)?,
                };
                with_bias(y, bias.as_ref())
            }
        }
    }

    /// Inference; with `fused`, a dense weight against at most 8 rows (a decode step) on a GPU
    /// goes through [`candle_offload::kernels::linear::linear_small`] (one bandwidth-bound kernel instead
    /// of cuBLAS's split-K GEMM and its reduction).
    ///
    /// Quantized weights of a block type the kernel has go through
    /// [`candle_offload::kernels::linear::qlinear_small`] the same way (dequantized in registers; variants 3
    /// and 4 quantize x to 8 bits). The output head uses this too.
    pub fn forward_step(&self, xs: &Tensor, fused: bool) -> Result<Tensor> {
        if !fused {
            return self.forward(xs);
        }
        let (y, bias) = match self {
            Self::Dense(l, _) => {
                let width = xs.dim(D::Minus1)?.max(1);
                let rows = xs.elem_count() / width;
                if !(xs.device().is_cuda() && rows <= 8 && l.weight().dtype() == xs.dtype()) {
                    return self.forward(xs);
                }
                (
                    candle_offload::kernels::linear::linear_small(xs, l.weight())?,
                    l.bias(),
                )
            }
            Self::Quantized {
                weight: QMatMul::QTensor(q),
                bias,
                tuning,
            } if candle_offload::kernels::linear::qlinear_small_fits(xs, &[q], tuning)? => (
                candle_offload::kernels::linear::qlinear_small(xs, q, tuning)?,
                bias.as_ref(),
            ),
            Self::Quantized { .. } => return self.forward(xs),
        };
        with_bias(y, bias)
    }

    /// [`forward_train`](Self::forward_train) when `train`, else [`forward`](Self::forward).
    pub fn run(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.run_with(xs, train, false)
    }

    /// [`forward_train`](Self::forward_train) when `train`, else
    /// [`forward_step`](Self::forward_step) with `fused`.
    pub fn run_with(&self, xs: &Tensor, train: bool, fused: bool) -> Result<Tensor> {
        if train {
            self.forward_train(xs)
        } else {
            self.forward_step(xs, fused)
        }
    }

    /// The training form (see [`linear_2d`]); quantized weights have none.
    pub fn forward_train(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(l, _) => linear_2d(l, xs),
            Self::Quantized { .. } => {
                candle_core::bail!("quantized weights cannot be trained; load the model dense")
            }
        }
    }
}

/// The weights of layers that a decode step multiplies in one launch.
enum OneLaunch<'a> {
    /// Dense, for [`candle_offload::kernels::linear::linear_small_multi`] /
    /// [`candle_offload::kernels::linear::linear_silu_mul`].
    Dense(Vec<&'a Tensor>),
    /// GGML blocks of one type, for [`candle_offload::kernels::linear::qlinear_small_multi`] /
    /// [`candle_offload::kernels::linear::qlinear_silu_mul`].
    Blocks(Vec<&'a candle_core::quantized::QTensor>),
}

/// Before a matmul through Candle (its CPU matmuls run on a pool of threads of its own): on
/// the CPU, the library's matmul workers park instead of spinning beside it.
fn before_candle_matmul(xs: &Tensor) {
    if xs.device().is_cpu() {
        candle_offload::kernels::pool::park_idle_workers();
    }
}

/// On the CPU, one row of `xs` against several projections of GGML blocks in one pass of the
/// matmul pool ([`candle_offload::kernels::linear::cpu_quant::forward_many`]: each output the number
/// [`Linear::forward`] gives), their biases added; `None` where that does not apply.
fn cpu_blocks_many(xs: &Tensor, ls: &[&Linear]) -> Result<Option<Vec<Tensor>>> {
    if !xs.device().is_cpu() {
        return Ok(None);
    }
    let ws: Option<Vec<_>> = ls
        .iter()
        .map(|l| match l {
            Linear::Quantized {
                weight: QMatMul::QTensor(q),
                ..
            } => Some(q),
            _ => None,
        })
        .collect();
    let Some(ws) = ws else {
        return Ok(None);
    };
    let Some(ys) =
        candle_offload::kernels::linear::cpu_quant::forward_many(&ws, xs, ls[0].tuning())?
    else {
        return Ok(None);
    };
    ys.into_iter()
        .zip(ls)
        .map(|(y, l)| match l {
            Linear::Quantized { bias, .. } => with_bias(y, bias.as_ref()),
            Linear::Dense(..) => Ok(y),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// `xs · wᵀ` for a quantized weight in F32, returned in `xs`'s dtype: Q4_1 and Q8_0 blocks
/// (`blocks`, the weight's) on the CPU through the library's SIMD matmul, otherwise Candle's.
fn quantized_in_f32(
    weight: &QMatMul,
    blocks: Option<&std::sync::Arc<candle_core::quantized::QTensor>>,
    xs: &Tensor,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    let x32 = xs.to_dtype(DType::F32)?;
    let fast = match blocks {
        Some(q) => candle_offload::kernels::linear::cpu_quant::forward(q, &x32, tuning)?,
        None => None,
    };
    let y = match fast {
        Some(y) => y,
        None => {
            before_candle_matmul(&x32);
            weight.forward(&x32)?
        }
    };
    y.to_dtype(xs.dtype())
}

/// `y + b` broadcast over y's rows, the bias cast to y's dtype; `y` itself without a bias.
fn with_bias(y: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?),
        None => Ok(y),
    }
}

/// The weights of `ls` when a decode step can multiply them in one launch: `xs` on a GPU with
/// at most 8 rows, every layer without bias, and either all dense in `xs`'s dtype or all
/// blocks the quantized kernel takes.
fn one_launch_weights<'a>(xs: &Tensor, ls: &[&'a Linear]) -> Result<Option<OneLaunch<'a>>> {
    let rows = xs.elem_count() / xs.dim(D::Minus1)?.max(1);
    if !xs.device().is_cuda() || rows > 8 {
        return Ok(None);
    }
    let dense: Option<Vec<_>> = ls
        .iter()
        .map(|l| match l {
            Linear::Dense(d, _) if d.bias().is_none() && d.weight().dtype() == xs.dtype() => {
                Some(d.weight())
            }
            _ => None,
        })
        .collect();
    if let Some(ws) = dense {
        return Ok(Some(OneLaunch::Dense(ws)));
    }
    let blocks: Option<Vec<_>> = ls
        .iter()
        .map(|l| match l {
            Linear::Quantized {
                weight: QMatMul::QTensor(q),
                bias: None,
                ..
            } => Some(q.as_ref()),
            _ => None,
        })
        .collect();
    Ok(match blocks {
        Some(ws)
            if candle_offload::kernels::linear::qlinear_small_fits(xs, &ws, ls[0].tuning())? =>
        {
            Some(OneLaunch::Blocks(ws))
        }
        _ => None,
    })
}

/// Whether `l` multiplies GGML blocks by x quantized in a launch of its own (the decode
/// kernels' variant 4): a norm right before it then quantizes its rows instead
/// ([`candle_offload::kernels::norm::rms_norm_residual_q8`]).
fn takes_quantized_x(l: &Linear) -> bool {
    match l {
        Linear::Quantized {
            weight: QMatMul::QTensor(q),
            tuning,
            ..
        } => {
            q.device().is_cuda()
                && tuning.qlinear_variant(q.dtype()) == candle_offload::QlinearVariant::V4
        }
        _ => false,
    }
}

/// A linear layer on (batch, seq, in) as one (batch·seq, in) matmul, for training: the weight
/// gradient is then one GEMM, where `Linear::forward` broadcasts the weight over the batch and
/// its backward pass materializes and sums a gradient per sequence.
pub fn linear_2d(l: &candle_nn::Linear, xs: &Tensor) -> Result<Tensor> {
    let (b, t, d) = xs.dims3()?;
    let y = xs.reshape((b * t, d))?.matmul(&l.weight().t()?)?;
    let y = match l.bias() {
        Some(bias) => y.broadcast_add(bias)?,
        None => y,
    };
    y.reshape((b, t, ()))
}

/// `cap · tanh(x / cap)` (Gemma 2's attention and final logit soft-capping).
pub fn soft_cap(x: &Tensor, cap: f64) -> Result<Tensor> {
    (x / cap)?.tanh()? * cap
}

/// A normalisation layer: RMSNorm (with `offset` 1 the weight is applied as `1 + w` in F32,
/// as Gemma does) or LayerNorm.
#[derive(Debug, Clone)]
pub struct Norm {
    kind: NormKind,
    f32_compute: bool,
}

#[derive(Debug, Clone)]
enum NormKind {
    Rms(candle_nn::RmsNorm),
    Layer(candle_nn::LayerNorm),
}

impl Norm {
    /// RMSNorm: `weight` of width `size` from `vb`, in `dtype`.
    pub fn load(size: usize, eps: f64, offset: f64, vb: VarBuilder, dtype: DType) -> Result<Self> {
        if offset == 0.0 {
            return Ok(Self {
                kind: NormKind::Rms(candle_nn::rms_norm(size, eps, vb.to_dtype(dtype))?),
                f32_compute: false,
            });
        }
        let w = vb.to_dtype(DType::F32).get(size, "weight")?;
        let w = (w + offset)?;
        Ok(Self {
            kind: NormKind::Rms(candle_nn::RmsNorm::new(w, eps)),
            f32_compute: true,
        })
    }

    /// LayerNorm: `weight` and `bias` of width `size` from `vb`, in `dtype`.
    pub fn layer_norm(size: usize, eps: f64, vb: VarBuilder, dtype: DType) -> Result<Self> {
        Ok(Self {
            kind: NormKind::Layer(candle_nn::layer_norm(size, eps, vb.to_dtype(dtype))?),
            f32_compute: false,
        })
    }

    fn run(&self, xs: &Tensor, diff: bool) -> Result<Tensor> {
        let dtype = xs.dtype();
        let x = if self.f32_compute {
            xs.to_dtype(DType::F32)?
        } else {
            xs.clone()
        };
        let y = match (&self.kind, diff) {
            (NormKind::Rms(n), false) => n.forward(&x)?,
            (NormKind::Rms(n), true) => n.forward_diff(&x)?,
            (NormKind::Layer(n), false) => n.forward(&x)?,
            (NormKind::Layer(n), true) => layer_norm_diff(n, &x)?,
        };
        if self.f32_compute {
            y.to_dtype(dtype)
        } else {
            Ok(y)
        }
    }

    /// Inference (Candle's fused kernels).
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.run(xs, false)
    }

    /// The weight and epsilon of a plain RMSNorm that computes in the weight's dtype (what
    /// [`candle_offload::kernels::norm::rms_norm_residual`] can replace); `None` for LayerNorm and for
    /// Gemma's `1 + w` norms computed in F32.
    pub fn rms_parts(&self) -> Option<(&Tensor, f64)> {
        match &self.kind {
            NormKind::Rms(n) if !self.f32_compute => Some((n.weight(), n.eps())),
            _ => None,
        }
    }

    /// Differentiable (training; Candle's fused kernels cut the gradient): the composition.
    pub fn forward_diff(&self, xs: &Tensor) -> Result<Tensor> {
        self.run(xs, true)
    }

    /// Differentiable, an RMSNorm as one op with its own backward kernels
    /// ([`candle_offload::kernels::norm::rms_norm`]); LayerNorm, and weights in another dtype than the
    /// input, as [`forward_diff`](Self::forward_diff).
    pub fn forward_train_fused(&self, xs: &Tensor) -> Result<Tensor> {
        let NormKind::Rms(n) = &self.kind else {
            return self.forward_diff(xs);
        };
        let dtype = xs.dtype();
        let x = if self.f32_compute {
            xs.to_dtype(DType::F32)?
        } else {
            xs.clone()
        };
        if n.weight().dtype() != x.dtype() {
            return self.forward_diff(xs);
        }
        let y = candle_offload::kernels::norm::rms_norm(&x, n.weight(), n.eps())?;
        if self.f32_compute {
            y.to_dtype(dtype)
        } else {
            Ok(y)
        }
    }

    /// Training: [`forward_train_fused`](Self::forward_train_fused) with `fused`, otherwise
    /// [`forward_diff`](Self::forward_diff).
    pub fn forward_train(&self, xs: &Tensor, fused: bool) -> Result<Tensor> {
        if fused {
            self.forward_train_fused(xs)
        } else {
            self.forward_diff(xs)
        }
    }
}

/// LayerNorm from differentiable ops (the composition Candle's fused kernel replaces).
fn layer_norm_diff(n: &candle_nn::LayerNorm, x: &Tensor) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let y = centered.broadcast_div(&(var + n.eps())?.sqrt()?)?;
    let y = y.broadcast_mul(n.weight())?;
    match n.bias() {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// How attention scores are formed once q and k are rotated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionSpec {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA: fewer; MQA: one).
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Scores are divided by this (`sqrt(head_dim)`, or Gemma 2's `sqrt(query_pre_attn_scalar)`).
    pub score_div: f64,
    /// Soft-capping of the scores before the mask (Gemma 2).
    pub softcap: Option<f64>,
    /// Keys further back than this are hidden (sliding-window layers).
    pub window: Option<usize>,
}

impl AttentionSpec {
    /// The widths of the query and of the key (= value) projections.
    pub fn widths(&self) -> (usize, usize) {
        (
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        )
    }

    /// Plain attention of `cfg`'s shape: scores over `sqrt(head_dim)`, no cap, no window.
    pub fn of(cfg: &Config) -> Self {
        Self {
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            score_div: (cfg.head_dim as f64).sqrt(),
            softcap: None,
            window: None,
        }
    }
}

#[derive(Debug)]
enum Qkv {
    Separate { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

/// Self-attention: projections, RoPE, the KV cache, GQA/MQA and the output projection.
#[derive(Debug)]
pub struct SelfAttention {
    qkv: Qkv,
    o_proj: Linear,
    spec: AttentionSpec,
}

impl SelfAttention {
    /// `q_proj`, `k_proj`, `v_proj` (with biases when `bias`) and `o_proj` under `w`, each
    /// dense or quantized as the unit holds it.
    pub fn load(
        w: UnitWeights<'_>,
        hidden: usize,
        spec: AttentionSpec,
        bias: bool,
    ) -> Result<Self> {
        let (q, kv) = spec.widths();
        Ok(Self {
            qkv: Qkv::Separate {
                q: w.pp("q_proj").linear(hidden, q, bias)?,
                k: w.pp("k_proj").linear(hidden, kv, bias)?,
                v: w.pp("v_proj").linear(hidden, kv, bias)?,
            },
            o_proj: w.pp("o_proj").linear(q, hidden, false)?,
            spec,
        })
    }

    /// One fused projection `fused` (rows: q, then k, then v) and `o_proj` under `w` (Phi-3).
    pub fn load_fused(
        w: UnitWeights<'_>,
        fused: &str,
        hidden: usize,
        spec: AttentionSpec,
    ) -> Result<Self> {
        let (q, kv) = spec.widths();
        Ok(Self {
            qkv: Qkv::Fused(w.pp(fused).linear(hidden, q + 2 * kv, false)?),
            o_proj: w.pp("o_proj").linear(q, hidden, false)?,
            spec,
        })
    }

    /// The attention's shape and scoring.
    pub fn spec(&self) -> &AttentionSpec {
        &self.spec
    }

    /// Whether its input projection takes x quantized by the norm before it.
    fn takes_quantized_x(&self) -> bool {
        match &self.qkv {
            Qkv::Separate { q, .. } => takes_quantized_x(q),
            Qkv::Fused(l) => takes_quantized_x(l),
        }
    }

    fn project(&self, xs: &Tensor, train: bool, fused: bool) -> Result<(Tensor, Tensor, Tensor)> {
        if let (false, true, Qkv::Separate { q, k, v }) = (train, fused, &self.qkv) {
            if let Some(ws) = one_launch_weights(xs, &[q, k, v])? {
                // q, k and v in one kernel, each written contiguous.
                let out = match ws {
                    OneLaunch::Dense(ws) => {
                        candle_offload::kernels::linear::linear_small_multi(xs, &ws)?
                    }
                    OneLaunch::Blocks(ws) => {
                        candle_offload::kernels::linear::qlinear_small_multi(xs, &ws, q.tuning())?
                    }
                };
                let mut out = out.into_iter();
                let mut next = || out.next().expect("three outputs");
                return Ok((next(), next(), next()));
            }
            // Blocks of two types (Q4_K_M keeps v in Q6_K in some layers): q and k in one
            // kernel, v in its own.
            if let Some(OneLaunch::Blocks(ws)) = one_launch_weights(xs, &[q, k])? {
                let mut out =
                    candle_offload::kernels::linear::qlinear_small_multi(xs, &ws, q.tuning())?
                        .into_iter();
                let mut next = || out.next().expect("two outputs");
                let (q, k) = (next(), next());
                return Ok((q, k, v.run_with(xs, train, fused)?));
            }
        }
        if let (false, Qkv::Separate { q, k, v }) = (train, &self.qkv) {
            // A CPU decode step: q, k and v in one pass of the matmul pool.
            if let Some(ys) = cpu_blocks_many(xs, &[q, k, v])? {
                let mut ys = ys.into_iter();
                let mut next = || ys.next().expect("three outputs");
                return Ok((next(), next(), next()));
            }
        }
        match &self.qkv {
            Qkv::Separate { q, k, v } => Ok((
                q.run_with(xs, train, fused)?,
                k.run_with(xs, train, fused)?,
                v.run_with(xs, train, fused)?,
            )),
            Qkv::Fused(l) => {
                let all = l.run_with(xs, train, fused)?;
                let (q, kv) = self.spec.widths();
                Ok((
                    all.narrow(D::Minus1, 0, q)?,
                    all.narrow(D::Minus1, q, kv)?,
                    all.narrow(D::Minus1, q + kv, kv)?,
                ))
            }
        }
    }

    /// Inference over `xs` (batch, seq, hidden) at positions `ctx.index_pos..`, appending to
    /// `kv`.
    pub fn forward(&self, xs: &Tensor, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Tensor> {
        let s = &self.spec;
        let (b, seq_len, _) = xs.dims3()?;
        let shape =
            |t: Tensor, heads: usize| t.reshape((b, seq_len, heads, s.head_dim))?.transpose(1, 2);
        let (q, k, v) = self.project(xs, false, ctx.fused)?;
        // The fused attention kernel; on the CPU also for a decode step of unfused ops, where
        // it replaces about ten small Candle ops per layer (casts, matmuls through the GEMM,
        // mask, softmax) with one loop over the cache.
        let cpu_step = xs.device().is_cpu() && seq_len == 1;
        let decode = (ctx.fused || cpu_step)
            && s.softcap.is_none()
            && seq_len <= DECODE_ATTENTION_MAX_NEW
            && (!ctx.masks.is_padded() || padded_decode(ctx, s));
        let heads = |t: Tensor, n: usize| t.reshape((b, seq_len, n, s.head_dim));
        // The decode attention's output as the output projection's rows: with `q8` the kernels
        // hand them over already flat (and quantized), otherwise (b, new, heads, head_dim).
        let q8 = takes_quantized_x(&self.o_proj);
        let rows = |y: Tensor| -> Result<Tensor> {
            if q8 {
                Ok(y)
            } else {
                y.reshape((b, seq_len, s.n_heads * s.head_dim))
            }
        };
        if let Some(pos) = ctx.pos_dev {
            // A captured step: the position is read on the device, by the two kernels that
            // depend on it, so that every replay of the graph runs at its own position.
            // A padded batch's counts are read on the device too (the graph's inputs).
            if !(ctx.fused && decode) {
                candle_core::bail!(
                    "this attention (soft-capping, a new position in a row's padding or \
                     unfused ops) cannot run in a captured step"
                );
            }
            let (q, k, v) = kv.append_rotated_at(
                &heads(q, s.n_heads)?,
                &heads(k, s.n_kv_heads)?,
                &heads(v, s.n_kv_heads)?,
                ctx.rope,
                pos,
            )?;
            let y = candle_offload::kernels::attention::decode_attention_at(
                &q,
                &k,
                &v,
                1.0 / s.score_div,
                s.window,
                pos,
                ctx.masks.pads_tensor()?.as_ref(),
                q8,
            )?;
            return self.o_proj.forward_step(&rows(y)?, ctx.fused);
        }
        let (q, k, v) = if ctx.fused && decode {
            // One kernel rotates q and k from the projections' layout and writes k and v
            // into the cache.
            kv.append_rotated(
                &heads(q, s.n_heads)?,
                &heads(k, s.n_kv_heads)?,
                &heads(v, s.n_kv_heads)?,
                ctx.rope,
                ctx.index_pos,
            )?
        } else {
            let (q, k) = if ctx.fused {
                // One kernel reads both in the projections' layout and writes them transposed.
                let (q, k) = (heads(q, s.n_heads)?, heads(k, s.n_kv_heads)?);
                ctx.rope.apply_qk(&q, &k, ctx.index_pos)?
            } else {
                (
                    ctx.rope.apply(&shape(q, s.n_heads)?, ctx.index_pos)?,
                    ctx.rope.apply(&shape(k, s.n_kv_heads)?, ctx.index_pos)?,
                )
            };
            let v = shape(v, s.n_kv_heads)?.contiguous()?;
            let (k, v) = kv.append(&k.contiguous()?, &v)?;
            (q, k, v)
        };
        if decode {
            // One kernel over the cache's views: no repeat, cast, copy, mask or softmax ops.
            let scale = 1.0 / s.score_div;
            let y = match ctx.masks.pads_tensor()? {
                // Each row's padding is left out by the kernel itself.
                Some(pads) => candle_offload::kernels::attention::decode_attention_padded(
                    &q, &k, &v, scale, s.window, &pads, q8,
                )?,
                // The kernel also quantizes its rows for the output projection.
                None if q8 => candle_offload::kernels::attention::decode_attention_q8(
                    &q, &k, &v, scale, s.window,
                )?,
                None => candle_offload::kernels::attention::decode_attention(
                    &q, &k, &v, scale, s.window,
                )?,
            };
            return self.o_proj.forward_step(&rows(y)?, ctx.fused);
        }
        if s.softcap.is_none()
            && s.window.is_none()
            && !ctx.masks.is_padded()
            && candle_offload::kernels::attention::prompt_attention_supported(
                xs.device(),
                q.dtype(),
                s.head_dim,
                self.o_proj.tuning(),
            )
        {
            // One flash-attention kernel over the cache's views: no F32 copies, no score
            // matrix, no mask or softmax launches.
            let y = candle_offload::kernels::attention::prompt_attention(
                &q,
                &k,
                &v,
                1.0 / s.score_div,
                self.o_proj.tuning(),
            )?;
            return self
                .o_proj
                .forward(&y.reshape((b, seq_len, s.n_heads * s.head_dim))?);
        }
        // Grouped-query attention without repeating k and v: the `rep` query heads of each kv
        // head are rows of one matmul against that head's keys, read from the cache's views
        // as they are (a repeat copied the whole cache `rep` times per layer and step).
        let rep = s.n_heads / s.n_kv_heads;
        let kv_len = k.dim(2)?;
        // Scores, softmax and the weighted sum in f32, as the reference implementations do.
        let in_dtype = q.dtype();
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let q = q
            .contiguous()?
            .reshape((b, s.n_kv_heads, rep * seq_len, s.head_dim))?;
        let att = (q.matmul(&k.t()?)? / s.score_div)?;
        let att = match s.softcap {
            Some(cap) => soft_cap(&att, cap)?,
            None => att,
        };
        let att = match ctx.masks.get(s.window)? {
            Some(m) => {
                // (seq, kv_len) or (b, 1, seq, kv_len) against (b, kv heads, rep, seq, kv_len).
                let m = if m.rank() == 4 { m.unsqueeze(1)? } else { m };
                att.reshape((b, s.n_kv_heads, rep, seq_len, kv_len))?
                    .broadcast_add(&m)?
                    .reshape((b, s.n_kv_heads, rep * seq_len, kv_len))?
            }
            None => att,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att
            .matmul(&v)?
            .reshape((b, s.n_heads, seq_len, s.head_dim))?
            .to_dtype(in_dtype)?;
        let y = y
            .transpose(1, 2)?
            .reshape((b, seq_len, s.n_heads * s.head_dim))?;
        self.o_proj.forward(&y)
    }

    /// Causal self-attention over the whole sequence with differentiable ops (training).
    /// With `ctx.fused`, no soft-capping, no sliding window and the plain causal mask, where
    /// a kernel exists ([`flash_attention_supported`]): [`flash_attention`] over all heads
    /// (F32 scores and sums). Otherwise the composition: projections and the two attention
    /// matmuls in `xs`'s dtype, mask and softmax in F32; with `ctx.head_chunks > 1` the heads
    /// are processed in that many checkpointed groups, so only one group's score matrix is
    /// ever held (it is recomputed in the backward pass).
    pub fn forward_train(&self, xs: &Tensor, ctx: &TrainCtx<'_>) -> Result<Tensor> {
        let s = self.spec;
        let (b, seq_len, _) = xs.dims3()?;
        let shape =
            |t: Tensor, heads: usize| t.reshape((b, seq_len, heads, s.head_dim))?.transpose(1, 2);
        let (q, k, v) = self.project(xs, true, false)?;
        let q = ctx.rope.apply_diff(&shape(q, s.n_heads)?.contiguous()?)?;
        let k = ctx
            .rope
            .apply_diff(&shape(k, s.n_kv_heads)?.contiguous()?)?;
        let v = shape(v, s.n_kv_heads)?.contiguous()?;
        if ctx.fused
            && s.softcap.is_none()
            && s.window.is_none()
            && ctx.masks.is_plain_causal()
            && flash_attention_supported(q.device(), q.dtype(), s.head_dim)
        {
            // One op over all heads: no repeated k and v, no score matrix, no head groups.
            let y = flash_attention(&q, &k, &v, (1.0 / s.score_div) as f32)?;
            let y = y
                .transpose(1, 2)?
                .reshape((b, seq_len, s.n_heads * s.head_dim))?;
            return self.o_proj.forward_train(&y);
        }
        let rep = s.n_heads / s.n_kv_heads;
        let k = candle_transformers::utils::repeat_kv(k, rep)?.contiguous()?;
        let v = candle_transformers::utils::repeat_kv(v, rep)?.contiguous()?;
        let mask = ctx.masks.get(s.window)?;
        let y = if ctx.head_chunks <= 1 {
            train_attention(&q, &k, &v, mask.as_ref(), &s)?
        } else {
            let ck = candle_offload::Checkpointer::new();
            let mut outs = Vec::new();
            for r in candle_offload::train::segment_ranges(s.n_heads, ctx.head_chunks) {
                let part = |t: &Tensor| t.narrow(1, r.start, r.len());
                let qkv = Tensor::stack(&[part(&q)?, part(&k)?, part(&v)?], 0)?;
                let mask = mask.clone();
                outs.push(ck.checkpoint(
                    move |qkv| {
                        let get = |i| qkv.get(i);
                        train_attention(&get(0)?, &get(1)?, &get(2)?, mask.as_ref(), &s)
                    },
                    &qkv,
                )?);
            }
            Tensor::cat(&outs, 1)?
        };
        let y = y
            .transpose(1, 2)?
            .reshape((b, seq_len, s.n_heads * s.head_dim))?;
        self.o_proj.forward_train(&y)
    }
}

/// softmax(q kᵀ / div (capped) + mask) v with the matmuls in q's dtype and the softmax in F32.
fn train_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    s: &AttentionSpec,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let att = (q * (1.0 / s.score_div))?.matmul(&k.t()?)?;
    let att = att.to_dtype(DType::F32)?;
    let att = match s.softcap {
        Some(cap) => soft_cap(&att, cap)?,
        None => att,
    };
    let att = match mask {
        Some(m) => candle_offload::train::grad::add_constant(&att, m)?,
        None => att,
    };
    let att = candle_nn::ops::softmax(&att, D::Minus1)?.to_dtype(dtype)?;
    att.matmul(v)
}

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
enum GateUp {
    Separate { gate: Linear, up: Linear },
    Fused(Linear),
}

/// `down(act(gate(x)) · up(x))`.
#[derive(Debug)]
pub struct GatedMlp {
    gate_up: GateUp,
    down: Linear,
    act: Activation,
    intermediate: usize,
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

    /// Whether its gate (and up) projection takes x quantized by the norm before it.
    fn takes_quantized_x(&self) -> bool {
        match &self.gate_up {
            GateUp::Separate { gate, .. } => takes_quantized_x(gate),
            GateUp::Fused(l) => takes_quantized_x(l),
        }
    }

    fn run(&self, xs: &Tensor, train: bool, fused: bool) -> Result<Tensor> {
        if let (false, true, Activation::Silu, GateUp::Separate { gate, up }) =
            (train, fused, self.act, &self.gate_up)
        {
            if let Some(ws) = one_launch_weights(xs, &[gate, up])? {
                // Gate, up and SiLU · mul in one kernel.
                let x = match ws {
                    OneLaunch::Dense(ws) => {
                        candle_offload::kernels::linear::linear_silu_mul(xs, ws[0], ws[1])?
                    }
                    // The kernel also quantizes its output for the down projection.
                    OneLaunch::Blocks(ws) if takes_quantized_x(&self.down) => {
                        candle_offload::kernels::linear::qlinear_silu_mul_q8(
                            xs,
                            ws[0],
                            ws[1],
                            gate.tuning(),
                        )?
                    }
                    OneLaunch::Blocks(ws) => candle_offload::kernels::linear::qlinear_silu_mul(
                        xs,
                        ws[0],
                        ws[1],
                        gate.tuning(),
                    )?,
                };
                return self.down.run_with(&x, train, fused);
            }
        }
        // A CPU decode step: gate and up in one pass of the matmul pool.
        let both = match (&self.gate_up, train) {
            (GateUp::Separate { gate, up }, false) => cpu_blocks_many(xs, &[gate, up])?,
            _ => None,
        };
        let (gate, up) = match (&self.gate_up, both) {
            (_, Some(ys)) => {
                let mut ys = ys.into_iter();
                let mut next = || ys.next().expect("two outputs");
                (next(), next())
            }
            (GateUp::Separate { gate, up }, None) => (
                gate.run_with(xs, train, fused)?,
                up.run_with(xs, train, fused)?,
            ),
            (GateUp::Fused(l), None) => {
                let both = l.run_with(xs, train, fused)?;
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
        self.down.run_with(&x, train, fused)
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

    /// Training: each projection one 2-D matmul (see [`linear_2d`]), the activation composed
    /// of Candle ops.
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

/// A pre-norm decoder layer:
/// `h = x + post_attn(attn(norm(x)))`, `out = h + post_mlp(mlp(pre_mlp(h)))`, where the
/// post-norms exist only in Gemma 2.
#[derive(Debug)]
pub struct PreNormBlock {
    /// Before attention.
    pub input_norm: Norm,
    /// Self-attention.
    pub attn: SelfAttention,
    /// After attention, before the residual add (Gemma 2).
    pub post_attn_norm: Option<Norm>,
    /// Before the MLP.
    pub pre_mlp_norm: Norm,
    /// The MLP.
    pub mlp: GatedMlp,
    /// After the MLP, before the residual add (Gemma 2).
    pub post_mlp_norm: Option<Norm>,
}

/// Whether a padded batch's step can take the decode attention kernel, which leaves each row's
/// padding out itself: every new position past every row's padding (the decode steps after a
/// padded prompt), and a head dim the kernel takes.
fn padded_decode(ctx: &StepCtx<'_>, s: &AttentionSpec) -> bool {
    ctx.masks.pads().iter().all(|&p| p <= ctx.index_pos)
        && s.head_dim <= candle_offload::kernels::attention::ATTENTION_MAX_HEAD_DIM
}

/// `norm(a + b)` and the sum: in one kernel ([`candle_offload::kernels::norm::rms_norm_residual`]) on a
/// fused step with an RMSNorm computed in the inputs' dtype, all three of one dtype, which with
/// `q8` (the next matmul takes x quantized: `takes_quantized_x`) also quantizes the normed rows
/// ([`candle_offload::kernels::norm::rms_norm_residual_q8`]); otherwise the add, then the norm.
fn add_norm(
    norm: &Norm,
    ctx: &StepCtx<'_>,
    a: Tensor,
    b: Tensor,
    q8: bool,
) -> Result<(Tensor, Tensor)> {
    let fusable = norm
        .rms_parts()
        .filter(|(w, _)| ctx.fused && w.dtype() == a.dtype() && b.dtype() == a.dtype());
    match fusable {
        Some((w, eps)) if q8 => candle_offload::kernels::norm::rms_norm_residual_q8(&a, &b, w, eps),
        Some((w, eps)) => candle_offload::kernels::norm::rms_norm_residual(&a, &b, w, eps),
        None => {
            let sum = (a + b)?;
            let normed = norm.forward(&sum)?;
            Ok((sum, normed))
        }
    }
}

impl DecoderBlock for PreNormBlock {
    fn forward(&self, xs: &Tensor, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Tensor> {
        self.forward_hidden(Hidden::Whole(xs.clone()), ctx, kv)?
            .into_tensor()
    }

    /// A fused step leaves the MLP's residual add to the next block's input norm (or the
    /// caller), which does it in its own kernel.
    fn forward_hidden(&self, xs: Hidden, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Hidden> {
        let (residual, normed) = match xs {
            Hidden::Whole(xs) => {
                let normed = self.input_norm.forward(&xs)?;
                (xs, normed)
            }
            Hidden::Split { h, residual } => add_norm(
                &self.input_norm,
                ctx,
                h,
                residual,
                self.attn.takes_quantized_x(),
            )?,
        };
        let h = self.attn.forward(&normed, ctx, kv)?;
        let h = match &self.post_attn_norm {
            Some(n) => n.forward(&h)?,
            None => h,
        };
        // The residual add and the norm after it in one kernel where it can.
        let (xs, normed) = add_norm(
            &self.pre_mlp_norm,
            ctx,
            h,
            residual,
            self.mlp.takes_quantized_x(),
        )?;
        let h = if ctx.fused {
            self.mlp.forward_fused(&normed)?
        } else {
            self.mlp.forward(&normed)?
        };
        match &self.post_mlp_norm {
            Some(n) => Ok(Hidden::Whole((n.forward(&h)? + xs)?)),
            None if ctx.fused => Ok(Hidden::Split { h, residual: xs }),
            None => Ok(Hidden::Whole((h + xs)?)),
        }
    }

    /// The residual stream stays in `xs`'s dtype (F32 under autocast), norms run in it, and
    /// the attention and MLP compute in `ctx.compute`.
    fn forward_train(&self, xs: &Tensor, ctx: &TrainCtx<'_>) -> Result<Tensor> {
        if ctx.fused {
            if let Some(out) = by_hand::forward_train(self, xs, ctx)? {
                return Ok(out);
            }
        }
        let residual = xs;
        let stream = residual.dtype();
        let fused = ctx.fused;
        let h = self.input_norm.forward_train(xs, fused)?;
        let h = self.attn.forward_train(&h.to_dtype(ctx.compute)?, ctx)?;
        let h = h.to_dtype(stream)?;
        let h = match &self.post_attn_norm {
            Some(n) => n.forward_train(&h, fused)?,
            None => h,
        };
        let xs = (h + residual)?;
        let h = self.pre_mlp_norm.forward_train(&xs, fused)?;
        let h = h.to_dtype(ctx.compute)?;
        let h = if fused {
            self.mlp.forward_train_fused(&h)?
        } else {
            self.mlp.forward_train(&h)?
        };
        let h = h.to_dtype(stream)?;
        let h = match &self.post_mlp_norm {
            Some(n) => n.forward_train(&h, fused)?,
            None => h,
        };
        h + xs
    }
}

/// A checkpoint tensor's name and shape.
pub type TensorShape = (String, Vec<usize>);

/// The tensors of an HF-layout checkpoint of `cfg`: embeddings, final norm, the output head
/// unless tied, and `layer(prefix, out)` for each decoder layer (`model.layers.{i}`).
pub fn hf_tensors(cfg: &Config, layer: impl Fn(&str, &mut Vec<TensorShape>)) -> Vec<TensorShape> {
    let h = cfg.hidden_size;
    let mut out = vec![
        ("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h]),
        ("model.norm.weight".into(), vec![h]),
    ];
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".into(), vec![cfg.vocab_size, h]));
    }
    for l in 0..cfg.num_hidden_layers {
        layer(&format!("model.layers.{l}"), &mut out);
    }
    out
}

/// `{p}.self_attn.{q,k,v,o}_proj` of `cfg`'s shape (q/k/v biases when `cfg.attention_bias`).
pub fn attention_tensors(p: &str, cfg: &Config, out: &mut Vec<TensorShape>) {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
    out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
    out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
    out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
    if cfg.attention_bias {
        out.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
        out.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
        out.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
    }
}

/// `{p}.mlp.{gate,up,down}_proj` of `cfg`'s shape.
pub fn mlp_tensors(p: &str, cfg: &Config, out: &mut Vec<TensorShape>) {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
    out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
    out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
}

/// `{p}.{name}.weight` of width `hidden` for each norm name.
pub fn norm_tensors(p: &str, names: &[&str], hidden: usize, out: &mut Vec<TensorShape>) {
    for n in names {
        out.push((format!("{p}.{n}.weight"), vec![hidden]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kv_cache_grows_by_its_length_and_keeps_every_position() -> Result<()> {
        let dev = Device::Cpu;
        let rows = |base: f32, n: usize| {
            let v: Vec<f32> = (0..n * 4).map(|i| base + i as f32).collect();
            Tensor::from_vec(v, (1, 1, n, 4), &dev)
        };
        let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
        let mut kv = KvCache::new(2);
        assert!(kv.is_empty() && kv.k()?.is_none());
        kv.append(&rows(0.0, 1)?, &rows(100.0, 1)?)?;
        assert_eq!((kv.len(), kv.capacity()), (1, 2));
        // Three more than fit: the buffers grow by the cache's length (2) until they do.
        let (k, v) = kv.append(&rows(10.0, 3)?, &rows(110.0, 3)?)?;
        assert_eq!((kv.len(), kv.capacity()), (4, 4));
        assert_eq!(k.dims(), &[1, 1, 4, 4]);
        assert_eq!(flat(&k.narrow(2, 0, 1)?)?, flat(&rows(0.0, 1)?)?);
        assert_eq!(flat(&k.narrow(2, 1, 3)?)?, flat(&rows(10.0, 3)?)?);
        assert_eq!(flat(&v.narrow(2, 0, 1)?)?, flat(&rows(100.0, 1)?)?);
        assert_eq!(flat(&v.narrow(2, 1, 3)?)?, flat(&rows(110.0, 3)?)?);
        assert_eq!(flat(&kv.v()?.expect("cached"))?, flat(&v)?);
        Ok(())
    }

    #[test]
    fn a_placed_cache_keeps_its_positions_and_grows() -> Result<()> {
        let dev = Device::Cpu;
        let mut cache = Cache::new(1, 6);
        let kv = |base: f32, t: usize| {
            let v: Vec<f32> = (0..2 * t * 3).map(|i| base + i as f32).collect();
            Tensor::from_vec(v, (1, 2, t, 3), &dev)
        };
        cache.kvs[0].append(&kv(0.0, 2)?, &kv(100.0, 2)?)?;
        let want = cache.kvs[0]
            .k()?
            .expect("cached")
            .flatten_all()?
            .to_vec1::<f32>()?;
        cache.place(0, &dev, DType::F16)?;
        let k = cache.kvs[0].k()?.expect("cached");
        assert_eq!((k.dtype(), k.dims()), (DType::F16, &[1, 2, 2, 3][..]));
        assert_eq!(
            k.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            want
        );
        assert_eq!(cache.kvs[0].capacity(), 6);
        // Appending goes on after the moved positions; placing again where it is does nothing.
        let f16 = |t: Tensor| t.to_dtype(DType::F16);
        cache.kvs[0].append(&f16(kv(50.0, 1)?)?, &f16(kv(150.0, 1)?)?)?;
        assert_eq!(cache.len(), 3);
        cache.place(0, &dev, DType::F16)?;
        cache.place(0, &dev, DType::F32)?;
        let v = cache.kvs[0].v()?.expect("cached");
        assert_eq!((v.dtype(), v.dims()), (DType::F32, &[1, 2, 3, 3][..]));
        assert_eq!(
            v.get(0)?.get(1)?.get(0)?.to_vec1::<f32>()?,
            vec![106.0, 107.0, 108.0]
        );
        Ok(())
    }

    #[test]
    fn window_mask_matches_transformers_rule() -> Result<()> {
        let dev = Device::Cpu;
        // 3 new positions after 2 cached, window 2: query 2 sees 1..=2, query 4 sees 3..=4.
        let m = window_mask(3, 2, Some(2), &dev)?.to_vec2::<f32>()?;
        let seen: Vec<Vec<usize>> = m
            .iter()
            .map(|row| (0..row.len()).filter(|&j| row[j] == 0.0).collect())
            .collect();
        assert_eq!(seen, vec![vec![1, 2], vec![2, 3], vec![3, 4]]);
        let causal = causal_mask(2, 1, &dev)?.to_vec2::<f32>()?;
        assert_eq!(causal[0], [0.0, 0.0, f32::NEG_INFINITY]);
        assert_eq!(causal[1], [0.0, 0.0, 0.0]);
        Ok(())
    }

    #[test]
    fn masks_skip_single_tokens_inside_the_window() -> Result<()> {
        let dev = Device::Cpu;
        assert!(Masks::new(1, 7, &dev).get(None)?.is_none());
        assert!(Masks::new(1, 7, &dev).get(Some(16))?.is_none());
        let m = Masks::new(1, 7, &dev).get(Some(4))?.expect("a mask");
        assert_eq!(m.dims(), [1, 8]);
        Ok(())
    }
}
