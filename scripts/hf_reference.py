#!/usr/bin/env python3
"""Writes random-weight LLaMA checkpoints with HF transformers and their reference outputs.

Usage: python3 scripts/hf_reference.py OUT_DIR
For each configuration NAME it writes OUT_DIR/NAME/ (config.json, model.safetensors) and
OUT_DIR/NAME/reference.json: the input ids, the float32 logits for every position, the logits
of the same model run in float16 and bfloat16, and 32 greedy tokens (float32, no KV cache).
Used on the GPU machine by examples/parity.rs (logit parity of our LLaMA with transformers).
"""
import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIGS = {
    # Llama-2 style: multi-head attention, separate output head.
    "llama2_mha": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=8, vocab_size=1024, tie_word_embeddings=False, rope_theta=10000.0),
    # GQA (4 query heads per KV head) with tied embeddings, SmolLM style.
    "gqa_tied": dict(hidden_size=256, intermediate_size=640, num_hidden_layers=5, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, rope_theta=100000.0),
    # Llama 3 rope scaling, MQA.
    "llama3_mqa": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=1, vocab_size=1024, tie_word_embeddings=False, rope_theta=500000.0,
                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=64)),
}
SEQ, STEPS = 48, 32


def main(out):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for name, kw in CONFIGS.items():
        torch.manual_seed(0)
        cfg = LlamaConfig(**kw, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = LlamaForCausalLM(cfg).float().eval()
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
    main(sys.argv[1])
