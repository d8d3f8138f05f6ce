//! The fused ops of `candle_offload::kernels` against the Candle compositions they replace, per
//! device (the CPU runs their CPU loops, CUDA the project's kernels): F32 within 1e-5, F16 and
//! BF16 within 1e-2 (max abs difference over the reference's max abs), odd widths, decode (one
//! row) and prefill (many rows) shapes, GQA/MQA, sliding windows, strided KV-cache views and
//! partial rotary; bad inputs are refused; and
//! the tiny models give the same logits with the fused ops on and off.

mod activation;
mod attention;
pub(crate) mod common;
mod fused_models;
mod gemm;
mod layer;
pub(crate) mod linear;
mod norm;
mod refused;
pub(crate) mod rope;
mod routed;
