//! `kernels::attention` against the compositions it replaces: decode attention (GQA/MQA, windows,
//! strided caches, padded batches, a position read on the device, the 8-bit copy of its rows) and
//! prompt attention.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_offload::kernels::{self, attention, linear, rope};
use candle_offload::{KernelTuning, QlinearVariant};

use crate::ops::common::*;
use crate::ops::rope::{rope_cache_operands, tables, RopeCacheCase};

/// The attention and the gate/up matmul that also quantize their output for the next matmul
/// (the output and the down projections) give the plain ops' values, and those projections
/// give bit for bit what they give on a copy of the same rows, which they quantize themselves:
/// split and unsplit attention, several heads' blocks, batches and continuations of a few
/// rows; a head dim that is not blocks of 32 (80) falls back.
fn attention_and_silu_q8_feed_the_matmuls(device: &Device) -> anyhow::Result<()> {
    let tun = KernelTuning::default();
    let same = |a: &Tensor, b: &Tensor| -> anyhow::Result<bool> {
        Ok(a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
            == b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let types = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
    ];
    // (batch, q heads, kv heads, new positions, cached positions, head dim)
    let shapes = [
        (1usize, 8usize, 2usize, 1usize, 40usize, 64usize),
        (1, 4, 4, 1, 700, 128),
        (2, 4, 1, 3, 9, 32),
        (1, 8, 8, 1, 33, 80),
    ];
    for dtype in DTYPES {
        for (i, &(b, hq, hk, tq, kv, d)) in shapes.iter().enumerate() {
            let qtype = types[i % types.len()];
            let seed = 900 + 10 * i as u64;
            let q = random(&[b, hq, tq, d], 1.0, seed, dtype, device)?;
            let k = random(&[b, hk, kv, d], 1.0, seed + 1, dtype, device)?;
            let v = random(&[b, hk, kv, d], 1.0, seed + 2, dtype, device)?;
            let what = format!("{dtype:?} {qtype:?} attention {:?}", shapes[i]);
            let y = attention::decode_attention_q8(&q, &k, &v, 0.125, None)?;
            let want =
                attention::decode_attention(&q, &k, &v, 0.125, None)?.reshape((b, tq, hq * d))?;
            anyhow::ensure!(same(&y, &want)?, "{what}: attention");
            let wt = random(&[72, hq * d], 1.0, seed + 3, DType::F32, &Device::Cpu)?;
            let w = QTensor::quantize_onto(&wt, qtype, device)?;
            let copy = (&y + 0.0)?;
            let found = kernels::quantized_rows_found();
            let got = linear::qlinear_small(&y, &w, &tun)?;
            anyhow::ensure!(
                same(&got, &linear::qlinear_small(&copy, &w, &tun)?)?,
                "{what}: o_proj"
            );
            let expect = u64::from(device.is_cuda() && d % 32 == 0);
            let seen = kernels::quantized_rows_found() - found;
            anyhow::ensure!(seen == expect, "{what}: quantized rows found {seen} times");
        }
        for (i, &qtype) in types.iter().enumerate() {
            for (rows, n) in [(1usize, 96usize), (2, 64), (5, 160), (8, 32)] {
                let k = 64 * (i + 1);
                let seed = 950 + 10 * (rows + i) as u64;
                let x = random(&[1, rows, k], 2.0, seed, dtype, device)?;
                let quantize = |s: u64, shape: [usize; 2]| -> anyhow::Result<QTensor> {
                    let wt = random(&shape, 1.0, s, DType::F32, &Device::Cpu)?;
                    Ok(QTensor::quantize_onto(&wt, qtype, device)?)
                };
                let (gate, up) = (quantize(seed + 1, [n, k])?, quantize(seed + 2, [n, k])?);
                let down = quantize(seed + 3, [40, n])?;
                let what = format!("{dtype:?} {qtype:?} gate/up {rows} rows of {n}");
                let y = linear::qlinear_silu_mul_q8(&x, &gate, &up, &tun)?;
                let want = linear::qlinear_silu_mul(&x, &gate, &up, &tun)?;
                anyhow::ensure!(same(&y, &want)?, "{what}: gate/up");
                let copy = (&y + 0.0)?;
                let found = kernels::quantized_rows_found();
                let got = linear::qlinear_small(&y, &down, &tun)?;
                anyhow::ensure!(
                    same(&got, &linear::qlinear_small(&copy, &down, &tun)?)?,
                    "{what}: down"
                );
                // Only variant 4's kernel for blocks of 32 writes a quantized output.
                let v4 = tun.qlinear_variant_at(qtype, rows) == QlinearVariant::V4;
                let expect = u64::from(device.is_cuda() && v4);
                let seen = kernels::quantized_rows_found() - found;
                anyhow::ensure!(seen == expect, "{what}: quantized rows found {seen} times");
            }
        }
    }
    Ok(())
}
test_device!(
    attention_and_silu_q8_feed_the_matmuls,
    ops_attention_and_silu_q8_cpu,
    ops_attention_and_silu_q8_gpu
);

/// The ops of a captured decode step, which read the position from the device, give what the
/// ops given it on the host give: `rope_qk_cache_at` (with the whole table) writes the same
/// caches and q bit for bit, `decode_attention_at` over the whole cache equals the composition
/// over the cached positions (the kernel's key ranges follow the cache's length, so the
/// summation order may differ), also for a padded batch (its counts on the device too,
/// against `decode_attention_padded` over the cached positions). On a GPU, a head dim no
/// kernel takes is refused rather than read to the host.
fn ops_at_a_device_position(device: &Device) -> anyhow::Result<()> {
    let cases: [RopeCacheCase; 3] = [
        (1, 1, 32, 8, 128, 128, 37, 40),
        (2, 1, 6, 2, 64, 64, 5, 8),
        (1, 2, 3, 3, 10, 6, 0, 2),
    ];
    for dtype in DTYPES {
        for (i, &case) in cases.iter().enumerate() {
            let (_, t, _, _, _, _, pos, _) = case;
            let [q, k, v, kc, vc, table] =
                rope_cache_operands(case, 900 + 10 * i as u64, dtype, device)?;
            let (kc2, vc2) = (kc.copy()?, vc.copy()?);
            let want =
                rope::rope_qk_cache(&q, &k, &v, &table.narrow(0, pos, t)?, (&kc, &vc), pos, None)?;
            let at = Tensor::new(&[pos as u32], device)?;
            let got = rope::rope_qk_cache_at(&q, &k, &v, &table, (&kc2, &vc2), &at, None)?;
            let what = format!("rope_qk_cache_at {:?} {dtype:?}", cases[i]);
            for (g, w, name) in [(&got, &want, "q"), (&kc2, &kc, "k"), (&vc2, &vc, "v")] {
                anyhow::ensure!(
                    rel_diff(g, w)? == 0.0,
                    "{what}: {name} differs from rope_qk_cache's"
                );
            }
        }
        for (i, &(b, hq, hk, tq, kv, d, window)) in ATTENTION_SHAPES.iter().enumerate() {
            let seed = 20 * i as u64 + 1;
            let q = random(&[b, hq, tq, d], 1.0, seed, dtype, device)?;
            let k = random(&[b, hk, kv + 7, d], 1.0, seed + 1, dtype, device)?;
            let v = random(&[b, hk, kv + 7, d], 1.0, seed + 2, dtype, device)?;
            let scale = 1.0 / (d as f64).sqrt();
            let at = Tensor::new(&[(kv - tq) as u32], device)?;
            let what = format!("decode_attention_at {:?} {dtype:?}", ATTENTION_SHAPES[i]);
            let got = attention::decode_attention_at(&q, &k, &v, scale, window, &at, None, false);
            if device.is_cuda() && d > 256 {
                anyhow::ensure!(got.is_err(), "{what}: no kernel, and no host read");
                continue;
            }
            let (kn, vn) = (k.narrow(2, 0, kv)?, v.narrow(2, 0, kv)?);
            let want = attention::decode_attention_unfused(&q, &kn, &vn, scale, window)?;
            ensure_close(&what, &got?, &want, dtype)?;
        }
        // A padded batch's step: the counts are read on the device as well.
        for (i, &(hq, hk, tq, kv, d, window, pads)) in PADDED_CASES.iter().enumerate() {
            let b = pads.len();
            let seed = 1500 + 10 * i as u64;
            let q = random(&[b, hq, tq, d], 1.0, seed, dtype, device)?;
            let k = random(&[b, hk, kv + 5, d], 1.0, seed + 1, dtype, device)?;
            let v = random(&[b, hk, kv + 5, d], 1.0, seed + 2, dtype, device)?;
            let scale = 1.0 / (d as f64).sqrt();
            let at = Tensor::new(&[(kv - tq) as u32], device)?;
            let counts = Tensor::new(pads.iter().map(|&p| p as u32).collect::<Vec<_>>(), device)?;
            let (kn, vn) = (k.narrow(2, 0, kv)?, v.narrow(2, 0, kv)?);
            for q8 in [false, true] {
                let got = attention::decode_attention_at(
                    &q,
                    &k,
                    &v,
                    scale,
                    window,
                    &at,
                    Some(&counts),
                    q8,
                )?;
                let want =
                    attention::decode_attention_padded(&q, &kn, &vn, scale, window, &counts, q8)?;
                ensure_close(
                    &format!(
                        "padded decode_attention_at {:?} q8 {q8} {dtype:?}",
                        PADDED_CASES[i]
                    ),
                    &got,
                    &want,
                    dtype,
                )?;
            }
        }
    }
    // A position that is not one u32 on the device of the operands: an error.
    let q = random(&[1, 1, 2, 8], 1.0, 1, DType::F32, device)?;
    let kc = Tensor::zeros((1, 2, 3, 8), DType::F32, device)?;
    let (cos, sin) = tables(4, 8, DType::F32, device)?;
    let table = rope::rope_table(&cos, &sin)?;
    for bad in [
        Tensor::new(&[1u32, 2], device)?,
        Tensor::new(&[1f32], device)?,
    ] {
        anyhow::ensure!(
            rope::rope_qk_cache_at(&q, &q, &q, &table, (&kc, &kc.copy()?), &bad, None).is_err()
        );
    }
    Ok(())
}
test_device!(
    ops_at_a_device_position,
    ops_at_a_device_position_cpu,
    ops_at_a_device_position_gpu
);

/// A padded batch's decode attention leaves each row's padding out: row r equals the
/// composition over its own positions from `pads[r]` on (attention depends only on the
/// distance between positions, windows included), for GQA, windows, several new positions,
/// split ranges and the quantized hand-over's variant; pads of zero are no padding; a head
/// dim past the kernel's and a wrong number of counts are refused.
/// (q heads, kv heads, new positions, cached positions, head_dim, window, pads)
type PaddedCase = (
    usize,
    usize,
    usize,
    usize,
    usize,
    Option<usize>,
    &'static [usize],
);

const PADDED_CASES: [PaddedCase; 4] = [
    (4, 2, 1, 9, 32, None, &[0, 3, 5]),
    (8, 8, 2, 40, 64, Some(6), &[10, 0]),
    (4, 1, 1, 600, 64, None, &[0, 17, 300, 599]),
    (2, 2, 1, 5, 32, None, &[0, 0]),
];

fn decode_attention_skips_each_rows_padding(device: &Device) -> anyhow::Result<()> {
    let cases = PADDED_CASES;
    for dtype in DTYPES {
        for (i, &(hq, hk, tq, kv, d, window, pads)) in cases.iter().enumerate() {
            let b = pads.len();
            let seed = 1200 + 10 * i as u64;
            let q = random(&[b, hq, tq, d], 1.0, seed, dtype, device)?;
            let k = random(&[b, hk, kv, d], 1.0, seed + 1, dtype, device)?;
            let v = random(&[b, hk, kv, d], 1.0, seed + 2, dtype, device)?;
            let scale = 1.0 / (d as f64).sqrt();
            let counts = Tensor::new(pads.iter().map(|&p| p as u32).collect::<Vec<_>>(), device)?;
            for q8 in [false, true] {
                let got =
                    attention::decode_attention_padded(&q, &k, &v, scale, window, &counts, q8)?;
                let got = got.reshape((b, tq, hq, d))?;
                for (r, &p) in pads.iter().enumerate() {
                    let row = |t: &Tensor| t.narrow(0, r, 1)?.narrow(2, p, kv - p);
                    let want = attention::decode_attention_unfused(
                        &q.narrow(0, r, 1)?,
                        &row(&k)?,
                        &row(&v)?,
                        scale,
                        window,
                    )?;
                    ensure_close(
                        &format!("padded attention {:?} row {r} q8 {q8} {dtype:?}", cases[i]),
                        &got.narrow(0, r, 1)?,
                        &want,
                        dtype,
                    )?;
                }
            }
        }
    }
    let (q, k) = (
        random(&[2, 2, 1, 320], 1.0, 1, DType::F32, device)?,
        random(&[2, 2, 4, 320], 1.0, 2, DType::F32, device)?,
    );
    anyhow::ensure!(attention::decode_attention_padded(
        &q,
        &k,
        &k,
        0.1,
        None,
        &Tensor::new(&[1u32, 0], device)?,
        false
    )
    .is_err());
    let (q, k) = (
        random(&[2, 2, 1, 32], 1.0, 1, DType::F32, device)?,
        random(&[2, 2, 4, 32], 1.0, 2, DType::F32, device)?,
    );
    anyhow::ensure!(attention::decode_attention_padded(
        &q,
        &k,
        &k,
        0.1,
        None,
        &Tensor::new(&[1u32], device)?,
        false
    )
    .is_err());
    Ok(())
}
test_device!(
    decode_attention_skips_each_rows_padding,
    ops_decode_attention_padded_cpu,
    ops_decode_attention_padded_gpu
);

/// (batch, q heads, kv heads, new positions, cached positions, head_dim, sliding window):
/// decode (one new), GQA, MQA with a window, several new positions, all positions new, odd head
/// dims, the largest head_dim of the kernel and one past it (the composition's fallback), and
/// more visible keys than one block of the CUDA kernel scores (256), split into ranges.
type AttentionShape = (usize, usize, usize, usize, usize, usize, Option<usize>);

const ATTENTION_SHAPES: [AttentionShape; 13] = [
    (1, 4, 4, 1, 1, 8, None),
    (1, 32, 32, 1, 77, 128, None),
    (2, 8, 2, 1, 33, 64, None),
    (1, 6, 1, 3, 17, 40, Some(5)),
    (1, 4, 2, 8, 8, 128, None),
    (2, 3, 3, 2, 130, 33, Some(64)),
    (1, 2, 1, 1, 9, 256, None),
    (1, 2, 2, 1, 5, 320, None),
    (1, 4, 4, 1, 1000, 64, Some(100)),
    (1, 4, 2, 2, 300, 128, None),
    (1, 2, 2, 1, 260, 36, Some(200)),
    // The CUDA kernel cuts these keys into ranges (flash-decoding) and combines them.
    (1, 2, 1, 3, 600, 64, None),
    (1, 32, 8, 1, 528, 128, None),
];

fn decode_attention_matches_composition(device: &Device) -> anyhow::Result<()> {
    for dtype in DTYPES {
        for (i, &(b, hq, hk, tq, kv, d, window)) in ATTENTION_SHAPES.iter().enumerate() {
            let seed = 10 * i as u64;
            let q = random(&[b, hq, tq, d], 1.0, seed, dtype, device)?;
            // k and v as views of a longer preallocated cache, as the KV cache hands them out.
            let cache = |s| -> anyhow::Result<Tensor> {
                Ok(random(&[b, hk, kv + 7, d], 1.0, s, dtype, device)?.narrow(2, 0, kv)?)
            };
            let (k, v) = (cache(seed + 1)?, cache(seed + 2)?);
            anyhow::ensure!(b * hk == 1 || !k.is_contiguous(), "the views are strided");
            let scale = 1.0 / (d as f64).sqrt();
            let got = attention::decode_attention(&q, &k, &v, scale, window)?;
            let want = attention::decode_attention_unfused(&q, &k, &v, scale, window)?;
            anyhow::ensure!(got.dims() == [b, tq, hq, d], "shape {:?}", got.dims());
            ensure_close(
                &format!("decode_attention {:?}", ATTENTION_SHAPES[i]),
                &got,
                &want,
                dtype,
            )?;
        }
    }
    // A mask that hides keys: with a window of 1 each query sees only its own position, so the
    // output is that position's value row.
    let (q, k, v) = (
        random(&[1, 2, 3, 16], 1.0, 7, DType::F32, device)?,
        random(&[1, 2, 5, 16], 1.0, 8, DType::F32, device)?,
        random(&[1, 2, 5, 16], 1.0, 9, DType::F32, device)?,
    );
    let got = attention::decode_attention(&q, &k, &v, 0.25, Some(1))?;
    let want = v.narrow(2, 2, 3)?.transpose(1, 2)?.contiguous()?;
    ensure_close("decode_attention window 1", &got, &want, DType::F32)?;
    Ok(())
}
test_device!(
    decode_attention_matches_composition,
    ops_decode_attention_cpu,
    ops_decode_attention_gpu
);

/// (batch, q heads, kv heads, new positions, cached positions, head_dim) of a prompt's pass: a
/// whole prompt (new = cached), later passes over a cache (GQA, MQA, batch 2, rows that are
/// not a multiple of the kernel's 64), one row, a 13B-shaped pass of 128 rows after 384, and a
/// head width without a kernel (the composition everywhere).
const PROMPT_SHAPES: [(usize, usize, usize, usize, usize, usize); 7] = [
    (1, 4, 4, 64, 64, 64),
    (1, 8, 2, 100, 300, 128),
    (2, 8, 1, 65, 130, 64),
    (1, 4, 2, 1, 9, 64),
    (1, 2, 2, 70, 70, 128),
    (1, 40, 40, 128, 512, 128),
    (1, 4, 4, 17, 40, 40),
];

/// `prompt_attention` over strided cache views against two references: the composition it
/// replaces on F32 copies on the CPU, and FlashAttention over every cached position's query
/// (`train::flash_attention`, from position 0; on the CPU its own loop), of which the pass's
/// rows are the last. On a GPU the kernel runs for F16 and BF16 and widths 64 and 128.
fn prompt_attention_matches_composition(device: &Device) -> anyhow::Result<()> {
    let tun = KernelTuning::default();
    use candle_offload::kernels::attention::flash_attention;
    for dtype in DTYPES {
        for (i, &(b, hq, hk, tq, kv, d)) in PROMPT_SHAPES.iter().enumerate() {
            let what = format!("prompt_attention {:?} {dtype:?}", PROMPT_SHAPES[i]);
            let seed = 1300 + 10 * i as u64;
            let q_all = random(&[b, hq, kv, d], 1.5, seed, dtype, device)?;
            let q = q_all.narrow(2, kv - tq, tq)?.contiguous()?;
            // k and v as views of a longer preallocated cache, as the KV cache hands them out.
            let cache = |s| -> anyhow::Result<Tensor> {
                Ok(random(&[b, hk, kv + 9, d], 1.5, s, dtype, device)?.narrow(2, 0, kv)?)
            };
            let (k, v) = (cache(seed + 1)?, cache(seed + 2)?);
            let scale = 1.0 / (d as f64).sqrt();
            let kernel = device.is_cuda()
                && dtype != DType::F32
                && (d == 64 || d == 128)
                && cfg!(feature = "cuda");
            anyhow::ensure!(
                attention::prompt_attention_supported(device, dtype, d, &tun) == kernel,
                "{what}: kernel expected: {kernel}"
            );
            let got = attention::prompt_attention(&q, &k, &v, scale, &tun)?;
            anyhow::ensure!(
                got.dims() == [b, tq, hq, d],
                "{what}: shape {:?}",
                got.dims()
            );
            anyhow::ensure!(got.dtype() == dtype, "{what}: dtype {:?}", got.dtype());
            let f32_cpu = |t: &Tensor| -> anyhow::Result<Tensor> {
                Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)
            };
            let want = attention::decode_attention_unfused(
                &f32_cpu(&q)?,
                &f32_cpu(&k)?,
                &f32_cpu(&v)?,
                scale,
                None,
            )?;
            ensure_close_values(&format!("{what} vs composition"), &got, &want, dtype)?;
            let full = flash_attention(&q_all, &k.contiguous()?, &v.contiguous()?, scale as f32)?;
            let rows = full.narrow(2, kv - tq, tq)?.transpose(1, 2)?;
            ensure_close_values(&format!("{what} vs flash_attention"), &got, &rows, dtype)?;
        }
    }
    Ok(())
}
test_device!(
    prompt_attention_matches_composition,
    ops_prompt_attention_cpu,
    ops_prompt_attention_gpu
);

/// The sequences of a ragged step over `caches` (key and value buffers), at the positions of
/// `seqs` ((capacity, position) each).
fn listed<'a>(
    caches: &'a [(Tensor, Tensor)],
    seqs: &[(usize, usize)],
) -> Vec<attention::RaggedDecodeSeq<'a>> {
    caches
        .iter()
        .zip(seqs)
        .map(|((kc, vc), &(_, pos))| attention::RaggedDecodeSeq {
            k_cache: kc,
            v_cache: vc,
            pos,
        })
        .collect()
}

/// `ragged_decode_attention` (several sequences' one new position each, each over its own
/// cache of its own capacity, in two launches on a GPU) against each sequence alone through
/// `rope_qk_cache` then `decode_attention` on copies of the same caches: the attention rows
/// and every cache buffer within each dtype's rounding, for GQA, full and partial rotary, a
/// sliding window, and positions that need the keys split into ranges; on a GPU the same from
/// a table of the caches and positions on the device (`ragged_decode_attention_at`), which a
/// table of the wrong dtype or the CPU refuse. Caches whose position is past their capacity
/// are refused.
fn ragged_decode_matches_each_sequence(device: &Device) -> anyhow::Result<()> {
    // (q heads, kv heads, head_dim, rotated dims, window, [(capacity, position) per sequence])
    type Case = (
        usize,
        usize,
        usize,
        usize,
        Option<usize>,
        &'static [(usize, usize)],
    );
    let cases: [Case; 4] = [
        (4, 2, 16, 16, None, &[(8, 0), (9, 5), (16, 15)]),
        (
            32,
            8,
            128,
            128,
            None,
            &[(640, 300), (700, 0), (640, 639), (100, 64)],
        ),
        (6, 1, 40, 20, Some(7), &[(30, 12), (30, 3)]),
        (8, 8, 64, 64, Some(200), &[(600, 599), (600, 1)]),
    ];
    for dtype in DTYPES {
        for (c, &(hq, hk, d, rot, window, seqs)) in cases.iter().enumerate() {
            let what = format!("case {c} {dtype:?}");
            let n = seqs.len();
            let seed = 500 + 10 * c as u64;
            let q = random(&[1, n, hq * d], 1.0, seed, dtype, device)?;
            let k = random(&[1, n, hk * d], 1.0, seed + 1, dtype, device)?;
            let v = random(&[1, n, hk * d], 1.0, seed + 2, dtype, device)?;
            let longest = seqs.iter().map(|&(cap, _)| cap).max().unwrap_or(1);
            let (cos, sin) = crate::ops::rope::tables(rot / 2, longest, dtype, device)?;
            let table = rope::rope_table(&cos, &sin)?;
            let caches = |s: u64| -> anyhow::Result<Vec<(Tensor, Tensor)>> {
                seqs.iter()
                    .enumerate()
                    .map(|(i, &(cap, _))| {
                        let c =
                            |t| random(&[1, hk, cap, d], 1.0, s + 2 * i as u64 + t, dtype, device);
                        Ok((c(0)?, c(1)?))
                    })
                    .collect()
            };
            let (ours, theirs) = (caches(seed + 100)?, caches(seed + 100)?);
            let scale = 1.0 / (d as f64).sqrt();
            let dims = attention::RaggedDims {
                n_heads: hq,
                n_kv_heads: hk,
                head_dim: d,
                scale,
                window,
            };
            let list = listed(&ours, seqs);
            let got = attention::ragged_decode_attention(&q, &k, &v, &table, &list, dims)?;
            anyhow::ensure!(got.dims() == [1, n, hq * d], "{what}: {:?}", got.dims());
            // The form a captured step launches: the sequences' caches and positions read from
            // a table on the device, the keys split for the largest capacity. The same rows
            // and caches on a GPU; refused elsewhere.
            let again = caches(seed + 100)?;
            let again_list = listed(&again, seqs);
            let read_at = |on_device: &Tensor| {
                attention::ragged_decode_attention_at(
                    &q,
                    &k,
                    &v,
                    &table,
                    &again_list,
                    dims,
                    on_device,
                )
            };
            if device.is_cuda() {
                let on_device =
                    Tensor::from_vec(attention::ragged_seq_table(&again_list)?, (n, 3), device)?;
                let at = read_at(&on_device)?;
                ensure_close(&format!("{what} from the device's table"), &at, &got, dtype)?;
                for (i, ((kc, vc), (kw, vw))) in again.iter().zip(&ours).enumerate() {
                    ensure_close(&format!("{what} keys {i}, device table"), kc, kw, dtype)?;
                    ensure_close(&format!("{what} values {i}, device table"), vc, vw, dtype)?;
                }
                let e = read_at(&on_device.to_dtype(DType::U32)?);
                anyhow::ensure!(e.is_err(), "{what}: a U32 table was taken");
            } else {
                anyhow::ensure!(
                    attention::ragged_seq_table(&again_list).is_err(),
                    "{what}: a table of CPU caches' addresses"
                );
                let e = read_at(&Tensor::zeros((n, 3), DType::I64, device)?);
                anyhow::ensure!(e.is_err(), "{what}: a device table read on the CPU");
            }
            for (i, ((kc, vc), &(_, pos))) in theirs.iter().zip(seqs).enumerate() {
                let row = |t: &Tensor, h: usize| -> candle_core::Result<Tensor> {
                    t.narrow(1, i, 1)?.reshape((1, 1, h, d))
                };
                let qr = rope::rope_qk_cache(
                    &row(&q, hq)?,
                    &row(&k, hk)?,
                    &row(&v, hk)?,
                    &table.narrow(0, pos, 1)?,
                    (kc, vc),
                    pos,
                    None,
                )?;
                let want = attention::decode_attention(
                    &qr,
                    &kc.narrow(2, 0, pos + 1)?,
                    &vc.narrow(2, 0, pos + 1)?,
                    scale,
                    window,
                )?
                .reshape((1, 1, hq * d))?;
                ensure_close(
                    &format!("{what} row {i}"),
                    &got.narrow(1, i, 1)?,
                    &want,
                    dtype,
                )?;
                ensure_close(&format!("{what} keys {i}"), &ours[i].0, kc, dtype)?;
                ensure_close(&format!("{what} values {i}"), &ours[i].1, vc, dtype)?;
            }
        }
    }
    // A replay's new positions: two layers' tables of two sequences (addresses, then capacity
    // << 32 | position) take them and keep addresses and capacities; a table that does not
    // list whole sequences is refused.
    let meta = |cap: i64, pos: i64| (cap << 32) | pos;
    let mut table = [11, 12, meta(40, 3), 21, 22, meta(9, 0)].repeat(2);
    attention::set_ragged_positions(&mut table, &[4, 1])?;
    anyhow::ensure!(
        table == [11, 12, meta(40, 4), 21, 22, meta(9, 1)].repeat(2),
        "{table:?}"
    );
    anyhow::ensure!(
        attention::set_ragged_positions(&mut table[..5], &[4, 1]).is_err(),
        "a cut table was taken"
    );
    let (kc, vc) = (
        Tensor::zeros((1, 1, 4, 8), DType::F32, device)?,
        Tensor::zeros((1, 1, 4, 8), DType::F32, device)?,
    );
    let x = Tensor::zeros((1, 1, 8), DType::F32, device)?;
    let (cos, sin) = crate::ops::rope::tables(4, 8, DType::F32, device)?;
    let past = [attention::RaggedDecodeSeq {
        k_cache: &kc,
        v_cache: &vc,
        pos: 4,
    }];
    let dims = attention::RaggedDims {
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 8,
        scale: 1.0,
        window: None,
    };
    anyhow::ensure!(
        attention::ragged_decode_attention(&x, &x, &x, &rope::rope_table(&cos, &sin)?, &past, dims)
            .is_err(),
        "a position past the cache's capacity was taken"
    );
    Ok(())
}
test_device!(
    ragged_decode_matches_each_sequence,
    ops_ragged_decode_cpu,
    ops_ragged_decode_gpu
);
