// A mixture-of-experts layer's choice made on the device (`candle_offload_kernels::linear::routed`):
// a decode row's router logits to its top-k experts and their weights, and those experts'
// weight buffers looked up in a table of where each expert of the layer is (a device slot,
// or its host copy in page-locked memory, which the device reads through its mapped
// address). The grouped kernels then read the chosen buffers from the device
// (`qlinear3_experts_at_*`, `qlinear3k_experts_at_*`), so that no step waits on the host.
#include <stdint.h>

#include "common.cuh"
#include "qblocks.cuh"

// The most experts a layer may have here (eight per lane of one warp).
#define MOE_ROUTE_MAX_EXPERTS 256
// The most table entries one moe_table_set launch writes.
#define MOE_TABLE_SET_MAX 32

// What moe_route writes for one decode row, in expert order: the chosen experts' gate and up
// buffers (gu), their down buffers (down, w1 = w0), their weights and their indices. Its
// layout is `RoutedGroup` in linear/routed.rs (640 bytes).
struct RoutedGroup {
    GroupWeights gu;
    GroupWeights down;
    GroupScales s;
    uint32_t ids[MAX_GROUP_EXPERTS];
};

// Entries of a layer's table: entry at[i] (expert · 3 + projection, gate, up, down) of the
// table gets ptr[i].
struct TableEntries {
    uint32_t at[MOE_TABLE_SET_MAX];
    uint64_t ptr[MOE_TABLE_SET_MAX];
};

// moe_route: one warp. logits: the router's `experts` logits (F32); table: the layer's
// experts × 3 buffer addresses (gate, up, down). The top k by softmax probability (largest
// first, ties to the lower index), divided by their sum when `renorm`, as `route_row` in the
// models crate computes them (the softmax's sum taken in expert order, the top k's in
// choice order), written to `out` sorted by expert index.
extern "C" __global__ void __launch_bounds__(32)
    moe_route(const float *logits, uint32_t experts, uint32_t k, uint32_t renorm,
              const uint64_t *table, RoutedGroup *out) {
    const uint32_t lane = threadIdx.x;
    constexpr int PER = MOE_ROUTE_MAX_EXPERTS / 32;
    float v[PER];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const uint32_t e = lane + 32u * i;
        v[i] = e < experts ? logits[e] : -INFINITY;
        mx = fmaxf(mx, v[i]);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const uint32_t e = lane + 32u * i;
        v[i] = e < experts ? expf(v[i] - mx) : 0.0f;
    }
    // The sum in expert order, as the host's.
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        for (uint32_t l = 0; l < 32; ++l) {
            const float x = __shfl_sync(0xffffffffu, v[i], l);
            if (l + 32u * i < experts) sum += x;
        }
    }
    // k rounds of the warp's largest untaken probability; NaN ranks last.
    uint32_t taken = 0, my_id = 0;
    float my_p = 0.0f;
    for (uint32_t r = 0; r < k; ++r) {
        float best = -2.0f;
        uint32_t bi = 0xffffffffu;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const uint32_t e = lane + 32u * i;
            if (e < experts && !((taken >> i) & 1u)) {
                const float key = isnan(v[i]) ? -1.0f : v[i];
                if (key > best) {
                    best = key;
                    bi = e;
                }
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
            }
        }
        if (bi != 0xffffffffu && bi % 32u == lane) taken |= 1u << (bi / 32u);
        if (lane == r) {
            my_id = bi;
            my_p = best / sum;
        }
    }
    if (renorm) {
        float total = 0.0f;
        for (uint32_t j = 0; j < k; ++j) total += __shfl_sync(0xffffffffu, my_p, j);
        my_p /= total;
    }
    // Each chosen expert's place in expert order.
    uint32_t rank = 0;
    for (uint32_t j = 0; j < k; ++j) {
        const uint32_t other = __shfl_sync(0xffffffffu, my_id, j);
        if (other < my_id) ++rank;
    }
    if (lane < k && my_id < experts) {
        const uint64_t *t = table + 3u * (size_t)my_id;
        out->gu.w0[rank] = (const uint8_t *)t[0];
        out->gu.w1[rank] = (const uint8_t *)t[1];
        out->down.w0[rank] = (const uint8_t *)t[2];
        out->down.w1[rank] = (const uint8_t *)t[2];
        out->s.w[rank] = my_p;
        out->ids[rank] = my_id;
    }
}

// moe_table_set: table[e.at[i]] = e.ptr[i] for i < n (one thread each).
extern "C" __global__ void moe_table_set(uint64_t *table, TableEntries e, uint32_t n) {
    const uint32_t i = threadIdx.x;
    if (i < n) table[e.at[i]] = e.ptr[i];
}

// moe_combine: a prompt's rows back from their experts' order. y: the experts' outputs, one
// row (h wide) per routed copy of a row, in expert order; slots: for each of `rows` rows, k
// rows of y (0xffffffff: none); w: their weights (F32). out[t] = Σ_j w[t, j] · y[slots[t, j]],
// summed in F32 in slot order and rounded once. Grid-stride over rows · h: a thread one column
// of one row, so a warp reads consecutive columns of each y row.
template <typename T>
__device__ void moe_combine(const T *y, const uint32_t *slots, const float *w, T *out,
                            uint32_t rows, uint32_t k, uint32_t h) {
    const size_t n = (size_t)rows * h;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t t = i / h, c = i % h;
        float acc = 0.f;
        for (uint32_t j = 0; j < k; ++j) {
            const uint32_t s = slots[t * k + j];
            if (s != 0xffffffffu) acc += w[t * k + j] * to_f32(y[(size_t)s * h + c]);
        }
        out[i] = from_f32<T>(acc);
    }
}

#define MOE_COMBINE(T, NAME)                                                                   \
    extern "C" __global__ void NAME(const T *y, const uint32_t *slots, const float *w, T *out, \
                                    uint32_t rows, uint32_t k, uint32_t h) {                   \
        moe_combine<T>(y, slots, w, out, rows, k, h);                                          \
    }
MOE_COMBINE(float, moe_combine_f32)
MOE_COMBINE(__half, moe_combine_f16)
MOE_COMBINE(__nv_bfloat16, moe_combine_bf16)
