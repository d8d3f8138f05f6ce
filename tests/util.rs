//! Helpers: per-device test expansion and small synthetic models.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_offload::HostStore;
use rand::Rng as _;

/// Expands `fn $name(&Device) -> anyhow::Result<()>` into a CPU test and, with `cuda`, a GPU test.
macro_rules! test_device {
    ($name:ident, $cpu:ident, $gpu:ident) => {
        #[test]
        fn $cpu() -> anyhow::Result<()> {
            $name(&candle_core::Device::Cpu)
        }
        #[cfg(feature = "cuda")]
        #[test]
        fn $gpu() -> anyhow::Result<()> {
            $name(&candle_core::Device::new_cuda_with_stream(0)?)
        }
    };
}

/// Named weights of an MLP stack `layers.{i}.{weight,bias}` plus an `embed.weight`, with
/// deterministic pseudo-random values.
pub fn mlp_weights(n_layers: usize, width: usize) -> anyhow::Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    let mut rng = candle_offload_suite::rng(1);
    let scale = 1.0 / (width as f32).sqrt();
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| rng.random_range(-0.5f32..0.5) * scale)
            .collect()
    };
    out.push((
        "embed.weight".to_string(),
        Tensor::from_vec(values(width), width, &Device::Cpu)?,
    ));
    for i in 0..n_layers {
        out.push((
            format!("layers.{i}.weight"),
            Tensor::from_vec(values(width * width), (width, width), &Device::Cpu)?,
        ));
        out.push((
            format!("layers.{i}.bias"),
            Tensor::from_vec(values(width), width, &Device::Cpu)?,
        ));
    }
    Ok(out)
}

/// Runs the stack once, taking each layer from `get_layer`.
pub fn run_mlp(
    n_layers: usize,
    width: usize,
    device: &Device,
    mut layer: impl FnMut(usize, &Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let mut xs = Tensor::arange(0f32, width as f32, device)?
        .affine(1.0 / width as f64, 0.)?
        .reshape((1, width))?;
    for i in 0..n_layers {
        xs = layer(i, &xs)?.tanh()?;
    }
    Ok(xs)
}

/// The store of `mlp_weights` on `device`.
pub fn mlp_store(
    n_layers: usize,
    width: usize,
    device: &Device,
    dtype: Option<DType>,
) -> anyhow::Result<Arc<HostStore>> {
    let cfg = candle_offload::StoreConfig {
        dtype,
        ..Default::default()
    };
    Ok(Arc::new(HostStore::from_tensors(
        &mlp_weights(n_layers, width)?,
        &cfg,
        device,
    )?))
}

/// `tests/fixtures/NAME.tar.xz` unpacked (with `tar`) into a directory of this test process's
/// own, the same directory for every call with `dir` (a `OnceLock` of the caller's).
pub fn unpacked_fixture(
    name: &str,
    dir: &'static std::sync::OnceLock<Result<std::path::PathBuf, String>>,
) -> anyhow::Result<std::path::PathBuf> {
    dir.get_or_init(|| {
        let archive = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("tests/fixtures/{name}.tar.xz"));
        let dir = std::env::temp_dir().join(format!(
            "candle-offload-{}-{}",
            name.replace('_', "-"),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let out = std::process::Command::new("tar")
            .arg("xJf")
            .arg(&archive)
            .arg("-C")
            .arg(&dir)
            .output()
            .map_err(|e| format!("cannot run tar to unpack {}: {e}", archive.display()))?;
        if !out.status.success() {
            return Err(format!(
                "tar xJf {}: {}",
                archive.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(dir)
    })
    .clone()
    .map_err(anyhow::Error::msg)
}
