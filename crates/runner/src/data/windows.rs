//! Batches cut from files as llm.c's loader cuts them (see the `data` module documentation),
//! in file order, or shuffled.
//!
//! Shuffling permutes the files once per epoch and, within each file, the order of its
//! world-batch windows (each `B·T·world_size` tokens); the window grid itself is llm.c's, so
//! every token is still read once per epoch. The permutations come from the job's seed, the
//! epoch and the file, the same on every rank, so ranks keep reading disjoint slices of one
//! window and a resumed run recomputes them from its position alone.

use std::fs::File;

use rand::seq::SliceRandom;

use super::file::{TokenFile, shard_paths};
use super::{BatchLayout, Position, Stream, rng, split_window};
use crate::error::Error;

pub(super) struct Windows {
    files: Vec<TokenFile>,
    layout: BatchLayout,
    /// Tokens at or above this are refused; `None` for text, whose bytes always fit.
    vocab_size: Option<usize>,
    /// The seed for shuffling, or `None` to read in order.
    shuffle: Option<u64>,
    position: Position,
    /// This epoch's file order: indices into `files`.
    order: (u64, Vec<usize>),
    /// The window order for (epoch, file index), when shuffling.
    window_order: Option<((u64, usize), Vec<u64>)>,
    /// The file being read, by index into `files`; llm.c also keeps just one open.
    open: Option<(usize, File)>,
    bytes: Vec<u8>,
    window: Vec<u32>,
}

impl Windows {
    pub(super) fn text(path: &str, layout: BatchLayout, vocab_size: usize) -> Result<Self, Error> {
        let file = TokenFile::text(path.into())?;
        if vocab_size < 256 {
            return Err(Error::Data {
                path: file.path,
                reason: format!("byte-level text needs vocab_size ≥ 256, not {vocab_size}"),
            });
        }
        Self::new(vec![file], layout, None, None)
    }

    pub(super) fn shards(
        pattern: &str,
        layout: BatchLayout,
        vocab_size: usize,
        shuffle: Option<u64>,
    ) -> Result<Self, Error> {
        let files = shard_paths(pattern)?
            .into_iter()
            .map(TokenFile::shard)
            .collect::<Result<_, _>>()?;
        Self::new(files, layout, Some(vocab_size), shuffle)
    }

    fn new(
        files: Vec<TokenFile>,
        layout: BatchLayout,
        vocab_size: Option<usize>,
        shuffle: Option<u64>,
    ) -> Result<Self, Error> {
        let mut windows = Windows {
            files,
            layout,
            vocab_size,
            shuffle,
            position: Position::default(),
            order: (0, Vec::new()),
            window_order: None,
            open: None,
            bytes: Vec::new(),
            window: vec![0; layout.tokens() + 1],
        };
        let need = windows.stride() + 1;
        if let Some(short) = windows.files.iter().find(|f| f.len < need) {
            return Err(Error::Data {
                path: short.path.clone(),
                reason: format!(
                    "{} tokens is less than one batch: B·T·world_size + 1 = {need}",
                    short.len
                ),
            });
        }
        windows.order = (0, windows.file_order(0));
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

    fn file_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.files.len()).collect();
        if let Some(seed) = self.shuffle {
            order.shuffle(&mut rng(seed, Stream::ShardOrder, epoch, 0));
        }
        order
    }

    /// The file at `position`, computing the epoch's order if it is not the cached one.
    fn file_at(&mut self, position: Position) -> usize {
        if self.order.0 != position.epoch {
            self.order = (position.epoch, self.file_order(position.epoch));
        }
        self.order.1[position.shard]
    }

    /// Which window of `file` the `batch`-th read of this epoch takes.
    fn window_index(&mut self, epoch: u64, file: usize, batch: u64) -> u64 {
        let Some(seed) = self.shuffle else {
            return batch;
        };
        let key = (epoch, file);
        if self.window_order.as_ref().is_none_or(|(k, _)| *k != key) {
            let mut order: Vec<u64> = (0..self.batches_in(file)).collect();
            order.shuffle(&mut rng(seed, Stream::WindowOrder, epoch, file as u64));
            self.window_order = Some((key, order));
        }
        self.window_order.as_ref().unwrap().1[batch as usize]
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
        split_window(&self.window, inputs, targets);
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
        if let Some(vocab_size) = self.vocab_size
            && let Some(i) = self.window.iter().position(|&t| t as usize >= vocab_size)
        {
            return Err(Error::TokenOutOfRange {
                path: f.path.clone(),
                index: start + i as u64,
                token: self.window[i],
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
