//! Checks and CPU helpers every op family shares: the dtypes the kernels take, the contiguous
//! part of a CPU buffer, F32 conversions, the alignment of the vector loads, and the dispatch
//! of a CPU loop over the float dtypes of its inputs.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType};

/// The most rows of x the decode kernels take (`linear_small`, `qlinear_small` and the 8-bit
/// copies of their x that the norm, the attention and the gate/up matmul hand over).
pub(crate) const LINEAR_SMALL_MAX_ROWS: usize = 8;

/// Refuses dtypes the kernels do not exist for, and mixed dtypes.
pub(crate) fn check_dtypes(op: &str, ts: &[&Tensor]) -> Result<DType> {
    let dtype = ts[0].dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("{op}: unsupported dtype {dtype:?} (F32, F16 or BF16)");
    }
    if let Some(t) = ts.iter().find(|t| t.dtype() != dtype) {
        candle_core::bail!("{op}: mixed dtypes {dtype:?} and {:?}", t.dtype());
    }
    Ok(dtype)
}

/// The contiguous part of a CPU buffer a layout covers.
pub(crate) fn contiguous<'a, T>(s: &'a [T], l: &Layout, op: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("{op}: input has to be contiguous"),
    }
}

pub(crate) fn f32_of<T: WithDType>(v: T) -> f32 {
    v.to_f64() as f32
}

pub(crate) fn of_f32<T: WithDType>(v: f32) -> T {
    T::from_f64(v as f64)
}

/// Applies `f` to two CPU buffers of one float dtype, giving a new buffer of that dtype.
macro_rules! cpu_dispatch2 {
    ($op:expr, $s1:expr, $s2:expr, $f:ident $(, $arg:expr)*) => {
        match ($s1, $s2) {
            (candle_core::CpuStorage::F32(a), candle_core::CpuStorage::F32(b)) => {
                candle_core::CpuStorage::F32($f(a, b $(, $arg)*)?)
            }
            (candle_core::CpuStorage::F16(a), candle_core::CpuStorage::F16(b)) => {
                candle_core::CpuStorage::F16($f(a, b $(, $arg)*)?)
            }
            (candle_core::CpuStorage::BF16(a), candle_core::CpuStorage::BF16(b)) => {
                candle_core::CpuStorage::BF16($f(a, b $(, $arg)*)?)
            }
            (a, _) => candle_core::bail!(
                "{}: unsupported dtype {:?}",
                $op,
                candle_core::backend::BackendStorage::dtype(a)
            ),
        }
    };
}
pub(crate) use cpu_dispatch2;

/// Whether `l`'s first element of a `dtype` buffer is 16-byte aligned (the vector loads of
/// the linear_small kernel; Candle's device buffers themselves start aligned).
pub(crate) fn aligned16(l: &Layout, dtype: DType) -> bool {
    (l.start_offset() * dtype.size_in_bytes()).is_multiple_of(16)
}

/// Applies `f` to three CPU buffers of one float dtype, giving a new buffer of that dtype.
macro_rules! cpu_dispatch3 {
    ($op:expr, $s1:expr, $s2:expr, $s3:expr, $f:ident $(, $arg:expr)*) => {
        match ($s1, $s2, $s3) {
            (
                candle_core::CpuStorage::F32(a),
                candle_core::CpuStorage::F32(b),
                candle_core::CpuStorage::F32(c),
            ) => candle_core::CpuStorage::F32($f(a, b, c $(, $arg)*)?),
            (
                candle_core::CpuStorage::F16(a),
                candle_core::CpuStorage::F16(b),
                candle_core::CpuStorage::F16(c),
            ) => candle_core::CpuStorage::F16($f(a, b, c $(, $arg)*)?),
            (
                candle_core::CpuStorage::BF16(a),
                candle_core::CpuStorage::BF16(b),
                candle_core::CpuStorage::BF16(c),
            ) => candle_core::CpuStorage::BF16($f(a, b, c $(, $arg)*)?),
            (a, _, _) => candle_core::bail!(
                "{}: unsupported dtype {:?}",
                $op,
                candle_core::backend::BackendStorage::dtype(a)
            ),
        }
    };
}
pub(crate) use cpu_dispatch3;

/// Applies `$f::<T>` to CPU buffers that are all of one float dtype `T` (the leading
/// arguments), passing the trailing arguments as they are; the result is whatever `$f` gives.
macro_rules! cpu_same {
    ($op:expr, [$($s:expr),+], $f:ident, |$($v:ident),+| ($($arg:expr),*)) => {
        match ($($s,)+) {
            ($(candle_core::CpuStorage::F32($v),)+) => $f($($v,)+ $($arg),*),
            ($(candle_core::CpuStorage::F16($v),)+) => $f($($v,)+ $($arg),*),
            ($(candle_core::CpuStorage::BF16($v),)+) => $f($($v,)+ $($arg),*),
            _ => candle_core::bail!("{}: unsupported or mixed dtypes", $op),
        }
    };
}
pub(crate) use cpu_same;

/// Wraps a typed CPU result as storage.
pub(crate) trait IntoCpu {
    fn into_cpu(self) -> CpuStorage;
}
impl IntoCpu for Vec<f32> {
    fn into_cpu(self) -> CpuStorage {
        CpuStorage::F32(self)
    }
}
impl IntoCpu for Vec<half::f16> {
    fn into_cpu(self) -> CpuStorage {
        CpuStorage::F16(self)
    }
}
impl IntoCpu for Vec<half::bf16> {
    fn into_cpu(self) -> CpuStorage {
        CpuStorage::BF16(self)
    }
}

/// The width of the rows of a buffer of `len` elements (`width` > 0 dividing `len`).
pub(crate) fn check_rows(op: &str, len: usize, width: usize) -> Result<()> {
    if width == 0 || !len.is_multiple_of(width) {
        candle_core::bail!("{op}: {len} elements are not rows of {width}");
    }
    Ok(())
}

/// A row's values as F32.
pub(crate) fn row_f32<T: WithDType>(row: &[T]) -> Vec<f32> {
    row.iter().map(|&v| f32_of(v)).collect()
}

/// `(2, dims…)`: a result of two outputs of `l`'s shape stacked (the sums, then the normed
/// rows; a gradient for each of two inputs).
pub(crate) fn stacked_shape(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

/// A device position's checks: one u32 on `like`'s device.
pub(crate) fn check_position(op: &str, pos: &Tensor, like: &Tensor) -> Result<()> {
    if pos.dtype() != DType::U32
        || pos.elem_count() != 1
        || !pos.device().same_device(like.device())
    {
        candle_core::bail!(
            "{op}: a position has to be one u32 on {:?}, not {:?} {:?} on {:?}",
            like.device(),
            pos.dtype(),
            pos.dims(),
            pos.device()
        );
    }
    Ok(())
}
