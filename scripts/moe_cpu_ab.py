#!/usr/bin/env python3
"""Decode speed of two `generate` builds alternated on one GGUF on this machine's CPU (the
mixture-of-experts issue's small Qwen3-MoE, or any model): each round runs both (their order
swapped every round, so that a host whose speed drifts weighs on both), greedy, 96 new
tokens. The new build's text must equal the old one's, unless `--texts-may-differ` comes
first (a change of float summation order that moves a near-tie of a random model's router);
the JSON then says whether they did.

Usage: python3 scripts/moe_cpu_ab.py [--texts-may-differ] OLD_GENERATE NEW_GENERATE MODEL.gguf
OUT.json [ROUNDS] (default 10 rounds). The JSON has the commit (of this checkout), the command, the machine,
the date, each run's decode tokens/s, the medians, `new_over_old` of the medians and the
median of the rounds' own ratios.
"""
import os
import re
import statistics
import subprocess
import sys

import bench_record

NEW_TOKENS = 96
PROMPT = "Hello there, how are you today?"


def decode(binary, model):
    args = [binary, "--cpu", "--model", model, "--prompt", PROMPT,
            "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0", "-v"]
    p = subprocess.run(args, capture_output=True, text=True, check=True)
    m = re.search(r"decode: (\d+) tokens at ([\d.]+) tokens/s", p.stderr)
    if not m:
        sys.exit(f"{binary}: no decode rate in its log")
    return float(m[2]), p.stdout


def main():
    argv = sys.argv[1:]
    may_differ = bool(argv) and argv[0] == "--texts-may-differ"
    if may_differ:
        argv = argv[1:]
    old, new, model, out = argv[:4]
    rounds = int(argv[4]) if len(argv) > 4 else 10
    load_at_start = os.getloadavg()
    runs = bench_record.alternate(rounds, old, new, lambda binary: decode(binary, model))
    rates = {k: [r for r, _ in v] for k, v in runs.items()}
    texts = {k: {t for _, t in v} for k, v in runs.items()}
    same_text = texts["old"] == texts["new"]
    if not same_text and not may_differ:
        sys.exit(f"the builds' answers differ: {texts}")
    median = {k: statistics.median(v) for k, v in rates.items()}
    paired = statistics.median(n / o for o, n in zip(rates["old"], rates["new"]))
    print(f"decode tok/s, median of {rounds}: old {median['old']:.1f}, new {median['new']:.1f} "
          f"({median['new'] / median['old']:.3f}x; paired {paired:.3f}x)")
    bench_record.write_ab(out, "cpu_generate_decode_ab", load_at_start, {
        "model": os.path.basename(model), "prompt": PROMPT, "new_tokens": NEW_TOKENS,
        "rounds": rounds, "old": old, "new": new, "decode_tokens_per_s": rates,
        "decode_tokens_per_s_median": median, "new_over_old": median["new"] / median["old"],
        "paired_median": paired, "same_text": same_text})


if __name__ == "__main__":
    main()
