#!/usr/bin/env python3
"""PEFT peer of bench_train's `lora-*` configurations: LoRA on transformers' LlamaForCausalLM
(random weights normal(0, 0.02), the same shape flags as bench_train), SDPA attention,
gradient checkpointing around every decoder layer (use_reentrant=False, as ours checkpoints one
segment per layer), adapters of --lora-rank with alpha 2·rank on q,k,v,o,gate,up,down (B
non-zero: init_lora_weights=False), torch.optim.AdamW over the adapters only, the same batch
and sequence.

Configurations, named like ours:
  lora-{f32,bf16}        the base in that dtype (bf16: the weights stored in BF16, as ours)
  lora-q4_k-bf16         QLoRA: the base in bitsandbytes' 4-bit NF4 (compute BF16) where
                         bitsandbytes is installed; recorded as an error otherwise. NF4 is not
                         Q4_K: the peer's row says which it ran (`base`).

Per configuration, after --warmup untimed steps: step_s (median of --steps, synchronised),
peak_device_bytes (torch.cuda.max_memory_allocated over the timed steps, minus what was
allocated before the model), losses.

Usage: python3 scripts/lora_peer.py [OUT.json] [--configs lora-bf16,lora-q4_k-bf16]
       [--layers 22 --hidden 2048 ...]; OUT defaults to $OUT/lora_peer.json.
"""
import argparse
import json
import os
import statistics
import time

import torch


def run(name, a, dev):
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model

    parts = name.split("-")
    prec = parts[-1]
    quant = parts[1] if len(parts) == 3 else None
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[prec]
    cfg = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        max_position_embeddings=max(a.seq_len, 2048), rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation="sdpa", initializer_range=0.02,
    )
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_alloc = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    base_name = prec
    if quant is None:
        model = LlamaForCausalLM(cfg).to(dtype=dtype, device=dev)
    else:
        try:
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError:
            return {"config": name, "error": "bitsandbytes is not installed: no 4-bit peer"}
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
            model = LlamaForCausalLM.from_pretrained(
                d, device_map={"": dev.index or 0}, attn_implementation="sdpa",
                quantization_config=BitsAndBytesConfig(
                    load_in_4bit=True, bnb_4bit_quant_type="nf4",
                    bnb_4bit_compute_dtype=torch.bfloat16))
        base_name = "bitsandbytes nf4"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    lora = LoraConfig(
        r=a.lora_rank, lora_alpha=2 * a.lora_rank, lora_dropout=0.0, bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch_size, a.seq_len + 1), generator=g).to(dev)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    autocast = torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with autocast:
            logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses, times = [], []
    for i in range(a.warmup + a.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    peak = torch.cuda.max_memory_allocated() - base_alloc if dev.type == "cuda" else None
    return {
        "config": name, "error": None, "base": base_name, "step_s": statistics.median(times),
        "step_s_all": times, "peak_device_bytes": peak, "losses": losses,
        "trainable_parameters": sum(p.numel() for p in params),
        "batch_size": a.batch_size, "seq_len": a.seq_len,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=os.path.join(os.environ.get("OUT", "."), "lora_peer.json"))
    p.add_argument("--configs", default="lora-bf16,lora-q4_k-bf16")
    for flag, default in [("steps", 3), ("warmup", 1), ("batch-size", 4), ("seq-len", 1024),
                          ("layers", 22), ("hidden", 2048), ("heads", 32), ("kv-heads", 4),
                          ("intermediate", 5632), ("vocab", 32000), ("lora-rank", 16)]:
        p.add_argument("--" + flag, type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args()
    dev = torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda:0")
    # The shape under bench_train's names (it compares only a peer of the same shape).
    shape = dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                 num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate,
                 vocab_size=a.vocab, batch_size=a.batch_size, seq_len=a.seq_len,
                 lora_rank=a.lora_rank)
    import peft
    import transformers
    head = {"peer": "peft", "peft": peft.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
            "shape": shape, "warmup_steps": a.warmup, "timed_steps": a.steps,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results = []
    for name in a.configs.split(","):
        try:
            results.append(run(name.strip(), a, dev))
        except Exception as e:  # a configuration that fails is recorded, the others run
            results.append({"config": name.strip(), "error": f"{type(e).__name__}: {e}"})
        with open(a.out, "w") as f:
            json.dump({**head, "results": results}, f, indent=1)
        print(json.dumps(results[-1])[:300])


if __name__ == "__main__":
    main()
