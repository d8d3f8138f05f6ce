// Variant 4's buffer of x quantized to 8-bit blocks of 32 (written by qlinear4_quantize_x in
// linear_q8.cu, rms_norm_residual_vec in norm.cu, decode_attention in attention.cu and the SiLU
// store of qlinear_small4) and the quantizing helpers every writer and reader shares, so that
// they all round x alike; variant 3's in-block quantization of x (quantize_x) and the integer
// dot products (dp4a4), which the K-quant kernels take too.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"

// Variant 4's buffer of quantized x (the layout is described at qlinear4_quantize_x below):
// each block of 32 elements' scale and quant sum, and the quantizing helpers that every writer
// of that buffer shares (qlinear4_quantize_x, rms_norm_residual_vec, decode_attention and the
// SiLU store of qlinear_small4), so that they all round x alike.
struct __align__(8) XBlock8 {
    float d;
    int sum;
};

// Eight values v of a block of 32 quantized, by the four consecutive lanes (4i .. 4i + 3 of
// the warp) that hold the block's four parts of eight (every lane of the warp calls, for the
// shuffles): the block's scale d, this part's quants packed four to a word in element order,
// and the sum of the block's 32 quants (above: d = amax / 127, quants v · (127 / amax) rounded
// to nearest). Variants 3 and 4 quantize x with this one function, so that they round it alike.
__device__ __forceinline__ void quantize8(const float *v, uint2 &packed, int &sum, float &d) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    d = __fdiv_rn(amax, 127.0f);
    const float id = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    const float scale = isfinite(id) ? id : 0.0f;
    uint32_t words[2] = {0u, 0u};
    sum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int q = __float2int_rn(__fmul_rn(v[i], scale));
        sum += q;
        words[i >> 2] |= ((uint32_t)q & 0xFFu) << (8 * (i & 3));
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    packed = make_uint2(words[0], words[1]);
}


// Stores part p (of 4) of block b of row r, as quantize8 made it, into variant 4's buffer xq
// of m rows of nbp blocks (k / 32 rounded up to a multiple of 32): the quants in variant 3's
// order, and (part 0) the block's scale and sum after all the rows' quants.
__device__ __forceinline__ void store_q8(uint4 *xq, uint32_t m, uint32_t nbp, uint32_t r,
                                         uint32_t b, uint32_t p, uint2 packed, int sum,
                                         float d) {
    uint4 *half = xq + (size_t)r * 2u * nbp + (b >> 5) * 64u + (p >> 1) * 32u + (b & 31u);
    reinterpret_cast<uint2 *>(half)[p & 1u] = packed;
    if (p == 0) {
        XBlock8 *xs = reinterpret_cast<XBlock8 *>(xq + (size_t)m * 2u * nbp);
        xs[(size_t)r * nbp + b] = {d, sum};
    }
}

// Eight values v quantized (quantize8: every lane of the warp calls) and, where `store`, stored
// as part p of block b of row r (store_q8).
__device__ __forceinline__ void quantize8_store(const float *v, bool store, uint4 *xq,
                                                uint32_t m, uint32_t nbp, uint32_t r,
                                                uint32_t b, uint32_t p) {
    uint2 packed;
    int sum;
    float d;
    quantize8(v, packed, sum, d);
    if (store) store_q8(xq, m, nbp, r, b, p, packed, sum, d);
}

// Blocks of 32 per row of variant 4's buffer: k / 32 rounded up to a multiple of 32.
__device__ __forceinline__ uint32_t q8_row_blocks(uint32_t k) {
    return ((k >> 5) + 31u) & ~31u;
}

// Blocks c0 .. c0 + nblk of the m rows of x (row length k) quantized into xq and xs, laid out
// for chunks of xblocks blocks (all the block's threads call; 4 threads per block of 32, each
// of 8 elements, so that the block's max and sum take two shuffles).
template <typename T>
__device__ __forceinline__ void quantize_x(const T *x, uint32_t m, uint32_t k, uint32_t c0,
                                           uint32_t nblk, uint32_t xblocks, uint4 *xq,
                                           XBlock8 *xs) {
    const uint32_t p = threadIdx.x & 3u;
    const uint32_t parts = nblk * 4u;
    for (uint32_t r = 0; r < m; ++r) {
        const T *xr = x + (size_t)r * k + (size_t)c0 * 32u;
        // Every lane of a warp runs each round (the shuffles); a group of 4 is in or out
        // together, as parts is a multiple of 4.
        for (uint32_t base = 0; base < parts; base += blockDim.x) {
            const uint32_t e = base + threadIdx.x;
            const bool in = e < parts;
            float v[8];
            if (in) {
                cvt8<T>(ld_raw(xr + 8u * e, false), v);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = 0.0f;
            }
            uint2 packed;
            int sum;
            float d;
            quantize8(v, packed, sum, d);
            if (in) {
                const uint32_t b = e >> 2;
                uint4 *half = xq + (size_t)r * 2u * xblocks + (b >> 5) * 64u + (p >> 1) * 32u +
                              (b & 31u);
                reinterpret_cast<uint2 *>(half)[p & 1u] = packed;
                if (p == 0) xs[(size_t)r * xblocks + b] = {d, sum};
            }
        }
    }
}

// Block b of row r of variant 4's quantized x (nbp blocks per row, m rows): quants and d, sq.
__device__ __forceinline__ void load_xblock(const uint4 *xq, const XBlock8 *xs, uint32_t nbp,
                                            uint32_t r, uint32_t b, uint4 &lo, uint4 &hi,
                                            XBlock8 &s) {
    const uint4 *v = xq + (size_t)r * 2u * nbp + (b >> 5) * 64u + (b & 31u);
    lo = __ldg(v);
    hi = __ldg(v + 32);
    const int2 sd = __ldg(reinterpret_cast<const int2 *>(xs + (size_t)r * nbp + b));
    s.d = __int_as_float(sd.x);
    s.sum = sd.y;
}

// Row `row` onwards of variant 4's buffer xq of `rows` rows of k (qlinear4_quantize_x's): its
// quants at .q and its blocks' scales and sums at .s, as the kernels reading a chunk of rows
// take them (rows of q8_row_blocks(k) blocks each).
struct XRows8 {
    const uint4 *q;
    const XBlock8 *s;
};
__device__ __forceinline__ XRows8 xq_rows_from(const uint4 *xq, uint32_t rows, uint32_t k,
                                               uint32_t row) {
    const uint32_t nbp = q8_row_blocks(k);
    const XBlock8 *xs = reinterpret_cast<const XBlock8 *>(xq + (size_t)rows * 2u * nbp);
    return {xq + (size_t)row * 2u * nbp, xs + (size_t)row * nbp};
}

// acc + the dot products of four words of quants q with x's four words v, in order.
__device__ __forceinline__ int dp4a4(const int *q, const uint4 &v, int acc) {
    acc = __dp4a(q[0], (int)v.x, acc);
    acc = __dp4a(q[1], (int)v.y, acc);
    acc = __dp4a(q[2], (int)v.z, acc);
    return __dp4a(q[3], (int)v.w, acc);
}
