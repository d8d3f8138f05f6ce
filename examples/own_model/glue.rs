//! All the glue `TinyLm` (model.rs, the application's own candle-nn code) needs to run
//! offloaded under a budget and sharded over devices: a `Family` naming its tensors and units
//! and building its blocks, a `DecoderBlock` handing each block the position, RoPE tables,
//! mask and KV cache the runtime owns, and the `Config` the runtime plans with.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use candle_offload_models::layers::{Norm, Rope};
use candle_offload_models::{Config, DecoderBlock, Family, KvCache, Layout, StepCtx, UnitWeights};

use super::model::{Block, TinyConfig};

/// `TinyLm` as a model family.
#[derive(Debug)]
pub struct TinyFamily(pub TinyConfig);

impl Family for TinyFamily {
    fn name(&self) -> &str {
        "tinylm"
    }

    fn tensors(&self, _: &Config) -> Vec<(String, Vec<usize>)> {
        self.0.tensors()
    }

    fn layout(&self, _: &Config) -> Layout {
        Layout {
            embed: "tok_embeddings".into(),
            layer_prefix: "layers.".into(),
            norm: "norm".into(),
            head: Some("output".into()),
            experts: None,
        }
    }

    fn rope(&self, _: &Config, max_len: usize, dtype: DType, dev: &Device) -> Result<Rope> {
        Rope::from_inv_freq(&self.0.inv_freq(), max_len, 1.0, dtype, dev)
    }

    fn block(
        &self,
        _: &Config,
        w: UnitWeights,
        _: usize,
        _: DType,
    ) -> Result<Box<dyn DecoderBlock>> {
        Ok(Box::new(TinyBlock(Block::load(w.vb().clone(), &self.0)?)))
    }

    fn final_norm(&self, cfg: &Config, vb: VarBuilder, dtype: DType) -> Result<Norm> {
        Norm::layer_norm(cfg.hidden_size, 1e-5, vb, dtype)
    }
}

#[derive(Debug)]
struct TinyBlock(Block);

impl DecoderBlock for TinyBlock {
    fn forward(&self, xs: &Tensor, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Tensor> {
        let mask = ctx.masks.get(None)?;
        let rope = (ctx.rope.cos(), ctx.rope.sin());
        self.0.forward(xs, ctx.index_pos, rope, mask.as_ref(), kv)
    }
}

/// The runtime's view of the model: its shapes and its family.
pub fn config(c: &TinyConfig) -> Config {
    let family = Arc::new(TinyFamily(c.clone()));
    let mut cfg = Config::new(family, c.hidden, c.ffn, c.layers, c.heads, c.vocab);
    cfg.max_position_embeddings = c.max_len;
    cfg
}
