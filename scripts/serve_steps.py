#!/usr/bin/env python3
"""serve_steps.py: where a `serve` run's time went, from its step spans.

Reads the log of a `serve -vv` run with RUST_LOG including
`candle_offload_models::batching=debug` (each `batch.step{seqs=N rows=M}` span's close line,
with its busy time: the whole step, its sampling's wait for the device included; the
warm-up's steps left out) and prints, per kind of step, how many ran, their median and total busy
time: decode steps by their sequence count (rows == sequences), steps that carry a prompt
chunk (rows > sequences) by their rows in bins. Standard library only.

  python3 scripts/serve_steps.py SERVE.log [--json OUT.json]
"""
import argparse
import json
import re
import statistics
import sys

SPAN = re.compile(r"batch\.step\{seqs=(\d+) rows=(\d+)\}: \S+: close time\.busy=([\d.]+)(ns|µs|us|ms|s)\b")
UNIT = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}


def kinds(lines):
    """{kind: [busy ms, ...]} from the step spans' close lines."""
    out = {}
    for line in lines:
        m = SPAN.search(line)
        if not m or "batch.warm_up" in line:
            continue  # the warm-up's steps ran before the first request
        seqs, rows, busy = int(m[1]), int(m[2]), float(m[3]) * UNIT[m[4]]
        if rows == seqs:
            kind = f"decode, {seqs} sequence{'s' if seqs > 1 else ''}"
        else:
            top = next(b for b in (64, 128, 256, 384, 512, 1 << 30) if rows - seqs < b or b == 1 << 30)
            kind = f"with a prompt chunk, < {top} prompt rows" if top < 1 << 30 else "with a prompt chunk, more rows"
        out.setdefault(kind, []).append(busy)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--json")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        got = kinds(f)
    if not got:
        sys.exit(f"serve_steps: no batch.step spans in {args.log} (run serve -vv with "
                 "RUST_LOG=candle_offload_models::batching=debug)")
    total = sum(sum(v) for v in got.values())
    rows = []
    print(f"{'kind':44} {'steps':>6} {'median ms':>10} {'total ms':>10} {'share':>6}")
    for kind in sorted(got, key=lambda k: -sum(got[k])):
        v = got[kind]
        rows.append({"kind": kind, "steps": len(v), "median_ms": statistics.median(v),
                     "total_ms": sum(v)})
        print(f"{kind:44} {len(v):6d} {statistics.median(v):10.2f} {sum(v):10.1f} "
              f"{sum(v) / total:6.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"log": args.log, "total_busy_ms": total, "kinds": rows}, f, indent=1)


if __name__ == "__main__":
    main()
