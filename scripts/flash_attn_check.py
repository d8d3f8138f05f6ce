"""Checks the flash attention kernels (candle-offload-kernels/kernels/flash.cu for F16/BF16,
flash_f32.cu for F32) against PyTorch autograd on a GPU, without building the crate: compiles
them with nvcc (sm_90a), launches the forward, the D precompute and the backward as the
crate's launchers do (src/attention/flash_cuda.rs: same grids, blocks and shared memory), and compares O, the log-sum-exp and dq, dk, dv with F32
PyTorch autograd of the causal composition (max abs difference over the reference's max abs,
floored for dq and dk at 1% of dv's as tests/train_ops.rs does; 1e-2 for F16/BF16, 1e-5 for
the F32 kernels against an F64 reference), then times forward + backward beside torch's SDPA
(BF16, and F32 for the F32 kernels).

Needs torch and cupy with a GPU: `python3 scripts/flash_attn_check.py` from the repository root.
"""
import subprocess, sys, math, time
import numpy as np, torch, cupy as cp

KERNELS = "candle-offload-kernels/kernels"
for name in ("flash", "flash_f32"):
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90a", "-cubin", f"-I{KERNELS}",
                    f"{KERNELS}/{name}.cu", "-o", f"/tmp/{name}.cubin"], check=True)
MODULES = {name: cp.RawModule(path=f"/tmp/{name}.cubin") for name in ("flash", "flash_f32")}


class _Kernels:
    """The two cubins as one module: F32 kernels from flash_f32.cu, the others from flash.cu."""

    def get_function(self, name):
        return MODULES["flash_f32" if name.endswith("_f32") else "flash"].get_function(name)


mod = _Kernels()

def smem(d, wmma, f32=False):
    """The forward's and the backward's dynamic shared memory (fa_smem, fa32_smem in
    attention/flash_cuda.rs)."""
    if f32:
        tile = 64 * (d + 4) * 4
        return 3 * tile, 4 * tile + 64 * 68 * 4 + 2 * 64 * 4
    ldt, lds, ldp, ldo = d + 8, 68, 72, d + 4
    tt, ts, tp, to = 64 * ldt * 2, 64 * lds * 4, 64 * ldp * 2, 64 * ldo * 4
    fwd = 3 * tt + ts + tp + to if wmma else 5 * tt
    return fwd, 4 * tt + ts + 64 * 64 * 4 + tp + 2 * 64 * 4

P = lambda t: np.uint64(t.data_ptr())
U = np.uint32

def flash(q, k, v, do, scale, wmma):
    b, h, t, d = q.shape; hkv = k.shape[1]
    sfx = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[q.dtype]
    f32 = q.dtype == torch.float32
    wmma = wmma and not f32  # one F32 forward kernel
    fs, bs = smem(d, wmma, f32)
    fwd = "flash_attn_fwd_wmma" if wmma else "flash_attn_fwd"
    f = mod.get_function(f"{fwd}_d{d}_{sfx}"); f.max_dynamic_shared_size_bytes = fs
    o = torch.empty_like(q); lse = torch.empty(b, h, t, device="cuda", dtype=torch.float32)
    f(((t + 63) // 64, b * h, 1), (256 if f32 else 128, 1, 1), (P(q), P(k), P(v), P(o), P(lse), U(h), U(hkv), U(t), np.float32(scale)), shared_mem=fs)
    prep = mod.get_function(f"flash_attn_bwd_prep_{sfx}")
    dvec = torch.empty(b, h, t, device="cuda", dtype=torch.float32)
    rows = b * h * t
    prep(((rows + 255) // 256 if f32 else (rows + 7) // 8, 1, 1), (256, 1, 1), (P(o), P(do), P(dvec), U(rows), U(d)))
    g = mod.get_function(f"flash_attn_bwd_d{d}_{sfx}"); g.max_dynamic_shared_size_bytes = bs
    dq = torch.zeros(b, h, t, d, device="cuda"); dk = torch.zeros(b, hkv, t, d, device="cuda"); dv = torch.zeros_like(dk)
    g(((t + 63) // 64, b * hkv, 1), (256, 1, 1), (P(q), P(k), P(v), P(do), P(lse), P(dvec), P(dq), P(dk), P(dv), U(h), U(hkv), U(t), np.float32(scale)), shared_mem=bs)
    torch.cuda.synchronize()
    return o, lse, dq, dk, dv

def ref(q, k, v, up, scale):
    wide = torch.float64 if q.dtype == torch.float32 else torch.float32
    q, k, v = [x.to(wide).detach().requires_grad_() for x in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ kk.transpose(-1, -2) * scale
    t = q.shape[2]
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device="cuda"), 1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    y = torch.softmax(s, -1) @ vv
    (y * up.to(wide)).sum().backward()
    return y, lse, q.grad, k.grad, v.grad

def rel(a, b, floor=1e-30):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()

ok = True
shapes = [(1, 1, 1, 1, 64), (2, 4, 1, 37, 64), (1, 8, 2, 70, 128), (2, 4, 4, 129, 64), (2, 8, 2, 65, 128),
          (1, 4, 1, 129, 128), (2, 8, 2, 1000, 128), (1, 32, 8, 2048, 64)]
torch.manual_seed(0)
cases = [(dt, w) for dt in (torch.float16, torch.bfloat16) for w in (False, True)] + [(torch.float32, False)]
for dt, wmma in cases:
    for (b, h, hkv, t, d) in shapes:
        q = (torch.rand(b, h, t, d, device="cuda") * 4 - 2).to(dt)
        k = (torch.rand(b, hkv, t, d, device="cuda") * 4 - 2).to(dt)
        v = (torch.rand(b, hkv, t, d, device="cuda") * 3 - 1.5).to(dt)
        up = (torch.rand(b, h, t, d, device="cuda") * 2 - 1).to(dt)
        scale = 1 / math.sqrt(d)
        got = flash(q, k, v, up, scale, wmma)
        want = ref(q, k, v, up, scale)
        floor = 1e-2 * want[4].abs().max().item()  # dq, dk vanish where t = 1
        ds = [rel(a, bb, floor if i in (2, 3) else 1e-30) for i, (a, bb) in enumerate(zip(got, want))]
        tol = 1e-5 if dt == torch.float32 else 1e-2
        bad = any(not (x <= tol) for x in ds)
        ok &= not bad
        print(dt, "wmma" if wmma else "mma", (b, h, hkv, t, d), "o lse dq dk dv:", " ".join(f"{x:.2e}" for x in ds), "FAIL" if bad else "ok", flush=True)
# timing
for (b, h, hkv, t, d) in [(4, 32, 8, 2048, 128), (4, 32, 8, 4096, 64)]:
    dt = torch.bfloat16
    q = torch.randn(b, h, t, d, device="cuda", dtype=dt); k = torch.randn(b, hkv, t, d, device="cuda", dtype=dt)
    v = torch.randn_like(k); up = torch.randn_like(q); scale = 1 / math.sqrt(d)
    tf = {}
    for wmma in (False, True):
        flash(q, k, v, up, scale, wmma)
        torch.cuda.synchronize(); t0 = time.time()
        for _ in range(5): flash(q, k, v, up, scale, wmma)
        torch.cuda.synchronize(); tf[wmma] = (time.time() - t0) / 5
    o_only = {}
    for wmma in (False, True):
        fs, _ = smem(d, wmma)
        f = mod.get_function(f"{'flash_attn_fwd_wmma' if wmma else 'flash_attn_fwd'}_d{d}_bf16"); f.max_dynamic_shared_size_bytes = fs
        o = torch.empty_like(q); lse = torch.empty(b, h, t, device="cuda")
        run = lambda: f(((t + 63) // 64, b * h, 1), (128, 1, 1), (P(q), P(k), P(v), P(o), P(lse), U(h), U(hkv), U(t), np.float32(scale)), shared_mem=fs)
        run(); torch.cuda.synchronize(); t0 = time.time()
        for _ in range(10): run()
        torch.cuda.synchronize(); o_only[wmma] = (time.time() - t0) / 10
    print(f"forward alone: mma {o_only[False]*1e3:.2f} ms ({4*b*h*t*t*d/2/o_only[False]/1e12:.0f} TFLOP/s), wmma {o_only[True]*1e3:.2f} ms", flush=True)
    qq, kk, vv = [x.detach().requires_grad_() for x in (q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1))]
    def sdpa():
        y = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True); y.backward(up)
    sdpa(); torch.cuda.synchronize(); t0 = time.time()
    for _ in range(5): sdpa()
    torch.cuda.synchronize(); ts = (time.time() - t0) / 5
    fl = 4 * b * h * t * t * d / 2 * 3.5  # fwd 2 matmuls + bwd 5, causal half
    print(f"timing {(b,h,hkv,t,d)}: fwd+bwd with the mma forward {tf[False]*1e3:.2f} ms ({fl/tf[False]/1e12:.0f} TFLOP/s), "
          f"with the wmma forward {tf[True]*1e3:.2f} ms, torch sdpa fwd+bwd {ts*1e3:.2f} ms", flush=True)
# F32: the FP32-core kernels beside torch's SDPA in F32
for (b, h, hkv, t, d) in [(4, 32, 8, 2048, 128), (4, 32, 8, 4096, 64)]:
    q = torch.randn(b, h, t, d, device="cuda"); k = torch.randn(b, hkv, t, d, device="cuda")
    v = torch.randn_like(k); up = torch.randn_like(q); scale = 1 / math.sqrt(d)
    flash(q, k, v, up, scale, False)
    torch.cuda.synchronize(); t0 = time.time()
    for _ in range(3): flash(q, k, v, up, scale, False)
    torch.cuda.synchronize(); tb = (time.time() - t0) / 3
    fs, _ = smem(d, False, True)
    f = mod.get_function(f"flash_attn_fwd_d{d}_f32"); f.max_dynamic_shared_size_bytes = fs
    o = torch.empty_like(q); lse = torch.empty(b, h, t, device="cuda")
    run = lambda: f(((t + 63) // 64, b * h, 1), (256, 1, 1), (P(q), P(k), P(v), P(o), P(lse), U(h), U(hkv), U(t), np.float32(scale)), shared_mem=fs)
    run(); torch.cuda.synchronize(); t0 = time.time()
    for _ in range(5): run()
    torch.cuda.synchronize(); tf = (time.time() - t0) / 5
    qq, kk, vv = [x.detach().requires_grad_() for x in (q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1))]
    def sdpa():
        y = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True); y.backward(up)
    sdpa(); torch.cuda.synchronize(); t0 = time.time()
    for _ in range(3): sdpa()
    torch.cuda.synchronize(); ts = (time.time() - t0) / 3
    fl = 4 * b * h * t * t * d / 2
    print(f"F32 {(b,h,hkv,t,d)}: forward {tf*1e3:.2f} ms ({fl/tf/1e12:.1f} TFLOP/s), fwd+bwd {tb*1e3:.2f} ms "
          f"({fl*3.5/tb/1e12:.1f} TFLOP/s), torch sdpa F32 fwd+bwd {ts*1e3:.2f} ms", flush=True)
print("ALL OK" if ok else "SOME FAILED")
