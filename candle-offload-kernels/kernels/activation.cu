// The SiLU · mul of `candle_offload_kernels::activation` (silu_mul, for inference) and the
// training SwiGLU's forward and backward (swiglu): elementwise grid-stride loops, each once per
// element type as `<name>_f32`, `<name>_f16`, `<name>_bf16`.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"

// out = silu(gate) * up, elementwise over `n`.
template <typename T>
__device__ void silu_mul(const T *gate, const T *up, T *out, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float g = to_f32(gate[i]);
        out[i] = from_f32<T>(g / (1.0f + expf(-g)) * to_f32(up[i]));
    }
}

namespace {

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

}  // namespace

#define ACTIVATION_FOR(T, SUFFIX)                                                               \
    extern "C" __global__ void silu_mul_##SUFFIX(const T *gate, const T *up, T *out, size_t n) { \
        silu_mul<T>(gate, up, out, n);                                                          \
    }                                                                                           \
    extern "C" __global__ void swiglu_fwd_##SUFFIX(const T *gate, const T *up, T *out,         \
                                                   size_t n) {                                  \
        swiglu_fwd<T>(gate, up, out, n);                                                        \
    }                                                                                           \
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T *gate, const T *up, const T *g,     \
                                                   T *out, size_t n) {                          \
        swiglu_bwd<T>(gate, up, g, out, n);                                                     \
    }

ACTIVATION_FOR(float, f32)
ACTIVATION_FOR(__half, f16)
ACTIVATION_FOR(__nv_bfloat16, bf16)
