//! `data`: where training tokens come from.

use serde::{Deserialize, Serialize};

use super::Architecture;
use crate::error::{Error, ensure};

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Data {
    /// A built-in corpus generated from `training.seed` (the default).
    #[default]
    Synthetic,
    /// A UTF-8 (or any) file read as bytes: token = byte, so the vocabulary needs ≥ 256 ids.
    Text { path: String },
    /// llm.c token shards (header magic 20240520, uint16 tokens); `path` may be a glob.
    /// `shuffle: false` (default) reads batches sequentially exactly as llm.c's loader does.
    Tokens {
        path: String,
        #[serde(default)]
        shuffle: bool,
    },
}

impl Data {
    pub(super) fn validate(&self, arch: &Architecture) -> Result<(), Error> {
        match self {
            Data::Synthetic => Ok(()),
            Data::Text { path } => {
                ensure(!path.trim().is_empty(), "data.path", || "must not be empty".into())?;
                match arch.gpt() {
                    Some(s) => ensure(s.vocab_size >= 256, "data.kind", || {
                        format!(
                            "byte-level text needs model.vocab_size ≥ 256, not {}",
                            s.vocab_size
                        )
                    }),
                    None => Ok(()),
                }
            }
            Data::Tokens { path, .. } => {
                ensure(!path.trim().is_empty(), "data.path", || "must not be empty".into())
            }
        }
    }
}
