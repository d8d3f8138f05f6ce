//! The managed-memory tier (`--engine managed`, CUDA builds only): a unit's bytes in CUDA
//! Unified Memory (`cuMemAllocManaged`), advised to live on the host and to be accessed by
//! the GPU. The copy engine does not copy such a unit: it migrates the unit's pages to the
//! GPU with `cuMemPrefetchAsync` on the copy stream before first use, hands out tensors that
//! point into the managed allocation, and migrates the pages back to the host after last use,
//! so the plan and the budget decide what is on the device exactly as for copies.
//!
//! Budget: a unit's allocation is rounded up to [`MANAGED_GRANULE`] (the largest page the
//! driver migrates), and the store counts [`ManagedBuffer::device_footprint`] (that size, one
//! granule more when the allocation does not start on a granule) as the unit's device bytes.
//! Nothing else migrates pages to the GPU: the preferred location is the host, so a GPU access
//! to a page that was not prefetched reads it over the link instead of faulting it over.
//!
//! Lifetime: Candle tensors cannot own memory they did not allocate, and cudarc frees a slice's
//! pointer with `cuMemFreeAsync` when the last tensor holding it drops, which is wrong for
//! managed memory. So every tensor made here has one clone that is never dropped (its slice
//! is never freed by cudarc). A tensor handed out may outlive the store (`UnitGuard::get`
//! returns an owned tensor, and views of it share its memory), so an allocation that ever
//! gave out a tensor is never freed: it lives until the process exits. Only one that gave out
//! none is freed by `Drop`. The managed engine is for inference on models that stay resident
//! (the runtime refuses streaming and training), so this is one model's weights per store.
//! Tensors a caller kept see `update_weights`' new values: they are the store's bytes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::result as cudarc_result;
use candle_core::cuda_backend::cudarc::driver::{sys as cusys, CudaStream, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Shape, Storage, Tensor};

use super::{HostTier, SysError, SysResult, TierKind, UmRow, MANAGED_GRANULE};

/// One unit's bytes in managed memory.
pub(crate) struct ManagedBuffer {
    ptr: cusys::CUdeviceptr,
    len: usize,
    alloc_len: usize,
    ordinal: i32,
    cuda: CudaDevice,
    compute: Arc<CudaStream>,
    /// Tensors already made, by (byte range, dtype, trainable).
    tensors: Mutex<HashMap<(usize, usize, DType, bool), Tensor>>,
}

impl std::fmt::Debug for ManagedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ManagedBuffer({} bytes, {} allocated)",
            self.len, self.alloc_len
        )
    }
}

fn location(device: Option<i32>) -> cusys::CUmemLocation {
    match device {
        Some(id) => cusys::CUmemLocation {
            type_: cusys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id,
        },
        None => cusys::CUmemLocation {
            type_: cusys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
    }
}

/// Why `device`'s GPU cannot hold managed units, or `None` when it can (from the attributes
/// the doctor reports, `device_info`).
pub(crate) fn unsupported(device: &Device) -> SysResult<Option<String>> {
    let facts = super::device_info(device)?;
    Ok(if !facts.managed_memory {
        Some(format!(
            "cuda:{} does not support managed memory (CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY is 0)",
            facts.ordinal
        ))
    } else if !facts.concurrent_managed_access {
        Some(format!(
            "cuda:{} has no concurrent managed access (no page migration or prefetch: a \
             Windows/WSL driver or a GPU before Pascal); use the explicit engine",
            facts.ordinal
        ))
    } else {
        None
    })
}

impl ManagedBuffer {
    /// Allocates `len` bytes (rounded up to [`MANAGED_GRANULE`]) of managed memory, zeroed
    /// on the host, advised to prefer the host and to be accessed by `cuda`'s GPU.
    pub(crate) fn alloc(cuda: &CudaDevice, len: usize) -> SysResult<Self> {
        let compute = cuda.cuda_stream();
        let ctx = compute.context().clone();
        let wrap = |what: &str, e: cudarc_result::DriverError| {
            SysError::Candle(candle_core::Error::Msg(format!(
                "managed memory: {what} of {len} bytes failed: {e}"
            )))
        };
        ctx.bind_to_thread()
            .map_err(|e| wrap("binding the context", e))?;
        let alloc_len = super::managed_alloc_len(len);
        let ordinal = ctx.ordinal() as i32;
        // SAFETY: a plain driver allocation in the current (bound) context; the pointer is
        // owned by the returned buffer and freed once in `Drop`.
        let ptr = unsafe {
            cudarc_result::malloc_managed(alloc_len, cusys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL)
        }
        .map_err(|e| wrap("cuMemAllocManaged", e))?;
        let buf = Self {
            ptr,
            len,
            alloc_len,
            ordinal,
            cuda: cuda.clone(),
            compute,
            tensors: Mutex::new(HashMap::new()),
        };
        use cusys::CUmem_advise as Adv;
        // SAFETY: `ptr..ptr + alloc_len` is exactly the allocation made above.
        unsafe {
            cudarc_result::mem_advise(
                ptr,
                alloc_len,
                Adv::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                location(None),
            )
        }
        .map_err(|e| wrap("advising the host as preferred location", e))?;
        // SAFETY: as above.
        unsafe {
            cudarc_result::mem_advise(
                ptr,
                alloc_len,
                Adv::CU_MEM_ADVISE_SET_ACCESSED_BY,
                location(Some(ordinal)),
            )
        }
        .map_err(|e| wrap("advising access by the GPU", e))?;
        // SAFETY: managed memory is host-accessible; nothing on the GPU uses it yet. The
        // write also places the pages on the host (first touch).
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, alloc_len) };
        Ok(buf)
    }

    /// Enqueues the migration of `range` (bytes of the unit) to the GPU on `stream`.
    pub(crate) fn prefetch_to_device(
        &self,
        range: std::ops::Range<usize>,
        stream: &CudaStream,
    ) -> candle_core::Result<()> {
        if range.end > self.alloc_len {
            candle_core::bail!(
                "managed prefetch of {range:?} past the allocation of {} bytes",
                self.alloc_len
            );
        }
        if range.is_empty() {
            return Ok(());
        }
        // SAFETY: the range lies inside this allocation (checked above); prefetching only
        // moves pages, it never changes their contents.
        unsafe {
            cudarc_result::mem_prefetch_async(
                self.ptr + range.start as cusys::CUdeviceptr,
                range.len(),
                location(Some(self.ordinal)),
                stream.cu_stream(),
            )
        }
        .w()
    }

    /// Device bytes the unit's pages may take once prefetched: the allocation in whole
    /// granules, one more when the driver did not start it on a granule.
    pub(crate) fn device_footprint(&self) -> usize {
        let aligned = (self.ptr as usize).is_multiple_of(MANAGED_GRANULE);
        self.alloc_len + if aligned { 0 } else { MANAGED_GRANULE }
    }

    /// The GPU (ordinal) its pages are advised to and prefetched to.
    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal as usize
    }

    /// The whole allocation, for migrating it back to the host after the unit's last use.
    pub(crate) fn pages(&self) -> ManagedPages {
        ManagedPages {
            ptr: self.ptr,
            len: self.alloc_len,
        }
    }

    /// The tensor of `dtype` and `shape` at byte `range` of the unit, pointing into the
    /// managed allocation (made once, then cloned).
    pub(crate) fn tensor(
        &self,
        range: std::ops::Range<usize>,
        dtype: DType,
        shape: &Shape,
        trainable: bool,
    ) -> candle_core::Result<Tensor> {
        if range.end > self.len || range.len() != shape.elem_count() * dtype.size_in_bytes() {
            candle_core::bail!(
                "managed tensor of {shape:?} {dtype:?} at {range:?} does not fit its unit of {} bytes",
                self.len
            );
        }
        let mut cache = self
            .tensors
            .lock()
            .map_err(|_| candle_core::Error::Msg("managed tensor cache poisoned".into()))?;
        let key = (range.start, range.end, dtype, trainable);
        if let Some(t) = cache.get(&key) {
            return Ok(t.clone());
        }
        let storage = match dtype {
            DType::F16 => self.slice::<half::f16>(range.clone())?,
            DType::BF16 => self.slice::<half::bf16>(range.clone())?,
            DType::F32 => self.slice::<f32>(range.clone())?,
            DType::F64 => self.slice::<f64>(range.clone())?,
            DType::U8 => self.slice::<u8>(range.clone())?,
            DType::U32 => self.slice::<u32>(range.clone())?,
            DType::I64 => self.slice::<i64>(range.clone())?,
            other => candle_core::bail!("dtype {other:?} cannot live in managed memory"),
        };
        let t = Tensor::from_storage(
            Storage::Cuda(storage),
            shape.clone(),
            BackpropOp::none(),
            trainable,
        );
        // The clone that is never dropped: cudarc must never free this pointer (see the
        // module's doc); `Drop` frees the allocation.
        std::mem::forget(t.clone());
        cache.insert(key, t.clone());
        Ok(t)
    }

    fn slice<T: DeviceRepr + CudaDType>(
        &self,
        range: std::ops::Range<usize>,
    ) -> candle_core::Result<candle_core::CudaStorage> {
        let n = range.len() / std::mem::size_of::<T>();
        // SAFETY: `ptr + start .. + n * size_of::<T>()` lies inside the allocation (checked by
        // `tensor`), is aligned for `T` (units' tensors start at multiples of `TIER_ALIGN`, 256,
        // and the driver aligns allocations to at least 256 bytes), and holds initialised
        // bytes (zeroed at allocation, then written by the store). The slice is never dropped
        // (see `tensor`), so cudarc never frees it, and an allocation that gave out a tensor
        // is never freed (see the module's doc).
        let slice = unsafe {
            self.compute
                .upgrade_device_ptr::<T>(self.ptr + range.start as cusys::CUdeviceptr, n)
        };
        Ok(T::wrap_cuda_slice(slice, self.cuda.clone()))
    }
}

/// A managed unit's allocation, remembered by the unit's events until its eviction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ManagedPages {
    ptr: cusys::CUdeviceptr,
    len: usize,
}

impl ManagedPages {
    /// Enqueues the migration of these pages back to the host on `stream`.
    pub(crate) fn to_host(self, stream: &CudaStream) -> candle_core::Result<()> {
        // SAFETY: the range is a whole managed allocation that gave out tensors (the unit was
        // fetched), so it is never freed (see the module's doc); prefetching moves pages and
        // never changes their contents.
        unsafe {
            cudarc_result::mem_prefetch_async(
                self.ptr,
                self.len,
                location(None),
                stream.cu_stream(),
            )
        }
        .w()
    }
}

impl HostTier for ManagedBuffer {
    fn kind(&self) -> TierKind {
        TierKind::Managed
    }
    fn len(&self) -> usize {
        self.len
    }
    fn bytes(&self) -> Option<&[u8]> {
        // SAFETY: managed memory is host-accessible at any time on a device with concurrent
        // managed access (checked before any is allocated); `len <= alloc_len` bytes,
        // initialised, alive as long as `self`.
        Some(unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) })
    }
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        // SAFETY: as in `bytes`; `&mut self` makes the host access exclusive (the store's
        // write lock). Pages on the GPU migrate back on the CPU's touch.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) })
    }
    fn managed(&self) -> Option<&ManagedBuffer> {
        Some(self)
    }
}

impl Drop for ManagedBuffer {
    fn drop(&mut self) {
        let handed_out = self.tensors.get_mut().map_or(true, |c| !c.is_empty());
        if handed_out {
            // A tensor over this memory may still be alive (see the module's doc).
            tracing::debug!(
                bytes = self.alloc_len,
                "managed memory kept until the process exits"
            );
            return;
        }
        // Work that may still touch the pages (a prefetch on the copy stream) finishes first.
        let _ = self.compute.context().synchronize();
        // SAFETY: the pointer came from `cuMemAllocManaged` and is freed exactly once here; no
        // tensor was ever made over it (checked above), and cudarc never frees it.
        if let Err(e) = unsafe { cudarc_result::free_sync(self.ptr) } {
            tracing::warn!(error = %e, "freeing managed memory failed");
        }
    }
}

/// Frees a managed allocation of `um_table` when dropped (on errors too), once the context is
/// idle.
struct FreeOnDrop(
    cusys::CUdeviceptr,
    Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>,
);

impl Drop for FreeOnDrop {
    fn drop(&mut self) {
        let _ = self.1.synchronize();
        // SAFETY: the pointer came from `cuMemAllocManaged` in `um_table` and is freed only
        // here; the only tensor over it was forgotten (never freed by cudarc) and is not used
        // after this point, and the context is idle.
        if let Err(e) = unsafe { cudarc_result::free_sync(self.0) } {
            tracing::warn!(error = %e, "freeing managed memory failed");
        }
    }
}

/// The seed's three rows on `cuda`'s GPU, for `bytes` of data: a plain copy (pageable host
/// buffer, device buffer, copy, kernel), managed memory read by the kernel where it lies
/// (pages migrate on the GPU's faults), and managed memory prefetched to the GPU first. Each
/// time covers getting the data to the kernel and the kernel; device bytes are the driver's
/// used memory at the end less at the start.
pub(crate) fn um_table(device: &Device, bytes: usize) -> candle_core::Result<Vec<UmRow>> {
    let cuda = device.as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let ctx = stream.context().clone();
    let n = bytes / 4;
    let used = || super::device_used_bytes(device);
    let host: Vec<f32> = (0..n).map(|i| (i % 1024) as f32).collect();
    let want: f64 = host.iter().map(|&x| f64::from(x)).sum();
    let check = |t: &Tensor| -> candle_core::Result<()> {
        let got = f64::from(t.sum_all()?.to_scalar::<f32>()?);
        if (got - want).abs() > want * 1e-3 {
            candle_core::bail!("UM table: the kernel summed {got}, expected {want}");
        }
        Ok(())
    };
    let mut rows = Vec::new();
    // 1. A plain copy.
    stream.synchronize().w()?;
    let before = used()?;
    let t0 = std::time::Instant::now();
    let t = Tensor::from_slice(&host, n, device)?;
    check(&t)?;
    let seconds = t0.elapsed().as_secs_f64();
    rows.push(UmRow {
        name: "plain copy",
        device_bytes: used()?.saturating_sub(before),
        host_bytes: bytes as u64,
        seconds,
        enqueue_seconds: None,
    });
    drop(t);
    super::trim_memory_pool(device)?;
    // 2. and 3. Managed memory, read where it lies or prefetched first.
    for prefetch in [false, true] {
        let before = used()?;
        let alloc_len = super::managed_alloc_len(bytes);
        // SAFETY: a plain allocation in the device's context, freed below after the stream
        // that used it finished.
        let ptr = unsafe {
            cudarc_result::malloc_managed(alloc_len, cusys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL)
        }
        .w()?;
        let _free = FreeOnDrop(ptr, ctx.clone());
        // SAFETY: `ptr` holds `alloc_len >= n * 4` bytes of host-accessible managed memory,
        // aligned to at least 256 bytes, not used by the GPU yet.
        unsafe { std::ptr::copy_nonoverlapping(host.as_ptr(), ptr as *mut f32, n) };
        let t0 = std::time::Instant::now();
        let mut enqueue_seconds = None;
        if prefetch {
            // SAFETY: the range is the allocation made above.
            unsafe {
                cudarc_result::mem_prefetch_async(
                    ptr,
                    alloc_len,
                    location(Some(ctx.ordinal() as i32)),
                    stream.cu_stream(),
                )
            }
            .w()?;
            enqueue_seconds = Some(t0.elapsed().as_secs_f64());
        }
        // SAFETY: `n` initialised f32 inside the allocation; the slice is leaked below, never
        // freed by cudarc.
        let slice = unsafe { stream.upgrade_device_ptr::<f32>(ptr, n) };
        let t = Tensor::from_storage(
            Storage::Cuda(f32::wrap_cuda_slice(slice, cuda.clone())),
            n,
            BackpropOp::none(),
            false,
        );
        let result = check(&t);
        let seconds = t0.elapsed().as_secs_f64();
        // Never dropped: cudarc must not free managed memory (`_free` does, after this).
        std::mem::forget(t);
        let device_bytes = used()?.saturating_sub(before);
        stream.synchronize().w()?;
        // What the driver still holds once the pages went back to the host (the managed
        // engine's eviction): whether migrating them out gives the device memory back.
        let back = if prefetch {
            let t1 = std::time::Instant::now();
            // SAFETY: the range is the allocation made above; its only reader has finished.
            unsafe {
                cudarc_result::mem_prefetch_async(
                    ptr,
                    alloc_len,
                    location(None),
                    stream.cu_stream(),
                )
            }
            .w()?;
            let enqueued = t1.elapsed().as_secs_f64();
            stream.synchronize().w()?;
            Some((
                t1.elapsed().as_secs_f64(),
                enqueued,
                used()?.saturating_sub(before),
            ))
        } else {
            None
        };
        drop(_free);
        result?;
        rows.push(UmRow {
            name: if prefetch {
                "Unified Memory, prefetched"
            } else {
                "Unified Memory"
            },
            device_bytes,
            host_bytes: alloc_len as u64,
            seconds,
            enqueue_seconds,
        });
        if let Some((seconds, enqueued, device_bytes)) = back {
            rows.push(UmRow {
                name: "prefetched, then back to the host",
                device_bytes,
                host_bytes: alloc_len as u64,
                seconds,
                enqueue_seconds: Some(enqueued),
            });
        }
    }
    Ok(rows)
}
