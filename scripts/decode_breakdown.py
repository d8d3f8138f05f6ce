#!/usr/bin/env python3
"""decode_breakdown.py: GPU time per kernel of one decode step, measured with Nsight Compute.

Runs on the GPU machine (ncu there; see gpu-run.sh's `breakdown` step). bench_generate is
started under `ncu --profile-from-start off` with `--profile-decode`, which opens the profiler's
capture around its timed decode steps only (candle_offload::diag::profiler_capture), so ncu
times exactly those kernels, one at a time, at the GPU's own clocks (`--clock-control none`).
Each kernel's `gpu__time_duration.sum` is grouped by what it does; the sum over a step is the
time the GPU is busy for one token. Set against the token time measured without the profiler
(--step-ms, or the JSON of an unprofiled run), the rest is the time the GPU waits for the host:
launches, allocations, event bookkeeping and the wait for each token id.

  python3 scripts/decode_breakdown.py --bin /tmp/bin/bench_generate --model-dir /tmp/llama7b \\
      --steps 4 --out /tmp/out/breakdown.json [--step-json /tmp/out/decode-eager.json] \\
      [-- EXTRA bench_generate ARGS]

Writes the JSON (kernels grouped per token) and prints a Markdown table for BENCHMARKS.md.
"""

import argparse
import csv
import io
import json
import os
import re
import subprocess
import sys
from collections import defaultdict

# What a kernel does, from its name (first match wins). Names are Candle's kernels
# (candle-kernels), ours (candle-offload/kernels/ops.cu), cuBLAS/CUTLASS and Candle's
# quantized kernels.
GROUPS = [
    ("matmul (cuBLAS)", r"gemv|gemm|xmma|cutlass|splitKreduce|sm\d\d_|ampere_|hopper"),
    ("quantized matmul", r"mul_mat|dequantize|quantize_q8|mmvq|mmq"),
    ("decode_attention (fused)", r"^decode_attention_"),
    ("linear_small (fused)", r"^linear_small_"),
    ("qlinear_small (fused, GGML blocks)", r"^qlinear_small_"),
    ("rms_norm_residual (fused)", r"^rms_norm_residual_"),
    ("silu_mul (fused)", r"^silu_mul_"),
    ("rope_qk (fused)", r"^rope_qk_"),
    ("rms norm", r"rmsnorm|rms_norm"),
    ("rope", r"rope"),
    ("softmax", r"softmax"),
    ("copy / contiguous / cat", r"copy|cat|transpose"),
    ("cast", r"^cast_"),
    ("elementwise binary (add, mul, ...)", r"^b(add|mul|sub|div|minimum|maximum)"),
    ("unary (silu, exp, ...)", r"^u(silu|exp|neg|sqr|sqrt|recip|gelu)|affine|^silu"),
    ("reduce (max, sum, argmax)", r"fast_|reduce|argmax|argmin|sum_|max_"),
    ("index_select / gather (embedding)", r"^is_|index_select|gather"),
    ("where / masks", r"where"),
    ("fill", r"fill|const_set|zeros"),
]


def group_of(name):
    for g, pat in GROUPS:
        if re.search(pat, name):
            return g
    return "other"


def short(name):
    """A kernel's name without template arguments and parameter lists."""
    name = re.sub(r"\(.*$", "", name)
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip()[:80]


def read_ncu_csv(text):
    rows = list(csv.reader(io.StringIO(text)))
    header = None
    for i, r in enumerate(rows):
        if "Kernel Name" in r:
            header, body = r, rows[i + 1 :]
            break
    if header is None:
        sys.exit("decode_breakdown: no kernel rows in ncu's CSV (did the capture open?)")
    name_i = header.index("Kernel Name")
    time_i = header.index("gpu__time_duration.sum")
    kernels = []
    for r in body:
        if len(r) <= time_i:
            continue
        try:
            t = float(r[time_i].replace(",", ""))
        except ValueError:
            continue  # the units row
        kernels.append((r[name_i], t))
    return kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="the bench_generate binary")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--steps", type=int, default=4, help="decode steps profiled")
    ap.add_argument("--budget", default="full")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--step-json", help="an unprofiled bench_generate JSON of the same config")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--out", required=True)
    ap.add_argument("extra", nargs="*", help="more bench_generate arguments (after --)")
    a = ap.parse_args()

    rep = os.path.splitext(a.out)[0] + ".ncu-rep"
    bench = [
        a.bin, "--model-dir", a.model_dir, "--budgets", a.budget, "--prompt-lens",
        str(a.prompt_len), "--depths", "1", "--new-tokens", str(a.steps), "--profile-decode",
    ]
    bench += a.extra
    cmd = [
        a.ncu, "--profile-from-start", "off", "--clock-control", "none", "--metrics",
        "gpu__time_duration.sum", "-f", "-o", os.path.splitext(rep)[0],
    ] + bench
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        sys.exit(f"decode_breakdown: ncu exited {r.returncode}")
    text = subprocess.run(
        [a.ncu, "--import", rep, "--csv", "--page", "raw", "--print-units", "base",
         "--metrics", "gpu__time_duration.sum"],
        check=True, capture_output=True, text=True,
    ).stdout
    kernels = read_ncu_csv(text)
    if not kernels:
        sys.exit("decode_breakdown: ncu recorded no kernels")

    per_group = defaultdict(lambda: [0, 0.0])
    per_kernel = defaultdict(lambda: [0, 0.0])
    for name, ns in kernels:
        g = group_of(short(name))
        per_group[g][0] += 1
        per_group[g][1] += ns
        k = (g, short(name))
        per_kernel[k][0] += 1
        per_kernel[k][1] += ns
    steps = a.steps
    busy_us = sum(ns for _, ns in kernels) / 1e3 / steps
    step_ms = None
    if a.step_json:
        with open(a.step_json) as f:
            recs = json.load(f)["records"]
        rec = next((x for x in recs if x.get("budget") == a.budget), recs[0])
        step_ms = rec["decode_step_s_median"] * 1e3
    groups = sorted(
        ({"group": g, "kernels_per_token": c / steps, "gpu_us_per_token": ns / 1e3 / steps}
         for g, (c, ns) in per_group.items()),
        key=lambda x: -x["gpu_us_per_token"],
    )
    top = sorted(
        ({"group": g, "kernel": k, "launches_per_token": c / steps,
          "gpu_us_per_token": ns / 1e3 / steps} for (g, k), (c, ns) in per_kernel.items()),
        key=lambda x: -x["gpu_us_per_token"],
    )[:25]
    out = {
        "command": " ".join(cmd),
        "steps_profiled": steps,
        "kernels_per_token": len(kernels) / steps,
        "gpu_busy_ms_per_token": busy_us / 1e3,
        "step_ms_unprofiled": step_ms,
        "host_gap_ms_per_token": (step_ms - busy_us / 1e3) if step_ms else None,
        "groups": groups,
        "top_kernels": top,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)

    print(f"\n{len(kernels) / steps:.0f} kernels per token, GPU busy {busy_us / 1e3:.2f} ms per token"
          + (f", token {step_ms:.2f} ms unprofiled -> {step_ms - busy_us / 1e3:.2f} ms the GPU waits"
             if step_ms else ""))
    print("\n| kernels | per token | GPU µs per token | share of busy |")
    print("| --- | ---: | ---: | ---: |")
    for g in groups:
        print(f"| {g['group']} | {g['kernels_per_token']:.0f} | {g['gpu_us_per_token']:.0f} | "
              f"{100 * g['gpu_us_per_token'] / busy_us:.1f}% |")
    print("\nTop kernels:")
    for t in top[:12]:
        print(f"  {t['gpu_us_per_token']:8.0f} us  x{t['launches_per_token']:.0f}  {t['group']}: {t['kernel']}")


if __name__ == "__main__":
    main()
