#!/usr/bin/env python3
"""The peer for the generation benchmark: HF transformers + accelerate big-model inference
(device_map with max_memory, CPU offload), on the same checkpoint and budgets as ours.
Adapted from the project's shared/peer/accelerate_baseline.py: the same dispatch and timing,
but reading the checkpoint that our benchmark reads, for several prompt lengths.

Usage: python3 scripts/accelerate_peer.py MODEL_DIR BUDGETS PROMPT_LENS NEW_TOKENS OUT.json [CPU_GIB OFFLOAD_DIR]
  BUDGETS: comma-separated GiB or "full"; PROMPT_LENS: comma-separated token counts.
  CPU_GIB, OFFLOAD_DIR: accelerate's disk offload: at most CPU_GIB of weights in host memory
  (max_memory "cpu"), the rest written to OFFLOAD_DIR and read back from it in every forward.
  DROP_CACHES=1 drops the page cache after those files are written (root only), so that the
  prefill reads them cold; later tokens find them in the page cache where RAM allows.
  DROP_CACHES=each drops it before every decode step as well (outside the timed step): what a
  host whose RAM cannot also hold the offload folder sees, on a machine whose RAM can.
"""
import json
import os
import sys
import time

import torch
from accelerate import dispatch_model, infer_auto_device_map
from transformers import AutoConfig, LlamaForCausalLM

model_dir, budgets, prompt_lens = sys.argv[1], sys.argv[2].split(","), [int(x) for x in sys.argv[3].split(",")]
new_tokens, out_path = int(sys.argv[4]), sys.argv[5]
cpu_gib = sys.argv[6] if len(sys.argv) > 6 else "400"
offload_dir = sys.argv[7] if len(sys.argv) > 7 else None

torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(model_dir)
base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float16).eval()
state = {k: v.detach() for k, v in base.state_dict().items()}
buffers = {k: v.detach() for k, v in base.named_buffers()}
del base


def run(budget, prompt_len):
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg).to(torch.float16).eval()
    m.load_state_dict(state, assign=True)
    for k, v in buffers.items():
        mod, _, name = k.rpartition(".")
        m.get_submodule(mod)._buffers[name] = v.clone()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if budget == "full":
        m = m.to("cuda"); offloaded = 0; on_disk = 0
    else:
        dm = infer_auto_device_map(m, max_memory={0: f"{budget}GiB", "cpu": f"{cpu_gib}GiB"},
                                   no_split_module_classes=["LlamaDecoderLayer"], dtype=torch.float16)
        offloaded = sum(1 for v in dm.values() if v in ("cpu", "disk"))
        on_disk = sum(1 for v in dm.values() if v == "disk")
        m = dispatch_model(m, device_map=dm, main_device=0, offload_dir=offload_dir)
        if offload_dir and os.environ.get("DROP_CACHES") in ("1", "each"):
            # Cold start for the files dispatch_model just wrote (needs root; kept otherwise).
            os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
    gen = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=gen).to("cuda")
    with torch.no_grad():
        torch.cuda.synchronize(); t0 = time.perf_counter()
        out = m(ids, use_cache=True)
        torch.cuda.synchronize(); prefill = time.perf_counter() - t0
        pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(new_tokens):
            if offload_dir and on_disk and os.environ.get("DROP_CACHES") == "each":
                os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
            t0 = time.perf_counter()
            out = m(nxt, past_key_values=pkv, use_cache=True)
            torch.cuda.synchronize(); steps.append(time.perf_counter() - t0)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    steps.sort()
    r = dict(budget=budget, prompt_len=prompt_len, offloaded_modules=offloaded,
             disk_modules=on_disk, cpu_gib=cpu_gib, prefill_s=prefill,
             page_cache_dropped=os.environ.get("DROP_CACHES", "no") if offload_dir else "no",
             decode_s_median=steps[len(steps) // 2], decode_tokens_per_s=1 / steps[len(steps) // 2],
             peak_gpu_bytes_torch=torch.cuda.max_memory_allocated())
    print(json.dumps(r), flush=True)
    del m
    torch.cuda.empty_cache()
    return r


results = [run(b, p) for p in prompt_lens for b in budgets]
json.dump({"peer": "transformers + accelerate CPU offload", "torch": torch.__version__,
           "command": " ".join(sys.argv), "results": results}, open(out_path, "w"), indent=1)
