//! The launch glue every op family's CUDA launches share: the PTX modules (one per
//! `kernels/*.cu` file, compiled by build.rs and embedded here), kernel handles looked up once per
//! device and thread, contiguous and strided views of Candle's device buffers, the grids of the
//! elementwise and row kernels, and the completion counters some kernels count in.
//!
//! Each module is loaded once per device by `CudaDevice::get_or_load_custom_func` (Candle
//! caches it by name) the first time one of its kernels runs, and every kernel runs on the
//! device's own stream, ordered with every other Candle op.

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorage, DeviceId, WrapErr};
use candle_core::{CudaDevice, DType, Layout, Result, WithDType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// build.rs's constants: the PTX of each `kernels/*.cu` file, named after it.
mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// One PTX module: the name Candle caches it under (per device) and its text.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Module {
    /// The name of the module in Candle's cache.
    pub(crate) name: &'static str,
    /// Its PTX.
    pub(crate) ptx: &'static str,
}

/// The residual RMSNorm (`norm::rms_norm_residual`).
pub(crate) const NORM: Module = Module {
    name: "candle_offload_norm",
    ptx: ptx::NORM,
};
/// The training RMSNorm (`norm::rms_norm`).
pub(crate) const NORM_TRAIN: Module = Module {
    name: "candle_offload_norm_train",
    ptx: ptx::NORM_TRAIN,
};
/// RoPE (`rope`).
pub(crate) const ROPE: Module = Module {
    name: "candle_offload_rope",
    ptx: ptx::ROPE,
};
/// SiLU · mul and the training SwiGLU (`activation`).
pub(crate) const ACTIVATION: Module = Module {
    name: "candle_offload_activation",
    ptx: ptx::ACTIVATION,
};
/// Decode attention (`attention::decode_attention`).
pub(crate) const ATTENTION: Module = Module {
    name: "candle_offload_attention",
    ptx: ptx::ATTENTION,
};
/// Flash attention in F16 and BF16, and prompt attention (`attention`).
pub(crate) const FLASH: Module = Module {
    name: "candle_offload_flash",
    ptx: ptx::FLASH,
};
/// Flash attention in F32 (`attention::flash_attention`).
pub(crate) const FLASH_F32: Module = Module {
    name: "candle_offload_flash_f32",
    ptx: ptx::FLASH_F32,
};
/// The decode matmuls over dense weights and variants 1 and 2 over blocks of 32.
pub(crate) const LINEAR: Module = Module {
    name: "candle_offload_linear",
    ptx: ptx::LINEAR,
};
/// Variants 3 and 4 of the decode matmuls over blocks of 32 (8-bit x).
pub(crate) const LINEAR_Q8: Module = Module {
    name: "candle_offload_linear_q8",
    ptx: ptx::LINEAR_Q8,
};
/// The decode matmuls over Q4_K and Q6_K.
pub(crate) const LINEAR_K: Module = Module {
    name: "candle_offload_linear_k",
    ptx: ptx::LINEAR_K,
};
/// A mixture-of-experts layer's routing on the device (`linear::routed`).
pub(crate) const MOE: Module = Module {
    name: "candle_offload_moe",
    ptx: ptx::MOE,
};
/// The dequantizing kernels of the prompt GEMM (`gemm`).
pub(crate) const GEMM: Module = Module {
    name: "candle_offload_gemm",
    ptx: ptx::GEMM,
};
/// Softmax cross-entropy (`loss`).
pub(crate) const LOSS: Module = Module {
    name: "candle_offload_loss",
    ptx: ptx::LOSS,
};
/// The multi-tensor AdamW (`optimizer::FusedAdamW`).
pub(crate) const OPTIMIZER: Module = Module {
    name: "candle_offload_optimizer",
    ptx: ptx::OPTIMIZER,
};
/// The profiler marker (`profile_mark`).
pub(crate) const PROFILE: Module = Module {
    name: "candle_offload_profile",
    ptx: ptx::PROFILE,
};

/// Every module (the names each kernel resolves in: the tests check them).
#[cfg(test)]
pub(crate) const ALL: [Module; 15] = [
    NORM, NORM_TRAIN, ROPE, ACTIVATION, ATTENTION, FLASH, FLASH_F32, LINEAR, LINEAR_Q8, LINEAR_K,
    MOE, GEMM, LOSS, OPTIMIZER, PROFILE,
];

/// A tensor's storage guard as the CUDA storage a launcher takes, or an error naming `op`.
pub(crate) fn on_gpu<'a, G: std::ops::Deref<Target = candle_core::Storage>>(
    op: &str,
    (s, l): &'a (G, &'a Layout),
) -> Result<(&'a candle_core::CudaStorage, &'a Layout)> {
    match &**s {
        candle_core::Storage::Cuda(s) => Ok((s, *l)),
        _ => candle_core::bail!("{op}: every operand has to be on the GPU"),
    }
}

/// Threads per block of the elementwise kernels.
pub(crate) const ELEMWISE_BLOCK: u32 = 256;

/// A float element type the kernels exist for.
pub(crate) trait Elem: CudaDType + DeviceRepr + WithDType {}
impl Elem for f32 {}
impl Elem for half::f16 {}
impl Elem for half::bf16 {}

/// Runs `$f::<T>` for the storage's float dtype.
macro_rules! by_dtype {
    ($op:expr, $dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            candle_core::DType::F32 => $f::<f32>($($arg),*),
            candle_core::DType::F16 => $f::<half::f16>($($arg),*),
            candle_core::DType::BF16 => $f::<half::bf16>($($arg),*),
            other => candle_core::bail!("{}: no kernel for {other:?}", $op),
        }
    };
}
pub(crate) use by_dtype;

/// Kernel handles already looked up, per thread: (device, module, dtype) to the kernel's root
/// name to its handle.
type FuncKey = (DeviceId, &'static str, Option<DType>);

thread_local! {
    static FUNCS: RefCell<HashMap<FuncKey, HashMap<String, CudaFunction>>> =
        RefCell::new(HashMap::new());
}

/// The kernel `{root}_{dtype}` (or `root` where `dtype` is `None`) of `module` on `dev`. Candle's `get_or_load_custom_func` takes a lock, formats the name
/// into a C string and asks the driver (`cuModuleGetFunction`) on every call, about once per
/// launch; a decode step launches a hundred and more of ours, so each handle is kept here
/// after its first lookup (a clone is one reference count). Device ids are never reused, so
/// an entry cannot name another device's kernel.
pub(crate) fn cached_func(
    dev: &CudaDevice,
    module: Module,
    root: &str,
    dtype: Option<DType>,
) -> Result<CudaFunction> {
    let key = (dev.id(), module.name, dtype);
    let hit = FUNCS.with(|c| c.borrow().get(&key).and_then(|m| m.get(root)).cloned());
    if let Some(f) = hit {
        return Ok(f);
    }
    let name = match dtype {
        Some(d) => format!("{root}_{}", d.as_str()),
        None => root.to_string(),
    };
    let f = dev
        .get_or_load_custom_func(&name, module.name, module.ptx)?
        .into_cuda_function();
    FUNCS.with(|c| {
        c.borrow_mut()
            .entry(key)
            .or_default()
            .insert(root.to_string(), f.clone())
    });
    Ok(f)
}

/// The kernel `{name}_{dtype}` of `module` on `dev`, for F32, F16 or BF16.
pub(crate) fn load<T: WithDType>(
    dev: &CudaDevice,
    module: Module,
    name: &str,
) -> Result<CudaFunction> {
    if !matches!(T::DTYPE, DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("{name}: no kernel for {:?}", T::DTYPE);
    }
    cached_func(dev, module, name, Some(T::DTYPE))
}

/// The kernel `name` (no dtype suffix) of `module` on `dev`.
pub(crate) fn load_named(dev: &CudaDevice, module: Module, name: &str) -> Result<CudaFunction> {
    cached_func(dev, module, name, None)
}

/// The contiguous part of `s` that `l` covers.
pub(crate) fn view<'a, T>(s: &'a CudaSlice<T>, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.slice(a..b)),
        None => candle_core::bail!("{what} has to be contiguous"),
    }
}

/// The contiguous part of `s`'s buffer that `l` covers, as `T`.
pub(crate) fn storage_view<'a, T: Elem>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let slice = s.as_cuda_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(slice.slice(a..b)),
        None => candle_core::bail!("{what} has to be contiguous"),
    }
}

/// The contiguous part of a buffer of a fixed element type (targets, F32 gradients).
pub(crate) fn view_of<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let slice = s.as_cuda_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(slice.slice(a..b)),
        None => candle_core::bail!("{what} has to be contiguous"),
    }
}

/// A decode step's position read on the device (`rope_qk_cache_at`,
/// `decode_attention_at`): one u32 element of a contiguous u32 storage.
pub(crate) type PosOnDevice<'a> = Option<(&'a CudaStorage, &'a Layout)>;

/// `buf`'s `n` u32 elements (a device position: 1; padding counts: one per batch row) as a
/// view, checked; `what` names them in the error.
pub(crate) fn u32_view<'a>(
    buf: PosOnDevice<'a>,
    n: usize,
    what: &str,
) -> Result<Option<CudaView<'a, u32>>> {
    let Some((s, l)) = buf else {
        return Ok(None);
    };
    let v = view(s.as_cuda_slice::<u32>()?, l, what)?;
    if v.len() != n {
        candle_core::bail!("{} {what} on the device, not {n}", v.len());
    }
    Ok(Some(v))
}

pub(crate) fn to_u32(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{what} {v} exceeds u32")))
}

/// A grid-stride launch over `n` elements (n > 0), at most `max_blocks` blocks.
pub(crate) fn grid_stride(n: usize, max_blocks: u32) -> LaunchConfig {
    let blocks = n
        .div_ceil(ELEMWISE_BLOCK as usize)
        .clamp(1, max_blocks as usize) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ELEMWISE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row of `n_cols`: about four elements per thread, whole warps, 32 to 1024.
pub(crate) fn per_row(n_rows: u32, n_cols: usize) -> LaunchConfig {
    let block = (n_cols.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32;
    LaunchConfig {
        grid_dim: (n_rows, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `(rows, width)` of a buffer of `el` elements whose rows are `width` wide.
pub(crate) fn rows_of(el: usize, width: usize, op: &str) -> Result<(u32, u32)> {
    if width == 0 || el == 0 || !el.is_multiple_of(width) {
        candle_core::bail!("{op}: {el} elements are not rows of {width}");
    }
    Ok((to_u32(el / width, "rows")?, to_u32(width, "row width")?))
}

/// A kernel's optional buffer (an output, a device position) as its pointer argument: the
/// buffer, or null for none.
pub(crate) fn arg_or_null<'a, B>(
    b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
    buf: Option<&'a B>,
) where
    candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>:
        PushKernelArg<&'a B> + PushKernelArg<&'a u64>,
{
    /// The null device pointer.
    static NULL: u64 = 0;
    match buf {
        Some(buf) => PushKernelArg::<&'a B>::arg(b, buf),
        None => PushKernelArg::<&'a u64>::arg(b, &NULL),
    };
}

/// A strided (b, h, positions, d) view of `s` with the last dim contiguous: the slice from its
/// start offset and the batch, head and position strides, after checking that the first
/// `rows` positions of every (batch, head) lie inside `s`.
pub(crate) fn strided_kv<'a, T>(
    s: &'a CudaSlice<T>,
    l: &Layout,
    rows: usize,
    what: &str,
) -> Result<(CudaView<'a, T>, [u64; 3])> {
    let (b, h, _, d) = l.shape().dims4()?;
    let st = l.stride();
    if st[3] != 1 {
        candle_core::bail!("{what}: the last dim has to be contiguous");
    }
    let start = l.start_offset();
    // The end of the last row, for a view of at least one of each (checked first, as the
    // offset counts from 1 of each).
    let nonempty = b > 0 && h > 0 && rows > 0 && d > 0;
    let last = nonempty
        .then(|| start + (b - 1) * st[0] + (h - 1) * st[1] + (rows - 1) * st[2] + d)
        .filter(|&last| last <= s.len());
    let Some(last) = last else {
        candle_core::bail!(
            "{what}: view {:?} / {st:?} does not fit its buffer",
            l.shape()
        );
    };
    Ok((
        s.slice(start..last),
        [st[0], st[1], st[2]].map(|v| v as u64),
    ))
}

/// Counters made at least (enough for a decode step's rows of attention, 8 rows of 128 heads,
/// and for the columns of a 131072-wide matmul in groups of 32).
pub(crate) const COUNTERS_MIN: usize = 4096;

/// Makes this thread's completion counters on `dev` before a step is captured, so that the
/// captured kernels use counters allocated outside the graph.
pub(crate) fn prepare_capture(dev: &CudaDevice) -> Result<()> {
    zeroed_counters(dev, COUNTERS_MIN).map(drop)
}

thread_local! {
    /// Counters of finished work for kernels whose last block to finish a piece completes it
    /// (`decode_attention`'s ranges per row, `qlinear4_small`'s columns per group of 32), per
    /// device: zeros between launches (the block that completes a piece sets its counter back).
    /// (An `Rc`: a `CudaSlice`'s clone copies the memory.)
    static COUNTERS: RefCell<HashMap<DeviceId, Rc<CudaSlice<u32>>>> = RefCell::new(HashMap::new());
}

/// At least `rows` (and at least one) zeroed counters on `dev`, kept for later launches: each
/// kernel that counts in them (`decode_attention`'s rows, `qlinear4_small`'s groups of 32
/// columns) sets every counter it used back to 0 before it ends, so that launches in stream
/// order share them.
pub(crate) fn zeroed_counters(dev: &CudaDevice, rows: usize) -> Result<Rc<CudaSlice<u32>>> {
    let have = COUNTERS.with(|c| {
        c.borrow()
            .get(&dev.id())
            .filter(|s| s.len() >= rows.max(1))
            .cloned()
    });
    if let Some(s) = have {
        return Ok(s);
    }
    // Kept past the launch: an allocation inside a captured step would belong to the graph
    // (hazard H19), so a capture that needs more counters than were made before it fails.
    let capturing = dev
        .cuda_stream()
        .capture_status()
        .w()?
        != candle_core::cuda_backend::cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    if capturing {
        candle_core::bail!(
            "{rows} completion counters are needed inside a captured step, more than were made before it"
        );
    }
    let s = Rc::new(dev.alloc_zeros::<u32>(rows.max(COUNTERS_MIN))?);
    COUNTERS.with(|c| c.borrow_mut().insert(dev.id(), s.clone()));
    Ok(s)
}

/// The multiprocessors of the first device asked, read once (for grid heuristics only: any
/// count gives the same results).
pub(crate) fn multiprocessors(dev: &CudaDevice) -> usize {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    static SMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SMS.get_or_init(|| {
        dev.cuda_stream()
            .context()
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |v| v.max(1) as usize)
    })
}

/// Launches the empty `profile_mark(phase)` kernel on `dev`'s stream: a boundary a profiler's
/// kernel list shows in launch order.
pub(crate) fn profile_mark(dev: &CudaDevice, phase: u32) -> Result<()> {
    let func = cached_func(dev, PROFILE, "profile_mark", None)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&phase);
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the argument matches `profile_mark(uint32_t)` in kernels/profile.cu, which touches
    // no memory.
    unsafe { b.launch(one) }.w()?;
    Ok(())
}

/// The kernels (`.entry` names) of a PTX module.
#[cfg(test)]
pub(crate) fn entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry "))
        .filter_map(|l| l.split('(').next())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every module has kernels, under a name of its own in Candle's cache.
    #[test]
    fn modules_are_distinct_and_not_empty() {
        let mut names: Vec<_> = ALL.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        for m in ALL {
            assert!(!entries(m.ptx).is_empty(), "{}", m.name);
        }
    }

    /// The kernels the launchers outside `linear` load (by their root names, once per dtype
    /// where they take one) are in the module they load them from.
    #[test]
    fn every_launched_kernel_is_in_its_module() {
        const FLOATS: &[&str] = &["f32", "f16", "bf16"];
        const HALVES: &[&str] = &["f16", "bf16"];
        let launched: &[(Module, &str, &[&str])] = &[
            (NORM, "rms_norm_residual", FLOATS),
            (NORM, "rms_norm_residual_vec", FLOATS),
            (NORM_TRAIN, "rms_norm_fwd", FLOATS),
            (NORM_TRAIN, "rms_rstd", FLOATS),
            (NORM_TRAIN, "rms_norm_bwd_dx", FLOATS),
            (NORM_TRAIN, "rms_norm_bwd_dw", FLOATS),
            (ROPE, "rope_qk", FLOATS),
            (ACTIVATION, "silu_mul", FLOATS),
            (ACTIVATION, "swiglu_fwd", FLOATS),
            (ACTIVATION, "swiglu_bwd", FLOATS),
            (ATTENTION, "decode_attention", FLOATS),
            (FLASH, "flash_attn_fwd_d64", HALVES),
            (FLASH, "flash_attn_fwd_d128", HALVES),
            (FLASH, "flash_attn_fwd_wmma_d64", HALVES),
            (FLASH, "flash_attn_fwd_wmma_d128", HALVES),
            (FLASH, "prompt_attn_d64", HALVES),
            (FLASH, "prompt_attn_d128", HALVES),
            (FLASH, "flash_attn_bwd_d64", HALVES),
            (FLASH, "flash_attn_bwd_d128", HALVES),
            (FLASH, "flash_attn_bwd_prep", HALVES),
            (FLASH_F32, "flash_attn_fwd_d64", &["f32"]),
            (FLASH_F32, "flash_attn_fwd_d128", &["f32"]),
            (FLASH_F32, "flash_attn_bwd_d64", &["f32"]),
            (FLASH_F32, "flash_attn_bwd_d128", &["f32"]),
            (FLASH_F32, "flash_attn_bwd_prep", &["f32"]),
            (LINEAR_Q8, "qlinear4_quantize_x", FLOATS),
            (LOSS, "cross_entropy_fwd", FLOATS),
            (LOSS, "cross_entropy_bwd", FLOATS),
            (OPTIMIZER, "adamw_multi_f32", &[""]),
            (PROFILE, "profile_mark", &[""]),
        ];
        for (module, root, dtypes) in launched {
            let have = entries(module.ptx);
            for d in *dtypes {
                let name = if d.is_empty() {
                    root.to_string()
                } else {
                    format!("{root}_{d}")
                };
                assert!(have.contains(&name.as_str()), "{name} in {}", module.name);
            }
        }
        let dequant = entries(GEMM.ptx);
        for out in ["f16", "bf16"] {
            for q in ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"] {
                let name = format!("dequant_{out}_{q}");
                assert!(dequant.contains(&name.as_str()), "{name}");
            }
        }
    }
}
