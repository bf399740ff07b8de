//! Low-rank adapters in the passes, as PEFT computes them: an adapted projection `y = x·Wᵀ`
//! (W frozen) becomes `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` with A `[rank, in]`, B `[out, rank]` and
//! `s = alpha/rank` (`scaling`). The family's pass runs its projection as before and hands
//! each one's input and output here; what is adapted gets its share added.
//!
//! Forward keeps `V = s·x·Aᵀ` per adapted projection, what B's gradient reads; backward
//! finds `G = dy·B` and `dB += dyᵀ·V` in one product, scales G by s, then `dx += G·A` and
//! `dA += Gᵀ·x` in one more. With dropout, x is the input dropped into a scratch
//! (`kernels::dropout`); backward drops it again for `dA`, then puts `G·A` there and adds it
//! into `dx` through the same mask. With an NF4 base (QLoRA) the adapted projections' weights
//! are dequantized, one at a time, into a scratch before each product that reads them. The
//! layout (`scheduler::model::lora`) orders a block's adapter unit as A then B of each adapted
//! projection, in state-dict order.

use kernels::dropout::{Mask, mix};
use kernels::matmul::{DinpMode, Layout};
use scheduler::memory::Category;
use std::ops::Range;

use scheduler::model::{AdapterPart, AdapterTensor, Adapters, ModelShape, ModelTensor, Nf4Part};

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::device::{Device, Num};

/// One adapted projection: where its A and B lie in the block's adapter unit and, with an
/// NF4 base, its weight's absmax and codes in the block's NF4 unit.
#[derive(Debug, Clone)]
struct Target {
    weight: ModelTensor,
    a: Range<usize>,
    b: Range<usize>,
    nf4: Option<Nf4At>,
    in_features: usize,
    out_features: usize,
    /// The model stores the weight (in, out) (GPT-2's Conv1D), not (out, in).
    stored_transposed: bool,
}

/// Byte ranges of one NF4 weight in its block's NF4 unit.
#[derive(Debug, Clone)]
struct Nf4At {
    absmax: Range<usize>,
    codes: Range<usize>,
}

/// A job's adapters as the passes use them, with their activations.
pub(crate) struct Lora<X, D: Device> {
    rank: usize,
    scaling: f32,
    targets: Vec<Target>,
    /// Per activation slot (one per block, or one under checkpointing), per target: V.
    saved: Vec<Vec<Buffer<X, D>>>,
    /// G of the projection whose backward runs.
    grad: Buffer<X, D>,
    /// NF4 base: the weight of the projection being computed, dequantized.
    dequantized: Option<Buffer<X, D>>,
    /// Dropout: its probability, the job's seed, the widest adapted input dropped (then its
    /// gradient before the mask), and the micro-batch being trained (none: evaluation).
    p: f32,
    seed: u64,
    dropped: Option<Buffer<X, D>>,
    batch: Option<MaskBatch>,
}

/// What keys a micro-batch's dropout masks: the optimizer step (updates applied so far) and the
/// index of its first token in the step's tokens of every rank, so that a token's mask does not
/// depend on the world size, the stage or a resumption.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MaskBatch {
    pub step: u64,
    pub first_token: u64,
}

impl<X: Num, D: Device> Lora<X, D> {
    /// The activations of `tokens` tokens, charged as `Adapters::activation_bytes` counts them,
    /// and with an NF4 base the scratch `Adapters::dequantize_scratch_bytes` counts.
    pub(crate) fn new(
        dev: &D,
        acct: &Accountant,
        (adapters, seed): (&Adapters, u64),
        model: &ModelShape,
        tokens: usize,
        checkpointing: bool,
    ) -> Result<Self, Error> {
        // Every block's units lay their tensors out alike, whatever the world size.
        let layout = adapters.layout(model, 1);
        let first = layout.adapters.iter().next().expect("a model has blocks");
        let range = |weight, part| {
            let t = first
                .tensors
                .iter()
                .find(|t| t.kind == AdapterTensor { weight, part });
            t.expect("every target has A and B").range()
        };
        let nf4 = layout.nf4.iter().next();
        let nf4_range = |part| {
            let t = nf4.and_then(|u| u.tensors.iter().find(|t| t.kind == part));
            t.expect("every NF4 weight has absmax and codes").range()
        };
        let targets: Vec<Target> = adapters
            .targets
            .of(model)
            .iter()
            .map(|p| Target {
                weight: p.weight,
                a: range(p.weight, AdapterPart::A),
                b: range(p.weight, AdapterPart::B),
                nf4: nf4.map(|_| Nf4At {
                    absmax: nf4_range(Nf4Part::Absmax(p.weight)),
                    codes: nf4_range(Nf4Part::Codes(p.weight)),
                }),
                in_features: p.in_features,
                out_features: p.out_features,
                stored_transposed: matches!(model, ModelShape::Gpt2(_)),
            })
            .collect();
        let x = X::BYTES as u64;
        let dequantized = match adapters.dequantize_scratch_bytes(model, x) / x {
            0 => None,
            len => Some(acct.alloc_on(dev, Category::Buffers, len as usize)?),
        };
        let slots = if checkpointing {
            1
        } else {
            model.summary().layers
        };
        let widest = targets.iter().map(|t| t.in_features).max().unwrap_or(0);
        let dropped = match adapters.dropout > 0.0 {
            true => Some(acct.alloc_on(dev, Category::Activations, tokens * widest)?),
            false => None,
        };
        let rank = adapters.rank;
        let act = || acct.alloc_on(dev, Category::Activations, tokens * rank);
        Ok(Lora {
            rank,
            scaling: adapters.scaling,
            saved: (0..slots)
                .map(|_| targets.iter().map(|_| act()).collect())
                .collect::<Result<_, Error>>()?,
            grad: act()?,
            targets,
            dequantized,
            p: adapters.dropout,
            seed,
            dropped,
            batch: None,
        })
    }

    /// Sets the micro-batch whose passes drop the adapters' input; none: evaluation, which
    /// drops nothing.
    pub(crate) fn set_batch(&mut self, batch: Option<MaskBatch>) {
        self.batch = batch;
    }

    /// The dropout mask of target `i` of block `l` for the micro-batch being trained; none
    /// without dropout or in evaluation.
    fn mask(&self, l: usize, i: usize) -> Option<Mask> {
        let batch = self.batch.filter(|_| self.dropped.is_some())?;
        let (step, at) = (mix(self.seed ^ mix(batch.step)), (l as u64) << 8 | i as u64);
        Some(Mask {
            p: self.p,
            key: mix(step ^ mix(at)),
            offset: batch.first_token * self.targets[i].in_features as u64,
        })
    }

    /// Whether the base's units hold `weight` (an NF4 weight is held in the NF4 units).
    pub(crate) fn in_base(&self, weight: ModelTensor) -> bool {
        self.target(weight).is_none_or(|(_, t)| t.nf4.is_none())
    }

    /// Quantizes `weight`, its values in the model's order from `next`, into `nf4`, a block's
    /// NF4 unit, through the dequantization scratch. It is held (out, in) as bitsandbytes holds
    /// it: a weight the model stores (in, out) (GPT-2's Conv1D) is transposed first, as
    /// transformers transposes it before quantizing.
    pub(crate) fn quantize(
        &mut self,
        dev: &D,
        weight: ModelTensor,
        nf4: D::ViewMut<'_, u8>,
        mut next: impl FnMut() -> f32,
    ) -> Result<(), Error> {
        let (_, t) = self.target(weight).expect("an NF4 weight is adapted");
        let at = t.nf4.expect("an NF4 weight");
        let scratch = self
            .dequantized
            .as_mut()
            .expect("an NF4 base has the scratch");
        let (inputs, outputs) = (t.in_features, t.out_features);
        let numel = inputs * outputs;
        dev.on_host(scratch.at_mut(0..numel), |w| {
            for e in 0..numel {
                let held = match t.stored_transposed {
                    true => (e % outputs) * inputs + e / outputs,
                    false => e,
                };
                w[held] = X::from_f32(next());
            }
        })?;
        // Every absmax lies before every codes (`LoraLayout::nf4`).
        let split = at.absmax.end;
        let (absmax, codes) = D::split_at_mut(nf4, split);
        let absmax = D::slice_mut(absmax, at.absmax);
        let codes = D::slice_mut(codes, at.codes.start - split..at.codes.end - split);
        dev.nf4_quantize(codes, absmax, scratch.at(0..numel))
    }

    /// The adapted projection whose frozen weight is `weight`, and its index; none if it has
    /// no adapter.
    fn target(&self, weight: ModelTensor) -> Option<(usize, Target)> {
        let i = self.targets.iter().position(|t| t.weight == weight)?;
        Some((i, self.targets[i].clone()))
    }

    /// Block `l`'s adapters, from its adapter unit, its NF4 unit (with an NF4 base) and, in
    /// backward, the adapter unit's gradient, for activation slot `slot`.
    pub(crate) fn block<'a>(
        &'a mut self,
        unit: D::View<'a, X>,
        nf4: Option<D::View<'a, u8>>,
        grad: Option<D::ViewMut<'a, X>>,
        (l, slot): (usize, usize),
    ) -> Adapted<'a, X, D> {
        Adapted {
            lora: Some(Bound {
                lora: self,
                unit,
                nf4,
            }),
            grad,
            l,
            slot,
        }
    }
}

/// The adapters and one block's units of them.
struct Bound<'a, X, D: Device> {
    lora: &'a mut Lora<X, D>,
    unit: D::View<'a, X>,
    nf4: Option<D::View<'a, u8>>,
}

/// One block's adapters for one pass, or none (full fine-tuning).
pub(crate) struct Adapted<'a, X, D: Device> {
    lora: Option<Bound<'a, X, D>>,
    grad: Option<D::ViewMut<'a, X>>,
    l: usize,
    slot: usize,
}

impl<'a, X: Num, D: Device> Adapted<'a, X, D> {
    pub(crate) fn none() -> Self {
        Adapted {
            lora: None,
            grad: None,
            l: 0,
            slot: 0,
        }
    }

    /// Whether the base's unit holds `weight` ([`Lora::in_base`]); always, without adapters.
    pub(crate) fn in_base(&self, weight: ModelTensor) -> bool {
        self.lora.as_ref().is_none_or(|b| b.lora.in_base(weight))
    }

    /// The weight `weight` to compute with and how a product reads it: `stored`, the one the
    /// base's unit holds, laid out as `layout`; or an NF4 weight dequantized into the scratch
    /// (which the next NF4 weight overwrites), held (out, in): `Layout::NK`.
    pub(crate) fn weight<'s, 'w: 's>(
        &'s mut self,
        dev: &D,
        weight: ModelTensor,
        (stored, layout): (Option<&'s D::View<'w, X>>, Layout),
    ) -> Result<(D::View<'s, X>, Layout), Error> {
        if let Some(w) = stored {
            return Ok((D::reborrow_ref(w), layout));
        }
        let Some(Bound {
            lora,
            nf4: Some(nf4),
            ..
        }) = &mut self.lora
        else {
            unreachable!("only an NF4 base lacks a weight");
        };
        let (_, t) = lora.target(weight).expect("an NF4 weight is adapted");
        let at = t.nf4.expect("an NF4 weight");
        let out = lora
            .dequantized
            .as_mut()
            .expect("an NF4 base has the scratch");
        let numel = t.in_features * t.out_features;
        let (absmax, codes) = (
            D::slice(D::share(nf4), at.absmax),
            D::slice(D::share(nf4), at.codes),
        );
        dev.nf4_dequantize(out.at_mut(0..numel), codes, absmax)?;
        Ok((out.at(0..numel), Layout::NK))
    }

    /// Adds the adapter's share into `y`, the output of the projection whose frozen weight is
    /// `weight`, for its input `x` of `n` rows; nothing if it has no adapter.
    pub(crate) fn forward(
        &mut self,
        dev: &D,
        weight: ModelTensor,
        y: D::ViewMut<'_, X>,
        x: D::View<'_, X>,
        n: usize,
        scratch: &mut Buffer<f32, D>,
    ) -> Result<(), Error> {
        let Some(Bound { lora, unit, .. }) = &mut self.lora else {
            return Ok(());
        };
        let Some((i, t)) = lora.target(weight) else {
            return Ok(());
        };
        let (r, mask) = (lora.rank, lora.mask(self.l, i));
        let (a, b) = (D::slice(D::share(unit), t.a), D::slice(D::share(unit), t.b));
        let v = &mut lora.saved[self.slot][i];
        let (mkn, mm) = ((n, t.in_features, r), scratch.view_mut());
        match (mask, &mut lora.dropped) {
            (Some(mask), Some(dropped)) => {
                let d = 0..n * t.in_features;
                dev.dropout_forward(dropped.at_mut(d.clone()), x, mask)?;
                let x = dropped.at(d);
                dev.matmul_forward(v.view_mut(), x, a, None, Layout::NK, mkn, mm)?;
            }
            _ => dev.matmul_forward(v.view_mut(), x, a, None, Layout::NK, mkn, mm)?,
        }
        dev.scale(v.view_mut(), lora.scaling)?;
        // y (n, out) += V (n, r) · Bᵀ, B (out, r): the input gradient of a product through B
        // laid out (K, N), added into y.
        dev.matmul_backward_input(
            y,
            v.view(),
            b,
            Layout::KN,
            (n, t.out_features, r),
            DinpMode::Accumulate,
            scratch.view_mut(),
        )
    }

    /// Backward of [`Adapted::forward`]: adds the adapter's share of ∂loss/∂x into `dx` and
    /// its gradients into the unit's, from the projection's output gradient `dy`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &mut self,
        dev: &D,
        weight: ModelTensor,
        dx: D::ViewMut<'_, X>,
        dy: D::View<'_, X>,
        x: D::View<'_, X>,
        n: usize,
        scratch: &mut Buffer<f32, D>,
    ) -> Result<(), Error> {
        let (Some(Bound { lora, unit, .. }), Some(grad)) = (&mut self.lora, &mut self.grad) else {
            return Ok(());
        };
        let Some((i, t)) = lora.target(weight) else {
            return Ok(());
        };
        let (r, a_at, b_at, mask) = (lora.rank, t.a, t.b, lora.mask(self.l, i));
        let g = &mut lora.grad;
        dev.matmul_backward(
            g.view_mut(),
            D::slice_mut(D::reborrow(grad), b_at.clone()),
            None,
            dy,
            lora.saved[self.slot][i].view(),
            D::slice(D::share(unit), b_at),
            Layout::NK,
            (n, r, t.out_features),
            DinpMode::Overwrite,
            scratch.view_mut(),
        )?;
        dev.scale(g.view_mut(), lora.scaling)?;
        let (da, a) = (
            D::slice_mut(D::reborrow(grad), a_at.clone()),
            D::slice(D::share(unit), a_at),
        );
        let mkn = (n, t.in_features, r);
        let (Some(mask), Some(dropped)) = (mask, &mut lora.dropped) else {
            let mode = DinpMode::Accumulate;
            return dev.matmul_backward(
                dx,
                da,
                None,
                g.view(),
                x,
                a,
                Layout::NK,
                mkn,
                mode,
                scratch.view_mut(),
            );
        };
        // Through the dropout: A's gradient from the input dropped again, then the input's
        // gradient, into the same scratch, masked as it is added.
        let d = 0..n * t.in_features;
        dev.dropout_forward(dropped.at_mut(d.clone()), x, mask)?;
        let mm = scratch.view_mut();
        dev.matmul_backward_weight(da, g.view(), dropped.at(d.clone()), Layout::NK, mkn, mm)?;
        let (mode, mm) = (DinpMode::Overwrite, scratch.view_mut());
        dev.matmul_backward_input(
            dropped.at_mut(d.clone()),
            g.view(),
            a,
            Layout::NK,
            mkn,
            mode,
            mm,
        )?;
        dev.dropout_backward(dx, dropped.at(d), mask)
    }
}
