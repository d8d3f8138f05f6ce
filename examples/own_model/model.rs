//! An application's own decoder, "TinyLm", as it was written before it was offloaded: plain
//! candle-nn, its own tensor names (`tok_embeddings`, `layers.N.attn.wqkv`, `norm`, `output`),
//! LayerNorm, fused q/k/v attention with RoPE over a KV cache, and a GELU MLP. Nothing here
//! comes from candle-offload but the KV cache, `candle_offload_models::KvCache`, which has
//! candle-nn's `KvCache::append` (the fused decode step writes into it in place);
//! `glue.rs` is all it takes to run it offloaded.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};
use candle_offload_models::KvCache;

/// The application's configuration.
#[derive(Debug, Clone)]
pub struct TinyConfig {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub ffn: usize,
    pub max_len: usize,
}

impl TinyConfig {
    /// Every tensor of a checkpoint, with its shape.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, f) = (self.hidden, self.ffn);
        let mut out = vec![
            ("tok_embeddings.weight".to_string(), vec![self.vocab, h]),
            ("norm.weight".into(), vec![h]),
            ("norm.bias".into(), vec![h]),
            ("output.weight".into(), vec![self.vocab, h]),
        ];
        for l in 0..self.layers {
            for (name, shape) in [
                ("norm1.weight", vec![h]),
                ("norm1.bias", vec![h]),
                ("attn.wqkv.weight", vec![3 * h, h]),
                ("attn.wo.weight", vec![h, h]),
                ("norm2.weight", vec![h]),
                ("norm2.bias", vec![h]),
                ("ffn.w1.weight", vec![f, h]),
                ("ffn.w1.bias", vec![f]),
                ("ffn.w2.weight", vec![h, f]),
                ("ffn.w2.bias", vec![h]),
            ] {
                out.push((format!("layers.{l}.{name}"), shape));
            }
        }
        out
    }

    /// RoPE inverse frequencies (base 10 000).
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.hidden / self.heads;
        (0..d / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / d as f32))
            .collect()
    }
}

/// One layer.
#[derive(Debug)]
pub struct Block {
    norm1: LayerNorm,
    wqkv: Linear,
    wo: Linear,
    norm2: LayerNorm,
    w1: Linear,
    w2: Linear,
    heads: usize,
}

impl Block {
    pub fn load(vb: VarBuilder, c: &TinyConfig) -> Result<Self> {
        let h = c.hidden;
        Ok(Self {
            norm1: candle_nn::layer_norm(h, 1e-5, vb.pp("norm1"))?,
            wqkv: candle_nn::linear_no_bias(h, 3 * h, vb.pp("attn.wqkv"))?,
            wo: candle_nn::linear_no_bias(h, h, vb.pp("attn.wo"))?,
            norm2: candle_nn::layer_norm(h, 1e-5, vb.pp("norm2"))?,
            w1: candle_nn::linear(h, c.ffn, vb.pp("ffn.w1"))?,
            w2: candle_nn::linear(c.ffn, h, vb.pp("ffn.w2"))?,
            heads: c.heads,
        })
    }

    /// `xs` (batch, seq, hidden) at positions `pos..`, with RoPE tables `cos`/`sin`, the
    /// causal `mask` (None for one token) and this layer's cache.
    pub fn forward(
        &self,
        xs: &Tensor,
        pos: usize,
        (cos, sin): (&Tensor, &Tensor),
        mask: Option<&Tensor>,
        kv: &mut KvCache,
    ) -> Result<Tensor> {
        let (b, t, h) = xs.dims3()?;
        let hd = h / self.heads;
        let qkv = self.wqkv.forward(&self.norm1.forward(xs)?)?;
        let split = |i: usize| {
            qkv.narrow(D::Minus1, i * h, h)?
                .reshape((b, t, self.heads, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (cos, sin) = (cos.narrow(0, pos, t)?, sin.narrow(0, pos, t)?);
        let q = candle_nn::rotary_emb::rope(&split(0)?, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope(&split(1)?, &cos, &sin)?;
        let (k, v) = kv.append(&k, &split(2)?)?;
        let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
        let att = match mask {
            Some(m) => att.broadcast_add(m)?,
            None => att,
        };
        let y = candle_nn::ops::softmax_last_dim(&att)?.matmul(&v)?;
        let y = y.transpose(1, 2)?.reshape((b, t, h))?;
        let xs = (self.wo.forward(&y)? + xs)?;
        let ffn = self
            .w2
            .forward(&self.w1.forward(&self.norm2.forward(&xs)?)?.gelu()?)?;
        ffn + xs
    }
}

/// The whole model, resident: the application's own forward pass.
#[derive(Debug)]
pub struct TinyLm {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    output: Linear,
    cos: Tensor,
    sin: Tensor,
}

impl TinyLm {
    pub fn load(vb: VarBuilder, c: &TinyConfig) -> Result<Self> {
        let inv = Tensor::new(c.inv_freq(), vb.device())?.unsqueeze(0)?;
        let t = Tensor::arange(0u32, c.max_len as u32, vb.device())?
            .to_dtype(DType::F32)?
            .unsqueeze(1)?;
        let freqs = t.matmul(&inv)?;
        Ok(Self {
            embed: candle_nn::embedding(c.vocab, c.hidden, vb.pp("tok_embeddings"))?,
            blocks: (0..c.layers)
                .map(|l| Block::load(vb.pp(format!("layers.{l}")), c))
                .collect::<Result<_>>()?,
            norm: candle_nn::layer_norm(c.hidden, 1e-5, vb.pp("norm"))?,
            output: candle_nn::linear_no_bias(c.hidden, c.vocab, vb.pp("output"))?,
            cos: freqs.cos()?,
            sin: freqs.sin()?,
        })
    }

    /// Logits (batch, vocab) of the last position of `ids`, which start at `pos`.
    pub fn forward(&self, ids: &Tensor, pos: usize, kvs: &mut [KvCache]) -> Result<Tensor> {
        let t = ids.dim(1)?;
        let mask = (t > 1)
            .then(|| causal_mask(t, pos, ids.device()))
            .transpose()?;
        let mut xs = self.embed.forward(ids)?;
        for (block, kv) in self.blocks.iter().zip(kvs) {
            xs = block.forward(&xs, pos, (&self.cos, &self.sin), mask.as_ref(), kv)?;
        }
        let xs = self.norm.forward(&xs.narrow(1, t - 1, 1)?)?;
        self.output.forward(&xs)?.squeeze(1)
    }
}

/// 0 where key `j` is visible from query `i` (after `pos` cached positions), -inf elsewhere.
pub fn causal_mask(t: usize, pos: usize, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..pos + t).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0. }))
        .collect();
    Tensor::from_vec(m, (t, pos + t), device)
}
