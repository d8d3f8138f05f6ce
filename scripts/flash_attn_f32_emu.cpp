// flash_attn_f32_emu.cpp: runs kernels/flash_f32.cu's F32 flash attention kernels
// (flash_attn_fwd_f32, flash_attn_bwd_f32; D formed on the host as flash_attn_bwd_prep_f32 does) on
// the CPU, one std::thread per CUDA thread (barriers and warp shuffles emulated, blocks one
// after another, shared memory poisoned before each block), and compares O, the log-sum-exp
// and dq, dk, dv with an f64 reference over the shapes of tests/train_ops.rs (relative to the
// reference's max abs, 1e-5; dq and dk also floored at 1% of dv's as the test does). Checks the
// index math, masking and barriers without a GPU (not the sm_90 float4 atomics: the scalar
// path runs). From the repository root:
//
//   awk '/^\/\/ F32 attention on the FP32 cores/{p=1} p{print} /^}  \/\/ namespace/{if(p) exit}' \
//       candle-offload-kernels/kernels/flash_f32.cu | grep -v '^}  // namespace' \
//     | sed 's/extern __shared__ __align__(128) unsigned char fa_smem\[\];/unsigned char *fa_smem = g_smem;/' \
//     > /tmp/fa32_kern.inc
//   g++ -std=c++20 -O2 -mfma -ffp-contract=fast -pthread -I/tmp scripts/flash_attn_f32_emu.cpp \
//     -o /tmp/fa32_emu && /tmp/fa32_emu
#include <barrier>
#include <thread>
#include <vector>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <random>
#include <algorithm>
#include <memory>
#include <tuple>
using std::min;
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct U3 { uint32_t x, y, z; };
thread_local U3 threadIdx, blockIdx;
U3 gridDim;
unsigned char *g_smem;
std::barrier<> *g_bar;
std::barrier<> *g_wbar[8];
float g_shfl[256];
inline void __syncthreads() { g_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    g_shfl[tid] = v;
    g_wbar[w]->arrive_and_wait();
    float r = g_shfl[w * 32 + (lane ^ off)];
    g_wbar[w]->arrive_and_wait();
    return r;
}
inline float neg_inf() { return -INFINITY; }
inline void atomicAdd(float *p, float v) { std::atomic_ref<float>(*p).fetch_add(v); }
constexpr int FA_BM = 64, FA_BN = 64;
#include "fa32_kern.inc"

template <class F> void launch(U3 grid, size_t smem, F f) {
    gridDim = grid;
    std::vector<unsigned char> buf(smem + 128);
    for (uint32_t by = 0; by < grid.y; ++by)
        for (uint32_t bx = 0; bx < grid.x; ++bx) {
            // poison shared memory
            std::fill(buf.begin(), buf.end(), 0xff);
            g_smem = (unsigned char *)(((uintptr_t)buf.data() + 127) & ~(uintptr_t)127);
            std::barrier<> bar(256);
            g_bar = &bar;
            std::vector<std::unique_ptr<std::barrier<>>> wb;
            for (int w = 0; w < 8; ++w) { wb.emplace_back(new std::barrier<>(32)); g_wbar[w] = wb.back().get(); }
            std::vector<std::thread> th;
            for (uint32_t t = 0; t < 256; ++t)
                th.emplace_back([&, t] { threadIdx = {t, 0, 0}; blockIdx = {bx, by, 0}; f(); });
            for (auto &x : th) x.join();
        }
}

template <int D> int run(int b, int h, int hkv, int t) {
    std::mt19937 rng(b * 1000 + h * 100 + t);
    std::uniform_real_distribution<float> u(-2, 2);
    size_t nq = (size_t)b * h * t * D, nkv = (size_t)b * hkv * t * D;
    std::vector<float> q(nq), k(nkv), v(nkv), g(nq);
    for (auto &x : q) x = u(rng);
    for (auto &x : k) x = u(rng);
    for (auto &x : v) x = u(rng) * 0.75f;
    for (auto &x : g) x = u(rng) * 0.5f;
    float scale = 1.0f / std::sqrt((float)D);
    std::vector<float> o(nq, NAN), lse(b * h * t, NAN);
    uint32_t tiles = (t + 63) / 64;
    launch({tiles, (uint32_t)(b * h), 1}, Fa32Smem<D>::fwd, [&] {
        flash_attn_fwd_f32<D>(q.data(), k.data(), v.data(), o.data(), lse.data(), h, hkv, t, scale);
    });
    std::vector<float> dvec(b * h * t);
    for (size_t r = 0; r < (size_t)b * h * t; ++r) {
        float a = 0;
        for (int c = 0; c < D; ++c) a = std::fma(g[r * D + c], o[r * D + c], a);
        dvec[r] = a;
    }
    std::vector<float> dq(nq, 0.0f), dk(nkv, NAN), dv(nkv, NAN);
    launch({tiles, (uint32_t)(b * hkv), 1}, Fa32Smem<D>::bwd, [&] {
        flash_attn_bwd_f32<D>(q.data(), k.data(), v.data(), g.data(), lse.data(), dvec.data(),
                              dq.data(), dk.data(), dv.data(), h, hkv, t, scale);
    });
    // reference in double
    std::vector<double> ro(nq, 0), rl(b * h * t), rdq(nq, 0), rdk(nkv, 0), rdv(nkv, 0);
    int rep = h / hkv;
    for (int bi = 0; bi < b; ++bi)
        for (int hi = 0; hi < h; ++hi) {
            size_t head = bi * h + hi, kvh = bi * hkv + hi / rep;
            const float *Q = &q[head * t * D], *K = &k[kvh * t * D], *V = &v[kvh * t * D], *G = &g[head * t * D];
            for (int i = 0; i < t; ++i) {
                std::vector<double> s(i + 1), p(i + 1), dp(i + 1);
                double m = -INFINITY;
                for (int j = 0; j <= i; ++j) {
                    double a = 0;
                    for (int c = 0; c < D; ++c) a += (double)Q[i * D + c] * K[j * D + c];
                    s[j] = a * scale; m = std::max(m, s[j]);
                }
                double l = 0;
                for (int j = 0; j <= i; ++j) { p[j] = std::exp(s[j] - m); l += p[j]; }
                for (int j = 0; j <= i; ++j) p[j] /= l;
                rl[head * t + i] = m + std::log(l);
                std::vector<double> oi(D, 0);
                for (int j = 0; j <= i; ++j) for (int c = 0; c < D; ++c) oi[c] += p[j] * V[j * D + c];
                double di = 0;
                for (int c = 0; c < D; ++c) { ro[(head * t + i) * D + c] = oi[c]; di += oi[c] * G[i * D + c]; }
                for (int j = 0; j <= i; ++j) {
                    double a = 0;
                    for (int c = 0; c < D; ++c) a += (double)G[i * D + c] * V[j * D + c];
                    double ds = p[j] * (a - di) * scale;
                    for (int c = 0; c < D; ++c) {
                        rdv[(kvh * t + j) * D + c] += p[j] * G[i * D + c];
                        rdk[(kvh * t + j) * D + c] += ds * Q[i * D + c];
                        rdq[(head * t + i) * D + c] += ds * K[j * D + c];
                    }
                }
            }
        }
    auto cmp = [](const char *n, const std::vector<float> &a, const std::vector<double> &r) {
        double mx = 0, md = 0;
        for (size_t i = 0; i < a.size(); ++i) { mx = std::max(mx, std::fabs(r[i])); md = std::max(md, std::fabs(a[i] - r[i])); if (std::isnan(a[i])) md = INFINITY; }
        double rel = md / std::max(mx, 1e-30);
        printf("  %s rel %.2e%s\n", n, rel, rel > 1e-5 ? "  <-- FAIL" : "");
        return rel > 1e-5;
    };
    printf("D %d b %d h %d hkv %d t %d\n", D, b, h, hkv, t);
    double mdv = 0; for (auto x : rdv) mdv = std::max(mdv, std::fabs(x));
    for (auto [n, A, R] : {std::tuple{"dq", &dq, &rdq}, std::tuple{"dk", &dk, &rdk}}) {
        double mx = 0, md = 0;
        for (size_t i = 0; i < A->size(); ++i) { mx = std::max(mx, std::fabs((*R)[i])); md = std::max(md, std::fabs((*A)[i] - (*R)[i])); }
        printf("  %s floored rel %.2e (abs %.2e)\n", n, md / std::max(mx, 1e-2 * mdv), md);
    }
    int bad = cmp("o", o, ro) + cmp("lse", lse, rl) + cmp("dq", dq, rdq) + cmp("dk", dk, rdk) + cmp("dv", dv, rdv);
    return bad;
}

int main() {
    int bad = 0;
    bad += run<64>(1, 1, 1, 1);
    bad += run<64>(2, 4, 1, 37);
    bad += run<128>(1, 8, 2, 70);
    bad += run<64>(1, 4, 4, 129);
    bad += run<128>(2, 2, 1, 65);
    bad += run<128>(1, 4, 1, 129);
    printf(bad ? "FAILURES %d\n" : "ALL OK\n", bad);
    return bad != 0;
}
