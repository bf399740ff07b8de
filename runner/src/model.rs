//! The model a rank trains, whatever its family: one micro-batch's activations and the passes
//! over them, dispatched to the family's module (`gpt`, `llama`). The ZeRO engine calls these
//! and never learns the family's name; this is the one place in the runner it is told.

use std::marker::PhantomData;

use scheduler::memory::{Category, DeviceKind};
use scheduler::model::{MATMUL_SCRATCH_F32, ModelShape, StepTensors};

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::device::{Device, Elem, Num};
use crate::{gpt, llama};

/// Allocates a family's step tensors exactly as `scheduler::model` lists them (sizes, element
/// types, categories), so the memory model counts what the trainer holds.
pub(crate) struct Alloc<'a, D, S, X> {
    dev: &'a D,
    acct: &'a Accountant,
    shape: &'a S,
    b: usize,
    t: usize,
    compute: PhantomData<X>,
}

impl<'a, D: Device, S, X: Num> Alloc<'a, D, S, X> {
    pub(crate) fn new(dev: &'a D, acct: &'a Accountant, shape: &'a S, b: usize, t: usize) -> Self {
        Alloc {
            dev,
            acct,
            shape,
            b,
            t,
            compute: PhantomData,
        }
    }

    pub(crate) fn take<T: Elem, A: StepTensors<Shape = S>>(
        &self,
        tensor: A,
    ) -> Result<Buffer<T, D>, Error> {
        debug_assert_eq!(
            size_of::<T>() as u64,
            tensor.stored_as().bytes(X::BYTES as u64)
        );
        let category = if tensor.buffer() {
            Category::Buffers
        } else {
            Category::Activations
        };
        self.acct.alloc_on(
            self.dev,
            category,
            tensor.elements(self.shape, self.b, self.t),
        )
    }

    /// Where the CPU's GEMMs widen 16-bit tiles; empty for fp32 and on a GPU
    /// (`scheduler::memory::rank_breakdown_on`).
    pub(crate) fn matmul_scratch(&self) -> Result<Buffer<f32, D>, Error> {
        let len = if X::as_f32(&[]).is_some() || D::KIND != DeviceKind::Cpu {
            0
        } else {
            MATMUL_SCRATCH_F32
        };
        self.acct.alloc_on(self.dev, Category::Buffers, len)
    }
}

/// One micro-batch's activations of a model of some family, and its passes. Units are given
/// whole (gathered at stage 3) as views of their flat buffers; gradients are added into.
pub(crate) enum Passes<X: Num, D: Device> {
    Gpt2(gpt::Model<X, D>),
    Llama(llama::Model<X, D>),
}

impl<X: Num, D: Device> Passes<X, D> {
    pub(crate) fn new(
        dev: &D,
        acct: &Accountant,
        model: &ModelShape,
        b: usize,
        t: usize,
        checkpointing: bool,
    ) -> Result<Self, Error> {
        Ok(match model {
            ModelShape::Gpt2(s) => {
                Passes::Gpt2(gpt::Model::new(dev, acct, s, b, t, checkpointing)?)
            }
            ModelShape::Llama(s) => {
                Passes::Llama(llama::Model::new(dev, acct, s, b, t, checkpointing)?)
            }
        })
    }

    /// Tokens of the micro-batch (B·T).
    pub(crate) fn tokens(&self) -> usize {
        match self {
            Passes::Gpt2(m) => m.dims.tokens(),
            Passes::Llama(m) => m.dims.tokens(),
        }
    }

    /// Where the data loader writes the micro-batch: input and target token ids.
    pub(crate) fn batch_mut(&mut self) -> (&mut Buffer<u32, D>, &mut Buffer<u32, D>) {
        match self {
            Passes::Gpt2(m) => (&mut m.acts.inputs, &mut m.acts.targets),
            Passes::Llama(m) => (&mut m.acts.inputs, &mut m.acts.targets),
        }
    }

    /// The logits buffer, dead outside a step (the export gathers through it).
    pub(crate) fn logits_mut(&mut self) -> &mut Buffer<f32, D> {
        match self {
            Passes::Gpt2(m) => &mut m.acts.logits,
            Passes::Llama(m) => &mut m.acts.logits,
        }
    }

    pub(crate) fn embed_forward(&mut self, dev: &D, emb: D::View<'_, X>) -> Result<(), Error> {
        match self {
            Passes::Gpt2(m) => m.embed_forward(dev, emb),
            Passes::Llama(m) => m.embed_forward(dev, emb),
        }
    }

    /// Block `l` forward, saving what its backward reads in activation slot `slot`.
    pub(crate) fn block_forward(
        &mut self,
        dev: &D,
        unit: D::View<'_, X>,
        l: usize,
        slot: usize,
    ) -> Result<(), Error> {
        match self {
            Passes::Gpt2(m) => m.block_forward(dev, unit, l, slot),
            Passes::Llama(m) => m.block_forward(dev, unit, l, slot),
        }
    }

    /// Block `l` backward: the residual stream's gradient goes from its output to its input,
    /// the block's parameter gradients are added into `grad`.
    pub(crate) fn block_backward(
        &mut self,
        dev: &D,
        unit: D::View<'_, X>,
        grad: D::ViewMut<'_, X>,
        l: usize,
        slot: usize,
    ) -> Result<(), Error> {
        match self {
            Passes::Gpt2(m) => m.block_backward(dev, unit, grad, l, slot),
            Passes::Llama(m) => m.block_backward(dev, unit, grad, l, slot),
        }
    }

    /// The final norm forward, the LM head and the cross-entropy, and back through the head:
    /// returns the micro-batch's mean loss and adds the head's weight gradient into `dhead`.
    /// `head` is the unit holding the (V, C) head weight first (the embeddings when tied).
    /// `dloss` is the gradient each token's loss contributes.
    pub(crate) fn loss(
        &mut self,
        dev: &D,
        norm: D::View<'_, X>,
        head: D::View<'_, X>,
        dhead: D::ViewMut<'_, X>,
        dloss: f32,
    ) -> Result<f64, Error> {
        match self {
            Passes::Gpt2(m) => m.loss(dev, norm, head, dhead, dloss),
            Passes::Llama(m) => m.loss(dev, norm, head, dhead, dloss),
        }
    }

    /// Back through the final norm (after [`Passes::loss`]): the residual stream's gradient at
    /// the last block's output, and the norm's gradient added into `dnorm`.
    pub(crate) fn norm_backward(
        &mut self,
        dev: &D,
        norm: D::View<'_, X>,
        dnorm: D::ViewMut<'_, X>,
    ) -> Result<(), Error> {
        match self {
            Passes::Gpt2(m) => m.norm_backward(dev, norm, dnorm),
            Passes::Llama(m) => m.norm_backward(dev, norm, dnorm),
        }
    }

    pub(crate) fn embed_backward(&self, dev: &D, demb: D::ViewMut<'_, X>) -> Result<(), Error> {
        match self {
            Passes::Gpt2(m) => m.embed_backward(dev, demb),
            Passes::Llama(m) => m.embed_backward(dev, demb),
        }
    }
}
