//! SentencePiece tokenization as llama.cpp does it for `tokenizer.ggml.model = llama`: the
//! text's chars are merged pairwise, the pair whose concatenation is the vocabulary's
//! highest-scoring token first (ties: the leftmost), and what is left unmerged and not in the
//! vocabulary falls back to `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::vocab::Vocab;

struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    len: usize,
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
    /// The heap's top is the highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// A symbol: a byte range of the text, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Appends the tokens of `text` (spaces already escaped to `▁`) to `out`.
pub(crate) fn tokenize(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
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
    let mut queue = BinaryHeap::new();
    let try_add = |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, l: Option<usize>, r| {
        let (Some(left), Some(right)) = (l, r) else {
            return;
        };
        let (a, b): (&Symbol, &Symbol) = (&symbols[left], &symbols[right]);
        let piece = &text[a.start..a.start + a.len + b.len];
        if let Some(id) = vocab.id(piece) {
            queue.push(Bigram {
                left,
                right,
                score: vocab.score(id),
                len: piece.len(),
            });
        }
    };
    for i in 1..symbols.len() {
        try_add(&symbols, &mut queue, Some(i - 1), Some(i));
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        // Stale: one side was merged since.
        if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(n) = r.next {
            symbols[n].prev = Some(b.left);
        }
        let left = symbols[b.left];
        try_add(&symbols, &mut queue, left.prev, Some(b.left));
        try_add(&symbols, &mut queue, Some(b.left), left.next);
    }
    let mut i = (!symbols.is_empty()).then_some(0);
    while let Some(at) = i {
        let s = symbols[at];
        let piece = &text[s.start..s.start + s.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => out.extend(piece.bytes().map(|b| vocab.byte_token(b))),
        }
        i = s.next;
    }
}
