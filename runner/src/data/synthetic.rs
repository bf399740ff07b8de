//! The built-in corpus: an order-2 Markov chain over at most `MAX_SYNTHETIC_VOCAB` tokens, made
//! from the seed. Each context (a, b) has four successors with probabilities
//! `SUCCESSOR_PROBABILITIES`; the likeliest depends on b alone, so a model first gains by
//! learning bigrams and then by attending to the token before. Every sequence starts from two
//! uniformly drawn tokens, so the best possible mean loss is known exactly (`entropy_floor`),
//! and training tests can state a threshold above it.

use rand::RngExt;
use rand::seq::SliceRandom;

use scheduler::memory::Category;
pub use scheduler::spec::MAX_SYNTHETIC_VOCAB;
use scheduler::spec::MIN_SYNTHETIC_VOCAB;

use super::{BatchLayout, Position, Stream, rng, split_window};
use crate::accounting::{Accountant, Buffer};
use crate::error::Error;

/// Probability of each of a context's four successors, likeliest (the bigram one) first.
pub const SUCCESSOR_PROBABILITIES: [f64; 4] = [0.5, 0.25, 0.15, 0.1];

/// The same probabilities as cumulative twentieths, for exact integer sampling.
const CUMULATIVE: [u32; MIN_SYNTHETIC_VOCAB] = [10, 15, 18, 20];

/// The number of distinct tokens synthetic data uses with a model of `vocab_size`.
pub fn synthetic_vocab(vocab_size: usize) -> usize {
    vocab_size.min(MAX_SYNTHETIC_VOCAB)
}

/// The lowest mean cross-entropy (nats per token) any model can reach on synthetic sequences
/// of `seq_len`: the first target follows a single uniformly drawn token (ln V), every later
/// one has its full context (the successors' entropy, 1.208 nats). With the default vocabulary
/// of 32 this is 1.243 nats at `seq_len` 64; uniform guessing costs ln 32 = 3.466, and a model
/// that knows only bigram statistics 1.970-1.985 (counted over seeds 1-5 in `tests/data.rs`),
/// so a loss below that shows attention at work.
pub fn entropy_floor(vocab_size: usize, seq_len: usize) -> f64 {
    let successors: f64 = SUCCESSOR_PROBABILITIES.iter().map(|p| -p * p.ln()).sum();
    let first = (synthetic_vocab(vocab_size) as f64).ln();
    (first + (seq_len as f64 - 1.0) * successors) / seq_len as f64
}

pub(super) struct Synthetic {
    layout: BatchLayout,
    seed: u64,
    vocab: u32,
    /// Successors of context (a, b) at `a·vocab + b`, likeliest first.
    successors: Buffer<[u32; 4]>,
    /// Batches produced so far.
    batches: u64,
    row: Buffer<u32>,
}

impl Synthetic {
    pub(super) fn new(
        layout: BatchLayout,
        seed: u64,
        vocab_size: usize,
        acct: &Accountant,
    ) -> Result<Self, Error> {
        let v = synthetic_vocab(vocab_size);
        if v < MIN_SYNTHETIC_VOCAB {
            return Err(Error::DataConfig {
                reason: format!(
                    "synthetic data needs vocab_size ≥ {MIN_SYNTHETIC_VOCAB}, not {vocab_size}"
                ),
            });
        }
        let v = v as u32;
        let mut rng = rng(seed, Stream::SyntheticChain, 0, 0);
        let mut bigram: Vec<u32> = (0..v).collect();
        bigram.shuffle(&mut rng);
        let mut successors = acct.alloc::<[u32; 4]>(Category::Buffers, (v * v) as usize)?;
        // Context (a, b) at a·v + b: its likeliest successor depends on b alone.
        let tops = (0..v).flat_map(|_a| bigram.iter().copied());
        for (slot, top) in successors.iter_mut().zip(tops) {
            let mut next = [top; 4];
            for k in 1..4 {
                next[k] = loop {
                    let t = rng.random_range(0..v);
                    if !next[..k].contains(&t) {
                        break t;
                    }
                };
            }
            *slot = next;
        }
        Ok(Synthetic {
            layout,
            seed,
            vocab: v,
            successors,
            batches: 0,
            row: acct.alloc(Category::Buffers, layout.seq_len + 1)?,
        })
    }

    /// Each row is its own sequence, keyed by its index in the world's stream of rows, so
    /// ranks read disjoint rows and any batch can be made without the ones before it.
    pub(super) fn next_batch(&mut self, inputs: &mut [u32], targets: &mut [u32]) {
        let BatchLayout {
            batch,
            seq_len: t,
            rank,
            world_size,
        } = self.layout;
        assert_eq!(inputs.len(), batch * t, "inputs must be B·T long");
        let first_row = (self.batches * world_size as u64 + rank as u64) * batch as u64;
        for b in 0..batch {
            self.fill_row(first_row + b as u64);
            let span = b * t..(b + 1) * t;
            split_window(
                &self.row,
                &mut inputs[span.clone()],
                &mut targets[span],
                false,
            );
        }
        self.batches += 1;
    }

    fn fill_row(&mut self, index: u64) {
        let v = self.vocab;
        let mut rng = rng(self.seed, Stream::SyntheticRow, index, 0);
        self.row[0] = rng.random_range(0..v);
        self.row[1] = rng.random_range(0..v);
        for i in 2..self.row.len() {
            let context = (self.row[i - 2] * v + self.row[i - 1]) as usize;
            let r = rng.random_range(0..CUMULATIVE[3]);
            let k = CUMULATIVE.iter().position(|&c| r < c).unwrap();
            self.row[i] = self.successors[context][k];
        }
    }

    pub(super) fn position(&self) -> Position {
        Position {
            batch: self.batches,
            ..Position::default()
        }
    }

    pub(super) fn seek(&mut self, position: Position) -> Result<(), Error> {
        if position.epoch != 0 || position.shard != 0 {
            return Err(Error::DataConfig {
                reason: format!("{position:?} is not a position in synthetic data"),
            });
        }
        self.batches = position.batch;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_thresholds_are_the_documented_probabilities() {
        let mut previous = 0;
        for (&c, p) in CUMULATIVE.iter().zip(SUCCESSOR_PROBABILITIES) {
            assert_eq!(f64::from(c - previous) / f64::from(CUMULATIVE[3]), p);
            previous = c;
        }
    }
}
