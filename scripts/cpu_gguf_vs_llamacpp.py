#!/usr/bin/env python3
"""Decode speed of our CPU path against llama.cpp on the same GGUF, on this machine, in rounds
that alternate the two (and optionally an older build of ours), each in the same run.
Ours: bench_generate --cpu --quantized (prompt 16, 32 new tokens, median step); llama.cpp: the
`xllamacpp` wheel's server, a 16-token prompt of token ids, 32 new tokens with end-of-sequence
ignored, 2 threads, the second of two requests (the first warms it).
Usage: cpu_gguf_vs_llamacpp.py OUT.json MODEL.gguf ROUNDS BENCH_GENERATE [BEFORE_BENCH_GENERATE]
(run llama.cpp's half with the xllamacpp environment's python: set XL_PYTHON)."""
import json
import os
import subprocess
import sys
import tempfile

import bench_record

out, model, rounds, ours = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
before = sys.argv[5] if len(sys.argv) > 5 else None
xl_python = os.environ.get("XL_PYTHON", sys.executable)

PEER = r"""
import json, sys
import xllamacpp as xlc
p = xlc.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx = 256
p.cpuparams.n_threads = 2
p.cpuparams_batch.n_threads = 2
s = xlc.Server(p)
rates = []
for _ in range(2):
    r = s.handle_completions({"prompt": list(range(3, 19)), "n_predict": 32, "ignore_eos": True,
                              "temperature": 0.0})
    rates.append(r.get("timings", {}).get("predicted_per_second"))
print(json.dumps({"decode_tokens_per_s": rates[-1]}))
"""


def ours_rate(binary):
    with tempfile.TemporaryDirectory() as d:
        j = os.path.join(d, "o.json")
        subprocess.run([binary, "--model-dir", model, "--quantized", "--cpu", "--budgets", "full",
                        "--prompt-lens", "16", "--new-tokens", "32", "--json-out", j],
                       check=True, capture_output=True)
        return json.load(open(j))["records"][0]["decode_tokens_per_s"]


def peer_rate():
    r = subprocess.run([xl_python, "-c", PEER, model], check=True, capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["decode_tokens_per_s"]


records = []
for i in range(rounds):
    rec = {"round": i + 1}
    if before:
        rec["ours_before_tokens_per_s"] = ours_rate(before)
    rec["ours_tokens_per_s"] = ours_rate(ours)
    rec["llamacpp_tokens_per_s"] = peer_rate()
    rec["vs_llamacpp"] = rec["ours_tokens_per_s"] / rec["llamacpp_tokens_per_s"]
    if before:
        rec["before_vs_llamacpp"] = rec["ours_before_tokens_per_s"] / rec["llamacpp_tokens_per_s"]
    print(json.dumps(rec), flush=True)
    records.append(rec)
json.dump({
    **bench_record.header("cpu_gguf_decode_vs_llamacpp", load_average_at_end=list(os.getloadavg())),
    "model": model,
    "records": records,
}, open(out, "w"), indent=1)
print("wrote", out)
