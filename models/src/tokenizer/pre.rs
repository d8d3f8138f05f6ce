//! Pre-tokenizers of byte-level BPE vocabularies (`tokenizer.ggml.pre`), as llama.cpp splits
//! text before merging: the GPT-2, Llama 3 and Qwen2 patterns, the digit splits of SmolLM and
//! of the default pre-tokenizer, with the Unicode classes llama.cpp uses (general categories
//! and `White_Space`, from `regex-syntax`'s Unicode tables).

use std::ops::Range;
use std::sync::OnceLock;

/// The Unicode classes a pre-tokenizer looks at, for one code point.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Flags {
    /// In the text (false past either end of a piece).
    pub present: bool,
    pub letter: bool,
    pub number: bool,
    pub punctuation: bool,
    pub mark: bool,
    pub whitespace: bool,
}

struct Tables {
    letter: Vec<(u32, u32)>,
    number: Vec<(u32, u32)>,
    punctuation: Vec<(u32, u32)>,
    mark: Vec<(u32, u32)>,
    whitespace: Vec<(u32, u32)>,
}

fn class_ranges(class: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let hir = regex_syntax::Parser::new()
        .parse(class)
        .expect("a valid Unicode class");
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => c
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        _ => unreachable!("{class} is a Unicode class"),
    }
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables {
        letter: class_ranges(r"\p{L}"),
        number: class_ranges(r"\p{N}"),
        punctuation: class_ranges(r"\p{P}"),
        mark: class_ranges(r"\p{M}"),
        whitespace: class_ranges(r"\p{White_Space}"),
    })
}

fn contains(ranges: &[(u32, u32)], c: u32) -> bool {
    ranges
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

/// The classes of `c`.
pub(crate) fn flags(c: char) -> Flags {
    let t = tables();
    let c = c as u32;
    Flags {
        present: true,
        letter: contains(&t.letter, c),
        number: contains(&t.number, c),
        punctuation: contains(&t.punctuation, c),
        mark: contains(&t.mark, c),
        whitespace: contains(&t.whitespace, c),
    }
}

/// One splitting pass; a pre-tokenizer runs its passes in order, each refining the pieces the
/// last one made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// (with `\p{N}` alone instead of `{1,3}` when `digits` is 1: Qwen2).
    Llama3 { digits: usize },
    /// Each `\p{N}` on its own.
    EachNumber,
    /// Runs of `\p{N}`.
    NumberRuns,
    /// Runs of `[\p{P}$+<=>^~|]`.
    PunctuationRuns,
    /// `[0-9]{3}`, left to right.
    AsciiDigitTriples,
}

/// A named pre-tokenizer: its passes and the decoder's space clean-up (llama.cpp's
/// `clean_spaces`), and whether a word found whole in the vocabulary skips the merges.
#[derive(Debug, Clone)]
pub(crate) struct PreTokenizer {
    pub name: String,
    pub passes: &'static [Pass],
    pub clean_spaces: bool,
    pub ignore_merges: bool,
    /// The default of `add_bos_token` when the file does not say.
    pub add_bos: bool,
}

const GPT2: &[Pass] = &[Pass::Gpt2];
const LLAMA3: &[Pass] = &[Pass::Llama3 { digits: 3 }];
const QWEN2: &[Pass] = &[Pass::Llama3 { digits: 1 }];
const SMOLLM: &[Pass] = &[Pass::EachNumber, Pass::Gpt2];
const DEFAULT: &[Pass] = &[
    Pass::PunctuationRuns,
    Pass::Gpt2,
    Pass::NumberRuns,
    Pass::AsciiDigitTriples,
];

/// The `tokenizer.ggml.pre` names this crate reads, for messages.
pub const SUPPORTED: &str = "default, llama3, llama-v3, llama-bpe, falcon3, pixtral, \
     dbrx, smaug-bpe, qwen2, deepseek-r1-qwen, megrez, stablelm2, smollm, starcoder, refact, \
     command-r, codeshell, exaone, minerva-7b, gpt-2, phi-2, jina-es, jina-de, jina-v2-es, \
     jina-v2-de, mpt, olmo, jais";

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for `name` (`None`: the file names none).
    pub(crate) fn named(name: Option<&str>) -> Option<Self> {
        let n = name.unwrap_or("default");
        // (passes, clean_spaces, ignore_merges, add_bos)
        let (passes, clean_spaces, ignore_merges, add_bos) = match n {
            "default" => (DEFAULT, true, false, false),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => {
                (LLAMA3, true, true, true)
            }
            "dbrx" | "smaug-bpe" => (LLAMA3, true, false, false),
            "qwen2" | "deepseek-r1-qwen" => (QWEN2, false, false, false),
            "megrez" | "stablelm2" => (QWEN2, true, false, false),
            "smollm" | "command-r" => (SMOLLM, false, false, false),
            "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" => {
                (SMOLLM, true, false, false)
            }
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "jina-v2-es" | "jina-v2-de" | "mpt"
            | "olmo" | "jais" => (GPT2, true, false, false),
            _ => return None,
        };
        Some(Self {
            name: n.to_string(),
            passes,
            clean_spaces,
            ignore_merges,
            add_bos,
        })
    }

    /// Splits `text` into words, as ranges of `chars`.
    pub(crate) fn split(&self, chars: &[char]) -> Vec<Range<usize>> {
        let mut pieces: Vec<Range<usize>> = std::iter::once(0..chars.len()).collect();
        if chars.is_empty() {
            return pieces;
        }
        for pass in self.passes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                let lens = split_piece(*pass, &chars[piece.clone()]);
                let mut at = piece.start;
                for l in lens {
                    next.push(at..at + l);
                    at += l;
                }
            }
            pieces = next;
        }
        pieces
    }
}

/// The lengths (in chars) of the words one pass makes of one piece; they add up to its length.
fn split_piece(pass: Pass, s: &[char]) -> Vec<usize> {
    match pass {
        Pass::Gpt2 => split_gpt2(s),
        Pass::Llama3 { digits } => split_llama3(s, digits),
        Pass::EachNumber => split_matches(s, |s, i| usize::from(is_collapsed_number(s[i]))),
        Pass::NumberRuns => split_matches(s, |s, i| {
            s[i..]
                .iter()
                .take_while(|&&c| is_collapsed_number(c))
                .count()
        }),
        Pass::PunctuationRuns => split_matches(s, |s, i| {
            s[i..]
                .iter()
                .take_while(|&&c| is_collapsed_punctuation(c))
                .count()
        }),
        Pass::AsciiDigitTriples => split_matches(s, |s, i| {
            if s.len() - i >= 3 && s[i..i + 3].iter().all(|c| c.is_ascii_digit()) {
                3
            } else {
                0
            }
        }),
    }
}

/// `\p{N}` as llama.cpp's category regexes see it: ASCII digits, and non-ASCII numbers.
fn is_collapsed_number(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    let f = flags(c);
    f.number && !f.whitespace
}

/// `[\p{P}$+<=>^~|]` as llama.cpp's category regexes see it: its ASCII punctuation set
/// (without the backtick) and the listed symbols, and non-ASCII punctuation.
fn is_collapsed_punctuation(c: char) -> bool {
    if c.is_ascii() {
        return "!\"#%&'()*,-./:;?@[\\]_{}$+<=>^~|".contains(c);
    }
    let f = flags(c);
    f.punctuation && !f.whitespace
}

/// A regex pass over one piece: each match is a word, and so is the text between matches.
/// `at(s, i)` is the length of the match starting at `i` (0: none).
fn split_matches(s: &[char], at: impl Fn(&[char], usize) -> usize) -> Vec<usize> {
    let mut out = Vec::new();
    let (mut i, mut gap) = (0, 0);
    while i < s.len() {
        let n = at(s, i);
        if n == 0 {
            i += 1;
            gap += 1;
            continue;
        }
        if gap > 0 {
            out.push(gap);
            gap = 0;
        }
        out.push(n);
        i += n;
    }
    if gap > 0 {
        out.push(gap);
    }
    out
}

/// Reads a piece's chars and their classes, with nothing past either end.
struct Cursor<'a> {
    s: &'a [char],
    f: Vec<Flags>,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a [char]) -> Self {
        Self {
            s,
            f: s.iter().map(|&c| flags(c)).collect(),
        }
    }
    fn c(&self, i: usize) -> Option<char> {
        self.s.get(i).copied()
    }
    fn f(&self, i: usize) -> Flags {
        self.f.get(i).copied().unwrap_or_default()
    }
    /// The length of an English contraction at `i` (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`,
    /// `'d`), any case if `fold`.
    fn contraction(&self, i: usize, fold: bool) -> usize {
        if self.c(i) != Some('\'') {
            return 0;
        }
        let low = |j: usize| {
            self.c(j).map(|c| {
                if fold {
                    let mut l = c.to_lowercase();
                    match (l.next(), l.next()) {
                        (Some(x), None) => x,
                        _ => c,
                    }
                } else {
                    c
                }
            })
        };
        match low(i + 1) {
            Some('s' | 't' | 'm' | 'd') => 2,
            Some(a) => match (a, low(i + 2)) {
                ('r', Some('e')) | ('v', Some('e')) | ('l', Some('l')) => 3,
                _ => 0,
            },
            None => 0,
        }
    }
    /// Whitespace from `i`: its length and the end of its last `\r` or `\n` (0: none).
    fn whitespace(&self, i: usize) -> (usize, usize) {
        let (mut n, mut last_nl) = (0, 0);
        while self.f(i + n).whitespace {
            if matches!(self.c(i + n), Some('\r' | '\n')) {
                last_nl = i + n + 1;
            }
            n += 1;
        }
        (n, last_nl)
    }
}

fn is_other(f: Flags) -> bool {
    f.present && !(f.whitespace || f.letter || f.number)
}

fn split_gpt2(s: &[char]) -> Vec<usize> {
    let cur = Cursor::new(s);
    let mut out = Vec::new();
    let mut start = 0;
    let mut pos = 0;
    let mut cut = |end: usize, out: &mut Vec<usize>| {
        if end > start {
            out.push(end - start);
        }
        start = end;
    };
    while pos < s.len() {
        let n = cur.contraction(pos, false);
        if n > 0 {
            pos += n;
            cut(pos, &mut out);
            continue;
        }
        // An optional space, then a run of one class.
        let space = usize::from(cur.c(pos) == Some(' '));
        let f = cur.f(pos + space);
        let run: Option<fn(Flags) -> bool> = if f.letter {
            Some(|f| f.letter)
        } else if f.number {
            Some(|f| f.number)
        } else if is_other(f) {
            Some(is_other)
        } else {
            None
        };
        if let Some(run) = run {
            pos += space;
            while run(cur.f(pos)) {
                pos += 1;
            }
            cut(pos, &mut out);
            continue;
        }
        let (ws, _) = cur.whitespace(pos);
        if ws > 1 && pos + ws < s.len() {
            // \s+(?!\S): leave the last space to the word after it.
            pos += ws - 1;
        } else if ws > 0 {
            pos += ws;
        } else {
            pos += 1;
        }
        cut(pos, &mut out);
    }
    out
}

fn split_llama3(s: &[char], digits: usize) -> Vec<usize> {
    let cur = Cursor::new(s);
    let mut out = Vec::new();
    let mut start = 0;
    let mut pos = 0;
    let mut cut = |end: usize, out: &mut Vec<usize>| {
        if end > start {
            out.push(end - start);
        }
        start = end;
    };
    while pos < s.len() {
        let c = s[pos];
        let f = cur.f(pos);
        let n = cur.contraction(pos, true);
        if n > 0 {
            pos += n;
            cut(pos, &mut out);
            continue;
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(c == '\r' || c == '\n' || f.number) && (f.letter || cur.f(pos + 1).letter) {
            pos += 1;
            while cur.f(pos).letter {
                pos += 1;
            }
            cut(pos, &mut out);
            continue;
        }
        // \p{N}{1,digits}
        if f.number {
            let mut run = 0;
            while cur.f(pos).number {
                pos += 1;
                run += 1;
                if run == digits {
                    cut(pos, &mut out);
                    run = 0;
                }
            }
            cut(pos, &mut out);
            continue;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let f2 = if c == ' ' { cur.f(pos + 1) } else { f };
        if is_other(f2) || (f.present && !(f2.whitespace || f2.letter || f2.number)) {
            pos += usize::from(c == ' ');
            while is_other(cur.f(pos)) {
                pos += 1;
            }
            while matches!(cur.c(pos), Some('\r' | '\n')) {
                pos += 1;
            }
            cut(pos, &mut out);
            continue;
        }
        let (ws, last_nl) = cur.whitespace(pos);
        if last_nl > 0 {
            // \s*[\r\n]+
            pos = last_nl;
        } else if ws > 1 && pos + ws < s.len() {
            pos += ws - 1;
        } else if ws > 0 {
            pos += ws;
        } else {
            pos += 1;
        }
        cut(pos, &mut out);
    }
    out
}

/// GPT-2's map of bytes to printable chars, and back.
pub(crate) fn byte_chars() -> &'static ([char; 256], std::collections::HashMap<char, u8>) {
    static MAP: OnceLock<([char; 256], std::collections::HashMap<char, u8>)> = OnceLock::new();
    MAP.get_or_init(|| {
        let mut to = ['\0'; 256];
        let mut n = 0u32;
        for b in 0..=255u8 {
            let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
            to[b as usize] = if printable {
                char::from(b)
            } else {
                n += 1;
                char::from_u32(255 + n).expect("a valid char")
            };
        }
        let back = to.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        (to, back)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: &str, text: &str) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        PreTokenizer::named(Some(pre))
            .unwrap()
            .split(&chars)
            .into_iter()
            .map(|r| chars[r].iter().collect())
            .collect()
    }

    #[test]
    fn gpt2_splits_words_numbers_and_spaces() {
        assert_eq!(
            words("gpt-2", "Hello  world's 123!!\n"),
            ["Hello", " ", " world", "'s", " 123", "!!", "\n"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three_and_qwen2_by_one() {
        assert_eq!(words("llama-bpe", "x 12345"), ["x", " ", "123", "45"]);
        assert_eq!(words("qwen2", "x 123"), ["x", " ", "1", "2", "3"]);
        assert_eq!(words("llama-bpe", "a\n\n b"), ["a", "\n\n", " b"]);
    }

    #[test]
    fn smollm_isolates_each_digit() {
        assert_eq!(
            words("smollm", "in 2024,"),
            ["in", " ", "2", "0", "2", "4", ","]
        );
    }

    #[test]
    fn default_splits_punctuation_then_digit_triples() {
        assert_eq!(
            words("default", "a+b 12345"),
            ["a", "+", "b", " ", "123", "45"]
        );
    }

    #[test]
    fn byte_map_round_trips() {
        let (to, back) = byte_chars();
        assert_eq!(to[b' ' as usize], 'Ġ');
        assert_eq!(to[b'\n' as usize], 'Ċ');
        for b in 0..=255u8 {
            assert_eq!(back[&to[b as usize]], b);
        }
    }
}
