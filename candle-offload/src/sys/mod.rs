//! The only module that talks to the OS and the CUDA driver, and the only one with `unsafe`.
//!
//! It selects `cuda.rs` (page-locked buffers, the copy stream, events) or `nocuda.rs` (the same
//! API with uninhabited types, so a CPU build has no `cfg` anywhere else), and holds the one
//! memory map used to stream safetensors into the store and the disk tier's reads (`disk.rs`).
//! Every `unsafe` block carries a `// SAFETY:` comment.
//!
//! This module is the leaf of the crate: it imports nothing from it (only from the kernels crate
//! below it, `candle_offload_kernels`, whose ops `cuda.rs` launches). It speaks in plain bytes,
//! Candle types and its own [`SysError`] (converted upward in `error.rs`); the store's units
//! reach it as a [`HostTier`] (where the bytes live) and a list of [`UploadItem`]s (what to
//! make of them on the device).

use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Shape, Tensor};

mod disk;
mod nccl;
mod nccl_comm;

pub(crate) use disk::{Conversion, DiskFile, DiskTier, ReadAhead, ReadPool, ReadShape, Segment};
pub use nccl::{find_nccl, python_nccl_dirs, NcclFound, NcclSearch};
pub(crate) use nccl_comm::{CommState, NcclComm, NcclError, NcclLib, NcclUniqueId};

#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
mod imp;
#[cfg(not(feature = "cuda"))]
#[path = "nocuda.rs"]
mod imp;

#[cfg(feature = "cuda")]
mod cuda_nccl;
#[cfg(feature = "cuda")]
pub(crate) use cuda_nccl::{nccl_bind, nccl_loopback, nccl_recv, nccl_send, NcclPending};
#[cfg(not(feature = "cuda"))]
pub(crate) use imp::{nccl_bind, nccl_loopback, nccl_recv, nccl_send, NcclPending};
#[cfg(feature = "cuda")]
mod managed;
#[cfg(feature = "cuda")]
pub(crate) use managed::{um_table, ManagedBuffer};

pub(crate) use imp::{
    context_memory, device_info, device_used_bytes, has_long_lived_pool, keep_pool_memory,
    long_lived, measure_h2d_gbps, pci_bus_id, pool_reserved_high_bytes, pool_used_high_bytes,
    profile_mark, profiler_capture, set_event_tracking, set_peer_access, trim_memory_pool,
    trim_memory_pool_to, trim_weight_pool, try_pin, CudaEngine, Downloader, Pinner, StepGraph,
    UnitSync,
};
#[cfg(not(feature = "cuda"))]
pub(crate) use imp::{um_table, ManagedBuffer};

/// Elements of padding Candle's CUDA quantized storage keeps after a GGML tensor's blocks
/// (`candle_core::quantized::cuda::MATRIX_ROW_PADDING`, checked against it in CUDA builds):
/// its matmul kernels read whole padded rows.
pub(crate) const GGML_ROW_PADDING_ELEMS: usize = 512;

/// What an upload did with the evicted units' GGML buffers it was offered (the spares).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SpareUse {
    /// Buffers its tensors took as they were (the same type, shape and size).
    pub taken: u64,
    /// Whether it freed spares whose room its new allocations do not take back at the same
    /// sizes ([`frees_reallocated`]): the weight pool then keeps that room beside what it maps
    /// for the new buffers, until it is trimmed.
    pub stranded: bool,
}

/// What an upload does with the spares its tensors did not take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UntakenSpares {
    /// Kept for the next fetch: the upload allocates nothing, so holding them takes no more
    /// room than the evicted units held (experts of one shape replacing each other).
    Keep,
    /// Freed before the upload allocates (held, they would sit in room the budget gives to
    /// its allocations); `stranded` as [`SpareUse::stranded`].
    Free { stranded: bool },
}

/// The fate of the spares an upload did not take (their buffer sizes, `untaken`), where
/// `allocates` says whether it allocates anything new (dense tensors, or blocks no spare
/// matched) and `allocated` gives the sizes of the GGML buffers it allocates.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn untaken_spares(
    untaken: &[usize],
    allocated: &[usize],
    allocates: bool,
) -> UntakenSpares {
    if allocates {
        UntakenSpares::Free {
            stranded: !frees_reallocated(untaken, allocated),
        }
    } else {
        UntakenSpares::Keep
    }
}

/// Bytes Candle's CUDA quantized storage allocates for `blocks_len` bytes of `ggml` blocks: the
/// blocks and the row padding after them (`QCudaStorage::zeros`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn ggml_buffer_len(ggml: candle_core::quantized::GgmlDType, blocks_len: usize) -> usize {
    blocks_len + GGML_ROW_PADDING_ELEMS.div_ceil(ggml.block_size()) * ggml.type_size()
}

/// Whether the buffers an upload freed (their byte sizes, `freed`) are taken back one for one
/// by its new allocations of the same sizes (`allocated`). A stream-ordered pool serves an
/// allocation from a block freed earlier on the same stream at once, so an exact size comes
/// back out of the freed block: a Q6_K buffer freed for a Q4_K tensor of the same padded size
/// (layers of mixed block types streaming at one size) costs nothing. A freed size that no new
/// allocation takes leaves room in the pool that the budget no longer counts.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn frees_reallocated(freed: &[usize], allocated: &[usize]) -> bool {
    let mut left = allocated.to_vec();
    freed
        .iter()
        .all(|f| match left.iter().position(|a| a == f) {
            Some(k) => {
                left.swap_remove(k);
                true
            }
            None => false,
        })
}

/// Allocation granule of a unit in managed memory: 2 MiB, the GPU's large page, so that a
/// unit's pages on the device never exceed its size rounded up to it (the size the budget
/// counts for it).
pub(crate) const MANAGED_GRANULE: usize = 2 << 20;

/// Bytes a unit of `len` bytes allocates in managed memory: whole granules, at least one.
pub(crate) fn managed_alloc_len(len: usize) -> usize {
    len.max(1).div_ceil(MANAGED_GRANULE) * MANAGED_GRANULE
}

/// One row of the seed's Unified Memory table (`um_table`): how data written on the host
/// reaches a GPU kernel that reads it, the device memory that took and the time it took.
#[derive(Debug, Clone, PartialEq)]
pub struct UmRow {
    /// `plain copy`, `Unified Memory`, `Unified Memory, prefetched`, and `prefetched, then
    /// back to the host` (the device memory the driver still holds after the migration back).
    pub name: &'static str,
    /// Device memory in use at the end less at the start, as the driver reports it.
    pub device_bytes: u64,
    /// Host memory the data took.
    pub host_bytes: u64,
    /// Seconds from the data on the host to the kernel's result.
    pub seconds: f64,
    /// For a prefetch: seconds until `cuMemPrefetchAsync` returned to the host (close to
    /// `seconds` when the driver migrates inside the call rather than on the stream).
    pub enqueue_seconds: Option<f64>,
}

/// What can go wrong in this module.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum SysError {
    /// A file that could not be opened or mapped.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The operation needs a CUDA build.
    #[cfg_attr(feature = "cuda", allow(dead_code))]
    #[error("{what} needs a build with `--features cuda`")]
    NotCompiledWithCuda {
        /// What was asked for.
        what: &'static str,
    },
    /// A setting this machine or device cannot honour.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    #[error("{field}: {reason}")]
    Unsupported {
        /// The setting.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// An error from Candle or the CUDA driver.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// An error from NCCL, or a communicator that failed.
    #[error(transparent)]
    Nccl(#[from] NcclError),
}

impl From<SysError> for candle_core::Error {
    fn from(e: SysError) -> Self {
        match e {
            SysError::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// `Result` with [`SysError`].
pub(crate) type SysResult<T> = std::result::Result<T, SysError>;

/// Device-side timings of one fetch, harvested once its events have completed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Timings {
    /// Seconds the copy engine spent on the unit (None when not measured yet or already counted).
    pub copy_s: Option<f64>,
    /// Seconds compute waited for the unit to arrive.
    pub stall_s: f64,
}

/// Identity and memory of a GPU as the driver reports them (raw integers; `diag` makes a
/// `DeviceInfo` of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuFacts {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (u32, u32),
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// `cuDriverGetVersion` (13000 is 13.0).
    pub driver_version: Option<i32>,
    /// The CUDA version the binary was built against, in the same form.
    pub built_version: Option<i32>,
    /// `CUDA_COMPUTE_CAP` at build time.
    pub compiled_arch: Option<String>,
    /// `CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY`: managed (Unified Memory) allocations work.
    pub managed_memory: bool,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`: the CPU and the GPU may touch managed
    /// memory at the same time, pages migrate on demand, and prefetch/advice apply.
    pub concurrent_managed_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`: the GPU reads ordinary host memory
    /// (HMM/ATS).
    pub pageable_memory_access: bool,
}

/// Where a unit's host bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TierKind {
    /// Page-locked host memory: copies from it are true asynchronous DMA.
    Pinned,
    /// Ordinary host memory: on a GPU its copies go through the pinned staging ring.
    Pageable,
    /// The checkpoint file: read on demand (positioned reads, O_DIRECT or the page cache), into
    /// the pinned staging ring on a GPU or a fresh copy on the CPU.
    Disk,
    /// CUDA managed (Unified) memory, preferring the host: the engine migrates a unit's pages
    /// to the GPU with a prefetch on the copy stream instead of copying them, and back after
    /// last use (`--engine managed`).
    Managed,
}

impl std::fmt::Display for TierKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Pinned => "pinned",
            Self::Pageable => "pageable",
            Self::Disk => "disk",
            Self::Managed => "managed",
        })
    }
}

/// A storage tier: the bytes of one unit, wherever they live. The store and the copy engines
/// use units only through this interface; a new tier (a memory-mapped file, managed memory)
/// is one implementation plus a case in `Pinner::alloc` that chooses it.
pub(crate) trait HostTier: Send + Sync + std::fmt::Debug {
    /// Which tier this is (for statistics and messages).
    fn kind(&self) -> TierKind;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// The bytes, when they sit in host memory the CPU can read directly (`None` for a tier
    /// that must be read, such as a file on disk). They start at a [`TIER_ALIGN`] boundary.
    fn bytes(&self) -> Option<&[u8]>;
    /// The bytes for writing (building the store, `update_weights`); `None` for a read-only
    /// tier.
    fn bytes_mut(&mut self) -> Option<&mut [u8]>;
    /// Whether the copy engine may DMA straight out of [`bytes`](Self::bytes): true only for
    /// page-locked memory; other tiers go through the staging ring.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn dma_ready(&self) -> bool {
        self.kind() == TierKind::Pinned
    }
    /// Starts reading the whole unit into host memory on one of `pool`'s threads, so that
    /// the next reads find it there; true when a read was started. Only tiers without host
    /// bytes (the disk) do anything.
    fn read_ahead(&self, _pool: &ReadPool) -> bool {
        false
    }
    /// Where its read-ahead stands.
    fn read_ahead_state(&self) -> ReadAhead {
        ReadAhead::None
    }
    /// Whether its reads bypass the page cache (O_DIRECT); false for memory tiers.
    fn reads_direct(&self) -> bool {
        false
    }
    /// Frees the read-ahead's bytes (the fetch that used them is done, or the plan no longer
    /// needs them); a read not started yet is skipped.
    fn end_read_ahead(&self) {}
    /// The managed-memory buffer behind this tier, for the engine that migrates its pages
    /// instead of copying them; `None` for every other tier.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn managed(&self) -> Option<&ManagedBuffer> {
        None
    }
    /// Copies `range` into `dst` (of the same length). The default reads from
    /// [`bytes`](Self::bytes); a tier without them overrides it.
    fn read_into(&self, range: Range<usize>, dst: &mut [u8]) -> std::io::Result<()> {
        let src = self.bytes().ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                format!("a {} tier must implement read_into", self.kind()),
            )
        })?;
        let src = src.get(range.clone()).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("range {range:?} is past the end ({} bytes)", src.len()),
            )
        })?;
        if src.len() != dst.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("reading {} bytes into {}", src.len(), dst.len()),
            ));
        }
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// Alignment of the start of every tier's buffer: tensors at aligned offsets in it can be
/// viewed as any element or GGML block type.
pub(crate) const TIER_ALIGN: usize = 256;

/// One aligned chunk of a [`PageableBuffer`].
#[derive(Clone, Copy)]
#[repr(C, align(256))]
struct Chunk([u8; TIER_ALIGN]);

/// Ordinary heap memory, its start aligned to [`TIER_ALIGN`].
pub(crate) struct PageableBuffer {
    chunks: Vec<Chunk>,
    len: usize,
}

impl std::fmt::Debug for PageableBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageableBuffer({} bytes)", self.len)
    }
}

impl PageableBuffer {
    pub(crate) fn zeroed(len: usize) -> Self {
        Self {
            chunks: vec![Chunk([0; TIER_ALIGN]); len.div_ceil(TIER_ALIGN)],
            len,
        }
    }
}

impl HostTier for PageableBuffer {
    fn kind(&self) -> TierKind {
        TierKind::Pageable
    }
    fn len(&self) -> usize {
        self.len
    }
    fn bytes(&self) -> Option<&[u8]> {
        // SAFETY: `chunks` holds `len.div_ceil(TIER_ALIGN) * TIER_ALIGN >= len` initialised
        // bytes (`Chunk` is `repr(C)` around a byte array, so it has no padding) and lives as
        // long as the returned borrow of `self`.
        Some(unsafe { std::slice::from_raw_parts(self.chunks.as_ptr().cast::<u8>(), self.len) })
    }
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        // SAFETY: as in `bytes`; `&mut self` makes the borrow exclusive.
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.chunks.as_mut_ptr().cast::<u8>(), self.len)
        })
    }
}

/// What the copy engine makes of one tensor's bytes on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DeviceLayout {
    /// A Candle tensor of this dtype.
    Dense(DType),
    /// Raw GGML blocks, in a buffer of `device_len` bytes (the blocks, then zeroed padding).
    Blocks {
        /// The GGML type.
        ggml: GgmlDType,
        /// Bytes to allocate on the device.
        device_len: usize,
    },
}

/// One tensor for `CudaEngine::upload`: a byte range of the unit's tier and its layout.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct UploadItem<'a> {
    /// Full name (for messages).
    pub name: &'a str,
    /// Bytes in the tier.
    pub range: Range<usize>,
    /// Shape.
    pub shape: &'a Shape,
    /// What to make of it.
    pub layout: DeviceLayout,
}

/// One uploaded tensor.
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum DeviceWeight {
    /// A Candle tensor.
    Dense(Tensor),
    /// GGML blocks in device memory, as a Candle quantized tensor.
    Blocks(Box<candle_core::quantized::QTensor>),
}

/// A read-only memory map of a weights file.
#[derive(Debug)]
pub(crate) struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl MappedFile {
    pub(crate) fn open(path: &Path) -> SysResult<Self> {
        let file = std::fs::File::open(path).map_err(|e| SysError::File {
            path: path.to_path_buf(),
            reason: format!("cannot open: {e}"),
        })?;
        // SAFETY: the map is read-only and private to this process. The contract of `Mmap::map`
        // is that the file is not truncated or written while mapped; weights files are not
        // modified while a model loads, and the map lives only until the store is built.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| SysError::File {
            path: path.to_path_buf(),
            reason: format!("cannot map: {e}"),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
        })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn frees_are_reallocated_one_for_one_by_size() {
        use super::frees_reallocated;
        // Nothing freed: nothing stranded, whatever was allocated.
        assert!(frees_reallocated(&[], &[]));
        assert!(frees_reallocated(&[], &[10, 20]));
        // Each freed size taken back once, in any order.
        assert!(frees_reallocated(&[20, 10], &[10, 20, 30]));
        assert!(frees_reallocated(&[10, 10], &[10, 30, 10]));
        // A size allocated once cannot take two frees, nor a near size one.
        assert!(!frees_reallocated(&[10, 10], &[10, 30]));
        assert!(!frees_reallocated(&[10], &[11]));
        assert!(!frees_reallocated(&[10], &[]));
    }

    #[test]
    fn untaken_spares_stay_unless_the_upload_allocates() {
        use super::{untaken_spares, UntakenSpares};
        // Every tensor took a spare: the rest wait for the next fetch, whatever their sizes.
        assert_eq!(
            untaken_spares(&[10, 10, 20], &[], false),
            UntakenSpares::Keep
        );
        assert_eq!(untaken_spares(&[], &[], false), UntakenSpares::Keep);
        // Allocations of the freed sizes take their room back.
        assert_eq!(
            untaken_spares(&[10, 20], &[20, 10], true),
            UntakenSpares::Free { stranded: false }
        );
        // A dense allocation (no GGML size) or another size leaves the freed room behind.
        assert_eq!(
            untaken_spares(&[10], &[], true),
            UntakenSpares::Free { stranded: true }
        );
        assert_eq!(
            untaken_spares(&[10], &[12], true),
            UntakenSpares::Free { stranded: true }
        );
        assert_eq!(
            untaken_spares(&[], &[12], true),
            UntakenSpares::Free { stranded: false }
        );
    }

    #[test]
    fn ggml_buffers_hold_the_row_padding_candle_adds() {
        use candle_core::quantized::GgmlDType;
        // 512 elements: two Q4_K (144 bytes) or Q6_K (210 bytes) blocks, sixteen Q8_0 blocks.
        assert_eq!(super::ggml_buffer_len(GgmlDType::Q4K, 1440), 1440 + 288);
        assert_eq!(super::ggml_buffer_len(GgmlDType::Q6K, 2100), 2100 + 420);
        assert_eq!(super::ggml_buffer_len(GgmlDType::Q8_0, 340), 340 + 16 * 34);
    }

    use super::*;

    #[test]
    fn pageable_tier_reads_ranges_and_refuses_bad_ones() {
        let mut t = PageableBuffer::zeroed(8);
        t.bytes_mut()
            .unwrap()
            .copy_from_slice(&[0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(t.bytes().unwrap().as_ptr() as usize % TIER_ALIGN, 0);
        assert_eq!(PageableBuffer::zeroed(0).bytes().unwrap().len(), 0);
        assert_eq!(PageableBuffer::zeroed(300).bytes().unwrap().len(), 300);
        assert_eq!(t.kind(), TierKind::Pageable);
        assert!(!t.dma_ready());
        let mut dst = [0u8; 3];
        t.read_into(2..5, &mut dst).unwrap();
        assert_eq!(dst, [2, 3, 4]);
        assert!(t.read_into(6..9, &mut dst).is_err());
        assert!(t.read_into(0..2, &mut dst).is_err());
    }
}
