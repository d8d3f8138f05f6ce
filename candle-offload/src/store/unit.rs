//! [`HostUnit`]: one unit's tensors and the storage tier its bytes live in, read out as raw
//! bytes, CPU tensors or quantized tensors, and rewritten in place by a training step.

use std::sync::{RwLock, RwLockReadGuard};

use candle_core::quantized::{QStorage, QTensor};
use candle_core::{CpuStorage, DType, Device, Tensor};

use super::convert::tensor_to_bytes;
use super::format::WeightFormat;
use super::layout::TensorMeta;
use crate::sys::{HostTier, TierKind};

/// One unit: its tensors' layout and its host buffer.
#[derive(Debug)]
pub struct HostUnit {
    pub(super) name: String,
    pub(super) layer: Option<usize>,
    pub(super) tensors: Vec<TensorMeta>,
    pub(super) bytes: u64,
    pub(super) own_bytes: u64,
    /// Where its bytes live. Written only by
    /// [`OffloadRuntime::update_weights`](crate::OffloadRuntime::update_weights), after it has
    /// waited for every copy out of it.
    pub(super) buf: RwLock<Box<dyn HostTier>>,
}

/// The bytes of one tensor of a unit: borrowed from host memory (the buffer cannot be
/// rewritten while this lives), or read out of a tier that has no such memory.
pub struct HostBytes<'a>(HostBytesInner<'a>);

enum HostBytesInner<'a> {
    Borrowed {
        guard: RwLockReadGuard<'a, Box<dyn HostTier>>,
        range: std::ops::Range<usize>,
    },
    Read(Vec<u8>),
}

impl std::ops::Deref for HostBytes<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            HostBytesInner::Borrowed { guard, range } => {
                &guard.bytes().expect("checked when made")[range.clone()]
            }
            HostBytesInner::Read(v) => v,
        }
    }
}

impl std::fmt::Debug for HostBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBytes({} bytes)", self.len())
    }
}

impl HostUnit {
    /// The unit's name (`model.layers.7`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layer index for units made by a layer prefix.
    pub fn layer(&self) -> Option<usize> {
        self.layer
    }

    /// Its tensors, in load order.
    pub fn tensors(&self) -> &[TensorMeta] {
        &self.tensors
    }

    /// Bytes it takes on the device (the sum of its tensors' device bytes; for a unit in
    /// managed memory, rounded up to the 2 MiB granules its pages take there).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes it takes on the device when it stays there for good: [`bytes`](Self::bytes)
    /// without the padding that evens out the layers of mixed block types for streaming
    /// (their tensors' [`TensorMeta::own_device_bytes`]). A runtime gives a unit this size
    /// when it never replaces it.
    pub fn resident_bytes(&self) -> u64 {
        self.own_bytes
    }

    /// Whether its host buffer is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.tier() == TierKind::Pinned
    }

    /// The storage tier its bytes live in.
    pub fn tier(&self) -> TierKind {
        self.buffer().kind()
    }

    /// Whether any of its tensors is in a GGML quantized format.
    pub fn has_quantized(&self) -> bool {
        self.tensors.iter().any(|t| t.format.is_quantized())
    }

    /// Its storage tier, read-locked: the copy engines read through this while they enqueue
    /// copies, so that `update_weights` cannot rewrite the bytes meanwhile.
    pub(crate) fn buffer(&self) -> RwLockReadGuard<'_, Box<dyn HostTier>> {
        // A writer that panicked left whole tensors behind (it copies tensor by tensor), so the
        // data is still well-formed.
        self.buf.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Host buffer length in bytes (tensors plus alignment padding).
    pub(super) fn buffer_len(&self) -> usize {
        self.buffer().len()
    }

    /// Bytes of its host layout (tensors plus alignment padding, in the store's formats): what
    /// it takes in host memory, or for a disk unit what a fetch reads into memory (the file
    /// bytes differ where a read converts, e.g. F32 to F16).
    pub fn host_bytes(&self) -> u64 {
        self.buffer_len() as u64
    }

    /// The raw bytes of one of its tensors (in its [`WeightFormat`]).
    pub fn tensor_bytes(&self, t: &TensorMeta) -> HostBytes<'_> {
        let range = t.offset..t.offset + t.nbytes;
        let guard = self.buffer();
        if guard.bytes().is_some() {
            return HostBytes(HostBytesInner::Borrowed { guard, range });
        }
        let mut v = vec![0u8; t.nbytes];
        if let Err(e) = guard.read_into(range, &mut v) {
            // Only a tier without host memory (the disk) can fail here.
            tracing::error!(tensor = %t.name, error = %e, "reading a tensor from its tier failed");
            v.clear();
        }
        HostBytes(HostBytesInner::Read(v))
    }

    /// [`tensor_bytes`](Self::tensor_bytes), failing when its tier could not hand over all of
    /// them.
    fn whole_tensor_bytes(&self, t: &TensorMeta) -> candle_core::Result<HostBytes<'_>> {
        let range = t.offset..t.offset + t.nbytes;
        let guard = self.buffer();
        if guard.bytes().is_some() {
            return Ok(HostBytes(HostBytesInner::Borrowed { guard, range }));
        }
        let mut v = vec![0u8; t.nbytes];
        guard
            .read_into(range, &mut v)
            .map_err(|e| candle_core::Error::Msg(format!("tensor {}: {e}", t.name)))?;
        Ok(HostBytes(HostBytesInner::Read(v)))
    }

    /// A CPU copy of one of its dense tensors; a GGML tensor is refused (see
    /// [`cpu_qtensor`](Self::cpu_qtensor)).
    pub fn cpu_tensor(&self, t: &TensorMeta) -> candle_core::Result<Tensor> {
        let WeightFormat::Dense(dtype) = t.format else {
            candle_core::bail!(
                "tensor {} holds {} blocks, not a dense tensor: read it with cpu_qtensor (or \
                 UnitGuard::get_quantized)",
                t.name,
                t.format
            );
        };
        let bytes = self.whole_tensor_bytes(t)?;
        Tensor::from_raw_buffer(&bytes, dtype, t.shape.dims(), &Device::Cpu)
    }

    /// A CPU `QTensor` over a copy of one of its GGML tensors' blocks; a dense tensor is
    /// refused (see [`cpu_tensor`](Self::cpu_tensor)).
    pub fn cpu_qtensor(&self, t: &TensorMeta) -> candle_core::Result<QTensor> {
        let WeightFormat::Ggml(ggml) = t.format else {
            candle_core::bail!(
                "tensor {} is dense ({}), not GGML blocks: read it with cpu_tensor (or \
                 UnitGuard::get)",
                t.name,
                t.format
            );
        };
        let bytes = self.whole_tensor_bytes(t)?;
        // `from_data` reinterprets the bytes as blocks, which needs them aligned for the block
        // type: tiers start their buffers at `sys::TIER_ALIGN` and tensors sit at
        // TENSOR_ALIGN offsets, so this holds; it is checked rather than assumed.
        // No GGML block or element type needs more than 8.
        if !(bytes.as_ptr() as usize).is_multiple_of(8) {
            candle_core::bail!(
                "tensor {}: its bytes are not aligned for {} blocks",
                t.name,
                t.format
            );
        }
        let storage = QStorage::from_data(std::borrow::Cow::Borrowed(&bytes), &Device::Cpu, ggml)?;
        QTensor::new(storage, t.shape.clone())
    }

    /// Overwrites tensors of this unit with new values (any float dtype, converted to the
    /// stored one; the shape must match). The caller guarantees that no copy out of the buffer
    /// is in flight.
    pub(crate) fn write(&self, values: &[(&TensorMeta, &Tensor)]) -> candle_core::Result<()> {
        // Every value is checked before any byte is written: a bad one changes nothing.
        let mut dense = Vec::with_capacity(values.len());
        for (meta, value) in values {
            let WeightFormat::Dense(dtype) = meta.format else {
                candle_core::bail!(
                    "cannot update {}: it holds {} blocks, and quantized weights are not rewritten",
                    meta.name,
                    meta.format
                );
            };
            if value.dims() != meta.shape.dims() {
                candle_core::bail!(
                    "cannot update {}: shape {:?}, the store holds {:?}",
                    meta.name,
                    value.dims(),
                    meta.shape.dims()
                );
            }
            dense.push((meta, dtype, value.to_device(&Device::Cpu)?));
        }
        let mut buf = self.buf.write().unwrap_or_else(|e| e.into_inner());
        let kind = buf.kind();
        let Some(bytes) = buf.bytes_mut() else {
            candle_core::bail!(
                "cannot update unit {}: its {kind} storage is read-only",
                self.name
            );
        };
        for (meta, dtype, value) in dense {
            let len = meta.shape.elem_count() * dtype.size_in_bytes();
            encode_into(&value, dtype, &mut bytes[meta.offset..meta.offset + len])?;
        }
        Ok(())
    }
}

/// Elements per task of [`encode_into`]'s parallel conversion.
const ENCODE_CHUNK: usize = 1 << 18;

/// Writes `value` (on the CPU, `dst.len()` bytes in `dtype`) into `dst` as `dtype`'s
/// little-endian bytes. An F32 value (an optimizer's master) goes straight from its storage
/// into `dst`, converted on every core; anything else through a converted copy.
fn encode_into(value: &Tensor, dtype: DType, dst: &mut [u8]) -> candle_core::Result<()> {
    use rayon::prelude::*;
    if value.dtype() == DType::F32 && matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        let (storage, layout) = value.storage_and_layout();
        if let (candle_core::Storage::Cpu(CpuStorage::F32(all)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            let src = &all[a..b];
            let width = dtype.size_in_bytes();
            if src.len() * width != dst.len() {
                candle_core::bail!("{} values for {} bytes of {dtype:?}", src.len(), dst.len());
            }
            dst.par_chunks_mut(ENCODE_CHUNK * width)
                .zip(src.par_chunks(ENCODE_CHUNK))
                .for_each(|(d, s)| match dtype {
                    DType::F16 => {
                        for (d, v) in d.chunks_exact_mut(2).zip(s) {
                            d.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
                        }
                    }
                    DType::BF16 => {
                        for (d, v) in d.chunks_exact_mut(2).zip(s) {
                            d.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
                        }
                    }
                    _ => {
                        for (d, v) in d.chunks_exact_mut(4).zip(s) {
                            d.copy_from_slice(&v.to_le_bytes());
                        }
                    }
                });
            return Ok(());
        }
    }
    let data = tensor_to_bytes(&value.to_dtype(dtype)?)?;
    if data.len() != dst.len() {
        candle_core::bail!("{} bytes for a place of {}", data.len(), dst.len());
    }
    dst.copy_from_slice(&data);
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::Shape;

    use super::*;
    /// F32 values written into F32, F16 and BF16 places give the bytes of `to_dtype`, over
    /// more than one task's chunk; a strided or other-dtype value too; a wrong length is an
    /// error.
    #[test]
    fn encode_into_matches_to_dtype() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let n = ENCODE_CHUNK + 19;
        let v = Tensor::randn(0f32, 1., (2, n), &dev)?;
        let strided = Tensor::randn(0f32, 1., (n, 2), &dev)?.t()?;
        for value in [&v, &strided, &v.to_dtype(DType::F16)?] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let want = tensor_to_bytes(&value.to_dtype(dtype)?)?;
                let mut got = vec![0u8; want.len()];
                encode_into(value, dtype, &mut got)?;
                assert!(got == want, "{:?} into {dtype:?}", value.dtype());
                assert!(encode_into(value, dtype, &mut got[1..]).is_err());
            }
        }
        Ok(())
    }

    /// A tier with no host bytes (like a file on disk): everything goes through `read_into`.
    #[derive(Debug)]
    struct ReadOnlyTier(Vec<u8>);

    impl HostTier for ReadOnlyTier {
        fn kind(&self) -> TierKind {
            TierKind::Pageable
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn bytes(&self) -> Option<&[u8]> {
            None
        }
        fn bytes_mut(&mut self) -> Option<&mut [u8]> {
            None
        }
        fn read_into(&self, range: std::ops::Range<usize>, dst: &mut [u8]) -> std::io::Result<()> {
            dst.copy_from_slice(&self.0[range]);
            Ok(())
        }
    }

    #[test]
    fn units_use_their_tier_only_through_its_interface() -> anyhow::Result<()> {
        let values = [1.5f32, -2.0, 4.0];
        let data: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        let meta = TensorMeta {
            name: "w".into(),
            format: WeightFormat::Dense(DType::F32),
            dtype: DType::F32,
            shape: Shape::from(3),
            offset: 0,
            nbytes: 12,
            device_bytes: 12,
            own_device_bytes: 12,
        };
        let unit = HostUnit {
            name: "u".into(),
            layer: None,
            tensors: vec![meta.clone()],
            bytes: 12,
            own_bytes: 12,
            buf: RwLock::new(Box::new(ReadOnlyTier(data.clone()))),
        };
        assert_eq!(&*unit.tensor_bytes(&meta), &data[..]);
        assert_eq!(unit.cpu_tensor(&meta)?.to_vec1::<f32>()?, values);
        assert!(!unit.is_pinned());
        let new = Tensor::new(&[0f32, 0., 0.], &Device::Cpu)?;
        let err = unit.write(&[(&meta, &new)]).unwrap_err().to_string();
        assert!(err.contains("read-only"), "{err}");
        Ok(())
    }
}
