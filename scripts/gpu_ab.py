#!/usr/bin/env python3
"""Before/after of two builds of the benchmark binaries on the same rows, interleaved, with the
peer measured in the same call.

    gpu_ab.py generate --before DIR --after DIR [--rounds 5] [--llamacpp-bin DIR] --out OUT.json \
        -- BENCH_GENERATE_ARGS...
    gpu_ab.py train --before DIR --after DIR [--rounds 5] [--peer PEER.json] --out OUT.json \
        -- BENCH_TRAIN_ARGS...

DIR holds the build's `bench_generate` / `bench_train`. Each round runs both builds once on the
same arguments, the first of the pair swapped every round so that drift weighs on both. For
`generate`, llama.cpp runs inside the `after` run (`--llamacpp-bin`), in every round or in the
first `--peer-rounds N`; the ratio of a build is the median of its figures over the median
of the peer's. For `train`, the PyTorch peer's JSON (scripts/train_peer.py, run in the same call)
is the peer.

OUT.json: benchmark `ab-generate` / `ab-train`, command, commit (this checkout: the after build),
`before_commit`, date, machine, every run's record (`rounds`), and per metric the medians, the
ratios to the peer (above 1: ours better) and `after_over_before` of the ratios.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import bench_record

GEN_METRICS = [  # (our key, peer key, higher is better)
    ("decode_tokens_per_s", "llamacpp_decode_tokens_per_s", True),
    ("prefill_tokens_per_s", "llamacpp_prefill_tokens_per_s", True),
    ("peak_device_bytes", "llamacpp_peak_device_bytes", False),
]
TRAIN_METRICS = [("step_s", "step_s", False), ("peak_device_bytes", "peak_device_bytes", False)]


def run(binary, args, out):
    t0 = time.time()
    p = subprocess.run([binary, *args, "--json-out", out], capture_output=True, text=True)
    sys.stdout.write(p.stdout[-1500:])
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-3000:])
        raise SystemExit(f"{binary} exited {p.returncode}")
    with open(out) as f:
        rec = json.load(f)
    return rec, time.time() - t0


def gen_rows(rec):
    return rec["records"]


def train_rows(rec):
    return rec["records"]["configs"]


def ratio(ours, peer, higher):
    if ours is None or peer is None or ours == 0 or peer == 0:
        return None
    return ours / peer if higher else peer / ours


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["generate", "train"])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llamacpp-bin")
    ap.add_argument("--peer-rounds", type=int, default=None,
                    help="run llama.cpp in the first N rounds only (default: every round)")
    ap.add_argument("--peer")
    ap.add_argument("--out", required=True)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    name = "bench_generate" if a.mode == "generate" else "bench_train"
    bins = {"before": os.path.join(a.before, name), "after": os.path.join(a.after, name)}
    tmp = os.path.splitext(a.out)[0]
    rounds = []
    for i in range(a.rounds):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        got = {}
        for build in order:
            extra = []
            if (a.mode == "generate" and build == "after" and a.llamacpp_bin
                    and (a.peer_rounds is None or i < a.peer_rounds)):
                extra = ["--llamacpp-bin", a.llamacpp_bin]
            rec, secs = run(bins[build], rest + extra, f"{tmp}-{build}-{i}.json")
            got[build] = {"seconds": round(secs, 2), "record": rec}
            print(f"round {i} {build}: {secs:.1f} s", flush=True)
        rounds.append(got)

    summary = {}
    if a.mode == "generate":
        n = len(gen_rows(rounds[0]["after"]["record"]))
        for j in range(n):
            row0 = gen_rows(rounds[0]["after"]["record"])[j]
            key = f"budget={row0.get('budget')} prompt={row0.get('prompt_len')}"
            for ours_k, peer_k, higher in GEN_METRICS:
                vals = {b: [gen_rows(r[b]["record"])[j].get(ours_k) for r in rounds]
                        for b in ("before", "after")}
                peer = [gen_rows(r["after"]["record"])[j].get(peer_k) for r in rounds]
                summary.setdefault(key, {})[ours_k] = summarize(vals, peer, higher)
    else:
        with open(a.peer) as f:
            peer_rec = json.load(f)
        peer_by = {c["config"]: c for c in peer_rec["results"]}
        n = len(train_rows(rounds[0]["after"]["record"]))
        for j in range(n):
            cfg = train_rows(rounds[0]["after"]["record"])[j]["config"]
            for ours_k, peer_k, higher in TRAIN_METRICS:
                vals = {b: [train_rows(r[b]["record"])[j].get(ours_k) for r in rounds]
                        for b in ("before", "after")}
                pv = peer_by.get(cfg, {}).get(peer_k)
                summary.setdefault(cfg, {})[ours_k] = summarize(vals, [pv], higher)

    out = bench_record.header(f"ab-{a.mode}")
    out.update(
        commit=rounds[0]["after"]["record"].get("commit") or out["commit"],
        before_commit=rounds[0]["before"]["record"].get("commit"),
        machine=rounds[0]["after"]["record"].get("machine"),
        summary=summary,
        rounds=rounds,
    )
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    for key, metrics in summary.items():
        for m, s in metrics.items():
            print(f"{key} {m}: before {s['before_median']} after {s['after_median']} peer {s['peer_median']}"
                  f" ratio before {s['ratio_before']} after {s['ratio_after']} after/before {s['after_over_before']}")


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(vals, peer, higher):
    b, a, p = med(vals["before"]), med(vals["after"]), med(peer)
    rb, ra = ratio(b, p, higher), ratio(a, p, higher)
    return {
        "before": vals["before"], "after": vals["after"], "peer": peer,
        "before_median": b, "after_median": a, "peer_median": p,
        "ratio_before": None if rb is None else round(rb, 4),
        "ratio_after": None if ra is None else round(ra, 4),
        "after_over_before": None if (rb is None or ra is None) else round(ra / rb, 4),
        "within_5_percent": None if (rb is None or ra is None) else abs(ra / rb - 1) <= 0.05,
    }


if __name__ == "__main__":
    main()
