// The decode matmuls of `candle_offload_kernels::linear` over dense weights (linear_small) and
// over GGML blocks of 32 elements with x in its float type (qlinear_small, variants 1 and 2 of
// KernelTuning::qlinear; variants 3 and 4 are linear_q8.cu's, the K-quants linear_k.cu's).
// Each kernel exists once per element type of x as `<name>_f32`, `<name>_f16`, `<name>_bf16`.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "reduce.cuh"
#include "qblocks.cuh"

// Maximum rows of x in linear_small.
#define LS_MAX_M 8

// acc[r] += this lane's share of x[r, :] · wr[:] for r < m <= M (elements lane * 8 + 256 j),
// with 16-byte loads (k % 8 == 0, rows 16-byte aligned). M is a compile-time bound so that a
// one-row decode step keeps one accumulator, not eight: registers decide how many warps an SM
// holds, and so how many bytes are on their way from memory.
template <typename T, int M>
__device__ __forceinline__ void dot_rows(const T *x, const T *wr, uint32_t m, uint32_t k,
                                         float *acc) {
    uint32_t i = (threadIdx.x & 31u) * 8u;
    // Four weight loads in flight per lane before any is used.
    for (; i + 768u < k; i += 1024u) {
        Raw8 w[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) w[u] = ld_raw(wr + i + 256u * u, true);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float wv[8];
            cvt8<T>(w[u], wv);
#pragma unroll
            for (int r = 0; r < M; ++r) {
                if ((uint32_t)r < m) {
                    float xv[8];
                    cvt8<T>(ld_raw(x + (size_t)r * k + i + 256u * u, false), xv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r] += wv[e] * xv[e];
                }
            }
        }
    }
    for (; i < k; i += 256u) {
        float wv[8];
        cvt8<T>(ld_raw(wr + i, true), wv);
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if ((uint32_t)r < m) {
                float xv[8];
                cvt8<T>(ld_raw(x + (size_t)r * k + i, false), xv);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r] += wv[e] * xv[e];
            }
        }
    }
}

// x (m, k) times up to three weights (n_i, k) at once, for few rows m <= M <= LS_MAX_M
// (decode): one warp per output column, f32 accumulation, one warp reduction per row of x.
// - silu == 0: the columns of w0, then w1, then w2 (n1, n2 may be 0); y holds x·w0ᵀ (m, n0),
//   then x·w1ᵀ (m, n1), then x·w2ᵀ (m, n2), each contiguous (q, k and v in one launch).
// - silu != 0: w0 is a gate and w1 an up projection (n0 == n1); each warp computes column c of
//   both and y (m, n0) gets silu(gate) · up (a SwiGLU MLP's first half in one launch).
template <typename T, int M>
__device__ void linear_small(const T *x, const T *w0, const T *w1, const T *w2, T *y, uint32_t m,
                             uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu) {
    column_per_warp<T, M>(w0, w1, w2, y, m, n0, n1, n2, k, silu,
                          [=](const T *row, float *acc) { dot_rows<T, M>(x, row, m, k, acc); });
}

// linear_small_m<M>_<dtype>: the kernel for at most M rows of x. One row of f16/bf16 fits in
// 32 registers (ptxas -v: 12 bytes spilled), so an SM holds 16 blocks, all its 64 warps, of the
// decode step's kernel; the others get at most 64 (8 blocks).
#define LINEAR_SMALL_FOR(T, SUFFIX, M)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS,                                \
                                                 (M == 1 && sizeof(T) == 2) ? 16 : 8)           \
        linear_small_m##M##_##SUFFIX(                                                           \
        const T *x, const T *w0, const T *w1, const T *w2, T *y, uint32_t m, uint32_t n0,       \
        uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu) {                                  \
        linear_small<T, M>(x, w0, w1, w2, y, m, n0, n1, n2, k, silu);                           \
    }

// router_logits_<dtype>: one row x (k) times w (n, k) into y (n) in F32 (a router's logits,
// whose top-k must not see 16-bit rounding): one warp per column, F32 accumulation, in place of
// two casts to F32 and cuBLAS's split-K GEMV with its reduction. k a multiple of 8, x and w
// starting 16-byte aligned.
template <typename T>
__device__ void router_logits(const T *x, const T *w, float *y, uint32_t n, uint32_t k) {
    const uint32_t warps = (gridDim.x * blockDim.x) >> 5;
    for (uint32_t c = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < n; c += warps) {
        float acc[1] = {0.0f};
        dot_rows<T, 1>(x, w + (size_t)c * k, 1, k, acc);
        const float sum = warp_sum(acc[0]);
        if ((threadIdx.x & 31u) == 0) y[c] = sum;
    }
}

#define ROUTER_LOGITS_FOR(T, SUFFIX)                                                            \
    extern "C" __global__ void router_logits_##SUFFIX(const T *x, const T *w, float *y,         \
                                                      uint32_t n, uint32_t k) {                 \
        router_logits<T>(x, w, y, n, k);                                                        \
    }

ROUTER_LOGITS_FOR(float, f32)
ROUTER_LOGITS_FOR(__half, f16)
ROUTER_LOGITS_FOR(__nv_bfloat16, bf16)

// linear_small over GGML blocks of 32 elements, variant 1: each warp stages its row's blocks
// (qblocks.cuh: QStage, stage_blocks) and lane j decodes block j there.

// Block b's 32 quants as floats in element order, its scale d and its min mn (0 without one):
// element e is d * q[e] + mn (GGML's dequantize_row_* for each type).
template <int QT>
__device__ __forceinline__ void decode_block(const uint8_t *b, float *q, float &d, float &mn);
template <> __device__ __forceinline__ void decode_block<QT_Q4_0>(const uint8_t *b, float *q,
                                                                  float &d, float &mn) {
    d = sm_f16(b);
    mn = 0.0f;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const uint32_t w = sm_u32(b + 2 + 4 * t);
        const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[4 * t + i] = byte_f32(lo, i, 8.0f);
            q[16 + 4 * t + i] = byte_f32(hi, i, 8.0f);
        }
    }
}
template <> __device__ __forceinline__ void decode_block<QT_Q4_1>(const uint8_t *b, float *q,
                                                                  float &d, float &mn) {
    d = sm_f16(b);
    mn = sm_f16(b + 2);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const uint32_t w = sm_u32(b + 4 + 4 * t);
        const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[4 * t + i] = byte_f32(lo, i, 0.0f);
            q[16 + 4 * t + i] = byte_f32(hi, i, 0.0f);
        }
    }
}
// Q5: the 4 low bits of element j and j + 16 share qs[j]; their 5th bits are bits j and j + 16
// of qh.
template <bool MIN>
__device__ __forceinline__ void decode_q5(const uint8_t *qh_at, const uint8_t *qs, float *q) {
    const uint32_t qh = sm_u32(qh_at);
    const float bias = MIN ? 0.0f : 16.0f;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const uint32_t w = sm_u32(qs + 4 * t);
        uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j = 4 * t + i;
            lo |= ((qh >> j) & 1u) << (8 * i + 4);
            hi |= ((qh >> (j + 16)) & 1u) << (8 * i + 4);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[4 * t + i] = byte_f32(lo, i, bias);
            q[16 + 4 * t + i] = byte_f32(hi, i, bias);
        }
    }
}
template <> __device__ __forceinline__ void decode_block<QT_Q5_0>(const uint8_t *b, float *q,
                                                                  float &d, float &mn) {
    d = sm_f16(b);
    mn = 0.0f;
    decode_q5<false>(b + 2, b + 6, q);
}
template <> __device__ __forceinline__ void decode_block<QT_Q5_1>(const uint8_t *b, float *q,
                                                                  float &d, float &mn) {
    d = sm_f16(b);
    mn = sm_f16(b + 2);
    decode_q5<true>(b + 4, b + 8, q);
}
template <> __device__ __forceinline__ void decode_block<QT_Q8_0>(const uint8_t *b, float *q,
                                                                  float &d, float &mn) {
    d = sm_f16(b);
    mn = 0.0f;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        // Signed bytes, offset to 0..255 by flipping their sign bits.
        const uint32_t w = sm_u32(b + 2 + 4 * t) ^ 0x80808080u;
#pragma unroll
        for (int i = 0; i < 4; ++i) q[4 * t + i] = byte_f32(w, i, 128.0f);
    }
}

// acc[r] += x[r, :] · block e of a row for r < m <= M (one lane, one block at b).
template <typename T, int M, int QT>
__device__ __forceinline__ void qdot_block(const T *x, const uint8_t *b, uint32_t e, uint32_t m,
                                           uint32_t k, float *acc) {
    float q[32], d, mn;
    decode_block<QT>(b, q, d, mn);
    const uint32_t e0 = e * 32u;
#pragma unroll
    for (int r = 0; r < M; ++r) {
        if ((uint32_t)r < m) {
            float s = 0.0f, sx = 0.0f;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                float xv[8];
                cvt8<T>(ld_raw(x + (size_t)r * k + e0 + 8u * u, false), xv);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    s += q[8 * u + i] * xv[i];
                    if (QBlock<QT>::MIN) sx += xv[i];
                }
            }
            acc[r] += d * s + (QBlock<QT>::MIN ? mn * sx : 0.0f);
        }
    }
}

// acc[w][r] += x[r, :] · rows[w] for the NW rows (k / 32 blocks each) and r < m <= M (one
// warp; every lane calls).
template <typename T, int M, int QT, int NW>
__device__ __forceinline__ void qdot_rows(const T *x, const uint8_t *const *rows, uint32_t m,
                                          uint32_t k, float (*acc)[M], uint4 *st) {
    constexpr int B = QBlock<QT>::BYTES;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t nb = k >> 5;
    for (uint32_t first = 0; first < nb; first += QStage<QT>::BLOCKS) {
        const uint32_t count = min((uint32_t)QStage<QT>::BLOCKS, nb - first);
        const uint8_t *at[NW];
        stage_blocks<QT, NW>(rows, first, count, st, at);
        for (uint32_t j = lane; j < count; j += 32u) {
#pragma unroll
            for (int w = 0; w < NW; ++w) qdot_block<T, M, QT>(x, at[w] + j * B, first + j, m, k, acc[w]);
        }
        // The stage is rewritten next round only after every lane has read its blocks.
        __syncwarp();
    }
}

// linear_small's contract (see there) with weights of GGML blocks: w0, w1, w2 point at the
// blocks of weights (n_i, k), k a multiple of 32. Dynamic shared memory: QStage::VECS 16-byte
// vectors per warp, twice that with silu (gate and up are staged together).
template <typename T, int M, int QT>
__device__ void qlinear_small(const T *x, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2,
                              T *y, uint32_t m, uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k,
                              uint32_t silu) {
    extern __shared__ uint4 qstage[];
    const uint32_t warp = threadIdx.x >> 5;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t col = blockIdx.x * OPS_WARPS + warp;
    const size_t row_bytes = (size_t)(k >> 5) * QBlock<QT>::BYTES;
    if (silu) {
        if (col >= n0) return;
        uint4 *st = qstage + (size_t)warp * 2 * QStage<QT>::VECS;
        float acc[2][M];
#pragma unroll
        for (int r = 0; r < M; ++r) acc[0][r] = acc[1][r] = 0.0f;
        const uint8_t *rows[2] = {w0 + col * row_bytes, w1 + col * row_bytes};
        qdot_rows<T, M, QT, 2>(x, rows, m, k, acc, st);
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if ((uint32_t)r < m) {
                const float g = warp_sum(acc[0][r]);
                const float u = warp_sum(acc[1][r]);
                if (lane == 0) y[(size_t)r * n0 + col] = from_f32<T>(g / (1.0f + expf(-g)) * u);
            }
        }
        return;
    }
    uint4 *st = qstage + (size_t)warp * QStage<QT>::VECS;
    const uint8_t *w;
    T *yb;
    uint32_t c, n;
    if (!pick_column(col, w0, w1, w2, y, m, n0, n1, n2, w, yb, c, n)) return;
    float acc[1][M];
#pragma unroll
    for (int r = 0; r < M; ++r) acc[0][r] = 0.0f;
    const uint8_t *rows[1] = {w + c * row_bytes};
    qdot_rows<T, M, QT, 1>(x, rows, m, k, acc, st);
#pragma unroll
    for (int r = 0; r < M; ++r) {
        if ((uint32_t)r < m) {
            const float s = warp_sum(acc[0][r]);
            if (lane == 0) yb[(size_t)r * n + c] = from_f32<T>(s);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// qlinear_small, variant 2 (`qlinear2_small_r<R>_m<M>_<q>_<dtype>`; the launcher picks the
// variant from KernelTuning::qlinear): the same contract, but each warp reads R weight rows
// together (R output columns, or R / 2 columns of gate and up with silu), so that the x values
// of a block, loaded and converted once per lane, serve R rows instead of one. Per round the
// warp stages QStage2::BLOCKS blocks of each of its R rows; lane j takes block j of every row,
// and for each 8-element chunk of that block loads the chunk of each row of x once, decodes the
// chunk of each weight row (unscaled quants) and adds d * (quants · x) to the row's
// accumulator, so the results are the f32 dot products of x with the dequantized weights, as

// Elements 4g .. 4g + 3 (g < 8, a constant after unrolling) of the block at b as unscaled
// floats: element e of the block is d * q[e] + mn (decode_block's q, d and mn).
template <int QT> __device__ __forceinline__ void decode4(const uint8_t *b, int g, float *q);
template <> __device__ __forceinline__ void decode4<QT_Q4_0>(const uint8_t *b, int g, float *q) {
    const uint32_t w = sm_u32(b + 2 + 4 * (g & 3));
    const uint32_t v = g < 4 ? w & 0x0F0F0F0Fu : (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = byte_f32(v, i, 8.0f);
}
template <> __device__ __forceinline__ void decode4<QT_Q4_1>(const uint8_t *b, int g, float *q) {
    const uint32_t w = sm_u32(b + 4 + 4 * (g & 3));
    const uint32_t v = g < 4 ? w & 0x0F0F0F0Fu : (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = byte_f32(v, i, 0.0f);
}
template <bool MIN>
__device__ __forceinline__ void decode4_q5(const uint8_t *qh_at, const uint8_t *qs, int g,
                                           float *q) {
    const uint32_t qh = sm_u32(qh_at);
    const uint32_t w = sm_u32(qs + 4 * (g & 3));
    const uint32_t v0 = g < 4 ? w & 0x0F0F0F0Fu : (w >> 4) & 0x0F0F0F0Fu;
    // The 4 high bits, bit i of (qh >> 4g) to bit 4 of byte i: the product places copies of
    // the 4 bits at bits 0, 7, 14 and 21 (no carries), so copy i has its bit i at 8i.
    const uint32_t v = v0 | (((((qh >> (4 * g)) & 0xFu) * 0x00204081u) & 0x01010101u) << 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = byte_f32(v, i, MIN ? 0.0f : 16.0f);
}
template <> __device__ __forceinline__ void decode4<QT_Q5_0>(const uint8_t *b, int g, float *q) {
    decode4_q5<false>(b + 2, b + 6, g, q);
}
template <> __device__ __forceinline__ void decode4<QT_Q5_1>(const uint8_t *b, int g, float *q) {
    decode4_q5<true>(b + 4, b + 8, g, q);
}
template <> __device__ __forceinline__ void decode4<QT_Q8_0>(const uint8_t *b, int g, float *q) {
    const uint32_t w = sm_u32(b + 2 + 4 * g) ^ 0x80808080u;
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = byte_f32(w, i, 128.0f);
}

// Rows of x per group in variant 2: two where the R * M accumulators, the group's chunk
// (8 G floats), one decoded chunk and the R scales stay within 34 registers (M = 2 and 4 with
// R = 2; more spill, ptxas -v), else one.
template <int M, int R> struct QGroup2 {
    static constexpr int G = (M >= 2 && R * M + 16 + 8 + R <= 34) ? 2 : 1;
};

// acc[w][r] += x[r, :] · rows[w] for the R rows (k / 32 blocks each) and r < m <= M (one
// warp; every lane calls). st: this warp's R * QStage2::VECS vectors of shared memory.
template <typename T, int M, int QT, int R>
__device__ __forceinline__ void qdot_rows2(const T *x, const uint8_t *const *rows, uint32_t m,
                                           uint32_t k, float (*acc)[M], uint4 *st) {
    constexpr int B = QBlock<QT>::BYTES;
    constexpr int G = QGroup2<M, R>::G;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t nb = k >> 5;
    for (uint32_t first = 0; first < nb; first += QStage2<QT>::BLOCKS) {
        const uint32_t count = min((uint32_t)QStage2<QT>::BLOCKS, nb - first);
        const uint8_t *at[R];
        stage_rows_async<QT, R>(rows, first, count, st, at);
        asm volatile("cp.async.wait_all;\n" ::);
        __syncwarp();
        for (uint32_t j = lane; j < count; j += 32u) {
            const T *xb = x + (size_t)(first + j) * 32u;
            float sx[M];
#pragma unroll
            for (int r = 0; r < M; ++r) sx[r] = 0.0f;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
#pragma unroll
                for (int r0 = 0; r0 < M; r0 += G) {
                    if ((uint32_t)r0 < m) {
                        float xv[G][8];
#pragma unroll
                        for (int g = 0; g < G; ++g) {
                            if ((uint32_t)(r0 + g) < m) {
                                cvt8<T>(ld_raw(xb + (size_t)(r0 + g) * k + 8u * u, false), xv[g]);
                            } else {
#pragma unroll
                                for (int i = 0; i < 8; ++i) xv[g][i] = 0.0f;
                            }
                            if (QBlock<QT>::MIN) {
#pragma unroll
                                for (int i = 0; i < 8; ++i) sx[r0 + g] += xv[g][i];
                            }
                        }
#pragma unroll
                        for (int w = 0; w < R; ++w) {
                            float q[8];
                            decode4<QT>(at[w] + j * B, 2 * u, q);
                            decode4<QT>(at[w] + j * B, 2 * u + 1, q + 4);
#pragma unroll
                            for (int g = 0; g < G; ++g) {
                                float t = 0.0f;
#pragma unroll
                                for (int i = 0; i < 8; ++i) t = fmaf(q[i], xv[g][i], t);
                                acc[w][r0 + g] = fmaf(sm_f16(at[w] + j * B), t, acc[w][r0 + g]);
                            }
                        }
                    }
                }
            }
            if (QBlock<QT>::MIN) {
#pragma unroll
                for (int w = 0; w < R; ++w) {
                    const float mn = sm_f16(at[w] + j * B + 2);
#pragma unroll
                    for (int r = 0; r < M; ++r) acc[w][r] = fmaf(mn, sx[r], acc[w][r]);
                }
            }
        }
        // The stage is rewritten next round only after every lane has read its blocks.
        __syncwarp();
    }
}

// qlinear_small's contract, variant 2. Dynamic shared memory: R * QStage2::VECS 16-byte vectors
// per warp. Warp i of the grid computes columns R i .. R i + R - 1 of the concatenated weights
// (a warp's columns may span two of them), or with silu columns (R / 2) i .. of both gate and
// up; columns past the last are computed on a repeat of the warp's first row and not written.
template <typename T, int M, int QT, int R>
__device__ void qlinear_small2(const T *x, const uint8_t *w0, const uint8_t *w1,
                               const uint8_t *w2, T *y, uint32_t m, uint32_t n0, uint32_t n1,
                               uint32_t n2, uint32_t k, uint32_t silu) {
    extern __shared__ uint4 qstage[];
    const uint32_t warp = threadIdx.x >> 5;
    const uint32_t gw = blockIdx.x * OPS_WARPS + warp;
    const size_t row_bytes = (size_t)(k >> 5) * QBlock<QT>::BYTES;
    uint4 *st = qstage + (size_t)warp * R * QStage2<QT>::VECS;
    const uint8_t *rows[R];
    uint32_t col0;
    if (!qrows2<T, R>(gw, w0, w1, w2, y, m, n0, n1, n2, row_bytes, silu, col0, rows)) return;
    float acc[R][M];
#pragma unroll
    for (int w = 0; w < R; ++w)
#pragma unroll
        for (int r = 0; r < M; ++r) acc[w][r] = 0.0f;
    // One call of qdot_rows2 for both forms (its unrolled body is most of the kernel's code).
    qdot_rows2<T, M, QT, R>(x, rows, m, k, acc, st);
    qstore2<T, M, R>(acc, col0, w0, w1, w2, y, m, n0, n1, n2, row_bytes, silu);
}

// qlinear_small_m<M>_<q>_<dtype>: at most M rows of x against weights of GGML type q.
#define QLINEAR_SMALL_FOR(T, SUFFIX, M, QT, QNAME)                                              \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS)                                 \
        qlinear_small_m##M##_##QNAME##_##SUFFIX(                                                \
        const T *x, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, T *y, uint32_t m,  \
        uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu) {                     \
        qlinear_small<T, M, QT>(x, w0, w1, w2, y, m, n0, n1, n2, k, silu);                      \
    }
// qlinear2_small_r<R>_m<M>_<q>_<dtype>: variant 2 with R weight rows per warp.
// At most 64 registers (8 blocks of 4 warps per SM).
#define QLINEAR2_SMALL_FOR(T, SUFFIX, M, QT, QNAME, R)                                          \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 8)                              \
        qlinear2_small_r##R##_m##M##_##QNAME##_##SUFFIX(                                        \
        const T *x, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, T *y, uint32_t m,  \
        uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu) {                     \
        qlinear_small2<T, M, QT, R>(x, w0, w1, w2, y, m, n0, n1, n2, k, silu);                  \
    }
#define QLINEAR_SMALL_TYPES(T, SUFFIX, M)                                                       \
    QLINEAR_SMALL_FOR(T, SUFFIX, M, QT_Q4_0, q4_0)                                              \
    QLINEAR_SMALL_FOR(T, SUFFIX, M, QT_Q4_1, q4_1)                                              \
    QLINEAR_SMALL_FOR(T, SUFFIX, M, QT_Q5_0, q5_0)                                              \
    QLINEAR_SMALL_FOR(T, SUFFIX, M, QT_Q5_1, q5_1)                                              \
    QLINEAR_SMALL_FOR(T, SUFFIX, M, QT_Q8_0, q8_0)
// experts_weighted_sum_<dtype>: out (n) = Σ_e s.w[e] · y[e · n + c] over `experts` rows of
// y (and out's own values first where `accumulate`), in F32, rounded once: a decode row's
// routed experts' outputs weighted and added (`linear::experts`). One thread per column.
// experts_weighted_sum_at_<dtype>: the same, s read from device memory (moe_route's).
template <typename T>
__device__ void experts_weighted_sum(const T *y, T *out, const GroupScales &s, uint32_t experts,
                                     uint32_t n, uint32_t accumulate) {
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float acc = accumulate ? to_f32(out[c]) : 0.0f;
    for (uint32_t e = 0; e < experts; ++e) acc = fmaf(s.w[e], to_f32(y[(size_t)e * n + c]), acc);
    out[c] = from_f32<T>(acc);
}
#define EXPERTS_WEIGHTED_SUM_FOR(T, SUFFIX)                                                     \
    extern "C" __global__ void experts_weighted_sum_##SUFFIX(                                   \
        const T *y, T *out, GroupScales s, uint32_t experts, uint32_t n, uint32_t accumulate) { \
        experts_weighted_sum<T>(y, out, s, experts, n, accumulate);                             \
    }                                                                                           \
    extern "C" __global__ void experts_weighted_sum_at_##SUFFIX(                                \
        const T *y, T *out, const GroupScales *s, uint32_t experts, uint32_t n,                 \
        uint32_t accumulate) {                                                                  \
        experts_weighted_sum<T>(y, out, *s, experts, n, accumulate);                            \
    }
#define LINEAR_FOR(T, SUFFIX)                                                                   \
    EXPERTS_WEIGHTED_SUM_FOR(T, SUFFIX)                                                         \
    LINEAR_SMALL_FOR(T, SUFFIX, 1)                                                              \
    LINEAR_SMALL_FOR(T, SUFFIX, 2)                                                              \
    LINEAR_SMALL_FOR(T, SUFFIX, 4)                                                              \
    LINEAR_SMALL_FOR(T, SUFFIX, 8)                                                              \
    QLINEAR_SMALL_TYPES(T, SUFFIX, 1)                                                           \
    QLINEAR_SMALL_TYPES(T, SUFFIX, 2)                                                           \
    QLINEAR_SMALL_TYPES(T, SUFFIX, 4)                                                           \
    QLINEAR_SMALL_TYPES(T, SUFFIX, 8)                                                           \
    QLINEAR_RM_ALL(QLINEAR2_SMALL_FOR, T, SUFFIX)                                               \
    QLINEAR_RM_TYPES(QLINEAR2_SMALL_FOR, T, SUFFIX, 4, 4)

LINEAR_FOR(float, f32)
LINEAR_FOR(__half, f16)
LINEAR_FOR(__nv_bfloat16, bf16)
