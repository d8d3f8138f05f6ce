//! The CUDA side of the `sys` module in a build without `--features cuda`: the same names,
//! uninhabited, so that every GPU path is statically unreachable and needs no `cfg`.

use candle_core::{Device, Tensor};

use super::{
    DeviceWeight, GpuFacts, HostTier, NcclComm, PageableBuffer, SysError, SysResult, Timings,
    UmRow, UploadItem,
};

/// Allocates host buffers for the store: always pageable here.
#[derive(Debug)]
pub(crate) struct Pinner;

impl Pinner {
    pub(crate) fn for_device(
        _device: &Device,
        _cap: Option<u64>,
        managed: bool,
    ) -> SysResult<Self> {
        if managed {
            return Err(SysError::NotCompiledWithCuda {
                what: "the managed (Unified Memory) engine",
            });
        }
        Ok(Self)
    }
    pub(crate) fn alloc(&mut self, len: usize, _unit: &str) -> SysResult<Box<dyn HostTier>> {
        Ok(Box::new(PageableBuffer::zeroed(len)))
    }
}

/// A unit in managed memory (never exists without CUDA).
#[derive(Debug)]
pub(crate) enum ManagedBuffer {}

impl ManagedBuffer {
    pub(crate) fn device_footprint(&self) -> usize {
        match *self {}
    }
    pub(crate) fn ordinal(&self) -> usize {
        match *self {}
    }
}

pub(crate) fn um_table(_device: &Device, _bytes: usize) -> candle_core::Result<Vec<UmRow>> {
    Err(SysError::NotCompiledWithCuda {
        what: "the Unified Memory table",
    }
    .into())
}

/// Events of a unit on a GPU (never exists without CUDA).
#[derive(Debug)]
pub(crate) enum UnitSync {}

impl UnitSync {
    pub(crate) fn is_settled(&self) -> bool {
        match *self {}
    }
}

/// A unit's last use on a GPU (never exists without CUDA).
#[derive(Debug, Clone)]
pub(crate) enum LastUse {}

/// A captured decode step (never exists without CUDA).
#[derive(Debug)]
pub(crate) enum StepGraph {}

/// The copy engine of a GPU (never exists without CUDA).
#[derive(Debug)]
pub(crate) enum CudaEngine {}

impl CudaEngine {
    pub(crate) fn new(
        _device: &Device,
        _event_tracking: bool,
        _weight_pool: bool,
    ) -> SysResult<Self> {
        Err(SysError::NotCompiledWithCuda {
            what: "a GPU offload runtime",
        })
    }
    pub(crate) fn upload(
        &self,
        _unit: &str,
        _src: &dyn HostTier,
        _items: &[UploadItem<'_>],
        _trainable: bool,
        _spare: &mut Vec<candle_core::quantized::QTensor>,
    ) -> candle_core::Result<(Vec<DeviceWeight>, UnitSync, super::SpareUse)> {
        match *self {}
    }
    pub(crate) fn wait_ready(&self, _sync: &mut UnitSync) -> candle_core::Result<()> {
        match *self {}
    }
    pub(crate) fn is_ready(&self, _sync: &UnitSync) -> candle_core::Result<bool> {
        match *self {}
    }
    pub(crate) fn record_last_use(&self, _sync: &mut UnitSync) -> candle_core::Result<()> {
        match *self {}
    }
    pub(crate) fn share_last_use(
        &self,
        _shared: &mut Option<LastUse>,
        _sync: &mut UnitSync,
    ) -> candle_core::Result<()> {
        match *self {}
    }
    pub(crate) fn evict<W>(
        &self,
        _weights: W,
        _sync: &UnitSync,
        _blocks: bool,
    ) -> candle_core::Result<()> {
        match *self {}
    }
    pub(crate) fn harvest(&self, _sync: &mut UnitSync) -> Option<Timings> {
        match *self {}
    }
    pub(crate) fn capture<R>(
        &self,
        _f: impl FnMut() -> candle_core::Result<R>,
    ) -> candle_core::Result<(StepGraph, R)> {
        match *self {}
    }
    pub(crate) fn replay(&self, _graph: &StepGraph) -> candle_core::Result<()> {
        match *self {}
    }
    pub(crate) fn mem_get_info(&self) -> candle_core::Result<(u64, u64)> {
        match *self {}
    }
    pub(crate) fn synchronize(&self) -> candle_core::Result<()> {
        match *self {}
    }
}

pub(crate) fn device_info(_device: &Device) -> SysResult<GpuFacts> {
    Err(SysError::NotCompiledWithCuda {
        what: "GPU device information",
    })
}

pub(crate) fn measure_h2d_gbps(
    _device: &Device,
    _bytes: usize,
    _pinned: bool,
    _reps: usize,
) -> candle_core::Result<f64> {
    Err(SysError::NotCompiledWithCuda {
        what: "measuring the host-to-device rate",
    }
    .into())
}

pub(crate) fn context_memory(_ordinal: usize) -> candle_core::Result<Vec<(&'static str, u64)>> {
    Err(SysError::NotCompiledWithCuda {
        what: "reading device memory",
    }
    .into())
}

pub(crate) fn device_used_bytes(_device: &Device) -> candle_core::Result<u64> {
    Err(SysError::NotCompiledWithCuda {
        what: "reading device memory",
    }
    .into())
}

pub(crate) fn keep_pool_memory(_device: &Device, _keep: bool) -> candle_core::Result<()> {
    Ok(())
}

pub(crate) fn set_event_tracking(_device: &Device, on: bool) -> candle_core::Result<bool> {
    Ok(on)
}

pub(crate) fn trim_memory_pool_to(_device: &Device, _keep: u64) -> candle_core::Result<()> {
    Ok(())
}

pub(crate) fn trim_memory_pool(_device: &Device) -> candle_core::Result<()> {
    Ok(())
}

pub(crate) fn trim_weight_pool(_device: &Device) -> candle_core::Result<()> {
    Ok(())
}

pub(crate) fn has_long_lived_pool(_device: &Device) -> candle_core::Result<bool> {
    Ok(false)
}

pub(crate) fn long_lived<R>(
    _device: &Device,
    alloc: impl FnOnce() -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    alloc()
}

pub(crate) fn profiler_capture(_device: &Device, _on: bool) -> candle_core::Result<()> {
    Ok(())
}

pub(crate) fn profile_mark(_device: &Device, _phase: u32) -> candle_core::Result<()> {
    Ok(())
}

pub(crate) fn try_pin(_device: &Device, _bytes: usize) -> bool {
    false
}

pub(crate) fn pci_bus_id(_device: &Device) -> Option<String> {
    None
}

pub(crate) fn set_peer_access(
    _from: &Device,
    _to: &Device,
    _enable: bool,
) -> candle_core::Result<bool> {
    Ok(false)
}

pub(crate) fn pool_used_high_bytes(_device: &Device, _reset: bool) -> candle_core::Result<u64> {
    Err(SysError::NotCompiledWithCuda {
        what: "reading the memory pool",
    }
    .into())
}

pub(crate) fn pool_reserved_high_bytes(_device: &Device, _reset: bool) -> candle_core::Result<u64> {
    Err(SysError::NotCompiledWithCuda {
        what: "reading the memory pool",
    }
    .into())
}

/// Device-to-host copies through page-locked memory: there is no device without `cuda`.
pub(crate) struct Downloader;

impl Downloader {
    pub(crate) fn new() -> Self {
        Self
    }

    pub(crate) fn download(&mut self, _t: &Tensor) -> candle_core::Result<&[u8]> {
        candle_core::bail!("download: built without `cuda`")
    }
}

/// An NCCL transfer on a device's stream (never exists without CUDA).
#[derive(Debug)]
pub(crate) enum NcclPending {}

impl NcclPending {
    pub(crate) fn is_done(&self) -> SysResult<bool> {
        match *self {}
    }
}

fn no_nccl<T>() -> SysResult<T> {
    Err(SysError::NotCompiledWithCuda {
        what: "NCCL's transfers",
    })
}

pub(crate) fn nccl_bind(_device: &Device) -> SysResult<()> {
    no_nccl()
}

pub(crate) fn nccl_send(
    _comm: &mut NcclComm,
    _t: &Tensor,
    _peer: usize,
    _deadline: std::time::Instant,
) -> SysResult<NcclPending> {
    no_nccl()
}

pub(crate) fn nccl_recv(
    _comm: &mut NcclComm,
    _dtype: candle_core::DType,
    _dims: &[usize],
    _device: &Device,
    _peer: usize,
    _deadline: std::time::Instant,
) -> SysResult<(Tensor, NcclPending)> {
    no_nccl()
}

pub(crate) fn nccl_loopback(
    _comm: &mut NcclComm,
    _t: &Tensor,
    _deadline: std::time::Instant,
) -> SysResult<(Tensor, NcclPending)> {
    no_nccl()
}
