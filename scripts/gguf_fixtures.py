#!/usr/bin/env python3
"""Writes the GGUF-against-safetensors fixtures: for every family the GGUF loader supports, a tiny
random-weight HF checkpoint (transformers, fixed seed) and the F32 and Q8_0 GGUFs that llama.cpp's
own `convert_hf_to_gguf.py` makes of it, packed as tests/fixtures/gguf_families.tar.xz.

Usage: PYTHONPATH=LLAMACPP/gguf-py python3 scripts/gguf_fixtures.py LLAMACPP [OUT.tar.xz]
  LLAMACPP: the pinned llama.cpp source (its convert_hf_to_gguf.py and gguf-py).
Needs torch, transformers, sentencepiece and safetensors.

The converter needs a tokenizer it recognises in each checkpoint: a SentencePiece model of 300
pieces trained here (every family's converter takes a `tokenizer.model` and writes it as a
`llama` vocabulary), so that the vocabulary, and the fixtures, stay small. The configurations
are ones a GGUF file can represent (what the converter does not store is what llama.cpp
assumes): Gemma 2 and 3 with `query_pre_attn_scalar` = head_dim, Gemma 3 with the default layer
pattern (every 6th layer global), Phi-3 and Mistral without sliding windows (llama.cpp has
none for them). Every weight, norms and biases included, is drawn at random.

tests/gguf_families.rs loads each and checks that our logits from the F32 GGUF equal our logits
from the safetensors, and that the Q8_0 GGUF runs generation with its blocks kept.
"""
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import sentencepiece as spm
import torch
import transformers

VOCAB = 300

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, pad_token_id=None)

# name -> (config class, model class, keyword arguments over COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(tie_word_embeddings=True, rope_theta=100000.0, sliding_window=None, num_key_value_heads=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(tie_word_embeddings=True, rope_theta=1000000.0, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(tie_word_embeddings=False, rope_theta=10000.0, partial_rotary_factor=0.5, sliding_window=None,
                  original_max_position_embeddings=256)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(head_dim=16, num_key_value_heads=1, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
                    attn_logit_softcapping=10.0, final_logit_softcapping=8.0, sliding_window=8, rope_theta=10000.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=16, num_hidden_layers=7, hidden_activation="gelu_pytorch_tanh",
                    sliding_window=8, tie_word_embeddings=True,
                    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                                     "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)})),
}


def tokenizer(dir_):
    """A 300-piece SentencePiece model trained on a fixed text."""
    words = ("the quick brown fox jumps over the lazy dog while seven wizards quietly hex "
             "jumbled boxes of zinc and copper near a frozen lake in the north").split()
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]
    lines += ["0123456789 (){}[];:.,!? +-*/=<>" for _ in range(20)]
    corpus = os.path.join(dir_, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("\n".join(lines))
    prefix = os.path.join(dir_, "tok")
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=VOCAB, model_type="bpe",
                                   byte_fallback=False, character_coverage=1.0, num_threads=1,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return prefix + ".model"


def build(name):
    cfg_cls, model_cls, kw = FAMILIES[name]
    args = dict(COMMON)
    args.update(kw)
    cfg = getattr(transformers, cfg_cls)(**args, attn_implementation="eager")
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, model_cls)(cfg).float().eval()
    gemma = "Gemma" in model_cls
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                # Gemma applies 1 + w (the converter stores 1 + w), the others w.
                p.copy_((0.0 if gemma else 1.0) + 0.2 * (torch.rand_like(p) - 0.5))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def main(llamacpp, out):
    work = tempfile.mkdtemp()
    tok = tokenizer(work)
    root = os.path.join(work, "gguf_families")
    for name in FAMILIES:
        d = os.path.join(root, name)
        build(name).save_pretrained(d, safe_serialization=True)
        shutil.copy(tok, os.path.join(d, "tokenizer.model"))
        for outtype in ("f32", "q8_0"):
            gguf = os.path.join(root, f"{name}.{outtype}.gguf")
            subprocess.run([sys.executable, os.path.join(llamacpp, "convert_hf_to_gguf.py"), d, "--outtype",
                            outtype, "--outfile", gguf], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        os.remove(os.path.join(d, "tokenizer.model"))
        for f in os.listdir(d):
            if f not in ("config.json", "model.safetensors"):
                os.remove(os.path.join(d, f))
        print(f"{name}: {os.path.getsize(gguf)} bytes of GGUF", flush=True)
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
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "tests/fixtures/gguf_families.tar.xz"))
