//! A safetensors file read a tensor at a time: only its header is held, and each tensor's
//! bytes go from the file straight to where they belong (checkpoints and `init_from` weights
//! are never read whole into memory the memory model does not count).

use std::fs::File;
use std::os::unix::fs::FileExt;

use safetensors::tensor::{Metadata, TensorInfo};

/// Largest header read: a GPT-2 file's is tens of KiB.
const MAX_HEADER_BYTES: u64 = 16 << 20;

#[derive(Debug)]
pub struct TensorFile {
    file: File,
    data_start: u64,
    header: Metadata,
}

/// What a file that is not one is called: its bytes are the user's, so nothing of them is
/// quoted.
const NOT_SAFETENSORS: &str = "not a safetensors file";

impl TensorFile {
    /// Reads and checks `file`'s header: every tensor's bytes are as many as its shape and
    /// dtype say, and lie within the file.
    pub fn new(file: File) -> Result<TensorFile, String> {
        let len = file
            .metadata()
            .map_err(|e| format!("cannot read its size: {}", e.kind()))?
            .len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|_| NOT_SAFETENSORS.to_string())?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER_BYTES.min(len.saturating_sub(8)) {
            return Err(NOT_SAFETENSORS.into());
        }
        let mut json = vec![0u8; n as usize];
        file.read_exact_at(&mut json, 8)
            .map_err(|e| format!("cannot read: {}", e.kind()))?;
        let header: Metadata =
            serde_json::from_slice(&json).map_err(|_| NOT_SAFETENSORS.to_string())?;
        let data_start = 8 + n;
        let fits = |info: &TensorInfo| {
            let (start, end) = info.data_offsets;
            let bytes = info
                .shape
                .iter()
                .try_fold(info.dtype.bitsize(), |bits, &d| bits.checked_mul(d))
                .map(|bits| bits.div_ceil(8));
            start <= end && bytes == Some(end - start) && data_start + end as u64 <= len
        };
        if !header.tensors().values().all(|info| fits(info)) {
            return Err(NOT_SAFETENSORS.into());
        }
        Ok(TensorFile {
            file,
            data_start,
            header,
        })
    }

    pub fn names(&self) -> Vec<String> {
        self.header.tensors().into_keys().collect()
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.header.info(name)
    }

    /// Bytes `at..at + dst.len()` of tensor `name` into `dst`.
    pub fn read(&self, name: &str, at: usize, dst: &mut [u8]) -> Result<(), String> {
        let info = self.info(name).ok_or_else(|| format!("no tensor {name}"))?;
        let (start, end) = info.data_offsets;
        if at + dst.len() > end - start {
            return Err(format!(
                "{name} holds {} bytes, not {}",
                end - start,
                at + dst.len()
            ));
        }
        self.file
            .read_exact_at(dst, self.data_start + (start + at) as u64)
            .map_err(|e| format!("{name}: cannot read: {}", e.kind()))
    }
}
