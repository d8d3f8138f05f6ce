//! The CUDA side of NCCL transfers: a tensor's device bytes on its device's stream (Candle's
//! one compute stream, so a transfer is ordered after the kernels that made the tensor and
//! before those that use it), and an event that says when a transfer is done.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorageSlice as Slice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};

use super::nccl_comm::NcclComm;
use super::{SysError, SysResult};

/// A transfer enqueued on a device's stream, done once its event has completed. It keeps the
/// tensor it reads or writes alive until then.
#[derive(Debug)]
pub(crate) struct NcclPending {
    event: CudaEvent,
    _tensors: Vec<Tensor>,
}

impl NcclPending {
    /// Whether the transfer has completed (an error of the device's stream is an error).
    pub(crate) fn is_done(&self) -> SysResult<bool> {
        self.event.try_is_complete().w().map_err(SysError::from)
    }
}

/// Makes `device` (a CUDA device) the current one of this thread, as NCCL's initialisation
/// expects.
pub(crate) fn nccl_bind(device: &Device) -> SysResult<()> {
    let dev = cuda(device)?;
    dev.cuda_stream().context().bind_to_thread().w()?;
    Ok(())
}

fn cuda(device: &Device) -> SysResult<&CudaDevice> {
    device.as_cuda_device().map_err(|_| not_cuda(device))
}

fn unsupported(reason: String) -> SysError {
    SysError::Unsupported {
        field: "nccl",
        reason,
    }
}

fn not_cuda(device: &Device) -> SysError {
    SysError::Unsupported {
        field: "device",
        reason: format!("NCCL carries tensors of CUDA devices, not {device:?}"),
    }
}

/// Waits until `comm` has enqueued its last call (a non-blocking communicator may still be
/// enqueuing when the call returns), at most until `deadline`.
fn wait_enqueued(comm: &NcclComm, deadline: Instant) -> SysResult<()> {
    if comm.wait_ready(deadline)? {
        return Ok(());
    }
    Err(unsupported(
        "a call was still being enqueued at its deadline".into(),
    ))
}

/// Enqueues the send of `t`'s elements (contiguous, any dtype Candle's CUDA storage has) to
/// `peer` on `t`'s device's stream.
pub(crate) fn nccl_send(
    comm: &mut NcclComm,
    t: &Tensor,
    peer: usize,
    deadline: Instant,
) -> SysResult<NcclPending> {
    let t = t.contiguous()?;
    enqueue_send(comm, &t, peer)?;
    finish(comm, t.device(), deadline, vec![t.clone()])
}

/// Enqueues the receive of a `dtype` tensor of shape `dims` from `peer` into new memory of
/// `device`, on its stream; the tensor is readable by later work on that stream at once, and by
/// the host once the pending transfer is done.
pub(crate) fn nccl_recv(
    comm: &mut NcclComm,
    dtype: DType,
    dims: &[usize],
    device: &Device,
    peer: usize,
    deadline: Instant,
) -> SysResult<(Tensor, NcclPending)> {
    let t = enqueue_recv(comm, dtype, dims, device, peer)?;
    let pending = finish(comm, device, deadline, vec![t.clone()])?;
    Ok((t, pending))
}

/// Sends `t` to this rank itself and receives it back (one NCCL group): what a communicator of
/// one rank can test of the transfers on one GPU.
pub(crate) fn nccl_loopback(
    comm: &mut NcclComm,
    t: &Tensor,
    deadline: Instant,
) -> SysResult<(Tensor, NcclPending)> {
    let me = comm.rank();
    let t = t.contiguous()?;
    let lib = comm.lib().clone();
    let got = lib.group(|| -> SysResult<Tensor> {
        enqueue_send(comm, &t, me)?;
        enqueue_recv(comm, t.dtype(), t.dims(), t.device(), me)
    })?;
    let pending = finish(comm, t.device(), deadline, vec![t.clone(), got.clone()])?;
    Ok((got, pending))
}

/// Waits until `comm` has enqueued its calls, then records the event that says they are done.
fn finish(
    comm: &NcclComm,
    device: &Device,
    deadline: Instant,
    keep: Vec<Tensor>,
) -> SysResult<NcclPending> {
    wait_enqueued(comm, deadline)?;
    let event = cuda(device)?.cuda_stream().record_event(None).w()?;
    Ok(NcclPending {
        event,
        _tensors: keep,
    })
}

/// Enqueues the send of `t` (contiguous) on its device's stream.
fn enqueue_send(comm: &mut NcclComm, t: &Tensor, peer: usize) -> SysResult<()> {
    let dev = cuda(t.device())?;
    let stream = dev.cuda_stream();
    let bytes = t.elem_count() * t.dtype().size_in_bytes();
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(not_cuda(t.device()));
    };
    let Some((a, b)) = layout.contiguous_offsets() else {
        return Err(unsupported("the tensor to send is not contiguous".into()));
    };
    fn send<T>(
        comm: &mut NcclComm,
        s: &CudaSlice<T>,
        range: std::ops::Range<usize>,
        bytes: usize,
        peer: usize,
        stream: &Arc<CudaStream>,
    ) -> SysResult<()> {
        let view = s.slice(range);
        // The guard orders the read after the slice's last write and records it as a read,
        // which a later free of the slice waits for.
        let (ptr, _guard) = view.device_ptr(stream);
        // SAFETY: `ptr` addresses `bytes` bytes of `s` (its contiguous range), alive while `s`
        // is, which `NcclPending` keeps; the send is enqueued on `stream`, the stream of `s`'s
        // device, after every kernel that wrote it.
        unsafe { comm.send(ptr, bytes, peer, stream.cu_stream() as *mut c_void) }?;
        Ok(())
    }
    match &cs.slice {
        Slice::U8(s) => send(comm, s, a..b, bytes, peer, &stream),
        Slice::U32(s) => send(comm, s, a..b, bytes, peer, &stream),
        Slice::I64(s) => send(comm, s, a..b, bytes, peer, &stream),
        Slice::BF16(s) => send(comm, s, a..b, bytes, peer, &stream),
        Slice::F16(s) => send(comm, s, a..b, bytes, peer, &stream),
        Slice::F32(s) => send(comm, s, a..b, bytes, peer, &stream),
        Slice::F64(s) => send(comm, s, a..b, bytes, peer, &stream),
        _ => Err(unsupported(format!("dtype {:?} cannot be sent", t.dtype()))),
    }
}

/// Enqueues the receive of a `dtype` tensor of shape `dims` into new memory of `device`.
fn enqueue_recv(
    comm: &mut NcclComm,
    dtype: DType,
    dims: &[usize],
    device: &Device,
    peer: usize,
) -> SysResult<Tensor> {
    let dev = cuda(device)?;
    let n: usize = dims.iter().product();
    let storage = match dtype {
        DType::U8 => recv_typed::<u8>(comm, dev, n, peer)?,
        DType::U32 => recv_typed::<u32>(comm, dev, n, peer)?,
        DType::I64 => recv_typed::<i64>(comm, dev, n, peer)?,
        DType::BF16 => recv_typed::<half::bf16>(comm, dev, n, peer)?,
        DType::F16 => recv_typed::<half::f16>(comm, dev, n, peer)?,
        DType::F32 => recv_typed::<f32>(comm, dev, n, peer)?,
        DType::F64 => recv_typed::<f64>(comm, dev, n, peer)?,
        other => return Err(unsupported(format!("dtype {other:?} cannot be received"))),
    };
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        dims,
        BackpropOp::none(),
        false,
    ))
}

fn recv_typed<T>(
    comm: &mut NcclComm,
    dev: &CudaDevice,
    n: usize,
    peer: usize,
) -> SysResult<candle_core::CudaStorage>
where
    T: DeviceRepr + CudaDType + ValidAsZeroBits,
{
    let stream = dev.cuda_stream();
    let mut dst: CudaSlice<T> = stream.alloc_zeros::<T>(n.max(1)).w()?;
    {
        let mut view = dst.slice_mut(..n);
        // The guard records the write, which later reads of the slice wait for.
        let (ptr, _guard) = view.device_ptr_mut(&stream);
        // SAFETY: `ptr` addresses the `n` elements of `dst`, new memory of this device that
        // nothing else can reach until the receive is enqueued; it is enqueued on `stream`,
        // ordered after the zeroing and before every later use of the tensor.
        unsafe {
            comm.recv(
                ptr,
                n * std::mem::size_of::<T>(),
                peer,
                stream.cu_stream() as *mut c_void,
            )
        }?;
    }
    Ok(T::wrap_cuda_slice(dst, dev.clone()))
}
