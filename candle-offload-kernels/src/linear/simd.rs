//! SIMD dot products over GGML blocks for the CPU quantized matmul
//! ([`crate::linear::cpu_quant`]); those of dense weight rows are `simd_dense`'s.
//!
//! Candle 0.11's CPU kernels for Q4_1 and Q8_0 are scalar unless the whole build targets AVX
//! (`-C target-cpu`), which a portable binary does not. These kernels pick AVX2 + FMA + F16C at
//! run time (checked once) and fall back to scalar code that computes the same per-block sums.
//! The arithmetic follows ggml's x86 kernels (`ggml_vec_dot_q4_1_q8_1`, `ggml_vec_dot_q8_0_q8_0`,
//! `quantize_row_q8_1`/`quantize_row_q8_0` with round-half-to-even), so results stay within
//! float-summation-order noise of llama.cpp's on the same file.
//!
//! Blocks are plain bytes in GGML's layout: Q4_1 `[d: f16, m: f16, qs: [u8; 16]]` (20 bytes,
//! element `j` in the low nibble of `qs[j]`, element `j + 16` in the high one), Q8_1
//! `[d: f16, s: f16, qs: [i8; 32]]` (36 bytes, `s = d * sum(qs)`), Q8_0 `[d: f16, qs: [i8; 32]]`
//! (34 bytes).

use half::f16;

/// Elements per block of Q4_1, Q8_0 and Q8_1.
pub(crate) const QK: usize = 32;
/// Bytes of one Q4_1 block.
pub(crate) const Q4_1_BYTES: usize = 20;
/// Bytes of one Q8_0 block.
pub(crate) const Q8_0_BYTES: usize = 34;
/// Bytes of one Q8_1 block.
pub(crate) const Q8_1_BYTES: usize = 36;

/// Candle's K-quant block types (Q2_K-Q6_K), which [`k_blocks`] may view bytes as: `#[repr(C)]`
/// structs of byte arrays, small integers and `f16`s, for which every bit pattern is a value.
pub(crate) trait PlainBlock: Sized {}
impl PlainBlock for candle_core::quantized::k_quants::BlockQ2K {}
impl PlainBlock for candle_core::quantized::k_quants::BlockQ3K {}
impl PlainBlock for candle_core::quantized::k_quants::BlockQ4K {}
impl PlainBlock for candle_core::quantized::k_quants::BlockQ5K {}
impl PlainBlock for candle_core::quantized::k_quants::BlockQ6K {}
impl PlainBlock for candle_core::quantized::k_quants::BlockQ8_0 {}

/// `bytes` (a tensor's GGML blocks as `QTensor::data` hands them out) as a slice of blocks of
/// `T`; `None` unless it is a whole number of them, aligned for `T`.
pub(crate) fn k_blocks<T: PlainBlock>(bytes: &[u8]) -> Option<&[T]> {
    let size = std::mem::size_of::<T>();
    if size == 0
        || !bytes.len().is_multiple_of(size)
        || bytes.as_ptr().align_offset(std::mem::align_of::<T>()) != 0
    {
        return None;
    }
    // SAFETY: the pointer is aligned for `T` and `bytes.len() / size` values of `T` fill
    // exactly the borrowed bytes, which stay borrowed (immutably) for the slice's lifetime;
    // `T: PlainBlock` has no padding-sensitive or invalid bit patterns (see the trait).
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) })
}

/// Whether this CPU runs the AVX2/FMA/F16C kernels (detected once).
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU runs the AVX-512 kernels of the F32-activation dot products (detected
/// once).
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| has_avx2() && std::arch::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x` rounded to the nearest integer, ties to even (`rintf` in the default rounding mode) for
/// |x| < 2^22, without a libm call per element: adding and subtracting 1.5 * 2^23 leaves
/// nothing below the units place.
#[inline]
fn round_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Quantizes `xs` (a multiple of 32 long) to Q8_1 blocks in `out` (36 bytes per 32 elements),
/// as ggml's x86 `quantize_row_q8_1` does.
pub(crate) fn quantize_q8_1(xs: &[f32], out: &mut [u8]) {
    assert!(xs.len().is_multiple_of(QK) && out.len() == xs.len() / QK * Q8_1_BYTES);
    for (x, y) in xs.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_1_BYTES)) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in y[4..].iter_mut().zip(x) {
            let i = round_even(v * id) as i8;
            sum += i as i32;
            *q = i as u8;
        }
        y[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        y[2..4].copy_from_slice(&f16::from_f32(d * sum as f32).to_le_bytes());
    }
}

/// Quantizes `xs` (a multiple of 32 long) to Q8_0 blocks in `out` (34 bytes per 32 elements),
/// as ggml's x86 `quantize_row_q8_0` does.
pub(crate) fn quantize_q8_0(xs: &[f32], out: &mut [u8]) {
    assert!(xs.len().is_multiple_of(QK) && out.len() == xs.len() / QK * Q8_0_BYTES);
    for (x, y) in xs.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        for (q, v) in y[2..].iter_mut().zip(x) {
            *q = round_even(v * id) as i8 as u8;
        }
        y[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    }
}

/// The dot product of Q4_1 blocks `x` with Q8_1 blocks `y` (the same number of blocks).
pub(crate) fn dot_q4_1_q8_1(x: &[u8], y: &[u8]) -> f32 {
    let nb = x.len() / Q4_1_BYTES;
    assert!(x.len() == nb * Q4_1_BYTES && y.len() == nb * Q8_1_BYTES);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above), and the lengths were checked:
        // `x` holds `nb` whole Q4_1 blocks and `y` `nb` whole Q8_1 blocks.
        return unsafe { avx2::dot_q4_1_q8_1(x, y, nb) };
    }
    dot_q4_1_q8_1_scalar(x, y)
}

/// The scales of Q8_1 blocks `ys` as f32, two per block (`d`, `s`), for
/// [`dot_q4_1_q8_1_rows`].
pub(crate) fn q8_1_scales(ys: &[u8]) -> Vec<f32> {
    ys.chunks_exact(Q8_1_BYTES)
        .flat_map(|b| [half_at(b, 0), half_at(b, 2)])
        .collect()
}

/// Each Q8_0 block's scale `d` of `ys` (rows of Q8_0 blocks, one after the other) as f32, in
/// order: a prompt's activations' scales converted once for every weight row
/// ([`dot_q8_0_q8_0_rows`]).
pub(crate) fn q8_0_scales(ys: &[u8]) -> Vec<f32> {
    ys.chunks_exact(Q8_0_BYTES).map(|b| half_at(b, 0)).collect()
}

/// `out[r]` for activation rows `r = 0..out.len()` of a prompt: four rows at a time through
/// `four(r)` (rows `r..r + 4`, a kernel that unpacks each weight block once for all four), the
/// rows past the last four through `one(r)`. Both give the same values.
pub(crate) fn by_fours(
    out: &mut [f32],
    four: impl Fn(usize) -> [f32; 4],
    one: impl Fn(usize) -> f32,
) {
    let whole = out.len() / 4 * 4;
    for (g, o) in out[..whole].chunks_exact_mut(4).enumerate() {
        o.copy_from_slice(&four(4 * g));
    }
    for (r, o) in out.iter_mut().enumerate().skip(whole) {
        *o = one(r);
    }
}

/// The dot products of one row of Q4_1 blocks `x` with each of `out.len()` rows of Q8_1 blocks
/// in `ys` (one after the other, each as long as `x` in blocks; `scales` from [`q8_1_scales`]
/// of `ys`), into `out`: the same sums as [`dot_q4_1_q8_1`] per row, with each weight block
/// unpacked once for four rows (prefill).
pub(crate) fn dot_q4_1_q8_1_rows(x: &[u8], ys: &[u8], scales: &[f32], out: &mut [f32]) {
    let nb = x.len() / Q4_1_BYTES;
    let row = nb * Q8_1_BYTES;
    assert!(x.len() == nb * Q4_1_BYTES && ys.len() == out.len() * row);
    assert!(scales.len() == out.len() * nb * 2);
    let one = |r: usize| dot_q4_1_q8_1(x, &ys[r * row..(r + 1) * row]);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above); `x` holds `nb` Q4_1 blocks,
        // and each four rows `r..r + 4` of `ys` `nb` Q8_1 blocks each (`by_fours` passes
        // `r + 4 <= out.len()`).
        let four = |r: usize| unsafe {
            avx2::dot_q4_1_q8_1_x4(
                x,
                &ys[r * row..(r + 4) * row],
                &scales[r * nb * 2..(r + 4) * nb * 2],
                nb,
            )
        };
        return by_fours(out, four, one);
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = one(r);
    }
}

/// The dot product of Q8_0 blocks `x` with Q8_0 blocks `y` (the same number of blocks).
///
/// `pf`: the bytes ahead of its reads of `x` the kernel prefetches (0: none).
pub(crate) fn dot_q8_0_q8_0(x: &[u8], y: &[u8], pf: usize) -> f32 {
    let nb = x.len() / Q8_0_BYTES;
    assert!(x.len() == nb * Q8_0_BYTES && y.len() == nb * Q8_0_BYTES);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above), and both slices hold `nb`
        // whole Q8_0 blocks (checked above).
        return unsafe { avx2::dot_q8_0_q8_0(x, y, nb, pf) };
    }
    dot_q8_0_q8_0_scalar(x, y)
}

/// The dot products of one row of Q8_0 blocks `x` with each of `out.len()` rows of Q8_0 blocks
/// in `ys` (one after the other, each as long as `x`; `dys` their scales, [`q8_0_scales`] of
/// `ys`), into `out`: [`dot_q8_0_q8_0`] of each row, bit for bit, with each weight block loaded
/// and its signs taken once for four rows (a prompt's rows). `pf` as for [`dot_q8_0_q8_0`].
pub(crate) fn dot_q8_0_q8_0_rows(x: &[u8], ys: &[u8], dys: &[f32], out: &mut [f32], pf: usize) {
    let nb = x.len() / Q8_0_BYTES;
    let row = nb * Q8_0_BYTES;
    assert!(x.len() == row && ys.len() == out.len() * row && dys.len() == out.len() * nb);
    let one = |r: usize| dot_q8_0_q8_0(x, &ys[r * row..(r + 1) * row], pf);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above); `x` holds `nb` Q8_0 blocks,
        // and each four rows `r..r + 4` of `ys` `nb` each, with `nb` scales each in `dys`
        // (`by_fours` passes `r + 4 <= out.len()`).
        let four = |r: usize| unsafe {
            avx2::dot_q8_0_q8_0_x4(
                x,
                &ys[r * row..(r + 4) * row],
                &dys[r * nb..(r + 4) * nb],
                nb,
                pf,
            )
        };
        return by_fours(out, four, one);
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = one(r);
    }
}

/// The bound on `|dot with F32 activations - dot with their Q8_0 blocks|` ([`dot_q8_0_q8_0`] of
/// a weight row with the activations quantized) per unit of the row's scale `sum_b |d_b| *
/// sum_j |q_bj| * amax[b]`, with `amax[b]` the largest magnitude of the activations' block `b`
/// ([`block_amax`]; the weights' part per block is [`q8_0_abs_scales`]). Quantizing to Q8_0
/// moves each activation by at most `0.5 * amax / 127` (round to nearest) plus its f16 scale's
/// rounding (`127 * 2^-11` of a step): `(0.5 + 127 * 2^-11) / 127` for the quantization, with 1%
/// and `1e-4` more for the float sums of either product (each within a few units of 2^-24 of
/// that scale).
pub(crate) const Q8_0_SCREEN_BOUND: f32 = (0.5 + 127.0 / 2048.0) / 127.0 * 1.01 + 1e-4;

/// The weights' part of the screen's scale ([`Q8_0_SCREEN_BOUND`]) for each of `x`'s Q8_0 blocks:
/// `|d_b| * sum_j |q_bj|` (exact in f32: an f16 times an integer below 2^12), into `out`.
/// Given these once per weight row, a row's scale is `sum_b out[b] * amax[b]`.
pub(crate) fn q8_0_abs_scales(x: &[u8], out: &mut [f32]) {
    let nb = x.len() / Q8_0_BYTES;
    assert!(x.len() == nb * Q8_0_BYTES && out.len() == nb);
    for (o, xb) in out.iter_mut().zip(x.chunks_exact(Q8_0_BYTES)) {
        let sumq: i32 = xb[2..].iter().map(|&q| (q as i8 as i32).abs()).sum();
        *o = half_at(xb, 0).abs() * sumq as f32;
    }
}

/// `sum_i s[i] * a[i]` over eight independent lanes (a short dot product whose sum in one chain
/// would wait on each add: the greedy screen's bound, one per head row).
pub(crate) fn weighted_sum(s: &[f32], a: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (cs, ca) = (s.chunks_exact(8), a.chunks_exact(8));
    let tail: f32 = cs
        .remainder()
        .iter()
        .zip(ca.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in cs.zip(ca) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    tail + lanes.iter().sum::<f32>()
}

/// [`dot_q8_0_q8_0`] of a weight row `x` with 8-bit activations `y`, and its scale for
/// [`Q8_0_SCREEN_BOUND`], in one scalar loop: the reference the screen's kernels are tested
/// against.
#[cfg(test)]
pub(crate) fn dot_q8_0_q8_0_bound_scalar(x: &[u8], y: &[u8], amax: &[f32]) -> (f32, f32) {
    let (mut sumf, mut scale) = (0f32, 0f32);
    for ((xb, yb), &a) in x
        .chunks_exact(Q8_0_BYTES)
        .zip(y.chunks_exact(Q8_0_BYTES))
        .zip(amax)
    {
        let (mut sumi, mut sumq) = (0i32, 0i32);
        for (&q, &v) in xb[2..].iter().zip(&yb[2..]) {
            sumi += q as i8 as i32 * v as i8 as i32;
            sumq += (q as i8 as i32).abs();
        }
        let d = half_at(xb, 0);
        sumf += sumi as f32 * d * half_at(yb, 0);
        scale += sumq as f32 * d.abs() * a;
    }
    (sumf, scale)
}

/// The dot product of Q4_1 blocks `x` with F32 activations `y` (32 per block), the
/// activations not quantized: per block `d * sum(q_j * y_j) + m * sum(y_j)`, the values the
/// dequantized weights give, summed in another order.
pub(crate) fn dot_q4_1_f32(x: &[u8], y: &[f32]) -> f32 {
    let nb = x.len() / Q4_1_BYTES;
    assert!(x.len() == nb * Q4_1_BYTES && y.len() == nb * QK);
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (checked above), and the lengths
        // were checked: `x` holds `nb` whole Q4_1 blocks and `y` `nb * 32` values.
        return unsafe { avx512::dot_q4_1_f32(x, y, nb) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above), and the lengths were checked:
        // `x` holds `nb` whole Q4_1 blocks and `y` `nb * 32` values.
        return unsafe { avx2::dot_q4_1_f32(x, y, nb) };
    }
    dot_q4_1_f32_scalar(x, y)
}

/// The sums of `y`'s blocks of 32 values, for [`dot_q4_1_f32_summed`].
pub(crate) fn block_sums(y: &[f32]) -> Vec<f32> {
    y.chunks_exact(QK).map(|b| b.iter().sum()).collect()
}

/// The largest magnitude in each of `y`'s blocks of 32 values, for [`Q8_0_SCREEN_BOUND`].
pub(crate) fn block_amax(y: &[f32]) -> Vec<f32> {
    y.chunks_exact(QK)
        .map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())))
        .collect()
}

/// [`dot_q4_1_f32`] given `ysum`, the sums of `y`'s blocks ([`block_sums`], once per row of
/// activations): with AVX-512 the `m * sum(y_j)` term is then one scalar product per block
/// instead of two vector operations, and two accumulators take alternate blocks (a decode
/// step's dot products, where the per-block work bounds the kernel). Elsewhere it is
/// [`dot_q4_1_f32`].
pub(crate) fn dot_q4_1_f32_summed(x: &[u8], y: &[f32], ysum: &[f32]) -> f32 {
    let nb = x.len() / Q4_1_BYTES;
    assert!(x.len() == nb * Q4_1_BYTES && y.len() == nb * QK && ysum.len() == nb);
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (checked above), and the lengths
        // were checked: `x` holds `nb` whole Q4_1 blocks, `y` `nb * 32` values and `ysum` `nb`.
        return unsafe { avx512::dot_q4_1_f32_summed(x, y, ysum, nb) };
    }
    dot_q4_1_f32(x, y)
}

/// [`dot_q4_1_f32`] of one row of Q4_1 blocks `x` with each of `out.len()` rows of F32
/// activations in `ys` (one after the other, each `x`'s length in elements), into `out`, each
/// weight block dequantized once for four rows (prefill).
pub(crate) fn dot_q4_1_f32_rows(x: &[u8], ys: &[f32], out: &mut [f32]) {
    let nb = x.len() / Q4_1_BYTES;
    let k = nb * QK;
    assert!(x.len() == nb * Q4_1_BYTES && ys.len() == out.len() * k);
    let mut r = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        while r + 4 <= out.len() {
            let rows = &ys[r * k..(r + 4) * k];
            let four = if has_avx512() {
                // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (checked); `x` holds `nb`
                // Q4_1 blocks and `rows` four rows of `k` values.
                unsafe { avx512::dot_q4_1_f32_x4(x, rows, nb) }
            } else {
                // SAFETY: the CPU has AVX2, FMA and F16C (checked above); `x` holds `nb` Q4_1
                // blocks and `rows` four rows of `k` values.
                unsafe { avx2::dot_q4_1_f32_x4(x, rows, nb) }
            };
            out[r..r + 4].copy_from_slice(&four);
            r += 4;
        }
    }
    for (o, y) in out[r..].iter_mut().zip(ys[r * k..].chunks_exact(k)) {
        *o = dot_q4_1_f32(x, y);
    }
}

/// [`dot_q4_1_f32_rows`] for four rows of Q4_1 blocks at once (`x[c]`, one per output
/// column `out[c]`, each `ys.len() / k` values): with AVX-512, four weight blocks are
/// dequantized once for four activation rows and the sixteen products kept in registers (a
/// 4x4 tile, where the one-column kernel re-reads every activation row for each weight row);
/// otherwise one column after the other.
pub(crate) fn dot_q4_1_f32_rows_cols4(x: [&[u8]; 4], ys: &[f32], out: &mut [&mut [f32]]) {
    let nb = x[0].len() / Q4_1_BYTES;
    let k = nb * QK;
    let m = ys.len() / k.max(1);
    assert!(
        out.len() == 4
            && x.iter().all(|w| w.len() == nb * Q4_1_BYTES)
            && ys.len() == m * k
            && out.iter().all(|o| o.len() == m)
    );
    let mut r = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        while r + 4 <= m {
            // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (checked); each `x[c]` holds
            // `nb` Q4_1 blocks and `ys[r * k..]` four rows of `k` values (r + 4 <= m).
            let tile = unsafe { avx512::dot_q4_1_f32_c4x4(x, &ys[r * k..(r + 4) * k], nb) };
            for (c, col) in out.iter_mut().enumerate() {
                col[r..r + 4].copy_from_slice(&tile[c]);
            }
            r += 4;
        }
    }
    for (c, col) in out.iter_mut().enumerate() {
        dot_q4_1_f32_rows(x[c], &ys[r * k..], &mut col[r..]);
    }
}

/// [`dot_q8_0_f32`] of two weight rows `x0`, `x1` (the same length) with one row of
/// activations `y`: each block of `y` loaded once for both, two independent chains of memory
/// reads and additions (a decode step). Each result is the same number, bit for bit, as
/// [`dot_q8_0_f32`] gives for its row.
/// `pf` as for [`dot_q8_0_q8_0`].
pub(crate) fn dot_q8_0_f32_pair(x0: &[u8], x1: &[u8], y: &[f32], pf: usize) -> (f32, f32) {
    let nb = x0.len() / Q8_0_BYTES;
    assert!(x0.len() == nb * Q8_0_BYTES && x1.len() == x0.len() && y.len() == nb * QK);
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (checked above), and the lengths
        // were checked: `x0` and `x1` hold `nb` whole Q8_0 blocks each and `y` `nb * 32` values.
        return unsafe { avx512::dot_q8_0_f32_pair(x0, x1, y, nb, pf) };
    }
    (dot_q8_0_f32(x0, y, pf), dot_q8_0_f32(x1, y, pf))
}

/// The dot product of Q8_0 blocks `x` with F32 activations `y` (32 per block), the activations
/// not quantized.
/// `pf` as for [`dot_q8_0_q8_0`].
pub(crate) fn dot_q8_0_f32(x: &[u8], y: &[f32], pf: usize) -> f32 {
    let nb = x.len() / Q8_0_BYTES;
    assert!(x.len() == nb * Q8_0_BYTES && y.len() == nb * QK);
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (checked above), and the lengths
        // were checked: `x` holds `nb` whole Q8_0 blocks and `y` `nb * 32` values.
        return unsafe { avx512::dot_q8_0_f32(x, y, nb, pf) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above), and the lengths were checked:
        // `x` holds `nb` whole Q8_0 blocks and `y` `nb * 32` values.
        return unsafe { avx2::dot_q8_0_f32(x, y, nb, pf) };
    }
    dot_q8_0_f32_scalar(x, y)
}

/// The dot products of one row of Q8_0 blocks `x` with each of `out.len()` rows of F32
/// activations in `ys` (one after the other, `x`'s blocks times 32 values each), into `out`:
/// [`dot_q8_0_f32`] of each row, bit for bit, with each weight block converted to F32 once for
/// four rows (a prompt's rows). `pf` as for [`dot_q8_0_q8_0`].
pub(crate) fn dot_q8_0_f32_rows(x: &[u8], ys: &[f32], out: &mut [f32], pf: usize) {
    let nb = x.len() / Q8_0_BYTES;
    let row = nb * QK;
    assert!(x.len() == nb * Q8_0_BYTES && ys.len() == out.len() * row);
    let one = |r: usize| dot_q8_0_f32(x, &ys[r * row..(r + 1) * row], pf);
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (checked above); `x` holds `nb`
        // Q8_0 blocks, and each four rows `r..r + 4` of `ys` `nb * 32` values each
        // (`by_fours` passes `r + 4 <= out.len()`).
        let four =
            |r: usize| unsafe { avx512::dot_q8_0_f32_x4(x, &ys[r * row..(r + 4) * row], nb, pf) };
        return by_fours(out, four, one);
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = one(r);
    }
}

/// [`dot_q4_1_f32`] without SIMD.
pub(crate) fn dot_q4_1_f32_scalar(x: &[u8], y: &[f32]) -> f32 {
    let mut sumf = 0f32;
    for (xb, yb) in x.chunks_exact(Q4_1_BYTES).zip(y.chunks_exact(QK)) {
        let (mut dot, mut sum) = (0f32, 0f32);
        for j in 0..QK / 2 {
            dot += (xb[4 + j] & 0x0f) as f32 * yb[j] + (xb[4 + j] >> 4) as f32 * yb[j + QK / 2];
            sum += yb[j] + yb[j + QK / 2];
        }
        sumf += half_at(xb, 0) * dot + half_at(xb, 2) * sum;
    }
    sumf
}

/// [`dot_q8_0_f32`] without SIMD.
pub(crate) fn dot_q8_0_f32_scalar(x: &[u8], y: &[f32]) -> f32 {
    let mut sumf = 0f32;
    for (xb, yb) in x.chunks_exact(Q8_0_BYTES).zip(y.chunks_exact(QK)) {
        let dot: f32 = xb[2..]
            .iter()
            .zip(yb)
            .map(|(&q, &v)| q as i8 as f32 * v)
            .sum();
        sumf += half_at(xb, 0) * dot;
    }
    sumf
}

/// [`dot_q4_1_q8_1`] without SIMD.
pub(crate) fn dot_q4_1_q8_1_scalar(x: &[u8], y: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (xb, yb) in x.chunks_exact(Q4_1_BYTES).zip(y.chunks_exact(Q8_1_BYTES)) {
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let v0 = (xb[4 + j] & 0x0f) as i32;
            let v1 = (xb[4 + j] >> 4) as i32;
            sumi += v0 * yb[4 + j] as i8 as i32 + v1 * yb[4 + j + QK / 2] as i8 as i32;
        }
        sumf += sumi as f32 * half_at(xb, 0) * half_at(yb, 0) + half_at(xb, 2) * half_at(yb, 2);
    }
    sumf
}

/// [`dot_q8_0_q8_0`] without SIMD.
pub(crate) fn dot_q8_0_q8_0_scalar(x: &[u8], y: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (xb, yb) in x.chunks_exact(Q8_0_BYTES).zip(y.chunks_exact(Q8_0_BYTES)) {
        let sumi: i32 = xb[2..]
            .iter()
            .zip(&yb[2..])
            .map(|(&a, &b)| a as i8 as i32 * b as i8 as i32)
            .sum();
        sumf += sumi as f32 * half_at(xb, 0) * half_at(yb, 0);
    }
    sumf
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::hsum;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Q4_1_BYTES, Q8_0_BYTES, Q8_1_BYTES};

    /// The two f16 at `p` (a block's `d` and `m`/`s`) as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn two_halves(p: *const u8) -> (f32, f32) {
        // SAFETY: the caller guarantees 4 readable bytes at `p`; the read is unaligned-safe.
        let bits = unsafe { std::ptr::read_unaligned(p as *const i32) };
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_shuffle_ps::<1>(v, v)))
    }

    /// Sum of the 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn hsum(x: __m256) -> f32 {
        let r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
        let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        let r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }

    /// Pairwise u8 x i8 products summed to 8 i32 lanes, as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn mul_sum_us8_pairs(ax: __m256i, sy: __m256i) -> __m256 {
        let dot = _mm256_maddubs_epi16(ax, sy);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), dot))
    }

    /// One Q4_1 block at `xb` against one Q8_1 block at `yb`: the 8 lanes of pairwise integer
    /// sums as f32, the product of the scales, and the `m * s` term.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; 20 bytes at `xb` and 36 at `yb` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_block(xb: *const u8, yb: *const u8) -> (__m256, f32, f32) {
        // SAFETY: the caller guarantees the block bytes: 4-byte headers at `xb` and `yb`, 16
        // bytes of nibbles at `xb + 4`, 32 bytes of int8 at `yb + 4`; the loads are unaligned.
        unsafe {
            let (dx, mx) = two_halves(xb);
            let (dy, sy) = two_halves(yb);
            let nibbles = _mm_loadu_si128(xb.add(4) as *const __m128i);
            let both = _mm256_insertf128_si256::<1>(
                _mm256_castsi128_si256(nibbles),
                _mm_srli_epi16::<4>(nibbles),
            );
            let qx = _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
            let qy = _mm256_loadu_si256(yb.add(4) as *const __m256i);
            (mul_sum_us8_pairs(qx, qy), dx * dy, mx * sy)
        }
    }

    /// One Q8_0 block at `xb` against one at `yb`: pairwise integer sums as f32, and the
    /// product of the scales.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; 34 bytes at `xb` and at `yb` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0_block(xb: *const u8, yb: *const u8) -> (__m256, f32) {
        // SAFETY: the caller guarantees the same 34 readable bytes at each.
        let (ax, sy, dx, dy) = unsafe { q8_0_block_parts(xb, yb) };
        (mul_sum_us8_pairs(ax, sy), dx * dy)
    }

    /// One Q8_0 block at `xb` and one at `yb` as `maddubs` takes them: `|qx|` (unsigned), `qy`
    /// with `qx`'s signs, and the two scales.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; 34 bytes at `xb` and at `yb` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0_block_parts(xb: *const u8, yb: *const u8) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: the caller guarantees 34 readable bytes at each: `two_halves` reads the
        // 2-byte scale and the first two quants, the loads the 32 quants at offset 2.
        unsafe {
            let (dx, _) = two_halves(xb);
            let (dy, _) = two_halves(yb);
            let qx = _mm256_loadu_si256(xb.add(2) as *const __m256i);
            let qy = _mm256_loadu_si256(yb.add(2) as *const __m256i);
            (_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx), dx, dy)
        }
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` holds `nb` Q4_1 blocks and `y` `nb` Q8_1 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_q8_1(x: &[u8], y: &[u8], nb: usize) -> f32 {
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        // One accumulator and the blocks in order, as ggml sums them: a different float order
        // flips near-tied greedy tokens of a small model against llama.cpp's.
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0f32;
        let mut i = 0;
        while i + 1 < nb {
            // SAFETY: blocks `i` and `i + 1` are below `nb`, inside both slices.
            let ((p0, d0, m0), (p1, d1, m1)) = unsafe {
                (
                    q4_1_block(xp.add(i * Q4_1_BYTES), yp.add(i * Q8_1_BYTES)),
                    q4_1_block(xp.add((i + 1) * Q4_1_BYTES), yp.add((i + 1) * Q8_1_BYTES)),
                )
            };
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d0), p0, acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d1), p1, acc);
            summs += m0;
            summs += m1;
            i += 2;
        }
        if i < nb {
            // SAFETY: block `i` is below `nb`, inside both slices.
            let (p, d, m) = unsafe { q4_1_block(xp.add(i * Q4_1_BYTES), yp.add(i * Q8_1_BYTES)) };
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc);
            summs += m;
        }
        hsum(acc) + summs
    }

    /// One row of Q4_1 blocks against four rows of Q8_1 blocks (`ys`, one after the other):
    /// each weight block is unpacked once, and the four rows accumulate independently.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` holds `nb` Q4_1 blocks, `ys` `4 * nb` Q8_1 blocks
    /// and `scales` their `8 * nb` scales as f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_q8_1_x4(
        x: &[u8],
        ys: &[u8],
        scales: &[f32],
        nb: usize,
    ) -> [f32; 4] {
        let (xp, yp, sp) = (x.as_ptr(), ys.as_ptr(), scales.as_ptr());
        let row = nb * Q8_1_BYTES;
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut summs = [0f32; 4];
        let low = _mm256_set1_epi8(0x0f);
        for i in 0..nb {
            // SAFETY: block `i < nb` of `x` and of each of the four rows of `ys`, and its two
            // scales, are in bounds (the caller's guarantee); the byte loads are unaligned.
            unsafe {
                let xb = xp.add(i * Q4_1_BYTES);
                let (dx, mx) = two_halves(xb);
                let nibbles = _mm_loadu_si128(xb.add(4) as *const __m128i);
                let qx = _mm256_and_si256(
                    _mm256_insertf128_si256::<1>(
                        _mm256_castsi128_si256(nibbles),
                        _mm_srli_epi16::<4>(nibbles),
                    ),
                    low,
                );
                for r in 0..4 {
                    let yb = yp.add(r * row + i * Q8_1_BYTES);
                    let (dy, sy) = (*sp.add((r * nb + i) * 2), *sp.add((r * nb + i) * 2 + 1));
                    let qy = _mm256_loadu_si256(yb.add(4) as *const __m256i);
                    acc[r] =
                        _mm256_fmadd_ps(_mm256_set1_ps(dx * dy), mul_sum_us8_pairs(qx, qy), acc[r]);
                    summs[r] += mx * sy;
                }
            }
        }
        [
            hsum(acc[0]) + summs[0],
            hsum(acc[1]) + summs[1],
            hsum(acc[2]) + summs[2],
            hsum(acc[3]) + summs[3],
        ]
    }

    /// [`dot_q8_0_q8_0`] of `x` with four rows of `ys`: each weight block's quants loaded and
    /// their magnitudes taken once, each row accumulating as that kernel does (one accumulator,
    /// the blocks in order), so each result is that kernel's bit for bit.
    ///
    /// `dys`: the four rows' blocks' scales as f32 (converted once for every weight row; the
    /// same values the one-row kernel converts from each block).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` holds `nb` Q8_0 blocks, `ys` `4 * nb` and `dys`
    /// `4 * nb` scales.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0_q8_0_x4(
        x: &[u8],
        ys: &[u8],
        dys: &[f32],
        nb: usize,
        pf: usize,
    ) -> [f32; 4] {
        let (xp, yp, dp) = (x.as_ptr(), ys.as_ptr(), dys.as_ptr());
        let row = nb * Q8_0_BYTES;
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in 0..nb {
            super::prefetch_ahead(xp, i * Q8_0_BYTES, pf);
            // SAFETY: block `i < nb` of `x` and of each of the four rows of `ys` is in bounds
            // (the caller's guarantee); the loads are unaligned.
            unsafe {
                let xb = xp.add(i * Q8_0_BYTES);
                let (dx, _) = two_halves(xb);
                let qx = _mm256_loadu_si256(xb.add(2) as *const __m256i);
                let ax = _mm256_sign_epi8(qx, qx);
                for (r, a) in acc.iter_mut().enumerate() {
                    let yb = yp.add(r * row + i * Q8_0_BYTES);
                    let dy = *dp.add(r * nb + i);
                    let qy = _mm256_loadu_si256(yb.add(2) as *const __m256i);
                    let p = mul_sum_us8_pairs(ax, _mm256_sign_epi8(qy, qx));
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(dx * dy), p, *a);
                }
            }
        }
        [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
    }

    /// `pf`: how far ahead of its reads of the weights it prefetches, in bytes (0: not at all).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` and `y` each hold `nb` Q8_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0_q8_0(x: &[u8], y: &[u8], nb: usize, pf: usize) -> f32 {
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 1 < nb {
            super::prefetch_ahead(xp, i * Q8_0_BYTES, pf);
            // SAFETY: blocks `i` and `i + 1` are below `nb`, inside both slices.
            let ((p0, d0), (p1, d1)) = unsafe {
                (
                    q8_0_block(xp.add(i * Q8_0_BYTES), yp.add(i * Q8_0_BYTES)),
                    q8_0_block(xp.add((i + 1) * Q8_0_BYTES), yp.add((i + 1) * Q8_0_BYTES)),
                )
            };
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d0), p0, acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d1), p1, acc);
            i += 2;
        }
        if i < nb {
            // SAFETY: block `i` is below `nb`, inside both slices.
            let (p, d) = unsafe { q8_0_block(xp.add(i * Q8_0_BYTES), yp.add(i * Q8_0_BYTES)) };
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc);
        }
        hsum(acc)
    }

    /// The eight int8 at `p` as f32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; 8 bytes at `p` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn i8x8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bytes at `p`; the load is unaligned.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
    }

    /// One Q4_1 block at `xb` dequantized to four vectors of 8 (`d * q + m`, elements 0-7,
    /// 8-15, 16-23, 24-31).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; 20 bytes at `xb` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_values(xb: *const u8) -> [__m256; 4] {
        // SAFETY: the caller guarantees 20 readable bytes: the 4-byte header and two 8-byte
        // halves of the nibbles at `xb + 4` and `xb + 12`; the loads are unaligned.
        unsafe {
            let (d, m) = two_halves(xb);
            let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
            let v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(xb.add(4) as *const __m128i));
            let v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(xb.add(12) as *const __m128i));
            let low = _mm256_set1_epi32(0x0f);
            [
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), d, m),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), d, m),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v0)), d, m),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v1)), d, m),
            ]
        }
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` holds `nb` Q4_1 blocks and `y` `nb * 32` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_f32(x: &[u8], y: &[f32], nb: usize) -> f32 {
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in 0..nb {
            // SAFETY: block `i` is below `nb`: 20 bytes at its weights and 32 values at its
            // activations are inside the slices; the loads are unaligned.
            unsafe {
                let w = q4_1_values(xp.add(i * Q4_1_BYTES));
                let yb = yp.add(i * 32);
                acc0 = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(yb), acc0);
                acc1 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(yb.add(8)), acc1);
                acc0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(yb.add(16)), acc0);
                acc1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(yb.add(24)), acc1);
            }
        }
        hsum(_mm256_add_ps(acc0, acc1))
    }

    /// One row of Q4_1 blocks `x` against four rows of F32 activations (`y`, `nb * 32` values
    /// each, one after the other): each block dequantized once for the four.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` holds `nb` Q4_1 blocks and `y` `4 * nb * 32`
    /// values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_f32_x4(x: &[u8], y: &[f32], nb: usize) -> [f32; 4] {
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let k = nb * 32;
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in 0..nb {
            // SAFETY: block `i` is below `nb`: its 20 weight bytes are inside `x`, and each of
            // the four rows' 32 values at `r * k + i * 32` inside `y`; the loads are unaligned.
            unsafe {
                let w = q4_1_values(xp.add(i * Q4_1_BYTES));
                for (r, a) in acc.iter_mut().enumerate() {
                    let yb = yp.add(r * k + i * 32);
                    let mut t = _mm256_mul_ps(w[0], _mm256_loadu_ps(yb));
                    t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(yb.add(8)), t);
                    t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(yb.add(16)), t);
                    t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(yb.add(24)), t);
                    *a = _mm256_add_ps(*a, t);
                }
            }
        }
        [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
    }

    /// `pf`: how far ahead of its reads of the weights it prefetches, in bytes (0: not at all).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` holds `nb` Q8_0 blocks and `y` `nb * 32` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0_f32(x: &[u8], y: &[f32], nb: usize, pf: usize) -> f32 {
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in 0..nb {
            super::prefetch_ahead(xp, i * Q8_0_BYTES, pf);
            // SAFETY: block `i` is below `nb`: 34 bytes at `xb` and 32 values at `yb` are
            // inside the slices (`two_halves` reads the scale and the first two quants, the
            // four 8-byte loads the quants); the loads are unaligned.
            unsafe {
                let (xb, yb) = (xp.add(i * Q8_0_BYTES), yp.add(i * 32));
                let (d, _) = two_halves(xb);
                let mut t0 = _mm256_mul_ps(i8x8(xb.add(2)), _mm256_loadu_ps(yb));
                let mut t1 = _mm256_mul_ps(i8x8(xb.add(10)), _mm256_loadu_ps(yb.add(8)));
                t0 = _mm256_fmadd_ps(i8x8(xb.add(18)), _mm256_loadu_ps(yb.add(16)), t0);
                t1 = _mm256_fmadd_ps(i8x8(xb.add(26)), _mm256_loadu_ps(yb.add(24)), t1);
                let d = _mm256_set1_ps(d);
                acc0 = _mm256_fmadd_ps(d, t0, acc0);
                acc1 = _mm256_fmadd_ps(d, t1, acc1);
            }
        }
        hsum(_mm256_add_ps(acc0, acc1))
    }
}

/// The F32-activation dot products with 16 lanes (decode, one activation row).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::avx2::two_halves;
    use super::{Q4_1_BYTES, Q8_0_BYTES};

    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; `x` holds `nb` Q4_1 blocks and `y`
    /// `nb * 32` values.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_f32(x: &[u8], y: &[f32], nb: usize) -> f32 {
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let low = _mm512_set1_epi32(0x0f);
        let (mut acc, mut acc_m) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for i in 0..nb {
            // SAFETY: block `i` is below `nb`: 20 bytes at `xb` and 32 values at `yb` are
            // inside the slices; the loads are unaligned.
            unsafe {
                let (xb, yb) = (xp.add(i * Q4_1_BYTES), yp.add(i * 32));
                let (d, m) = two_halves(xb);
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(xb.add(4) as *const __m128i));
                let (y0, y1) = (_mm512_loadu_ps(yb), _mm512_loadu_ps(yb.add(16)));
                let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
                let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
                let dot = _mm512_fmadd_ps(lo, y0, _mm512_mul_ps(hi, y1));
                acc = _mm512_fmadd_ps(_mm512_set1_ps(d), dot, acc);
                acc_m = _mm512_fmadd_ps(_mm512_set1_ps(m), _mm512_add_ps(y0, y1), acc_m);
            }
        }
        _mm512_reduce_add_ps(_mm512_add_ps(acc, acc_m))
    }

    /// [`super::dot_q4_1_f32_summed`]'s kernel.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; `x` holds `nb` Q4_1 blocks, `y` `nb * 32`
    /// values and `ysum` `nb`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_f32_summed(x: &[u8], y: &[f32], ysum: &[f32], nb: usize) -> f32 {
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let low = _mm512_set1_epi32(0x0f);
        // d * sum(q_j * y_j) of block `i`, added into `acc`; returns the block's m.
        let block = |i: usize, acc: &mut __m512| -> f32 {
            // SAFETY: `i` is below `nb`: 20 bytes at `xb` and 32 values at `yb` are inside the
            // slices; the loads are unaligned.
            unsafe {
                let (xb, yb) = (xp.add(i * Q4_1_BYTES), yp.add(i * 32));
                let (d, m) = two_halves(xb);
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(xb.add(4) as *const __m128i));
                let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
                let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
                let dot = _mm512_fmadd_ps(
                    lo,
                    _mm512_loadu_ps(yb),
                    _mm512_mul_ps(hi, _mm512_loadu_ps(yb.add(16))),
                );
                *acc = _mm512_fmadd_ps(_mm512_set1_ps(d), dot, *acc);
                m
            }
        };
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let (mut s0, mut s1) = (0f32, 0f32);
        let mut i = 0;
        while i + 2 <= nb {
            s0 += block(i, &mut a0) * ysum[i];
            s1 += block(i + 1, &mut a1) * ysum[i + 1];
            i += 2;
        }
        if i < nb {
            s0 += block(i, &mut a0) * ysum[i];
        }
        _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + (s0 + s1)
    }

    /// One row of Q4_1 blocks against four rows of F32 activations, each block dequantized
    /// once for the four (prefill).
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; `x` holds `nb` Q4_1 blocks and `y`
    /// `4 * nb * 32` values.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_f32_x4(x: &[u8], y: &[f32], nb: usize) -> [f32; 4] {
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let k = nb * 32;
        let low = _mm512_set1_epi32(0x0f);
        let mut acc = [_mm512_setzero_ps(); 4];
        for i in 0..nb {
            // SAFETY: block `i` is below `nb`: its 20 weight bytes are inside `x`, and each of
            // the four rows' 32 values at `r * k + i * 32` inside `y`; the loads are unaligned.
            unsafe {
                let xb = xp.add(i * Q4_1_BYTES);
                let (d, m) = two_halves(xb);
                let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(xb.add(4) as *const __m128i));
                let w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), d, m);
                let w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v)), d, m);
                for (r, a) in acc.iter_mut().enumerate() {
                    let yb = yp.add(r * k + i * 32);
                    let t = _mm512_fmadd_ps(
                        w0,
                        _mm512_loadu_ps(yb),
                        _mm512_mul_ps(w1, _mm512_loadu_ps(yb.add(16))),
                    );
                    *a = _mm512_add_ps(*a, t);
                }
            }
        }
        [
            _mm512_reduce_add_ps(acc[0]),
            _mm512_reduce_add_ps(acc[1]),
            _mm512_reduce_add_ps(acc[2]),
            _mm512_reduce_add_ps(acc[3]),
        ]
    }

    /// Four rows of Q4_1 blocks against four rows of F32 activations: each weight block
    /// dequantized once, each activation block loaded once, the 4x4 products in registers.
    /// `[c][r]` is weight row `c` against activation row `r`.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; each `x[c]` holds `nb` Q4_1 blocks and `y`
    /// `4 * nb * 32` values.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_f32_c4x4(x: [&[u8]; 4], y: &[f32], nb: usize) -> [[f32; 4]; 4] {
        let yp = y.as_ptr();
        let k = nb * 32;
        let low = _mm512_set1_epi32(0x0f);
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        for i in 0..nb {
            let mut w = [[_mm512_setzero_ps(); 2]; 4];
            for (c, wc) in w.iter_mut().enumerate() {
                // SAFETY: block `i` is below `nb`: its 20 bytes are inside `x[c]`; the loads
                // are unaligned.
                unsafe {
                    let xb = x[c].as_ptr().add(i * Q4_1_BYTES);
                    let (d, m) = two_halves(xb);
                    let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
                    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(xb.add(4) as *const __m128i));
                    wc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), d, m);
                    wc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v)), d, m);
                }
            }
            for r in 0..4 {
                // SAFETY: row `r`'s 32 values of block `i` at `r * k + i * 32` are inside `y`
                // (four rows of `k`); the loads are unaligned.
                let (y0, y1) = unsafe {
                    let yb = yp.add(r * k + i * 32);
                    (_mm512_loadu_ps(yb), _mm512_loadu_ps(yb.add(16)))
                };
                for (a, wc) in acc.iter_mut().zip(&w) {
                    a[r] = _mm512_fmadd_ps(wc[0], y0, _mm512_fmadd_ps(wc[1], y1, a[r]));
                }
            }
        }
        let mut out = [[0f32; 4]; 4];
        for (o, a) in out.iter_mut().zip(&acc) {
            for (o, v) in o.iter_mut().zip(a) {
                *o = _mm512_reduce_add_ps(*v);
            }
        }
        out
    }

    /// [`super::dot_q8_0_f32_pair`]'s kernel: per row the operations of [`dot_q8_0_f32`] in
    /// its order.
    ///
    /// A Q8_0 block at `xb`: its scale, and its 32 quants as two vectors of 16 F32.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; 34 bytes at `xb` are readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q8_0_block(xb: *const u8) -> (f32, __m512, __m512) {
        // SAFETY: the caller guarantees the block's 34 bytes: the scale at `xb`, the quants at
        // `xb + 2` and `xb + 18`; the loads are unaligned.
        unsafe {
            let (d, _) = two_halves(xb);
            let q = |at: usize| {
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    xb.add(at) as *const __m128i
                )))
            };
            (d, q(2), q(18))
        }
    }

    /// One Q8_0 block's dot with 32 activations (`y0`, `y1`), before its scale, as every F32
    /// kernel here sums it.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn q8_0_block_dot((q0, q1): (__m512, __m512), y0: __m512, y1: __m512) -> __m512 {
        _mm512_fmadd_ps(q0, y0, _mm512_mul_ps(q1, y1))
    }

    /// `pf`: how far ahead of its reads of the weights it prefetches, in bytes (0: not at all).
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; `x0` and `x1` hold `nb` Q8_0 blocks each and
    /// `y` `nb * 32` values.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0_f32_pair(
        x0: &[u8],
        x1: &[u8],
        y: &[f32],
        nb: usize,
        pf: usize,
    ) -> (f32, f32) {
        let (p0, p1, yp) = (x0.as_ptr(), x1.as_ptr(), y.as_ptr());
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for i in 0..nb {
            super::prefetch_ahead(p0, i * Q8_0_BYTES, pf);
            super::prefetch_ahead(p1, i * Q8_0_BYTES, pf);
            // SAFETY: block `i` is below `nb`: 34 bytes at each row's block and 32 values at
            // `yb` are inside the slices; the loads are unaligned.
            unsafe {
                let yb = yp.add(i * 32);
                let (y0, y1) = (_mm512_loadu_ps(yb), _mm512_loadu_ps(yb.add(16)));
                let row = |xb: *const u8, acc: __m512| {
                    let (d, q0, q1) = q8_0_block(xb);
                    _mm512_fmadd_ps(_mm512_set1_ps(d), q8_0_block_dot((q0, q1), y0, y1), acc)
                };
                a0 = row(p0.add(i * Q8_0_BYTES), a0);
                a1 = row(p1.add(i * Q8_0_BYTES), a1);
            }
        }
        (_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1))
    }

    /// `pf`: how far ahead of its reads of the weights it prefetches, in bytes (0: not at all).
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; `x` holds `nb` Q8_0 blocks and `y`
    /// `nb * 32` values.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0_f32(x: &[u8], y: &[f32], nb: usize, pf: usize) -> f32 {
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let mut acc = _mm512_setzero_ps();
        for i in 0..nb {
            super::prefetch_ahead(xp, i * Q8_0_BYTES, pf);
            // SAFETY: block `i` is below `nb`: 34 bytes at `xb` and 32 values at `yb` are
            // inside the slices; the loads are unaligned.
            unsafe {
                let (xb, yb) = (xp.add(i * Q8_0_BYTES), yp.add(i * 32));
                let (d, q0, q1) = q8_0_block(xb);
                let dot =
                    q8_0_block_dot((q0, q1), _mm512_loadu_ps(yb), _mm512_loadu_ps(yb.add(16)));
                acc = _mm512_fmadd_ps(_mm512_set1_ps(d), dot, acc);
            }
        }
        _mm512_reduce_add_ps(acc)
    }

    /// [`dot_q8_0_f32`] of one row of Q8_0 blocks `x` with four rows of F32 activations `ys`
    /// (`nb * 32` values each, one after the other), each weight block converted once, each
    /// row accumulating as that kernel does (one accumulator, the blocks in order, the same
    /// operations), so each result is that kernel's bit for bit.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; `x` holds `nb` Q8_0 blocks and `ys`
    /// `4 * nb * 32` values.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0_f32_x4(x: &[u8], ys: &[f32], nb: usize, pf: usize) -> [f32; 4] {
        let (xp, yp) = (x.as_ptr(), ys.as_ptr());
        let row = nb * 32;
        let mut acc = [_mm512_setzero_ps(); 4];
        for i in 0..nb {
            super::prefetch_ahead(xp, i * Q8_0_BYTES, pf);
            // SAFETY: block `i` is below `nb`: 34 bytes at `xb` and 32 values at each row's
            // `yb` are inside the slices (the caller's guarantee); the loads are unaligned.
            unsafe {
                let (d, q0, q1) = q8_0_block(xp.add(i * Q8_0_BYTES));
                let d = _mm512_set1_ps(d);
                for (r, a) in acc.iter_mut().enumerate() {
                    let yb = yp.add(r * row + i * 32);
                    let dot =
                        q8_0_block_dot((q0, q1), _mm512_loadu_ps(yb), _mm512_loadu_ps(yb.add(16)));
                    *a = _mm512_fmadd_ps(d, dot, *a);
                }
            }
        }
        acc.map(|a| _mm512_reduce_add_ps(a))
    }
}

/// Asks the memory for the cache line `pf` bytes past byte `at` of a weight row at `p` (a
/// kernel's next reads, `pf` as its caller was given it); nothing where `pf` is 0. Any address
/// will do: a prefetch never faults.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_ahead(p: *const u8, at: usize, pf: usize) {
    if pf == 0 {
        return;
    }
    let p = p.wrapping_add(at + pf);
    // SAFETY: a prefetch reads nothing the program sees and never faults, wherever `p`
    // points (SSE, which every x86_64 CPU has).
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
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
    fn simd_dots_equal_scalar() {
        let k = 32 * 18;
        let mut x4 = vec![0u8; k / QK * Q4_1_BYTES];
        for (i, b) in x4.iter_mut().enumerate() {
            *b = (i * 37 % 251) as u8;
        }
        for i in 0..k / QK {
            let o = i * Q4_1_BYTES;
            x4[o..o + 2].copy_from_slice(&f16::from_f32(0.01 * (i as f32 + 1.0)).to_le_bytes());
            x4[o + 2..o + 4].copy_from_slice(&f16::from_f32(-0.05 * i as f32).to_le_bytes());
        }
        let mut y1 = vec![0u8; k / QK * Q8_1_BYTES];
        quantize_q8_1(&ramp(k, 7), &mut y1);
        let (a, b) = (dot_q4_1_q8_1(&x4, &y1), dot_q4_1_q8_1_scalar(&x4, &y1));
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{a} {b}");
        // Seven rows: a tile of four and three single rows.
        let mut ys = vec![0u8; 7 * y1.len()];
        for (r, y) in ys.chunks_exact_mut(y1.len()).enumerate() {
            quantize_q8_1(&ramp(k, 100 + r as u32), y);
        }
        let mut out = [0f32; 7];
        dot_q4_1_q8_1_rows(&x4, &ys, &q8_1_scales(&ys), &mut out);
        for (o, y) in out.iter().zip(ys.chunks_exact(y1.len())) {
            let b = dot_q4_1_q8_1_scalar(&x4, y);
            assert!((o - b).abs() <= 1e-4 * b.abs().max(1.0), "{o} {b}");
        }

        let mut x8 = vec![0u8; k / QK * Q8_0_BYTES];
        let mut y8 = vec![0u8; k / QK * Q8_0_BYTES];
        quantize_q8_0(&ramp(k, 3), &mut x8);
        quantize_q8_0(&ramp(k, 11), &mut y8);
        // Nine rows (two tiles of four and a single row), at two prefetch distances: each
        // equal to the one-row kernel's bit for bit.
        let mut ys8 = vec![0u8; 9 * y8.len()];
        for (r, y) in ys8.chunks_exact_mut(y8.len()).enumerate() {
            quantize_q8_0(&ramp(k, 200 + r as u32), y);
        }
        for pf in [0, 4096] {
            let mut out = [0f32; 9];
            dot_q8_0_q8_0_rows(&x8, &ys8, &q8_0_scales(&ys8), &mut out, pf);
            for (o, y) in out.iter().zip(ys8.chunks_exact(y8.len())) {
                assert_eq!(o.to_bits(), dot_q8_0_q8_0(&x8, y, pf).to_bits());
                let b = dot_q8_0_q8_0_scalar(&x8, y);
                assert!((o - b).abs() <= 1e-4 * b.abs().max(1.0), "{o} {b}");
            }
        }
        // F32 activations, nine rows at two prefetch distances: each equal to the one-row
        // kernel's bit for bit.
        let yfs: Vec<f32> = (0..9).flat_map(|r| ramp(k, 300 + r)).collect();
        for pf in [0, 4096] {
            let mut out = [0f32; 9];
            dot_q8_0_f32_rows(&x8, &yfs, &mut out, pf);
            for (o, y) in out.iter().zip(yfs.chunks_exact(k)) {
                assert_eq!(o.to_bits(), dot_q8_0_f32(&x8, y, pf).to_bits());
                let b = dot_q8_0_f32_scalar(&x8, y);
                assert!((o - b).abs() <= 1e-4 * b.abs().max(1.0), "{o} {b}");
            }
        }
        {
            let (mut x8b, yf8) = (vec![0u8; x8.len()], ramp(k, 17));
            quantize_q8_0(&ramp(k, 5), &mut x8b);
            let pair = dot_q8_0_f32_pair(&x8, &x8b, &yf8, 4096);
            let single = (
                dot_q8_0_f32(&x8, &yf8, 4096),
                dot_q8_0_f32(&x8b, &yf8, 4096),
            );
            assert_eq!(
                (pair.0.to_bits(), pair.1.to_bits()),
                (single.0.to_bits(), single.1.to_bits())
            );
        }
        let (a, b) = (
            dot_q8_0_q8_0(&x8, &y8, 4096),
            dot_q8_0_q8_0_scalar(&x8, &y8),
        );
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{a} {b}");

        // F32 activations: SIMD, scalar and the dequantized weights' plain dot agree.
        let yf = ramp(k, 13);
        let deq4: Vec<f32> = x4
            .chunks_exact(Q4_1_BYTES)
            .flat_map(|b| {
                let (d, m) = (half_at(b, 0), half_at(b, 2));
                let lo: Vec<f32> = (0..16).map(|j| (b[4 + j] & 0x0f) as f32 * d + m).collect();
                let hi: Vec<f32> = (0..16).map(|j| (b[4 + j] >> 4) as f32 * d + m).collect();
                lo.into_iter().chain(hi)
            })
            .collect();
        let plain: f32 = deq4.iter().zip(&yf).map(|(a, b)| a * b).sum();
        let summed = dot_q4_1_f32_summed(&x4, &yf, &block_sums(&yf));
        for v in [
            dot_q4_1_f32(&x4, &yf),
            dot_q4_1_f32_scalar(&x4, &yf),
            summed,
        ] {
            assert!(
                (v - plain).abs() <= 1e-4 * plain.abs().max(1.0),
                "{v} {plain}"
            );
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // The AVX2 kernels too where AVX-512 takes the public path.
            // SAFETY: the CPU has AVX2, FMA and F16C (checked); `x4` holds `k / 32` Q4_1
            // blocks, `x8` as many Q8_0 blocks, and `yf` `k` values.
            let (a, b) = unsafe {
                (
                    avx2::dot_q4_1_f32(&x4, &yf, k / QK),
                    avx2::dot_q8_0_f32(&x8, &yf, k / QK, 512),
                )
            };
            let (pa, pb) = (dot_q4_1_f32_scalar(&x4, &yf), dot_q8_0_f32_scalar(&x8, &yf));
            assert!((a - pa).abs() <= 1e-4 * pa.abs().max(1.0), "{a} {pa}");
            assert!((b - pb).abs() <= 1e-4 * pb.abs().max(1.0), "{b} {pb}");
            let rows: Vec<f32> = (0..4).flat_map(|r| ramp(k, 300 + r)).collect();
            // SAFETY: as above; `rows` holds four rows of `k` values.
            let four = unsafe { avx2::dot_q4_1_f32_x4(&x4, &rows, k / QK) };
            for (o, y) in four.iter().zip(rows.chunks_exact(k)) {
                let b = dot_q4_1_f32_scalar(&x4, y);
                assert!((o - b).abs() <= 1e-4 * b.abs().max(1.0), "{o} {b}");
            }
        }
        let yfs: Vec<f32> = (0..7).flat_map(|r| ramp(k, 200 + r)).collect();
        let mut out = [0f32; 7];
        dot_q4_1_f32_rows(&x4, &yfs, &mut out);
        for (o, y) in out.iter().zip(yfs.chunks_exact(k)) {
            let b = dot_q4_1_f32_scalar(&x4, y);
            assert!((o - b).abs() <= 1e-4 * b.abs().max(1.0), "{o} {b}");
        }
        let deq8: Vec<f32> = x8
            .chunks_exact(Q8_0_BYTES)
            .flat_map(|b| {
                let d = half_at(b, 0);
                b[2..]
                    .iter()
                    .map(move |&q| q as i8 as f32 * d)
                    .collect::<Vec<_>>()
            })
            .collect();
        let plain: f32 = deq8.iter().zip(&yf).map(|(a, b)| a * b).sum();
        for v in [dot_q8_0_f32(&x8, &yf, 4096), dot_q8_0_f32_scalar(&x8, &yf)] {
            assert!(
                (v - plain).abs() <= 1e-4 * plain.abs().max(1.0),
                "{v} {plain}"
            );
        }
    }

    /// The dense kernels against the scalar sums: every type, widths that are and are not
    /// multiples of the 8 and 16 lanes, 1 to 11 rows (one group of 8 and a rest).
    #[test]
    fn quantize_q8_1_keeps_the_sum() {
        let xs = ramp(64, 5);
        let mut y = vec![0u8; 2 * Q8_1_BYTES];
        quantize_q8_1(&xs, &mut y);
        for (b, x) in y.chunks_exact(Q8_1_BYTES).zip(xs.chunks_exact(QK)) {
            let d = half_at(b, 0);
            let back: f32 = b[4..].iter().map(|&q| q as i8 as f32 * d).sum();
            let exact: f32 = x.iter().sum();
            // Each element rounds by at most d/2.
            assert!(
                (back - exact).abs() <= QK as f32 * d / 2.0 + 1e-5,
                "{back} {exact}"
            );
            assert!((half_at(b, 2) - back).abs() <= 1e-2 * back.abs().max(1.0));
        }
    }
}
