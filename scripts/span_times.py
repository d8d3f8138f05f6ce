#!/usr/bin/env python3
"""span_times.py: where a run's host time went, by tracing span, from a `-vv` log.

A binary run with `-vv` logs each span's end with its busy and idle time (`init_tracing`).
This sums them by span name (the innermost span of each close line, its fields left out):
count, median and total busy time, and each name's share of the PARENT span's busy total
(`--parent`, e.g. `moe.layer`). `--skip N` leaves out the first N closes of the parent span
(a load's or a prompt's, when only decode steps are wanted): every span closing before the
(N+1)-th parent's first child is left out. `--match TEXT` keeps only the closes whose span
path (fields included) contains TEXT, e.g. `rows=1}` for a mixture-of-experts layer's decode
rows. Standard library only.

  python3 scripts/span_times.py RUN.log [--parent moe.layer] [--skip N] [--match TEXT]
      [--json OUT.json]
"""
import argparse
import json
import re
import statistics
import sys

CLOSE = re.compile(r"^(?:\S+\s+)?(?:TRACE|DEBUG|INFO|WARN|ERROR)\s+(.*): (\S+): close "
                   r"time\.busy=([\d.]+)(ns|µs|us|ms|s) time\.idle=([\d.]+)(ns|µs|us|ms|s)")
FIELDS = re.compile(r"\{[^}]*\}")
UNIT = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def closes(lines):
    """(raw path, name, path, busy ms, idle ms) of each span's close line, in order."""
    for line in lines:
        m = CLOSE.search(ANSI.sub("", line.strip()))
        if not m:
            continue
        path = [p for p in FIELDS.sub("", m[1]).split(":") if p]
        if not path:
            continue
        yield m[1], path[-1], path, float(m[3]) * UNIT[m[4]], float(m[5]) * UNIT[m[6]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--parent", help="span whose busy total the shares are of")
    ap.add_argument("--skip", type=int, default=0, help="closes of --parent to leave out first")
    ap.add_argument("--match", help="keep only closes whose span path contains this")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.skip and not args.parent:
        sys.exit("span_times: --skip counts closes of --parent; name it")
    got = {}
    parents_seen = 0
    with open(args.log, errors="replace") as f:
        for raw, name, path, busy, idle in closes(f):
            if args.match and args.match not in raw:
                continue
            if args.parent and name == args.parent:
                parents_seen += 1
                if parents_seen <= args.skip:
                    continue
            elif args.parent and args.parent in path and parents_seen < args.skip:
                continue
            got.setdefault(name, []).append((busy, idle))
    if not got:
        sys.exit(f"span_times: no span closes in {args.log} (run with -vv)")
    base = sum(b for b, _ in got.get(args.parent, [])) if args.parent else None
    rows = []
    print(f"{'span':28} {'count':>7} {'median ms':>10} {'total ms':>10} {'idle ms':>9} {'share':>6}")
    for name in sorted(got, key=lambda k: -sum(b for b, _ in got[k])):
        v = got[name]
        busy = [b for b, _ in v]
        total, idle = sum(busy), sum(i for _, i in v)
        share = total / base if base else None
        rows.append({"span": name, "count": len(v), "median_ms": statistics.median(busy),
                     "total_ms": total, "idle_ms": idle, "share_of_parent": share})
        print(f"{name:28} {len(v):7d} {statistics.median(busy):10.3f} {total:10.1f} {idle:9.1f} "
              + (f"{share:6.1%}" if share is not None else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"log": args.log, "parent": args.parent, "skip": args.skip,
                       "match": args.match, "spans": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
