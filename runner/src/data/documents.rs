//! The documents of a text dataset, in order: JSON Lines (one object a line, a string member of
//! it the document, or two: a prompt and its completion, or a conversation: a list of messages)
//! or UTF-8 files (a file a document).
//! Errors name the file, the line and the field; a file is named by the spec's path (and its
//! place among a glob's matches).

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;

use scheduler::spec::Fields;

use super::file::data_error;
use crate::error::Error;
use wire::data_roots::open_regular;

/// How documents are laid out in a file.
#[derive(Debug, Clone, Copy)]
pub(super) enum Format<'a> {
    /// One JSON object a line; `Fields` names the document's string members.
    Jsonl(Fields<'a>),
    /// The whole file is one document.
    Text,
}

/// A document, and where it is (the file and line, for errors).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Document {
    pub(super) what: String,
    pub(super) body: Body,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Body {
    /// Text, all of it trained on.
    Text(String),
    /// A prompt that is context only, and its completion.
    PromptCompletion { prompt: String, completion: String },
    /// A conversation (objects with string `role` and `content`), rendered by a chat template.
    Messages(serde_json::Value),
}

impl Document {
    /// Bytes of text, about, for sizing blocks.
    fn len(&self) -> usize {
        match &self.body {
            Body::Text(text) => text.len(),
            Body::PromptCompletion { prompt, completion } => prompt.len() + completion.len(),
            Body::Messages(messages) => messages.as_array().map_or(0, |m| {
                m.iter()
                    .map(|m| m["content"].as_str().map_or(0, str::len))
                    .sum()
            }),
        }
    }
}

/// One file of documents, resolved inside the data roots, and how errors name it.
#[derive(Debug, Clone)]
pub(super) struct DocFile {
    pub(super) path: PathBuf,
    pub(super) what: String,
}

/// Documents read a block at a time, so that a block can be tokenized in parallel while memory
/// stays bounded by the block.
pub(super) struct Documents<'a> {
    files: &'a [DocFile],
    format: Format<'a>,
    /// The file being read and its reader, with the number of the last line read.
    current: Option<(usize, BufReader<std::fs::File>, u64)>,
    next_file: usize,
    /// Bytes of the files read so far.
    pub(super) bytes_read: u64,
}

impl<'a> Documents<'a> {
    pub(super) fn new(files: &'a [DocFile], format: Format<'a>) -> Self {
        Documents {
            files,
            format,
            current: None,
            next_file: 0,
            bytes_read: 0,
        }
    }

    /// Up to about `max_bytes` of documents (at least one, unless the files are done).
    pub(super) fn next_block(&mut self, max_bytes: usize) -> Result<Vec<Document>, Error> {
        let mut block = Vec::new();
        let mut bytes = 0;
        while bytes < max_bytes {
            let Some(doc) = self.next_document()? else {
                break;
            };
            bytes += doc.len().max(1);
            block.push(doc);
        }
        Ok(block)
    }

    fn next_document(&mut self) -> Result<Option<Document>, Error> {
        loop {
            let (index, mut reader, mut line) = match self.current.take() {
                Some(open) => open,
                None => {
                    let Some(f) = self.files.get(self.next_file) else {
                        return Ok(None);
                    };
                    self.next_file += 1;
                    let file = open_regular(&f.path, &f.what)?;
                    (self.next_file - 1, BufReader::new(file), 0)
                }
            };
            let what = &self.files[index].what;
            match self.format {
                Format::Text => {
                    let mut bytes = Vec::new();
                    reader
                        .read_to_end(&mut bytes)
                        .map_err(|e| data_error(what, format!("cannot read: {}", e.kind())))?;
                    self.bytes_read += bytes.len() as u64;
                    let text = utf8(bytes, what, 0)?;
                    return Ok(Some(Document {
                        what: what.clone(),
                        body: Body::Text(text),
                    }));
                }
                Format::Jsonl(fields) => {
                    let Some(bytes) =
                        next_line(&mut reader, what, &mut line, &mut self.bytes_read)?
                    else {
                        continue;
                    };
                    let doc = json_document(bytes, fields, format!("{what}, line {line}"))?;
                    self.current = Some((index, reader, line));
                    if doc.is_some() {
                        return Ok(doc);
                    }
                }
            }
        }
    }
}

/// The next line (without its newline), counting lines and bytes; `None` at the end.
fn next_line(
    reader: &mut BufReader<std::fs::File>,
    what: &str,
    line: &mut u64,
    bytes_read: &mut u64,
) -> Result<Option<Vec<u8>>, Error> {
    let mut bytes = Vec::new();
    let n = reader.read_until(b'\n', &mut bytes).map_err(|e| {
        data_error(
            what,
            format!("cannot read line {}: {}", *line + 1, e.kind()),
        )
    })?;
    if n == 0 {
        return Ok(None);
    }
    *line += 1;
    *bytes_read += n as u64;
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
    }
    Ok(Some(bytes))
}

/// A line's document: `None` for a blank line, an error naming the line and field otherwise.
fn json_document(
    line: Vec<u8>,
    fields: Fields<'_>,
    what: String,
) -> Result<Option<Document>, Error> {
    let line = utf8(line, &what, 1)?;
    if line.trim().is_empty() {
        return Ok(None);
    }
    let fail = |reason: String| data_error(&what, reason);
    let value: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| fail(format!("not JSON: {e}")))?;
    let serde_json::Value::Object(mut object) = value else {
        return Err(fail("not a JSON object".into()));
    };
    let mut member = |field: &str| {
        object
            .remove(field)
            .ok_or_else(|| fail(format!("no field {field:?}")))
    };
    let string = |field: &str, v: serde_json::Value| match v {
        serde_json::Value::String(s) => Ok(s),
        _ => Err(fail(format!("field {field:?} is not a string"))),
    };
    let body = match fields {
        Fields::Text(field) => Body::Text(string(field, member(field)?)?),
        Fields::PromptCompletion { prompt, completion } => Body::PromptCompletion {
            prompt: string(prompt, member(prompt)?)?,
            completion: string(completion, member(completion)?)?,
        },
        Fields::Messages(field) => {
            let messages = member(field)?;
            let list = messages
                .as_array()
                .ok_or_else(|| fail(format!("field {field:?} is not a list of messages")))?;
            for (i, m) in list.iter().enumerate() {
                for key in ["role", "content"] {
                    if !m[key].is_string() {
                        return Err(fail(format!("field {field:?}[{i}].{key} is not a string")));
                    }
                }
            }
            Body::Messages(messages)
        }
    };
    Ok(Some(Document { what, body }))
}

/// `bytes` as text; an error says where the first invalid byte is (its line, counted from
/// `first_line`, when the text is a whole file).
fn utf8(bytes: Vec<u8>, what: &str, first_line: u64) -> Result<String, Error> {
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let bytes = e.as_bytes();
        let reason = if first_line == 0 {
            let line = 1 + bytes[..at].iter().filter(|&&b| b == b'\n').count();
            format!("not valid UTF-8 at line {line}")
        } else {
            format!("not valid UTF-8 (byte {} of the line)", at + 1)
        };
        data_error(what, reason)
    })
}
