//! What the loaders read, from the spec's `data`: its files resolved inside the data roots, and
//! text tokenized into cached shards first.

use std::path::{Path, PathBuf};

use scheduler::spec::{Data, InitFrom, TOKENIZER_FILE, TokenizerSource, Validation};

use super::documents::{DocFile, Format};
use super::tokenize::{self, Holdout, Job, TokenizerFile, Tokenizing};
use crate::error::Error;
use wire::data_roots::{DataRoots, describe};

/// What one loader reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// The corpus generated from the seed.
    Synthetic,
    /// A file read a byte a token.
    Bytes { path: PathBuf, what: String },
    /// llm.c token shards, each with how errors name it, read in order or shuffled by the
    /// seed.
    Shards {
        files: Vec<(PathBuf, String)>,
        shuffle: bool,
        /// Tokens carry [`super::NOT_A_TARGET`] where they are not trained on.
        masked: bool,
    },
}

/// The training data and, when the spec validates, the validation data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inputs {
    pub train: Input,
    pub validation: Option<Input>,
}

impl Inputs {
    /// Resolves `data` inside `roots`, tokenizing text (once per content and settings, see
    /// `tokenize`) with the tokenizer the spec names or `init_from`'s.
    pub fn prepare(
        data: &Data,
        init_from: Option<&InitFrom>,
        roots: &DataRoots,
        t: &Tokenizing<'_>,
    ) -> Result<Inputs, Error> {
        let validation_path = |v: &Validation| -> Result<String, Error> {
            v.path.clone().ok_or_else(|| Error::DataConfig {
                reason: "data.validation.split: only tokenized text has documents to split".into(),
            })
        };
        match data {
            Data::Synthetic => Ok(Inputs {
                train: Input::Synthetic,
                validation: None,
            }),
            Data::Text {
                path,
                tokenizer: None,
                validation,
            } => {
                let bytes = |field, path: &str| -> Result<Input, Error> {
                    Ok(Input::Bytes {
                        path: roots.resolve(field, path)?,
                        what: describe(field, path),
                    })
                };
                Ok(Inputs {
                    train: bytes("data.path", path)?,
                    validation: validation
                        .as_ref()
                        .map(|v| bytes("data.validation.path", &validation_path(v)?))
                        .transpose()?,
                })
            }
            Data::Tokens {
                path,
                shuffle,
                validation,
            } => {
                let shards = |field, path: &str, shuffle| -> Result<Input, Error> {
                    Ok(Input::Shards {
                        files: matches(roots, field, path)?,
                        shuffle,
                        masked: false,
                    })
                };
                Ok(Inputs {
                    train: shards("data.path", path, *shuffle)?,
                    validation: validation
                        .as_ref()
                        .map(|v| shards("data.validation.path", &validation_path(v)?, false))
                        .transpose()?,
                })
            }
            Data::Text {
                path, validation, ..
            }
            | Data::Jsonl {
                path, validation, ..
            } => tokenized(data, path, validation.as_ref(), init_from, roots, t),
        }
    }
}

/// Text `data` (at `path`, validated on `validation`) tokenized into the cache, as shards.
fn tokenized(
    data: &Data,
    path: &str,
    validation: Option<&Validation>,
    init_from: Option<&InitFrom>,
    roots: &DataRoots,
    t: &Tokenizing<'_>,
) -> Result<Inputs, Error> {
    let format = data.fields().map_or(Format::Text, Format::Jsonl);
    let source = data.tokenizer(init_from).ok_or_else(|| Error::DataConfig {
        reason: "data.tokenizer: JSON Lines need a tokenizer".into(),
    })?;
    let tokenizer = tokenizer_file(roots, source)?;
    let docs = |field, path: &str| -> Result<Vec<DocFile>, Error> {
        Ok(matches(roots, field, path)?
            .into_iter()
            .map(|(path, what)| DocFile { path, what })
            .collect())
    };
    let train = docs("data.path", path)?;
    let held_out_files = match validation.and_then(|v| v.path.as_deref()) {
        Some(p) => Some(docs("data.validation.path", p)?),
        None => None,
    };
    let holdout = match (validation, &held_out_files) {
        (_, Some(files)) => Some(Holdout::Files(files)),
        (Some(v), None) => v.split.map(Holdout::Split),
        (None, None) => None,
    };
    let what = describe("data.path", path);
    let job = Job {
        format,
        train: &train,
        validation: holdout,
        tokenizer: &tokenizer,
        what: &what,
    };
    let (dir, manifest) = tokenize::tokenize(&job, t)?;
    let shards = |names: &[String], part: &str| Input::Shards {
        files: names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let n = names.len();
                let what = format!("{what}, tokenized {part}, shard {} of {n}", i + 1);
                (dir.join(name), what)
            })
            .collect(),
        shuffle: false,
        masked: manifest.masked,
    };
    Ok(Inputs {
        train: shards(&manifest.train, "training data"),
        validation: validation
            .is_some()
            .then(|| shards(&manifest.validation, "validation data")),
    })
}

/// The files `pattern` matches, each named by the field, the pattern and, for several, its place
/// in the sorted list (never its own name).
fn matches(
    roots: &DataRoots,
    field: &'static str,
    pattern: &str,
) -> Result<Vec<(PathBuf, String)>, Error> {
    let paths = roots.glob(field, pattern)?;
    let n = paths.len();
    Ok(paths
        .into_iter()
        .enumerate()
        .map(|(i, path)| {
            let what = match n {
                1 => describe(field, pattern),
                _ => format!("{}, file {} of {n}", describe(field, pattern), i + 1),
            };
            (path, what)
        })
        .collect())
}

/// The tokenizer file, resolved inside the roots: the one named, or the `tokenizer.json` of the
/// directory `model.init_from` names (or holds its file).
fn tokenizer_file(roots: &DataRoots, source: TokenizerSource<'_>) -> Result<TokenizerFile, Error> {
    match source {
        TokenizerSource::Named(path) => Ok(TokenizerFile {
            path: roots.resolve("data.tokenizer", path)?,
            what: describe("data.tokenizer", path),
        }),
        TokenizerSource::InitFrom(path) => {
            let resolved = roots.resolve("model.init_from", path)?;
            let dir = if resolved.is_dir() {
                resolved.as_path()
            } else {
                resolved.parent().unwrap_or(Path::new("/"))
            };
            let beside = dir.join(TOKENIZER_FILE);
            let what = format!("{}'s {TOKENIZER_FILE}", describe("model.init_from", path));
            let beside = beside.to_str().ok_or_else(|| Error::Data {
                what: what.clone(),
                reason: "not valid UTF-8".into(),
            })?;
            Ok(TokenizerFile {
                path: roots.resolve("model.init_from", beside)?,
                what,
            })
        }
    }
}
