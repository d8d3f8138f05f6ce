//! The model's text side, as the request handlers use it: prompts from chat messages (the
//! model's chat template) and texts, tokens back to text as they stream (UTF-8 safe).

use std::sync::Arc;

use candle_offload_models::{ChatTemplate, Tokenizer};

use crate::api::Message;
use crate::error::ApiError;

/// What the server needs of a tokenizer: [`Tokenizer`]'s, or a test's own.
pub trait Codec: Send + Sync {
    /// The ids of a prompt, with the tokens the model adds (BOS).
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, String>;
    /// The text of `ids`, control tokens left out; a character cut between tokens becomes
    /// U+FFFD.
    fn decode(&self, ids: &[u32]) -> Result<String, String>;
}

impl Codec for Tokenizer {
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, String> {
        Tokenizer::encode_prompt(self, text).map_err(|e| e.to_string())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        Tokenizer::decode(self, ids, true).map_err(|e| e.to_string())
    }
}

/// The served model as the handlers see it.
#[derive(Clone)]
pub struct ModelInfo {
    /// Its tokenizer.
    pub codec: Arc<dyn Codec>,
    /// Its chat template; without one a conversation is written `role: content` a line each,
    /// ending with `assistant:`.
    pub chat_template: Option<ChatTemplate>,
    /// Tokens that end a generation (EOS, end of turn): not sent as text.
    pub end_tokens: Vec<u32>,
    /// Positions a request may reach (prompt and new tokens).
    pub context: usize,
    /// Token ids below this are valid in a token prompt.
    pub vocab_size: usize,
}

impl std::fmt::Debug for ModelInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelInfo")
            .field("chat_template", &self.chat_template.is_some())
            .field("end_tokens", &self.end_tokens)
            .field("context", &self.context)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl ModelInfo {
    /// The prompt text of a conversation, ending where the assistant's answer begins.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<String, ApiError> {
        match &self.chat_template {
            Some(t) => t
                .render_messages(messages, true)
                .map_err(|e| ApiError::invalid("messages", format!("the chat template: {e}"))),
            None => {
                let mut s = String::new();
                for (role, content) in messages {
                    s.push_str(role);
                    s.push_str(": ");
                    s.push_str(content);
                    s.push('\n');
                }
                s.push_str("assistant:");
                Ok(s)
            }
        }
    }
}

/// Turns tokens into text as they come: text is released once it is complete UTF-8 (not
/// ending in U+FFFD) and stable, decoded over a window that starts at the previous release
/// so that tokenizers which print a leading space or merge pieces stay right.
pub struct Detokenizer {
    codec: Arc<dyn Codec>,
    tokens: Vec<u32>,
    prev: usize,
    current: usize,
}

impl std::fmt::Debug for Detokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detokenizer")
            .field("tokens", &self.tokens.len())
            .finish()
    }
}

impl Detokenizer {
    /// A detokenizer over `codec`.
    pub fn new(codec: Arc<dyn Codec>) -> Self {
        Self {
            codec,
            tokens: Vec::new(),
            prev: 0,
            current: 0,
        }
    }

    /// Adds a token; returns the new text, if any is ready.
    pub fn push(&mut self, token: u32) -> Result<Option<String>, String> {
        let before = self.codec.decode(&self.tokens[self.prev..self.current])?;
        self.tokens.push(token);
        let text = self.codec.decode(&self.tokens[self.prev..])?;
        if text.len() > before.len() && !text.ends_with('\u{fffd}') {
            let new = text.get(before.len()..).unwrap_or_default().to_string();
            self.prev = self.current;
            self.current = self.tokens.len();
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }

    /// Whatever text is still held back (at the end of the stream).
    pub fn rest(&self) -> Result<Option<String>, String> {
        let before = self.codec.decode(&self.tokens[self.prev..self.current])?;
        let text = self.codec.decode(&self.tokens[self.prev..])?;
        Ok((text.len() > before.len())
            .then(|| text.get(before.len()..).unwrap_or_default().to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One byte per token; ids from 256 are control tokens (left out).
    struct Bytes;

    impl Codec for Bytes {
        fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, String> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn decode(&self, ids: &[u32]) -> Result<String, String> {
            let b: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
            Ok(String::from_utf8_lossy(&b).into_owned())
        }
    }

    #[test]
    fn characters_cut_between_tokens_wait_for_their_end() {
        let mut d = Detokenizer::new(Arc::new(Bytes));
        let mut out = String::new();
        for t in "aé€b".bytes() {
            if let Some(s) = d.push(u32::from(t)).unwrap() {
                assert!(!s.contains('\u{fffd}'), "{s:?}");
                out.push_str(&s);
            }
        }
        assert_eq!(out, "aé€b");
        assert_eq!(d.rest().unwrap(), None);
        let mut d = Detokenizer::new(Arc::new(Bytes));
        assert_eq!(d.push(0xC3).unwrap(), None);
        assert_eq!(d.rest().unwrap().as_deref(), Some("\u{fffd}"));
    }

    #[test]
    fn plain_chat_prompt_without_a_template() {
        let info = ModelInfo {
            codec: Arc::new(Bytes),
            chat_template: None,
            end_tokens: vec![],
            context: 10,
            vocab_size: 256,
        };
        let m = [
            ("system".to_string(), "Be brief.".to_string()),
            ("user".to_string(), "Hi".to_string()),
        ];
        assert_eq!(
            info.chat_prompt(&m).unwrap(),
            "system: Be brief.\nuser: Hi\nassistant:"
        );
    }
}
