#!/usr/bin/env python3
"""Write a random-weight LLaMA-shaped GGUF whose projections are Q4_K and Q6_K blocks laid out as
llama.cpp's Q4_K_M mix lays them out (attn_v and ffn_down in Q6_K on the layers llama.cpp's
`use_more_bits` picks, Q4_K elsewhere; token_embd Q4_K, output Q6_K), for CPU throughput runs of
the K-quant kernels next to llama.cpp on the same file. gguf-py cannot quantize to K-quants, so
the blocks are random bytes with finite, small scales: every bit pattern of the quants and the
packed 6-bit scales is a valid block, and throughput does not depend on the values.
Usage: PYTHONPATH=LLAMACPP/gguf-py gguf_kquant_llama.py OUT.gguf HIDDEN LAYERS INTER HEADS KV VOCAB"""
import sys

import numpy as np

import gguf

out = sys.argv[1]
h, L, inter, heads, kv, vocab = (int(x) for x in sys.argv[2:8])
hd = h // heads
rng = np.random.default_rng(0)
Q = gguf.GGMLQuantizationType


def blocks(shape, qtype):
    """Random blocks for a (rows, cols) tensor: (rows, cols / 256 * block bytes) uint8."""
    rows, cols = shape
    size = {Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
    nb = rows * cols // 256
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.0005).tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_K:
        b[:, 0:2] = scale  # d
        b[:, 2:4] = scale  # dmin
    else:
        b[:, 208:210] = scale  # d
    return b.reshape(rows, cols // 256 * size)


def use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


w = gguf.GGUFWriter(out, "llama")
w.add_context_length(4096); w.add_embedding_length(h); w.add_block_count(L)
w.add_feed_forward_length(inter); w.add_head_count(heads); w.add_head_count_kv(kv)
w.add_rope_dimension_count(hd); w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(10000.0)
w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
w.add_tokenizer_model("llama"); w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
w.add_token_scores([0.0] * vocab); w.add_token_types([gguf.TokenType.NORMAL] * vocab)
w.add_bos_token_id(1); w.add_eos_token_id(2)
ones = np.ones(h, dtype=np.float32)


def q(name, shape, qtype):
    w.add_tensor(name, blocks(shape, qtype), raw_dtype=qtype)


q("token_embd.weight", (vocab, h), Q.Q4_K)
for i in range(L):
    p = f"blk.{i}."
    more = Q.Q6_K if use_more_bits(i, L) else Q.Q4_K
    w.add_tensor(p + "attn_norm.weight", ones); w.add_tensor(p + "ffn_norm.weight", ones)
    q(p + "attn_q.weight", (heads * hd, h), Q.Q4_K); q(p + "attn_k.weight", (kv * hd, h), Q.Q4_K)
    q(p + "attn_v.weight", (kv * hd, h), more); q(p + "attn_output.weight", (h, heads * hd), Q.Q4_K)
    q(p + "ffn_gate.weight", (inter, h), Q.Q4_K); q(p + "ffn_up.weight", (inter, h), Q.Q4_K)
    q(p + "ffn_down.weight", (h, inter), more)
w.add_tensor("output_norm.weight", ones)
q("output.weight", (vocab, h), Q.Q6_K)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print("wrote", out, flush=True)
