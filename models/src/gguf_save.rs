//! Writing weights back as a GGUF file laid out as the GGUF they came from: a model loaded
//! from a GGUF and fine-tuned is saved with the source's metadata (architecture, tokenizer,
//! chat template, everything llama.cpp reads) and its tensor names, so that it loads again,
//! here or in llama.cpp, as the family it was. The tensors are given as the store holds them
//! (HF names; llama's q/k rows in HF order, put back into llama.cpp's here; Gemma's norms as
//! the file stores them, with the 1 added).

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};
use crate::gguf::gguf_content;
use crate::gguf_arch::{self, Permuted};

/// Writes `tensors` (HF names, as the store of a model loaded from the GGUF file `source`
/// holds them) to `out` as a GGUF file in `dtype` (F32, F16 or BF16), with `source`'s metadata
/// and tensor names. Every given tensor must have a place in `source`; the source's tensors
/// not given (the ones training leaves alone, such as Phi-3's LongRoPE factors) are copied as
/// they are. Written to a temporary file beside `out`, then renamed: a failure leaves any
/// earlier `out` as it was.
pub fn save_like(
    source: &Path,
    tensors: &[(String, Tensor)],
    dtype: DType,
    out: &Path,
) -> Result<()> {
    let ggml = match dtype {
        DType::F32 => GgmlDType::F32,
        DType::F16 => GgmlDType::F16,
        DType::BF16 => GgmlDType::BF16,
        other => {
            return Err(ModelError::config(
                out,
                "dtype",
                format!("{other:?} is not a GGUF float type (f32, f16, bf16)"),
            ))
        }
    };
    let (content, mut file) = gguf_content(source)?;
    let arch = gguf_arch::architecture(&content, source)?;
    let cfg = gguf_arch::config(&content, source)?;
    let tensor_err = |name: &str, e: candle_core::Error| ModelError::Tensor {
        path: source.to_path_buf(),
        tensor: name.to_string(),
        reason: e.to_string(),
    };
    let given: HashMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut used = std::collections::HashSet::new();
    // The source's order (by offset), so that the file reads as the source does.
    let mut names: Vec<(&String, u64)> = content
        .tensor_infos
        .iter()
        .map(|(n, i)| (n, i.offset))
        .collect();
    names.sort_by_key(|&(_, offset)| offset);
    let mut written: Vec<(String, QTensor)> = Vec::with_capacity(names.len());
    for (g, _) in names {
        let mapped = gguf_arch::hf_name(&arch, g);
        let q = match mapped
            .as_ref()
            .and_then(|(hf, p)| Some((given.get(hf.as_str())?, hf, p)))
        {
            Some((t, hf, perm)) => {
                used.insert(hf.clone());
                let t = match perm {
                    Some(Permuted::Q) => {
                        crate::lora::merge::gguf_permute(t, cfg.num_attention_heads)
                    }
                    Some(Permuted::K) => {
                        crate::lora::merge::gguf_permute(t, cfg.num_key_value_heads)
                    }
                    None => Ok((*t).clone()),
                };
                let t = t
                    .and_then(|t| t.to_device(&Device::Cpu)?.to_dtype(DType::F32))
                    .map_err(|e| tensor_err(g, e))?;
                let want = content.tensor_infos[g].shape.dims();
                if t.dims() != want {
                    return Err(ModelError::Tensor {
                        path: out.to_path_buf(),
                        tensor: hf.clone(),
                        reason: format!("shape {:?} where {g} is {want:?}", t.dims()),
                    });
                }
                // Norms and other vectors stay F32, as the converters write them.
                let ty = if t.rank() == 1 { GgmlDType::F32 } else { ggml };
                QTensor::quantize(&t, ty).map_err(|e| tensor_err(g, e))?
            }
            None => content
                .tensor(&mut file, g, &Device::Cpu)
                .map_err(|e| tensor_err(g, e))?,
        };
        written.push((g.clone(), q));
    }
    if let Some((name, _)) = tensors.iter().find(|(n, _)| !used.contains(n)) {
        return Err(ModelError::Tensor {
            path: source.to_path_buf(),
            tensor: name.clone(),
            reason: "has no place in the GGUF file the model came from".into(),
        });
    }
    // Candle's writer aligns the data to its default (32 bytes), which readers assume when
    // the key is absent.
    let mut metadata: Vec<(String, Value)> = content
        .metadata
        .into_iter()
        .filter(|(k, _)| k != "general.alignment")
        .collect();
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    // llama.cpp's `general.file_type`: all F32, mostly F16, mostly BF16.
    let file_type = match ggml {
        GgmlDType::F16 => 1,
        GgmlDType::BF16 => 32,
        _ => 0,
    };
    match metadata.iter_mut().find(|(k, _)| k == "general.file_type") {
        Some((_, v)) => *v = Value::U32(file_type),
        None => metadata.push(("general.file_type".into(), Value::U32(file_type))),
    }
    let meta_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = written.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tmp = out.with_extension("gguf.part");
    let write = || -> std::result::Result<(), String> {
        let mut f = std::fs::File::create(&tmp).map_err(|e| format!("cannot create: {e}"))?;
        gguf_file::write(&mut f, &meta_refs, &tensor_refs).map_err(|e| e.to_string())?;
        f.sync_all().map_err(|e| format!("cannot write: {e}"))?;
        std::fs::rename(&tmp, out).map_err(|e| format!("cannot rename into place: {e}"))
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ModelError::file(out, e)
    })
}
