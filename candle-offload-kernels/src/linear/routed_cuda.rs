//! The CUDA side of [`ExpertTable`](super::routed::ExpertTable): the table and the routed
//! groups in device memory, `moe_route` and `moe_table_set` (kernels/moe.cu), the grouped
//! kernels' `_at_` twins, and each layer's chosen experts copied back into page-locked memory.

use candle_core::cuda_backend::cudarc::driver::{
    result, sys, CudaEvent, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice,
    PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice as S, WrapErr};
use candle_core::quantized::QTensor;
use candle_core::{CudaDevice, Device, Layout, Result, Tensor, WithDType, D};

use super::cuda::{group_launch, GroupArg};
use super::routed_shape::{ExpertAddrs, RoutedShape};
use crate::cuda::{load, load_named, to_u32, view, LINEAR, MOE};
use crate::linear::MAX_GROUP_EXPERTS;
use crate::util::aligned16;

/// Bytes of kernels/moe.cu's `RoutedGroup`: two `GroupWeights` (16 + 16 addresses each),
/// a `GroupScales` (16 f32) and 16 u32 indices.
const GROUP_BYTES: usize = 2 * 2 * MAX_GROUP_EXPERTS * 8 + 2 * MAX_GROUP_EXPERTS * 4;
/// Offsets in a `RoutedGroup`: the down projections' `GroupWeights`, the scales, the indices.
const DOWN_AT: usize = 2 * MAX_GROUP_EXPERTS * 8;
const SCALES_AT: usize = 2 * DOWN_AT;
const IDS_AT: usize = SCALES_AT + MAX_GROUP_EXPERTS * 4;
/// `MOE_TABLE_SET_MAX` in kernels/moe.cu.
const SET_MAX: usize = 32;

/// kernels/moe.cu's `TableEntries`.
#[repr(C)]
#[derive(Clone, Copy)]
struct TableEntries {
    at: [u32; SET_MAX],
    ptr: [u64; SET_MAX],
}
// SAFETY: plain data laid out as `TableEntries` in kernels/moe.cu (32 u32, then 32 u64 at
// offset 128, no padding), which `moe_table_set` takes by value.
unsafe impl DeviceRepr for TableEntries {}

pub(super) struct Table {
    dev: CudaDevice,
    table: CudaSlice<u64>,
    groups: CudaSlice<u8>,
    /// The device addresses of `table` and `groups`.
    table_at: u64,
    groups_at: u64,
    /// Per layer, its last row's chosen experts (the `ids` of its group, `MAX_GROUP_EXPERTS`
    /// u32 a layer), copied back by plain copies (no event of cudarc's: a captured step's copy
    /// would leave one that cannot be waited on), and its address.
    chosen: PinnedHostSlice<u32>,
    chosen_at: usize,
    /// Recorded after the copies of an eager row, and by [`record_copied`](Self::record_copied)
    /// after a captured step's launch: what [`chosen`](Self::chosen) waits for.
    copied: CudaEvent,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExpertTable({} entries)", self.table.len())
    }
}

impl Table {
    pub(super) fn new(device: &Device, layers: usize, experts: usize) -> Result<Self> {
        let Device::Cuda(dev) = device else {
            candle_core::bail!("expert table: {device:?} is not a GPU")
        };
        let stream = dev.cuda_stream();
        let table = stream.alloc_zeros::<u64>(layers * experts * 3).w()?;
        let groups = stream.alloc_zeros::<u8>(layers.max(1) * GROUP_BYTES).w()?;
        let table_at = table.device_ptr(&stream).0;
        let groups_at = groups.device_ptr(&stream).0;
        let ctx = stream.context();
        // SAFETY: uninitialised page-locked memory, zeroed here before any copy into it (the
        // copies `forward` enqueues write whole layers' ids).
        let mut chosen =
            unsafe { ctx.alloc_pinned::<u32>(layers.max(1) * MAX_GROUP_EXPERTS) }.w()?;
        chosen.as_mut_slice().w()?.fill(0);
        let chosen_at = chosen.as_mut_ptr().w()? as usize;
        let copied = ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .w()?;
        Ok(Self {
            dev: dev.clone(),
            table,
            groups,
            table_at,
            groups_at,
            chosen,
            chosen_at,
            copied,
        })
    }

    pub(super) fn set(
        &self,
        experts: usize,
        entries: &[(usize, usize, ExpertAddrs)],
    ) -> Result<()> {
        let func = load_named(&self.dev, MOE, "moe_table_set")?;
        let stream = self.dev.cuda_stream();
        // Three entries (gate, up, down) an expert.
        let flat: Vec<(u32, u64)> = entries
            .iter()
            .flat_map(|&(l, e, a)| (0..3).map(move |j| (((l * experts + e) * 3 + j) as u32, a[j])))
            .collect();
        for chunk in flat.chunks(SET_MAX) {
            let mut t = TableEntries {
                at: [0; SET_MAX],
                ptr: [0; SET_MAX],
            };
            for (i, &(at, p)) in chunk.iter().enumerate() {
                t.at[i] = at;
                t.ptr[i] = p;
            }
            let n = chunk.len() as u32;
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (SET_MAX as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&func);
            b.arg(&self.table).arg(&t).arg(&n);
            // SAFETY: `moe_table_set(uint64_t* table, TableEntries e, uint32_t n)` in
            // kernels/moe.cu writes table[e.at[i]] for i < n: each index is an entry of a
            // layer and expert `ExpertTable::set` checked, inside the table's
            // layers · experts · 3 entries.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(())
    }

    pub(super) fn forward(
        &self,
        layer: usize,
        experts: usize,
        x: &Tensor,
        logits: &Tensor,
        shape: &RoutedShape,
    ) -> Result<Tensor> {
        if (layer + 1) * GROUP_BYTES > self.groups.len() {
            candle_core::bail!("expert table: no routed group of layer {layer}");
        }
        let hidden = x.dim(D::Minus1)?;
        let x2 = x.reshape((1, hidden))?;
        let x2 = if aligned16(x2.layout(), x2.dtype()) && x2.is_contiguous() {
            x2
        } else {
            x2.force_contiguous()?
        };
        let logits = logits.flatten_all()?.contiguous()?;
        let out = {
            let (xs, xl) = x2.storage_and_layout();
            let (ls, ll) = logits.storage_and_layout();
            let (candle_core::Storage::Cuda(xs), candle_core::Storage::Cuda(ls)) = (&*xs, &*ls)
            else {
                candle_core::bail!("expert table: the row and the logits have to be on the GPU")
            };
            let S::F32(lv) = &ls.slice else {
                candle_core::bail!("expert table: the logits have to be F32")
            };
            let logits = view(lv, ll, "logits")?;
            self.route(layer, experts, &logits, shape)?;
            let slice = match &xs.slice {
                S::F32(v) => S::F32(self.experts(layer, (v, xl), shape)?),
                S::F16(v) => S::F16(self.experts(layer, (v, xl), shape)?),
                S::BF16(v) => S::BF16(self.experts(layer, (v, xl), shape)?),
                _ => candle_core::bail!("expert table: unsupported dtype {:?}", x.dtype()),
            };
            CudaStorage {
                slice,
                device: self.dev.clone(),
            }
        };
        // The chosen experts, back to the host behind the row's kernels.
        let stream = self.dev.cuda_stream();
        let ids_at = self.groups_at + (layer * GROUP_BYTES + IDS_AT) as u64;
        let dst = (self.chosen_at + layer * MAX_GROUP_EXPERTS * 4) as *mut u32;
        // SAFETY: `dst` is layer `layer`'s MAX_GROUP_EXPERTS u32 of `chosen` (page-locked,
        // layers · MAX_GROUP_EXPERTS long, alive as long as `self`; `layer` < layers, checked by
        // `ExpertTable::forward`), read on the host only by `chosen` after the event recorded
        // behind this copy; `ids_at` is the layer's group's MAX_GROUP_EXPERTS u32 indices,
        // inside `groups`. The copy is in stream order after `moe_route` wrote them.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(dst, MAX_GROUP_EXPERTS);
            result::memcpy_dtoh_async(dst, ids_at, stream.cu_stream())
        }
        .w()?;
        if stream.capture_status().w()? == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        {
            self.record_copied()?;
        }
        Ok(Tensor::from_storage(
            candle_core::Storage::Cuda(out),
            x.shape().clone(),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }

    /// `moe_route` for `layer`'s group.
    fn route(
        &self,
        layer: usize,
        experts: usize,
        logits: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, f32>,
        shape: &RoutedShape,
    ) -> Result<()> {
        let func = load_named(&self.dev, MOE, "moe_route")?;
        let stream = self.dev.cuda_stream();
        let table = self.table_at + (layer * experts * 3 * 8) as u64;
        let group = self.groups_at + (layer * GROUP_BYTES) as u64;
        let (e, k, renorm) = (
            to_u32(experts, "experts")?,
            to_u32(shape.top_k, "experts a token")?,
            u32::from(shape.renormalize),
        );
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(logits)
            .arg(&e)
            .arg(&k)
            .arg(&renorm)
            .arg(&table)
            .arg(&group);
        // SAFETY: `moe_route(const float* logits, uint32_t experts, uint32_t k, uint32_t
        // renorm, const uint64_t* table, RoutedGroup* out)` in kernels/moe.cu, one warp: it
        // reads `experts` logits (the view holds that many, checked by `ExpertTable::forward`),
        // the layer's experts · 3 table entries (inside the table), and writes k ≤
        // MAX_GROUP_EXPERTS (checked by `RoutedShape::fits`) entries of the layer's group,
        // GROUP_BYTES inside `groups`.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// The grouped SwiGLU, down and weighted-sum launches over `layer`'s group.
    fn experts<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        layer: usize,
        (x, xl): (&CudaSlice<T>, &Layout),
        shape: &RoutedShape,
    ) -> Result<CudaSlice<T>> {
        let dev = &self.dev;
        let (hidden, inter, k) = (shape.hidden, shape.inter, shape.top_k);
        let x = view(x, xl, "x")?;
        let group = self.groups_at + (layer * GROUP_BYTES) as u64;
        let stream = dev.cuda_stream();
        // SAFETY: uninitialised device memory on the device's stream: k rows of `inter`
        // columns, each written by the SwiGLU launch (its grid covers every expert's columns)
        // before the down launch reads them; then k rows of `hidden` by the down launch before
        // the weighted sum reads them; `out` written whole by the sum (accumulate = 0).
        let act = unsafe { dev.alloc::<T>(k * inter) }?;
        group_launch(
            dev,
            shape.gate,
            (&x, 0),
            GroupArg::At(group),
            &act,
            [inter, inter],
            hidden,
            true,
            k,
        )?;
        // SAFETY: as `act`'s.
        let ys = unsafe { dev.alloc::<T>(k * hidden) }?;
        let act_view = act.slice(..);
        group_launch(
            dev,
            shape.down,
            (&act_view, inter),
            GroupArg::At(group + DOWN_AT as u64),
            &ys,
            [hidden, 0],
            inter,
            false,
            k,
        )?;
        // SAFETY: as `act`'s.
        let out = unsafe { dev.alloc::<T>(hidden) }?;
        let func = load::<T>(dev, LINEAR, "experts_weighted_sum_at")?;
        let cfg = LaunchConfig {
            grid_dim: (to_u32(hidden.div_ceil(256), "blocks")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (scales, n, count, accumulate) = (
            group + SCALES_AT as u64,
            to_u32(hidden, "width")?,
            k as u32,
            0u32,
        );
        let mut b = stream.launch_builder(&func);
        b.arg(&ys)
            .arg(&out)
            .arg(&scales)
            .arg(&count)
            .arg(&n)
            .arg(&accumulate);
        // SAFETY: `experts_weighted_sum_at_<dtype>(const T* y, T* out, const GroupScales* s,
        // uint32_t experts, uint32_t n, uint32_t accumulate)` in kernels/linear.cu: y holds k
        // rows of n (written above), out n elements, s the layer's group's scales (written by
        // moe_route before, in stream order); one thread per column, the grid covers n.
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }

    /// Records `copied` behind the work enqueued so far.
    pub(super) fn record_copied(&self) -> Result<()> {
        self.copied.record(&self.dev.cuda_stream()).w()
    }

    pub(super) fn chosen(&self, layer: usize, k: usize) -> Result<Vec<u32>> {
        if (layer + 1) * MAX_GROUP_EXPERTS > self.chosen.len() {
            candle_core::bail!("expert table: no chosen experts of layer {layer}");
        }
        self.copied.synchronize().w()?;
        let at = (self.chosen_at + layer * MAX_GROUP_EXPERTS * 4) as *const u32;
        // SAFETY: layer `layer`'s MAX_GROUP_EXPERTS u32 inside `chosen` (`layer` < layers,
        // checked by `ExpertTable::chosen`), written by copies that completed before the event
        // just waited for (or zero).
        let ids = unsafe { std::slice::from_raw_parts(at, MAX_GROUP_EXPERTS) };
        Ok(ids[..k].to_vec())
    }
}

pub(super) fn qtensor_addr(q: &QTensor) -> Result<u64> {
    let Device::Cuda(dev) = q.device() else {
        candle_core::bail!("expert table: a quantized tensor is not on the GPU")
    };
    let stream = dev.cuda_stream();
    let (at, _guard) = q.device_ptr_with_guard(&stream)?;
    if !(at as usize).is_multiple_of(16) {
        candle_core::bail!("expert table: an expert's blocks are not 16-byte aligned");
    }
    Ok(at as u64)
}
