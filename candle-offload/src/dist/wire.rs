//! Tensors as bytes on the wire: a small header (dtype, shape) and the elements in
//! little-endian order, bit for bit; and back, onto any device.

use candle_core::{DType, Device, Tensor};

use super::error::DistError;

/// The dtypes a tensor may be sent in.
const DTYPES: [DType; 7] = [
    DType::U8,
    DType::U32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

/// `t`'s header: its dtype and shape; `to` names the peer in errors.
pub(super) fn encode_head(t: &Tensor, to: usize) -> Result<Vec<u8>, DistError> {
    let code = DTYPES
        .iter()
        .position(|&d| d == t.dtype())
        .ok_or_else(|| DistError::Tensor {
            rank: to,
            reason: format!("dtype {:?} cannot be sent", t.dtype()),
        })?;
    let dims = t.dims();
    let mut head = vec![code as u8, dims.len() as u8];
    for &d in dims {
        head.extend((d as u64).to_le_bytes());
    }
    Ok(head)
}

/// `t`'s header and its elements' bytes (copied to the host when `t` is on a device); `to`
/// names the peer in errors.
pub(super) fn encode(t: &Tensor, to: usize) -> Result<(Vec<u8>, Vec<u8>), DistError> {
    let err = |reason: String| DistError::Tensor { rank: to, reason };
    let head = encode_head(t, to)?;
    let flat = t
        .flatten_all()
        .and_then(|f| f.to_device(&Device::Cpu))
        .map_err(|e| err(e.to_string()))?;
    let c = |e: candle_core::Error| err(e.to_string());
    let bytes = match t.dtype() {
        DType::U8 => flat.to_vec1::<u8>().map_err(c)?,
        DType::U32 => le(flat.to_vec1::<u32>().map_err(c)?, u32::to_le_bytes),
        DType::I64 => le(flat.to_vec1::<i64>().map_err(c)?, i64::to_le_bytes),
        DType::BF16 => le(flat.to_vec1::<half::bf16>().map_err(c)?, |x| {
            x.to_bits().to_le_bytes()
        }),
        DType::F16 => le(flat.to_vec1::<half::f16>().map_err(c)?, |x| {
            x.to_bits().to_le_bytes()
        }),
        DType::F32 => le(flat.to_vec1::<f32>().map_err(c)?, f32::to_le_bytes),
        DType::F64 => le(flat.to_vec1::<f64>().map_err(c)?, f64::to_le_bytes),
        other => return Err(err(format!("dtype {other:?} cannot be sent"))),
    };
    Ok((head, bytes))
}

fn le<T: Copy, const N: usize>(v: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * N);
    for x in v {
        out.extend(f(x));
    }
    out
}

/// A header's dtype and shape, and the bytes after it; `from` names the peer.
pub(super) fn decode_head(
    frame: &[u8],
    from: usize,
) -> Result<(DType, Vec<usize>, &[u8]), DistError> {
    let err = |reason: String| DistError::Tensor { rank: from, reason };
    let (&code, rest) = frame
        .split_first()
        .ok_or_else(|| err("an empty tensor frame".into()))?;
    let dtype = *DTYPES
        .get(code as usize)
        .ok_or_else(|| err(format!("unknown dtype code {code}")))?;
    let (&rank, mut rest) = rest
        .split_first()
        .ok_or_else(|| err("a tensor frame without its rank".into()))?;
    let mut dims = Vec::with_capacity(rank as usize);
    for _ in 0..rank {
        if rest.len() < 8 {
            return Err(err("a tensor frame cut inside its shape".into()));
        }
        let (d, r) = rest.split_at(8);
        dims.push(u64::from_le_bytes(d.try_into().unwrap_or_default()) as usize);
        rest = r;
    }
    Ok((dtype, dims, rest))
}

/// The tensor a frame holds (`header` then bytes), on `device`; `from` names the peer.
pub(super) fn decode(frame: &[u8], device: &Device, from: usize) -> Result<Tensor, DistError> {
    let err = |reason: String| DistError::Tensor { rank: from, reason };
    let (dtype, dims, rest) = decode_head(frame, from)?;
    let want = dims
        .iter()
        .try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d));
    if want != Some(rest.len()) {
        return Err(err(format!(
            "a {dtype:?} tensor of shape {dims:?} with {} bytes",
            rest.len()
        )));
    }
    Tensor::from_raw_buffer(rest, dtype, &dims, device).map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_bit_for_bit() {
        let dev = Device::Cpu;
        let base = Tensor::arange(0f32, 24., &dev)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        // NaN, infinities, negative zero and subnormals travel as they are.
        let odd = Tensor::new(
            &[
                f32::NAN,
                f32::INFINITY,
                -0.0,
                f32::MIN_POSITIVE / 4.0,
                1e-40,
                -3.5,
            ],
            &dev,
        )
        .unwrap();
        for dtype in DTYPES {
            for t in [&base, &odd] {
                let t = t.to_dtype(dtype).unwrap();
                let (head, bytes) = encode(&t, 1).unwrap();
                let back = decode(&[head, bytes.clone()].concat(), &dev, 1).unwrap();
                assert_eq!(back.dims(), t.dims(), "{dtype:?}");
                assert_eq!(back.dtype(), dtype);
                assert_eq!(encode(&back, 1).unwrap().1, bytes, "{dtype:?}");
            }
        }
        // A scalar and an empty tensor.
        for t in [
            Tensor::new(7u32, &dev).unwrap(),
            Tensor::zeros((0, 5), DType::F16, &dev).unwrap(),
        ] {
            let (head, bytes) = encode(&t, 0).unwrap();
            let back = decode(&[head, bytes].concat(), &dev, 0).unwrap();
            assert_eq!(back.dims(), t.dims());
        }
    }

    #[test]
    fn a_frame_of_the_wrong_size_is_refused() {
        let t = Tensor::ones((2, 2), DType::F32, &Device::Cpu).unwrap();
        let (head, bytes) = encode(&t, 3).unwrap();
        let e = decode(&[head, bytes[..12].to_vec()].concat(), &Device::Cpu, 3).unwrap_err();
        assert_eq!(e.peer(), Some(3));
        assert!(e.to_string().contains("12 bytes"), "{e}");
        assert!(decode(&[42], &Device::Cpu, 3).is_err());
    }
}
