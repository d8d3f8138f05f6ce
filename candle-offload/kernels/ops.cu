// The fused decode kernels of `candle_offload::ops` (compiled to PTX by build.rs with the
// `cuda` feature, loaded by src/sys/kernels.rs). Every kernel reads and writes contiguous
// buffers of one element type (f32, f16 or bf16) and accumulates in f32; each exists once per
// type as `<name>_f32`, `<name>_f16`, `<name>_bf16` (Candle's kernel_name convention).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}

// Sum of `v` over the block. Every thread of the block must call it; blockDim.x is a multiple
// of 32 (at most 1024).
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const unsigned n_warps = blockDim.x >> 5;
        float w = lane < n_warps ? partial[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
        if (lane == 0) total = w;
    }
    __syncthreads();
    return total;
}

// One block per row of `n_cols`: sum = x + r (rounded to T), normed = sum / rms(sum) * w.
// `out` holds all the sums (n_rows * n_cols), then all the normed rows.
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

// out = silu(gate) * up, elementwise over `n`.
template <typename T>
__device__ void silu_mul(const T *gate, const T *up, T *out, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float g = to_f32(gate[i]);
        out[i] = from_f32<T>(g / (1.0f + expf(-g)) * to_f32(up[i]));
    }
}

// Half-rotated RoPE of q (b, t, hq, d) and k (b, t, hk, d) in one pass, written transposed:
// `out` holds q as (b, hq, t, d), then k as (b, hk, t, d). `cs` holds one row per position
// (t rows of 2 * rot_half: the cos of each rotated pair, then its sin); the first 2 * rot_half
// dimensions of each head rotate, the rest pass through (partial rotary).
template <typename T>
__device__ void rope_qk(const T *q, const T *k, const T *cs, T *out, uint32_t b, uint32_t t,
                        uint32_t hq, uint32_t hk, uint32_t d, uint32_t rot_half) {
    const size_t nq = (size_t)b * hq * t * d;
    const size_t n = nq + (size_t)b * hk * t * d;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        const bool is_q = e < nq;
        const size_t o = is_q ? e : e - nq;
        const uint32_t h = is_q ? hq : hk;
        const T *src = is_q ? q : k;
        const uint32_t i = (uint32_t)(o % d);
        const size_t row = o / d;  // (bi * h + hi) * t + ti
        const uint32_t ti = (uint32_t)(row % t);
        const size_t bh = row / t;
        const uint32_t hi = (uint32_t)(bh % h);
        const size_t bi = bh / h;
        const T *head = src + ((bi * t + ti) * h + hi) * (size_t)d;
        float y;
        if (i < 2 * rot_half) {
            const uint32_t j = i < rot_half ? i : i - rot_half;
            const float x1 = to_f32(head[j]);
            const float x2 = to_f32(head[j + rot_half]);
            const float c = to_f32(cs[(size_t)ti * 2 * rot_half + j]);
            const float s = to_f32(cs[(size_t)ti * 2 * rot_half + rot_half + j]);
            y = i < rot_half ? x1 * c - x2 * s : x2 * c + x1 * s;
        } else {
            y = to_f32(head[i]);
        }
        out[e] = from_f32<T>(y);
    }
}

#define OPS_FOR(T, SUFFIX)                                                                      \
    extern "C" __global__ void rms_norm_residual_##SUFFIX(const T *x, const T *r, const T *w,  \
                                                          T *out, uint32_t n_rows,              \
                                                          uint32_t n_cols, float eps) {         \
        rms_norm_residual<T>(x, r, w, out, n_rows, n_cols, eps);                               \
    }                                                                                           \
    extern "C" __global__ void silu_mul_##SUFFIX(const T *gate, const T *up, T *out, size_t n) { \
        silu_mul<T>(gate, up, out, n);                                                          \
    }                                                                                           \
    extern "C" __global__ void rope_qk_##SUFFIX(const T *q, const T *k, const T *cs, T *out,   \
                                                uint32_t b, uint32_t t, uint32_t hq,            \
                                                uint32_t hk, uint32_t d, uint32_t rot_half) {   \
        rope_qk<T>(q, k, cs, out, b, t, hq, hk, d, rot_half);                                   \
    }

OPS_FOR(float, f32)
OPS_FOR(__half, f16)
OPS_FOR(__nv_bfloat16, bf16)
