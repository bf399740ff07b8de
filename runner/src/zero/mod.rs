//! The ZeRO engine of one rank. Parameters, gradients, fp32 master weights and optimizer
//! states live in flat per-unit buffers (`scheduler::model::Units`); the stage decides which
//! are kept whole and which as this rank's shard, and when the collectives run:
//!
//! - stage 0: everything whole; gradients all-reduced after the last micro-batch;
//! - stage 1: optimizer states and master weights sharded; gradients reduce-scattered, the
//!   updated parameters all-gathered;
//! - stage 2: gradients sharded too: each unit's gradient is reduce-scattered as soon as
//!   backward finishes it, and only the own shard is kept across micro-batches;
//! - stage 3: parameters sharded too: each unit is all-gathered before its forward and again
//!   before its backward.

use scheduler::memory::{self, Category, Setup};
use scheduler::model::{GptShape, Units};

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::comm::{Collective, Communicator, DeviceCollectives, Summable};
use crate::data::DataLoader;
use crate::device::{Cpu, Device, Elem, Num};
use crate::gpt::{self, Acts, BatchDims};
use crate::loss_scale::LossScaler;
use crate::optimizer::{OptimizerState, Slices, Step};

mod layout;
mod state;
mod weights;

use layout::{Part, ShardLayout};

/// Index of the embeddings unit; block `l` is unit `l + 1`, the final norm unit `L + 1`.
const EMB: usize = 0;

/// The model's buffers on this rank.
struct Buffers<X, D: Device> {
    /// Per unit: the elements the layout holds of `Part::Params`.
    params: Vec<Buffer<X, D>>,
    /// Per unit: the elements the layout holds of `Part::Grads`.
    grads: Vec<Buffer<X, D>>,
    /// Stages 2-3: the full gradient of the embeddings and of the other unit in backward.
    unit_grads: Option<[Buffer<X, D>; 2]>,
    /// Stage 3: the gathered embeddings and two block-sized units (alternating).
    gathered: Option<[Buffer<X, D>; 3]>,
}

impl<X, D: Device> Buffers<X, D> {
    fn gathered_slot(u: usize) -> usize {
        if u == EMB { 0 } else { 1 + u % 2 }
    }

    fn grad_slot(u: usize) -> usize {
        usize::from(u != EMB)
    }

    /// Unit `u`'s whole parameters (gathered first at stage 3).
    fn param(&self, u: usize, len: usize) -> D::View<'_, X> {
        match &self.gathered {
            Some(g) => g[Self::gathered_slot(u)].at(0..len),
            None => self.params[u].view(),
        }
    }

    /// Where backward adds unit `u`'s whole gradient.
    fn grad(&mut self, u: usize) -> D::ViewMut<'_, X> {
        match &mut self.unit_grads {
            Some(g) => g[Self::grad_slot(u)].view_mut(),
            None => self.grads[u].view_mut(),
        }
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Mean loss over the step's tokens on every rank.
    pub loss: f64,
    /// The loss scale the step's gradients carried.
    pub loss_scale: f32,
    pub skipped: bool,
    /// Global gradient norm, when it was needed (fp16 or clipping).
    pub grad_norm: Option<f64>,
}

/// One rank's trainer on device `D`.
pub struct Engine<X: Num, D: Device = Cpu> {
    dev: D,
    shape: GptShape,
    units: Units,
    layout: ShardLayout,
    dims: BatchDims,
    checkpointing: bool,
    grad_accum: usize,
    /// Whether ranks agree on the gradient norm each step (fp16 overflow checks, clipping).
    reduces_norm: bool,
    bufs: Buffers<X, D>,
    /// Mixed precision: fp32 master weights of each unit's `Part::State` range.
    master: Option<Vec<Buffer<f32, D>>>,
    optimizer: OptimizerState<D>,
    acts: Acts<X, D>,
    comm: Communicator,
    acct: Accountant,
    /// Optimizer updates applied so far (skipped steps do not count, as in PyTorch).
    applied: u64,
}

impl<X: Num + Summable> Engine<X> {
    /// [`Engine::on`] the CPU.
    pub fn new(
        setup: &Setup,
        shape: GptShape,
        seed: u64,
        comm: Communicator,
        acct: Accountant,
    ) -> Result<Engine<X>, Error> {
        Engine::on(Cpu, setup, shape, seed, comm, acct)
    }
}

impl<X: Num + Summable, D: DeviceCollectives> Engine<X, D> {
    /// Allocates every buffer on `dev` through `acct` and initialises the weights, GPT-2
    /// style, from `seed`: the same values whatever the device, stage or world size.
    pub fn on(
        dev: D,
        setup: &Setup,
        shape: GptShape,
        seed: u64,
        comm: Communicator,
        acct: Accountant,
    ) -> Result<Engine<X, D>, Error> {
        let units = Units::new(&shape, comm.world_size());
        let layout = ShardLayout::new(setup.stage, &units, comm.rank());
        let params = alloc_held(&dev, &acct, &layout, Category::Params, Part::Params)?;
        let grads = alloc_held(&dev, &acct, &layout, Category::Grads, Part::Grads)?;
        let mixed = X::as_f32(&[]).is_none();
        let master = if mixed {
            Some(alloc_held(
                &dev,
                &acct,
                &layout,
                Category::Optimizer,
                Part::State,
            )?)
        } else {
            None
        };
        let held: Vec<_> = units
            .iter()
            .enumerate()
            .map(|(u, unit)| (unit, layout.held(Part::State, u)))
            .collect();
        let optimizer = OptimizerState::new(&dev, setup.optimizer, &held, &acct)?;
        let (emb, other) = (
            units.embeddings().padded_len,
            units.largest_other_padded_len(),
        );
        let unit_grads = if layout.sharded(Part::Grads) {
            Some([
                acct.alloc_on(&dev, Category::Buffers, emb)?,
                acct.alloc_on(&dev, Category::Buffers, other)?,
            ])
        } else {
            None
        };
        let gathered = if layout.sharded(Part::Params) {
            Some([
                acct.alloc_on(&dev, Category::Buffers, emb)?,
                acct.alloc_on(&dev, Category::Buffers, other)?,
                acct.alloc_on(&dev, Category::Buffers, other)?,
            ])
        } else {
            None
        };
        let mut comm = comm;
        let ring = memory::ring_scratch_bytes(setup);
        if ring > 0 {
            debug_assert_eq!(ring % 8, 0, "ring chunks are whole 8-byte words");
            comm.set_scratch(acct.alloc(Category::Buffers, (ring / 8) as usize)?);
        }
        if comm.nccl_requested() {
            dev.join_collectives(&mut comm)?;
        }
        let dims = BatchDims::new(&shape, setup.micro_batch, setup.seq_len);
        let acts = Acts::new(&dev, &acct, &shape, dims.b, dims.t, setup.checkpointing)?;
        let mut engine = Engine {
            dev,
            shape,
            units,
            layout,
            dims,
            checkpointing: setup.checkpointing,
            grad_accum: setup.grad_accum,
            reduces_norm: setup.reduces_norm,
            bufs: Buffers {
                params,
                grads,
                unit_grads,
                gathered,
            },
            master,
            optimizer,
            acts,
            comm,
            acct,
            applied: 0,
        };
        engine.init_weights(seed)?;
        Ok(engine)
    }

    pub fn accountant(&self) -> &Accountant {
        &self.acct
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    /// This rank's index in its job.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn dims(&self) -> BatchDims {
        self.dims
    }

    /// Optimizer updates applied so far.
    pub fn applied_steps(&self) -> u64 {
        self.applied
    }

    pub fn set_applied_steps(&mut self, applied: u64) {
        self.applied = applied;
    }

    /// Bytes this rank has sent, by collective.
    pub fn sent_bytes(&self) -> std::collections::BTreeMap<crate::comm::Op, u64> {
        self.comm.sent_bytes().clone()
    }

    /// Stage 3: gathers unit `u`'s parameters from every rank's shard.
    fn fetch(&mut self, u: usize) -> Result<(), Error> {
        let len = self.unit_len(u);
        let Some(gathered) = &mut self.bufs.gathered else {
            return Ok(());
        };
        let buf = &mut gathered[Buffers::<X, D>::gathered_slot(u)];
        let held = self.layout.held(Part::Params, u);
        self.dev
            .copy(buf.at_mut(held), self.bufs.params[u].view())?;
        self.dev
            .collective(&mut self.comm, Collective::AllGather, buf.at_mut(0..len))
    }

    /// The first of the three points where stages differ: backward has finished unit `u`'s
    /// whole gradient. Where gradients are sharded (stages 2-3), it is reduce-scattered and
    /// this rank's shard added into the gradient kept across micro-batches; the buffer is then
    /// cleared for the next unit. Elsewhere backward added into the kept gradient directly.
    fn after_unit_backward(&mut self, u: usize) -> Result<(), Error> {
        let len = self.unit_len(u);
        let Some(unit_grads) = &mut self.bufs.unit_grads else {
            return Ok(());
        };
        let buf = &mut unit_grads[Buffers::<X, D>::grad_slot(u)];
        self.dev.collective(
            &mut self.comm,
            Collective::ReduceScatter,
            buf.at_mut(0..len),
        )?;
        let held = self.layout.held(Part::Grads, u);
        self.dev
            .residual_accumulate(self.bufs.grads[u].view_mut(), buf.at(held))?;
        self.dev.fill_zero(buf.at_mut(0..len))
    }

    /// The second: every micro-batch's gradient has been added up. Whole gradients are
    /// all-reduced (stage 0), or reduce-scattered where only the state is sharded (stage 1);
    /// sharded ones were reduced unit by unit already.
    fn after_accumulation(&mut self) -> Result<(), Error> {
        if self.layout.sharded(Part::Grads) {
            return Ok(());
        }
        let c = if self.layout.sharded(Part::State) {
            Collective::ReduceScatter
        } else {
            Collective::AllReduce
        };
        let (dev, comm) = (&self.dev, &mut self.comm);
        self.bufs
            .grads
            .iter_mut()
            .try_for_each(|g| dev.collective(comm, c, g.view_mut()))
    }

    /// The third: the optimizer has updated this rank's state range. Where that is a shard of
    /// whole parameters (stages 1-2), every rank's updated shard is gathered.
    fn after_update(&mut self) -> Result<(), Error> {
        if !self.layout.sharded(Part::State) || self.layout.sharded(Part::Params) {
            return Ok(());
        }
        let (dev, comm) = (&self.dev, &mut self.comm);
        self.bufs
            .params
            .iter_mut()
            .try_for_each(|p| dev.collective(comm, Collective::AllGather, p.view_mut()))
    }

    fn unit_len(&self, u: usize) -> usize {
        self.units.iter().nth(u).expect("unit index").padded_len
    }

    /// Forward and backward of the micro-batch in `acts.inputs`/`targets`; returns its loss.
    fn micro_step(&mut self, dloss: f32) -> Result<f64, Error> {
        let (shape, d, l_n) = (self.shape, self.dims, self.shape.n_layer);
        let norm = l_n + 1;
        let ckpt = self.checkpointing;
        let slot = move |l: usize| if ckpt { 0 } else { l };
        // Stage 3 gathers each unit one unit ahead, into the other of the two block slots, so
        // that on a device with collectives of its own (NCCL) the gather of the next unit runs
        // while this one computes; the gathers are the same, in the same order.
        self.fetch(EMB)?;
        self.fetch(1)?;
        let dev = &self.dev;
        gpt::embed_forward(
            dev,
            self.bufs.param(EMB, self.unit_len(EMB)),
            &shape,
            &d,
            &mut self.acts,
        )?;
        for l in 0..l_n {
            {
                let p = gpt::block::<D, X>(self.bufs.param(l + 1, self.unit_len(l + 1)), &shape);
                gpt::block_forward(&self.dev, &p, &mut self.acts, l, slot(l), &d)?;
            }
            // The next block's, or after the last block the final norm's.
            self.fetch(l + 2)?;
        }
        self.fetch(EMB)?;
        let loss = {
            let (norm_len, emb_len) = (self.unit_len(norm), self.unit_len(EMB));
            let Buffers {
                params,
                grads,
                unit_grads,
                gathered,
            } = &mut self.bufs;
            let (p_norm, p_emb) = match gathered {
                Some(g) => (
                    g[Buffers::<X, D>::gathered_slot(norm)].at(0..norm_len),
                    g[0].at(0..emb_len),
                ),
                None => (params[norm].view(), params[EMB].view()),
            };
            let (g_norm, g_emb) = match unit_grads {
                Some([emb, other]) => (other.view_mut(), emb.view_mut()),
                None => {
                    let [g_emb, g_norm] =
                        grads.get_disjoint_mut([EMB, norm]).expect("distinct units");
                    (g_norm.view_mut(), g_emb.view_mut())
                }
            };
            gpt::head(
                &self.dev,
                p_norm,
                p_emb,
                g_norm,
                g_emb,
                &mut self.acts,
                &shape,
                &d,
                dloss,
            )?
        };
        self.after_unit_backward(norm)?;
        if l_n > 0 {
            self.fetch(l_n)?;
        }
        for l in (0..l_n).rev() {
            let len = self.unit_len(l + 1);
            if self.checkpointing {
                let p = gpt::block::<D, X>(self.bufs.param(l + 1, len), &shape);
                gpt::block_forward(&self.dev, &p, &mut self.acts, l, 0, &d)?;
            }
            let Buffers {
                params,
                grads,
                unit_grads,
                gathered,
            } = &mut self.bufs;
            let p = match gathered {
                Some(g) => g[Buffers::<X, D>::gathered_slot(l + 1)].at(0..len),
                None => params[l + 1].view(),
            };
            let g = match unit_grads {
                Some([_, other]) => other.at_mut(0..len),
                None => grads[l + 1].view_mut(),
            };
            gpt::block_backward(
                &self.dev,
                &gpt::block::<D, X>(p, &shape),
                gpt::block_mut::<D, X>(g, &shape),
                &mut self.acts,
                l,
                slot(l),
                &d,
            )?;
            // Gathered ahead (into the slot of the unit whose backward is done) before this
            // unit's gradient is reduced: on NCCL's stream the gather need not wait for this
            // block's backward, the reduction must.
            if l > 0 {
                self.fetch(l)?;
            }
            self.after_unit_backward(l + 1)?;
        }
        gpt::embed_backward(&self.dev, self.bufs.grad(EMB), &shape, &d, &self.acts)?;
        self.after_unit_backward(EMB)?;
        Ok(loss)
    }
}

impl<X: Num + Summable, D: DeviceCollectives> Engine<X, D> {
    /// One optimizer step: `grad_accum` micro-batches from `data`, the gradient reductions, the
    /// global norm (found-inf and clipping), the loss scaler's verdict, and the update.
    pub fn step(
        &mut self,
        data: &mut DataLoader,
        scaler: &mut LossScaler,
        lr: f32,
        clip: f64,
    ) -> Result<StepReport, Error> {
        for g in &mut self.bufs.grads {
            self.dev.fill_zero(g.view_mut())?;
        }
        let scale = scaler.scale();
        let tokens = self.dims.tokens() * self.grad_accum * self.comm.world_size();
        // Each token's loss is divided by the tokens of the whole step on every rank, so the
        // summed gradients are the mean's; the loss scale rides along.
        let dloss = scale / tokens as f32;
        let mut loss = 0.0;
        for _ in 0..self.grad_accum {
            let (dev, acts) = (&self.dev, &mut self.acts);
            dev.on_host(acts.inputs.view_mut(), |inputs| {
                dev.on_host(acts.targets.view_mut(), |targets| {
                    data.next_batch(inputs, targets)
                })
            })???;
            loss += self.micro_step(dloss)?;
        }
        loss /= self.grad_accum as f64;
        self.after_accumulation()?;
        let (loss, grad_norm) = self.agree(loss, scale)?;
        let found_inf = grad_norm.is_some_and(|n| !n.is_finite());
        let step = self.applied + 1;
        let report = |skipped| StepReport {
            loss,
            loss_scale: scale,
            skipped,
            grad_norm,
        };
        if scaler.update(found_inf)?.is_skipped() {
            return Ok(report(true));
        }
        if found_inf {
            return Err(Error::NonFiniteGradients { step });
        }
        let clip_coef = match grad_norm {
            Some(norm) if clip > 0.0 => (clip / (norm + 1e-6)).min(1.0),
            _ => 1.0,
        };
        let s = Step {
            lr,
            t: step,
            grad_scale: (clip_coef / f64::from(scale)) as f32,
        };
        self.update(s)?;
        self.after_update()?;
        self.applied = step;
        Ok(report(false))
    }

    /// Makes the ranks agree on the step's mean loss and, when fp16 or clipping needs it, on
    /// ‖g‖ of the unscaled gradients (summed over shards when sharded): one all-reduce of two
    /// f32s.
    fn agree(&mut self, loss: f64, scale: f32) -> Result<(f64, Option<f64>), Error> {
        let sharded = self.layout.sharded(Part::State);
        let mut sq = 0f64;
        if self.reduces_norm {
            for (u, g) in self.bufs.grads.iter().enumerate() {
                let held = self.layout.held_within(Part::State, Part::Grads, u);
                sq += self.dev.sum_squares(g.at(held))?;
            }
        }
        let n = self.comm.world_size();
        let mut loss = loss;
        if n > 1 {
            let mut agreed = [if sharded { sq as f32 } else { 0.0 }, loss as f32];
            self.comm.all_reduce(&mut agreed)?;
            if sharded {
                sq = f64::from(agreed[0]);
            }
            loss = f64::from(agreed[1]) / n as f64;
        }
        Ok((
            loss,
            self.reduces_norm.then(|| sq.sqrt() / f64::from(scale)),
        ))
    }

    /// Applies the optimizer to every unit's state range.
    fn update(&mut self, s: Step) -> Result<(), Error> {
        let layout = &self.layout;
        let mut masters: Vec<Option<D::ViewMut<'_, f32>>> = match &mut self.master {
            Some(m) => m.iter_mut().map(|b| Some(b.view_mut())).collect(),
            None => self.bufs.params.iter().map(|_| None).collect(),
        };
        let mut slices = Vec::with_capacity(masters.len());
        let units = self
            .units
            .iter()
            .zip(self.bufs.params.iter_mut())
            .zip(&self.bufs.grads);
        for (u, (((unit, p), g), m)) in units.zip(masters.iter_mut().map(Option::take)).enumerate()
        {
            let grads = g.at(layout.held_within(Part::State, Part::Grads, u));
            let params = p.at_mut(layout.held_within(Part::State, Part::Params, u));
            let (master, param_out) = match m {
                Some(m) => (m, Some(params)),
                None => (
                    D::as_f32_mut(params).expect("fp32 parameters are their own master"),
                    None,
                ),
            };
            slices.push(Slices {
                unit,
                held: layout.held(Part::State, u),
                master,
                grads,
                param_out,
            });
        }
        let shards = layout.sharded(Part::State).then_some(&mut self.comm);
        self.optimizer.step(&self.dev, &mut slices, s, shards)
    }
}

/// One buffer per unit of the elements `part` holds, charged to `category`.
fn alloc_held<D: Device, T: Elem>(
    dev: &D,
    acct: &Accountant,
    layout: &ShardLayout,
    category: Category,
    part: Part,
) -> Result<Vec<Buffer<T, D>>, Error> {
    layout
        .held_lens(part)
        .map(|len| acct.alloc_on(dev, category, len))
        .collect()
}

#[cfg(test)]
mod tests;
