#!/usr/bin/env python3
"""Write a random-weight F16 GGUF of a Qwen3 or Gemma 3 (text) shape, laid out as llama.cpp's
convert_hf_to_gguf.py writes that architecture: the same tensor names, shapes and types (2-D
weights F16, norms F32), the same metadata keys, and a synthetic vocabulary of the real size and
kind (`gpt2` byte-level BPE with merges and the `qwen2` pre-tokenizer for qwen3; `llama`
SentencePiece with byte tokens for gemma3). For throughput runs and llama.cpp's loader; the
logits mean nothing.

Usage: PYTHONPATH=LLAMACPP/gguf-py gguf_random_family.py OUT.gguf ARCH [--tiny] [SHAPE...]
  ARCH: qwen3 (Qwen3-8B shape by default) or gemma3 (Gemma-3-12B text shape by default)
  --tiny: a small shape of the same architecture (2 layers for qwen3; 6 for gemma3: 5 local and
  1 global), for tests
  SHAPE: --layers N --hidden N --intermediate N --heads N --kv-heads N --head-dim N --vocab N
  --context N --sliding-window N --rope-theta X --rope-local-theta X --rope-scale X (gemma3's
  linear scaling of the global layers' RoPE; 0: none) --seed N

What the converter writes and this does too:
- qwen3: untied `output.weight`; `qwen3.attention.key_length`/`value_length` from head_dim;
  per-head `attn_q_norm`/`attn_k_norm`; added tokens after the BPE vocabulary, `[PADn]` (unused)
  up to the config's vocab_size; add_bos_token false.
- gemma3: no `output.weight` (tied); norms with Gemma's `+1` folded in (so near 1.0);
  `post_attention_norm` and `post_ffw_norm`; `gemma3.attention.sliding_window`,
  `gemma3.rope.freq_base` (global) and `gemma3.rope.freq_base_swa` (local), the global layers'
  linear RoPE scaling when the config has one (Gemma-3-12B: factor 8); no
  query_pre_attn_scalar and no layer pattern (llama.cpp assumes head_dim and 5 local : 1
  global); the SentencePiece pieces, `[PADn]` up to the config's vocab_size (262208 for
  262144 pieces); add_bos_token true, add_space_prefix false.

The weights come from one pool of random F16 values (std 0.02) that every tensor reads from at
its own offset, written straight to the file: an 8B model's 16 GB take about as long as the
disk does.
"""
import argparse
import sys

import numpy as np
import gguf

SHAPES = {
    # Qwen3-8B: config.json of Qwen/Qwen3-8B.
    "qwen3": dict(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                  vocab=151936, context=40960, rope_theta=1e6, eps=1e-6),
    # Gemma-3-12B's text_config.
    "gemma3": dict(layers=48, hidden=3840, intermediate=15360, heads=16, kv_heads=8, head_dim=256,
                   vocab=262208, context=131072, rope_theta=1e6, rope_local_theta=1e4,
                   rope_scale=8.0, sliding_window=1024, eps=1e-6),
}
TINY = {
    "qwen3": dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                  vocab=2048, context=4096),
    "gemma3": dict(layers=6, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                   vocab=2048, context=4096, sliding_window=32),
}
NAMES = {"qwen3": "Qwen3 8B (random weights)", "gemma3": "Gemma 3 12B (random weights)"}

# Qwen3's added tokens (ids from 151643 in the real vocabulary: right after the BPE ones); the
# `<|...|>` ones are special (control), the others user-defined, as in its tokenizer.json.
QWEN3_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
# The real Qwen3 vocabulary: 151643 BPE tokens, 26 added, 267 `[PADn]` up to 151936.
QWEN3_PADS = 151936 - 151643 - len(QWEN3_ADDED)
# The real Gemma 3 vocabulary: 262144 pieces, 64 `[PADn]` up to 262208.
GEMMA3_PADS = 262208 - 262144

QWEN3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def bytes_to_unicode():
    """GPT-2's byte-to-character table (the symbols byte-level BPE vocabularies are written in):
    the characters in the order Qwen's vocabulary starts with, and each byte's character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs], {b: chr(c) for b, c in zip(bs, cs)}


def grow_pieces(rng, base, count, max_len):
    """`base` then random concatenations of two earlier pieces (each new, at most `max_len`
    characters) up to `count` pieces; returns the pieces and, for each merged one, its two
    parts. Short pieces are drawn more often, as in a trained vocabulary."""
    pieces = list(base)
    seen = set(pieces)
    parts = []
    # Draw indices in batches: a mix of the first pieces and any piece so far.
    while len(pieces) < count:
        n = len(pieces)
        a = rng.integers(0, n, 4096)
        b = np.minimum(rng.integers(0, n, 4096), rng.integers(0, min(n, 4 * len(base)), 4096))
        for i, j in zip(a.tolist(), b.tolist()):
            s = pieces[i] + pieces[j]
            if len(s) > max_len or s in seen:
                continue
            seen.add(s)
            pieces.append(s)
            parts.append((pieces[i], pieces[j]))
            if len(pieces) == count:
                break
    return pieces, parts


def vocab_qwen3(w, rng, vocab):
    n_bpe = vocab - len(QWEN3_ADDED) - QWEN3_PADS
    if n_bpe < 512:
        sys.exit(f"--vocab {vocab}: qwen3 needs at least {512 + len(QWEN3_ADDED) + QWEN3_PADS}")
    # The 256 byte symbols, then " t"-style pieces, then random merges of those.
    sym, of_byte = bytes_to_unicode()
    space = of_byte[ord(" ")]
    base = sym + [space + c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    merges = [f"{space} {c}" for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    pieces, parts = grow_pieces(rng, base, n_bpe, 12)
    merges += [f"{a} {b}" for a, b in parts]
    tokens = pieces + QWEN3_ADDED + [f"[PAD{i}]" for i in range(n_bpe + len(QWEN3_ADDED), vocab)]
    types = [gguf.TokenType.NORMAL] * n_bpe
    types += [gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.USER_DEFINED
              for t in QWEN3_ADDED]
    types += [gguf.TokenType.UNUSED] * (vocab - len(types))
    eot = n_bpe  # <|endoftext|>
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eot + 2)  # <|im_end|>
    w.add_pad_token_id(eot)
    w.add_bos_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(QWEN3_TEMPLATE)


def vocab_gemma3(w, rng, vocab):
    n_real = vocab - GEMMA3_PADS
    if n_real < 1024:
        sys.exit(f"--vocab {vocab}: gemma3 needs at least {1024 + GEMMA3_PADS}")
    # Gemma 3's special ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4, ...,
    # <start_of_turn> 105, <end_of_turn> 106; then the 256 byte tokens.
    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    special += [f"<unused{i}>" for i in range(105 - len(special))]
    special += ["<start_of_turn>", "<end_of_turn>"]
    ctypes = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL]
    ctypes += [gguf.TokenType.UNUSED] * (105 - 5) + [gguf.TokenType.CONTROL] * 2
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    sp = "\u2581"
    chars = [chr(c) for c in range(0x21, 0x7F)] + list("éèàüöäçñßø") + list("的一是不了人我在有他")
    base = [sp] + chars + [sp + c for c in chars[:94]] + ["\n", "\n\n", sp * 2, sp * 4]
    n_pieces = n_real - len(special) - len(byte_tokens)
    pieces, _ = grow_pieces(rng, base, n_pieces, 16)
    tokens = special + byte_tokens + pieces + [f"[PAD{i}]" for i in range(n_real, vocab)]
    # SentencePiece BPE scores: earlier pieces merge first (llama.cpp's SPM merges by score).
    scores = [0.0] * (len(special) + len(byte_tokens)) + [-float(i) for i in range(n_pieces)]
    scores += [-10000.0] * (vocab - n_real)
    types = ctypes + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * n_pieces
    types += [gguf.TokenType.UNUSED] * (vocab - n_real)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(GEMMA3_TEMPLATE)
    w.add_add_space_prefix(False)


class PoolTensor:
    """An F16 tensor of `shape` whose values are the pool's from `offset` on (wrapping): what
    GGUFWriter needs of a tensor (shape, dtype, nbytes, tofile) without holding it."""

    def __init__(self, pool, shape, offset):
        self.pool, self.shape, self.offset = pool, tuple(shape), offset
        self.dtype = pool.dtype
        self.nbytes = int(np.prod(self.shape)) * pool.itemsize

    def tofile(self, fout):
        n = self.nbytes // self.pool.itemsize
        pos = self.offset
        while n > 0:
            k = min(n, len(self.pool) - pos)
            fout.write(memoryview(self.pool[pos:pos + k]).cast("B"))
            n -= k
            pos = 0

    def byteswap(self, inplace=False):
        raise NotImplementedError("PoolTensor is written in the host's byte order only")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("arch", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true")
    for k in ("layers", "hidden", "intermediate", "heads", "kv-heads", "head-dim", "vocab",
              "context", "sliding-window", "seed"):
        p.add_argument(f"--{k}", type=int)
    for k in ("rope-theta", "rope-local-theta", "rope-scale"):
        p.add_argument(f"--{k}", type=float)
    a = p.parse_args(argv)
    s = dict(SHAPES[a.arch])
    if a.tiny:
        s.update(TINY[a.arch])
    for k, v in vars(a).items():
        if k not in ("out", "arch", "tiny", "seed") and v is not None:
            if a.arch == "qwen3" and k in ("sliding_window", "rope_local_theta", "rope_scale"):
                p.error(f"--{k.replace('_', '-')}: qwen3 has none")
            s[k] = v
    return a.out, a.arch, s, a.seed or 0


def main(argv):
    out, arch, s, seed = parse_args(argv)
    L, h, ff = s["layers"], s["hidden"], s["intermediate"]
    heads, kv, hd, vocab = s["heads"], s["kv_heads"], s["head_dim"], s["vocab"]
    rng = np.random.default_rng(seed)
    # 64 Mi values (128 MiB): far more than a row, so rows differ; each tensor starts elsewhere.
    pool_len = min(1 << 26, max(1 << 20, vocab * h))
    pool = (rng.standard_normal(pool_len, dtype=np.float32) * 0.02).astype(np.float16)
    step = 7_919_993 % pool_len or 1
    count = [0]

    def rand(*shape):
        count[0] += 1
        return PoolTensor(pool, shape, (count[0] * step) % pool_len)

    def norm(n):  # near 1 (Gemma's `1 + w` already folded in, as the converter writes it)
        return (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)

    w = gguf.GGUFWriter(out, arch)
    w.add_type(gguf.GGUFType.MODEL)
    custom = any(s[k] != v for k, v in SHAPES[arch].items())
    w.add_name(f"{arch} (random weights, custom shape)" if custom else NAMES[arch])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(L)
    w.add_context_length(s["context"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    if arch == "gemma3":
        if s["rope_scale"]:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(s["rope_scale"])
        w.add_rope_freq_base_swa(s["rope_local_theta"])
        w.add_sliding_window(s["sliding_window"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    (vocab_qwen3 if arch == "qwen3" else vocab_gemma3)(w, rng, vocab)

    w.add_tensor("token_embd.weight", rand(vocab, h))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(h))
        w.add_tensor(p + "attn_q.weight", rand(heads * hd, h))
        w.add_tensor(p + "attn_k.weight", rand(kv * hd, h))
        w.add_tensor(p + "attn_v.weight", rand(kv * hd, h))
        w.add_tensor(p + "attn_output.weight", rand(h, heads * hd))
        w.add_tensor(p + "attn_q_norm.weight", norm(hd))
        w.add_tensor(p + "attn_k_norm.weight", norm(hd))
        if arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", norm(h))
        w.add_tensor(p + "ffn_norm.weight", norm(h))
        w.add_tensor(p + "ffn_gate.weight", rand(ff, h))
        w.add_tensor(p + "ffn_up.weight", rand(ff, h))
        w.add_tensor(p + "ffn_down.weight", rand(h, ff))
        if arch == "gemma3":
            w.add_tensor(p + "post_ffw_norm.weight", norm(h))
    w.add_tensor("output_norm.weight", norm(h))
    if arch == "qwen3":
        w.add_tensor("output.weight", rand(vocab, h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
