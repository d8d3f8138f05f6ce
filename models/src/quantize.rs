//! Quantize on load: a safetensors checkpoint's decoder-layer projections quantized to a GGML
//! type on the host, tensors spread over threads, cached as a GGUF next to the model, and
//! loaded from that file with the projections kept as blocks (`QMatMul`).
//!
//! **Which tensors.** Exactly those the GGUF loader keeps as blocks (`gguf::keeps_blocks`):
//! the 2-D `*_proj.weight`s inside decoder layers and an untied `lm_head.weight`, whose rows
//! are whole blocks of the type. Embeddings, norms and biases stay dense, in their source dtype
//! (F64 as F32). Projections whose rows are not whole blocks stay dense, with one warning.
//!
//! **The cache.** `candle-offload.<type>.gguf` in the directory of the model's first
//! safetensors file: the model directory, or for a hub model its snapshot directory in the HF
//! cache (`snapshots/<commit>/`, beside the links to the blobs). Where that directory is not
//! writable, the file goes to `loader::cache_dir()/quantized/<hash of that directory's
//! path>/`; both places are looked in. The file keeps the HF tensor names (no llama.cpp
//! renaming or q/k permutation: any family works) under `general.architecture =
//! "candle-offload-hf"`, so the GGUF model loader refuses it instead of misreading it.
//!
//! **Staleness.** The file records the quant type, a format version and the source's
//! identity: per safetensors file its name, size, modification time and a hash (FNV-1a) of its
//! header (names, dtypes, shapes, offsets), plus the hub revision (the snapshot's commit) when
//! the files sit in an HF cache snapshot. A cached file whose identity differs, or whose
//! tensors are not the ones the current rule makes (names, shapes, types), is rebuilt.
//!
//! **Atomicity.** The file is written to a temporary file in the same directory and renamed
//! over the cache name only once every tensor is written and synced. A failure (or a
//! cancellation from the progress callback) removes the temporary file: nothing half-written
//! is ever left as the cache.

use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Shape, Tensor};
use candle_offload::store::{RawTensorSpec, WeightFormat};
use candle_offload::{FileSource, HostStore, StoreConfig};

use crate::error::{ModelError, Result};
use crate::files::{cache_dir, ModelFiles, Weights};
use crate::gguf::{gguf_content, keeps_blocks};

/// The types quantize-on-load writes, by the names `--quantize` takes.
pub const TYPES: [(&str, GgmlDType); 5] = [
    ("q8_0", GgmlDType::Q8_0),
    ("q6_k", GgmlDType::Q6K),
    ("q5_k", GgmlDType::Q5K),
    ("q4_k", GgmlDType::Q4K),
    ("q4_0", GgmlDType::Q4_0),
];

/// The name of a type of [`TYPES`] (`q4_k`), or `None` for any other type.
pub fn type_name(t: GgmlDType) -> Option<&'static str> {
    TYPES.iter().find(|(_, x)| *x == t).map(|(n, _)| *n)
}

/// The type of [`TYPES`] named `name` (`q4_k`), or `None`.
pub fn parse_type(name: &str) -> Option<GgmlDType> {
    TYPES
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, t)| *t)
}

/// Bumped whenever the file layout or the metadata changes meaning; older files are rebuilt.
const FORMAT_VERSION: u32 = 1;
/// GGUF's default alignment of tensor data (Candle's reader assumes it without the key).
const ALIGN: u64 = 32;
/// `general.architecture` of the cache files: no GGUF model loader mistakes them for its own.
pub const ARCHITECTURE: &str = "candle-offload-hf";
const KEY_SOURCE: &str = "candle_offload.source";
const KEY_TYPE: &str = "candle_offload.quantize.type";
const KEY_VERSION: &str = "candle_offload.quantize.version";

/// Where a quantization stands, reported after each tensor is written.
#[derive(Debug, Clone)]
pub struct Progress<'a> {
    /// The tensor just written.
    pub tensor: &'a str,
    /// Tensors written so far.
    pub done: usize,
    /// Tensors in all.
    pub total: usize,
    /// Source bytes read so far.
    pub done_bytes: u64,
    /// Source bytes in all.
    pub total_bytes: u64,
}

/// The progress callback: called from the worker threads, one call at a time, after each
/// tensor; [`ControlFlow::Break`] cancels (the call then fails and nothing is cached).
pub type ProgressFn<'a> = &'a (dyn Fn(&Progress<'_>) -> ControlFlow<()> + Sync);

/// How to quantize.
#[derive(Clone, Copy, Default)]
pub struct QuantizeOptions<'a> {
    /// Where the cache file goes (and is looked for); `None`: next to the model (see the
    /// module documentation).
    pub cache_dir: Option<&'a Path>,
    /// Worker threads; `None`: the available parallelism.
    pub threads: Option<usize>,
    /// Called after each tensor (a binary draws its progress bar from it).
    pub progress: Option<ProgressFn<'a>>,
}

impl std::fmt::Debug for QuantizeOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantizeOptions")
            .field("cache_dir", &self.cache_dir)
            .field("threads", &self.threads)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

/// How the cache file was had.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CacheState {
    /// A valid cache file was found; nothing was quantized.
    Hit,
    /// There was none; it was built.
    Built,
    /// There was one for another source, revision or rule; it was rebuilt.
    Rebuilt {
        /// What differed.
        reason: String,
    },
}

/// The cache file of a quantized checkpoint.
#[derive(Debug, Clone)]
pub struct Cached {
    /// The GGUF file.
    pub path: PathBuf,
    /// Whether it was found or built.
    pub state: CacheState,
    /// The type its projections are in.
    pub ty: GgmlDType,
    /// Tensors held as GGML blocks.
    pub quantized_tensors: usize,
    /// Tensors held dense.
    pub dense_tensors: usize,
    /// Tensors this call quantized (0 on a hit).
    pub requantized: usize,
}

/// One tensor of the source and what it becomes.
#[derive(Debug, Clone)]
struct Planned {
    name: String,
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Absolute byte range in its safetensors file.
    start: u64,
    len: u64,
    /// Its GGML type in the cache (F32/F16/BF16 for a dense tensor).
    target: GgmlDType,
    /// Byte offset in the GGUF data section.
    offset: u64,
}

#[derive(Debug)]
struct Plan {
    paths: Vec<PathBuf>,
    tensors: Vec<Planned>,
    identity: String,
    /// Where the last tensor's bytes end, and the data section's padded length.
    data_end: u64,
    data_bytes: u64,
}

fn ggml_bytes(t: GgmlDType, shape: &[usize]) -> u64 {
    let elems: usize = shape.iter().product();
    (elems / t.block_size() * t.type_size()) as u64
}

fn is_dense(t: GgmlDType) -> bool {
    matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// GGML's type ids (Candle keeps its own mapping crate-private).
fn ggml_id(t: GgmlDType) -> u32 {
    match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

/// 64-bit FNV-1a: a stable hash (the standard library's may change between releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn st_dtype(s: &str) -> Option<DType> {
    Some(match s {
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "F32" => DType::F32,
        "F64" => DType::F64,
        _ => return None,
    })
}

/// The safetensors files of `files`, or the error for a model that is already quantized.
fn sources(files: &ModelFiles) -> Result<&[PathBuf]> {
    match &files.weights {
        Weights::Safetensors(paths) if !paths.is_empty() => Ok(paths),
        Weights::Safetensors(_) => Err(ModelError::Source {
            id: files.origin.clone(),
            reason: "has no safetensors files to quantize".into(),
        }),
        Weights::Gguf(path) => Err(ModelError::file(
            path,
            "is a GGUF file, already quantized: quantize-on-load takes a safetensors \
             checkpoint (load a GGUF as it is, with its blocks kept)",
        )),
    }
}

/// Reads every source header and decides each tensor's fate and place.
fn plan(files: &ModelFiles, ty: GgmlDType) -> Result<Plan> {
    let paths = sources(files)?.to_vec();
    let mut tensors = Vec::new();
    let mut ids = Vec::new();
    let mut uneven = Vec::new();
    for (fi, path) in paths.iter().enumerate() {
        let bad = |reason: String| ModelError::file(path, reason);
        let mut f = std::fs::File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
        let meta = f.metadata().map_err(|e| bad(format!("cannot stat: {e}")))?;
        let size = meta.len();
        let mut n = [0u8; 8];
        f.read_exact(&mut n)
            .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
        let n = u64::from_le_bytes(n);
        if n > size.saturating_sub(8) || n > 100 << 20 {
            return Err(bad(format!(
                "not a valid safetensors file: a header of {n} bytes in a file of {size}"
            )));
        }
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header)
            .map_err(|e| bad(format!("cannot read the header: {e}")))?;
        let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
            .map_err(|e| bad(format!("not a valid safetensors header: {e}")))?;
        let data_start = 8 + n;
        let mut names: Vec<&String> = json.keys().filter(|k| *k != "__metadata__").collect();
        names.sort();
        for name in names {
            let tbad = |reason: String| ModelError::Tensor {
                path: path.clone(),
                tensor: name.clone(),
                reason,
            };
            let v = &json[name];
            let dtype_s = v.get("dtype").and_then(|d| d.as_str()).unwrap_or("?");
            let dtype = st_dtype(dtype_s).ok_or_else(|| {
                tbad(format!(
                    "dtype {dtype_s}: quantize-on-load takes F16, BF16, F32 or F64 tensors"
                ))
            })?;
            let shape: Option<Vec<usize>> = v
                .get("shape")
                .and_then(|s| s.as_array())
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect());
            let offsets: Option<Vec<u64>> = v
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .and_then(|a| a.iter().map(|d| d.as_u64()).collect());
            let (Some(shape), Some(&[a, b])) = (shape, offsets.as_deref()) else {
                return Err(tbad("malformed header entry (shape, data_offsets)".into()));
            };
            let elems: usize = shape.iter().product();
            let len = (elems * dtype.size_in_bytes()) as u64;
            if b < a || b - a != len {
                return Err(tbad(format!(
                    "holds {} bytes, but its shape {shape:?} and dtype {dtype_s} need {len}",
                    b.saturating_sub(a)
                )));
            }
            if data_start + b > size {
                return Err(tbad(format!(
                    "its data ends at byte {}, past the end of the file ({size} bytes)",
                    data_start + b
                )));
            }
            let target = if keeps_blocks(name, ty, &shape) {
                ty
            } else {
                if shape.len() == 2 && keeps_blocks(name, ty, &[shape[0], ty.block_size()]) {
                    uneven.push(name.clone());
                }
                match dtype {
                    DType::F16 => GgmlDType::F16,
                    DType::BF16 => GgmlDType::BF16,
                    _ => GgmlDType::F32,
                }
            };
            tensors.push(Planned {
                name: name.clone(),
                file: fi,
                dtype,
                shape,
                start: data_start + a,
                len,
                target,
                offset: 0,
            });
        }
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as u64);
        ids.push(serde_json::json!({
            "name": path.file_name().map(|n| n.to_string_lossy().into_owned()),
            "size": size,
            "mtime_ns": mtime_ns,
            "header_fnv1a": format!("{:016x}", fnv1a(&header)),
        }));
    }
    if let Some(first) = uneven.first() {
        tracing::warn!(
            tensors = uneven.len(),
            first = %first,
            block = ty.block_size(),
            "rows are not whole blocks of {ty:?}: these projections stay dense"
        );
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let (mut offset, mut data_end) = (0u64, 0u64);
    for t in &mut tensors {
        t.offset = offset;
        data_end = offset + ggml_bytes(t.target, &t.shape);
        offset = data_end.next_multiple_of(ALIGN);
    }
    let identity = serde_json::json!({
        "files": ids,
        "revision": hub_revision(&paths[0]),
    })
    .to_string();
    Ok(Plan {
        paths,
        tensors,
        identity,
        data_end,
        data_bytes: offset,
    })
}

/// The commit of an HF cache snapshot that `path` sits in (`.../snapshots/<commit>/file`).
fn hub_revision(path: &Path) -> Option<String> {
    let dir = path.parent()?;
    let parent = dir.parent()?;
    (parent.file_name()? == "snapshots").then(|| dir.file_name()?.to_str().map(String::from))?
}

/// The directories the cache file may be in, in order of preference.
fn cache_dirs(plan: &Plan, opts: &QuantizeOptions<'_>) -> Vec<PathBuf> {
    if let Some(d) = opts.cache_dir {
        return vec![d.to_path_buf()];
    }
    let model_dir = plan.paths[0]
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let abs = std::path::absolute(&model_dir).unwrap_or_else(|_| model_dir.clone());
    let fallback = cache_dir()
        .join("quantized")
        .join(format!("{:016x}", fnv1a(abs.to_string_lossy().as_bytes())));
    vec![model_dir, fallback]
}

fn cache_name(ty: GgmlDType) -> String {
    let name = type_name(ty).map_or_else(|| format!("{ty:?}").to_lowercase(), String::from);
    format!("candle-offload.{name}.gguf")
}

/// Why the cache file at `path` does not serve `plan`, or `Ok` if it does.
fn check(path: &Path, plan: &Plan, ty: GgmlDType) -> std::result::Result<(), String> {
    let (c, file) = gguf_content(path).map_err(|e| e.to_string())?;
    let text = |k: &str| c.metadata.get(k).and_then(|v| v.to_string().ok()).cloned();
    if c.metadata.get(KEY_VERSION).and_then(|v| v.to_u32().ok()) != Some(FORMAT_VERSION) {
        return Err(format!(
            "written by another format version (want {FORMAT_VERSION})"
        ));
    }
    if text(KEY_TYPE).as_deref() != type_name(ty) {
        return Err(format!("holds {:?}, not {ty:?}", text(KEY_TYPE)));
    }
    if text(KEY_SOURCE).as_deref() != Some(plan.identity.as_str()) {
        tracing::debug!(cached = ?text(KEY_SOURCE), now = %plan.identity, "source identity differs");
        return Err("made from another source or revision".into());
    }
    if c.tensor_infos.len() != plan.tensors.len() {
        return Err(format!(
            "holds {} tensors, the source {}",
            c.tensor_infos.len(),
            plan.tensors.len()
        ));
    }
    for t in &plan.tensors {
        match c.tensor_infos.get(&t.name) {
            Some(i) if i.shape.dims() == t.shape && i.ggml_dtype == t.target => {}
            Some(i) => {
                return Err(format!(
                    "tensor {} is {:?} {:?}, the rule now makes it {:?} {:?}",
                    t.name,
                    i.ggml_dtype,
                    i.shape.dims(),
                    t.target,
                    t.shape
                ))
            }
            None => return Err(format!("has no tensor {}", t.name)),
        }
    }
    let size = file.metadata().map_err(|e| e.to_string())?.len();
    if size < c.tensor_data_offset + plan.data_end {
        return Err(format!("is truncated ({size} bytes)"));
    }
    Ok(())
}

fn put_str(w: &mut Vec<u8>, s: &str) {
    w.extend_from_slice(&(s.len() as u64).to_le_bytes());
    w.extend_from_slice(s.as_bytes());
}

/// The GGUF header (v3) of `plan`'s tensors, padded to the data section.
fn header(plan: &Plan, ty: GgmlDType) -> Vec<u8> {
    let strings = [
        ("general.architecture", ARCHITECTURE.to_string()),
        (KEY_TYPE, type_name(ty).unwrap_or_default().to_string()),
        (KEY_SOURCE, plan.identity.clone()),
    ];
    let u32s = [
        ("general.alignment", ALIGN as u32),
        (KEY_VERSION, FORMAT_VERSION),
    ];
    let mut w = Vec::new();
    w.extend_from_slice(&0x4655_4747u32.to_le_bytes());
    w.extend_from_slice(&3u32.to_le_bytes());
    w.extend_from_slice(&(plan.tensors.len() as u64).to_le_bytes());
    w.extend_from_slice(&((strings.len() + u32s.len()) as u64).to_le_bytes());
    for (k, v) in &strings {
        put_str(&mut w, k);
        w.extend_from_slice(&8u32.to_le_bytes());
        put_str(&mut w, v);
    }
    for (k, v) in u32s {
        put_str(&mut w, k);
        w.extend_from_slice(&4u32.to_le_bytes());
        w.extend_from_slice(&v.to_le_bytes());
    }
    for t in &plan.tensors {
        put_str(&mut w, &t.name);
        w.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().rev() {
            w.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        w.extend_from_slice(&ggml_id(t.target).to_le_bytes());
        w.extend_from_slice(&t.offset.to_le_bytes());
    }
    w.resize((w.len() as u64).next_multiple_of(ALIGN) as usize, 0);
    w
}

/// Removes the temporary file unless the write completed.
struct TempFile {
    path: PathBuf,
    keep: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// One tensor's bytes as the cache holds them.
fn convert(t: &Planned, src: &mut std::fs::File, ty: GgmlDType) -> candle_core::Result<Vec<u8>> {
    let mut raw = vec![0u8; t.len as usize];
    src.seek(SeekFrom::Start(t.start))?;
    src.read_exact(&mut raw)?;
    if t.target == ty {
        let x = Tensor::from_raw_buffer(&raw, t.dtype, &t.shape, &Device::Cpu)?;
        return Ok(QTensor::quantize(&x, ty)?.data()?.into_owned());
    }
    if t.dtype == DType::F64 {
        let x = Tensor::from_raw_buffer(&raw, t.dtype, &t.shape, &Device::Cpu)?;
        return candle_offload::store::tensor_to_bytes(&x.to_dtype(DType::F32)?);
    }
    Ok(raw)
}

/// Writes the cache file for `plan` into `dir`: a temporary file, renamed when complete.
fn build(plan: &Plan, ty: GgmlDType, dir: &Path, opts: &QuantizeOptions<'_>) -> Result<PathBuf> {
    let target = dir.join(cache_name(ty));
    std::fs::create_dir_all(dir)
        .map_err(|e| ModelError::file(dir, format!("cannot create: {e}")))?;
    let tmp = TempFile {
        path: dir.join(format!(".{}.{}.tmp", cache_name(ty), std::process::id())),
        keep: false,
    };
    let io = |p: &Path, what: &str, e: std::io::Error| ModelError::file(p, format!("{what}: {e}"));
    let mut out =
        std::fs::File::create(&tmp.path).map_err(|e| io(&tmp.path, "cannot create", e))?;
    let head = header(plan, ty);
    out.write_all(&head)
        .and_then(|_| out.set_len(head.len() as u64 + plan.data_bytes))
        .map_err(|e| io(&tmp.path, "cannot write", e))?;
    let data_start = head.len() as u64;

    // Largest tensors first, so that the threads finish together.
    let mut order: Vec<usize> = (0..plan.tensors.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(plan.tensors[i].len));
    let total_bytes: u64 = plan.tensors.iter().map(|t| t.len).sum();
    let threads = opts
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, plan.tensors.len().max(1));
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let failure: Mutex<Option<ModelError>> = Mutex::new(None);
    let done = Mutex::new((0usize, 0u64));
    let fail = |e: ModelError| {
        stop.store(true, Ordering::SeqCst);
        failure.lock().expect("failure lock").get_or_insert(e);
    };
    let span = tracing::info_span!("quantize", ty = ?ty, tensors = plan.tensors.len(), threads);
    let _entered = span.enter();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut out = match std::fs::OpenOptions::new().write(true).open(&tmp.path) {
                    Ok(f) => f,
                    Err(e) => return fail(io(&tmp.path, "cannot open", e)),
                };
                let mut srcs: Vec<Option<std::fs::File>> =
                    plan.paths.iter().map(|_| None).collect();
                while !stop.load(Ordering::SeqCst) {
                    let Some(&i) = order.get(next.fetch_add(1, Ordering::SeqCst)) else {
                        break;
                    };
                    let t = &plan.tensors[i];
                    let path = &plan.paths[t.file];
                    let src = match &mut srcs[t.file] {
                        Some(f) => f,
                        slot => match std::fs::File::open(path) {
                            Ok(f) => slot.insert(f),
                            Err(e) => return fail(io(path, "cannot open", e)),
                        },
                    };
                    let bytes = match convert(t, src, ty) {
                        Ok(b) => b,
                        Err(e) => {
                            return fail(ModelError::Tensor {
                                path: path.clone(),
                                tensor: t.name.clone(),
                                reason: format!("cannot quantize to {ty:?}: {e}"),
                            })
                        }
                    };
                    let want = ggml_bytes(t.target, &t.shape);
                    if bytes.len() as u64 != want {
                        return fail(ModelError::Tensor {
                            path: path.clone(),
                            tensor: t.name.clone(),
                            reason: format!("{} bytes as {:?}, want {want}", bytes.len(), t.target),
                        });
                    }
                    if let Err(e) = out
                        .seek(SeekFrom::Start(data_start + t.offset))
                        .and_then(|_| out.write_all(&bytes))
                    {
                        return fail(io(&tmp.path, &format!("cannot write tensor {}", t.name), e));
                    }
                    let mut d = done.lock().expect("progress lock");
                    d.0 += 1;
                    d.1 += t.len;
                    let p = Progress {
                        tensor: &t.name,
                        done: d.0,
                        total: plan.tensors.len(),
                        done_bytes: d.1,
                        total_bytes,
                    };
                    tracing::debug!(tensor = %t.name, done = p.done, total = p.total, "written");
                    if let Some(cb) = opts.progress {
                        if cb(&p).is_break() {
                            return fail(ModelError::file(
                                &target,
                                "quantize-on-load cancelled; nothing was cached",
                            ));
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().expect("failure lock") {
        return Err(e);
    }
    out.sync_all()
        .map_err(|e| io(&tmp.path, "cannot sync", e))?;
    drop(out);
    std::fs::rename(&tmp.path, &target)
        .map_err(|e| io(&target, "cannot rename the finished file into place", e))?;
    let mut tmp = tmp;
    tmp.keep = true;
    Ok(target)
}

/// Finds or builds the quantized cache file of `files` (a safetensors checkpoint) in `ty`,
/// one of [`TYPES`].
pub fn cached_gguf(
    files: &ModelFiles,
    ty: GgmlDType,
    opts: &QuantizeOptions<'_>,
) -> Result<Cached> {
    let path = files.weights_path();
    sources(files)?;
    if type_name(ty).is_none() {
        let names: Vec<&str> = TYPES.iter().map(|(n, _)| *n).collect();
        return Err(ModelError::config(
            path,
            "quantize",
            format!(
                "{ty:?} is not a quantize-on-load type ({})",
                names.join(", ")
            ),
        ));
    }
    let plan = plan(files, ty)?;
    let dirs = cache_dirs(&plan, opts);
    let mut stale = None;
    for dir in &dirs {
        let p = dir.join(cache_name(ty));
        if !p.is_file() {
            continue;
        }
        match check(&p, &plan, ty) {
            Ok(()) => {
                tracing::info!(path = %p.display(), "quantized cache hit");
                return Ok(counted(&plan, p, CacheState::Hit, 0));
            }
            Err(reason) => {
                tracing::info!(path = %p.display(), %reason, "quantized cache is stale; rebuilding");
                stale.get_or_insert(reason);
            }
        }
    }
    for (k, dir) in dirs.iter().enumerate() {
        match build(&plan, ty, dir, opts) {
            Ok(p) => {
                let n = plan.tensors.iter().filter(|t| t.target == ty).count();
                let state = match stale {
                    Some(reason) => CacheState::Rebuilt { reason },
                    None => CacheState::Built,
                };
                tracing::info!(path = %p.display(), quantized = n, "quantized cache written");
                return Ok(counted(&plan, p, state, n));
            }
            // Only a directory we may not write to sends us on to the next one.
            Err(ModelError::File { reason, .. })
                if reason.starts_with("cannot create") && k + 1 < dirs.len() =>
            {
                tracing::info!(dir = %dir.display(), %reason,
                    "cannot write the quantized cache next to the model; using the project cache");
            }
            Err(e) => return Err(e),
        }
    }
    Err(ModelError::file(
        path,
        "no directory for the quantized cache",
    ))
}

fn counted(plan: &Plan, path: PathBuf, state: CacheState, requantized: usize) -> Cached {
    let q = plan.tensors.iter().filter(|t| !is_dense(t.target)).count();
    let ty = plan
        .tensors
        .iter()
        .map(|t| t.target)
        .find(|t| !is_dense(*t))
        .unwrap_or(GgmlDType::F32);
    Cached {
        path,
        state,
        ty,
        quantized_tensors: q,
        dense_tensors: plan.tensors.len() - q,
        requantized,
    }
}

/// Loads a cache file written by [`cached_gguf`] into a host store for `files`' model: GGML
/// tensors stay blocks, dense ones are converted to `dtype`.
pub fn load_cached(
    files: &ModelFiles,
    gguf: &Path,
    dtype: DType,
    device: &Device,
    pinned_cap_bytes: Option<u64>,
) -> Result<HostStore> {
    let cfg = StoreConfig {
        dtype: Some(dtype),
        pinned_cap_bytes,
        ..Default::default()
    };
    load_cached_config(files, gguf, &cfg, device)
}

/// [`load_cached`] with every store setting, such as
/// [`StoreConfig::host_memory_limit`]: the units past it stay in the cache file (the disk
/// tier), their blocks read as they are and their dense tensors converted on every read. The
/// grouping is the model's; `cfg.dtype` `None` keeps each dense tensor's dtype.
pub fn load_cached_config(
    files: &ModelFiles,
    gguf: &Path,
    cfg: &StoreConfig,
    device: &Device,
) -> Result<HostStore> {
    let (c, mut file) = gguf_content(gguf)?;
    let arch = c
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok());
    if arch.map(String::as_str) != Some(ARCHITECTURE) {
        return Err(ModelError::config(
            gguf,
            "general.architecture",
            format!("is not a quantize-on-load cache file ({ARCHITECTURE})"),
        ));
    }
    let mut names: Vec<&String> = c.tensor_infos.keys().collect();
    names.sort();
    // Where each tensor is in the file, as it is there: HF names, no rows reordered.
    let (specs, sources): (Vec<RawTensorSpec>, Vec<Option<FileSource>>) = names
        .iter()
        .map(|n| {
            let info = &c.tensor_infos[*n];
            let format = WeightFormat::in_gguf(info.ggml_dtype);
            let spec = RawTensorSpec {
                name: (*n).clone(),
                format,
                shape: Shape::from(info.shape.dims()),
            };
            let at = c.tensor_data_offset + info.offset;
            (spec, Some(FileSource::new(gguf, at, format)))
        })
        .unzip();
    let cfg = StoreConfig {
        grouping: files.config.layout().grouping(),
        ..cfg.clone()
    };
    let store =
        HostStore::from_raw_in_files(&specs, &sources, &cfg, device, |spec, format, dst| {
            let info = &c.tensor_infos[&spec.name];
            let bad = |reason: String| candle_offload::Error::File {
                path: gguf.to_path_buf(),
                reason: format!("tensor {}: {reason}", spec.name),
            };
            let len = ggml_bytes(info.ggml_dtype, info.shape.dims());
            let mut read = |buf: &mut [u8]| {
                file.seek(SeekFrom::Start(c.tensor_data_offset + info.offset))
                    .and_then(|_| file.read_exact(buf))
                    .map_err(|e| bad(format!("cannot read: {e}")))
            };
            match (format, spec.format) {
                (a, b) if a == b => {
                    if dst.len() as u64 != len {
                        return Err(bad(format!(
                            "{} bytes in the file, {} in the store",
                            len,
                            dst.len()
                        )));
                    }
                    read(dst)
                }
                (WeightFormat::Dense(to), WeightFormat::Dense(from)) => {
                    let mut raw = vec![0u8; len as usize];
                    read(&mut raw)?;
                    let bytes =
                        Tensor::from_raw_buffer(&raw, from, info.shape.dims(), &Device::Cpu)
                            .and_then(|t| t.to_dtype(to))
                            .and_then(|t| candle_offload::store::tensor_to_bytes(&t))
                            .map_err(|e| bad(e.to_string()))?;
                    if bytes.len() != dst.len() {
                        return Err(bad(format!(
                            "{} bytes converted, {} in the store",
                            bytes.len(),
                            dst.len()
                        )));
                    }
                    dst.copy_from_slice(&bytes);
                    Ok(())
                }
                (to, from) => Err(bad(format!("cannot store {from:?} as {to:?}"))),
            }
        })?;
    Ok(store)
}

/// Quantizes `files` (a safetensors checkpoint) to `ty` through the cache ([`cached_gguf`])
/// and loads the result ([`load_cached`]).
pub fn load_store(
    files: &ModelFiles,
    ty: GgmlDType,
    dtype: DType,
    device: &Device,
    pinned_cap_bytes: Option<u64>,
    opts: &QuantizeOptions<'_>,
) -> Result<(HostStore, Cached)> {
    let cfg = StoreConfig {
        dtype: Some(dtype),
        pinned_cap_bytes,
        ..Default::default()
    };
    load_store_config(files, ty, &cfg, device, opts)
}

/// [`load_store`] with every store setting, such as [`StoreConfig::host_memory_limit`]: the
/// units past it stay in the cached GGUF (the disk tier; see [`load_cached_config`]).
pub fn load_store_config(
    files: &ModelFiles,
    ty: GgmlDType,
    cfg: &StoreConfig,
    device: &Device,
    opts: &QuantizeOptions<'_>,
) -> Result<(HostStore, Cached)> {
    let cached = cached_gguf(files, ty, opts)?;
    let store = load_cached_config(files, &cached.path, cfg, device)?;
    Ok((store, cached))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names_round_trip() {
        for (n, t) in TYPES {
            assert_eq!(parse_type(n), Some(t));
            assert_eq!(type_name(t), Some(n));
        }
        assert_eq!(parse_type("q3_k"), None);
    }

    #[test]
    fn fnv1a_is_the_reference_hash() {
        // FNV-1a 64 of "a" (the published test vector).
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn hub_revision_is_the_snapshot_commit() {
        let p = Path::new("/h/models--x--y/snapshots/abc123/model.safetensors");
        assert_eq!(hub_revision(p).as_deref(), Some("abc123"));
        assert_eq!(hub_revision(Path::new("/m/model.safetensors")), None);
    }
}
