#!/usr/bin/env python3
"""Whole-process wall time of two `generate` binaries on the same command, alternated: the
README's default question to the default model on this machine's CPU (load, prompt and up to
32 greedy tokens; the answer ends after 8), nine rounds, the first of each pair swapped every round so that a host whose
speed drifts weighs on both. Each answer must still name Paris.

Usage: python3 scripts/wall_time_ab.py OLD_GENERATE NEW_GENERATE MODEL.gguf OUT.json
The JSON has the commit (of this checkout), the command, the machine, the date, each run's
seconds, the medians and `new_over_old`.
"""
import os
import statistics
import subprocess
import sys
import time

import bench_record

ROUNDS = 9


def main():
    old, new, model, out = sys.argv[1:5]
    args = ["--cpu", "--model", model, "--prompt", "What is the capital of France?",
            "--max-new-tokens", "32", "--temperature", "0"]
    load_at_start = os.getloadavg()

    def run(binary):
        t = time.perf_counter()
        p = subprocess.run([binary] + args, capture_output=True, text=True, check=True)
        if "Paris" not in p.stdout:
            sys.exit(f"{binary} answered {p.stdout!r}")
        return time.perf_counter() - t

    wall = bench_record.alternate(ROUNDS, old, new, run)
    median = {k: statistics.median(v) for k, v in wall.items()}
    print(f"wall s, median of {ROUNDS}: old {median['old']:.3f}, new {median['new']:.3f} "
          f"({median['new'] / median['old']:.2f}x)")
    bench_record.write_ab(out, "cpu_default_command_wall_time", load_at_start, {
        "generate_args": args, "rounds": ROUNDS, "wall_s": wall, "wall_s_median": median,
        "new_over_old": median["new"] / median["old"]})


if __name__ == "__main__":
    main()
