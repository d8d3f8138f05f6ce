// Causal self-attention in F32 on the FP32 cores for `candle_offload_kernels::attention`'s
// flash_attention (forward and backward; the same contract as flash.cu's kernels).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "train.cuh"
#include "flash.cuh"

namespace {

// ---------------------------------------------------------------------------------------------
// F32 attention on the FP32 cores (SIMT FMA, no TF32: the results stay F32-exact up to the
// order of the sums). Same semantics, tiles (64 query rows, 64 keys) and L handshake as the
// kernels above; 256 threads, thread (ty = tid / 16, tx = tid % 16) owns a 4x4 micro-tile of
// every 64x64 product (rows 4 ty + i, columns tx + 16 j) and of every 64xD product a 4x(D/16)
// one (rows 4 ty + i, columns 64 jj + 4 tx + e), so the 16 threads of a row are one half-warp
// (row reductions are 4 shuffles). Tiles are row-major with a pitch of D + 4 floats (64 + 4
// for P and dS): the float4 reads of 8 consecutive rows hit distinct banks.
//
// Forward (flash_attn_fwd_d*_f32): grid (ceil(t / 64), b * h); Q, K, V in shared memory, P
// written over K once S is formed (3 tiles: two blocks fit on an SM for D = 128).
// Backward (flash_attn_bwd_d*_f32): grid (ceil(t / 64), b * hkv) as above; K, V, Q, dO, then
// P and dS in one [64][68] tile; dK and dV stay in registers over the loop; dQ is added to the
// f32 buffer with atomics.

template <int D> struct Fa32Smem {
    static constexpr int LD = D + 4;        // pitch of the [64][D] tiles
    static constexpr int LDP = FA_BN + 4;   // pitch of the [64][64] tiles (P, dS)
    static constexpr size_t tile = (size_t)FA_BM * LD * 4;
    static constexpr size_t tile_p = (size_t)FA_BM * LDP * 4;
    // Forward: Q, K (then P), V.
    static constexpr size_t fwd = 3 * tile;
    // Backward: K, V, Q, dO, P (then dS), L and D of the query tile.
    static constexpr size_t bwd = 4 * tile + tile_p + 2 * FA_BM * 4;
    static_assert(tile_p <= tile, "P fits in K's tile");
    static_assert(fwd <= 113 * 1024, "two forward blocks fit on an sm_80+ SM");
    static_assert(bwd <= 163 * 1024, "attention tiles exceed shared memory");
};

constexpr int FA32_THREADS = 256;

// Copies rows [row0, row0 + 64) of a [t][D] f32 matrix into a [64][LD] tile, zeros past t.
template <int D, int LD>
__device__ __forceinline__ void fa32_load_tile(float *dst, const float *src, uint32_t row0,
                                               uint32_t t) {
    constexpr int PER_ROW = D / 4;
    for (int i = threadIdx.x; i < FA_BM * PER_ROW; i += FA32_THREADS) {
        const int r = i / PER_ROW;
        const int c = (i % PER_ROW) * 4;
        float4 val = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row0 + r < t) val = *reinterpret_cast<const float4 *>(src + (size_t)(row0 + r) * D + c);
        *reinterpret_cast<float4 *>(dst + r * LD + c) = val;
    }
}

// acc[i][j] += A[4 ty + i] . B[tx + 16 j] over D: rows of two [64][LD] tiles.
template <int D, int LD>
__device__ __forceinline__ void fa32_abt(float acc[4][4], const float *a, const float *b, int ty,
                                         int tx) {
#pragma unroll 1
    for (int kk = 0; kk < D; kk += 4) {
        float4 x[4], y[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = *reinterpret_cast<const float4 *>(a + (4 * ty + i) * LD + kk);
#pragma unroll
        for (int j = 0; j < 4; ++j) y[j] = *reinterpret_cast<const float4 *>(b + (tx + 16 * j) * LD + kk);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc[i][j] = fmaf(x[i].x, y[j].x, acc[i][j]);
                acc[i][j] = fmaf(x[i].y, y[j].y, acc[i][j]);
                acc[i][j] = fmaf(x[i].z, y[j].z, acc[i][j]);
                acc[i][j] = fmaf(x[i].w, y[j].w, acc[i][j]);
            }
        }
    }
}

// acc[i][4 jj + e] += sum_n A[4 ty + i][n] B[n][64 jj + 4 tx + e]: A a [64][LDP] tile (rows of
// P or dS), B a [64][LD] tile.
template <int D, int LD, int LDP>
__device__ __forceinline__ void fa32_ab(float acc[4][D / 16], const float *a, const float *b,
                                        int ty, int tx) {
#pragma unroll 2
    for (int n = 0; n < FA_BN; n += 4) {
        float4 x[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = *reinterpret_cast<const float4 *>(a + (4 * ty + i) * LDP + n);
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
#pragma unroll
            for (int jj = 0; jj < D / 64; ++jj) {
                const float4 y = *reinterpret_cast<const float4 *>(b + (n + nn) * LD + 64 * jj + 4 * tx);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float xi = nn == 0 ? x[i].x : nn == 1 ? x[i].y : nn == 2 ? x[i].z : x[i].w;
                    acc[i][4 * jj + 0] = fmaf(xi, y.x, acc[i][4 * jj + 0]);
                    acc[i][4 * jj + 1] = fmaf(xi, y.y, acc[i][4 * jj + 1]);
                    acc[i][4 * jj + 2] = fmaf(xi, y.z, acc[i][4 * jj + 2]);
                    acc[i][4 * jj + 3] = fmaf(xi, y.w, acc[i][4 * jj + 3]);
                }
            }
        }
    }
}

// acc[i][4 jj + e] += sum_r A[r][4 ty + i] B[r][64 jj + 4 tx + e]: A^T B with A a [64][LDP]
// tile (P or dS, rows = queries) and B a [64][LD] tile (dO or Q).
template <int D, int LD, int LDP>
__device__ __forceinline__ void fa32_atb(float acc[4][D / 16], const float *a, const float *b,
                                         int ty, int tx) {
#pragma unroll 4
    for (int r = 0; r < FA_BM; ++r) {
        const float4 x = *reinterpret_cast<const float4 *>(a + r * LDP + 4 * ty);
        const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int jj = 0; jj < D / 64; ++jj) {
            const float4 y = *reinterpret_cast<const float4 *>(b + r * LD + 64 * jj + 4 * tx);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc[i][4 * jj + 0] = fmaf(xs[i], y.x, acc[i][4 * jj + 0]);
                acc[i][4 * jj + 1] = fmaf(xs[i], y.y, acc[i][4 * jj + 1]);
                acc[i][4 * jj + 2] = fmaf(xs[i], y.z, acc[i][4 * jj + 2]);
                acc[i][4 * jj + 3] = fmaf(xs[i], y.w, acc[i][4 * jj + 3]);
            }
        }
    }
}

template <int D>
__device__ void flash_attn_fwd_f32(const float *__restrict__ q, const float *__restrict__ k,
                                   const float *__restrict__ v, float *__restrict__ o,
                                   float *__restrict__ lse, uint32_t h, uint32_t hkv, uint32_t t,
                                   float scale) {
    using S = Fa32Smem<D>;
    constexpr int LD = S::LD, LDP = S::LDP;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    float *sQ = reinterpret_cast<float *>(fa_smem);
    float *sK = reinterpret_cast<float *>(fa_smem + S::tile);
    float *sP = sK;  // P replaces K once S is formed
    float *sV = reinterpret_cast<float *>(fa_smem + 2 * S::tile);

    // The last query tiles have the most keys: start them first.
    const uint32_t m0 = (gridDim.x - 1 - blockIdx.x) * FA_BM;
    const uint32_t head = blockIdx.y;  // b * h + hi
    const uint32_t bi = head / h, hi = head % h;
    const uint32_t kvh = bi * hkv + hi / (h / hkv);
    const float *kh = k + (size_t)kvh * t * D;
    const float *vh = v + (size_t)kvh * t * D;
    const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;

    fa32_load_tile<D, LD>(sQ, q + (size_t)head * t * D, m0, t);

    float oacc[4][D / 16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int c = 0; c < D / 16; ++c) oacc[i][c] = 0.0f;
    }
    // Each row's running maximum (the same in its 16 threads) and this thread's part of its sum.
    float m_run[4], l_run[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m_run[i] = neg_inf();
        l_run[i] = 0.0f;
    }

    const uint32_t last = min(t, m0 + FA_BM);  // keys < last are seen by some row
    const uint32_t n_tiles = (last + FA_BN - 1) / FA_BN;
    for (uint32_t kt = 0; kt < n_tiles; ++kt) {
        const uint32_t n0 = kt * FA_BN;
        __syncthreads();  // the previous tile's readers of P (K's place) and V are done
        fa32_load_tile<D, LD>(sK, kh, n0, t);
        fa32_load_tile<D, LD>(sV, vh, n0, t);
        __syncthreads();

        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        fa32_abt<D, LD>(s, sQ, sK, ty, tx);

        // Scale and mask (key after the row or past t), the rows' maxima, P.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t row = m0 + 4 * ty + i;
            float mx = neg_inf();
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint32_t col = n0 + tx + 16 * j;
                const float x = (col > row || col >= t) ? neg_inf() : s[i][j] * scale;
                s[i][j] = x;
                mx = fmaxf(mx, x);
            }
#pragma unroll
            for (int off = 1; off < 16; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m_run[i], mx);
            // Every row sees key 0 in the first tile, so m_new is finite; kept safe anyway.
            const float m_use = m_new == neg_inf() ? 0.0f : m_new;
            const float alpha = expf(m_run[i] - m_use);
            m_run[i] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float p = expf(s[i][j] - m_use);
                s[i][j] = p;
                sum += p;
            }
            l_run[i] = l_run[i] * alpha + sum;
#pragma unroll
            for (int c = 0; c < D / 16; ++c) oacc[i][c] *= alpha;
        }
        __syncthreads();  // every thread is done reading K
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) sP[(4 * ty + i) * LDP + tx + 16 * j] = s[i][j];
        }
        __syncthreads();
        fa32_ab<D, LD, LDP>(oacc, sP, sV, ty, tx);
    }

    float *oh = o + (size_t)head * t * D;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float l = l_run[i];
#pragma unroll
        for (int off = 1; off < 16; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
        const uint32_t row = m0 + 4 * ty + i;
        if (row >= t) continue;
        const float inv = 1.0f / l;
#pragma unroll
        for (int jj = 0; jj < D / 64; ++jj) {
            const float4 val = make_float4(oacc[i][4 * jj] * inv, oacc[i][4 * jj + 1] * inv,
                                           oacc[i][4 * jj + 2] * inv, oacc[i][4 * jj + 3] * inv);
            *reinterpret_cast<float4 *>(oh + (size_t)row * D + 64 * jj + 4 * tx) = val;
        }
        if (tx == 0) lse[(size_t)head * t + row] = m_run[i] + logf(l);
    }
}

template <int D>
__device__ void flash_attn_bwd_f32(const float *__restrict__ q, const float *__restrict__ k,
                                   const float *__restrict__ v, const float *__restrict__ dout,
                                   const float *__restrict__ lse, const float *__restrict__ dvec,
                                   float *__restrict__ dq, float *__restrict__ dk,
                                   float *__restrict__ dv, uint32_t h, uint32_t hkv, uint32_t t,
                                   float scale) {
    using S = Fa32Smem<D>;
    constexpr int LD = S::LD, LDP = S::LDP;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    float *sK = reinterpret_cast<float *>(fa_smem);
    float *sV = reinterpret_cast<float *>(fa_smem + S::tile);
    float *sQ = reinterpret_cast<float *>(fa_smem + 2 * S::tile);
    float *sdO = reinterpret_cast<float *>(fa_smem + 3 * S::tile);
    float *sP = reinterpret_cast<float *>(fa_smem + 4 * S::tile);  // P, then dS
    float *sL = reinterpret_cast<float *>(fa_smem + 4 * S::tile + S::tile_p);
    float *sD = sL + FA_BM;

    const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
    const uint32_t n0 = blockIdx.x * FA_BN;
    const uint32_t kvh = blockIdx.y;  // b * hkv + g
    const uint32_t bi = kvh / hkv, g = kvh % hkv;
    const uint32_t rep = h / hkv;
    fa32_load_tile<D, LD>(sK, k + (size_t)kvh * t * D, n0, t);
    fa32_load_tile<D, LD>(sV, v + (size_t)kvh * t * D, n0, t);

    // dK, dV rows n0 + 4 ty + i, columns 64 jj + 4 tx + e.
    float dk_acc[4][D / 16], dv_acc[4][D / 16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int c = 0; c < D / 16; ++c) dk_acc[i][c] = dv_acc[i][c] = 0.0f;
    }

    const uint32_t m_start = (n0 / FA_BM) * FA_BM;
    for (uint32_t hq = g * rep; hq < (g + 1) * rep; ++hq) {
        const uint32_t head = bi * h + hq;
        const float *qh = q + (size_t)head * t * D;
        const float *gh = dout + (size_t)head * t * D;
        float *dqh = dq + (size_t)head * t * D;
        for (uint32_t m0 = m_start; m0 < t; m0 += FA_BM) {
            __syncthreads();  // the previous tile's readers of Q, dO and dS are done
            fa32_load_tile<D, LD>(sQ, qh, m0, t);
            fa32_load_tile<D, LD>(sdO, gh, m0, t);
            for (int i = threadIdx.x; i < FA_BM; i += FA32_THREADS) {
                const bool in = m0 + i < t;
                sL[i] = in ? lse[(size_t)head * t + m0 + i] : 0.0f;
                sD[i] = in ? dvec[(size_t)head * t + m0 + i] : 0.0f;
            }
            __syncthreads();

            // S = Q K^T and dP = dO V^T: rows (queries) 4 ty + i, keys tx + 16 j.
            float p[4][4], ds[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) p[i][j] = ds[i][j] = 0.0f;
            }
            fa32_abt<D, LD>(p, sQ, sK, ty, tx);
            fa32_abt<D, LD>(ds, sdO, sV, ty, tx);
            // P = exp(S * scale - L), zero where masked (key after the row, row past t);
            // dS = P * (dP - D) * scale.
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = 4 * ty + i;
                const uint32_t row = m0 + r;
                const float li = sL[r], di = sD[r];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint32_t col = n0 + tx + 16 * j;
                    const float pv = (row < t && col <= row) ? expf(p[i][j] * scale - li) : 0.0f;
                    p[i][j] = pv;
                    ds[i][j] = pv * (ds[i][j] - di) * scale;
                    sP[r * LDP + tx + 16 * j] = pv;
                }
            }
            __syncthreads();
            // dV += P^T dO.
            fa32_atb<D, LD, LDP>(dv_acc, sP, sdO, ty, tx);
            __syncthreads();  // every thread is done reading P
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) sP[(4 * ty + i) * LDP + tx + 16 * j] = ds[i][j];
            }
            __syncthreads();
            // dK += dS^T Q.
            fa32_atb<D, LD, LDP>(dk_acc, sP, sQ, ty, tx);
            // dQ += dS K: rows (queries) 4 ty + i, added to global memory.
            float dq_acc[4][D / 16];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int c = 0; c < D / 16; ++c) dq_acc[i][c] = 0.0f;
            }
            fa32_ab<D, LD, LDP>(dq_acc, sP, sK, ty, tx);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t row = m0 + 4 * ty + i;
                if (row >= t) continue;
#pragma unroll
                for (int jj = 0; jj < D / 64; ++jj) {
                    float *dst = dqh + (size_t)row * D + 64 * jj + 4 * tx;
#if __CUDA_ARCH__ >= 900
                    // sm_90's float4 atomicAdd (16-byte aligned: dq starts its buffer, rows are
                    // D floats, columns a multiple of 4).
                    atomicAdd(reinterpret_cast<float4 *>(dst),
                              make_float4(dq_acc[i][4 * jj], dq_acc[i][4 * jj + 1],
                                          dq_acc[i][4 * jj + 2], dq_acc[i][4 * jj + 3]));
#else
#pragma unroll
                    for (int e = 0; e < 4; ++e) atomicAdd(dst + e, dq_acc[i][4 * jj + e]);
#endif
                }
            }
        }
    }

    // dK and dV of this key tile: rows n0.. below t.
    float *dkh = dk + (size_t)kvh * t * D;
    float *dvh = dv + (size_t)kvh * t * D;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t row = n0 + 4 * ty + i;
        if (row >= t) continue;
#pragma unroll
        for (int jj = 0; jj < D / 64; ++jj) {
            const size_t at = (size_t)row * D + 64 * jj + 4 * tx;
            *reinterpret_cast<float4 *>(dkh + at) =
                make_float4(dk_acc[i][4 * jj], dk_acc[i][4 * jj + 1], dk_acc[i][4 * jj + 2],
                            dk_acc[i][4 * jj + 3]);
            *reinterpret_cast<float4 *>(dvh + at) =
                make_float4(dv_acc[i][4 * jj], dv_acc[i][4 * jj + 1], dv_acc[i][4 * jj + 2],
                            dv_acc[i][4 * jj + 3]);
        }
    }
}

}  // namespace

// F32 (FP32 cores): two forward blocks of 256 threads per SM (at most 128 registers); the
// backward takes 153 KiB of shared memory for D = 128 (one block per SM), 86 KiB for D = 64.
#define FLASH_ATTN_F32_FOR(D)                                                                   \
    extern "C" __global__ void __launch_bounds__(FA32_THREADS, 2)                               \
        flash_attn_fwd_d##D##_f32(const float *q, const float *k, const float *v, float *o,     \
                                  float *lse, uint32_t h, uint32_t hkv, uint32_t t,             \
                                  float scale) {                                                \
        flash_attn_fwd_f32<D>(q, k, v, o, lse, h, hkv, t, scale);                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(FA32_THREADS, (D) == 64 ? 2 : 1)               \
        flash_attn_bwd_d##D##_f32(const float *q, const float *k, const float *v,               \
                                  const float *dout, const float *lse, const float *dvec,       \
                                  float *dq, float *dk, float *dv, uint32_t h, uint32_t hkv,    \
                                  uint32_t t, float scale) {                                    \
        flash_attn_bwd_f32<D>(q, k, v, dout, lse, dvec, dq, dk, dv, h, hkv, t, scale);          \
    }

FLASH_ATTN_F32_FOR(64)
FLASH_ATTN_F32_FOR(128)

// One thread per row (not flash_attn_bwd_prep's warp): D = sum(dO * O) as one fma chain over
// the columns in order, the order in which flash_attn_bwd_f32 forms dP = dO . V. Where a row
// sees one key O = V exactly, so dP - D is exactly 0 as in the composition's softmax backward
// (t = 1: dq and dk exactly 0, not rounding noise of dP's size).
extern "C" __global__ void flash_attn_bwd_prep_f32(const float *o, const float *dout,
                                                   float *dvec, uint32_t rows, uint32_t d) {
    const uint32_t row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const float *a = o + (size_t)row * d;
    const float *b = dout + (size_t)row * d;
    float acc = 0.0f;
    for (uint32_t c = 0; c < d; ++c) acc = fmaf(b[c], a[c], acc);
    dvec[row] = acc;
}
