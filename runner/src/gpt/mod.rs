//! GPT-2 on flat per-unit buffers: named views of a unit's tensors, the activations of one
//! micro-batch, and the forward and backward passes of each unit.

mod acts;
mod pass;

pub use acts::{Acts, BlockActs};

use scheduler::model::{GptShape, ModelTensor, TensorKind};

use crate::Error;
use crate::accounting::Accountant;
use crate::device::{Device, Num, front, front_mut, split, split_mut};

/// A GPT-2 model's passes over one micro-batch's activations (`pass.rs`).
pub struct Model<X: Num, D: Device> {
    pub shape: GptShape,
    pub dims: BatchDims,
    pub acts: Acts<X, D>,
}

impl<X: Num, D: Device> Model<X, D> {
    pub fn new(
        dev: &D,
        acct: &Accountant,
        shape: &GptShape,
        b: usize,
        t: usize,
        checkpointing: bool,
    ) -> Result<Self, Error> {
        Ok(Model {
            shape: *shape,
            dims: BatchDims::new(shape, b, t),
            acts: Acts::new(dev, acct, shape, b, t, checkpointing)?,
        })
    }
}

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
        kernels::attention::AttentionDims::mha(self.b, self.t, self.c, self.nh)
    }
}

/// The tensors of a block, in state-dict order, as views `S` (shared or exclusive) of the
/// block's unit buffer. Weights are Hugging Face Conv1D layout, used as x·W + b; a projection
/// weight is `None` where the unit does not hold it (a QLoRA base's NF4 weights, which
/// `lora::Adapted::weight` dequantizes).
pub struct Block<S> {
    pub ln1_w: S,
    pub ln1_b: S,
    /// (C, 3C)
    pub attn_w: Option<S>,
    pub attn_b: S,
    /// (C, C)
    pub proj_w: Option<S>,
    pub proj_b: S,
    pub ln2_w: S,
    pub ln2_b: S,
    /// (C, 4C)
    pub fc_w: Option<S>,
    pub fc_b: S,
    /// (4C, C)
    pub fcproj_w: Option<S>,
    pub fcproj_b: S,
}

impl<S> Block<S> {
    /// Names the views `take` cuts, in turn, for each of the block's tensors the unit holds
    /// (`held`).
    fn cut(
        shape: &GptShape,
        held: impl Fn(ModelTensor) -> bool,
        mut take: impl FnMut(usize) -> S,
    ) -> Block<S> {
        let [
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
        ] = TensorKind::BLOCK.map(|k| {
            let numel = k.dims(shape).numel();
            held(ModelTensor::Gpt2(k)).then(|| take(numel))
        });
        let need = |s: Option<S>| s.expect("a block's unit holds its norms and biases");
        Block {
            ln1_w: need(ln1_w),
            ln1_b: need(ln1_b),
            attn_w,
            attn_b: need(attn_b),
            proj_w,
            proj_b: need(proj_b),
            ln2_w: need(ln2_w),
            ln2_b: need(ln2_b),
            fc_w,
            fc_b: need(fc_b),
            fcproj_w,
            fcproj_b: need(fcproj_b),
        }
    }
}

/// Block `unit`'s tensors, to read: those it holds (`held`).
pub fn block<'a, D: Device, X>(
    unit: D::View<'a, X>,
    shape: &GptShape,
    held: impl Fn(ModelTensor) -> bool,
) -> Block<D::View<'a, X>> {
    Block::cut(shape, held, front::<D, X>(unit))
}

/// Block `unit`'s tensors, to write (its gradient); every one `None` without one (frozen).
pub fn block_mut<'a, D: Device, X>(
    unit: Option<D::ViewMut<'a, X>>,
    shape: &GptShape,
) -> Block<Option<D::ViewMut<'a, X>>> {
    // Only a model that is trained has a gradient, and it holds every tensor.
    Block::cut(shape, |_| true, front_mut::<D, X>(unit))
}

/// `(wte (V, C), wpe (maxT, C))` of the embeddings unit.
pub fn embeddings<'a, D: Device, X>(unit: D::View<'a, X>, shape: &GptShape) -> [D::View<'a, X>; 2] {
    split::<D, X, 2>(unit, lens(&TensorKind::EMBEDDINGS, shape))
}

pub fn embeddings_mut<'a, D: Device, X>(
    unit: D::ViewMut<'a, X>,
    shape: &GptShape,
) -> [D::ViewMut<'a, X>; 2] {
    split_mut::<D, X, 2>(unit, lens(&TensorKind::EMBEDDINGS, shape))
}

/// `(weight, bias)` of the final LayerNorm unit.
pub fn final_norm<'a, D: Device, X>(unit: D::View<'a, X>, shape: &GptShape) -> [D::View<'a, X>; 2] {
    split::<D, X, 2>(unit, lens(&TensorKind::FINAL_NORM, shape))
}

pub fn final_norm_mut<'a, D: Device, X>(
    unit: D::ViewMut<'a, X>,
    shape: &GptShape,
) -> [D::ViewMut<'a, X>; 2] {
    split_mut::<D, X, 2>(unit, lens(&TensorKind::FINAL_NORM, shape))
}

fn lens<const N: usize>(kinds: &[TensorKind; N], shape: &GptShape) -> [usize; N] {
    kinds.map(|k| k.dims(shape).numel())
}
