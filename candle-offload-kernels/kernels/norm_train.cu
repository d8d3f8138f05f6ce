// The training RMSNorm of `candle_offload_kernels::norm` (rms_norm forward and backward): one
// block per row, blockDim.x a multiple of 32 (at most 1024); each kernel once per element type
// as `<name>_f32`, `<name>_f16`, `<name>_bf16`.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "train.cuh"

namespace {

// 1 / sqrt(mean(x^2) + eps) of the row `x` of `n` (every thread gets it).
template <typename T> __device__ float row_rstd(const T *x, uint32_t n, float eps) {
    float acc = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = to_f32(x[i]);
        acc += v * v;
    }
    return rsqrtf(block_sum(acc) / (float)n + eps);
}

// y = x * rstd(x) * w, one block per row.
template <typename T>
__device__ void rms_norm_fwd(const T *x, const T *w, T *y, uint32_t n, float eps) {
    const size_t base = (size_t)blockIdx.x * n;
    const float r = row_rstd(x + base, n, eps);
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        y[base + i] = from_f32<T>(to_f32(x[base + i]) * r * to_f32(w[i]));
    }
}

// One block per row: rstd[row] = 1 / sqrt(mean(x^2) + eps) (f32).
template <typename T> __device__ void rms_rstd(const T *x, float *rstd, uint32_t n, float eps) {
    const float r = row_rstd(x + (size_t)blockIdx.x * n, n, eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// One block per row: dx = r * g * w - x * r^3 * mean(g * w * x), r = rstd(x).
template <typename T>
__device__ void rms_norm_bwd_dx(const T *x, const T *w, const T *g, T *dx, uint32_t n,
                                float eps) {
    const size_t base = (size_t)blockIdx.x * n;
    const float r = row_rstd(x + base, n, eps);
    float acc = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        acc += to_f32(g[base + i]) * to_f32(w[i]) * to_f32(x[base + i]);
    }
    const float c = block_sum(acc) / (float)n * r * r * r;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = r * to_f32(g[base + i]) * to_f32(w[i]) - to_f32(x[base + i]) * c;
        dx[base + i] = from_f32<T>(v);
    }
}

// partial[chunk][col] = sum over the rows of `chunk` of g * x * rstd[row]: grid
// (ceil(n / blockDim.x), n_chunks), each chunk `rows_per_chunk` rows.
template <typename T>
__device__ void rms_norm_bwd_dw(const T *x, const T *g, const float *rstd, float *partial,
                                uint32_t n_rows, uint32_t n, uint32_t rows_per_chunk) {
    const uint32_t col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= n) return;
    const uint32_t chunk = blockIdx.y;
    const uint32_t start = chunk * rows_per_chunk;
    const uint32_t end = min(n_rows, start + rows_per_chunk);
    float acc = 0.0f;
    for (uint32_t row = start; row < end; ++row) {
        const size_t at = (size_t)row * n + col;
        acc += to_f32(g[at]) * to_f32(x[at]) * rstd[row];
    }
    partial[(size_t)chunk * n + col] = acc;
}

}  // namespace

#define NORM_TRAIN_FOR(T, SUFFIX)                                                               \
    extern "C" __global__ void rms_norm_fwd_##SUFFIX(const T *x, const T *w, T *y, uint32_t n, \
                                                     float eps) {                               \
        rms_norm_fwd<T>(x, w, y, n, eps);                                                       \
    }                                                                                           \
    extern "C" __global__ void rms_rstd_##SUFFIX(const T *x, float *rstd, uint32_t n,          \
                                                 float eps) {                                   \
        rms_rstd<T>(x, rstd, n, eps);                                                           \
    }                                                                                           \
    extern "C" __global__ void rms_norm_bwd_dx_##SUFFIX(const T *x, const T *w, const T *g,    \
                                                        T *dx, uint32_t n, float eps) {         \
        rms_norm_bwd_dx<T>(x, w, g, dx, n, eps);                                                \
    }                                                                                           \
    extern "C" __global__ void rms_norm_bwd_dw_##SUFFIX(const T *x, const T *g,                \
                                                        const float *rstd, float *partial,      \
                                                        uint32_t n_rows, uint32_t n,            \
                                                        uint32_t rows_per_chunk) {              \
        rms_norm_bwd_dw<T>(x, g, rstd, partial, n_rows, n, rows_per_chunk);                     \
    }

NORM_TRAIN_FOR(float, f32)
NORM_TRAIN_FOR(__half, f16)
NORM_TRAIN_FOR(__nv_bfloat16, bf16)
