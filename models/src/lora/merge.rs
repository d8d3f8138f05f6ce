//! Folding adapters into their base weights: `W + scale·B·A`, for dense weights in their dtype
//! and for GGML blocks (dequantized one weight at a time, the sum quantized again to the same
//! type, and the error that second quantization adds measured).
//!
//! Weights are merged as this crate holds them, in the HF checkpoint's row order: the GGUF
//! loader has already put llama's permuted q/k rows back. [`gguf_permute`] gives a merged q or
//! k weight llama.cpp's row order again, for writing it into a llama-architecture GGUF.

use candle_core::quantized::QTensor;
use candle_core::{DType, Result, Tensor};
use candle_offload::store::{HostUnit, TensorMeta};
use candle_offload::{HostStore, RawTensorSpec, StoreConfig, WeightFormat};

use super::Adapters;

/// `weight` (out, in) of the module at `path` with its adapter folded in, in the weight's
/// dtype; the weight itself where the module has no adapter.
pub fn merge_dense(adapters: &Adapters, path: &str, weight: &Tensor) -> Result<Tensor> {
    let Some(a) = adapters.get(path) else {
        return Ok(weight.clone());
    };
    let delta = a.delta_weight()?.to_device(weight.device())?;
    (weight.to_dtype(DType::F32)? + delta)?.to_dtype(weight.dtype())
}

/// What quantizing a merged weight again added.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequantError {
    /// ‖q(W + ΔW) − (W + ΔW)‖ / ‖W + ΔW‖, W the dequantized base.
    pub rel_l2: f64,
    /// ‖ΔW‖ / ‖W‖: how large the update is beside it.
    pub update_rel_l2: f64,
}

/// GGML blocks `q` (out, in) of the module at `path` with its adapter folded in: dequantized,
/// the update added in F32, quantized again to `q`'s type, with the error that adds; `None`
/// where the module has no adapter.
pub fn merge_blocks(
    adapters: &Adapters,
    path: &str,
    q: &QTensor,
) -> Result<Option<(QTensor, RequantError)>> {
    let Some(a) = adapters.get(path) else {
        return Ok(None);
    };
    let device = candle_core::Device::Cpu;
    let w = q.dequantize(&device)?;
    let delta = a.delta_weight()?.to_device(&device)?;
    let merged = (&w + &delta)?;
    let requant = QTensor::quantize(&merged, q.dtype())?;
    let back = requant.dequantize(&device)?;
    let norm = |t: &Tensor| -> Result<f64> {
        Ok(t.to_dtype(DType::F64)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f64>()?
            .sqrt())
    };
    let base = norm(&merged)?.max(f64::MIN_POSITIVE);
    let err = RequantError {
        rel_l2: norm(&(back - &merged)?)? / base,
        update_rel_l2: norm(&delta)? / norm(&w)?.max(f64::MIN_POSITIVE),
    };
    Ok(Some((requant, err)))
}

/// What [`merge_store`] did: weights merged, and per re-quantized weight the error it added.
#[derive(Debug, Clone, Default)]
pub struct MergeReport {
    /// Dense weights the adapters were added to.
    pub dense: usize,
    /// GGML-block weights merged and quantized again, with the error that added.
    pub requantized: Vec<(String, RequantError)>,
}

impl MergeReport {
    /// The largest error a re-quantization added (0 without any).
    pub fn max_requant_rel_l2(&self) -> f64 {
        self.requantized
            .iter()
            .map(|(_, e)| e.rel_l2)
            .fold(0.0, f64::max)
    }
}

/// A copy of `store` with `adapters` folded into their weights: dense weights in the store's
/// dtype, GGML blocks re-quantized to their type ([`merge_blocks`]); every other tensor as it
/// is. The copy is laid out by `cfg` on `device` as a new store (the original is left as it is).
pub fn merge_store(
    store: &HostStore,
    adapters: &Adapters,
    cfg: &StoreConfig,
    device: &candle_core::Device,
) -> std::result::Result<(HostStore, MergeReport), crate::ModelError> {
    let mut report = MergeReport::default();
    let merged = rebuild(store, cfg, device, |unit, t| {
        let path = t.name.strip_suffix(".weight").unwrap_or(&t.name);
        match t.format {
            WeightFormat::Ggml(_) => {
                let q = unit.cpu_qtensor(t)?;
                Ok(match merge_blocks(adapters, path, &q)? {
                    Some((m, err)) => {
                        report.requantized.push((t.name.clone(), err));
                        Stored::Blocks(Box::new(m))
                    }
                    None => Stored::Blocks(Box::new(q)),
                })
            }
            _ => {
                let w = unit.cpu_tensor(t)?;
                if adapters.get(path).is_some() {
                    report.dense += 1;
                    return Ok(Stored::Dense(merge_dense(adapters, path, &w)?));
                }
                Ok(Stored::Dense(w))
            }
        }
    })?;
    Ok((merged, report))
}

/// A copy of `store` for a frozen LoRA base: GGML blocks kept in the units whose names start
/// with `keep_blocks_under` (the decoder layers, whose projections carry the adapters),
/// dequantized elsewhere (embeddings, final norm, output head: read dense by training); the
/// store itself where nothing needs dequantizing.
pub fn frozen_base(
    store: std::sync::Arc<HostStore>,
    keep_blocks_under: &str,
    cfg: &StoreConfig,
    device: &candle_core::Device,
) -> std::result::Result<std::sync::Arc<HostStore>, crate::ModelError> {
    let outside = |name: &str| !name.starts_with(keep_blocks_under);
    let needs = store.units().iter().any(|u| {
        outside(u.name())
            && u.tensors()
                .iter()
                .any(|t| matches!(t.format, WeightFormat::Ggml(_)))
    });
    if !needs {
        return Ok(store);
    }
    let copy = rebuild(&store, cfg, device, |unit, t| match t.format {
        WeightFormat::Ggml(_) if !outside(unit.name()) => {
            Ok(Stored::Blocks(Box::new(unit.cpu_qtensor(t)?)))
        }
        WeightFormat::Ggml(_) => Ok(Stored::Dense(
            unit.cpu_qtensor(t)?.dequantize(&candle_core::Device::Cpu)?,
        )),
        _ => Ok(Stored::Dense(unit.cpu_tensor(t)?)),
    })?;
    Ok(std::sync::Arc::new(copy))
}

/// A tensor of a rebuilt store.
enum Stored {
    Dense(Tensor),
    Blocks(Box<QTensor>),
}

/// A new store of `store`'s tensors as `each` gives them, laid out by `cfg` on `device`.
fn rebuild(
    store: &HostStore,
    cfg: &StoreConfig,
    device: &candle_core::Device,
    mut each: impl FnMut(&HostUnit, &TensorMeta) -> Result<Stored>,
) -> std::result::Result<HostStore, crate::ModelError> {
    let mut specs = Vec::new();
    let mut data: Vec<Vec<u8>> = Vec::new();
    for unit in store.units() {
        for t in unit.tensors() {
            let (format, bytes) = match each(unit, t)? {
                Stored::Blocks(q) => (WeightFormat::Ggml(q.dtype()), q.data()?.into_owned()),
                Stored::Dense(w) => {
                    let v = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    (WeightFormat::Dense(DType::F32), bytes)
                }
            };
            specs.push(RawTensorSpec {
                name: t.name.clone(),
                format,
                shape: t.shape.clone(),
            });
            data.push(bytes);
        }
    }
    let index: std::collections::HashMap<String, usize> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.clone(), i))
        .collect();
    Ok(HostStore::from_raw(&specs, cfg, device, |spec, _, dst| {
        let bytes = &data[index[&spec.name]];
        if dst.len() != bytes.len() {
            return Err(candle_offload::Error::InvalidConfig {
                field: spec.name.clone(),
                reason: format!("{} bytes for a buffer of {}", bytes.len(), dst.len()),
            });
        }
        dst.copy_from_slice(bytes);
        Ok(())
    })?)
}

/// A q or k weight (heads·head_dim, in) in HF row order put into llama.cpp's order for
/// `heads` heads (its converter's `permute`: each head's two rotary halves interleaved), the
/// inverse of what the GGUF loader undoes.
pub fn gguf_permute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    if heads == 0 || out % (2 * heads) != 0 {
        candle_core::bail!(
            "gguf_permute: {out} rows do not split into {heads} heads of two halves"
        );
    }
    w.reshape((heads, 2, out / heads / 2, inp))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((out, inp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::LoraConfig;
    use candle_core::Device;
    use std::collections::BTreeMap;

    fn adapters(out: usize, inp: usize) -> Result<Adapters> {
        let a = Tensor::randn(0f32, 0.1, (4, inp), &Device::Cpu)?;
        let b = Tensor::randn(0f32, 0.1, (out, 4), &Device::Cpu)?;
        let mut t = BTreeMap::new();
        t.insert("m".to_string(), (a, b));
        Adapters::from_tensors(LoraConfig::default(), t, &Device::Cpu)
    }

    /// A merged dense weight gives the unmerged layer's output; merged blocks come back within
    /// the type's own error and report it.
    #[test]
    fn merged_weights_give_the_adapted_layer() -> Result<()> {
        let (out, inp) = (32, 256);
        let ad = adapters(out, inp)?;
        let w = Tensor::randn(0f32, 0.5, (out, inp), &Device::Cpu)?;
        let x = Tensor::randn(0f32, 1.0, (3, inp), &Device::Cpu)?;
        let merged = merge_dense(&ad, "m", &w)?;
        let want = (x.matmul(&w.t()?)? + ad.get("m").unwrap().delta(&x, false)?)?;
        let got = x.matmul(&merged.t()?)?;
        let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "{diff}");
        assert_eq!(
            merge_dense(&ad, "other", &w)?.to_vec2::<f32>()?,
            w.to_vec2::<f32>()?
        );
        let q = QTensor::quantize(&w, candle_core::quantized::GgmlDType::Q8_0)?;
        let (mq, err) = merge_blocks(&ad, "m", &q)?.unwrap();
        assert_eq!(mq.dtype(), q.dtype());
        assert!(err.rel_l2 > 0.0 && err.rel_l2 < 1e-2, "{err:?}");
        assert!(err.update_rel_l2 > 0.0);
        Ok(())
    }

    /// llama.cpp's permutation, undone as the GGUF loader undoes it, gives the weight back.
    #[test]
    fn gguf_permute_is_undone_by_the_inverse() -> Result<()> {
        let (heads, hd, inp) = (4, 8, 5);
        let w = Tensor::arange(0f32, (heads * hd * inp) as f32, &Device::Cpu)?
            .reshape((heads * hd, inp))?;
        let p = gguf_permute(&w, heads)?;
        assert_ne!(p.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        let back = p
            .reshape((heads, hd / 2, 2, inp))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((heads * hd, inp))?;
        assert_eq!(back.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        Ok(())
    }
}
