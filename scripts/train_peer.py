#!/usr/bin/env python3
"""PyTorch peer of bench/src/bin/bench_train.rs: the same 1B-shaped LLaMA, batch, sequence and
AdamW, in the same nine configurations:

    precision     {f32, f16 (torch.autocast + torch.amp.GradScaler), bf16 (torch.autocast)}
  x checkpointing {none,
                   layer: torch.utils.checkpoint.checkpoint around every decoder layer
                          (what transformers' gradient_checkpointing_enable does),
                   sqrt:  torch.utils.checkpoint.checkpoint_sequential over the decoder layers
                          with round(sqrt(L)) segments}
  named like ours: none-f32, layer-f32, sqrt-f32, none-f16, ...

The model is a minimal LLaMA written here in plain PyTorch (not transformers' LlamaForCausalLM)
so that checkpoint_sequential applies to the decoder layers directly: embedding, then per
layer RMSNorm -> q/k/v projections -> rotary embedding -> F.scaled_dot_product_attention
(is_causal=True, enable_gqa=True) -> o projection -> residual, RMSNorm -> SiLU-gated MLP ->
residual; final RMSNorm, an untied output head, and the cross-entropy in F32. Weights
normal(0, 0.02), norms one, as ours. Both sides use checkpoint with use_reentrant=False.
Note: checkpoint_sequential does not checkpoint its last segment (PyTorch's design); ours
checkpoints every segment.

Per configuration, after `--warmup` untimed steps (which also create the AdamW state):
  step_s               median wall time of `--steps` timed steps, synchronised after each
  peak_device_bytes    torch.cuda.max_memory_allocated over the timed steps, minus the bytes
                       allocated before the model was built
  static_bytes         allocated after the warm-up with gradients freed: weights + AdamW state
  grad_bytes           4 bytes per parameter (F32 gradients)
  activation_bytes     peak_device_bytes - static_bytes - grad_bytes
  peak_reserved_bytes  torch.cuda.max_memory_reserved, same baseline (the caching allocator)
  fwd_bwd_peak_bytes   max_memory_allocated over one extra forward + backward pass without an
                       optimizer step (same baseline); fwd_bwd_extra_bytes = that - static_bytes:
                       activations and the gradients present then, without the optimizer's
                       temporaries (foreach AdamW allocates about one parameter-sized copy)
  device_peak_bytes    device-level peak: torch.cuda.mem_get_info polled every ~1 ms from a
                       thread during the timed steps, minus the device's used bytes before
                       the model was built (comparable to ours, which is measured the same way)

Usage: python3 scripts/train_peer.py [OUT.json] [--configs none-f32,...] [--steps 3]
       [--layers 22 --hidden 2048 ...]. OUT defaults to $OUT/train_peer.json, else
       ./train_peer.json. The file is rewritten after every configuration.
"""
import argparse
import gc
import json
import math
import os
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

CONFIGS = [f"{c}-{p}" for p in ("f32", "f16", "bf16") for c in ("none", "layer", "sqrt")]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        h, i = a.hidden, a.intermediate
        self.nh, self.nkv, self.hd = a.heads, a.kv_heads, a.hidden // a.heads
        self.input_layernorm = RMSNorm(h, 1e-5)
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, 1e-5)
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        # Rotary tables, set by the model (plain attributes: neither parameters nor buffers).
        self.cos = self.sin = None

    def forward(self, x):
        b, t, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
        cos, sin = self.cos[:t].to(q.dtype), self.sin[:t].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, self.nh * self.hd))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Llama(nn.Module):
    def __init__(self, a, max_len):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, 1e-5)
        self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
        hd = a.hidden // a.heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        f = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            layer.cos, layer.sin = cos, sin
        self.mode, self.segments = "none", 0

    def forward(self, ids, targets):
        x = self.embed_tokens(ids)
        if self.mode == "none":
            for layer in self.layers:
                x = layer(x)
        elif self.mode == "layer":
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
        else:
            x = checkpoint_sequential(self.layers, self.segments, x, use_reentrant=False)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class DeviceSampler:
    """Polls torch.cuda.mem_get_info on a thread; keeps the largest used bytes."""

    def __init__(self):
        self.peak, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(0.001)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def device_used():
    free, total = torch.cuda.mem_get_info()
    return total - free


def run(name, a):
    ckpt, prec = name.split("-")
    rec = dict(config=name, precision=prec, checkpointing={"layer": "per-layer"}.get(ckpt, ckpt))
    model = opt = None
    try:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base_alloc, base_dev = torch.cuda.memory_allocated(), device_used()
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.device("cuda"):
            model = Llama(a, a.seq_len)
        segments = {"none": 0, "layer": a.layers, "sqrt": max(1, round(math.sqrt(a.layers)))}[ckpt]
        model.mode, model.segments = ckpt, segments
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        scaler = torch.amp.GradScaler("cuda") if prec == "f16" else None
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16}.get(prec)
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(0, a.vocab, (a.batch_size, a.seq_len + 1), device="cuda", generator=g)
        inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        params = sum(p.numel() for p in model.parameters())
        torch.cuda.synchronize()
        build_s = time.perf_counter() - t0

        skipped = [0]

        def step():
            if dtype is None:
                loss = model(inputs, targets)
            else:
                with torch.autocast("cuda", dtype=dtype):
                    loss = model(inputs, targets)
            if scaler is not None:
                scaler.scale(loss).backward()
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                if scaler.get_scale() < before:
                    skipped[0] += 1
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return loss.item()

        losses = [step() for _ in range(a.warmup)]
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated() - base_alloc
        torch.cuda.reset_peak_memory_stats()
        times = []
        with DeviceSampler() as sampler:
            for _ in range(a.steps):
                t0 = time.perf_counter()
                losses.append(step())
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base_alloc
        grads = 4 * params
        # Forward and backward alone (no optimizer step): without the optimizer's temporaries.
        torch.cuda.reset_peak_memory_stats()
        if dtype is None:
            loss = model(inputs, targets)
        else:
            with torch.autocast("cuda", dtype=dtype):
                loss = model(inputs, targets)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        del loss
        torch.cuda.synchronize()
        fwd_bwd_peak = torch.cuda.max_memory_allocated() - base_alloc
        opt.zero_grad(set_to_none=True)
        rec.update(
            checkpoint_segments=segments,
            parameters=params,
            build_s=round(build_s, 3),
            step_s=sorted(times)[len(times) // 2],
            step_s_all=times,
            tokens_per_s=a.batch_size * a.seq_len / sorted(times)[len(times) // 2],
            peak_device_bytes=peak,
            static_bytes=static,
            grad_bytes=grads,
            activation_bytes=peak - static - grads,
            fwd_bwd_peak_bytes=fwd_bwd_peak,
            fwd_bwd_extra_bytes=fwd_bwd_peak - static,
            peak_reserved_bytes=torch.cuda.max_memory_reserved() - base_alloc,
            device_peak_bytes=max(0, sampler.peak - base_dev),
            losses=losses,
            final_loss=losses[-1],
            skipped_steps=skipped[0],
            loss_scale=scaler.get_scale() if scaler is not None else 1.0,
            error=None,
        )
    except Exception as e:  # OOM and the like: record, go on with the next configuration
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=os.path.join(os.environ.get("OUT", "."), "train_peer.json"))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--lr", type=float, default=1e-5)
    a = p.parse_args()
    names = [c.strip() for c in a.configs.split(",") if c.strip()]
    for n in names:
        if n not in CONFIGS:
            sys.exit(f"train_peer.py: --configs: unknown configuration {n!r} (known: {', '.join(CONFIGS)})")
    if a.steps < 1 or a.warmup < 1:
        sys.exit("train_peer.py: --steps and --warmup must be at least 1 (the warm-up creates the AdamW state)")
    if not torch.cuda.is_available():
        sys.exit("train_peer.py: needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # F32 means F32, as in candle
    torch.backends.cudnn.allow_tf32 = False
    doc = dict(
        peer="pytorch",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(0),
        shape=dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                   num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate,
                   vocab_size=a.vocab, batch_size=a.batch_size, seq_len=a.seq_len),
        optimizer=f"torch.optim.AdamW lr {a.lr} (defaults otherwise: weight decay 0.01, foreach)",
        model="minimal LLaMA in plain PyTorch, F.scaled_dot_product_attention(is_causal=True)",
        warmup_steps=a.warmup,
        timed_steps=a.steps,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        results=[],
    )
    for n in names:
        t0 = time.perf_counter()
        r = run(n, a)
        doc["results"].append(r)
        print(json.dumps({k: r.get(k) for k in ("config", "step_s", "peak_device_bytes",
                                                 "activation_bytes", "device_peak_bytes",
                                                 "final_loss", "error")}),
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
