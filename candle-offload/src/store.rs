//! The host store: every weight, loaded once into (preferably page-locked) host memory,
//! grouped into units that move to the device together.
//!
//! Tensors are grouped by name: `model.layers.7.mlp.up_proj.weight` belongs to the unit
//! `model.layers.7` (see [`UnitGrouping`]); anything else belongs to its module
//! (`model.embed_tokens`, `lm_head`). Each unit is one contiguous host buffer with its tensors
//! at 256-byte aligned offsets, converted to the store's dtype on the way in.
//!
//! Each tensor carries its [`WeightFormat`]: a dense Candle dtype, or a GGML quantized type
//! kept as its raw blocks. The store and the copy engines move the bytes without looking at
//! them; the format decides the host size, the device size the budget counts, and what an
//! acquired unit hands out (a `Tensor` or a `QTensor`).
//!
//! Where a unit's bytes live is its storage tier (`TierKind`: pinned, pageable or disk), behind
//! one interface (`sys::HostTier`) that the store and the copy engines use without knowing
//! which tier it is.
//!
//! The store holds at most [`StoreConfig::host_memory_limit`] bytes in host memory (by default
//! 3/4 of the machine's RAM, [`default_host_limit`]). Units are placed in unit order (the
//! non-layer units, embeddings, norms and head, first, then the layers by index), each in
//! memory while it fits under the cap; a unit that does not fit stays in its checkpoint file
//! (the disk tier: safetensors, or any file its loader locates each tensor in with a
//! [`FileSource`], such as a GGUF), so with a small cap the last layers are the ones read from
//! disk, on every fetch: with O_DIRECT where the file system allows it, otherwise through the
//! page cache ([`StoreConfig::disk_page_cache`]).
//!
//! On a CUDA device the buffers are pinned (page-locked, portable, not write-combined, so the
//! CPU can still read them) up to a cap; past the cap, or where pinning fails, a unit stays in
//! pageable memory and its transfers go through the runtime's small pinned staging ring, with a
//! warning. Loading from safetensors streams tensor by tensor out of the memory-mapped file, so
//! the model is never held twice.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{CpuStorage, DType, Device, Shape, Tensor};

use crate::budget::{human_bytes, MemoryLimit};
use crate::cache::UnitId;
use crate::error::{Error, Result};
use crate::sys::{self, HostTier};

pub use crate::sys::TierKind;

/// Alignment of each tensor inside a unit's buffer (whose start is aligned to
/// `sys::TIER_ALIGN`, a multiple of it).
const TENSOR_ALIGN: usize = 256;
const _: () = assert!(sys::TIER_ALIGN.is_multiple_of(TENSOR_ALIGN));

/// How tensor names map to units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitGrouping {
    /// Prefixes followed by a layer index: `model.layers.` makes `model.layers.7` a unit.
    pub layer_prefixes: Vec<String>,
}

impl Default for UnitGrouping {
    /// The decoder-layer prefixes of the HF LLaMA family, GPT-2 style and GGUF (`blk.N`).
    fn default() -> Self {
        Self {
            layer_prefixes: [
                "model.layers.",
                "layers.",
                "transformer.h.",
                "model.decoder.layers.",
                "blk.",
            ]
            .into_iter()
            .map(String::from)
            .collect(),
        }
    }
}

impl UnitGrouping {
    /// Groups by these prefixes (each followed by a layer index).
    pub fn by_prefixes<S: AsRef<str>>(prefixes: &[S]) -> Self {
        Self {
            layer_prefixes: prefixes.iter().map(|p| p.as_ref().to_string()).collect(),
        }
    }

    /// The unit a tensor belongs to, and for layer units the layer index.
    pub fn unit_of(&self, tensor: &str) -> (String, Option<usize>) {
        for p in &self.layer_prefixes {
            if let Some(rest) = tensor.strip_prefix(p.as_str()) {
                let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
                let after = &rest[digits.len()..];
                if !digits.is_empty() && (after.is_empty() || after.starts_with('.')) {
                    if let Ok(idx) = digits.parse() {
                        return (format!("{p}{digits}"), Some(idx));
                    }
                }
            }
        }
        match tensor.rsplit_once('.') {
            Some((module, _)) => (module.to_string(), None),
            None => (tensor.to_string(), None),
        }
    }
}

/// Settings of a [`HostStore`].
#[derive(Debug, Clone, Default)]
pub struct StoreConfig {
    /// Convert floating-point tensors to this dtype on load (usually the compute dtype, which
    /// also halves the bytes moved for an F32 checkpoint run in F16). `None` keeps each dtype.
    pub dtype: Option<DType>,
    /// At most this many bytes of page-locked host memory; `None` for no cap.
    pub pinned_cap_bytes: Option<u64>,
    /// At most this much host memory (pinned and pageable together) for the weights: a size,
    /// or a share (`%`) of the machine's RAM. Units past it stay in their checkpoint file and
    /// are read from it on every fetch (the disk tier: safetensors, and stores built with
    /// [`HostStore::from_raw_in_files`], such as a GGUF's). `None` is the
    /// default, 3/4 of the machine's RAM ([`default_host_limit`]). A cap smaller than the
    /// largest unit is refused.
    pub host_memory_limit: Option<MemoryLimit>,
    /// How tensor names map to units.
    pub grouping: UnitGrouping,
    /// Read the disk tier through the page cache even where the file system allows O_DIRECT.
    /// By default (false) disk units are read with O_DIRECT where it works (the page cache
    /// cannot hold what did not fit under the cap anyway, and copying through it costs a
    /// copy and evicts other files), falling back to the page cache with one warning naming
    /// the file; the summary says which.
    pub disk_page_cache: bool,
    /// How weights reach the GPU: copied from host memory (the default), or migrated in
    /// managed (Unified) memory.
    pub engine: EngineKind,
    /// How the disk tier cuts its reads ([`crate::Tuning::disk`]).
    pub disk_reads: crate::tuning::DiskTuning,
}

/// How the store's weights reach the GPU (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum EngineKind {
    /// Units in page-locked (or pageable) host memory, copied into device buffers on the copy
    /// stream.
    #[default]
    Explicit,
    /// Units in CUDA managed memory preferring the host, migrated to the GPU with a prefetch
    /// on the copy stream before use and back after last use, following the same plan and
    /// budget (the seed's Unified Memory). Each unit's device footprint is its size rounded
    /// up to 2 MiB. GPU only, and only for models that fit the budget: the driver keeps the
    /// device memory of pages it migrated back, so a runtime whose managed units would stream
    /// is refused. Quantized blocks are still copied (Candle's quantized storage cannot point
    /// into memory it did not allocate).
    Managed,
}

impl std::str::FromStr for EngineKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "explicit" | "copy" => Ok(Self::Explicit),
            "managed" | "um" | "unified" => Ok(Self::Managed),
            other => Err(Error::InvalidConfig {
                field: "engine".into(),
                reason: format!("{other:?} is not an engine (explicit or managed)"),
            }),
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Explicit => "explicit",
            Self::Managed => "managed",
        })
    }
}

/// How a tensor's bytes are laid out: the data the store and the copy engines carry with
/// each tensor, instead of assuming a Candle dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WeightFormat {
    /// A Candle dtype, little-endian, row-major: fetched as a `Tensor`.
    Dense(DType),
    /// GGML blocks of this type, as a GGUF file holds them: fetched as a `QTensor`.
    Ggml(GgmlDType),
}

impl WeightFormat {
    /// How a GGUF file holds a tensor of GGML type `t`: F32, F16 and BF16 as dense floats,
    /// every other type as its blocks.
    pub fn in_gguf(t: GgmlDType) -> Self {
        match t {
            GgmlDType::F32 => Self::Dense(DType::F32),
            GgmlDType::F16 => Self::Dense(DType::F16),
            GgmlDType::BF16 => Self::Dense(DType::BF16),
            q => Self::Ggml(q),
        }
    }

    /// Elements per block (1 for a dense dtype).
    pub fn block_elems(&self) -> usize {
        match self {
            Self::Dense(_) => 1,
            Self::Ggml(g) => g.block_size(),
        }
    }

    /// Bytes per block (the dtype's size for a dense dtype).
    pub fn block_bytes(&self) -> usize {
        match self {
            Self::Dense(d) => d.size_in_bytes(),
            Self::Ggml(g) => g.type_size(),
        }
    }

    /// Whether this is a GGML quantized format.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Self::Ggml(_))
    }

    /// The dtype of a dense format.
    pub fn dense_dtype(&self) -> Option<DType> {
        match self {
            Self::Dense(d) => Some(*d),
            Self::Ggml(_) => None,
        }
    }

    /// The GGML type of a quantized format.
    pub fn ggml_dtype(&self) -> Option<GgmlDType> {
        match self {
            Self::Dense(_) => None,
            Self::Ggml(g) => Some(*g),
        }
    }

    /// Whether this is a GGML type that Candle 0.11's quantized matmul multiplies as it is on
    /// every backend (the CPU's kernels and CUDA's mmvq/mmq): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
    /// Q2_K–Q6_K. Q8_1 and Q8_K (llama.cpp's activation formats) have CPU kernels only, and
    /// GGML F32/F16/BF16 are dense: loaders dequantize those instead of keeping their blocks.
    pub fn has_quantized_matmul(&self) -> bool {
        use GgmlDType as G;
        matches!(
            self,
            Self::Ggml(
                G::Q4_0
                    | G::Q4_1
                    | G::Q5_0
                    | G::Q5_1
                    | G::Q8_0
                    | G::Q2K
                    | G::Q3K
                    | G::Q4K
                    | G::Q5K
                    | G::Q6K
            )
        )
    }

    /// The Candle dtype of the values: a dense format's dtype, F32 for GGML blocks (what
    /// Candle dequantizes them to).
    pub fn value_dtype(&self) -> DType {
        self.dense_dtype().unwrap_or(DType::F32)
    }

    /// Host bytes of `shape` in this format; an error when a GGML tensor's rows are not whole
    /// blocks (Candle's quantized storage needs whole blocks per row).
    pub fn host_bytes(&self, shape: &Shape) -> std::result::Result<usize, String> {
        let elems = shape.elem_count();
        let block = self.block_elems();
        if let Self::Ggml(g) = self {
            let row = shape.dims().last().copied().unwrap_or(1);
            if row % block != 0 {
                return Err(format!(
                    "shape {:?} does not fit {g:?}: its rows of {row} elements are not whole \
                     blocks of {block}",
                    shape.dims()
                ));
            }
        }
        Ok(elems / block * self.block_bytes())
    }

    /// Bytes the tensor takes on the device, which the budget counts: the host bytes, plus
    /// for GGML blocks the zeroed padding Candle's CUDA quantized storage allocates after them
    /// (512 elements' worth, `MATRIX_ROW_PADDING`), so that its kernels can read whole rows.
    pub fn device_bytes(&self, host_bytes: usize) -> usize {
        match self {
            Self::Dense(_) => host_bytes,
            Self::Ggml(g) => {
                host_bytes + sys::GGML_ROW_PADDING_ELEMS / g.block_size() * g.type_size()
            }
        }
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Evens out the device bytes of GGML tensors across layer units of one shape.
///
/// Layer units whose tensors have the same shapes in the same order stream through the same
/// room on the device, one replacing another. When their block types differ (a Q4_K_M file
/// keeps some layers' `attn_v` and `ffn_down` in Q6_K, the others in Q4_K), the driver's
/// memory pool cannot serve the incoming tensor from the outgoing one's freed block and maps
/// new memory while keeping the old, and the device peak passes the budget (docs/tuning.md).
/// So each GGML tensor of such a class is allocated (and budgeted) at one size for its
/// position: the largest, rounded up to a multiple of every member's block size (5040 bytes for
/// Q4_K and Q6_K), which each member's buffer of whole blocks takes exactly. Every unit then
/// frees exactly what the next one allocates. Units of one block type per position (all of
/// Q4_0, Q8_0, F16 ... files) are unchanged.
fn pad_block_classes<'a>(units: impl Iterator<Item = (Option<usize>, &'a mut Vec<TensorMeta>)>) {
    let mut classes: HashMap<Vec<Vec<usize>>, Vec<&'a mut Vec<TensorMeta>>> = HashMap::new();
    for (layer, tensors) in units {
        if layer.is_some() {
            let key = tensors.iter().map(|t| t.shape.dims().to_vec()).collect();
            classes.entry(key).or_default().push(tensors);
        }
    }
    for members in classes.values_mut() {
        let Some(width) = members.first().map(|m| m.len()) else {
            continue;
        };
        for i in 0..width {
            let blocks = members
                .iter()
                .all(|m| matches!(m[i].format, WeightFormat::Ggml(_)));
            let largest = members
                .iter()
                .map(|m| m[i].own_device_bytes)
                .max()
                .unwrap_or(0);
            if !blocks || members.iter().all(|m| m[i].own_device_bytes == largest) {
                continue;
            }
            // One size every member's buffer can take exactly: a buffer is whole blocks of its
            // type (Candle's row padding is whole blocks too), so the size is the first common
            // multiple of the block sizes at or past the largest.
            let common = members
                .iter()
                .map(|m| m[i].format.block_bytes())
                .fold(1, |l, b| l / gcd(l, b) * b);
            let size = largest.next_multiple_of(common);
            for m in members.iter_mut() {
                m[i].device_bytes = size;
            }
        }
    }
}

impl From<DType> for WeightFormat {
    fn from(d: DType) -> Self {
        Self::Dense(d)
    }
}

impl From<GgmlDType> for WeightFormat {
    fn from(g: GgmlDType) -> Self {
        Self::Ggml(g)
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dense(d) => write!(f, "{d:?}"),
            Self::Ggml(g) => write!(f, "GGML {g:?}"),
        }
    }
}

/// Where one tensor lives inside its unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Full name, as in the checkpoint.
    pub name: String,
    /// How its bytes are laid out.
    pub format: WeightFormat,
    /// The Candle dtype of its values ([`WeightFormat::value_dtype`]: the stored dtype of a
    /// dense tensor, F32 for GGML blocks).
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
    /// Byte offset in the unit's buffer.
    pub offset: usize,
    /// Byte length in host memory.
    pub nbytes: usize,
    /// Bytes it takes on the device when it streams (what the budget counts for a unit that
    /// comes and goes): [`WeightFormat::device_bytes`], or for GGML blocks of a layer unit the
    /// most any layer unit of the same shapes takes at this position (its buffer then holds
    /// whole blocks past its own, zeroed, so that layers of mixed block types free and
    /// allocate the same sizes as they stream).
    pub device_bytes: usize,
    /// Bytes it takes on the device when its unit stays there for good (uploaded once, never
    /// replaced): [`WeightFormat::device_bytes`], without the streaming padding.
    pub own_device_bytes: usize,
}

/// One unit: its tensors' layout and its host buffer.
#[derive(Debug)]
pub struct HostUnit {
    name: String,
    layer: Option<usize>,
    tensors: Vec<TensorMeta>,
    bytes: u64,
    own_bytes: u64,
    /// Where its bytes live. Written only by
    /// [`OffloadRuntime::update_weights`](crate::OffloadRuntime::update_weights), after it has
    /// waited for every copy out of it.
    buf: RwLock<Box<dyn HostTier>>,
}

/// The bytes of one tensor of a unit: borrowed from host memory (the buffer cannot be
/// rewritten while this lives), or read out of a tier that has no such memory.
pub struct HostBytes<'a>(HostBytesInner<'a>);

enum HostBytesInner<'a> {
    Borrowed {
        guard: RwLockReadGuard<'a, Box<dyn HostTier>>,
        range: std::ops::Range<usize>,
    },
    Read(Vec<u8>),
}

impl std::ops::Deref for HostBytes<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            HostBytesInner::Borrowed { guard, range } => {
                &guard.bytes().expect("checked when made")[range.clone()]
            }
            HostBytesInner::Read(v) => v,
        }
    }
}

impl std::fmt::Debug for HostBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBytes({} bytes)", self.len())
    }
}

impl HostUnit {
    /// The unit's name (`model.layers.7`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layer index for units made by a layer prefix.
    pub fn layer(&self) -> Option<usize> {
        self.layer
    }

    /// Its tensors, in load order.
    pub fn tensors(&self) -> &[TensorMeta] {
        &self.tensors
    }

    /// Bytes it takes on the device (the sum of its tensors' device bytes; for a unit in
    /// managed memory, rounded up to the 2 MiB granules its pages take there).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes it takes on the device when it stays there for good: [`bytes`](Self::bytes)
    /// without the padding that evens out the layers of mixed block types for streaming
    /// (their tensors' [`TensorMeta::own_device_bytes`]). A runtime gives a unit this size
    /// when it never replaces it.
    pub fn resident_bytes(&self) -> u64 {
        self.own_bytes
    }

    /// Whether its host buffer is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.tier() == TierKind::Pinned
    }

    /// The storage tier its bytes live in.
    pub fn tier(&self) -> TierKind {
        self.buffer().kind()
    }

    /// Whether any of its tensors is in a GGML quantized format.
    pub fn has_quantized(&self) -> bool {
        self.tensors.iter().any(|t| t.format.is_quantized())
    }

    /// Its storage tier, read-locked: the copy engines read through this while they enqueue
    /// copies, so that `update_weights` cannot rewrite the bytes meanwhile.
    pub(crate) fn buffer(&self) -> RwLockReadGuard<'_, Box<dyn HostTier>> {
        // A writer that panicked left whole tensors behind (it copies tensor by tensor), so the
        // data is still well-formed.
        self.buf.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Host buffer length in bytes (tensors plus alignment padding).
    fn buffer_len(&self) -> usize {
        self.buffer().len()
    }

    /// Bytes of its host layout (tensors plus alignment padding, in the store's formats): what
    /// it takes in host memory, or for a disk unit what a fetch reads into memory (the file
    /// bytes differ where a read converts, e.g. F32 to F16).
    pub fn host_bytes(&self) -> u64 {
        self.buffer_len() as u64
    }

    /// The raw bytes of one of its tensors (in its [`WeightFormat`]).
    pub fn tensor_bytes(&self, t: &TensorMeta) -> HostBytes<'_> {
        let range = t.offset..t.offset + t.nbytes;
        let guard = self.buffer();
        if guard.bytes().is_some() {
            return HostBytes(HostBytesInner::Borrowed { guard, range });
        }
        let mut v = vec![0u8; t.nbytes];
        if let Err(e) = guard.read_into(range, &mut v) {
            // Only a tier without host memory (the disk) can fail here.
            tracing::error!(tensor = %t.name, error = %e, "reading a tensor from its tier failed");
            v.clear();
        }
        HostBytes(HostBytesInner::Read(v))
    }

    /// [`tensor_bytes`](Self::tensor_bytes), failing when its tier could not hand over all of
    /// them.
    fn whole_tensor_bytes(&self, t: &TensorMeta) -> candle_core::Result<HostBytes<'_>> {
        let range = t.offset..t.offset + t.nbytes;
        let guard = self.buffer();
        if guard.bytes().is_some() {
            return Ok(HostBytes(HostBytesInner::Borrowed { guard, range }));
        }
        let mut v = vec![0u8; t.nbytes];
        guard
            .read_into(range, &mut v)
            .map_err(|e| candle_core::Error::Msg(format!("tensor {}: {e}", t.name)))?;
        Ok(HostBytes(HostBytesInner::Read(v)))
    }

    /// A CPU copy of one of its dense tensors; a GGML tensor is refused (see
    /// [`cpu_qtensor`](Self::cpu_qtensor)).
    pub fn cpu_tensor(&self, t: &TensorMeta) -> candle_core::Result<Tensor> {
        let WeightFormat::Dense(dtype) = t.format else {
            candle_core::bail!(
                "tensor {} holds {} blocks, not a dense tensor: read it with cpu_qtensor (or \
                 UnitGuard::get_quantized)",
                t.name,
                t.format
            );
        };
        let bytes = self.whole_tensor_bytes(t)?;
        Tensor::from_raw_buffer(&bytes, dtype, t.shape.dims(), &Device::Cpu)
    }

    /// A CPU `QTensor` over a copy of one of its GGML tensors' blocks; a dense tensor is
    /// refused (see [`cpu_tensor`](Self::cpu_tensor)).
    pub fn cpu_qtensor(&self, t: &TensorMeta) -> candle_core::Result<QTensor> {
        let WeightFormat::Ggml(ggml) = t.format else {
            candle_core::bail!(
                "tensor {} is dense ({}), not GGML blocks: read it with cpu_tensor (or \
                 UnitGuard::get)",
                t.name,
                t.format
            );
        };
        let bytes = self.whole_tensor_bytes(t)?;
        // `from_data` reinterprets the bytes as blocks, which needs them aligned for the block
        // type: tiers start their buffers at `sys::TIER_ALIGN` and tensors sit at
        // TENSOR_ALIGN offsets, so this holds; it is checked rather than assumed.
        // No GGML block or element type needs more than 8.
        if !(bytes.as_ptr() as usize).is_multiple_of(8) {
            candle_core::bail!(
                "tensor {}: its bytes are not aligned for {} blocks",
                t.name,
                t.format
            );
        }
        let storage = QStorage::from_data(std::borrow::Cow::Borrowed(&bytes), &Device::Cpu, ggml)?;
        QTensor::new(storage, t.shape.clone())
    }

    /// Overwrites tensors of this unit with new values (any float dtype, converted to the
    /// stored one; the shape must match). The caller guarantees that no copy out of the buffer
    /// is in flight.
    pub(crate) fn write(&self, values: &[(&TensorMeta, &Tensor)]) -> candle_core::Result<()> {
        // Every value is checked before any byte is written: a bad one changes nothing.
        let mut dense = Vec::with_capacity(values.len());
        for (meta, value) in values {
            let WeightFormat::Dense(dtype) = meta.format else {
                candle_core::bail!(
                    "cannot update {}: it holds {} blocks, and quantized weights are not rewritten",
                    meta.name,
                    meta.format
                );
            };
            if value.dims() != meta.shape.dims() {
                candle_core::bail!(
                    "cannot update {}: shape {:?}, the store holds {:?}",
                    meta.name,
                    value.dims(),
                    meta.shape.dims()
                );
            }
            dense.push((meta, dtype, value.to_device(&Device::Cpu)?));
        }
        let mut buf = self.buf.write().unwrap_or_else(|e| e.into_inner());
        let kind = buf.kind();
        let Some(bytes) = buf.bytes_mut() else {
            candle_core::bail!(
                "cannot update unit {}: its {kind} storage is read-only",
                self.name
            );
        };
        for (meta, dtype, value) in dense {
            let len = meta.shape.elem_count() * dtype.size_in_bytes();
            encode_into(&value, dtype, &mut bytes[meta.offset..meta.offset + len])?;
        }
        Ok(())
    }
}

/// Elements per task of [`encode_into`]'s parallel conversion.
const ENCODE_CHUNK: usize = 1 << 18;

/// Writes `value` (on the CPU, `dst.len()` bytes in `dtype`) into `dst` as `dtype`'s
/// little-endian bytes. An F32 value (an optimizer's master) goes straight from its storage
/// into `dst`, converted on every core; anything else through a converted copy.
fn encode_into(value: &Tensor, dtype: DType, dst: &mut [u8]) -> candle_core::Result<()> {
    use rayon::prelude::*;
    if value.dtype() == DType::F32 && matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        let (storage, layout) = value.storage_and_layout();
        if let (candle_core::Storage::Cpu(CpuStorage::F32(all)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            let src = &all[a..b];
            let width = dtype.size_in_bytes();
            if src.len() * width != dst.len() {
                candle_core::bail!("{} values for {} bytes of {dtype:?}", src.len(), dst.len());
            }
            dst.par_chunks_mut(ENCODE_CHUNK * width)
                .zip(src.par_chunks(ENCODE_CHUNK))
                .for_each(|(d, s)| match dtype {
                    DType::F16 => {
                        for (d, v) in d.chunks_exact_mut(2).zip(s) {
                            d.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
                        }
                    }
                    DType::BF16 => {
                        for (d, v) in d.chunks_exact_mut(2).zip(s) {
                            d.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
                        }
                    }
                    _ => {
                        for (d, v) in d.chunks_exact_mut(4).zip(s) {
                            d.copy_from_slice(&v.to_le_bytes());
                        }
                    }
                });
            return Ok(());
        }
    }
    let data = tensor_to_bytes(&value.to_dtype(dtype)?)?;
    if data.len() != dst.len() {
        candle_core::bail!("{} bytes for a place of {}", data.len(), dst.len());
    }
    dst.copy_from_slice(&data);
    Ok(())
}

/// The host-memory cap when none is given: 3/4 of the machine's RAM. The quarter left is for
/// the OS and other programs, the activations and KV cache (on the CPU engine they live in
/// host memory too), and the page cache that the disk tier reads through; on a 16 GiB laptop
/// that is 4 GiB.
pub fn default_host_limit(total_ram_bytes: u64) -> u64 {
    total_ram_bytes / 4 * 3
}

/// The host-memory cap in bytes for `limit` on a machine with `total_ram_bytes` of RAM (`None`
/// when unknown): `None` for no cap (the default where the RAM is unknown). A share of RAM
/// needs the RAM; a size larger than the RAM is refused.
pub fn resolve_host_limit(
    limit: Option<MemoryLimit>,
    total_ram_bytes: Option<u64>,
) -> Result<Option<u64>> {
    let err = |reason: String| Error::InvalidConfig {
        field: "host_memory_limit".into(),
        reason,
    };
    match (limit, total_ram_bytes) {
        (None, total) => Ok(total.map(default_host_limit)),
        (Some(MemoryLimit::Bytes(b)), Some(total)) if b > total => Err(err(format!(
            "{} is more than the machine's RAM ({})",
            human_bytes(b),
            human_bytes(total)
        ))),
        (Some(MemoryLimit::Bytes(b)), _) => Ok(Some(b)),
        (Some(MemoryLimit::FractionOfDevice(f)), Some(total)) => {
            Ok(Some((total as f64 * f) as u64))
        }
        (Some(MemoryLimit::FractionOfDevice(f)), None) => Err(err(format!(
            "a share of RAM ({}%) needs /proc/meminfo; give a size such as 8GiB instead",
            f * 100.0
        ))),
    }
}

/// All weights of a model, grouped into units: in host memory up to the host cap, the rest in
/// their checkpoint file.
#[derive(Debug)]
pub struct HostStore {
    units: Vec<HostUnit>,
    unit_index: HashMap<String, UnitId>,
    tensor_index: HashMap<String, (UnitId, usize)>,
    host_limit: Option<u64>,
}

/// Where a tensor's bytes are in a checkpoint file, for the disk tier.
struct FileSpan {
    file: Arc<sys::DiskFile>,
    /// Offset of its first byte.
    offset: u64,
    /// Its length in the file.
    len: usize,
    /// How the file holds it.
    format: WeightFormat,
    /// Stored row `r` is file row `rows[r]` (`None`: the file's order).
    rows: Option<Vec<usize>>,
}

/// Where a tensor's bytes sit in a checkpoint file, so that its unit can stay there when it
/// does not fit under the host cap (the disk tier): what a loader of another format (GGUF)
/// gives [`HostStore::from_raw_in_files`] next to each tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FileSource {
    /// The file.
    pub path: PathBuf,
    /// Offset of the tensor's first byte in it.
    pub offset: u64,
    /// How the file holds the tensor: a dense dtype (a float converted to the stored dtype on
    /// every read) or GGML blocks (read as they are when the store keeps them as blocks,
    /// dequantized on every read, as Candle dequantizes them, when it stores them dense).
    pub format: WeightFormat,
    /// For a tensor whose rows the loader reorders (llama.cpp's q/k permutation): stored row
    /// `r` is file row `row_order[r]`. Rows are the first dimension.
    pub row_order: Option<Vec<usize>>,
}

impl FileSource {
    /// A tensor at `offset` of `path`, held there in `format`, rows in the file's order.
    pub fn new(path: impl Into<PathBuf>, offset: u64, format: WeightFormat) -> Self {
        Self {
            path: path.into(),
            offset,
            format,
            row_order: None,
        }
    }

    /// The same, with stored row `r` read from file row `order[r]`.
    pub fn with_row_order(mut self, order: Vec<usize>) -> Self {
        self.row_order = Some(order);
        self
    }
}

/// A dense tensor to create in [`HostStore::from_fn`] (for any format, see
/// [`RawTensorSpec`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Full name (decides its unit).
    pub name: String,
    /// Dtype before the store's conversion.
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
}

/// A tensor of any [`WeightFormat`] to create in [`HostStore::from_raw`]: a loader of
/// quantized checkpoints (GGUF) describes each tensor by its GGML type and fills its raw
/// blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTensorSpec {
    /// Full name (decides its unit).
    pub name: String,
    /// Format of the bytes `fill` will write. A dense format is converted to the store's
    /// dtype like [`TensorSpec`]'s; a GGML format is kept as it is.
    pub format: WeightFormat,
    /// Shape (in elements; a GGML tensor's rows are whole blocks).
    pub shape: Shape,
}

impl From<&TensorSpec> for RawTensorSpec {
    fn from(s: &TensorSpec) -> Self {
        Self {
            name: s.name.clone(),
            format: WeightFormat::Dense(s.dtype),
            shape: s.shape.clone(),
        }
    }
}

/// One tensor of a source, before it is placed.
struct Pending {
    name: String,
    format: WeightFormat,
    shape: Shape,
}

impl HostStore {
    /// Loads safetensors files (a model's shards), mapping each file and copying tensor by tensor
    /// into the store, so the model is never held twice. Pinned where `device` is a GPU.
    pub fn from_safetensors<P: AsRef<Path>>(
        paths: &[P],
        cfg: &StoreConfig,
        device: &Device,
    ) -> Result<Self> {
        let _span = tracing::info_span!("offload.load_safetensors", files = paths.len()).entered();
        let maps = paths
            .iter()
            .map(|p| sys::MappedFile::open(p.as_ref()).map_err(Error::from))
            .collect::<Result<Vec<_>>>()?;
        let mut files = Vec::with_capacity(maps.len());
        for m in &maps {
            let st = safetensors::SafeTensors::deserialize(m.bytes()).map_err(|e| Error::File {
                path: m.path().to_path_buf(),
                reason: format!("not a valid safetensors file: {e}"),
            })?;
            files.push(st);
        }
        let disk_files = paths
            .iter()
            .map(|p| sys::DiskFile::open(p.as_ref(), !cfg.disk_page_cache).map_err(Error::from))
            .collect::<Result<Vec<_>>>()?;
        let mut pending = Vec::new();
        let mut origin: Vec<(usize, String)> = Vec::new();
        let mut sources = Vec::new();
        for (fi, st) in files.iter().enumerate() {
            let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
            names.sort();
            for name in names {
                let view = st.tensor(&name).map_err(|e| Error::File {
                    path: maps[fi].path().to_path_buf(),
                    reason: format!("tensor {name}: {e}"),
                })?;
                let dtype = dtype_of(view.dtype()).ok_or_else(|| Error::File {
                    path: maps[fi].path().to_path_buf(),
                    reason: format!("tensor {name} has unsupported dtype {:?}", view.dtype()),
                })?;
                pending.push(Pending {
                    name: name.clone(),
                    format: WeightFormat::Dense(dtype),
                    shape: Shape::from(view.shape()),
                });
                // The data's offset in the file, from its place in the map.
                let offset = view.data().as_ptr() as usize - maps[fi].bytes().as_ptr() as usize;
                sources.push(Some(FileSpan {
                    file: disk_files[fi].clone(),
                    offset: offset as u64,
                    len: view.data().len(),
                    format: WeightFormat::Dense(dtype),
                    rows: None,
                }));
                origin.push((fi, name));
            }
        }
        Self::build(pending, cfg, device, &sources, |i, dst_format, dst| {
            let dst_dtype = dst_format
                .dense_dtype()
                .expect("safetensors tensors are dense");
            let (fi, name) = &origin[i];
            let view = files[*fi].tensor(name).map_err(|e| Error::File {
                path: maps[*fi].path().to_path_buf(),
                reason: format!("tensor {name}: {e}"),
            })?;
            let src_dtype = dtype_of(view.dtype()).expect("checked above");
            convert_into(view.data(), src_dtype, dst, dst_dtype).map_err(|reason| Error::File {
                path: maps[*fi].path().to_path_buf(),
                reason: format!("tensor {name}: {reason}"),
            })
        })
    }

    /// Builds a store from named tensors (any device; they are read back to the host).
    pub fn from_tensors<S: AsRef<str>>(
        tensors: &[(S, Tensor)],
        cfg: &StoreConfig,
        device: &Device,
    ) -> Result<Self> {
        let pending = tensors
            .iter()
            .map(|(n, t)| Pending {
                name: n.as_ref().to_string(),
                format: WeightFormat::Dense(t.dtype()),
                shape: t.shape().clone(),
            })
            .collect();
        Self::build(pending, cfg, device, &[], |i, dst_format, dst| {
            let dst_dtype = dst_format.dense_dtype().expect("tensors are dense");
            let t = tensors[i]
                .1
                .to_device(&Device::Cpu)?
                .to_dtype(dst_dtype)?
                .flatten_all()?;
            let bytes = tensor_to_bytes(&t)?;
            dst.copy_from_slice(&bytes);
            Ok(())
        })
    }

    /// Builds a store from tensor specifications, with `fill` writing each tensor's bytes
    /// (little-endian, in the stored dtype it is given) straight into the store's buffer: for
    /// synthetic weights and for loaders of other formats.
    pub fn from_fn(
        specs: &[TensorSpec],
        cfg: &StoreConfig,
        device: &Device,
        mut fill: impl FnMut(&TensorSpec, DType, &mut [u8]) -> Result<()>,
    ) -> Result<Self> {
        let pending = specs
            .iter()
            .map(|s| Pending {
                name: s.name.clone(),
                format: WeightFormat::Dense(s.dtype),
                shape: s.shape.clone(),
            })
            .collect();
        Self::build(pending, cfg, device, &[], |i, format, dst| {
            let dtype = format.dense_dtype().expect("TensorSpec is dense");
            fill(&specs[i], dtype, dst)
        })
    }

    /// Builds a store from tensors of any [`WeightFormat`], with `fill` writing each tensor's
    /// bytes in the stored format it is given: a dense tensor little-endian in the store's
    /// dtype (as in [`from_fn`](Self::from_fn)), a GGML tensor as its raw blocks, exactly as a
    /// GGUF file holds them. A GGML tensor whose rows are not whole blocks is refused, naming
    /// it.
    pub fn from_raw(
        specs: &[RawTensorSpec],
        cfg: &StoreConfig,
        device: &Device,
        fill: impl FnMut(&RawTensorSpec, WeightFormat, &mut [u8]) -> Result<()>,
    ) -> Result<Self> {
        Self::from_raw_in_files(specs, &vec![None; specs.len()], cfg, device, fill)
    }

    /// [`from_raw`](Self::from_raw) for tensors that sit in checkpoint files: `sources[i]`
    /// says where `specs[i]` is (`None` for a tensor with no place in a file). A unit past
    /// the host cap whose tensors all have a source stays in its file(s) (the disk tier) and
    /// is read on every fetch, reordered and converted as its sources say; `fill` is called
    /// only for the units held in memory, and must write what a read of the source gives
    /// (tests compare the two bit for bit). A source whose size, row order or conversion does
    /// not fit its tensor is an error naming the file and the tensor.
    pub fn from_raw_in_files(
        specs: &[RawTensorSpec],
        sources: &[Option<FileSource>],
        cfg: &StoreConfig,
        device: &Device,
        mut fill: impl FnMut(&RawTensorSpec, WeightFormat, &mut [u8]) -> Result<()>,
    ) -> Result<Self> {
        if sources.len() != specs.len() {
            return Err(Error::InvalidConfig {
                field: "sources".into(),
                reason: format!("{} sources for {} tensors", sources.len(), specs.len()),
            });
        }
        let mut opened: HashMap<&Path, Arc<sys::DiskFile>> = HashMap::new();
        let mut spans = Vec::with_capacity(specs.len());
        for (spec, source) in specs.iter().zip(sources) {
            let Some(src) = source else {
                spans.push(None);
                continue;
            };
            let file = match opened.get(src.path.as_path()) {
                Some(f) => f.clone(),
                None => {
                    let f = sys::DiskFile::open(&src.path, !cfg.disk_page_cache)?;
                    opened.insert(&src.path, f.clone());
                    f
                }
            };
            let len = src
                .format
                .host_bytes(&spec.shape)
                .map_err(|reason| Error::File {
                    path: src.path.clone(),
                    reason: format!("tensor {}: {reason}", spec.name),
                })?;
            spans.push(Some(FileSpan {
                file,
                offset: src.offset,
                len,
                format: src.format,
                rows: src.row_order.clone(),
            }));
        }
        let pending = specs
            .iter()
            .map(|s| Pending {
                name: s.name.clone(),
                format: s.format,
                shape: s.shape.clone(),
            })
            .collect();
        Self::build(pending, cfg, device, &spans, |i, format, dst| {
            fill(&specs[i], format, dst)
        })
    }

    /// Groups `pending` into units, lays each unit out, and places it: in host memory (pinned
    /// where the device and the pinned cap allow, filled by `fill`) while it fits under the
    /// host cap, otherwise in its checkpoint file when `sources` locates every one of its
    /// tensors there (`sources` is empty for stores without a file).
    fn build(
        pending: Vec<Pending>,
        cfg: &StoreConfig,
        device: &Device,
        sources: &[Option<FileSpan>],
        mut fill: impl FnMut(usize, WeightFormat, &mut [u8]) -> Result<()>,
    ) -> Result<Self> {
        // Group into units, keeping layer units in index order.
        let mut groups: Vec<(String, Option<usize>, Vec<usize>)> = Vec::new();
        let mut group_of: HashMap<String, usize> = HashMap::new();
        for (i, p) in pending.iter().enumerate() {
            let (unit, layer) = cfg.grouping.unit_of(&p.name);
            let g = *group_of.entry(unit.clone()).or_insert_with(|| {
                groups.push((unit, layer, Vec::new()));
                groups.len() - 1
            });
            groups[g].2.push(i);
        }
        groups.sort_by(|a, b| match (a.1, b.1) {
            (Some(x), Some(y)) => (x, &a.0).cmp(&(y, &b.0)),
            (None, Some(_)) => std::cmp::Ordering::Less,
            (Some(_), None) => std::cmp::Ordering::Greater,
            (None, None) => a.0.cmp(&b.0),
        });

        // Lay every unit out first: the cap is checked against the largest.
        let mut layouts = Vec::with_capacity(groups.len());
        for (unit_name, layer, members) in groups {
            let mut tensors = Vec::with_capacity(members.len());
            let mut len = 0usize;
            for &i in &members {
                let p = &pending[i];
                let format = match (p.format, cfg.dtype) {
                    (WeightFormat::Dense(s), Some(d)) if s.is_float() && d.is_float() => {
                        WeightFormat::Dense(d)
                    }
                    (f, _) => f,
                };
                len = len.next_multiple_of(TENSOR_ALIGN);
                let nbytes =
                    format
                        .host_bytes(&p.shape)
                        .map_err(|reason| Error::InvalidConfig {
                            field: format!("tensor {}", p.name),
                            reason,
                        })?;
                tensors.push(TensorMeta {
                    name: p.name.clone(),
                    format,
                    dtype: format.value_dtype(),
                    shape: p.shape.clone(),
                    offset: len,
                    nbytes,
                    device_bytes: format.device_bytes(nbytes),
                    own_device_bytes: format.device_bytes(nbytes),
                });
                len += nbytes;
            }
            layouts.push((unit_name, layer, members, tensors, len));
        }
        pad_block_classes(layouts.iter_mut().map(|l| (l.1, &mut l.3)));

        let explicit = cfg.host_memory_limit.is_some();
        let host_limit = resolve_host_limit(
            cfg.host_memory_limit,
            crate::diag::host_memory().map(|m| m.total_bytes),
        )?;
        if let (true, Some(cap), Some((name, len))) = (
            explicit,
            host_limit,
            layouts
                .iter()
                .map(|l| (&l.0, l.4 as u64))
                .max_by_key(|(_, len)| *len),
        ) {
            if cap < len {
                return Err(Error::InvalidConfig {
                    field: "host_memory_limit".into(),
                    reason: format!(
                        "{} is smaller than the largest unit ({name}, {}): a unit is read into \
                         host memory whole, so the cap must hold at least one",
                        human_bytes(cap),
                        human_bytes(len)
                    ),
                });
            }
        }

        let mut pinner = sys::Pinner::for_device(
            device,
            cfg.pinned_cap_bytes,
            cfg.engine == EngineKind::Managed,
        )?;
        let mut units = Vec::with_capacity(layouts.len());
        let mut unit_index = HashMap::new();
        let mut tensor_index = HashMap::new();
        let mut held = 0u64;
        let mut warned = false;
        for (unit_name, layer, members, tensors, len) in layouts {
            let uid = UnitId(units.len());
            // What the unit takes in host memory: managed memory is allocated in granules.
            let host_len = match cfg.engine {
                EngineKind::Managed => sys::managed_alloc_len(len),
                EngineKind::Explicit => len,
            } as u64;
            let fits = host_limit.is_none_or(|cap| held + host_len <= cap);
            let spans: Option<Vec<&FileSpan>> = if fits {
                None
            } else {
                members
                    .iter()
                    .map(|&i| sources.get(i).and_then(Option::as_ref))
                    .collect()
            };
            let buf: Box<dyn HostTier> = if let Some(spans) = spans {
                Box::new(disk_tier(
                    &unit_name,
                    len,
                    &tensors,
                    &spans,
                    cfg.disk_reads,
                )?)
            } else {
                if !fits {
                    let why = format!(
                        "unit {unit_name} ({}) does not fit under the host cap of {} ({} \
                         already held) and has no checkpoint file to stay in (a store built \
                         from tensors or a fill function has none)",
                        human_bytes(len as u64),
                        human_bytes(host_limit.unwrap_or(0)),
                        human_bytes(held)
                    );
                    if explicit {
                        return Err(Error::InvalidConfig {
                            field: "host_memory_limit".into(),
                            reason: why,
                        });
                    }
                    if !warned {
                        tracing::warn!("{why}: holding it in memory past the default cap");
                        warned = true;
                    }
                }
                held += host_len;
                let mut buf = pinner.alloc(len, &unit_name)?;
                {
                    let kind = buf.kind();
                    let bytes = buf.bytes_mut().ok_or_else(|| Error::InvalidConfig {
                        field: format!("unit {unit_name}"),
                        reason: format!("its {kind} storage cannot be written"),
                    })?;
                    for (t, &i) in tensors.iter().zip(&members) {
                        fill(i, t.format, &mut bytes[t.offset..t.offset + t.nbytes])?;
                    }
                }
                buf
            };
            for (k, t) in tensors.iter().enumerate() {
                tensor_index.insert(t.name.clone(), (uid, k));
            }
            unit_index.insert(unit_name.clone(), uid);
            let sum = |size: fn(&TensorMeta) -> usize| -> u64 {
                match buf.managed() {
                    // Dense tensors' pages migrate in whole granules (up to the allocation's);
                    // blocks are copied into buffers of their own.
                    Some(m) => {
                        let blocks: u64 = tensors
                            .iter()
                            .filter(|t| matches!(t.format, WeightFormat::Ggml(_)))
                            .map(|t| size(t) as u64)
                            .sum();
                        m.device_footprint() as u64 + blocks
                    }
                    None => tensors.iter().map(|t| size(t) as u64).sum(),
                }
            };
            let (bytes, own_bytes) = (sum(|t| t.device_bytes), sum(|t| t.own_device_bytes));
            units.push(HostUnit {
                name: unit_name,
                layer,
                tensors,
                bytes,
                own_bytes,
                buf: RwLock::new(buf),
            });
        }
        let store = Self {
            units,
            unit_index,
            tensor_index,
            host_limit,
        };
        if store.disk_bytes() > 0 {
            tracing::info!(
                held = %human_bytes(store.pinned_bytes() + store.pageable_bytes()),
                cap = %human_bytes(host_limit.unwrap_or(0)),
                disk = %human_bytes(store.disk_bytes()),
                units = %store.disk_units().join(", "),
                direct = %store.disk_direct_units().join(", "),
                "units past the host-memory cap stay in the checkpoint file and are read from it \
                 on every fetch (those listed as direct with O_DIRECT, the others through the \
                 page cache)"
            );
        }
        if store.pageable_bytes() > 0 && !device.is_cpu() {
            tracing::warn!(
                pageable = %human_bytes(store.pageable_bytes()),
                pinned = %human_bytes(store.pinned_bytes()),
                "some weights are not in page-locked memory (cap reached or pinning failed); \
                 their transfers go through the staging ring and are slower"
            );
        }
        Ok(store)
    }

    /// The units, in order (non-layer units first, then layers by index).
    pub fn units(&self) -> &[HostUnit] {
        &self.units
    }

    /// One unit.
    pub fn unit(&self, id: UnitId) -> &HostUnit {
        &self.units[id.0]
    }

    /// Looks a unit up by name.
    pub fn unit_id(&self, name: &str) -> Option<UnitId> {
        self.unit_index.get(name).copied()
    }

    /// The unit of layer `idx`, if one was grouped by a layer prefix.
    pub fn layer_unit(&self, idx: usize) -> Option<UnitId> {
        self.units
            .iter()
            .position(|u| u.layer == Some(idx))
            .map(UnitId)
    }

    /// The unit holding a tensor, and the tensor's metadata.
    pub fn tensor(&self, name: &str) -> Option<(UnitId, &TensorMeta)> {
        self.tensor_index
            .get(name)
            .map(|&(u, k)| (u, &self.units[u.0].tensors[k]))
    }

    /// Sizes of all units in order (the cache's input).
    pub fn unit_bytes(&self) -> Vec<u64> {
        self.units.iter().map(|u| u.bytes).collect()
    }

    /// Every unit's [`HostUnit::resident_bytes`], in unit order.
    pub fn resident_unit_bytes(&self) -> Vec<u64> {
        self.units.iter().map(|u| u.own_bytes).collect()
    }

    /// Total bytes of all units.
    pub fn total_bytes(&self) -> u64 {
        self.units.iter().map(|u| u.bytes).sum()
    }

    /// Bytes in page-locked buffers.
    pub fn pinned_bytes(&self) -> u64 {
        self.units
            .iter()
            .filter(|u| u.is_pinned())
            .map(|u| u.buffer_len() as u64)
            .sum()
    }

    /// How many tensors are held as GGML blocks.
    pub fn ggml_tensor_count(&self) -> usize {
        self.units
            .iter()
            .flat_map(|u| u.tensors())
            .filter(|t| matches!(t.format, WeightFormat::Ggml(_)))
            .count()
    }

    /// Bytes in pageable buffers.
    pub fn pageable_bytes(&self) -> u64 {
        self.tier_bytes(TierKind::Pageable)
    }

    /// Bytes in managed (Unified) memory (the managed engine).
    pub fn managed_bytes(&self) -> u64 {
        self.tier_bytes(TierKind::Managed)
    }

    /// Bytes of the units left in their checkpoint file (their layout's length).
    pub fn disk_bytes(&self) -> u64 {
        self.tier_bytes(TierKind::Disk)
    }

    /// The units left in their checkpoint file, in order.
    pub fn disk_units(&self) -> Vec<&str> {
        self.units
            .iter()
            .filter(|u| u.tier() == TierKind::Disk)
            .map(|u| u.name())
            .collect()
    }

    /// The disk units read with O_DIRECT (the others go through the page cache), in order.
    pub fn disk_direct_units(&self) -> Vec<&str> {
        self.units
            .iter()
            .filter(|u| u.tier() == TierKind::Disk && u.buffer().reads_direct())
            .map(|u| u.name())
            .collect()
    }

    /// The host-memory cap the store was built under, bytes (`None`: no cap).
    pub fn host_limit_bytes(&self) -> Option<u64> {
        self.host_limit
    }

    fn tier_bytes(&self, kind: TierKind) -> u64 {
        self.units
            .iter()
            .filter(|u| u.tier() == kind)
            .map(|u| u.buffer_len() as u64)
            .sum()
    }
}

/// The disk tier of a unit laid out as `tensors`, each read from its span of a file: one
/// segment per tensor, or per run of rows where the span reorders them, with the conversion
/// from the file's format to the stored one.
fn disk_tier(
    unit: &str,
    len: usize,
    tensors: &[TensorMeta],
    spans: &[&FileSpan],
    reads: crate::tuning::DiskTuning,
) -> Result<sys::DiskTier> {
    let mut segments = Vec::with_capacity(tensors.len());
    for (t, span) in tensors.iter().zip(spans) {
        let bad = |reason: String| Error::File {
            path: span.file.path().to_path_buf(),
            reason: format!("tensor {}: {reason}", t.name),
        };
        let need = span.format.host_bytes(&t.shape).map_err(bad)?;
        if span.len != need {
            return Err(bad(format!(
                "holds {} bytes, but its shape and {} need {need}",
                span.len, span.format
            )));
        }
        let conversion = conversion(span.format, t.format).map_err(bad)?;
        let name: Arc<str> = t.name.as_str().into();
        let segment = |at: usize, len: usize, file_offset: u64| sys::Segment {
            file: span.file.clone(),
            name: name.clone(),
            at,
            len,
            file_offset,
            conversion: conversion.clone(),
        };
        let Some(order) = &span.rows else {
            segments.push(segment(t.offset, t.nbytes, span.offset));
            continue;
        };
        // Runs of rows that follow each other in the file: one segment each.
        let rows = t.shape.dims().first().copied().unwrap_or(1);
        let mut seen = vec![false; rows];
        if order.len() != rows
            || order
                .iter()
                .any(|&r| r >= rows || std::mem::replace(&mut seen[r], true))
        {
            return Err(bad(format!(
                "its row order is not a permutation of its {rows} rows"
            )));
        }
        let (row, file_row) = (t.nbytes / rows, span.len / rows);
        let mut r = 0;
        while r < rows {
            let mut n = 1;
            while r + n < rows && order[r + n] == order[r] + n {
                n += 1;
            }
            segments.push(segment(
                t.offset + r * row,
                n * row,
                span.offset + (order[r] * file_row) as u64,
            ));
            r += n;
        }
    }
    let shape = sys::ReadShape {
        threads: reads.threads,
        piece: (reads.piece_mib as u64) << 20,
    };
    Ok(sys::DiskTier::new(unit, len, segments, shape)?)
}

/// How a disk segment's file bytes (`from`) become its stored bytes (`to`): `None` when they
/// are the same; a float conversion ([`convert_into`]); GGML blocks dequantized as Candle
/// dequantizes them, then converted to the stored dtype as Candle converts (what the GGUF
/// loader does in memory). Anything else cannot be read from the file.
fn conversion(
    from: WeightFormat,
    to: WeightFormat,
) -> std::result::Result<Option<sys::Conversion>, String> {
    match (from, to) {
        (f, t) if f == t => Ok(None),
        (WeightFormat::Dense(f), WeightFormat::Dense(t)) if f.is_float() && t.is_float() => {
            Ok(Some(sys::Conversion {
                what: format!("{f:?} -> {t:?}").into(),
                from_group: f.size_in_bytes(),
                to_group: t.size_in_bytes(),
                convert: Arc::new(move |src, dst| convert_into(src, f, dst, t)),
            }))
        }
        (WeightFormat::Ggml(g), WeightFormat::Dense(t)) if t.is_float() => {
            Ok(Some(sys::Conversion {
                what: format!("{g:?} blocks -> {t:?}").into(),
                from_group: g.type_size(),
                to_group: g.block_size() * t.size_in_bytes(),
                convert: Arc::new(move |src, dst| {
                    dequantize_into(src, g, dst, t).map_err(|e| e.to_string())
                }),
            }))
        }
        (f, t) => Err(format!(
            "the file holds it as {f}, which cannot be read as {t}"
        )),
    }
}

/// Dequantizes whole blocks of `g` in `src` into `dst` as `to`, through Candle exactly as the
/// GGUF loader does in memory (`QTensor::dequantize`, then `to_dtype`).
fn dequantize_into(src: &[u8], g: GgmlDType, dst: &mut [u8], to: DType) -> candle_core::Result<()> {
    // `QStorage::from_data` views the bytes as blocks: align them for any block type (8).
    let mut buf = vec![0u8; src.len() + 8];
    let at = buf.as_ptr().align_offset(8);
    if at > 8 {
        candle_core::bail!("cannot align a buffer for {g:?} blocks");
    }
    buf[at..at + src.len()].copy_from_slice(src);
    let elems = src.len() / g.type_size() * g.block_size();
    let storage = QStorage::from_data(
        std::borrow::Cow::Borrowed(&buf[at..at + src.len()]),
        &Device::Cpu,
        g,
    )?;
    let t = QTensor::new(storage, elems)?
        .dequantize(&Device::Cpu)?
        .to_dtype(to)?;
    let bytes = tensor_to_bytes(&t)?;
    if bytes.len() != dst.len() {
        candle_core::bail!("{} bytes dequantized into {}", bytes.len(), dst.len());
    }
    dst.copy_from_slice(&bytes);
    Ok(())
}

/// The candle dtype of a safetensors dtype, where candle has one.
fn dtype_of(d: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match d {
        S::U8 => DType::U8,
        S::U32 => DType::U32,
        S::I16 => DType::I16,
        S::I32 => DType::I32,
        S::I64 => DType::I64,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::F32 => DType::F32,
        S::F64 => DType::F64,
        _ => return None,
    })
}

/// Little-endian bytes of a CPU tensor, flattened (the layout the store and safetensors use).
pub fn tensor_to_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U8 => t.to_vec1::<u8>()?,
        DType::U32 => t
            .to_vec1::<u32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::I64 => t
            .to_vec1::<i64>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F32 => t
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F64 => t
            .to_vec1::<f64>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        other => candle_core::bail!("dtype {other:?} is not supported by the host store"),
    })
}

fn read_float(src: &[u8], dtype: DType, i: usize) -> f64 {
    match dtype {
        DType::F16 => half::f16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f64(),
        DType::F32 => f32::from_le_bytes(src[4 * i..4 * i + 4].try_into().expect("4 bytes")) as f64,
        DType::F64 => f64::from_le_bytes(src[8 * i..8 * i + 8].try_into().expect("8 bytes")),
        _ => unreachable!("read_float on a non-float dtype"),
    }
}

/// Copies `src` (of `from`) into `dst` (of `to`), converting floats; sizes are checked.
pub(crate) fn convert_into(
    src: &[u8],
    from: DType,
    dst: &mut [u8],
    to: DType,
) -> std::result::Result<(), String> {
    let n = dst.len() / to.size_in_bytes();
    if src.len() != n * from.size_in_bytes() {
        return Err(format!(
            "holds {} bytes, but its shape and dtype {from:?} need {}",
            src.len(),
            n * from.size_in_bytes()
        ));
    }
    if from == to {
        dst.copy_from_slice(src);
        return Ok(());
    }
    if !(from.is_float() && to.is_float()) {
        return Err(format!("cannot convert {from:?} to {to:?}"));
    }
    let width = to.size_in_bytes();
    for i in 0..n {
        let x = read_float(src, from, i);
        let out = &mut dst[i * width..(i + 1) * width];
        match to {
            DType::F16 => out.copy_from_slice(&half::f16::from_f64(x).to_le_bytes()),
            DType::BF16 => out.copy_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
            DType::F32 => out.copy_from_slice(&(x as f32).to_le_bytes()),
            DType::F64 => out.copy_from_slice(&x.to_le_bytes()),
            other => return Err(format!("cannot convert to {other:?}")),
        }
    }
    Ok(())
}

/// Paths of a model's safetensors: `model.safetensors`, or every shard named by
/// `model.safetensors.index.json`, in `dir`.
pub fn safetensors_in_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).map_err(|e| Error::File {
        path: index.clone(),
        reason: format!("neither model.safetensors nor a readable index: {e}"),
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::File {
        path: index.clone(),
        reason: format!("not valid JSON: {e}"),
    })?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::File {
            path: index.clone(),
            reason: "has no \"weight_map\" object".into(),
        })?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    files.sort();
    files.dedup();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// F32 values written into F32, F16 and BF16 places give the bytes of `to_dtype`, over
    /// more than one task's chunk; a strided or other-dtype value too; a wrong length is an
    /// error.
    #[test]
    fn encode_into_matches_to_dtype() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let n = ENCODE_CHUNK + 19;
        let v = Tensor::randn(0f32, 1., (2, n), &dev)?;
        let strided = Tensor::randn(0f32, 1., (n, 2), &dev)?.t()?;
        for value in [&v, &strided, &v.to_dtype(DType::F16)?] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let want = tensor_to_bytes(&value.to_dtype(dtype)?)?;
                let mut got = vec![0u8; want.len()];
                encode_into(value, dtype, &mut got)?;
                assert!(got == want, "{:?} into {dtype:?}", value.dtype());
                assert!(encode_into(value, dtype, &mut got[1..]).is_err());
            }
        }
        Ok(())
    }

    #[test]
    fn groups_by_layer_prefix_and_module() {
        let g = UnitGrouping::default();
        assert_eq!(
            g.unit_of("model.layers.12.mlp.up_proj.weight"),
            ("model.layers.12".into(), Some(12))
        );
        assert_eq!(g.unit_of("blk.3.attn_q.weight"), ("blk.3".into(), Some(3)));
        assert_eq!(
            g.unit_of("model.embed_tokens.weight"),
            ("model.embed_tokens".into(), None)
        );
        assert_eq!(g.unit_of("lm_head.weight"), ("lm_head".into(), None));
        assert_eq!(
            g.unit_of("model.layers.x.weight"),
            ("model.layers.x".into(), None)
        );
        assert_eq!(g.unit_of("scale"), ("scale".into(), None));
    }

    #[test]
    fn converts_floats_and_checks_sizes() {
        let src: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let mut dst = vec![0u8; 4];
        convert_into(&src, DType::F32, &mut dst, DType::F16).unwrap();
        assert_eq!(half::f16::from_le_bytes([dst[0], dst[1]]).to_f32(), 1.5);
        assert_eq!(half::f16::from_le_bytes([dst[2], dst[3]]).to_f32(), -2.0);
        let mut short = vec![0u8; 6];
        assert!(convert_into(&src, DType::F32, &mut short, DType::F16).is_err());
    }

    #[test]
    fn store_from_tensors_round_trips() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 6., &dev)?.reshape((2, 3))?;
        let b = Tensor::new(&[7u32, 8], &dev)?;
        let store = HostStore::from_tensors(
            &[
                ("model.layers.1.w", a.clone()),
                ("model.layers.0.w", a.clone()),
                ("model.embed.ids", b.clone()),
            ],
            &StoreConfig {
                dtype: Some(DType::F16),
                ..Default::default()
            },
            &dev,
        )?;
        let names: Vec<&str> = store.units().iter().map(|u| u.name()).collect();
        assert_eq!(names, ["model.embed", "model.layers.0", "model.layers.1"]);
        let (u, meta) = store.tensor("model.layers.1.w").unwrap();
        assert_eq!(meta.dtype, DType::F16);
        let back = store.unit(u).cpu_tensor(meta)?.to_dtype(DType::F32)?;
        assert_eq!(back.to_vec2::<f32>()?, a.to_vec2::<f32>()?);
        let (u, meta) = store.tensor("model.embed.ids").unwrap();
        assert_eq!(meta.dtype, DType::U32, "integers are not converted");
        assert_eq!(store.unit(u).cpu_tensor(meta)?.to_vec1::<u32>()?, [7, 8]);
        assert_eq!(store.pinned_bytes(), 0);
        Ok(())
    }

    #[test]
    fn layers_of_mixed_block_types_take_one_size_per_position() {
        let meta = |name: &str, format: WeightFormat, dims: (usize, usize)| {
            let shape = Shape::from(dims);
            let nbytes = format.host_bytes(&shape).unwrap();
            TensorMeta {
                name: name.into(),
                format,
                dtype: format.value_dtype(),
                shape,
                offset: 0,
                nbytes,
                device_bytes: format.device_bytes(nbytes),
                own_device_bytes: format.device_bytes(nbytes),
            }
        };
        let (q4k, q6k) = (
            WeightFormat::Ggml(GgmlDType::Q4K),
            WeightFormat::Ggml(GgmlDType::Q6K),
        );
        let f32 = WeightFormat::Dense(DType::F32);
        // A Q4_K_M pattern: `v` in Q6_K in one layer, Q4_K in the other; norms dense.
        let layer = |v: WeightFormat| {
            vec![
                meta("q", q4k, (8, 512)),
                meta("v", v, (8, 512)),
                meta("norm", f32, (1, 512)),
            ]
        };
        let mut units = [
            (Some(0), layer(q6k)),
            (Some(1), layer(q4k)),
            // Not a layer: left alone even with the same shapes.
            (None, layer(q4k)),
            // Another shape: a class of its own.
            (Some(2), vec![meta("v", q4k, (4, 512))]),
        ];
        let before: Vec<Vec<usize>> = units
            .iter()
            .map(|(_, ts)| ts.iter().map(|t| t.device_bytes).collect())
            .collect();
        pad_block_classes(units.iter_mut().map(|(l, ts)| (*l, ts)));
        let after = |u: usize, i: usize| units[u].1[i].device_bytes;
        // `v`: both layers take the Q6_K layer's size rounded up to whole blocks of both types
        // (a multiple of 144 and 210: 5040 bytes).
        let q6 = before[0][1];
        assert_eq!(after(0, 1), after(1, 1), "one size");
        assert!(
            after(0, 1) >= q6 && after(0, 1) < q6 + 5040,
            "{} vs {q6}",
            after(0, 1)
        );
        assert_eq!(after(0, 1) % 5040, 0, "whole blocks of both types");
        // Positions of one type, dense tensors, other units: unchanged.
        for (u, sizes) in before.iter().enumerate() {
            for (i, &b) in sizes.iter().enumerate() {
                if i != 1 || u > 1 {
                    assert_eq!(units[u].1[i].device_bytes, b, "unit {u} tensor {i}");
                }
            }
        }
    }

    #[test]
    fn weight_formats_size_blocks_and_device_padding() {
        let q4 = WeightFormat::Ggml(GgmlDType::Q4_0);
        assert_eq!((q4.block_elems(), q4.block_bytes()), (32, 18));
        assert_eq!(q4.host_bytes(&Shape::from((4, 64))), Ok(4 * 2 * 18));
        assert_eq!(q4.device_bytes(144), 144 + 16 * 18);
        let k = WeightFormat::Ggml(GgmlDType::Q6K);
        assert_eq!(k.host_bytes(&Shape::from((2, 256))), Ok(2 * 210));
        assert_eq!(k.device_bytes(420), 420 + 2 * 210);
        let err = k.host_bytes(&Shape::from((256, 32))).unwrap_err();
        assert!(err.contains("[256, 32]") && err.contains("256"), "{err}");
        let dense = WeightFormat::Dense(DType::BF16);
        assert_eq!(dense.host_bytes(&Shape::from((3, 5))), Ok(30));
        assert_eq!(dense.device_bytes(30), 30);
        assert_eq!(dense.value_dtype(), DType::BF16);
        assert_eq!(q4.value_dtype(), DType::F32);
        assert_eq!(q4.to_string(), "GGML Q4_0");
        assert!(q4.has_quantized_matmul() && k.has_quantized_matmul());
        for other in [GgmlDType::Q8_1, GgmlDType::Q8K, GgmlDType::F16] {
            assert!(
                !WeightFormat::Ggml(other).has_quantized_matmul(),
                "{other:?}"
            );
        }
        assert!(!dense.has_quantized_matmul());
    }

    #[test]
    fn raw_store_keeps_blocks_and_refuses_partial_blocks() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let specs = [
            RawTensorSpec {
                name: "blk.0.attn_q.weight".into(),
                format: GgmlDType::Q8_0.into(),
                shape: Shape::from((2, 32)),
            },
            RawTensorSpec {
                name: "blk.0.attn_norm.weight".into(),
                format: DType::F32.into(),
                shape: Shape::from(32),
            },
        ];
        let cfg = StoreConfig {
            dtype: Some(DType::F16),
            ..Default::default()
        };
        let store = HostStore::from_raw(&specs, &cfg, &dev, |s, f, dst| {
            // The dense tensor is converted to the store's dtype; blocks are kept.
            match f {
                WeightFormat::Ggml(GgmlDType::Q8_0) => assert_eq!(dst.len(), 2 * 34),
                WeightFormat::Dense(DType::F16) => assert_eq!(dst.len(), 64),
                other => panic!("{}: {other}", s.name),
            }
            dst.fill(1);
            Ok(())
        })?;
        let (u, meta) = store.tensor("blk.0.attn_q.weight").unwrap();
        let unit = store.unit(u);
        assert!(unit.has_quantized());
        assert_eq!(unit.tier(), TierKind::Pageable);
        assert_eq!(&*unit.tensor_bytes(meta), &[1u8; 68][..]);
        assert_eq!(unit.cpu_qtensor(meta)?.dtype(), GgmlDType::Q8_0);
        assert!(unit.cpu_tensor(meta).is_err());
        let (_, norm) = store.tensor("blk.0.attn_norm.weight").unwrap();
        assert!(unit.cpu_qtensor(norm).is_err());
        assert_eq!(unit.cpu_tensor(norm)?.dtype(), DType::F16);

        let bad = [RawTensorSpec {
            name: "blk.0.ffn_down.weight".into(),
            format: GgmlDType::Q4K.into(),
            shape: Shape::from((256, 100)),
        }];
        let err = HostStore::from_raw(&bad, &cfg, &dev, |_, _, _| Ok(())).unwrap_err();
        assert!(err.to_string().contains("blk.0.ffn_down.weight"), "{err}");
        Ok(())
    }

    #[test]
    fn host_limits_default_to_three_quarters_of_ram_and_name_their_field() {
        let gib = 1u64 << 30;
        assert_eq!(default_host_limit(16 * gib), 12 * gib);
        assert_eq!(
            resolve_host_limit(None, Some(16 * gib)).unwrap(),
            Some(12 * gib)
        );
        assert_eq!(resolve_host_limit(None, None).unwrap(), None);
        assert_eq!(
            resolve_host_limit(Some(MemoryLimit::FractionOfDevice(0.5)), Some(16 * gib)).unwrap(),
            Some(8 * gib)
        );
        assert_eq!(
            resolve_host_limit(Some(MemoryLimit::Bytes(gib)), None).unwrap(),
            Some(gib)
        );
        for (limit, ram) in [
            (MemoryLimit::Bytes(32 * gib), Some(16 * gib)),
            (MemoryLimit::FractionOfDevice(0.5), None),
        ] {
            let e = resolve_host_limit(Some(limit), ram)
                .unwrap_err()
                .to_string();
            assert!(e.contains("host_memory_limit"), "{e}");
        }
    }

    #[test]
    fn units_past_the_cap_go_to_disk_in_unit_order() -> anyhow::Result<()> {
        // Three layers of 1 KiB and a 256-byte embedding, F32 in a safetensors file.
        let dir = std::env::temp_dir().join(format!("candle-offload-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("model.safetensors");
        let dev = Device::Cpu;
        let mut tensors = HashMap::new();
        tensors.insert(
            "embed.weight".to_string(),
            Tensor::ones(64, DType::F32, &dev)?,
        );
        for i in 0..3 {
            let w = Tensor::arange(0f32, 256., &dev)?.affine(1.0, i as f64)?;
            tensors.insert(format!("layers.{i}.weight"), w);
        }
        candle_core::safetensors::save(&tensors, &path)?;
        let cfg = |cap: u64| StoreConfig {
            host_memory_limit: Some(MemoryLimit::Bytes(cap)),
            ..Default::default()
        };
        let store = HostStore::from_safetensors(&[&path], &cfg(256 + 1024), &dev)?;
        assert_eq!(store.disk_units(), ["layers.1", "layers.2"]);
        assert_eq!((store.pageable_bytes(), store.disk_bytes()), (1280, 2048));
        let (u, meta) = store.tensor("layers.2.weight").unwrap();
        let back = store.unit(u).cpu_tensor(meta)?;
        assert_eq!(
            back.to_vec1::<f32>()?,
            tensors["layers.2.weight"].to_vec1::<f32>()?
        );
        // Converted on every read: F32 in the file, F16 in the layout.
        let cfg16 = StoreConfig {
            dtype: Some(DType::F16),
            ..cfg(128 + 512)
        };
        let store = HostStore::from_safetensors(&[&path], &cfg16, &dev)?;
        assert_eq!(store.disk_units(), ["layers.1", "layers.2"]);
        let (u, meta) = store.tensor("layers.1.weight").unwrap();
        let back = store.unit(u).cpu_tensor(meta)?.to_dtype(DType::F32)?;
        assert_eq!(
            back.to_vec1::<f32>()?,
            tensors["layers.1.weight"].to_vec1::<f32>()?
        );
        // A unit cannot be rewritten in its file.
        let new = Tensor::zeros(256, DType::F32, &dev)?;
        assert!(store.unit(u).write(&[(meta, &new)]).is_err());
        let e = HostStore::from_safetensors(&[&path], &cfg(1000), &dev).unwrap_err();
        assert!(e.to_string().contains("host_memory_limit"), "{e}");
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    /// A tier with no host bytes (like a file on disk): everything goes through `read_into`.
    #[derive(Debug)]
    struct ReadOnlyTier(Vec<u8>);

    impl HostTier for ReadOnlyTier {
        fn kind(&self) -> TierKind {
            TierKind::Pageable
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn bytes(&self) -> Option<&[u8]> {
            None
        }
        fn bytes_mut(&mut self) -> Option<&mut [u8]> {
            None
        }
        fn read_into(&self, range: std::ops::Range<usize>, dst: &mut [u8]) -> std::io::Result<()> {
            dst.copy_from_slice(&self.0[range]);
            Ok(())
        }
    }

    #[test]
    fn units_use_their_tier_only_through_its_interface() -> anyhow::Result<()> {
        let values = [1.5f32, -2.0, 4.0];
        let data: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        let meta = TensorMeta {
            name: "w".into(),
            format: WeightFormat::Dense(DType::F32),
            dtype: DType::F32,
            shape: Shape::from(3),
            offset: 0,
            nbytes: 12,
            device_bytes: 12,
            own_device_bytes: 12,
        };
        let unit = HostUnit {
            name: "u".into(),
            layer: None,
            tensors: vec![meta.clone()],
            bytes: 12,
            own_bytes: 12,
            buf: RwLock::new(Box::new(ReadOnlyTier(data.clone()))),
        };
        assert_eq!(&*unit.tensor_bytes(&meta), &data[..]);
        assert_eq!(unit.cpu_tensor(&meta)?.to_vec1::<f32>()?, values);
        assert!(!unit.is_pinned());
        let new = Tensor::new(&[0f32, 0., 0.], &Device::Cpu)?;
        let err = unit.write(&[(&meta, &new)]).unwrap_err().to_string();
        assert!(err.contains("read-only"), "{err}");
        Ok(())
    }
}
