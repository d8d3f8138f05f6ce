//! Stores and runtimes the runtime's unit tests share.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Shape};

use super::config::OffloadConfig;
use super::shared::OffloadRuntime;
use crate::store::{HostStore, RawTensorSpec, StoreConfig, WeightFormat};

/// A store with one layer holding a quantized matrix (raw blocks of `q`) and a dense
/// vector, and a runtime over it on the CPU.
pub(super) fn runtime_with(q: &QTensor) -> anyhow::Result<OffloadRuntime> {
    let blocks = q.data()?.into_owned();
    let specs = [
        RawTensorSpec {
            name: "model.layers.0.proj.weight".into(),
            format: WeightFormat::Ggml(q.dtype()),
            shape: q.shape().clone(),
        },
        RawTensorSpec {
            name: "model.layers.0.norm.weight".into(),
            format: WeightFormat::Dense(DType::F32),
            shape: Shape::from(4),
        },
    ];
    let store = HostStore::from_raw(
        &specs,
        &StoreConfig::default(),
        &Device::Cpu,
        |s, f, dst| {
            if f.is_quantized() {
                dst.copy_from_slice(&blocks);
            } else {
                assert_eq!(f, WeightFormat::Dense(DType::F32), "{}", s.name);
                for (i, c) in dst.chunks_mut(4).enumerate() {
                    c.copy_from_slice(&(i as f32).to_le_bytes());
                }
            }
            Ok(())
        },
    )?;
    Ok(OffloadRuntime::new(
        Arc::new(store),
        &Device::Cpu,
        &OffloadConfig::default(),
    )?)
}

/// A store of `layers` layers, each one F32 vector `model.layers.{l}.w` of `len` zeros.
pub(super) fn zero_layers(layers: usize, len: usize, dev: &Device) -> anyhow::Result<HostStore> {
    let specs: Vec<RawTensorSpec> = (0..layers)
        .map(|l| RawTensorSpec {
            name: format!("model.layers.{l}.w"),
            format: WeightFormat::Dense(DType::F32),
            shape: Shape::from(len),
        })
        .collect();
    Ok(HostStore::from_raw(
        &specs,
        &StoreConfig::default(),
        dev,
        |_, _, dst| {
            dst.fill(0);
            Ok(())
        },
    )?)
}
