//! Sparse mixture-of-experts families: Mixtral (`MixtralForCausalLM`: the LLaMA block with
//! every MLP a mixture of experts, top-k renormalised), Qwen3-MoE (`Qwen3MoeForCausalLM`:
//! Qwen3's attention with per-head q/k norms; the layers `decoder_sparse_step` and
//! `mlp_only_layers` choose are mixtures of `num_experts` experts of width
//! `moe_intermediate_size`, the others dense MLPs; renormalised when `norm_topk_prob`) and
//! Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen2's attention with q/k/v biases, Qwen3-MoE's layer
//! choice and routing, and a shared expert of `shared_expert_intermediate_size` every row goes
//! through, scaled by a sigmoid gate).
//!
//! Three checkpoint layouts of the experts, found from the checkpoint's tensor names
//! ([`Family::for_checkpoint`]):
//! - one tensor per expert under `mlp.experts.{e}.{gate,up,down}_proj` (Qwen3-MoE, and both
//!   families from GGUF), or Mixtral's `block_sparse_moe.experts.{e}.{w1,w3,w2}` with its
//!   router at `block_sparse_moe.gate`: each expert is then a unit of its own
//!   ([`Layout::experts`]);
//! - fused stacks, `mlp.experts.gate_up_proj` (experts, 2·inter, hidden) and
//!   `mlp.experts.down_proj` (experts, hidden, inter), as transformers 5 holds them: the
//!   experts stay in their layer's unit, each a view of the stacks.

use std::sync::Arc;

use candle_core::{DType, Result};

use crate::family::{
    dense_mlp_activation_bytes, Config, DecoderBlock, ExpertLayout, Family, Layout, UnitWeights,
};
use crate::hf_config::{CommonDefaults, HfFields, Registration};
use crate::layers::{
    attention_tensors, hf_tensors, mlp_tensors, norm_tensors, Activation, AttentionSpec,
    ExpertShape, Experts, GatedMlp, Norm, PreNormBlock, Routing, SelfAttention, SharedExpert,
    SparseMoe, TensorShape,
};
use crate::ModelError;

/// `mixtral`, `qwen3_moe` and `qwen2_moe` configs.
pub const REGISTRATION: Registration = Registration {
    model_types: &[
        ("mixtral", "MixtralForCausalLM"),
        ("qwen3_moe", "Qwen3MoeForCausalLM"),
        ("qwen2_moe", "Qwen2MoeForCausalLM"),
    ],
    from_hf,
};

/// Which family's block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeKind {
    /// Mixtral: LLaMA attention.
    Mixtral,
    /// Qwen3-MoE: Qwen3 attention (per-head q/k norms).
    Qwen3Moe,
    /// Qwen2-MoE: Qwen2 attention (q/k/v biases) and a gated shared expert.
    Qwen2Moe,
}

/// How a checkpoint stores a layer's router and experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertKeys {
    /// `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`.
    PerExpert,
    /// Mixtral's `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.{w1,w3,w2}`.
    MixtralPerExpert,
    /// `mlp.gate`, `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` stacks.
    Fused,
}

impl ExpertKeys {
    /// The router's prefix inside a layer.
    pub fn router(self) -> &'static str {
        match self {
            Self::MixtralPerExpert => "block_sparse_moe.gate",
            _ => "mlp.gate",
        }
    }

    /// The experts' prefix inside a layer (followed by the expert index, or by the stacks).
    pub fn infix(self) -> &'static str {
        match self {
            Self::MixtralPerExpert => "block_sparse_moe.experts.",
            _ => "mlp.experts.",
        }
    }

    /// Gate, up and down names under one expert's prefix.
    pub fn names(self) -> [&'static str; 3] {
        match self {
            Self::MixtralPerExpert => ["w1", "w3", "w2"],
            _ => ["gate_proj", "up_proj", "down_proj"],
        }
    }

    /// The layout of the checkpoint whose tensors are `names`, `None` when it has no experts.
    pub fn of_checkpoint(names: &[String]) -> Option<Self> {
        if names.iter().any(|n| n.ends_with(".experts.gate_up_proj")) {
            Some(Self::Fused)
        } else if names
            .iter()
            .any(|n| n.contains(".block_sparse_moe.experts."))
        {
            Some(Self::MixtralPerExpert)
        } else if names.iter().any(|n| n.contains(".mlp.experts.")) {
            Some(Self::PerExpert)
        } else {
            None
        }
    }
}

/// A mixture-of-experts family. See the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    /// Mixtral or Qwen3-MoE.
    pub kind: MoeKind,
    /// Experts, top-k and renormalisation.
    pub routing: Routing,
    /// Each expert's MLP width.
    pub expert_intermediate: usize,
    /// Per layer, whether it is a mixture of experts (the others: dense MLPs of
    /// `intermediate_size`).
    pub sparse: Vec<bool>,
    /// The checkpoint's expert layout.
    pub keys: ExpertKeys,
    /// Per layer, the sliding window of its attention, if any.
    pub windows: Vec<Option<usize>>,
    /// The shared expert's MLP width (Qwen2-MoE), in every sparse layer.
    pub shared_intermediate: Option<usize>,
}

fn from_hf(f: &HfFields<'_>) -> crate::Result<Config> {
    let rope_scaling = super::llama::llama3_rope_scaling(f)?;
    let mixtral = f.model_type == "mixtral";
    let qwen2 = f.model_type == "qwen2_moe";
    let defaults = CommonDefaults {
        attention_bias: qwen2 && f.bool_or("qkv_bias", true)?,
        ..CommonDefaults::default()
    };
    let mut cfg = Config::from_hf_common(f, super::llama::family(), defaults)?;
    cfg.rope_scaling = rope_scaling;
    let n = cfg.num_hidden_layers;
    let experts = match f.opt_usize("num_experts")? {
        Some(e) => e,
        None => f.usize("num_local_experts")?,
    };
    let top_k = f.usize("num_experts_per_tok")?;
    if top_k > experts {
        return Err(ModelError::config(
            f.path,
            "num_experts_per_tok",
            format!("{top_k} is more than the {experts} experts"),
        ));
    }
    let (kind, renormalize, expert_intermediate, sparse, keys) = if mixtral {
        let all = vec![true; n];
        (
            MoeKind::Mixtral,
            true,
            cfg.intermediate_size,
            all,
            ExpertKeys::MixtralPerExpert,
        )
    } else {
        let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
        let dense: Vec<usize> = match f.get("mlp_only_layers") {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|x| x.as_u64().map(|x| x as usize))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| {
                    ModelError::config(f.path, "mlp_only_layers", "expected a list of layers")
                })?,
        };
        let sparse = (0..n)
            .map(|l| !dense.contains(&l) && (l + 1) % step == 0)
            .collect();
        (
            if qwen2 {
                MoeKind::Qwen2Moe
            } else {
                MoeKind::Qwen3Moe
            },
            f.bool_or("norm_topk_prob", false)?,
            f.usize("moe_intermediate_size")?,
            sparse,
            ExpertKeys::PerExpert,
        )
    };
    cfg.family = Arc::new(Moe {
        kind,
        routing: Routing {
            experts,
            top_k,
            renormalize,
        },
        expert_intermediate,
        sparse,
        keys,
        windows: super::llama::windows(f, n)?,
        shared_intermediate: if qwen2 {
            Some(f.usize("shared_expert_intermediate_size")?)
        } else {
            None
        },
    });
    Ok(cfg)
}

impl Moe {
    fn is_sparse(&self, layer: usize) -> bool {
        self.sparse.get(layer).copied().unwrap_or(false)
    }
}

impl Family for Moe {
    fn name(&self) -> &str {
        match self.kind {
            MoeKind::Mixtral => "mixtral",
            MoeKind::Qwen3Moe => "qwen3_moe",
            MoeKind::Qwen2Moe => "qwen2_moe",
        }
    }

    fn tensors(&self, cfg: &Config) -> Vec<TensorShape> {
        let (h, i, e) = (
            cfg.hidden_size,
            self.expert_intermediate,
            self.routing.experts,
        );
        let mut out = hf_tensors(cfg, |_, _| {});
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            attention_tensors(&p, cfg, &mut out);
            if self.kind == MoeKind::Qwen3Moe {
                let qk = ["self_attn.q_norm", "self_attn.k_norm"];
                norm_tensors(&p, &qk, cfg.head_dim, &mut out);
            }
            let norms = ["input_layernorm", "post_attention_layernorm"];
            norm_tensors(&p, &norms, h, &mut out);
            if !self.is_sparse(l) {
                mlp_tensors(&p, cfg, &mut out);
                continue;
            }
            let k = self.keys;
            out.push((format!("{p}.{}.weight", k.router()), vec![e, h]));
            if let Some(si) = self.shared_intermediate {
                for (name, shape) in [
                    ("gate_proj", vec![si, h]),
                    ("up_proj", vec![si, h]),
                    ("down_proj", vec![h, si]),
                ] {
                    out.push((format!("{p}.mlp.shared_expert.{name}.weight"), shape));
                }
                out.push((format!("{p}.mlp.shared_expert_gate.weight"), vec![1, h]));
            }
            let x = format!("{p}.{}", k.infix());
            if k == ExpertKeys::Fused {
                out.push((format!("{x}gate_up_proj"), vec![e, 2 * i, h]));
                out.push((format!("{x}down_proj"), vec![e, h, i]));
            } else {
                let [g, u, d] = k.names();
                for j in 0..e {
                    out.push((format!("{x}{j}.{g}.weight"), vec![i, h]));
                    out.push((format!("{x}{j}.{u}.weight"), vec![i, h]));
                    out.push((format!("{x}{j}.{d}.weight"), vec![h, i]));
                }
            }
        }
        out
    }

    fn layout(&self, cfg: &Config) -> Layout {
        Layout {
            experts: (self.keys != ExpertKeys::Fused).then(|| ExpertLayout {
                infix: self.keys.infix().into(),
                count: self.routing.experts,
                sparse: self.sparse.clone(),
            }),
            ..Layout::hf(cfg.tie_word_embeddings)
        }
    }

    fn for_checkpoint(&self, _cfg: &Config, names: &[String]) -> Option<Arc<dyn Family>> {
        let keys = ExpertKeys::of_checkpoint(names)?;
        (keys != self.keys).then(|| {
            Arc::new(Self {
                keys,
                ..self.clone()
            }) as Arc<dyn Family>
        })
    }

    fn plain_attention(&self, _cfg: &Config) -> bool {
        self.windows.iter().all(Option::is_none)
    }

    /// The larger of a dense layer's MLP and a sparse layer's: the routers' logits, each row's
    /// copies (`top_k` a row) gathered and through their experts in F32 (the input, its
    /// 8-bit quantization, the gate and up, their product, the output), the rows' sum, the
    /// largest expert dequantized to 16 bits (an expert of many rows through cuBLAS), and the
    /// shared expert's MLP.
    fn mlp_activation_bytes(&self, cfg: &Config, seq_len: usize, dtype: DType) -> u64 {
        let (s, h) = (seq_len as u64, cfg.hidden_size as u64);
        let dense = if self.sparse.iter().all(|&x| x) {
            0
        } else {
            dense_mlp_activation_bytes(seq_len, cfg.intermediate_size, dtype)
        };
        let ei = self.expert_intermediate as u64;
        let copies = s * self.routing.top_k as u64;
        // F32 input, Q8_1 input (36 bytes per 32 values), output; gate, up and product.
        let per_copy = h * 4 + h.div_ceil(32) * 36 + h * 4 + 3 * ei * 4;
        let routed =
            4 * s * self.routing.experts as u64 + copies * per_copy + s * h * 4 + 3 * h * ei * 2;
        let shared = self
            .shared_intermediate
            .map_or(0, |w| dense_mlp_activation_bytes(seq_len, w, dtype));
        dense.max(routed + shared)
    }

    fn block(
        &self,
        cfg: &Config,
        w: UnitWeights<'_>,
        layer: usize,
        norm_dtype: DType,
    ) -> Result<Box<dyn DecoderBlock>> {
        let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let norm = |name: &str, n| Norm::load(n, eps, 0.0, w.vb().pp(name), norm_dtype);
        let spec = AttentionSpec {
            window: self.windows.get(layer).copied().flatten(),
            ..AttentionSpec::of(cfg)
        };
        let mut attn = SelfAttention::load(w.pp("self_attn"), h, spec, cfg.attention_bias)?;
        if self.kind == MoeKind::Qwen3Moe {
            attn = attn.with_qk_norm(norm("self_attn.q_norm", hd)?, norm("self_attn.k_norm", hd)?);
        }
        let mlp = if self.is_sparse(layer) {
            let k = self.keys;
            let i = self.expert_intermediate;
            let e = self.routing.experts;
            let x = w.pp(k.infix().trim_end_matches('.'));
            let shape = ExpertShape {
                names: k.names(),
                hidden: h,
                intermediate: i,
            };
            let experts = if k == ExpertKeys::Fused {
                let gate_up = x.vb().get((e, 2 * i, h), "gate_up_proj")?;
                let down = x.vb().get((e, h, i), "down_proj")?;
                Experts::InLayer(SparseMoe::stacked_experts(&gate_up, &down, w.kernels())?)
            } else if x.contains(&format!("0.{}.weight", shape.names[0])) {
                // The experts were grouped with the layer (a store not split by expert).
                Experts::InLayer(
                    (0..e)
                        .map(|j| Ok(Arc::new(shape.load(x.pp(j))?)))
                        .collect::<Result<_>>()?,
                )
            } else {
                Experts::Units(shape)
            };
            let shared = match self.shared_intermediate {
                Some(si) => Some(Box::new(SharedExpert {
                    mlp: GatedMlp::load(w.pp("mlp.shared_expert"), h, si, Activation::Silu)?,
                    gate: w.pp("mlp.shared_expert_gate").linear(h, 1, false)?,
                })),
                None => None,
            };
            SparseMoe {
                router: w.pp(k.router()).linear(h, e, false)?,
                routing: self.routing,
                experts,
                layer,
                shared,
            }
            .into()
        } else {
            GatedMlp::load(w.pp("mlp"), h, cfg.intermediate_size, Activation::Silu)?.into()
        };
        Ok(Box::new(PreNormBlock {
            input_norm: norm("input_layernorm", h)?,
            attn,
            post_attn_norm: None,
            pre_mlp_norm: norm("post_attention_layernorm", h)?,
            mlp,
            post_mlp_norm: None,
        }))
    }
}
