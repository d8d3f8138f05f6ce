//! `kernels::linear::ExpertTable`: a decode row's experts chosen on the device against the
//! host's routing (`layers::route_row`) and the grouped kernels over the same experts
//! (`linear::qexperts_row`).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_offload::kernels::linear::routed::qtensor_addr;
use candle_offload::kernels::linear::{self, ExpertTable, RoutedShape};
use candle_offload::KernelTuning;
use candle_offload_models::layers::{route_row, Routing};

use rand::Rng as _;

use crate::ops::common::*;

/// `count` experts of random weights quantized on `device`: gate and up `(inter, hidden)` of
/// `gt`, down `(hidden, inter)` of `dt`, expert e's from seeds `seed + 3e` onwards.
fn random_experts(
    count: usize,
    (hidden, inter): (usize, usize),
    (gt, dt): (GgmlDType, GgmlDType),
    seed: u64,
    device: &Device,
) -> anyhow::Result<Vec<[QTensor; 3]>> {
    let q = |shape: &[usize], ty, s: u64| -> anyhow::Result<QTensor> {
        let v = random(
            shape,
            1.0 / (shape[1] as f32).sqrt(),
            s,
            DType::F32,
            &Device::Cpu,
        )?;
        Ok(QTensor::quantize_onto(&v, ty, device)?)
    };
    (0..count)
        .map(|e| {
            let s = seed + 3 * e as u64;
            Ok([
                q(&[inter, hidden], gt, s)?,
                q(&[inter, hidden], gt, s + 1)?,
                q(&[hidden, inter], dt, s + 2)?,
            ])
        })
        .collect()
}

/// 40 experts (not a multiple of the warp's 32) in two layers of a table, every expert's
/// entry its device blocks: for k of 1, 4 and 8, renormalised or not, and logits with an exact
/// tie at the top, the experts the device chose (read back) are `route_row`'s in expert
/// order, and the row's output is `qexperts_row`'s over them with `route_row`'s weights,
/// within the dtype's tolerance (the softmax's exponentials may differ in their last bit).
/// Q8_0 experts, and Q4_K gates and ups with Q6_K downs. On a CPU the table is refused.
fn expert_table_routes_as_route_row(device: &Device) -> anyhow::Result<()> {
    let (experts, hidden, inter) = (40usize, 256usize, 256usize);
    if !device.is_cuda() {
        anyhow::ensure!(
            ExpertTable::new(device, 2, experts).is_err(),
            "a table on {device:?}"
        );
        return Ok(());
    }
    let tun = KernelTuning::default();
    for (t, &(gt, dt)) in [
        (GgmlDType::Q8_0, GgmlDType::Q8_0),
        (GgmlDType::Q4K, GgmlDType::Q6K),
    ]
    .iter()
    .enumerate()
    {
        let weights = random_experts(
            experts,
            (hidden, inter),
            (gt, dt),
            9000 + 100 * t as u64,
            device,
        )?;
        let table = ExpertTable::new(device, 2, experts)?;
        let mut entries = Vec::new();
        for (e, [g, u, d]) in weights.iter().enumerate() {
            let addrs = [qtensor_addr(g)?, qtensor_addr(u)?, qtensor_addr(d)?];
            entries.push((0, e, addrs));
            entries.push((1, e, addrs));
        }
        table.set(&entries)?;
        for dtype in DTYPES {
            for (c, (k, renormalize)) in [(1, true), (4, false), (8, true), (8, false)]
                .into_iter()
                .enumerate()
            {
                let seed = 20 + 10 * t as u64 + c as u64;
                let x = random(&[1, 1, hidden], 1.0, seed, dtype, device)?;
                let mut logits: Vec<f32> =
                    random(&[experts], 2.0, seed + 5, DType::F32, &Device::Cpu)?.to_vec1()?;
                // An exact tie at the top: the lower index goes first.
                logits[29] = 3.0;
                logits[6] = 3.0;
                let shape = RoutedShape {
                    gate: gt,
                    down: dt,
                    hidden,
                    inter,
                    top_k: k,
                    renormalize,
                };
                let what = format!("{gt:?}/{dt:?} k {k} renormalize {renormalize} {dtype:?}");
                anyhow::ensure!(shape.fits(&x, &tun)?, "{what}: the kernels' fit");
                let layer = c % 2;
                let l = Tensor::new(logits.as_slice(), device)?.unsqueeze(0)?;
                let got = table.forward(layer, &x, &l, &shape)?;
                let chosen = table.chosen(layer, k)?;
                let mut want_routes = route_row(
                    &logits,
                    Routing {
                        experts,
                        top_k: k,
                        renormalize,
                    },
                );
                want_routes.sort_by_key(|&(e, _)| e);
                let ids: Vec<u32> = want_routes.iter().map(|&(e, _)| e as u32).collect();
                anyhow::ensure!(chosen == ids, "{what}: chose {chosen:?}, route_row {ids:?}");
                let experts_of: Vec<linear::QExpert<'_>> = want_routes
                    .iter()
                    .map(|&(e, w)| linear::QExpert {
                        gate: &weights[e][0],
                        up: &weights[e][1],
                        down: &weights[e][2],
                        weight: w,
                    })
                    .collect();
                let want = linear::qexperts_row(&x, &experts_of, &tun)?;
                anyhow::ensure!(got.dims() == x.dims() && got.dtype() == dtype, "{what}");
                ensure_close_values(&what, &got, &want, dtype)?;
            }
        }
    }
    Ok(())
}

test_device!(
    expert_table_routes_as_route_row,
    expert_table_routes_as_route_row_cpu,
    expert_table_routes_as_route_row_gpu
);

/// A prompt's rows sorted by expert (`linear::qexperts_rows`): 12 experts with 0 to 19 rows
/// each (chunks of 8 and their remainders, an expert without rows), against each row through
/// its expert alone (`qexperts_row` of weight 1), within the dtype's tolerance; and one
/// expert's 19 rows on their own (the launch without a table) as in the whole. Q8_0 experts,
/// and Q4_K gates and ups with Q6_K downs; x quantized by every block of threads and
/// (`experts_rows_x_once`) once for all rows. On a CPU the kernels take none.
fn qexperts_rows_match_each_row_alone(device: &Device) -> anyhow::Result<()> {
    for x_once in [false, true] {
        let mut tun = KernelTuning::default();
        tun.experts_rows_x_once = x_once;
        // Every expert through the grouped kernels (the cuBLAS path has a test of its own).
        tun.experts_gemm_min_rows = 0;
        qexperts_rows_match_each_row_alone_with(device, &tun)?;
    }
    Ok(())
}

fn qexperts_rows_match_each_row_alone_with(
    device: &Device,
    tun: &KernelTuning,
) -> anyhow::Result<()> {
    let (hidden, inter) = (256usize, 512usize);
    let rows_of = [3usize, 0, 8, 19, 1, 9, 16, 2, 7, 0, 5, 11];
    let x_once = tun.experts_rows_x_once;
    for (t, &(gt, dt)) in ROWS_TYPES.iter().enumerate() {
        let weights = random_experts(
            rows_of.len(),
            (hidden, inter),
            (gt, dt),
            7000 + 100 * t as u64,
            device,
        )?;
        let experts = expert_rows(&weights, &rows_of);
        let n: usize = rows_of.iter().sum();
        for dtype in DTYPES {
            let what = format!("qexperts_rows {gt:?}/{dt:?} {dtype:?}, x once {x_once}");
            let x = random(&[n, hidden], 1.0, 40 + t as u64, dtype, device)?;
            anyhow::ensure!(
                linear::qexperts_rows_fits(&x, &experts, tun)? == device.is_cuda(),
                "{what}: the kernels' fit on {device:?}"
            );
            if !device.is_cuda() {
                anyhow::ensure!(linear::qexperts_rows(&x, &experts, tun).is_err(), "{what}");
                continue;
            }
            let got = linear::qexperts_rows(&x, &experts, tun)?;
            anyhow::ensure!(got.dims() == [n, hidden] && got.dtype() == dtype, "{what}");
            let mut at = 0;
            for (e, &rows) in rows_of.iter().enumerate() {
                let one = [linear::QExpert {
                    gate: &weights[e][0],
                    up: &weights[e][1],
                    down: &weights[e][2],
                    weight: 1.0,
                }];
                for r in at..at + rows {
                    let want = linear::qexperts_row(&x.narrow(0, r, 1)?, &one, tun)?;
                    let row = got.narrow(0, r, 1)?;
                    ensure_close_values(&format!("{what} expert {e} row {r}"), &row, &want, dtype)?;
                }
                at += rows;
            }
            // One expert alone (its weights by value, nothing uploaded): the same rows.
            let first: usize = rows_of[..3].iter().sum();
            let alone = linear::qexperts_rows(&x.narrow(0, first, 19)?, &experts[3..4], tun)?;
            ensure_close_values(
                &format!("{what} expert 3 alone"),
                &alone,
                &got.narrow(0, first, 19)?,
                dtype,
            )?;
            // Rows that are not the experts' are refused.
            anyhow::ensure!(
                linear::qexperts_rows(&x.narrow(0, 0, n - 1)?, &experts, tun).is_err(),
                "{what}: one row short"
            );
        }
    }
    Ok(())
}

/// The (gate, up) and down block types the prompt-rows tests run: Q8_0's kernels, and the
/// K-quants' of Q4_K_M.
const ROWS_TYPES: [(GgmlDType, GgmlDType); 2] = [
    (GgmlDType::Q8_0, GgmlDType::Q8_0),
    (GgmlDType::Q4K, GgmlDType::Q6K),
];

/// Each expert of `weights` with its count of the sorted rows.
fn expert_rows<'a>(weights: &'a [[QTensor; 3]], rows_of: &[usize]) -> Vec<linear::QExpertRows<'a>> {
    weights
        .iter()
        .zip(rows_of)
        .map(|([g, u, d], &rows)| linear::QExpertRows {
            gate: g,
            up: u,
            down: d,
            rows,
        })
        .collect()
}

/// `qexperts_rows` with `experts_gemm_min_rows`: the experts with that many rows through 16-bit
/// weights and cuBLAS, within 1e-2 of their MLP in F32 over the dequantized weights; the others
/// bit for bit what the grouped kernels give with the switch off (one expert alone too).
fn qexperts_rows_gemm_matches_the_dequantized_mlp(device: &Device) -> anyhow::Result<()> {
    if !device.is_cuda() {
        return Ok(());
    }
    let (hidden, inter) = (256usize, 512usize);
    let rows_of = [70usize, 3, 0, 130, 9, 64];
    let heavy = |r: usize| r >= 64;
    for (t, &(gt, dt)) in ROWS_TYPES.iter().enumerate() {
        let weights = random_experts(
            rows_of.len(),
            (hidden, inter),
            (gt, dt),
            8000 + 100 * t as u64,
            device,
        )?;
        let experts = expert_rows(&weights, &rows_of);
        let n: usize = rows_of.iter().sum();
        for x_once in [false, true] {
            let mut on = KernelTuning::default();
            on.experts_rows_x_once = x_once;
            on.experts_gemm_min_rows = 64;
            let mut off = on;
            off.experts_gemm_min_rows = 0;
            for dtype in DTYPES {
                let what = format!("qexperts_rows gemm {gt:?}/{dt:?} {dtype:?}, x once {x_once}");
                let x = random(&[n, hidden], 1.0, 60 + t as u64, dtype, device)?;
                let got = linear::qexperts_rows(&x, &experts, &on)?;
                let kernels = linear::qexperts_rows(&x, &experts, &off)?;
                anyhow::ensure!(got.dims() == [n, hidden] && got.dtype() == dtype, "{what}");
                let mut at = 0;
                for (e, &rows) in rows_of.iter().enumerate() {
                    let (g, k) = (got.narrow(0, at, rows)?, kernels.narrow(0, at, rows)?);
                    if rows == 0 {
                        continue;
                    }
                    if heavy(rows) {
                        let [wg, wu, wd] = &weights[e];
                        let f = |w: &QTensor| -> anyhow::Result<Tensor> {
                            Ok(w.dequantize(&Device::Cpu)?.to_device(&Device::Cpu)?)
                        };
                        let xe = x
                            .narrow(0, at, rows)?
                            .to_dtype(DType::F32)?
                            .to_device(&Device::Cpu)?;
                        let gate = xe.matmul(&f(wg)?.t()?)?;
                        let up = xe.matmul(&f(wu)?.t()?)?;
                        let act = (candle_nn::ops::silu(&gate)? * up)?;
                        let want = act.matmul(&f(wd)?.t()?)?;
                        let d = rel_diff_values(&g, &want)?;
                        anyhow::ensure!(d <= 1e-2, "{what} expert {e} ({rows} rows): {d:e}");
                    } else {
                        let d = rel_diff_values(&g, &k)?;
                        anyhow::ensure!(d == 0.0, "{what} expert {e} ({rows} rows): {d:e}");
                    }
                    at += rows;
                }
                // One expert alone, through cuBLAS: the same rows.
                let first: usize = rows_of[..3].iter().sum();
                let alone = linear::qexperts_rows(&x.narrow(0, first, 130)?, &experts[3..4], &on)?;
                let d = rel_diff_values(&alone, &got.narrow(0, first, 130)?)?;
                anyhow::ensure!(d == 0.0, "{what}: expert 3 alone {d:e}");
            }
        }
    }
    Ok(())
}

test_device!(
    qexperts_rows_gemm_matches_the_dequantized_mlp,
    qexperts_rows_gemm_matches_the_dequantized_mlp_cpu,
    qexperts_rows_gemm_matches_the_dequantized_mlp_gpu
);

/// `qexperts_rows`' cuBLAS experts wider than one scratch slice of
/// `gemm::PREFILL_GEMM_SLICE_BYTES`: gate and up (8448 × 2048) in three slices, down (2048 ×
/// 8448) in two, within 1e-2 of the MLP in F32 over the dequantized weights, for each dtype;
/// the rows of the grouped expert beside it untouched by the slices.
fn qexperts_rows_gemm_slices_wide_experts(device: &Device) -> anyhow::Result<()> {
    if !device.is_cuda() {
        return Ok(());
    }
    let (hidden, inter) = (2048usize, 8448usize);
    let weights = random_experts(
        2,
        (hidden, inter),
        (GgmlDType::Q8_0, GgmlDType::Q8_0),
        9100,
        device,
    )?;
    let rows_of = [5usize, 80];
    let experts = expert_rows(&weights, &rows_of);
    let mut on = KernelTuning::default();
    on.experts_gemm_min_rows = 64;
    let mut off = on;
    off.experts_gemm_min_rows = 0;
    let f = |w: &QTensor| -> anyhow::Result<Tensor> { Ok(w.dequantize(device)?) };
    let [wg, wu, wd] = &weights[1];
    for dtype in DTYPES {
        let x = random(&[85, hidden], 1.0, 95, dtype, device)?;
        let got = linear::qexperts_rows(&x, &experts, &on)?;
        let kernels = linear::qexperts_rows(&x, &experts, &off)?;
        let d = rel_diff_values(&got.narrow(0, 0, 5)?, &kernels.narrow(0, 0, 5)?)?;
        anyhow::ensure!(d == 0.0, "{dtype:?}: the grouped expert's rows {d:e}");
        let xe = x.narrow(0, 5, 80)?.to_dtype(DType::F32)?;
        let gate = xe.matmul(&f(wg)?.t()?)?;
        let up = xe.matmul(&f(wu)?.t()?)?;
        let want = (candle_nn::ops::silu(&gate)? * up)?.matmul(&f(wd)?.t()?)?;
        let d = rel_diff_values(&got.narrow(0, 5, 80)?, &want)?;
        anyhow::ensure!(d <= 1e-2, "{dtype:?}: the wide expert's rows {d:e}");
    }
    Ok(())
}

test_device!(
    qexperts_rows_gemm_slices_wide_experts,
    qexperts_rows_gemm_slices_wide_experts_cpu,
    qexperts_rows_gemm_slices_wide_experts_gpu
);

/// `linear::combine_rows` (a prompt's expert outputs summed back into their rows): against the
/// sum written out in F32 on the host, for each dtype, rows with every slot, some, and none
/// (`NO_SLOT`); a slot past y's rows and tables of another length refused.
fn combine_rows_match_the_sum(device: &Device) -> anyhow::Result<()> {
    let (copies, hidden, k) = (23usize, 77usize, 3usize);
    let rows = 9;
    let mut rng = candle_offload_suite::rng(91);
    let mut slots = Vec::new();
    let mut weights = Vec::new();
    for t in 0..rows {
        for j in 0..k {
            // Row 4 has no copy; rows 1 and 7 one fewer than k.
            let none = t == 4 || (j == k - 1 && (t == 1 || t == 7));
            slots.push(if none {
                linear::NO_SLOT
            } else {
                rng.random_range(0..copies as u32)
            });
            weights.push(rng.random_range(-1.0f32..1.0));
        }
    }
    for dtype in DTYPES {
        let what = format!("combine_rows {dtype:?}");
        let y = random(&[copies, hidden], 1.0, 17, dtype, device)?;
        let got = linear::combine_rows(&y, &slots, &weights, k)?;
        anyhow::ensure!(
            got.dims() == [rows, hidden] && got.dtype() == dtype,
            "{what}"
        );
        let yv = y
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec2::<f32>()?;
        let mut want = vec![0f32; rows * hidden];
        for t in 0..rows {
            for j in 0..k {
                let s = slots[t * k + j];
                if s == linear::NO_SLOT {
                    continue;
                }
                for c in 0..hidden {
                    want[t * hidden + c] += weights[t * k + j] * yv[s as usize][c];
                }
            }
        }
        let want = Tensor::from_vec(want, (rows, hidden), &Device::Cpu)?;
        ensure_close_values(&what, &got, &want, dtype)?;
        let empty = got
            .narrow(0, 4, 1)?
            .abs()?
            .sum_all()?
            .to_dtype(DType::F32)?;
        anyhow::ensure!(
            empty.to_scalar::<f32>()? == 0.0,
            "{what}: a row without copies"
        );
    }
    let y = random(&[copies, hidden], 1.0, 17, DType::F32, device)?;
    let mut past = slots.clone();
    past[5] = copies as u32;
    anyhow::ensure!(
        linear::combine_rows(&y, &past, &weights, k).is_err(),
        "a slot past y"
    );
    anyhow::ensure!(
        linear::combine_rows(&y, &slots[1..], &weights[1..], k).is_err(),
        "a table of rows·k + 2 entries"
    );
    anyhow::ensure!(
        linear::combine_rows(&y, &slots, &weights[1..], k).is_err(),
        "short weights"
    );
    Ok(())
}

test_device!(
    combine_rows_match_the_sum,
    combine_rows_match_the_sum_cpu,
    combine_rows_match_the_sum_gpu
);

test_device!(
    qexperts_rows_match_each_row_alone,
    qexperts_rows_match_each_row_alone_cpu,
    qexperts_rows_match_each_row_alone_gpu
);
