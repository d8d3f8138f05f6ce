//! `kernels::rope` against the compositions it replaces, and its writes into a KV cache.

use candle_core::{DType, Device, Tensor, D};
use candle_offload::kernels::rope;

use crate::ops::common::*;

/// cos/sin tables as `Rope::from_inv_freq` builds them, for `pairs` rotated pairs.
pub(crate) fn tables(
    pairs: usize,
    max_len: usize,
    dtype: DType,
    device: &Device,
) -> anyhow::Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..pairs)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / (2 * pairs) as f32))
        .collect();
    let inv = Tensor::from_vec(inv, (1, pairs), device)?;
    let t = Tensor::arange(0u32, max_len as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((max_len, 1))?;
    let f = t.matmul(&inv)?;
    Ok((f.cos()?.to_dtype(dtype)?, f.sin()?.to_dtype(dtype)?))
}

fn rope_qk_matches_composition(device: &Device) -> anyhow::Result<()> {
    // (batch, seq, q heads, kv heads, head_dim, rotated dims, first position)
    let cases = [
        (1, 1, 4, 2, 8, 8, 0),       // decode, GQA
        (1, 1, 32, 8, 128, 128, 37), // decode, LLaMA-like heads, at a position
        (2, 13, 6, 1, 64, 64, 3),    // prefill, MQA, batch 2
        (1, 5, 3, 3, 10, 6, 2),      // partial rotary (Phi-4-mini-like), MHA
        (1, 1, 1, 1, 2, 2, 0),       // the smallest head
        (3, 7, 5, 5, 96, 32, 11),    // partial rotary, odd head counts
    ];
    for dtype in DTYPES {
        for (i, &(b, t, hq, hk, d, rot, pos)) in cases.iter().enumerate() {
            let seed = 200 + 10 * i as u64;
            let q = random(&[b, t, hq, d], 2.0, seed, dtype, device)?;
            let k = random(&[b, t, hk, d], 2.0, seed + 1, dtype, device)?;
            let (cos, sin) = tables(rot / 2, 64, dtype, device)?;
            let table = rope::rope_table(&cos, &sin)?.narrow(0, pos, t)?;
            let (gq, gk) = rope::rope_qk(&q, &k, &table)?;
            let (wq, wk) = rope::rope_qk_unfused(&q, &k, &table)?;
            let what = format!("rope_qk {:?}", cases[i]);
            anyhow::ensure!(gq.dims() == [b, hq, t, d] && gk.dims() == [b, hk, t, d]);
            anyhow::ensure!(gq.is_contiguous() && gk.is_contiguous());
            ensure_close(&format!("{what} q"), &gq, &wq, dtype)?;
            ensure_close(&format!("{what} k"), &gk, &wk, dtype)?;
        }
    }
    // The reference itself is what the models ran before: Candle's rope on the transposed
    // heads (checked once against rotate-half written out, in F32).
    let q = random(&[1, 3, 2, 8], 1.0, 1, DType::F32, device)?;
    let (cos, sin) = tables(4, 8, DType::F32, device)?;
    let (c, s) = (cos.narrow(0, 0, 3)?, sin.narrow(0, 0, 3)?);
    let (gq, _) = rope::rope_qk(&q, &q, &rope::rope_table(&c, &s)?)?;
    let x = q.transpose(1, 2)?.contiguous()?;
    let rot_half = Tensor::cat(
        &[
            x.narrow(D::Minus1, 4, 4)?.neg()?,
            x.narrow(D::Minus1, 0, 4)?,
        ],
        D::Minus1,
    )?;
    let c2 = Tensor::cat(&[&c, &c], D::Minus1)?;
    let s2 = Tensor::cat(&[&s, &s], D::Minus1)?;
    let want = (x.broadcast_mul(&c2)? + rot_half.broadcast_mul(&s2)?)?;
    ensure_close("rope_qk vs rotate-half", &gq, &want, DType::F32)?;
    Ok(())
}
test_device!(
    rope_qk_matches_composition,
    ops_rope_qk_cpu,
    ops_rope_qk_gpu
);

/// (batch, new positions, q heads, kv heads, head_dim, rotated dims, position, cache size)
pub(crate) type RopeCacheCase = (usize, usize, usize, usize, usize, usize, usize, usize);

/// A RoPE/KV-cache case's operands from `seed`: q, k, v, the key and value caches, and the
/// whole RoPE table (64 positions).
pub(crate) fn rope_cache_operands(
    (b, t, hq, hk, d, rot, _pos, cap): RopeCacheCase,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> anyhow::Result<[Tensor; 6]> {
    let (cos, sin) = tables(rot / 2, 64, dtype, device)?;
    Ok([
        random(&[b, t, hq, d], 2.0, seed, dtype, device)?,
        random(&[b, t, hk, d], 2.0, seed + 1, dtype, device)?,
        random(&[b, t, hk, d], 2.0, seed + 2, dtype, device)?,
        random(&[b, hk, cap, d], 1.0, seed + 3, dtype, device)?,
        random(&[b, hk, cap, d], 1.0, seed + 4, dtype, device)?,
        rope::rope_table(&cos, &sin)?,
    ])
}

/// `rope_qk_cache` rotates q and k as `rope_qk` does and writes k and v into the caches' given
/// positions only: the positions before and after keep what they held, q comes back
/// (b, hq, t, d).
fn rope_qk_cache_writes_its_positions(device: &Device) -> anyhow::Result<()> {
    let cases: [RopeCacheCase; 3] = [
        (1, 1, 32, 8, 128, 128, 37, 40),
        (2, 3, 6, 2, 64, 64, 5, 8),
        (1, 2, 3, 3, 10, 6, 0, 2),
    ];
    for dtype in DTYPES {
        for (i, &case) in cases.iter().enumerate() {
            let (b, t, hq, _, d, _, pos, cap) = case;
            let [q, k, v, kc, vc, table] =
                rope_cache_operands(case, 700 + 10 * i as u64, dtype, device)?;
            let (k_before, v_before) = (kc.copy()?, vc.copy()?);
            let table = table.narrow(0, pos, t)?;
            let got_q = rope::rope_qk_cache(&q, &k, &v, &table, (&kc, &vc), pos, None)?;
            let (want_q, want_k) = rope::rope_qk_unfused(&q, &k, &table)?;
            let want_v = v.transpose(1, 2)?.contiguous()?;
            let what = format!("rope_qk_cache {:?}", cases[i]);
            anyhow::ensure!(
                got_q.dims() == [b, hq, t, d],
                "{what}: q {:?}",
                got_q.dims()
            );
            ensure_close(&format!("{what} q"), &got_q, &want_q, dtype)?;
            ensure_close(&format!("{what} k"), &kc.narrow(2, pos, t)?, &want_k, dtype)?;
            ensure_close(&format!("{what} v"), &vc.narrow(2, pos, t)?, &want_v, dtype)?;
            for (after, before, name) in [(&kc, &k_before, "k"), (&vc, &v_before, "v")] {
                let same = |a: usize, n: usize| -> anyhow::Result<bool> {
                    let diff = (after.narrow(2, a, n)? - before.narrow(2, a, n)?)?;
                    Ok(diff
                        .abs()?
                        .to_dtype(DType::F32)?
                        .max_all()?
                        .to_scalar::<f32>()?
                        == 0.0)
                };
                anyhow::ensure!(
                    pos == 0 || same(0, pos)?,
                    "{what}: {name} before pos changed"
                );
                let end = pos + t;
                anyhow::ensure!(
                    end == cap || same(end, cap - end)?,
                    "{what}: {name} after the new positions changed"
                );
            }
        }
    }
    // No room for the new positions: an error.
    let q = random(&[1, 2, 2, 8], 1.0, 1, DType::F32, device)?;
    let kc = Tensor::zeros((1, 2, 3, 8), DType::F32, device)?;
    let (cos, sin) = tables(4, 8, DType::F32, device)?;
    let table = rope::rope_table(&cos, &sin)?.narrow(0, 2, 2)?;
    anyhow::ensure!(rope::rope_qk_cache(&q, &q, &q, &table, (&kc, &kc.copy()?), 2, None).is_err());
    Ok(())
}
test_device!(
    rope_qk_cache_writes_its_positions,
    ops_rope_qk_cache_cpu,
    ops_rope_qk_cache_gpu
);

/// `rope_qk_cache` with a `QkNorm` (q's and k's per-head RMSNorms folded into the rotation, Qwen3's
/// `q_norm` and `k_norm`) equals the norms applied first and `rope_qk_cache` after, at a
/// position given on the host and at one held on the device: q, and the keys and values it
/// writes.
fn rope_qk_cache_normed_equals_norm_then_rope(device: &Device) -> anyhow::Result<()> {
    let cases: [RopeCacheCase; 3] = [
        (1, 1, 32, 4, 128, 128, 37, 40),
        (2, 3, 6, 2, 64, 64, 5, 8),
        (1, 1, 4, 2, 64, 32, 0, 2),
    ];
    for dtype in DTYPES {
        for (i, &case) in cases.iter().enumerate() {
            let (_, t, _, _, d, _, pos, _) = case;
            let seed = 900 + 10 * i as u64;
            let [q, k, v, kc, vc, table] = rope_cache_operands(case, seed, dtype, device)?;
            let qw = (random(&[d], 0.5, seed + 7, dtype, device)? + 1.0)?;
            let kw = (random(&[d], 0.5, seed + 8, dtype, device)? + 1.0)?;
            let norm = rope::QkNorm {
                q: &qw,
                k: &kw,
                eps: 1e-6,
            };
            let (want_kc, want_vc) = (kc.copy()?, vc.copy()?);
            let (qn, kn) = norm.apply(&q, &k)?;
            let rows = table.narrow(0, pos, t)?;
            let want_q = rope::rope_qk_cache(&qn, &kn, &v, &rows, (&want_kc, &want_vc), pos, None)?;
            let what = format!("rope_qk_cache normed {case:?} {dtype:?}");
            let (got_kc, got_vc) = (kc.copy()?, vc.copy()?);
            let got_q =
                rope::rope_qk_cache(&q, &k, &v, &rows, (&got_kc, &got_vc), pos, Some(norm))?;
            ensure_close(&format!("{what} q"), &got_q, &want_q, dtype)?;
            ensure_close(&format!("{what} k"), &got_kc, &want_kc, dtype)?;
            ensure_close(&format!("{what} v"), &got_vc, &want_vc, dtype)?;
            // The same at a position held on the device (the whole table).
            let at = Tensor::new(&[pos as u32], device)?;
            let (at_kc, at_vc) = (kc.copy()?, vc.copy()?);
            let at_q =
                rope::rope_qk_cache_at(&q, &k, &v, &table, (&at_kc, &at_vc), &at, Some(norm))?;
            ensure_close(&format!("{what} q at"), &at_q, &want_q, dtype)?;
            ensure_close(&format!("{what} k at"), &at_kc, &want_kc, dtype)?;
            ensure_close(&format!("{what} v at"), &at_vc, &want_vc, dtype)?;
        }
    }
    // Norm weights that are not a head wide: an error.
    let [q, k, v, kc, vc, table] =
        rope_cache_operands((1, 1, 4, 2, 64, 64, 0, 2), 1, DType::F32, device)?;
    let short = Tensor::ones(32, DType::F32, device)?;
    let norm = rope::QkNorm {
        q: &short,
        k: &short,
        eps: 1e-6,
    };
    anyhow::ensure!(rope::rope_qk_cache(
        &q,
        &k,
        &v,
        &table.narrow(0, 0, 1)?,
        (&kc, &vc),
        0,
        Some(norm)
    )
    .is_err());
    Ok(())
}
test_device!(
    rope_qk_cache_normed_equals_norm_then_rope,
    ops_rope_qk_cache_normed_cpu,
    ops_rope_qk_cache_normed_gpu
);
