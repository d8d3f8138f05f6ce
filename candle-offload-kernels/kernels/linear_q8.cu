// Variants 3 and 4 of the decode matmuls over GGML blocks of 32 elements
// (`candle_offload_kernels::linear`, KernelTuning::qlinear): x quantized to 8-bit blocks and
// integer dot products, x quantized by each block of threads (variant 3) or once per call by
// qlinear4_quantize_x (variant 4). Each kernel exists once per element type of x.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "reduce.cuh"
#include "q8.cuh"
#include "qblocks.cuh"

// ---------------------------------------------------------------------------------------------
// qlinear_small, variant 3 (`qlinear3_small_r<R>_m<M>_<q>_<dtype>`): variant 2's grid, warps
// and staged weight rows, but x quantized to 8 bits in blocks of 32, as integer dot products of
// four bytes at once (__dp4a) take it, instead of every weight converted to float and
// multiplied on its own.
//
// x's block of 32 values v (one row) becomes d = amax |v| / 127, quants q = v · (127 / amax)
// rounded to nearest (ties to even; a multiplication per value rather than a division by d;
// all 0 when 127 / amax is not finite) and their sum sq = Σ q. A weight block of scale
// dw, quants n, offset o (8 for Q4_0, 16 for Q5_0, else 0) and min mw (Q4_1, Q5_1, else 0)
// holds elements dw (n - o) + mw, so its dot product with the quantized x is
//     Σ (dw (n - o) + mw) d q = dw d (Σ n q - o sq) + mw d sq,
// with Σ n q from eight __dp4a over the block (n and q fit signed bytes: n < 32, or Q8_0's
// signed quants). These are the results: exactly x rounded to its blocks times the
// dequantized weights, but for f32 rounding of the few float terms per block.
//
// Each block of threads quantizes the rows of x it needs into shared memory itself, in chunks
// of `xblocks` blocks (all of k when they fit, as for every shape of a 7B model with 1 or 2
// rows), rather than in a launch of its own: the decode step already makes ~360 launches per
// token, and a separate pass would add one per matmul plus a round trip of x through memory.
// The redundancy, per block of threads and 32 elements of k: it streams 4 R weight rows from
// memory, 4 R · 18 = 288 bytes of Q4_0 for R = 4 (544 of Q8_0), and quantizing reads m · 64
// bytes of f16 x from L2 (every block of threads reads the same x, 22% of its weight bytes
// for one row of Q4_0, where variant 2's warps each read all of x). In instructions, a
// thread quantizes m k / 128 elements at about 8 each (load, |v|, max, multiply, round, pack,
// sum), about half of its share of the dot products for one row (k / 32 blocks of R rows over
// 32 lanes, ~30 each), which the block of threads issues before anything else; its first
// weight copies go out before that, so that their latency overlaps it.

// Where variant 3 keeps x's quantized blocks: per row of x, the 32 quants of the chunk's block
// b as two 16-byte halves h at vector (b / 32) 64 + 32 h + b % 32 (a warp, whose lanes take 32
// consecutive blocks, reads one half of each in one conflict-free sweep of 512 bytes), then,
// after all the rows' quants, each block's scale d and quant sum sq.
// (XBlock8, quantize8 and quantize_x, which variant 4's writers share, are in q8.cuh.)

// The block at b's quants n as the eight words __dp4a takes: word g holds elements
// 4g .. 4g + 3, one per byte (x's words in the same order).
// The 16 bytes of 4-bit quants at qs as eight words: low nibbles (elements 0..15) first.
__device__ __forceinline__ void nibble_words(const uint8_t *qs, int *q) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const uint32_t w = sm_u32(qs + 4 * t);
        q[t] = (int)(w & 0x0F0F0F0Fu);
        q[t + 4] = (int)((w >> 4) & 0x0F0F0F0Fu);
    }
}
template <int QT> __device__ __forceinline__ void quant_words(const uint8_t *b, int *q);
template <> __device__ __forceinline__ void quant_words<QT_Q4_0>(const uint8_t *b, int *q) {
    nibble_words(b + 2, q);  // after d
}
template <> __device__ __forceinline__ void quant_words<QT_Q4_1>(const uint8_t *b, int *q) {
    nibble_words(b + 4, q);  // after d and m
}
// Q5: decode4_q5's layout, the 5th bits of word g's elements from bits 4g .. 4g + 3 of qh.
__device__ __forceinline__ void quant_words_q5(const uint8_t *qh_at, const uint8_t *qs, int *q) {
    const uint32_t qh = sm_u32(qh_at);
#pragma unroll
    for (int g = 0; g < 8; ++g) {
        const uint32_t w = sm_u32(qs + 4 * (g & 3));
        const uint32_t lo = g < 4 ? w & 0x0F0F0F0Fu : (w >> 4) & 0x0F0F0F0Fu;
        q[g] = (int)(lo | (((((qh >> (4 * g)) & 0xFu) * 0x00204081u) & 0x01010101u) << 4));
    }
}
template <> __device__ __forceinline__ void quant_words<QT_Q5_0>(const uint8_t *b, int *q) {
    quant_words_q5(b + 2, b + 6, q);
}
template <> __device__ __forceinline__ void quant_words<QT_Q5_1>(const uint8_t *b, int *q) {
    quant_words_q5(b + 4, b + 8, q);
}
template <> __device__ __forceinline__ void quant_words<QT_Q8_0>(const uint8_t *b, int *q) {
#pragma unroll
    for (int g = 0; g < 8; ++g) q[g] = (int)sm_u32(b + 2 + 4 * g);
}
// The offset o of each type's quants (elements dw (n - o) + mw).
template <int QT> struct QOffset { static constexpr int O = 0; };
template <> struct QOffset<QT_Q4_0> { static constexpr int O = 8; };
template <> struct QOffset<QT_Q5_0> { static constexpr int O = 16; };

// acc + the dot product of a weight block at b (quants q as quant_words gives them, scale dw)
// with a block of quantized x (its quants' halves lo and hi, scale and sum s): variants 3 and
// 4's terms.
// acc + the dot products of four words of quants q with x's four words v, in order.
template <int QT>
__device__ __forceinline__ float qdot8(const int *q, float dw, const uint8_t *b, const uint4 &lo,
                                       const uint4 &hi, const XBlock8 &s, float acc) {
    int dot = dp4a4(q + 4, hi, dp4a4(q, lo, 0));
    dot -= QOffset<QT>::O * s.sum;
    float a = fmaf(dw * s.d, (float)dot, acc);
    if (QBlock<QT>::MIN) a = fmaf(sm_f16(b + 2) * s.d, (float)s.sum, a);
    return a;
}

// qlinear_small's contract, variant 3: variant 2's columns per warp (qrows2), with x quantized
// (see above) in chunks of xblocks blocks (a multiple of 32). Dynamic shared memory: variant
// 2's R * QStage2::VECS 16-byte vectors per warp, then m * xblocks * 40 bytes of x's blocks.
template <typename T, int M, int QT, int R>
__device__ void qlinear_small3(const T *x, const uint8_t *w0, const uint8_t *w1,
                               const uint8_t *w2, T *y, uint32_t m, uint32_t n0, uint32_t n1,
                               uint32_t n2, uint32_t k, uint32_t silu, uint32_t xblocks) {
    constexpr int B = QBlock<QT>::BYTES;
    constexpr uint32_t BLOCKS = QStage2<QT>::BLOCKS;
    extern __shared__ uint4 qstage[];
    const uint32_t warp = threadIdx.x >> 5;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t gw = blockIdx.x * OPS_WARPS + warp;
    const size_t row_bytes = (size_t)(k >> 5) * B;
    uint4 *st = qstage + (size_t)warp * R * QStage2<QT>::VECS;
    uint4 *xq = qstage + (size_t)OPS_WARPS * R * QStage2<QT>::VECS;
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
        const uint8_t *at[R];
        if (active) stage_rows_async<QT, R>(rows, c0, min(BLOCKS, cn), st, at);
        __syncthreads();  // every warp is done with the previous chunk of x
        quantize_x<T>(x, m, k, c0, cn, xblocks, xq, xs);
        __syncthreads();
        if (!active) continue;
        for (uint32_t f = 0; f < cn; f += BLOCKS) {
            const uint32_t count = min(BLOCKS, cn - f);
            if (f > 0) stage_rows_async<QT, R>(rows, c0 + f, count, st, at);
            asm volatile("cp.async.wait_all;\n" ::);
            __syncwarp();
            for (uint32_t j = lane; j < count; j += 32u) {
                // Block f + j of the chunk; its x halves sit at lane of their sweeps.
                const uint32_t xv = ((f + j) >> 5) * 64u + lane;
#pragma unroll
                for (int w = 0; w < R; ++w) {
                    const uint8_t *b = at[w] + j * B;
                    int q[8];
                    quant_words<QT>(b, q);
                    const float dw = sm_f16(b);
#pragma unroll
                    for (int r = 0; r < M; ++r) {
                        if ((uint32_t)r < m) {
                            const uint4 *xr = xq + (size_t)r * 2u * xblocks + xv;
                            const uint4 lo = xr[0], hi = xr[32];
                            const XBlock8 s = xs[(size_t)r * xblocks + f + j];
                            acc[w][r] = qdot8<QT>(q, dw, b, lo, hi, s, acc[w][r]);
                        }
                    }
                }
            }
            // The stage is rewritten next round only after every lane has read its blocks.
            __syncwarp();
        }
    }
    if (active) qstore2<T, M, R>(acc, col0, w0, w1, w2, y, m, n0, n1, n2, row_bytes, silu);
}

// ---------------------------------------------------------------------------------------------
// qlinear_small, variant 4 (`qlinear4_quantize_x_<dtype>`, then
// `qlinear4_small_r<R>_m<M>_<q>_<dtype>`): variant 3's arithmetic, x quantized once per call
// instead of once per block of threads. A first launch quantizes the m rows of x into a device
// buffer (quantize8, so the blocks are exactly variant 3's); the matmul kernel, variant 2's
// grid, warps and staged weight rows, reads each lane's block of quantized x straight from
// global memory through the read-only path (two 16-byte loads of quants and one 8-byte load of
// d and sq; the few KB of x stay in L1 and L2) and takes variant 3's __dp4a dot products. No
// shared memory for x (variant 2's 19 KB per block of threads of Q4_0, not variant 3's 24-33),
// and every element of x is quantized once, not once per block of threads.
//
// The buffer, for nbp = k / 32 rounded up to a multiple of 32 blocks per row: first the quants,
// per row 2 nbp 16-byte vectors in variant 3's order (the two halves of block b at vectors
// (b / 32) 64 + b % 32 and 32 further, so that a warp's 32 consecutive blocks are two
// coalesced 512-byte sweeps), then the m nbp XBlock8 of the rows' blocks (d and sq); 40 bytes
// per block in all. Blocks b >= k / 32 of a row's last 32 are written as zeros and never read.

// x's quants for the matmul kernels of variant 4, m rows of k (a multiple of 32) into xq
// (m nbp 40 bytes, the layout above). Blocks of 128 threads, m nbp / 32 of them (so the
// threads cover exactly the m rows of nbp blocks, 4 threads a block of 32; a warp lies in
// one row).
template <typename T>
__device__ void qlinear4_quantize_x(const T *x, uint4 *xq, uint32_t m, uint32_t k) {
    const uint32_t nb = k >> 5;
    const uint32_t nbp = q8_row_blocks(k);
    const uint32_t per_row = nbp * 4u;  // a multiple of 128: whole warps per row
    const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t r = t / per_row;
    if (r >= m) return;  // the whole warp (none with the launcher's grid)
    const uint32_t e = t - r * per_row;
    const uint32_t b = e >> 2, p = e & 3u;
    float v[8];
    if (b < nb) {
        cvt8<T>(ld_raw(x + (size_t)r * k + 8u * e, false), v);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    }
    quantize8_store(v, true, xq, m, nbp, r, b, p);
}

// With silu and yq (not null), qlinear_small4 also writes its output y (m rows of n0, n0 a
// multiple of 32) quantized into yq, variant 4's buffer for the down projection's x, as
// qlinear4_quantize_x would quantize y. A group of 32 columns is quantized by the last warp to
// store one of them: after its stores, lane 0 of each warp adds its C columns to the group's
// counter (after a fence: the stores are seen before the count); the warp that brings it to 32
// sets it back to 0 for the next launch on the stream and, after a fence, reads the group's
// 32 columns of every row from L2 (lane l: row l / 4, part l % 4; m <= 8) and quantizes them.
template <typename T, int C>
__device__ __forceinline__ void silu_group_q8(const T *y, uint4 *yq, uint32_t *counters,
                                              uint32_t m, uint32_t n0, uint32_t col0) {
    static_assert(32 % C == 0, "a warp's columns lie in one group of 32");
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t g = col0 >> 5;
    uint32_t done = 0;
    if (lane == 0) {
        __threadfence();
        done = atomicAdd(counters + g, (uint32_t)C) + C;
    }
    if (__shfl_sync(0xffffffffu, done, 0) != 32u) return;
    __threadfence();
    if (lane == 0) counters[g] = 0;
    const uint32_t r = lane >> 2, p = lane & 3u;
    float v[8];
    const T *src = y + (size_t)r * n0 + 32u * g + 8u * p;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = r < m ? ld_cg_f32(src + i) : 0.0f;
    quantize8_store(v, r < m, yq, m, q8_row_blocks(n0), r, g, p);
}

// qlinear_small's contract, variant 4, x given as qlinear4_quantize_x wrote it (xq; m and k as
// it had them). Dynamic shared memory: variant 2's R * QStage2::VECS 16-byte vectors per warp.
// Columns per warp as in variant 2 (qrows2, qstore2); lane j of a round takes block j of the
// staged blocks of every row, as there.
// qlinear_small4_at: the same with the blocks' scales and sums at xs (rows of nbp each),
// so that a chunk of a larger buffer's rows can be read: xq and xs at its first row.
template <typename T, int M, int QT, int R>
__device__ void qlinear_small4_at(const uint4 *xq, const XBlock8 *xs, const uint8_t *w0,
                                  const uint8_t *w1, const uint8_t *w2, T *y, uint32_t m,
                                  uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k,
                                  uint32_t silu, uint4 *yq, uint32_t *counters) {
    constexpr int B = QBlock<QT>::BYTES;
    constexpr uint32_t BLOCKS = QStage2<QT>::BLOCKS;
    extern __shared__ uint4 qstage[];
    const uint32_t warp = threadIdx.x >> 5;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t gw = blockIdx.x * OPS_WARPS + warp;
    const size_t row_bytes = (size_t)(k >> 5) * B;
    uint4 *st = qstage + (size_t)warp * R * QStage2<QT>::VECS;
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
    for (uint32_t first = 0; first < nb; first += BLOCKS) {
        const uint32_t count = min(BLOCKS, nb - first);
        const uint8_t *at[R];
        stage_rows_async<QT, R>(rows, first, count, st, at);
        asm volatile("cp.async.wait_all;\n" ::);
        __syncwarp();
        for (uint32_t j = lane; j < count; j += 32u) {
            const uint32_t b = first + j;
            if (M == 1) {
                // One row of x: its block loaded once for the R weight rows.
                uint4 lo, hi;
                XBlock8 s;
                load_xblock(xq, xs, nbp, 0, b, lo, hi, s);
#pragma unroll
                for (int w = 0; w < R; ++w) {
                    const uint8_t *wb = at[w] + j * B;
                    int q[8];
                    quant_words<QT>(wb, q);
                    acc[w][0] = qdot8<QT>(q, sm_f16(wb), wb, lo, hi, s, acc[w][0]);
                }
            } else {
                // Each weight block decoded once for the rows of x, whose blocks are reloaded
                // per weight row (L1 hits; fewer registers than holding them all).
#pragma unroll
                for (int w = 0; w < R; ++w) {
                    const uint8_t *wb = at[w] + j * B;
                    int q[8];
                    quant_words<QT>(wb, q);
                    const float dw = sm_f16(wb);
#pragma unroll
                    for (int r = 0; r < M; ++r) {
                        if ((uint32_t)r < m) {
                            uint4 lo, hi;
                            XBlock8 s;
                            load_xblock(xq, xs, nbp, r, b, lo, hi, s);
                            acc[w][r] = qdot8<QT>(q, dw, wb, lo, hi, s, acc[w][r]);
                        }
                    }
                }
            }
        }
        // The stage is rewritten next round only after every lane has read its blocks.
        __syncwarp();
    }
    qstore2<T, M, R>(acc, col0, w0, w1, w2, y, m, n0, n1, n2, row_bytes, silu);
    if (yq != nullptr) silu_group_q8<T, R / 2>(y, yq, counters, m, n0, col0);
}

// qlinear3_small_r<R>_m<M>_<q>_<dtype>: variant 3 with R weight rows per warp, x's chunk
// length (in blocks) last. At most 64 registers, but 72 (7 blocks per SM) for the 16
// accumulators of 8 rows of x with R = 2, which spill 20-28 bytes within 64 (ptxas -v).
#define QLINEAR3_SMALL_FOR(T, SUFFIX, M, QT, QNAME, R)                                          \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, R * M >= 16 ? 7 : 8)            \
        qlinear3_small_r##R##_m##M##_##QNAME##_##SUFFIX(                                        \
        const T *x, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, T *y, uint32_t m,  \
        uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu, uint32_t xblocks) {   \
        qlinear_small3<T, M, QT, R>(x, w0, w1, w2, y, m, n0, n1, n2, k, silu, xblocks);         \
    }
// qlinear_small4: qlinear_small4_at over the whole buffer qlinear4_quantize_x wrote for m rows
// (the scales and sums after all the rows' quants).
template <typename T, int M, int QT, int R>
__device__ void qlinear_small4(const uint4 *xq, const uint8_t *w0, const uint8_t *w1,
                               const uint8_t *w2, T *y, uint32_t m, uint32_t n0, uint32_t n1,
                               uint32_t n2, uint32_t k, uint32_t silu, uint4 *yq,
                               uint32_t *counters) {
    const XRows8 x = xq_rows_from(xq, m, k, 0);
    qlinear_small4_at<T, M, QT, R>(x.q, x.s, w0, w1, w2, y, m, n0, n1, n2, k, silu, yq,
                                   counters);
}
// qlinear4_small_r<R>_m<M>_<q>_<dtype>: variant 4 with R weight rows per warp, reading the
// buffer qlinear4_quantize_x_<dtype> wrote from x. Register bounds as variant 3's.
#define QLINEAR4_SMALL_FOR(T, SUFFIX, M, QT, QNAME, R)                                          \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, R * M >= 16 ? 7 : 8)            \
        qlinear4_small_r##R##_m##M##_##QNAME##_##SUFFIX(                                        \
        const uint4 *xq, const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, T *y,         \
        uint32_t m, uint32_t n0, uint32_t n1, uint32_t n2, uint32_t k, uint32_t silu,           \
        uint4 *yq, uint32_t *counters) {                                                        \
        qlinear_small4<T, M, QT, R>(xq, w0, w1, w2, y, m, n0, n1, n2, k, silu, yq, counters);   \
    }
// qlinear3_experts_r<R>_<q>_<dtype>: variant 3 for one row of x over a group of experts
// (blockIdx.y: expert e): expert e's weights g.w0[e] (and g.w1[e], the up projection, with
// silu), its row of x at x + e · x_stride (0: one row for all) and its output row at
// y + e · (n0 + n1) (n0 with silu). Otherwise qlinear3_small_r<R>_m1's contract per expert.
// qlinear3_experts_at_r<R>_<q>_<dtype>: the same, g read from device memory (moe_route's).
#define QLINEAR3_EXPERTS_FOR(T, SUFFIX, M, QT, QNAME, R)                                        \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 8)                              \
        qlinear3_experts_r##R##_##QNAME##_##SUFFIX(                                             \
        const T *x, uint32_t x_stride, GroupWeights g, T *y, uint32_t n0, uint32_t n1,          \
        uint32_t k, uint32_t silu, uint32_t xblocks) {                                          \
        const uint32_t e = blockIdx.y;                                                          \
        qlinear_small3<T, 1, QT, R>(x + (size_t)e * x_stride, g.w0[e], g.w1[e], g.w0[e],        \
                                    y + (size_t)e * (silu ? n0 : n0 + n1), 1u, n0, n1, 0u, k,   \
                                    silu, xblocks);                                             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 8)                              \
        qlinear3_experts_at_r##R##_##QNAME##_##SUFFIX(                                          \
        const T *x, uint32_t x_stride, const GroupWeights *g, T *y, uint32_t n0, uint32_t n1,   \
        uint32_t k, uint32_t silu, uint32_t xblocks) {                                          \
        const uint32_t e = blockIdx.y;                                                          \
        qlinear_small3<T, 1, QT, R>(x + (size_t)e * x_stride, g->w0[e], g->w1[e], g->w0[e],     \
                                    y + (size_t)e * (silu ? n0 : n0 + n1), 1u, n0, n1, 0u, k,   \
                                    silu, xblocks);                                             \
    }
// qlinear3_rows_experts_<q>_<dtype>: variant 3 (2 weight rows per warp) over a prompt's rows
// sorted by expert, blockIdx.y chunk c (`RowChunk`): rows c.row .. c.row + c.rows of x (k
// wide) against expert c.expert's weights w0[c.expert] (and w1[c.expert], the up projection,
// with silu), into the same rows of y (n0 wide; with silu, silu(gate) · up of n0 columns
// each). Otherwise qlinear3_small_r2_m8's contract per chunk.
#define QLINEAR3_ROWS_EXPERTS_FOR(T, SUFFIX, M, QT, QNAME, R)                                   \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 7)                              \
        qlinear3_rows_experts_##QNAME##_##SUFFIX(                                               \
        const T *x, const uint64_t *w0, const uint64_t *w1, const RowChunk *chunks, T *y,       \
        uint32_t n0, uint32_t k, uint32_t silu, uint32_t xblocks) {                             \
        const RowChunk c = chunks[blockIdx.y];                                                  \
        const uint8_t *a = reinterpret_cast<const uint8_t *>(w0[c.expert]);                     \
        const uint8_t *b = reinterpret_cast<const uint8_t *>(w1[c.expert]);                     \
        qlinear_small3<T, ROWS_CHUNK_MAX, QT, 2>(x + (size_t)c.row * k, a, b, a,                \
                                                 y + (size_t)c.row * n0, c.rows, n0,            \
                                                 silu ? n0 : 0u, 0u, k, silu, xblocks);         \
    }
// qlinear3_rows_expert_<q>_<dtype>: the same for the `rows` rows of one expert, whose weights
// w0 (and w1 with silu) come by value: chunk blockIdx.y is rows 8 · blockIdx.y onwards, so
// that nothing is uploaded for the launch.
#define QLINEAR3_ROWS_EXPERT_FOR(T, SUFFIX, M, QT, QNAME, R)                                    \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 7)                              \
        qlinear3_rows_expert_##QNAME##_##SUFFIX(                                                \
        const T *x, const uint8_t *w0, const uint8_t *w1, T *y, uint32_t rows, uint32_t n0,     \
        uint32_t k, uint32_t silu, uint32_t xblocks) {                                          \
        const uint32_t row = blockIdx.y * ROWS_CHUNK_MAX;                                       \
        qlinear_small3<T, ROWS_CHUNK_MAX, QT, 2>(x + (size_t)row * k, w0, w1, w0,               \
                                                 y + (size_t)row * n0,                          \
                                                 min((uint32_t)ROWS_CHUNK_MAX, rows - row), n0, \
                                                 silu ? n0 : 0u, 0u, k, silu, xblocks);         \
    }
// qlinear4_rows_experts_<q>_<dtype>: qlinear3_rows_experts_<q>_<dtype>'s chunks, weights and
// output, x given as qlinear4_quantize_x wrote all `rows` of its rows (xq) rather than
// quantized by every block of threads: chunk c reads rows c.row .. c.row + c.rows there
// (variant 4, 2 weight rows per warp, up to 8 rows).
#define QLINEAR4_ROWS_EXPERTS_FOR(T, SUFFIX, M, QT, QNAME, R)                                   \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 7)                              \
        qlinear4_rows_experts_##QNAME##_##SUFFIX(                                               \
        const uint4 *xq, uint32_t rows, const uint64_t *w0, const uint64_t *w1,                 \
        const RowChunk *chunks, T *y, uint32_t n0, uint32_t k, uint32_t silu) {                 \
        const RowChunk c = chunks[blockIdx.y];                                                  \
        const uint8_t *a = reinterpret_cast<const uint8_t *>(w0[c.expert]);                     \
        const uint8_t *b = reinterpret_cast<const uint8_t *>(w1[c.expert]);                     \
        const XRows8 x = xq_rows_from(xq, rows, k, c.row);                                      \
        qlinear_small4_at<T, ROWS_CHUNK_MAX, QT, 2>(x.q, x.s, a, b, a, y + (size_t)c.row * n0,  \
                                                    c.rows, n0, silu ? n0 : 0u, 0u, k, silu,    \
                                                    nullptr, nullptr);                          \
    }
// qlinear4_rows_expert_<q>_<dtype>: the same for the `rows` rows of one expert (weights by
// value, chunk blockIdx.y the rows 8 · blockIdx.y onwards), qlinear3_rows_expert's form.
#define QLINEAR4_ROWS_EXPERT_FOR(T, SUFFIX, M, QT, QNAME, R)                                    \
    extern "C" __global__ void __launch_bounds__(32 * OPS_WARPS, 7)                              \
        qlinear4_rows_expert_##QNAME##_##SUFFIX(                                                \
        const uint4 *xq, const uint8_t *w0, const uint8_t *w1, T *y, uint32_t rows,             \
        uint32_t n0, uint32_t k, uint32_t silu) {                                               \
        const uint32_t row = blockIdx.y * ROWS_CHUNK_MAX;                                       \
        const XRows8 x = xq_rows_from(xq, rows, k, row);                                        \
        qlinear_small4_at<T, ROWS_CHUNK_MAX, QT, 2>(                                            \
            x.q, x.s, w0, w1, w0, y + (size_t)row * n0,                                         \
            min((uint32_t)ROWS_CHUNK_MAX, rows - row), n0, silu ? n0 : 0u, 0u, k, silu,         \
            nullptr, nullptr);                                                                  \
    }
#define LINEAR_Q8_FOR(T, SUFFIX)                                                                \
    QLINEAR_RM_TYPES(QLINEAR3_ROWS_EXPERTS_FOR, T, SUFFIX, 8, 2)                                \
    QLINEAR_RM_TYPES(QLINEAR4_ROWS_EXPERTS_FOR, T, SUFFIX, 8, 2)                                \
    QLINEAR_RM_TYPES(QLINEAR4_ROWS_EXPERT_FOR, T, SUFFIX, 8, 2)                                 \
    QLINEAR_RM_TYPES(QLINEAR3_ROWS_EXPERT_FOR, T, SUFFIX, 8, 2)                                 \
    QLINEAR_RM_TYPES(QLINEAR3_EXPERTS_FOR, T, SUFFIX, 1, 2)                                     \
    QLINEAR_RM_TYPES(QLINEAR3_EXPERTS_FOR, T, SUFFIX, 1, 4)                                     \
    QLINEAR_RM_ALL(QLINEAR3_SMALL_FOR, T, SUFFIX)                                               \
    QLINEAR_RM_ALL(QLINEAR4_SMALL_FOR, T, SUFFIX)                                               \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        qlinear4_quantize_x_##SUFFIX(const T *x, uint4 *xq, uint32_t m, uint32_t k) {          \
        qlinear4_quantize_x<T>(x, xq, m, k);                                                    \
    }

LINEAR_Q8_FOR(float, f32)
LINEAR_Q8_FOR(__half, f16)
LINEAR_Q8_FOR(__nv_bfloat16, bf16)
