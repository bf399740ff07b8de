//! Batches cut from files as llm.c's loader cuts them (see the `data` module documentation),
//! in file order, or shuffled.
//!
//! Shuffling permutes the files once per epoch and, within each file, the order of its
//! world-batch windows (each `B·T·world_size` tokens); the window grid itself is llm.c's, so
//! every token is still read once per epoch. The permutations come from the job's seed, the
//! epoch and the file, the same on every rank, so ranks keep reading disjoint slices of one
//! window and a resumed run recomputes them from its position alone. They are computed an
//! element at a time (`permuted`), so the loader's memory does not grow with the data.

use std::fs::File;
use std::path::{Path, PathBuf};

use rand::Rng;
use scheduler::memory::Category;

use super::file::{TokenFile, data_error};
use super::{BatchLayout, NOT_A_TARGET, Position, Stream, rng, split_window};
use crate::accounting::{Accountant, Buffer};
use crate::error::Error;

pub(super) struct Windows {
    files: Vec<TokenFile>,
    layout: BatchLayout,
    /// Tokens at or above this are refused; `None` for text, whose bytes always fit.
    vocab_size: Option<usize>,
    /// The seed for shuffling, or `None` to read in order.
    shuffle: Option<u64>,
    /// Whether tokens carry `NOT_A_TARGET` (tokenized fine-tuning examples).
    masked: bool,
    position: Position,
    /// The file being read, by index into `files`; llm.c also keeps just one open.
    open: Option<(usize, File)>,
    /// The raw bytes of one window.
    bytes: Buffer<u8>,
    window: Buffer<u32>,
}

impl Windows {
    /// A file read a byte a token.
    pub(super) fn text(
        path: &Path,
        what: &str,
        layout: BatchLayout,
        vocab_size: usize,
        acct: &Accountant,
    ) -> Result<Self, Error> {
        if vocab_size < 256 {
            return Err(data_error(
                what,
                format!("byte-level text needs vocab_size ≥ 256, not {vocab_size}"),
            ));
        }
        let file = TokenFile::text(path.to_path_buf(), what.to_string())?;
        Self::new(vec![file], 1, layout, None, (None, false), acct)
    }

    /// llm.c shards, each named in errors by its `what`, shuffled by a seed or not, with
    /// `NOT_A_TARGET` marks or not.
    pub(super) fn shards(
        files: &[(PathBuf, String)],
        layout: BatchLayout,
        vocab_size: usize,
        order: (Option<u64>, bool),
        acct: &Accountant,
    ) -> Result<Self, Error> {
        let files = files
            .iter()
            .map(|(path, what)| TokenFile::shard(path.clone(), what.clone()))
            .collect::<Result<_, _>>()?;
        // Room for either shard version, as the memory model counts it.
        Self::new(files, 4, layout, Some(vocab_size), order, acct)
    }

    fn new(
        files: Vec<TokenFile>,
        width: usize,
        layout: BatchLayout,
        vocab_size: Option<usize>,
        (shuffle, masked): (Option<u64>, bool),
        acct: &Accountant,
    ) -> Result<Self, Error> {
        let tokens = layout.tokens() + 1;
        let windows = Windows {
            files,
            layout,
            vocab_size,
            shuffle,
            masked,
            position: Position::default(),
            open: None,
            bytes: acct.alloc(Category::Buffers, tokens * width)?,
            window: acct.alloc(Category::Buffers, tokens)?,
        };
        let need = windows.stride() + 1;
        if let Some(short) = windows.files.iter().find(|f| f.len < need) {
            return Err(data_error(
                &short.what,
                format!("less than one batch: B·T·world_size + 1 = {need} tokens"),
            ));
        }
        Ok(windows)
    }

    /// Tokens between the starts of consecutive world batches (llm.c's total batch size).
    fn stride(&self) -> u64 {
        (self.layout.tokens() * self.layout.world_size) as u64
    }

    /// Whole windows in a file; the last token of a window is the next one's first.
    fn batches_in(&self, file: usize) -> u64 {
        (self.files[file].len - 1) / self.stride()
    }

    /// The file at `position`: this epoch's permutation of the files.
    fn file_at(&self, position: Position) -> usize {
        let n = self.files.len() as u64;
        match self.shuffle {
            Some(seed) => {
                let key = rng(seed, Stream::ShardOrder, position.epoch, 0).next_u64();
                permuted(position.shard as u64, n, key) as usize
            }
            None => position.shard,
        }
    }

    /// Which window of `file` the `batch`-th read of this epoch takes.
    fn window_index(&self, epoch: u64, file: usize, batch: u64) -> u64 {
        match self.shuffle {
            Some(seed) => {
                let key = rng(seed, Stream::WindowOrder, epoch, file as u64).next_u64();
                permuted(batch, self.batches_in(file), key)
            }
            None => batch,
        }
    }

    pub(super) fn next_batch(
        &mut self,
        inputs: &mut [u32],
        targets: &mut [u32],
    ) -> Result<(), Error> {
        let mut p = self.position;
        let current = self.file_at(p);
        if p.batch >= self.batches_in(current) {
            p.batch = 0;
            p.shard += 1;
            if p.shard == self.files.len() {
                p.shard = 0;
                p.epoch += 1;
            }
        }
        let file = self.file_at(p);
        let window = self.window_index(p.epoch, file, p.batch);
        let start = window * self.stride() + (self.layout.rank * self.layout.tokens()) as u64;
        self.read(file, start)?;
        split_window(&self.window, inputs, targets, self.masked);
        p.batch += 1;
        self.position = p;
        Ok(())
    }

    /// Reads `B·T + 1` tokens of `file` from token `start` into `self.window`.
    fn read(&mut self, file: usize, start: u64) -> Result<(), Error> {
        let handle = match &mut self.open {
            Some((open, handle)) if *open == file => handle,
            slot => &mut slot.insert((file, self.files[file].open()?)).1,
        };
        let f = &self.files[file];
        f.read(handle, start, &mut self.bytes, &mut self.window)?;
        let id_bits = if self.masked { !NOT_A_TARGET } else { u32::MAX };
        if let Some(vocab_size) = self.vocab_size
            && let Some(i) = self
                .window
                .iter()
                .position(|&t| (t & id_bits) as usize >= vocab_size)
        {
            return Err(Error::TokenOutOfRange {
                what: f.what.clone(),
                index: start + i as u64,
                vocab_size,
            });
        }
        Ok(())
    }

    pub(super) fn position(&self) -> Position {
        self.position
    }

    pub(super) fn seek(&mut self, position: Position) -> Result<(), Error> {
        let fits = position.shard < self.files.len() && {
            let file = self.file_at(position);
            position.batch <= self.batches_in(file)
        };
        if !fits {
            return Err(Error::DataConfig {
                reason: format!(
                    "{position:?} is past the end of these {} file(s) with this batch layout",
                    self.files.len()
                ),
            });
        }
        self.position = position;
        Ok(())
    }
}

/// Element `i` of a permutation of `0..n` chosen by `key`: a four-round Feistel network over the
/// smallest domain of 4^k ≥ n values, applied again while the result is ≥ n (cycle walking),
/// which stays inside `0..n` and keeps the map one-to-one. Costs no memory, whatever `n`.
fn permuted(i: u64, n: u64, key: u64) -> u64 {
    assert!(i < n, "index {i} outside 0..{n}");
    let half = (64 - (n - 1).leading_zeros()).div_ceil(2).max(1);
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut left, mut right) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = mix(right ^ key.rotate_left(16 * round as u32) ^ round) & mask;
            (left, right) = (right, left ^ f);
        }
        x = (left << half) | right;
        if x < n {
            return x;
        }
    }
}

/// SplitMix64's finaliser: every input bit affects every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::permuted;

    #[test]
    fn permuted_is_a_permutation_of_every_size_and_depends_on_the_key() {
        for n in [1u64, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097] {
            for key in [0u64, 1, 0xdead_beef] {
                let mut seen: Vec<u64> = (0..n).map(|i| permuted(i, n, key)).collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n {n} key {key}");
            }
        }
        let order = |key| {
            (0..1000)
                .map(|i| permuted(i, 1000, key))
                .collect::<Vec<_>>()
        };
        assert_ne!(order(1), order(2));
        assert_ne!(order(1), (0..1000).collect::<Vec<_>>());
    }
}
