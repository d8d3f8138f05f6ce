//! What each GGUF architecture means, as llama.cpp reads it: its metadata as a [`Config`]
//! (with llama.cpp's rules for what its converter leaves out), its tensor names as HF names,
//! and how a tensor is changed back into the HF one (llama's q/k rows un-permuted). The Gemma
//! families' norm weights keep the 1 the converter added (their `norm_offset` is 0).
//!
//! Architectures: `llama` (also Mistral-shaped models, which the converter writes as `llama`,
//! and Mixtral: `llama` with `expert_count`), `mistral`, `qwen2`, `qwen3`, `qwen3moe`, `qwen2moe`, `phi3` (fused `attn_qkv`; `ffn_up` holds gate and up), `gemma`,
//! `gemma2`, `gemma3`. What llama.cpp assumes where the file is silent:
//! - Gemma 2 and 3 scale scores by `1/sqrt(head_dim)`, or `1/sqrt(hidden / heads)` for the
//!   27B shapes (46 and 62 layers): the converter does not store `query_pre_attn_scalar`.
//! - Gemma 2's local layers are the even ones (window 4096 when absent), soft-caps 50 and 30
//!   when absent. Gemma 3's layer pattern is `attention.sliding_window_pattern` (a number `n`:
//!   every `n`th layer global; or one flag per layer), 6 when absent, and only when the file
//!   has a sliding window; its local layers rotate with `rope.freq_base_swa` (10000 when
//!   absent) unscaled, the global ones with `rope.freq_base` and `rope.scaling.factor`
//!   (linear). Its converter trims the embedding to the tokenizer's size: the vocabulary is
//!   the embedding's rows.
//! - Mixture-of-experts layers (Mixtral, `qwen3moe`, `qwen2moe` with its shared expert): every layer, the chosen experts'
//!   weights renormalised (llama.cpp's graph for both); an expert's width is
//!   `expert_feed_forward_length`, or `feed_forward_length` where absent (Mixtral). The
//!   experts' stacks (`ffn_{gate,up,down}_exps`) are read one expert at a time, as the HF
//!   per-expert tensors `mlp.experts.{e}.{gate,up,down}_proj` ([`expert_stack`]).
//! - Llama 3.1's RoPE scaling is the tensor `rope_freqs.weight` (a divisor per rotated pair,
//!   [`LlamaFamily::freq_factors`](crate::families::llama::LlamaFamily::freq_factors)).
//! - Phi-3's sliding window is ignored (llama.cpp turns it off); its LongRoPE factors are the
//!   tensors `rope_factors_{short,long}.weight` ([`long_rope`]).

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::{ModelError, Result};
use crate::families::gemma::Gemma;
use crate::families::gemma3::{Gemma3, RopeBase, TextKeys};
use crate::families::moe::{ExpertKeys, Moe, MoeKind};
use crate::families::phi3::{LongRope, Phi3};
use crate::family::{Config, Family};
use crate::gguf::{meta, meta_usize};
use crate::layers::{Activation, Routing};

/// The GGUF architectures this crate loads.
pub(crate) const SUPPORTED: &[&str] = &[
    "llama", "mistral", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "phi3", "gemma", "gemma2",
    "gemma3",
];

/// A q or k projection whose rows llama.cpp's converter permuted for its rope (to be put
/// back), by the heads its rows split into.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Permuted {
    /// The query projection (query heads).
    Q,
    /// The key projection (key/value heads).
    K,
}

/// The architecture a GGUF file names, checked against [`SUPPORTED`].
pub(crate) fn architecture(c: &Content, path: &Path) -> Result<String> {
    let arch = meta(c, path, "general.architecture")?
        .to_string()
        .map_err(|e| ModelError::config(path, "general.architecture", e))?
        .clone();
    if !SUPPORTED.contains(&arch.as_str()) {
        return Err(ModelError::UnknownArchitecture {
            path: path.into(),
            name: arch,
            supported: format!(
                "{} (GGUF files; other families from safetensors)",
                SUPPORTED.join(", ")
            ),
        });
    }
    Ok(arch)
}

/// A number from the metadata (any integer or float type), `None` when absent.
fn number(c: &Content, key: &str) -> Option<f64> {
    let v = c.metadata.get(key)?;
    match v {
        Value::U8(x) => Some(f64::from(*x)),
        Value::I8(x) => Some(f64::from(*x)),
        Value::U16(x) => Some(f64::from(*x)),
        Value::I16(x) => Some(f64::from(*x)),
        Value::U32(x) => Some(f64::from(*x)),
        Value::I32(x) => Some(f64::from(*x)),
        Value::U64(x) => Some(*x as f64),
        Value::I64(x) => Some(*x as f64),
        Value::F32(x) => Some(f64::from(*x)),
        Value::F64(x) => Some(*x),
        _ => None,
    }
}

/// A positive number from the metadata, `None` when absent; an error naming the key when it
/// is there but not a positive number.
fn positive(c: &Content, path: &Path, key: &str) -> Result<Option<f64>> {
    match c.metadata.get(key) {
        None => Ok(None),
        Some(_) => match number(c, key) {
            Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
            Some(0.0) => Ok(None),
            _ => Err(ModelError::config(path, key, "expected a positive number")),
        },
    }
}

/// The configuration of a GGUF file of a supported architecture (see the module docs).
pub(crate) fn config(c: &Content, path: &Path) -> Result<Config> {
    let arch = architecture(c, path)?;
    let key = |k: &str| format!("{arch}.{k}");
    let hidden_size = meta_usize(c, path, &key("embedding_length"))?;
    let num_attention_heads = meta_usize(c, path, &key("attention.head_count"))?;
    let num_key_value_heads =
        meta_usize(c, path, &key("attention.head_count_kv")).unwrap_or(num_attention_heads);
    let num_hidden_layers = meta_usize(c, path, &key("block_count"))?;
    let head_dim = match positive(c, path, &key("attention.key_length"))? {
        Some(d) => d as usize,
        None => hidden_size / num_attention_heads,
    };
    let vocab_size = match c.tensor_infos.get("token_embd.weight") {
        Some(t) => t.shape.dims()[0],
        None => meta(c, path, "tokenizer.ggml.tokens")?
            .to_vec()
            .map_err(|e| ModelError::config(path, "tokenizer.ggml.tokens", e))?
            .len(),
    };
    let token_id = |k: &str| c.metadata.get(k).and_then(|v| v.to_u32().ok());
    let gemma = arch.starts_with("gemma");
    let rope_theta = positive(c, path, &key("rope.freq_base"))?.unwrap_or(10_000.0);
    let experts = match positive(c, path, &key("expert_count"))? {
        Some(e) => Some((
            e as usize,
            meta_usize(c, path, &key("expert_used_count"))?,
            match positive(c, path, &key("expert_feed_forward_length"))? {
                Some(i) => i as usize,
                None => meta_usize(c, path, &key("feed_forward_length"))?,
            },
        )),
        None => None,
    };
    let mut cfg = Config {
        // The HF model type of the text model (`gemma3` names the multimodal one).
        model_type: match arch.as_str() {
            "gemma3" => "gemma3_text".into(),
            "qwen3moe" => "qwen3_moe".into(),
            "qwen2moe" => "qwen2_moe".into(),
            "llama" | "mistral" if experts.is_some() => "mixtral".into(),
            _ => arch.clone(),
        },
        hidden_size,
        intermediate_size: meta_usize(c, path, &key("feed_forward_length"))?,
        vocab_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: positive(c, path, &key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(if gemma { 1e-6 } else { 1e-5 }),
        rope_theta: rope_theta as f32,
        rope_scaling: None,
        max_position_embeddings: meta_usize(c, path, &key("context_length")).unwrap_or(4096),
        tie_word_embeddings: !c.tensor_infos.contains_key("output.weight"),
        attention_bias: c.tensor_infos.contains_key("blk.0.attn_q.bias"),
        bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: token_id("tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect(),
        family: crate::families::llama::family(),
        extra: Default::default(),
    };
    let scaling_type = c
        .metadata
        .get(&key("rope.scaling.type"))
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
        .unwrap_or("linear");
    let scaling_factor = positive(c, path, &key("rope.scaling.factor"))?
        .or(positive(c, path, &key("rope.scale_linear"))?)
        .unwrap_or(1.0);
    let scaled = scaling_factor != 1.0 && scaling_type != "none";
    let unsupported_scaling = |what: &str| {
        Err(ModelError::config(
            path,
            &key("rope.scaling.type"),
            format!("{what} RoPE scaling ({scaling_type:?}, factor {scaling_factor}) is not supported for {arch} GGUF files"),
        ))
    };
    // 27B shapes scale scores by hidden / heads (llama.cpp, after gemma_pytorch).
    let gemma_scalar = |big_layers: usize| {
        if num_hidden_layers == big_layers {
            (hidden_size / num_attention_heads) as f64
        } else {
            head_dim as f64
        }
    };
    let family: Arc<dyn Family> = match arch.as_str() {
        "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3moe" | "qwen2moe" if scaled => {
            return unsupported_scaling("this")
        }
        "llama" | "mistral" | "qwen3moe" | "qwen2moe"
            if experts.is_some() || arch.ends_with("moe") =>
        {
            let Some((count, top_k, width)) = experts else {
                return Err(ModelError::config(
                    path,
                    &key("expert_count"),
                    "missing from the GGUF metadata",
                ));
            };
            if top_k > count {
                return Err(ModelError::config(
                    path,
                    &key("expert_used_count"),
                    format!("{top_k} is more than the {count} experts"),
                ));
            }
            Arc::new(Moe {
                kind: match arch.as_str() {
                    "qwen3moe" => MoeKind::Qwen3Moe,
                    "qwen2moe" => MoeKind::Qwen2Moe,
                    _ => MoeKind::Mixtral,
                },
                routing: Routing {
                    experts: count,
                    top_k,
                    // As llama.cpp weighs them: Qwen2-MoE's top-k probabilities as they are.
                    renormalize: arch != "qwen2moe",
                },
                expert_intermediate: width,
                sparse: vec![true; num_hidden_layers],
                keys: ExpertKeys::PerExpert,
                windows: vec![None; num_hidden_layers],
                shared_intermediate: match arch.as_str() {
                    "qwen2moe" => Some(meta_usize(
                        c,
                        path,
                        &key("expert_shared_feed_forward_length"),
                    )?),
                    _ => None,
                },
            })
        }
        "llama" | "mistral" | "qwen2" => {
            const FREQS: &str = "rope_freqs.weight";
            if c.tensor_infos.contains_key(FREQS) {
                let rotary = positive(c, path, &key("rope.dimension_count"))?
                    .map_or(head_dim, |d| d as usize);
                let factors = factor_tensor(c, path, FREQS, rotary / 2)?;
                Arc::new(crate::families::llama::LlamaFamily {
                    windows: Vec::new(),
                    freq_factors: Some(factors.into_iter().map(|f| f as f32).collect()),
                })
            } else {
                crate::families::llama::family()
            }
        }
        "qwen3" => crate::families::qwen3::family(),
        "phi3" => {
            if scaled {
                return unsupported_scaling("this");
            }
            let rotary_dim =
                positive(c, path, &key("rope.dimension_count"))?.map_or(head_dim, |d| d as usize);
            let context = meta_usize(c, path, &key("context_length")).unwrap_or(4096);
            Arc::new(Phi3 {
                act: Activation::Silu,
                rotary_dim,
                long_rope: long_rope(c, path, &key, rotary_dim, context)?,
                sliding_window: None,
            })
        }
        "gemma" | "gemma2" => {
            if scaled {
                return unsupported_scaling("this");
            }
            let v2 = arch == "gemma2";
            let (softcap_attn, softcap_final, window) = if v2 {
                (
                    positive(c, path, &key("attn_logit_softcapping"))?.or(Some(50.0)),
                    positive(c, path, &key("final_logit_softcapping"))?.or(Some(30.0)),
                    Some(
                        positive(c, path, &key("attention.sliding_window"))?
                            .map_or(4096, |w| w as usize),
                    ),
                )
            } else {
                (None, None, None)
            };
            let sliding_layers =
                swa_layers(c, path, &key, num_hidden_layers, if v2 { 2 } else { 0 })?;
            Arc::new(Gemma {
                version: if v2 { 2 } else { 1 },
                act: Activation::GeluTanh,
                query_pre_attn_scalar: if v2 {
                    gemma_scalar(46)
                } else {
                    head_dim as f64
                },
                attn_logit_softcapping: softcap_attn,
                final_logit_softcapping: softcap_final,
                sliding_window: window,
                sliding_layers,
                norm_offset: 0.0,
            })
        }
        "gemma3" => {
            if scaled && scaling_type != "linear" {
                return unsupported_scaling("non-linear");
            }
            let window = positive(c, path, &key("attention.sliding_window"))?.map(|w| w as usize);
            let sliding_layers = match window {
                Some(_) => swa_layers(c, path, &key, num_hidden_layers, 6)?,
                None => vec![false; num_hidden_layers],
            };
            Arc::new(Gemma3 {
                act: Activation::GeluTanh,
                query_pre_attn_scalar: gemma_scalar(62),
                attn_logit_softcapping: None,
                final_logit_softcapping: positive(c, path, &key("final_logit_softcapping"))?,
                sliding_window: window,
                sliding_layers,
                global_rope: RopeBase {
                    theta: rope_theta,
                    factor: if scaled { scaling_factor } else { 1.0 },
                },
                local_rope: RopeBase {
                    theta: positive(c, path, &key("rope.freq_base_swa"))?.unwrap_or(10_000.0),
                    factor: 1.0,
                },
                keys: TextKeys::Text,
                norm_offset: 0.0,
            })
        }
        other => unreachable!("{other} is checked against SUPPORTED"),
    };
    cfg.family = family;
    cfg.validate(path)?;
    Ok(cfg)
}

/// Which layers are local (sliding-window): `attention.sliding_window_pattern` as one flag per
/// layer, or a number `n` (layer `i` is local unless `i % n == n - 1`; 0: all local), or
/// `default` when absent (0 here: none).
fn swa_layers(
    c: &Content,
    path: &Path,
    key: &dyn Fn(&str) -> String,
    n: usize,
    default: usize,
) -> Result<Vec<bool>> {
    let k = key("attention.sliding_window_pattern");
    let pattern = match c.metadata.get(&k) {
        None if default == 0 => return Ok(vec![false; n]),
        None => default,
        Some(Value::Array(flags)) => {
            let flags: Vec<bool> = flags.iter().filter_map(|f| f.to_bool().ok()).collect();
            if flags.len() < n {
                return Err(ModelError::config(
                    path,
                    &k,
                    format!("{} flags for {n} layers", flags.len()),
                ));
            }
            return Ok(flags[..n].to_vec());
        }
        Some(_) => number(c, &k)
            .filter(|p| *p >= 0.0)
            .ok_or_else(|| ModelError::config(path, &k, "expected a number or a list of flags"))?
            as usize,
    };
    Ok((0..n)
        .map(|i| pattern == 0 || i % pattern < pattern - 1)
        .collect())
}

/// The HF name of a GGUF tensor of `arch`, and whether its rows are permuted; `None` for
/// tensors the model does not use.
/// The `n` positive factors of the small F32 tensor `name` (RoPE factors per rotated pair),
/// read from the file; a tensor that is missing, of another length or not positive is an
/// error naming it.
fn factor_tensor(c: &Content, path: &Path, name: &str, n: usize) -> Result<Vec<f64>> {
    let bad = |e: String| ModelError::Tensor {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        reason: e,
    };
    if !c.tensor_infos.contains_key(name) {
        return Err(bad("is missing".into()));
    }
    let mut file = std::fs::File::open(path)
        .map_err(|e| ModelError::file(path, format!("cannot open: {e}")))?;
    let values = c
        .tensor(&mut file, name, &candle_core::Device::Cpu)
        .and_then(|t| t.dequantize(&candle_core::Device::Cpu))
        .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
        .map_err(|e| bad(e.to_string()))?;
    if values.len() != n {
        return Err(bad(format!(
            "{} factors for a rotary width of {} (want {n})",
            values.len(),
            2 * n
        )));
    }
    if let Some(v) = values.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
        return Err(bad(format!("factor {v} is not a positive number")));
    }
    Ok(values.into_iter().map(f64::from).collect())
}

/// Phi-3's LongRoPE as llama.cpp's converter stores it: the per-dimension factors as the
/// tensors `rope_factors_short.weight` and `rope_factors_long.weight` (F32, rotary_dim / 2
/// each), the pre-training context as `rope.scaling.original_context_length` and the cos/sin
/// multiplier as `rope.scaling.attn_factor` (where absent, transformers' default from the two
/// contexts). `None` where the file has no factors.
fn long_rope(
    c: &Content,
    path: &Path,
    key: &dyn Fn(&str) -> String,
    rotary_dim: usize,
    context: usize,
) -> Result<Option<LongRope>> {
    const SHORT: &str = "rope_factors_short.weight";
    const LONG: &str = "rope_factors_long.weight";
    match (
        c.tensor_infos.contains_key(SHORT),
        c.tensor_infos.contains_key(LONG),
    ) {
        (false, false) => return Ok(None),
        (true, true) => {}
        (short, _) => {
            return Err(ModelError::Tensor {
                path: path.to_path_buf(),
                tensor: (if short { LONG } else { SHORT }).to_string(),
                reason: "missing: LongRoPE needs both the short and the long factors".into(),
            })
        }
    }
    let original = match positive(c, path, &key("rope.scaling.original_context_length"))? {
        Some(n) => n as usize,
        None => 4096,
    };
    let factor = context as f64 / original as f64;
    let attention_factor = match positive(c, path, &key("rope.scaling.attn_factor"))? {
        Some(a) => a,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
    };
    Ok(Some(LongRope {
        short_factor: factor_tensor(c, path, SHORT, rotary_dim / 2)?,
        long_factor: factor_tensor(c, path, LONG, rotary_dim / 2)?,
        original_max_position_embeddings: original,
        attention_factor,
    }))
}

pub(crate) fn hf_name(arch: &str, gguf: &str) -> Option<(String, Option<Permuted>)> {
    let fixed = match gguf {
        "token_embd.weight" => Some(("model.embed_tokens.weight", None)),
        "output_norm.weight" => Some(("model.norm.weight", None)),
        "output.weight" => Some(("lm_head.weight", None)),
        _ => None,
    };
    if let Some((f, perm)) = fixed {
        return Some((f.to_string(), perm));
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    // llama.cpp's converter permutes q and k for the llama architecture only (the others use
    // the rotate-half rope, as HF does).
    let permuted = matches!(arch, "llama" | "mistral");
    let perm = |p| {
        if permuted {
            Some(p)
        } else {
            None
        }
    };
    let (hf, perm) = match (arch, tail) {
        (_, "attn_q.weight") => ("self_attn.q_proj.weight", perm(Permuted::Q)),
        (_, "attn_k.weight") => ("self_attn.k_proj.weight", perm(Permuted::K)),
        (_, "attn_q.bias") => ("self_attn.q_proj.bias", perm(Permuted::Q)),
        (_, "attn_k.bias") => ("self_attn.k_proj.bias", perm(Permuted::K)),
        (_, "attn_v.weight") => ("self_attn.v_proj.weight", None),
        (_, "attn_v.bias") => ("self_attn.v_proj.bias", None),
        ("phi3", "attn_qkv.weight") => ("self_attn.qkv_proj.weight", None),
        (_, "attn_output.weight") => ("self_attn.o_proj.weight", None),
        (_, "attn_q_norm.weight") => ("self_attn.q_norm.weight", None),
        (_, "attn_k_norm.weight") => ("self_attn.k_norm.weight", None),
        ("phi3", "ffn_up.weight") => ("mlp.gate_up_proj.weight", None),
        (_, "ffn_gate_inp.weight") => ("mlp.gate.weight", None),
        (_, "ffn_gate_inp_shexp.weight") => ("mlp.shared_expert_gate.weight", None),
        (_, "ffn_gate_shexp.weight") => ("mlp.shared_expert.gate_proj.weight", None),
        (_, "ffn_up_shexp.weight") => ("mlp.shared_expert.up_proj.weight", None),
        (_, "ffn_down_shexp.weight") => ("mlp.shared_expert.down_proj.weight", None),
        (_, "ffn_gate.weight") => ("mlp.gate_proj.weight", None),
        (_, "ffn_up.weight") => ("mlp.up_proj.weight", None),
        (_, "ffn_down.weight") => ("mlp.down_proj.weight", None),
        (_, "attn_norm.weight") => ("input_layernorm.weight", None),
        ("gemma2" | "gemma3", "post_attention_norm.weight") => {
            ("post_attention_layernorm.weight", None)
        }
        ("gemma2" | "gemma3", "ffn_norm.weight") => ("pre_feedforward_layernorm.weight", None),
        ("gemma2" | "gemma3", "post_ffw_norm.weight") => {
            ("post_feedforward_layernorm.weight", None)
        }
        (_, "ffn_norm.weight") => ("post_attention_layernorm.weight", None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}"), perm))
}

/// A stack of every expert's projection of one layer (`blk.{l}.ffn_{gate,up,down}_exps.weight`,
/// experts first): the layer and the HF name of expert `e`'s slice, `None` for other tensors.
pub(crate) fn expert_stack(gguf: &str) -> Option<(usize, impl Fn(usize) -> String)> {
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let proj = match tail {
        "ffn_gate_exps.weight" => "gate_proj",
        "ffn_up_exps.weight" => "up_proj",
        "ffn_down_exps.weight" => "down_proj",
        _ => return None,
    };
    Some((layer, move |e: usize| {
        format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight")
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_stacks_name_each_expert() {
        let (l, name) = expert_stack("blk.7.ffn_down_exps.weight").unwrap();
        assert_eq!(l, 7);
        assert_eq!(name(3), "model.layers.7.mlp.experts.3.down_proj.weight");
        assert!(expert_stack("blk.7.ffn_down.weight").is_none());
        assert!(expert_stack("output.weight").is_none());
        assert_eq!(
            hf_name("qwen3moe", "blk.1.ffn_gate_inp.weight").unwrap().0,
            "model.layers.1.mlp.gate.weight"
        );
    }

    #[test]
    fn names_map_per_architecture() {
        let name = hf_name;
        assert_eq!(
            name("llama", "blk.3.attn_q.weight"),
            Some((
                "model.layers.3.self_attn.q_proj.weight".into(),
                Some(Permuted::Q)
            ))
        );
        // Rotate-half architectures are stored as HF has them.
        for arch in ["qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3"] {
            assert_eq!(name(arch, "blk.0.attn_k.weight").unwrap().1, None, "{arch}");
        }
        assert_eq!(
            name("phi3", "blk.1.attn_qkv.weight").unwrap().0,
            "model.layers.1.self_attn.qkv_proj.weight"
        );
        assert_eq!(
            name("phi3", "blk.1.ffn_up.weight").unwrap().0,
            "model.layers.1.mlp.gate_up_proj.weight"
        );
        assert_eq!(
            name("llama", "blk.1.ffn_up.weight").unwrap().0,
            "model.layers.1.mlp.up_proj.weight"
        );
        assert_eq!(
            name("qwen3", "blk.2.attn_q_norm.weight"),
            Some(("model.layers.2.self_attn.q_norm.weight".into(), None))
        );
        assert_eq!(
            name("gemma3", "blk.2.attn_k_norm.weight"),
            Some(("model.layers.2.self_attn.k_norm.weight".into(), None))
        );
        assert_eq!(
            name("gemma2", "blk.0.ffn_norm.weight").unwrap().0,
            "model.layers.0.pre_feedforward_layernorm.weight"
        );
        assert_eq!(
            name("gemma", "blk.0.ffn_norm.weight").unwrap().0,
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(name("llama", "output_norm.weight").unwrap().1, None);
        assert!(name("llama", "rope_freqs.weight").is_none());
    }
}
