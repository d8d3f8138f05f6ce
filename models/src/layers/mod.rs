//! Building blocks shared by the model families: RoPE tables (`rope.rs`), the KV cache and the
//! causal, sliding-window and padded masks (`cache.rs`),
//! linear layers over dense or GGML weights (`linear.rs`), RMSNorm (plain and Gemma's
//! `1 + w`) and LayerNorm (`norm.rs`), self-attention (separate or fused q/k/v, per-head q/k
//! norms, local or global RoPE tables, GQA/MQA, optional logit soft-capping and sliding
//! window) with its training path (`attention.rs`), the gated MLP (SwiGLU, GeGLU; separate or
//! fused gate/up; `mlp.rs`), the sparse mixture-of-experts MLP (router, top-k, experts
//! built with the layer or acquired as units of their own; `moe.rs`), and the pre-norm
//! decoder block that LLaMA, Qwen3, Phi-3, Gemma 1/2/3, Mixtral and Qwen3-MoE are all
//! instances of (`block.rs`, its hand-written training pass in `by_hand.rs`);
//! `tensors.rs` lists an HF-layout checkpoint's tensors.
//!
//! A family file picks and names these pieces (`vb.pp(..)` names mirror its checkpoint keys);
//! nothing here knows a tensor name beyond what the caller passes in.

mod attention;
mod block;
mod by_hand;
mod cache;
mod linear;
mod mlp;
mod moe;
mod norm;
mod rope;
mod tensors;

pub use attention::{soft_cap, AttentionSpec, SelfAttention, DECODE_ATTENTION_MAX_NEW};
pub use block::{FeedForward, PreNormBlock};
pub use cache::{causal_mask, window_mask, Cache, KvCache, Masks};
pub use linear::{linear, linear_2d, Linear, LinearWeight, LoraAdapter};
pub use mlp::{Activation, GatedMlp};
pub use moe::{
    group_by_expert, route_row, route_rows, separate_blocks, BuildExpert, Expert, ExpertShape,
    ExpertSite, ExpertUnits, Experts, Routing, SharedExpert, SparseMoe, ROUTE_CHUNK_ROWS,
};
pub use norm::Norm;
pub use rope::Rope;
pub use tensors::{attention_tensors, hf_tensors, mlp_tensors, norm_tensors, TensorShape};
