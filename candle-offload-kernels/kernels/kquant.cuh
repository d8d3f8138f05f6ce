// Q4_K's sub-block scales and mins, for the K-quant matmuls (linear_k.cu) and the
// dequantizing kernels (gemm.cu).
#pragma once
#include <stdint.h>

// Sub-block j's (j < 8) 6-bit scale and min from a Q4_K super-block's 12 scale bytes s (ggml's
// get_scale_min_k4).
__device__ __forceinline__ void q4k_scale_min(const uint8_t *s, uint32_t j, float &sc,
                                              float &mn) {
    uint32_t a, b;
    if (j < 4) {
        a = s[j] & 63u;
        b = s[j + 4] & 63u;
    } else {
        a = (s[j + 4] & 0xFu) | ((uint32_t)(s[j - 4] >> 6) << 4);
        b = (uint32_t)(s[j + 4] >> 4) | ((uint32_t)(s[j] >> 6) << 4);
    }
    sc = (float)a;
    mn = (float)b;
}
