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

/// `NAME` under Cargo's directory for integration tests' files (`target/tmp`), made if need
/// be; `candle-offload-NAME` in the system's temporary directory where that cannot be made (a
/// test binary carried to another machine finds no build directory there). Files that every
/// test run may share, written under fixed names.
pub fn shared_dir(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    if std::fs::create_dir_all(&dir).is_ok() {
        return dir;
    }
    let dir = std::env::temp_dir().join(format!("candle-offload-{name}"));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// `tests/fixtures/NAME.tar.xz` unpacked (with `tar`), once per version of the archive, into
/// `NAME-{FNV-1a hash of the archive}` in [`shared_dir`]`("fixtures")`: every test run and
/// every call with `dir` (a `OnceLock` of the caller's) reads the same files, which no test
/// writes. A new version of the archive unpacks beside the old ones (nothing is removed that
/// another test process, of another checkout sharing the build directory, may be reading).
pub fn unpacked_fixture(
    name: &str,
    dir: &'static std::sync::OnceLock<Result<std::path::PathBuf, String>>,
) -> anyhow::Result<std::path::PathBuf> {
    dir.get_or_init(|| unpack(name))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn unpack(name: &str) -> Result<std::path::PathBuf, String> {
    let archive = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/{name}.tar.xz"));
    let bytes = std::fs::read(&archive).map_err(|e| format!("{}: {e}", archive.display()))?;
    // FNV-1a: the same name for the same bytes from every build and toolchain.
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let root = shared_dir("fixtures");
    let dir = root.join(format!("{name}-{hash:016x}"));
    if dir.is_dir() {
        return Ok(dir);
    }
    // Unpacked beside it and renamed, so that a test process never sees half of it (a
    // directory whose unpacking failed is removed with its `TempDir`).
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
    Ok(dir)
}
