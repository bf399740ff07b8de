//! One file of tokens: an llm.c token shard (a header of 256 little-endian i32 — magic,
//! version, token count — then the tokens: uint16 for magic 20240520 version 1, uint32 for
//! 20240801 version 7, as llm.c's `dev/data/data_common.py` writes them for GPT-2 and for
//! Llama 3's vocabulary) or a text file (one token per byte).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use crate::error::Error;
use wire::data_roots::open_regular;

/// The two shard formats: (magic, version, bytes per token).
const SHARD_FORMATS: [(i32, i32, usize); 2] = [(20240520, 1, 2), (20240801, 7, 4)];
pub(super) const HEADER_BYTES: u64 = 256 * 4;

/// The uint32 format's header, as tokenized text is written.
pub(super) fn shard_header_u32(tokens: u64) -> [u8; HEADER_BYTES as usize] {
    let (magic, version, _) = SHARD_FORMATS[1];
    let mut header = [0u8; HEADER_BYTES as usize];
    let count = i32::try_from(tokens).expect("a shard holds at most i32::MAX tokens");
    for (i, v) in [magic, version, count].into_iter().enumerate() {
        header[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    header
}

pub(super) struct TokenFile {
    /// Resolved inside the data roots.
    path: PathBuf,
    /// How errors name it: the spec field and path (for a glob, which match), never the
    /// resolved name.
    pub(super) what: String,
    /// Where the tokens start.
    header_bytes: u64,
    /// Bytes per token: 2 or 4 for shards, 1 for text.
    pub(super) width: usize,
    /// Tokens in the file.
    pub(super) len: u64,
}

pub(super) fn data_error(what: &str, reason: impl Into<String>) -> Error {
    Error::Data {
        what: what.to_string(),
        reason: reason.into(),
    }
}

impl TokenFile {
    /// Checks a token shard's header against its size, as llm.c's `dataloader_load_shard_`.
    /// Errors say what is wrong, never the bytes or the size found.
    pub(super) fn shard(path: PathBuf, what: String) -> Result<Self, Error> {
        let mut file = open_regular(&path, &what)?;
        let size = file_size(&file, &what)?;
        let mut header = [0u8; HEADER_BYTES as usize];
        if size < HEADER_BYTES {
            return Err(data_error(
                &what,
                format!("truncated: shorter than the {HEADER_BYTES}-byte header"),
            ));
        }
        file.read_exact(&mut header)
            .map_err(|e| data_error(&what, format!("cannot read the header: {}", e.kind())))?;
        let field = |i: usize| i32::from_le_bytes(header[4 * i..4 * i + 4].try_into().unwrap());
        let (magic, version, count) = (field(0), field(1), field(2));
        let Some(&(_, expected_version, width)) =
            SHARD_FORMATS.iter().find(|(m, _, _)| *m == magic)
        else {
            return Err(data_error(
                &what,
                "bad magic, expected 20240520 or 20240801: not an llm.c token shard",
            ));
        };
        if version != expected_version {
            return Err(data_error(
                &what,
                format!("unsupported version, expected {expected_version} for magic {magic}"),
            ));
        }
        let len = u64::try_from(count)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| data_error(&what, "the header's token count is not positive"))?;
        let expected = HEADER_BYTES + width as u64 * len;
        if size != expected {
            let what_is_wrong = if size < expected {
                "truncated"
            } else {
                "too long"
            };
            return Err(data_error(
                &what,
                format!(
                    "{what_is_wrong}: the file's size does not match the token count in its header"
                ),
            ));
        }
        Ok(TokenFile {
            path,
            what,
            header_bytes: HEADER_BYTES,
            width,
            len,
        })
    }

    pub(super) fn text(path: PathBuf, what: String) -> Result<Self, Error> {
        let len = file_size(&open_regular(&path, &what)?, &what)?;
        Ok(TokenFile {
            path,
            what,
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
        .map_err(|e| {
            data_error(
                &self.what,
                format!("cannot read token {start}: {}", e.kind()),
            )
        })?;
        match self.width {
            1 => out
                .iter_mut()
                .zip(bytes.iter())
                .for_each(|(o, &b)| *o = b.into()),
            2 => out
                .iter_mut()
                .zip(bytes.chunks_exact(2))
                .for_each(|(o, b)| *o = u16::from_le_bytes([b[0], b[1]]).into()),
            _ => out
                .iter_mut()
                .zip(bytes.chunks_exact(4))
                .for_each(|(o, b)| *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
        Ok(())
    }

    /// Opens the file again (it is checked again: still a regular file, no symlink swapped in).
    pub(super) fn open(&self) -> Result<File, Error> {
        Ok(open_regular(&self.path, &self.what)?)
    }
}

fn file_size(file: &File, what: &str) -> Result<u64, Error> {
    file.metadata()
        .map(|m| m.len())
        .map_err(|e| data_error(what, format!("cannot read its size: {}", e.kind())))
}
