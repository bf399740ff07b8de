//! GPT-2 on flat per-unit buffers: named views of a unit's tensors, the activations of one
//! micro-batch, and the forward and backward passes of each unit.

mod acts;
mod pass;

pub use acts::{Acts, BlockActs};
pub use pass::{block_backward, block_forward, embed_backward, embed_forward, head};

use scheduler::model::{GptShape, TensorKind};

/// Sizes of one micro-batch of one model: B, T, C, NH, V, L.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchDims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    pub v: usize,
    pub l: usize,
}

impl BatchDims {
    pub fn new(shape: &GptShape, micro_batch: usize, seq_len: usize) -> BatchDims {
        BatchDims {
            b: micro_batch,
            t: seq_len,
            c: shape.n_embd,
            nh: shape.n_head,
            v: shape.vocab_size,
            l: shape.n_layer,
        }
    }

    /// Rows of every (B·T, ·) matrix.
    pub fn tokens(&self) -> usize {
        self.b * self.t
    }

    pub(crate) fn attention(&self) -> kernels::attention::AttentionDims {
        kernels::attention::AttentionDims {
            b: self.b,
            t: self.t,
            c: self.c,
            nh: self.nh,
        }
    }
}

/// The tensors of a block, in state-dict order, as slices `S` (`&[X]` or `&mut [X]`) of the
/// block's unit buffer. Weights are Hugging Face Conv1D layout, used as x·W + b.
pub struct Block<S> {
    pub ln1_w: S,
    pub ln1_b: S,
    /// (C, 3C)
    pub attn_w: S,
    pub attn_b: S,
    /// (C, C)
    pub proj_w: S,
    pub proj_b: S,
    pub ln2_w: S,
    pub ln2_b: S,
    /// (C, 4C)
    pub fc_w: S,
    pub fc_b: S,
    /// (4C, C)
    pub fcproj_w: S,
    pub fcproj_b: S,
}

impl<S> Block<S> {
    fn from_parts(
        [
            ln1_w,
            ln1_b,
            attn_w,
            attn_b,
            proj_w,
            proj_b,
            ln2_w,
            ln2_b,
            fc_w,
            fc_b,
            fcproj_w,
            fcproj_b,
        ]: [S; 12],
    ) -> Self {
        Block {
            ln1_w,
            ln1_b,
            attn_w,
            attn_b,
            proj_w,
            proj_b,
            ln2_w,
            ln2_b,
            fc_w,
            fc_b,
            fcproj_w,
            fcproj_b,
        }
    }
}

impl<'a, X> Block<&'a [X]> {
    pub fn new(unit: &'a [X], shape: &GptShape) -> Self {
        Block::from_parts(split(unit, lens(&TensorKind::BLOCK, shape)))
    }
}

impl<'a, X> Block<&'a mut [X]> {
    pub fn new_mut(unit: &'a mut [X], shape: &GptShape) -> Self {
        Block::from_parts(split_mut(unit, lens(&TensorKind::BLOCK, shape)))
    }
}

/// `(wte (V, C), wpe (maxT, C))` of the embeddings unit.
pub fn embeddings<'a, X>(unit: &'a [X], shape: &GptShape) -> [&'a [X]; 2] {
    split(unit, lens(&TensorKind::EMBEDDINGS, shape))
}

pub fn embeddings_mut<'a, X>(unit: &'a mut [X], shape: &GptShape) -> [&'a mut [X]; 2] {
    split_mut(unit, lens(&TensorKind::EMBEDDINGS, shape))
}

/// `(weight, bias)` of the final LayerNorm unit.
pub fn final_norm<'a, X>(unit: &'a [X], shape: &GptShape) -> [&'a [X]; 2] {
    split(unit, lens(&TensorKind::FINAL_NORM, shape))
}

pub fn final_norm_mut<'a, X>(unit: &'a mut [X], shape: &GptShape) -> [&'a mut [X]; 2] {
    split_mut(unit, lens(&TensorKind::FINAL_NORM, shape))
}

fn lens<const N: usize>(kinds: &[TensorKind; N], shape: &GptShape) -> [usize; N] {
    kinds.map(|k| k.dims(shape).numel())
}

/// Consecutive slices of the given lengths from the front of `buf` (the rest is padding).
fn split<T, const N: usize>(mut buf: &[T], lens: [usize; N]) -> [&[T]; N] {
    lens.map(|n| {
        let (head, tail) = buf.split_at(n);
        buf = tail;
        head
    })
}

fn split_mut<T, const N: usize>(mut buf: &mut [T], lens: [usize; N]) -> [&mut [T]; N] {
    lens.map(|n| {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(n);
        buf = tail;
        head
    })
}
