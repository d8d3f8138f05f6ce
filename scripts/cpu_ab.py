#!/usr/bin/env python3
"""Before/after of two `generate` builds on the default model on this machine's CPU, with
llama.cpp (its Python binding, ../shared/peer/llamacpp/cpu_peer.py) in the same run.

Usage: python3 scripts/cpu_ab.py OLD_GENERATE NEW_GENERATE MODEL.gguf PEER_PYTHON OUT.json [ROUNDS]

Each round (default 5) answers the prompts of scripts/cpu_default_bench.py greedily, 32 new
tokens, by llama.cpp, then by both builds (their order swapped every round, so that a host
whose speed drifts weighs on both). Per build: the median over rounds of the median decode
and prefill tokens/s over prompts, its ratio to llama.cpp's (above 1: ours faster) and
`after_over_before` of the ratios. Each answer of the new build must equal the old build's.
"""
import json
import os
import statistics
import sys

import bench_record
import cpu_default_bench as cdb


def main():
    old, new, model, peer_python, out = sys.argv[1:6]
    rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 5
    load_at_start = os.getloadavg()
    runs = {"before": [], "after": [], "llamacpp": []}
    answers_equal = True
    for i in range(rounds):
        peer = cdb.run_peer(peer_python, model, 2, cdb.PROMPTS)
        runs["llamacpp"].append(peer)
        got = {}
        for build in (["before", "after"] if i % 2 == 0 else ["after", "before"]):
            binary = old if build == "before" else new
            got[build] = [cdb.ours(binary, model, p, "default") for p in cdb.PROMPTS]
            runs[build].append(got[build])
        answers_equal &= [r["answer"] for r in got["before"]] == [r["answer"] for r in got["after"]]
        line = {b: round(statistics.median(r["decode_tokens_per_s"] for r in runs[b][-1]), 1)
                for b in runs}
        print(f"round {i}: decode tok/s {line}", flush=True)

    def med(build, key):
        return statistics.median(statistics.median(r[key] for r in rnd) for rnd in runs[build])

    summary = {}
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        b, a, p = med("before", key), med("after", key), med("llamacpp", key)
        summary[key] = {
            "before_median": round(b, 2), "after_median": round(a, 2), "llamacpp_median": round(p, 2),
            "ratio_before": round(b / p, 4), "ratio_after": round(a / p, 4),
            "after_over_before": round(a / b, 4), "within_5_percent": abs(a / b - 1) <= 0.05,
        }
    doc = bench_record.header("cpu-ab-default-model", load_average_at_start=load_at_start,
                              load_average_at_end=os.getloadavg())
    doc.update(model=os.path.basename(model), rounds=rounds, prompts=cdb.PROMPTS,
               answers_identical=answers_equal, summary=summary, runs=runs)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    for key, s in summary.items():
        print(key, json.dumps(s))
    print("answers identical:", answers_equal)


if __name__ == "__main__":
    main()
