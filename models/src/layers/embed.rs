//! The embedding lookup of a model's input tokens, dense or from GGML blocks.

use candle_core::{Module, Result, Tensor};

use crate::family::{Config, UnitWeights};

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
