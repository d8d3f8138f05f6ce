//! A vocabulary entry's kind: the token types of GGUF (`tokenizer.ggml.token_type`).

/// The token types of GGUF (`tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
    Undefined,
}

impl Kind {
    pub(crate) fn from_gguf(t: i32) -> Self {
        match t {
            1 => Kind::Normal,
            2 => Kind::Unknown,
            3 => Kind::Control,
            4 => Kind::UserDefined,
            5 => Kind::Unused,
            6 => Kind::Byte,
            _ => Kind::Undefined,
        }
    }
}
