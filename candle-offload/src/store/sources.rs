//! Where a [`HostStore`]'s weights come from: safetensors files, named tensors, a fill function
//! over tensor specifications (dense or GGML blocks, as a GGUF loader gives them), with or
//! without their places in checkpoint files ([`FileSource`]) for the disk tier.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};

use super::config::StoreConfig;
use super::convert::{convert_into, tensor_to_bytes};
use super::disk::FileSpan;
use super::format::WeightFormat;
use super::host::HostStore;
use super::layout::Pending;
use crate::error::{Error, Result};
use crate::sys;

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
    use candle_core::quantized::GgmlDType;

    use super::*;
    use crate::budget::MemoryLimit;
    use crate::sys::TierKind;
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
    fn only_the_units_asked_for_are_loaded() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 6., &dev)?.reshape((2, 3))?;
        let named: Vec<(String, Tensor)> =
            ["model.embed.w", "model.layers.0.w", "model.layers.1.w"]
                .iter()
                .map(|n| (n.to_string(), a.clone()))
                .collect();
        let store = HostStore::from_tensors(
            &named,
            &StoreConfig {
                only_units: Some(vec!["model.layers.1".into()]),
                ..Default::default()
            },
            &dev,
        )?;
        let names: Vec<&str> = store.units().iter().map(|u| u.name()).collect();
        assert_eq!(names, ["model.layers.1"]);
        assert!(store.tensor("model.layers.0.w").is_none());
        let (u, meta) = store.tensor("model.layers.1.w").unwrap();
        let back = store.unit(u).cpu_tensor(meta)?;
        assert_eq!(back.to_vec2::<f32>()?, a.to_vec2::<f32>()?);
        assert_eq!(store.total_bytes(), 24);
        Ok(())
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
    fn units_past_the_cap_go_to_disk_in_unit_order() -> anyhow::Result<()> {
        // Three layers of 1 KiB and a 256-byte embedding, F32 in a safetensors file.
        let tmp = tempfile::Builder::new()
            .prefix("candle-offload-store-")
            .tempdir()?;
        let dir = tmp.path();
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
        Ok(())
    }
}
