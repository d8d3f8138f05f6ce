//! `kernels::activation::silu_mul` against its composition.

use candle_core::{Device, D};
use candle_offload::kernels::activation;

use crate::ops::common::*;

fn silu_mul_matches_composition(device: &Device) -> anyhow::Result<()> {
    for dtype in DTYPES {
        for (i, shape) in ROW_SHAPES.iter().enumerate() {
            let seed = 100 + 10 * i as u64;
            let gate = random(shape, 6.0, seed, dtype, device)?;
            let up = random(shape, 2.0, seed + 1, dtype, device)?;
            let got = activation::silu_mul(&gate, &up)?;
            let want = activation::silu_mul_unfused(&gate, &up)?;
            ensure_close(&format!("silu_mul {shape:?}"), &got, &want, dtype)?;
        }
        // Halves of one fused gate/up projection (narrowed views).
        let both = random(&[3, 2 * 11], 4.0, 5, dtype, device)?;
        let (g, u) = (
            both.narrow(D::Minus1, 0, 11)?,
            both.narrow(D::Minus1, 11, 11)?,
        );
        let got = activation::silu_mul(&g, &u)?;
        ensure_close(
            "silu_mul halves",
            &got,
            &activation::silu_mul_unfused(&g, &u)?,
            dtype,
        )?;
    }
    Ok(())
}
test_device!(
    silu_mul_matches_composition,
    ops_silu_mul_cpu,
    ops_silu_mul_gpu
);
