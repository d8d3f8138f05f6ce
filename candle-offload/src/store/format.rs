//! [`WeightFormat`]: how a tensor's bytes are laid out (a dense dtype or GGML blocks), and the
//! host and device sizes that follow from it.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Shape};

use crate::sys;

/// How a tensor's bytes are laid out: the data the store and the copy engines carry with
/// each tensor, instead of assuming a Candle dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WeightFormat {
    /// A Candle dtype, little-endian, row-major: fetched as a `Tensor`.
    Dense(DType),
    /// GGML blocks of this type, as a GGUF file holds them: fetched as a `QTensor`.
    Ggml(GgmlDType),
}

impl WeightFormat {
    /// How a GGUF file holds a tensor of GGML type `t`: F32, F16 and BF16 as dense floats,
    /// every other type as its blocks.
    pub fn in_gguf(t: GgmlDType) -> Self {
        match t {
            GgmlDType::F32 => Self::Dense(DType::F32),
            GgmlDType::F16 => Self::Dense(DType::F16),
            GgmlDType::BF16 => Self::Dense(DType::BF16),
            q => Self::Ggml(q),
        }
    }

    /// Elements per block (1 for a dense dtype).
    pub fn block_elems(&self) -> usize {
        match self {
            Self::Dense(_) => 1,
            Self::Ggml(g) => g.block_size(),
        }
    }

    /// Bytes per block (the dtype's size for a dense dtype).
    pub fn block_bytes(&self) -> usize {
        match self {
            Self::Dense(d) => d.size_in_bytes(),
            Self::Ggml(g) => g.type_size(),
        }
    }

    /// Whether this is a GGML quantized format.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Self::Ggml(_))
    }

    /// The dtype of a dense format.
    pub fn dense_dtype(&self) -> Option<DType> {
        match self {
            Self::Dense(d) => Some(*d),
            Self::Ggml(_) => None,
        }
    }

    /// The GGML type of a quantized format.
    pub fn ggml_dtype(&self) -> Option<GgmlDType> {
        match self {
            Self::Dense(_) => None,
            Self::Ggml(g) => Some(*g),
        }
    }

    /// Whether this is a GGML type that Candle 0.11's quantized matmul multiplies as it is on
    /// every backend (the CPU's kernels and CUDA's mmvq/mmq): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
    /// Q2_K–Q6_K. Q8_1 and Q8_K (llama.cpp's activation formats) have CPU kernels only, and
    /// GGML F32/F16/BF16 are dense: loaders dequantize those instead of keeping their blocks.
    pub fn has_quantized_matmul(&self) -> bool {
        use GgmlDType as G;
        matches!(
            self,
            Self::Ggml(
                G::Q4_0
                    | G::Q4_1
                    | G::Q5_0
                    | G::Q5_1
                    | G::Q8_0
                    | G::Q2K
                    | G::Q3K
                    | G::Q4K
                    | G::Q5K
                    | G::Q6K
            )
        )
    }

    /// The Candle dtype of the values: a dense format's dtype, F32 for GGML blocks (what
    /// Candle dequantizes them to).
    pub fn value_dtype(&self) -> DType {
        self.dense_dtype().unwrap_or(DType::F32)
    }

    /// Host bytes of `shape` in this format; an error when a GGML tensor's rows are not whole
    /// blocks (Candle's quantized storage needs whole blocks per row).
    pub fn host_bytes(&self, shape: &Shape) -> std::result::Result<usize, String> {
        let elems = shape.elem_count();
        let block = self.block_elems();
        if let Self::Ggml(g) = self {
            let row = shape.dims().last().copied().unwrap_or(1);
            if row % block != 0 {
                return Err(format!(
                    "shape {:?} does not fit {g:?}: its rows of {row} elements are not whole \
                     blocks of {block}",
                    shape.dims()
                ));
            }
        }
        Ok(elems / block * self.block_bytes())
    }

    /// Bytes the tensor takes on the device, which the budget counts: the host bytes, plus
    /// for GGML blocks the zeroed padding Candle's CUDA quantized storage allocates after them
    /// (512 elements' worth, `MATRIX_ROW_PADDING`), so that its kernels can read whole rows.
    pub fn device_bytes(&self, host_bytes: usize) -> usize {
        match self {
            Self::Dense(_) => host_bytes,
            Self::Ggml(g) => {
                host_bytes + sys::GGML_ROW_PADDING_ELEMS / g.block_size() * g.type_size()
            }
        }
    }
}

impl From<DType> for WeightFormat {
    fn from(d: DType) -> Self {
        Self::Dense(d)
    }
}

impl From<GgmlDType> for WeightFormat {
    fn from(g: GgmlDType) -> Self {
        Self::Ggml(g)
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dense(d) => write!(f, "{d:?}"),
            Self::Ggml(g) => write!(f, "GGML {g:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn weight_formats_size_blocks_and_device_padding() {
        let q4 = WeightFormat::Ggml(GgmlDType::Q4_0);
        assert_eq!((q4.block_elems(), q4.block_bytes()), (32, 18));
        assert_eq!(q4.host_bytes(&Shape::from((4, 64))), Ok(4 * 2 * 18));
        assert_eq!(q4.device_bytes(144), 144 + 16 * 18);
        let k = WeightFormat::Ggml(GgmlDType::Q6K);
        assert_eq!(k.host_bytes(&Shape::from((2, 256))), Ok(2 * 210));
        assert_eq!(k.device_bytes(420), 420 + 2 * 210);
        let err = k.host_bytes(&Shape::from((256, 32))).unwrap_err();
        assert!(err.contains("[256, 32]") && err.contains("256"), "{err}");
        let dense = WeightFormat::Dense(DType::BF16);
        assert_eq!(dense.host_bytes(&Shape::from((3, 5))), Ok(30));
        assert_eq!(dense.device_bytes(30), 30);
        assert_eq!(dense.value_dtype(), DType::BF16);
        assert_eq!(q4.value_dtype(), DType::F32);
        assert_eq!(q4.to_string(), "GGML Q4_0");
        assert!(q4.has_quantized_matmul() && k.has_quantized_matmul());
        for other in [GgmlDType::Q8_1, GgmlDType::Q8K, GgmlDType::F16] {
            assert!(
                !WeightFormat::Ggml(other).has_quantized_matmul(),
                "{other:?}"
            );
        }
        assert!(!dense.has_quantized_matmul());
    }
}
