#!/usr/bin/env python3
"""A CPU run's memory and time from start to its last token, two `generate` binaries A/B on
the same GGUFs (`/usr/bin/time -v`: the maximum resident set and the wall time), rounds
alternating, and whether their answers are the same: what keeping one copy of the weights
(the store reading each unit from the file into the CPU runtime's own) saves.

Usage: python3 scripts/cpu_load_ab.py BEFORE_BIN AFTER_BIN OUT.json ROUNDS MODEL.gguf [...]
"""
import json
import re
import statistics
import subprocess
import sys

import bench_record

PROMPT = "Hello there, how are you today?"


def run(binary, model):
    cmd = ["/usr/bin/time", "-v", binary, "--cpu", "--model", model, "--prompt", PROMPT,
           "--max-new-tokens", "16", "--temperature", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)[1])
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", p.stderr)
    wall = int(m[1] or 0) * 3600 + int(m[2]) * 60 + float(m[3])
    return {"max_rss_mib": round(rss / 1024, 1), "wall_s": wall, "answer": p.stdout.strip()}


def main():
    before, after, out, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    records = []
    for model in sys.argv[5:]:
        runs = {"before": [], "after": []}
        run(before, model), run(after, model)  # warm-up: the page cache
        for i in range(rounds):
            for side in (["before", "after"] if i % 2 == 0 else ["after", "before"]):
                runs[side].append(run(before if side == "before" else after, model))
        med = {s: {k: statistics.median(r[k] for r in runs[s]) for k in ("max_rss_mib", "wall_s")}
               for s in runs}
        same = len({r["answer"] for r in runs["before"] + runs["after"]}) == 1
        records.append({"model": model.rsplit("/", 1)[-1], "median": med, "same_answer": same,
                        "runs": runs})
        print(model, json.dumps(med), "same answer:", same, flush=True)
    doc = bench_record.header("cpu-load-ab", before=before, after=after, prompt=PROMPT, rounds=rounds)
    doc["records"] = records
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
