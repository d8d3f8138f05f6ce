//! Bytes of tensors: a CPU tensor's little-endian bytes ([`tensor_to_bytes`]) and float
//! conversions between dtypes' bytes ([`convert_into`]), as the store lays them out.

use candle_core::{DType, Tensor};

/// Little-endian bytes of a CPU tensor, flattened (the layout the store and safetensors use).
pub fn tensor_to_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U8 => t.to_vec1::<u8>()?,
        DType::U32 => t
            .to_vec1::<u32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::I64 => t
            .to_vec1::<i64>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F32 => t
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F64 => t
            .to_vec1::<f64>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        other => candle_core::bail!("dtype {other:?} is not supported by the host store"),
    })
}

fn read_float(src: &[u8], dtype: DType, i: usize) -> f64 {
    match dtype {
        DType::F16 => half::f16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f64(),
        DType::F32 => f32::from_le_bytes(src[4 * i..4 * i + 4].try_into().expect("4 bytes")) as f64,
        DType::F64 => f64::from_le_bytes(src[8 * i..8 * i + 8].try_into().expect("8 bytes")),
        _ => unreachable!("read_float on a non-float dtype"),
    }
}

/// Copies `src` (of `from`) into `dst` (of `to`), converting floats; sizes are checked.
pub(super) fn convert_into(
    src: &[u8],
    from: DType,
    dst: &mut [u8],
    to: DType,
) -> std::result::Result<(), String> {
    let n = dst.len() / to.size_in_bytes();
    if src.len() != n * from.size_in_bytes() {
        return Err(format!(
            "holds {} bytes, but its shape and dtype {from:?} need {}",
            src.len(),
            n * from.size_in_bytes()
        ));
    }
    if from == to {
        dst.copy_from_slice(src);
        return Ok(());
    }
    if !(from.is_float() && to.is_float()) {
        return Err(format!("cannot convert {from:?} to {to:?}"));
    }
    let width = to.size_in_bytes();
    for i in 0..n {
        let x = read_float(src, from, i);
        let out = &mut dst[i * width..(i + 1) * width];
        match to {
            DType::F16 => out.copy_from_slice(&half::f16::from_f64(x).to_le_bytes()),
            DType::BF16 => out.copy_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
            DType::F32 => out.copy_from_slice(&(x as f32).to_le_bytes()),
            DType::F64 => out.copy_from_slice(&x.to_le_bytes()),
            other => return Err(format!("cannot convert to {other:?}")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn converts_floats_and_checks_sizes() {
        let src: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let mut dst = vec![0u8; 4];
        convert_into(&src, DType::F32, &mut dst, DType::F16).unwrap();
        assert_eq!(half::f16::from_le_bytes([dst[0], dst[1]]).to_f32(), 1.5);
        assert_eq!(half::f16::from_le_bytes([dst[2], dst[3]]).to_f32(), -2.0);
        let mut short = vec![0u8; 6];
        assert!(convert_into(&src, DType::F32, &mut short, DType::F16).is_err());
    }
}
