#!/usr/bin/env python3
"""llama.cpp's greedy answers under one attention configuration of its own, through the same
`xllamacpp` CPU wheel as ../shared/peer/llamacpp/cpu_peer.py (which runs llama.cpp's defaults:
flash attention where it can, the KV cache in F16).

Usage: cpu_peer_attention.py MODEL.gguf THREADS FLASH_ATTN CACHE_TYPE [PROMPT ...]
FLASH_ATTN: llama.cpp's flash_attn_type (-1 auto, 0 off, 1 on); CACHE_TYPE: its ggml type of
the KV cache (0 F32, 1 F16). Each prompt is answered greedily with 32 new tokens (the GGUF's chat
template); one JSON line per prompt with the answer. Used by scripts/cpu_default_bench.py to see
how far llama.cpp's own answers move with its attention's arithmetic."""
import json
import sys

import xllamacpp as xlc

model, threads, fa, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompts = sys.argv[5:] or ["What is the capital of France?"]
params = xlc.CommonParams()
params.model.path = model
params.n_ctx = 1024
params.cpuparams.n_threads = threads
params.cpuparams_batch.n_threads = threads
params.flash_attn_type = fa
params.cache_type_k = cache
params.cache_type_v = cache
server = xlc.Server(params)
for prompt in prompts:
    r = server.handle_chat_completions({"messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": 32, "temperature": 0.0})
    print(json.dumps({"prompt": prompt, "answer": r["choices"][0]["message"]["content"]}), flush=True)
