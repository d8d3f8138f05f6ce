//! Q4_K and Q6_K weight rows against Q8_K activations with a software prefetch: the decode
//! step's K-quant host layers ([`crate::linear::cpu_quant`]'s K-quant loop).
//!
//! Candle's own `vec_dot` for these types (its AVX2 kernels) reads each row without asking
//! the memory for anything ahead, and no prefetch can be put inside it; these kernels add one
//! (docs/tuning.md, CPU prefetch distance). They compute exactly what Candle's AVX2 `vec_dot`
//! computes, in the same order (the integer sums are exact, and every float operation is the
//! same one on the same lanes), so their results are Candle's bit for bit; they only add the
//! prefetch. Without AVX2 they call Candle's `vec_dot`.
//!
//! Blocks are Candle's `#[repr(C)]` structs, read here as bytes (their fields are private to
//! Candle): Q4_K `[d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]]` (144 bytes), Q6_K
//! `[ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16]` (210 bytes), Q8_K `[d: f32,
//! qs: [i8; 256], bsums: [i16; 16]]` (292 bytes).

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ6K, BlockQ8K, QK_K};
use candle_core::quantized::GgmlType;

/// Row `x` of Q4_K blocks against activations `y` (as many Q8_K blocks): Candle's
/// `BlockQ4K::vec_dot`, bit for bit, prefetching the row ahead.
/// `pf`: the bytes ahead of its reads of `x` it prefetches (0: none).
pub(crate) fn dot_q4k_q8k(x: &[BlockQ4K], y: &[BlockQ8K], pf: usize) -> f32 {
    assert_eq!(x.len(), y.len(), "Q4_K row against Q8_K activations");
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above); `x` and `y` are slices of
        // `x.len()` whole blocks of Candle's `#[repr(C)]` types, whose sizes are asserted below.
        return unsafe { avx2::dot_q4k_q8k(x.as_ptr().cast(), y.as_ptr().cast(), x.len(), pf) };
    }
    BlockQ4K::vec_dot(x.len() * QK_K, x, y)
}

/// Row `x` of Q4_K blocks against each of `out.len()` rows of Q8_K activations in `ys` (one
/// after the other, each as many blocks as `x`), into `out`: [`dot_q4k_q8k`] of each row, bit
/// for bit, with each weight block's scales, mins and nibbles unpacked once for four rows (a
/// prompt's rows). `pf` as for [`dot_q4k_q8k`].
pub(crate) fn dot_q4k_q8k_rows(x: &[BlockQ4K], ys: &[BlockQ8K], out: &mut [f32], pf: usize) {
    let nb = x.len();
    assert_eq!(
        ys.len(),
        out.len() * nb,
        "Q4_K row against rows of Q8_K activations"
    );
    let one = |r: usize| dot_q4k_q8k(x, &ys[r * nb..(r + 1) * nb], pf);
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above); `x` is `nb` whole blocks,
        // and each four rows `r..r + 4` of `ys` `nb` each (`by_fours` passes
        // `r + 4 <= out.len()`), of Candle's `#[repr(C)]` types whose sizes are asserted
        // below.
        let four = |r: usize| unsafe {
            avx2::dot_q4k_q8k_x4(x.as_ptr().cast(), ys[r * nb..].as_ptr().cast(), nb, pf)
        };
        return super::simd::by_fours(out, four, one);
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = one(r);
    }
}

/// Row `x` of Q6_K blocks against activations `y` (as many Q8_K blocks): Candle's
/// `BlockQ6K::vec_dot`, bit for bit, prefetching the row ahead.
/// `pf` as for [`dot_q4k_q8k`].
pub(crate) fn dot_q6k_q8k(x: &[BlockQ6K], y: &[BlockQ8K], pf: usize) -> f32 {
    assert_eq!(x.len(), y.len(), "Q6_K row against Q8_K activations");
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        // SAFETY: as in `dot_q4k_q8k`.
        return unsafe { avx2::dot_q6k_q8k(x.as_ptr().cast(), y.as_ptr().cast(), x.len(), pf) };
    }
    BlockQ6K::vec_dot(x.len() * QK_K, x, y)
}

/// Row `x` of Q6_K blocks against each of `out.len()` rows of Q8_K activations in `ys`, into
/// `out`: [`dot_q6k_q8k`] of each row, bit for bit, each weight block's quants and scales
/// unpacked once for four rows. `pf` as for [`dot_q4k_q8k`].
pub(crate) fn dot_q6k_q8k_rows(x: &[BlockQ6K], ys: &[BlockQ8K], out: &mut [f32], pf: usize) {
    let nb = x.len();
    assert_eq!(
        ys.len(),
        out.len() * nb,
        "Q6_K row against rows of Q8_K activations"
    );
    let one = |r: usize| dot_q6k_q8k(x, &ys[r * nb..(r + 1) * nb], pf);
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        // SAFETY: as in `dot_q4k_q8k_rows`.
        let four = |r: usize| unsafe {
            avx2::dot_q6k_q8k_x4(x.as_ptr().cast(), ys[r * nb..].as_ptr().cast(), nb, pf)
        };
        return super::simd::by_fours(out, four, one);
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = one(r);
    }
}

/// Activations `xs` (a multiple of 256 floats) quantized into Q8_K blocks `ys`: Candle's
/// `BlockQ8K::from_float`, bit for bit (each block scaled by its first value of the largest
/// magnitude, rounded half away from zero, with its sums of sixteen). A block with a NaN or an
/// infinity takes Candle's own loop.
pub(crate) fn quantize_q8k(xs: &[f32], ys: &mut [BlockQ8K]) {
    assert_eq!(xs.len(), ys.len() * QK_K, "Q8_K blocks for the activations");
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        for (x, y) in xs.chunks_exact(QK_K).zip(ys.iter_mut()) {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above); `x` is 256 floats and
            // `y` one block of Candle's `#[repr(C)]` type, whose size is asserted below.
            let done = unsafe { avx2::quantize_q8k(x.as_ptr(), (y as *mut BlockQ8K).cast()) };
            if !done {
                BlockQ8K::from_float(x, std::slice::from_mut(y));
            }
        }
        return;
    }
    BlockQ8K::from_float(xs, ys);
}

/// Bytes of one Q4_K block.
const Q4K_BYTES: usize = 144;
/// Bytes of one Q6_K block.
const Q6K_BYTES: usize = 210;
/// Bytes of one Q8_K block.
const Q8K_BYTES: usize = 292;
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == Q4K_BYTES);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == Q6K_BYTES);
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == Q8K_BYTES);

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::simd::prefetch_ahead;
    use super::{Q4K_BYTES, Q6K_BYTES, Q8K_BYTES};

    /// Values of a Q8_K block.
    const QK: usize = super::QK_K;

    /// The f16 at `p` as f32.
    ///
    /// # Safety
    /// The CPU has F16C; 2 bytes at `p` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees 2 readable bytes; the read is unaligned-safe.
        let bits = unsafe { std::ptr::read_unaligned(p as *const u16) };
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// The f32 at `p`.
    ///
    /// # Safety
    /// 4 bytes at `p` are readable.
    #[inline(always)]
    unsafe fn single(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees 4 readable bytes; the read is unaligned-safe.
        unsafe { std::ptr::read_unaligned(p as *const f32) }
    }

    /// Candle's `BlockQ8K::from_float` of the 256 floats at `x` into the Q8_K block at `y`
    /// (`[d: f32, qs: [i8; 256], bsums: [i16; 16]]`); `false`, with nothing written, where a
    /// value is not finite (Candle's loop then handles it).
    ///
    /// # Safety
    /// The CPU has AVX2; 256 floats at `x` are readable and `Q8K_BYTES` at `y` writable.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8k(x: *const f32, y: *mut u8) -> bool {
        // Every call below reads the floats i * 8..i * 8 + 8 with i < 32.
        let load = |i: usize| {
            // SAFETY: `x` holds 256 readable floats and i * 8 + 8 <= 256.
            unsafe { _mm256_loadu_ps(x.add(8 * i)) }
        };
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let inf = _mm256_set1_ps(f32::INFINITY);
        let (mut amax, mut bad) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in 0..QK / 8 {
            let a = _mm256_and_ps(load(i), abs_mask);
            // NaN (unordered) or infinite: not ordered below infinity.
            bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
            amax = _mm256_max_ps(amax, a);
        }
        if _mm256_movemask_ps(bad) != 0 {
            return false;
        }
        let m = _mm_max_ps(
            _mm256_castps256_ps128(amax),
            _mm256_extractf128_ps::<1>(amax),
        );
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
        if m == 0.0 {
            // SAFETY: `y` has Q8K_BYTES writable bytes.
            unsafe { std::ptr::write_bytes(y, 0, Q8K_BYTES) };
            return true;
        }
        // Candle keeps the first value whose magnitude is the largest.
        let target = _mm256_set1_ps(m);
        let mut max = m;
        for i in 0..QK / 8 {
            let v = load(i);
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(
                _mm256_and_ps(v, abs_mask),
                target,
            ));
            if hit != 0 {
                // SAFETY: the lane is one of the 8 at i * 8 < 256.
                max = unsafe { *x.add(8 * i + hit.trailing_zeros() as usize) };
                break;
            }
        }
        let iscale = -127f32 / max;
        let scale = _mm256_set1_ps(iscale);
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        let sign_mask = _mm256_set1_ps(-0.0);
        let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
        // The quant of 8 values: `(iscale * x).round()` (half away from zero) clamped.
        let quant = |i: usize| {
            let v = _mm256_mul_ps(scale, load(i));
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
            // v - t is exact; a fraction of at least a half rounds away from zero.
            let frac = _mm256_and_ps(_mm256_sub_ps(v, t), abs_mask);
            let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), one);
            let r = _mm256_add_ps(t, _mm256_or_ps(up, _mm256_and_ps(v, sign_mask)));
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        };
        let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let mut sums = [0i16; QK / 16];
        // SAFETY: `y` has Q8K_BYTES writable bytes: the quants at 4..260, the sums after.
        let qs = unsafe { y.add(4) };
        for j in 0..QK / 32 {
            let q: [__m256i; 4] = std::array::from_fn(|u| quant(4 * j + u));
            for (h, pair) in q.chunks_exact(2).enumerate() {
                let s = _mm256_add_epi32(pair[0], pair[1]);
                let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                let s = _mm_hadd_epi32(s, s);
                let s = _mm_hadd_epi32(s, s);
                sums[2 * j + h] = _mm_cvtsi128_si32(s) as i16;
            }
            let a = _mm256_packs_epi32(q[0], q[1]);
            let b = _mm256_packs_epi32(q[2], q[3]);
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), perm);
            // SAFETY: bytes 32 * j..32 * j + 32 of the 256 quants.
            unsafe { _mm256_storeu_si256(qs.add(32 * j).cast(), bytes) };
        }
        // SAFETY: the scale at 0..4 and the sums at 260..292, unaligned writes.
        unsafe {
            std::ptr::write_unaligned(y.cast::<f32>(), 1.0 / iscale);
            std::ptr::copy_nonoverlapping(sums.as_ptr().cast::<u8>(), y.add(4 + QK), 2 * QK / 16);
        }
        true
    }

    /// Sum of the 8 lanes, in Candle's order (`hsum_float_8`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum8(x: __m256) -> f32 {
        let r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
        let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        let r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }

    /// Asks for the lines `pf` bytes past a block of `bytes` at `p`: one address every 64
    /// bytes and the block's last, so that consecutive blocks leave no line out.
    #[inline(always)]
    fn prefetch_block(p: *const u8, bytes: usize, pf: usize) {
        let mut at = 0;
        while at < bytes {
            prefetch_ahead(p, at, pf);
            at += 64;
        }
        prefetch_ahead(p, bytes - 1, pf);
    }

    /// Q4_K's 12 bytes of packed 6-bit scales and mins at `p` as four words: the 8 scales'
    /// bytes, then the 8 mins' (ggml's `get_scale_min_k4` layout).
    ///
    /// # Safety
    /// 12 bytes at `p` are readable.
    #[inline(always)]
    unsafe fn q4k_scales_mins(p: *const u8) -> [u32; 4] {
        const KMASK1: u32 = 0x3f3f3f3f;
        const KMASK2: u32 = 0x0f0f0f0f;
        const KMASK3: u32 = 0x03030303;
        // SAFETY: the caller guarantees the 12 bytes; the reads are unaligned-safe.
        let u = unsafe {
            [
                u32::from_le(std::ptr::read_unaligned(p as *const u32)),
                u32::from_le(std::ptr::read_unaligned(p.add(4) as *const u32)),
                u32::from_le(std::ptr::read_unaligned(p.add(8) as *const u32)),
            ]
        };
        [
            u[0] & KMASK1,
            (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4),
            u[1] & KMASK1,
            ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4),
        ]
    }

    /// `nb` Q4_K blocks at `x` against `nb` Q8_K blocks at `y`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `nb` whole blocks are readable at `x` and at `y`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4k_q8k(x: *const u8, y: *const u8, nb: usize, pf: usize) -> f32 {
        let m4 = _mm256_set1_epi8(0xF);
        let mut acc = _mm256_setzero_ps();
        let mut acc_m = _mm_setzero_ps();
        for b in 0..nb {
            let xb = x.wrapping_add(b * Q4K_BYTES);
            let yb = y.wrapping_add(b * Q8K_BYTES);
            prefetch_block(xb, Q4K_BYTES, pf);
            // SAFETY: block `b` of each is readable (the caller's guarantee): the x block's
            // d, dmin (bytes 0-3), scales (4-15) and quants (16-143); the y block's d (0-3),
            // quants (4-259) and sums (260-291). Every load is unaligned-safe.
            unsafe {
                let yd = single(yb);
                let d = yd * half(xb);
                let dmin = -yd * half(xb.add(2));
                let u = q4k_scales_mins(xb.add(4));
                let mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(
                    u[3] as i32,
                    u[2] as i32,
                    u[1] as i32,
                    u[0] as i32,
                ));
                let q8sums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
                let q8s = _mm_hadd_epi16(
                    _mm256_extracti128_si256::<0>(q8sums),
                    _mm256_extracti128_si256::<1>(q8sums),
                );
                let prod = _mm_madd_epi16(_mm256_extracti128_si256::<1>(mins_and_scales), q8s);
                acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);

                let sc = _mm256_extracti128_si256::<0>(mins_and_scales);
                let mut scale = [0i16; 8];
                _mm_storeu_si128(scale.as_mut_ptr() as *mut __m128i, sc);
                let mut sumi = _mm256_setzero_si256();
                for j in 0..4 {
                    let scale_l = _mm256_set1_epi16(scale[2 * j]);
                    let scale_h = _mm256_set1_epi16(scale[2 * j + 1]);
                    let q4bits = _mm256_loadu_si256(xb.add(16 + 32 * j) as *const __m256i);
                    let q4l = _mm256_and_si256(q4bits, m4);
                    let q4h = _mm256_and_si256(_mm256_srli_epi16::<4>(q4bits), m4);
                    let q8l = _mm256_loadu_si256(yb.add(4 + 64 * j) as *const __m256i);
                    let q8h = _mm256_loadu_si256(yb.add(4 + 64 * j + 32) as *const __m256i);
                    let p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, q8l));
                    sumi = _mm256_add_epi32(sumi, p16l);
                    let p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, q8h));
                    sumi = _mm256_add_epi32(sumi, p16h);
                }
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            }
        }
        let acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
        let acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
        hsum8(acc) + _mm_cvtss_f32(acc_m)
    }

    /// [`dot_q4k_q8k`] of the `nb` Q4_K blocks at `x` with four rows of `nb` Q8_K blocks each
    /// at `y` (one after the other): each weight block's scales, mins and nibbles unpacked
    /// once, each row's sums in that kernel's order, so each result is that kernel's bit for
    /// bit.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `nb` whole blocks are readable at `x` and `4 * nb` at
    /// `y`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4k_q8k_x4(
        x: *const u8,
        y: *const u8,
        nb: usize,
        pf: usize,
    ) -> [f32; 4] {
        let m4 = _mm256_set1_epi8(0xF);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut acc_m = [_mm_setzero_ps(); 4];
        for b in 0..nb {
            let xb = x.wrapping_add(b * Q4K_BYTES);
            prefetch_block(xb, Q4K_BYTES, pf);
            // SAFETY: block `b` of `x` and of each of the four rows of `y` is readable (the
            // caller's guarantee), with the byte offsets of `dot_q4k_q8k`. Every load is
            // unaligned-safe.
            unsafe {
                let (xd, xdmin) = (half(xb), half(xb.add(2)));
                let u = q4k_scales_mins(xb.add(4));
                let mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(
                    u[3] as i32,
                    u[2] as i32,
                    u[1] as i32,
                    u[0] as i32,
                ));
                let mins = _mm256_extracti128_si256::<1>(mins_and_scales);
                let mut scale = [0i16; 8];
                _mm_storeu_si128(
                    scale.as_mut_ptr() as *mut __m128i,
                    _mm256_extracti128_si256::<0>(mins_and_scales),
                );
                let mut q4 = [[_mm256_setzero_si256(); 2]; 4];
                for (j, q) in q4.iter_mut().enumerate() {
                    let q4bits = _mm256_loadu_si256(xb.add(16 + 32 * j) as *const __m256i);
                    *q = [
                        _mm256_and_si256(q4bits, m4),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(q4bits), m4),
                    ];
                }
                for r in 0..4 {
                    let yb = y.wrapping_add((r * nb + b) * Q8K_BYTES);
                    let yd = single(yb);
                    let d = yd * xd;
                    let dmin = -yd * xdmin;
                    let q8sums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
                    let q8s = _mm_hadd_epi16(
                        _mm256_extracti128_si256::<0>(q8sums),
                        _mm256_extracti128_si256::<1>(q8sums),
                    );
                    let prod = _mm_madd_epi16(mins, q8s);
                    acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r]);
                    let mut sumi = _mm256_setzero_si256();
                    for (j, [q4l, q4h]) in q4.iter().enumerate() {
                        let scale_l = _mm256_set1_epi16(scale[2 * j]);
                        let scale_h = _mm256_set1_epi16(scale[2 * j + 1]);
                        let q8l = _mm256_loadu_si256(yb.add(4 + 64 * j) as *const __m256i);
                        let q8h = _mm256_loadu_si256(yb.add(4 + 64 * j + 32) as *const __m256i);
                        let p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(*q4l, q8l));
                        sumi = _mm256_add_epi32(sumi, p16l);
                        let p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(*q4h, q8h));
                        sumi = _mm256_add_epi32(sumi, p16h);
                    }
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
                }
            }
        }
        std::array::from_fn(|r| {
            let m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
            let m = _mm_add_ss(m, _mm_movehdup_ps(m));
            hsum8(acc[r]) + _mm_cvtss_f32(m)
        })
    }

    /// Q6_K's two high bits of each quant, `shift` bits down in `bits`, moved above its low
    /// four.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn q6_high(bits: __m256i, shift: i32, m2: __m256i) -> __m256i {
        _mm256_slli_epi16::<4>(_mm256_and_si256(
            _mm256_srl_epi16(bits, _mm_cvtsi32_si128(shift)),
            m2,
        ))
    }

    /// `nb` Q6_K blocks at `x` against `nb` Q8_K blocks at `y`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `nb` whole blocks are readable at `x` and at `y`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q6k_q8k(x: *const u8, y: *const u8, nb: usize, pf: usize) -> f32 {
        let m4 = _mm256_set1_epi8(0xF);
        let m2 = _mm256_set1_epi8(3);
        let m32s = _mm256_set1_epi8(32);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let xb = x.wrapping_add(b * Q6K_BYTES);
            let yb = y.wrapping_add(b * Q8K_BYTES);
            prefetch_block(xb, Q6K_BYTES, pf);
            // SAFETY: block `b` of each is readable (the caller's guarantee): the x block's
            // low bits (bytes 0-127), high bits (128-191), scales (192-207) and d (208-209);
            // the y block's d (0-3) and quants (4-259). Every load is unaligned-safe.
            unsafe {
                let d = single(yb) * half(xb.add(208));
                let scales = xb.add(192) as *const i8;
                let mut sumi = _mm256_setzero_si256();
                for j in 0..2 {
                    let ql = xb.add(64 * j);
                    let q4bits1 = _mm256_loadu_si256(ql as *const __m256i);
                    let q4bits2 = _mm256_loadu_si256(ql.add(32) as *const __m256i);
                    let q4bits_h = _mm256_loadu_si256(xb.add(128 + 32 * j) as *const __m256i);
                    let q4 = [
                        _mm256_or_si256(_mm256_and_si256(q4bits1, m4), q6_high(q4bits_h, 0, m2)),
                        _mm256_or_si256(_mm256_and_si256(q4bits2, m4), q6_high(q4bits_h, 2, m2)),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(q4bits1), m4),
                            q6_high(q4bits_h, 4, m2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(q4bits2), m4),
                            q6_high(q4bits_h, 6, m2),
                        ),
                    ];
                    let mut p = [_mm256_setzero_si256(); 4];
                    for (i, (p, q4)) in p.iter_mut().zip(q4).enumerate() {
                        let q8 = _mm256_loadu_si256(yb.add(4 + 128 * j + 32 * i) as *const __m256i);
                        let q8s = _mm256_maddubs_epi16(m32s, q8);
                        let p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q4, q8), q8s);
                        // Sub-blocks 16 long: the first 16 bytes take one scale, the next 16
                        // the following one.
                        let s = 2 * (4 * j + i);
                        let sc = _mm256_setr_m128i(
                            _mm_set1_epi16(*scales.add(s) as i16),
                            _mm_set1_epi16(*scales.add(s + 1) as i16),
                        );
                        *p = _mm256_madd_epi16(sc, p16);
                    }
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
                }
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            }
        }
        hsum8(acc)
    }

    /// [`dot_q6k_q8k`] of the `nb` Q6_K blocks at `x` with four rows of `nb` Q8_K blocks each
    /// at `y` (one after the other): each weight block's 6-bit quants and scales unpacked once,
    /// each row's sums in that kernel's order, so each result is that kernel's bit for bit.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `nb` whole blocks are readable at `x` and `4 * nb` at
    /// `y`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q6k_q8k_x4(
        x: *const u8,
        y: *const u8,
        nb: usize,
        pf: usize,
    ) -> [f32; 4] {
        let m4 = _mm256_set1_epi8(0xF);
        let m2 = _mm256_set1_epi8(3);
        let m32s = _mm256_set1_epi8(32);
        let mut acc = [_mm256_setzero_ps(); 4];
        for b in 0..nb {
            let xb = x.wrapping_add(b * Q6K_BYTES);
            prefetch_block(xb, Q6K_BYTES, pf);
            // SAFETY: block `b` of `x` and of each of the four rows of `y` is readable (the
            // caller's guarantee), with the byte offsets of `dot_q6k_q8k`. Every load is
            // unaligned-safe.
            unsafe {
                let xd = half(xb.add(208));
                let scales = xb.add(192) as *const i8;
                let mut q6 = [[_mm256_setzero_si256(); 4]; 2];
                let mut sc = [[_mm256_setzero_si256(); 4]; 2];
                for j in 0..2 {
                    let ql = xb.add(64 * j);
                    let q4bits1 = _mm256_loadu_si256(ql as *const __m256i);
                    let q4bits2 = _mm256_loadu_si256(ql.add(32) as *const __m256i);
                    let q4bits_h = _mm256_loadu_si256(xb.add(128 + 32 * j) as *const __m256i);
                    q6[j] = [
                        _mm256_or_si256(_mm256_and_si256(q4bits1, m4), q6_high(q4bits_h, 0, m2)),
                        _mm256_or_si256(_mm256_and_si256(q4bits2, m4), q6_high(q4bits_h, 2, m2)),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(q4bits1), m4),
                            q6_high(q4bits_h, 4, m2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(q4bits2), m4),
                            q6_high(q4bits_h, 6, m2),
                        ),
                    ];
                    for (i, sc) in sc[j].iter_mut().enumerate() {
                        let s = 2 * (4 * j + i);
                        *sc = _mm256_setr_m128i(
                            _mm_set1_epi16(*scales.add(s) as i16),
                            _mm_set1_epi16(*scales.add(s + 1) as i16),
                        );
                    }
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let yb = y.wrapping_add((r * nb + b) * Q8K_BYTES);
                    let d = single(yb) * xd;
                    let mut sumi = _mm256_setzero_si256();
                    for j in 0..2 {
                        let mut p = [_mm256_setzero_si256(); 4];
                        for (i, p) in p.iter_mut().enumerate() {
                            let q8 =
                                _mm256_loadu_si256(yb.add(4 + 128 * j + 32 * i) as *const __m256i);
                            let q8s = _mm256_maddubs_epi16(m32s, q8);
                            let p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q6[j][i], q8), q8s);
                            *p = _mm256_madd_epi16(sc[j][i], p16);
                        }
                        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
                    }
                    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), *acc);
                }
            }
        }
        std::array::from_fn(|r| hsum8(acc[r]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::BlockQ8K;

    /// Rows with a few large values among small ones, so that scales and mins vary.
    fn row(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let v = (s % 2001) as f32 / 1000.0 - 1.0;
                if i % 97 == 3 {
                    v * 40.0
                } else {
                    v
                }
            })
            .collect()
    }

    /// The Q8_K quantizer gives Candle's `from_float` bit for bit: rows of mixed magnitudes,
    /// values a scale puts on halves (rounded away from zero), a largest magnitude met first
    /// with either sign, a block of zeros, and blocks with a NaN or an infinity.
    #[test]
    fn q8k_quantizer_equals_candles() {
        let check = |xs: &[f32], what: &str| {
            let nb = xs.len() / QK_K;
            let mut want = vec![BlockQ8K::zeros(); nb];
            BlockQ8K::from_float(xs, &mut want);
            let mut got = vec![BlockQ8K::zeros(); nb];
            quantize_q8k(xs, &mut got);
            assert_eq!(format!("{got:?}"), format!("{want:?}"), "{what}");
        };
        for nb in [1usize, 3, 8] {
            check(
                &row(nb * QK_K, 31 + nb as u32),
                &format!("mixed rows, {nb} blocks"),
            );
        }
        // The largest value ±127 first: iscale ∓1, every odd i's value a tie at a half.
        for top in [-127.0f32, 127.0] {
            let mut halves: Vec<f32> = (0..QK_K).map(|i| (i as f32 - 128.0) * 0.5).collect();
            halves[0] = top;
            check(&halves, &format!("halves under {top}"));
        }
        let mut first = vec![0.5f32; QK_K];
        (first[9], first[200]) = (-7.0, 7.0);
        check(&first, "the largest magnitude first negative");
        (first[9], first[200]) = (7.0, -7.0);
        check(&first, "the largest magnitude first positive");
        check(&vec![0.0; 2 * QK_K], "zeros");
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut xs = row(2 * QK_K, 5);
            xs[300] = bad;
            check(&xs, &format!("{bad} in the second block"));
        }
    }

    /// Both kernels give Candle's `vec_dot` bit for bit, at every prefetch distance (0: off),
    /// over rows of 1 to 43 blocks with activations of mixed magnitudes.
    #[test]
    fn kquant_rows_equal_candles_vec_dot() {
        for nb in [1usize, 2, 5, 16, 43] {
            let k = nb * QK_K;
            let xs = row(k, nb as u32);
            let mut yq = vec![BlockQ8K::zeros(); nb];
            BlockQ8K::from_float(&row(k, 7 + nb as u32), &mut yq);
            let mut q4 = vec![BlockQ4K::zeros(); nb];
            BlockQ4K::from_float(&xs, &mut q4);
            let mut q6 = vec![BlockQ6K::zeros(); nb];
            BlockQ6K::from_float(&xs, &mut q6);
            let want4 = BlockQ4K::vec_dot(k, &q4, &yq);
            let want6 = BlockQ6K::vec_dot(k, &q6, &yq);
            // Seven rows of activations: a tile of four and three single rows, each Candle's.
            let mut ys = vec![BlockQ8K::zeros(); 7 * nb];
            for (r, y) in ys.chunks_exact_mut(nb).enumerate() {
                BlockQ8K::from_float(&row(k, 100 + r as u32), y);
            }
            for pf in [0usize, 4096] {
                let mut out = [0f32; 7];
                dot_q4k_q8k_rows(&q4, &ys, &mut out, pf);
                for (o, y) in out.iter().zip(ys.chunks_exact(nb)) {
                    let want = BlockQ4K::vec_dot(k, &q4, y);
                    assert_eq!(o.to_bits(), want.to_bits(), "Q4_K rows nb {nb}");
                }
                dot_q6k_q8k_rows(&q6, &ys, &mut out, pf);
                for (o, y) in out.iter().zip(ys.chunks_exact(nb)) {
                    let want = BlockQ6K::vec_dot(k, &q6, y);
                    assert_eq!(o.to_bits(), want.to_bits(), "Q6_K rows nb {nb}");
                }
            }
            for pf in [0usize, 64, 4096] {
                assert_eq!(
                    dot_q4k_q8k(&q4, &yq, pf).to_bits(),
                    want4.to_bits(),
                    "Q4_K nb {nb}"
                );
                assert_eq!(
                    dot_q6k_q8k(&q6, &yq, pf).to_bits(),
                    want6.to_bits(),
                    "Q6_K nb {nb}"
                );
            }
        }
    }
}
