//! The CUDA launches of the decode matmuls (`kernels/linear.cu`, `kernels/linear_q8.cu`,
//! `kernels/linear_k.cu`): x (m ≤ 8 rows, k) times one to three weights, dense or of GGML
//! blocks, concatenated or as a SwiGLU's silu(gate) · up, by the kernel the tuning gives the
//! block type. The weights' device buffers are Candle's (quantized) storages.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{CudaDevice, Layout, Result, WithDType};

use crate::cuda::{
    arg_or_null, load, multiprocessors, to_u32, view, zeroed_counters, Module, LINEAR, LINEAR_K,
    LINEAR_Q8,
};
use crate::handover::qlinear4_x_bytes;
use crate::linear::blocks::MAX_GROUP_EXPERTS;
use crate::linear::blocks::{is_qlinear_k_type, qlinear_small_type};
use crate::tuning::{KernelTuning, QlinearVariant};
use crate::util::{aligned16, LINEAR_SMALL_MAX_ROWS};

/// The scalar arguments that close every `linear_small` and `qlinear_small` kernel's list,
/// in its order: m, n0, n1, n2, k, silu.
struct SmallDims([u32; 6]);

impl SmallDims {
    fn new(m: usize, ns: [usize; 3], k: usize, silu: bool) -> Result<Self> {
        Ok(Self([
            to_u32(m, "rows")?,
            to_u32(ns[0], "columns")?,
            to_u32(ns[1], "columns")?,
            to_u32(ns[2], "columns")?,
            to_u32(k, "width")?,
            u32::from(silu),
        ]))
    }

    /// Pushes them after the output's argument.
    fn push<'a>(&'a self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>) {
        for v in &self.0 {
            b.arg(v);
        }
    }
}

/// `router_logits`: one row x (1, k) times a weight (n, k) in F32, k a multiple of 8, both
/// contiguous and starting 16-byte aligned; x·wᵀ (1, n) in F32.
pub(crate) fn router_logits(
    (x, xl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    fn run<T: DeviceRepr + WithDType>(
        dev: &CudaDevice,
        (x, xl): (&CudaSlice<T>, &Layout),
        (w, wl): (&CudaSlice<T>, &Layout),
    ) -> Result<CudaSlice<f32>> {
        let (m, k) = xl.shape().dims2()?;
        let (n, wk) = wl.shape().dims2()?;
        let aligned = |l: &Layout| aligned16(l, T::DTYPE);
        if m != 1
            || wk != k
            || n == 0
            || k == 0
            || !k.is_multiple_of(8)
            || !aligned(xl)
            || !aligned(wl)
        {
            candle_core::bail!(
                "router_logits: x {:?} and the weight {:?} do not fit the kernel",
                xl.shape(),
                wl.shape()
            );
        }
        let func = load::<T>(dev, LINEAR, "router_logits")?;
        let (x, w) = (view(x, xl, "x")?, view(w, wl, "weight")?);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(n.div_ceil(4), "blocks")?, 1, 1),
            block_dim: (32 * 4, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: uninitialised device memory of n F32 on the device's stream; the kernel
        // launched next on that stream writes every one (lane 0 of each column's warp).
        let out = unsafe { dev.alloc::<f32>(n) }?;
        let (n, k) = (to_u32(n, "columns")?, to_u32(k, "width")?);
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&x).arg(&w).arg(&out).arg(&n).arg(&k);
        // SAFETY: the arguments match `router_logits_<dtype>(const T* x, const T* w, float* y,
        // uint32_t n, uint32_t k)` in kernels/linear.cu; x holds k and w n·k elements, both
        // starting 16-byte aligned with k a multiple of 8, so its 8-element vector loads stay
        // aligned and in bounds; y holds the n columns it writes; the grid's warps cover them.
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }
    let slice = match (&x.slice, &w.slice) {
        (S::F32(xs), S::F32(ws)) => run(&x.device, (xs, xl), (ws, wl))?,
        (S::F16(xs), S::F16(ws)) => run(&x.device, (xs, xl), (ws, wl))?,
        (S::BF16(xs), S::BF16(ws)) => run(&x.device, (xs, xl), (ws, wl))?,
        _ => candle_core::bail!("router_logits: unsupported or mixed dtypes"),
    };
    Ok(CudaStorage {
        slice: S::F32(slice),
        device: x.device.clone(),
    })
}

/// `linear_small`: x (m, k) times up to three weights (n_i, k) in one launch, m ≤ 8, k a
/// multiple of 8, all contiguous and starting 16-byte aligned. Without `silu`: x·w0ᵀ (m, n0),
/// then x·w1ᵀ, then x·w2ᵀ, each contiguous in one buffer; with `silu` (two weights of one
/// shape, gate then up): silu(x·w0ᵀ) · x·w1ᵀ (m, n0).
pub(crate) fn linear_small(
    (x, xl): (&CudaStorage, &Layout),
    ws: &[(&CudaStorage, &Layout)],
    silu: bool,
) -> Result<CudaStorage> {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    fn run<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        dev: &CudaDevice,
        x: &CudaSlice<T>,
        xl: &Layout,
        ws: &[(&CudaSlice<T>, &Layout)],
        silu: bool,
    ) -> Result<CudaSlice<T>> {
        let (m, k) = xl.shape().dims2()?;
        // The kernel instance for at most 1, 2, 4 or 8 rows (its accumulators are registers).
        let bound = m.next_power_of_two().clamp(1, LINEAR_SMALL_MAX_ROWS);
        let func = load::<T>(dev, LINEAR, &format!("linear_small_m{bound}"))?;
        let aligned = |l: &Layout| aligned16(l, T::DTYPE);
        let mut ns = [0usize; 3];
        let mut views = Vec::with_capacity(3);
        for (i, (w, wl)) in ws.iter().enumerate() {
            let (n, wk) = wl.shape().dims2()?;
            if wk != k || n == 0 || !aligned(wl) {
                candle_core::bail!(
                    "linear_small: weight {:?} does not fit x {:?}",
                    wl.shape(),
                    xl.shape()
                );
            }
            ns[i] = n;
            views.push(view(w, wl, "weight")?);
        }
        let x = view(x, xl, "x")?;
        if ws.is_empty()
            || ws.len() > 3
            || (silu && (ws.len() != 2 || ns[0] != ns[1]))
            || m == 0
            || m > LINEAR_SMALL_MAX_ROWS
            || k == 0
            || !k.is_multiple_of(8)
            || !aligned(xl)
        {
            candle_core::bail!(
                "linear_small: x {:?} and {} weights do not fit the kernel",
                xl.shape(),
                ws.len()
            );
        }
        let cols = if silu { ns[0] } else { ns.iter().sum() };
        let out_len = m * cols;
        let dims = SmallDims::new(m, ns, k, silu)?;
        let cfg = LaunchConfig {
            grid_dim: (to_u32(cols.div_ceil(4), "blocks")?, 1, 1),
            block_dim: (32 * 4, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: uninitialised device memory of m·cols elements on the device's stream; the
        // kernel launched next on that stream writes every one (lane 0 of each column's warp
        // writes that column for each row r < m).
        let out = unsafe { dev.alloc::<T>(out_len) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&x);
        // Absent weights repeat the first (a valid pointer the kernel never reads: n_i = 0).
        for i in 0..3 {
            b.arg(&views[i.min(views.len() - 1)]);
        }
        b.arg(&out);
        dims.push(&mut b);
        // SAFETY: the arguments match `linear_small_m<M>_<dtype>(const T* x, const T* w0, w1,
        // w2, T* y, uint32_t m, n0, n1, n2, k, silu)` in kernels/linear.cu, M ≥ m; x holds m·k and weight i
        // n_i·k elements (n_i = 0 for absent ones, which are never read), all starting 16-byte
        // aligned with k a multiple of 8, so its 8-element vector loads stay aligned and in
        // bounds; y holds m·cols, the columns it writes (n0 + n1 + n2, or n0 with silu, where
        // n0 = n1); warps past the last column return.
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }
    macro_rules! go {
        ($v:ident) => {{
            let S::$v(xs) = &x.slice else { unreachable!() };
            let mut w = Vec::with_capacity(ws.len());
            for (s, l) in ws {
                match &s.slice {
                    S::$v(v) => w.push((v, *l)),
                    _ => candle_core::bail!("linear_small: mixed dtypes"),
                }
            }
            S::$v(run(&x.device, xs, xl, &w, silu)?)
        }};
    }
    let slice = match &x.slice {
        S::F32(_) => go!(F32),
        S::F16(_) => go!(F16),
        S::BF16(_) => go!(BF16),
        _ => candle_core::bail!("linear_small: unsupported dtype {:?}", x.dtype()),
    };
    Ok(CudaStorage {
        slice,
        device: x.device.clone(),
    })
}

/// The 16-byte vectors of shared memory one warp of `qlinear_small` stages a weight row's
/// blocks in, for blocks of `block_bytes` (`QStage<QT>::VECS` in kernels/qblocks.cuh, which this
/// mirrors): about 2.3 KB of whole blocks, a multiple of 32, plus the alignment slack.
fn qlinear_small_stage_vecs(block_bytes: usize) -> usize {
    let blocks = 2304 / block_bytes / 32 * 32;
    (blocks * block_bytes + 31) / 16 + 1
}

/// [`qlinear_small_stage_vecs`] for variant 2 (`QStage2<QT>::VECS`, per weight row): whole
/// blocks, a multiple of 32 and at least 32, about 1.1 KB, plus the alignment slack.
pub(crate) fn qlinear2_small_stage_vecs(block_bytes: usize) -> usize {
    let blocks = 32 * (1152 / block_bytes / 32).max(1);
    (blocks * block_bytes + 31) / 16 + 1
}

/// Warps per block of threads of the `qlinear_small` kernels (`OPS_WARPS` in kernels/qblocks.cuh).
pub(crate) const QLINEAR_WARPS: usize = 4;

/// Variant 3's dynamic shared memory per block of threads at most: what a launch gets without
/// opting in to more. An SM holds 4 blocks of threads of that much (16 warps); a 7B model's
/// largest decode step, the 4 stages of 4 rows of Q4_0 and k = 11008 of one row of x (352
/// blocks, in one chunk), takes 33 KB, 6 per SM.
const QLINEAR3_SHARED_BYTES: usize = 48 * 1024;

/// Variant 3's bytes per block of 32 elements of one row of x (`XBlock8` and the quants in
/// kernels/q8.cuh): 32 quants, the scale and the quants' sum.
pub(crate) const QLINEAR3_X_BLOCK_BYTES: usize = 40;

/// Variant 3's chunk of x (`xblocks`, in blocks of 32 elements, a multiple of 32): all of x's
/// `nb` blocks per row when its `m` rows fit into [`QLINEAR3_SHARED_BYTES`] beside the warps'
/// weight stages (`stage_bytes`), else as many as fit.
pub(crate) fn qlinear3_x_blocks(m: usize, nb: usize, stage_bytes: usize) -> usize {
    let fit = QLINEAR3_SHARED_BYTES.saturating_sub(stage_bytes) / (m * QLINEAR3_X_BLOCK_BYTES);
    nb.next_multiple_of(32).min((fit / 32 * 32).max(32))
}

/// Variant 2's weight rows per warp for the kernel of `bound` rows of x and `cols` output
/// columns (`silu`: columns of gate and of up): 4 where that kernel exists (up to 4 rows of x)
/// and the grid still has at least two blocks of threads per SM, else 2. Variants 3 and 4 ask
/// it up to 2 rows of x (their kernels of 4 rows). The SM count is the
/// first device's asked, read once (a heuristic only: any count gives the same results).
fn qlinear2_rows_per_warp(dev: &CudaDevice, bound: usize, cols: usize, silu: bool) -> usize {
    if bound > 4 {
        return 2;
    }
    let sms = multiprocessors(dev);
    let cols_per_block = QLINEAR_WARPS * if silu { 2 } else { 4 };
    if cols.div_ceil(cols_per_block) >= 2 * sms {
        4
    } else {
        2
    }
}

/// Variant 4's first launch, `qlinear4_quantize_x_<dtype>`: the m rows of x (m, k) quantized to
/// 8-bit blocks of 32 into a new device buffer for its matmul kernels, k / 32 blocks per row
/// rounded up to a multiple of 32 ([`QLINEAR4_X_BLOCK_BYTES`] each).
pub(super) fn qlinear4_quantize_x<T: DeviceRepr + WithDType>(
    dev: &CudaDevice,
    x: &CudaView<'_, T>,
    m: usize,
    k: usize,
) -> Result<CudaSlice<u8>> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    if m == 0 || k == 0 || !k.is_multiple_of(32) || x.len() != m * k {
        candle_core::bail!(
            "qlinear_small: x of {} elements is not {m} rows of {k}",
            x.len()
        );
    }
    let nbp = (k / 32).next_multiple_of(32);
    let func = load::<T>(dev, LINEAR_Q8, "qlinear4_quantize_x")?;
    // SAFETY: uninitialised device memory on the device's stream; the kernel launched next on
    // that stream writes every byte of it (each of the m·nbp blocks' 32 quants, and its scale
    // and sum, zeros for the blocks past k / 32) before the matmul that reads it.
    let xq = unsafe { dev.alloc::<u8>(qlinear4_x_bytes(m, k)) }?;
    let stream = dev.cuda_stream();
    {
        let (p, _sync) = xq.device_ptr(&stream);
        if !(p as usize).is_multiple_of(16) {
            candle_core::bail!("qlinear_small: the buffer of quantized x is not 16-byte aligned");
        }
    }
    let (m_u, k_u) = (to_u32(m, "rows")?, to_u32(k, "width")?);
    let cfg = LaunchConfig {
        // 128 threads per 32 blocks of a row: the threads cover the m rows' nbp blocks exactly.
        grid_dim: (to_u32(m * nbp / 32, "blocks")?, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&func);
    b.arg(x);
    b.arg(&xq);
    b.arg(&m_u);
    b.arg(&k_u);
    // SAFETY: the arguments match `qlinear4_quantize_x_<dtype>(const T* x, uint4* xq,
    // uint32_t m, uint32_t k)` in kernels/linear_q8.cu; x holds m·k elements, 16-byte aligned (the
    // caller checked its layout), k a multiple of 32, so its 8-element loads of the blocks below
    // k / 32 stay aligned and in bounds; xq, 16-byte aligned, holds m·nbp·40 bytes, the extent
    // the kernel writes (quants at 32 bytes per block, then 8 per block), and the grid of
    // m·nbp/32 blocks of 128 threads gives each thread a row below m.
    unsafe { b.launch(cfg) }.w()?;
    Ok(xq)
}

/// `linear_small` with weights of GGML blocks (`qlinear_small_m<M>_<type>_<dtype>` and the
/// other variants' kernels, the one `tuning` gives the block type):
/// x (m, k) times one to three weights (n_i, k) of one block type, concatenated or (`silu`, two
/// weights) as silu(x·w0ᵀ)·(x·w1ᵀ). The weights' device buffers are Candle's quantized
/// storages, read through their device pointers on the device's stream. Variant 4 launches
/// [`qlinear4_quantize_x`] first, into a buffer freed (in stream order) after the matmul.
///
/// `pre`: x already quantized for variant 4 (by `rms_norm_residual_q8` or another writer of
/// that buffer, from these very rows), used instead of quantizing it again when variant 4 runs.
///
/// `q8_out` (variant 4's kernel for blocks of 32, `silu`, n0 a multiple of 32): the kernel also
/// writes its output quantized as [`qlinear4_quantize_x`] would, in a buffer of
/// [`qlinear4_x_bytes`] for the next variant-4 matmul (the down projection), returned beside it.
pub(crate) fn qlinear_small(
    (x, xl): (&CudaStorage, &Layout),
    ws: &[&candle_core::quantized::QTensor],
    silu: bool,
    pre: Option<&CudaStorage>,
    q8_out: bool,
    tuning: &KernelTuning,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    type Out<T> = (CudaSlice<T>, Option<CudaSlice<u8>>);
    fn run<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        dev: &CudaDevice,
        (x, xl): (&CudaSlice<T>, &Layout),
        ws: &[&candle_core::quantized::QTensor],
        silu: bool,
        pre: Option<&CudaSlice<u8>>,
        q8_out: bool,
        tuning: &KernelTuning,
    ) -> Result<Out<T>> {
        let (m, k) = xl.shape().dims2()?;
        let ggml = ws.first().map(|w| w.dtype());
        let qname = ggml.and_then(qlinear_small_type);
        let mut ns = [0usize; 3];
        for (i, w) in ws.iter().enumerate() {
            let (n, wk) = w.shape().dims2()?;
            if wk != k || n == 0 || Some(w.dtype()) != ggml || !w.device().is_cuda() {
                candle_core::bail!(
                    "qlinear_small: weight {:?} of {:?} does not fit x {:?}",
                    w.shape(),
                    w.dtype(),
                    xl.shape()
                );
            }
            ns[i] = n;
        }
        let x = view(x, xl, "x")?;
        let Some(qname) = qname else {
            candle_core::bail!("qlinear_small: no kernel for {ggml:?} blocks")
        };
        if ws.len() > 3
            || (silu && (ws.len() != 2 || ns[0] != ns[1]))
            || m == 0
            || m > LINEAR_SMALL_MAX_ROWS
            || k == 0
            || !k.is_multiple_of(ws[0].dtype().block_size())
            || !aligned16(xl, T::DTYPE)
        {
            candle_core::bail!(
                "qlinear_small: x {:?} and {} weights do not fit the kernel",
                xl.shape(),
                ws.len()
            );
        }
        let bound = m.next_power_of_two().clamp(1, LINEAR_SMALL_MAX_ROWS);
        let cols = if silu { ns[0] } else { ns.iter().sum() };
        let block_bytes = ws[0].dtype().type_size();
        // The kernel, the output columns one warp computes, the shared memory of a block of
        // threads and, for variant 3, the chunk of x it quantizes at once (in blocks).
        let variant = tuning.qlinear_variant_at(ws[0].dtype(), m);
        let kquant = is_qlinear_k_type(ws[0].dtype());
        // Warps a column group (qlinear3ks2_small: 2).
        let mut splits = 1usize;
        let (name, cols_per_warp, shared_bytes, xblocks) = match variant {
            // K-quant blocks converting to floats (every variant but 3 and 4): their own
            // kernel, one column (of gate and up with silu) per warp, or two for Q4_K with
            // `qlinear_k_rows`, no shared memory.
            v if kquant && !matches!(v, QlinearVariant::V3 | QlinearVariant::V4) => {
                if tuning.qlinear_k_rows == 2 && bound <= 2 && qname == "q4_k" {
                    (format!("qlinear_k2_small_r2_m{bound}_{qname}"), 2, 0, None)
                } else {
                    (format!("qlinear_k_small_m{bound}_{qname}"), 1, 0, None)
                }
            }
            // One staged row per warp, two (gate and up) with silu.
            QlinearVariant::V1 => (
                format!("qlinear_small_m{bound}_{qname}"),
                1,
                QLINEAR_WARPS
                    * 16
                    * qlinear_small_stage_vecs(block_bytes)
                    * (1 + usize::from(silu)),
                None,
            ),
            // r staged rows per warp: r columns, or r / 2 columns of gate and of up. K-quant
            // blocks under variants 3 and 4 (`qlinear3k`/`qlinear4k`) take the same rows per
            // warp and x's chunks but read their rows unstaged.
            v => {
                use QlinearVariant as V;
                let r = match v {
                    V::V2R2 => 2,
                    // No kernel of 4 rows for more than 4 rows of x.
                    V::V2R4 if bound <= 4 => 4,
                    V::V2R4 => 2,
                    // Variant 3's and 4's kernels of 4 rows take at most 2 rows of x.
                    V::V3 | V::V4 if bound > 2 => 2,
                    _ => qlinear2_rows_per_warp(dev, bound, cols, silu),
                };
                let (stages, kq) = if kquant {
                    (0, "k")
                } else {
                    (
                        QLINEAR_WARPS * 16 * qlinear2_small_stage_vecs(block_bytes) * r,
                        "",
                    )
                };
                let cols_per_warp = if silu { r / 2 } else { r };
                if v == V::V3 {
                    // K-quant blocks up to 2 rows of x: two warps a column group where the grid
                    // is small (qlinear3ks2_small), their sums' static shared memory beside x.
                    splits = if kquant && bound <= 2 {
                        match tuning.qlinear_k_splits {
                            1 => 1,
                            2 => 2,
                            _ if cols.div_ceil(QLINEAR_WARPS * cols_per_warp)
                                < 4 * multiprocessors(dev) =>
                            {
                                2
                            }
                            _ => 1,
                        }
                    } else {
                        1
                    };
                    let sums = (splits - 1) * QLINEAR_WARPS * r * bound * 32 * 4;
                    let xblocks = qlinear3_x_blocks(m, k / 32, stages + sums);
                    let kernel = if splits == 2 {
                        "3ks2".to_string()
                    } else {
                        format!("3{kq}")
                    };
                    (
                        format!("qlinear{kernel}_small_r{r}_m{bound}_{qname}"),
                        cols_per_warp,
                        stages + m * xblocks * QLINEAR3_X_BLOCK_BYTES,
                        Some(to_u32(xblocks, "blocks of x")?),
                    )
                } else {
                    let kernel = if v == V::V4 { "qlinear4" } else { "qlinear2" };
                    (
                        format!("{kernel}{kq}_small_r{r}_m{bound}_{qname}"),
                        cols_per_warp,
                        stages,
                        None,
                    )
                }
            }
        };
        // Variant 4's kernels for blocks of 32 (not qlinear4k) take yq and counters last.
        let v4_blocks = variant == QlinearVariant::V4 && !kquant;
        if q8_out && !(v4_blocks && silu && ns[0].is_multiple_of(32)) {
            candle_core::bail!(
                "qlinear_small: a quantized output needs variant 4, blocks of 32, gate and up, \
                 and a width that is a multiple of 32 ({variant:?}, {ggml:?}, {} columns)",
                ns[0]
            );
        }
        let func = load::<T>(dev, kernel_module(&name), &name)?;
        let dims = SmallDims::new(m, ns, k, silu)?;
        let cfg = LaunchConfig {
            grid_dim: (
                to_u32(cols.div_ceil(QLINEAR_WARPS * cols_per_warp), "blocks")?,
                1,
                1,
            ),
            block_dim: (32 * (QLINEAR_WARPS * splits) as u32, 1, 1),
            shared_mem_bytes: to_u32(shared_bytes, "shared memory")?,
        };
        let stream = dev.cuda_stream();
        // The guards order the stream after the buffers' last writes (the copy stream's
        // upload, where cudarc tracks events) and record this launch's read on drop.
        let mut ptrs = Vec::with_capacity(3);
        let mut guards = Vec::with_capacity(3);
        for w in ws {
            let (p, g) = w.device_ptr_with_guard(&stream)?;
            if !(p as usize).is_multiple_of(16) {
                candle_core::bail!("qlinear_small: a weight's blocks are not 16-byte aligned");
            }
            ptrs.push(p as u64);
            guards.push(g);
        }
        // SAFETY: uninitialised device memory of m·cols elements on the device's stream; the
        // kernel launched next on that stream writes every one (lane 0 of the warp that
        // computes a column writes that column for each row r < m; the grid covers all the
        // columns, cols_per_warp per warp).
        let out = unsafe { dev.alloc::<T>(m * cols) }?;
        // Variant 4: x quantized into a buffer of its own first (unless the norm before it
        // wrote one: `pre`), which the kernel reads instead.
        let own;
        let xq = match (variant == QlinearVariant::V4, pre) {
            (false, _) => None,
            (true, Some(p)) if p.len() == qlinear4_x_bytes(m, k) => Some(p),
            (true, Some(p)) => candle_core::bail!(
                "qlinear_small: {} bytes of quantized x for {m} rows of {k}",
                p.len()
            ),
            (true, None) => {
                own = qlinear4_quantize_x(dev, &x, m, k)?;
                Some(&own)
            }
        };
        // The quantized output and its groups' counters (`q8_out`).
        let yq = if q8_out {
            // SAFETY: uninitialised device memory on the device's stream; the kernel launched
            // next writes the quants and the scale and sum of every block of the m rows of
            // n0 / 32 blocks (each group's by the last warp to store one of its columns); the
            // padding blocks up to a multiple of 32 per row stay unwritten, and variant 4's
            // matmuls read only blocks below k / 32.
            Some(unsafe { dev.alloc::<u8>(qlinear4_x_bytes(m, ns[0])) }?)
        } else {
            None
        };
        let counters = if v4_blocks {
            Some(zeroed_counters(dev, if q8_out { ns[0] / 32 } else { 0 })?)
        } else {
            None
        };
        let mut b = stream.launch_builder(&func);
        match xq {
            Some(xq) => b.arg(xq),
            None => b.arg(&x),
        };
        // Absent weights repeat the first (a valid pointer the kernel never reads: n_i = 0).
        for i in 0..3 {
            b.arg(&ptrs[i.min(ptrs.len() - 1)]);
        }
        b.arg(&out);
        dims.push(&mut b);
        if let Some(xblocks) = &xblocks {
            b.arg(xblocks);
        }
        if let Some(counters) = &counters {
            arg_or_null(&mut b, yq.as_ref());
            b.arg(&**counters);
        }
        // SAFETY: the arguments match `qlinear_small_m<M>_<type>_<dtype>` and
        // `qlinear2_small_r<R>_m<M>_<type>_<dtype>(const T* x, const uint8_t* w0, w1, w2, T* y,
        // uint32_t m, n0, n1, n2, k, silu)` in kernels/linear.cu (kernel_module gives each
        // kernel's file: variants 3 and 4 in linear_q8.cu, the K-quants in linear_k.cu),
        // `qlinear3_small_r<R>_m<M>_<type>_<dtype>` the same with `uint32_t xblocks` last (a
        // multiple of 32; `qlinear3ks2_small_...` in blocks of 8 warps, whose static shared
        // memory for the sums was left beside x's chunk within the 48 KB), and
        // `qlinear4_small_r<R>_m<M>_<type>_<dtype>` the same as variant 2's with
        // `const uint4* xq` for x and `uint4* yq, uint32_t* counters` last (yq null, or with
        // silu m rows of n0 / 32 blocks rounded up to 32 at 40 bytes, 16-byte aligned, n0 a
        // multiple of 32 and m ≤ 8, and then n0 / 32 zeroed counters, which the kernel sets
        // back to 0), with M ≥ m, every weight of that block type and the
        // shared memory their stages take (QStage / QStage2 mirrored above), for variant 3 with
        // m rows of xblocks blocks of x after them. x holds m·k elements, 16-byte aligned,
        // k a multiple of 32; for variant 4, xq is the buffer qlinear4_quantize_x (or, as
        // `pre`, rms_norm_residual_q8 from the same rows: the handover module matches them by
        // tensor id) filled from it, launched before on this stream, for the m and k passed here (the kernel reads
        // blocks below k / 32 of rows below m, in its extent). Weight i is a live quantized
        // storage of n_i·k elements (n_i = 0 for absent ones, never read), 16-byte aligned,
        // whose rows are k/32 blocks: the kernel
        // reads from the 16-byte boundary at or before a block to the one at or after a row's
        // end, at most 15 bytes past the last row, inside the 512 zeroed padding elements
        // Candle allocates after every quantized buffer. For Q4_K and Q6_K,
        // `qlinear_k_small_m<M>_<type>_<dtype>` and `qlinear_k2_small_r<R>_m<M>_<type>_<dtype>`
        // (R columns a warp, the grid sized for them) have variant 1's arguments; k is a multiple of
        // 256, the rows are k/256 super-blocks of 144 (Q4_K, 16-byte aligned as the buffer is)
        // or 210 bytes (Q6_K, read in 16-bit loads: 2-byte aligned), and the kernel reads
        // inside them only. `qlinear4k_small_r<R>_m<M>_<type>_<dtype>` and
        // `qlinear3k_small_r<R>_m<M>_<type>_<dtype>` (Q4_K, Q6_K) have variant 4's and 3's
        // arguments (xq filled as for variant 4; the shared memory of m rows of xblocks blocks
        // of x), and read those rows the same way, except
        // Q6_K's groups of quant bytes, read in the aligned 4-byte words that hold them: from
        // at most 2 bytes before a group (the buffer starts 16-byte aligned, so that word is in
        // it) to at most 3 past it, still inside its super-block. y holds m·cols elements.
        unsafe { b.launch(cfg) }.w()?;
        drop(guards);
        // A buffer of its own is freed in stream order (at the end of this scope), after the
        // kernel has read it.
        Ok((out, yq))
    }
    let pre = match pre.map(|p| &p.slice) {
        Some(S::U8(p)) => Some(p),
        Some(_) => candle_core::bail!("qlinear_small: quantized x is not a buffer of bytes"),
        None => None,
    };
    fn wrap<T>((out, yq): Out<T>, f: impl Fn(CudaSlice<T>) -> S) -> (S, Option<S>) {
        (f(out), yq.map(S::U8))
    }
    let dev = &x.device;
    let (slice, yq) = match &x.slice {
        S::F32(v) => wrap(run(dev, (v, xl), ws, silu, pre, q8_out, tuning)?, S::F32),
        S::F16(v) => wrap(run(dev, (v, xl), ws, silu, pre, q8_out, tuning)?, S::F16),
        S::BF16(v) => wrap(run(dev, (v, xl), ws, silu, pre, q8_out, tuning)?, S::BF16),
        _ => candle_core::bail!("qlinear_small: unsupported dtype {:?}", x.dtype()),
    };
    let storage = |slice| CudaStorage {
        slice,
        device: dev.clone(),
    };
    Ok((storage(slice), yq.map(storage)))
}

/// The experts of a grouped launch: their buffers by value, or the device address of a
/// `GroupWeights` (`moe_route`'s).
pub(crate) enum GroupArg<'a> {
    /// Passed with the launch.
    Value(&'a GroupWeights),
    /// Read by the kernel from this device address.
    At(u64),
}

/// kernels/qblocks.cuh's `GroupWeights`: each expert's weight buffers (w1: the up projection).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct GroupWeights {
    w0: [u64; MAX_GROUP_EXPERTS],
    w1: [u64; MAX_GROUP_EXPERTS],
}
// SAFETY: plain data laid out as `GroupWeights` in kernels/qblocks.cuh (two arrays of 16
// 8-byte device pointers, no padding), which the grouped kernels take by value.
unsafe impl DeviceRepr for GroupWeights {}

/// kernels/qblocks.cuh's `GroupScales`: each expert's output weight.
#[repr(C)]
#[derive(Clone, Copy)]
struct GroupScales {
    w: [f32; MAX_GROUP_EXPERTS],
}
// SAFETY: plain data laid out as `GroupScales` in kernels/qblocks.cuh (16 f32), taken by value.
unsafe impl DeviceRepr for GroupScales {}

/// One decode row x (1, hidden) through its routed experts (gate, up, down of GGML blocks:
/// gate and up (inter, hidden) of one type, down (hidden, inter) of one type, for every
/// expert), each expert's output times its scale, summed: per group of at most
/// [`MAX_GROUP_EXPERTS`], one launch of variant 3's kernel for every expert's SwiGLU
/// (`qlinear3_experts_*` / `qlinear3k_experts_*`, blockIdx.y the expert), one for every
/// down projection of those rows, and the weighted sum added into the result
/// (`experts_weighted_sum_*`). The caller checked the shapes and types
/// (`linear::experts::qexperts_row_fits`).
pub(crate) fn qlinear_experts(
    (x, xl): (&CudaStorage, &Layout),
    experts: &[[&candle_core::quantized::QTensor; 3]],
    scales: &[f32],
) -> Result<CudaStorage> {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    fn run<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        dev: &CudaDevice,
        (x, xl): (&CudaSlice<T>, &Layout),
        experts: &[[&candle_core::quantized::QTensor; 3]],
        scales: &[f32],
    ) -> Result<CudaSlice<T>> {
        let (m, hidden) = xl.shape().dims2()?;
        let Some(first) = experts.first() else {
            candle_core::bail!("qlinear_experts: no experts")
        };
        let inter = first[0].shape().dims2()?.0;
        if m != 1 || experts.len() != scales.len() || !aligned16(xl, T::DTYPE) {
            candle_core::bail!(
                "qlinear_experts: x {:?} and {} experts ({} scales) do not fit the kernels",
                xl.shape(),
                experts.len(),
                scales.len()
            );
        }
        let x = view(x, xl, "x")?;
        let stream = dev.cuda_stream();
        // SAFETY: uninitialised device memory of `hidden` elements on the device's stream;
        // the first group's weighted sum (accumulate = 0) writes every one before anything
        // reads it, and the later groups add to them.
        let out = unsafe { dev.alloc::<T>(hidden) }?;
        for (c, group) in experts.chunks(MAX_GROUP_EXPERTS).enumerate() {
            let e = group.len();
            let mut gate_up = GroupWeights {
                w0: [0; MAX_GROUP_EXPERTS],
                w1: [0; MAX_GROUP_EXPERTS],
            };
            let mut down = gate_up;
            let mut guards = Vec::with_capacity(3 * e);
            for (j, w) in group.iter().enumerate() {
                let mut p = [0u64; 3];
                for (i, q) in w.iter().enumerate() {
                    let (at, g) = q.device_ptr_with_guard(&stream)?;
                    if !(at as usize).is_multiple_of(16) {
                        candle_core::bail!(
                            "qlinear_experts: an expert's blocks are not 16-byte aligned"
                        );
                    }
                    guards.push(g);
                    p[i] = at as u64;
                }
                [gate_up.w0[j], gate_up.w1[j], down.w0[j]] = p;
                // The down kernels take no w1 (n1 = 0): a valid pointer, never read.
                down.w1[j] = down.w0[j];
            }
            // SAFETY: uninitialised device memory on the device's stream: e rows of `inter`
            // columns, every one written by the SwiGLU launch (its grid covers the columns of
            // each expert, blockIdx.y the expert), then e rows of `hidden` by the down launch,
            // before the weighted sum reads them, all in stream order.
            let act = unsafe { dev.alloc::<T>(e * inter) }?;
            group_launch(
                dev,
                first[0].dtype(),
                (&x, 0),
                GroupArg::Value(&gate_up),
                &act,
                [inter, inter],
                hidden,
                true,
                e,
            )?;
            // SAFETY: as `act`'s.
            let ys = unsafe { dev.alloc::<T>(e * hidden) }?;
            let act_view = act.slice(..);
            group_launch(
                dev,
                first[2].dtype(),
                (&act_view, inter),
                GroupArg::Value(&down),
                &ys,
                [hidden, 0],
                inter,
                false,
                e,
            )?;
            let mut w = GroupScales {
                w: [0.0; MAX_GROUP_EXPERTS],
            };
            w.w[..e].copy_from_slice(&scales[c * MAX_GROUP_EXPERTS..c * MAX_GROUP_EXPERTS + e]);
            let func = load::<T>(dev, LINEAR, "experts_weighted_sum")?;
            let cfg = LaunchConfig {
                grid_dim: (to_u32(hidden.div_ceil(256), "blocks")?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let (n, count, accumulate) = (to_u32(hidden, "width")?, e as u32, u32::from(c > 0));
            let mut b = stream.launch_builder(&func);
            b.arg(&ys)
                .arg(&out)
                .arg(&w)
                .arg(&count)
                .arg(&n)
                .arg(&accumulate);
            // SAFETY: `experts_weighted_sum_<dtype>(const T* y, T* out, GroupScales s,
            // uint32_t experts, uint32_t n, uint32_t accumulate)` in kernels/linear.cu: y holds
            // e rows of n (written above), out n elements (written by the first group, which
            // passes accumulate = 0); one thread per column, the grid covers n.
            unsafe { b.launch(cfg) }.w()?;
            drop(guards);
        }
        Ok(out)
    }
    let dev = &x.device;
    let slice = match &x.slice {
        S::F32(v) => S::F32(run(dev, (v, xl), experts, scales)?),
        S::F16(v) => S::F16(run(dev, (v, xl), experts, scales)?),
        S::BF16(v) => S::BF16(run(dev, (v, xl), experts, scales)?),
        _ => candle_core::bail!("qlinear_experts: unsupported dtype {:?}", x.dtype()),
    };
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// One grouped launch of variant 3 over `e` experts for one row each: x's row of expert j at
/// `x + j · x_stride` (`x_stride` 0: one row for all), weights `w` of block type `ty`
/// (`k` wide), outputs `y` (e rows of `ns[0]` with `silu`, else of `ns[0] + ns[1]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn group_launch<T: DeviceRepr + WithDType>(
    dev: &CudaDevice,
    ty: candle_core::quantized::GgmlDType,
    (x, x_stride): (&CudaView<'_, T>, usize),
    w: GroupArg<'_>,
    y: &CudaSlice<T>,
    ns: [usize; 2],
    k: usize,
    silu: bool,
    e: usize,
) -> Result<()> {
    let Some(qname) = qlinear_small_type(ty) else {
        candle_core::bail!("qlinear_experts: no kernel for {ty:?} blocks")
    };
    let kquant = is_qlinear_k_type(ty);
    let cols = if silu { ns[0] } else { ns[0] + ns[1] };
    let r = qlinear2_rows_per_warp(dev, 1, cols * e, silu);
    let stages = if kquant {
        0
    } else {
        QLINEAR_WARPS * 16 * qlinear2_small_stage_vecs(ty.type_size()) * r
    };
    let xblocks = qlinear3_x_blocks(1, k / 32, stages);
    let at = if matches!(w, GroupArg::At(_)) {
        "_at"
    } else {
        ""
    };
    let (module, name) = if kquant {
        (LINEAR_K, format!("qlinear3k_experts{at}_r{r}_{qname}"))
    } else {
        (LINEAR_Q8, format!("qlinear3_experts{at}_r{r}_{qname}"))
    };
    let func = load::<T>(dev, module, &name)?;
    let cols_per_warp = if silu { r / 2 } else { r };
    let cfg = LaunchConfig {
        grid_dim: (
            to_u32(cols.div_ceil(QLINEAR_WARPS * cols_per_warp), "blocks")?,
            to_u32(e, "experts")?,
            1,
        ),
        block_dim: (32 * QLINEAR_WARPS as u32, 1, 1),
        shared_mem_bytes: to_u32(stages + xblocks * QLINEAR3_X_BLOCK_BYTES, "shared memory")?,
    };
    let stream = dev.cuda_stream();
    let (stride, n0, n1) = (
        to_u32(x_stride, "x stride")?,
        to_u32(ns[0], "columns")?,
        to_u32(ns[1], "columns")?,
    );
    let (kk, s, xb) = (
        to_u32(k, "width")?,
        u32::from(silu),
        to_u32(xblocks, "blocks of x")?,
    );
    let mut b = stream.launch_builder(&func);
    b.arg(x).arg(&stride);
    match &w {
        GroupArg::Value(w) => b.arg(*w),
        GroupArg::At(at) => b.arg(at),
    };
    b.arg(y);
    b.arg(&n0).arg(&n1).arg(&kk).arg(&s).arg(&xb);
    // SAFETY: `qlinear3_experts_r<R>_<q>_<dtype>` (kernels/linear_q8.cu) and
    // `qlinear3k_experts_r<R>_<q>_<dtype>` (kernels/linear_k.cu) take (const T* x, uint32_t
    // x_stride, GroupWeights g, T* y, uint32_t n0, n1, k, silu, xblocks) (their `_at_`
    // twins `const GroupWeights* g`, a live device buffer moe_route wrote) and run, for expert
    // blockIdx.y < e, variant 3's one-row kernel of that type (qlinear3_small_r<R>_m1 /
    // qlinear3k_small_r<R>_m1, whose contract `qlinear_small` states) on x + j · x_stride,
    // weights g.w0[j] (and g.w1[j] with silu), output y + j · (silu ? n0 : n0 + n1). Every
    // expert's row of x is k elements inside x's buffer (x_stride = 0, or the e rows of
    // `act`), 16-byte aligned (x checked by the caller, `act`'s rows are `inter` elements of
    // a multiple of 32 or 256); each weight is a live quantized storage of that type with
    // the shape the caller checked (n_i rows of k), 16-byte aligned (checked above); y holds
    // e rows of the output's columns; the shared memory is the stages and the chunk of x
    // variant 3 takes for R and one row, as `qlinear_small` sizes them.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// The module a decode matmul kernel of `name` is in: `kernels/linear_k.cu` for the K-quants'
/// (`qlinear_k_*`, `qlinear_k2_*`, `qlinear3k*`, `qlinear4k*`), `kernels/linear_q8.cu` for
/// variants 3 and 4 over blocks of 32 (`qlinear3_*`, `qlinear4_*`), `kernels/linear.cu` for the
/// others (`linear_small_*`, `qlinear_small_*`, `qlinear2_*`).
pub(crate) fn kernel_module(name: &str) -> Module {
    let k_quant = name.starts_with("qlinear_k")
        || name.starts_with("qlinear3k")
        || name.starts_with("qlinear4k");
    if k_quant {
        LINEAR_K
    } else if name.starts_with("qlinear3_") || name.starts_with("qlinear4_") {
        LINEAR_Q8
    } else {
        LINEAR
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel of the three decode-matmul modules is found in the module `kernel_module`
    /// names for it, which is where the launcher loads it from.
    #[test]
    fn every_decode_matmul_kernel_resolves_in_its_module() {
        for module in [LINEAR, LINEAR_Q8, LINEAR_K] {
            let names = crate::cuda::entries(module.ptx);
            assert!(!names.is_empty(), "{}", module.name);
            for name in names {
                assert_eq!(kernel_module(name).name, module.name, "{name}");
            }
        }
    }
}
