#!/usr/bin/env python3
"""llama.cpp on the CPU through the `xllamacpp` wheel, as a peer for a raw prompt (no chat
template: for random-weight GGUFs, which have none): greedy, N new tokens, llama.cpp's own
prefill and decode rates from its timings. One JSON line per prompt.

Usage: cpu_peer_completion.py MODEL.gguf THREADS NEW_TOKENS PROMPT [PROMPT ...]
"""
import json
import sys

import xllamacpp as xlc

model, threads, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
params = xlc.CommonParams()
params.model.path = model
params.n_ctx = 1024
params.cpuparams.n_threads = threads
params.cpuparams_batch.n_threads = threads
server = xlc.Server(params)
for prompt in sys.argv[4:]:
    r = server.handle_completions({"prompt": prompt, "max_tokens": new, "temperature": 0.0,
                                   "ignore_eos": True})
    t = r.get("timings", {})
    print(json.dumps({"prompt": prompt, "prompt_tokens": t.get("prompt_n"),
                      "new_tokens": t.get("predicted_n"),
                      "prefill_tokens_per_s": t.get("prompt_per_second"),
                      "decode_tokens_per_s": t.get("predicted_per_second")}), flush=True)
