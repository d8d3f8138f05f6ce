#!/usr/bin/env python3
"""Writes a 7B-shaped LLaMA (hidden 4096, 32 layers, intermediate 11008, 32 heads, vocab 32000)
with random fp16 weights, in the HF layout (config.json + sharded safetensors), with transformers.

Usage: python3 scripts/make_llama7b.py OUT_DIR   (on the GPU machine; ~12.6 GB on disk)
"""
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPE = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)

t0 = time.time()
torch.manual_seed(0)
torch.set_default_dtype(torch.float16)
dev = "cuda" if torch.cuda.is_available() else "cpu"
with torch.device(dev):
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
model.save_pretrained(sys.argv[1], safe_serialization=True, max_shard_size="4GB")
print(f"wrote {sys.argv[1]} in {time.time() - t0:.1f} s", flush=True)
