// The decode matmuls of `candle_offload_kernels::linear` over Q4_K and Q6_K super-blocks
// (on unless KernelTuning::qlinear_k is off): x in its float type, or quantized to 8-bit blocks
// under variants 3 and 4. Each kernel exists once per element type of x.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "reduce.cuh"
#include "q8.cuh"
#include "qblocks.cuh"
#include "kquant.cuh"

// ---------------------------------------------------------------------------------------------
// qlinear_small for K-quant blocks (`qlinear_k_small_m<M>_<q>_<dtype>`, Q4_K and Q6_K), on
// unless KernelTuning::qlinear_k is off: the same contract. Q4_K: super-blocks of 256
// elements, 144 bytes each: d and dmin (f16), 12 bytes of 6-bit sub-block scales and mins, 128
// bytes of 4-bit quants. Element 64p + l of a super-block (p < 4, l < 32) is quant byte
// 32p + l's low nibble times d · scale(2p), less dmin · min(2p); element 64p + 32 + l is its high
// nibble with sub-block 2p + 1's (ggml's dequantize_row_q4_K). One warp per output column (gate
// and up with silu); lane j takes the 64-element pairs j, j + 32, ... of the row: its 32 quant
// bytes in two 16-byte loads (a super-block is 16-byte aligned when its row is), its two scales
// and mins, and for each row of x the 64 x values, whose sum the mins multiply.


// acc[r] += this lane's share of x[r, :] · the Q4_K row at `row` (k / 256 super-blocks), for
// r < m <= M.
template <typename T, int M>
__device__ __forceinline__ void q4k_dot_row(const T *x, const uint8_t *row, uint32_t m,
                                            uint32_t k, float *acc) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t pairs = k >> 6;
    for (uint32_t t = lane; t < pairs; t += 32u) {
        const uint8_t *b = row + (size_t)(t >> 2) * 144u;
        const uint32_t p = t & 3u;
        const float d = __half2float(*reinterpret_cast<const __half *>(b));
        const float dmin = __half2float(*reinterpret_cast<const __half *>(b + 2));
        float sc0, mn0, sc1, mn1;
        q4k_scale_min(b + 4, 2u * p, sc0, mn0);
        q4k_scale_min(b + 4, 2u * p + 1u, sc1, mn1);
        const uint4 *qv = reinterpret_cast<const uint4 *>(b + 16u + 32u * p);
        const uint4 qa = __ldcs(qv), qb = __ldcs(qv + 1);
        const uint32_t qw[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const size_t e0 = (size_t)t * 64u;
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if ((uint32_t)r < m) {
                float s0 = 0.0f, x0 = 0.0f, s1 = 0.0f, x1 = 0.0f;
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    float lo[8], hi[8];
                    cvt8<T>(ld_raw(x + (size_t)r * k + e0 + 8u * u, false), lo);
                    cvt8<T>(ld_raw(x + (size_t)r * k + e0 + 32u + 8u * u, false), hi);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const uint32_t q = (qw[2 * u + i / 4] >> (8 * (i % 4))) & 0xFFu;
                        s0 += (float)(q & 0xFu) * lo[i];
                        x0 += lo[i];
                        s1 += (float)(q >> 4) * hi[i];
                        x1 += hi[i];
                    }
                }
                acc[r] += d * (sc0 * s0 + sc1 * s1) - dmin * (mn0 * x0 + mn1 * x1);
            }
        }
    }
}

// acc[r] += this lane's share of x[r, :] · the Q6_K row at `row` (k / 256 super-blocks of 210
// bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed 8-bit scales of 16 elements,
// d as f16), for r < m <= M. Element 128h + 32j + l of a super-block (h < 2, j < 4, l < 32) is
// low-bit byte 64h + 32(j & 1) + l's nibble j >> 1 with bits 2j of high-bit byte 32h + l above
// it, less 32, times d · scale 8h + 2j + l / 16 (ggml's dequantize_row_q6_K). Lane j takes the
// 64-element units j, j + 32, ...: unit t is super-block t / 4, half h = (t / 2) & 1 and
// l = 16 (t & 1) .. + 16 of every j. Super-blocks are only 2-byte aligned: 16-bit loads.
template <typename T, int M>
__device__ __forceinline__ void q6k_dot_row(const T *x, const uint8_t *row, uint32_t m,
                                            uint32_t k, float *acc) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t units = k >> 6;
    for (uint32_t t = lane; t < units; t += 32u) {
        const uint8_t *b = row + (size_t)(t >> 2) * 210u;
        const uint32_t h = (t >> 1) & 1u, g = t & 1u;
        const uint16_t *lo0 = reinterpret_cast<const uint16_t *>(b + 64u * h + 16u * g);
        const uint16_t *lo1 = reinterpret_cast<const uint16_t *>(b + 64u * h + 32u + 16u * g);
        const uint16_t *hi = reinterpret_cast<const uint16_t *>(b + 128u + 32u * h + 16u * g);
        uint32_t l0[8], l1[8], hb[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            l0[i] = __ldcs(lo0 + i);
            l1[i] = __ldcs(lo1 + i);
            hb[i] = __ldcs(hi + i);
        }
        const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192u + 8u * h + g);
        const float scj[4] = {(float)sc[0], (float)sc[2], (float)sc[4], (float)sc[6]};
        const float d = __half2float(*reinterpret_cast<const __half *>(b + 208));
        const size_t e0 = (size_t)(t >> 2) * 256u + 128u * h + 16u * g;
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if ((uint32_t)r < m) {
                float tot = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float xv[16];
                    cvt8<T>(ld_raw(x + (size_t)r * k + e0 + 32u * j, false), xv);
                    cvt8<T>(ld_raw(x + (size_t)r * k + e0 + 32u * j + 8u, false), xv + 8);
                    float sj = 0.0f;
#pragma unroll
                    for (int i = 0; i < 16; ++i) {
                        const uint32_t lw = (j & 1) ? l1[i / 2] : l0[i / 2];
                        const uint32_t byte = (lw >> (8 * (i % 2))) & 0xFFu;
                        const uint32_t low = (j >> 1) ? (byte >> 4) : (byte & 0xFu);
                        const uint32_t high = ((hb[i / 2] >> (8 * (i % 2))) >> (2 * j)) & 3u;
                        sj += (float)((int)(low | (high << 4)) - 32) * xv[i];
                    }
                    tot += scj[j] * sj;
                }
                acc[r] += d * tot;
            }
        }
    }
}

enum { KT_Q4_K = 0, KT_Q6_K = 1 };
template <int KT> struct KBlock;
template <> struct KBlock<KT_Q4_K> { static constexpr uint32_t BYTES = 144; };
template <> struct KBlock<KT_Q6_K> { static constexpr uint32_t BYTES = 210; };

template <typename T, int M, int KT>
__device__ __forceinline__ void kdot_row(const T *x, const uint8_t *row, uint32_t m, uint32_t k,
                                         float *acc) {
    if constexpr (KT == KT_Q4_K) {
        q4k_dot_row<T, M>(x, row, m, k, acc);
    } else {
        q6k_dot_row<T, M>(x, row, m, k, acc);
    }
}

// qlinear_small's contract (see there) for weights of K-quant blocks KT, k a multiple of 256.
template <typename T, int M, int KT>
__device__ void qlinear_k_small(const T *x, const uint8_t *w0, const uint8_t *w1,
                                const uint8_t *w2, T *y, uint32_t m, uint32_t n0, uint32_t n1,
                                uint32_t n2, uint32_t k, uint32_t silu) {
    const uint32_t row_bytes = (k >> 8) * KBlock<KT>::BYTES;
    column_per_warp<T, M>(w0, w1, w2, y, m, n0, n1, n2, row_bytes, silu,
                          [=](const uint8_t *row, float *acc) {
                              kdot_row<T, M, KT>(x, row, m, k, acc);
                          });
}

// qlinear_k_small_m<M>_<q>_<dtype>: at most M rows of x against weights of K-quant type q.
#define QLINEAR_K_SMALL_ONE(T, SUFFIX, M, KT, QNAME)                                            \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS)                                 \
        qlinear_k_small_m##M##_##QNAME##_##SUFFIX(                                              \
        const T *x, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, T *y, uint32_t m,  \
        uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu) {                     \
        qlinear_k_small<T, M, KT>(x, w0, w1, w2, y, m, n0, n1, n2, k, silu);                    \
    }
#define QLINEAR_K_SMALL_FOR(T, SUFFIX, M)                                                       \
    QLINEAR_K_SMALL_ONE(T, SUFFIX, M, KT_Q4_K, q4_k)                                            \
    QLINEAR_K_SMALL_ONE(T, SUFFIX, M, KT_Q6_K, q6_k)

// qlinear_k_small with R output columns per warp (`qlinear_k2_small_r<R>_m<M>_<q>_<dtype>`,
// opt-in: KernelTuning::qlinear_k_rows = 2): the same contract and results (each dot product
// sums in the same order), but a warp takes columns R·w .. R·w + R (with silu, gate and up of
// each) and each lane loads and converts its share of x once for all of their rows, where one
// column per warp re-reads all of x for every column (F16 x: 4 bytes read for each byte of
// Q4_K weight).
// One lane's 64-element unit t of a Q4_K row (q4k_dot_row's loads): its 32 quant bytes as
// words, d, dmin and its two sub-blocks' scales and mins.
template <int KT> struct KUnit;
template <> struct KUnit<KT_Q4_K> {
    uint32_t qw[8];
    float d, dmin, sc0, mn0, sc1, mn1;
    __device__ __forceinline__ void load(const uint8_t *row, uint32_t t) {
        const uint8_t *b = row + (size_t)(t >> 2) * 144u;
        const uint32_t p = t & 3u;
        d = __half2float(*reinterpret_cast<const __half *>(b));
        dmin = __half2float(*reinterpret_cast<const __half *>(b + 2));
        q4k_scale_min(b + 4, 2u * p, sc0, mn0);
        q4k_scale_min(b + 4, 2u * p + 1u, sc1, mn1);
        const uint4 *qv = reinterpret_cast<const uint4 *>(b + 16u + 32u * p);
        const uint4 qa = __ldcs(qv), qb = __ldcs(qv + 1);
        qw[0] = qa.x, qw[1] = qa.y, qw[2] = qa.z, qw[3] = qa.w;
        qw[4] = qb.x, qw[5] = qb.y, qw[6] = qb.z, qw[7] = qb.w;
    }
};
// acc[j][r] += x[r, unit t] · unit u[j] for every live j < NR and r < m: q4k_dot_row's
// arithmetic (the same order for each sum), x converted once for all NR units. (Q6_K's form
// spilled 600-760 bytes at two columns, ptxas -v, and is not kept.)
template <typename T, int M, int NR>
__device__ __forceinline__ void k_units_dot(const T *x, const KUnit<KT_Q4_K> *u, const bool *live,
                                            uint32_t t, uint32_t m, uint32_t k,
                                            float (*acc)[M]) {
    const size_t e0 = (size_t)t * 64u;
#pragma unroll
    for (int r = 0; r < M; ++r) {
        if ((uint32_t)r < m) {
            float s0[NR], s1[NR], x0 = 0.0f, x1 = 0.0f;
#pragma unroll
            for (int j = 0; j < NR; ++j) s0[j] = 0.0f, s1[j] = 0.0f;
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                float lo[8], hi[8];
                cvt8<T>(ld_raw(x + (size_t)r * k + e0 + 8u * v, false), lo);
                cvt8<T>(ld_raw(x + (size_t)r * k + e0 + 32u + 8u * v, false), hi);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    x0 += lo[i];
                    x1 += hi[i];
#pragma unroll
                    for (int j = 0; j < NR; ++j) {
                        const uint32_t q = (u[j].qw[2 * v + i / 4] >> (8 * (i % 4))) & 0xFFu;
                        s0[j] += (float)(q & 0xFu) * lo[i];
                        s1[j] += (float)(q >> 4) * hi[i];
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < NR; ++j) {
                if (live[j]) {
                    acc[j][r] += u[j].d * (u[j].sc0 * s0[j] + u[j].sc1 * s1[j]) -
                                 u[j].dmin * (u[j].mn0 * x0 + u[j].mn1 * x1);
                }
            }
        }
    }
}
template <typename T, int M, int R, int KT>
__device__ void qlinear_k2_small(const T *x, const uint8_t *w0, const uint8_t *w1,
                                 const uint8_t *w2, T *y, uint32_t m, uint32_t n0, uint32_t n1,
                                 uint32_t n2, uint32_t k, uint32_t silu) {
    constexpr int NR = 2 * R;  // weight rows: with silu gate and up of each column
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t first = (blockIdx.x * OPS_WARPS + (threadIdx.x >> 5)) * R;
    const uint32_t row_bytes = (k >> 8) * KBlock<KT>::BYTES;
    const uint8_t *rows[NR];
    bool live[NR];
    T *yb[R];
    uint32_t cs[R], ns[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
        const uint32_t col = first + j;
        live[j] = false, live[R + j] = false;
        rows[j] = w0, rows[R + j] = w0;
        yb[j] = y, cs[j] = 0, ns[j] = 0;
        if (silu) {
            if (col < n0) {
                live[j] = live[R + j] = true;
                rows[j] = w0 + (size_t)col * row_bytes;
                rows[R + j] = w1 + (size_t)col * row_bytes;
                cs[j] = col, ns[j] = n0;
            }
        } else {
            const uint8_t *w;
            if (pick_column(col, w0, w1, w2, y, m, n0, n1, n2, w, yb[j], cs[j], ns[j])) {
                live[j] = true;
                rows[j] = w + (size_t)cs[j] * row_bytes;
            }
        }
    }
    bool any = false;
#pragma unroll
    for (int j = 0; j < NR; ++j) any |= live[j];
    if (!any) return;
    float acc[NR][M];
#pragma unroll
    for (int j = 0; j < NR; ++j)
#pragma unroll
        for (int r = 0; r < M; ++r) acc[j][r] = 0.0f;
    const uint32_t units = k >> 6;
    for (uint32_t t = lane; t < units; t += 32u) {
        KUnit<KT> u[NR];
#pragma unroll
        for (int j = 0; j < NR; ++j) {
            if (live[j]) u[j].load(rows[j], t);
        }
        if (silu) {
            k_units_dot<T, M, NR>(x, u, live, t, m, k, acc);
        } else {
            // Without silu only the first R rows are live.
            k_units_dot<T, M, R>(x, u, live, t, m, k, acc);
        }
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if ((uint32_t)r < m && live[j]) {
                const float a = warp_sum(acc[j][r]);
                if (silu) {
                    const float up = warp_sum(acc[R + j][r]);
                    if (lane == 0) y[(size_t)r * n0 + cs[j]] = from_f32<T>(a / (1.0f + expf(-a)) * up);
                } else if (lane == 0) {
                    yb[j][(size_t)r * ns[j] + cs[j]] = from_f32<T>(a);
                }
            }
        }
    }
}

// qlinear_small for K-quant blocks with x quantized, in variant 3's and 4's two forms
// (`qlinear3k_small_r<R>_m<M>_<q>_<dtype>`: x quantized by each block of threads into shared
// memory; `qlinear4k_small_r<R>_m<M>_<q>_<dtype>`: x as qlinear4_quantize_x wrote it, a launch
// before), what Q4_K and Q6_K run under variants 3 and 4 (KernelTuning::qlinear). x in 8-bit
// blocks of 32 with scale and quant sum, and the dot products __dp4a over words of four weight
// quants, as llama.cpp's K-quant kernels take them (its q8_1 x), where qlinear_k_small converts
// every weight and x value to float, and the conversions bound that kernel (docs/tuning.md).
// Variant 2's warps and columns (qrows2, qstore2); lane j of a round takes block j
// of 32 elements (one 6-bit-scaled sub-block of Q4_K, two 16-element sub-blocks of Q6_K) of
// each of its R weight rows, reading its quants straight from global memory (the two lanes of
// a Q4_K byte pair, and the four of a Q6_K high-bit group, read the same words in the same
// instruction), and x's block once per row of x.
//
// A block of 32 elements of a K-quant row, as the integer dot products take it: its quants as
// eight words of signed bytes in element order (Q6_K's less 32), the scales s0 of words 0..3
// and s1 of words 4..7, and the min mn (Q4_K's dmin · min; 0 for Q6_K), so that its dot product
// with x's quantized block (scale dx, quants q, their sum sq) is
//     dx (s0 Σ_{g<4} dp4a(w_g, q_g) + s1 Σ_{g≥4} dp4a(w_g, q_g) - mn sq).
struct KQ8Block {
    int q[8];
    float s0, s1, mn;
};
// Eight little-endian words from p, only 2-byte aligned (Q6_K's super-blocks): nine aligned
// word loads and funnel shifts; the ninth word lies inside the same super-block for every use
// below.
__device__ __forceinline__ void ld_words_a2(const uint8_t *p, uint32_t *w) {
    const uint32_t *a = reinterpret_cast<const uint32_t *>((uintptr_t)p & ~(uintptr_t)3);
    const uint32_t sh = ((uint32_t)(uintptr_t)p & 3u) * 8u;
    uint32_t v[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) v[i] = __ldcs(a + i);
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = __funnelshift_r(v[i], v[i + 1], sh);
}
template <int KT> __device__ __forceinline__ void kq8_block(const uint8_t *row, uint32_t b,
                                                           KQ8Block &o);
// Q4_K block b: sub-block j = b % 8 of super-block b / 8, the low (j even) or high nibbles of
// quant bytes 32 (j / 2) .. + 32 (q4k_dot_row's layout).
template <> __device__ __forceinline__ void kq8_block<KT_Q4_K>(const uint8_t *row, uint32_t b,
                                                              KQ8Block &o) {
    const uint8_t *sb = row + (size_t)(b >> 3) * 144u;
    const uint32_t j = b & 7u;
    const uint4 *qv = reinterpret_cast<const uint4 *>(sb + 16u + 32u * (j >> 1));
    const uint4 qa = __ldcs(qv), qb = __ldcs(qv + 1);
    const uint32_t w[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
    const uint32_t sh = 4u * (j & 1u);
#pragma unroll
    for (int i = 0; i < 8; ++i) o.q[i] = (int)((w[i] >> sh) & 0x0F0F0F0Fu);
    const __half2 dm = *reinterpret_cast<const __half2 *>(sb);
    float sc, mn;
    q4k_scale_min(sb + 4, j, sc, mn);
    o.s0 = o.s1 = __low2float(dm) * sc;
    o.mn = __high2float(dm) * mn;
}
// Q6_K block b: within super-block b / 8, half h = (b / 4) % 2 and j = b % 4 (q6k_dot_row's
// element 128h + 32j + l): low bits from bytes 64h + 32 (j % 2) + l, nibble j / 2, high bits
// 2j of bytes 128 + 32h + l, scales 8h + 2j (l < 16) and 8h + 2j + 1.
template <> __device__ __forceinline__ void kq8_block<KT_Q6_K>(const uint8_t *row, uint32_t b,
                                                              KQ8Block &o) {
    const uint8_t *sb = row + (size_t)(b >> 3) * 210u;
    const uint32_t h = (b >> 2) & 1u, j = b & 3u;
    uint32_t lo[8], hi[8];
    ld_words_a2(sb + 64u * h + 32u * (j & 1u), lo);
    ld_words_a2(sb + 128u + 32u * h, hi);
    const uint32_t ls = 4u * (j >> 1), hs = 2u * j;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint32_t v = ((lo[i] >> ls) & 0x0F0F0F0Fu) | (((hi[i] >> hs) & 0x03030303u) << 4);
        o.q[i] = (int)__vsub4(v, 0x20202020u);
    }
    const uint16_t sc = *reinterpret_cast<const uint16_t *>(sb + 192u + 8u * h + 2u * j);
    const float d = sm_f16(sb + 208);
    o.s0 = d * (float)(int8_t)(sc & 0xFFu);
    o.s1 = d * (float)(int8_t)(sc >> 8);
    o.mn = 0.0f;
}
// acc + the block's dot product with x's block (lo, hi, s) (the formula above).
__device__ __forceinline__ float kq8_dot(const KQ8Block &w, const uint4 &lo, const uint4 &hi,
                                         const XBlock8 &s, float acc) {
    const int a = dp4a4(w.q, lo, 0), c = dp4a4(w.q + 4, hi, 0);
    return fmaf(s.d, w.s0 * (float)a + w.s1 * (float)c - w.mn * (float)s.sum, acc);
}
// qlinear_small's contract for K-quant weights, x given as qlinear4_quantize_x wrote it, the
// blocks' scales and sums at xs (rows of nbp each: a chunk of a larger buffer's rows can be
// read, xq and xs at its first row).
template <typename T, int M, int KT, int R>
__device__ void qlinear4k_small_at(const uint4 *xq, const XBlock8 *xs, const uint8_t *w0,
                                   const uint8_t *w1, const uint8_t *w2, T *y, uint32_t m,
                                   uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k,
                                   uint32_t silu) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t gw = blockIdx.x * OPS_WARPS + (threadIdx.x >> 5);
    const size_t row_bytes = (size_t)(k >> 8) * KBlock<KT>::BYTES;
    const uint8_t *rows[R];
    uint32_t col0;
    if (!qrows2<T, R>(gw, w0, w1, w2, y, m, n0, n1, n2, row_bytes, silu, col0, rows)) return;
    const uint32_t nb = k >> 5;
    const uint32_t nbp = q8_row_blocks(k);
    float acc[R][M];
#pragma unroll
    for (int w = 0; w < R; ++w)
#pragma unroll
        for (int r = 0; r < M; ++r) acc[w][r] = 0.0f;
#pragma unroll 2
    for (uint32_t b = lane; b < nb; b += 32u) {
        if (M == 1) {
            uint4 lo, hi;
            XBlock8 s;
            load_xblock(xq, xs, nbp, 0, b, lo, hi, s);
#pragma unroll
            for (int w = 0; w < R; ++w) {
                KQ8Block q;
                kq8_block<KT>(rows[w], b, q);
                acc[w][0] = kq8_dot(q, lo, hi, s, acc[w][0]);
            }
        } else {
#pragma unroll
            for (int w = 0; w < R; ++w) {
                KQ8Block q;
                kq8_block<KT>(rows[w], b, q);
#pragma unroll
                for (int r = 0; r < M; ++r) {
                    if ((uint32_t)r < m) {
                        uint4 lo, hi;
                        XBlock8 s;
                        load_xblock(xq, xs, nbp, r, b, lo, hi, s);
                        acc[w][r] = kq8_dot(q, lo, hi, s, acc[w][r]);
                    }
                }
            }
        }
    }
    qstore2<T, M, R>(acc, col0, w0, w1, w2, y, m, n0, n1, n2, row_bytes, silu);
}

// qlinear4k_small: qlinear4k_small_at over the whole buffer qlinear4_quantize_x wrote for m
// rows.
template <typename T, int M, int KT, int R>
__device__ void qlinear4k_small(const uint4 *xq, const uint8_t *w0, const uint8_t *w1,
                                const uint8_t *w2, T *y, uint32_t m, uint32_t n0, uint32_t n1,
                                uint32_t n2, uint32_t k, uint32_t silu) {
    const XRows8 x = xq_rows_from(xq, m, k, 0);
    qlinear4k_small_at<T, M, KT, R>(x.q, x.s, w0, w1, w2, y, m, n0, n1, n2, k, silu);
}

// qlinear4k_small with x quantized by each block of threads (variant 3's quantize_x, in chunks
// of xblocks blocks; dynamic shared memory m · xblocks · 40 bytes), no launch before. With S > 1
// a block of threads has S · OPS_WARPS warps: S warps take each group of columns, warp s of
// them the rounds s, s + S, ... of each chunk's blocks (more warps in flight where the grid is
// small: a 4096-column projection is 512 blocks of 4 warps), and adds its sums to the first's
// through shared memory before that one stores them.
template <typename T, int M, int KT, int R, int S>
__device__ void qlinear3k_small(const T *x, const uint8_t *w0, const uint8_t *w1,
                                const uint8_t *w2, T *y, uint32_t m, uint32_t n0, uint32_t n1,
                                uint32_t n2, uint32_t k, uint32_t silu, uint32_t xblocks) {
    extern __shared__ uint4 qstage[];
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t wi = threadIdx.x >> 5;
    const uint32_t split = wi / OPS_WARPS, group = wi % OPS_WARPS;
    const uint32_t gw = blockIdx.x * OPS_WARPS + group;
    const size_t row_bytes = (size_t)(k >> 8) * KBlock<KT>::BYTES;
    uint4 *xq = qstage;
    XBlock8 *xs = reinterpret_cast<XBlock8 *>(xq + (size_t)m * 2u * xblocks);
    const uint8_t *rows[R];
    uint32_t col0;
    // A warp without columns (in the grid's last block of threads) still quantizes its share
    // of x and meets the barriers.
    const bool active = qrows2<T, R>(gw, w0, w1, w2, y, m, n0, n1, n2, row_bytes, silu, col0, rows);
    float acc[R][M];
#pragma unroll
    for (int w = 0; w < R; ++w)
#pragma unroll
        for (int r = 0; r < M; ++r) acc[w][r] = 0.0f;
    const uint32_t nb = k >> 5;
    for (uint32_t c0 = 0; c0 < nb; c0 += xblocks) {
        const uint32_t cn = min(xblocks, nb - c0);
        __syncthreads();  // every warp is done with the previous chunk of x
        quantize_x<T>(x, m, k, c0, cn, xblocks, xq, xs);
        __syncthreads();
        if (!active) continue;
        for (uint32_t j = lane + 32u * split; j < cn; j += 32u * S) {
            // Block j of the chunk: its x halves at lane of their sweeps (j % 32 == lane).
            const uint32_t xv = (j >> 5) * 64u + lane;
#pragma unroll
            for (int w = 0; w < R; ++w) {
                KQ8Block q;
                kq8_block<KT>(rows[w], c0 + j, q);
#pragma unroll
                for (int r = 0; r < M; ++r) {
                    if ((uint32_t)r < m) {
                        const uint4 *xr = xq + (size_t)r * 2u * xblocks + xv;
                        acc[w][r] = kq8_dot(q, xr[0], xr[32], xs[(size_t)r * xblocks + j],
                                            acc[w][r]);
                    }
                }
            }
        }
    }
    if constexpr (S > 1) {
        // Each lane's sums of the later splits, added to the first split's lane.
        __shared__ float part[(S - 1) * OPS_WARPS * R * M * 32];
        if (split > 0) {
            float *mine = part + (size_t)((split - 1) * OPS_WARPS + group) * R * M * 32;
#pragma unroll
            for (int w = 0; w < R; ++w)
#pragma unroll
                for (int r = 0; r < M; ++r) mine[(w * M + r) * 32 + lane] = acc[w][r];
        }
        __syncthreads();
        if (split == 0) {
            for (uint32_t t = 1; t < (uint32_t)S; ++t) {
                const float *other = part + (size_t)((t - 1) * OPS_WARPS + group) * R * M * 32;
#pragma unroll
                for (int w = 0; w < R; ++w)
#pragma unroll
                    for (int r = 0; r < M; ++r) acc[w][r] += other[(w * M + r) * 32 + lane];
            }
        }
    }
    if (active && split == 0)
        qstore2<T, M, R>(acc, col0, w0, w1, w2, y, m, n0, n1, n2, row_bytes, silu);
}

// qlinear_k2_small_r<R>_m<M>_<q>_<dtype>: qlinear_k_small's arguments, R columns per warp.
#define QLINEAR_K2_SMALL_ONE(T, SUFFIX, M, R, KT, QNAME)                                        \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS)                                 \
        qlinear_k2_small_r##R##_m##M##_##QNAME##_##SUFFIX(                                      \
        const T *x, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, T *y, uint32_t m,  \
        uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu) {                     \
        qlinear_k2_small<T, M, R, KT>(x, w0, w1, w2, y, m, n0, n1, n2, k, silu);                \
    }
// Q4_K only, R = 2, up to 2 rows of x: ptxas -v (sm_90) gives 128 registers for one row and
// 148 for two without spills; Q6_K's units (24 words each) spilled 600-760 bytes at R = 2, and
// R = 4 took all 255 registers, so those are not built.
#define QLINEAR_K2_SMALL_ALL(T, SUFFIX)                                                         \
    QLINEAR_K2_SMALL_ONE(T, SUFFIX, 1, 2, KT_Q4_K, q4_k)                                        \
    QLINEAR_K2_SMALL_ONE(T, SUFFIX, 2, 2, KT_Q4_K, q4_k)
// qlinear4k_small_r<R>_m<M>_<q>_<dtype>: qlinear4k_small, variant 4's arguments, R weight rows
// per warp; variant 4's instances (R = 2 up to 8 rows of x, R = 4 up to 2). At most 80 registers
// (6 blocks of 4 warps per SM): within 64, ptxas -v (sm_90) spilled 4-128 bytes in most of
// them (two rounds of blocks in flight per lane, `unroll 2`); within 80 only R = 4 with one
// row still spills (12 bytes for Q4_K, 76 for Q6_K). qlinear3k_small's instances take 54-80
// registers without spills.
#define QLINEAR4K_SMALL_FOR(T, SUFFIX, M, R)                                                    \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 6)                              \
        qlinear4k_small_r##R##_m##M##_q4_k_##SUFFIX(                                            \
        const uint4 *xq, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, T *y,         \
        uint32_t m, uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu) {         \
        qlinear4k_small<T, M, KT_Q4_K, R>(xq, w0, w1, w2, y, m, n0, n1, n2, k, silu);           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 6)                              \
        qlinear4k_small_r##R##_m##M##_q6_k_##SUFFIX(                                            \
        const uint4 *xq, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, T *y,         \
        uint32_t m, uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu) {         \
        qlinear4k_small<T, M, KT_Q6_K, R>(xq, w0, w1, w2, y, m, n0, n1, n2, k, silu);           \
    }
// qlinear3k_small_r<R>_m<M>_<q>_<dtype>: qlinear3k_small, variant 3's arguments (x's chunk
// length last), the instances and register bound of qlinear4k_small's; qlinear3ks2_small_...
// the same with two warps a column group (S = 2, blocks of 8 warps), up to 2 rows of x.
#define QLINEAR3K_SMALL_ONE(T, SUFFIX, M, R, S, NAME, KT, QNAME)                                \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS * S, 6 / S)                      \
        NAME##_small_r##R##_m##M##_##QNAME##_##SUFFIX(                                          \
        const T *x, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, T *y, uint32_t m,  \
        uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu, uint32_t xblocks) {   \
        qlinear3k_small<T, M, KT, R, S>(x, w0, w1, w2, y, m, n0, n1, n2, k, silu, xblocks);     \
    }
#define QLINEAR3K_SMALL_FOR(T, SUFFIX, M, R)                                                    \
    QLINEAR3K_SMALL_ONE(T, SUFFIX, M, R, 1, qlinear3k, KT_Q4_K, q4_k)                           \
    QLINEAR3K_SMALL_ONE(T, SUFFIX, M, R, 1, qlinear3k, KT_Q6_K, q6_k)
#define QLINEAR3KS2_SMALL_FOR(T, SUFFIX, M, R)                                                  \
    QLINEAR3K_SMALL_ONE(T, SUFFIX, M, R, 2, qlinear3ks2, KT_Q4_K, q4_k)                         \
    QLINEAR3K_SMALL_ONE(T, SUFFIX, M, R, 2, qlinear3ks2, KT_Q6_K, q6_k)
#define QLINEAR4K_SMALL_ALL(T, SUFFIX)                                                          \
    QLINEAR4K_SMALL_FOR(T, SUFFIX, 1, 2)                                                        \
    QLINEAR4K_SMALL_FOR(T, SUFFIX, 2, 2)                                                        \
    QLINEAR4K_SMALL_FOR(T, SUFFIX, 4, 2)                                                        \
    QLINEAR4K_SMALL_FOR(T, SUFFIX, 8, 2)                                                        \
    QLINEAR4K_SMALL_FOR(T, SUFFIX, 1, 4)                                                        \
    QLINEAR4K_SMALL_FOR(T, SUFFIX, 2, 4)                                                        \
    QLINEAR3K_SMALL_FOR(T, SUFFIX, 1, 2)                                                        \
    QLINEAR3K_SMALL_FOR(T, SUFFIX, 2, 2)                                                        \
    QLINEAR3K_SMALL_FOR(T, SUFFIX, 4, 2)                                                        \
    QLINEAR3K_SMALL_FOR(T, SUFFIX, 8, 2)                                                        \
    QLINEAR3K_SMALL_FOR(T, SUFFIX, 1, 4)                                                        \
    QLINEAR3K_SMALL_FOR(T, SUFFIX, 2, 4)                                                        \
    QLINEAR3KS2_SMALL_FOR(T, SUFFIX, 1, 2)                                                      \
    QLINEAR3KS2_SMALL_FOR(T, SUFFIX, 2, 2)                                                      \
    QLINEAR3KS2_SMALL_FOR(T, SUFFIX, 1, 4)                                                      \
    QLINEAR3KS2_SMALL_FOR(T, SUFFIX, 2, 4)

// qlinear3k_experts_r<R>_<q>_<dtype>: qlinear3k_small for one row of x over a group of
// experts, with qlinear3_experts_r<R>_<q>_<dtype>'s arguments and layout (linear_q8.cu);
// qlinear3k_experts_at_r<R>_<q>_<dtype>, g read from device memory.
#define QLINEAR3K_EXPERTS_ONE(T, SUFFIX, R, KT, QNAME)                                          \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 6)                              \
        qlinear3k_experts_r##R##_##QNAME##_##SUFFIX(                                            \
        const T *x, uint32_t x_stride, GroupWeights g, T *y, uint32_t n0, uint32_t n1,          \
        uint32_t k, uint32_t silu, uint32_t xblocks) {                                          \
        const uint32_t e = blockIdx.y;                                                          \
        qlinear3k_small<T, 1, KT, R, 1>(x + (size_t)e * x_stride, g.w0[e], g.w1[e], g.w0[e],    \
                                        y + (size_t)e * (silu ? n0 : n0 + n1), 1u, n0, n1, 0u,  \
                                        k, silu, xblocks);                                      \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 6)                              \
        qlinear3k_experts_at_r##R##_##QNAME##_##SUFFIX(                                         \
        const T *x, uint32_t x_stride, const GroupWeights *g, T *y, uint32_t n0, uint32_t n1,   \
        uint32_t k, uint32_t silu, uint32_t xblocks) {                                          \
        const uint32_t e = blockIdx.y;                                                          \
        qlinear3k_small<T, 1, KT, R, 1>(x + (size_t)e * x_stride, g->w0[e], g->w1[e], g->w0[e], \
                                        y + (size_t)e * (silu ? n0 : n0 + n1), 1u, n0, n1, 0u,  \
                                        k, silu, xblocks);                                      \
    }
#define QLINEAR3K_EXPERTS_ALL(T, SUFFIX)                                                        \
    QLINEAR3K_EXPERTS_ONE(T, SUFFIX, 2, KT_Q4_K, q4_k)                                          \
    QLINEAR3K_EXPERTS_ONE(T, SUFFIX, 4, KT_Q4_K, q4_k)                                          \
    QLINEAR3K_EXPERTS_ONE(T, SUFFIX, 2, KT_Q6_K, q6_k)                                          \
    QLINEAR3K_EXPERTS_ONE(T, SUFFIX, 4, KT_Q6_K, q6_k)

// qlinear3k_rows_experts_<q>_<dtype>: qlinear3_rows_experts_<q>_<dtype>'s arguments and
// contract (linear_q8.cu) for K-quant blocks, qlinear3k_small_r2_m8 per chunk.
#define QLINEAR3K_ROWS_EXPERTS_ONE(T, SUFFIX, KT, QNAME)                                        \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 6)                              \
        qlinear3k_rows_experts_##QNAME##_##SUFFIX(                                              \
        const T *x, const uint64_t *w0, const uint64_t *w1, const RowChunk *chunks, T *y,       \
        uint32_t n0, uint32_t k, uint32_t silu, uint32_t xblocks) {                             \
        const RowChunk c = chunks[blockIdx.y];                                                  \
        const uint8_t *a = reinterpret_cast<const uint8_t *>(w0[c.expert]);                     \
        const uint8_t *b = reinterpret_cast<const uint8_t *>(w1[c.expert]);                     \
        qlinear3k_small<T, ROWS_CHUNK_MAX, KT, 2, 1>(x + (size_t)c.row * k, a, b, a,            \
                                                     y + (size_t)c.row * n0, c.rows, n0,        \
                                                     silu ? n0 : 0u, 0u, k, silu, xblocks);     \
    }
// qlinear3k_rows_expert_<q>_<dtype>: qlinear3_rows_expert_<q>_<dtype>'s arguments and contract
// (linear_q8.cu) for K-quant blocks.
#define QLINEAR3K_ROWS_EXPERT_ONE(T, SUFFIX, KT, QNAME)                                         \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 6)                              \
        qlinear3k_rows_expert_##QNAME##_##SUFFIX(                                               \
        const T *x, const uint8_t *w0, const uint8_t *w1, T *y, uint32_t rows, uint32_t n0,     \
        uint32_t k, uint32_t silu, uint32_t xblocks) {                                          \
        const uint32_t row = blockIdx.y * ROWS_CHUNK_MAX;                                       \
        qlinear3k_small<T, ROWS_CHUNK_MAX, KT, 2, 1>(                                           \
            x + (size_t)row * k, w0, w1, w0, y + (size_t)row * n0,                              \
            min((uint32_t)ROWS_CHUNK_MAX, rows - row), n0, silu ? n0 : 0u, 0u, k, silu,         \
            xblocks);                                                                           \
    }
// qlinear4k_rows_experts_<q>_<dtype> and qlinear4k_rows_expert_<q>_<dtype>: the arguments and
// contracts of qlinear4_rows_experts_<q>_<dtype> and qlinear4_rows_expert_<q>_<dtype>
// (linear_q8.cu) for K-quant blocks, qlinear4k_small_r2_m8 per chunk.
#define QLINEAR4K_ROWS_EXPERTS_ONE(T, SUFFIX, KT, QNAME)                                        \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 6)                              \
        qlinear4k_rows_experts_##QNAME##_##SUFFIX(                                              \
        const uint4 *xq, uint32_t rows, const uint64_t *w0, const uint64_t *w1,                 \
        const RowChunk *chunks, T *y, uint32_t n0, uint32_t k, uint32_t silu) {                 \
        const RowChunk c = chunks[blockIdx.y];                                                  \
        const uint8_t *a = reinterpret_cast<const uint8_t *>(w0[c.expert]);                     \
        const uint8_t *b = reinterpret_cast<const uint8_t *>(w1[c.expert]);                     \
        const XRows8 x = xq_rows_from(xq, rows, k, c.row);                                      \
        qlinear4k_small_at<T, ROWS_CHUNK_MAX, KT, 2>(x.q, x.s, a, b, a, y + (size_t)c.row * n0, \
                                                     c.rows, n0, silu ? n0 : 0u, 0u, k, silu);  \
    }
#define QLINEAR4K_ROWS_EXPERT_ONE(T, SUFFIX, KT, QNAME)                                         \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 6)                              \
        qlinear4k_rows_expert_##QNAME##_##SUFFIX(                                               \
        const uint4 *xq, const uint8_t *w0, const uint8_t *w1, T *y, uint32_t rows,             \
        uint32_t n0, uint32_t k, uint32_t silu) {                                               \
        const uint32_t row = blockIdx.y * ROWS_CHUNK_MAX;                                       \
        const XRows8 x = xq_rows_from(xq, rows, k, row);                                        \
        qlinear4k_small_at<T, ROWS_CHUNK_MAX, KT, 2>(                                           \
            x.q, x.s, w0, w1, w0, y + (size_t)row * n0,                                         \
            min((uint32_t)ROWS_CHUNK_MAX, rows - row), n0, silu ? n0 : 0u, 0u, k, silu);        \
    }
#define LINEAR_K_FOR(T, SUFFIX)                                                                 \
    QLINEAR4K_ROWS_EXPERT_ONE(T, SUFFIX, KT_Q4_K, q4_k)                                         \
    QLINEAR4K_ROWS_EXPERT_ONE(T, SUFFIX, KT_Q6_K, q6_k)                                         \
    QLINEAR4K_ROWS_EXPERTS_ONE(T, SUFFIX, KT_Q4_K, q4_k)                                        \
    QLINEAR4K_ROWS_EXPERTS_ONE(T, SUFFIX, KT_Q6_K, q6_k)                                        \
    QLINEAR3K_ROWS_EXPERT_ONE(T, SUFFIX, KT_Q4_K, q4_k)                                         \
    QLINEAR3K_ROWS_EXPERT_ONE(T, SUFFIX, KT_Q6_K, q6_k)                                         \
    QLINEAR3K_ROWS_EXPERTS_ONE(T, SUFFIX, KT_Q4_K, q4_k)                                        \
    QLINEAR3K_ROWS_EXPERTS_ONE(T, SUFFIX, KT_Q6_K, q6_k)                                        \
    QLINEAR3K_EXPERTS_ALL(T, SUFFIX)                                                            \
    QLINEAR_K2_SMALL_ALL(T, SUFFIX)                                                             \
    QLINEAR4K_SMALL_ALL(T, SUFFIX)                                                              \
    QLINEAR_K_SMALL_FOR(T, SUFFIX, 1)                                                           \
    QLINEAR_K_SMALL_FOR(T, SUFFIX, 2)                                                           \
    QLINEAR_K_SMALL_FOR(T, SUFFIX, 4)                                                           \
    QLINEAR_K_SMALL_FOR(T, SUFFIX, 8)

LINEAR_K_FOR(float, f32)
LINEAR_K_FOR(__half, f16)
LINEAR_K_FOR(__nv_bfloat16, bf16)
