//! A GGUF file's vocabulary (`tokenizer.ggml.*`), read as llama.cpp reads it: tokens, scores,
//! token types, merges, the special ids and flags; the split of text around special tokens
//! before tokenization; and decoding.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};

use super::kind::Kind;
use super::pre::{byte_chars, PreTokenizer, SUPPORTED};
use super::special;
use crate::error::{ModelError, Result};

/// `tokenizer.ggml.model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Model {
    /// `llama`: SentencePiece.
    Spm,
    /// `gpt2`: byte-level BPE.
    Bpe,
}

/// The `tokenizer.ggml.model` names this crate reads, for messages.
pub const SUPPORTED_MODELS: &str = "llama (SentencePiece), gpt2 (byte-level BPE)";

#[derive(Debug, Clone)]
pub(crate) struct Vocab {
    pub model: Model,
    pub pre: Option<PreTokenizer>,
    tokens: Vec<String>,
    scores: Vec<f32>,
    kinds: Vec<Kind>,
    /// Special tokens stripped of spaces on their right (left) when matched in text.
    rstrip: Vec<bool>,
    lstrip: Vec<bool>,
    ids: HashMap<String, u32>,
    merges: HashMap<String, u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    /// Tokens that end generation (EOS, end of turn, ...).
    end: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    pub clean_spaces: bool,
    /// Control, user-defined and unknown tokens, longest first: matched whole in text.
    specials: Vec<u32>,
}

fn strings(c: &Content, path: &Path, key: &str) -> Result<Option<Vec<String>>> {
    let Some(v) = c.metadata.get(key) else {
        return Ok(None);
    };
    let list = v.to_vec().map_err(|e| ModelError::config(path, key, e))?;
    list.iter()
        .map(|v| {
            v.to_string()
                .cloned()
                .map_err(|e| ModelError::config(path, key, e))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn numbers<T>(
    c: &Content,
    path: &Path,
    key: &str,
    n: usize,
    read: impl Fn(&Value) -> Option<T>,
) -> Result<Option<Vec<T>>> {
    let Some(v) = c.metadata.get(key) else {
        return Ok(None);
    };
    let list = v.to_vec().map_err(|e| ModelError::config(path, key, e))?;
    if list.len() < n {
        return Err(ModelError::config(
            path,
            key,
            format!("has {} entries for {n} tokens", list.len()),
        ));
    }
    list.iter()
        .map(|v| read(v).ok_or_else(|| ModelError::config(path, key, format!("bad entry {v:?}"))))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn flag(c: &Content, path: &Path, key: &str) -> Result<Option<bool>> {
    c.metadata
        .get(key)
        .map(|v| v.to_bool().map_err(|e| ModelError::config(path, key, e)))
        .transpose()
}

impl Vocab {
    /// Reads the vocabulary of the GGUF file at `path` (header `c`).
    pub(crate) fn from_gguf(c: &Content, path: &Path) -> Result<Self> {
        let key = "tokenizer.ggml.model";
        let name = c
            .metadata
            .get(key)
            .ok_or_else(|| ModelError::config(path, key, "is missing"))?
            .to_string()
            .map_err(|e| ModelError::config(path, key, e))?
            .clone();
        let model = match name.as_str() {
            "llama" => Model::Spm,
            "gpt2" => Model::Bpe,
            other => {
                return Err(ModelError::config(
                    path,
                    key,
                    format!(
                        "tokenizer model {other:?} is not supported (supported: \
                         {SUPPORTED_MODELS}); pass a tokenizer.json with --tokenizer"
                    ),
                ))
            }
        };
        let pre_name = match c.metadata.get("tokenizer.ggml.pre") {
            Some(v) => Some(
                v.to_string()
                    .map_err(|e| ModelError::config(path, "tokenizer.ggml.pre", e))?
                    .clone(),
            ),
            None => None,
        };
        let pre = match model {
            Model::Spm => None,
            Model::Bpe => Some(PreTokenizer::named(pre_name.as_deref()).ok_or_else(|| {
                ModelError::config(
                    path,
                    "tokenizer.ggml.pre",
                    format!(
                        "pre-tokenizer {:?} is not supported (supported: {SUPPORTED}); pass a \
                         tokenizer.json with --tokenizer",
                        pre_name.as_deref().unwrap_or_default()
                    ),
                )
            })?),
        };
        let mut tokens = strings(c, path, "tokenizer.ggml.tokens")?
            .ok_or_else(|| ModelError::config(path, "tokenizer.ggml.tokens", "is missing"))?;
        let n = tokens.len();
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]");
            }
        }
        let scores = numbers(c, path, "tokenizer.ggml.scores", n, |v| match v {
            Value::F32(x) => Some(*x),
            Value::I32(x) => Some(*x as f32),
            _ => None,
        })?
        .unwrap_or_else(|| vec![0.0; n]);
        let mut kinds = numbers(c, path, "tokenizer.ggml.token_type", n, |v| match v {
            Value::I32(x) => Some(Kind::from_gguf(*x)),
            _ => None,
        })?
        .unwrap_or_else(|| vec![Kind::Normal; n]);
        kinds.truncate(n);
        let mut ids = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            ids.insert(t.clone(), i as u32);
        }
        let mut merges = HashMap::new();
        if model == Model::Bpe {
            let list = strings(c, path, "tokenizer.ggml.merges")?
                .ok_or_else(|| ModelError::config(path, "tokenizer.ggml.merges", "is missing"))?;
            merges.reserve(list.len());
            for (rank, m) in list.into_iter().enumerate() {
                // llama.cpp splits at the first space after the first byte.
                let key = match m.as_bytes().iter().skip(1).any(|&b| b == b' ') {
                    true => m,
                    false => " ".to_string(),
                };
                merges.entry(key).or_insert(rank as u32);
            }
        }
        let id = |k: &str| -> Result<Option<u32>> {
            match c.metadata.get(k) {
                None => Ok(None),
                Some(v) => v
                    .to_u32()
                    .map(Some)
                    .map_err(|e| ModelError::config(path, k, e)),
            }
        };
        let in_range = |i: Option<u32>| i.filter(|&i| (i as usize) < n);
        // llama.cpp's defaults, then the file's values where it has them (in range).
        let (bos0, eos0, unk0) = match model {
            Model::Spm => (Some(1), Some(2), Some(0)),
            Model::Bpe => (Some(11), Some(11), None),
        };
        let pick = |k: &str, default: Option<u32>| -> Result<Option<u32>> {
            Ok(in_range(id(k)?).or(in_range(default)))
        };
        let bos = pick("tokenizer.ggml.bos_token_id", bos0)?;
        let eos = pick("tokenizer.ggml.eos_token_id", eos0)?;
        let unk = pick("tokenizer.ggml.unknown_token_id", unk0)?;
        let (add_bos0, add_space_prefix0, clean_spaces) = match (&model, &pre) {
            (Model::Spm, _) => (true, true, false),
            (Model::Bpe, Some(p)) => (p.add_bos, false, p.clean_spaces),
            (Model::Bpe, None) => (false, false, true),
        };
        let add_bos = flag(c, path, "tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos0);
        let add_eos = flag(c, path, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let add_space_prefix = match model {
            Model::Spm => {
                flag(c, path, "tokenizer.ggml.add_space_prefix")?.unwrap_or(add_space_prefix0)
            }
            Model::Bpe => false,
        };
        let mut named = HashMap::new();
        for k in [
            "eot", "eom", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep",
            "prefix", "suffix", "middle",
        ] {
            if let Some(i) = pick(&format!("tokenizer.ggml.{k}_token_id"), None)? {
                named.insert(k, i);
            }
        }
        let end = special::mark(&ids, &mut kinds, |k| named.get(k).copied(), eos);
        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                matches!(
                    kinds[i as usize],
                    Kind::Control | Kind::UserDefined | Kind::Unknown
                )
            })
            .collect();
        specials.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));
        let mut rstrip = vec![false; n];
        let lstrip = vec![false; n];
        // llama.cpp's one rule by model name: Phi-3's special tokens eat the spaces after them.
        let general_name = c
            .metadata
            .get("general.name")
            .and_then(|v| v.to_string().ok())
            .map(|s| s.to_lowercase())
            .unwrap_or_default();
        if general_name.contains("phi-3") || general_name.contains("phi3") {
            for &i in &specials {
                rstrip[i as usize] = true;
            }
            for (t, on) in [
                ("</s>", true),
                ("<unk>", false),
                ("<s>", false),
                ("<|endoftext|>", false),
            ] {
                if let Some(&i) = ids.get(t) {
                    rstrip[i as usize] = on;
                }
            }
        }
        Ok(Self {
            model,
            pre,
            tokens,
            scores,
            kinds,
            rstrip,
            lstrip,
            ids,
            merges,
            bos,
            eos,
            unk,
            end,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            specials,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    pub(crate) fn text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub(crate) fn kind(&self, id: u32) -> Option<Kind> {
        self.kinds.get(id as usize).copied()
    }

    pub(crate) fn score(&self, id: u32) -> f32 {
        self.scores[id as usize]
    }

    pub(crate) fn merge_rank(&self, a: &str, b: &str) -> Option<u32> {
        let mut k = String::with_capacity(a.len() + b.len() + 1);
        k.push_str(a);
        k.push(' ');
        k.push_str(b);
        self.merges.get(&k).copied()
    }

    /// The token of one byte: `<0xXX>`, else the byte as text, else the unknown token.
    pub(crate) fn byte_token(&self, b: u8) -> u32 {
        self.id(&format!("<0x{b:02X}>"))
            .or_else(|| std::str::from_utf8(&[b]).ok().and_then(|t| self.id(t)))
            .or(self.unk)
            .unwrap_or(0)
    }

    /// The tokens that end generation: EOS, end of turn, end of message.
    pub(crate) fn end_ids(&self) -> Vec<u32> {
        self.end.clone()
    }

    /// Splits `text` around the special tokens it contains (longest first): text fragments
    /// and token ids, in order.
    pub(crate) fn partition<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        let mut frags = vec![Fragment::Text(text)];
        for &id in &self.specials {
            let special = self.tokens[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Fragment::Text(mut rest) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = rest.find(special) {
                    let mut left = &rest[..at];
                    if self.lstrip[id as usize] {
                        left = left.trim_end_matches(is_c_space);
                    }
                    if !left.is_empty() {
                        next.push(Fragment::Text(left));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + special.len()..];
                    if self.rstrip[id as usize] {
                        rest = rest.trim_start_matches(is_c_space);
                    }
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            frags = next;
        }
        frags
    }

    /// The bytes of one token; control and unknown tokens only if `special`.
    fn piece(&self, id: u32, special: bool) -> Vec<u8> {
        let (Some(text), Some(kind)) = (self.text(id), self.kind(id)) else {
            return Vec::new();
        };
        match kind {
            Kind::Control | Kind::Unknown if !special => Vec::new(),
            Kind::Control | Kind::Unknown | Kind::UserDefined => text.as_bytes().to_vec(),
            Kind::Normal => match self.model {
                Model::Spm => text.replace('\u{2581}', " ").into_bytes(),
                Model::Bpe => decode_byte_level(text),
            },
            Kind::Byte => match self.model {
                Model::Spm => text
                    .strip_prefix("<0x")
                    .and_then(|h| h.strip_suffix('>'))
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .map(|b| vec![b])
                    .unwrap_or_default(),
                Model::Bpe => decode_byte_level(text),
            },
            Kind::Unused | Kind::Undefined => Vec::new(),
        }
    }

    /// The bytes of `ids`, as llama.cpp detokenizes: with `remove_special`, a leading BOS and
    /// trailing EOS the model adds are dropped; with `special`, control tokens are written.
    pub(crate) fn detokenize(
        &self,
        mut ids: &[u32],
        remove_special: bool,
        special: bool,
    ) -> Vec<u8> {
        let mut remove_space = self.add_space_prefix;
        if remove_special && self.add_bos && !ids.is_empty() && ids.first() == self.bos.as_ref() {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special && self.add_eos && ids.last().is_some() && ids.last() == self.eos.as_ref()
        {
            ids = &ids[..ids.len() - 1];
        }
        let mut out = Vec::new();
        for &id in ids {
            let p = self.piece(id, special);
            let p = if remove_space && p.first() == Some(&b' ') {
                &p[1..]
            } else {
                &p[..]
            };
            out.extend_from_slice(p);
            remove_space = false;
        }
        if self.clean_spaces {
            out = clean_spaces(&out);
        }
        out
    }
}

/// A piece of text to tokenize, or a special token found whole in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// C's `isspace`.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0B' | '\x0C' | '\r')
}

/// GPT-2's printable chars back to bytes; a char outside the map is written as llama.cpp does.
fn decode_byte_level(text: &str) -> Vec<u8> {
    let (_, back) = byte_chars();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match back.get(&c) {
            Some(&b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut utf8 = [0u8; 4];
                for b in c.encode_utf8(&mut utf8).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// llama.cpp's `clean_spaces`: no space before `?!.,`, around a lone `'`, or before `'s`,
/// `'m`, `'re`, `'ve`.
fn clean_spaces(t: &[u8]) -> Vec<u8> {
    // " ?", " !", " .", " ,"
    let mut a: Vec<u8> = Vec::with_capacity(t.len());
    for (i, &x) in t.iter().enumerate() {
        if i > 0 && t[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            a.pop();
        }
        a.push(x);
    }
    // " ' "
    let mut b: Vec<u8> = Vec::with_capacity(a.len());
    let mut i = 0;
    while i < a.len() {
        let x = a[i];
        if i > 0 && x == b'\'' && i + 1 < a.len() && a[i - 1] == b' ' && a[i + 1] == b' ' {
            b.pop();
            b.push(x);
            // llama.cpp blanks the space it skips: it no longer counts for the next char.
            a[i + 1] = 0;
            i += 2;
            continue;
        }
        b.push(x);
        i += 1;
    }
    // " 's", " 'm", " 're", " 've"
    let mut c: Vec<u8> = Vec::with_capacity(b.len());
    for i in 0..b.len() {
        let x = b[i];
        if i > 0 && b[i - 1] == b' ' && x == b'\'' && i + 1 < b.len() {
            let x1 = b[i + 1];
            let drop = match x1 {
                b's' | b'm' => true,
                b'r' | b'v' => i + 2 < b.len() && b[i + 2] == b'e',
                _ => false,
            };
            if drop {
                c.pop();
            }
        }
        c.push(x);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_spaces_follows_llama_cpp() {
        let s = |t: &str| String::from_utf8(clean_spaces(t.as_bytes())).unwrap();
        assert_eq!(s("Hi , you . It 's a ' b"), "Hi, you. It's a'b");
        assert_eq!(s("we 're ok"), "we're ok");
        assert_eq!(s("don 't"), "don 't");
    }
}
