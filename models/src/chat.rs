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
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(minijinja::context! { role => "system", content => s });
        }
        messages.push(minijinja::context! { role => "user", content => user });
        env.get_template("chat")
            .map_err(err)?
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
            })
            .map_err(err)
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
