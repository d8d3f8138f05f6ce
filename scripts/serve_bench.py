#!/usr/bin/env python3
"""Serving benchmark: our `serve` against llama.cpp's `llama-server` on the same GGUF, closed
loop, as the OpenAI-server issue asks. Standard library only (the GPU machine has no extras).

Each server is started in turn from its command line, waited for (/health 200), warmed up with
one request, then driven at each concurrency C: C clients each send a streaming
`/v1/completions` request (token-id prompt, `ignore_eos`, greedy, `stream_options.include_usage`)
and send their next one as soon as it finishes, until `--requests-per-client` each are done.
Prompts: lengths drawn uniformly from [--min-prompt, --max-prompt] with a fixed seed, token ids
drawn from [--id-low, --id-high) (the random GGUFs have placeholder vocabularies), the same list
for both servers. Per concurrency: total generated tokens/s over the wall time, per-request
decode tokens/s (after the first token), time to first token p50/p95, failed requests, and the
server process's peak GPU memory (nvidia-smi's per-process figure, polled every 50 ms).

Usage:
  serve_bench.py --ours "CMD ..." --peer "CMD ..." --port-ours 8081 --port-peer 8082 \\
      --concurrency 1,4,16 --budget-gib 6 --out OUT.json
Either server may be left out (then no ratios). OUT.json opens with the record header of every
benchmark file (benchmark, commit, command, machine, date; scripts/bench_record.py), `--commit`
naming the servers' build where this checkout is not it. `--peer-ngl-search 33,30,28,...` starts the peer
with each `-ngl` in turn (the command must contain `{ngl}`) and keeps the first whose peak after a
full-concurrency probe is within --budget-gib.
"""
import argparse
import http.client
import json
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time

import bench_record


def wait_ready(port, proc, timeout=600):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return time.time() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no /health 200 on port {port} after {timeout} s")


def stream_completion(port, model, prompt, new_tokens, timeout=600):
    """One streaming completion; returns (ttft_s, total_s, completion_tokens, chunks)."""
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
        "cache_prompt": False,
    })
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, chunks, usage = None, 0, None
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        if ev.get("choices"):
            chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    tokens = usage["completion_tokens"] if usage else chunks
    return ttft if ttft is not None else total, total, tokens, chunks


class GpuPeak:
    """The peak of a process's GPU memory (MiB), polled from nvidia-smi."""

    def __init__(self, pid):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()

    def _poll(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=5).stdout
                for line in out.splitlines():
                    parts = [p.strip() for p in line.split(",")]
                    if len(parts) == 2 and parts[0] == str(self.pid):
                        self.peak = max(self.peak, int(parts[1]))
            except (OSError, subprocess.SubprocessError, ValueError):
                pass
            time.sleep(0.05)

    def stop(self):
        self._stop.set()
        self._t.join()
        return self.peak


def drive(port, model, prompts, concurrency, per_client, new_tokens):
    jobs = list(prompts[: concurrency * per_client])
    lock = threading.Lock()
    results, failures = [], []

    def client():
        while True:
            with lock:
                if not jobs:
                    return
                p = jobs.pop(0)
            try:
                results.append(stream_completion(port, model, p, new_tokens))
            except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
                failures.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))] if xs else None  # noqa: E731
    per_req = [(r[2] - 1) / max(r[1] - r[0], 1e-9) for r in results if r[2] > 1]
    return {
        "concurrency": concurrency, "requests": len(results) + len(failures),
        "failed_requests": len(failures), "failures": failures[:5],
        "wall_s": wall, "generated_tokens": sum(r[2] for r in results),
        "total_tokens_per_s": sum(r[2] for r in results) / wall,
        "per_request_tokens_per_s_median": statistics.median(per_req) if per_req else None,
        "ttft_p50_s": q(ttfts, 0.5), "ttft_p95_s": q(ttfts, 0.95),
    }


def run_server(name, cmd, port, model, prompts, levels, args):
    print(f"[{name}] {cmd}", file=sys.stderr, flush=True)
    log = open(f"{args.log_prefix}{name}.log", "w")
    proc = subprocess.Popen(shlex.split(cmd), stdout=log, stderr=subprocess.STDOUT)
    peak = GpuPeak(proc.pid) if args.gpu else None
    try:
        load_s = wait_ready(port, proc)
        stream_completion(port, model, prompts[0][:16], 4)
        rows = [drive(port, model, prompts, c, args.requests_per_client, args.new_tokens) for c in levels]
    finally:
        peak_mib = peak.stop() if peak else None
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return {"command": cmd, "load_s": load_s, "rows": rows, "peak_gpu_mib": peak_mib}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours")
    ap.add_argument("--peer")
    ap.add_argument("--port-ours", type=int, default=8081)
    ap.add_argument("--port-peer", type=int, default=8082)
    ap.add_argument("--model-name", default="model")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--id-low", type=int, default=100)
    ap.add_argument("--id-high", type=int, default=30000)
    ap.add_argument("--seed", type=int, default=57)
    ap.add_argument("--budget-gib", type=float)
    ap.add_argument("--peer-ngl-search")
    ap.add_argument("--gpu", action="store_true", help="poll nvidia-smi for the peak")
    ap.add_argument("--log-prefix", default="/tmp/serve_bench-")
    ap.add_argument("--commit", help="the commit the servers were built from (default: this checkout's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    rng = random.Random(args.seed)
    n = max(levels) * args.requests_per_client
    prompts = [[rng.randrange(args.id_low, args.id_high) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(n)]
    doc = bench_record.header("serve")
    if args.commit:
        doc["commit"] = args.commit
    if args.gpu:
        doc["machine"]["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True).stdout.strip() or None
    doc.update({"prompts": {"count": n, "lengths": [len(p) for p in prompts], "seed": args.seed},
                "new_tokens": args.new_tokens, "concurrency": levels, "budget_gib": args.budget_gib})
    if args.ours:
        doc["ours"] = run_server("ours", args.ours, args.port_ours, args.model_name, prompts, levels, args)
    if args.peer:
        cmd = args.peer
        if args.peer_ngl_search:
            for ngl in args.peer_ngl_search.split(","):
                probe = run_server(f"peer-ngl{ngl}", cmd.replace("{ngl}", ngl), args.port_peer, args.model_name,
                                   prompts[: max(levels)], [max(levels)], argparse.Namespace(**{**vars(args), "requests_per_client": 1}))
                fits = probe["peak_gpu_mib"] is not None and probe["peak_gpu_mib"] <= args.budget_gib * 1024
                print(f"[peer] -ngl {ngl}: peak {probe['peak_gpu_mib']} MiB, fits {fits}", file=sys.stderr, flush=True)
                if fits:
                    cmd = cmd.replace("{ngl}", ngl)
                    doc["peer_ngl"] = int(ngl)
                    break
            else:
                raise SystemExit("no -ngl in --peer-ngl-search fits the budget")
        doc["peer"] = run_server("peer", cmd, args.port_peer, args.model_name, prompts, levels, args)
    if "ours" in doc and "peer" in doc:
        records = {}
        for o, p in zip(doc["ours"]["rows"], doc["peer"]["rows"]):
            records[str(o["concurrency"])] = {
                "total_tokens_per_s_vs_llama_server": o["total_tokens_per_s"] / p["total_tokens_per_s"],
                "ttft_p50_vs_llama_server": o["ttft_p50_s"] / p["ttft_p50_s"],
                "failed_requests": o["failed_requests"],
            }
        budget = args.budget_gib
        peak = doc["ours"]["peak_gpu_mib"]
        for r in records.values():
            r["peak_within_budget"] = None if budget is None or peak is None else peak <= budget * 1024
        doc["records"] = records
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc.get("records", {}), indent=1))


if __name__ == "__main__":
    main()
