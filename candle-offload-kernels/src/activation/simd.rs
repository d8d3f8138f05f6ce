//! `silu(gate) · up` over F32 slices with a vectorized `exp` (AVX2 and FMA): a mixture of
//! experts' activations on the CPU between its two passes of matmuls; and the same `exp` for a
//! CPU decode step's softmax numerators.

#[cfg(target_arch = "x86_64")]
use crate::linear::has_avx2;

/// `g / (1 + e^-g) · u` for each pair of `g` and `u` (the same length), into a new vector.
/// Where the CPU runs the SIMD kernels (AVX2, FMA and F16C, `linear::has_avx2`), `e^x` is
/// Cephes' single-precision polynomial, and each value is within 4 ulp of the scalar formula's
/// with `f32::exp` (the test's bound); elsewhere that formula.
pub fn silu_mul_f32(g: &[f32], u: &[f32]) -> Vec<f32> {
    assert_eq!(
        g.len(),
        u.len(),
        "silu_mul_f32: gate and up differ in length"
    );
    let mut out = vec![0f32; g.len()];
    #[cfg(target_arch = "x86_64")]
    let done = if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (`has_avx2`); the three slices have the same length.
        unsafe { avx2::silu_mul(g, u, &mut out) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for ((o, &g), &u) in out[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
    out
}

/// `x ← e^(x - shift)` for each value, by the same vectorized `exp` as [`silu_mul_f32`] where
/// the CPU runs the SIMD kernels (within 4 ulp of `f32::exp`'s), elsewhere `f32::exp`: the
/// numerators of a softmax (a decode step's attention scores, a router's logits).
pub fn exp_shifted_in_place(x: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    let done = if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (`has_avx2`).
        unsafe { avx2::exp_shifted(x, shift) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for v in &mut x[done..] {
        *v = (*v - shift).exp();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `e^x` lane by lane: x clamped to where the result is finite and normal, split into
    /// `n · ln 2 + r` with |r| <= ln 2 / 2, `e^r` by a degree-7 polynomial, then scaled by `2^n`
    /// through the exponent bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.336_55)),
            _mm256_set1_ps(88.376_26),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        // ln 2 in two parts, so that n · ln2_hi is exact.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_fmadd_ps(
            p,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(e, _mm256_castsi256_ps(pow2))
    }

    /// [`super::exp_shifted_in_place`] over whole vectors of 8; returns how many values it
    /// wrote.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_shifted(x: &mut [f32], shift: f32) -> usize {
        let whole = x.len() / 8 * 8;
        let s = _mm256_set1_ps(shift);
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= whole <= x.len(); unaligned loads and stores.
            unsafe {
                let v = _mm256_loadu_ps(x.as_ptr().add(i));
                _mm256_storeu_ps(x.as_mut_ptr().add(i), exp(_mm256_sub_ps(v, s)));
            }
        }
        whole
    }

    /// [`super::silu_mul_f32`] over whole vectors of 8; returns how many values it wrote.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `g`, `u` and `out` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        let whole = g.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= whole <= the slices' common length; unaligned loads and stores.
            unsafe {
                let gv = _mm256_loadu_ps(g.as_ptr().add(i));
                let uv = _mm256_loadu_ps(u.as_ptr().add(i));
                let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
                let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, uv));
            }
        }
        whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized values are within a few ulp of `f32::exp`'s, from values that
    /// overflow `e^-g` to ones that underflow it, including a tail shorter than a vector.
    #[test]
    fn silu_mul_f32_matches_the_scalar_formula() {
        let g: Vec<f32> = (0..1003).map(|i| (i as f32 - 501.0) * 0.2).collect();
        let u: Vec<f32> = (0..1003)
            .map(|i| ((i * 7) % 13) as f32 * 0.3 - 1.7)
            .collect();
        let got = silu_mul_f32(&g, &u);
        for ((&g, &u), &got) in g.iter().zip(&u).zip(&got) {
            let want = g / (1.0 + (-g).exp()) * u;
            let tol = 4.0 * f32::EPSILON * want.abs() + 1e-30;
            assert!(
                (got - want).abs() <= tol,
                "g {g} u {u}: {got} against {want}"
            );
        }
        assert!(silu_mul_f32(&[], &[]).is_empty());
    }

    /// The shifted exponentials are within a few ulp of `f32::exp`'s, a tail included.
    #[test]
    fn exp_shifted_matches_f32_exp() {
        let x: Vec<f32> = (0..203).map(|i| i as f32 * 0.37 - 60.0).collect();
        let mut got = x.clone();
        exp_shifted_in_place(&mut got, 3.5);
        for (&x, &got) in x.iter().zip(&got) {
            let want = (x - 3.5).exp();
            assert!(
                (got - want).abs() <= 4.0 * f32::EPSILON * want + 1e-37,
                "x {x}: {got} against {want}"
            );
        }
    }
}
