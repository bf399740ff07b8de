//! `data`: where training tokens come from, how text becomes tokens, and what the model is
//! validated on.

use serde::{Deserialize, Serialize};

use super::{Architecture, InitFrom};
use crate::error::{Error, ensure};

/// Synthetic tokens are below `min(vocab_size, MAX_SYNTHETIC_VOCAB)`: 32² contexts is a table a
/// tiny GPT learns in a few hundred steps (the runner's `data` module makes the corpus).
pub const MAX_SYNTHETIC_VOCAB: usize = 32;

/// Each context of the synthetic corpus has four successors: a smaller vocabulary has none to
/// draw.
pub const MIN_SYNTHETIC_VOCAB: usize = 4;

/// The file a model directory's tokenizer is in, as transformers saves it.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", from = "DataDoc")]
pub enum Data {
    /// A built-in corpus generated from `training.seed` (the default).
    #[default]
    Synthetic,
    /// UTF-8 files (`path` may be a glob), one document each, tokenized with `tokenizer`; with
    /// no tokenizer, one file read as bytes (token = byte, so the vocabulary needs ≥ 256 ids).
    Text {
        path: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        tokenizer: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        validation: Option<Validation>,
    },
    /// JSON Lines (`path` may be a glob): one object a line, its string member `field` a
    /// document, or with `prompt` and `completion` (the names of two members) a fine-tuning
    /// example whose loss counts the completion's tokens only, or with `messages` (a member's
    /// name) a conversation rendered by the tokenizer's chat template whose loss counts the
    /// assistant's turns only; tokenized with `tokenizer` or,
    /// when that is omitted, the `tokenizer.json` of the directory `model.init_from` names.
    Jsonl {
        path: String,
        field: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        prompt: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        completion: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        messages: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        tokenizer: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        validation: Option<Validation>,
    },
    /// llm.c token shards, uint16 (magic 20240520, version 1) or uint32 (20240801, version 7);
    /// `path` may be a glob. `shuffle: false` (default) reads batches sequentially exactly as
    /// llm.c's loader does.
    Tokens {
        path: String,
        shuffle: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        validation: Option<Validation>,
    },
}

/// How the model is validated: the mean token loss over `batches` batches (each rank reading
/// its slice, as in training) after every `every_steps` steps and after the last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Validation {
    /// A separate dataset of the training data's kind (and tokenizer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Or this fraction of the training documents, chosen by `training.seed` and never
    /// trained on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<f64>,
    #[serde(default = "default_every_steps")]
    pub every_steps: u32,
    #[serde(default = "default_batches")]
    pub batches: u32,
}

fn default_every_steps() -> u32 {
    100
}

/// llm.c's default number of validation batches.
fn default_batches() -> u32 {
    20
}

/// The wire form. serde ignores extra keys next to the tag of a unit variant, so `synthetic` is
/// an empty struct variant here, where `deny_unknown_fields` applies.
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
enum DataDoc {
    Synthetic {},
    Text {
        path: String,
        tokenizer: Option<String>,
        validation: Option<Validation>,
    },
    Jsonl {
        path: String,
        #[serde(default = "default_field")]
        field: String,
        prompt: Option<String>,
        completion: Option<String>,
        messages: Option<String>,
        tokenizer: Option<String>,
        validation: Option<Validation>,
    },
    Tokens {
        path: String,
        #[serde(default)]
        shuffle: bool,
        validation: Option<Validation>,
    },
}

fn default_field() -> String {
    "text".into()
}

impl From<DataDoc> for Data {
    fn from(d: DataDoc) -> Data {
        match d {
            DataDoc::Synthetic {} => Data::Synthetic,
            DataDoc::Text {
                path,
                tokenizer,
                validation,
            } => Data::Text {
                path,
                tokenizer,
                validation,
            },
            DataDoc::Jsonl {
                path,
                field,
                prompt,
                completion,
                messages,
                tokenizer,
                validation,
            } => Data::Jsonl {
                path,
                field,
                prompt,
                completion,
                messages,
                tokenizer,
                validation,
            },
            DataDoc::Tokens {
                path,
                shuffle,
                validation,
            } => Data::Tokens {
                path,
                shuffle,
                validation,
            },
        }
    }
}

/// Which members of a JSON Lines object make its document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fields<'a> {
    /// One string, all of it trained on.
    Text(&'a str),
    /// A prompt, not trained on, and its completion.
    PromptCompletion {
        prompt: &'a str,
        completion: &'a str,
    },
    /// A list of messages (`role`, `content`) rendered by the tokenizer's chat template; only
    /// the assistant's turns are trained on.
    Messages(&'a str),
}

/// Where a job's tokenizer comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerSource<'a> {
    /// `data.tokenizer`: a `tokenizer.json`.
    Named(&'a str),
    /// The `tokenizer.json` beside `model.init_from` (its directory, or the directory of its
    /// file).
    InitFrom(&'a str),
}

impl Data {
    /// The path of the training files (none for synthetic data).
    pub fn path(&self) -> Option<&str> {
        match self {
            Data::Synthetic => None,
            Data::Text { path, .. } | Data::Jsonl { path, .. } | Data::Tokens { path, .. } => {
                Some(path)
            }
        }
    }

    /// The members a JSON Lines line's document is read from (`None` for other kinds).
    pub fn fields(&self) -> Option<Fields<'_>> {
        match self {
            Data::Jsonl {
                prompt: Some(prompt),
                completion: Some(completion),
                ..
            } => Some(Fields::PromptCompletion { prompt, completion }),
            Data::Jsonl {
                messages: Some(messages),
                ..
            } => Some(Fields::Messages(messages)),
            Data::Jsonl { field, .. } => Some(Fields::Text(field)),
            _ => None,
        }
    }

    pub fn validation(&self) -> Option<&Validation> {
        match self {
            Data::Synthetic => None,
            Data::Text { validation, .. }
            | Data::Jsonl { validation, .. }
            | Data::Tokens { validation, .. } => validation.as_ref(),
        }
    }

    /// The tokenizer text is tokenized with, given the spec's `model.init_from`; `None` for
    /// tokens, synthetic data and byte-level text, and for JSON Lines with neither (which
    /// admission refuses).
    pub fn tokenizer<'a>(&'a self, init_from: Option<&'a InitFrom>) -> Option<TokenizerSource<'a>> {
        match self {
            Data::Text { tokenizer, .. } => tokenizer.as_deref().map(TokenizerSource::Named),
            Data::Jsonl { tokenizer, .. } => {
                match (tokenizer, init_from.and_then(InitFrom::path)) {
                    (Some(t), _) => Some(TokenizerSource::Named(t)),
                    (None, Some(dir)) => Some(TokenizerSource::InitFrom(dir)),
                    (None, None) => None,
                }
            }
            Data::Synthetic | Data::Tokens { .. } => None,
        }
    }

    /// Bytes per token of the files the loader reads, or 0 for synthetic data: bytes for
    /// byte-level text, 4 for llm.c shards (room for either version) and for tokenized text,
    /// which is read from uint32 shards.
    pub fn token_width(&self) -> usize {
        match self {
            Data::Synthetic => 0,
            Data::Text {
                tokenizer: None, ..
            } => 1,
            Data::Text { .. } | Data::Jsonl { .. } | Data::Tokens { .. } => 4,
        }
    }

    pub(super) fn validate(
        &self,
        arch: &Architecture,
        init_from: Option<&InitFrom>,
    ) -> Result<(), Error> {
        let vocab = arch.model().map(|m| m.vocab_size());
        if let Some(path) = self.path() {
            ensure(!path.trim().is_empty(), "data.path", || {
                "must not be empty".into()
            })?;
        }
        match self {
            Data::Synthetic => {
                return match vocab {
                    Some(v) => ensure(v >= MIN_SYNTHETIC_VOCAB, "data.kind", || {
                        format!(
                            "synthetic data needs model.vocab_size ≥ {MIN_SYNTHETIC_VOCAB}, not {v}"
                        )
                    }),
                    None => Ok(()),
                };
            }
            Data::Text {
                tokenizer: None, ..
            } => {
                if let Some(v) = vocab {
                    ensure(v >= 256, "data.kind", || {
                        format!("byte-level text needs model.vocab_size ≥ 256, not {v}")
                    })?;
                }
            }
            Data::Jsonl {
                field,
                prompt,
                completion,
                messages,
                ..
            } => {
                ensure(!field.is_empty(), "data.field", || {
                    "must not be empty".into()
                })?;
                for (name, value, other) in [
                    ("data.prompt", prompt, completion),
                    ("data.completion", completion, prompt),
                ] {
                    ensure(value.is_none() || other.is_some(), name, || {
                        "give `prompt` and `completion` together".into()
                    })?;
                    ensure(value.as_ref().is_none_or(|v| !v.is_empty()), name, || {
                        "must not be empty".into()
                    })?;
                }
                ensure(
                    prompt.is_none() || *field == default_field(),
                    "data.field",
                    || "not read when `prompt` and `completion` are given".into(),
                )?;
                ensure(
                    messages.as_ref().is_none_or(|m| !m.is_empty()),
                    "data.messages",
                    || "must not be empty".into(),
                )?;
                ensure(
                    messages.is_none() || (prompt.is_none() && *field == default_field()),
                    "data.messages",
                    || {
                        "a conversation is read alone: not with `field`, `prompt` or `completion`"
                            .into()
                    },
                )?;
                ensure(
                    self.tokenizer(init_from).is_some(),
                    "data.tokenizer",
                    || {
                        "JSON Lines need a tokenizer: name a tokenizer.json, or a model.init_from directory that has one".into()
                    },
                )?;
            }
            Data::Text { .. } | Data::Tokens { .. } => {}
        }
        if let Data::Text {
            tokenizer: Some(t), ..
        }
        | Data::Jsonl {
            tokenizer: Some(t), ..
        } = self
        {
            ensure(!t.trim().is_empty(), "data.tokenizer", || {
                "must not be empty".into()
            })?;
        }
        match self.validation() {
            Some(v) => v.validate(self, init_from),
            None => Ok(()),
        }
    }
}

impl Validation {
    fn validate(&self, data: &Data, init_from: Option<&InitFrom>) -> Result<(), Error> {
        ensure(self.every_steps > 0, "data.validation.every_steps", || {
            "must be at least 1".into()
        })?;
        ensure(self.batches > 0, "data.validation.batches", || {
            "must be at least 1".into()
        })?;
        match (&self.path, self.split) {
            (Some(path), None) => ensure(!path.trim().is_empty(), "data.validation.path", || {
                "must not be empty".into()
            }),
            (None, Some(split)) => {
                ensure(split > 0.0 && split < 1.0, "data.validation.split", || {
                    format!("{split} must be a fraction of the documents, above 0 and below 1")
                })?;
                ensure(
                    data.tokenizer(init_from).is_some(),
                    "data.validation.split",
                    || "only tokenized text has documents to split; give a separate path".into(),
                )
            }
            _ => Err(Error::spec(
                "data.validation",
                "give either `path` (a separate dataset) or `split` (a fraction of the documents)",
            )),
        }
    }
}
