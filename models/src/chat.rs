//! Chat templates: the model's own Jinja template (from tokenizer_config.json or GGUF
//! metadata), rendered with minijinja and its Python-compatibility methods.

use crate::error::{ModelError, Result};

/// A model's chat template with the special tokens it refers to.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// A template with its `bos_token` and `eos_token` texts.
    pub fn new(source: String, bos_token: Option<String>, eos_token: Option<String>) -> Self {
        Self {
            source,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
        }
    }

    /// The prompt for one user message (and an optional system message), ending where the
    /// assistant's answer begins.
    pub fn render(&self, user: &str, system: Option<&str>) -> Result<String> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(("system".to_string(), s.to_string()));
        }
        messages.push(("user".to_string(), user.to_string()));
        self.render_messages(&messages, true)
    }

    /// A conversation of `(role, content)` messages as the template writes it, ending with
    /// the assistant's turn opened when `add_generation_prompt`.
    pub fn render_messages(
        &self,
        messages: &[(String, String)],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let err = |e: minijinja::Error| ModelError::Source {
            id: "chat template".into(),
            reason: e.to_string(),
        };
        env.add_template("chat", &self.source).map_err(err)?;
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| minijinja::context! { role => role, content => content })
            .collect();
        env.get_template("chat")
            .map_err(err)?
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
            })
            .map_err(err)
    }

    /// A conversation for training, as consecutive pieces of its rendered text, each marked
    /// with whether it is trained on: every assistant message as the template closes it
    /// (its end-of-turn tokens included), everything else (system, user, the template's
    /// openings of the assistant's turn) not. The pieces join to the whole conversation's
    /// rendering. A template that does not render a conversation as the prefix of its
    /// continuation is refused.
    pub fn training_pieces(&self, messages: &[(String, String)]) -> Result<Vec<(String, bool)>> {
        let mut pieces = Vec::new();
        let mut done = String::new();
        for (i, (role, _)) in messages.iter().enumerate() {
            if role != "assistant" {
                continue;
            }
            let prompt = self.render_messages(&messages[..i], true)?;
            let through = self.render_messages(&messages[..=i], false)?;
            let (Some(head), Some(answer)) = (
                prompt.strip_prefix(done.as_str()),
                through.strip_prefix(prompt.as_str()),
            ) else {
                return Err(ModelError::Source {
                    id: "chat template".into(),
                    reason: format!(
                        "message {i}: the template does not render the conversation so far as \
                         the beginning of its continuation, so the assistant's tokens cannot be \
                         told apart"
                    ),
                });
            };
            if !head.is_empty() {
                pieces.push((head.to_string(), false));
            }
            pieces.push((answer.to_string(), true));
            done = through;
        }
        let all = self.render_messages(messages, false)?;
        if let Some(rest) = all.strip_prefix(done.as_str()) {
            if !rest.is_empty() {
                pieces.push((rest.to_string(), false));
            }
        }
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml() {
        let t = ChatTemplate::new(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}".into(),
            None,
            None,
        );
        let out = t.render("Hi", Some("Be brief.")).unwrap();
        assert_eq!(out, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn training_pieces_mark_the_assistants_turns() {
        let t = ChatTemplate::new(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}".into(),
            None,
            None,
        );
        let m = |r: &str, c: &str| (r.to_string(), c.to_string());
        let msgs = [
            m("user", "Hi"),
            m("assistant", "Hello"),
            m("user", "Bye"),
            m("assistant", "Ciao"),
        ];
        let pieces = t.training_pieces(&msgs).unwrap();
        let trained: Vec<&str> = pieces
            .iter()
            .filter(|p| p.1)
            .map(|p| p.0.as_str())
            .collect();
        assert_eq!(trained, ["Hello<|im_end|>\n", "Ciao<|im_end|>\n"]);
        let joined: String = pieces.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(joined, t.render_messages(&msgs, false).unwrap());
        assert!(!pieces[0].1 && pieces[0].0.ends_with("<|im_start|>assistant\n"));
    }

    #[test]
    fn python_methods_and_errors() {
        let t = ChatTemplate::new(
            "{{ messages[0]['content'].strip() }}{{ raise_exception('no') if false }}".into(),
            None,
            None,
        );
        assert_eq!(t.render("  x  ", None).unwrap(), "x");
        let bad = ChatTemplate::new("{% if %}".into(), None, None);
        assert!(bad.render("x", None).is_err());
    }
}
