//! Every performance choice of the library as one value: which kernel multiplies which weight
//! format, where a prompt's GEMM starts, whether decode steps replay from CUDA graphs, the CPU
//! worker threads, the disk reader's shape.
//!
//! A [`Tuning`] travels in the configuration ([`crate::OffloadConfig::tuning`], the model's
//! settings) to the code that uses it; nothing in the library reads the environment or flips
//! a process-wide switch for tuning. [`Tuning::default`] holds the measured best choices;
//! [`Tuning::for_host`] adds the ones that depend on this host (the K-quant CPU path).
//! docs/tuning.md gives each default's measurement and the environment variables the binaries
//! map onto [`Tuning::set`].
//!
//! ```
//! use candle_offload::Tuning;
//! let mut t = Tuning::for_host();
//! t.set("kernels.prefill_gemm_min_rows", "128").unwrap();
//! assert_eq!(t.kernels.prefill_gemm_min_rows, 128);
//! assert!(t.set("kernels.qlinear_k_rows", "3").is_err());
//! ```

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

/// The choices of the ops ([`crate::ops`], [`crate::cpu_quant`]): which kernel a linear layer or
/// an attention runs for a given device, weight format and number of rows.
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
    /// ([`Tuning::for_host`] says which for this host).
    pub cpu_kquants: Option<bool>,
    /// Bytes ahead the CPU quantized kernels prefetch their weight rows (0: no prefetch).
    pub cpu_prefetch_bytes: usize,
    /// On the CPU, Q4_1 and Q8_0 weights multiply activations quantized to 8-bit blocks, as
    /// llama.cpp does (its arithmetic and speed), instead of the F32 activations (what the
    /// dequantized model gives). It changes results, so it is off by default.
    pub cpu_q8_activations: bool,
}

/// Threads from which the CPU K-quant loop ([`KernelTuning::cpu_kquants`]) beats Candle's
/// repacked tiles (docs/tuning.md).
pub const KQUANT_MIN_THREADS: usize = 12;

/// The prompt rows from which a quantized projection goes through 16-bit weights and cuBLAS
/// ([`KernelTuning::prefill_gemm_min_rows`]'s default).
pub const PREFILL_GEMM_MIN_ROWS: usize = 64;

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
            prefill_gemm: true,
            prefill_gemm_min_rows: PREFILL_GEMM_MIN_ROWS,
            prompt_attention: true,
            cpu_kquants: None,
            cpu_prefetch_bytes: CPU_PREFETCH_BYTES,
            cpu_q8_activations: false,
        }
    }
}

impl KernelTuning {
    /// The GPU decode kernel block type `t` runs.
    pub fn qlinear_variant(&self, t: GgmlDType) -> QlinearVariant {
        self.qlinear.of(t)
    }
}

/// How the disk tier cuts a long read: into pieces of `piece_mib` MiB (the largest request one
/// O_DIRECT `pread` makes), read by up to `threads` threads at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct DiskTuning {
    /// Threads reading one unit's pieces at once: 1 to 64.
    pub threads: usize,
    /// The largest request, in MiB: 1 to 256.
    pub piece_mib: usize,
}

impl Default for DiskTuning {
    fn default() -> Self {
        Self {
            threads: 2,
            piece_mib: 8,
        }
    }
}

/// Every performance choice of the library (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Tuning {
    /// The ops' kernel choices.
    pub kernels: KernelTuning,
    /// Threads of the CPU matmul pool (the caller and its workers): `None` for one per core.
    /// The pool is made once per process, by the first runtime that starts.
    pub cpu_threads: Option<usize>,
    /// Decode steps of resident weights replayed from CUDA graphs.
    pub graphs: bool,
    /// Weights (and what lives as long as them) in a device memory pool of their own, apart
    /// from activations.
    pub weight_pool: bool,
    /// The disk tier's reads.
    pub disk: DiskTuning,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            kernels: KernelTuning::default(),
            cpu_threads: None,
            graphs: true,
            weight_pool: true,
            disk: DiskTuning::default(),
        }
    }
}

/// A [`Tuning`] key that does not exist, or a value out of its range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tuning `{key}`: {reason}")]
#[non_exhaustive]
pub struct TuningError {
    /// The key, as given.
    pub key: String,
    /// What is wrong.
    pub reason: String,
}

impl Tuning {
    /// The defaults with the choices that depend on this host made: the CPU K-quant loop where
    /// the matmul pool has at least [`KQUANT_MIN_THREADS`] threads.
    pub fn for_host() -> Self {
        Self::default().fitted_to_host()
    }

    /// `self` with the host-dependent choices it leaves open made for this host's threads
    /// ([`Self::cpu_threads`], or its cores); choices already made stay.
    pub fn fitted_to_host(mut self) -> Self {
        let on = self.threads() >= KQUANT_MIN_THREADS;
        self.kernels.cpu_kquants.get_or_insert(on);
        self
    }

    /// The threads of the CPU matmul pool this tuning asks for.
    pub fn threads(&self) -> usize {
        self.cpu_threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }

    /// Every key [`Self::set`] takes.
    pub const KEYS: [&'static str; 16] = [
        "kernels.qlinear",
        "kernels.qlinear_k",
        "kernels.qlinear_k_rows",
        "kernels.qlinear_k_splits",
        "kernels.prefill_gemm",
        "kernels.prefill_gemm_min_rows",
        "kernels.prompt_attention",
        "kernels.cpu_kquants",
        "kernels.cpu_prefetch_bytes",
        "kernels.cpu_q8_activations",
        "cpu_threads",
        "graphs",
        "weight_pool",
        "disk.threads",
        "disk.piece_mib",
        "kernels.qlinear.<type>",
    ];

    /// Sets one choice from text, as a settings file or an environment override gives it:
    /// `key` one of [`Self::KEYS`] (`kernels.qlinear` forces one variant for every block type,
    /// `auto` restores the per-type defaults; `kernels.qlinear.q8_0` sets one type's), booleans
    /// as `1`/`0`, `on`/`off`, `true`/`false`. Nothing changes on an error.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), TuningError> {
        let v = value.trim();
        let err = |reason: String| TuningError {
            key: key.to_string(),
            reason,
        };
        let flag = || parse_bool(v).ok_or_else(|| err(format!("{v:?} is not on/off")));
        let number = |lo: usize, hi: usize| match v.parse::<usize>() {
            Ok(n) if (lo..=hi).contains(&n) => Ok(n),
            _ => Err(err(format!(
                "{v:?} is not a whole number from {lo} to {hi}"
            ))),
        };
        let variant = || {
            QlinearVariant::parse(v)
                .ok_or_else(|| err(format!("{v:?} is not v1, v2, v2r2, v2r4, v3 or v4")))
        };
        let k = &mut self.kernels;
        match key.trim() {
            "kernels.qlinear" if v.is_empty() || v.eq_ignore_ascii_case("auto") => {
                k.qlinear = QlinearVariants::default();
            }
            "kernels.qlinear" => k.qlinear = QlinearVariants::all(variant()?),
            "kernels.qlinear_k" => k.qlinear_k = flag()?,
            "kernels.qlinear_k_rows" => k.qlinear_k_rows = number(1, 2)?,
            "kernels.qlinear_k_splits" => k.qlinear_k_splits = number(0, 2)?,
            "kernels.prefill_gemm" => k.prefill_gemm = flag()?,
            "kernels.prefill_gemm_min_rows" => k.prefill_gemm_min_rows = number(9, 1 << 20)?,
            "kernels.prompt_attention" => k.prompt_attention = flag()?,
            "kernels.cpu_kquants" if v.eq_ignore_ascii_case("auto") => k.cpu_kquants = None,
            "kernels.cpu_kquants" => k.cpu_kquants = Some(flag()?),
            "kernels.cpu_prefetch_bytes" => k.cpu_prefetch_bytes = number(0, 65536)?,
            "kernels.cpu_q8_activations" => k.cpu_q8_activations = flag()?,
            "cpu_threads" if v.is_empty() || v.eq_ignore_ascii_case("auto") => {
                self.cpu_threads = None;
            }
            "cpu_threads" => self.cpu_threads = Some(number(1, 1024)?),
            "graphs" => self.graphs = flag()?,
            "weight_pool" => self.weight_pool = flag()?,
            "disk.threads" => self.disk.threads = number(1, 64)?,
            "disk.piece_mib" => self.disk.piece_mib = number(1, 256)?,
            other => {
                let slot = other
                    .strip_prefix("kernels.qlinear.")
                    .and_then(|ty| match ty {
                        "q4_0" => Some(&mut k.qlinear.q4_0),
                        "q4_1" => Some(&mut k.qlinear.q4_1),
                        "q5_0" => Some(&mut k.qlinear.q5_0),
                        "q5_1" => Some(&mut k.qlinear.q5_1),
                        "q8_0" => Some(&mut k.qlinear.q8_0),
                        "q4_k" => Some(&mut k.qlinear.q4_k),
                        "q6_k" => Some(&mut k.qlinear.q6_k),
                        _ => None,
                    });
                match slot {
                    Some(slot) => *slot = variant()?,
                    None => {
                        return Err(err(format!(
                            "no such key; the keys are {}",
                            Self::KEYS.join(", ")
                        )))
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks every range [`Self::set`] checks, for a value built or deserialized whole.
    pub fn validate(&self) -> Result<(), TuningError> {
        let k = &self.kernels;
        let checks: [(&str, usize, usize, usize); 6] = [
            ("kernels.qlinear_k_rows", k.qlinear_k_rows, 1, 2),
            ("kernels.qlinear_k_splits", k.qlinear_k_splits, 0, 2),
            (
                "kernels.prefill_gemm_min_rows",
                k.prefill_gemm_min_rows,
                9,
                1 << 20,
            ),
            ("kernels.cpu_prefetch_bytes", k.cpu_prefetch_bytes, 0, 65536),
            ("disk.threads", self.disk.threads, 1, 64),
            ("disk.piece_mib", self.disk.piece_mib, 1, 256),
        ];
        let threads = ("cpu_threads", self.cpu_threads.unwrap_or(1), 1, 1024);
        for (key, value, lo, hi) in checks.into_iter().chain([threads]) {
            if !(lo..=hi).contains(&value) {
                return Err(TuningError {
                    key: key.into(),
                    reason: format!("{value} is not from {lo} to {hi}"),
                });
            }
        }
        Ok(())
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "on" | "true" | "yes" => Some(true),
        "0" | "off" | "false" | "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_sets_its_field_and_bad_values_change_nothing() {
        let mut t = Tuning::default();
        for (key, value) in [
            ("kernels.qlinear", "v2r4"),
            ("kernels.qlinear_k", "off"),
            ("kernels.qlinear_k_rows", "2"),
            ("kernels.qlinear_k_splits", "1"),
            ("kernels.prefill_gemm", "0"),
            ("kernels.prefill_gemm_min_rows", "128"),
            ("kernels.prompt_attention", "false"),
            ("kernels.cpu_kquants", "on"),
            ("kernels.cpu_prefetch_bytes", "0"),
            ("kernels.cpu_q8_activations", "yes"),
            ("cpu_threads", "3"),
            ("graphs", "0"),
            ("weight_pool", "off"),
            ("disk.threads", "4"),
            ("disk.piece_mib", "16"),
            ("kernels.qlinear.q8_0", "V1"),
        ] {
            t.set(key, value).unwrap();
        }
        let k = t.kernels;
        assert_eq!(k.qlinear.q4_0, QlinearVariant::V2R4);
        assert_eq!(k.qlinear.q8_0, QlinearVariant::V1);
        assert!(!k.qlinear_k && !k.prefill_gemm && !k.prompt_attention);
        assert_eq!(k.cpu_kquants, Some(true));
        assert!(k.cpu_q8_activations);
        assert_eq!((k.qlinear_k_rows, k.qlinear_k_splits), (2, 1));
        assert_eq!((k.prefill_gemm_min_rows, k.cpu_prefetch_bytes), (128, 0));
        assert_eq!(t.cpu_threads, Some(3));
        assert!(!t.graphs && !t.weight_pool);
        assert_eq!((t.disk.threads, t.disk.piece_mib), (4, 16));
        t.validate().unwrap();

        let before = t;
        for (key, value) in [
            ("kernels.qlinear", "v5"),
            ("kernels.qlinear_k_rows", "3"),
            ("kernels.qlinear_k_splits", "-1"),
            ("kernels.prefill_gemm", "maybe"),
            ("kernels.cpu_prefetch_bytes", "65537"),
            ("kernels.prefill_gemm_min_rows", "8"),
            ("cpu_threads", "0"),
            ("disk.piece_mib", "257"),
            ("kernels.qlinear.q2_k", "v1"),
            ("no_such_key", "1"),
        ] {
            let e = t.set(key, value).unwrap_err();
            assert_eq!(e.key, key);
            assert!(e.to_string().contains(key), "{e}");
        }
        assert_eq!(t, before);
        t.set("kernels.qlinear", "auto").unwrap();
        t.set("cpu_threads", "auto").unwrap();
        assert_eq!(t.kernels.qlinear, QlinearVariants::default());
        assert_eq!(t.cpu_threads, None);
    }

    #[test]
    fn round_trips_through_yaml_and_refuses_unknown_keys() {
        let mut t = Tuning::for_host();
        t.set("kernels.qlinear.q4_k", "v4").unwrap();
        t.set("cpu_threads", "2").unwrap();
        let text = serde_norway::to_string(&t).unwrap();
        let back: Tuning = serde_norway::from_str(&text).unwrap();
        assert_eq!(back, t);
        let partial: Tuning =
            serde_norway::from_str("kernels:\n  qlinear:\n    q8_0: v2\ngraphs: false\n").unwrap();
        assert_eq!(partial.kernels.qlinear.q8_0, QlinearVariant::V2);
        assert_eq!(partial.kernels.qlinear.q4_0, QlinearVariant::V4);
        assert!(!partial.graphs && partial.weight_pool);
        assert!(serde_norway::from_str::<Tuning>("graph: false\n").is_err());
        assert!(serde_norway::from_str::<Tuning>("kernels:\n  qlinear:\n    q8_0: v9\n").is_err());
    }

    #[test]
    fn validate_names_the_field_out_of_range() {
        let t = Tuning {
            disk: DiskTuning {
                threads: 0,
                ..DiskTuning::default()
            },
            ..Tuning::default()
        };
        assert_eq!(t.validate().unwrap_err().key, "disk.threads");
        let t = Tuning {
            cpu_threads: Some(5000),
            ..Tuning::default()
        };
        assert_eq!(t.validate().unwrap_err().key, "cpu_threads");
    }

    #[test]
    fn the_host_fit_turns_the_kquant_loop_on_from_its_thread_count() {
        let mut t = Tuning {
            cpu_threads: Some(KQUANT_MIN_THREADS - 1),
            ..Tuning::default()
        };
        assert_eq!(t.fitted_to_host().kernels.cpu_kquants, Some(false));
        t.cpu_threads = Some(KQUANT_MIN_THREADS);
        assert_eq!(t.fitted_to_host().kernels.cpu_kquants, Some(true));
        // A choice made stays.
        t.kernels.cpu_kquants = Some(false);
        assert_eq!(t.fitted_to_host().kernels.cpu_kquants, Some(false));
    }
}
