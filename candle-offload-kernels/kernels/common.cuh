// Helpers shared by the crate's CUDA kernels (kernels/*.cu include it): conversions of the
// element types to and from the f32 they accumulate in, and 16-byte loads and stores of eight
// elements.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}

// Raw 16-byte loads (8 elements of f16/bf16, 4 of f32), converted to f32 only when used, so
// that four loads in flight cost 16 registers rather than 32. `ld_stream` loads are evict-first
// (the weights, read once); `ld_keep` loads the reused x.
struct Raw8 {
    uint4 a, b;  // b only for f32
};
template <typename T> __device__ __forceinline__ Raw8 ld_raw(const T *p, bool stream);
template <> __device__ __forceinline__ Raw8 ld_raw<__half>(const __half *p, bool stream) {
    const uint4 *q = reinterpret_cast<const uint4 *>(p);
    return {stream ? __ldcs(q) : __ldg(q), make_uint4(0, 0, 0, 0)};
}
template <>
__device__ __forceinline__ Raw8 ld_raw<__nv_bfloat16>(const __nv_bfloat16 *p, bool stream) {
    const uint4 *q = reinterpret_cast<const uint4 *>(p);
    return {stream ? __ldcs(q) : __ldg(q), make_uint4(0, 0, 0, 0)};
}
template <> __device__ __forceinline__ Raw8 ld_raw<float>(const float *p, bool stream) {
    const uint4 *q = reinterpret_cast<const uint4 *>(p);
    return {stream ? __ldcs(q) : __ldg(q), stream ? __ldcs(q + 1) : __ldg(q + 1)};
}
template <typename T> __device__ __forceinline__ void cvt8(const Raw8 &r, float *o);
template <> __device__ __forceinline__ void cvt8<__half>(const Raw8 &r, float *o) {
    const __half2 *h = reinterpret_cast<const __half2 *>(&r.a);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        o[2 * i] = f.x;
        o[2 * i + 1] = f.y;
    }
}
template <> __device__ __forceinline__ void cvt8<__nv_bfloat16>(const Raw8 &r, float *o) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&r.a);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        o[2 * i] = f.x;
        o[2 * i + 1] = f.y;
    }
}
template <> __device__ __forceinline__ void cvt8<float>(const Raw8 &r, float *o) {
    o[0] = __uint_as_float(r.a.x); o[1] = __uint_as_float(r.a.y);
    o[2] = __uint_as_float(r.a.z); o[3] = __uint_as_float(r.a.w);
    o[4] = __uint_as_float(r.b.x); o[5] = __uint_as_float(r.b.y);
    o[6] = __uint_as_float(r.b.z); o[7] = __uint_as_float(r.b.w);
}

// Eight values rounded to T and stored at p (16-byte aligned) in one or two 16-byte stores.
template <typename T> __device__ __forceinline__ void st8(T *p, const float *v);
template <> __device__ __forceinline__ void st8<float>(float *p, const float *v) {
    float4 *q = reinterpret_cast<float4 *>(p);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <> __device__ __forceinline__ void st8<__half>(__half *p, const float *v) {
    uint4 u;
    uint32_t *w = reinterpret_cast<uint32_t *>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t *>(&h);
    }
    *reinterpret_cast<uint4 *>(p) = u;
}
template <>
__device__ __forceinline__ void st8<__nv_bfloat16>(__nv_bfloat16 *p, const float *v) {
    uint4 u;
    uint32_t *w = reinterpret_cast<uint32_t *>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t *>(&h);
    }
    *reinterpret_cast<uint4 *>(p) = u;
}

// f32 of an element another block of threads wrote in this launch (an L2 load, past L1).
__device__ __forceinline__ float ld_cg_f32(const float *p) { return __ldcg(p); }
__device__ __forceinline__ float ld_cg_f32(const __half *p) {
    return __half2float(__ushort_as_half(__ldcg(reinterpret_cast<const unsigned short *>(p))));
}
__device__ __forceinline__ float ld_cg_f32(const __nv_bfloat16 *p) {
    return __bfloat162float(
        __ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short *>(p))));
}
