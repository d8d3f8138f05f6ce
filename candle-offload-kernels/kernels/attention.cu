// The decode attention of `candle_offload_kernels::attention` (decode_attention and its
// padded, device-position and 8-bit forms), once per element type as
// `decode_attention_<dtype>`. (A prompt's attention is flash.cu's prompt_attn kernel.)
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "reduce.cuh"
#include "q8.cuh"

// Attention of tq new queries over the first kv_len positions of a KV cache, for decode.
// q is contiguous (b, hq, tq, d); k and v are (b, hk, >= kv_len, d) with the last dim contiguous
// and the other strides given (views of a preallocated cache); query qi sits at position
// kv_len - tq + qi and sees keys j <= its position, and with window > 0 only those with
// position < j + window (the causal and sliding-window masks). GQA/MQA: q head h reads kv head
// h / (hq / hk). out is (b, tq, hq, d); d <= 32 * DA_DIMS.
//
// Each query's visible keys are cut into `splits` equal ranges of at most DA_CHUNK keys
// (flash-decoding), one block of DA_WARPS warps each: grid (tq * splits, hq, b). A warp scores
// one key at a time, lane l multiplying dims l, l + 32, ... (each key row read coalesced), the
// warp's sum into shared memory; the range's maximum and exponentials follow, then each warp
// accumulates the value rows of its keys (again one coalesced row at a time) and the warps'
// sums are added. With one split the block writes its row of out. Otherwise it writes its
// range's (max, sum, weighted values) to `part`, and the last of the query's blocks to finish
// (an atomic count in `counters`, which it sets back to 0) combines them into out.
//
// With xq (not null; d a multiple of 32), the block that writes a row of out also writes it
// quantized into xq, variant 4's buffer for the output projection's x: m = b tq rows of
// k = hq d, the head's d / 32 blocks at h d / 32 (attention_row_q8), exactly as
// qlinear4_quantize_x would quantize out, so that projection needs no launch of its own.
#define DA_WARPS 8

// The row of out (d values, rounded to T, in `vals` in shared memory) quantized into xq by
// warp 0 of the block that wrote it: lane l takes elements 8 l .. 8 l + 7, part l % 4 of block
// l / 4 of the head (d <= 256: at most 32 lanes; the others quantize zeros for the shuffles).
__device__ __forceinline__ void attention_row_q8(const float *vals, uint4 *xq, uint32_t m,
                                                 uint32_t row, uint32_t h, uint32_t hq,
                                                 uint32_t d) {
    const uint32_t lane = threadIdx.x & 31u;
    const bool mine = lane < d / 8u;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = mine ? vals[8u * lane + i] : 0.0f;
    quantize8_store(v, mine, xq, m, q8_row_blocks(hq * d), row, h * (d / 32u) + lane / 4u,
                    lane & 3u);
}

#define DA_CHUNK 256
#define DA_DIMS 8
template <typename T>
__device__ void decode_attention(const T *q, const T *k, const T *v, T *out, uint4 *xq,
                                 float *part, uint32_t *counters, uint32_t tq, uint32_t hq,
                                 uint32_t hk,
                                 uint32_t d, uint32_t kv_len, uint64_t k_sb, uint64_t k_sh,
                                 uint64_t k_st, uint64_t v_sb, uint64_t v_sh, uint64_t v_st,
                                 float scale, uint32_t window, uint32_t splits,
                                 const uint32_t *pos_dev, const uint32_t *pads) {
    // A replayed decode step reads the cached length from the device: kv_len is then the
    // views' capacity, and the positions are *pos_dev + tq of them (at most kv_len).
    if (pos_dev != nullptr) kv_len = min(*pos_dev + tq, kv_len);
    __shared__ float ps[DA_CHUNK];
    __shared__ float sums[DA_WARPS][32 * DA_DIMS];
    __shared__ bool last;
    const uint32_t qi = blockIdx.x / splits, sp = blockIdx.x % splits;
    const uint32_t h = blockIdx.y, bi = blockIdx.z;
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const uint32_t kvh = h / (hq / hk);
    const uint32_t pos = kv_len - tq + qi;
    uint32_t lo = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;
    // Left padding of this batch row (pads not null): keys before pads[bi] are not tokens; a
    // query inside the padding sees only itself.
    if (pads != nullptr) lo = pos < pads[bi] ? pos : max(lo, pads[bi]);
    const uint32_t per = (pos + 1 - lo + splits - 1) / splits;
    const uint32_t start = lo + sp * per;
    const uint32_t end = min(pos + 1, start + per);
    const uint32_t n = end > start ? end - start : 0;
    const T *qrow = q + (((size_t)bi * hq + h) * tq + qi) * d;
    float qr[DA_DIMS];
#pragma unroll
    for (uint32_t i = 0; i < DA_DIMS; ++i) {
        const uint32_t e = lane + 32u * i;
        qr[i] = e < d ? to_f32(qrow[e]) * scale : 0.0f;
    }
    const T *kb = k + bi * k_sb + kvh * k_sh + (size_t)start * k_st;
    const T *vb = v + bi * v_sb + kvh * v_sh + (size_t)start * v_st;
    // Scores, two keys in flight per warp.
    for (uint32_t j = warp; j < n; j += 2 * DA_WARPS) {
        const uint32_t j2 = j + DA_WARPS;
        const T *k1 = kb + (size_t)j * k_st;
        const T *k2 = kb + (size_t)(j2 < n ? j2 : j) * k_st;
        float a1 = 0.0f, a2 = 0.0f;
#pragma unroll
        for (uint32_t i = 0; i < DA_DIMS; ++i) {
            const uint32_t e = lane + 32u * i;
            if (e < d) {
                a1 += qr[i] * to_f32(k1[e]);
                a2 += qr[i] * to_f32(k2[e]);
            }
        }
        a1 = warp_sum(a1);
        a2 = warp_sum(a2);
        if (lane == 0) {
            ps[j] = a1;
            if (j2 < n) ps[j2] = a2;
        }
    }
    __syncthreads();
    float mx = -__int_as_float(0x7f800000);
    for (uint32_t j = tid; j < n; j += blockDim.x) mx = fmaxf(mx, ps[j]);
    mx = block_max(mx);  // its barriers order the reads above before the writes below
    float l = 0.0f;
    for (uint32_t j = tid; j < n; j += blockDim.x) {
        const float p = expf(ps[j] - mx);
        ps[j] = p;
        l += p;
    }
    l = block_sum(l);  // its barriers also publish ps
    float acc[DA_DIMS];
#pragma unroll
    for (uint32_t i = 0; i < DA_DIMS; ++i) acc[i] = 0.0f;
    for (uint32_t j = warp; j < n; j += DA_WARPS) {
        const T *vr = vb + (size_t)j * v_st;
        const float pj = ps[j];
#pragma unroll
        for (uint32_t i = 0; i < DA_DIMS; ++i) {
            const uint32_t e = lane + 32u * i;
            if (e < d) acc[i] += pj * to_f32(vr[e]);
        }
    }
#pragma unroll
    for (uint32_t i = 0; i < DA_DIMS; ++i) sums[warp][lane + 32u * i] = acc[i];
    __syncthreads();
    const size_t row = ((size_t)bi * tq + qi) * hq + h;  // out's row, and the record's
    T *orow = out + row * d;
    const uint32_t m = (uint32_t)gridDim.z * tq, xrow = bi * tq + qi;  // xq's rows, this one's
    if (splits == 1) {
        for (uint32_t e = tid; e < d; e += blockDim.x) {
            float a = 0.0f;
#pragma unroll
            for (uint32_t w = 0; w < DA_WARPS; ++w) a += sums[w][e];
            const T o = from_f32<T>(a / l);
            orow[e] = o;
            sums[0][e] = to_f32(o);  // only this thread read column e above
        }
        if (xq != nullptr) {
            __syncthreads();
            if (warp == 0) attention_row_q8(sums[0], xq, m, xrow, h, hq, d);
        }
        return;
    }
    // This range's record: max, sum, then d weighted values.
    float *rec = part + (row * splits + sp) * (d + 2);
    for (uint32_t e = tid; e < d; e += blockDim.x) {
        float a = 0.0f;
#pragma unroll
        for (uint32_t w = 0; w < DA_WARPS; ++w) a += sums[w][e];
        rec[2 + e] = a;
    }
    if (tid == 0) {
        rec[0] = n > 0 ? mx : -__int_as_float(0x7f800000);
        rec[1] = l;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const uint32_t done = atomicAdd(counters + row, 1u);
        last = done == splits - 1;
        if (last) counters[row] = 0;  // ready for the next launch on this stream
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Split 0 is never empty (it starts at lo <= pos), so the maximum is finite.
    const float *recs = part + row * splits * (d + 2);
    float mx_all = -__int_as_float(0x7f800000);
    for (uint32_t s = 0; s < splits; ++s) mx_all = fmaxf(mx_all, __ldcg(recs + s * (d + 2)));
    float total = 0.0f;
    for (uint32_t s = 0; s < splits; ++s) {
        const float *r = recs + s * (d + 2);
        total += expf(__ldcg(r) - mx_all) * __ldcg(r + 1);
    }
    for (uint32_t e = tid; e < d; e += blockDim.x) {
        float a = 0.0f;
        for (uint32_t s = 0; s < splits; ++s) {
            const float *r = recs + s * (d + 2);
            a += expf(__ldcg(r) - mx_all) * __ldcg(r + 2 + e);
        }
        const T o = from_f32<T>(a / total);
        orow[e] = o;
        sums[0][e] = to_f32(o);  // sums is not read after the records were written
    }
    if (xq != nullptr) {
        __syncthreads();
        if (warp == 0) attention_row_q8(sums[0], xq, m, xrow, h, hq, d);
    }
}

#define ATTENTION_FOR(T, SUFFIX)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * DA_WARPS) decode_attention_##SUFFIX(     \
        const T *q, const T *k, const T *v, T *out, uint4 *xq, float *part,                     \
        uint32_t *counters, uint32_t tq, uint32_t hq, uint32_t hk, uint32_t d, uint32_t kv_len, \
        uint64_t k_sb, uint64_t k_sh, uint64_t k_st, uint64_t v_sb, uint64_t v_sh,              \
        uint64_t v_st, float scale, uint32_t window, uint32_t splits,                           \
        const uint32_t *pos_dev, const uint32_t *pads) {                                        \
        decode_attention<T>(q, k, v, out, xq, part, counters, tq, hq, hk, d, kv_len, k_sb,      \
                            k_sh, k_st, v_sb, v_sh, v_st, scale, window, splits, pos_dev,       \
                            pads);                                                              \
    }

ATTENTION_FOR(float, f32)
ATTENTION_FOR(__half, f16)
ATTENTION_FOR(__nv_bfloat16, bf16)

// A ragged decode step's attention: n sequences of one new query each, q (n, hq, d)
// contiguous, each over its own cache. `seqs` holds three u64 per sequence, as rope.cu's
// rope_qk_ragged reads them: its key and value buffers' addresses ((hk, cap, d) each) and
// (cap << 32) | pos, where pos is the new position (the query sees keys 0 ..= pos). Grid
// (splits, hq, n); out (n, hq, d). Every sequence's visible keys are cut into the same number
// of splits, each of at most DA_CHUNK keys for the longest (the host chooses splits for it).
template <typename T>
__device__ void decode_attention_ragged(const T *q, const uint64_t *seqs, T *out, float *part,
                                        uint32_t *counters, uint32_t hq, uint32_t hk,
                                        uint32_t d, float scale, uint32_t window,
                                        uint32_t splits) {
    const uint32_t bi = blockIdx.z;
    const T *k = (const T *)seqs[3 * (size_t)bi];
    const T *v = (const T *)seqs[3 * (size_t)bi + 1];
    const uint64_t meta = seqs[3 * (size_t)bi + 2];
    const uint64_t cap = meta >> 32;
    // A position past the cache (a table the host did not check) reads no key outside it.
    const uint32_t kv_len = (uint32_t)min((uint64_t)(uint32_t)meta + 1, cap);
    // Batch row bi of q and out; its cache has no batch stride (one sequence per buffer).
    decode_attention<T>(q, k, v, out, nullptr, part, counters, 1, hq, hk, d, kv_len, 0, cap * d,
                        d, 0, cap * d, d, scale, window, splits, nullptr, nullptr);
}

#define ATTENTION_RAGGED_FOR(T, SUFFIX)                                                         \
    extern "C" __global__ void __launch_bounds__(32 * DA_WARPS)                                 \
        decode_attention_ragged_##SUFFIX(const T *q, const uint64_t *seqs, T *out, float *part,  \
                                         uint32_t *counters, uint32_t hq, uint32_t hk,          \
                                         uint32_t d, float scale, uint32_t window,              \
                                         uint32_t splits) {                                     \
        decode_attention_ragged<T>(q, seqs, out, part, counters, hq, hk, d, scale, window,     \
                                   splits);                                                     \
    }

ATTENTION_RAGGED_FOR(float, f32)
ATTENTION_RAGGED_FOR(__half, f16)
ATTENTION_RAGGED_FOR(__nv_bfloat16, bf16)
