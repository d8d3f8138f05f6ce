#!/usr/bin/env python3
"""Regenerate benches/current.json, the current-results table, from the raw result files.

    python3 scripts/current_results.py            # rewrite the files below
    python3 scripts/current_results.py --check    # exit 1 where any of them differs

It reads the raw records under benches/results/ (through benches/results/index.json), picks for
every measured configuration the newest record of our default configuration that has its peer
measured in the same call, and writes:

- benches/current.json: one row per configuration and metric (fields in FIELDS);
- BENCHMARKS.md: the summary tables between `<!-- current:begin -->` and `<!-- current:end -->`;
- README.md: a compact "results at a glance" between `<!-- glance:begin -->` and
  `<!-- glance:end -->`, where README.md has those markers;
- benches/results/index.json: the `current` flag of every entry (true for the files that feed
  a row); the other fields of the index are written by hand.

Every number comes from the raw files. What this script holds is the selection: which raw
files may hold a family's newest measurement (SOURCES), what counts as our default there
(the `*_default` functions), and which configurations the grid expects (GRID_EXPECTED), so
that a configuration never measured shows up as such. A new measurement goes in as a raw
file plus its index entry; add the file to SOURCES and rerun this script.

Python 3 standard library only.
"""
import functools
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benches/results"
INDEX = f"{RESULTS}/index.json"
CURRENT = "benches/current.json"
BENCHMARKS = "BENCHMARKS.md"
README = "README.md"
MARKERS = {
    BENCHMARKS: ("<!-- current:begin -->", "<!-- current:end -->"),
    README: ("<!-- glance:begin -->", "<!-- glance:end -->"),
}

FIELDS = [
    "benchmark", "model", "weights", "budget_gib", "prompt_len", "metric",
    "ours", "peer", "peer_value", "ratio",
    "peak_mib", "budget_mib", "within_budget",
    "commit", "date", "source",
]
MIB = 1 << 20

# -- the selection --------------------------------------------------------------------------
# Raw files that may hold the newest measurement of each family, relative to benches/results/.
# Within a family the newest default record of a configuration wins (file date, then device
# call, then order in the file), so an older file listed here only fills what newer ones lack.
SOURCES = {
    # bench_generate on the GPU, llama.cpp on the same GGUF file in the same process.
    "generate-gpu": [
        "2026-12-04/2026-12-04-stop48-q4_k_m-trim-every-unmatched-free-fdb199e-h200.json",
        "2026-12-04/2026-12-04-stop48-q4_k_m-4gib-9736af5-h200.json",
        "2026-12-04/2026-12-04-stop49-grid-13b-q8_0-7b-f16-q8_0-d7971bb-h200.json",
        "2026-12-04/2026-12-04-stop50-grid-7b-q4_0-q4_k_m-a61df2c-h200.json",
        "2026-12-04/2026-12-04-stop51-p64-gemm-from-64-e095323-h200.json",
        "2026-12-04/2026-12-04-stop51-spread-resident-loss-9e01ec2-h200.json",
    ],
    # scripts/gpu_ab.py generate (ab-generate): two builds interleaved over rounds, llama.cpp
    # inside the after build's runs; the after build's medians stand for its rows.
    "generate-gpu-ab": [
        "2026-12-05/2026-12-05-redesign-gpu-ab-gen-q4km-cc93333-vs-1c4dba4-h200.json",
        "2026-12-05/2026-12-05-redesign-gpu-ab-gen-f16-cc93333-vs-1c4dba4-h200.json",
        "2026-12-05/2026-12-05-redesign-gpu-ab-gen-q8-r1-cc93333-vs-1c4dba4-h200.json",
        "2026-12-05/2026-12-05-redesign-gpu-ab-gen-q8-r2-cc93333-vs-1c4dba4-h200.json",
    ],
    # scripts/cpu_default_bench.py: generate --cpu on the default model, llama.cpp's Python
    # binding in the same run, prompt by prompt, round by round.
    "generate-cpu": [
        "2026-12-04/2026-12-04-stop49-cpu-default-model-3ab4984.json",
        "2026-12-04/2026-12-04-stop49-cpu-default-model-9437729.json",
        "2026-12-04/2026-12-04-stop51-cpu-default-model-fc29c6d-run1.json",
        "2026-12-04/2026-12-04-stop51-cpu-default-model-fc29c6d-run2.json",
        "2026-12-04/2026-12-04-cpu-default-model-b5a4840.json",
        "2026-12-05/2026-12-05-cpu-default-model-e207087.json",
    ],
    # scripts/moe_cpu_bench.py: generate --cpu on a random small Qwen3-MoE GGUF, llama.cpp's
    # Python binding on the same file and token ids in the same run, rounds alternating.
    "moe-cpu": [
        "2026-12-04/2026-12-04-moe-cpu-small-1586905.json",
        "2026-12-05/2026-12-05-moe-cpu-small-4de615f.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q8_0-before-run1-fa5ced6.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q8_0-before-run2-fa5ced6.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q8_0-run1-88898b2.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q8_0-run2-88898b2.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-fixed-writer-18e69b3.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-expert-runs-e13673a.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-runs-matched-once-run1-f0eae8a.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-runs-matched-once-run2-f0eae8a.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q8_0-runs-f0eae8a.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-silu-vectorized-44f236f.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-softmax-exp-four-runs-pooled-c124452.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q8_0-readback-2807321.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q8_0-before-rows4-fa8ca9b.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q8_0-rows4-f1e1915.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-before-q4k-rows-f1e1915.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-q4k-rows-9400117.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-q6k-rows-run1-4aab8f8.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-q6k-rows-run2-4aab8f8.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-run2-89f1cce.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q4_k_m-89f1cce.json",
        "2026-12-06/2026-12-06-moe-cpu-small-q8_0-89f1cce.json",
        "2026-12-07/2026-12-07-moe-cpu-small-q4_k_m-017ceb1.json",
        "2026-12-07/2026-12-07-moe-cpu-small-q4_k_m-fc4140d.json",
        "2026-12-07/2026-12-07-moe-cpu-small-q8_0-f32-rows-12a17d2.json",
    ],
    # scripts/moe_cpu_bench.py with a long prompt (the same prompt text repeated), on the
    # default model and on the small Qwen3-MoE: the CPU prompt attention's blocks.
    "cpu-long": [
        "2026-12-06/2026-12-06-cpu-long-prompt-smollm2-blocks-cc5ab71.json",
        "2026-12-06/2026-12-06-cpu-long-prompt-moe-small-q8_0-blocks-cc5ab71.json",
    ],
    # bench_generate on random Qwen3-8B- and Gemma-3-12B-shaped GGUFs (gpu-run.sh gguf_qwen3_8b,
    # gguf_gemma3_12b, qbench), llama.cpp on the same file in the same process.
    "family-gpu": [
        "2026-12-06/2026-12-06-qwen3-8b-q4_k_m-4gib-streamed-no-host-layers-b1b366c-h100.json",
        "2026-12-06/2026-12-06-gemma3-12b-q4_k_m-4gib-streamed-no-host-layers-b1b366c-h100.json",
    ],
    # bench_generate --llamacpp-moe on a random Qwen3-30B-A3B GGUF (scripts/gpu_moe_session.sh),
    # llama.cpp at the fewest -ncmoe within each budget in the same process; and a file of
    # printed figures transcribed, where the call ran without --json-out (all on the GPU).
    "moe-gpu": [
        "2026-12-05/2026-12-05-moe-all-on-gpu-q8_0-q4_k_m-printed-6e9b932-h200.json",
        "2026-12-05/2026-12-05-moe-q8_0-uniform-4-8-12gib-p64-grouped-7493f1c-h100.json",
        "2026-12-05/2026-12-05-moe-q8_0-skewed-4gib-p64-7493f1c-h100.json",
        "2026-12-05/2026-12-05-moe-q8_0-skewed-8-12gib-p64-7493f1c-h100.json",
        "2026-12-06/2026-12-06-moe-q8_0-uniform-fixed-writer-4-8-12gib-p64-b1b366c-h100.json",
        "2026-12-06/2026-12-06-moe-q8_0-uniform-4gib-p64-spares-kept-be86de4-h200.json",
        "2026-12-06/2026-12-06-moe-q8_0-uniform-8-12gib-p64-spares-kept-c79a959-h100.json",
        "2026-12-06/2026-12-06-moe-q8_0-uniform-8-12gib-p64-prefetch-split-01dfc19-h100.json",
        "2026-12-06/2026-12-06-moe-q8_0-skewed-fixed-writer-8gib-p64-512-8c290a0-h100.json",
        "2026-12-06/2026-12-06-moe-q8_0-skewed-fixed-writer-12gib-p64-512-8c290a0-h100.json",
        "2026-12-06/2026-12-06-moe-q4_k_m-skewed-fixed-writer-8gib-p64-512-8c290a0-h100.json",
        "2026-12-06/2026-12-06-moe-q4_k_m-skewed-fixed-writer-12gib-p64-512-8c290a0-h100.json",
        "2026-12-06/2026-12-06-moe-q8_0-skewed-8gib-p64-512-device-route-auto-c683167-h100.json",
        "2026-12-06/2026-12-06-moe-q8_0-skewed-12gib-p64-512-device-route-auto-c683167-h100.json",
        "2026-12-06/2026-12-06-moe-q4_k_m-skewed-12gib-p64-device-route-auto-c683167-h100.json",
        "2026-12-06/2026-12-06-moe-q4_k_m-skewed-8gib-p64-device-route-auto-c683167-h100.json",
        "2026-12-06/2026-12-06-moe-q4_k_m-skewed-12gib-p64-graphs-grouped-rows-7f7ebe1-h100.json",
        "2026-12-06/2026-12-06-moe-q8_0-skewed-8gib-p64-512-graphs-grouped-rows-7f7ebe1-h100.json",
        "2026-12-06/2026-12-06-moe-q8_0-skewed-8gib-p64-512-457d2cd-h200.json",
        "2026-12-06/2026-12-06-moe-q4_k_m-skewed-12gib-p64-512-457d2cd-h200.json",
        "2026-12-06/2026-12-06-moe-q4_k_m-skewed-8gib-p64-512-457d2cd-h200.json",
        "2026-12-06/2026-12-06-moe-q8_0-uniform-8gib-p64-512-457d2cd-h200.json",
        "2026-12-07/2026-12-07-moe-q8_0-uniform-8gib-p64-512-4869765-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-skewed-8gib-p64-512-4869765-h100.json",
        "2026-12-07/2026-12-07-moe-q4_k_m-skewed-12gib-p64-512-4869765-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-uniform-8gib-p64-512-prompt-rate-e14d726-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-skewed-8gib-p64-512-prompt-rate-e14d726-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-uniform-8gib-p64-512-22bc7a4-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-uniform-8gib-p64-512-enqueue-split-c7162f4-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-skewed-8gib-p64-512-enqueue-split-c7162f4-h100.json",
        "2026-12-07/2026-12-07-moe-q4_k_m-skewed-12gib-p64-enqueue-split-c7162f4-h100.json",
        "2026-12-07/2026-12-07-moe-q4_k_m-skewed-12gib-p512-enqueue-split-c7162f4-h100.json",
        "2026-12-07/2026-12-07-moe-q4_k_m-skewed-8gib-p64-512-982b847-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-skewed-12gib-p64-512-982b847-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-skewed-4gib-p64-512-982b847-h100.json",
        "2026-12-07/2026-12-07-moe-q4_k_m-skewed-4gib-p64-512-982b847-h100.json",
        "2026-12-07/2026-12-07-moe-q4_k_m-skewed-12gib-p512-982b847-h100.json",
        "2026-12-07/2026-12-07-moe-q4_k_m-skewed-8-12gib-p512-2b8d255-h100.json",
        "2026-12-07/2026-12-07-moe-q4_k_m-skewed-4gib-p512-2b8d255-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-skewed-4gib-p512-2b8d255-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-uniform-12gib-p64-512-2b8d255-h100.json",
        "2026-12-07/2026-12-07-moe-q4_k_m-skewed-12gib-p512-9378b14-h100.json",
        "2026-12-07/2026-12-07-moe-q8_0-uniform-12gib-p64-12ba107-h100.json",
    ],
    # bench_train with scripts/train_peer.py (PyTorch) run just before it in the same call.
    # bench_train's lora-* configurations, with scripts/lora_peer.py (PEFT) run just before it
    # in the same call for the resident ones.
    # scripts/serve_bench.py: serve against llama-server, same GGUF, same call.
    "serve": [
        "2026-12-07/2026-12-07-serve-8b-q4_k_m-full-k-v4-rows-2-f69412e-h100.json",
        "2026-12-06/2026-12-06-serve-8b-q4_k_m-6gib-warm-up-161e405-h100.json",
    ],
    "lora": [
        "2026-12-06/2026-12-06-lora-1b-bf16-accumulated-update-70def38-h100.json",
        "2026-12-06/2026-12-06-lora-1b-qlora-bnb-nf4-accumulated-update-70def38-h100.json",
        "2026-12-06/2026-12-06-lora-7b-qlora-budgets-reserve-20-bytes-e2bd3f1-h200.json",
        "2026-12-06/2026-12-06-lora-7b-bf16-budgets-reserve-20-bytes-e2bd3f1-h200.json",
    ],
    "train": [
        "2026-12-01/2026-12-01-train-hand-first-h200.json",
        "2026-12-01/2026-12-01-train-scaler-rows-h200.json",
        "2026-12-01/2026-12-01-train-hand-backward-h200.json",
        "2026-12-01/2026-12-01-train-head-by-hand-h200.json",
        "2026-12-01/2026-12-01-train-head-by-hand-f32-offload-h200.json",
    ],
}

# The grid the GPU rows should cover: (model size, weights) x budgets (GiB, None = all on the
# GPU) x prompt lengths. A configuration with no record is listed under the table.
GRID_EXPECTED = [
    (size, w, b, p)
    for size, ws, budgets in [
        ("7b", ["f16", "q8_0", "q4_k_m", "q4_0"], [4, 8, 12, None]),
        ("13b", ["q4_k_m", "q8_0"], [4, 8, 12, None]),
    ]
    for w in ws
    for b in budgets
    for p in (64, 512)
]
TRAIN_CONFIGS = ["none", "layer", "sqrt"]
TRAIN_PRECISIONS = ["bf16", "f16", "f32"]


def grid_default(r):
    """A bench_generate record of generate's default choices, next to llama.cpp.

    `--host-layers spread:auto` is generate's default; every tuning variable unset, each
    block type's own kernel, the explicit engine, graphs and the prompt GEMM on. The grid runs
    `--q8-activations` and `--prefetch-depth 2` throughout (see the table's note)."""
    env_set = [k for k, v in r.items() if k.endswith("_env") and v is not None]
    return (
        r.get("batch", 1) == 1
        and r.get("host_layers_choice") == "SpreadAuto"
        and r.get("qlinear_variant", "default") == "default"
        and not env_set
        and r.get("engine", "explicit") == "explicit"
        and r.get("graphs", True) is True
        and r.get("prefill_gemm", True) is True
        and r.get("quantize_on_load") is None
        and not r.get("disk_page_cache")
        and bool(r.get("llamacpp_decode_tokens_per_s"))
    )


def train_default(c):
    """A bench_train configuration as the trainer runs it by default (the layer's backward by
    hand), finished without error."""
    return c.get("hand_backward") is True and c.get("error") is None and not c.get("host_profile")


# -- helpers ----------------------------------------------------------------------------------
def load(rel):
    with open(ROOT / RESULTS / rel) as f:
        return json.load(f)


def day(doc):
    return str(doc["date"])[:10]


def rnd(x, digits):
    if x is None:
        return None
    v = round(float(x), digits)
    return int(v) if digits == 0 else v


def gib(x):
    """A budget in GiB: an integer where it is one."""
    if x is None:
        return None
    v = round(float(x), 2)
    return int(v) if v == int(v) else v


def ratio(ours, peer, higher_is_better):
    if not ours or not peer:
        return None
    return round(ours / peer if higher_is_better else peer / ours, 4)


def call_number(r):
    m = re.search(r"device call (\d+)", str(r.get("call", "")))
    return int(m.group(1)) if m else -1


def row(**kw):
    missing = [f for f in FIELDS if f not in kw]
    assert not missing and len(kw) == len(FIELDS), f"row fields: missing {missing}"
    return {f: kw[f] for f in FIELDS}


# -- families ---------------------------------------------------------------------------------
def ab_records(doc):
    """An ab-generate file's rows as bench_generate records: the after build's first-round
    record of each row (its configuration), with the decode and prefill rates replaced by the
    after build's medians over the rounds, llama.cpp's by its medians, and the peak by the
    after build's highest."""
    records = []
    for r in doc["rounds"][0]["after"]["record"]["records"]:
        summary = doc["summary"].get(f"budget={r.get('budget')} prompt={r.get('prompt_len')}", {})
        r = dict(r)
        for ours, peer in [("decode_tokens_per_s", "llamacpp_decode_tokens_per_s"),
                           ("prefill_tokens_per_s", "llamacpp_prefill_tokens_per_s")]:
            m = summary.get(ours)
            if m:
                r[ours], r[peer] = m["after_median"], m["peer_median"]
        peaks = [x for x in summary.get("peak_device_bytes", {}).get("after", []) if x]
        if peaks:
            r["peak_device_bytes"] = max(peaks)
            if r.get("budget_bytes"):
                r["peak_within_budget"] = max(peaks) <= r["budget_bytes"]
        records.append(r)
    return records


def llamacpp_rate_rows(r, common):
    """A bench_generate record's decode and prefill rows against llama.cpp's, where both are."""
    out = []
    for metric, ours, peer in [
        ("decode_tokens_per_s", r["decode_tokens_per_s"], r["llamacpp_decode_tokens_per_s"]),
        ("prefill_tokens_per_s", r["prefill_tokens_per_s"], r.get("llamacpp_prefill_tokens_per_s")),
    ]:
        if ours and peer:
            out.append(row(metric=metric, ours=rnd(ours, 2), peer_value=rnd(peer, 2),
                           ratio=ratio(ours, peer, True), **common))
    return out


def gpu_llamacpp_rows(benchmark, model, weights, b, p, r, doc, rel, within=None):
    """A bench_generate record's rows against llama.cpp: its peak against its budget (`within`,
    or the record's own `peak_within_budget`), where and when it ran."""
    peak = r["peak_device_bytes"] / MIB
    budget_mib = r["budget_bytes"] / MIB if r.get("budget_bytes") else None
    if budget_mib is None:
        within = None
    elif within is None:
        within = r["peak_within_budget"]
    common = dict(
        benchmark=benchmark, model=model, weights=weights.upper(), budget_gib=gib(b),
        prompt_len=p, peer="llama.cpp", peak_mib=rnd(peak, 0), budget_mib=rnd(budget_mib, 0),
        within_budget=within, commit=str(doc["commit"]), date=day(doc),
        source=f"{RESULTS}/{rel}")
    return llamacpp_rate_rows(r, common)


def gpu_rows():
    best = {}
    docs = [(rel, load(rel)) for rel in SOURCES["generate-gpu"]]
    docs = [(rel, doc, doc["records"]) for rel, doc in docs]
    docs += [(rel, doc, ab_records(doc)) for rel, doc in
             ((rel, load(rel)) for rel in SOURCES["generate-gpu-ab"])]
    for rel, doc, records in docs:
        for i, r in enumerate(records):
            if not grid_default(r):
                continue
            size, w = r["weights"].split("-", 1)
            b = None if r["budget"] == "full" else float(r["budget"])
            key = (size, w, b, r["prompt_len"])
            order = (str(doc["date"]), call_number(r), i)
            if key not in best or order > best[key][0]:
                best[key] = (order, rel, doc, r)
    rows = []
    for key in sorted(best, key=lambda k: GRID_EXPECTED.index(k) if k in GRID_EXPECTED else 1e9):
        _, rel, doc, r = best[key]
        size, w, b, p = key
        rows += gpu_llamacpp_rows("generate-gpu", f"LLaMA {size.upper()} shape", w, b, p, r, doc, rel)
    return rows


def cpu_rows():
    newest = None
    for rel in SOURCES["generate-cpu"]:
        doc = load(rel)
        q = [r for r in doc["records"] if r.get("mode") == "default"]
        if q and (newest is None or str(doc["date"]) > str(newest[1]["date"])):
            newest = (rel, doc, q)
    if newest is None:
        return []
    rel, doc, q = newest
    m = re.search(r"([\w.-]+?)\.(Q\w+|F16|F32|BF16)\.gguf", doc["command"])
    model, weights = (m.group(1), m.group(2)) if m else ("default model", None)
    rows = []
    for metric, ours_k, peer_k, ratio_k in [
        ("decode_tokens_per_s", "decode_tokens_per_s", "llamacpp_decode_tokens_per_s", "cpu_vs_llamacpp"),
        ("prefill_tokens_per_s", "prefill_tokens_per_s", "llamacpp_prefill_tokens_per_s", "prefill_vs_llamacpp"),
    ]:
        # Rounds of paired runs: each side's median, and the median of the pairs' ratios (the
        # harness's own summary, which this recomputes and checks).
        r_med = statistics.median(r[ratio_k] for r in q)
        if not math.isclose(r_med, doc[ratio_k], rel_tol=1e-9):
            sys.exit(f"{rel}: {ratio_k} is {doc[ratio_k]}, its records' median {r_med}")
        rows.append(row(
            benchmark="generate-cpu", model=model, weights=weights, budget_gib=None,
            prompt_len=None, metric=metric,
            ours=rnd(statistics.median(r[ours_k] for r in q), 2), peer="llama.cpp",
            peer_value=rnd(statistics.median(r[peer_k] for r in q), 2), ratio=round(r_med, 4),
            peak_mib=None, budget_mib=None, within_budget=None,
            commit=str(doc["commit"]), date=day(doc), source=f"{RESULTS}/{rel}"))
    return rows


def moe_cpu_weights(doc):
    """The block type of the file a moe_cpu_bench.py record ran, from its command."""
    return "Q8_0" if "q8_0" in str(doc["command"]).lower() else "Q4_K_M"


def moe_cpu_rows():
    """The newest record per block type."""
    rows = []
    newest = {}
    for rel in SOURCES["moe-cpu"]:
        doc = load(rel) | {"_rel": rel}
        w = moe_cpu_weights(doc)
        if w not in newest or str(doc["date"]) > str(newest[w]["date"]):
            newest[w] = doc
    for w, doc in sorted(newest.items(), key=lambda kv: kv[0] != "Q4_K_M"):
        rows += moe_cpu_doc_rows(doc, w)
    return rows


def moe_cpu_doc_rows(newest, weights, benchmark="generate-cpu-moe",
                     model="Qwen3-MoE small shape (random)"):
    """A moe_cpu_bench.py record's decode and prefill rows against llama.cpp."""
    rows = []
    for metric in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        s = newest["summary"][metric]
        rows.append(row(
            benchmark=benchmark, model=model,
            weights=weights, budget_gib=None, prompt_len=len(newest["prompt_ids"]), metric=metric,
            ours=rnd(s["ours_median"], 2), peer="llama.cpp", peer_value=rnd(s["llamacpp_median"], 2),
            ratio=ratio(s["ours_median"], s["llamacpp_median"], True), peak_mib=None,
            budget_mib=None, within_budget=None, commit=str(newest["commit"]),
            date=day(newest), source=f"{RESULTS}/{newest['_rel']}"))
    return rows


def cpu_long_rows():
    """Each long-prompt record's decode and prefill against llama.cpp."""
    rows = []
    for rel in SOURCES["cpu-long"]:
        doc = load(rel) | {"_rel": rel}
        if doc["benchmark"] == "moe-cpu-small":
            rows += moe_cpu_doc_rows(doc, moe_cpu_weights(doc), "generate-cpu-long")
            continue
        m = re.search(r"([\w.-]+?)\.(Q\w+|F16|F32|BF16)\.gguf$", doc["model"])
        model, weights = (m.group(1), m.group(2)) if m else (doc["model"], None)
        rows += moe_cpu_doc_rows(doc, weights, "generate-cpu-long", model)
    return rows


FAMILY_NAMES = {"qwen3-8b": "Qwen3-8B shape", "gemma3-12b": "Gemma-3-12B shape"}


def placement(r):
    """A bench_generate record's placement of decoder layers, as a table says it."""
    return {"SpreadAuto": "spread:auto", "None": "streamed, no host layers"}.get(
        r.get("host_layers_choice"), str(r.get("host_layers_choice")))


def family_gpu_rows():
    """The newest record per (model, weights, budget, prompt, placement) of the newer families."""
    best = {}
    for rel in SOURCES["family-gpu"]:
        doc = load(rel)
        for i, r in enumerate(doc["records"]):
            if not r.get("llamacpp_decode_tokens_per_s"):
                continue
            # e.g. qwen3-8b-q4_k_m: the model's name, then the weights' type.
            name, w = re.fullmatch(r"(.+?)-(q\d\w*|f16|bf16|f32)", r["weights"]).groups()
            b = None if r["budget"] == "full" else float(r["budget"])
            key = (name, w, b, r["prompt_len"], placement(r))
            order = (str(doc["date"]), i)
            if key not in best or order > best[key][0]:
                best[key] = (order, rel, doc, r)
    rows = []
    for key in sorted(best):
        _, rel, doc, r = best[key]
        name, w, b, p, place = key
        rows += gpu_llamacpp_rows("generate-gpu-family", f"{FAMILY_NAMES.get(name, name)} ({place})",
                                  w, b, p, r, doc, rel)
    return rows


def moe_gpu_rows():
    """The newest record per (weights, budget, prompt) with llama.cpp's figures beside it."""
    best = {}
    for rel in SOURCES["moe-gpu"]:
        doc = load(rel)
        for i, r in enumerate(doc["records"]):
            if "llamacpp" in r:  # a transcribed record
                lc = r["llamacpp"]
                if not lc:
                    continue
                r = dict(r, budget_bytes=None, peak_device_bytes=r["peak_device_mib"] * MIB,
                         prefill_tokens_per_s=r["prompt_len"] / r["prefill_s"],
                         llamacpp_decode_tokens_per_s=lc["tg16_tokens_per_s"],
                         llamacpp_prefill_tokens_per_s=lc[f"pp{r['prompt_len']}_tokens_per_s"])
            elif not r.get("llamacpp_decode_tokens_per_s"):
                continue
            w = r["weights"].replace("qwen3-30b-a3b-", "")
            b = None if r["budget"] == "full" else float(r["budget"])
            key = (w, b, r["prompt_len"])
            order = (str(doc["date"]), i)
            if key not in best or order > best[key][0]:
                best[key] = (order, rel, doc, r)
    rows = []
    for key in sorted(best, key=lambda k: (k[0], k[1] is None, k[1] or 0, k[2])):
        _, rel, doc, r = best[key]
        w, b, p = key
        weights, routing = w.rsplit("-", 1)
        # Transcribed records carry no `peak_within_budget`: the peak against the budget here.
        within = r["peak_device_bytes"] <= r["budget_bytes"] if r.get("budget_bytes") else None
        rows += gpu_llamacpp_rows("generate-gpu-moe", f"Qwen3-30B-A3B shape ({routing} routing)",
                                  weights, b, p, r, doc, rel, within)
    return rows


def train_rows():
    best = {}
    for rel in SOURCES["train"]:
        doc = load(rel)
        recs = doc["records"]
        shape = recs["shape"]
        for c in recs["configs"]:
            if not train_default(c):
                continue
            offload = bool(c.get("offload"))
            if not offload and not (c.get("pytorch") and c.get("step_time_vs_pytorch")):
                continue  # a resident row counts only next to PyTorch's of the same call
            key = c["config"]
            if key not in best or str(doc["date"]) > str(best[key][1]["date"]):
                best[key] = (rel, doc, c, shape)
    rows = []
    order = [f"{k}-{p}" for p in TRAIN_PRECISIONS for k in TRAIN_CONFIGS]
    for key in sorted(best, key=lambda k: (k.startswith("offload"), order.index(k) if k in order else k)):
        rel, doc, c, shape = best[key]
        params = c["parameters"] / 1e9
        common = dict(
            model=f"LLaMA {params:.1f}B shape",
            weights=c["precision"].upper(),
            prompt_len=None,
            commit=str(doc["commit"]),
            date=day(doc),
            source=f"{RESULTS}/{rel}",
        )
        if c.get("offload"):
            budget = c["budget_bytes"]
            rows.append(row(
                benchmark="train-offload", budget_gib=gib(budget / (1 << 30)), metric="step_s",
                ours=rnd(c["step_s"], 4), peer=None, peer_value=None, ratio=None,
                peak_mib=rnd(c["peak_over_context_bytes"] / MIB, 0), budget_mib=rnd(budget / MIB, 0),
                within_budget=c["budget_holds_driver"], **common))
            continue
        pt = c["pytorch"]
        peak = c["peak_device_bytes"] / MIB
        bench = "train-" + c["config"].split("-")[0]
        rows.append(row(
            benchmark=bench, budget_gib=None, metric="step_s",
            ours=rnd(c["step_s"], 4), peer="PyTorch", peer_value=rnd(pt["step_s"], 4),
            ratio=ratio(c["step_s"], pt["step_s"], False),
            peak_mib=rnd(peak, 0), budget_mib=None, within_budget=None, **common))
        rows.append(row(
            benchmark=bench, budget_gib=None, metric="peak_mib",
            ours=rnd(peak, 0), peer="PyTorch", peer_value=rnd(pt["peak_device_bytes"] / MIB, 0),
            ratio=ratio(c["peak_device_bytes"], pt["peak_device_bytes"], False),
            peak_mib=rnd(peak, 0), budget_mib=None, within_budget=None, **common))
    return rows


def lora_rows():
    """bench_train's `lora-*` configurations: resident against PEFT's LoRA in the same call
    (scripts/lora_peer.py; the Q4_K base against bitsandbytes' NF4), under a budget against
    the step's ideal (the streamed bytes at the link's rate plus the resident step's time)."""
    best = {}
    for rel in SOURCES["lora"]:
        doc = load(rel)
        for c in doc["records"]["configs"]:
            if c.get("error") or not c.get("lora"):
                continue
            if c.get("budget_bytes") is None and not c.get("step_time_vs_peft"):
                continue  # a resident row counts only next to PEFT's of the same call
            key = (c["config"], doc["records"]["shape"]["hidden_size"])
            if key not in best or str(doc["date"]) >= str(best[key][1]["date"]):
                best[key] = (rel, doc, c)
    rows = []
    for key in sorted(best, key=lambda k: (k[1], k[0])):
        rel, doc, c = best[key]
        shape = doc["records"]["shape"]
        size = {2048: "1B", 4096: "7B"}.get(shape["hidden_size"], f"hidden {shape['hidden_size']}")
        base = c["lora"]["base"]
        common = dict(
            model=f"LLaMA {size} shape, rank {c['lora']['rank']}, "
                  f"batch {c['batch_size']} x {c['seq_len']}",
            weights=base.upper(), prompt_len=None, commit=str(doc["commit"]), date=day(doc),
            source=f"{RESULTS}/{rel}",
        )
        budget = c.get("budget_bytes")
        if budget is None:
            pe = c["peft"]
            rows.append(row(
                benchmark="lora", budget_gib=None, metric="step_s",
                ours=rnd(c["step_s"], 4), peer=f"PEFT ({pe['base']})",
                peer_value=rnd(pe["step_s"], 4), ratio=ratio(c["step_s"], pe["step_s"], False),
                peak_mib=rnd(c["peak_device_bytes"] / MIB, 0), budget_mib=None,
                within_budget=None, **common))
        else:
            rows.append(row(
                benchmark="lora-offload", budget_gib=gib(budget / (1 << 30)), metric="step_s",
                ours=rnd(c["step_s"], 4), peer="ideal", peer_value=rnd(c["lora_step_ideal_s"], 4),
                ratio=ratio(c["step_s"], c["lora_step_ideal_s"], False),
                peak_mib=rnd(c["peak_over_context_bytes"] / MIB, 0), budget_mib=rnd(budget / MIB, 0),
                within_budget=c["peak_within_budget"], **common))
    return rows


def serve_rows():
    """scripts/serve_bench.py: our `serve` against llama-server on the same GGUF in the same
    call, closed loop, per concurrency: total generated tokens/s and the p50 time to first
    token; peak: each server process's GPU memory (nvidia-smi's per-process figure, the CUDA
    context included) against the budget where one was set."""
    rows = []
    for rel in SOURCES["serve"]:
        doc = load(rel)
        budget = doc.get("budget_gib")
        ours, peer = doc["ours"], doc["peer"]
        peak = ours.get("peak_gpu_mib")
        for o, p in zip(ours["rows"], peer["rows"]):
            common = dict(
                benchmark="serve",
                model=f"LLaMA 8B shape, {o['concurrency']} concurrent",
                weights="Q4_K_M", budget_gib=gib(budget), prompt_len=None,
                peer="llama-server", peak_mib=peak,
                budget_mib=rnd(budget * 1024, 0) if budget else None,
                within_budget=(peak <= budget * 1024) if budget and peak is not None else None,
                commit=str(doc["commit"]), date=day(doc), source=f"{RESULTS}/{rel}",
            )
            rows.append(row(metric="total_tokens_per_s", ours=rnd(o["total_tokens_per_s"], 1),
                            peer_value=rnd(p["total_tokens_per_s"], 1),
                            ratio=ratio(o["total_tokens_per_s"], p["total_tokens_per_s"], True),
                            **common))
            rows.append(row(metric="ttft_p50_s", ours=rnd(o["ttft_p50_s"], 4),
                            peer_value=rnd(p["ttft_p50_s"], 4),
                            ratio=ratio(o["ttft_p50_s"], p["ttft_p50_s"], False), **common))
    return rows


def gpu_name(doc):
    """The GPU a result file names in its `machine` (a name, or an object with one), or None."""
    gpu = (doc.get("machine") or {}).get("gpu")
    return gpu.get("name") if isinstance(gpu, dict) else gpu


def machines():
    """One line per family: the machine its sources name."""
    out = {}
    for fam, rels in SOURCES.items():
        names = set()
        for rel in rels:
            doc = load(rel)
            m = doc.get("machine") or {}
            gpu = gpu_name(doc)
            cpu = f"{m.get('cores')}-core {m.get('cpu')} host" if m.get("cores") else None
            names.add(", ".join(x for x in [gpu, cpu] if x))
        out[fam] = "; ".join(sorted(n for n in names if n))
    return out


# -- rendering --------------------------------------------------------------------------------
def fmt(x, digits=2):
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


def budget_label(b):
    return "all on the GPU" if b is None else f"{fmt(b, 0) if b == int(b) else b} GiB"


@functools.lru_cache(maxsize=None)
def card(source):
    """The GPU a row's source file was measured on, as its short name (H100, H200), or None."""
    name = gpu_name(load(source.removeprefix(f"{RESULTS}/")))
    return next((w for w in str(name or "").split() if w[:1] in "HAL" and w[1:].isdigit()), None)


def measured(r):
    where = f"{card(r['source'])}, " if card(r["source"]) else ""
    return f"{r['date']}, {where}`{r['commit'][:7]}`, [json]({r['source']})"


def peak_cell(r):
    """A row's peak, with its budget where it had one, marked where it went over."""
    peak = fmt(r["peak_mib"]) + (f" ({fmt(r['budget_mib'])})" if r["budget_mib"] else "")
    return peak + (" **over**" if r["within_budget"] is False else "")


def by_key(rows, *fields):
    out = {}
    for r in rows:
        out.setdefault(tuple(r[f] for f in fields), []).append(r)
    return out


def generation_rows(rows, label):
    """A generation table's lines, one per (model, weights, budget, prompt): decode and
    prefill against the peer, the peak against the budget, where it was measured."""
    out = []
    for (model, w, b, p), rs in by_key(rows, "model", "weights", "budget_gib", "prompt_len").items():
        d = next((r for r in rs if r["metric"] == "decode_tokens_per_s"), None)
        f = next((r for r in rs if r["metric"] == "prefill_tokens_per_s"), None)
        any_r = d or f
        peak = peak_cell(any_r)
        out.append(
            f"| {label(model)} | {w} | {budget_label(b)} | {p} | "
            f"{fmt(d['ours']) + ' / ' + fmt(d['peer_value']) if d else '-'} | "
            f"{'**' + fmt(d['ratio']) + '**' if d else '-'} | "
            f"{fmt(f['ours'], 0) + ' / ' + fmt(f['peer_value'], 0) if f else '-'} | "
            f"{fmt(f['ratio']) if f else '-'} | {peak} | {measured(any_r)} |"
        )
    return out


def render_benchmarks(rows):
    mach = machines()
    gpu = [r for r in rows if r["benchmark"] == "generate-gpu"]
    cpu = [r for r in rows if r["benchmark"] == "generate-cpu"]
    moe_cpu = [r for r in rows if r["benchmark"] == "generate-cpu-moe"]
    cpu_long = [r for r in rows if r["benchmark"] == "generate-cpu-long"]
    moe_gpu = [r for r in rows if r["benchmark"] == "generate-gpu-moe"]
    family = [r for r in rows if r["benchmark"] == "generate-gpu-family"]
    train = [r for r in rows if r["benchmark"].startswith("train-") and r["benchmark"] != "train-offload"]
    off = [r for r in rows if r["benchmark"] == "train-offload"]
    lora = [r for r in rows if r["benchmark"] == "lora"]
    lora_off = [r for r in rows if r["benchmark"] == "lora-offload"]
    serve = [r for r in rows if r["benchmark"] == "serve"]
    L = [
        f"Generated by `scripts/current_results.py` from `{CURRENT}` ({len(rows)} rows); "
        "CI checks that the two agree. \"x\" is ours over the peer's rate, or the peer's time or "
        "memory over ours: above 1, ours is better.",
        "",
    ]
    if gpu:
        L += [
            "### Generation on the GPU, against llama.cpp",
            "",
            f"{mach['generate-gpu']}; batch 1; random-weight LLaMA-shaped GGUF files; llama.cpp "
            "on the same file in the same `bench_generate` process, its `-ngl` probed per budget "
            "and prompt. Ours with generate's default `--host-layers spread:auto`, plus the "
            "grid's `--q8-activations` (host layers multiply 8-bit activations, as llama.cpp "
            "does) and `--prefetch-depth 2` (generate's default is 1); neither changes a row "
            "where the whole model is on the GPU. Peak: device memory in use over the CUDA "
            "context, polled.",
            "",
            "| model | weights | budget | prompt | decode tok/s, ours / llama.cpp | x | prefill tok/s, ours / llama.cpp | x | peak MiB (budget) | measured |",
            "| --- | --- | --- | ---: | --- | ---: | --- | ---: | --- | --- |",
        ]
        L += generation_rows(gpu, lambda model: model.replace(' shape', ''))
        have = {(r["model"], r["weights"], r["budget_gib"], r["prompt_len"]) for r in gpu}
        missing = {}
        for size, w, b, p in GRID_EXPECTED:
            if (f"LLaMA {size.upper()} shape", w.upper(), b, p) not in have:
                missing.setdefault((size.upper(), w.upper(), b), []).append(p)
        if missing:
            L += ["", "Not measured: " + "; ".join(
                f"{s} {w} {budget_label(b)} (prompt {', '.join(map(str, ps))})"
                for (s, w, b), ps in missing.items()) + "."]
        L.append("")
    if family:
        L += [
            "### Qwen3 and Gemma 3 on the GPU, against llama.cpp",
            "",
            f"{mach['family-gpu']}; batch 1; random-weight GGUFs of the Qwen3-8B and Gemma-3-12B "
            "text shapes (`scripts/gguf_random_family.py`, then `llama-quantize`); llama.cpp on "
            "the same file in the same process, its `-ngl` probed per budget. The placement is "
            "in the model column: these rows streamed every layer that did not fit "
            "(`bench_generate`'s default then), not generate's `spread:auto`, which runs layers "
            "on the host CPU where the link cannot bring them in time; `spread:auto` is not "
            "measured on these shapes yet.",
            "",
            "| model | weights | budget | prompt | decode tok/s, ours / llama.cpp | x | prefill tok/s, ours / llama.cpp | x | peak MiB (budget) | measured |",
            "| --- | --- | --- | ---: | --- | ---: | --- | ---: | --- | --- |",
        ]
        L += generation_rows(family, lambda model: model)
        L.append("")
    if moe_gpu:
        L += [
            "### A mixture of experts on the GPU, against llama.cpp",
            "",
            f"{mach['moe-gpu']}; batch 1; a random-weight Qwen3-30B-A3B-shaped GGUF (48 layers, "
            "128 experts, top 8; `scripts/gguf_random_moe.py`); ours with the expert cache (LRU, "
            "the next layer's guess prefetched, `--expert-prefetch`); llama.cpp at `-ngl 99 -fa 1` "
            "with the fewest `-ncmoe` whose peak fits the budget, probed in the same process "
            "(`--llamacpp-moe`), or with nothing on the CPU where the whole model is on the GPU. "
            "Rows measured at `c683167` choose a decode row's experts as `--expert-route auto` "
            "does (on the device while the cache's recent hit rate keeps its misses cheap); the "
            "older ones on the host (read back each layer, the misses split between fetches and "
            "the host CPU). llama.cpp's decode follows the host CPU that computes its experts: "
            "at Q8_0 12 GiB it decoded 31.8 tok/s on the host of the `c683167` rows and 60.7 on "
            "the host of the `8c290a0` rows. The same-machine A/B of the two routes is in the "
            "index (Q8_0 12 GiB: 99.7 tok/s on the device route against 71.8 on the host's; "
            "Q4_K_M 12 GiB: 144.4 against 86.4; Q8_0 8 GiB, where the hit rate is 89-97%: 62.8 "
            "on auto, 66.1 always on the device, 68.4 on the host's). The skewed 8 and 12 GiB "
            "rows ran the fixed writer's file with random decode tokens; the skewed 4 GiB row is "
            "older (the writer before that fix, greedy tokens that repeat, so hit rates higher "
            "than the routing alone gives). The uniform rows ran the fixed writer's file "
            "(`475e7a4`) with random decode tokens, as llama-bench feeds: every layer's hit rate "
            "is close to its slots' share of 128 experts. The hosts differ: on the H100 host of the "
            "`22bc7a4` uniform rows llama.cpp decoded at 55 tok/s, on the host of the `c7162f4` "
            "rows at 29-37, so only same-call ratios compare. The uniform decode's physical bound "
            "(the host bytes a token reads over the host's read rate) was 79.6 and 77.4 tok/s at "
            "prompts 64 and 512 on the first (1.45x and 1.40x llama.cpp's there; ours 50%), and "
            "45.4 and 44.3 on the second (1.24x and 1.52x; ours 80% and 76% at `c7162f4`), so "
            "1.5x llama.cpp's uniform decode was beyond the bound itself at prompt 64 on both. A "
            "512-token prompt's link bound (the bytes of the used experts past the cache's slots "
            "over the link's measured 55 GB/s): uniform Q8_0 8 GiB 1,125 tok/s (ours 769 at "
            "`c7162f4`, 68%), skewed Q8_0 8 GiB 5,963 (ours 1,672, 28%: past the cache it is bound "
            "by the per-layer work, not the link). Skewed Q4_K_M 12 GiB: the prompt finds nearly "
            "every used expert in the cache (none past it), so it is bound by the host's work a "
            "layer: 2,016 tok/s against 1,366 (1.48x) at `982b847` on the `22bc7a4` rows' host, "
            "whose spans of the timed prompt gave 3.85 ms a layer with the device idle at every "
            "wait (the routing 1.58 on one thread, the device's enqueue 1.29, the placement "
            "0.29). `2b8d255` routes a prompt's rows on the CPU workers with a vectorized `exp` "
            "and takes its many-row experts through one batched call; on another H100 host, whose "
            "llama.cpp prefilled that row at 1,947 tok/s, it prefilled at 5,051 (2.59x), and ours "
            "alone on that machine, `355c846` (the workers' routing, the former cuBLAS path) "
            "against `2b8d255` in alternation: 5,209 and 4,871 against 6,182 and 5,385 tok/s "
            "(+15%, with the runs spread by 7%). Uniform Q8_0 12 GiB at `2b8d255`: decode 31.1 and "
            "28.8 tok/s, 55% and 53% of the bound (56.9 and 54.8), against llama.cpp's 40.2 and "
            "39.8. `9378b14` acquires a layer's experts under one hold of the runtime's lock and "
            "releases them together with one last-use event (one event recorded and one destroyed "
            "per expert before): ours alone on a third H100 host, `615ec9e` then `9378b14`, "
            "3,099 and 4,066 tok/s (+31%, one run each); with llama.cpp in the same call, whose "
            "prefill there was 1,435 tok/s, 3,993 (2.78x; 3x needs 4,304, 7% more). The spans of "
            "that prompt (the warm one): 2.1 ms a layer, of which the device's enqueue 0.93 (its "
            "work done 0.14 ms after), the routing 0.37 (the attention's wait included), the "
            "placement 0.32 (one fetched expert a layer 0.11 of it) and the host's expert 0.11. "
            "The `2b8d255` rows (the skewed rows at 512 tokens but Q8_0 8 and 12 GiB, "
            "uniform Q8_0 12 GiB) ran on that host; the `982b847` rows (skewed Q8_0 12 GiB, the "
            "4 GiB rows at 64 tokens) on the `22bc7a4` rows' host. The skewed Q8_0 8 GiB row at 512 "
            "tokens peaked 10 MiB over its budget at `4869765` and `e14d726`; since `5c2f9a2` the "
            "reservation counts a prompt's routed copies, and it peaked 246 MiB under at `c7162f4`.",
            "",
            "| model | weights | budget | prompt | decode tok/s, ours / llama.cpp | x | prefill tok/s, ours / llama.cpp | x | peak MiB (budget) | measured |",
            "| --- | --- | --- | ---: | --- | ---: | --- | ---: | --- | --- |",
        ]
        L += generation_rows(moe_gpu, lambda model: model)
        L.append("")
    if cpu:
        L += [
            "### Generation on the CPU, the default model, against llama.cpp",
            "",
            f"{mach['generate-cpu']}; `generate --cpu` with no tuning flags on the "
            "default model against llama.cpp (its Python binding, same file, same thread count) "
            "in the same run: the same chat prompts, in rounds alternating the two; ours and "
            "llama.cpp: each side's median over every prompt and round; x: the median of the "
            "pairs' ratios.",
            "",
            "| model | weights | metric | ours | llama.cpp | x | measured |",
            "| --- | --- | --- | ---: | ---: | ---: | --- |",
        ]
        for r in cpu:
            L.append(f"| {r['model']} | {r['weights']} | {r['metric'].split('_')[0]} tok/s | "
                     f"{fmt(r['ours'])} | {fmt(r['peer_value'])} | **{fmt(r['ratio'])}** | {measured(r)} |")
        L.append("")
    if moe_cpu:
        L += [
            "### A mixture of experts on the CPU, against llama.cpp",
            "",
            f"{mach['moe-cpu']}; `generate --cpu` on a random-weight Qwen3-MoE GGUF (hidden 1024, "
            "16 layers, 64 experts, top 4, expert FFN 512, vocab 32000; `scripts/gguf_random_moe.py "
            "--shape cpu-small`, in Q8_0 and requantized to Q4_K_M by llama-quantize; the Q4_K_M "
            "row is the issue's target) against llama.cpp (its "
            "Python binding, the same file, the same prompt token ids, 2 threads, prompt cache off) "
            "in the same run, rounds alternating; medians over rounds.",
            "",
            "| model | weights | metric | ours | llama.cpp | x | measured |",
            "| --- | --- | --- | ---: | ---: | ---: | --- |",
        ]
        for r in moe_cpu:
            L.append(f"| {r['model']} | {r['weights']} | {r['metric'].split('_')[0]} tok/s | "
                     f"{fmt(r['ours'])} | {fmt(r['peer_value'])} | **{fmt(r['ratio'])}** | {measured(r)} |")
        L.append("")
    if cpu_long:
        L += [
            "### Long prompts on the CPU, against llama.cpp",
            "",
            f"{mach['cpu-long']}; `generate --cpu` with no tuning flags and llama.cpp (its Python "
            "binding, the same file, the same prompt token ids, 2 threads, prompt cache off) in the "
            "same run, rounds alternating, on one prompt of a sentence repeated; 32 new tokens after "
            "it; medians over rounds.",
            "",
            "| model | weights | prompt | metric | ours | llama.cpp | x | measured |",
            "| --- | --- | ---: | --- | ---: | ---: | ---: | --- |",
        ]
        for r in cpu_long:
            L.append(f"| {r['model']} | {r['weights']} | {fmt(r['prompt_len'])} | "
                     f"{r['metric'].split('_')[0]} tok/s | {fmt(r['ours'])} | {fmt(r['peer_value'])} | "
                     f"**{fmt(r['ratio'])}** | {measured(r)} |")
        L.append("")
    if train:
        L += [
            "### Training against PyTorch",
            "",
            f"{mach['train']}; `bench_train`, {train[0]['model']}, random weights, AdamW, "
            "F32 masters with autocast to the precision named; PyTorch "
            "(`scripts/train_peer.py`, SDPA attention, autocast) in the same call. Checkpointing: "
            "none, every layer, or sqrt(layers) segments. Peak: the memory pool's high-water "
            "mark of memory in use (PyTorch: `max_memory_allocated`).",
            "",
            "| checkpointing | precision | step s, ours / PyTorch | x | peak MiB, ours / PyTorch | x | measured |",
            "| --- | --- | --- | ---: | --- | ---: | --- |",
        ]
        for (bench, w), rs in by_key(train, "benchmark", "weights").items():
            s = next((r for r in rs if r["metric"] == "step_s"), None)
            m = next((r for r in rs if r["metric"] == "peak_mib"), None)
            L.append(
                f"| {bench.split('-', 1)[1]} | {w} | "
                f"{fmt(s['ours'], 3)} / {fmt(s['peer_value'], 3)} | **{fmt(s['ratio'])}** | "
                f"{fmt(m['ours'])} / {fmt(m['peer_value'])} | {fmt(m['ratio'])} | {measured(s or m)} |"
            )
        L.append("")
    if off:
        L += [
            "Offloaded training (no peer in these calls: the weights stream from host memory "
            "under the budget, every layer checkpointed, AdamW on the host); peak: device memory "
            "in use over the CUDA context, polled:",
            "",
            "| budget | precision | step s | peak MiB (budget) | within | measured |",
            "| --- | --- | ---: | --- | --- | --- |",
        ]
        for r in off:
            L.append(f"| {budget_label(r['budget_gib'])} | {r['weights']} | {fmt(r['ours'], 3)} | "
                     f"{fmt(r['peak_mib'])} ({fmt(r['budget_mib'])}) | "
                     f"{'yes' if r['within_budget'] else '**no**'} | {measured(r)} |")
        L.append("")
    if lora or lora_off:
        L += [
            "### LoRA and QLoRA fine-tuning",
            "",
            f"{mach['lora']}; `bench_train`'s `lora-*` configurations: adapters of the rank named on "
            "q, k, v, o, gate, up and down of a frozen random base (BF16, or Q4_K blocks: "
            "QLoRA), alpha 2·rank, every layer checkpointed, AdamW on the adapters. Resident: "
            "against PEFT's LoRA on transformers (`scripts/lora_peer.py`: SDPA, gradient "
            "checkpointing, the Q4_K base against bitsandbytes' NF4) in the same call. Under a "
            "budget: against the step's ideal, the bytes streamed at the link's measured rate "
            "plus the same base's resident step in the same run; peak: device memory in use "
            "over the CUDA context, polled.",
            "",
            "| model | base | budget | step s, ours / peer | peer | x | peak MiB (budget) | measured |",
            "| --- | --- | --- | --- | --- | ---: | --- | --- |",
        ]
        for r in lora + lora_off:
            peak = peak_cell(r)
            L.append(f"| {r['model']} | {r['weights']} | {budget_label(r['budget_gib'])} | "
                     f"{fmt(r['ours'], 3)} / {fmt(r['peer_value'], 3)} | {r['peer']} | "
                     f"**{fmt(r['ratio'])}** | {peak} | {measured(r)} |")
        L.append("")
    if serve:
        L += [
            "### Serving against llama-server",
            "",
            f"{mach['serve']}; `serve` (continuous batching, 16 sequences of 640 positions) "
            "against llama-server (`--cont-batching -fa on -np 16`, the same context per slot) "
            "on the same random-weight Llama-3-8B-shaped Q4_K_M GGUF, one after the other in "
            "the same call (`scripts/serve_bench.py`): closed loop, 2 streaming requests per "
            "client, token-id prompts of 64-512 tokens (the same seeded list), 128 new tokens, "
            "EOS ignored. Under a budget llama-server's `-ngl` is the highest whose peak fits. "
            "Peak: each server process's GPU memory as nvidia-smi reports it (the CUDA context "
            "included; our budget does not count the context).",
            "",
            "| budget | concurrency | total tok/s, ours / llama-server | x | TTFT p50 s, ours / llama-server | x | peak MiB (budget) | measured |",
            "| --- | ---: | --- | ---: | --- | ---: | --- | --- |",
        ]
        for (model, b), rs in by_key(serve, "model", "budget_gib").items():
            t = next(r for r in rs if r["metric"] == "total_tokens_per_s")
            f = next(r for r in rs if r["metric"] == "ttft_p50_s")
            peak = peak_cell(t)
            L.append(f"| {budget_label(b)} | {model.split(', ')[1].split()[0]} | "
                     f"{fmt(t['ours'])} / {fmt(t['peer_value'])} | **{fmt(t['ratio'])}** | "
                     f"{fmt(f['ours'], 3)} / {fmt(f['peer_value'], 3)} | **{fmt(f['ratio'])}** | "
                     f"{peak} | {measured(t)} |")
        L.append("")
    return "\n".join(L).rstrip("\n") + "\n"


def rng(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def render_glance(rows):
    """README's compact version: the decode grid as a table, the rest in one paragraph."""
    gpu = [r for r in rows if r["benchmark"] == "generate-gpu"]
    cpu = [r for r in rows if r["benchmark"] == "generate-cpu"]
    moe_cpu = [r for r in rows if r["benchmark"] == "generate-cpu-moe"]
    moe_gpu = [r for r in rows if r["benchmark"] == "generate-gpu-moe"]
    family = [r for r in rows if r["benchmark"] == "generate-gpu-family"]
    train = [r for r in rows if r["benchmark"].startswith("train-") and r["benchmark"] != "train-offload"]
    off = [r for r in rows if r["benchmark"] == "train-offload"]
    lora = [r for r in rows if r["benchmark"] == "lora"]
    lora_off = [r for r in rows if r["benchmark"] == "lora-offload"]
    L, text = [], []
    if gpu:
        gpu_name = machines()["generate-gpu"].split(",")[0].replace("NVIDIA ", "")
        budgets = [4, 8, 12, None]
        L += [
            f"| {gpu_name}, decode: ours over llama.cpp in the same call (prompt 64 / 512) | "
            + " | ".join(budget_label(b) for b in budgets) + " |",
            "| --- |" + " --- |" * len(budgets),
        ]
        dec = {(r["model"], r["weights"], r["budget_gib"], r["prompt_len"]): r["ratio"]
               for r in gpu if r["metric"] == "decode_tokens_per_s"}
        models = []
        for size, w, _, _ in GRID_EXPECTED:
            k = (f"LLaMA {size.upper()} shape", w.upper())
            if k not in models:
                models.append(k)
        for model, w in models:
            cells = []
            for b in budgets:
                a, c = dec.get((model, w, b, 64)), dec.get((model, w, b, 512))
                cells.append("not measured" if a is None and c is None else f"{fmt(a)} / {fmt(c)}")
            L.append(f"| {model.replace('LLaMA ', '').replace(' shape', '')} {w} | " + " | ".join(cells) + " |")
        pre = [r["ratio"] for r in gpu if r["metric"] == "prefill_tokens_per_s"]
        within = [r["within_budget"] for r in gpu
                  if r["within_budget"] is not None and r["metric"] == "decode_tokens_per_s"]
        text.append(f"Prefill in the same rows: {rng(pre)}x"
                    + (f"; our peak within the budget in {sum(within)} of {len(within)} rows." if within else "."))
    if family:
        parts = []
        for model in sorted({r["model"] for r in family}):
            d = next((r for r in family if r["model"] == model and r["metric"] == "decode_tokens_per_s"), None)
            f = next((r for r in family if r["model"] == model and r["metric"] == "prefill_tokens_per_s"), None)
            if d:
                parts.append(f"{model} {d['weights']} at {budget_label(d['budget_gib'])}: decode "
                             f"{fmt(d['ratio'])}x" + (f", prefill {fmt(f['ratio'])}x" if f else ""))
        text.append("; ".join(parts) + ".")
    if moe_gpu:
        dec = [r for r in moe_gpu if r["metric"] == "decode_tokens_per_s" and r["budget_gib"] is not None]
        full = [r for r in moe_gpu if r["metric"] == "decode_tokens_per_s" and r["budget_gib"] is None]
        pre = [r["ratio"] for r in moe_gpu if r["metric"] == "prefill_tokens_per_s" and r["budget_gib"] is not None]
        text.append(
            f"Qwen3-30B-A3B ({'/'.join(sorted({r['weights'] for r in dec})) or '-'}) under 4-12 GiB against llama.cpp's "
            f"best `-ncmoe`: decode {rng([r['ratio'] for r in dec])}x, prefill {rng(pre)}x"
            + (f"; all on the GPU, decode {rng([r['ratio'] for r in full])}x" if full else "")
            + " (uniform and skewed routing; llama.cpp's side follows its host CPU: see BENCHMARKS.md).")
    if train:
        by_prec = {}
        for r in train:
            if r["metric"] == "step_s":
                by_prec.setdefault(r["weights"], []).append(r["ratio"])
        pk = [r["ratio"] for r in train if r["metric"] == "peak_mib"]
        text.append(
            f"Training ({train[0]['model']}, with and without checkpointing) against PyTorch in the "
            "same call, its step time over ours: "
            + ", ".join(f"{p.upper()} {rng(by_prec[p.upper()])}" for p in TRAIN_PRECISIONS
                        if p.upper() in by_prec)
            + f"; its peak memory over ours: {rng(pk)}"
            + ("; offloaded: " + ", ".join(
                f"{r['weights']} within {budget_label(r['budget_gib'])} at {fmt(r['ours'], 2)} s a step"
                for r in off) if off else "") + ".")
    if lora or lora_off:
        parts = [f"{r['weights']} {fmt(r['ratio'])}" + (" (its base in bitsandbytes' NF4)"
                                                        if "nf4" in r["peer"] else "")
                 for r in lora]
        within = [r["within_budget"] for r in lora_off]
        text.append(
            "LoRA (rank 16) against PEFT in the same call, its step time over ours: "
            + (", ".join(parts) or "-")
            + (f"; 7B under 4-8 GiB, the ideal step over ours {rng([r['ratio'] for r in lora_off])}, "
               f"the peak within the budget in {sum(within)} of {len(within)} rows" if lora_off else "")
            + ".")
    serve = [r for r in rows if r["benchmark"] == "serve"]
    if serve:
        def serve_part(budget):
            rs = [r for r in serve if r["budget_gib"] == budget]
            tok = [r["ratio"] for r in rs if r["metric"] == "total_tokens_per_s"]
            ttft = [r["ratio"] for r in rs if r["metric"] == "ttft_p50_s"]
            return (f"{budget_label(budget)}: total tokens/s {rng(tok)}x, time to first token "
                    f"{rng(ttft)}x")
        budgets = sorted({r["budget_gib"] for r in serve}, key=lambda b: -1 if b is None else b)
        text.append("Serving (Llama-3-8B shape, Q4_K_M) against llama-server at 1, 4 and 16 "
                    "concurrent requests: " + "; ".join(serve_part(b) for b in budgets) + ".")
    if cpu:
        d = next((r for r in cpu if r["metric"] == "decode_tokens_per_s"), None)
        f = next((r for r in cpu if r["metric"] == "prefill_tokens_per_s"), None)
        host = machines()["generate-cpu"].replace(" host", "")
        text.append(f"The default model ({cpu[0]['model']} {cpu[0]['weights']}) on a {host} CPU "
                    f"against llama.cpp in the same run: decode {fmt(d['ratio']) if d else '-'}x, "
                    f"prefill {fmt(f['ratio']) if f else '-'}x.")
    text.append("Above 1, ours is faster (or smaller). Every row with its peak, commit and raw "
                "file: [BENCHMARKS.md](BENCHMARKS.md).")
    if L:
        L.append("")
    L.append(" ".join(text))
    return "\n".join(L) + "\n"


# -- files ------------------------------------------------------------------------------------
def splice(text, begin, end, body):
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < 0 or j < i:
        return None
    return text[: i + len(begin)] + "\n" + body + text[j:]


def index_text(entries):
    """A JSON list with one entry a line (current.json's rows, the index's files)."""
    return "[\n" + ",\n".join(json.dumps(e, ensure_ascii=False) for e in entries) + "\n]\n"


def check_index(entries):
    """Every raw file has one entry, and every entry names a file of its date's folder."""
    problems = []
    on_disk = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / RESULTS).glob("*/*")
        if p.is_file() and re.fullmatch(r"\d{4}-\d{2}-\d{2}", p.parent.name)
    }
    listed = [e["path"] for e in entries]
    for p in sorted(on_disk - set(listed)):
        problems.append(f"{p}: a raw file with no entry in {INDEX}")
    for e in entries:
        if e["path"] not in on_disk:
            problems.append(f"{INDEX}: {e['path']} does not exist")
        folder = e["path"].split("/")[-2]
        if e["date"] != folder or not e["path"].split("/")[-1].startswith(folder):
            problems.append(f"{INDEX}: {e['path']}: date {e['date']} and folder disagree")
        if set(e) != {"path", "date", "kind", "what", "current"}:
            problems.append(f"{INDEX}: {e['path']}: fields {sorted(e)}")
    if len(listed) != len(set(listed)):
        problems.append(f"{INDEX}: a path is listed twice")
    return problems


def main():
    check = "--check" in sys.argv[1:]
    rows = (gpu_rows() + family_gpu_rows() + moe_gpu_rows() + train_rows() + lora_rows()
            + serve_rows() + cpu_rows() + moe_cpu_rows() + cpu_long_rows())
    sources = {r["source"] for r in rows}

    with open(ROOT / INDEX) as f:
        entries = json.load(f)
    problems = check_index(entries)
    for e in entries:
        e["current"] = e["path"] in sources
    for s in sorted(sources - {e["path"] for e in entries}):
        problems.append(f"{s}: feeds a row but has no entry in {INDEX}")

    outputs = {
        CURRENT: index_text(rows),
        INDEX: index_text(entries),
    }
    for path, body in [(BENCHMARKS, render_benchmarks(rows)), (README, render_glance(rows))]:
        text = (ROOT / path).read_text()
        new = splice(text, *MARKERS[path], body)
        if new is None:
            if path == BENCHMARKS:
                problems.append(f"{path}: no {MARKERS[path][0]} ... {MARKERS[path][1]} region")
            continue  # README.md's region is optional
        outputs[path] = new

    stale = []
    for path, body in outputs.items():
        old = (ROOT / path).read_text() if (ROOT / path).exists() else None
        if old != body:
            stale.append(path)
            if not check:
                (ROOT / path).write_text(body)
    if problems:
        print("\n".join(f"current_results: {p}" for p in problems), file=sys.stderr)
    if check:
        if stale:
            print(f"current_results: out of date with the raw results: {', '.join(stale)}; "
                  "run `python3 scripts/current_results.py` and commit what it writes",
                  file=sys.stderr)
        if stale or problems:
            sys.exit(1)
        print(f"current_results: {CURRENT} ({len(rows)} rows), {BENCHMARKS}, {INDEX}"
              + (f" and {README}'s glance" if README in outputs else "") + " agree with the raw results")
    else:
        print(f"current_results: {len(rows)} rows; wrote {', '.join(stale) or 'nothing (all up to date)'}")
        if problems:
            sys.exit(1)


if __name__ == "__main__":
    main()
