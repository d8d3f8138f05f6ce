//! The CUDA launches of the prompt GEMM (`kernels/gemm.cu`): a GGML weight's rows dequantized
//! to F16 or BF16, and x times the weight through those rows a slice at a time and cuBLAS.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{CudaDevice, DType, Layout, Result};

use crate::cuda::{load_named, to_u32, ELEMWISE_BLOCK, GEMM};
use crate::linear::qlinear_small_type;

/// A GGML weight on a GPU that `dequant_*` in kernels/gemm.cu read: its device, its type's
/// kernel name, its shape (n rows of k) and the bytes of a row.
struct DequantSource {
    dev: CudaDevice,
    qname: &'static str,
    n: usize,
    k: usize,
    row_bytes: usize,
}

fn dequant_source(w: &candle_core::quantized::QTensor, what: &str) -> Result<DequantSource> {
    let (n, k) = w.shape().dims2()?;
    let ggml = w.dtype();
    let Some(qname) = qlinear_small_type(ggml) else {
        candle_core::bail!("{what}: no kernel for {ggml:?}");
    };
    if !k.is_multiple_of(ggml.block_size()) {
        candle_core::bail!("{what}: a {n}x{k} {ggml:?} weight's rows are not whole blocks");
    }
    let candle_core::Device::Cuda(dev) = w.device() else {
        candle_core::bail!("{what}: the weight is not on a GPU");
    };
    Ok(DequantSource {
        dev,
        qname,
        n,
        k,
        row_bytes: k / ggml.block_size() * ggml.type_size(),
    })
}

/// The 16-bit element types the dequantizing kernels write.
trait DequantOut: DeviceRepr + ValidAsZeroBits + Copy + 'static {
    const NAME: &'static str;
    const ONE: Self;
    const ZERO: Self;
}
impl DequantOut for half::f16 {
    const NAME: &'static str = "f16";
    const ONE: Self = half::f16::ONE;
    const ZERO: Self = half::f16::ZERO;
}
impl DequantOut for half::bf16 {
    const NAME: &'static str = "bf16";
    const ONE: Self = half::bf16::ONE;
    const ZERO: Self = half::bf16::ZERO;
}

/// Launches the dequantizing kernel on `stream`: the `rows` rows of `src`'s weight whose first
/// block is at device address `first` (within the weight's buffer, whose read the caller
/// holds a guard of) into `out`'s first rows·k elements.
fn launch_dequant<T: DequantOut>(
    src: &DequantSource,
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    first: u64,
    rows: usize,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let func = load_named(
        &src.dev,
        GEMM,
        &format!("dequant_{}_{}", T::NAME, src.qname),
    )?;
    if out.len() < rows * src.k {
        candle_core::bail!(
            "dequantize: {} elements out for {rows}x{}",
            out.len(),
            src.k
        );
    }
    // Each thread writes 8 elements (k is a multiple of 32).
    let groups = to_u32(rows * src.k / 8, "parts of 8 elements")?;
    let mut b = stream.launch_builder(&func);
    b.arg(&first);
    b.arg(out);
    b.arg(&groups);
    let cfg = LaunchConfig {
        grid_dim: (groups.div_ceil(ELEMWISE_BLOCK), 1, 1),
        block_dim: (ELEMWISE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `dequant_<f16|bf16>_<type>(const uint8_t* w, T* out,
    // uint32_t groups8)` in kernels/gemm.cu, T the element type of `out`. `first` points at the
    // first of `rows` whole rows of the weight's buffer (the callers check r0 + rows <= n and
    // hold the buffer's read guard), and thread g reads only the block holding elements 8g ..
    // 8g + 8 of those rows (a 32-element block, or the 144- or 210-byte super-block of 256 for
    // Q4_K and Q6_K, in 2-byte and byte loads; k is a multiple of the block). It writes those
    // elements of `out`, which holds at least rows·k (checked above) and is 16-byte aligned
    // (the allocator's granularity) for the 16-byte stores.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Rows `r0 .. r0 + rows` of the GGML weight `w` (rows of k elements, a type
/// `qlinear_small_type` names) in `dtype` (F16 or BF16), row-major: the
/// dequantizing kernels of kernels/gemm.cu, on the device's stream.
pub(crate) fn dequantize_rows(
    w: &candle_core::quantized::QTensor,
    r0: usize,
    rows: usize,
    dtype: DType,
) -> Result<CudaStorage> {
    let what = "dequantize_rows";
    let src = dequant_source(w, what)?;
    if r0 + rows > src.n || rows == 0 {
        candle_core::bail!(
            "{what}: rows {r0}..{} of a {}x{} weight",
            r0 + rows,
            src.n,
            src.k
        );
    }
    fn run<T: DequantOut>(
        w: &candle_core::quantized::QTensor,
        src: &DequantSource,
        r0: usize,
        rows: usize,
    ) -> Result<CudaSlice<T>> {
        let stream = src.dev.cuda_stream();
        // Uninitialised device memory of rows·k elements on the device's stream; the kernel
        // launched next writes every one.
        // SAFETY: written whole by launch_dequant below before anything reads it.
        let mut out = unsafe { src.dev.alloc::<T>(rows * src.k) }?;
        // The guard orders the stream after the weight's upload and records this read on
        // drop.
        let (p, guard) = w.device_ptr_with_guard(&stream)?;
        launch_dequant(
            src,
            &stream,
            p as u64 + (r0 * src.row_bytes) as u64,
            rows,
            &mut out.slice_mut(..),
        )?;
        drop(guard);
        Ok(out)
    }
    use candle_core::cuda_backend::CudaStorageSlice as S;
    let slice = match dtype {
        DType::F16 => S::F16(run::<half::f16>(w, &src, r0, rows)?),
        DType::BF16 => S::BF16(run::<half::bf16>(w, &src, r0, rows)?),
        _ => candle_core::bail!("{what}: no kernel writes {dtype:?}"),
    };
    Ok(CudaStorage {
        slice,
        device: src.dev.clone(),
    })
}

/// `x · wᵀ` for x (rows × k, F16 or BF16, `x_l` its layout) and the GGML weight `w` (n × k):
/// w dequantized `slice_rows` rows at a time into one buffer, each slice multiplied by cuBLAS
/// straight into its columns of the output (rows × n, x's dtype; F32 accumulation). For
/// [`crate::gemm::qlinear_prefill`]: one scratch buffer and one output, no copy of the parts.
pub(crate) fn qlinear_prefill_gemm(
    x: &CudaStorage,
    x_l: &Layout,
    w: &candle_core::quantized::QTensor,
    slice_rows: usize,
) -> Result<CudaStorage> {
    let what = "qlinear_prefill";
    let src = dequant_source(w, what)?;
    let (rows, k) = x_l.shape().dims2()?;
    if k != src.k || slice_rows == 0 || rows == 0 {
        candle_core::bail!(
            "{what}: x {rows}x{k} against a {}x{} weight in slices of {slice_rows}",
            src.n,
            src.k
        );
    }
    let Some((o1, o2)) = x_l.contiguous_offsets() else {
        candle_core::bail!("{what}: x is not contiguous");
    };
    fn run<T: DequantOut>(
        v: &CudaSlice<T>,
        (o1, o2): (usize, usize),
        rows: usize,
        w: &candle_core::quantized::QTensor,
        src: &DequantSource,
        slice_rows: usize,
    ) -> Result<CudaSlice<T>>
    where
        candle_core::cuda_backend::cudarc::cublas::CudaBlas:
            candle_core::cuda_backend::cudarc::cublas::Gemm<T>,
    {
        use candle_core::cuda_backend::cudarc::cublas::{sys::cublasOperation_t as Op, Gemm};
        let (n, k) = (src.n, src.k);
        let x = v.slice(o1..o2);
        let stream = src.dev.cuda_stream();
        let blas = src.dev.cublas_handle();
        let slice_rows = slice_rows.min(n);
        // SAFETY: uninitialised; each slice's launch_dequant below writes the rows the GEMM
        // after it reads.
        let mut part = unsafe { src.dev.alloc::<T>(slice_rows * k) }?;
        // SAFETY: uninitialised; the GEMMs below write every element (their columns r0 .. r0 +
        // r cover 0 .. n, beta 0).
        let mut y = unsafe { src.dev.alloc::<T>(rows * n) }?;
        let (p, guard) = w.device_ptr_with_guard(&stream)?;
        let to = |v: usize| -> Result<i32> {
            i32::try_from(v)
                .map_err(|_| candle_core::Error::Msg(format!("qlinear_prefill: {v} too large")))
        };
        let mut r0 = 0;
        while r0 < n {
            let r = slice_rows.min(n - r0);
            launch_dequant(
                src,
                &stream,
                p as u64 + (r0 * src.row_bytes) as u64,
                r,
                &mut part.slice_mut(..),
            )?;
            // Column-major, as cuBLAS reads: the slice (r rows of k, row-major) is k × r, x is
            // k × rows, and y (rows × n, row-major) is n × rows with leading dimension n, so
            // yᵀ's rows r0 .. r0 + r are C = sliceᵀ · x, from element r0 on.
            let cfg = candle_core::cuda_backend::cudarc::cublas::GemmConfig {
                transa: Op::CUBLAS_OP_T,
                transb: Op::CUBLAS_OP_N,
                m: to(r)?,
                n: to(rows)?,
                k: to(k)?,
                alpha: T::ONE,
                lda: to(k)?,
                ldb: to(k)?,
                beta: T::ZERO,
                ldc: to(n)?,
            };
            let mut c = y.slice_mut(r0..);
            // SAFETY: A is `part`'s first r·k elements (written by the launch above, ordered
            // before on the same stream), B is x's rows·k, C is y from element r0: cuBLAS
            // writes (j, i) at r0 + j·n + i for i < r, j < rows, at most r0 + (rows − 1)·n +
            // r − 1 < rows·n, within y. All three are on the blas handle's stream (the
            // device's), which `device_ptr` orders.
            unsafe { blas.gemm(cfg, &part.slice(..r * k), &x, &mut c) }.w()?;
            r0 += r;
        }
        drop(guard);
        Ok(y)
    }
    use candle_core::cuda_backend::CudaStorageSlice as S;
    let slice = match &x.slice {
        S::F16(v) => S::F16(run(v, (o1, o2), rows, w, &src, slice_rows)?),
        S::BF16(v) => S::BF16(run(v, (o1, o2), rows, w, &src, slice_rows)?),
        _ => candle_core::bail!("{what}: x is {:?}, not F16 or BF16", x.dtype()),
    };
    Ok(CudaStorage {
        slice,
        device: src.dev.clone(),
    })
}

/// One expert of [`experts_mlp`]: its weights (gate and up `(inter, hidden)`, down
/// `(hidden, inter)`, of block types `qlinear_small_type` names) and its rows of x,
/// `first .. first + rows`.
pub(crate) struct ExpertGemm<'a> {
    pub weights: [&'a candle_core::quantized::QTensor; 3],
    pub first: usize,
    pub rows: usize,
}

/// Each expert's rows of x (`x_l` its layout: rows × hidden, F16 or BF16, contiguous) through
/// its SiLU-gated MLP, `down · (silu(gate · x) ⊙ (up · x))`, written over the same rows of
/// `out` (rows × hidden from element 0, x's dtype); the other rows are left as they are. The
/// weights are dequantized into one scratch buffer, `s_gu` rows of gate and of up at a time,
/// then `s_d` of down, expert after expert (the stream orders each GEMM's read before
/// the next dequantization's write); gate and up go through one strided-batched GEMM a slice,
/// down straight into `out`: six launches an expert of one slice, three allocations a call.
pub(crate) fn experts_mlp(
    x: &CudaStorage,
    x_l: &Layout,
    experts: &[ExpertGemm<'_>],
    out: &mut CudaStorage,
    (s_gu, s_d): (usize, usize),
) -> Result<()> {
    let what = "experts_mlp";
    let Some(e0) = experts.first() else {
        return Ok(());
    };
    let (inter, hidden) = e0.weights[0].shape().dims2()?;
    let (rows_x, k) = x_l.shape().dims2()?;
    let Some((o1, _)) = x_l.contiguous_offsets() else {
        candle_core::bail!("{what}: x is not contiguous");
    };
    if k != hidden {
        candle_core::bail!("{what}: x {rows_x}x{k} against experts of {hidden} columns");
    }
    for e in experts {
        let [g, u, d] = e.weights;
        let shapes = (g.shape().dims2()?, u.shape().dims2()?, d.shape().dims2()?);
        if shapes != ((inter, hidden), (inter, hidden), (hidden, inter))
            || e.first + e.rows > rows_x
        {
            candle_core::bail!(
                "{what}: an expert of shapes {shapes:?} and rows {}..{} against x {rows_x}x{k} \
                 and ({inter}, {hidden}) experts",
                e.first,
                e.first + e.rows
            );
        }
    }
    let max_rows = experts.iter().map(|e| e.rows).max().unwrap_or(0);
    if max_rows == 0 {
        return Ok(());
    }
    if s_gu == 0 || s_d == 0 {
        candle_core::bail!("{what}: slices of {s_gu} and {s_d} rows");
    }
    fn run<T: DequantOut>(
        x: &CudaSlice<T>,
        o1: usize,
        experts: &[ExpertGemm<'_>],
        out: &mut CudaSlice<T>,
        (hidden, inter, max_rows): (usize, usize, usize),
        (s_gu, s_d): (usize, usize),
        dev: &CudaDevice,
    ) -> Result<()>
    where
        candle_core::cuda_backend::cudarc::cublas::CudaBlas:
            candle_core::cuda_backend::cudarc::cublas::Gemm<T>,
    {
        use candle_core::cuda_backend::cudarc::cublas::{
            sys::cublasOperation_t as Op, Gemm, GemmConfig, StridedBatchedConfig,
        };
        let what = "experts_mlp";
        let end = experts.iter().map(|e| e.first + e.rows).max().unwrap_or(0);
        if out.len() < end * hidden {
            candle_core::bail!("{what}: out holds {} elements", out.len());
        }
        let to = |v: usize| -> Result<i32> {
            i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{what}: {v} too large")))
        };
        let stream = dev.cuda_stream();
        let blas = dev.cublas_handle();
        let silu = load_named(
            dev,
            crate::cuda::ACTIVATION,
            &format!("silu_mul_{}", T::NAME),
        )?;
        let (s_gu, s_d) = (s_gu.min(inter), s_d.min(hidden));
        // SAFETY: uninitialised; each slice's dequantizing launches write the weight
        // elements the GEMM after them reads.
        let mut part = unsafe { dev.alloc::<T>((2 * s_gu * hidden).max(s_d * inter)) }?;
        // SAFETY: uninitialised; the batched GEMMs write the gate and up outputs the SiLU
        // reads (every column of the expert's rows, slice by slice).
        let mut gu = unsafe { dev.alloc::<T>(2 * max_rows * inter) }?;
        // SAFETY: uninitialised; the SiLU writes the activations the down GEMMs read.
        let mut act = unsafe { dev.alloc::<T>(max_rows * inter) }?;
        // Rows r0 .. r0 + rows of w into the first rows·k elements of `into`.
        let dequant = |w: &candle_core::quantized::QTensor,
                       r0: usize,
                       rows: usize,
                       into: &mut CudaViewMut<'_, T>|
         -> Result<()> {
            let src = dequant_source(w, what)?;
            let (p, guard) = w.device_ptr_with_guard(&stream)?;
            launch_dequant(
                &src,
                &stream,
                p as u64 + (r0 * src.row_bytes) as u64,
                rows,
                into,
            )?;
            drop(guard);
            Ok(())
        };
        for e in experts.iter().filter(|e| e.rows > 0) {
            let [gate, up, down] = e.weights;
            let r = e.rows;
            let n = r * inter;
            let x_e = x.slice(o1 + e.first * hidden..o1 + (e.first + r) * hidden);
            let mut r0 = 0;
            while r0 < inter {
                let s = s_gu.min(inter - r0);
                let w_len = s * hidden;
                dequant(gate, r0, s, &mut part.slice_mut(..w_len))?;
                dequant(up, r0, s, &mut part.slice_mut(w_len..2 * w_len))?;
                // Column-major, as cuBLAS reads: batch i's A is weight i's slice (s rows of
                // hidden, row-major: hidden × s, transposed), B is x's rows (hidden × r), and
                // C (s × r, leading dimension inter) is the slice's columns of the rows'
                // outputs, row-major r × inter, gate's at gu[0 .. n] and up's at gu[n .. 2n].
                let cfg = StridedBatchedConfig {
                    gemm: GemmConfig {
                        transa: Op::CUBLAS_OP_T,
                        transb: Op::CUBLAS_OP_N,
                        m: to(s)?,
                        n: to(r)?,
                        k: to(hidden)?,
                        alpha: T::ONE,
                        lda: to(hidden)?,
                        ldb: to(hidden)?,
                        beta: T::ZERO,
                        ldc: to(inter)?,
                    },
                    batch_size: 2,
                    stride_a: w_len as i64,
                    stride_b: 0,
                    stride_c: n as i64,
                };
                let mut c = gu.slice_mut(r0..2 * n);
                // SAFETY: batch i reads A at part[i·w_len ..][.. w_len] (written by the two
                // launches above, earlier on the same stream), B at x_e (r·hidden elements,
                // B's stride 0: the same rows for both), and writes (j, col) at r0 + i·n +
                // j·inter + col for col < s, j < r, at most r0 + n + (r − 1)·inter + s − 1 <
                // 2n (r0 + s <= inter): within `c`. All on the blas handle's stream, the
                // device's.
                unsafe { blas.gemm_strided_batched(cfg, &part.slice(..2 * w_len), &x_e, &mut c) }
                    .w()?;
                r0 += s;
            }
            {
                let (g, u) = (gu.slice(..n), gu.slice(n..2 * n));
                let mut a = act.slice_mut(..n);
                let mut b = stream.launch_builder(&silu);
                b.arg(&g);
                b.arg(&u);
                b.arg(&mut a);
                b.arg(&n);
                // SAFETY: the arguments match `silu_mul_<dtype>(const T*, const T*, T*,
                // size_t)` in kernels/activation.cu; gate, up and out hold n elements each
                // and the grid-stride loop touches indices below n only.
                unsafe { b.launch(crate::cuda::grid_stride(n, 1 << 20)) }.w()?;
            }
            let mut h0 = 0;
            while h0 < hidden {
                let s = s_d.min(hidden - h0);
                dequant(down, h0, s, &mut part.slice_mut(..s * inter))?;
                // C = the slice (s rows of inter, row-major: inter × s, transposed) times the
                // activations (inter × r): s × r with leading dimension hidden, the slice's
                // columns of out's rows first .. first + r, row-major.
                let cfg = GemmConfig {
                    transa: Op::CUBLAS_OP_T,
                    transb: Op::CUBLAS_OP_N,
                    m: to(s)?,
                    n: to(r)?,
                    k: to(inter)?,
                    alpha: T::ONE,
                    lda: to(inter)?,
                    ldb: to(inter)?,
                    beta: T::ZERO,
                    ldc: to(hidden)?,
                };
                let mut c = out.slice_mut(e.first * hidden + h0..(e.first + r) * hidden);
                // SAFETY: A is part's first s·inter elements (down's slice, dequantized above
                // on the same stream, after the GEMMs before it read the part), B is the
                // SiLU's n elements of act, and C's (j, col) is at h0 + j·hidden + col for col
                // < s, j < r, below r·hidden from out's row `first`: within `c`.
                unsafe { blas.gemm(cfg, &part.slice(..s * inter), &act.slice(..n), &mut c) }.w()?;
                h0 += s;
            }
        }
        Ok(())
    }
    use candle_core::cuda_backend::CudaStorageSlice as S;
    let dev = x.device.clone();
    let dims = (hidden, inter, max_rows);
    match (&x.slice, &mut out.slice) {
        (S::F16(xv), S::F16(ov)) => run(xv, o1, experts, ov, dims, (s_gu, s_d), &dev),
        (S::BF16(xv), S::BF16(ov)) => run(xv, o1, experts, ov, dims, (s_gu, s_d), &dev),
        _ => candle_core::bail!(
            "{what}: x {:?} and out {:?}, not both F16 or both BF16",
            x.dtype(),
            out.dtype()
        ),
    }
}
