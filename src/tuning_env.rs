//! The binaries' environment overrides of [`Tuning`]: read once, here, and nowhere in the
//! libraries. docs/tuning.md documents every variable in one table; this module's
//! [`TUNING_VARS`] is that table in code.

use candle_offload::Tuning;

/// Each environment variable the binaries read for tuning, with the [`Tuning::set`] key its
/// value goes to.
pub const TUNING_VARS: [(&str, &str); 19] = [
    ("CANDLE_OFFLOAD_QLINEAR", "kernels.qlinear"),
    ("CANDLE_OFFLOAD_QLINEAR_K", "kernels.qlinear_k"),
    ("CANDLE_OFFLOAD_QLINEAR_K_ROWS", "kernels.qlinear_k_rows"),
    (
        "CANDLE_OFFLOAD_QLINEAR_K_SPLITS",
        "kernels.qlinear_k_splits",
    ),
    (
        "CANDLE_OFFLOAD_QLINEAR_SMALL_ROWS",
        "kernels.qlinear_small_rows",
    ),
    (
        "CANDLE_OFFLOAD_QLINEAR_K_V4_ROWS",
        "kernels.qlinear_k_v4_rows",
    ),
    ("CANDLE_OFFLOAD_PREFILL_GEMM", "kernels.prefill_gemm"),
    (
        "CANDLE_OFFLOAD_PREFILL_GEMM_MIN_ROWS",
        "kernels.prefill_gemm_min_rows",
    ),
    (
        "CANDLE_OFFLOAD_PROMPT_ATTENTION",
        "kernels.prompt_attention",
    ),
    ("CANDLE_OFFLOAD_CPU_KQUANTS", "kernels.cpu_kquants"),
    (
        "CANDLE_OFFLOAD_CPU_PREFETCH_BYTES",
        "kernels.cpu_prefetch_bytes",
    ),
    (
        "CANDLE_OFFLOAD_EXPERTS_ROWS_X_ONCE",
        "kernels.experts_rows_x_once",
    ),
    (
        "CANDLE_OFFLOAD_EXPERTS_GEMM_MIN_ROWS",
        "kernels.experts_gemm_min_rows",
    ),
    ("CANDLE_OFFLOAD_CPU_THREADS", "cpu_threads"),
    ("CANDLE_OFFLOAD_GRAPHS", "graphs"),
    ("CANDLE_OFFLOAD_RAGGED_GRAPHS", "ragged_graphs"),
    ("CANDLE_OFFLOAD_WEIGHT_POOL", "weight_pool"),
    ("CANDLE_OFFLOAD_DISK_THREADS", "disk.threads"),
    ("CANDLE_OFFLOAD_DISK_PIECE_MIB", "disk.piece_mib"),
];

/// Variables no longer read, with what replaces them.
pub const REMOVED_VARS: [(&str, &str); 1] = [(
    "CANDLE_OFFLOAD_EVEN_LAYERS",
    "nothing: layers of one shape always take one size per tensor (it only served an A/B)",
)];

/// `CANDLE_OFFLOAD_*` variables read for something other than tuning.
const OTHER_VARS: [&str; 2] = ["CANDLE_OFFLOAD_CACHE", "CANDLE_OFFLOAD_COMMIT"];

/// `base` with the overrides that `vars` (name, value) set, and one warning for each variable
/// ignored: a value [`Tuning::set`] refuses, a removed variable, an unknown `CANDLE_OFFLOAD_*`
/// name (a typo would otherwise measure the default).
pub fn apply_env(
    base: Tuning,
    vars: impl IntoIterator<Item = (String, String)>,
) -> (Tuning, Vec<String>) {
    let mut tuning = base;
    let mut warnings = Vec::new();
    let mut vars: Vec<(String, String)> = vars
        .into_iter()
        .filter(|(k, _)| k.starts_with("CANDLE_OFFLOAD_"))
        .collect();
    vars.sort();
    for (name, value) in vars {
        if let Some((_, key)) = TUNING_VARS.iter().find(|(var, _)| *var == name) {
            if value.trim().is_empty() {
                continue;
            }
            if let Err(e) = tuning.set(key, &value) {
                warnings.push(format!("{name}={value:?} ignored: {e}"));
            }
        } else if let Some((_, instead)) = REMOVED_VARS.iter().find(|(var, _)| *var == name) {
            warnings.push(format!(
                "{name} is no longer read; its replacement: {instead}"
            ));
        } else if !OTHER_VARS.contains(&name.as_str()) {
            warnings.push(format!(
                "{name} is not a variable candle-offload reads (docs/tuning.md lists them)"
            ));
        }
    }
    (tuning, warnings)
}

/// `base` with this process's environment overrides ([`apply_env`]), each ignored variable
/// warned about once on stderr through `tracing`.
pub fn tuning_from_env(base: Tuning) -> Tuning {
    let (tuning, warnings) = apply_env(base, std::env::vars());
    for w in warnings {
        tracing::warn!("{w}");
    }
    tuning
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn every_variable_reaches_its_key() {
        let values = [
            "v2", "0", "2", "1", "4", "2", "off", "128", "false", "1", "0", "off", "32", "3", "0",
            "on", "0", "4", "16",
        ];
        let pairs: Vec<(&str, &str)> = TUNING_VARS
            .iter()
            .zip(values)
            .map(|((var, _), v)| (*var, v))
            .collect();
        let (t, warnings) = apply_env(Tuning::default(), vars(&pairs));
        assert!(warnings.is_empty(), "{warnings:?}");
        let k = t.kernels;
        assert_eq!(k.qlinear.q8_0, candle_offload::QlinearVariant::V2);
        assert!(!k.qlinear_k && !k.prefill_gemm && !k.prompt_attention);
        assert_eq!((k.qlinear_k_rows, k.qlinear_k_splits), (2, 1));
        assert_eq!(k.qlinear_small_rows, 4);
        assert_eq!(k.qlinear_k_v4_rows, 2);
        assert_eq!(k.prefill_gemm_min_rows, 128);
        assert_eq!(k.cpu_kquants, Some(true));
        assert_eq!(k.cpu_prefetch_bytes, 0);
        assert!(!k.experts_rows_x_once);
        assert_eq!(k.experts_gemm_min_rows, 32);
        assert_eq!(t.cpu_threads, Some(3));
        assert!(!t.graphs && t.ragged_graphs && !t.weight_pool);
        assert_eq!((t.disk.threads, t.disk.piece_mib), (4, 16));
    }

    #[test]
    fn bad_removed_and_unknown_variables_are_warned_about_and_change_nothing() {
        let (t, warnings) = apply_env(
            Tuning::default(),
            vars(&[
                ("CANDLE_OFFLOAD_QLINEAR_K_ROWS", "3"),
                ("CANDLE_OFFLOAD_EVEN_LAYERS", "0"),
                ("CANDLE_OFFLOAD_GRAPH", "0"),
                ("CANDLE_OFFLOAD_CACHE", "/tmp/x"),
                ("CANDLE_OFFLOAD_PREFILL_GEMM", ""),
                ("HOME", "/root"),
            ]),
        );
        assert_eq!(t, Tuning::default());
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        assert!(
            warnings[0].contains("CANDLE_OFFLOAD_EVEN_LAYERS") && warnings[0].contains("no longer")
        );
        assert!(
            warnings[1].contains("CANDLE_OFFLOAD_GRAPH") && warnings[1].contains("not a variable")
        );
        assert!(warnings[2].contains("CANDLE_OFFLOAD_QLINEAR_K_ROWS"));
    }
}
