//! The tensors of an HF-layout checkpoint, with their shapes: what a family's
//! [`Family::tensors`](crate::Family::tensors) lists from its configuration.

use crate::family::Config;

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
