//! `data`: where training tokens come from.

use serde::{Deserialize, Serialize};

use super::Architecture;
use crate::error::{Error, ensure};

/// Synthetic tokens are below `min(vocab_size, MAX_SYNTHETIC_VOCAB)`: 32² contexts is a table a
/// tiny GPT learns in a few hundred steps (the runner's `data` module makes the corpus).
pub const MAX_SYNTHETIC_VOCAB: usize = 32;

/// Each context of the synthetic corpus has four successors: a smaller vocabulary has none to
/// draw.
pub const MIN_SYNTHETIC_VOCAB: usize = 4;

impl Data {
    /// Bytes of the tokens of a file of this kind (none for synthetic data).
    pub fn token_width(&self) -> usize {
        match self {
            Data::Synthetic => 0,
            Data::Text { .. } => 1,
            Data::Tokens { .. } => 2,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", from = "DataDoc")]
pub enum Data {
    /// A built-in corpus generated from `training.seed` (the default).
    #[default]
    Synthetic,
    /// A UTF-8 (or any) file read as bytes: token = byte, so the vocabulary needs ≥ 256 ids.
    Text { path: String },
    /// llm.c token shards (header magic 20240520, uint16 tokens); `path` may be a glob.
    /// `shuffle: false` (default) reads batches sequentially exactly as llm.c's loader does.
    Tokens { path: String, shuffle: bool },
}

/// The wire form. serde ignores extra keys next to the tag of a unit variant, so `synthetic` is
/// an empty struct variant here, where `deny_unknown_fields` applies.
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
enum DataDoc {
    Synthetic {},
    Text {
        path: String,
    },
    Tokens {
        path: String,
        #[serde(default)]
        shuffle: bool,
    },
}

impl From<DataDoc> for Data {
    fn from(d: DataDoc) -> Data {
        match d {
            DataDoc::Synthetic {} => Data::Synthetic,
            DataDoc::Text { path } => Data::Text { path },
            DataDoc::Tokens { path, shuffle } => Data::Tokens { path, shuffle },
        }
    }
}

impl Data {
    pub(super) fn validate(&self, arch: &Architecture) -> Result<(), Error> {
        match self {
            Data::Synthetic => match arch.model().map(|m| m.vocab_size()) {
                Some(v) => ensure(v >= MIN_SYNTHETIC_VOCAB, "data.kind", || {
                    format!(
                        "synthetic data needs model.vocab_size ≥ {MIN_SYNTHETIC_VOCAB}, not {v}"
                    )
                }),
                None => Ok(()),
            },
            Data::Text { path } => {
                ensure(!path.trim().is_empty(), "data.path", || {
                    "must not be empty".into()
                })?;
                match arch.model().map(|m| m.vocab_size()) {
                    Some(v) => ensure(v >= 256, "data.kind", || {
                        format!("byte-level text needs model.vocab_size ≥ 256, not {v}")
                    }),
                    None => Ok(()),
                }
            }
            Data::Tokens { path, .. } => ensure(!path.trim().is_empty(), "data.path", || {
                "must not be empty".into()
            }),
        }
    }
}
