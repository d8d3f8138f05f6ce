//! What a [`Config`] implies: RoPE inverse frequencies, the device bytes a run reserves beside
//! the weights (KV cache, activations, the quantized matmul's workspace, a batch), and a
//! training step's FLOPs and memory. `Config` itself is defined with the
//! [`Family`](crate::family::Family) it names, in [`crate::family`]; reading and writing an HF
//! `config.json` is in [`crate::hf_config`] and [`crate::families`].

use candle_transformers::models::llama::Llama3RopeType;

pub use crate::family::Config;

impl Config {
    /// RoPE inverse frequencies, with Llama 3 scaling where configured.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let base: Vec<f32> = (0..self.head_dim)
            .step_by(2)
            .map(|i| 1f32 / self.rope_theta.powf(i as f32 / self.head_dim as f32))
            .collect();
        match &self.rope_scaling {
            Some(r) if !matches!(r.rope_type, Llama3RopeType::Default) => {
                let low = r.original_max_position_embeddings as f32 / r.low_freq_factor;
                let high = r.original_max_position_embeddings as f32 / r.high_freq_factor;
                base.into_iter()
                    .map(|freq| {
                        let wavelen = 2. * std::f32::consts::PI / freq;
                        if wavelen < high {
                            freq
                        } else if wavelen > low {
                            freq / r.factor
                        } else {
                            let smooth = (r.original_max_position_embeddings as f32 / wavelen
                                - r.low_freq_factor)
                                / (r.high_freq_factor - r.low_freq_factor);
                            (1. - smooth) * freq / r.factor + smooth * freq
                        }
                    })
                    .collect()
            }
            _ => base,
        }
    }

    /// Device bytes to reserve beside the weights for a forward pass over `seq_len` new tokens
    /// with up to `max_len` positions in all: the KV cache (allocated once, whole); the live
    /// activations of one layer (hidden states, the MLP, f32 attention: queries, keys and
    /// values, scores and their softmax) with half again for the allocator's fragmentation;
    /// the logits; and 256 MiB for library workspaces (cuBLAS) and small tables.
    /// Sized from measured peaks (docs/tuning.md, "Reservation and fragmentation allowance").
    pub fn reserve_bytes(&self, seq_len: usize, max_len: usize, dtype: candle_core::DType) -> u64 {
        self.reserve_bytes_with(seq_len, max_len, dtype, false)
    }

    /// [`reserve_bytes`](Self::reserve_bytes), where with `attention_kernel` a pass's attention
    /// runs as one kernel ([`candle_offload::kernels::attention::prompt_attention`] on a GPU): then it holds
    /// no F32 copies of q, k and v and no score matrix, only the rotated queries and the
    /// output (twice: as the kernel writes it and as the output projection reads it) in
    /// `dtype`.
    pub fn reserve_bytes_with(
        &self,
        seq_len: usize,
        max_len: usize,
        dtype: candle_core::DType,
        attention_kernel: bool,
    ) -> u64 {
        let kv = self.kv_cache_bytes(max_len, dtype);
        let live = self.layer_activation_bytes(seq_len, max_len, dtype, attention_kernel);
        let logits = 2 * 4 * self.vocab_size as u64;
        kv + live
            + self.fragmentation_bytes(seq_len, max_len, dtype, attention_kernel)
            + logits
            + (256 << 20)
    }

    /// The live activations of one layer for `seq_len` new rows (hidden states, the MLP, and
    /// the attention's buffers: with `attention_kernel` the rotated queries and the output, else
    /// the f32 composition's copies and scores over `max_len` positions), as
    /// [`reserve_bytes_with`](Self::reserve_bytes_with) counts them.
    fn layer_activation_bytes(
        &self,
        seq_len: usize,
        max_len: usize,
        dtype: candle_core::DType,
        attention_kernel: bool,
    ) -> u64 {
        let d = dtype.size_in_bytes() as u64;
        let (s, m) = (seq_len as u64, max_len as u64);
        let (nh, hd) = (self.num_attention_heads as u64, self.head_dim as u64);
        let hidden = 8 * s * self.hidden_size as u64 * d;
        let mlp = self.family.mlp_activation_bytes(self, seq_len, dtype);
        let attn = if attention_kernel {
            3 * s * nh * hd * d
        } else {
            4 * (2 * s * nh * hd + 2 * m * nh * hd + 3 * nh * s * m)
        };
        hidden + mlp + attn
    }

    /// The part of [`reserve_bytes_with`](Self::reserve_bytes_with) that allows for the
    /// allocator's fragmentation by those activations: half again their size. A stage that
    /// streams nothing while its prompt runs in passes may leave it out (the passes'
    /// allocations are all it makes, alike pass after pass; measured: docs/tuning.md).
    pub fn fragmentation_bytes(
        &self,
        seq_len: usize,
        max_len: usize,
        dtype: candle_core::DType,
        attention_kernel: bool,
    ) -> u64 {
        self.layer_activation_bytes(seq_len, max_len, dtype, attention_kernel) / 2
    }

    /// Device bytes a batch of `batch` sequences needs beyond [`reserve_bytes`](Self::reserve_bytes)
    /// for one (each further sequence's KV cache and activations; the workspace allowance is
    /// shared): what to add to `OffloadSettings::reserve_bytes` for
    /// [`generate_batch`](crate::generation::generate_batch).
    pub fn batch_reserve_bytes(
        &self,
        batch: usize,
        seq_len: usize,
        max_len: usize,
        dtype: candle_core::DType,
    ) -> u64 {
        let one = self.reserve_bytes(seq_len, max_len, dtype) - (256 << 20);
        batch.saturating_sub(1) as u64 * one
    }

    /// Device bytes Candle 0.11's CUDA quantized matmul holds beside the weights for `seq_len`
    /// rows, which the dense estimate above does not see: its stream-k fixup workspace (16 MiB,
    /// kept for the process), the activations quantized to Q8_1 blocks, and for the widest
    /// projection an F32 copy of the input and an F32 output (without it a budget can be
    /// passed: docs/tuning.md).
    ///
    /// From `tuning`'s [`prefill_gemm_min_rows`](candle_offload::KernelTuning::prefill_gemm_min_rows)
    /// rows on, a prompt's projections go through dequantized 16-bit weights and cuBLAS instead
    /// ([`candle_offload::kernels::gemm::qlinear_prefill`], [`candle_offload::kernels::gemm::prefill_gemm_bytes`]
    /// for the widest); block types without that kernel still take Candle's, so this is the
    /// larger of the two.
    pub fn quantized_matmul_bytes(
        &self,
        seq_len: usize,
        tuning: &candle_offload::KernelTuning,
    ) -> u64 {
        let s = seq_len as u64;
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let k = h.max(i) as u64;
        let fixup = 256 * 128 * 128 * 4;
        let q8_1 = (s * k.div_ceil(512) * 512 / 128 + 128) * 144;
        let mmq = fixup + q8_1 + 2 * s * k * 4;
        let q = self.num_attention_heads * self.head_dim;
        let gemm = [(i, h), (h, i), (q, h), (h, q)]
            .into_iter()
            .map(|(n, k)| candle_offload::kernels::gemm::prefill_gemm_bytes(seq_len, n, k, tuning))
            .max()
            .unwrap_or(0);
        mmq.max(gemm)
    }

    /// Model FLOPs of one training step per token at `seq_len` (forward and backward, no
    /// recomputation), as MFU counts them (PaLM, appendix B): 6 per matmul parameter, every
    /// projection and the head (the embedding table is a lookup, unless tied to the head),
    /// plus 12 · layers · heads · head_dim · seq_len for the attention scores and their
    /// weighted sum (causal masking not discounted).
    pub fn train_flops_per_token(&self, seq_len: usize) -> f64 {
        let (h, i, v) = (
            self.hidden_size as f64,
            self.intermediate_size as f64,
            self.vocab_size as f64,
        );
        let (nh, kv, hd) = (
            self.num_attention_heads as f64,
            self.num_key_value_heads as f64,
            self.head_dim as f64,
        );
        let layer = h * nh * hd + 2.0 * h * kv * hd + nh * hd * h + 3.0 * h * i;
        let matmul_params = self.num_hidden_layers as f64 * layer + h * v;
        6.0 * matmul_params + 12.0 * self.num_hidden_layers as f64 * nh * hd * seq_len as f64
    }

    /// [`train_flops_per_token`](Self::train_flops_per_token) of LoRA on a frozen base: the
    /// base's matmuls forward and backward to the activations only (4·N, no weight
    /// gradients), attention as there, and the adapters' `adapter_forward_flops` a token
    /// three times (forward, backward to x, backward to A and B). Recomputation is not
    /// counted, as there.
    pub fn lora_train_flops_per_token(&self, seq_len: usize, adapter_forward_flops: f64) -> f64 {
        let full = self.train_flops_per_token(seq_len);
        let attention = 12.0
            * self.num_hidden_layers as f64
            * self.num_attention_heads as f64
            * self.head_dim as f64
            * seq_len as f64;
        (full - attention) * 4.0 / 6.0 + attention + 3.0 * adapter_forward_flops
    }

    /// Device bytes a training step needs besides the weights, for `batch` sequences of
    /// `seq_len` tokens with `segments` checkpointed segments (0: none) and matmuls in
    /// `compute`: segment boundaries (F32), one segment's recomputed graph and its backward
    /// temporaries, one attention head group's scores (at most 64 MiB each), one chunk of
    /// output logits (at most 128 MiB), one segment's weight gradients, and workspace. An
    /// estimate, checked against measured peaks by the training benchmark.
    pub fn train_reserve_bytes(
        &self,
        batch: usize,
        seq_len: usize,
        segments: usize,
        compute: candle_core::DType,
    ) -> u64 {
        self.reserve_for_training(batch, seq_len, segments, compute, true)
    }

    /// [`train_reserve_bytes`](Self::train_reserve_bytes) of LoRA on a frozen base: the same
    /// without the base's weight gradients (the adapters' are negligible beside it).
    pub fn lora_train_reserve_bytes(
        &self,
        batch: usize,
        seq_len: usize,
        segments: usize,
        compute: candle_core::DType,
    ) -> u64 {
        self.reserve_for_training(batch, seq_len, segments, compute, false)
    }

    fn reserve_for_training(
        &self,
        batch: usize,
        seq_len: usize,
        segments: usize,
        compute: candle_core::DType,
        weight_grads: bool,
    ) -> u64 {
        let c = compute.size_in_bytes() as u64;
        let tokens = (batch * seq_len) as u64;
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let (nh, kv, hd) = (
            self.num_attention_heads as u64,
            self.num_key_value_heads as u64,
            self.head_dim as u64,
        );
        let layers = self.num_hidden_layers as u64;
        let seg_len = if segments == 0 {
            layers
        } else {
            layers.div_ceil(segments.min(self.num_hidden_layers).max(1) as u64)
        };
        let boundaries = (segments as u64 + 2) * tokens * h * 4;
        // Residual, norms and casts in F32; projections, rotary copies and the MLP in `c`.
        let per_layer = tokens * (12 * h * 4 + (3 * nh * hd + 4 * kv * hd + 2 * h) * c + 4 * i * c);
        let scores = 4 * (64u64 << 20);
        let logits = 5 * (128u64 << 20);
        let layer_weights = if weight_grads {
            (2 * h * nh * hd + 2 * h * kv * hd + 3 * h * i) * c
        } else {
            0
        };
        boundaries
            + 2 * seg_len * per_layer
            + scores
            + logits
            + 2 * seg_len * layer_weights
            + (256 << 20)
    }

    /// Bytes of the KV cache for `tokens` positions in `dtype`.
    pub fn kv_cache_bytes(&self, tokens: usize, dtype: candle_core::DType) -> u64 {
        (2 * self.num_hidden_layers
            * self.num_key_value_heads
            * self.head_dim
            * tokens
            * dtype.size_in_bytes()) as u64
    }
}

/// A model's RoPE tables: the rotation's own code (`layers/rope.rs`) knows no `Config`.
impl crate::layers::Rope {
    /// The tables of `cfg` (base `rope_theta`, Llama 3 scaling where configured).
    pub fn new(
        cfg: &Config,
        max_len: usize,
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> candle_core::Result<Self> {
        Self::from_inv_freq(&cfg.rope_inv_freq(), max_len, 1.0, dtype, device)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const SMOL: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":576,
        "intermediate_size":1536,"num_attention_heads":9,"num_hidden_layers":30,"num_key_value_heads":3,
        "rms_norm_eps":1e-05,"rope_theta":100000,"tie_word_embeddings":true,"vocab_size":49152,
        "max_position_embeddings":8192,"bos_token_id":1,"eos_token_id":2}"#;

    /// Llama 2 7B has 6,738,415,616 parameters: less the embedding table (32000 x 4096) and the
    /// Llama 2 7B has 6,738,415,616 parameters: less the embedding table (32000 x 4096) and the
    /// norms (65 x 4096), 6,607,077,376 multiply in matmuls.
    #[test]
    fn train_flops_count_llama2_7b() {
        let c = Config::from_json_str(
            r#"{"model_type":"llama","hidden_size":4096,"intermediate_size":11008,
            "num_attention_heads":32,"num_hidden_layers":32,"num_key_value_heads":32,
            "vocab_size":32000,"rms_norm_eps":1e-5}"#,
            Path::new("config.json"),
        )
        .unwrap();
        assert_eq!(c.train_flops_per_token(0), 6.0 * 6_607_077_376.0);
        let attention = c.train_flops_per_token(4096) - c.train_flops_per_token(0);
        assert_eq!(attention, 12.0 * 32.0 * 4096.0 * 4096.0);
    }

    /// With the prompt-attention kernel the reservation drops exactly the composition's F32
    /// q/k/v copies and score matrix (with the fragmentation allowance) and adds the kernel's
    /// three (rows, heads · head_dim) tensors in the dtype; SmolLM's llama family is plain
    /// causal, a config with a sliding window is not.
    #[test]
    fn the_attention_kernel_reserves_less() {
        let c = Config::from_json_str(SMOL, Path::new("config.json")).unwrap();
        assert!(c.family.plain_attention(&c));
        let (nh, hd) = (9u64, 64u64);
        for (s, m) in [(1u64, 16u64), (64, 96), (512, 544)] {
            let (su, mu) = (s as usize, m as usize);
            let dense = c.reserve_bytes(su, mu, candle_core::DType::F16);
            assert_eq!(
                c.reserve_bytes_with(su, mu, candle_core::DType::F16, false),
                dense
            );
            let kernel = c.reserve_bytes_with(su, mu, candle_core::DType::F16, true);
            let composition = 4 * (2 * s * nh * hd + 2 * m * nh * hd + 3 * nh * s * m);
            let own = 3 * s * nh * hd * 2;
            let rest = 8 * s * 576 * 2 + 4 * s * 1536 * 2; // hidden states and the MLP
            let want = (rest + composition) * 3 / 2 - (rest + own) * 3 / 2;
            assert_eq!(dense - kernel, want, "{s} rows");
        }
        let windowed = SMOL.replace(
            "\"model_type\":\"llama\"",
            "\"model_type\":\"mistral\",\"sliding_window\":4096",
        );
        let w = Config::from_json_str(&windowed, Path::new("config.json")).unwrap();
        assert!(!w.family.plain_attention(&w));
    }
}
