//! SIMD dot products of dense F16/BF16/F32 weight rows with a few rows of F32 activations, for
//! the CPU dense matmul of a decode step ([`crate::linear::cpu_dense`]): AVX-512 (16 lanes),
//! else AVX2/FMA/F16C (8 lanes), detected at run time, else scalar code that computes the same
//! sums.

use half::f16;

#[cfg(target_arch = "x86_64")]
use crate::linear::simd::{has_avx2, has_avx512, prefetch_ahead};

/// A dense weight row for [`dot_dense_rows`]: `k` values of one float type.
#[derive(Clone, Copy, Debug)]
pub(crate) enum DenseRow<'a> {
    F16(&'a [f16]),
    BF16(&'a [half::bf16]),
    F32(&'a [f32]),
}

impl DenseRow<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F16(w) => w.len(),
            Self::BF16(w) => w.len(),
            Self::F32(w) => w.len(),
        }
    }
}

/// The element type of a dense row, as the kernels' const parameter.
const DENSE_F16: u8 = 0;
const DENSE_BF16: u8 = 1;
const DENSE_F32: u8 = 2;

/// Activation rows the dense kernels multiply against one weight row at a time.
pub(crate) const DENSE_ROWS: usize = 8;

/// Calls `$f::<D, M>(args)` with `M` the number of rows (1 to [`DENSE_ROWS`]).
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($m:expr, $($f:ident)::+, $d:expr, $($arg:expr),*) => {
        match $m {
            1 => $($f)::+::<$d, 1>($($arg),*),
            2 => $($f)::+::<$d, 2>($($arg),*),
            3 => $($f)::+::<$d, 3>($($arg),*),
            4 => $($f)::+::<$d, 4>($($arg),*),
            5 => $($f)::+::<$d, 5>($($arg),*),
            6 => $($f)::+::<$d, 6>($($arg),*),
            7 => $($f)::+::<$d, 7>($($arg),*),
            _ => $($f)::+::<$d, 8>($($arg),*),
        }
    };
}

/// [`dot_dense_rows_add`] into a zeroed `out`, of rows `k` apart (the tests' reference form).
#[cfg(test)]
pub(crate) fn dot_dense_rows(w: DenseRow<'_>, xs: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    dot_dense_rows_add(w, xs, w.len(), out, crate::tuning::CPU_PREFETCH_BYTES);
}

/// The dot products of one dense weight row `w` (`k` values in F16, BF16 or F32) with each of
/// `out.len()` rows of F32 activations `xs[r * ldx..r * ldx + k]`, added to `out[r]`,
/// accumulated in F32: up to [`DENSE_ROWS`] activation rows per pass over the weight row, so
/// that a decode step of a few rows reads each weight once (and the matmul can walk `k` in
/// blocks whose activations stay in L1). AVX-512 (16 lanes), else AVX2/FMA/F16C (8 lanes),
/// detected at run time, else scalar.
/// `pf` as for [`dot_q8_0_q8_0`].
pub(crate) fn dot_dense_rows_add(
    w: DenseRow<'_>,
    xs: &[f32],
    ldx: usize,
    out: &mut [f32],
    pf: usize,
) {
    let k = w.len();
    let m = out.len();
    assert!(ldx >= k && (m == 0 || xs.len() >= (m - 1) * ldx + k));
    if k == 0 {
        return;
    }
    for (g, out) in out.chunks_mut(DENSE_ROWS).enumerate() {
        let xs = &xs[g * DENSE_ROWS * ldx..];
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            let m = out.len();
            let x = xs.as_ptr();
            let avx512 = has_avx512();
            // SAFETY: the CPU has AVX2, FMA and F16C (checked), and AVX-512F where
            // `dense_avx512` runs (`avx512`); `w` holds `k` values of the type `D` names, `xs`
            // `m` rows of `k` values `ldx` apart (checked above: `xs` starts at row
            // `g * DENSE_ROWS` of them), and `out` `m` (1 to 8) values.
            unsafe {
                match (w, avx512) {
                    (DenseRow::F16(w), true) => {
                        let w = w.as_ptr() as *const u8;
                        by_rows!(m, dense_avx512::dot_rows, DENSE_F16, w, k, x, ldx, out, pf)
                    }
                    (DenseRow::BF16(w), true) => {
                        let w = w.as_ptr() as *const u8;
                        by_rows!(m, dense_avx512::dot_rows, DENSE_BF16, w, k, x, ldx, out, pf)
                    }
                    (DenseRow::F32(w), true) => {
                        let w = w.as_ptr() as *const u8;
                        by_rows!(m, dense_avx512::dot_rows, DENSE_F32, w, k, x, ldx, out, pf)
                    }
                    (DenseRow::F16(w), false) => {
                        let w = w.as_ptr() as *const u8;
                        by_rows!(m, dense_avx2::dot_rows, DENSE_F16, w, k, x, ldx, out, pf)
                    }
                    (DenseRow::BF16(w), false) => {
                        let w = w.as_ptr() as *const u8;
                        by_rows!(m, dense_avx2::dot_rows, DENSE_BF16, w, k, x, ldx, out, pf)
                    }
                    (DenseRow::F32(w), false) => {
                        let w = w.as_ptr() as *const u8;
                        by_rows!(m, dense_avx2::dot_rows, DENSE_F32, w, k, x, ldx, out, pf)
                    }
                }
            }
            continue;
        }
        dot_dense_rows_add_scalar(w, xs, ldx, out);
    }
}

/// [`dot_dense_rows`] without SIMD.
#[cfg(test)]
pub(crate) fn dot_dense_rows_scalar(w: DenseRow<'_>, xs: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    dot_dense_rows_add_scalar(w, xs, w.len(), out);
}

/// [`dot_dense_rows_add`] without SIMD.
fn dot_dense_rows_add_scalar(w: DenseRow<'_>, xs: &[f32], ldx: usize, out: &mut [f32]) {
    let k = w.len();
    let row: Vec<f32> = match w {
        DenseRow::F16(w) => w.iter().map(|v| v.to_f32()).collect(),
        DenseRow::BF16(w) => w.iter().map(|v| v.to_f32()).collect(),
        DenseRow::F32(w) => w.to_vec(),
    };
    for (r, o) in out.iter_mut().enumerate() {
        let x = &xs[r * ldx..r * ldx + k];
        *o += row.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
    }
}

/// Bytes per element of a dense row of type `D`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
const fn size<const D: u8>() -> usize {
    match D {
        DENSE_F16 | DENSE_BF16 => 2,
        _ => 4,
    }
}

/// The value of element `i` of a dense row of type `D` at `w`, as f32.
///
/// # Safety
/// Element `i` of type `D` at `w` is readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dense_elem<const D: u8>(w: *const u8, i: usize) -> f32 {
    // SAFETY: the caller guarantees the element; the reads are unaligned.
    unsafe {
        match D {
            DENSE_F16 => {
                f16::from_bits(std::ptr::read_unaligned(w.add(2 * i) as *const u16)).to_f32()
            }
            DENSE_BF16 => {
                f32::from_bits((std::ptr::read_unaligned(w.add(2 * i) as *const u16) as u32) << 16)
            }
            _ => std::ptr::read_unaligned(w.add(4 * i) as *const f32),
        }
    }
}

/// One dense weight row against `M` activation rows, 8 lanes.
#[cfg(target_arch = "x86_64")]
mod dense_avx2 {
    use std::arch::x86_64::*;

    use super::{dense_elem, prefetch_ahead, size, DENSE_BF16, DENSE_F16};
    use crate::linear::simd::hsum;

    /// Values `i..i + 8` of a dense row of type `D` at `w`, as f32.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; the 8 elements are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const D: u8>(w: *const u8, i: usize) -> __m256 {
        // SAFETY: the caller guarantees the 8 elements (16 or 32 bytes); the loads are
        // unaligned.
        unsafe {
            match D {
                DENSE_F16 => _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * i) as *const __m128i)),
                DENSE_BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(w.add(2 * i) as *const __m128i),
                ))),
                _ => _mm256_loadu_ps(w.add(4 * i) as *const f32),
            }
        }
    }

    /// `out[r] +=` row `w` (`k` values of type `D`) · row `r` of `x` (`M` rows, `ldx` apart);
    /// two accumulators per row up to four rows, one beyond (16 registers).
    ///
    /// `pf`: how far ahead of its reads of the weights it prefetches, in bytes (0: not at all).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `k` values of type `D` at `w` and `M` rows of `k`
    /// values `ldx` apart at `x`
    /// are readable, and `out` holds `M` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows<const D: u8, const M: usize>(
        w: *const u8,
        k: usize,
        x: *const f32,
        ldx: usize,
        out: &mut [f32],
        pf: usize,
    ) {
        let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); M], [_mm256_setzero_ps(); M]);
        let mut i = 0;
        if M <= 4 {
            while i + 16 <= k {
                // SAFETY: elements `i..i + 16` are below `k`, inside the weight row and each
                // activation row (`r * ldx + i`, r < M); the loads are unaligned.
                unsafe {
                    prefetch_ahead(w, i * size::<D>(), pf);
                    let (w0, w1) = (load8::<D>(w, i), load8::<D>(w, i + 8));
                    for (r, (a0, a1)) in acc0.iter_mut().zip(acc1.iter_mut()).enumerate() {
                        let xr = x.add(r * ldx + i);
                        *a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), *a0);
                        *a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr.add(8)), *a1);
                    }
                }
                i += 16;
            }
        }
        while i + 8 <= k {
            // SAFETY: as above, for elements `i..i + 8`.
            unsafe {
                let w0 = load8::<D>(w, i);
                for (r, a) in acc0.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x.add(r * ldx + i)), *a);
                }
            }
            i += 8;
        }
        for (r, o) in out.iter_mut().enumerate().take(M) {
            let mut s = hsum(_mm256_add_ps(acc0[r], acc1[r]));
            for j in i..k {
                // SAFETY: `j` is below `k`: inside the weight row and activation row `r`.
                s += unsafe { dense_elem::<D>(w, j) * *x.add(r * ldx + j) };
            }
            *o += s;
        }
    }
}

/// One dense weight row against `M` activation rows, 16 lanes.
#[cfg(target_arch = "x86_64")]
mod dense_avx512 {
    use std::arch::x86_64::*;

    use super::{dense_elem, prefetch_ahead, size, DENSE_BF16, DENSE_F16};

    /// Values `i..i + 16` of a dense row of type `D` at `w`, as f32.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; the 16 elements are readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16<const D: u8>(w: *const u8, i: usize) -> __m512 {
        // SAFETY: the caller guarantees the 16 elements (32 or 64 bytes); the loads are
        // unaligned.
        unsafe {
            match D {
                DENSE_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(w.add(2 * i) as *const __m256i)),
                DENSE_BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(w.add(2 * i) as *const __m256i),
                ))),
                _ => _mm512_loadu_ps(w.add(4 * i) as *const f32),
            }
        }
    }

    /// `out[r] +=` row `w` (`k` values of type `D`) · row `r` of `x` (`M` rows, `ldx` apart),
    /// two accumulators per row (at most 16 of the 32 registers).
    ///
    /// `pf`: how far ahead of its reads of the weights it prefetches, in bytes (0: not at all).
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; `k` values of type `D` at `w` and `M` rows of
    /// `k` values `ldx` apart at `x` are readable, and `out` holds `M` values.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows<const D: u8, const M: usize>(
        w: *const u8,
        k: usize,
        x: *const f32,
        ldx: usize,
        out: &mut [f32],
        pf: usize,
    ) {
        let (mut acc0, mut acc1) = ([_mm512_setzero_ps(); M], [_mm512_setzero_ps(); M]);
        let mut i = 0;
        while i + 32 <= k {
            // SAFETY: elements `i..i + 32` are below `k`, inside the weight row and each
            // activation row (`r * ldx + i`, r < M); the loads are unaligned.
            unsafe {
                // 64 or 128 bytes of the row a step: one line or two.
                prefetch_ahead(w, i * size::<D>(), pf);
                if size::<D>() == 4 {
                    prefetch_ahead(w, i * 4 + 64, pf);
                }
                let (w0, w1) = (load16::<D>(w, i), load16::<D>(w, i + 16));
                for (r, (a0, a1)) in acc0.iter_mut().zip(acc1.iter_mut()).enumerate() {
                    let xr = x.add(r * ldx + i);
                    *a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), *a0);
                    *a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr.add(16)), *a1);
                }
            }
            i += 32;
        }
        if i + 16 <= k {
            // SAFETY: as above, for elements `i..i + 16`.
            unsafe {
                let w0 = load16::<D>(w, i);
                for (r, a) in acc0.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x.add(r * ldx + i)), *a);
                }
            }
            i += 16;
        }
        for (r, o) in out.iter_mut().enumerate().take(M) {
            let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
            for j in i..k {
                // SAFETY: `j` is below `k`: inside the weight row and activation row `r`.
                s += unsafe { dense_elem::<D>(w, j) * *x.add(r * ldx + j) };
            }
            *o += s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 250.0 - 2.0)
            .collect()
    }

    #[test]
    fn dense_dots_equal_scalar() {
        for k in [1usize, 5, 8, 15, 16, 17, 31, 32, 33, 47, 100, 576, 4099] {
            let w32 = ramp(k, 17);
            let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            let wb: Vec<half::bf16> = w32.iter().map(|&v| half::bf16::from_f32(v)).collect();
            for m in 1..=11usize {
                let xs = ramp(m * k, 29 + m as u32);
                // Per row, the sum of |products|: the bound of the summation order's rounding.
                let mags: Vec<f32> = xs
                    .chunks_exact(k)
                    .map(|x| w32.iter().zip(x).map(|(a, b)| (a * b).abs()).sum())
                    .collect();
                for w in [
                    DenseRow::F16(&w16),
                    DenseRow::BF16(&wb),
                    DenseRow::F32(&w32),
                ] {
                    let (mut got, mut want) = (vec![0f32; m], vec![0f32; m]);
                    dot_dense_rows(w, &xs, &mut got);
                    dot_dense_rows_scalar(w, &xs, &mut want);
                    for (r, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - e).abs() <= 1e-5 * mags[r],
                            "{w:?} k={k} m={m} r={r}: {g} {e}"
                        );
                    }
                    #[cfg(target_arch = "x86_64")]
                    if has_avx2() && m <= DENSE_ROWS {
                        // The AVX2 kernel too where AVX-512 takes the public path, with a prefetch.
                        let mut avx2 = vec![0f32; m];
                        let x = xs.as_ptr();
                        // SAFETY: the CPU has AVX2, FMA and F16C (checked); each row holds
                        // `k` values of its type, `xs` `m` rows of `k`, `avx2` `m` values.
                        unsafe {
                            match w {
                                DenseRow::F16(w) => by_rows!(
                                    m,
                                    dense_avx2::dot_rows,
                                    DENSE_F16,
                                    w.as_ptr() as *const u8,
                                    k,
                                    x,
                                    k,
                                    &mut avx2,
                                    256
                                ),
                                DenseRow::BF16(w) => by_rows!(
                                    m,
                                    dense_avx2::dot_rows,
                                    DENSE_BF16,
                                    w.as_ptr() as *const u8,
                                    k,
                                    x,
                                    k,
                                    &mut avx2,
                                    256
                                ),
                                DenseRow::F32(w) => by_rows!(
                                    m,
                                    dense_avx2::dot_rows,
                                    DENSE_F32,
                                    w.as_ptr() as *const u8,
                                    k,
                                    x,
                                    k,
                                    &mut avx2,
                                    256
                                ),
                            }
                        }
                        for ((g, e), mag) in avx2.iter().zip(&want).zip(&mags) {
                            assert!(
                                (g - e).abs() <= 1e-5 * mag,
                                "avx2 {w:?} k={k} m={m}: {g} {e}"
                            );
                        }
                    }
                }
            }
        }
        let mut out = [1f32; 3];
        dot_dense_rows(DenseRow::F32(&[]), &[], &mut out);
        assert_eq!(out, [0.0; 3]);
        // A segment of longer rows, added to what `out` holds.
        let (k, ldx, m) = (37, 100, 10);
        let xs = ramp(m * ldx, 41);
        let w = ramp(k, 43);
        let mut got = vec![1f32; m];
        dot_dense_rows_add(DenseRow::F32(&w), &xs[5..], ldx, &mut got, 4096);
        for (r, g) in got.iter().enumerate() {
            let x = &xs[5 + r * ldx..5 + r * ldx + k];
            let want = 1.0 + w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
            assert!(
                (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{r}: {g} {want}"
            );
        }
    }
}
