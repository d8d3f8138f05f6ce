// The multi-tensor AdamW of `candle_offload_kernels::optimizer` (FusedAdamW on a GPU), F32 only.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

// AdamW over many F32 tensors in one launch. `table` holds 5 u64 per tensor: the addresses of
// its parameter, gradient, first and second moment (f32, contiguous) and its element count.
// blockIdx.y picks the tensor; blocks along x stride over its elements. The arithmetic is
// candle-nn's AdamW, one rounded f32 operation at a time (no contraction into FMAs), on the
// gradient times gscale (1: as given; 1 / loss scale: unscaled here rather than in a pass of
// its own):
//   g = g*gscale; m = m*b1 + g*(1-b1); v = v*b2 + g*g*(1-b2);
//   p = p*(1-lr*wd) - (m*scale_m / (sqrt(v*scale_v) + eps)) * lr.
extern "C" __global__ void adamw_multi_f32(const uint64_t *table, float lr, float decay,
                                           float b1, float one_minus_b1, float b2,
                                           float one_minus_b2, float scale_m, float scale_v,
                                           float eps, float gscale) {
    const uint64_t *e = table + 5 * (size_t)blockIdx.y;
    float *p = reinterpret_cast<float *>(e[0]);
    const float *g = reinterpret_cast<const float *>(e[1]);
    float *m = reinterpret_cast<float *>(e[2]);
    float *v = reinterpret_cast<float *>(e[3]);
    const size_t n = (size_t)e[4];
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float gi = __fmul_rn(g[i], gscale);
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
