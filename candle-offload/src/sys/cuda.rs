//! The CUDA side of the `sys` module: page-locked host buffers, a copy stream per GPU, the
//! staging ring for pageable weights, and the events that order copies against compute.
//!
//! Candle runs every kernel of a device on that device's one stream (compute, **C**). Weights
//! are allocated and copied on a second stream of the same context (copy, **X**). Candle's and
//! cudarc's own per-slice tracking does not cover every path (candle-internals.md §2.4), so
//! each unit carries explicit events:
//! - `ready`, recorded on X after the unit's last copy; C waits on it before the unit's first
//!   use (H1, H2: covers `to_dtype`, `index_select` ids, quantized fast paths);
//! - `last_use`, recorded on C when the caller releases the unit; X waits on it before the
//!   unit's memory is freed, which cudarc orders on X, the allocating stream (H4, H5).
//!
//! Host code never blocks on the GPU in steady state: both directions are stream waits. The
//! only host waits are in the staging ring (pageable weights, a slow path with a warning).

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc;
use candle_core::cuda_backend::cudarc::driver::result as cudarc_result;
use candle_core::cuda_backend::cudarc::driver::{
    sys as cusys, CudaContext, CudaEvent, CudaSlice, CudaStream, CudaViewMut, DeviceRepr,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::quantized::cuda::QCudaStorage;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Storage, Tensor};

use super::{
    ggml_buffer_len, untaken_spares, DeviceLayout, DeviceWeight, GpuFacts, HostTier,
    PageableBuffer, SpareUse, SysError, SysResult, TierKind, Timings, UntakenSpares, UploadItem,
    GGML_ROW_PADDING_ELEMS,
};

// The padding the budget counts for GGML tensors is the padding Candle allocates.
const _: () = assert!(GGML_ROW_PADDING_ELEMS == candle_core::quantized::cuda::MATRIX_ROW_PADDING);

/// Size of one staging buffer.
const STAGING_CHUNK: usize = 8 << 20;
/// Number of staging buffers in the ring.
const STAGING_BUFFERS: usize = 3;

/// Page-locked, portable (usable from every GPU's context), not write-combined host memory.
#[derive(Debug)]
pub(crate) struct PinnedBuffer {
    slice: candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<u8>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned by this struct alone (like a `Vec<u8>`); the raw pointer is only
// turned into slices through `&self` (shared, read-only) or `&mut self` (exclusive), so the
// usual borrow rules make cross-thread use as safe as for a `Vec<u8>`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: see `Send` above; `&PinnedBuffer` only ever gives out `&[u8]`.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    fn alloc(ctx: &Arc<CudaContext>, len: usize) -> std::result::Result<Self, String> {
        let n = len.max(1);
        // SAFETY: `alloc_pinned_with_flags` returns uninitialised memory; it is zeroed below
        // before any slice of it is formed. PORTABLE (no WRITECOMBINED) keeps CPU reads fast.
        let mut slice =
            unsafe { ctx.alloc_pinned_with_flags::<u8>(n, cusys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(|e| e.to_string())?;
        // The slice's internal event is never recorded (copies use `&[u8]` views, not the
        // `PinnedHostSlice` itself), so this does not wait on anything.
        let ptr = slice.as_mut_ptr().map_err(|e| e.to_string())?;
        // SAFETY: `ptr` points to `n` writable bytes owned by `slice`.
        unsafe { std::ptr::write_bytes(ptr, 0, n) };
        Ok(Self { slice, ptr, len })
    }

    fn as_bytes(&self) -> &[u8] {
        let _owner = &self.slice;
        // SAFETY: `ptr` is valid for `len <= n` initialised bytes for as long as `self.slice`
        // lives; the GPU only reads this memory (host-to-device DMA), never writes it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`; `&mut self` makes the access exclusive on the host. The
        // store writes only while it is being built, before any copy from it is enqueued, and
        // the staging ring waits for a buffer's last copy before writing it again.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl HostTier for PinnedBuffer {
    fn kind(&self) -> TierKind {
        TierKind::Pinned
    }
    fn len(&self) -> usize {
        self.len
    }
    fn bytes(&self) -> Option<&[u8]> {
        Some(self.as_bytes())
    }
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(self.as_bytes_mut())
    }
}

/// Allocates the store's host buffers: pinned on a GPU up to the cap, pageable past it; or
/// every unit in managed memory (the managed engine).
#[derive(Debug)]
pub(crate) struct Pinner {
    ctx: Option<Arc<CudaContext>>,
    managed: Option<CudaDevice>,
    cap: Option<u64>,
    used: u64,
    warned: bool,
}

impl Pinner {
    pub(crate) fn for_device(device: &Device, cap: Option<u64>, managed: bool) -> SysResult<Self> {
        let ctx = match device {
            Device::Cuda(d) => Some(d.cuda_stream().context().clone()),
            _ => None,
        };
        let managed = match (managed, device) {
            (false, _) => None,
            (true, Device::Cuda(d)) => {
                if let Some(why) = super::managed::unsupported(device)? {
                    return Err(SysError::Unsupported {
                        field: "engine",
                        reason: format!("managed memory unsupported: {why}"),
                    });
                }
                Some(d.clone())
            }
            (true, other) => {
                return Err(SysError::Unsupported {
                    field: "engine",
                    reason: format!(
                        "the managed engine needs a CUDA GPU, not {}",
                        if other.is_cpu() {
                            "the CPU"
                        } else {
                            "this device"
                        }
                    ),
                })
            }
        };
        Ok(Self {
            ctx,
            managed,
            cap,
            used: 0,
            warned: false,
        })
    }

    pub(crate) fn alloc(&mut self, len: usize, unit: &str) -> SysResult<Box<dyn HostTier>> {
        if let Some(cuda) = &self.managed {
            // A failed allocation (out of memory) is a driver error naming the unit, not a
            // setting.
            return Ok(Box::new(super::ManagedBuffer::alloc(cuda, len).map_err(
                |e| SysError::Candle(candle_core::Error::Msg(format!("unit {unit}: {e}"))),
            )?));
        }
        let Some(ctx) = &self.ctx else {
            return Ok(Box::new(PageableBuffer::zeroed(len)));
        };
        if self.cap.is_some_and(|cap| self.used + len as u64 > cap) {
            if !self.warned {
                tracing::warn!(
                    unit,
                    cap = self.cap,
                    "pinned-memory cap reached; the rest stays pageable"
                );
                self.warned = true;
            }
            return Ok(Box::new(PageableBuffer::zeroed(len)));
        }
        match PinnedBuffer::alloc(ctx, len) {
            Ok(p) => {
                self.used += len as u64;
                Ok(Box::new(p))
            }
            Err(e) => {
                if !self.warned {
                    tracing::warn!(unit, error = %e, "cannot pin host memory (check `ulimit -l`); using pageable memory");
                    self.warned = true;
                }
                Ok(Box::new(PageableBuffer::zeroed(len)))
            }
        }
    }
}

/// The events of one unit on the device.
#[derive(Debug)]
pub(crate) struct UnitSync {
    copy_start: CudaEvent,
    ready: CudaEvent,
    copy_pending: bool,
    stall_probes: Vec<(CudaEvent, CudaEvent)>,
    last_use: Option<LastUse>,
    /// A managed unit's pages, migrated back to the host on eviction.
    managed: Option<super::managed::ManagedPages>,
}

impl UnitSync {
    pub(crate) fn is_settled(&self) -> bool {
        !self.copy_pending && self.stall_probes.is_empty()
    }

    /// The unit's last use is `at` (an event recorded on the compute stream after it).
    fn set_last_use(&mut self, at: LastUse) {
        self.last_use = Some(at);
    }
}

/// An event recorded on the compute stream after a unit's last use, shared by the units
/// released together ([`CudaEngine::last_use_event`]).
#[derive(Debug, Clone)]
pub(crate) struct LastUse(Arc<CudaEvent>);

#[derive(Debug)]
struct StagingBuffer {
    buf: PinnedBuffer,
    done: Option<CudaEvent>,
}

/// One GPU's copy machinery.
#[derive(Debug)]
pub(crate) struct CudaEngine {
    cuda: CudaDevice,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    staging: Mutex<(Vec<StagingBuffer>, usize)>,
    /// The device's weight pool and its default pool ([`weight_pool`]), where weights get one.
    pools: Option<(Pool, Pool)>,
}

/// A memory pool handle of the driver.
#[derive(Clone, Copy, Debug)]
struct Pool(cusys::CUmemoryPool);

// SAFETY: a pool handle is an opaque driver object; the driver's pool calls are thread-safe,
// and the handles used here live for the whole process (never destroyed).
unsafe impl Send for Pool {}
// SAFETY: as for `Send`: the handle is only passed to the driver, never dereferenced here.
unsafe impl Sync for Pool {}

/// `alloc()` with `pools.0` as the current pool of `ctx`'s device, `pools.1` (its default
/// pool) current again after; just `alloc()` without pools.
fn with_current_pool<R>(
    ctx: &Arc<CudaContext>,
    pools: Option<(Pool, Pool)>,
    alloc: impl FnOnce() -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    use candle_core::cuda_backend::cudarc::driver::result;
    let Some((weights, default)) = pools else {
        return alloc();
    };
    ctx.bind_to_thread().w()?;
    let dev = ctx.cu_device();
    // SAFETY: `dev` is this live context's device and `weights` a live pool made for it
    // (`weight_pool`, never destroyed).
    unsafe { result::device::set_mem_pool(dev, weights.0) }.w()?;
    let out = alloc();
    // SAFETY: as above, with the device's own default pool.
    unsafe { result::device::set_mem_pool(dev, default.0) }.w()?;
    out
}

/// `alloc()` with `device`'s pool for long-lived buffers current ([`weight_pool`]: weights,
/// and what lives as long as they do, such as a model's KV cache), as the runtime allocates
/// weights; just `alloc()` where there is no such pool.
pub(crate) fn long_lived<R>(
    device: &Device,
    alloc: impl FnOnce() -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
    with_current_pool(&ctx, pools_of(&ctx, false)?, alloc)
}

/// `ctx`'s device's weight pool and its default pool, where weights get a pool of their own
/// (made here with `create`, else only where a runtime made it already).
fn pools_of(ctx: &Arc<CudaContext>, create: bool) -> SysResult<Option<(Pool, Pool)>> {
    Ok(match weight_pool(ctx, create)? {
        Some(weights) => Some((weights, Pool(default_pool(ctx)?))),
        None => None,
    })
}

/// Whether `device` can have a pool for long-lived buffers ([`weight_pool`]): it has
/// stream-ordered memory pools.
pub(crate) fn has_long_lived_pool(device: &Device) -> candle_core::Result<bool> {
    let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
    Ok(ctx.has_async_alloc())
}

/// The memory pool the runtime allocates weights from on `ctx`'s device, made by the first
/// runtime asking for it (`create`) and kept for the process (one per device), with the default
/// pool's keep-freed-memory setting; `None` where none was made (or is to be) or the device has
/// no stream-ordered pools.
///
/// Weights apart from activations: in one pool, a weight allocated into a block an
/// activation freed pins that block's chunk of physical memory after the activations around
/// it are gone, so that trimming the pool when a prompt ends cannot give it back
/// (docs/tuning.md). Each pool only ever holds its own kind.
fn weight_pool(ctx: &Arc<CudaContext>, create: bool) -> SysResult<Option<Pool>> {
    use candle_core::cuda_backend::cudarc::driver::result;
    static POOLS: Mutex<Vec<(usize, Pool)>> = Mutex::new(Vec::new());
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    let ordinal = ctx.ordinal();
    let mut pools = POOLS
        .lock()
        .map_err(|_| SysError::Candle(candle_core::Error::Msg("weight pools poisoned".into())))?;
    if let Some((_, pool)) = pools.iter().find(|(o, _)| *o == ordinal) {
        return Ok(Some(*pool));
    }
    if !create {
        return Ok(None);
    }
    ctx.bind_to_thread()
        .map_err(|e| SysError::Candle(candle_core::Error::wrap(e)))?;
    // SAFETY: an all-zero `CUmemPoolProps` is the driver's documented default (no handle
    // types, no maximum size, reserved bytes zero); the fields set below make it a pool of
    // pinned device memory on this device. The location's id is the `c_int` right after its
    // type in every CUDA version's layout (a plain field, or the first of a union), written
    // through a pointer to that place.
    let pool = unsafe {
        let mut props: cusys::CUmemPoolProps = std::mem::zeroed();
        props.allocType = cusys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = cusys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let id = (&mut props.location as *mut cusys::CUmemLocation)
            .cast::<std::ffi::c_int>()
            .add(1);
        id.write(ordinal as std::ffi::c_int);
        result::mem_pool::create(&props)
    }
    .map_err(|e| SysError::Candle(candle_core::Error::wrap(e)))?;
    set_release_threshold(pool, u64::MAX)?;
    pools.push((ordinal, Pool(pool)));
    Ok(Some(Pool(pool)))
}

fn timing_event(stream: &CudaStream) -> candle_core::Result<CudaEvent> {
    stream
        .record_event(Some(cusys::CUevent_flags::CU_EVENT_DEFAULT))
        .w()
}

impl CudaEngine {
    /// The engine of `device`; `weight_pool`: weights in a memory pool of their own
    /// ([`weight_pool`]).
    pub(crate) fn new(device: &Device, event_tracking: bool, weight_pool: bool) -> SysResult<Self> {
        let cuda = device.as_cuda_device()?.clone();
        let compute = cuda.cuda_stream();
        let ctx = compute.context().clone();
        if !event_tracking && ctx.is_event_tracking() {
            tracing::debug!("cudarc event tracking off for this device's context");
            // SAFETY: cudarc's conditions, each met by the runtime's own ordering: no buffer is
            // freed before another stream's use of it finishes (weights are freed on the copy
            // stream after it waits on `last_use`; quantized buffers, freed on the compute
            // stream, only after compute waited on `ready` in `evict`); no buffer is used on a
            // stream before its allocation on another finishes (compute waits on `ready` before
            // a unit's first use; the copy stream waits on `allocated` in `upload_blocks`); no
            // buffer is written by two streams (the copy stream writes only weights, and only
            // before `ready`). Activations, caches and Candle's workspaces live on the compute
            // stream alone. Multi-GPU pipelines keep tracking (their device-to-device copies
            // rely on it), and so does any context where this is not called.
            unsafe { ctx.disable_event_tracking() };
        }
        if !ctx.has_async_alloc() {
            tracing::warn!(
                "this GPU has no stream-ordered memory pools: every eviction synchronises"
            );
        }
        // Keep freed blocks in the stream-ordered pool across synchronisations: otherwise every
        // token returns evicted weights' memory to the driver and maps it again (slow). The
        // budget, not the pool, bounds what weights take; `trim_memory_pool` gives it back.
        if ctx.has_async_alloc() {
            set_pool_release_threshold(&ctx, u64::MAX)?;
        }
        // A stream of the *same* context object switches cudarc into multi-stream mode.
        let copy = ctx
            .new_stream()
            .map_err(|e| SysError::Candle(candle_core::Error::wrap(e)))?;
        let pools = if weight_pool {
            pools_of(&ctx, true)?
        } else {
            None
        };
        Ok(Self {
            cuda,
            ctx,
            compute,
            copy,
            staging: Mutex::new((Vec::new(), 0)),
            pools,
        })
    }

    /// `alloc()` with the device's weight pool as its current memory pool, so that the
    /// stream-ordered allocations in it (Candle's and cudarc's, which take the current pool)
    /// come from there; the default pool is current again after it. An allocation another
    /// thread makes on this device meanwhile lands in the weight pool too, which changes
    /// where it lies, not what it does: every block is freed to the pool it came from.
    fn in_weight_pool<R>(
        &self,
        alloc: impl FnOnce() -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        with_current_pool(&self.ctx, self.pools, alloc)
    }

    /// Allocates and copies a unit's tensors on the copy stream, reading them out of `src`
    /// (straight from page-locked memory, through the staging ring from any other tier), and
    /// records the unit's events. GGML blocks go into a buffer taken from `spare` where one of
    /// the same type, shape and size is there (evicted units' buffers, see
    /// [`upload_blocks`](Self::upload_blocks)). The rest of `spare` is freed when anything here
    /// allocates, and kept for the next fetch when every tensor took a spare (holding them then
    /// takes no more room than the evicted units held). The third value counts the buffers
    /// taken, and says whether the freed ones left room behind.
    pub(crate) fn upload(
        &self,
        unit: &str,
        src: &dyn HostTier,
        items: &[UploadItem<'_>],
        trainable: bool,
        spare: &mut Vec<QTensor>,
    ) -> candle_core::Result<(Vec<DeviceWeight>, UnitSync, SpareUse)> {
        let bytes: usize = items.iter().map(|i| i.range.len()).sum();
        let _span = tracing::debug_span!("offload.h2d", unit, bytes).entered();
        let copy_start = timing_event(&self.copy)?;
        let mut out = Vec::with_capacity(items.len());
        let managed = src.managed();
        // The spare buffer each item's blocks take, if one matches; the others are freed now
        // (on the compute stream, after their units' copies: `evict`) when anything here
        // allocates: held, they would sit in room the budget gives to those allocations. When
        // nothing does (experts of one shape replacing each other), they stay for the next
        // fetch, which would otherwise find none and trim the pool first.
        let mut taken: Vec<Option<QTensor>> = items
            .iter()
            .map(|item| match &item.layout {
                DeviceLayout::Blocks { ggml, device_len } => spare
                    .iter()
                    .position(|q| takes_spare(q, item, *ggml, *device_len))
                    .map(|k| spare.swap_remove(k)),
                DeviceLayout::Dense(_) => None,
            })
            .collect();
        let untaken: Vec<usize> = spare
            .iter()
            .map(|q| ggml_buffer_len(q.dtype(), q.storage_size_in_bytes()))
            .collect();
        let allocated: Vec<usize> = items
            .iter()
            .zip(&taken)
            .filter_map(|(item, t)| match (&item.layout, t) {
                (DeviceLayout::Blocks { ggml, device_len }, None) => {
                    let (alloc_blocks, padding_blocks) = block_buffer(*ggml, *device_len);
                    Some((alloc_blocks + padding_blocks) * ggml.type_size())
                }
                _ => None,
            })
            .collect();
        // Dense tensors and blocks that took no spare allocate.
        let allocates = taken.iter().any(Option::is_none);
        let stranded = match untaken_spares(&untaken, &allocated, allocates) {
            UntakenSpares::Keep => false,
            UntakenSpares::Free { stranded } => {
                spare.clear();
                stranded
            }
        };
        let mut reused = 0;
        for (item, buffer) in items.iter().zip(&mut taken) {
            let range = item.range.clone();
            let weight = match (&item.layout, managed) {
                (DeviceLayout::Dense(dtype), Some(m)) => {
                    // Managed memory: migrate the pages, no copy; the tensor points into them.
                    m.prefetch_to_device(range.clone(), &self.copy)?;
                    DeviceWeight::Dense(m.tensor(range, *dtype, item.shape, trainable)?)
                }
                (DeviceLayout::Dense(dtype), None) => {
                    let storage = match dtype {
                        DType::F16 => self.upload_typed::<half::f16>(src, range)?,
                        DType::BF16 => self.upload_typed::<half::bf16>(src, range)?,
                        DType::F32 => self.upload_typed::<f32>(src, range)?,
                        DType::F64 => self.upload_typed::<f64>(src, range)?,
                        DType::U8 => self.upload_typed::<u8>(src, range)?,
                        DType::U32 => self.upload_typed::<u32>(src, range)?,
                        DType::I64 => self.upload_typed::<i64>(src, range)?,
                        other => candle_core::bail!(
                            "tensor {}: dtype {other:?} cannot be offloaded",
                            item.name
                        ),
                    };
                    DeviceWeight::Dense(Tensor::from_storage(
                        Storage::Cuda(storage),
                        item.shape.clone(),
                        BackpropOp::none(),
                        trainable,
                    ))
                }
                // Candle's quantized storage cannot point into memory it did not allocate, so
                // blocks are copied even from managed memory (through the staging ring).
                (DeviceLayout::Blocks { ggml, device_len }, _) => {
                    let recycled = buffer.take();
                    reused += u64::from(recycled.is_some());
                    let q = self.upload_blocks(src, item, *ggml, *device_len, recycled)?;
                    DeviceWeight::Blocks(Box::new(q))
                }
            };
            out.push(weight);
        }
        let ready = timing_event(&self.copy)?;
        Ok((
            out,
            UnitSync {
                copy_start,
                ready,
                copy_pending: true,
                stall_probes: Vec::new(),
                last_use: None,
                managed: managed.map(|m| m.pages()),
            },
            SpareUse {
                taken: reused,
                stranded,
            },
        ))
    }

    fn upload_typed<T>(
        &self,
        src: &dyn HostTier,
        range: std::ops::Range<usize>,
    ) -> candle_core::Result<candle_core::CudaStorage>
    where
        T: DeviceRepr + CudaDType + bytemuck::Pod,
    {
        let size = std::mem::size_of::<T>();
        let n = range.len() / size;
        // SAFETY: the memory is uninitialised; the copies below, enqueued on the same stream,
        // overwrite all `n` elements before anything that waits on `ready` can read them.
        let mut dst: CudaSlice<T> =
            self.in_weight_pool(|| unsafe { self.copy.alloc::<T>(n.max(1)) }.w())?;
        if n > 0 {
            self.copy_into(src, range, &mut dst.slice_mut(..n))?;
        }
        Ok(T::wrap_cuda_slice(dst, self.cuda.clone()))
    }

    /// A tensor's GGML blocks as a Candle `QTensor` in device memory, copied on the copy
    /// stream: into `spare` where given (an evicted unit's, matched by [`takes_spare`]),
    /// otherwise into a new buffer.
    ///
    /// Candle 0.11.1 cannot wrap a device buffer it did not allocate (`QCudaStorage`'s fields
    /// are private). A new buffer is Candle's (`QCudaStorage::zeros`: stream-ordered on the
    /// compute stream, from the memory pool, with the zeroed row padding its kernels read), and
    /// the blocks are written through its device pointer.
    ///
    /// A spare's buffer is exactly what `zeros` would allocate, and its bytes past the blocks
    /// are still the zeros `zeros` wrote (every write covers the same `len` bytes). No
    /// allocation and no free, so a streamed unit takes over its victim's memory without the
    /// pool seeing a freed block that an activation could split (hazard H12). The victim's
    /// last use was waited for on the copy stream when it was evicted (`evict`), before these
    /// copies.
    fn upload_blocks(
        &self,
        src: &dyn HostTier,
        item: &UploadItem<'_>,
        ggml: GgmlDType,
        device_len: usize,
        spare: Option<QTensor>,
    ) -> candle_core::Result<QTensor> {
        let len = item.range.len();
        let elems = item.shape.elem_count();
        // The buffer is `device_len` bytes: the tensor's blocks, possibly whole blocks more (the
        // store evens out layers of mixed block types), then Candle's row padding.
        let (alloc_blocks, padding_blocks) = block_buffer(ggml, device_len);
        let q = match spare {
            Some(q) => q,
            None => {
                let storage = self.in_weight_pool(|| {
                    QCudaStorage::zeros(&self.cuda, alloc_blocks * ggml.block_size(), ggml)
                })?;
                // Candle allocated and zeroed the buffer on the compute stream; the copy stream
                // writes it only after that (explicitly, for contexts without cudarc's event
                // tracking).
                let allocated = self.compute.record_event(None).w()?;
                self.copy.wait(&allocated).w()?;
                QTensor::new(QStorage::Cuda(storage), item.shape.clone())?
            }
        };
        if q.storage_size_in_bytes() < len
            || len != elems / ggml.block_size() * ggml.type_size()
            || (alloc_blocks + padding_blocks) * ggml.type_size() != device_len
        {
            candle_core::bail!(
                "tensor {}: {len} bytes of {ggml:?} blocks do not fill {elems} elements \
                 ({} bytes on the device, {device_len} budgeted)",
                item.name,
                q.storage_size_in_bytes()
            );
        }
        self.write_blocks(src, item, &q, len)?;
        Ok(q)
    }

    /// Copies `item`'s `len` bytes of blocks into the start of `q`'s buffer on the copy stream.
    fn write_blocks(
        &self,
        src: &dyn HostTier,
        item: &UploadItem<'_>,
        q: &QTensor,
        len: usize,
    ) -> candle_core::Result<()> {
        if len == 0 {
            return Ok(());
        }
        // With cudarc's event tracking, the guard makes the copy stream wait for the buffer's
        // last write and reads (the allocation's memset, or an evicted unit's matmuls); on drop
        // it records the copy as a write, which later reads and the free wait for.
        let (ptr, _guard) = q.device_ptr_with_guard(&self.copy)?;
        let base = ptr as cusys::CUdeviceptr;
        self.copy_chunks(src, item.range.clone(), |bytes, offset| {
            debug_assert!(offset + bytes.len() <= len);
            // SAFETY: `base..base + len` is the blocks' part of `q`'s buffer (its callers check
            // `storage_size_in_bytes() >= len`), alive until `q` is dropped, after the guard.
            // Nothing reads it before the unit's `ready` event, recorded after these copies;
            // a reused buffer's earlier readers finished before its eviction's wait on the copy
            // stream. `bytes` is host memory that stays valid until the copy completes:
            // page-locked store memory, or a staging buffer that is not reused before its `done`
            // event (see `copy_chunks`).
            unsafe {
                cudarc_result::memcpy_htod_async(
                    base + offset as cusys::CUdeviceptr,
                    bytes,
                    self.copy.cu_stream(),
                )
            }
            .w()
        })
    }

    /// Copies `range` of `src` into `dst` on the copy stream.
    fn copy_into<T: DeviceRepr + bytemuck::Pod>(
        &self,
        src: &dyn HostTier,
        range: std::ops::Range<usize>,
        dst: &mut CudaViewMut<'_, T>,
    ) -> candle_core::Result<()> {
        let size = std::mem::size_of::<T>();
        self.copy_chunks(src, range, |bytes, offset| {
            let typed: &[T] = bytemuck::try_cast_slice(bytes)
                .map_err(|e| candle_core::Error::Msg(format!("{e}")))?;
            let mut view = dst.slice_mut(offset / size..(offset + bytes.len()) / size);
            self.copy.memcpy_htod(typed, &mut view).w()
        })
    }

    /// Hands `put` the bytes of `range` of `src` with their offset in `range`, for it to enqueue
    /// their copy on the copy stream: the page-locked bytes at once (one DMA), or for every
    /// other tier chunk by chunk through the ring of pinned staging buffers.
    fn copy_chunks(
        &self,
        src: &dyn HostTier,
        range: std::ops::Range<usize>,
        mut put: impl FnMut(&[u8], usize) -> candle_core::Result<()>,
    ) -> candle_core::Result<()> {
        if let (Some(bytes), true) = (src.bytes(), src.dma_ready()) {
            let bytes = bytes.get(range.clone()).ok_or_else(|| {
                candle_core::Error::Msg(format!("range {range:?} is past the host buffer"))
            })?;
            return put(bytes, 0);
        }
        let mut guard = self
            .staging
            .lock()
            .map_err(|_| candle_core::Error::Msg("staging ring poisoned".into()))?;
        let (ring, next) = &mut *guard;
        if ring.is_empty() {
            for _ in 0..STAGING_BUFFERS {
                let buf = PinnedBuffer::alloc(&self.ctx, STAGING_CHUNK).map_err(|e| {
                    candle_core::Error::Msg(format!("cannot allocate the pinned staging ring: {e}"))
                })?;
                ring.push(StagingBuffer { buf, done: None });
            }
        }
        // Whole elements of any dtype per chunk (sizes divide 8 MiB).
        let total = range.len();
        for start in (0..total).step_by(STAGING_CHUNK) {
            let len = STAGING_CHUNK.min(total - start);
            let slot = &mut ring[*next];
            *next = (*next + 1) % STAGING_BUFFERS;
            if let Some(done) = slot.done.take() {
                done.synchronize().w()?; // the host waits for the buffer's previous DMA
            }
            let from = range.start + start;
            src.read_into(from..from + len, &mut slot.buf.as_bytes_mut()[..len])?;
            put(&slot.buf.as_bytes()[..len], start)?;
            slot.done = Some(self.copy.record_event(None).w()?);
        }
        Ok(())
    }

    pub(crate) fn wait_ready(&self, sync: &mut UnitSync) -> candle_core::Result<()> {
        if sync.ready.try_is_complete().w()? {
            return Ok(());
        }
        let before = timing_event(&self.compute)?;
        self.compute.wait(&sync.ready).w()?;
        let after = timing_event(&self.compute)?;
        sync.stall_probes.push((before, after));
        Ok(())
    }

    /// Whether the unit's copies are done (never waits).
    pub(crate) fn is_ready(&self, sync: &UnitSync) -> candle_core::Result<bool> {
        sync.ready.try_is_complete().w()
    }

    pub(crate) fn record_last_use(&self, sync: &mut UnitSync) -> candle_core::Result<()> {
        sync.set_last_use(self.last_use_event()?);
        Ok(())
    }

    /// An event recorded now on the compute stream: the last use of every unit whose work is
    /// enqueued before it.
    fn last_use_event(&self) -> candle_core::Result<LastUse> {
        Ok(LastUse(Arc::new(self.compute.record_event(None).w()?)))
    }

    /// Records `sync`'s unit's last use as `shared`, the event recorded now on the compute
    /// stream where `shared` holds none yet: units released together share one event.
    pub(crate) fn share_last_use(
        &self,
        shared: &mut Option<LastUse>,
        sync: &mut UnitSync,
    ) -> candle_core::Result<()> {
        let at = match shared {
            Some(at) => at.clone(),
            None => shared.insert(self.last_use_event()?).clone(),
        };
        sync.set_last_use(at);
        Ok(())
    }

    /// Drops a unit's device memory (`weights`: whatever holds it, `blocks`: whether it holds
    /// quantized buffers) once compute is done with it.
    pub(crate) fn evict<W>(
        &self,
        weights: W,
        sync: &UnitSync,
        blocks: bool,
    ) -> candle_core::Result<()> {
        let _span = tracing::debug_span!("offload.evict").entered();
        if let Some(LastUse(last_use)) = &sync.last_use {
            self.copy.wait(last_use).w()?;
        }
        // Quantized buffers were allocated by Candle on the compute stream, which frees them
        // there: after the copies into them (a unit evicted before its first use never waited).
        if blocks {
            self.compute.wait(&sync.ready).w()?;
        }
        // Dense slices were allocated on the copy stream, so cudarc frees them there,
        // stream-ordered after the wait above.
        drop(weights);
        // A managed unit's pages go back to the host, after its last use (the wait above).
        if let Some(pages) = sync.managed {
            pages.to_host(&self.copy)?;
        }
        Ok(())
    }

    pub(crate) fn harvest(&self, sync: &mut UnitSync) -> Option<Timings> {
        let mut t = Timings::default();
        let mut any = false;
        if sync.copy_pending && sync.ready.try_is_complete().unwrap_or(false) {
            if let Ok(ms) = sync.copy_start.elapsed_ms(&sync.ready) {
                t.copy_s = Some(f64::from(ms) / 1e3);
            }
            sync.copy_pending = false;
            any = true;
        }
        sync.stall_probes.retain(|(before, after)| {
            if after.try_is_complete().unwrap_or(false) {
                t.stall_s += before
                    .elapsed_ms(after)
                    .map(|ms| f64::from(ms) / 1e3)
                    .unwrap_or(0.0);
                any = true;
                false
            } else {
                true
            }
        });
        any.then_some(t)
    }

    pub(crate) fn mem_get_info(&self) -> candle_core::Result<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info().w()?;
        Ok((free as u64, total as u64))
    }

    pub(crate) fn synchronize(&self) -> candle_core::Result<()> {
        self.copy.synchronize().w()?;
        self.compute.synchronize().w()
    }

    /// Captures what `f` enqueues on the compute stream (Candle's stream) into a graph, in
    /// relaxed mode (the capturing thread may still query events and load modules). `f` runs
    /// twice: first eagerly, as a warm-up whose work is real (so `f` must be repeatable), then
    /// captured, when nothing runs: the work runs at each [`replay`](Self::replay). Both runs
    /// keep Candle's cache of host data for kernels on (`enable_cuda_graph_htod_cache`): the
    /// warm-up uploads each op's dims and strides once, and the captured kernels read those
    /// persistent copies, where a plain upload would leave the graph a copy node reading host
    /// memory freed after the capture (hazard H19); an upload the warm-up did not make fails
    /// the capture. With cudarc's event tracking on (multi-GPU pipelines) every buffer's use
    /// would record events inside the graph that waits outside it could not use: refused.
    pub(crate) fn capture<R>(
        &self,
        mut f: impl FnMut() -> candle_core::Result<R>,
    ) -> candle_core::Result<(StepGraph, R)> {
        if self.ctx.is_event_tracking() {
            candle_core::bail!("a CUDA graph needs cudarc's event tracking off on this device");
        }
        candle_offload_kernels::prepare_capture(&self.cuda)?;
        let _params = self.cuda.enable_cuda_graph_htod_cache();
        f()?;
        self.compute
            .begin_capture(cusys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .w()?;
        let out = f();
        // Always end the capture, also after an error, so the stream runs work again.
        let graph = self.compute.end_capture(cusys::CUgraphInstantiate_flags(0));
        let out = out?;
        match graph.w()? {
            Some(g) => Ok((StepGraph(g), out)),
            None => candle_core::bail!("the captured step enqueued nothing"),
        }
    }

    /// Launches `graph` on the compute stream, after everything enqueued there before.
    pub(crate) fn replay(&self, graph: &StepGraph) -> candle_core::Result<()> {
        graph.0.launch().w()
    }
}

/// Work captured on a device's compute stream ([`CudaEngine::capture`]).
pub(crate) struct StepGraph(cudarc::driver::CudaGraph);

// SAFETY: a CUDA graph may be used from any thread as long as no two threads use it at once
// (the driver's graph thread-safety rules); `StepGraph` is only launched through `&self` by
// its owner, who keeps it behind a lock (`Send` without `Sync`), and cudarc binds the context
// to the launching thread before each launch.
unsafe impl Send for StepGraph {}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}

/// Identity and memory of a GPU.
pub(crate) fn device_info(device: &Device) -> SysResult<GpuFacts> {
    let cuda = device.as_cuda_device()?;
    let ctx = cuda.cuda_stream().context().clone();
    let wrap = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
        SysError::Candle(candle_core::Error::wrap(e))
    };
    let attr = |a| ctx.attribute(a).map_err(wrap);
    let major = attr(cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let (free, total) = ctx.mem_get_info().map_err(wrap)?;
    // An attribute the driver does not know reads as unsupported.
    let flag = |a| ctx.attribute(a).is_ok_and(|v| v != 0);
    use cusys::CUdevice_attribute as A;
    let managed_memory = flag(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY);
    let concurrent_managed_access = flag(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS);
    let pageable_memory_access = flag(A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS);
    let mut version: std::ffi::c_int = 0;
    // SAFETY: `cuDriverGetVersion` writes one int through a valid pointer; it needs no context.
    let driver = unsafe { cusys::cuDriverGetVersion(&mut version) }
        .result()
        .ok()
        .map(|()| version);
    Ok(GpuFacts {
        ordinal: ctx.ordinal(),
        name: ctx.name().map_err(wrap)?,
        compute_capability: (major as u32, minor as u32),
        total_bytes: total as u64,
        free_bytes: free as u64,
        driver_version: driver,
        built_version: option_env!("CUDARC_CUDA_VERSION").and_then(|v| v.parse().ok()),
        compiled_arch: option_env!("CUDA_COMPUTE_CAP").map(String::from),
        managed_memory,
        concurrent_managed_access,
        pageable_memory_access,
    })
}

/// Median host-to-device rate over `reps` copies of `bytes`, in GB/s, on a fresh stream.
pub(crate) fn measure_h2d_gbps(
    device: &Device,
    bytes: usize,
    pinned: bool,
    reps: usize,
) -> candle_core::Result<f64> {
    let cuda = device.as_cuda_device()?;
    let ctx = cuda.cuda_stream().context().clone();
    let stream = ctx.new_stream().w()?;
    let pinned_src;
    let pageable_src;
    let src: &[u8] = if pinned {
        pinned_src = PinnedBuffer::alloc(&ctx, bytes).map_err(candle_core::Error::Msg)?;
        pinned_src.as_bytes()
    } else {
        pageable_src = vec![1u8; bytes];
        &pageable_src
    };
    // SAFETY: uninitialised device memory that is only ever written by the copies below.
    let mut dst = unsafe { stream.alloc::<u8>(bytes) }.w()?;
    stream.memcpy_htod(src, &mut dst).w()?;
    stream.synchronize().w()?;
    let mut rates = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = timing_event(&stream)?;
        stream.memcpy_htod(src, &mut dst).w()?;
        let end = timing_event(&stream)?;
        let ms = start.elapsed_ms(&end).w()?;
        rates.push(bytes as f64 / (f64::from(ms) / 1e3) / 1e9);
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}

/// Bytes in use on the whole device (total minus free), as the driver sees it.
pub(crate) fn device_used_bytes(device: &Device) -> candle_core::Result<u64> {
    let (free, total) = device
        .as_cuda_device()?
        .cuda_stream()
        .context()
        .mem_get_info()
        .w()?;
    Ok((total - free) as u64)
}

/// Device memory in use after each step of bringing up CUDA on GPU `ordinal` in a process that
/// has not touched it yet (the driver's total minus free, so other processes count too): the
/// bare context, Candle's device (a cuBLAS handle and a cuRAND generator), the first Candle
/// kernels and cuBLAS matmul, then this crate's first kernel. Each entry is what its step
/// added. The first step is only right before anything else in the process opened the GPU.
pub(crate) fn context_memory(ordinal: usize) -> candle_core::Result<Vec<(&'static str, u64)>> {
    let ctx = CudaContext::new(ordinal).w()?;
    let used = || -> candle_core::Result<u64> {
        let (free, total) = ctx.mem_get_info().w()?;
        Ok((total - free) as u64)
    };
    let bare = used()?;
    let device = Device::new_cuda_with_stream(ordinal)?;
    let candle = used()?;
    let x = Tensor::ones((64, 64), DType::F16, &device)?;
    let y = x.matmul(&x)?.exp()?;
    device.synchronize()?;
    let kernels = used()?;
    candle_offload_kernels::activation::silu_mul(&y, &x)?;
    device.synchronize()?;
    let ours = used()?;
    Ok(vec![
        ("CUDA context", bare),
        (
            "Candle's device (cuBLAS, cuRAND)",
            candle.saturating_sub(bare),
        ),
        (
            "first Candle kernels and matmul",
            kernels.saturating_sub(candle),
        ),
        ("first kernel of this crate", ours.saturating_sub(kernels)),
    ])
}

/// Whether `item`'s blocks (`ggml`, `device_len` bytes on the device) go into `q`'s buffer: the
/// same type and shape, and the buffer `QCudaStorage::zeros` would allocate for them.
fn takes_spare(q: &QTensor, item: &UploadItem<'_>, ggml: GgmlDType, device_len: usize) -> bool {
    let (alloc_blocks, _) = block_buffer(ggml, device_len);
    q.dtype() == ggml
        && q.shape() == item.shape
        && q.storage_size_in_bytes() == alloc_blocks * ggml.type_size()
}

/// The blocks `QCudaStorage::zeros` is asked for, and the blocks of row padding it adds, for a
/// buffer of `device_len` bytes of `ggml` blocks.
fn block_buffer(ggml: GgmlDType, device_len: usize) -> (usize, usize) {
    let padding_blocks = GGML_ROW_PADDING_ELEMS / ggml.block_size();
    let alloc_blocks = (device_len / ggml.type_size()).saturating_sub(padding_blocks);
    (alloc_blocks, padding_blocks)
}

fn default_pool(ctx: &Arc<CudaContext>) -> SysResult<cusys::CUmemoryPool> {
    use candle_core::cuda_backend::cudarc::driver::result;
    ctx.bind_to_thread()
        .map_err(|e| SysError::Candle(candle_core::Error::wrap(e)))?;
    // SAFETY: `cu_device` comes from a live context, as `get_default_mem_pool` requires.
    unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }
        .map_err(|e| SysError::Candle(candle_core::Error::wrap(e)))
}

fn set_pool_release_threshold(ctx: &Arc<CudaContext>, bytes: u64) -> SysResult<()> {
    set_release_threshold(default_pool(ctx)?, bytes)
}

/// Lets `pool` (a live pool) keep up to `bytes` of freed memory across synchronizations.
fn set_release_threshold(pool: cusys::CUmemoryPool, bytes: u64) -> SysResult<()> {
    use candle_core::cuda_backend::cudarc::driver::result;
    let mut value: u64 = bytes;
    // SAFETY: `pool` is live (the caller's contract); RELEASE_THRESHOLD takes a pointer to a
    // cuuint64_t, which `value` is.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            cusys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut value as *mut u64).cast(),
        )
    }
    .map_err(|e| SysError::Candle(candle_core::Error::wrap(e)))
}

/// Lets the default pool of `device` keep freed memory across synchronizations
/// (`keep`), or return it at each one (the driver's default).
pub(crate) fn keep_pool_memory(device: &Device, keep: bool) -> candle_core::Result<()> {
    let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let bytes = if keep { u64::MAX } else { 0 };
    set_pool_release_threshold(&ctx, bytes)?;
    if let Some(weights) = weight_pool(&ctx, false)? {
        set_release_threshold(weights.0, bytes)?;
    }
    Ok(())
}

/// Turns cudarc's per-buffer event tracking of `device`'s context on or off; returns whether it
/// was on. The caller (`train::set_event_tracking`) holds the contract: off only while every
/// buffer of the context is used on one stream.
pub(crate) fn set_event_tracking(device: &Device, on: bool) -> candle_core::Result<bool> {
    let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
    let was = ctx.is_event_tracking();
    if on && !was {
        // SAFETY: buffers made while tracking was off carry no events; turning it back on
        // only adds events to later uses, which cudarc allows, and the buffers made while it
        // was off were used on the device's one stream (the contract of turning it off).
        unsafe { ctx.enable_event_tracking() };
    } else if !on && was {
        // SAFETY: the caller's contract (hazard H15 in ARCHITECTURE.md): until tracking is on
        // again, every buffer of this context is allocated, used and freed on the Candle
        // device's one stream, so stream order alone orders every use (resident training:
        // no copy stream, no second Candle device on this GPU).
        unsafe { ctx.disable_event_tracking() };
    }
    Ok(was)
}

/// Waits for the device, then returns the default pool's unused memory to the driver.
pub(crate) fn trim_memory_pool(device: &Device) -> candle_core::Result<()> {
    trim_memory_pool_to(device, 0)
}

/// Waits for the device, then returns the default pool's unused memory to the driver until
/// the pool holds at most `keep` bytes (in use or not).
pub(crate) fn trim_memory_pool_to(device: &Device, keep: u64) -> candle_core::Result<()> {
    use candle_core::cuda_backend::cudarc::driver::result;
    device.synchronize()?;
    let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
    let pool = default_pool(&ctx)?;
    ctx.synchronize().w()?;
    // SAFETY: `pool` is the live default pool of this context's device.
    unsafe { result::mem_pool::trim_to(pool, keep as usize) }.w()?;
    if let Some(weights) = weight_pool(&ctx, false)? {
        trim_weights(weights)?;
    }
    Ok(())
}

/// Waits for the device, then returns the memory `device`'s weight pool holds beyond the
/// weights in use to the driver (nothing where it has no weight pool).
pub(crate) fn trim_weight_pool(device: &Device) -> candle_core::Result<()> {
    let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
    let Some(weights) = weight_pool(&ctx, false)? else {
        return Ok(());
    };
    device.synchronize()?;
    ctx.synchronize().w()?;
    trim_weights(weights)
}

/// Returns what the weight pool `weights` holds beyond the weights in use to the driver, all
/// of it (freed weights' memory). The caller has synchronised its context, so that every free
/// enqueued on the pool has happened.
fn trim_weights(weights: Pool) -> candle_core::Result<()> {
    use candle_core::cuda_backend::cudarc::driver::result;
    // SAFETY: `weights` is a device's live weight pool (`weight_pool`: never destroyed).
    unsafe { result::mem_pool::trim_to(weights.0, 0) }.w()?;
    Ok(())
}

/// Starts (`on`) or stops the CUDA profiler's capture (`cuProfilerStart`/`Stop`), so that a
/// profiler launched with `--profile-from-start off` (ncu, nsys) records only that range.
pub(crate) fn profiler_capture(device: &Device, on: bool) -> candle_core::Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
    ctx.bind_to_thread().w()?;
    // SAFETY: both calls take no arguments and act on the context just bound to this thread;
    // without a profiler attached they do nothing.
    let r = unsafe {
        if on {
            sys::cuProfilerStart()
        } else {
            sys::cuProfilerStop()
        }
    };
    r.result().w()
}

/// Launches the empty marker kernel `profile_mark(phase)` on `device`'s stream.
pub(crate) fn profile_mark(device: &Device, phase: u32) -> candle_core::Result<()> {
    candle_offload_kernels::profile_mark(device.as_cuda_device()?, phase)
}

/// Whether `bytes` of host memory can be pinned in `device`'s context.
pub(crate) fn try_pin(device: &Device, bytes: usize) -> bool {
    match device.as_cuda_device() {
        Ok(cuda) => PinnedBuffer::alloc(cuda.cuda_stream().context(), bytes).is_ok(),
        Err(_) => false,
    }
}

/// The PCI address of `device` (`0000:3b:00.0`).
pub(crate) fn pci_bus_id(device: &Device) -> Option<String> {
    let ctx = device
        .as_cuda_device()
        .ok()?
        .cuda_stream()
        .context()
        .clone();
    let attr = |a| ctx.attribute(a).ok();
    let domain = attr(cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
    let bus = attr(cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
    let dev = attr(cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.0"))
}

/// Turns direct access from `from`'s context to `to`'s memory on or off. Returns `false` when
/// the two GPUs cannot access each other (copies between them then go through host memory);
/// enabling twice or disabling what was never enabled is not an error.
pub(crate) fn set_peer_access(
    from: &Device,
    to: &Device,
    enable: bool,
) -> candle_core::Result<bool> {
    let a = from.as_cuda_device()?.cuda_stream().context().clone();
    let b = to.as_cuda_device()?.cuda_stream().context().clone();
    if a.cu_device() == b.cu_device() {
        return Ok(true);
    }
    let mut can: std::ffi::c_int = 0;
    // SAFETY: writes one int through a valid pointer; both device handles come from live
    // contexts.
    unsafe { cusys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
        .result()
        .w()?;
    if can == 0 {
        return Ok(false);
    }
    a.bind_to_thread().w()?;
    // SAFETY: `a` is the current context (bound above) and `b`'s context stays alive for the
    // call (we hold an `Arc` to it); flags must be 0.
    let r = unsafe {
        if enable {
            cusys::cuCtxEnablePeerAccess(b.cu_ctx(), 0)
        } else {
            cusys::cuCtxDisablePeerAccess(b.cu_ctx())
        }
    };
    use cusys::cudaError_enum as E;
    match r {
        E::CUDA_SUCCESS
        | E::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        | E::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED => Ok(true),
        other => other.result().w().map(|()| true),
    }
}

/// The high-water mark of memory in use (allocated and not yet freed) in `device`'s default
/// memory pool, the pool Candle allocates from, plus its weight pool's ([`weight_pool`]; the
/// sum of the two pools' own marks, which may have been reached at different times); with
/// `reset`, the marks are then set back to the memory in use now.
pub(crate) fn pool_used_high_bytes(device: &Device, reset: bool) -> candle_core::Result<u64> {
    pool_high_bytes(
        device,
        cusys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        reset,
    )
}

/// The high-water mark of memory `device`'s default pool and weight pool held from the driver
/// (in use, or freed and kept for reuse; summed as [`pool_used_high_bytes`] sums); with
/// `reset`, set back to what they hold now. Above the used mark by what fragmentation and the
/// kept free blocks cost.
pub(crate) fn pool_reserved_high_bytes(device: &Device, reset: bool) -> candle_core::Result<u64> {
    pool_high_bytes(
        device,
        cusys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        reset,
    )
}

fn pool_high_bytes(
    device: &Device,
    attr: cusys::CUmemPool_attribute,
    reset: bool,
) -> candle_core::Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::result;
    device.synchronize()?;
    let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
    let mut pools = vec![default_pool(&ctx)?];
    pools.extend(weight_pool(&ctx, false)?.map(|p| p.0));
    let mut total = 0;
    for pool in pools {
        let mut value: u64 = 0;
        // SAFETY: `pool` is a live pool of this context's device (its default pool, or its
        // weight pool, never destroyed); both high-water attributes are read through a
        // pointer to a cuuint64_t, which `value` is.
        unsafe { result::mem_pool::get_attribute(pool, attr, (&mut value as *mut u64).cast()) }
            .w()?;
        total += value;
        if reset {
            let mut zero: u64 = 0;
            // SAFETY: as above; setting a high-water attribute takes a pointer to a
            // cuuint64_t holding 0.
            unsafe { result::mem_pool::set_attribute(pool, attr, (&mut zero as *mut u64).cast()) }
                .w()?;
        }
    }
    Ok(total)
}

/// Device tensors copied to the host through one reused page-locked buffer: the copy runs at
/// the link's pinned rate and faults in no fresh pageable pages (what `Tensor::to_device`
/// does for every tensor). Grown when a tensor needs more, never shrunk.
pub(crate) struct Downloader {
    buf: Option<PinnedBuffer>,
}

impl Downloader {
    pub(crate) fn new() -> Self {
        Self { buf: None }
    }

    /// Copies `t` (on a CUDA device) into the buffer on its device's stream, waits for the
    /// copy, and returns its elements' bytes, contiguous, in `t`'s dtype.
    pub(crate) fn download(&mut self, t: &Tensor) -> candle_core::Result<&[u8]> {
        use candle_core::cuda_backend::CudaStorageSlice as Slice;
        let t = t.contiguous()?;
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        let stream = t.device().as_cuda_device()?.cuda_stream();
        if self.buf.as_ref().is_none_or(|b| b.len < bytes) {
            self.buf = None;
            let buf =
                PinnedBuffer::alloc(stream.context(), bytes).map_err(candle_core::Error::Msg)?;
            self.buf = Some(buf);
        }
        let Some(buf) = self.buf.as_mut() else {
            candle_core::bail!("download: no staging buffer");
        };
        {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cuda(cs) = &*storage else {
                candle_core::bail!("download: the tensor is not on a CUDA device");
            };
            let Some((a, b)) = layout.contiguous_offsets() else {
                candle_core::bail!("download: the tensor is not contiguous");
            };
            let dst = &mut buf.as_bytes_mut()[..bytes];
            match &cs.slice {
                Slice::U8(s) => dtoh(s, a..b, &stream, dst)?,
                Slice::U32(s) => dtoh(s, a..b, &stream, dst)?,
                Slice::I64(s) => dtoh(s, a..b, &stream, dst)?,
                Slice::BF16(s) => dtoh(s, a..b, &stream, dst)?,
                Slice::F16(s) => dtoh(s, a..b, &stream, dst)?,
                Slice::F32(s) => dtoh(s, a..b, &stream, dst)?,
                Slice::F64(s) => dtoh(s, a..b, &stream, dst)?,
                _ => candle_core::bail!("download: unsupported dtype {:?}", t.dtype()),
            }
        }
        stream.synchronize().w()?;
        Ok(&buf.as_bytes()[..bytes])
    }
}

/// Enqueues the copy of `s[range]` into `dst` (its byte size) on `stream`.
fn dtoh<T: DeviceRepr>(
    s: &CudaSlice<T>,
    range: std::ops::Range<usize>,
    stream: &Arc<CudaStream>,
    dst: &mut [u8],
) -> candle_core::Result<()> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    if range.len() * std::mem::size_of::<T>() != dst.len() {
        candle_core::bail!("download: {} elements for {} bytes", range.len(), dst.len());
    }
    let view = s.slice(range);
    // The guard orders the read after the slice's last write on other streams (with event
    // tracking) and records it as a read, which a free waits for.
    let (ptr, _guard) = view.device_ptr(stream);
    // SAFETY: `ptr` addresses `dst.len()` bytes of `s` (checked above), alive while `s` is;
    // `dst` is page-locked memory owned by the `Downloader`, which the caller does not read
    // before `stream.synchronize()` and does not reuse before this copy has completed.
    unsafe { cudarc_result::memcpy_dtoh_async(dst, ptr, stream.cu_stream()) }.w()
}
