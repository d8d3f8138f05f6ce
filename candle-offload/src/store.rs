//! The host store: every weight, loaded once into (preferably page-locked) host memory,
//! grouped into units that move to the device together.
//!
//! Tensors are grouped by name: `model.layers.7.mlp.up_proj.weight` belongs to the unit
//! `model.layers.7` (see [`UnitGrouping`]); anything else belongs to its module
//! (`model.embed_tokens`, `lm_head`). Each unit is one contiguous host buffer with its tensors
//! at 256-byte aligned offsets, converted to the store's dtype on the way in.
//!
//! On a CUDA device the buffers are pinned (page-locked, portable, not write-combined, so the
//! CPU can still read them) up to a cap; past the cap, or where pinning fails, a unit stays in
//! pageable memory and its transfers go through the runtime's small pinned staging ring, with a
//! warning. Loading from safetensors streams tensor by tensor out of the memory-mapped file, so
//! the model is never held twice.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{RwLock, RwLockReadGuard};

use candle_core::{DType, Device, Shape, Tensor};

use crate::budget::human_bytes;
use crate::cache::UnitId;
use crate::error::{Error, Result};
use crate::sys;

/// Alignment of each tensor inside a unit's buffer.
const TENSOR_ALIGN: usize = 256;

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
    /// How tensor names map to units.
    pub grouping: UnitGrouping,
}

/// Where one tensor lives inside its unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Full name, as in the checkpoint.
    pub name: String,
    /// Dtype as stored.
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
    /// Byte offset in the unit's buffer.
    pub offset: usize,
    /// Byte length.
    pub nbytes: usize,
}

/// Host memory that holds one unit.
#[derive(Debug)]
pub(crate) enum HostBuffer {
    /// Page-locked; copies from it are true asynchronous DMA.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Pinned(sys::PinnedBuffer),
    /// Ordinary memory; on a GPU its copies go through the staging ring.
    Pageable(Vec<u8>),
}

impl HostBuffer {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Self::Pinned(p) => p.as_bytes(),
            Self::Pageable(v) => v,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Pinned(p) => p.as_bytes_mut(),
            Self::Pageable(v) => v,
        }
    }

    pub(crate) fn is_pinned(&self) -> bool {
        matches!(self, Self::Pinned(_))
    }
}

/// One unit: its tensors' layout and its host buffer.
#[derive(Debug)]
pub struct HostUnit {
    name: String,
    layer: Option<usize>,
    tensors: Vec<TensorMeta>,
    bytes: u64,
    /// Written only by [`OffloadRuntime::update_weights`](crate::OffloadRuntime::update_weights),
    /// after it has waited for every copy out of it.
    buf: RwLock<HostBuffer>,
}

/// The bytes of one tensor in a unit's host buffer, borrowed (the buffer cannot be rewritten
/// while this lives).
pub struct HostBytes<'a> {
    guard: RwLockReadGuard<'a, HostBuffer>,
    range: std::ops::Range<usize>,
}

impl std::ops::Deref for HostBytes<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.guard.bytes()[self.range.clone()]
    }
}

impl std::fmt::Debug for HostBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBytes({} bytes)", self.range.len())
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

    /// Bytes it takes on the device (the sum of its tensors).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether its host buffer is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.buffer().is_pinned()
    }

    fn buffer(&self) -> RwLockReadGuard<'_, HostBuffer> {
        // A writer that panicked left whole tensors behind (it copies tensor by tensor), so the
        // data is still well-formed.
        self.buf.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Host buffer length in bytes (tensors plus alignment padding).
    fn buffer_len(&self) -> usize {
        self.buffer().bytes().len()
    }

    /// The raw bytes of one of its tensors.
    pub fn tensor_bytes(&self, t: &TensorMeta) -> HostBytes<'_> {
        HostBytes {
            guard: self.buffer(),
            range: t.offset..t.offset + t.nbytes,
        }
    }

    /// A CPU copy of one of its tensors.
    pub fn cpu_tensor(&self, t: &TensorMeta) -> candle_core::Result<Tensor> {
        Tensor::from_raw_buffer(&self.tensor_bytes(t), t.dtype, t.shape.dims(), &Device::Cpu)
    }

    /// Overwrites tensors of this unit with new values (any float dtype, converted to the
    /// stored one; the shape must match). The caller guarantees that no copy out of the buffer
    /// is in flight.
    pub(crate) fn write(&self, values: &[(&TensorMeta, &Tensor)]) -> candle_core::Result<()> {
        let mut encoded = Vec::with_capacity(values.len());
        for (meta, value) in values {
            if value.dims() != meta.shape.dims() {
                candle_core::bail!(
                    "cannot update {}: shape {:?}, the store holds {:?}",
                    meta.name,
                    value.dims(),
                    meta.shape.dims()
                );
            }
            let value = value.to_device(&Device::Cpu)?.to_dtype(meta.dtype)?;
            encoded.push((meta.offset, tensor_to_bytes(&value)?));
        }
        let mut buf = self.buf.write().unwrap_or_else(|e| e.into_inner());
        let bytes = buf.bytes_mut();
        for (offset, data) in encoded {
            bytes[offset..offset + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }
}

/// All weights of a model in host memory, grouped into units.
#[derive(Debug)]
pub struct HostStore {
    units: Vec<HostUnit>,
    unit_index: HashMap<String, UnitId>,
    tensor_index: HashMap<String, (UnitId, usize)>,
}

/// A tensor to create in [`HostStore::from_fn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Full name (decides its unit).
    pub name: String,
    /// Dtype before the store's conversion.
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
}

/// One tensor of a source, before it is placed.
struct Pending {
    name: String,
    dtype: DType,
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
            .map(|p| sys::MappedFile::open(p.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let mut files = Vec::with_capacity(maps.len());
        for m in &maps {
            let st = safetensors::SafeTensors::deserialize(m.bytes()).map_err(|e| Error::File {
                path: m.path().to_path_buf(),
                reason: format!("not a valid safetensors file: {e}"),
            })?;
            files.push(st);
        }
        let mut pending = Vec::new();
        let mut origin: Vec<(usize, String)> = Vec::new();
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
                    dtype,
                    shape: Shape::from(view.shape()),
                });
                origin.push((fi, name));
            }
        }
        Self::build(pending, cfg, device, |i, dst_dtype, dst| {
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
                dtype: t.dtype(),
                shape: t.shape().clone(),
            })
            .collect();
        Self::build(pending, cfg, device, |i, dst_dtype, dst| {
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
                dtype: s.dtype,
                shape: s.shape.clone(),
            })
            .collect();
        Self::build(pending, cfg, device, |i, dtype, dst| {
            fill(&specs[i], dtype, dst)
        })
    }

    fn build(
        pending: Vec<Pending>,
        cfg: &StoreConfig,
        device: &Device,
        mut fill: impl FnMut(usize, DType, &mut [u8]) -> Result<()>,
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

        let mut pinner = sys::Pinner::for_device(device, cfg.pinned_cap_bytes)?;
        let mut units = Vec::with_capacity(groups.len());
        let mut unit_index = HashMap::new();
        let mut tensor_index = HashMap::new();
        for (unit_name, layer, members) in groups {
            let uid = UnitId(units.len());
            let mut tensors = Vec::with_capacity(members.len());
            let mut len = 0usize;
            for &i in &members {
                let p = &pending[i];
                let dtype = match cfg.dtype {
                    Some(d) if p.dtype.is_float() && d.is_float() => d,
                    _ => p.dtype,
                };
                len = len.next_multiple_of(TENSOR_ALIGN);
                let nbytes = p.shape.elem_count() * dtype.size_in_bytes();
                tensors.push(TensorMeta {
                    name: p.name.clone(),
                    dtype,
                    shape: p.shape.clone(),
                    offset: len,
                    nbytes,
                });
                len += nbytes;
            }
            let mut buf = pinner.alloc(len, &unit_name)?;
            {
                let bytes = buf.bytes_mut();
                for (t, &i) in tensors.iter().zip(&members) {
                    fill(i, t.dtype, &mut bytes[t.offset..t.offset + t.nbytes])?;
                }
            }
            for (k, t) in tensors.iter().enumerate() {
                tensor_index.insert(t.name.clone(), (uid, k));
            }
            unit_index.insert(unit_name.clone(), uid);
            let bytes = tensors.iter().map(|t| t.nbytes as u64).sum();
            units.push(HostUnit {
                name: unit_name,
                layer,
                tensors,
                bytes,
                buf: RwLock::new(buf),
            });
        }
        let store = Self {
            units,
            unit_index,
            tensor_index,
        };
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

    /// Bytes in pageable buffers.
    pub fn pageable_bytes(&self) -> u64 {
        self.units
            .iter()
            .filter(|u| !u.is_pinned())
            .map(|u| u.buffer_len() as u64)
            .sum()
    }
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
}
