//! Helpers of the op tests: the dtypes and their tolerances, random inputs, relative differences,
//! and the row shapes the norm and the SiLU are checked on.

use candle_core::{DType, Device, Tensor};
use rand::Rng as _;

pub(crate) const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

pub(crate) fn tolerance(dtype: DType) -> f32 {
    if dtype == DType::F32 {
        1e-5
    } else {
        1e-2
    }
}

/// Uniform values in [-scale, scale) of `shape`, in `dtype` on `device`.
pub(crate) fn random(
    shape: &[usize],
    scale: f32,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> anyhow::Result<Tensor> {
    let n = shape.iter().product();
    let mut rng = candle_offload_suite::rng(seed);
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?)
}

/// max |got - want| / max |want| (in F32, on the CPU), after checking the shape; `got` and
/// `want` may differ in dtype and device (a reference computed in F32 on the CPU).
pub(crate) fn rel_diff_values(got: &Tensor, want: &Tensor) -> anyhow::Result<f32> {
    anyhow::ensure!(
        got.shape() == want.shape(),
        "shape {:?} != {:?}",
        got.shape(),
        want.shape()
    );
    let (g, w) = (
        got.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
        want.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
    );
    let diff = (g - &w)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let scale = w.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok(diff / scale.max(f32::MIN_POSITIVE))
}

/// [`rel_diff_values`] of two tensors of one dtype.
pub(crate) fn rel_diff(got: &Tensor, want: &Tensor) -> anyhow::Result<f32> {
    anyhow::ensure!(got.dtype() == want.dtype(), "dtype {:?}", got.dtype());
    rel_diff_values(got, want)
}

/// [`rel_diff_values`] within `dtype`'s [`tolerance`].
pub(crate) fn ensure_close_values(
    what: &str,
    got: &Tensor,
    want: &Tensor,
    dtype: DType,
) -> anyhow::Result<()> {
    let d = rel_diff_values(got, want)?;
    anyhow::ensure!(
        d <= tolerance(dtype),
        "{what} {dtype:?}: relative difference {d:e} > {:e}",
        tolerance(dtype)
    );
    Ok(())
}

/// [`ensure_close_values`] of two tensors of one dtype.
pub(crate) fn ensure_close(
    what: &str,
    got: &Tensor,
    want: &Tensor,
    dtype: DType,
) -> anyhow::Result<()> {
    anyhow::ensure!(got.dtype() == want.dtype(), "dtype {:?}", got.dtype());
    ensure_close_values(what, got, want, dtype)
}

/// Decode (one row), small and prefill shapes, with odd widths, and widths of parts of 8 (the
/// CUDA norm's register-resident kernel: one part a thread, several, and too many, which
/// falls back).
pub(crate) const ROW_SHAPES: [&[usize]; 10] = [
    &[1, 1, 1],
    &[1, 1, 7],
    &[1, 1, 577],
    &[1, 1, 4099],
    &[2, 9, 577],
    &[1, 33, 4099],
    &[5, 64],
    &[3, 5, 4104],
    &[1, 2, 20000],
    &[1, 1, 40000],
];
