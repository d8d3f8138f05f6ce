// The frames of the small-matmul kernels (linear.cu, linear_q8.cu, linear_k.cu) and the GGML
// blocks of 32 elements they and the dequantizing kernels (gemm.cu) read: the warps per block
// of threads, the columns a warp computes, the weight rows it stages in shared memory.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "reduce.cuh"

// Warps per block of threads of the linear_small and qlinear_small kernels.
#define OPS_WARPS 4

// Column `col` of the weights w0, w1, w2 side by side (n0, n1, n2 columns; pointers of any
// element type W): the weight it is in, its index c there, that weight's column count n, and
// where that weight's outputs start in y (m, n0 + n1 + n2 as three contiguous blocks: element
// r * n + c of yb is row r's). False past the last column.
template <typename W, typename T>
__device__ __forceinline__ bool pick_column(uint32_t col, W *w0, W *w1, W *w2, T *y, uint32_t m,
                                            uint32_t n0, uint32_t n1, uint32_t n2, W *&w,
                                            T *&yb, uint32_t &c, uint32_t &n) {
    if (col < n0) {
        w = w0, yb = y, c = col, n = n0;
    } else if (col < n0 + n1) {
        w = w1, yb = y + (size_t)m * n0, c = col - n0, n = n1;
    } else if (col < n0 + n1 + n2) {
        w = w2, yb = y + (size_t)m * (n0 + n1), c = col - n0 - n1, n = n2;
    } else {
        return false;
    }
    return true;
}

// The frame of the kernels that give each output column one warp (linear_small,
// qlinear_k_small): with silu, the warp's column of gate w0 and up w1 and y = silu(gate) · up;
// otherwise the column pick_column finds in w0, w1, w2. `dot(row, acc)` adds this lane's share
// of x[r, :] · the weight row at `row` to acc[r] for r < m; rows are `row_stride` elements of
// W apart. One warp reduction per row of x; lane 0 stores.
template <typename T, int M, typename W, typename Dot>
__device__ __forceinline__ void column_per_warp(const W *w0, const W *w1, const W *w2, T *y,
                                                uint32_t m, uint32_t n0, uint32_t n1,
                                                uint32_t n2, uint32_t row_stride, uint32_t silu,
                                                Dot dot) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t col = blockIdx.x * OPS_WARPS + (threadIdx.x >> 5);
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = 0.0f;
    if (silu) {
        if (col >= n0) return;
        float up[M];
#pragma unroll
        for (int r = 0; r < M; ++r) up[r] = 0.0f;
        dot(w0 + (size_t)col * row_stride, acc);
        dot(w1 + (size_t)col * row_stride, up);
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if ((uint32_t)r < m) {
                const float g = warp_sum(acc[r]);
                const float u = warp_sum(up[r]);
                if (lane == 0) y[(size_t)r * n0 + col] = from_f32<T>(g / (1.0f + expf(-g)) * u);
            }
        }
        return;
    }
    const W *w;
    T *yb;
    uint32_t c, n;
    if (!pick_column(col, w0, w1, w2, y, m, n0, n1, n2, w, yb, c, n)) return;
    dot(w + (size_t)c * row_stride, acc);
#pragma unroll
    for (int r = 0; r < M; ++r) {
        if ((uint32_t)r < m) {
            const float s = warp_sum(acc[r]);
            if (lane == 0) yb[(size_t)r * n + c] = from_f32<T>(s);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// linear_small over GGML blocks of 32 elements (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), as Candle's
// quantized CUDA storage holds them: row c of the weight is k / 32 blocks, rows back to back,
// the buffer zero-padded past its last row. The weight is dequantized in registers and
// multiplied by x in f32 (x is not quantized, unlike Candle's mmvq).
//
// Blocks are 18 to 34 bytes, so a lane cannot read its block with aligned vector loads. Each
// warp stages 32 blocks of its row at a time in shared memory with 16-byte loads (from the
// 16-byte boundary at or before the first block to the one at or after the last: at most 15
// bytes of the neighbouring row or of the padding are read and not used), then lane j decodes
// block j there.

enum { QT_Q4_0 = 0, QT_Q4_1 = 1, QT_Q5_0 = 2, QT_Q5_1 = 3, QT_Q8_0 = 4 };
template <int QT> struct QBlock;
template <> struct QBlock<QT_Q4_0> { static constexpr int BYTES = 18; static constexpr bool MIN = false; };
template <> struct QBlock<QT_Q4_1> { static constexpr int BYTES = 20; static constexpr bool MIN = true; };
template <> struct QBlock<QT_Q5_0> { static constexpr int BYTES = 22; static constexpr bool MIN = false; };
template <> struct QBlock<QT_Q5_1> { static constexpr int BYTES = 24; static constexpr bool MIN = true; };
template <> struct QBlock<QT_Q8_0> { static constexpr int BYTES = 34; static constexpr bool MIN = false; };

// Little-endian reads from 2-byte aligned shared memory.
__device__ __forceinline__ uint32_t sm_u32(const uint8_t *p) {
    const uint16_t *h = reinterpret_cast<const uint16_t *>(p);
    return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
}
__device__ __forceinline__ float sm_f16(const uint8_t *p) {
    return __half2float(*reinterpret_cast<const __half *>(p));
}
// Byte i of w (0..255) as a float less `bias`, exactly: the byte permute builds 2^23 + byte.
__device__ __forceinline__ float byte_f32(uint32_t w, uint32_t i, float bias) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7650u | i)) - (8388608.0f + bias);
}

// What one warp stages at once: about 2.3 KB of blocks (a multiple of 32 blocks), as many bytes
// in flight per warp as linear_small's four 16-byte loads per lane. VECS: the 16-byte vectors
// of shared memory per staged row, with the slack of both ends' alignment. Mirrored by
// `qlinear_small_stage_vecs` in src/linear/cuda.rs, which sizes the dynamic shared memory.
template <int QT> struct QStage {
    static constexpr int BLOCKS = (2304 / QBlock<QT>::BYTES) / 32 * 32;
    static constexpr int VECS = (BLOCKS * QBlock<QT>::BYTES + 31) / 16 + 1;
};

// 16 bytes from global to shared memory without passing through registers (cp.async, sm_80+;
// .cg: cached in L2 only, as the weights are read once).
__device__ __forceinline__ void cp_async16(uint4 *smem, const uint4 *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

// Starts the copies of blocks first .. first + count of each of the NW rows into
// st[w * VECS ..] (one warp, all lanes; all copies in flight at once) and returns in at[w]
// where block `first` of row w lands; the caller waits for them (cp.async.wait_all, then
// __syncwarp). VECS: the 16-byte vectors a row's stage holds.
template <int QT, int NW, int VECS>
__device__ __forceinline__ void stage_async(const uint8_t *const *rows, uint32_t first,
                                            uint32_t count, uint4 *st, const uint8_t **at) {
    constexpr int B = QBlock<QT>::BYTES;
    const uint32_t lane = threadIdx.x & 31u;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        const uintptr_t s = reinterpret_cast<uintptr_t>(rows[w]) + (uintptr_t)first * B;
        const uintptr_t a0 = s & ~(uintptr_t)15;
        const uint32_t nvec = (uint32_t)((s + (uintptr_t)count * B + 15 - a0) >> 4);
        uint4 *dst = st + w * VECS;
        at[w] = reinterpret_cast<const uint8_t *>(dst) + (s - a0);
        const uint4 *src = reinterpret_cast<const uint4 *>(a0);
        for (uint32_t v = lane; v < nvec; v += 32u) cp_async16(dst + v, src + v);
    }
}

// Stages blocks first .. first + count (count <= QStage::BLOCKS) of each of the NW rows in
// st[w * QStage::VECS ..] and waits for them (one warp, all lanes), at[w] as stage_async's.
template <int QT, int NW>
__device__ __forceinline__ void stage_blocks(const uint8_t *const *rows, uint32_t first,
                                             uint32_t count, uint4 *st, const uint8_t **at) {
    stage_async<QT, NW, QStage<QT>::VECS>(rows, first, count, st, at);
    asm volatile("cp.async.wait_all;\n" ::);
    __syncwarp();
}

// Weight rows per round: QStage2::BLOCKS blocks of each of R rows (at least 32, about 1.1 KB
// of each row), VECS 16-byte vectors per row with the alignment slack. Mirrored by
// `qlinear2_small_stage_vecs` in src/linear/cuda.rs.
template <int QT> struct QStage2 {
    static constexpr int BLOCKS = 32 * ((1152 / QBlock<QT>::BYTES) / 32 > 1 ? (1152 / QBlock<QT>::BYTES) / 32 : 1);
    static constexpr int VECS = (BLOCKS * QBlock<QT>::BYTES + 31) / 16 + 1;
};

// Column `col` of the concatenated weights (col < n0 + n1 + n2): its row of blocks, and where
// its outputs go (element r * n of yb is row r's).
template <typename T>
__device__ __forceinline__ void qcolumn(uint32_t col, const uint8_t *w0, const uint8_t *w1,
                                        const uint8_t *w2, T *y, uint32_t m, uint32_t n0,
                                        uint32_t n1, size_t row_bytes, const uint8_t *&row,
                                        T *&yb, uint32_t &n, uint32_t n2) {
    // pick_column's choice without its bound check (callers pass col < n0 + n1 + n2): with
    // the check, ptxas allocates 1-5 more registers in most instances of the measured kernel.
    if (col < n0) {
        row = w0 + col * row_bytes, yb = y + col, n = n0;
    } else if (col < n0 + n1) {
        row = w1 + (col - n0) * row_bytes, yb = y + (size_t)m * n0 + (col - n0), n = n1;
    } else {
        row = w2 + (col - n0 - n1) * row_bytes;
        yb = y + (size_t)m * (n0 + n1) + (col - n0 - n1), n = n2;
    }
}

// Starts the copies of blocks first .. first + count (count <= QStage2::BLOCKS) of each of the
// R rows into st[w * QStage2::VECS ..] (stage_async); the caller waits for them
// (cp.async.wait_all, then __syncwarp).
template <int QT, int R>
__device__ __forceinline__ void stage_rows_async(const uint8_t *const *rows, uint32_t first,
                                                 uint32_t count, uint4 *st, const uint8_t **at) {
    stage_async<QT, R, QStage2<QT>::VECS>(rows, first, count, st, at);
}

// The weight rows of warp `gw` in the grid of variants 2 and 3: R columns of the concatenated
// weights from col0 = R gw, or with silu R / 2 columns of gate and of up from col0 = (R / 2) gw;
// columns past the last repeat the warp's first. False if the warp has no column at all (col0
// past the last).
template <typename T, int R>
__device__ __forceinline__ bool qrows2(uint32_t gw, const uint8_t *w0, const uint8_t *w1,
                                       const uint8_t *w2, T *y, uint32_t m, uint32_t n0,
                                       uint32_t n1, uint32_t n2, size_t row_bytes, uint32_t silu,
                                       uint32_t &col0, const uint8_t **rows) {
    constexpr int C = R / 2;
    const uint32_t total = n0 + n1 + n2;
    col0 = silu ? gw * C : gw * R;
    if (col0 >= (silu ? n0 : total)) return false;
    if (silu) {
#pragma unroll
        for (int i = 0; i < C; ++i) {
            const uint32_t c = col0 + i < n0 ? col0 + i : col0;
            rows[i] = w0 + c * row_bytes;
            rows[C + i] = w1 + c * row_bytes;
        }
    } else {
#pragma unroll
        for (int w = 0; w < R; ++w) {
            T *yb;
            uint32_t n;
            qcolumn<T>(col0 + w < total ? col0 + w : col0, w0, w1, w2, y, m, n0, n1, row_bytes,
                       rows[w], yb, n, n2);
        }
    }
    return true;
}

// Sums each lane's acc over the warp and writes the warp's columns from col0 (qrows2's), or
// with silu silu(gate) · up of its columns; those past the last are not written.
template <typename T, int M, int R>
__device__ __forceinline__ void qstore2(float (*acc)[M], uint32_t col0, const uint8_t *w0,
                                        const uint8_t *w1, const uint8_t *w2, T *y, uint32_t m,
                                        uint32_t n0, uint32_t n1, uint32_t n2, size_t row_bytes,
                                        uint32_t silu) {
    constexpr int C = R / 2;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t total = n0 + n1 + n2;
    if (silu) {
#pragma unroll
        for (int i = 0; i < C; ++i) {
#pragma unroll
            for (int r = 0; r < M; ++r) {
                if ((uint32_t)r < m) {
                    const float g = warp_sum(acc[i][r]);
                    const float u = warp_sum(acc[C + i][r]);
                    if (lane == 0 && col0 + i < n0)
                        y[(size_t)r * n0 + col0 + i] = from_f32<T>(g / (1.0f + expf(-g)) * u);
                }
            }
        }
        return;
    }
#pragma unroll
    for (int w = 0; w < R; ++w) {
        const uint32_t col = col0 + w;
        const uint8_t *row;
        T *yb;
        uint32_t n;
        qcolumn<T>(col < total ? col : col0, w0, w1, w2, y, m, n0, n1, row_bytes, row, yb, n, n2);
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if ((uint32_t)r < m) {
                const float s = warp_sum(acc[w][r]);
                if (lane == 0 && col < total) yb[(size_t)r * n] = from_f32<T>(s);
            }
        }
    }
}

// Variants 2, 3 and 4 (FOR: QLINEAR2_SMALL_FOR, QLINEAR3_SMALL_FOR or QLINEAR4_SMALL_FOR) for
// M rows of x and R weight rows per warp, every block type.
#define QLINEAR_RM_TYPES(FOR, T, SUFFIX, M, R)                                                  \
    FOR(T, SUFFIX, M, QT_Q4_0, q4_0, R)                                                         \
    FOR(T, SUFFIX, M, QT_Q4_1, q4_1, R)                                                         \
    FOR(T, SUFFIX, M, QT_Q5_0, q5_0, R)                                                         \
    FOR(T, SUFFIX, M, QT_Q5_1, q5_1, R)                                                         \
    FOR(T, SUFFIX, M, QT_Q8_0, q8_0, R)
// Variants 2, 3 and 4 take R = 2 up to 8 rows of x and R = 4 up to 2 rows; variant 2 also up
// to 4 (R = 4 with 8 rows would need 32 accumulators; variant 3's R = 4 with 4 rows spills
// within 72 registers, ptxas -v; variant 4 has variant 3's instances).
#define QLINEAR_RM_ALL(FOR, T, SUFFIX)                                                          \
    QLINEAR_RM_TYPES(FOR, T, SUFFIX, 1, 2)                                                      \
    QLINEAR_RM_TYPES(FOR, T, SUFFIX, 2, 2)                                                      \
    QLINEAR_RM_TYPES(FOR, T, SUFFIX, 4, 2)                                                      \
    QLINEAR_RM_TYPES(FOR, T, SUFFIX, 8, 2)                                                      \
    QLINEAR_RM_TYPES(FOR, T, SUFFIX, 1, 4)                                                      \
    QLINEAR_RM_TYPES(FOR, T, SUFFIX, 2, 4)

// The routed experts of one grouped launch of a decode row (`linear::experts`): expert
// blockIdx.y's weight buffers (w0; w1 for a SwiGLU's up) and its output's scale, passed by
// value. At most MAX_GROUP_EXPERTS a launch (`MAX_GROUP_EXPERTS` in linear/experts.rs).
#define MAX_GROUP_EXPERTS 16
struct GroupWeights {
    const uint8_t *w0[MAX_GROUP_EXPERTS];
    const uint8_t *w1[MAX_GROUP_EXPERTS];
};
struct GroupScales {
    float w[MAX_GROUP_EXPERTS];
};

// A prompt's rows routed to several experts, sorted by expert (`linear::experts_rows`): one
// launch's blockIdx.y takes the chunk of at most ROWS_CHUNK_MAX rows of one expert: rows
// `row` .. `row + rows` of x and y, against expert `expert`'s weights (its entry of the
// launch's table of weight addresses).
#define ROWS_CHUNK_MAX 8
struct RowChunk {
    uint32_t expert, row, rows, pad;
};
