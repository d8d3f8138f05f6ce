//! Every kind of bad input a user can supply, in one table: each must give one clear error of
//! the expected kind whose message names the file or field, never a panic.

use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use candle_offload::{Error as OffloadError, MemoryLimit};
use candle_offload_models::{loader, ModelError};

use crate::models::write_tiny_llama;
use crate::quantized::{write_random_llama_gguf, LAST_TENSOR};

/// A case: its name, what breaks the model and tries to load it, what must come out.
type Row = (
    &'static str,
    Box<dyn Fn() -> Result<(), ModelError>>,
    Expect,
);

/// What a row expects: the error kind and the text the message must contain.
enum Expect {
    Model(fn(&ModelError) -> bool, &'static [&'static str]),
    Offload(fn(&OffloadError) -> bool, &'static [&'static str]),
}

/// Loads a GGUF model's weights, keeping quantized blocks or not.
fn load_gguf(path: &Path, keep_blocks: bool) -> Result<(), ModelError> {
    let files = loader::from_gguf(path)?;
    loader::load_store_with(&files, DType::F32, &Device::Cpu, None, keep_blocks).map(|_| ())
}

/// Rewrites one tensor's dimensions (GGML order, innermost first) and type id in a GGUF header
/// (version 2 or 3) written by Candle.
fn patch_tensor_header(path: &Path, tensor: &str, edit: impl FnOnce(&mut [u64], &mut u32)) {
    let mut b = std::fs::read(path).unwrap();
    let at = b
        .windows(tensor.len())
        .position(|w| w == tensor.as_bytes())
        .unwrap()
        + tensor.len();
    let n = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
    let dims_at = at + 4;
    let ty_at = dims_at + 8 * n;
    let mut dims: Vec<u64> = (0..n)
        .map(|i| u64::from_le_bytes(b[dims_at + 8 * i..dims_at + 8 * i + 8].try_into().unwrap()))
        .collect();
    let mut ty = u32::from_le_bytes(b[ty_at..ty_at + 4].try_into().unwrap());
    edit(&mut dims, &mut ty);
    for (i, d) in dims.iter().enumerate() {
        b[dims_at + 8 * i..dims_at + 8 * i + 8].copy_from_slice(&d.to_le_bytes());
    }
    b[ty_at..ty_at + 4].copy_from_slice(&ty.to_le_bytes());
    std::fs::write(path, b).unwrap();
}

fn model_rows(dir: &Path) -> Vec<Row> {
    let d = dir.to_path_buf();
    let st = dir.join("model.safetensors");
    let cfg = dir.join("config.json");
    let is_file = |e: &ModelError| {
        matches!(
            e,
            ModelError::File { .. } | ModelError::Offload(OffloadError::File { .. })
        )
    };
    let is_config = |e: &ModelError| matches!(e, ModelError::Config { .. });
    let is_arch = |e: &ModelError| matches!(e, ModelError::UnknownArchitecture { .. });
    let load = move |d: &Path| -> Result<(), ModelError> {
        let files = loader::from_dir(d)?;
        loader::load_store(&files, DType::F32, &Device::Cpu, None).map(|_| ())
    };
    let (d1, d2, d3, d4, d5, d6) = (
        d.clone(),
        d.clone(),
        d.clone(),
        d.clone(),
        d.clone(),
        d.clone(),
    );
    let (st1, st2, cfg1, cfg2, cfg3, cfg4) = (
        st.clone(),
        st.clone(),
        cfg.clone(),
        cfg.clone(),
        cfg.clone(),
        cfg.clone(),
    );
    let gguf = dir.join("weights.gguf");
    let gguf2 = dir.join("zero-align.gguf");
    let (d7, cfg5) = (d.clone(), cfg.clone());
    let is_tensor = |e: &ModelError| matches!(e, ModelError::Tensor { .. });
    let quant = dir.join("quant.gguf");
    let (q1, q2, q3) = (quant.clone(), quant.clone(), quant);
    vec![
        (
            "a quantized GGUF whose last tensor's data is cut short",
            Box::new(move || {
                write_random_llama_gguf(&q1, 1, |_| GgmlDType::Q4K).unwrap();
                let b = std::fs::read(&q1).unwrap();
                std::fs::write(&q1, &b[..b.len() - 100]).unwrap();
                load_gguf(&q1, true)
            }),
            Expect::Model(is_tensor, &["quant.gguf", LAST_TENSOR, "truncated"]),
        ),
        (
            "a GGUF tensor of a quant type Candle cannot read (IQ2_XXS)",
            Box::new(move || {
                write_random_llama_gguf(&q2, 1, |_| GgmlDType::Q4_0).unwrap();
                patch_tensor_header(&q2, "blk.0.attn_q.weight", |_, ty| *ty = 16);
                load_gguf(&q2, true)
            }),
            Expect::Model(
                is_tensor,
                &[
                    "quant.gguf",
                    "blk.0.attn_q.weight",
                    "IQ2_XXS",
                    "not supported",
                ],
            ),
        ),
        (
            "a quantized GGUF tensor whose rows are not whole blocks",
            Box::new(move || {
                write_random_llama_gguf(&q3, 1, |_| GgmlDType::Q4K).unwrap();
                // [256, 512] as [1024, 128]: the same bytes, rows of half a Q4_K block.
                patch_tensor_header(&q3, "blk.0.ffn_down.weight", |dims, _| {
                    dims.copy_from_slice(&[128, 1024])
                });
                load_gguf(&q3, false)
            }),
            Expect::Model(
                is_tensor,
                &[
                    "quant.gguf",
                    "blk.0.ffn_down.weight",
                    "not whole Q4_K blocks",
                ],
            ),
        ),
        (
            "truncated safetensors",
            Box::new(move || {
                let b = std::fs::read(&st1).unwrap();
                std::fs::write(&st1, &b[..b.len() - 100]).unwrap();
                load(&d1)
            }),
            Expect::Model(is_file, &["model.safetensors"]),
        ),
        (
            "corrupt safetensors header",
            Box::new(move || {
                let mut b = std::fs::read(&st2).unwrap();
                b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes()); // a header longer than the file
                std::fs::write(&st2, &b).unwrap();
                load(&d2)
            }),
            Expect::Model(is_file, &["model.safetensors", "not a valid safetensors"]),
        ),
        (
            "malformed config.json",
            Box::new(move || {
                std::fs::write(&cfg1, "{\"hidden_size\": 64,").unwrap();
                load(&d3)
            }),
            Expect::Model(is_file, &["config.json", "not valid JSON"]),
        ),
        (
            "config.json without a key",
            Box::new(move || {
                std::fs::write(&cfg2, r#"{"model_type":"llama","hidden_size":64}"#).unwrap();
                load(&d4)
            }),
            Expect::Model(
                is_config,
                &["config.json", "num_attention_heads", "missing"],
            ),
        ),
        (
            "config.json with a negative size",
            Box::new(move || {
                std::fs::write(&cfg3, r#"{"model_type":"llama","hidden_size":-64}"#).unwrap();
                load(&d5)
            }),
            Expect::Model(is_config, &["config.json", "hidden_size"]),
        ),
        (
            "unknown architecture",
            Box::new(move || {
                std::fs::write(&cfg4, r#"{"model_type":"rwkv","hidden_size":64}"#).unwrap();
                load(&d6)
            }),
            Expect::Model(is_arch, &["config.json", "rwkv"]),
        ),
        (
            "a file that is not GGUF",
            Box::new(move || {
                std::fs::write(&gguf, b"PK\x03\x04 a zip, not a gguf").unwrap();
                loader::from_gguf(&gguf).map(|_| ())
            }),
            Expect::Model(is_file, &["weights.gguf", "GGUF"]),
        ),
        (
            "a GGUF header whose alignment is 0 (Candle's reader divides by it; found by fuzzing)",
            Box::new(move || {
                let mut bytes = b"GGUF".to_vec();
                bytes.extend(1u32.to_le_bytes()); // version 1: 32-bit counts
                bytes.extend(0u32.to_le_bytes()); // tensors
                bytes.extend(1u32.to_le_bytes()); // metadata entries
                bytes.extend(17u32.to_le_bytes());
                bytes.extend(b"general.alignment");
                bytes.extend(4u32.to_le_bytes()); // u32
                bytes.extend(0u32.to_le_bytes());
                std::fs::write(&gguf2, bytes).unwrap();
                loader::from_gguf(&gguf2).map(|_| ())
            }),
            Expect::Model(is_file, &["zero-align.gguf", "GGUF"]),
        ),
        (
            "--model naming a character device (/dev/null)",
            Box::new(|| loader::resolve("/dev/null", None, true).map(|_| ())),
            Expect::Model(is_file, &["/dev/null", "character device", "not a model"]),
        ),
        (
            "--model naming a directory without config.json",
            Box::new(move || {
                std::fs::remove_file(&cfg5).unwrap();
                loader::resolve(d7.to_str().unwrap(), None, true).map(|_| ())
            }),
            Expect::Model(is_file, &["without config.json", "not a model"]),
        ),
    ]
}

#[test]
fn bad_inputs_table() -> anyhow::Result<()> {
    let rows = model_rows(Path::new(".")).len();
    for i in 0..rows {
        // Each row gets a fresh, valid model to break.
        let dir = crate::util::scratch(&format!("bad-{i}"));
        write_tiny_llama(&dir, false, false)?;
        let (what, run, expect) = model_rows(&dir).swap_remove(i);
        let err = run().err().unwrap_or_else(|| panic!("{what}: no error"));
        let msg = err.to_string();
        let Expect::Model(kind, needles) = expect else {
            unreachable!()
        };
        assert!(kind(&err), "{what}: unexpected kind {err:?}");
        for n in needles {
            assert!(msg.contains(n), "{what}: {msg:?} does not name {n:?}");
        }
    }
    // Budgets: negative, zero, unparsable units, larger than the card, a share without a card.
    let budget_rows: Vec<(&str, Result<u64, OffloadError>, Expect)> = vec![
        (
            "negative",
            MemoryLimit::parse("--gpu-memory-limit", "-2").map(|_| 0),
            Expect::Offload(
                |e| matches!(e, OffloadError::InvalidMemorySize { .. }),
                &["--gpu-memory-limit", "larger than zero"],
            ),
        ),
        (
            "zero",
            MemoryLimit::parse("memory.max_gpu_memory", "0GB").map(|_| 0),
            Expect::Offload(
                |e| matches!(e, OffloadError::InvalidMemorySize { .. }),
                &["memory.max_gpu_memory"],
            ),
        ),
        (
            "unparsable unit",
            MemoryLimit::parse("--gpu-memory-limit", "4 bananas").map(|_| 0),
            Expect::Offload(
                |e| matches!(e, OffloadError::InvalidMemorySize { .. }),
                &["unknown unit"],
            ),
        ),
        (
            "larger than the card",
            MemoryLimit::gib(200.0).resolve("cuda:0", Some(140 << 30)),
            Expect::Offload(
                |e| matches!(e, OffloadError::BudgetExceedsDevice { .. }),
                &["cuda:0", "larger than"],
            ),
        ),
        (
            "a share without a card",
            MemoryLimit::FractionOfDevice(0.5).resolve("cpu", None),
            Expect::Offload(
                |e| matches!(e, OffloadError::InvalidConfig { .. }),
                &["share of the card"],
            ),
        ),
    ];
    // The binaries' flags (`candle_offload_suite::flags`, clap puts the flag's name in front):
    // what each parser refuses and the reason it must give.
    use candle_offload_suite::flags;
    let flag_rows: Vec<(&str, Result<(), String>, &str)> = vec![
        ("--top-p 7", flags::probability("7").map(drop), "(0, 1]"),
        ("--top-p 0", flags::probability("0").map(drop), "(0, 1]"),
        ("--top-p NaN", flags::probability("NaN").map(drop), "(0, 1]"),
        (
            "--temperature -1",
            flags::non_negative("-1").map(drop),
            "zero or more",
        ),
        (
            "--temperature inf",
            flags::non_negative("inf").map(drop),
            "finite",
        ),
        ("--lr 0", flags::positive("0").map(drop), "above zero"),
        ("--lr NaN", flags::positive("NaN").map(drop), "finite"),
        (
            "--max-new-tokens 0",
            flags::at_least_one("0").map(drop),
            "at least 1",
        ),
        (
            "--steps -3",
            flags::at_least_one("-3").map(drop),
            "not a whole number",
        ),
        (
            "--dtype u8",
            flags::float_dtype("u8").map(drop),
            "f32, f16, bf16",
        ),
        (
            "--devices 0,0",
            flags::distinct_devices(&[0, 0]),
            "listed twice",
        ),
        (
            "--devices 1,0,1",
            flags::distinct_devices(&[1, 0, 1]),
            "device 1",
        ),
    ];
    for (what, result, needle) in flag_rows {
        let err = result.err().unwrap_or_else(|| panic!("{what}: no error"));
        assert!(
            err.contains(needle),
            "{what}: {err:?} does not say {needle:?}"
        );
    }
    assert_eq!(flags::probability("1"), Ok(1.0));
    assert_eq!(flags::float_dtype("BF16"), Ok(DType::BF16));
    assert_eq!(flags::distinct_devices(&[1, 0]), Ok(()));

    for (what, result, expect) in budget_rows {
        let err = result.err().unwrap_or_else(|| panic!("{what}: no error"));
        let Expect::Offload(kind, needles) = expect else {
            unreachable!()
        };
        assert!(kind(&err), "{what}: unexpected kind {err:?}");
        for n in needles {
            assert!(
                err.to_string().contains(n),
                "{what}: {err} does not name {n:?}"
            );
        }
    }
    Ok(())
}
