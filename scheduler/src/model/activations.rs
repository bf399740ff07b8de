//! What one micro-batch of training keeps besides the model states: the tensors each forward
//! saves for its backward, the backward's scratch, and the step's buffers (logits, tokens).
//! B = micro-batch, T = sequence length, C = channels, NH = heads, V = vocabulary, L = layers.

use serde::Serialize;

use super::GptShape;

/// Every tensor the trainer allocates per micro-batch, named for its role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActivationTensor {
    // Saved by each block's forward for its backward.
    /// (B, T, C) first LayerNorm output.
    Ln1,
    /// (B, T) fp32 statistics of the first LayerNorm.
    Ln1Mean,
    Ln1Rstd,
    /// (B, T, 3C) query, key, value.
    Qkv,
    /// (B, NH, T) fp32 log-sum-exp of each query row's scores: all the attention backward
    /// needs of the probabilities, which it recomputes tile by tile.
    AttLse,
    /// (B, T, C) attention output before its projection.
    AttY,
    /// (B, T, C) residual stream after attention.
    Res2,
    /// (B, T, C) second LayerNorm output.
    Ln2,
    Ln2Mean,
    Ln2Rstd,
    /// (B, T, 4C) MLP pre-activation.
    Fch,
    /// (B, T, 4C) MLP GELU output.
    FchGelu,
    /// (B, T, C) block output: the next block's input. The only per-block tensor kept under
    /// activation checkpointing.
    Res3,
    // Saved once.
    /// (B, T, C) token + position embedding: block 0's input.
    Encoded,
    /// (B, T, C) final LayerNorm output and its fp32 statistics.
    Lnf,
    LnfMean,
    LnfRstd,
    // Backward scratch, reused by every block.
    /// (B, T, C) gradient of the residual stream.
    DResidual,
    /// (B, T, C) gradient of a LayerNorm output or of the attention output.
    DChannels,
    /// (B, T, 4C) gradient of the MLP hidden layer, then of qkv.
    DWide,
    /// (B, NH, T) fp32 `rowsum(dout ∘ out)` of each query row, the attention backward's scratch.
    AttDelta,
    // Buffers.
    /// (rows, V) fp32 logits of one chunk of [`loss_chunk_rows`] tokens, overwritten in place
    /// by their gradient.
    Logits,
    /// (B, T) fp32 per-token losses.
    Losses,
    /// (B, T) input token ids.
    Inputs,
    /// (B, T) target token ids.
    Targets,
}

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

impl ActivationTensor {
    /// Tensors saved per block (all of them unless activation checkpointing is on).
    pub const BLOCK: [ActivationTensor; 13] = [
        Self::Ln1,
        Self::Ln1Mean,
        Self::Ln1Rstd,
        Self::Qkv,
        Self::AttLse,
        Self::AttY,
        Self::Res2,
        Self::Ln2,
        Self::Ln2Mean,
        Self::Ln2Rstd,
        Self::Fch,
        Self::FchGelu,
        Self::Res3,
    ];
    /// Tensors held once per step.
    pub const ONCE: [ActivationTensor; 12] = [
        Self::Encoded,
        Self::Lnf,
        Self::LnfMean,
        Self::LnfRstd,
        Self::DResidual,
        Self::DChannels,
        Self::DWide,
        Self::AttDelta,
        Self::Logits,
        Self::Losses,
        Self::Inputs,
        Self::Targets,
    ];

    /// Number of elements for a micro-batch of `b` sequences of `t` tokens.
    pub fn len(self, s: &GptShape, b: usize, t: usize) -> usize {
        let (c, tokens) = (s.n_embd, b * t);
        match self {
            Self::Ln1Mean
            | Self::Ln1Rstd
            | Self::Ln2Mean
            | Self::Ln2Rstd
            | Self::LnfMean
            | Self::LnfRstd
            | Self::Losses
            | Self::Inputs
            | Self::Targets => tokens,
            Self::AttLse | Self::AttDelta => tokens * s.n_head,
            Self::Ln1
            | Self::AttY
            | Self::Res2
            | Self::Ln2
            | Self::Res3
            | Self::Encoded
            | Self::Lnf
            | Self::DResidual
            | Self::DChannels => tokens * c,
            Self::Qkv => tokens * 3 * c,
            Self::Fch | Self::FchGelu | Self::DWide => tokens * 4 * c,
            Self::Logits => loss_chunk_rows(tokens, s.vocab_size) * s.vocab_size,
        }
    }

    pub fn element(self) -> Element {
        match self {
            Self::Ln1Mean
            | Self::Ln1Rstd
            | Self::Ln2Mean
            | Self::Ln2Rstd
            | Self::LnfMean
            | Self::LnfRstd
            | Self::AttLse
            | Self::AttDelta
            | Self::Logits
            | Self::Losses => Element::F32,
            Self::Inputs | Self::Targets => Element::U32,
            _ => Element::Compute,
        }
    }

    /// Logits and token ids count as buffers; everything else as activations.
    pub fn is_buffer(self) -> bool {
        matches!(
            self,
            Self::Logits | Self::Losses | Self::Inputs | Self::Targets
        )
    }

    /// How many copies a step holds: per-block tensors once per layer, or, under activation
    /// checkpointing, block outputs once per layer plus one block's worth to recompute into.
    pub fn copies(self, s: &GptShape, checkpointing: bool) -> usize {
        copies(self, s, checkpointing)
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

impl StepTensors for ActivationTensor {
    type Shape = GptShape;
    const PER_BLOCK: &'static [Self] = &Self::BLOCK;
    const PER_STEP: &'static [Self] = &Self::ONCE;
    const BLOCK_OUTPUT: Self = Self::Res3;
    const ATTENTION: [Self; 2] = [Self::AttLse, Self::AttDelta];
    const LOGITS: Self = Self::Logits;
    fn elements(self, s: &GptShape, b: usize, t: usize) -> usize {
        self.len(s, b, t)
    }
    fn stored_as(self) -> Element {
        self.element()
    }
    fn buffer(self) -> bool {
        self.is_buffer()
    }
    fn layers(s: &GptShape) -> usize {
        s.n_layer
    }
    fn widest(s: &GptShape) -> usize {
        4 * s.n_embd
    }
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

/// f32 scratch the matrix multiplications widen fp16/bf16 tiles into: enough for the kernels'
/// full tiles (512×1024 inputs, 1024×1024 weights, 512×1024 outputs). fp32 needs none.
pub const MATMUL_SCRATCH_F32: usize = 1 << 21;

/// The deepest product of a step of `b` × `t` tokens: the weight gradients' (depth: the
/// tokens), or a block's widest layer's.
pub fn matmul_depth<A: StepTensors>(s: &A::Shape, b: usize, t: usize) -> usize {
    (b * t).max(A::widest(s))
}

/// f32 scratch of the CPU matmuls when no product is deeper than `depth`: the widening tiles
/// ([`MATMUL_SCRATCH_F32`]), or the bf16 dot-product kernels' packs of one B panel and one
/// row block where those are larger (past 65,536 of depth): 64 dwords per pair on AMX, the
/// larger of its two engines, for whole steps of 32 (`kernels::matmul::packs_len`).
pub fn matmul_scratch_f32(depth: usize) -> usize {
    MATMUL_SCRATCH_F32.max(1024 * depth.div_ceil(32))
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
