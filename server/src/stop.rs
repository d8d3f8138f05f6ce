//! Stop strings on streamed text: text that could be the start of a stop string is held back
//! until it is not; at a match the text before it is released and the generation ends.
//!
//! A match is the first stop string to be completed as the text grows (the earliest end;
//! at one end, the longest string), as a generation that checks after every token would see
//! it. The text released over a whole stream is the text cut at that match, however the
//! stream was split into pieces, and never contains a stop string.

/// Watches a stream of text for stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

/// What a piece of text released.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Released {
    /// Text that can go to the client (possibly empty).
    pub text: String,
    /// A stop string matched: the generation ends (nothing more is released).
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher of `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string matched.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds the next piece of text; returns what can be released now.
    pub fn push(&mut self, piece: &str) -> Released {
        if self.stopped {
            return Released {
                text: String::new(),
                stopped: true,
            };
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(piece);
        // The match completed first: the earliest end, then the earliest start. Any match
        // that ends in this piece starts in `buf`, since what was released before could not
        // begin one.
        let first = self
            .stops
            .iter()
            .filter_map(|s| buf.find(s.as_str()).map(|at| (at + s.len(), at)))
            .min();
        if let Some((_, at)) = first {
            buf.truncate(at);
            self.stopped = true;
            return Released {
                text: buf,
                stopped: true,
            };
        }
        // Hold back the longest end of `buf` that begins some stop string.
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let from = buf.len().saturating_sub(longest.saturating_sub(1));
        let cut = (from..buf.len())
            .filter(|&i| buf.is_char_boundary(i))
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&buf[i..])))
            .unwrap_or(buf.len());
        self.held = buf.split_off(cut);
        Released {
            text: buf,
            stopped: false,
        }
    }

    /// The stream ended without a match: releases what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The text a generation that checks after every character releases.
    fn reference(text: &str, stops: &[String]) -> (String, bool) {
        let ends = text
            .char_indices()
            .map(|(i, c)| i + c.len_utf8())
            .collect::<Vec<_>>();
        for e in ends {
            let head = &text[..e];
            if let Some(len) = stops
                .iter()
                .filter(|s| !s.is_empty() && head.ends_with(s.as_str()))
                .map(String::len)
                .max()
            {
                return (text[..e - len].to_string(), true);
            }
        }
        (text.to_string(), false)
    }

    fn run(pieces: &[&str], stops: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn holds_back_a_possible_start_across_pieces() {
        let mut m = StopMatcher::new(vec!["</s>".into()]);
        assert_eq!(m.push("Paris<").text, "Paris");
        assert_eq!(m.push("/").text, "");
        let r = m.push("s> more");
        assert_eq!((r.text.as_str(), r.stopped), ("", true));
        let mut m = StopMatcher::new(vec!["</s>".into()]);
        assert_eq!(m.push("a<").text, "a");
        assert_eq!(m.push("b").text, "<b");
        assert_eq!(m.finish(), "");
        assert_eq!(run(&["x", "<", "/"], &["</s>"]), ("x</".into(), false));
        // The first string completed wins over one that started earlier.
        assert_eq!(run(&["abcd"], &["abcd", "bc"]), ("a".into(), true));
        assert_eq!(run(&["ab", "cd"], &["abcd", "bc"]), ("a".into(), true));
        // Multi-byte characters are never split.
        assert_eq!(run(&["é", "é", "x"], &["éx"]), ("é".into(), true));
    }

    fn pieces_of(text: &str, cuts: &[usize]) -> Vec<String> {
        let bounds: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        let mut at: Vec<usize> = cuts.iter().map(|c| bounds[c % bounds.len()]).collect();
        at.push(0);
        at.push(text.len());
        at.sort_unstable();
        at.dedup();
        at.windows(2)
            .map(|w| text[w[0]..w[1]].to_string())
            .collect()
    }

    proptest! {
        #[test]
        fn released_text_is_the_text_cut_at_the_first_match(
            text in "[ab é<>]{0,40}",
            stops in proptest::collection::vec("[ab é<>]{1,4}", 0..4),
            cuts in proptest::collection::vec(0usize..64, 0..12),
        ) {
            let pieces = pieces_of(&text, &cuts);
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let (out, stopped) = run(&refs, &stop_refs);
            let (want, want_stopped) = reference(&text, &stops);
            prop_assert_eq!(&out, &want);
            prop_assert_eq!(stopped, want_stopped);
            for s in &stops {
                prop_assert!(!out.contains(s.as_str()), "{:?} contains {:?}", out, s);
            }
        }
    }
}
