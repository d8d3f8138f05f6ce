#!/usr/bin/env python3
"""The default model on this machine's CPU: our generate (a GGUF's quantized blocks against F32
activations, the default; the blocks against 8-bit activations as llama.cpp computes,
`--q8-activations`; and `--dequantize`) next to llama.cpp on the same file in the same run,
with the agreement checks of issue 12; also llama.cpp's answers under two other attention
configurations of its own (scripts/cpu_peer_attention.py: no flash attention, and that with an
F32 KV cache, our attention's arithmetic) and ours against those.

Usage: python3 scripts/cpu_default_bench.py GENERATE_BIN MODEL.gguf PEER_PYTHON OUT.json [PROMPT ...]
(CPU_BENCH_ROUNDS=N repeats llama.cpp's prompts and then ours N - 1 more times, default mode only.)
PEER_PYTHON is a python with the `xllamacpp` wheel (../shared/peer/llamacpp/cpu_peer.py runs
under it). Each prompt is answered greedily with 32 new tokens by each. The JSON has our and
llama.cpp's prefill and decode tokens/s, `cpu_vs_llamacpp` (our quantized decode over theirs,
per record and the median over prompts), per prompt whether our quantized 32 tokens agree with
llama.cpp's (`agrees_with_llamacpp`, the decoded texts compared exactly), and whether the
quantized and dequantized answers are identical on the three factual prompts (the first three),
with commit, command, machine and date.
"""
import json
import os
import re
import statistics
import subprocess
import sys

import bench_record

PEER = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "peer", "llamacpp", "cpu_peer.py")
PEER_ATTENTION = os.path.join(os.path.dirname(__file__), "cpu_peer_attention.py")
# llama.cpp's attention configurations besides its default (flash attention, F16 KV cache):
# name -> (flash_attn_type, KV cache type). "f32_attention" is ours: F32 cache, no flash attention.
PEER_CONFIGS = {"no_flash_f16_cache": (0, 1), "f32_attention": (0, 0)}

# Chosen once, before any result: three factual questions, then two open ones.
PROMPTS = ["What is the capital of France?",
           "What is the largest planet in the solar system?",
           "Who wrote Romeo and Juliet?",
           "How many legs does a spider have?",
           "Give me one tip for sleeping better."]
FACTUAL = 3


MODES = {"default": ("GGUF blocks, F32 activations (default)", []),
         "q8": ("GGUF blocks, 8-bit activations (--q8-activations)", ["--q8-activations"]),
         "dequantized": ("dequantized to F32 (--dequantize)", ["--dequantize"])}


def ours(binary, model, prompt, mode):
    cmd = [binary, "--cpu", "--model", model, "--prompt", prompt, "--max-new-tokens", "32",
           "--temperature", "0"] + MODES[mode][1]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"prefill: (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\); decode: (\d+) tokens at ([\d.]+) tokens/s",
                  p.stderr)
    return {"answer": p.stdout.strip(), "prefill_tokens": int(m[1]), "prefill_tokens_per_s": float(m[2]),
            "decode_tokens": int(m[3]), "decode_tokens_per_s": float(m[4]), "command": " ".join(cmd)}


def run_peer(peer_python, model, threads, prompts):
    """llama.cpp's answers and rates for every prompt, one server (cpu_peer.py)."""
    out = subprocess.run([peer_python, PEER, model, str(threads)] + prompts,
                         capture_output=True, text=True, check=True).stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def run_peer_config(peer_python, model, threads, prompts, config):
    """llama.cpp's answers under one attention configuration of PEER_CONFIGS."""
    fa, cache = PEER_CONFIGS[config]
    out = subprocess.run([peer_python, PEER_ATTENTION, model, str(threads), str(fa), str(cache)] + prompts,
                         capture_output=True, text=True, check=True).stdout
    return [json.loads(l)["answer"] for l in out.splitlines() if l.startswith("{")]


def record(prompt, mode, r, theirs, rnd=0):
    """One prompt in one mode: our run `r` next to llama.cpp's `theirs` (round `rnd` > 0 is
    marked, the first is not)."""
    rec = {"round": rnd} if rnd else {}
    rec.update({
        "prompt": prompt,
        "mode": mode,
        "weights": MODES[mode][0],
        "decode_tokens_per_s": r["decode_tokens_per_s"],
        "prefill_tokens_per_s": r["prefill_tokens_per_s"],
        "prefill_tokens": r["prefill_tokens"],
        "llamacpp_decode_tokens_per_s": theirs["decode_tokens_per_s"],
        "llamacpp_prefill_tokens_per_s": theirs["prefill_tokens_per_s"],
        "cpu_vs_llamacpp": r["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
        "prefill_vs_llamacpp": r["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"],
        "answer": r["answer"],
        "llamacpp_answer": theirs["answer"],
        "same_answer_text": r["answer"].strip() == theirs["answer"].strip(),
        "command": r["command"],
    })
    return rec


def main():
    binary, model, peer_python, out = sys.argv[1:5]
    prompts = sys.argv[5:] or PROMPTS
    threads = os.cpu_count() or 2
    load_at_start = os.getloadavg()
    peer = run_peer(peer_python, model, threads, prompts)
    others = {c: run_peer_config(peer_python, model, threads, prompts, c) for c in PEER_CONFIGS}
    records, prompts_summary = [], []
    for i, (prompt, theirs) in enumerate(zip(prompts, peer)):
        runs = {}
        for mode in MODES:
            r = ours(binary, model, prompt, mode)
            runs[mode] = r
            records.append(record(prompt, mode, r, theirs))
        prompts_summary.append({
            "prompt": prompt,
            "factual": i < FACTUAL,
            "agrees_with_llamacpp": runs["default"]["answer"].strip() == theirs["answer"].strip(),
            "q8_agrees_with_llamacpp": runs["q8"]["answer"].strip() == theirs["answer"].strip(),
            "dequantized_agrees_with_llamacpp": runs["dequantized"]["answer"].strip() == theirs["answer"].strip(),
            "quantized_equals_dequantized": runs["default"]["answer"].strip() == runs["dequantized"]["answer"].strip(),
            "answer": runs["default"]["answer"],
            "q8_answer": runs["q8"]["answer"],
            "llamacpp_answer": theirs["answer"],
        })
        # llama.cpp under its other attention configurations: its own answers, and ours against
        # them (the default mode and q8).
        for c, answers in others.items():
            a = answers[i].strip()
            prompts_summary[-1].update({
                f"llamacpp_{c}_answer": answers[i],
                f"llamacpp_{c}_equals_llamacpp": a == theirs["answer"].strip(),
                f"agrees_with_llamacpp_{c}": runs["default"]["answer"].strip() == a,
                f"q8_agrees_with_llamacpp_{c}": runs["q8"]["answer"].strip() == a,
            })
    # More rounds (CPU_BENCH_ROUNDS, default 1): llama.cpp's prompts again, then ours (the
    # default mode), so that a host whose speed drifts within the minute weighs on both sides;
    # the summary's ratios are medians over every round.
    rounds = int(os.environ.get("CPU_BENCH_ROUNDS", "1"))
    for rnd in range(1, rounds):
        peer = run_peer(peer_python, model, threads, prompts)
        for prompt, theirs in zip(prompts, peer):
            r = ours(binary, model, prompt, "default")
            records.append(record(prompt, "default", r, theirs, rnd))
    q = [r for r in records if r["mode"] == "default"]
    q8 = [r for r in records if r["mode"] == "q8"]
    doc = {**bench_record.header("cpu_default_model", cores=threads,
                                 load_average_at_start=load_at_start,
                                 load_average_at_end=os.getloadavg()),
           "rounds": rounds,
           "cpu_vs_llamacpp_per_round": [
               statistics.median(r["cpu_vs_llamacpp"] for r in q if r.get("round", 0) == rnd)
               for rnd in range(rounds)],
           "cpu_vs_llamacpp": statistics.median(r["cpu_vs_llamacpp"] for r in q),
           "prefill_vs_llamacpp": statistics.median(r["prefill_vs_llamacpp"] for r in q),
           "prompts_agreeing_with_llamacpp": sum(p["agrees_with_llamacpp"] for p in prompts_summary),
           "q8_cpu_vs_llamacpp": statistics.median(r["cpu_vs_llamacpp"] for r in q8),
           "q8_prefill_vs_llamacpp": statistics.median(r["prefill_vs_llamacpp"] for r in q8),
           "q8_prompts_agreeing_with_llamacpp": sum(p["q8_agrees_with_llamacpp"] for p in prompts_summary),
           **{f"{name}_{c}": sum(p[f"{key}_{c}"] for p in prompts_summary)
              for c in PEER_CONFIGS
              for name, key in [("prompts_agreeing_with_llamacpp", "agrees_with_llamacpp"),
                                ("q8_prompts_agreeing_with_llamacpp", "q8_agrees_with_llamacpp")]},
           **{f"llamacpp_{c}_prompts_equal_to_its_default": sum(
               p[f"llamacpp_{c}_equals_llamacpp"] for p in prompts_summary) for c in PEER_CONFIGS},
           "factual_quantized_equals_dequantized": all(
               p["quantized_equals_dequantized"] for p in prompts_summary if p["factual"]),
           "prompts": prompts_summary,
           "records": records}
    with open(out, "w") as f:
        json.dump(doc, f, indent=2, ensure_ascii=False)
    for r in records:
        print(f"{r['mode']:11} decode {r['decode_tokens_per_s']:6.1f} tok/s (llama.cpp {r['llamacpp_decode_tokens_per_s']:6.1f}), "
              f"prefill {r['prefill_tokens_per_s']:6.1f} ({r['llamacpp_prefill_tokens_per_s']:6.1f}), same answer {r['same_answer_text']}: {r['prompt']}")
    for p in prompts_summary:
        print(f"agrees with llama.cpp {p['agrees_with_llamacpp']!s:5} (q8 {p['q8_agrees_with_llamacpp']!s:5}), quantized == dequantized "
              f"{p['quantized_equals_dequantized']!s:5}: {p['prompt']} -> {p['answer'][:60]!r}")
    for c in PEER_CONFIGS:
        print(f"llama.cpp {c}: equal to its default on {doc[f'llamacpp_{c}_prompts_equal_to_its_default']} of "
              f"{len(prompts)}; ours agree on {doc[f'prompts_agreeing_with_llamacpp_{c}']} "
              f"(q8 {doc[f'q8_prompts_agreeing_with_llamacpp_{c}']})")
    print(f"cpu_vs_llamacpp (median) {doc['cpu_vs_llamacpp']:.2f}, prefill {doc['prefill_vs_llamacpp']:.2f}; "
          f"q8: {doc['q8_cpu_vs_llamacpp']:.2f}, prefill {doc['q8_prefill_vs_llamacpp']:.2f}")


if __name__ == "__main__":
    main()
