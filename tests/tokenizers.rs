//! Tokenizers rebuilt from GGUF metadata against llama.cpp's: the ids `llama-tokenize` gives
//! on the same vocabulary-only GGUFs (fixtures/tokenizers, made by
//! scripts/tokenizer_fixtures.py) for a corpus of ASCII, whitespace runs, numbers, code,
//! accents, CJK, emoji, byte-fallback text and special tokens; decoding back to the text; the
//! default model's BPE; errors for what is not supported; and a random-weight GGUF with the real
//! Llama 2 vocabulary through generate's path.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_offload_models::generation::{generate, TokenStream};
use candle_offload_models::tokenizer;
use candle_offload_models::{loader, Llama, Tokenizer};
use candle_transformers::generation::LogitsProcessor;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers")
}

/// The fixture GGUF `name`, decompressed (with `xz`) into a directory shared by runs, under a
/// name that changes with the compressed file.
fn fixture_gguf(name: &str) -> PathBuf {
    let src = fixtures().join(format!("{name}.gguf.xz"));
    let len = std::fs::metadata(&src)
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
        .len();
    let out = tempfile_dir("fixtures").join(format!("{name}-{len}.gguf"));
    if !out.is_file() {
        let data = std::process::Command::new("xz")
            .arg("-dc")
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("cannot run xz to decompress {}: {e}", src.display()));
        assert!(data.status.success(), "xz -dc {} failed", src.display());
        let tmp = out.with_extension(format!(
            "{}-{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&tmp, data.stdout).unwrap();
        std::fs::rename(&tmp, &out).unwrap();
    }
    out
}

/// The corpus and, per vocabulary, llama.cpp's ids for each text.
struct Expected {
    texts: Vec<String>,
    vocabs: HashMap<String, Vec<Vec<u32>>>,
}

fn expected() -> &'static Expected {
    static E: OnceLock<Expected> = OnceLock::new();
    E.get_or_init(|| {
        let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let texts = v["texts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect();
        let vocabs = v["vocabs"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(name, ids)| {
                let ids = serde_json::from_value(ids["llamacpp"].clone()).unwrap();
                (name.clone(), ids)
            })
            .collect();
        Expected { texts, vocabs }
    })
}

/// Every corpus text encodes to llama.cpp's ids and decodes back to itself.
fn check(name: &str, tok: &Tokenizer) {
    let e = expected();
    let want = &e.vocabs[name];
    assert_eq!(want.len(), e.texts.len());
    let mut wrong = Vec::new();
    for (text, ids) in e.texts.iter().zip(want) {
        let got = tok.encode(text, true).unwrap();
        if &got != ids {
            wrong.push(format!(
                "{text:?}:\n  ours      {got:?}\n  llama.cpp {ids:?}"
            ));
            continue;
        }
        // SentencePiece adds a space after a special token: such texts do not round-trip.
        if ["<s>", "<|", "<start_of_turn>"]
            .iter()
            .any(|s| text.contains(s))
        {
            continue;
        }
        let plain = tok.encode(text, false).unwrap();
        let back = tok.decode(&plain, false).unwrap();
        if &back != text {
            wrong.push(format!("{text:?}: decodes to {back:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{name}: {} of {} texts:\n{}",
        wrong.len(),
        e.texts.len(),
        wrong.join("\n")
    );
}

fn check_fixture(name: &str) -> Tokenizer {
    let tok = Tokenizer::from_gguf(&fixture_gguf(name)).unwrap();
    check(name, &tok);
    tok
}

#[test]
fn trained_sentencepiece_matches_llama_cpp() {
    let tok = check_fixture("spm-trained");
    assert_eq!(tok.describe(), "GGUF llama (SentencePiece)");
}

#[test]
fn llama2_matches_llama_cpp() {
    let tok = check_fixture("llama2");
    // SentencePiece's space prefix, byte fallback for a character outside the vocabulary.
    let id = |t: &str| tok.token_to_id(t).unwrap();
    assert_eq!(
        tok.encode("Hello world", true).unwrap(),
        [1, id("\u{2581}Hello"), id("\u{2581}world")]
    );
    let ids = tok.encode("\u{1D518}", false).unwrap();
    assert!(ids[1..].iter().all(|&i| (3..259).contains(&i)), "{ids:?}");
}

#[test]
fn gemma3_matches_llama_cpp() {
    let tok = check_fixture("gemma3");
    // The end of a turn stops a generation.
    let eot = tok.token_to_id("<end_of_turn>").unwrap();
    assert!(tok.end_of_generation().contains(&eot));
}

#[test]
fn qwen3_matches_llama_cpp() {
    let tok = check_fixture("qwen3");
    assert_eq!(tok.describe(), "GGUF gpt2 (byte-level BPE, pre qwen2)");
}

#[test]
fn smollm2_bpe_matches_llama_cpp_and_splits_digits() {
    let gguf = loader::default_model_gguf(false).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    assert_eq!(tok.describe(), "GGUF gpt2 (byte-level BPE, pre smollm)");
    check("smollm", &tok);
    let ids = tok.encode("12345", false).unwrap();
    assert_eq!(ids.len(), 5, "one token per digit: {ids:?}");
}

/// A GGUF holding only `metadata` (and no tensors).
fn write_gguf(path: &Path, metadata: &[(&str, Value)]) {
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md, &[]).unwrap();
}

fn strings(v: &[&str]) -> Value {
    Value::Array(v.iter().map(|s| Value::String(s.to_string())).collect())
}

#[test]
fn unsupported_tokenizers_are_errors_naming_them() {
    let dir = tempfile_dir("unsupported");
    let pre = dir.join(format!("pre-{}.gguf", std::process::id()));
    write_gguf(
        &pre,
        &[
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("no-such-pre".into())),
            ("tokenizer.ggml.tokens", strings(&["a", "b", "ab"])),
            ("tokenizer.ggml.merges", strings(&["a b"])),
        ],
    );
    let e = Tokenizer::from_gguf(&pre).unwrap_err().to_string();
    assert!(
        e.contains("no-such-pre") && e.contains("smollm") && e.contains("tokenizer.ggml.pre"),
        "{e}"
    );
    let model = dir.join(format!("model-{}.gguf", std::process::id()));
    write_gguf(
        &model,
        &[
            ("tokenizer.ggml.model", Value::String("bert".into())),
            ("tokenizer.ggml.tokens", strings(&["a"])),
        ],
    );
    let e = Tokenizer::from_gguf(&model).unwrap_err().to_string();
    assert!(e.contains("\"bert\"") && e.contains("gpt2"), "{e}");
    // A bad --tokenizer file is an error naming it.
    let bad = dir.join(format!("tokenizer-{}.json", std::process::id()));
    std::fs::write(&bad, "{ not json").unwrap();
    let files = loader::from_gguf(&llama2_model()).unwrap();
    let e = tokenizer::load(&files, Some(&bad)).unwrap_err().to_string();
    assert!(e.contains(&bad.display().to_string()), "{e}");
    let missing = dir.join("missing.json");
    let e = tokenizer::load(&files, Some(&missing))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.json"), "{e}");
}

#[test]
fn byte_level_bpe_from_metadata_merges_by_rank() {
    let dir = tempfile_dir("bpe");
    let path = dir.join(format!("bpe-{}.gguf", std::process::id()));
    // Ranks: "a b" before "b c": "abc" is "ab" + "c".
    write_gguf(
        &path,
        &[
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("gpt-2".into())),
            (
                "tokenizer.ggml.tokens",
                strings(&["a", "b", "c", "ab", "bc", "Ġ", "Ġa"]),
            ),
            ("tokenizer.ggml.merges", strings(&["a b", "b c", "Ġ a"])),
        ],
    );
    let tok = Tokenizer::from_gguf(&path).unwrap();
    assert_eq!(tok.encode("abc a", false).unwrap(), [3, 2, 6]);
    assert_eq!(tok.decode(&[3, 2, 6], false).unwrap(), "abc a");
}

/// `tok-NAME` in [`crate::util::shared_dir`] (the same for every run: tests write there under
/// fixed names, replaced atomically).
fn tempfile_dir(name: &str) -> PathBuf {
    crate::util::shared_dir(&format!("tok-{name}"))
}

/// A random-weight LLaMA GGUF (one layer, hidden 32) with `vocab`'s tokenizer metadata.
fn random_llama_with_vocab(vocab: &Path, out: &Path) -> anyhow::Result<()> {
    let mut f = std::fs::File::open(vocab)?;
    let c = gguf_file::Content::read(&mut f)?;
    let n = c.metadata["tokenizer.ggml.tokens"].to_vec()?.len();
    let (hidden, inter, heads) = (32usize, 64usize, 2usize);
    let mut md: Vec<(String, Value)> = c
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, v) in [
        ("general.architecture", Value::String("llama".into())),
        ("llama.embedding_length", Value::U32(hidden as u32)),
        ("llama.feed_forward_length", Value::U32(inter as u32)),
        ("llama.block_count", Value::U32(1)),
        ("llama.attention.head_count", Value::U32(heads as u32)),
        ("llama.attention.head_count_kv", Value::U32(heads as u32)),
        ("llama.context_length", Value::U32(128)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
    ] {
        md.push((k.into(), v));
    }
    let dev = Device::Cpu;
    let t = |rows: usize, cols: usize| -> anyhow::Result<QTensor> {
        let w = Tensor::randn(0f32, 0.5, (rows, cols), &dev)?;
        Ok(QTensor::quantize(&w, GgmlDType::F32)?)
    };
    let ones = |cols: usize| -> anyhow::Result<QTensor> {
        Ok(QTensor::quantize(
            &Tensor::ones(cols, DType::F32, &dev)?,
            GgmlDType::F32,
        )?)
    };
    let tensors: Vec<(String, QTensor)> = vec![
        ("token_embd.weight".into(), t(n, hidden)?),
        ("blk.0.attn_norm.weight".into(), ones(hidden)?),
        ("blk.0.attn_q.weight".into(), t(hidden, hidden)?),
        ("blk.0.attn_k.weight".into(), t(hidden, hidden)?),
        ("blk.0.attn_v.weight".into(), t(hidden, hidden)?),
        ("blk.0.attn_output.weight".into(), t(hidden, hidden)?),
        ("blk.0.ffn_norm.weight".into(), ones(hidden)?),
        ("blk.0.ffn_gate.weight".into(), t(inter, hidden)?),
        ("blk.0.ffn_up.weight".into(), t(inter, hidden)?),
        ("blk.0.ffn_down.weight".into(), t(hidden, inter)?),
        ("output_norm.weight".into(), ones(hidden)?),
    ];
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let named: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, q)| (k.as_str(), q)).collect();
    let mut out = std::fs::File::create(out)?;
    gguf_file::write(&mut out, &md, &named)?;
    Ok(())
}

/// The GGUF made by [`random_llama_with_vocab`] from the Llama 2 vocabulary, once per process.
fn llama2_model() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let out = tempfile_dir("model").join("llama2-random.gguf");
        let tmp = out.with_extension(format!("{}.tmp", std::process::id()));
        random_llama_with_vocab(&fixture_gguf("llama2"), &tmp).unwrap();
        std::fs::rename(&tmp, &out).unwrap();
        out
    })
    .clone()
}

#[test]
fn a_gguf_with_the_llama2_vocabulary_tokenizes_and_decodes_in_generate() -> anyhow::Result<()> {
    let gguf = llama2_model();
    let files = loader::from_gguf(&gguf)?;
    assert!(files.tokenizer_json.is_none());
    let tok = loader::load_tokenizer(&files)?;
    let prompt = "The capital of France is";
    let ids = tok.encode_prompt(prompt)?;
    // BOS (add_bos_token), then the text with SentencePiece's space prefix.
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids[1..], true)?, prompt);
    // A prompt that already starts with BOS (a chat template's `<s>`) keeps one.
    assert_eq!(
        tok.encode_prompt("<s>[INST] Hi [/INST]")?
            .iter()
            .filter(|&&i| i == 1)
            .count(),
        1
    );
    let store = Arc::new(loader::load_store(&files, DType::F32, &Device::Cpu, None)?);
    let model = Llama::builder(&files, store)
        .dtype(DType::F32)
        .max_len(ids.len() + 8)
        .build()?;
    let mut sampler = LogitsProcessor::new(0, None, None);
    let mut stream = TokenStream::new(&tok);
    let mut text = String::new();
    let (tokens, _) = generate(&model, &ids, 8, &mut sampler, &[], |t| {
        if let Some(s) = stream.next_token(t)? {
            text.push_str(&s);
        }
        Ok(())
    })?;
    if let Some(rest) = stream.rest()? {
        text.push_str(&rest);
    }
    assert_eq!(tokens.len(), 8);
    // The streamed text is the decoded text of the tokens (spaces between words kept).
    assert_eq!(text, tok.decode(&tokens, true)?);
    assert!(!text.is_empty());
    Ok(())
}

/// A GGUF tokenizer saved into a model directory (`tokenizer.gguf`, what `finetune` writes)
/// reads back as the same tokenizer, and the loader finds it beside safetensors weights.
#[test]
fn a_saved_gguf_tokenizer_reads_back_the_same() {
    for name in ["qwen3", "llama2"] {
        let tok = Tokenizer::from_gguf(&fixture_gguf(name)).unwrap();
        let dir = tempfile_dir(&format!("saved-{name}"));
        let path = tok.save(&dir).unwrap();
        assert_eq!(path, dir.join(tokenizer::TOKENIZER_GGUF));
        let back = Tokenizer::from_gguf(&path).unwrap();
        check(name, &back);
        assert_eq!(back.describe(), tok.describe());
        assert_eq!(back.bos_added(), tok.bos_added());
        assert_eq!(back.end_of_generation(), tok.end_of_generation());
        // Beside safetensors weights (no tokenizer.json), the loader takes it.
        crate::models::write_tiny_llama(&dir, false, false).unwrap();
        let files = loader::from_dir(&dir).unwrap();
        let found = tokenizer::load(&files, None).unwrap();
        assert_eq!(found.source(), path.as_path());
    }
}
