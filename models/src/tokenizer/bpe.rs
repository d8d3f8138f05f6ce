//! Byte-level BPE as llama.cpp does it for `tokenizer.ggml.model = gpt2`: the pre-tokenizer's
//! words, each byte mapped to GPT-2's printable chars, merged pairwise by the rank of the pair
//! in `tokenizer.ggml.merges` (lowest first; ties: the leftmost).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::pre::byte_chars;
use super::vocab::Vocab;

struct Bigram {
    left: usize,
    right: usize,
    rank: u32,
    text: String,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The heap's top is the lowest rank, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.left.cmp(&self.left))
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Appends the tokens of `text` (one fragment between special tokens) to `out`.
pub(crate) fn tokenize(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    let pre = vocab
        .pre
        .as_ref()
        .expect("a BPE vocabulary has a pre-tokenizer");
    let chars: Vec<char> = text.chars().collect();
    let (to_char, _) = byte_chars();
    for range in pre.split(&chars) {
        let mut word = String::new();
        let mut utf8 = [0u8; 4];
        for &c in &chars[range] {
            for &b in c.encode_utf8(&mut utf8).as_bytes() {
                word.push(to_char[b as usize]);
            }
        }
        word_tokens(vocab, &word, pre.ignore_merges, out);
    }
}

fn word_tokens(vocab: &Vocab, word: &str, ignore_merges: bool, out: &mut Vec<u32>) {
    if ignore_merges {
        if let Some(id) = vocab.id(word) {
            out.push(id);
            return;
        }
    }
    let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
    for (start, c) in word.char_indices() {
        let i = symbols.len();
        symbols.push(Symbol {
            start,
            len: c.len_utf8(),
            prev: i.checked_sub(1),
            next: None,
        });
        if i > 0 {
            symbols[i - 1].next = Some(i);
        }
    }
    let text = |s: &Symbol| &word[s.start..s.start + s.len];
    let mut queue = BinaryHeap::new();
    let add = |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, l: Option<usize>, r| {
        let (Some(left), Some(right)) = (l, r) else {
            return;
        };
        let (a, b) = (text(&symbols[left]), text(&symbols[right]));
        if let Some(rank) = vocab.merge_rank(a, b) {
            queue.push(Bigram {
                left,
                right,
                rank,
                text: format!("{a}{b}"),
            });
        }
    };
    for i in 1..symbols.len() {
        add(&symbols, &mut queue, Some(i - 1), Some(i));
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        if l.len == 0 || r.len == 0 {
            continue;
        }
        // Stale: the pair's text changed since it was queued.
        if l.len + r.len != b.text.len() || word[l.start..l.start + l.len + r.len] != b.text {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(n) = r.next {
            symbols[n].prev = Some(b.left);
        }
        let left = symbols[b.left];
        add(&symbols, &mut queue, left.prev, Some(b.left));
        add(&symbols, &mut queue, Some(b.left), left.next);
    }
    for s in symbols.iter().filter(|s| s.len > 0) {
        let piece = text(s);
        match vocab.id(piece) {
            Some(id) => out.push(id),
            // Not in the vocabulary: each byte of the piece that is a token on its own.
            None => {
                for b in piece.bytes() {
                    if let Some(id) = std::str::from_utf8(&[b]).ok().and_then(|t| vocab.id(t)) {
                        out.push(id);
                    }
                }
            }
        }
    }
}
