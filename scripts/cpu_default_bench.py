#!/usr/bin/env python3
"""The default model on this machine's CPU: our generate (GGUF quantized blocks with
--quantized, and dequantized) next to llama.cpp on the same file in the same run.

Usage: python3 scripts/cpu_default_bench.py GENERATE_BIN MODEL.gguf PEER_PYTHON OUT.json [PROMPT ...]
PEER_PYTHON is a python with the `xllamacpp` wheel (../shared/peer/llamacpp/cpu_peer.py runs
under it). Each prompt is answered greedily with 32 new tokens by each; the JSON has our and
llama.cpp's prefill and decode tokens/s, `cpu_vs_llamacpp` (our decode over theirs) and the
answers, with commit, command, machine and date.
"""
import datetime
import json
import os
import re
import subprocess
import sys

PEER = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "peer", "llamacpp", "cpu_peer.py")


def ours(binary, model, prompt, quantized):
    cmd = [binary, "--cpu", "--model", model, "--prompt", prompt, "--max-new-tokens", "32",
           "--temperature", "0"] + (["--quantized"] if quantized else [])
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"prefill: (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\); decode: (\d+) tokens at ([\d.]+) tokens/s",
                  p.stderr)
    return {"answer": p.stdout.strip(), "prefill_tokens": int(m[1]), "prefill_tokens_per_s": float(m[2]),
            "decode_tokens": int(m[3]), "decode_tokens_per_s": float(m[4]), "command": " ".join(cmd)}


def main():
    binary, model, peer_python, out = sys.argv[1:5]
    prompts = sys.argv[5:] or ["What is the capital of France?",
                               "What is the largest planet in the solar system?",
                               "Who wrote Romeo and Juliet?"]
    threads = os.cpu_count() or 2
    peer_out = subprocess.run([peer_python, PEER, model, str(threads)] + prompts,
                              capture_output=True, text=True, check=True).stdout
    peer = [json.loads(l) for l in peer_out.splitlines() if l.startswith("{")]
    records = []
    for prompt, theirs in zip(prompts, peer):
        for quantized in (True, False):
            r = ours(binary, model, prompt, quantized)
            records.append({
                "prompt": prompt,
                "weights": "Q4_1 blocks (QMatMul)" if quantized else "dequantized to F32",
                "decode_tokens_per_s": r["decode_tokens_per_s"],
                "prefill_tokens_per_s": r["prefill_tokens_per_s"],
                "llamacpp_decode_tokens_per_s": theirs["decode_tokens_per_s"],
                "llamacpp_prefill_tokens_per_s": theirs["prefill_tokens_per_s"],
                "cpu_vs_llamacpp": r["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
                "answer": r["answer"],
                "llamacpp_answer": theirs["answer"],
                "same_answer_text": r["answer"].strip() == theirs["answer"].strip(),
                "command": r["command"],
            })
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    doc = {"benchmark": "cpu_default_model", "commit": commit, "command": " ".join(sys.argv),
           "machine": {"cpu": cpu, "cores": threads, "gpu": None},
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "records": records}
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
    for r in records:
        print(f"{r['weights']:22} decode {r['decode_tokens_per_s']:6.1f} tok/s (llama.cpp {r['llamacpp_decode_tokens_per_s']:6.1f}), "
              f"prefill {r['prefill_tokens_per_s']:6.1f} ({r['llamacpp_prefill_tokens_per_s']:6.1f}), same answer {r['same_answer_text']}: {r['prompt']}")


if __name__ == "__main__":
    main()
