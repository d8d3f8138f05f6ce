#!/usr/bin/env python3
"""Writes a random-weight Qwen3-MoE GGUF (`qwen3moe` architecture) for throughput runs, its
projections directly in Q8_0 blocks (Q4_K_M: requantize it with
`llama-quantize --allow-requantize OUT.gguf OUT-q4km.gguf Q4_K_M`), with one of two routings.

Usage: PYTHONPATH=LLAMACPP/gguf-py python3 scripts/gguf_random_moe.py OUT.gguf
           [--shape 30b-a3b|cpu-small] [--layers N] [--routing uniform|skewed]

Shapes:
- `30b-a3b` (default): Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads, 4 KV heads, head_dim
  128, 128 experts, top 8, expert FFN 768, vocab 151936 (31 GB in Q8_0).
- `cpu-small`: the CPU target: hidden 1024, 16 layers, 16 heads, 4 KV heads, head_dim 64,
  64 experts, top 4, expert FFN 512, vocab 32000.

Routings (the same file serves both sides of a benchmark):
- `uniform`: the router is random (N(0, 0.05²)) and the embeddings are EMBED_SCALE times the
  other weights' scale, so that each token's own row dominates the residual stream at every
  depth: a token's experts are nearly uniform over the experts and independent of the previous
  token's, the worst case for any cache (on `cpu-small` with random tokens, 16 slots of 64 hit
  22-31% in every layer; uniform is 25%).
- `skewed`: fixed BEFORE any measurement, not to be tuned after seeing results:
  * popularity: Zipf-like, expert of rank r (a fixed random permutation per layer) has prior
    weight r^-ZIPF_S with ZIPF_S = 1.0;
  * it is built into the router through a direction every hidden state shares: each token
    embedding is COMMON_SCALE * c + its own random row (c a fixed unit vector), and router row e
    is POP_SCALE * log(r_e^-ZIPF_S) * c + random (N(0, 0.05²)), so that the logits carry the
    log-popularity where the hidden state keeps its share of c; the embeddings are then scaled
    by EMBED_SCALE, as the uniform file's, so that the hidden state keeps that share at depth;
  * token-to-token correlation: the vocabulary is split into TOPICS = 16 contiguous blocks of
    ids; each topic has a random unit vector t_k added to its tokens' embeddings
    (TOPIC_SCALE), and each layer's router favours TOPIC_EXPERTS = top-k experts per topic
    (TOPIC_BOOST added along t_k), so tokens of one topic share experts. REPEAT_SHARE = 0.5 is
    the intended share of a token's experts repeated from the previous token of the same
    topic; the realised share and hit rates are measured and reported, not tuned.
Random weights from a fixed seed (0); Q8_0 scales small enough that activations stay finite.
"""
import argparse

import numpy as np
import gguf

SHAPES = {
    "30b-a3b": dict(h=2048, layers=48, heads=32, kv=4, hd=128, E=128, K=8, ff=768, vocab=151936),
    "cpu-small": dict(h=1024, layers=16, heads=16, kv=4, hd=64, E=64, K=4, ff=512, vocab=32000),
}
# The skewed routing's parameters (see the module docs): fixed before any measurement.
ZIPF_S = 1.0
COMMON_SCALE = 1.0
POP_SCALE = 1.0
TOPICS = 16
TOPIC_SCALE = 1.0
TOPIC_BOOST = 2.0
REPEAT_SHARE = 0.5
# Both routings' embeddings against the other weights' scale (see main).
EMBED_SCALE = 1000.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="30b-a3b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--routing", choices=["uniform", "skewed"], default="uniform")
    a = ap.parse_args()
    s = dict(SHAPES[a.shape])
    if a.layers:
        s["layers"] = a.layers
    h, L, heads, kv, hd, E, K, ff, vocab = (s[k] for k in ("h", "layers", "heads", "kv", "hd", "E", "K", "ff", "vocab"))
    rng = np.random.default_rng(0)
    # A pool of random Q8_0 blocks: an f16 scale and 32 int8.
    nb = 1 << 18
    scales = (np.abs(rng.standard_normal(nb)) * 0.0005 + 0.0002).astype(np.float16).view(np.uint8).reshape(nb, 2)
    qs = rng.integers(-127, 128, size=(nb, 32), dtype=np.int8).view(np.uint8)
    pool = np.concatenate([scales, qs], axis=1)

    def q8(shape, blocks_from=pool):
        # Each tensor starts at its own random place in the pool, so that no two layers or
        # experts share their weights.
        rows, blocks = int(np.prod(shape[:-1])), shape[-1] // 32
        start = int(rng.integers(nb))
        return np.resize(np.roll(blocks_from, -start, axis=0), (rows * blocks, 34)).reshape(*shape[:-1], blocks * 34)

    skewed = a.routing == "skewed"
    c = rng.standard_normal(h).astype(np.float32)
    c /= np.linalg.norm(c)
    topics = rng.standard_normal((TOPICS, h)).astype(np.float32)
    topics /= np.linalg.norm(topics, axis=1, keepdims=True)

    w = gguf.GGUFWriter(a.out, "qwen3moe")
    w.add_context_length(40960)
    w.add_embedding_length(h)
    w.add_block_count(L)
    w.add_feed_forward_length(6144)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(ff)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    Q8 = gguf.GGMLQuantizationType.Q8_0

    def add(name, shape):
        w.add_tensor(name, q8(shape), raw_dtype=Q8)

    def ones(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    if skewed:
        # F32 embeddings: the shared direction and the topics must survive exactly.
        emb = 0.5 * rng.standard_normal((vocab, h)).astype(np.float32) / np.sqrt(h)
        emb += COMMON_SCALE * c
        emb += TOPIC_SCALE * topics[(np.arange(vocab) * TOPICS) // vocab]
        # As the uniform file's: the embeddings outweigh what the layers add.
        emb *= EMBED_SCALE
        w.add_tensor("token_embd.weight", emb.astype(np.float32))
    else:
        # Embeddings EMBED_SCALE times the other weights' scale: each token's own row then
        # outweighs what the layers add to the residual stream (the attention's output, much
        # the same for every new token, would otherwise steer every router alike).
        big = pool.copy()
        big[:, :2] = (scales.view(np.float16) * EMBED_SCALE).astype(np.float16).view(np.uint8).reshape(nb, 2)
        w.add_tensor("token_embd.weight", q8((vocab, h), big), raw_dtype=Q8)
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(h))
        w.add_tensor(p + "ffn_norm.weight", ones(h))
        w.add_tensor(p + "attn_q_norm.weight", ones(hd))
        w.add_tensor(p + "attn_k_norm.weight", ones(hd))
        add(p + "attn_q.weight", (heads * hd, h))
        add(p + "attn_k.weight", (kv * hd, h))
        add(p + "attn_v.weight", (kv * hd, h))
        add(p + "attn_output.weight", (h, heads * hd))
        router = (0.05 * rng.standard_normal((E, h))).astype(np.float32)
        if skewed:
            rank = rng.permutation(E) + 1
            router += (POP_SCALE * np.log(rank.astype(np.float32) ** -ZIPF_S))[:, None] * c[None, :]
            for k in range(TOPICS):
                favoured = rng.choice(E, size=K, replace=False)
                router[favoured] += TOPIC_BOOST * topics[k][None, :]
        w.add_tensor(p + "ffn_gate_inp.weight", router)
        add(p + "ffn_gate_exps.weight", (E, ff, h))
        add(p + "ffn_up_exps.weight", (E, ff, h))
        add(p + "ffn_down_exps.weight", (E, h, ff))
    w.add_tensor("output_norm.weight", ones(h))
    add("output.weight", (vocab, h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print(f"wrote {a.out} ({a.shape}, {L} layers, routing {a.routing})", flush=True)


if __name__ == "__main__":
    main()
