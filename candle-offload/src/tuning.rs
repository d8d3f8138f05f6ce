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

use serde::{Deserialize, Serialize};

pub use candle_offload_kernels::tuning::{
    KernelTuning, QlinearVariant, QlinearVariants, CPU_PREFETCH_BYTES, KQUANT_MIN_THREADS,
    PREFILL_GEMM_MIN_ROWS,
};

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
    /// With [`graphs`](Self::graphs), a continuous batch's ragged decode steps (several
    /// sequences, each with its own KV cache) replayed from CUDA graphs too.
    pub ragged_graphs: bool,
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
            ragged_graphs: false,
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

    /// [`fitted_to_host`](Self::fitted_to_host) for a model that `experts` says is a mixture
    /// of experts: there the CPU K-quant loop is on whatever the threads, since the experts'
    /// many small matmuls run on its pool ([`crate::kernels::linear::cpu_experts`]), and the
    /// dense layers' matmuls on Candle's pool between them would leave each pool to wake the
    /// other's threads a few dozen times a step (a 2-core host decodes a small Q4_K_M
    /// Qwen3-MoE some five times faster with one pool). Choices already made stay.
    pub fn fitted_to_model(mut self, experts: bool) -> Self {
        if experts {
            self.kernels.cpu_kquants.get_or_insert(true);
        }
        self.fitted_to_host()
    }

    /// The threads of the CPU matmul pool this tuning asks for.
    pub fn threads(&self) -> usize {
        self.cpu_threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }

    /// Every key [`Self::set`] takes.
    pub const KEYS: [&'static str; 22] = [
        "kernels.qlinear",
        "kernels.qlinear_k",
        "kernels.qlinear_k_rows",
        "kernels.qlinear_k_splits",
        "kernels.qlinear_small_rows",
        "kernels.qlinear_k_v4_rows",
        "kernels.prefill_gemm",
        "kernels.prefill_gemm_min_rows",
        "kernels.prompt_attention",
        "kernels.cpu_kquants",
        "kernels.cpu_prefetch_bytes",
        "kernels.cpu_q8_activations",
        "kernels.grouped_experts",
        "kernels.experts_rows_x_once",
        "kernels.experts_gemm_min_rows",
        "cpu_threads",
        "graphs",
        "ragged_graphs",
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
        // Ranges are `validate`'s, checked below on the whole value.
        let number = || {
            v.parse::<usize>()
                .map_err(|_| err(format!("{v:?} is not a whole number")))
        };
        let variant = || {
            QlinearVariant::parse(v)
                .ok_or_else(|| err(format!("{v:?} is not v1, v2, v2r2, v2r4, v3 or v4")))
        };
        let mut next = *self;
        let k = &mut next.kernels;
        match key.trim() {
            "kernels.qlinear" if v.is_empty() || v.eq_ignore_ascii_case("auto") => {
                k.qlinear = QlinearVariants::default();
            }
            "kernels.qlinear" => k.qlinear = QlinearVariants::all(variant()?),
            "kernels.qlinear_k" => k.qlinear_k = flag()?,
            "kernels.qlinear_k_rows" => k.qlinear_k_rows = number()?,
            "kernels.qlinear_k_splits" => k.qlinear_k_splits = number()?,
            "kernels.qlinear_small_rows" => k.qlinear_small_rows = number()?,
            "kernels.qlinear_k_v4_rows" => k.qlinear_k_v4_rows = number()?,
            "kernels.prefill_gemm" => k.prefill_gemm = flag()?,
            "kernels.prefill_gemm_min_rows" => k.prefill_gemm_min_rows = number()?,
            "kernels.prompt_attention" => k.prompt_attention = flag()?,
            "kernels.cpu_kquants" if v.eq_ignore_ascii_case("auto") => k.cpu_kquants = None,
            "kernels.cpu_kquants" => k.cpu_kquants = Some(flag()?),
            "kernels.cpu_prefetch_bytes" => k.cpu_prefetch_bytes = number()?,
            "kernels.cpu_q8_activations" => k.cpu_q8_activations = flag()?,
            "kernels.grouped_experts" => k.grouped_experts = flag()?,
            "kernels.experts_rows_x_once" => k.experts_rows_x_once = flag()?,
            "kernels.experts_gemm_min_rows" => k.experts_gemm_min_rows = number()?,
            "cpu_threads" if v.is_empty() || v.eq_ignore_ascii_case("auto") => {
                next.cpu_threads = None;
            }
            "cpu_threads" => next.cpu_threads = Some(number()?),
            "graphs" => next.graphs = flag()?,
            "ragged_graphs" => next.ragged_graphs = flag()?,
            "weight_pool" => next.weight_pool = flag()?,
            "disk.threads" => next.disk.threads = number()?,
            "disk.piece_mib" => next.disk.piece_mib = number()?,
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
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// Checks every field's range (the one place they are written; [`Self::set`] checks
    /// through it), for a value built, set or deserialized.
    pub fn validate(&self) -> Result<(), TuningError> {
        let k = &self.kernels;
        let checks: [(&str, usize, usize, usize); 9] = [
            ("kernels.qlinear_k_rows", k.qlinear_k_rows, 1, 2),
            ("kernels.qlinear_k_splits", k.qlinear_k_splits, 0, 2),
            (
                "kernels.qlinear_small_rows",
                k.qlinear_small_rows,
                1,
                candle_offload_kernels::tuning::QLINEAR_SMALL_ROWS,
            ),
            (
                "kernels.qlinear_k_v4_rows",
                k.qlinear_k_v4_rows,
                1,
                candle_offload_kernels::tuning::QLINEAR_SMALL_ROWS + 1,
            ),
            (
                "kernels.prefill_gemm_min_rows",
                k.prefill_gemm_min_rows,
                9,
                1 << 20,
            ),
            (
                "kernels.experts_gemm_min_rows",
                k.experts_gemm_min_rows,
                0,
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
            ("kernels.grouped_experts", "off"),
            ("kernels.experts_rows_x_once", "off"),
            ("kernels.experts_gemm_min_rows", "0"),
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
        assert!(k.cpu_q8_activations && !k.grouped_experts && !k.experts_rows_x_once);
        assert_eq!((k.qlinear_k_rows, k.qlinear_k_splits), (2, 1));
        assert_eq!((k.prefill_gemm_min_rows, k.cpu_prefetch_bytes), (128, 0));
        assert_eq!(k.experts_gemm_min_rows, 0);
        assert_eq!(t.cpu_threads, Some(3));
        assert!(!t.graphs && !t.weight_pool);
        assert_eq!((t.disk.threads, t.disk.piece_mib), (4, 16));
        t.validate().unwrap();

        let before = t;
        for (key, value) in [
            ("kernels.qlinear", "v5"),
            ("kernels.qlinear_k_rows", "3"),
            ("kernels.qlinear_k_splits", "-1"),
            ("kernels.qlinear_small_rows", "0"),
            ("kernels.qlinear_small_rows", "9"),
            ("kernels.qlinear_k_v4_rows", "0"),
            ("kernels.qlinear_k_v4_rows", "10"),
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

    #[test]
    fn a_mixture_of_experts_turns_the_kquant_loop_on_at_any_thread_count() {
        let mut t = Tuning {
            cpu_threads: Some(2),
            ..Tuning::default()
        };
        assert_eq!(t.fitted_to_model(true).kernels.cpu_kquants, Some(true));
        assert_eq!(t.fitted_to_model(false).kernels.cpu_kquants, Some(false));
        t.kernels.cpu_kquants = Some(false);
        assert_eq!(t.fitted_to_model(true).kernels.cpu_kquants, Some(false));
    }
}
