#!/usr/bin/env python3
"""Writes random-weight checkpoints of every model family with HF transformers, and their
reference outputs.

Usage: python3 scripts/hf_reference.py OUT_DIR [NAME ...]
For each configuration NAME (all of them when none is named) it writes OUT_DIR/NAME/
(config.json, model.safetensors) and OUT_DIR/NAME/reference.json: the input ids, the float32
logits for every position, the logits of the same model run in float16 and bfloat16, and 32
greedy tokens (float32, no KV cache: the whole sequence is run again for every token).
Used on the GPU machine by bench/src/bin/parity.rs (logit parity of our families with transformers).

The LLaMA configurations are written exactly as they always were. The Phi-3, Gemma and Qwen3 ones
run transformers' eager attention (the exact reference: Gemma 2's soft-capping needs it), and have
their norm weights drawn at random too (Qwen3's and Gemma 3's per-head q/k norms included), so that
Gemma's `1 + w` and every norm is exercised.

Phi-3's LongRoPE: transformers picks the long factors once the sequence seen so far is longer
than `original_max_position_embeddings`, our tables when the model is set up for more positions
than that (prompt + 32 here). `phi3_longrope` has an original context of 32, shorter than the
48-token prompt, so both use the long factors everywhere; `phi4_partial` has 256, longer than
prompt + 32, so both use the short ones. Both have max_position_embeddings 512, so the attention
factor sqrt(1 + ln(512 / original) / ln(original)) is not 1.
"""
import json
import os
import sys

import torch
import transformers
from transformers import LlamaConfig

SEQ, STEPS = 48, 32


def _factors(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return [round(float(x), 4) for x in lo + (hi - lo) * torch.rand(n, generator=g)]


# name -> (config class, model class, keyword arguments). The LLaMA entries keep the original
# script's defaults (SDPA attention, norms at 1); the others run eager with random norms.
CONFIGS = {
    # Llama-2 style: multi-head attention, separate output head.
    "llama2_mha": ("LlamaConfig", "LlamaForCausalLM",
                   dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=1024, tie_word_embeddings=False, rope_theta=10000.0)),
    # GQA (4 query heads per KV head) with tied embeddings, SmolLM style.
    "gqa_tied": ("LlamaConfig", "LlamaForCausalLM",
                 dict(hidden_size=256, intermediate_size=640, num_hidden_layers=5, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, rope_theta=100000.0)),
    # Llama 3 rope scaling, MQA.
    "llama3_mqa": ("LlamaConfig", "LlamaForCausalLM",
                   dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, vocab_size=1024, tie_word_embeddings=False, rope_theta=500000.0,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    # Phi-3 128k style: fused qkv_proj and gate_up_proj, GQA, LongRoPE with the long factors
    # (original context 32 < the 48-token prompt) and attention factor sqrt(1 + ln 16 / ln 32).
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM",
                      dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False,
                           original_max_position_embeddings=32,
                           rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                short_factor=_factors(16, 1.0, 1.5, 1),
                                                long_factor=_factors(16, 1.0, 8.0, 2)))),
    # Phi-4-mini style: partial rotary (24 of 32 dimensions), tied embeddings, a sliding window
    # of 24 (prompt + 32 crosses it), LongRoPE with the short factors (original context 256 >
    # prompt + 32) and attention factor sqrt(1 + ln 2 / ln 256).
    "phi4_partial": ("Phi3Config", "Phi3ForCausalLM",
                     dict(hidden_size=192, intermediate_size=384, num_hidden_layers=3, num_attention_heads=6,
                          num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, sliding_window=24,
                          original_max_position_embeddings=256,
                          rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                                               short_factor=_factors(12, 1.0, 3.0, 3),
                                               long_factor=_factors(12, 1.0, 8.0, 4)))),
    # Gemma: head_dim 256 on a 128-wide model, MQA, GeGLU, (1 + w) norms, scaled embeddings.
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, vocab_size=1024, hidden_act="gelu_pytorch_tanh",
                   rope_theta=10000.0)),
    # Gemma 2: GQA, pre/post norms, query_pre_attn_scalar 48 != head_dim 64, soft-capping that
    # bites on these weights (attention 10, logits 8), sliding window 12 on the even layers
    # (layer_types left to its default).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=1024, hidden_activation="gelu_pytorch_tanh",
                    query_pre_attn_scalar=48, attn_logit_softcapping=10.0, final_logit_softcapping=8.0,
                    sliding_window=12, rope_theta=10000.0)),
    # Mistral with a sliding window of 16 on every layer (prompt + 32 crosses it).
    "mistral_window": ("MistralConfig", "MistralForCausalLM",
                       dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                            num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False, rope_theta=10000.0,
                            sliding_window=16)),
    # Qwen2 with q/k/v biases and sliding windows of 16 on the layers from max_window_layers 1 on.
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False, rope_theta=10000.0,
                          use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    # Qwen3: per-head q/k RMSNorms (random weights), head_dim 48 != hidden / heads = 32, GQA, no
    # biases, separate output head.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=48, vocab_size=1024, tie_word_embeddings=False,
                   rope_theta=1000000.0)),
    # Qwen3 with tied embeddings and sliding windows of 16 on the layers from max_window_layers 1
    # on (prompt + 32 crosses them).
    "qwen3_tied_window": ("Qwen3Config", "Qwen3ForCausalLM",
                          dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=64, vocab_size=1024,
                               tie_word_embeddings=True, rope_theta=10000.0, use_sliding_window=True,
                               sliding_window=16, max_window_layers=1)),
    # Gemma 3 text: q/k norms (1 + w, random), local layers with a window of 12 (crossed) and
    # RoPE base 10 beside global layers with base 100000 and linear scaling 4, GQA,
    # query_pre_attn_scalar 48 != head_dim 64, pre/post norms, tied embeddings.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=1024, hidden_activation="gelu_pytorch_tanh",
                    query_pre_attn_scalar=48, sliding_window=12,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                                     "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=100000.0)})),
    # Gemma 3 with a separate output head, MQA, and the pattern from sliding_window_pattern 3
    # (layers 2 and 5 global), window 20, bases 1000 (local) and 1000000 (global, scaled by 8).
    "gemma3_untied": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                      dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, vocab_size=1024,
                           hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32, sliding_window=20,
                           sliding_window_pattern=3, tie_word_embeddings=False,
                           rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1000.0),
                                            "full_attention": dict(rope_type="linear", factor=8.0,
                                                                   rope_theta=1000000.0)})),
    # Mixture-of-experts families (issue 55), each expert its own unit under the budget:
    # Qwen3-MoE: per-head q/k norms, top 2 of 8 experts renormalised, the middle layer dense
    # (mlp_only_layers), a separate head.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                       vocab_size=1024, tie_word_embeddings=False, rope_theta=1000000.0)),
    # Mixtral: top 2 of 4 experts (softmax over the chosen), GQA.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(hidden_size=128, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                     tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=None)),
    # Qwen2-MoE: q/k/v biases, top 3 of 6 not renormalised, and the shared expert with its
    # sigmoid gate.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=6,
                       num_experts_per_tok=3, norm_topk_prob=False, shared_expert_intermediate_size=96,
                       decoder_sparse_step=1, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=1024, tie_word_embeddings=False, rope_theta=1000000.0)),
}


def build(name):
    cfg_cls, model_cls, kw = CONFIGS[name]
    cfg_cls, model_cls = getattr(transformers, cfg_cls), getattr(transformers, model_cls)
    llama = cfg_cls is LlamaConfig
    torch.manual_seed(0)
    extra = {} if llama else dict(attn_implementation="eager")
    cfg = cfg_cls(**kw, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    model = model_cls(cfg).float().eval()
    if not llama:
        # Norm weights: Gemma's are applied as 1 + w (initialized to 0), the others as w.
        one = 0.0 if "Gemma" in model_cls.__name__ else 1.0
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(one + 0.2 * (torch.rand_like(p) - 0.5))
    return cfg, model


def main(out, names):
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for name in names or CONFIGS:
        cfg, model = build(name)
        path = os.path.join(out, name)
        model.save_pretrained(path, safe_serialization=True)
        ids = torch.randint(0, cfg.vocab_size, (1, SEQ))
        model = model.to(dev)
        ref = {"input_ids": ids[0].tolist()}
        with torch.no_grad():
            ref["logits_f32"] = model(ids.to(dev)).logits[0].float().cpu().tolist()
            seq = ids.to(dev)
            greedy = []
            for _ in range(STEPS):
                nxt = model(seq).logits[0, -1].argmax()
                greedy.append(int(nxt))
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            ref["greedy_f32"] = greedy
            for dt, key in ((torch.float16, "logits_f16"), (torch.bfloat16, "logits_bf16")):
                ref[key] = model.to(dt)(ids.to(dev)).logits[0].float().cpu().tolist()
                model = model.float()
        with open(os.path.join(path, "reference.json"), "w") as f:
            json.dump(ref, f)
        print(f"{name}: wrote {path}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
