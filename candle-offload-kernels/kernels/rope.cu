// The RoPE of `candle_offload_kernels::rope` (rope_qk, rope_qk_cache and its form at a device
// position; rope_qk_norm with the per-head RMSNorms of q and k before it), once per element
// type as `rope_qk_<dtype>`.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "reduce.cuh"

// Element i of a head's row after half-rotated RoPE by the table row `c` (2 * rot_half values:
// the cos of each rotated pair, then its sin) where `rotate` and i is among the first
// 2 * rot_half dimensions (partial rotary passes the rest through); the element as it is else.
template <typename T>
__device__ __forceinline__ float rope_elem(const T *head, const T *c, uint32_t i,
                                           uint32_t rot_half, bool rotate) {
    if (!rotate || i >= 2 * rot_half) return to_f32(head[i]);
    const uint32_t j = i < rot_half ? i : i - rot_half;
    const float x1 = to_f32(head[j]);
    const float x2 = to_f32(head[j + rot_half]);
    const float cj = to_f32(c[j]);
    const float sj = to_f32(c[rot_half + j]);
    return i < rot_half ? x1 * cj - x2 * sj : x2 * cj + x1 * sj;
}

// Half-rotated RoPE of q (b, t, hq, d) and k (b, t, hk, d) in one pass, written transposed:
// q as (b, hq, t, d) into qout, k into positions pos .. pos + t of kout, (b, hk, cap, d) (a KV
// cache's buffer; cap = t and pos = 0 for a plain (b, hk, t, d) output), and, where v is not
// null, v (b, t, hk, d) unrotated into the same positions of vout. `cs` holds one row per
// position (t rows of 2 * rot_half: the cos of each rotated pair, then its sin); the first
// 2 * rot_half dimensions of each head rotate, the rest pass through (partial rotary).
//
// With pos_dev (not null; a decode step replayed from a CUDA graph), the position is read from
// the device, *pos_dev, in place of `pos`, and `cs` is the whole table of cs_rows positions,
// read from row pos on. A position whose rows would not fit the cache or the table writes
// nothing (the host checks it before each replay; this only keeps the writes in bounds).
template <typename T>
__device__ void rope_qk(const T *q, const T *k, const T *v, const T *cs, T *qout, T *kout,
                        T *vout, uint32_t b, uint32_t t, uint32_t hq, uint32_t hk, uint32_t d,
                        uint32_t rot_half, uint32_t cap, uint32_t pos, const uint32_t *pos_dev,
                        uint32_t cs_rows) {
    if (pos_dev != nullptr) {
        pos = *pos_dev;
        if (pos > cap - t || pos > cs_rows - t) return;
        cs += (size_t)pos * 2 * rot_half;
    }
    const size_t nq = (size_t)b * hq * t * d;
    const size_t nk = (size_t)b * hk * t * d;
    const size_t n = nq + nk + (v != nullptr ? nk : 0);
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        const int part = e < nq ? 0 : (e < nq + nk ? 1 : 2);  // q, k, v
        const size_t o = part == 0 ? e : (part == 1 ? e - nq : e - nq - nk);
        const uint32_t h = part == 0 ? hq : hk;
        const T *src = part == 0 ? q : (part == 1 ? k : v);
        const uint32_t i = (uint32_t)(o % d);
        const size_t row = o / d;  // (bi * h + hi) * t + ti
        const uint32_t ti = (uint32_t)(row % t);
        const size_t bh = row / t;
        const uint32_t hi = (uint32_t)(bh % h);
        const size_t bi = bh / h;
        const T *head = src + ((bi * t + ti) * h + hi) * (size_t)d;
        const float y = rope_elem(head, cs + (size_t)ti * 2 * rot_half, i, rot_half, part < 2);
        if (part == 0) {
            qout[e] = from_f32<T>(y);
        } else {
            T *dst = part == 1 ? kout : vout;
            dst[(bh * cap + pos + ti) * (size_t)d + i] = from_f32<T>(y);
        }
    }
}

#define ROPE_FOR(T, SUFFIX)                                                                     \
    extern "C" __global__ void rope_qk_##SUFFIX(                                                \
        const T *q, const T *k, const T *v, const T *cs, T *qout, T *kout, T *vout, uint32_t b, \
        uint32_t t, uint32_t hq, uint32_t hk, uint32_t d, uint32_t rot_half, uint32_t cap,      \
        uint32_t pos, const uint32_t *pos_dev, uint32_t cs_rows) {                              \
        rope_qk<T>(q, k, v, cs, qout, kout, vout, b, t, hq, hk, d, rot_half, cap, pos, pos_dev, \
                   cs_rows);                                                                    \
    }

ROPE_FOR(float, f32)
ROPE_FOR(__half, f16)
ROPE_FOR(__nv_bfloat16, bf16)

// rope_qk with each head's row of q and k RMS-normed first (Qwen3's q_norm and k_norm, weights
// qw and kw of d elements): one warp per row of q, k or v (v copied as rope_qk copies it). A
// normed element is rounded to T before it rotates, as the separate norm kernel writes it
// (scale · x · w in F32, then T), so the result is the two launches' up to the order of the
// sum of squares.
template <typename T>
__device__ void rope_qk_norm(const T *q, const T *k, const T *v, const T *cs, T *qout, T *kout,
                             T *vout, uint32_t b, uint32_t t, uint32_t hq, uint32_t hk, uint32_t d,
                             uint32_t rot_half, uint32_t cap, uint32_t pos,
                             const uint32_t *pos_dev, uint32_t cs_rows, const T *qw, const T *kw,
                             float eps) {
    if (pos_dev != nullptr) {
        pos = *pos_dev;
        if (pos > cap - t || pos > cs_rows - t) return;
        cs += (size_t)pos * 2 * rot_half;
    }
    const uint32_t lane = threadIdx.x & 31u;
    const size_t rq = (size_t)b * hq * t;
    const size_t rk = (size_t)b * hk * t;
    const size_t rows = rq + rk + (v != nullptr ? rk : 0);
    const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
    for (size_t r = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const int part = r < rq ? 0 : (r < rq + rk ? 1 : 2);  // q, k, v
        const size_t o = part == 0 ? r : (part == 1 ? r - rq : r - rq - rk);  // (bi, hi, ti)
        const uint32_t h = part == 0 ? hq : hk;
        const T *src = part == 0 ? q : (part == 1 ? k : v);
        const T *w = part == 0 ? qw : kw;
        const uint32_t ti = (uint32_t)(o % t);
        const size_t bh = o / t;
        const uint32_t hi = (uint32_t)(bh % h);
        const size_t bi = bh / h;
        const T *head = src + ((bi * t + ti) * h + hi) * (size_t)d;
        float scale = 1.0f;
        if (part < 2) {
            float ss = 0.0f;
            for (uint32_t i = lane; i < d; i += 32u) {
                const float x = to_f32(head[i]);
                ss += x * x;
            }
            scale = rsqrtf(warp_sum(ss) / (float)d + eps);
        }
        const T *c = cs + (size_t)ti * 2 * rot_half;
        for (uint32_t i = lane; i < d; i += 32u) {
            float y;
            if (part == 2) {
                y = to_f32(head[i]);
            } else {
                auto normed = [&](uint32_t j) {
                    return to_f32(from_f32<T>(scale * to_f32(head[j]) * to_f32(w[j])));
                };
                if (i >= 2 * rot_half) {
                    y = normed(i);
                } else {
                    const uint32_t j = i < rot_half ? i : i - rot_half;
                    const float x1 = normed(j), x2 = normed(j + rot_half);
                    const float cj = to_f32(c[j]), sj = to_f32(c[rot_half + j]);
                    y = i < rot_half ? x1 * cj - x2 * sj : x2 * cj + x1 * sj;
                }
            }
            if (part == 0) {
                qout[o * d + i] = from_f32<T>(y);
            } else {
                T *dst = part == 1 ? kout : vout;
                dst[(bh * cap + pos + ti) * (size_t)d + i] = from_f32<T>(y);
            }
        }
    }
}

#define ROPE_NORM_FOR(T, SUFFIX)                                                                \
    extern "C" __global__ void rope_qk_norm_##SUFFIX(                                           \
        const T *q, const T *k, const T *v, const T *cs, T *qout, T *kout, T *vout, uint32_t b, \
        uint32_t t, uint32_t hq, uint32_t hk, uint32_t d, uint32_t rot_half, uint32_t cap,      \
        uint32_t pos, const uint32_t *pos_dev, uint32_t cs_rows, const T *qw, const T *kw,      \
        float eps) {                                                                            \
        rope_qk_norm<T>(q, k, v, cs, qout, kout, vout, b, t, hq, hk, d, rot_half, cap, pos,     \
                        pos_dev, cs_rows, qw, kw, eps);                                         \
    }

ROPE_NORM_FOR(float, f32)
ROPE_NORM_FOR(__half, f16)
ROPE_NORM_FOR(__nv_bfloat16, bf16)

// A ragged decode step's RoPE: n sequences of one new position each, q (n, hq, d), k and v
// (n, hk, d) rows as the projections give them, q rotated into qout (n, hq, d) and k rotated
// with v into each sequence's own cache. `seqs` holds three u64 per sequence: its key and
// value buffers' addresses ((hk, cap, d) each) and (cap << 32) | pos, the position the row is
// written at (the positions cached before it); `cs` is the whole table (a row of 2 * rot_half
// per position, cs_rows of them). A row whose position does not fit its cache or the table
// writes nothing (the host checks it; this only keeps the writes in bounds).
template <typename T>
__device__ void rope_qk_ragged(const T *q, const T *k, const T *v, const T *cs, T *qout,
                               const uint64_t *seqs, uint32_t n, uint32_t hq, uint32_t hk,
                               uint32_t d, uint32_t rot_half, uint32_t cs_rows) {
    const size_t nq = (size_t)n * hq * d;
    const size_t nk = (size_t)n * hk * d;
    const size_t total = nq + 2 * nk;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const int part = e < nq ? 0 : (e < nq + nk ? 1 : 2);  // q, k, v
        const size_t o = part == 0 ? e : (part == 1 ? e - nq : e - nq - nk);
        const uint32_t h = part == 0 ? hq : hk;
        const T *src = part == 0 ? q : (part == 1 ? k : v);
        const uint32_t i = (uint32_t)(o % d);
        const size_t row = o / d;  // bi * h + hi
        const uint32_t hi = (uint32_t)(row % h);
        const uint32_t bi = (uint32_t)(row / h);
        const uint64_t meta = seqs[3 * (size_t)bi + 2];
        const uint32_t cap = (uint32_t)(meta >> 32), pos = (uint32_t)meta;
        if (pos >= cap || pos >= cs_rows) continue;
        const T *head = src + row * (size_t)d;
        const float y = rope_elem(head, cs + (size_t)pos * 2 * rot_half, i, rot_half, part < 2);
        if (part == 0) {
            qout[e] = from_f32<T>(y);
        } else {
            T *dst = (T *)seqs[3 * (size_t)bi + (part == 1 ? 0 : 1)];
            dst[((size_t)hi * cap + pos) * d + i] = from_f32<T>(y);
        }
    }
}

#define ROPE_RAGGED_FOR(T, SUFFIX)                                                              \
    extern "C" __global__ void rope_qk_ragged_##SUFFIX(                                         \
        const T *q, const T *k, const T *v, const T *cs, T *qout, const uint64_t *seqs,         \
        uint32_t n, uint32_t hq, uint32_t hk, uint32_t d, uint32_t rot_half,                    \
        uint32_t cs_rows) {                                                                     \
        rope_qk_ragged<T>(q, k, v, cs, qout, seqs, n, hq, hk, d, rot_half, cs_rows);            \
    }

ROPE_RAGGED_FOR(float, f32)
ROPE_RAGGED_FOR(__half, f16)
ROPE_RAGGED_FOR(__nv_bfloat16, bf16)
