//! `data`: the batches of training tokens one rank reads, from the built-in synthetic corpus, a
//! byte-level text file, or llm.c token shards, which text and JSON Lines are tokenized into
//! first (`tokenize`). Every kind is deterministic given the seed and the `Position`, so a run
//! resumed from a checkpoint reads exactly what it would have read.
//!
//! Files are cut into windows the way llm.c's `dataloader_next_batch` cuts them: each batch of
//! the world reads `B·T·world_size + 1` tokens from one file, rank r takes the `B·T + 1` tokens
//! at `r·B·T` inside it (inputs the first `B·T`, targets the same shifted by one), and the next
//! batch starts `B·T·world_size` tokens later; a file whose next window would not fit is left
//! for the next one, and after the last file the data starts over (a new epoch).

mod chat;
mod documents;
mod file;
mod inputs;
mod synthetic;
mod tokenize;
mod windows;

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::accounting::Accountant;
use crate::error::Error;
use synthetic::Synthetic;
use windows::Windows;

pub use inputs::{Input, Inputs};
pub use synthetic::{MAX_SYNTHETIC_VOCAB, SUCCESSOR_PROBABILITIES, entropy_floor, synthetic_vocab};
pub use tokenize::Tokenizing;
pub use wire::data_roots::DataRoots;
pub(crate) use wire::data_roots::describe;

/// The bit of a stored token (tokenized fine-tuning data) that says it is not trained on: a
/// position whose next token carries it gets the target [`kernels::crossentropy::IGNORE`].
/// Ids stay below 2^31, far above any vocabulary.
pub const NOT_A_TARGET: u32 = 1 << 31;

/// How one rank's batches are shaped and which slice of the world's batch it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLayout {
    /// Sequences per batch (B).
    pub batch: usize,
    /// Tokens per sequence (T).
    pub seq_len: usize,
    pub rank: usize,
    pub world_size: usize,
}

impl BatchLayout {
    /// Tokens in one rank's batch, the length of `inputs` and of `targets`.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq_len
    }

    fn validate(&self) -> Result<(), Error> {
        let reason = if self.batch == 0 || self.seq_len == 0 {
            format!(
                "batch {} and seq_len {} must be positive",
                self.batch, self.seq_len
            )
        } else if self.rank >= self.world_size {
            format!(
                "rank {} is not below world_size {}",
                self.rank, self.world_size
            )
        } else {
            return Ok(());
        };
        Err(Error::DataConfig { reason })
    }
}

/// Where a loader is in its data. Every rank of a job is at the same position, so one copy
/// goes into a checkpoint; it is valid for the same data, seed and batch layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Position {
    /// Completed passes over all the files (0 for synthetic data, which never ends).
    pub epoch: u64,
    /// Index into this epoch's order of token shards (0 for text and synthetic data).
    pub shard: usize,
    /// Batches already read from that shard this epoch (synthetic: in total).
    pub batch: u64,
}

/// Fills one rank's batches; see the module documentation for how files are read.
pub struct DataLoader {
    source: Source,
}

enum Source {
    Synthetic(Synthetic),
    Files(Windows),
}

impl DataLoader {
    /// Opens and checks `input` (every shard's header, as llm.c does at start-up), so that a
    /// bad file fails the job before training. `vocab_size` is the model's: text needs ≥ 256,
    /// and a shard token at or above it is an error when read. Its buffers come from `acct`
    /// (category buffers).
    pub fn new(
        input: &Input,
        layout: BatchLayout,
        seed: u64,
        vocab_size: usize,
        acct: &Accountant,
    ) -> Result<Self, Error> {
        layout.validate()?;
        let source = match input {
            Input::Synthetic => Source::Synthetic(Synthetic::new(layout, seed, vocab_size, acct)?),
            Input::Bytes { path, what } => {
                Source::Files(Windows::text(path, what, layout, vocab_size, acct)?)
            }
            Input::Shards {
                files,
                shuffle,
                masked,
            } => Source::Files(Windows::shards(
                files,
                layout,
                vocab_size,
                (shuffle.then_some(seed), *masked),
                acct,
            )?),
        };
        Ok(DataLoader { source })
    }

    /// Writes the next batch: `inputs[i]` is followed by `targets[i]` in the data.
    ///
    /// # Panics
    /// If either slice is not `layout.tokens()` long.
    pub fn next_batch(&mut self, inputs: &mut [u32], targets: &mut [u32]) -> Result<(), Error> {
        match &mut self.source {
            Source::Synthetic(s) => {
                s.next_batch(inputs, targets);
                Ok(())
            }
            Source::Files(w) => w.next_batch(inputs, targets),
        }
    }

    /// The position to save; `seek` to it to continue with the next batch.
    pub fn position(&self) -> Position {
        match &self.source {
            Source::Synthetic(s) => s.position(),
            Source::Files(w) => w.position(),
        }
    }

    /// Continues from a saved position; fails if the position is outside this data.
    pub fn seek(&mut self, position: Position) -> Result<(), Error> {
        match &mut self.source {
            Source::Synthetic(s) => s.seek(position),
            Source::Files(w) => w.seek(position),
        }
    }
}

/// What a seeded random stream is for; part of its key so that streams never overlap.
#[derive(Clone, Copy)]
enum Stream {
    SyntheticChain = 1,
    SyntheticRow = 2,
    ShardOrder = 3,
    WindowOrder = 4,
    ValidationSplit = 5,
}

/// An independent, reproducible random stream for (`seed`, `stream`, `a`, `b`).
fn rng(seed: u64, stream: Stream, a: u64, b: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    for (chunk, word) in key.chunks_exact_mut(8).zip([seed, stream as u64, a, b]) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    ChaCha8Rng::from_seed(key)
}

/// Copies `B·T + 1` consecutive tokens into inputs and targets offset by one; `masked`
/// windows' [`NOT_A_TARGET`] tokens are ignored as targets and read without the bit as inputs.
fn split_window(window: &[u32], inputs: &mut [u32], targets: &mut [u32], masked: bool) {
    let n = window.len() - 1;
    assert_eq!(
        (inputs.len(), targets.len()),
        (n, n),
        "inputs and targets must be B·T long"
    );
    if !masked {
        inputs.copy_from_slice(&window[..n]);
        targets.copy_from_slice(&window[1..]);
        return;
    }
    for (i, t) in inputs.iter_mut().zip(&window[..n]) {
        *i = t & !NOT_A_TARGET;
    }
    for (o, &t) in targets.iter_mut().zip(&window[1..]) {
        *o = if t & NOT_A_TARGET == 0 {
            t
        } else {
            kernels::crossentropy::IGNORE
        };
    }
}
