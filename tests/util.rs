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

/// A fresh directory of this test's own under the system's temporary directory, named
/// `candle-offload-{tag}-` and a random suffix, removed with everything in it when dropped (also
/// when the test fails). Reads as the directory's `Path`.
pub struct Scratch(tempfile::TempDir);

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        self.0.path()
    }
}

impl AsRef<std::path::Path> for Scratch {
    fn as_ref(&self) -> &std::path::Path {
        self.0.path()
    }
}

/// A new [`Scratch`] directory tagged `tag` (panics where the temporary directory cannot be
/// written: nothing in the test could run).
pub fn scratch(tag: &str) -> Scratch {
    let dir = tempfile::Builder::new()
        .prefix(&format!("candle-offload-{tag}-"))
        .tempdir()
        .unwrap_or_else(|e| panic!("cannot create a temporary directory for {tag}: {e}"));
    Scratch(dir)
}

/// `tests/fixtures/NAME.tar.xz` unpacked (with `tar`), once per version of the archive, into
/// `NAME-{hash of the archive}` under Cargo's directory for integration tests' files
/// (`target/tmp`; `candle-offload-fixtures` in the temporary directory where that cannot be
/// made): every test run and every call with `dir` (a `OnceLock` of the caller's) reads
/// the same files, no copy piles up from run to run, and another version's
/// directory is removed when a new one is unpacked.
pub fn unpacked_fixture(
    name: &str,
    dir: &'static std::sync::OnceLock<Result<std::path::PathBuf, String>>,
) -> anyhow::Result<std::path::PathBuf> {
    dir.get_or_init(|| unpack(name))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn unpack(name: &str) -> Result<std::path::PathBuf, String> {
    use std::hash::{Hash as _, Hasher as _};
    let archive = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/{name}.tar.xz"));
    let bytes = std::fs::read(&archive).map_err(|e| format!("{}: {e}", archive.display()))?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut hasher);
    // A test binary carried to another machine may find no build directory there.
    let mut root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fixtures");
    if std::fs::create_dir_all(&root).is_err() {
        root = std::env::temp_dir().join("candle-offload-fixtures");
        std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    }
    let dir = root.join(format!("{name}-{:016x}", hasher.finish()));
    if dir.is_dir() {
        return Ok(dir);
    }
    // Unpacked beside it and renamed, so that a test process never sees half of it.
    let partial = tempfile::Builder::new()
        .prefix(&format!(".{name}-"))
        .tempdir_in(&root)
        .map_err(|e| format!("{}: {e}", root.display()))?;
    let out = std::process::Command::new("tar")
        .arg("xJf")
        .arg(&archive)
        .arg("-C")
        .arg(partial.path())
        .output()
        .map_err(|e| format!("cannot run tar to unpack {}: {e}", archive.display()))?;
    if !out.status.success() {
        return Err(format!(
            "tar xJf {}: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let unpacked = partial.keep();
    if std::fs::rename(&unpacked, &dir).is_err() {
        // Another test process renamed its copy first: use that one.
        let _ = std::fs::remove_dir_all(&unpacked);
        if !dir.is_dir() {
            return Err(format!(
                "cannot move {} to {}",
                unpacked.display(),
                dir.display()
            ));
        }
    }
    for old in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let path = old.path();
        let stale = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
            n.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        });
        if stale && path != dir {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
    Ok(dir)
}
