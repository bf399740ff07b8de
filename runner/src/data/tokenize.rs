//! Text into tokens, once: documents are tokenized with a Hugging Face `tokenizer.json`, each
//! followed by the end-of-sequence token (a fine-tuning example's prompt first, with the special
//! tokens the tokenizer adds and its tokens marked [`NOT_A_TARGET`], then the completion), and
//! written as llm.c uint32 shards into a cache folder
//! named by a hash of everything that decides them (the files' contents, the tokenizer, the
//! format and, for a split, the seed). Every rank, retry and later job with the same data reads
//! those shards; none tokenizes again.
//!
//! A tokenization is built in `<key>.partial` under an exclusive lock on `<key>.lock` and renamed
//! to `<key>` once its manifest is written, so a folder named by its key is always complete: a
//! run killed part way leaves only a `.partial` folder, which the next run starts over.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use super::chat::ChatTemplate;
use super::documents::{Body, DocFile, Document, Documents, Format};
use super::file::{HEADER_BYTES, data_error, shard_header_u32};
use super::{NOT_A_TARGET, Stream, rng};
use crate::error::Error;
use scheduler::spec::Fields;
use wire::data_roots::open_regular;

/// Bumped when the shards' layout changes, so old cache entries are not read.
const CACHE_VERSION: &str = "zerotrain-tokens-1";

/// The most tokens one shard holds: llm.c's header counts them in an i32.
const SHARD_TOKENS: u64 = i32::MAX as u64;

/// Text read per parallel block.
const BLOCK_BYTES: usize = 8 << 20;

/// Where tokenization happens and whom it tells.
pub struct Tokenizing<'a> {
    /// The cache folder; tokenized data goes in `tokens/<key>/` under it.
    pub cache: &'a Path,
    /// The job's seed, which chooses a split's validation documents.
    pub seed: u64,
    /// The model's vocabulary: every id the tokenizer can produce must be below it.
    pub vocab_size: usize,
    /// The model config's `eos_token_id`, used when the tokenizer's files name none.
    pub eos_token_id: Option<u32>,
    /// ProgressLines lines.
    pub log: &'a (dyn Fn(&str) + Sync),
}

/// A tokenizer file, resolved, and how errors name it.
pub(super) struct TokenizerFile {
    pub(super) path: PathBuf,
    pub(super) what: String,
}

/// What to tokenize.
pub(super) struct Job<'a> {
    pub(super) format: Format<'a>,
    pub(super) train: &'a [DocFile],
    /// Separate validation files, or the fraction of the training documents to hold out.
    pub(super) validation: Option<Holdout<'a>>,
    pub(super) tokenizer: &'a TokenizerFile,
    /// How errors about the whole dataset name it.
    pub(super) what: &'a str,
}

pub(super) enum Holdout<'a> {
    Files(&'a [DocFile]),
    Split(f64),
}

/// The shards of a tokenization.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct TokenShards {
    pub(super) documents: u64,
    pub(super) tokens: u64,
    pub(super) train: Vec<String>,
    pub(super) validation_documents: u64,
    pub(super) validation_tokens: u64,
    pub(super) validation: Vec<String>,
    /// Whether tokens carry [`NOT_A_TARGET`] (prompts).
    #[serde(default)]
    pub(super) masked: bool,
}

/// The cache folder of `job`'s tokens and its manifest, tokenizing first if no complete one
/// exists.
pub(super) fn tokenize(job: &Job<'_>, t: &Tokenizing<'_>) -> Result<(PathBuf, TokenShards), Error> {
    let encoder = Encoder::new(job, t)?;
    let key = key(job, t, &encoder)?;
    let root = t.cache.join("tokens");
    std::fs::create_dir_all(&root).map_err(|e| cache_error(&root, &e))?;
    let dir = root.join(&key);
    if let Some(m) = read_manifest(&dir)? {
        (t.log)(&format!(
            "{}: tokenized before ({} tokens, cache {key:.16}): not tokenizing again",
            job.what, m.tokens
        ));
        return Ok((dir, m));
    }
    let lock_path = root.join(format!("{key}.lock"));
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| cache_error(&lock_path, &e))?;
    lock.lock().map_err(|e| cache_error(&lock_path, &e))?;
    // Another rank or process may have finished while this one waited.
    if let Some(m) = read_manifest(&dir)? {
        return Ok((dir, m));
    }
    let partial = root.join(format!("{key}.partial"));
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(|e| cache_error(&partial, &e))?;
    }
    std::fs::create_dir(&partial).map_err(|e| cache_error(&partial, &e))?;
    let manifest = write_shards(job, t, &encoder, &partial)?;
    let file = partial.join(MANIFEST);
    std::fs::write(
        &file,
        serde_json::to_vec(&manifest).expect("a manifest serialises"),
    )
    .and_then(|()| File::open(&file)?.sync_all())
    .map_err(|e| cache_error(&file, &e))?;
    std::fs::rename(&partial, &dir).map_err(|e| cache_error(&dir, &e))?;
    Ok((dir, manifest))
}

const MANIFEST: &str = "manifest.json";

fn read_manifest(dir: &Path) -> Result<Option<TokenShards>, Error> {
    let file = dir.join(MANIFEST);
    match std::fs::read(&file) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| cache_error(&file, &e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(cache_error(&file, &e)),
    }
}

fn cache_error(path: &Path, e: &dyn std::fmt::Display) -> Error {
    Error::DataConfig {
        reason: format!("tokenized data cache {}: {e}", path.display()),
    }
}

/// The tokenizer, and its file's text (part of the cache key).
fn load(file: &TokenizerFile, t: &Tokenizing<'_>) -> Result<(Tokenizer, String), Error> {
    let text = read_text(&file.path, &file.what)?;
    let tokenizer = <Tokenizer as std::str::FromStr>::from_str(&text).map_err(|e| {
        data_error(
            &file.what,
            format!("not a tokenizer.json the tokenizers library reads: {e}"),
        )
    })?;
    let ids = tokenizer
        .get_vocab(true)
        .values()
        .max()
        .map_or(0, |&id| id as usize + 1);
    if ids > t.vocab_size {
        return Err(data_error(
            &file.what,
            format!(
                "its vocabulary has ids up to {}, which model.vocab_size {} cannot embed",
                ids - 1,
                t.vocab_size
            ),
        ));
    }
    Ok((tokenizer, text))
}

fn read_text(path: &Path, what: &str) -> Result<String, Error> {
    let mut text = String::new();
    open_regular(path, what)?
        .read_to_string(&mut text)
        .map_err(|e| data_error(what, format!("cannot read it as UTF-8 text: {}", e.kind())))?;
    Ok(text)
}

/// The JSON files transformers saves beside a tokenizer, each with how errors name it.
struct Beside {
    /// `tokenizer_config.json` and `special_tokens_map.json`, where present, as text.
    files: Vec<(String, String)>,
}

impl Beside {
    const NAMES: [&str; 2] = ["tokenizer_config.json", "special_tokens_map.json"];

    fn read(file: &TokenizerFile) -> Result<Beside, Error> {
        let dir = file.path.parent().unwrap_or(Path::new("."));
        let mut files = Vec::new();
        for name in Self::NAMES {
            let path = dir.join(name);
            if path.is_file() {
                let what = format!("{} ({name} beside it)", file.what);
                files.push((read_text(&path, &what)?, what));
            }
        }
        Ok(Beside { files })
    }

    /// Each file's JSON, in `NAMES` order.
    fn json(&self) -> Result<Vec<(serde_json::Value, &str)>, Error> {
        self.files
            .iter()
            .map(|(text, what)| {
                serde_json::from_str(text)
                    .map(|json| (json, what.as_str()))
                    .map_err(|e| data_error(what, format!("not JSON: {e}")))
            })
            .collect()
    }
}

/// A tokenizer with what it adds to documents: the end-of-sequence id and, for conversations,
/// the chat template.
struct Encoder {
    tokenizer: Tokenizer,
    /// `tokenizer.json` as read.
    source: String,
    eos: u32,
    chat: Option<ChatTemplate>,
    beside: Beside,
}

impl Encoder {
    fn new(job: &Job<'_>, t: &Tokenizing<'_>) -> Result<Encoder, Error> {
        let (tokenizer, source) = load(job.tokenizer, t)?;
        let beside = Beside::read(job.tokenizer)?;
        let configs = beside.json()?;
        let eos = eos_id(&tokenizer, &configs, job.tokenizer, t.eos_token_id)?;
        let chat = match job.format {
            Format::Jsonl(Fields::Messages(_)) => {
                let (config, what) = configs
                    .iter()
                    .find(|(json, _)| !json["chat_template"].is_null())
                    .ok_or_else(|| {
                        data_error(
                            &job.tokenizer.what,
                            "conversations need a chat template: tokenizer_config.json beside it has no chat_template",
                        )
                    })?;
                ChatTemplate::from_config(config).map_err(|reason| data_error(what, reason))?
            }
            _ => None,
        };
        Ok(Encoder {
            tokenizer,
            source,
            eos,
            chat,
            beside,
        })
    }

    /// A document's tokens, those not trained on marked [`NOT_A_TARGET`], then the EOS.
    fn encode(&self, doc: &Document) -> Result<Vec<u32>, Error> {
        let fail = |reason: String| data_error(&doc.what, reason);
        let ids = |text: &str, special: bool, target: bool| {
            let mark = if target { 0 } else { NOT_A_TARGET };
            self.tokenizer
                .encode_fast(text, special)
                .map(|e| e.get_ids().iter().map(|&id| id | mark).collect::<Vec<_>>())
                .map_err(|e| fail(format!("the tokenizer failed: {e}")))
        };
        let mut all = match &doc.body {
            Body::Text(text) => ids(text, true, true)?,
            Body::PromptCompletion { prompt, completion } => {
                let mut all = ids(prompt, true, false)?;
                all.extend(ids(completion, false, true)?);
                all
            }
            Body::Messages(messages) => {
                let chat = self.chat.as_ref().expect("conversations have a template");
                let mut all = Vec::new();
                // The template writes the special tokens itself.
                for (text, trained) in chat.spans(messages).map_err(fail)? {
                    all.extend(ids(&text, false, trained)?);
                }
                all
            }
        };
        all.push(self.eos);
        Ok(all)
    }
}

/// The end-of-sequence id: `eos_token` of `tokenizer_config.json` or `special_tokens_map.json`
/// beside the tokenizer (as transformers saves them), else the model config's.
fn eos_id(
    tokenizer: &Tokenizer,
    configs: &[(serde_json::Value, &str)],
    file: &TokenizerFile,
    config: Option<u32>,
) -> Result<u32, Error> {
    for (json, what) in configs {
        let token = match &json["eos_token"] {
            serde_json::Value::String(s) => Some(s.as_str()),
            other => other["content"].as_str(),
        };
        if let Some(token) = token {
            return tokenizer.token_to_id(token).ok_or_else(|| {
                data_error(
                    what,
                    format!("its eos_token {token:?} is not in the tokenizer"),
                )
            });
        }
    }
    config.ok_or_else(|| {
        data_error(
            &file.what,
            "no end-of-sequence token: neither tokenizer_config.json nor special_tokens_map.json \
             beside it names an eos_token, nor does the model's config an eos_token_id",
        )
    })
}

/// The cache key: a SHA-256 of everything the shards depend on.
fn key(job: &Job<'_>, t: &Tokenizing<'_>, encoder: &Encoder) -> Result<String, Error> {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(CACHE_VERSION.as_bytes());
    field(encoder.source.as_bytes());
    for (text, _) in &encoder.beside.files {
        field(text.as_bytes());
    }
    field(&encoder.eos.to_le_bytes());
    match job.format {
        Format::Jsonl(fields) => field(format!("jsonl {fields:?}").as_bytes()),
        Format::Text => field(b"text"),
    }
    let files = |files: &[DocFile], h: &mut Sha256| -> Result<(), Error> {
        for f in files {
            h.update(content_hash(f)?);
        }
        Ok(())
    };
    files(job.train, &mut h)?;
    match job.validation {
        Some(Holdout::Files(v)) => {
            h.update(b"validation files");
            files(v, &mut h)?;
        }
        Some(Holdout::Split(split)) => {
            h.update(b"validation split");
            h.update(split.to_le_bytes());
            h.update(t.seed.to_le_bytes());
        }
        None => {}
    }
    Ok(hex::encode(h.finalize()))
}

fn content_hash(f: &DocFile) -> Result<[u8; 32], Error> {
    let mut file = open_regular(&f.path, &f.what)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| data_error(&f.what, format!("cannot read: {}", e.kind())))?;
        if n == 0 {
            return Ok(h.finalize().into());
        }
        h.update(&buf[..n]);
    }
}

/// Tokenizes every document into `dir`'s shards, a block of documents at a time in parallel,
/// written in order.
fn write_shards(
    job: &Job<'_>,
    t: &Tokenizing<'_>,
    encoder: &Encoder,
    dir: &Path,
) -> Result<TokenShards, Error> {
    let separate: &[DocFile] = match job.validation {
        Some(Holdout::Files(v)) => v,
        _ => &[],
    };
    let total: u64 = job
        .train
        .iter()
        .chain(separate)
        .filter_map(|f| f.path.metadata().ok())
        .map(|m| m.len())
        .sum();
    let mut progress = ProgressLines::new(job.what, total, t.log);
    let mut train = ShardWriter::new(dir, "train");
    let mut validation = ShardWriter::new(dir, "validation");
    let split = match job.validation {
        Some(Holdout::Split(s)) => Some(s),
        _ => None,
    };
    let encode = |block: &[Document]| -> Result<Vec<Vec<u32>>, Error> {
        block.par_iter().map(|doc| encoder.encode(doc)).collect()
    };
    // The training files (a split's held-out documents to validation), then any validation
    // files (all to validation).
    let (mut index, mut read_before) = (0u64, 0);
    for (files, all_held_out) in [(job.train, false), (separate, true)] {
        let mut docs = Documents::new(files, job.format);
        loop {
            let block = docs.next_block(BLOCK_BYTES)?;
            if block.is_empty() {
                break;
            }
            for ids in encode(&block)? {
                let held_out = all_held_out || split.is_some_and(|s| held_out(t.seed, index, s));
                let w = if held_out {
                    &mut validation
                } else {
                    &mut train
                };
                w.push(&ids)?;
                index += 1;
            }
            let tokens = train.tokens + validation.tokens;
            progress.update(read_before + docs.bytes_read, index, tokens);
        }
        read_before += docs.bytes_read;
    }
    if train.documents == 0 {
        return Err(data_error(job.what, "no documents to train on"));
    }
    if job.validation.is_some() && validation.documents == 0 {
        return Err(data_error(
            job.what,
            format!(
                "no validation documents{}",
                match split {
                    Some(s) => format!(": a split of {s} held out none of {index}"),
                    None => String::new(),
                }
            ),
        ));
    }
    progress.done(index, train.tokens + validation.tokens);
    Ok(TokenShards {
        documents: train.documents,
        tokens: train.tokens,
        train: train.finish()?,
        validation_documents: validation.documents,
        validation_tokens: validation.tokens,
        validation: validation.finish()?,
        masked: matches!(
            job.format,
            Format::Jsonl(Fields::PromptCompletion { .. } | Fields::Messages(_))
        ),
    })
}

/// Whether document `index` is held out for validation: a draw from the seed's own stream.
fn held_out(seed: u64, index: u64, split: f64) -> bool {
    use rand::Rng;
    let draw = rng(seed, Stream::ValidationSplit, index, 0).next_u64() >> 11;
    (draw as f64 / (1u64 << 53) as f64) < split
}

/// Tokens appended to llm.c uint32 shards of at most `SHARD_TOKENS`, each header written when
/// the shard is full or finished.
struct ShardWriter {
    dir: PathBuf,
    prefix: &'static str,
    names: Vec<String>,
    open: Option<(PathBuf, BufWriter<File>, u64)>,
    /// A document's tokens as bytes, reused.
    bytes: Vec<u8>,
    documents: u64,
    tokens: u64,
}

impl ShardWriter {
    fn new(dir: &Path, prefix: &'static str) -> Self {
        ShardWriter {
            dir: dir.to_path_buf(),
            prefix,
            names: Vec::new(),
            open: None,
            bytes: Vec::new(),
            documents: 0,
            tokens: 0,
        }
    }

    /// A document's tokens, across shards where one fills.
    fn push(&mut self, mut ids: &[u32]) -> Result<(), Error> {
        while !ids.is_empty() {
            if self
                .open
                .as_ref()
                .is_some_and(|(_, _, n)| *n == SHARD_TOKENS)
            {
                self.close()?;
            }
            let (path, w, n) = match &mut self.open {
                Some(open) => open,
                slot => {
                    let name = format!("{}_{:06}.bin", self.prefix, self.names.len());
                    let path = self.dir.join(&name);
                    let mut w = File::create(&path)
                        .map(BufWriter::new)
                        .map_err(|e| cache_error(&path, &e))?;
                    w.write_all(&[0; HEADER_BYTES as usize])
                        .map_err(|e| cache_error(&path, &e))?;
                    self.names.push(name);
                    slot.insert((path, w, 0))
                }
            };
            let take = ids.len().min((SHARD_TOKENS - *n) as usize);
            self.bytes.clear();
            self.bytes
                .extend(ids[..take].iter().flat_map(|id| id.to_le_bytes()));
            w.write_all(&self.bytes)
                .map_err(|e| cache_error(path, &e))?;
            *n += take as u64;
            self.tokens += take as u64;
            ids = &ids[take..];
        }
        self.documents += 1;
        Ok(())
    }

    /// Writes the open shard's header and syncs it.
    fn close(&mut self) -> Result<(), Error> {
        let Some((path, w, n)) = self.open.take() else {
            return Ok(());
        };
        let mut file = w.into_inner().map_err(|e| cache_error(&path, e.error()))?;
        file.seek(SeekFrom::Start(0))
            .and_then(|_| file.write_all(&shard_header_u32(n)))
            .and_then(|()| file.sync_all())
            .map_err(|e| cache_error(&path, &e))
    }

    fn finish(mut self) -> Result<Vec<String>, Error> {
        self.close()?;
        Ok(self.names)
    }
}

/// ProgressLines lines, at most one every few seconds, and one at the end.
struct ProgressLines<'a> {
    what: &'a str,
    total_bytes: u64,
    log: &'a (dyn Fn(&str) + Sync),
    start: Instant,
    last: Instant,
    bytes: u64,
}

impl<'a> ProgressLines<'a> {
    fn new(what: &'a str, total_bytes: u64, log: &'a (dyn Fn(&str) + Sync)) -> Self {
        let now = Instant::now();
        log(&format!(
            "{what}: tokenizing {:.1} MB",
            total_bytes as f64 / 1e6
        ));
        ProgressLines {
            what,
            total_bytes,
            log,
            start: now,
            last: now,
            bytes: 0,
        }
    }

    fn update(&mut self, bytes: u64, documents: u64, tokens: u64) {
        self.bytes = bytes;
        if self.last.elapsed().as_secs_f64() >= 2.0 {
            self.last = Instant::now();
            (self.log)(&self.line("tokenizing", documents, tokens));
        }
    }

    fn done(&self, documents: u64, tokens: u64) {
        (self.log)(&self.line("tokenized", documents, tokens));
    }

    fn line(&self, verb: &str, documents: u64, tokens: u64) -> String {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        format!(
            "{}: {verb} {:.1} of {:.1} MB, {documents} documents, {tokens} tokens, {:.0} tokens/s",
            self.what,
            self.bytes as f64 / 1e6,
            self.total_bytes as f64 / 1e6,
            tokens as f64 / secs
        )
    }
}
