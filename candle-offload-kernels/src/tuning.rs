//! The kernel choices of the ops ([`KernelTuning`]): which CUDA kernel multiplies which GGML
//! block type by a decode step's rows ([`QlinearVariant`] per type), where a prompt's GEMM
//! starts, whether a prompt's attention runs as one kernel, and the CPU paths of the quantized
//! matmuls. The ops take it as an argument; candle-offload's `Tuning` holds it with the
//! runtime's other performance choices and documents each default's measurement
//! (docs/tuning.md).

use candle_core::quantized::GgmlDType;
use serde::{Deserialize, Serialize};

/// Which CUDA kernel multiplies GGML blocks by a decode step's few rows (the same contract and
/// results within the same tolerances; the CPU path is one loop either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QlinearVariant {
    /// One warp per output column; each lane loads its block's x values for every column.
    V1,
    /// Each warp reads 2 or 4 weight rows together (4 where the grid still has at least two
    /// blocks of threads per SM, and x has at most 4 rows) and each lane loads its block's x
    /// values once for all of them.
    V2,
    /// [`Self::V2`] with 2 weight rows per warp whatever the shape.
    V2R2,
    /// [`Self::V2`] with 4 weight rows per warp whatever the shape, except for more than 4
    /// rows of x (2 there: the kernel of 4 needs too many registers).
    V2R4,
    /// [`Self::V2`]'s warps with x quantized to 8 bits in blocks of 32 (by each block of
    /// threads, into shared memory) and integer dot products (`__dp4a`), as llama.cpp's
    /// kernels do: 4 weight rows per warp as [`Self::V2`] picks them, but only up to 2 rows of
    /// x. Its results are x rounded to those blocks times the dequantized weights, so they
    /// differ from the others' by x's rounding (about 0.4% of a block's largest value per
    /// element).
    V3,
    /// [`Self::V3`]'s quantized x and integer dot products, but x quantized once per call by a
    /// launch of its own into a device buffer (40 bytes per block of 32: the int8 quants, the
    /// scale and the quants' sum), which the matmul kernel, [`Self::V2`]'s warps and weight
    /// rows per warp (4 as [`Self::V3`] picks them), reads from global memory. x is rounded
    /// exactly as [`Self::V3`] rounds it, so its results are [`Self::V3`]'s up to the f32
    /// summation order.
    V4,
}

impl QlinearVariant {
    /// Every variant.
    pub const ALL: [Self; 6] = [
        Self::V1,
        Self::V2,
        Self::V2R2,
        Self::V2R4,
        Self::V3,
        Self::V4,
    ];

    /// `v1`, `v2`, `v2r2`, `v2r4`, `v3`, `v4` (any case) as a variant.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|v| v.name().eq_ignore_ascii_case(s.trim()))
    }

    /// `v1`, `v2`, `v2r2`, `v2r4`, `v3` or `v4`.
    pub fn name(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
            Self::V2R2 => "v2r2",
            Self::V2R4 => "v2r4",
            Self::V3 => "v3",
            Self::V4 => "v4",
        }
    }

    /// Whether the variant multiplies x quantized to 8 bits (integer dot products).
    pub fn quantizes_x(self) -> bool {
        matches!(self, Self::V3 | Self::V4)
    }
}

/// The decode kernel of each GGML block type the kernel has; a type not listed runs
/// [`QlinearVariant::V2`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QlinearVariants {
    /// Q4_0 blocks.
    pub q4_0: QlinearVariant,
    /// Q4_1 blocks.
    pub q4_1: QlinearVariant,
    /// Q5_0 blocks.
    pub q5_0: QlinearVariant,
    /// Q5_1 blocks.
    pub q5_1: QlinearVariant,
    /// Q8_0 blocks.
    pub q8_0: QlinearVariant,
    /// Q4_K super-blocks (of the variants only x's quantization applies: V3 and V4 take
    /// 8-bit x and integer dot products, the others convert to floats).
    pub q4_k: QlinearVariant,
    /// Q6_K super-blocks (as Q4_K).
    pub q6_k: QlinearVariant,
}

impl Default for QlinearVariants {
    /// The measured best per type (docs/tuning.md, `QlinearVariants`).
    fn default() -> Self {
        use QlinearVariant::{V3, V4};
        Self {
            q4_0: V4,
            q4_1: V4,
            q5_0: V4,
            q5_1: V4,
            q8_0: V3,
            q4_k: V3,
            q6_k: V3,
        }
    }
}

impl QlinearVariants {
    /// Every block type listed, with its variant.
    pub fn entries(&self) -> [(GgmlDType, QlinearVariant); 7] {
        [
            (GgmlDType::Q4_0, self.q4_0),
            (GgmlDType::Q4_1, self.q4_1),
            (GgmlDType::Q5_0, self.q5_0),
            (GgmlDType::Q5_1, self.q5_1),
            (GgmlDType::Q8_0, self.q8_0),
            (GgmlDType::Q4K, self.q4_k),
            (GgmlDType::Q6K, self.q6_k),
        ]
    }

    /// The variant of block type `t` ([`QlinearVariant::V2`] for a type not listed).
    pub fn of(&self, t: GgmlDType) -> QlinearVariant {
        self.entries()
            .into_iter()
            .find(|(ty, _)| *ty == t)
            .map_or(QlinearVariant::V2, |(_, v)| v)
    }

    /// Every type set to `v`.
    pub fn all(v: QlinearVariant) -> Self {
        Self {
            q4_0: v,
            q4_1: v,
            q5_0: v,
            q5_1: v,
            q8_0: v,
            q4_k: v,
            q6_k: v,
        }
    }
}

/// The choices of the ops ([`crate::linear`], [`crate::gemm`], [`crate::attention`],
/// [`crate::linear::cpu_quant`]): which kernel a linear layer or an attention runs for a given
/// device, weight format and number of rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct KernelTuning {
    /// The GPU decode kernel per GGML block type.
    pub qlinear: QlinearVariants,
    /// Q4_K and Q6_K through their own GPU kernel (off: Candle's quantized matmul).
    pub qlinear_k: bool,
    /// Output columns per warp of the float K-quant kernel for Q4_K: 1 or 2.
    pub qlinear_k_rows: usize,
    /// Warps sharing each column group of the 8-bit K-quant kernels: 0 (chosen by the grid's
    /// size), 1 or 2.
    pub qlinear_k_splits: usize,
    /// The most rows of x a quantized projection on a GPU takes through the library's decode
    /// kernels (1 to [`QLINEAR_SMALL_ROWS`]); more rows go to Candle's quantized matmul (up to
    /// 8 rows its MMVQ kernels: x quantized to 8 bits, integer dot products).
    pub qlinear_small_rows: usize,
    /// Rows of x from which Q4_K and Q6_K, where their variant is `v3`, run `v4` instead: x
    /// quantized once (by a launch of its own, or by the op that made x), where every block of
    /// threads of `v3` quantizes all of x's rows again ([`QLINEAR_SMALL_ROWS`] + 1 or more:
    /// never). Q8_0 keeps `v3` at any rows.
    pub qlinear_k_v4_rows: usize,
    /// A prompt's quantized projections on a GPU through 16-bit weights and cuBLAS, from
    /// [`Self::prefill_gemm_min_rows`] rows (off: the GGML kernels at any rows).
    pub prefill_gemm: bool,
    /// Rows of x from which [`Self::prefill_gemm`] applies: at least 9 (up to 8 rows are a
    /// decode step's, which the decode kernels take).
    pub prefill_gemm_min_rows: usize,
    /// A prompt's attention on a GPU as one flash-attention kernel (off: the composition).
    pub prompt_attention: bool,
    /// On the CPU, K-quant weights (Q2_K-Q6_K) against a decode step's rows through the
    /// library's own loop over the blocks as they are (off: Candle's repacked tiles). `None`
    /// (the default): on where the CPU matmul pool has at least [`KQUANT_MIN_THREADS`] threads
    /// (candle-offload's `Tuning::for_host` says which for this host).
    pub cpu_kquants: Option<bool>,
    /// Bytes ahead the CPU quantized kernels prefetch their weight rows (0: no prefetch).
    pub cpu_prefetch_bytes: usize,
    /// On the CPU, Q4_1 and Q8_0 weights multiply activations quantized to 8-bit blocks, as
    /// llama.cpp does (its arithmetic and speed), instead of the F32 activations (what the
    /// dequantized model gives). It changes results, so it is off by default.
    pub cpu_q8_activations: bool,
    /// A decode row's routed experts of GGML blocks on a GPU through the grouped kernels
    /// ([`crate::linear::qexperts_row`]; off: each expert's own decode matmuls).
    pub grouped_experts: bool,
    /// A prompt's rows through their experts on a GPU ([`crate::linear::qexperts_rows`]) with
    /// each projection's input quantized once for all rows (variant 4's kernels), where off
    /// every block of threads quantizes its chunk of rows again (variant 3's).
    pub experts_rows_x_once: bool,
    /// Rows of one expert from which [`crate::linear::qexperts_rows`] takes that expert
    /// through its weights dequantized to 16 bits and cuBLAS (as [`Self::prefill_gemm`] takes
    /// a prompt's dense projections) rather than the grouped kernels (0: never).
    pub experts_gemm_min_rows: usize,
}

/// The most rows of x the library's GPU decode kernels take
/// ([`KernelTuning::qlinear_small_rows`]'s default and bound).
pub const QLINEAR_SMALL_ROWS: usize = crate::util::LINEAR_SMALL_MAX_ROWS;

/// Rows of x from which Q4_K and Q6_K run `v4` rather than `v3`
/// ([`KernelTuning::qlinear_k_v4_rows`]'s default; docs/tuning.md).
pub const QLINEAR_K_V4_ROWS: usize = 2;

/// Threads from which the CPU K-quant loop ([`KernelTuning::cpu_kquants`]) beats Candle's
/// repacked tiles (docs/tuning.md).
pub const KQUANT_MIN_THREADS: usize = 12;

/// The prompt rows from which a quantized projection goes through 16-bit weights and cuBLAS
/// ([`KernelTuning::prefill_gemm_min_rows`]'s default).
pub const PREFILL_GEMM_MIN_ROWS: usize = 64;

/// An expert's prompt rows from which it goes through 16-bit weights and cuBLAS
/// ([`KernelTuning::experts_gemm_min_rows`]'s default; docs/tuning.md).
pub const EXPERTS_GEMM_MIN_ROWS: usize = 64;

/// The CPU quantized kernels' prefetch distance ([`KernelTuning::cpu_prefetch_bytes`]'s
/// default).
pub const CPU_PREFETCH_BYTES: usize = 4096;

impl Default for KernelTuning {
    fn default() -> Self {
        Self {
            qlinear: QlinearVariants::default(),
            qlinear_k: true,
            qlinear_k_rows: 1,
            qlinear_k_splits: 0,
            qlinear_small_rows: QLINEAR_SMALL_ROWS,
            qlinear_k_v4_rows: QLINEAR_K_V4_ROWS,
            prefill_gemm: true,
            prefill_gemm_min_rows: PREFILL_GEMM_MIN_ROWS,
            prompt_attention: true,
            cpu_kquants: None,
            cpu_prefetch_bytes: CPU_PREFETCH_BYTES,
            cpu_q8_activations: false,
            grouped_experts: true,
            experts_rows_x_once: true,
            experts_gemm_min_rows: EXPERTS_GEMM_MIN_ROWS,
        }
    }
}

impl KernelTuning {
    /// The GPU decode kernel block type `t` runs.
    pub fn qlinear_variant(&self, t: GgmlDType) -> QlinearVariant {
        self.qlinear.of(t)
    }

    /// The GPU decode kernel block type `t` runs for `rows` rows of x: its variant, with `v3`
    /// becoming `v4` for Q4_K and Q6_K from [`Self::qlinear_k_v4_rows`] rows.
    pub fn qlinear_variant_at(&self, t: GgmlDType, rows: usize) -> QlinearVariant {
        match self.qlinear.of(t) {
            QlinearVariant::V3
                if matches!(t, GgmlDType::Q4K | GgmlDType::Q6K)
                    && rows >= self.qlinear_k_v4_rows =>
            {
                QlinearVariant::V4
            }
            v => v,
        }
    }
}
