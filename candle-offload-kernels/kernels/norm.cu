// The residual RMSNorm of `candle_offload_kernels::norm` (rms_norm_residual, with the 8-bit
// copy of its rows for variant 4's matmuls: rms_norm_residual_q8). Each kernel exists once per
// element type as `<name>_f32`, `<name>_f16`, `<name>_bf16` (Candle's kernel_name convention).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "reduce.cuh"
#include "q8.cuh"

// One block per row of `n_cols`: sum = x + r (rounded to T), normed = sum / rms(sum) * w.
// `out` holds all the sums (n_rows * n_cols), then all the normed rows. (rms_norm_residual_vec
// below, for aligned rows of parts of 8, also quantizes them.)
template <typename T>
__device__ void rms_norm_residual(const T *x, const T *r, const T *w, T *out, uint32_t n_rows,
                                  uint32_t n_cols, float eps) {
    const size_t row = blockIdx.x;
    const size_t base = row * n_cols;
    T *sum = out + base;
    T *normed = out + (size_t)n_rows * n_cols + base;
    float acc = 0.0f;
    for (uint32_t i = threadIdx.x; i < n_cols; i += blockDim.x) {
        const T s = from_f32<T>(to_f32(x[base + i]) + to_f32(r[base + i]));
        sum[i] = s;
        const float v = to_f32(s);
        acc += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(acc) / (float)n_cols + eps);
    // Each thread reads back only the sums it wrote itself.
    for (uint32_t i = threadIdx.x; i < n_cols; i += blockDim.x) {
        normed[i] = from_f32<T>(to_f32(sum[i]) * inv * to_f32(w[i]));
    }
}

// rms_norm_residual's contract for rows whose parts of 8 elements fit the block's threads,
// RN_PARTS a thread (n_cols a multiple of 8, at most 8 RN_PARTS blockDim.x; with xq a multiple
// of 32), x, r, w and out 16-byte aligned: each thread holds its parts in registers, so x, r
// and w are read once, in 16-byte loads, and the sums and normed values written in 16-byte
// stores. With xq (not null) the normed rows are also quantized as qlinear4_quantize_x
// quantizes x (xq, its layout; m = n_rows, k = n_cols), from those registers, so that variant
// 4's matmuls of them need no launch of their own (part e of a row is part e % 4 of block
// e / 4, and the four parts of a block are four consecutive lanes, as quantize8 needs). One
// block of threads per row. Every launch of rms_norm_residual_vec rounds alike with or without
// xq (the same sums, in the same order), so the normed rows of the two equal each other bit
// for bit.
#define RN_PARTS 4
template <typename T>
__device__ void rms_norm_residual_vec(const T *x, const T *r, const T *w, T *out, uint4 *xq,
                                      uint32_t n_rows, uint32_t n_cols, float eps) {
    const size_t base = (size_t)blockIdx.x * n_cols;
    const uint32_t parts = n_cols >> 3;
    float v[RN_PARTS][8];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < RN_PARTS; ++j) {
        const uint32_t e = threadIdx.x + j * blockDim.x;
        if (e < parts) {
            float a[8], b[8];
            cvt8<T>(ld_raw(x + base + 8u * e, false), a);
            cvt8<T>(ld_raw(r + base + 8u * e, false), b);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                v[j][i] = to_f32(from_f32<T>(a[i] + b[i]));
                acc += v[j][i] * v[j][i];
            }
            st8<T>(out + base + 8u * e, v[j]);
        }
    }
    const float inv = 1.0f / sqrtf(block_sum(acc) / (float)n_cols + eps);
    T *normed = out + (size_t)n_rows * n_cols + base;
    const uint32_t nbp = q8_row_blocks(n_cols);
#pragma unroll
    for (int j = 0; j < RN_PARTS; ++j) {
        if (j * blockDim.x >= parts) break;  // uniform over the block
        const uint32_t e = threadIdx.x + j * blockDim.x;
        const bool mine = e < parts;
        if (mine) {
            float wv[8];
            cvt8<T>(ld_raw(w + 8u * e, false), wv);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[j][i] = to_f32(from_f32<T>(v[j][i] * inv * wv[i]));
            st8<T>(normed + 8u * e, v[j]);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[j][i] = 0.0f;
        }
        if (xq != nullptr)
            quantize8_store(v[j], mine, xq, n_rows, nbp, blockIdx.x, e >> 2, e & 3u);
    }
}

#define NORM_FOR(T, SUFFIX)                                                                     \
    extern "C" __global__ void rms_norm_residual_##SUFFIX(const T *x, const T *r, const T *w,  \
                                                          T *out, uint32_t n_rows,              \
                                                          uint32_t n_cols, float eps) {         \
        rms_norm_residual<T>(x, r, w, out, n_rows, n_cols, eps);                               \
    }                                                                                           \
    extern "C" __global__ void rms_norm_residual_vec_##SUFFIX(                                  \
        const T *x, const T *r, const T *w, T *out, uint4 *xq, uint32_t n_rows, uint32_t n_cols, \
        float eps) {                                                                            \
        rms_norm_residual_vec<T>(x, r, w, out, xq, n_rows, n_cols, eps);                        \
    }

NORM_FOR(float, f32)
NORM_FOR(__half, f16)
NORM_FOR(__nv_bfloat16, bf16)
