// Warp and block reductions of the inference kernels (norm.cu, attention.cu, linear*.cu).
#pragma once
#include <stdint.h>

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

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Maximum of `v` over the block (as block_sum).
__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const unsigned n_warps = blockDim.x >> 5;
        float w = lane < n_warps ? partial[lane] : -__int_as_float(0x7f800000);
        for (int o = 16; o > 0; o >>= 1) w = fmaxf(w, __shfl_xor_sync(0xffffffffu, w, o));
        if (lane == 0) total = w;
    }
    __syncthreads();
    return total;
}
