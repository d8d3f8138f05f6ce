// The softmax cross-entropy of `candle_offload_kernels::loss`, forward and backward: one block
// per row of logits, blockDim.x a multiple of 32 (at most 1024); once per element type of the
// logits as `<name>_f32`, `<name>_f16`, `<name>_bf16` (targets U32, the loss and its gradient
// F32).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "train.cuh"

namespace {

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

#define LOSS_FOR(T, SUFFIX)                                                                     \
    extern "C" __global__ void cross_entropy_fwd_##SUFFIX(const T *logits,                     \
                                                          const uint32_t *targets, float *loss, \
                                                          uint32_t v) {                         \
        cross_entropy_fwd<T>(logits, targets, loss, v);                                         \
    }                                                                                           \
    extern "C" __global__ void cross_entropy_bwd_##SUFFIX(                                      \
        const T *logits, const uint32_t *targets, const float *g, T *dx, uint32_t v) {          \
        cross_entropy_bwd<T>(logits, targets, g, dx, v);                                        \
    }

LOSS_FOR(float, f32)
LOSS_FOR(__half, f16)
LOSS_FOR(__nv_bfloat16, bf16)
