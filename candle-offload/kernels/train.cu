// The fused training ops of `candle_offload::train::fused` (compiled to PTX by build.rs with the
// `cuda` feature, loaded by src/sys/train_kernels.rs): RMSNorm forward and backward, SwiGLU
// forward and backward, softmax cross-entropy forward and backward, and a multi-tensor AdamW.
// Every kernel reads and writes contiguous buffers, accumulates in f32 and exists once per
// element type as `<name>_f32`, `<name>_f16`, `<name>_bf16` (Candle's kernel_name convention),
// except AdamW (F32 only). Row kernels run one block per row; blockDim.x is a multiple of 32, at
// most 1024. Elementwise kernels are grid-stride loops.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"

namespace {


__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fffffff); }

// Sum of `v` over the block; every thread gets it. Every thread of the block must call it.
// The barrier before the write to `partial` keeps a second call from overwriting it while a
// slow warp still reads the first call's values.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();  // an earlier call's readers are done with `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const unsigned n_warps = blockDim.x >> 5;
    float w = lane < n_warps ? partial[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
    return w;
}

// Maximum of `v` over the block; every thread gets it (same contract as block_sum).
__device__ float block_max(float v) {
    __shared__ float partial[32];
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const unsigned n_warps = blockDim.x >> 5;
    float w = lane < n_warps ? partial[lane] : neg_inf();
    for (int o = 16; o > 0; o >>= 1) w = fmaxf(w, __shfl_xor_sync(0xffffffffu, w, o));
    return w;
}

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

// out = silu(gate) * up, elementwise.
template <typename T>
__device__ void swiglu_fwd(const T *gate, const T *up, T *out, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float a = to_f32(gate[i]);
        const float s = 1.0f / (1.0f + expf(-a));
        out[i] = from_f32<T>(a * s * to_f32(up[i]));
    }
}

// out[0..n] = d gate = g * up * s * (1 + a * (1 - s)), out[n..2n] = d up = g * a * s, where
// s = sigmoid(a), a = gate.
template <typename T>
__device__ void swiglu_bwd(const T *gate, const T *up, const T *g, T *out, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float a = to_f32(gate[i]);
        const float s = 1.0f / (1.0f + expf(-a));
        const float gi = to_f32(g[i]);
        out[i] = from_f32<T>(gi * to_f32(up[i]) * s * (1.0f + a * (1.0f - s)));
        out[n + i] = from_f32<T>(gi * a * s);
    }
}

// log(sum(exp(x))) of the row `x` of `v` (every thread gets it): the max first, then the sum
// of exp(x - max), each one pass over the row in blockDim-wide chunks.
template <typename T> __device__ float row_logsumexp(const T *x, uint32_t v) {
    float m = neg_inf();
    for (uint32_t i = threadIdx.x; i < v; i += blockDim.x) m = fmaxf(m, to_f32(x[i]));
    m = block_max(m);
    float s = 0.0f;
    for (uint32_t i = threadIdx.x; i < v; i += blockDim.x) s += expf(to_f32(x[i]) - m);
    return m + logf(block_sum(s));
}

// One block per row of `v` logits: loss[row] = logsumexp(x) - x[target] (f32); a target
// outside the vocabulary gives NaN.
template <typename T>
__device__ void cross_entropy_fwd(const T *logits, const uint32_t *targets, float *loss,
                                  uint32_t v) {
    const size_t row = blockIdx.x;
    const T *x = logits + row * v;
    const float lse = row_logsumexp(x, v);
    if (threadIdx.x == 0) {
        const uint32_t t = targets[row];
        loss[row] = t < v ? lse - to_f32(x[t]) : nan_f32();
    }
}

// One block per row: dx = (softmax(x) - onehot(target)) * g[row] (g f32), the probabilities
// recomputed chunk by chunk from the row's logsumexp.
template <typename T>
__device__ void cross_entropy_bwd(const T *logits, const uint32_t *targets, const float *g,
                                  T *dx, uint32_t v) {
    const size_t row = blockIdx.x;
    const T *x = logits + row * v;
    const float lse = row_logsumexp(x, v);
    const uint32_t t = targets[row];
    const float gr = t < v ? g[row] : nan_f32();
    for (uint32_t i = threadIdx.x; i < v; i += blockDim.x) {
        const float p = expf(to_f32(x[i]) - lse) - (i == t ? 1.0f : 0.0f);
        dx[row * v + i] = from_f32<T>(p * gr);
    }
}

}  // namespace

#define TRAIN_OPS_FOR(T, SUFFIX)                                                                \
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
    }                                                                                           \
    extern "C" __global__ void swiglu_fwd_##SUFFIX(const T *gate, const T *up, T *out,         \
                                                   size_t n) {                                  \
        swiglu_fwd<T>(gate, up, out, n);                                                        \
    }                                                                                           \
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T *gate, const T *up, const T *g,     \
                                                   T *out, size_t n) {                          \
        swiglu_bwd<T>(gate, up, g, out, n);                                                     \
    }                                                                                           \
    extern "C" __global__ void cross_entropy_fwd_##SUFFIX(const T *logits,                     \
                                                          const uint32_t *targets, float *loss, \
                                                          uint32_t v) {                         \
        cross_entropy_fwd<T>(logits, targets, loss, v);                                         \
    }                                                                                           \
    extern "C" __global__ void cross_entropy_bwd_##SUFFIX(                                      \
        const T *logits, const uint32_t *targets, const float *g, T *dx, uint32_t v) {          \
        cross_entropy_bwd<T>(logits, targets, g, dx, v);                                        \
    }

TRAIN_OPS_FOR(float, f32)
TRAIN_OPS_FOR(__half, f16)
TRAIN_OPS_FOR(__nv_bfloat16, bf16)

// AdamW over many F32 tensors in one launch. `table` holds 5 u64 per tensor: the addresses of
// its parameter, gradient, first and second moment (f32, contiguous) and its element count.
// blockIdx.y picks the tensor; blocks along x stride over its elements. The arithmetic is
// candle-nn's AdamW, one rounded f32 operation at a time (no contraction into FMAs):
//   m = m*b1 + g*(1-b1); v = v*b2 + g*g*(1-b2);
//   p = p*(1-lr*wd) - (m*scale_m / (sqrt(v*scale_v) + eps)) * lr.
extern "C" __global__ void adamw_multi_f32(const uint64_t *table, float lr, float decay,
                                           float b1, float one_minus_b1, float b2,
                                           float one_minus_b2, float scale_m, float scale_v,
                                           float eps) {
    const uint64_t *e = table + 5 * (size_t)blockIdx.y;
    float *p = reinterpret_cast<float *>(e[0]);
    const float *g = reinterpret_cast<const float *>(e[1]);
    float *m = reinterpret_cast<float *>(e[2]);
    float *v = reinterpret_cast<float *>(e[3]);
    const size_t n = (size_t)e[4];
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float gi = g[i];
        const float nm = __fadd_rn(__fmul_rn(m[i], b1), __fmul_rn(gi, one_minus_b1));
        const float nv =
            __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(gi, gi), one_minus_b2));
        const float m_hat = __fmul_rn(nm, scale_m);
        const float v_hat = __fmul_rn(nv, scale_v);
        const float step = __fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), eps));
        p[i] = __fsub_rn(__fmul_rn(p[i], decay), __fmul_rn(step, lr));
        m[i] = nm;
        v[i] = nv;
    }
}
