#!/usr/bin/env python3
"""kernel_breakdown.py: GPU time per kernel of a decode step or a training step, with Nsight Compute.

Runs on the GPU machine (ncu there; see gpu-run.sh's `breakdown` and `trainprof` steps). The
benchmark is started under `ncu --profile-from-start off`, and opens the profiler's capture
(candle_offload::diag::profiler_capture) around the work to time only, so ncu times exactly
those kernels, one at a time, at the GPU's own clocks (`--clock-control none`). Each kernel's
`gpu__time_duration.sum` is grouped by what it does. Set against the step's time measured
without the profiler, the rest is the time the GPU waits for the host: launches, allocations,
event bookkeeping, synchronizations.

  decode: bench_generate --profile-decode; the sum over a token is the time the GPU is busy
          for one token (--step-json: an unprofiled bench_generate JSON of the same config).
  train:  bench_train --profile-capture; one training step after the timed ones, whose
          `profile_mark` kernels split it into forward, backward and optimizer, each set
          against the phase's unprofiled time from the same run (forward_s, backward_s,
          optimizer_s).

  python3 scripts/kernel_breakdown.py decode --bin /tmp/bin/bench_generate \\
      --model-dir /tmp/llama7b --steps 4 --out /tmp/out/breakdown.json \\
      [--step-json /tmp/out/decode-eager.json] [-- EXTRA bench_generate ARGS]
  python3 scripts/kernel_breakdown.py train --bin /tmp/bin/bench_train --config none-bf16 \\
      --out /tmp/out/trainprof-none-bf16.json [-- EXTRA bench_train ARGS]

Writes the JSON (kernels grouped per token or per phase) and prints Markdown tables for
BENCHMARKS.md.
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
# (candle-kernels), ours (candle-offload-kernels/kernels/*.cu), cuBLAS/CUTLASS and Candle's
# quantized kernels.
GROUPS = [
    ("matmul (cuBLAS)", r"gemv|gemm|xmma|cutlass|splitKreduce|sm\d\d_|ampere_|hopper"),
    ("quantized matmul", r"mul_mat|dequantize|quantize_q8|mmvq|mmq"),
    ("decode_attention (fused)", r"^decode_attention_"),
    ("linear_small (fused)", r"^linear_small_"),
    ("qlinear (fused, GGML blocks; x quantized to 8 bits included)", r"^qlinear"),
    ("rms_norm_residual (fused)", r"^rms_norm_residual_"),
    ("silu_mul (fused)", r"^silu_mul_"),
    ("rope_qk (fused)", r"^rope_qk_"),
    ("flash attention (fused, training)", r"^flash_attn"),
    ("rms_norm fwd/bwd (fused, training)", r"^rms_norm_fwd_|^rms_norm_bwd_|^rms_rstd_"),
    ("swiglu fwd/bwd (fused, training)", r"^swiglu_"),
    ("cross_entropy fwd/bwd (fused, training)", r"^cross_entropy_"),
    ("AdamW (fused, multi-tensor)", r"^adamw_"),
    ("rms norm", r"rmsnorm|rms_norm"),
    ("rope", r"rope"),
    ("softmax", r"softmax"),
    ("copy / contiguous / cat", r"copy|cat|transpose"),
    ("cast", r"^cast_"),
    ("elementwise binary (add, mul, ...)", r"^b(add|mul|sub|div|minimum|maximum)"),
    ("unary (silu, exp, ...)", r"^u(silu|exp|neg|sqr|sqrt|recip|gelu)|affine|^silu"),
    ("reduce (max, sum, argmax)", r"fast_|reduce|argmax|argmin|sum_|max_"),
    ("index_select / gather (embedding)", r"^is_|index_select|gather"),
    ("index_add / scatter (embedding backward)", r"index_add|scatter"),
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
        sys.exit("kernel_breakdown: no kernel rows in ncu's CSV (did the capture open?)")
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


MARK = "profile_mark"


def run_ncu(ncu, rep, bench):
    """Runs `bench` under ncu into `rep` (.ncu-rep) and returns its kernels in launch order."""
    cmd = [
        ncu, "--profile-from-start", "off", "--clock-control", "none", "--metrics",
        "gpu__time_duration.sum", "-f", "-o", os.path.splitext(rep)[0],
    ] + bench
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        sys.exit(f"kernel_breakdown: ncu exited {r.returncode}")
    text = subprocess.run(
        [ncu, "--import", rep, "--csv", "--page", "raw", "--print-units", "base",
         "--metrics", "gpu__time_duration.sum"],
        check=True, capture_output=True, text=True,
    ).stdout
    kernels = read_ncu_csv(text)
    if not kernels:
        sys.exit("kernel_breakdown: ncu recorded no kernels")
    return cmd, kernels


def aggregate(kernels, per, top_n=25):
    """Groups and kernels by GPU time, each figure divided by `per` (tokens or steps)."""
    per_group = defaultdict(lambda: [0, 0.0])
    per_kernel = defaultdict(lambda: [0, 0.0])
    for name, ns in kernels:
        g = group_of(short(name))
        per_group[g][0] += 1
        per_group[g][1] += ns
        k = (g, short(name))
        per_kernel[k][0] += 1
        per_kernel[k][1] += ns
    groups = sorted(
        ({"group": g, "launches": c / per, "gpu_us": ns / 1e3 / per}
         for g, (c, ns) in per_group.items()),
        key=lambda x: -x["gpu_us"],
    )
    top = sorted(
        ({"group": g, "kernel": k, "launches": c / per, "gpu_us": ns / 1e3 / per}
         for (g, k), (c, ns) in per_kernel.items()),
        key=lambda x: -x["gpu_us"],
    )[:top_n]
    return groups, top


def print_groups(groups, busy_us, unit):
    print(f"\n| kernels | launches per {unit} | GPU µs per {unit} | share of busy |")
    print("| --- | ---: | ---: | ---: |")
    for g in groups:
        share = 100 * g["gpu_us"] / busy_us if busy_us else 0.0
        print(f"| {g['group']} | {g['launches']:.0f} | {g['gpu_us']:.0f} | {share:.1f}% |")


def print_top(top, n=12):
    print("\nTop kernels:")
    for t in top[:n]:
        print(f"  {t['gpu_us']:10.0f} us  x{t['launches']:.0f}  {t['group']}: {t['kernel']}")


def decode(a):
    rep = os.path.splitext(a.out)[0] + ".ncu-rep"
    bench_json = os.path.splitext(a.out)[0] + ".bench.json"
    bench = [
        a.bin, "--model-dir", a.model_dir, "--budgets", a.budget, "--prompt-lens",
        str(a.prompt_len), "--depths", "1", "--new-tokens", str(a.steps), "--profile-decode",
        "--json-out", bench_json,
    ] + a.extra
    cmd, kernels = run_ncu(a.ncu, rep, bench)
    # The profiled binary's provenance (its JSON carries the commit it was built from, the
    # machine and the date), as the train mode records it.
    provenance = {}
    try:
        with open(bench_json) as f:
            data = json.load(f)
        provenance = {k: data.get(k) for k in ("commit", "machine", "date")}
    except (OSError, ValueError):
        print("kernel_breakdown: the benchmark wrote no JSON: no commit or machine recorded",
              file=sys.stderr)
    steps = a.steps
    busy_us = sum(ns for _, ns in kernels) / 1e3 / steps
    step_ms = None
    if a.step_json:
        with open(a.step_json) as f:
            recs = json.load(f)["records"]
        rec = next((x for x in recs if x.get("budget") == a.budget), recs[0])
        step_ms = rec["decode_step_s_median"] * 1e3
    groups, top = aggregate(kernels, steps)
    out = {
        "command": " ".join(cmd),
        "steps_profiled": steps,
        "kernels_per_token": len(kernels) / steps,
        "gpu_busy_ms_per_token": busy_us / 1e3,
        "step_ms_unprofiled": step_ms,
        "host_gap_ms_per_token": (step_ms - busy_us / 1e3) if step_ms else None,
        "groups": groups,
        "top_kernels": top,
        **provenance,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\n{len(kernels) / steps:.0f} kernels per token, GPU busy {busy_us / 1e3:.2f} ms per token"
          + (f", token {step_ms:.2f} ms unprofiled -> {step_ms - busy_us / 1e3:.2f} ms the GPU waits"
             if step_ms else ""))
    print_groups(groups, busy_us, "token")
    print_top(top)


PHASES = ["forward", "backward", "optimizer"]


def split_phases(kernels):
    """The kernels between the 1st and 2nd, 2nd and 3rd, 3rd and 4th profile_mark launches
    (the profiled step's; later ones, if any, are not part of it)."""
    marks = [i for i, (name, _) in enumerate(kernels) if short(name) == MARK]
    if len(marks) < 4:
        sys.exit(f"kernel_breakdown: expected 4 {MARK} launches in the capture, found {len(marks)}")
    return {p: kernels[marks[j] + 1 : marks[j + 1]] for j, p in enumerate(PHASES)}


def train(a):
    rep = os.path.splitext(a.out)[0] + ".ncu-rep"
    bench_json = os.path.splitext(a.out)[0] + ".bench.json"
    # The phase times come from a run of their own, outside ncu: under ncu every launch is
    # intercepted, captured or not, and the host's time grows with it (a 2-layer step took
    # 90 ms there and 34 ms on its own).
    plain = [a.bin, "--configs", a.config, "--steps", str(a.steps), "--warmup", "1",
             "--json-out", bench_json] + a.extra
    r = subprocess.run(plain)
    if r.returncode != 0:
        sys.exit(f"kernel_breakdown: bench_train exited {r.returncode}")
    with open(bench_json) as f:
        data = json.load(f)
    bench = [
        a.bin, "--configs", a.config, "--steps", "1", "--warmup", "1",
        "--profile-capture", "--json-out", os.path.splitext(a.out)[0] + ".ncu-bench.json",
    ] + a.extra
    cmd, kernels = run_ncu(a.ncu, rep, bench)
    rec = next(x for x in data["records"]["configs"] if x.get("config") == a.config)
    if rec.get("error"):
        sys.exit(f"kernel_breakdown: bench_train failed: {rec['error']}")
    phases = split_phases(kernels)
    out = {"command": " ".join(cmd), "timing_command": " ".join(plain), "config": a.config,
           "step_s_unprofiled": rec.get("step_s"),
           "commit": data.get("commit"), "machine": data.get("machine"), "date": data.get("date"),
           "phases": {}}
    rows = []
    all_kernels = []
    for p in PHASES:
        ks = phases[p]
        all_kernels += ks
        busy_ms = sum(ns for _, ns in ks) / 1e6
        wall_ms = (rec.get(f"{p}_s") or 0.0) * 1e3
        groups, top = aggregate(ks, 1)
        out["phases"][p] = {
            "launches": len(ks), "gpu_busy_ms": busy_ms, "wall_ms_unprofiled": wall_ms,
            "gpu_idle_ms": wall_ms - busy_ms if wall_ms else None,
            "groups": groups, "top_kernels": top,
        }
        rows.append((p, len(ks), busy_ms, wall_ms))
    groups, top = aggregate(all_kernels, 1, top_n=40)
    out["step"] = {"launches": len(all_kernels),
                   "gpu_busy_ms": sum(ns for _, ns in all_kernels) / 1e6,
                   "groups": groups, "top_kernels": top}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\n{a.config}: step {1e3 * (rec.get('step_s') or 0):.1f} ms unprofiled")
    print("\n| phase | launches | GPU busy ms | wall ms (unprofiled) | GPU idle ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for p, n, busy, wall in rows:
        print(f"| {p} | {n} | {busy:.1f} | {wall:.1f} | {wall - busy:.1f} |")
    print_groups(groups, out["step"]["gpu_busy_ms"] * 1e3, "step")
    print_top(top, 20)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("decode", help="a decode step of bench_generate")
    d.add_argument("--bin", required=True, help="the bench_generate binary")
    d.add_argument("--model-dir", required=True)
    d.add_argument("--steps", type=int, default=4, help="decode steps profiled")
    d.add_argument("--budget", default="full")
    d.add_argument("--prompt-len", type=int, default=64)
    d.add_argument("--step-json", help="an unprofiled bench_generate JSON of the same config")
    t = sub.add_parser("train", help="a training step of bench_train")
    t.add_argument("--bin", required=True, help="the bench_train binary")
    t.add_argument("--config", default="none-bf16", help="one bench_train configuration")
    t.add_argument("--steps", type=int, default=2, help="unprofiled timed steps first")
    for p in (d, t):
        p.add_argument("--ncu", default="ncu")
        p.add_argument("--out", required=True)
        p.add_argument("extra", nargs="*", help="more benchmark arguments (after --)")
    a = ap.parse_args()
    decode(a) if a.mode == "decode" else train(a)


if __name__ == "__main__":
    main()
