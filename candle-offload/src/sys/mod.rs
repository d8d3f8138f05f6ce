//! The only module that talks to the OS and the CUDA driver, and the only one with `unsafe`.
//!
//! It selects `cuda.rs` (page-locked buffers, the copy stream, events) or `nocuda.rs` (the same
//! API with uninhabited types, so a CPU build has no `cfg` anywhere else), and holds the one
//! memory map used to stream safetensors into the store. Every `unsafe` block carries a
//! `// SAFETY:` comment.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
mod imp;
#[cfg(not(feature = "cuda"))]
#[path = "nocuda.rs"]
mod imp;

pub(crate) use imp::{
    device_info, device_used_bytes, measure_h2d_gbps, pci_bus_id, pool_used_high_bytes,
    set_peer_access, trim_memory_pool, try_pin, CudaEngine, PinnedBuffer, Pinner, UnitSync,
};

/// A read-only memory map of a weights file.
#[derive(Debug)]
pub(crate) struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl MappedFile {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::File {
            path: path.to_path_buf(),
            reason: format!("cannot open: {e}"),
        })?;
        // SAFETY: the map is read-only and private to this process. The contract of `Mmap::map`
        // is that the file is not truncated or written while mapped; weights files are not
        // modified while a model loads, and the map lives only until the store is built.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::File {
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
