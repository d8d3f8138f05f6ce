// Causal self-attention on tensor cores (f16/bf16) for `candle_offload_kernels::attention`:
// the training forward and backward (flash_attention) and a prompt's attention over a KV cache
// (prompt_attention), FlashAttention-2 style. (F32 is flash_f32.cu's.)
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "train.cuh"
#include "flash.cuh"

// ---------------------------------------------------------------------------------------------
// Causal self-attention, FlashAttention-2 style, on tensor cores (f16/bf16 inputs, f32
// accumulators), for `candle_offload_kernels::attention::flash_attention`.
//
// q, o: [b, h, t, D]; k, v: [b, hkv, t, D] (h % hkv == 0, query head i reads kv head
// i / (h / hkv)); lse: [b, h, t] f32 (natural log). All contiguous, each buffer starting
// 16-byte aligned (the tiles are loaded with 16-byte vectors). Row i attends to keys 0..=i.
//
// Forward (flash_attn_fwd_*: mma.sync m16n8k16 and ldmatrix; flash_attn_fwd_wmma_*: WMMA, S,
// P and O staged in shared memory, the first version, kept as a reference): grid
// (ceil(t / 64), b * h), 4 warps; a CTA owns 64 query rows (a warp 16 of them) and loops over
// 64-key tiles up to the diagonal with an online softmax. Writes O and L = m + log l.
//
// prompt_attn_* runs the same forward for an inference prompt (`candle_offload_kernels::attention::
// prompt_attention`): k and v are the tk >= t cached positions of a KV cache whose heads lie
// kstride elements apart (rows of D contiguous); query row i sits at position tk - t + i and
// attends to keys 0..=tk - t + i. No L.
//
// Backward (WMMA 16x16x16; S, P, dP and dS go through shared memory, as WMMA fragments'
// layout is opaque): flash_attn_bwd_prep computes D = rowsum(dO * O) (f32) first; then grid
// (ceil(t / 64), b * h), 8 warps: a CTA owns 64 keys of one query head (so of the kv head of
// its group) and loops over the 64-row query tiles from the diagonal on: S = Q K^T,
// P = exp(S * scale - L) (masked), dV += P^T dO, dP = dO V^T, dS = P * (dP - D) * scale,
// dK += dS^T Q, dQ += dS K. dK and dV stay in registers (each warp its fragments) over the
// loop; at the end they are stored, or, where several query heads share a kv head (GQA,
// MQA), added with atomicAdd: one CTA per query head rather than one looping over the
// group's heads (8 times the CTAs and an eighth of the longest CTA's work at 32:4). dQ is
// added to an f32 buffer with atomicAdd. The gradients are f32: dq, dk, dv (zeroed by the
// caller).
#include <mma.h>

namespace {

constexpr int FA_FWD_WARPS = 4;  // FA_BM / 16
constexpr int FA_BWD_WARPS = 8;

template <int D> struct FaSmem {
    static constexpr int LDT = D + 8;       // row pitch of f16/bf16 [rows][D] tiles
    static constexpr int LDS = FA_BN + 4;   // row pitch of f32 [rows][FA_BN] tiles
    static constexpr int LDP = FA_BN + 8;   // row pitch of f16/bf16 [rows][FA_BN] tiles
    static constexpr int LDO = D + 4;       // row pitch of the WMMA forward's f32 O tile
    static constexpr size_t tile_t = (size_t)FA_BM * LDT * 2;   // bytes of a [64][D] tile
    static constexpr size_t tile_s = (size_t)FA_BM * LDS * 4;   // bytes of a [64][64] f32 tile
    static constexpr size_t tile_p = (size_t)FA_BM * LDP * 2;   // bytes of a [64][64] T tile
    // Forward (mma.sync): Q, then K and V twice (double-buffered).
    static constexpr size_t fwd = 5 * tile_t;
    // Forward (WMMA): Q, K, V, S, P, O.
    static constexpr size_t fwd_wmma = 3 * tile_t + tile_s + tile_p + (size_t)FA_BM * LDO * 4;
    // Backward: Q, dO, K, V, P (f32), dP (f32, unpadded; the warps' 16x16 f32 scratch once dS
    // is formed), P then dS (T), L and D of the query tile: under 113 KiB for D = 128, so two
    // blocks fit on an SM.
    static constexpr int LDD = FA_BN;  // row pitch of dP
    static constexpr size_t bwd =
        4 * tile_t + tile_s + (size_t)FA_BM * LDD * 4 + tile_p + 2 * FA_BM * 4;
    static_assert(FA_BWD_WARPS * 16 * 16 <= FA_BM * LDD, "the scratch fits in dP");
    // What an sm_80+ block may opt into (sm_80: 163 KiB; sm_90: 227 KiB).
    static_assert(fwd_wmma <= 163 * 1024 && bwd <= 163 * 1024, "attention tiles exceed shared memory");
};

// Copies rows [row0, row0 + 64) of a [t][D] matrix into a [64][LDT] tile, zeros past t.
template <typename T, int D, int LDT>
__device__ __forceinline__ void fa_load_tile(T *dst, const T *src, uint32_t row0, uint32_t t) {
    constexpr int VEC = 8;  // 8 x 16-bit = 16 bytes
    constexpr int PER_ROW = D / VEC;
    for (int i = threadIdx.x; i < FA_BM * PER_ROW; i += blockDim.x) {
        const int r = i / PER_ROW;
        const int c = (i % PER_ROW) * VEC;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (row0 + r < t) {
            val = *reinterpret_cast<const uint4 *>(src + (size_t)(row0 + r) * D + c);
        }
        *reinterpret_cast<uint4 *>(dst + r * LDT + c) = val;
    }
}

// Copies rows [row0, row0 + 64) of a [t][D] matrix into a [64][LDT] tile with 16-byte
// cp.async copies (sm_80+), zero-filling rows past t; complete after fa_cp_async_wait.
template <typename T, int D, int LDT>
__device__ __forceinline__ void fa_load_tile_async(T *dst, const T *src, uint32_t row0,
                                                   uint32_t t) {
#if __CUDA_ARCH__ >= 800
    constexpr int VEC = 8;
    constexpr int PER_ROW = D / VEC;
    for (int i = threadIdx.x; i < FA_BM * PER_ROW; i += blockDim.x) {
        const int r = i / PER_ROW;
        const int c = (i % PER_ROW) * VEC;
        const bool in = row0 + r < t;
        // A row past t reads nothing (source size 0) from a valid address.
        const T *g = src + (size_t)(in ? row0 + r : 0) * D + c;
        const uint32_t sa = (uint32_t)__cvta_generic_to_shared(dst + r * LDT + c);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(g),
                     "r"(in ? 16 : 0));
    }
#endif
}

// One 16x16 fragment of A B^T into shared memory (row-major, stride ldo): A's and B's 16 rows
// at a and b, each [16][LDT] over D columns (the backward pass's S = Q K^T and dP = dO V^T).
template <typename T, int D, int LDT>
__device__ __forceinline__ void fa_abt_fragment(const T *a, const T *b, float *out, int ldo) {
    using namespace nvcuda;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll 2
    for (int kf = 0; kf < D / 16; ++kf) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, a + kf * 16, LDT);
        wmma::load_matrix_sync(fb, b + kf * 16, LDT);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out, acc, ldo, wmma::mem_row_major);
}

__device__ __forceinline__ void fa_cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N> __device__ __forceinline__ void fa_cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Two floats as the packed pair of 16-bit values an mma operand register holds (lo first).
template <typename T> __device__ __forceinline__ uint32_t fa_pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t fa_pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}
template <> __device__ __forceinline__ uint32_t fa_pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}

// c += a * b for one m16n8k16 tile (a: 4 registers, row-major 16x16; b: 2 registers, the
// 16x8 column-major operand; c: 4 f32), f16 or bf16 inputs.
template <typename T>
__device__ __forceinline__ void fa_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void fa_mma<__half>(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
template <>
__device__ __forceinline__ void fa_mma<__nv_bfloat16>(float c[4], const uint32_t a[4],
                                                      uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// ldmatrix .x4: four 8x8 16-bit matrices from shared memory, lane l giving the address of row
// l % 8 of matrix l / 8; register i gets matrix i's (row lane / 4, columns 2 (lane % 4) + 0..1),
// or with TRANS the transposed matrix's.
template <bool TRANS> __device__ __forceinline__ void fa_ldsm_x4(uint32_t r[4], const void *p) {
#if __CUDA_ARCH__ >= 800
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    }
#endif
}

// The forward pass: mma.sync m16n8k16 with every accumulator in registers (FlashAttention-2).
// A warp owns 16 query rows; lane (g = lane / 4, q = lane % 4) holds rows g and g + 8 of each
// 16x8 accumulator tile, columns 2q and 2q + 1. Q's fragments are loaded once; per 64-key tile
// S (8 tiles of 16x8) is masked, its rows' maxima and sums updated (a row's 4 lanes combine by
// shuffles), O (D / 8 tiles) rescaled, and P, repacked from S's registers as the A operand,
// multiplied by V (ldmatrix.trans). Shared memory holds only the Q, K and V tiles.
template <typename T, int D>
__device__ void flash_attn_fwd_mma(const T *__restrict__ q, const T *__restrict__ k,
                               const T *__restrict__ v, T *__restrict__ o,
                               float *__restrict__ lse, uint32_t h, uint32_t hkv, uint32_t t,
                               uint32_t tk, size_t kstride, float scale) {
#if __CUDA_ARCH__ >= 800
    using S = FaSmem<D>;
    constexpr int LDT = S::LDT;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    T *sQ = reinterpret_cast<T *>(fa_smem);
    // K and V of key tile kt in buffer kt % 2: the next tile's copies run during this one's math.
    auto sk_of = [&](uint32_t kt) {
        return reinterpret_cast<T *>(fa_smem + (1 + 2 * (kt & 1)) * S::tile_t);
    };
    auto sv_of = [&](uint32_t kt) {
        return reinterpret_cast<T *>(fa_smem + (2 + 2 * (kt & 1)) * S::tile_t);
    };
    static_assert(5 * S::tile_t == S::fwd, "layout");

    // The last query tiles have the most keys: start them first.
    const uint32_t m0 = (gridDim.x - 1 - blockIdx.x) * FA_BM;
    const uint32_t head = blockIdx.y;  // b * h + hi
    const uint32_t bi = head / h, hi = head % h;
    const uint32_t kvh = bi * hkv + hi / (h / hkv);
    const T *kh = k + (size_t)kvh * kstride;
    const T *vh = v + (size_t)kvh * kstride;
    const uint32_t off = tk - t;  // query row r sits at position off + r
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    // ldmatrix addressing: the row and column this lane points at within a 16x16 block.
    const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lcol = (lane >> 4) * 8;
    const int krow = (lane & 7) + (lane >> 4) * 8, kcol = ((lane >> 3) & 1) * 8;

    fa_load_tile<T, D, LDT>(sQ, q + (size_t)head * t * D, m0, t);
    __syncthreads();
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kf = 0; kf < D / 16; ++kf) {
        fa_ldsm_x4<false>(qf[kf], sQ + (warp * 16 + lrow) * LDT + kf * 16 + lcol);
    }

    const uint32_t row0 = m0 + warp * 16 + g, row1 = row0 + 8;
    float oacc[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) oacc[j][0] = oacc[j][1] = oacc[j][2] = oacc[j][3] = 0.0f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.0f, 0.0f};

    const uint32_t last = min(tk, off + m0 + FA_BM);  // keys < last are seen by some row
    const uint32_t n_tiles = (last + FA_BN - 1) / FA_BN;
    fa_load_tile_async<T, D, LDT>(sk_of(0), kh, 0, tk);
    fa_load_tile_async<T, D, LDT>(sv_of(0), vh, 0, tk);
    fa_cp_async_commit();
    for (uint32_t kt = 0; kt < n_tiles; ++kt) {
        const uint32_t n0 = kt * FA_BN;
        if (kt + 1 < n_tiles) {
            // The other buffer was last read in tile kt - 1, before its closing barrier.
            fa_load_tile_async<T, D, LDT>(sk_of(kt + 1), kh, n0 + FA_BN, tk);
            fa_load_tile_async<T, D, LDT>(sv_of(kt + 1), vh, n0 + FA_BN, tk);
            fa_cp_async_commit();
            fa_cp_async_wait<1>();  // this thread's copies of tile kt have landed
        } else {
            fa_cp_async_wait<0>();
        }
        __syncthreads();  // and every thread's
        const T *sK = sk_of(kt);
        const T *sV = sv_of(kt);

        float s[FA_BN / 8][4];
#pragma unroll
        for (int j = 0; j < FA_BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kf = 0; kf < D / 16; ++kf) {
#pragma unroll
            for (int nj = 0; nj < FA_BN / 16; ++nj) {
                uint32_t b[4];
                fa_ldsm_x4<false>(b, sK + (nj * 16 + krow) * LDT + kf * 16 + kcol);
                fa_mma<T>(s[2 * nj], qf[kf], b[0], b[1]);
                fa_mma<T>(s[2 * nj + 1], qf[kf], b[2], b[3]);
            }
        }

        // Scale and mask (key after the row's position or past tk), then the rows' maxima.
        float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int j = 0; j < FA_BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint32_t col = n0 + j * 8 + 2 * tq + (e & 1);
                const uint32_t row = e < 2 ? row0 : row1;
                const float val = (col <= row + off && col < tk) ? s[j][e] * scale : neg_inf();
                s[j][e] = val;
                mx[e >> 1] = fmaxf(mx[e >> 1], val);
            }
        }
        float alpha[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            // Every row sees key 0 in the first tile, so the maximum is finite from then on.
            const float m_new = fmaxf(m_run[i], mx[i]);
            alpha[i] = __expf(m_run[i] - m_new);
            m_run[i] = m_new;
            l_run[i] *= alpha[i];  // this lane's partial sum of the row
        }
#pragma unroll
        for (int j = 0; j < FA_BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = __expf(s[j][e] - m_run[e >> 1]);
                s[j][e] = p;
                l_run[e >> 1] += p;
            }
        }
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            oacc[j][0] *= alpha[0];
            oacc[j][1] *= alpha[0];
            oacc[j][2] *= alpha[1];
            oacc[j][3] *= alpha[1];
        }

        // O += P V, 16 keys per step.
#pragma unroll
        for (int kk = 0; kk < FA_BN / 16; ++kk) {
            const uint32_t a[4] = {
                fa_pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                fa_pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                fa_pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                fa_pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            };
#pragma unroll
            for (int dj = 0; dj < D / 16; ++dj) {
                uint32_t b[4];
                fa_ldsm_x4<true>(b, sV + (kk * 16 + lrow) * LDT + dj * 16 + lcol);
                fa_mma<T>(oacc[2 * dj], a, b[0], b[1]);
                fa_mma<T>(oacc[2 * dj + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with this tile's K and V
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
    }
    const float inv[2] = {1.0f / l_run[0], 1.0f / l_run[1]};
    T *oh = o + (size_t)head * t * D;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const uint32_t row = i == 0 ? row0 : row1;
        if (row >= t) continue;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const uint32_t packed = fa_pack2<T>(oacc[j][2 * i] * inv[i], oacc[j][2 * i + 1] * inv[i]);
            *reinterpret_cast<uint32_t *>(oh + (size_t)row * D + j * 8 + 2 * tq) = packed;
        }
        if (lse != nullptr && tq == 0) lse[(size_t)head * t + row] = m_run[i] + logf(l_run[i]);
    }
#else
    __trap();
#endif
}

// The forward pass with WMMA (16x16x16 fragments): S, P and the O accumulator go through
// shared memory, as WMMA fragments' layout is opaque, so the per-row rescaling and masking are
// plain loops over a warp's own 16 rows (lanes 2r and 2r + 1 own row r). Slower than
// flash_attn_fwd_mma (shared-memory round trips); kept as its reference on the GPU.
template <typename T, int D>
__device__ void flash_attn_fwd_wmma(const T *__restrict__ q, const T *__restrict__ k,
                               const T *__restrict__ v, T *__restrict__ o,
                               float *__restrict__ lse, uint32_t h, uint32_t hkv, uint32_t t,
                               float scale) {
#if __CUDA_ARCH__ >= 800
    using namespace nvcuda;
    using S = FaSmem<D>;
    constexpr int LDT = S::LDT, LDS = S::LDS, LDP = S::LDP, LDO = S::LDO;
    constexpr size_t tile_o = (size_t)FA_BM * LDO * 4;  // the f32 O accumulator
    extern __shared__ __align__(128) unsigned char fa_smem[];
    T *sQ = reinterpret_cast<T *>(fa_smem);
    T *sK = reinterpret_cast<T *>(fa_smem + S::tile_t);
    T *sV = reinterpret_cast<T *>(fa_smem + 2 * S::tile_t);
    float *sS = reinterpret_cast<float *>(fa_smem + 3 * S::tile_t);
    T *sP = reinterpret_cast<T *>(fa_smem + 3 * S::tile_t + S::tile_s);
    float *sO = reinterpret_cast<float *>(fa_smem + 3 * S::tile_t + S::tile_s + S::tile_p);
    static_assert(3 * S::tile_t + S::tile_s + S::tile_p + tile_o == S::fwd_wmma, "layout");

    // The last query tiles have the most keys: start them first.
    const uint32_t m0 = (gridDim.x - 1 - blockIdx.x) * FA_BM;
    const uint32_t head = blockIdx.y;  // b * h + hi
    const uint32_t bi = head / h, hi = head % h;
    const uint32_t kvh = bi * hkv + hi / (h / hkv);
    const T *qh = q + (size_t)head * t * D;
    const T *kh = k + (size_t)kvh * t * D;
    const T *vh = v + (size_t)kvh * t * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    fa_load_tile<T, D, LDT>(sQ, qh, m0, t);
    for (int i = threadIdx.x; i < FA_BM * LDO; i += blockDim.x) sO[i] = 0.0f;

    // Lanes 2r and 2r+1 own row r of the warp's 16: columns [half * n / 2, (half + 1) * n / 2).
    const int r = lane >> 1, half_ = lane & 1;
    const uint32_t row = m0 + warp * 16 + r;
    float m_run = neg_inf(), l_run = 0.0f;

    const uint32_t last = min(t, m0 + FA_BM);  // keys < last are seen by some row
    const uint32_t n_tiles = (last + FA_BN - 1) / FA_BN;
    float *wS = sS + warp * 16 * LDS;
    T *wP = sP + warp * 16 * LDP;
    float *wO = sO + warp * 16 * LDO;
    const T *wQ = sQ + warp * 16 * LDT;
    for (uint32_t kt = 0; kt < n_tiles; ++kt) {
        const uint32_t n0 = kt * FA_BN;
        __syncthreads();  // every warp is done with the previous K and V
        fa_load_tile<T, D, LDT>(sK, kh, n0, t);
        fa_load_tile<T, D, LDT>(sV, vh, n0, t);
        __syncthreads();

        // S = Q K^T for the warp's 16 rows.
#pragma unroll
        for (int nf = 0; nf < FA_BN / 16; ++nf) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.0f);
#pragma unroll
            for (int kf = 0; kf < D / 16; ++kf) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bk;
                wmma::load_matrix_sync(a, wQ + kf * 16, LDT);
                wmma::load_matrix_sync(bk, sK + nf * 16 * LDT + kf * 16, LDT);
                wmma::mma_sync(acc, a, bk, acc);
            }
            wmma::store_matrix_sync(wS + nf * 16, acc, LDS, wmma::mem_row_major);
        }
        __syncwarp();

        // Online softmax over the row's valid keys (j <= row, j < t).
        constexpr int HALF_N = FA_BN / 2;
        const int c0 = half_ * HALF_N;
        float mx = neg_inf();
        for (int c = c0; c < c0 + HALF_N; ++c) {
            const uint32_t j = n0 + c;
            if (j <= row && j < t) mx = fmaxf(mx, wS[r * LDS + c] * scale);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m_run, mx);
        // Every row sees key 0 in the first tile, so m_new is finite from then on.
        const float alpha = __expf(m_run - m_new);
        float sum = 0.0f;
        for (int c = c0; c < c0 + HALF_N; ++c) {
            const uint32_t j = n0 + c;
            float p = 0.0f;
            if (j <= row && j < t) p = __expf(wS[r * LDS + c] * scale - m_new);
            sum += p;
            wP[r * LDP + c] = from_f32<T>(p);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l_run = l_run * alpha + sum;
        m_run = m_new;
        constexpr int HALF_D = D / 2;
        for (int c = half_ * HALF_D; c < (half_ + 1) * HALF_D; ++c) wO[r * LDO + c] *= alpha;
        __syncwarp();

        // O += P V for the warp's rows.
#pragma unroll
        for (int df = 0; df < D / 16; ++df) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, wO + df * 16, LDO, wmma::mem_row_major);
#pragma unroll
            for (int kf = 0; kf < FA_BN / 16; ++kf) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bv;
                wmma::load_matrix_sync(a, wP + kf * 16, LDP);
                wmma::load_matrix_sync(bv, sV + kf * 16 * LDT + df * 16, LDT);
                wmma::mma_sync(acc, a, bv, acc);
            }
            wmma::store_matrix_sync(wO + df * 16, acc, LDO, wmma::mem_row_major);
        }
        __syncwarp();
    }

    if (row < t) {
        const float inv = 1.0f / l_run;
        constexpr int HALF_D = D / 2;
        T *orow = o + ((size_t)head * t + row) * D;
        for (int c = half_ * HALF_D; c < (half_ + 1) * HALF_D; ++c) {
            orow[c] = from_f32<T>(wO[r * LDO + c] * inv);
        }
        if (half_ == 0) lse[(size_t)head * t + row] = m_run + logf(l_run);
    }
#else
    __trap();
#endif
}

// One warp per row of D: dvec[row] = sum(dO * O) in f32.
template <typename T>
__device__ void flash_attn_bwd_prep(const T *o, const T *dout, float *dvec, uint32_t rows,
                                    uint32_t d) {
    const uint32_t row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const uint32_t lane = threadIdx.x & 31u;
    if (row >= rows) return;
    const T *a = o + (size_t)row * d;
    const T *b = dout + (size_t)row * d;
    float acc = 0.0f;
    for (uint32_t c = lane; c < d; c += 32) acc += to_f32(a[c]) * to_f32(b[c]);
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane == 0) dvec[row] = acc;
}

// Adds a warp's 16x16 f32 fragment (row-major in `scratch`) to rows row0.. (below t) and
// columns col0.. of a [t][D] f32 buffer with atomics: four columns per atomic on sm_90 (its
// float4 atomicAdd; 16-byte aligned: the buffers start aligned, rows are D floats, the
// scratch sits at a 16-byte offset), one otherwise.
template <int D>
__device__ __forceinline__ void fa_add_fragment(float *out, const float *scratch, uint32_t row0,
                                                int col0, uint32_t t, int lane) {
#if __CUDA_ARCH__ >= 900
    for (int e = lane; e < 64; e += 32) {
        const int r = e >> 2, c = (e & 3) * 4;
        const uint32_t row = row0 + r;
        if (row < t) {
            const float4 val = *reinterpret_cast<const float4 *>(scratch + r * 16 + c);
            atomicAdd(reinterpret_cast<float4 *>(out + (size_t)row * D + col0 + c), val);
        }
    }
#else
    for (int e = lane; e < 256; e += 32) {
        const uint32_t row = row0 + e / 16;
        if (row < t) atomicAdd(out + (size_t)row * D + col0 + e % 16, scratch[e]);
    }
#endif
}

template <typename T, int D>
__device__ void flash_attn_bwd(const T *__restrict__ q, const T *__restrict__ k,
                               const T *__restrict__ v, const T *__restrict__ dout,
                               const float *__restrict__ lse, const float *__restrict__ dvec,
                               float *__restrict__ dq, float *__restrict__ dk,
                               float *__restrict__ dv, uint32_t h, uint32_t hkv, uint32_t t,
                               float scale) {
#if __CUDA_ARCH__ >= 800
    using namespace nvcuda;
    using S = FaSmem<D>;
    constexpr int LDT = S::LDT, LDS = S::LDS, LDP = S::LDP;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    constexpr int LDD = S::LDD;
    unsigned char *p = fa_smem;
    T *sQ = reinterpret_cast<T *>(p);
    T *sdO = reinterpret_cast<T *>(p + S::tile_t);
    T *sK = reinterpret_cast<T *>(p + 2 * S::tile_t);
    T *sV = reinterpret_cast<T *>(p + 3 * S::tile_t);
    p += 4 * S::tile_t;
    float *sP32 = reinterpret_cast<float *>(p);
    p += S::tile_s;
    float *sdP = reinterpret_cast<float *>(p);
    p += (size_t)FA_BM * LDD * 4;
    // P (T) until dV has used it, then dS (T) in the same place.
    T *sP = reinterpret_cast<T *>(p);
    T *sdS = sP;
    p += S::tile_p;
    float *sL = reinterpret_cast<float *>(p);
    float *sD = sL + FA_BM;
    static_assert(4 * S::tile_t + S::tile_s + (size_t)FA_BM * LDD * 4 + S::tile_p + 2 * FA_BM * 4 ==
                      S::bwd,
                  "layout");

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // A warp's 16x16 f32 scratch for dQ, dK and dV: in dP's place, which is read only before
    // the barrier ahead of the dQ step and written only after the next tile's first barriers.
    float *scratch = sdP + warp * 256;
    const uint32_t n0 = blockIdx.x * FA_BN;
    const uint32_t head = blockIdx.y;  // b * h + query head
    const uint32_t bi = head / h;
    const uint32_t rep = h / hkv;
    const uint32_t kvh = bi * hkv + (head % h) / rep;
    fa_load_tile<T, D, LDT>(sK, k + (size_t)kvh * t * D, n0, t);
    fa_load_tile<T, D, LDT>(sV, v + (size_t)kvh * t * D, n0, t);

    // dK, dV [64][D] as (64/16) x (D/16) fragments; warp w owns fragments w, w + 8, ...
    constexpr int N_FRAG = (FA_BN / 16) * (D / 16);
    constexpr int PER_WARP = N_FRAG / FA_BWD_WARPS;
    constexpr int DCOLS = D / 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dk_acc[PER_WARP], dv_acc[PER_WARP];
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        wmma::fill_fragment(dk_acc[i], 0.0f);
        wmma::fill_fragment(dv_acc[i], 0.0f);
    }

    const uint32_t m_start = (n0 / FA_BM) * FA_BM;
    {
        const T *qh = q + (size_t)head * t * D;
        const T *gh = dout + (size_t)head * t * D;
        for (uint32_t m0 = m_start; m0 < t; m0 += FA_BM) {
            __syncthreads();  // the previous tile's readers are done
            fa_load_tile<T, D, LDT>(sQ, qh, m0, t);
            fa_load_tile<T, D, LDT>(sdO, gh, m0, t);
            for (int i = threadIdx.x; i < FA_BM; i += blockDim.x) {
                const bool in = m0 + i < t;
                sL[i] = in ? lse[(size_t)head * t + m0 + i] : 0.0f;
                sD[i] = in ? dvec[(size_t)head * t + m0 + i] : 0.0f;
            }
            __syncthreads();

            // S = Q K^T into sP32; 16 fragments, 2 per warp.
            for (int f = warp; f < (FA_BM / 16) * (FA_BN / 16); f += FA_BWD_WARPS) {
                const int fr = f / (FA_BN / 16), fc = f % (FA_BN / 16);
                fa_abt_fragment<T, D, LDT>(sQ + fr * 16 * LDT, sK + fc * 16 * LDT,
                                           sP32 + fr * 16 * LDS + fc * 16, LDS);
            }
            __syncthreads();

            // P = exp(S * scale - L), zero where masked (key after the row, row past t).
            for (int i = threadIdx.x; i < FA_BM * FA_BN; i += blockDim.x) {
                const int r = i / FA_BN, c = i % FA_BN;
                const uint32_t row = m0 + r, col = n0 + c;
                float pv = 0.0f;
                if (row < t && col <= row) pv = __expf(sP32[r * LDS + c] * scale - sL[r]);
                sP32[r * LDS + c] = pv;
                sP[r * LDP + c] = from_f32<T>(pv);
            }
            __syncthreads();

            // dV += P^T dO (the warp's own fragments) and dP = dO V^T into sdP.
#pragma unroll
            for (int i = 0; i < PER_WARP; ++i) {
                const int f = warp + i * FA_BWD_WARPS;
                const int fr = f / DCOLS, fc = f % DCOLS;  // key block, column block
#pragma unroll
                for (int kf = 0; kf < FA_BM / 16; ++kf) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bg;
                    wmma::load_matrix_sync(a, sP + kf * 16 * LDP + fr * 16, LDP);
                    wmma::load_matrix_sync(bg, sdO + kf * 16 * LDT + fc * 16, LDT);
                    wmma::mma_sync(dv_acc[i], a, bg, dv_acc[i]);
                }
            }
            for (int f = warp; f < (FA_BM / 16) * (FA_BN / 16); f += FA_BWD_WARPS) {
                const int fr = f / (FA_BN / 16), fc = f % (FA_BN / 16);
                fa_abt_fragment<T, D, LDT>(sdO + fr * 16 * LDT, sV + fc * 16 * LDT,
                                           sdP + fr * 16 * LDD + fc * 16, LDD);
            }
            __syncthreads();

            // dS = P * (dP - D) * scale.
            for (int i = threadIdx.x; i < FA_BM * FA_BN; i += blockDim.x) {
                const int r = i / FA_BN, c = i % FA_BN;
                const float ds = sP32[r * LDS + c] * (sdP[r * LDD + c] - sD[r]) * scale;
                sdS[r * LDP + c] = from_f32<T>(ds);
            }
            __syncthreads();

            // dK += dS^T Q (own fragments); dQ += dS K, added to global memory.
#pragma unroll
            for (int i = 0; i < PER_WARP; ++i) {
                const int f = warp + i * FA_BWD_WARPS;
                const int fr = f / DCOLS, fc = f % DCOLS;
#pragma unroll
                for (int kf = 0; kf < FA_BM / 16; ++kf) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bq;
                    wmma::load_matrix_sync(a, sdS + kf * 16 * LDP + fr * 16, LDP);
                    wmma::load_matrix_sync(bq, sQ + kf * 16 * LDT + fc * 16, LDT);
                    wmma::mma_sync(dk_acc[i], a, bq, dk_acc[i]);
                }
            }
            float *dqh = dq + (size_t)head * t * D;
            for (int f = warp; f < (FA_BM / 16) * DCOLS; f += FA_BWD_WARPS) {
                const int fr = f / DCOLS, fc = f % DCOLS;  // query block, column block
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
                wmma::fill_fragment(acc, 0.0f);
#pragma unroll
                for (int kf = 0; kf < FA_BN / 16; ++kf) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bk;
                    wmma::load_matrix_sync(a, sdS + fr * 16 * LDP + kf * 16, LDP);
                    wmma::load_matrix_sync(bk, sK + kf * 16 * LDT + fc * 16, LDT);
                    wmma::mma_sync(acc, a, bk, acc);
                }
                wmma::store_matrix_sync(scratch, acc, 16, wmma::mem_row_major);
                __syncwarp();
                fa_add_fragment<D>(dqh, scratch, m0 + fr * 16, fc * 16, t, lane);
                __syncwarp();
            }
        }
    }

    // dK and dV of this key tile (rows n0.. below t) from this query head: stored where the
    // kv head has one query head, otherwise added (the buffers start at zero) to what the
    // group's other query heads give.
    float *dkh = dk + (size_t)kvh * t * D;
    float *dvh = dv + (size_t)kvh * t * D;
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        const int f = warp + i * FA_BWD_WARPS;
        const int fr = f / DCOLS, fc = f % DCOLS;
#pragma unroll
        for (int which = 0; which < 2; ++which) {
            float *out = which == 0 ? dkh : dvh;
            wmma::store_matrix_sync(scratch, which == 0 ? dk_acc[i] : dv_acc[i], 16,
                                    wmma::mem_row_major);
            __syncwarp();
            if (rep == 1) {
                for (int e = lane; e < 256; e += 32) {
                    const uint32_t row = n0 + fr * 16 + e / 16;
                    if (row < t) out[(size_t)row * D + fc * 16 + e % 16] = scratch[e];
                }
            } else {
                fa_add_fragment<D>(out, scratch, n0 + fr * 16, fc * 16, t, lane);
            }
            __syncwarp();
        }
    }
#else
    __trap();
#endif
}

}  // namespace

#define FLASH_ATTN_FOR(T, SUFFIX, D)                                                            \
    extern "C" __global__ void __launch_bounds__(FA_FWD_WARPS * 32)                             \
        flash_attn_fwd_d##D##_##SUFFIX(const T *q, const T *k, const T *v, T *o, float *lse,    \
                                       uint32_t h, uint32_t hkv, uint32_t t, float scale) {     \
        flash_attn_fwd_mma<T, D>(q, k, v, o, lse, h, hkv, t, t, (size_t)t * D, scale);          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(FA_FWD_WARPS * 32)                             \
        prompt_attn_d##D##_##SUFFIX(const T *q, const T *k, const T *v, T *o, uint32_t h,       \
                                    uint32_t hkv, uint32_t t, uint32_t tk, uint64_t kstride,    \
                                    float scale) {                                              \
        flash_attn_fwd_mma<T, D>(q, k, v, o, nullptr, h, hkv, t, tk, kstride, scale);           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(FA_FWD_WARPS * 32)                             \
        flash_attn_fwd_wmma_d##D##_##SUFFIX(const T *q, const T *k, const T *v, T *o,           \
                                            float *lse, uint32_t h, uint32_t hkv, uint32_t t,   \
                                            float scale) {                                      \
        flash_attn_fwd_wmma<T, D>(q, k, v, o, lse, h, hkv, t, scale);                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(FA_BWD_WARPS * 32, 2)                          \
        flash_attn_bwd_d##D##_##SUFFIX(const T *q, const T *k, const T *v, const T *dout,       \
                                       const float *lse, const float *dvec, float *dq,          \
                                       float *dk, float *dv, uint32_t h, uint32_t hkv,          \
                                       uint32_t t, float scale) {                               \
        flash_attn_bwd<T, D>(q, k, v, dout, lse, dvec, dq, dk, dv, h, hkv, t, scale);           \
    }

FLASH_ATTN_FOR(__half, f16, 64)
FLASH_ATTN_FOR(__half, f16, 128)
FLASH_ATTN_FOR(__nv_bfloat16, bf16, 64)
FLASH_ATTN_FOR(__nv_bfloat16, bf16, 128)

extern "C" __global__ void flash_attn_bwd_prep_f16(const __half *o, const __half *dout,
                                                   float *dvec, uint32_t rows, uint32_t d) {
    flash_attn_bwd_prep<__half>(o, dout, dvec, rows, d);
}
extern "C" __global__ void flash_attn_bwd_prep_bf16(const __nv_bfloat16 *o,
                                                    const __nv_bfloat16 *dout, float *dvec,
                                                    uint32_t rows, uint32_t d) {
    flash_attn_bwd_prep<__nv_bfloat16>(o, dout, dvec, rows, d);
}
