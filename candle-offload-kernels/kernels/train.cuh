// Helpers of the training kernels (norm_train.cu, loss.cu, flash.cu, flash_f32.cu): the f32
// constants and the block reductions every thread gets the result of.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

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


}  // namespace
