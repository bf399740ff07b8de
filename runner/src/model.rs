//! The model a rank trains, whatever its family: one micro-batch's activations and the passes
//! over them, dispatched to the family's module (`gpt`, `llama`). The ZeRO engine calls these
//! and never learns the family's name; this is the one place in the runner it is told.

use std::marker::PhantomData;
use std::ops::Range;

use kernels::matmul::{DinpMode, Layout};
use scheduler::memory::{Category, DeviceKind};
use scheduler::model::{ModelShape, ModelTensor, StepTensors, matmul_depth, matmul_scratch_f32};

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::device::{Device, Elem, Num};
use crate::lora::Adapted;
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

    /// The micro-batch's family-independent buffers, from the family's names for them.
    pub(crate) fn batch<A: StepTensors<Shape = S>>(
        &self,
        [inputs, targets, logits, losses]: [A; 4],
    ) -> Result<Batch<D>, Error> {
        Ok(Batch {
            inputs: self.take(inputs)?,
            targets: self.take(targets)?,
            logits: self.take(logits)?,
            losses: self.take(losses)?,
        })
    }

    /// Where the CPU's GEMMs widen 16-bit tiles and pack bf16 ones, for the deepest product
    /// of the family `A`'s step; empty for fp32 and on a GPU
    /// (`scheduler::memory::rank_breakdown_on`).
    pub(crate) fn matmul_scratch<A: StepTensors<Shape = S>>(
        &self,
    ) -> Result<Buffer<f32, D>, Error> {
        let len = if X::as_f32(&[]).is_some() || D::KIND != DeviceKind::Cpu {
            0
        } else {
            matmul_scratch_f32(matmul_depth::<A>(self.shape, self.b, self.t))
        };
        self.acct.alloc_on(self.dev, Category::Buffers, len)
    }
}

/// What every family's step holds beside its activations: the micro-batch's token ids, the
/// logits (overwritten by their gradient) and each token's loss.
pub(crate) struct Batch<D: Device> {
    pub inputs: Buffer<u32, D>,
    pub targets: Buffer<u32, D>,
    pub logits: Buffer<f32, D>,
    pub losses: Buffer<f32, D>,
}

impl<D: Device> Batch<D> {
    /// The LM head and the cross-entropy, forward and backward at once, as every family has
    /// them, over chunks of rows (as many as the logits buffer holds,
    /// `scheduler::model::loss_chunk_rows`), so logits never exist for the whole micro-batch:
    /// per chunk, logits = x·Wᵀ for the head weight W (V, C), each token's loss and, in place
    /// of the logits, their gradient (`dloss` per token); then the chunk's rows of
    /// `dx` = ∂loss/∂x, and ∂loss/∂W added into `dw` (none for a frozen head). Returns the
    /// micro-batch's mean loss.
    /// Without `dloss` (validation) only the losses are computed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lm_head<X: Num>(
        &mut self,
        dev: &D,
        x: D::View<'_, X>,
        (w, mut dw): (D::View<'_, X>, Option<D::ViewMut<'_, X>>),
        mut dx: D::ViewMut<'_, X>,
        (n, c, v): (usize, usize, usize),
        dloss: Option<f32>,
        scratch: &mut Buffer<f32, D>,
    ) -> Result<f64, Error> {
        let chunk = self.logits.len() / v;
        for start in (0..n).step_by(chunk) {
            let rows = start..n.min(start + chunk);
            let mkn = (rows.len(), c, v);
            let x = D::slice(D::share(&x), rows.start * c..rows.end * c);
            let mut logits = self.logits.at_mut(0..mkn.0 * v);
            dev.matmul_forward(
                D::reborrow(&mut logits),
                D::share(&x),
                D::share(&w),
                None,
                Layout::NK,
                mkn,
                scratch.view_mut(),
            )?;
            dev.crossentropy_forward(
                self.losses.at_mut(rows.clone()),
                D::reborrow(&mut logits),
                self.targets.at(rows.clone()),
                v,
                dloss,
            )?;
            if dloss.is_none() {
                continue;
            }
            let dx = D::slice_mut(D::reborrow(&mut dx), rows.start * c..rows.end * c);
            let grads = dw.as_mut().map(|dw| (D::reborrow(dw), None));
            let inputs = (x, D::share(&w));
            let (logits, mode) = (D::freeze(logits), DinpMode::Overwrite);
            linear_backward(
                dev,
                dx,
                grads,
                logits,
                inputs,
                Layout::NK,
                mkn,
                mode,
                scratch,
            )?;
        }
        let losses = dev.to_host(self.losses.view())?;
        Ok(losses.iter().map(|&l| f64::from(l)).sum::<f64>() / n as f64)
    }
}

/// A layer's weight gradient and bias gradient to add into; `None` where the weights are
/// frozen (LoRA's base), so backward finds only the input's gradient.
pub(crate) type WeightGrads<'a, X, D> = Option<(
    <D as Device>::ViewMut<'a, X>,
    Option<<D as Device>::ViewMut<'a, X>>,
)>;

/// Backward of `out = inp·W(ᵀ) + b`: `dinp` set or added to (`mode`), and W's and b's
/// gradients added into `grads` unless the weights are frozen; `dout` in the compute dtype or
/// (the LM head's logits) in f32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_backward<X: Num, G: Num, D: Device>(
    dev: &D,
    dinp: D::ViewMut<'_, X>,
    grads: WeightGrads<'_, X, D>,
    dout: D::View<'_, G>,
    (inp, w): (D::View<'_, X>, D::View<'_, X>),
    layout: Layout,
    mkn: (usize, usize, usize),
    mode: DinpMode,
    scratch: &mut Buffer<f32, D>,
) -> Result<(), Error> {
    let scratch = scratch.view_mut();
    match grads {
        Some((dw, db)) => {
            dev.matmul_backward(dinp, dw, db, dout, inp, w, layout, mkn, mode, scratch)
        }
        None => dev.matmul_backward_input(dinp, dout, w, layout, mkn, mode, scratch),
    }
}

/// A tensor as a block's unit holds it, or `None` where it holds it not.
pub(crate) type Stored<'p, 'v, X, D> = &'p Option<<D as Device>::View<'v, X>>;

/// A block's linear projection: which (`kind`, as adapters are keyed), its weight as the unit
/// holds it (`None`: an NF4 weight, which the adapters dequantize), its bias and how the
/// product reads the weight.
pub(crate) struct Linear<'p, 'v: 'p, X: 'v, D: Device> {
    pub kind: ModelTensor,
    pub w: Stored<'p, 'v, X, D>,
    pub b: Option<D::View<'p, X>>,
    pub layout: Layout,
}

/// `out = x·W(ᵀ) + b` for `lin`, then its adapter's share added (LoRA).
pub(crate) fn projection<X: Num, D: Device>(
    dev: &D,
    ad: &mut Adapted<'_, X, D>,
    lin: Linear<'_, '_, X, D>,
    out: &mut Buffer<X, D>,
    x: D::View<'_, X>,
    mkn: (usize, usize, usize),
    scratch: &mut Buffer<f32, D>,
) -> Result<(), Error> {
    {
        let (w, layout) = ad.weight(dev, lin.kind, (lin.w.as_ref(), lin.layout))?;
        let (y, x) = (out.view_mut(), D::share(&x));
        dev.matmul_forward(y, x, w, lin.b, layout, mkn, scratch.view_mut())?;
    }
    ad.forward(dev, lin.kind, out.view_mut(), x, mkn.0, scratch)
}

/// Backward of [`projection`]: elements `at` of `dinp` set or added to (`mode`), the weight's
/// gradients added into `grads` (none: frozen) and the adapter's into its own.
#[allow(clippy::too_many_arguments)]
pub(crate) fn projection_backward<X: Num, D: Device>(
    dev: &D,
    ad: &mut Adapted<'_, X, D>,
    lin: Linear<'_, '_, X, D>,
    (dinp, at): (&mut Buffer<X, D>, Range<usize>),
    grads: WeightGrads<'_, X, D>,
    dout: D::View<'_, X>,
    x: D::View<'_, X>,
    (mkn, mode): ((usize, usize, usize), DinpMode),
    scratch: &mut Buffer<f32, D>,
) -> Result<(), Error> {
    {
        let (w, layout) = ad.weight(dev, lin.kind, (lin.w.as_ref(), lin.layout))?;
        let (dx, dy, operands) = (dinp.at_mut(at.clone()), D::share(&dout), (D::share(&x), w));
        linear_backward(dev, dx, grads, dy, operands, layout, mkn, mode, scratch)?;
    }
    ad.backward(dev, lin.kind, dinp.at_mut(at), dout, x, mkn.0, scratch)
}

/// `rmsnorm_backward`, or through a frozen weight (`dweight` none) its input's gradient only.
pub(crate) fn rmsnorm_backward<X: Num, D: Device>(
    dev: &D,
    dinp: D::ViewMut<'_, X>,
    dweight: Option<D::ViewMut<'_, X>>,
    dout: D::View<'_, X>,
    (inp, weight, rstd): (D::View<'_, X>, D::View<'_, X>, D::View<'_, f32>),
) -> Result<(), Error> {
    match dweight {
        Some(dw) => dev.rmsnorm_backward(dinp, dw, dout, inp, weight, rstd),
        None => dev.rmsnorm_backward_input(dinp, dout, inp, weight, rstd),
    }
}

/// `layernorm_backward`, or through a frozen weight and bias (`grads` none) its input's
/// gradient only.
pub(crate) fn layernorm_backward<X: Num, D: Device>(
    dev: &D,
    dinp: D::ViewMut<'_, X>,
    grads: Option<[D::ViewMut<'_, X>; 2]>,
    dout: D::View<'_, X>,
    (inp, weight): (D::View<'_, X>, D::View<'_, X>),
    (mean, rstd): (D::View<'_, f32>, D::View<'_, f32>),
) -> Result<(), Error> {
    match grads {
        Some([dw, db]) => dev.layernorm_backward(dinp, dw, db, dout, inp, weight, mean, rstd),
        None => dev.layernorm_backward_input(dinp, dout, inp, weight, mean, rstd),
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

    /// The token ids the data loader writes, and the logits, dead outside a step (the export
    /// gathers through them).
    pub(crate) fn batch(&mut self) -> &mut Batch<D> {
        match self {
            Passes::Gpt2(m) => &mut m.acts.batch,
            Passes::Llama(m) => &mut m.acts.batch,
        }
    }

    pub(crate) fn embed_forward(&mut self, dev: &D, emb: D::View<'_, X>) -> Result<(), Error> {
        match self {
            Passes::Gpt2(m) => m.embed_forward(dev, emb),
            Passes::Llama(m) => m.embed_forward(dev, emb),
        }
    }

    /// Block `l` forward with its adapters, saving what its backward reads in activation
    /// slot `slot`.
    pub(crate) fn block_forward(
        &mut self,
        dev: &D,
        unit: D::View<'_, X>,
        adapters: Adapted<'_, X, D>,
        l: usize,
        slot: usize,
    ) -> Result<(), Error> {
        match self {
            Passes::Gpt2(m) => m.block_forward(dev, unit, adapters, l, slot),
            Passes::Llama(m) => m.block_forward(dev, unit, adapters, l, slot),
        }
    }

    /// Block `l` backward: the residual stream's gradient goes from its output to its input,
    /// the block's parameter gradients are added into `grad` (none where the block is frozen)
    /// and its adapters' into theirs.
    pub(crate) fn block_backward(
        &mut self,
        dev: &D,
        unit: D::View<'_, X>,
        grad: Option<D::ViewMut<'_, X>>,
        adapters: Adapted<'_, X, D>,
        l: usize,
        slot: usize,
    ) -> Result<(), Error> {
        match self {
            Passes::Gpt2(m) => m.block_backward(dev, unit, grad, adapters, l, slot),
            Passes::Llama(m) => m.block_backward(dev, unit, grad, adapters, l, slot),
        }
    }

    /// The final norm forward, the LM head and the cross-entropy, and back through the head:
    /// returns the micro-batch's mean loss and adds the head's weight gradient into `dhead`
    /// (none where it is frozen).
    /// `head` is the unit holding the (V, C) head weight first (the embeddings when tied).
    /// `dloss` is the gradient each token's loss contributes; without it nothing is
    /// differentiated (validation).
    pub(crate) fn loss(
        &mut self,
        dev: &D,
        norm: D::View<'_, X>,
        head: D::View<'_, X>,
        dhead: Option<D::ViewMut<'_, X>>,
        dloss: Option<f32>,
    ) -> Result<f64, Error> {
        match self {
            Passes::Gpt2(m) => m.loss(dev, norm, head, dhead, dloss),
            Passes::Llama(m) => m.loss(dev, norm, head, dhead, dloss),
        }
    }

    /// Back through the final norm (after [`Passes::loss`]): the residual stream's gradient at
    /// the last block's output, and the norm's gradient added into `dnorm` (none: frozen).
    pub(crate) fn norm_backward(
        &mut self,
        dev: &D,
        norm: D::View<'_, X>,
        dnorm: Option<D::ViewMut<'_, X>>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Cpu;

    /// The loss over chunks of 5 rows (the last one 3) against one chunk of all 23: the same
    /// losses and input gradients, and the head's gradient summed in another order.
    #[test]
    fn the_loss_in_chunks_equals_the_loss_in_one() {
        let (n, c, v) = (23, 6, 11);
        let fill = |len: usize, k: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * k % 97) as f32 / 48.5 - 1.0) * 0.7)
                .collect()
        };
        let (x, w) = (fill(n * c, 31), fill(v * c, 17));
        let targets: Vec<u32> = (0..n).map(|i| (i * 7 % v) as u32).collect();
        let run = |chunk: usize| {
            let acct = Accountant::new(None);
            let alloc = |len| {
                acct.alloc_on::<Cpu, f32>(&Cpu, Category::Buffers, len)
                    .unwrap()
            };
            let mut batch = Batch {
                inputs: acct.alloc_on(&Cpu, Category::Buffers, n).unwrap(),
                targets: acct.alloc_on(&Cpu, Category::Buffers, n).unwrap(),
                logits: alloc(chunk * v),
                losses: alloc(n),
            };
            batch.targets.view_mut().copy_from_slice(&targets);
            let (mut dw, mut dx, mut scratch) = (vec![0.5f32; v * c], vec![0f32; n * c], alloc(0));
            let loss = batch
                .lm_head(
                    &Cpu,
                    &x,
                    (&w, Some(&mut dw)),
                    &mut dx,
                    (n, c, v),
                    Some(0.25),
                    &mut scratch,
                )
                .unwrap();
            (loss, batch.losses.view().to_vec(), dx, dw)
        };
        let (whole, chunked) = (run(n), run(5));
        assert_eq!(whole.0, chunked.0);
        assert_eq!(whole.1, chunked.1);
        assert_eq!(whole.2, chunked.2);
        for (a, b) in whole.3.iter().zip(&chunked.3) {
            assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{a} vs {b}");
        }
        assert!(whole.3.iter().any(|&g| g != 0.5), "dw was added into");
    }
}
