//! Conversations into text: the tokenizer's chat template (`tokenizer_config.json`'s Jinja
//! `chat_template`, as transformers' `apply_chat_template` renders it), and which spans of the
//! rendered text the assistant wrote, which alone are trained on.
//!
//! A span is found by rendering the conversation up to each assistant turn twice: without it,
//! asking for the generation prompt (what the model sees before it answers), and with it. The
//! difference is the answer with the template's own end-of-turn markup, as transformers'
//! `return_assistant_tokens_mask` counts it for templates that mark generations.

use minijinja::value::Serde;
use minijinja::{Environment, Error as JinjaError, ErrorKind, context};
use serde_json::Value;

/// A chat template ready to render, with the special tokens it may name.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// The template of a `tokenizer_config.json` (a string, or a list of named templates of
    /// which `default` is used); `None` if it has none.
    pub(super) fn from_config(config: &Value) -> Result<Option<ChatTemplate>, String> {
        let source = match &config[NAME] {
            Value::String(s) => s.clone(),
            Value::Array(named) => match named.iter().find(|t| t["name"] == "default") {
                Some(t) => t["template"].as_str().unwrap_or_default().to_owned(),
                None => return Err("chat_template lists no template named \"default\"".into()),
            },
            _ => return Ok(None),
        };
        let mut env = Environment::new();
        // Python's string methods (`.strip()`, `.startswith()`), which templates call.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<(), JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(NAME, source)
            .map_err(|e| format!("chat_template does not parse: {e}"))?;
        let token = |key: &str| match &config[key] {
            Value::String(s) => s.clone(),
            other => other["content"].as_str().unwrap_or_default().to_owned(),
        };
        Ok(Some(ChatTemplate {
            env,
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
        }))
    }

    fn render(&self, messages: &[Value], add_generation_prompt: bool) -> Result<String, String> {
        let template = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        template
            .render(context! {
                messages => Serde(messages),
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                add_generation_prompt,
            })
            .map_err(|e| format!("the chat template failed: {e}"))
    }

    /// The rendered conversation as consecutive spans, each with whether it is trained on (the
    /// assistant's turns).
    pub(super) fn spans(&self, messages: &Value) -> Result<Vec<(String, bool)>, String> {
        let messages = messages.as_array().map_or(&[][..], Vec::as_slice);
        let whole = self.render(messages, false)?;
        let (mut spans, mut done) = (Vec::new(), 0);
        for (k, m) in messages.iter().enumerate() {
            if m["role"] != "assistant" {
                continue;
            }
            let before = self.render(&messages[..k], true)?;
            let after = self.render(&messages[..=k], false)?;
            if before.len() < done || !after.starts_with(&before) || !whole.starts_with(&after) {
                return Err(format!(
                    "the chat template does not render message {k} after the ones before it, \
                     so its tokens cannot be told apart"
                ));
            }
            spans.push((whole[done..before.len()].to_owned(), false));
            spans.push((whole[before.len()..after.len()].to_owned(), true));
            done = after.len();
        }
        spans.push((whole[done..].to_owned(), false));
        spans.retain(|(text, _)| !text.is_empty());
        Ok(spans)
    }
}
