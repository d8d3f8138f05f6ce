#!/usr/bin/env python3
"""The CPU target of the mixture-of-experts issue (any other GGUF runs the same way, recorded as
`cpu-generate`): a small random Qwen3-MoE in Q4_K_M
(gguf_random_moe.py --shape cpu-small, then llama-quantize --allow-requantize ... Q4_K_M)
decoded by `generate --cpu` and by llama.cpp (the xllamacpp wheel, in this process, loaded
once; its prompt cache off, so that every round computes the whole prompt) on the same prompt
token ids, interleaved: each round runs ours, then llama.cpp (their
order swapped every other round), greedy, 32 new tokens, 2 threads for llama.cpp.

Usage: python3 scripts/moe_cpu_bench.py GENERATE MODEL.gguf OUT.json [ROUNDS] [PROMPT]
MOE_CPU_THREADS=N runs both sides on N threads (default 2; ours through
CANDLE_OFFLOAD_CPU_THREADS).

The prompt's token ids come from `generate -v` (`prompt ids: [...]`): xllamacpp cannot
tokenize the random file's made-up vocabulary, so it gets the ids. Records each round's rates,
the medians over rounds, and the ratios (above 1: ours faster), with the load averages.
"""
import json
import os
import re
import statistics
import subprocess
import sys

import bench_record

NEW_TOKENS = 32
THREADS = int(os.environ.get("MOE_CPU_THREADS", "2"))


def ours(binary, model, prompt):
    cmd = [binary, "--cpu", "--model", model, "--prompt", prompt, "--max-new-tokens", str(NEW_TOKENS),
           "--temperature", "0", "-v"]
    env = dict(os.environ, CANDLE_OFFLOAD_CPU_THREADS=str(THREADS)) if "MOE_CPU_THREADS" in os.environ else None
    p = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    m = re.search(r"prefill: (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\); decode: (\d+) tokens at ([\d.]+) tokens/s",
                  p.stderr)
    ids = json.loads(re.search(r"prompt ids: (\[[\d, ]*\])", p.stderr)[1])
    return ids, {"prefill_tokens": int(m[1]), "prefill_tokens_per_s": float(m[2]),
                 "decode_tokens": int(m[3]), "decode_tokens_per_s": float(m[4]),
                 "answer": p.stdout.strip()}


def peer_server(model, prompt_len):
    import xllamacpp as xlc
    params = xlc.CommonParams()
    params.model.path = model
    # Room for the prompt and the new tokens (at least 1024, as before long prompts).
    params.n_ctx = max(1024, prompt_len + NEW_TOKENS + 16)
    params.cpuparams.n_threads = THREADS
    params.cpuparams_batch.n_threads = THREADS
    return xlc.Server(params)


def peer(server, ids):
    r = server.handle_completions({"prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                                   "ignore_eos": True, "cache_prompt": False})
    t = r.get("timings", {})
    return {"prefill_tokens": t.get("prompt_n"), "prefill_tokens_per_s": t.get("prompt_per_second"),
            "decode_tokens": t.get("predicted_n"), "decode_tokens_per_s": t.get("predicted_per_second")}


def main():
    binary, model, out = sys.argv[1:4]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    prompt = sys.argv[5] if len(sys.argv) > 5 else "Hello there, how are you today?"
    load_at_start = os.getloadavg()
    ids, _ = ours(binary, model, prompt)  # warm-up (page cache), and the ids
    server = peer_server(model, len(ids))
    peer(server, ids)  # warm-up
    runs = {"ours": [], "llamacpp": []}
    loads = []
    for i in range(rounds):
        order = ["ours", "llamacpp"] if i % 2 == 0 else ["llamacpp", "ours"]
        for side in order:
            runs[side].append(ours(binary, model, prompt)[1] if side == "ours" else peer(server, ids))
        loads.append(os.getloadavg())
        print(f"round {i}: decode ours {runs['ours'][-1]['decode_tokens_per_s']:.1f} llama.cpp "
              f"{runs['llamacpp'][-1]['decode_tokens_per_s']:.1f}; prefill ours "
              f"{runs['ours'][-1]['prefill_tokens_per_s']:.1f} llama.cpp "
              f"{runs['llamacpp'][-1]['prefill_tokens_per_s']:.1f}; load {loads[-1][0]:.2f}", flush=True)
    summary = {}
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        o = statistics.median(r[key] for r in runs["ours"])
        p = statistics.median(r[key] for r in runs["llamacpp"])
        summary[key] = {"ours_median": round(o, 2), "llamacpp_median": round(p, 2), "ratio": round(o / p, 4)}
    moe = "moe" in os.path.basename(model).lower()
    doc = bench_record.header("moe-cpu-small" if moe else "cpu-generate", cores=os.cpu_count(),
                              load_average_at_start=load_at_start,
                              load_average_per_round=loads, load_average_at_end=os.getloadavg())
    weights = "Q8_0" if "q8_0" in os.path.basename(model).lower() else "Q4_K_M"
    shape = ("qwen3moe hidden 1024, 16 layers, 64 experts, top 4, expert FFN 512, vocab 32000, "
             f"{weights} (by the file's name)") if moe else "the file's own"
    doc.update(model=os.path.basename(model), shape=shape, rounds=rounds, prompt=prompt, prompt_ids=ids,
               new_tokens=NEW_TOKENS, llamacpp_threads=THREADS,
               ours_threads=THREADS if "MOE_CPU_THREADS" in os.environ else "default", peer="xllamacpp (llama.cpp), token ids as the prompt",
               summary=summary, vs_llamacpp=summary["decode_tokens_per_s"]["ratio"],
               prefill_vs_llamacpp=summary["prefill_tokens_per_s"]["ratio"], runs=runs)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    for key, s in summary.items():
        print(key, json.dumps(s))


if __name__ == "__main__":
    main()
