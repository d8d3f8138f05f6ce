//! The KV cache (per layer, allocated once for the whole context on the device it runs on)
//! and the masks of a forward pass: causal, sliding-window and a padded batch's.

use std::sync::Mutex;

use candle_core::{DType, Device, Result, Tensor};
use candle_offload::kernels::rope::{self, QkNorm};

use super::rope::Rope;

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

    /// The key and value buffers, once allocated.
    pub(crate) fn buffers(&self) -> Option<(&Tensor, &Tensor)> {
        self.bufs.as_ref().map(|(k, v)| (k, v))
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

    /// The buffers (1, heads, positions, d) in `like`'s dtype with room for one more position,
    /// and that position: a ragged decode step writes it itself
    /// ([`candle_offload::kernels::attention::ragged_decode_attention`]) and then counts it
    /// ([`advance_one`](Self::advance_one)).
    pub(crate) fn room_for_one(
        &mut self,
        heads: usize,
        d: usize,
        like: &Tensor,
    ) -> Result<(Tensor, Tensor, usize)> {
        let (k, v) = self.make_room((1, heads, d), 1, like)?;
        Ok((k, v, self.len))
    }

    /// Counts the position [`room_for_one`](Self::room_for_one) made room for, once written.
    pub(crate) fn advance_one(&mut self) {
        self.len += 1;
    }

    /// The fused step's append: q and k (b, t, heads, head_dim, as the projections give them)
    /// rotated by `rope` for positions `index_pos..`, k and v (b, t, kv heads, head_dim)
    /// written into the buffers at the cache's end, q and k each normed per head first where
    /// `norm` is given. Returns q rotated (b, heads, t, head_dim) and every cached position's
    /// keys and values.
    pub fn append_rotated(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: &Rope,
        index_pos: usize,
        norm: Option<QkNorm<'_>>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, heads, d) = k.dims4()?;
        let (kb, vb) = self.make_room((b, heads, d), t, k)?;
        let table = rope.table_rows(index_pos, t)?;
        let caches = (&kb, &vb);
        let q = rope::rope_qk_cache(q, k, v, &table, caches, self.len, norm)?;
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
        norm: Option<QkNorm<'_>>,
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
        let q = rope::rope_qk_cache_at(q, k, v, rope.table(), (&kb, &vb), pos, norm)?;
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

    /// Positions the caches are for (what [`new`](Self::new) was given, or what they grew to).
    pub fn capacity(&self) -> usize {
        self.kvs.first().map_or(0, KvCache::capacity)
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

/// What the attention op reads of a pass's masks.
impl candle_offload::kernels::attention::StepMasks for Masks {
    fn pads(&self) -> &[usize] {
        Masks::pads(self)
    }

    fn pads_tensor(&self) -> Result<Option<Tensor>> {
        Masks::pads_tensor(self)
    }

    fn mask(&self, window: Option<usize>) -> Result<Option<Tensor>> {
        self.get(window)
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
