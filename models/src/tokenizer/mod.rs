//! Tokenizers: a `tokenizer.json` (through HF `tokenizers`), or the vocabulary stored in a GGUF
//! file, rebuilt as llama.cpp reads it (`llama`: SentencePiece merged by score, with byte
//! fallback; `gpt2`: byte-level BPE with the pre-tokenizer `tokenizer.ggml.pre` names). One
//! type, [`Tokenizer`], serves the rest of the crate either way.
//!
//! The GGUF tokenizers are written here rather than rebuilt as a `tokenizer.json`: llama.cpp
//! merges SentencePiece pieces by their scores (HF's BPE model merges by rank), splits text
//! with hand-written passes whose edge cases (`\s+(?!\S)` at a piece's end, the category
//! "collapse" of its default and SmolLM pre-tokenizers) no HF pre-tokenizer reproduces, and
//! detokenizes with its own rules (leading space, `clean_spaces`). Token ids must equal
//! llama.cpp's on the same file.

mod bpe;
mod kind;
mod pre;
mod special;
mod spm;
mod vocab;

use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};
use crate::files::{ModelFiles, Weights};
use crate::gguf::gguf_content;
use vocab::{Fragment, Model, Vocab};

pub use pre::SUPPORTED as SUPPORTED_PRE_TOKENIZERS;
pub use vocab::SUPPORTED_MODELS as SUPPORTED_TOKENIZER_MODELS;

/// A tokenizer: from a `tokenizer.json`, or rebuilt from a GGUF file's metadata.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: Inner,
    /// Where it was read from, for messages.
    source: PathBuf,
}

#[derive(Debug, Clone)]
enum Inner {
    Json(Box<tokenizers::Tokenizer>),
    Gguf(Box<Vocab>),
}

impl Tokenizer {
    /// Reads `path`: a GGUF file (by its `.gguf` extension or magic) or a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(ModelError::file(
                path,
                "is not a file (want a tokenizer.json or a GGUF file)",
            ));
        }
        let mut magic = [0u8; 4];
        let is_gguf = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
            || std::fs::File::open(path)
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
                .is_ok_and(|_| &magic == b"GGUF");
        if is_gguf {
            Self::from_gguf(path)
        } else {
            Self::from_json(path)
        }
    }

    /// Reads a `tokenizer.json`.
    pub fn from_json(path: &Path) -> Result<Self> {
        let t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| ModelError::file(path, format!("not a valid tokenizer.json: {e}")))?;
        Ok(Self {
            inner: Inner::Json(Box::new(t)),
            source: path.to_path_buf(),
        })
    }

    /// Rebuilds the tokenizer stored in a GGUF file's metadata.
    pub fn from_gguf(path: &Path) -> Result<Self> {
        let (c, _) = gguf_content(path)?;
        Ok(Self {
            inner: Inner::Gguf(Box::new(Vocab::from_gguf(&c, path)?)),
            source: path.to_path_buf(),
        })
    }

    /// What it is, for messages: `tokenizer.json`, or the GGUF tokenizer model and
    /// pre-tokenizer.
    pub fn describe(&self) -> String {
        match &self.inner {
            Inner::Json(_) => "tokenizer.json".into(),
            Inner::Gguf(v) => match (&v.model, &v.pre) {
                (Model::Spm, _) => "GGUF llama (SentencePiece)".into(),
                (Model::Bpe, Some(p)) => format!("GGUF gpt2 (byte-level BPE, pre {})", p.name),
                (Model::Bpe, None) => "GGUF gpt2 (byte-level BPE)".into(),
            },
        }
    }

    /// The file it was read from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The `tokenizers` tokenizer, when read from a `tokenizer.json`.
    pub fn as_json(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.inner {
            Inner::Json(t) => Some(t),
            Inner::Gguf(_) => None,
        }
    }

    /// The ids of `text`. Special tokens written in the text (`<|im_start|>`, `<s>`) are
    /// matched whole. With `add_special`, the tokens the model adds around a text (BOS, and EOS
    /// where `add_eos_token` says so; a `tokenizer.json`'s post-processor) are added.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Json(t) => t
                .encode(text, add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| ModelError::file(&self.source, format!("cannot tokenize: {e}"))),
            Inner::Gguf(v) => Ok(encode_gguf(v, text, add_special)),
        }
    }

    /// The ids of a prompt: [`Self::encode`] with the model's added tokens, and one BOS where
    /// the text already starts with it (a chat template that writes `<s>`), as llama.cpp does.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode(text, true)?;
        if let Some(bos) = self.bos_added() {
            if ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
                ids.remove(0);
            }
        }
        Ok(ids)
    }

    /// The text of `ids`; with `skip_special`, control tokens (and the BOS/EOS the model adds)
    /// are left out. Invalid UTF-8 (a character cut between tokens) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.inner {
            Inner::Json(t) => t
                .decode(ids, skip_special)
                .map_err(|e| ModelError::file(&self.source, format!("cannot decode: {e}"))),
            Inner::Gguf(v) => {
                let bytes = v.detokenize(ids, skip_special, !skip_special);
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    /// The vocabulary's text of token `id`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.inner {
            Inner::Json(t) => t.id_to_token(id),
            Inner::Gguf(v) => v.text(id).map(String::from),
        }
    }

    /// The id of the token whose vocabulary text is `token`.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Inner::Json(t) => t.token_to_id(token),
            Inner::Gguf(v) => v.id(token),
        }
    }

    /// The number of tokens, added ones included.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Json(t) => t.get_vocab_size(true),
            Inner::Gguf(v) => v.len(),
        }
    }

    /// The BOS token, when the model adds one to a text it encodes (GGUF
    /// `tokenizer.ggml.add_bos_token`; for a `tokenizer.json`, its post-processor's first token).
    pub fn bos_added(&self) -> Option<u32> {
        match &self.inner {
            Inner::Json(t) => {
                let with = t.encode("a", true).ok()?;
                let without = t.encode("a", false).ok()?;
                (with.get_ids().len() > without.get_ids().len()
                    && with.get_ids().first() != without.get_ids().first())
                .then(|| with.get_ids()[0])
            }
            Inner::Gguf(v) => v.bos.filter(|_| v.add_bos),
        }
    }

    /// Tokens that end a generation, as llama.cpp lists them for a GGUF vocabulary: EOS, end
    /// of turn (`<end_of_turn>`, `<|im_end|>`, `<|eot_id|>`), end of message, and the other
    /// texts it knows. Empty for a `tokenizer.json`.
    pub fn end_of_generation(&self) -> Vec<u32> {
        match &self.inner {
            Inner::Json(_) => Vec::new(),
            Inner::Gguf(v) => v.end_ids(),
        }
    }

    /// Writes the tokenizer into the model directory `dir`, as the loader reads it back: a
    /// `tokenizer.json` for one read from a `tokenizer.json`; for one rebuilt from a GGUF file,
    /// a vocabulary-only `tokenizer.gguf` holding that file's `tokenizer.*` metadata as it is
    /// (no `tokenizer.json` can say what llama.cpp's tokenizers do). Returns the file written.
    pub fn save(&self, dir: &Path) -> Result<PathBuf> {
        match &self.inner {
            Inner::Json(t) => {
                let path = dir.join(TOKENIZER_JSON);
                t.save(&path, false)
                    .map_err(|e| ModelError::file(&path, format!("cannot write: {e}")))?;
                Ok(path)
            }
            Inner::Gguf(_) => {
                let path = dir.join(TOKENIZER_GGUF);
                write_vocab_gguf(&self.source, &path)?;
                Ok(path)
            }
        }
    }
}

/// The file name of a model directory's tokenizer in HF's format.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// The file name of a model directory's vocabulary-only GGUF ([`Tokenizer::save`]).
pub const TOKENIZER_GGUF: &str = "tokenizer.gguf";

/// Copies `source`'s `tokenizer.*` metadata (and `general.name`) into a GGUF file with no
/// tensors at `dest`.
fn write_vocab_gguf(source: &Path, dest: &Path) -> Result<()> {
    let (c, _) = gguf_content(source)?;
    let mut keys: Vec<&String> = c
        .metadata
        .keys()
        .filter(|k| k.starts_with("tokenizer.") || k.as_str() == "general.name")
        .collect();
    keys.sort();
    let metadata: Vec<(&str, &candle_core::quantized::gguf_file::Value)> =
        keys.iter().map(|k| (k.as_str(), &c.metadata[*k])).collect();
    let mut out = std::fs::File::create(dest)
        .map_err(|e| ModelError::file(dest, format!("cannot create: {e}")))?;
    candle_core::quantized::gguf_file::write(&mut out, &metadata, &[])
        .map_err(|e| ModelError::file(dest, format!("cannot write: {e}")))
}

fn encode_gguf(v: &Vocab, text: &str, add_special: bool) -> Vec<u32> {
    let mut out = Vec::new();
    let add_bos = add_special && v.add_bos && v.bos.is_some();
    if add_bos {
        out.extend(v.bos);
    }
    let frags = if text.is_empty() {
        Vec::new()
    } else {
        v.partition(text)
    };
    // SentencePiece: a space before the text, and before text right after a special token.
    let mut prev_special = true;
    for f in frags {
        match f {
            Fragment::Token(id) => {
                out.push(id);
                prev_special = true;
            }
            Fragment::Text(t) => {
                match v.model {
                    Model::Spm => {
                        let mut s = String::with_capacity(t.len() + 3);
                        if v.add_space_prefix && prev_special {
                            s.push(' ');
                        }
                        s.push_str(t);
                        spm::tokenize(v, &s.replace(' ', "\u{2581}"), &mut out);
                    }
                    Model::Bpe => bpe::tokenize(v, t, &mut out),
                }
                prev_special = false;
            }
        }
    }
    if add_special && v.add_eos {
        out.extend(v.eos);
    }
    out
}

/// The tokenizer of a model: `--tokenizer`'s file if given (`override_file`), else its
/// `tokenizer.json`, else the one in its GGUF file's metadata (or, for safetensors weights,
/// in a `tokenizer.gguf` beside them: [`Tokenizer::save`]). A GGUF whose tokenizer this
/// crate cannot rebuild uses a `tokenizer.json` beside it, if there is one.
pub fn load(files: &ModelFiles, override_file: Option<&Path>) -> Result<Tokenizer> {
    if let Some(p) = override_file {
        return Tokenizer::from_file(p);
    }
    if let Some(p) = &files.tokenizer_json {
        return Tokenizer::from_json(p);
    }
    match &files.weights {
        Weights::Gguf(path) => match Tokenizer::from_gguf(path) {
            Ok(t) => Ok(t),
            Err(e @ ModelError::Config { .. }) => {
                let beside = path.with_file_name("tokenizer.json");
                if beside.is_file() {
                    tracing::warn!("{e}; using {}", beside.display());
                    Tokenizer::from_json(&beside)
                } else {
                    Err(e)
                }
            }
            Err(e) => Err(e),
        },
        Weights::Safetensors(paths) => {
            // A model saved from a GGUF-tokenized one keeps its vocabulary as `tokenizer.gguf`.
            let beside = paths.first().map(|p| p.with_file_name(TOKENIZER_GGUF));
            match beside {
                Some(p) if p.is_file() => Tokenizer::from_gguf(&p),
                _ => Err(ModelError::Source {
                    id: files.origin.clone(),
                    reason: "has no tokenizer.json (pass one with --tokenizer)".into(),
                }),
            }
        }
    }
}
