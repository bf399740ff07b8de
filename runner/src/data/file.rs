//! One file of tokens: an llm.c token shard (a header of 256 little-endian i32 — magic
//! 20240520, version 1, token count — then uint16 tokens) or a text file (one token per byte).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::Error;

const SHARD_MAGIC: i32 = 20240520;
const SHARD_VERSION: i32 = 1;
const HEADER_BYTES: u64 = 256 * 4;

pub(super) struct TokenFile {
    pub(super) path: PathBuf,
    /// Where the tokens start.
    header_bytes: u64,
    /// Bytes per token: 2 for shards, 1 for text.
    pub(super) width: usize,
    /// Tokens in the file.
    pub(super) len: u64,
}

fn data_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::Data {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

impl TokenFile {
    /// Checks a token shard's header against its size, as llm.c's `dataloader_load_shard_`.
    pub(super) fn shard(path: PathBuf) -> Result<Self, Error> {
        let mut file = open(&path)?;
        let size = file_size(&file, &path)?;
        let mut header = [0u8; HEADER_BYTES as usize];
        if size < HEADER_BYTES {
            return Err(data_error(
                &path,
                format!("truncated: {size} bytes is shorter than the {HEADER_BYTES}-byte header"),
            ));
        }
        file.read_exact(&mut header)
            .map_err(|e| data_error(&path, format!("cannot read the header: {e}")))?;
        let field = |i: usize| i32::from_le_bytes(header[4 * i..4 * i + 4].try_into().unwrap());
        let (magic, version, count) = (field(0), field(1), field(2));
        if magic != SHARD_MAGIC {
            return Err(data_error(
                &path,
                format!("bad magic {magic}, expected {SHARD_MAGIC}: not an llm.c token shard"),
            ));
        }
        if version != SHARD_VERSION {
            return Err(data_error(
                &path,
                format!("unsupported version {version}, expected {SHARD_VERSION}"),
            ));
        }
        let len = u64::try_from(count)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| data_error(&path, format!("header says {count} tokens")))?;
        let expected = HEADER_BYTES + 2 * len;
        if size != expected {
            let what = if size < expected {
                "truncated"
            } else {
                "too long"
            };
            return Err(data_error(
                &path,
                format!(
                    "{what}: the header says {len} tokens, which take {expected} bytes, but the file has {size}"
                ),
            ));
        }
        Ok(TokenFile {
            path,
            header_bytes: HEADER_BYTES,
            width: 2,
            len,
        })
    }

    pub(super) fn text(path: PathBuf) -> Result<Self, Error> {
        let len = file_size(&open(&path)?, &path)?;
        Ok(TokenFile {
            path,
            header_bytes: 0,
            width: 1,
            len,
        })
    }

    /// Reads `out.len()` tokens starting at token `start` through `file`, an open handle of
    /// this file; `scratch` holds at least `out.len() · width` bytes.
    pub(super) fn read(
        &self,
        file: &mut File,
        start: u64,
        scratch: &mut [u8],
        out: &mut [u32],
    ) -> Result<(), Error> {
        let bytes = &mut scratch[..out.len() * self.width];
        file.seek(SeekFrom::Start(
            self.header_bytes + start * self.width as u64,
        ))
        .and_then(|_| file.read_exact(bytes))
        .map_err(|e| data_error(&self.path, format!("cannot read token {start}: {e}")))?;
        match self.width {
            1 => out
                .iter_mut()
                .zip(bytes.iter())
                .for_each(|(o, &b)| *o = b.into()),
            _ => out
                .iter_mut()
                .zip(bytes.chunks_exact(2))
                .for_each(|(o, b)| *o = u16::from_le_bytes([b[0], b[1]]).into()),
        }
        Ok(())
    }

    pub(super) fn open(&self) -> Result<File, Error> {
        open(&self.path)
    }
}

fn open(path: &Path) -> Result<File, Error> {
    File::open(path).map_err(|e| data_error(path, format!("cannot open: {e}")))
}

fn file_size(file: &File, path: &Path) -> Result<u64, Error> {
    file.metadata()
        .map(|m| m.len())
        .map_err(|e| data_error(path, format!("cannot read its size: {e}")))
}

/// The files a shard pattern names, sorted; a pattern without wildcards is one file.
pub(super) fn shard_paths(pattern: &str) -> Result<Vec<PathBuf>, Error> {
    if glob::Pattern::escape(pattern) == pattern {
        return Ok(vec![PathBuf::from(pattern)]);
    }
    let paths = glob::glob(pattern)
        .map_err(|e| data_error(Path::new(pattern), format!("invalid glob pattern: {e}")))?;
    let mut files = Vec::new();
    for entry in paths {
        let path =
            entry.map_err(|e| data_error(e.path(), format!("cannot read: {}", e.error())))?;
        if path.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(data_error(
            Path::new(pattern),
            "the pattern matches no files",
        ));
    }
    files.sort();
    Ok(files)
}
