#!/usr/bin/env python3
"""Writes the mixture-of-experts test fixtures (tests/fixtures/moe_families.tar.xz): tiny random
Mixtral and Qwen3-MoE checkpoints (transformers, fixed seeds), the logits transformers computes for
them, and the F32 and Q8_0 GGUFs llama.cpp's own `convert_hf_to_gguf.py` makes of two of them.

Usage: PYTHONPATH=LLAMACPP/gguf-py python3 scripts/moe_fixtures.py LLAMACPP [OUT.tar.xz]
  LLAMACPP: the pinned llama.cpp source (its convert_hf_to_gguf.py and gguf-py).
Needs torch, transformers, sentencepiece and safetensors.

Checkpoints (each `config.json` + `model.safetensors` + `logits.f32`, the reference):
- `mixtral`: 4 experts, top 2, Mixtral's keys (`block_sparse_moe.experts.{e}.w1/w2/w3`, as
  transformers saves them); GGUFs `mixtral.{f32,q8_0}.gguf` (llama.cpp's `llama` architecture
  with `expert_count`).
- `qwen3_moe`: 4 experts, top 2, `norm_topk_prob` true (what llama.cpp assumes for `qwen3moe`),
  every layer sparse; GGUFs `qwen3_moe.{f32,q8_0}.gguf`.
- `qwen3_moe_mixed`: 3 layers, the middle one dense (`mlp_only_layers`), top 3 of 4 without
  renormalisation (`norm_topk_prob` false), and a tied head.
- `qwen2_moe`: top 2 of 4 without renormalisation (what llama.cpp assumes for `qwen2moe`),
  q/k/v biases, and the shared expert (width 48) with its sigmoid gate, every layer sparse;
  GGUFs `qwen2_moe.{f32,q8_0}.gguf`.
- `mixtral_fused`, `qwen3_moe_mixed_fused`: the same weights as `mixtral` and
  `qwen3_moe_mixed` in the layout transformers 5 holds in memory (`mlp.experts.gate_up_proj`
  (experts, 2 inter, hidden), `mlp.experts.down_proj`), saved from its state dict.

`logits.f32`: transformers' F32 logits (eager attention) of the last 8 positions of a 24-token
prompt, token i = (37 i + 11) mod 300, little-endian, row-major (8, 300).
tests/moe_families.rs checks our logits against them, our GGUF logits against our safetensors
ones, and the Q8_0 GGUFs with their expert stacks sliced per expert.
"""
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_fixtures import tokenizer, VOCAB  # noqa: E402

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2, pad_token_id=None)

# name -> (config class, model class, keyword arguments over COMMON, make GGUFs)
CHECKPOINTS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0,
                     sliding_window=None, tie_word_embeddings=False), True),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=True, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False), True),
    "qwen3_moe_mixed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1], head_dim=16,
                             rope_theta=1000000.0, tie_word_embeddings=True), False),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=False, shared_expert_intermediate_size=48, rope_theta=1000000.0,
                       tie_word_embeddings=False), True),
}
FUSED = {"mixtral_fused": "mixtral", "qwen3_moe_mixed_fused": "qwen3_moe_mixed"}
# llama.cpp's converter, with Qwen3-MoE and Qwen2-MoE reading the SentencePiece `tokenizer.model` as its dense
# Qwen3 does (its MoE converter only reads a GPT-2 style tokenizer.json).
CONVERT = """
import runpy, sys
llamacpp = sys.argv.pop(1)
sys.path.insert(0, llamacpp)
import conversion.qwen as q
q.Qwen3MoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
q.Qwen2MoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
sys.argv[0] = llamacpp + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""
PROMPT = [(i * 37 + 11) % VOCAB for i in range(24)]


def build(name):
    cfg_cls, model_cls, kw, _ = CHECKPOINTS[name]
    args = dict(COMMON)
    args.update(kw)
    cfg = getattr(transformers, cfg_cls)(**args, attn_implementation="eager")
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * (torch.rand_like(p) - 0.5))
            elif "gate.weight" in pname:
                # Routers spread enough that tokens choose different experts.
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def reference(model, d):
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -8:].float().contiguous()
    logits.numpy().astype("<f4").tofile(os.path.join(d, "logits.f32"))


def main(llamacpp, out):
    work = tempfile.mkdtemp()
    tok = tokenizer(work)
    root = os.path.join(work, "moe_families")
    models = {}
    for name, (_, _, _, gguf) in CHECKPOINTS.items():
        d = os.path.join(root, name)
        model = build(name)
        models[name] = model
        model.save_pretrained(d, safe_serialization=True)
        reference(model, d)
        if gguf:
            shutil.copy(tok, os.path.join(d, "tokenizer.model"))
            for outtype in ("f32", "q8_0"):
                path = os.path.join(root, f"{name}.{outtype}.gguf")
                subprocess.run([sys.executable, "-c", CONVERT, llamacpp, d, "--outtype", outtype, "--outfile", path],
                               check=True, stdout=subprocess.DEVNULL)
        for f in os.listdir(d):
            if f not in ("config.json", "model.safetensors", "logits.f32"):
                os.remove(os.path.join(d, f))
        print(f"{name}: done", flush=True)
    for fused, src in FUSED.items():
        d = os.path.join(root, fused)
        os.makedirs(d)
        state = {k: v.contiguous() for k, v in models[src].state_dict().items()}
        if models[src].config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        assert any(k.endswith("experts.gate_up_proj") for k in state), sorted(state)[:8]
        save_file(state, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        for f in ("config.json", "logits.f32"):
            shutil.copy(os.path.join(root, src, f), os.path.join(d, f))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=9) as tar:
        for name in sorted(os.listdir(root)):
            tar.add(os.path.join(root, name), arcname=name, filter=lambda t: (setattr(t, "mtime", 0), t)[1])
    with open(out, "wb") as f:
        f.write(buf.getvalue())
    print(f"wrote {out} ({len(buf.getvalue())} bytes)")
    shutil.rmtree(work)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "tests/fixtures/moe_families.tar.xz"))
