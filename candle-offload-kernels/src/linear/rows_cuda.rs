//! The CUDA launches of [`qexperts_rows`](super::qexperts_rows): a table of the experts'
//! weight addresses and the rows' chunks, uploaded once, then `qlinear3_rows_experts_*` /
//! `qlinear3k_rows_experts_*` (kernels/linear_q8.cu, kernels/linear_k.cu) for every gate and
//! up, then for every down projection; with x quantized once (`x_once`), x's and then the
//! SwiGLU's rows quantized first, each read by `qlinear4_rows_experts_*` /
//! `qlinear4k_rows_experts_*`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice as S, WrapErr};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CudaDevice, Layout, Result, WithDType};

use super::blocks::{is_qlinear_k_type, qlinear_small_type};
use super::cuda::{
    qlinear2_small_stage_vecs, qlinear3_x_blocks, qlinear4_quantize_x, QLINEAR3_X_BLOCK_BYTES,
    QLINEAR_WARPS,
};
use crate::cuda::{load, to_u32, view, LINEAR_K, LINEAR_Q8};

/// Weight rows a warp reads together (the kernels' R).
const ROWS_PER_WARP: usize = 2;

/// x's rows (sorted by expert) through `experts`' MLPs (gate, up, down each), each `[expert,
/// first row, rows, 0]` of `chunks` (at most `chunk_rows` rows, the kernels' ROWS_CHUNK_MAX)
/// one block of threads' work, the output's rows no chunk holds left unwritten (with more
/// than one expert; one expert's rows are all its); `x_once`: each projection's input
/// quantized once for all rows, not by every block of threads.
pub(crate) fn qlinear_rows_experts(
    (x, xl): (&CudaStorage, &Layout),
    experts: &[[&QTensor; 3]],
    chunks: &[[u32; 4]],
    chunk_rows: usize,
    x_once: bool,
) -> Result<CudaStorage> {
    fn run<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        dev: &CudaDevice,
        (x, xl): (&CudaSlice<T>, &Layout),
        experts: &[[&QTensor; 3]],
        chunks: &[[u32; 4]],
        chunk_rows: usize,
        x_once: bool,
    ) -> Result<CudaSlice<T>> {
        let (rows, hidden) = xl.shape().dims2()?;
        let Some(&[gate, _, down]) = experts.first() else {
            candle_core::bail!("qexperts_rows: no experts")
        };
        let inter = gate.shape().dims2()?.0;
        let e = experts.len();
        let stream = dev.cuda_stream();
        // Every gate's address, every up's, every down's.
        let mut addrs: Vec<u64> = vec![0; 3 * e];
        let mut guards = Vec::with_capacity(3 * e);
        for (j, w) in experts.iter().enumerate() {
            for (i, q) in w.iter().enumerate() {
                let (at, g) = q.device_ptr_with_guard(&stream)?;
                if !(at as usize).is_multiple_of(16) {
                    candle_core::bail!("qexperts_rows: an expert's blocks are not 16-byte aligned");
                }
                guards.push(g);
                addrs[i * e + j] = at as u64;
            }
        }
        // One expert's weights go by value, its chunks follow from the rows: nothing to
        // upload (an upload from pageable memory waits for the stream, and a prompt's
        // streamed experts come one at a time). Several experts' addresses and chunks go in
        // one table.
        let table;
        let (gate_up, down_w) = if e == 1 {
            (
                Weights::One([addrs[0], addrs[1]], rows),
                Weights::One([addrs[2], addrs[2]], rows),
            )
        } else {
            let mut t = addrs;
            for c in chunks {
                t.push(u64::from(c[0]) | (u64::from(c[1]) << 32));
                t.push(u64::from(c[2]) | (u64::from(c[3]) << 32));
            }
            table = stream.clone_htod(&t).w()?;
            let at = table.device_ptr(&stream).0;
            let chunks_at = at + (3 * e * 8) as u64;
            let down_at = at + (2 * e * 8) as u64;
            (
                Weights::Table([at, at + (e * 8) as u64, chunks_at], chunks.len()),
                Weights::Table([down_at, down_at, chunks_at], chunks.len()),
            )
        };
        let x = view(x, xl, "x")?;
        // SAFETY: uninitialised device memory on the device's stream: `rows` rows of `inter`
        // columns, each row a chunk holds written by it in the SwiGLU launch (the grid covers
        // every column) before the down launch reads the same chunks' rows; then `rows` rows
        // of `hidden`, the chunks' rows written by the down launch. Rows no chunk holds (an
        // expert `qexperts_rows` takes through cuBLAS) are never read here; the caller writes
        // them in the output before it returns it.
        let act = unsafe { dev.alloc::<T>(rows * inter) }?;
        launch(
            dev,
            gate.dtype(),
            &Input::of(dev, &x, (rows, hidden), x_once)?,
            gate_up,
            &act,
            (inter, hidden, chunk_rows),
            true,
        )?;
        // SAFETY: as `act`'s.
        let out = unsafe { dev.alloc::<T>(rows * hidden) }?;
        let act_view = act.slice(..);
        launch(
            dev,
            down.dtype(),
            &Input::of(dev, &act_view, (rows, inter), x_once)?,
            down_w,
            &out,
            (hidden, inter, chunk_rows),
            false,
        )?;
        drop(guards);
        Ok(out)
    }
    let dev = &x.device;
    let slice = match &x.slice {
        S::F32(v) => S::F32(run(dev, (v, xl), experts, chunks, chunk_rows, x_once)?),
        S::F16(v) => S::F16(run(dev, (v, xl), experts, chunks, chunk_rows, x_once)?),
        S::BF16(v) => S::BF16(run(dev, (v, xl), experts, chunks, chunk_rows, x_once)?),
        _ => candle_core::bail!("qexperts_rows: unsupported dtype {:?}", x.dtype()),
    };
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// A launch's x: its rows as they are (variant 3's kernels quantize them in every block of
/// threads), or as `qlinear4_quantize_x` wrote its rows (variant 4's read them).
enum Input<'a, 'b, T> {
    Float(&'a CudaView<'b, T>),
    Quantized(CudaSlice<u8>, usize),
}

impl<'a, 'b, T: DeviceRepr + WithDType> Input<'a, 'b, T> {
    /// x's `(rows, k)` as they are, or (`once`) quantized for all rows in a launch now.
    fn of(
        dev: &CudaDevice,
        x: &'a CudaView<'b, T>,
        (rows, k): (usize, usize),
        once: bool,
    ) -> Result<Self> {
        Ok(if once {
            Self::Quantized(qlinear4_quantize_x(dev, x, rows, k)?, rows)
        } else {
            Self::Float(x)
        })
    }
}

/// Where a launch finds its weights and chunks.
#[derive(Clone, Copy)]
enum Weights {
    /// The device addresses of the tables of w0 and w1 (by expert) and of the chunks, and
    /// the chunks' count.
    Table([u64; 3], usize),
    /// One expert's w0 and w1, and its rows (chunks of `chunk_rows` from the first).
    One([u64; 2], usize),
}

/// One launch over every chunk: x's rows (k wide) against the weights `w` says (w1 with
/// `silu`), into y (n wide).
fn launch<T: DeviceRepr + WithDType>(
    dev: &CudaDevice,
    ty: GgmlDType,
    x: &Input<'_, '_, T>,
    w: Weights,
    y: &CudaSlice<T>,
    (n, k, chunk_rows): (usize, usize, usize),
    silu: bool,
) -> Result<()> {
    let Some(qname) = qlinear_small_type(ty) else {
        candle_core::bail!("qexperts_rows: no kernel for {ty:?} blocks")
    };
    let kquant = is_qlinear_k_type(ty);
    let stages = if kquant {
        0
    } else {
        QLINEAR_WARPS * 16 * qlinear2_small_stage_vecs(ty.type_size()) * ROWS_PER_WARP
    };
    let xblocks = qlinear3_x_blocks(chunk_rows, k / 32, stages);
    let (kind, count) = match w {
        Weights::Table(_, count) => ("experts", count),
        Weights::One(_, rows) => ("expert", rows.div_ceil(chunk_rows)),
    };
    // Variant 3 quantizes each chunk of x in shared memory beside the stages; variant 4 reads
    // x quantized.
    let (v, x_shared) = match x {
        Input::Float(_) => ("3", chunk_rows * xblocks * QLINEAR3_X_BLOCK_BYTES),
        Input::Quantized(..) => ("4", 0),
    };
    let (module, name) = if kquant {
        (LINEAR_K, format!("qlinear{v}k_rows_{kind}_{qname}"))
    } else {
        (LINEAR_Q8, format!("qlinear{v}_rows_{kind}_{qname}"))
    };
    let func = load::<T>(dev, module, &name)?;
    let cols_per_warp = if silu {
        ROWS_PER_WARP / 2
    } else {
        ROWS_PER_WARP
    };
    let cfg = LaunchConfig {
        grid_dim: (
            to_u32(n.div_ceil(QLINEAR_WARPS * cols_per_warp), "blocks")?,
            to_u32(count, "chunks")?,
            1,
        ),
        block_dim: (32 * QLINEAR_WARPS as u32, 1, 1),
        shared_mem_bytes: to_u32(stages + x_shared, "shared memory")?,
    };
    let stream = dev.cuda_stream();
    let (nn, kk, s, xb) = (
        to_u32(n, "columns")?,
        to_u32(k, "width")?,
        u32::from(silu),
        to_u32(xblocks, "blocks of x")?,
    );
    // The weights' (or their tables') addresses, the chunks' table, and one expert's rows.
    let (p0, p1, chunks, rows) = match w {
        Weights::Table(t, _) => (t[0], t[1], Some(t[2]), None),
        Weights::One(ws, rows) => (ws[0], ws[1], None, Some(to_u32(rows, "rows")?)),
    };
    let mut b = stream.launch_builder(&func);
    let all_rows;
    match x {
        Input::Float(x) => b.arg(*x),
        Input::Quantized(xq, total) => {
            b.arg(xq);
            if chunks.is_some() {
                all_rows = to_u32(*total, "rows")?;
                b.arg(&all_rows);
            }
            &mut b
        }
    };
    b.arg(&p0).arg(&p1);
    if let Some(c) = &chunks {
        b.arg(c);
    }
    b.arg(y);
    if let Some(r) = &rows {
        b.arg(r);
    }
    b.arg(&nn).arg(&kk).arg(&s);
    if matches!(x, Input::Float(_)) {
        b.arg(&xb);
    }
    // SAFETY: `qlinear3_rows_experts_<q>_<dtype>` (kernels/linear_q8.cu) and
    // `qlinear3k_rows_experts_<q>_<dtype>` (kernels/linear_k.cu) take (const T* x, const
    // uint64_t* w0, const uint64_t* w1, const RowChunk* chunks, T* y, uint32_t n0, k, silu,
    // xblocks) and run, for chunk blockIdx.y < count, variant 3's kernel of R = 2 and 8 rows
    // on rows c.row .. c.row + c.rows of x and y. `w0`, `w1` and `chunks` lie in the table
    // uploaded on this stream before (3 · experts addresses of live quantized storages of
    // type `ty`, their shapes checked by `qexperts_rows_fits` and 16-byte aligned; then
    // `count` chunks of 16 bytes, each an expert index below the table's and at most
    // `chunk_rows` (the kernels' 8) rows inside x, as `experts_rows::row_chunks` makes them).
    // `qlinear3_rows_expert_<q>_<dtype>` / `qlinear3k_rows_expert_<q>_<dtype>` take (const T*
    // x, const uint8_t* w0, const uint8_t* w1, T* y, uint32_t rows, n0, k, silu, xblocks):
    // one expert's weights (live, checked and aligned as above), chunk blockIdx.y the rows
    // 8 · blockIdx.y .. min(+8, rows), the grid's count = ⌈rows / 8⌉. Either way x holds the
    // rows (k elements each, 16-byte aligned: checked by the caller, or `act`'s rows of
    // `inter`, a multiple of 32) and y as many rows of n; the shared memory is the weight
    // stages and the chunk of x variant 3 takes for `chunk_rows` rows.
    // `qlinear4_rows_experts_<q>_<dtype>` / `qlinear4k_rows_experts_<q>_<dtype>` take (const
    // uint4* xq, uint32_t rows, then the table form's arguments without xblocks) and
    // `qlinear4_rows_expert_<q>_<dtype>` / `qlinear4k_rows_expert_<q>_<dtype>` (const uint4*
    // xq, then the one-expert form's arguments without xblocks): xq is the buffer
    // `qlinear4_quantize_x` wrote on this stream for all of x's `rows` rows of k (its
    // quants, then every row's scales and sums), so each chunk's rows lie inside it; their
    // shared memory is the weight stages alone.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
