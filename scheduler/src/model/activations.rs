//! What one micro-batch of training keeps besides the model states: the tensors each forward
//! saves for its backward, the backward's scratch, and the step's buffers (logits, tokens).
//! B = micro-batch, T = sequence length, C = channels, NH = heads, V = vocabulary, L = layers.

use serde::Serialize;

use super::{ActivationTensor, GptShape};
use crate::kernel_figures::{MATMUL_SCRATCH_F32, matmul_packs_f32};

/// How an activation tensor's elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Element {
    /// The compute dtype (fp32, fp16 or bf16).
    Compute,
    F32,
    U32,
}

impl Element {
    pub fn bytes(self, compute_bytes: u64) -> u64 {
        match self {
            Element::Compute => compute_bytes,
            Element::F32 | Element::U32 => 4,
        }
    }
}

/// What the memory model reads of a family's list of step tensors (`ActivationTensor` for
/// GPT-2, `LlamaActivation`): each family lists its tensors, this counts them alike.
pub trait StepTensors: Copy + PartialEq + 'static {
    type Shape;
    /// Saved per block (all of them unless activation checkpointing is on).
    const PER_BLOCK: &'static [Self];
    /// Held once per step.
    const PER_STEP: &'static [Self];
    /// The block output: kept per layer even under checkpointing.
    const BLOCK_OUTPUT: Self;
    /// The attention's saved log-sum-exp and its backward's scratch.
    const ATTENTION: [Self; 2];
    /// One chunk of the loss's logits.
    const LOGITS: Self;
    fn elements(self, s: &Self::Shape, b: usize, t: usize) -> usize;
    fn stored_as(self) -> Element;
    fn buffer(self) -> bool;
    fn layers(s: &Self::Shape) -> usize;
    /// The widest input or output of a block's matmuls: with the micro-batch's tokens, the
    /// deepest product of a step ([`matmul_depth`]).
    fn widest(s: &Self::Shape) -> usize;
}

/// Copies of `tensor` a step holds (see `ActivationTensor::copies`).
pub(crate) fn copies<A: StepTensors>(tensor: A, s: &A::Shape, checkpointing: bool) -> usize {
    if tensor == A::BLOCK_OUTPUT || (A::PER_BLOCK.contains(&tensor) && !checkpointing) {
        A::layers(s)
    } else {
        1
    }
}

/// What the attention and the loss hold of a step, as the estimate states them: the two
/// terms that grew with T² and with B·T·V before attention ran in tiles and the loss in chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StepScratch {
    /// Rows of logits the loss computes at once ([`loss_chunk_rows`]).
    pub loss_chunk_rows: u64,
    /// fp32 logits of one chunk (among the buffers).
    pub logits_bytes: u64,
    /// The attention's log-sum-exp saved per layer and its backward's scratch (among the
    /// activations).
    pub attention_bytes: u64,
}

impl StepScratch {
    /// For a micro-batch of `b` × `t` tokens of a model of `A`'s family with vocabulary `v`.
    pub(crate) fn of<A: StepTensors>(
        s: &A::Shape,
        (b, t, v): (usize, usize, usize),
        checkpointing: bool,
    ) -> Self {
        let bytes = |a: A| (a.elements(s, b, t) * copies(a, s, checkpointing)) as u64 * 4;
        StepScratch {
            loss_chunk_rows: loss_chunk_rows(b * t, v) as u64,
            logits_bytes: bytes(A::LOGITS),
            attention_bytes: A::ATTENTION.into_iter().map(bytes).sum(),
        }
    }
}

/// Bytes of every tensor of `A`'s list for a micro-batch of `b` × `t` tokens, with the CPU
/// matmuls' widening scratch among the buffers.
pub(crate) fn tally<A: StepTensors>(
    s: &A::Shape,
    b: usize,
    t: usize,
    checkpointing: bool,
    compute_bytes: u64,
) -> Activations {
    let mut out = Activations {
        activations: 0,
        buffers: matmul_scratch_bytes(compute_bytes, matmul_depth::<A>(s, b, t)),
    };
    for &tensor in A::PER_BLOCK.iter().chain(A::PER_STEP) {
        let bytes = (tensor.elements(s, b, t) * copies(tensor, s, checkpointing)) as u64
            * tensor.stored_as().bytes(compute_bytes);
        if tensor.buffer() {
            out.buffers += bytes;
        } else {
            out.activations += bytes;
        }
    }
    out
}

/// The most bytes the loss's logits take: the LM head and the cross-entropy run over chunks
/// of rows, forward and backward fused per chunk, so logits never exist for a whole batch.
pub const LOSS_CHUNK_BYTES: usize = 64 << 20;

/// Rows per chunk of the loss over `tokens` rows and a vocabulary of `v`: as many as fit in
/// [`LOSS_CHUNK_BYTES`] of fp32 logits, at least 64 (the head's GEMM wants rows), at most all.
pub fn loss_chunk_rows(tokens: usize, v: usize) -> usize {
    (LOSS_CHUNK_BYTES / (4 * v.max(1))).max(64).min(tokens)
}

/// The deepest product of a step of `b` × `t` tokens: the weight gradients' (depth: the
/// tokens), or a block's widest layer's.
pub fn matmul_depth<A: StepTensors>(s: &A::Shape, b: usize, t: usize) -> usize {
    (b * t).max(A::widest(s))
}

/// f32 scratch of the CPU matmuls when no product is deeper than `depth`: the widening tiles
/// ([`MATMUL_SCRATCH_F32`]), or the bf16 dot-product kernels' packs where those are larger
/// (past 65,536 of depth).
pub fn matmul_scratch_f32(depth: usize) -> usize {
    MATMUL_SCRATCH_F32.max(matmul_packs_f32(depth))
}

/// Bytes of the CPU matmuls' scratch for a compute dtype of `compute_bytes` and products up
/// to `depth` deep.
pub fn matmul_scratch_bytes(compute_bytes: u64, depth: usize) -> u64 {
    if compute_bytes == 4 {
        0
    } else {
        4 * matmul_scratch_f32(depth) as u64
    }
}

/// Bytes of activations and of activation-sized buffers for one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activations {
    pub activations: u64,
    pub buffers: u64,
}

impl Activations {
    pub fn new(s: &GptShape, b: usize, t: usize, checkpointing: bool, compute_bytes: u64) -> Self {
        tally::<ActivationTensor>(s, b, t, checkpointing, compute_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    #[test]
    fn checkpointing_keeps_block_outputs_and_one_block_to_recompute() {
        let s = Preset::Gpt2Small.shape();
        let (b, t) = (4, 64);
        let full = Activations::new(&s, b, t, false, 4).activations;
        let ckpt = Activations::new(&s, b, t, true, 4).activations;
        let block: u64 = ActivationTensor::BLOCK
            .iter()
            .map(|a| a.len(&s, b, t) as u64 * a.element().bytes(4))
            .sum();
        let res3 = ActivationTensor::Res3.len(&s, b, t) as u64 * 4;
        assert_eq!(full - ckpt, (s.n_layer as u64 - 1) * (block - res3));
    }

    #[test]
    fn half_precision_halves_stored_tensors_but_not_statistics() {
        let s = Preset::Tiny.shape();
        let f32 = Activations::new(&s, 2, 16, false, 4);
        let bf16 = Activations::new(&s, 2, 16, false, 2);
        assert!(bf16.activations < f32.activations && bf16.activations * 2 > f32.activations);
        // Logits and token ids stay 4 bytes; fp16/bf16 add the matmuls' widening scratch.
        assert_eq!(bf16.buffers, f32.buffers + 4 * MATMUL_SCRATCH_F32 as u64);
    }
}
