// The dequantizing kernels of `candle_offload_kernels::gemm` (dequantize_rows, and the
// prompt GEMM's slices of 16-bit weight: qlinear_prefill).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "qblocks.cuh"
#include "kquant.cuh"

// dequant_{f16,bf16}_<q>: consecutive rows of a weight of GGML blocks to F16 or BF16, in element
// order (GGML's dequantize_row_* for each type: scale times quant, less the min, in f32, rounded
// once), for a prompt's GEMM (gemm::qlinear_prefill). `w` points at the first row's first block
// and the rows are back to back; thread g writes the 8 elements 8g .. 8g + 8 as one 16-byte
// store (out 16-byte aligned), so that a warp's stores cover 512 contiguous bytes. `groups8` is
// rows·k / 8. Part p (0..3) of a 32-element run: elements 8p .. 8p + 8 (faster than 32
// elements a thread, 64 bytes apart across the warp: docs/tuning.md, the prompt GEMM).
// Low 4 bits of element 8p + i of a 32-element block whose quants are packed GGML-style
// (element j and j + 16 in the low and high nibble of byte j): byte 8 (p & 1) + i, nibble p / 2.
__device__ __forceinline__ void nibbles8(const uint8_t *qs, uint32_t p, uint32_t &lo,
                                         uint32_t &hi) {
    const uint32_t sh = 4u * (p >> 1);
    lo = (sm_u32(qs + 8u * (p & 1u)) >> sh) & 0x0F0F0F0Fu;
    hi = (sm_u32(qs + 8u * (p & 1u) + 4u) >> sh) & 0x0F0F0F0Fu;
}
template <int QT> __device__ __forceinline__ void dequant_run(const uint8_t *w, uint32_t g,
                                                               float *o) {
    const uint8_t *b = w + (size_t)(g >> 2) * QBlock<QT>::BYTES;
    const uint32_t p = g & 3u;
    float q[8], d, mn = 0.0f;
    if constexpr (QT == QT_Q8_0) {
        d = sm_f16(b);
        const uint32_t lo = sm_u32(b + 2u + 8u * p) ^ 0x80808080u;
        const uint32_t hi = sm_u32(b + 6u + 8u * p) ^ 0x80808080u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = byte_f32(lo, i, 128.0f);
            q[4 + i] = byte_f32(hi, i, 128.0f);
        }
    } else {
        // Scale, min (types _1), the 32 fifth bits (Q5) and the quants, as decode_block reads.
        constexpr uint32_t QH = QBlock<QT>::MIN ? 4u : 2u;
        constexpr bool Q5 = QT == QT_Q5_0 || QT == QT_Q5_1;
        constexpr uint32_t QS = QH + (Q5 ? 4u : 0u);
        d = sm_f16(b);
        if constexpr (QBlock<QT>::MIN) mn = sm_f16(b + 2);
        uint32_t lo, hi;
        nibbles8(b + QS, p, lo, hi);
        float bias = QBlock<QT>::MIN ? 0.0f : 8.0f;
        if constexpr (Q5) {
            // Element 8p + i's fifth bit is bit 8 (p & 1) + i + 16 (p / 2) of qh.
            const uint32_t qh = sm_u32(b + QH) >> (8u * (p & 1u) + 16u * (p >> 1));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo |= ((qh >> i) & 1u) << (8 * i + 4);
                hi |= ((qh >> (i + 4)) & 1u) << (8 * i + 4);
            }
            bias = QBlock<QT>::MIN ? 0.0f : 16.0f;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = byte_f32(lo, i, bias);
            q[4 + i] = byte_f32(hi, i, bias);
        }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = d * q[e] + mn;
}
// Q4_K: thread t (0..31) of a super-block writes elements 8 (t % 4) .. + 8 of sub-block t / 4.
__device__ __forceinline__ void dequant_run_q4k(const uint8_t *w, uint32_t g, float *o) {
    const uint8_t *b = w + (size_t)(g >> 5) * 144u;
    const uint32_t s = (g >> 2) & 7u, p = g & 3u;
    const float d = __half2float(*reinterpret_cast<const __half *>(b));
    const float dmin = __half2float(*reinterpret_cast<const __half *>(b + 2));
    float sc, mn;
    q4k_scale_min(b + 4, s, sc, mn);
    const float d1 = d * sc, m1 = dmin * mn;
    const uint8_t *qs = b + 16u + 32u * (s >> 1) + 8u * p;
    const uint32_t shift = (s & 1u) * 4u;
    const uint32_t lo = (sm_u32(qs) >> shift) & 0x0F0F0F0Fu;
    const uint32_t hi = (sm_u32(qs + 4) >> shift) & 0x0F0F0F0Fu;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = d1 * byte_f32(lo, i, 0.0f) - m1;
        o[4 + i] = d1 * byte_f32(hi, i, 0.0f) - m1;
    }
}
// Q6_K (ql[128], qh[64], int8 scales[16], d): thread t of a super-block writes elements
// 8 (t % 4) .. + 8 of run r = t / 4, quarter r % 4 of half r / 4: 32 elements whose low 4 bits
// are the low (quarters 0, 1) or high (2, 3) nibbles of ql bytes l or l + 32 (odd quarters) of
// the half's 64, and whose top 2 bits are bits 2 (r % 4) of its 32 qh bytes; a thread's 8 share
// one of the scales (sixteen elements share each).
__device__ __forceinline__ void dequant_run_q6k(const uint8_t *w, uint32_t g, float *o) {
    const uint8_t *b = w + (size_t)(g >> 5) * 210u;
    const uint32_t r = (g >> 2) & 7u, p = g & 3u;
    const uint32_t h = r >> 2, t = r & 3u;
    const float d = __half2float(*reinterpret_cast<const __half *>(b + 208));
    const uint8_t *ql = b + 64u * h + 32u * (t & 1u) + 8u * p;
    const uint8_t *qh = b + 128u + 32u * h + 8u * p;
    const float sc = (float)reinterpret_cast<const int8_t *>(b + 192)[8u * h + 2u * t + (p >> 1)];
    const uint32_t lshift = (t >> 1) * 4u, hshift = 2u * t;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const uint32_t l4 = (sm_u32(ql + 4 * j) >> lshift) & 0x0F0F0F0Fu;
        const uint32_t h4 = ((sm_u32(qh + 4 * j) >> hshift) & 0x03030303u) << 4;
#pragma unroll
        for (int i = 0; i < 4; ++i) o[4 * j + i] = d * sc * byte_f32(l4 | h4, i, 32.0f);
    }
}
#define DEQUANT_ONE(T, SUFFIX, QNAME, RUN)                                                      \
    extern "C" __global__ void dequant_##SUFFIX##_##QNAME(const uint8_t *w, T *out,            \
                                                          uint32_t groups8) {                   \
        const uint32_t g = blockIdx.x * blockDim.x + threadIdx.x;                               \
        if (g >= groups8) return;                                                               \
        float o[8];                                                                             \
        RUN(w, g, o);                                                                           \
        st8<T>(out + (size_t)g * 8u, o);                                                        \
    }
#define DEQUANT_FOR(T, SUFFIX)                                                                 \
    DEQUANT_ONE(T, SUFFIX, q4_0, dequant_run<QT_Q4_0>)                                        \
    DEQUANT_ONE(T, SUFFIX, q4_1, dequant_run<QT_Q4_1>)                                        \
    DEQUANT_ONE(T, SUFFIX, q5_0, dequant_run<QT_Q5_0>)                                        \
    DEQUANT_ONE(T, SUFFIX, q5_1, dequant_run<QT_Q5_1>)                                        \
    DEQUANT_ONE(T, SUFFIX, q8_0, dequant_run<QT_Q8_0>)                                        \
    DEQUANT_ONE(T, SUFFIX, q4_k, dequant_run_q4k)                                             \
    DEQUANT_ONE(T, SUFFIX, q6_k, dequant_run_q6k)
DEQUANT_FOR(__half, f16)
DEQUANT_FOR(__nv_bfloat16, bf16)
