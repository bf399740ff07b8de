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
use scheduler::model::{
    AdapterTensor, Adapters, BaseStorage, LoraLayout, ModelShape, ModelTensor, Nf4Part, Units,
};
use scheduler::spec::ZeroStage;

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::comm::{Collective, Communicator, DeviceCollectives, Summable};
use crate::data::DataLoader;
use crate::device::{Cpu, Device, Elem, Num};
use crate::lora::{Adapted, Lora, MaskBatch};
use crate::loss_scale::LossScaler;
use crate::model::Passes;
use crate::optimizer::{OptimizerState, Slices, Step};
use kernels::crossentropy::IGNORE;

mod layout;
mod state;
mod weights;

use layout::{Part, ShardLayout};
pub(crate) use weights::seeded_values;

/// Index of the embeddings unit; block `l` is unit `l + 1`, the final norm unit `L + 1` and
/// an untied LM head unit `L + 2`.
const EMB: usize = 0;

/// What a trained tensor is: one of the model's (full fine-tuning) or an adapter matrix
/// (LoRA, where block `l`'s adapters are trained unit `l`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trainable {
    Model(ModelTensor),
    Adapter(AdapterTensor),
}

/// The units a job trains, laid out for `world_size` ranks: the model's, or its adapters'.
fn trained_units(
    model: &ModelShape,
    adapters: Option<&Adapters>,
    world_size: usize,
) -> Units<Trainable> {
    match adapters {
        None => model.units(world_size).map_kinds(Trainable::Model),
        Some(a) => a
            .layout(model, world_size)
            .adapters
            .map_kinds(Trainable::Adapter),
    }
}

/// Unit-sized device buffers: one for the pinned embeddings (a tied LM head keeps them from
/// the first operation of a step to its last) and some taken in turn by the other units.
struct Slots<X, D: Device> {
    pinned: Option<Buffer<X, D>>,
    streamed: Vec<Buffer<X, D>>,
}

impl<X, D: Device> Slots<X, D> {
    fn new<K>(dev: &D, acct: &Accountant, units: &Units<K>, streamed: usize) -> Result<Self, Error>
    where
        X: Elem,
    {
        let pinned = match units.pinned_padded_len() {
            0 => None,
            len => Some(acct.alloc_on(dev, Category::Buffers, len)?),
        };
        let len = units.largest_streamed_padded_len();
        Ok(Slots {
            pinned,
            streamed: (0..streamed)
                .map(|_| acct.alloc_on(dev, Category::Buffers, len))
                .collect::<Result<_, Error>>()?,
        })
    }

    fn slot_index(&self, u: usize) -> Option<usize> {
        match &self.pinned {
            Some(_) if u == EMB => None,
            _ => Some(u % self.streamed.len()),
        }
    }

    fn get(&self, u: usize) -> &Buffer<X, D> {
        match self.slot_index(u) {
            None => self.pinned.as_ref().expect("pinned slot"),
            Some(i) => &self.streamed[i],
        }
    }

    fn get_mut(&mut self, u: usize) -> &mut Buffer<X, D> {
        match self.slot_index(u) {
            None => self.pinned.as_mut().expect("pinned slot"),
            Some(i) => &mut self.streamed[i],
        }
    }
}

/// The parameters of some units as this rank holds them: whole, or (stage 3) its shard of
/// each, gathered in turn into two streamed slots (and the pinned embeddings) to compute with.
struct Held<X, D: Device, K> {
    units: Units<K>,
    layout: ShardLayout,
    /// Per unit: the elements the layout holds of `Part::Params`.
    params: Vec<Buffer<X, D>>,
    gathered: Option<Slots<X, D>>,
}

impl<X: Elem + Summable, D: DeviceCollectives, K> Held<X, D, K> {
    fn new(
        dev: &D,
        acct: &Accountant,
        units: Units<K>,
        stage: ZeroStage,
        rank: usize,
    ) -> Result<Self, Error> {
        let layout = ShardLayout::new(stage, &units, rank);
        let params = alloc_held(dev, acct, &layout, Category::Params, Part::Params)?;
        let gathered = if layout.sharded(Part::Params) {
            Some(Slots::new(dev, acct, &units, 2)?)
        } else {
            None
        };
        Ok(Held {
            units,
            layout,
            params,
            gathered,
        })
    }

    fn unit_len(&self, u: usize) -> usize {
        self.units.iter().nth(u).expect("unit index").padded_len
    }

    /// Unit `u`'s whole parameters (gathered first at stage 3).
    fn view(&self, u: usize) -> D::View<'_, X> {
        match &self.gathered {
            Some(g) => g.get(u).at(0..self.unit_len(u)),
            None => self.params[u].view(),
        }
    }

    /// Unit `u`'s whole parameters to write: its buffer, or at stage 3 its gathered slot,
    /// whose part this rank holds [`Held::keep`] then copies into its shard.
    fn whole_mut(&mut self, u: usize) -> D::ViewMut<'_, X> {
        let len = self.unit_len(u);
        match &mut self.gathered {
            Some(g) => g.get_mut(u).at_mut(0..len),
            None => self.params[u].view_mut(),
        }
    }

    /// Stage 3: keeps this rank's part of what was written through [`Held::whole_mut`].
    fn keep(&mut self, dev: &D, u: usize) -> Result<(), Error> {
        let Some(gathered) = &self.gathered else {
            return Ok(());
        };
        let held = self.layout.held(Part::Params, u);
        dev.copy(self.params[u].view_mut(), gathered.get(u).at(held))
    }

    /// Stage 3: gathers unit `u`'s parameters from every rank's shard.
    fn fetch(&mut self, dev: &D, comm: &mut Communicator, u: usize) -> Result<(), Error> {
        let len = self.unit_len(u);
        let Some(gathered) = &mut self.gathered else {
            return Ok(());
        };
        let buf = gathered.get_mut(u);
        let held = self.layout.held(Part::Params, u);
        dev.copy(buf.at_mut(held), self.params[u].view())?;
        dev.collective(comm, Collective::AllGather, buf.at_mut(0..len))
    }
}

/// What the optimizer trains: the held parameters, their gradients, fp32 master weights and
/// optimizer states.
struct Trained<X, D: Device> {
    held: Held<X, D, Trainable>,
    /// Per unit: the elements the layout holds of `Part::Grads`.
    grads: Vec<Buffer<X, D>>,
    /// Stages 2-3: the full gradient of the unit in backward (and of pinned embeddings).
    unit_grads: Option<Slots<X, D>>,
    /// Mixed precision: fp32 master weights of each unit's `Part::State` range.
    master: Option<Vec<Buffer<f32, D>>>,
    optimizer: OptimizerState<D>,
}

impl<X: Num + Summable, D: DeviceCollectives> Trained<X, D> {
    fn new(
        dev: &D,
        acct: &Accountant,
        setup: &Setup,
        units: Units<Trainable>,
        rank: usize,
    ) -> Result<Self, Error> {
        let held = Held::new(dev, acct, units, setup.stage, rank)?;
        let (units, layout) = (&held.units, &held.layout);
        let grads = alloc_held(dev, acct, layout, Category::Grads, Part::Grads)?;
        let master = if X::as_f32(&[]).is_none() {
            Some(alloc_held(
                dev,
                acct,
                layout,
                Category::Optimizer,
                Part::State,
            )?)
        } else {
            None
        };
        let state: Vec<_> = units
            .iter()
            .enumerate()
            .map(|(u, unit)| (unit, layout.held(Part::State, u)))
            .collect();
        let optimizer = OptimizerState::new(dev, setup.optimizer, &state, acct)?;
        let unit_grads = if layout.sharded(Part::Grads) {
            Some(Slots::new(dev, acct, units, 1)?)
        } else {
            None
        };
        Ok(Trained {
            held,
            grads,
            unit_grads,
            master,
            optimizer,
        })
    }

    /// Unit `u`'s whole parameters and, when `backward`, where its whole gradient is added.
    fn views(&mut self, u: usize, backward: bool) -> (D::View<'_, X>, Option<D::ViewMut<'_, X>>) {
        let len = self.held.unit_len(u);
        let grad = backward.then(|| grad(&mut self.unit_grads, &mut self.grads, u, len));
        (self.held.view(u), grad)
    }

    /// The first of the three points where stages differ: backward has finished unit `u`'s
    /// whole gradient. Where gradients are sharded (stages 2-3), it is reduce-scattered and
    /// this rank's shard added into the gradient kept across micro-batches; the buffer is then
    /// cleared for the next unit. Elsewhere backward added into the kept gradient directly.
    fn after_unit_backward(
        &mut self,
        dev: &D,
        comm: &mut Communicator,
        u: usize,
    ) -> Result<(), Error> {
        let len = self.held.unit_len(u);
        let Some(unit_grads) = &mut self.unit_grads else {
            return Ok(());
        };
        let buf = unit_grads.get_mut(u);
        dev.collective(comm, Collective::ReduceScatter, buf.at_mut(0..len))?;
        let held = self.held.layout.held(Part::Grads, u);
        dev.residual_accumulate(self.grads[u].view_mut(), buf.at(held))?;
        dev.fill_zero(buf.at_mut(0..len))
    }

    /// The second: every micro-batch's gradient has been added up. Whole gradients are
    /// all-reduced (stage 0), or reduce-scattered where only the state is sharded (stage 1);
    /// sharded ones were reduced unit by unit already.
    fn after_accumulation(&mut self, dev: &D, comm: &mut Communicator) -> Result<(), Error> {
        let layout = &self.held.layout;
        if layout.sharded(Part::Grads) {
            return Ok(());
        }
        let c = if layout.sharded(Part::State) {
            Collective::ReduceScatter
        } else {
            Collective::AllReduce
        };
        self.grads
            .iter_mut()
            .try_for_each(|g| dev.collective(comm, c, g.view_mut()))
    }

    /// The third: the optimizer has updated this rank's state range. Where that is a shard of
    /// whole parameters (stages 1-2), every rank's updated shard is gathered.
    fn after_update(&mut self, dev: &D, comm: &mut Communicator) -> Result<(), Error> {
        let layout = &self.held.layout;
        if !layout.sharded(Part::State) || layout.sharded(Part::Params) {
            return Ok(());
        }
        self.held
            .params
            .iter_mut()
            .try_for_each(|p| dev.collective(comm, Collective::AllGather, p.view_mut()))
    }

    /// Σg² over this rank's state range of every unit.
    fn sum_squares(&self, dev: &D) -> Result<f64, Error> {
        let mut sq = 0f64;
        for (u, g) in self.grads.iter().enumerate() {
            let held = self.held.layout.held_within(Part::State, Part::Grads, u);
            sq += dev.sum_squares(g.at(held))?;
        }
        Ok(sq)
    }

    /// Applies the optimizer to every unit's state range.
    fn update(&mut self, dev: &D, comm: &mut Communicator, s: Step) -> Result<(), Error> {
        let layout = &self.held.layout;
        let mut masters: Vec<Option<D::ViewMut<'_, f32>>> = match &mut self.master {
            Some(m) => m.iter_mut().map(|b| Some(b.view_mut())).collect(),
            None => self.held.params.iter().map(|_| None).collect(),
        };
        let mut slices = Vec::with_capacity(masters.len());
        let units = self
            .held
            .units
            .iter()
            .zip(self.held.params.iter_mut())
            .zip(&self.grads);
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
        let shards = layout.sharded(Part::State).then_some(comm);
        self.optimizer.step(dev, &mut slices, s, shards)
    }
}

/// Where backward adds unit `u`'s whole gradient (`len` elements).
fn grad<'a, X, D: Device>(
    unit_grads: &'a mut Option<Slots<X, D>>,
    grads: &'a mut [Buffer<X, D>],
    u: usize,
    len: usize,
) -> D::ViewMut<'a, X> {
    match unit_grads {
        Some(g) => g.get_mut(u).at_mut(0..len),
        None => grads[u].view_mut(),
    }
}

/// A LoRA job's frozen side: the base model's weights (no gradients, master copy or optimizer
/// state), QLoRA's NF4 weights, and the adapters' activations.
struct Frozen<X, D: Device> {
    adapters: Adapters,
    base: Held<X, D, ModelTensor>,
    /// One unit per block: its adapted projections' NF4 weights (QLoRA).
    nf4: Option<Held<u8, D, Nf4Part>>,
    lora: Lora<X, D>,
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
    model: ModelShape,
    /// The model's units (full fine-tuning) or its adapters' (LoRA).
    trained: Trained<X, D>,
    /// LoRA: the frozen base the adapters are trained on.
    frozen: Option<Frozen<X, D>>,
    checkpointing: bool,
    grad_accum: usize,
    /// Whether ranks agree on the gradient norm each step (fp16 overflow checks, clipping).
    reduces_norm: bool,
    passes: Passes<X, D>,
    comm: Communicator,
    acct: Accountant,
    /// Optimizer updates applied so far (skipped steps do not count, as in PyTorch).
    applied: u64,
}

impl<X: Num + Summable> Engine<X> {
    /// [`Engine::on`] the CPU.
    pub fn new(
        setup: &Setup,
        model: ModelShape,
        seed: u64,
        comm: Communicator,
        acct: Accountant,
    ) -> Result<Engine<X>, Error> {
        Engine::on(Cpu, setup, model, seed, comm, acct)
    }
}

impl<X: Num + Summable, D: DeviceCollectives> Engine<X, D> {
    /// Allocates every buffer on `dev` through `acct` and initialises the weights as the
    /// model's family does (and the adapters as PEFT does), from `seed`: the same values
    /// whatever the device, stage or world size.
    pub fn on(
        dev: D,
        setup: &Setup,
        model: ModelShape,
        seed: u64,
        comm: Communicator,
        acct: Accountant,
    ) -> Result<Engine<X, D>, Error> {
        let (world, rank) = (comm.world_size(), comm.rank());
        let units = trained_units(&model, setup.lora.as_ref(), world);
        let trained = Trained::new(&dev, &acct, setup, units, rank)?;
        let mut comm = comm;
        let ring = memory::ring_scratch_bytes(setup);
        if ring > 0 {
            debug_assert_eq!(ring % 8, 0, "ring chunks are whole 8-byte words");
            comm.set_scratch(acct.alloc(Category::Buffers, (ring / 8) as usize)?);
        }
        if comm.nccl_requested() {
            dev.join_collectives(&mut comm)?;
        }
        let (b, t) = (setup.micro_batch, setup.seq_len);
        let passes = Passes::new(&dev, &acct, &model, b, t, setup.checkpointing)?;
        let frozen = match &setup.lora {
            Some(adapters) => {
                let LoraLayout { base, nf4, .. } = adapters.layout(&model, world);
                let stage = setup.stage;
                Some(Frozen {
                    adapters: *adapters,
                    base: Held::new(&dev, &acct, base, stage, rank)?,
                    nf4: match adapters.base {
                        BaseStorage::Compute => None,
                        BaseStorage::Nf4 => Some(Held::new(&dev, &acct, nf4, stage, rank)?),
                    },
                    lora: Lora::new(
                        &dev,
                        &acct,
                        (adapters, seed),
                        &model,
                        b * t,
                        setup.checkpointing,
                    )?,
                })
            }
            None => None,
        };
        let mut engine = Engine {
            dev,
            model,
            trained,
            frozen,
            checkpointing: setup.checkpointing,
            grad_accum: setup.grad_accum,
            reduces_norm: setup.reduces_norm,
            passes,
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

    /// Tokens of one micro-batch (B·T).
    pub fn micro_batch_tokens(&self) -> usize {
        self.passes.tokens()
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

    /// Stage 3: gathers the model's unit `u` (the frozen base's, in LoRA) and, given `l`, the
    /// adapters of block `l`.
    fn fetch(&mut self, u: usize, adapters_of: Option<usize>) -> Result<(), Error> {
        let (dev, comm) = (&self.dev, &mut self.comm);
        match &mut self.frozen {
            None => self.trained.held.fetch(dev, comm, u),
            Some(f) => {
                f.base.fetch(dev, comm, u)?;
                let Some(l) = adapters_of else {
                    return Ok(());
                };
                if let Some(nf4) = &mut f.nf4 {
                    nf4.fetch(dev, comm, l)?;
                }
                self.trained.held.fetch(dev, comm, l)
            }
        }
    }

    /// The units this job trains, laid out for `world_size` ranks.
    fn trained_units(&self, world_size: usize) -> Units<Trainable> {
        let adapters = self.frozen.as_ref().map(|f| &f.adapters);
        trained_units(&self.model, adapters, world_size)
    }

    /// Backward has finished the gradient of the model's unit `u` (full fine-tuning; the
    /// frozen base has none).
    fn after_model_unit_backward(&mut self, u: usize) -> Result<(), Error> {
        if self.frozen.is_some() {
            return Ok(());
        }
        self.trained
            .after_unit_backward(&self.dev, &mut self.comm, u)
    }

    /// Backward has finished the gradients of block `l` (its unit's, or its adapters').
    fn after_block_backward(&mut self, l: usize) -> Result<(), Error> {
        let u = if self.frozen.is_some() { l } else { l + 1 };
        self.trained
            .after_unit_backward(&self.dev, &mut self.comm, u)
    }

    /// The final norm's unit.
    fn norm_unit(&self) -> usize {
        self.model.summary().layers + 1
    }

    /// The unit holding the LM head: the embeddings when tied, else its own after the norm.
    fn head_unit(&self) -> usize {
        if self.model.summary().tied_embeddings {
            EMB
        } else {
            self.norm_unit() + 1
        }
    }

    /// Forward through the embeddings and every block, leaving the final norm's and the
    /// head's units gathered (stage 3) for [`Self::head_loss`].
    fn forward(&mut self) -> Result<(), Error> {
        let l_n = self.norm_unit() - 1;
        let ckpt = self.checkpointing;
        let slot = move |l: usize| if ckpt { 0 } else { l };
        // Stage 3 gathers each unit one unit ahead, into the other of the two streamed slots,
        // so that on a device with collectives of its own (NCCL) the gather of the next unit
        // runs while this one computes; the gathers are the same, in the same order.
        self.fetch(EMB, None)?;
        self.fetch(1, Some(0))?;
        let emb = model_view(&self.trained, &self.frozen, EMB);
        self.passes.embed_forward(&self.dev, emb)?;
        for l in 0..l_n {
            let BlockViews {
                params, adapters, ..
            } = block_views(&mut self.trained, &mut self.frozen, l, slot(l), false);
            self.passes
                .block_forward(&self.dev, params, adapters, l, slot(l))?;
            // The next block's, or after the last block the final norm's.
            self.fetch(l + 2, (l + 1 < l_n).then_some(l + 1))?;
        }
        // A tied head's embeddings again, or the untied head.
        self.fetch(self.head_unit(), None)
    }

    /// The final norm, the head and the loss after [`Self::forward`], and back through the
    /// head when `dloss` is given.
    fn head_loss(&mut self, dloss: Option<f32>) -> Result<f64, Error> {
        let (norm, head) = (self.norm_unit(), self.head_unit());
        let (p_norm, p_head, g_head) = match &self.frozen {
            Some(f) => (f.base.view(norm), f.base.view(head), None),
            None => {
                let t = &mut self.trained;
                let len = t.held.unit_len(head);
                let g_head = grad(&mut t.unit_grads, &mut t.grads, head, len);
                (t.held.view(norm), t.held.view(head), Some(g_head))
            }
        };
        self.passes.loss(&self.dev, p_norm, p_head, g_head, dloss)
    }

    /// Forward and backward of the micro-batch in the passes' inputs and targets; returns its
    /// loss.
    fn micro_step(&mut self, dloss: f32) -> Result<f64, Error> {
        let (norm, head) = (self.norm_unit(), self.head_unit());
        let l_n = norm - 1;
        let ckpt = self.checkpointing;
        let slot = move |l: usize| if ckpt { 0 } else { l };
        self.forward()?;
        let loss = self.head_loss(Some(dloss))?;
        if head != EMB {
            self.after_model_unit_backward(head)?;
        }
        let (p_norm, g_norm) = match &self.frozen {
            Some(f) => (f.base.view(norm), None),
            None => self.trained.views(norm, true),
        };
        self.passes.norm_backward(&self.dev, p_norm, g_norm)?;
        self.after_model_unit_backward(norm)?;
        if l_n > 0 {
            self.fetch(l_n, Some(l_n - 1))?;
        }
        for l in (0..l_n).rev() {
            if self.checkpointing {
                let BlockViews {
                    params, adapters, ..
                } = block_views(&mut self.trained, &mut self.frozen, l, 0, false);
                self.passes
                    .block_forward(&self.dev, params, adapters, l, 0)?;
            }
            let BlockViews {
                params,
                grad,
                adapters,
            } = block_views(&mut self.trained, &mut self.frozen, l, slot(l), true);
            self.passes
                .block_backward(&self.dev, params, grad, adapters, l, slot(l))?;
            // Gathered ahead (into the slot of the unit whose backward is done) before this
            // unit's gradient is reduced: on NCCL's stream the gather need not wait for this
            // block's backward, the reduction must. The embeddings' backward reads no weights.
            if l > 0 {
                self.fetch(l, Some(l - 1))?;
            }
            self.after_block_backward(l)?;
        }
        if self.frozen.is_none() {
            let (_, g) = self.trained.views(EMB, true);
            let g = g.expect("backward views carry the gradient");
            self.passes.embed_backward(&self.dev, g)?;
            self.after_model_unit_backward(EMB)?;
        }
        Ok(loss)
    }
}

/// The model's unit `u`, whole: trained, or LoRA's frozen base.
fn model_view<'a, X: Num + Summable, D: DeviceCollectives>(
    trained: &'a Trained<X, D>,
    frozen: &'a Option<Frozen<X, D>>,
    u: usize,
) -> D::View<'a, X> {
    match frozen {
        Some(f) => f.base.view(u),
        None => trained.held.view(u),
    }
}

/// Block `l`'s whole parameters, where backward adds their gradient (none when frozen), and
/// its adapters for activation slot `slot`, borrowed at once.
struct BlockViews<'a, X, D: Device> {
    params: D::View<'a, X>,
    grad: Option<D::ViewMut<'a, X>>,
    adapters: Adapted<'a, X, D>,
}

fn block_views<'a, X: Num + Summable, D: DeviceCollectives>(
    trained: &'a mut Trained<X, D>,
    frozen: &'a mut Option<Frozen<X, D>>,
    l: usize,
    slot: usize,
    backward: bool,
) -> BlockViews<'a, X, D> {
    match frozen {
        None => {
            let (params, grad) = trained.views(l + 1, backward);
            BlockViews {
                params,
                grad,
                adapters: Adapted::none(),
            }
        }
        Some(f) => {
            let (a, ga) = trained.views(l, backward);
            let nf4 = f.nf4.as_ref().map(|h| h.view(l));
            BlockViews {
                params: f.base.view(l + 1),
                grad: None,
                adapters: f.lora.block(a, nf4, ga, (l, slot)),
            }
        }
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
        for g in &mut self.trained.grads {
            self.dev.fill_zero(g.view_mut())?;
        }
        let scale = scaler.scale();
        let tokens = self.passes.tokens() * self.grad_accum * self.comm.world_size();
        // Each token's loss is divided by the tokens of the whole step on every rank, so the
        // summed gradients are the mean's; the loss scale rides along. Where targets are
        // ignored (fine-tuning prompts), `agree` turns that into the mean over counted ones.
        let dloss = scale / tokens as f32;
        let (mut loss, mut ignored) = (0.0, 0);
        for micro in 0..self.grad_accum {
            ignored += self.load(data)?;
            self.drop_for(Some(micro));
            loss += self.micro_step(dloss)?;
        }
        loss /= self.grad_accum as f64;
        self.trained.after_accumulation(&self.dev, &mut self.comm)?;
        let agreed = self.agree(loss, scale, ignored, tokens)?;
        let (loss, grad_norm) = (agreed.loss, agreed.grad_norm);
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
            grad_scale: (clip_coef * agreed.counted_share / f64::from(scale)) as f32,
        };
        self.trained.update(&self.dev, &mut self.comm, s)?;
        self.trained.after_update(&self.dev, &mut self.comm)?;
        self.applied = step;
        Ok(report(false))
    }

    /// The mean loss over `batches` batches of `data` from its start, forward only, averaged
    /// over the ranks (each reads its slice, as in training). It uses the training buffers, so
    /// it costs no memory, and it leaves the gradients as they are.
    pub fn evaluate(&mut self, data: &mut DataLoader, batches: u32) -> Result<f64, Error> {
        data.seek(crate::data::Position::default())?;
        self.drop_for(None);
        let (mut loss, mut ignored) = (0.0, 0);
        for _ in 0..batches {
            ignored += self.load(data)?;
            self.forward()?;
            loss += self.head_loss(None)?;
        }
        let n = self.comm.world_size();
        let mut agreed = [(loss / f64::from(batches)) as f32, ignored as f32];
        if n > 1 {
            self.comm.all_reduce(&mut agreed)?;
        }
        let tokens = self.passes.tokens() * batches as usize * n;
        let share = counted_share(tokens, f64::from(agreed[1]));
        Ok(f64::from(agreed[0]) / n as f64 * share)
    }

    /// Keys LoRA's dropout masks to micro-batch `micro` of the step being trained, whose
    /// tokens are window `micro · world + rank` of the step's (`data`); none: evaluation, which
    /// drops nothing.
    fn drop_for(&mut self, micro: Option<usize>) {
        let Some(f) = &mut self.frozen else {
            return;
        };
        let (world, rank) = (self.comm.world_size(), self.comm.rank());
        let tokens = self.passes.tokens();
        f.lora.set_batch(micro.map(|m| MaskBatch {
            step: self.applied,
            first_token: ((m * world + rank) * tokens) as u64,
        }));
    }

    /// Reads the next micro-batch of `data` into the passes' inputs and targets; returns the
    /// targets it ignores.
    fn load(&mut self, data: &mut DataLoader) -> Result<usize, Error> {
        let (dev, batch) = (&self.dev, self.passes.batch());
        dev.on_host(batch.inputs.view_mut(), |inputs| {
            dev.on_host(batch.targets.view_mut(), |targets| {
                data.next_batch(inputs, targets)?;
                Ok::<_, Error>(targets.iter().filter(|&&t| t == IGNORE).count())
            })
        })??
    }

    /// Makes the ranks agree on the step's mean loss and, when fp16 or clipping needs it, on
    /// ‖g‖ of the unscaled gradients (summed over shards when sharded): one all-reduce of three
    /// f32s, the third the targets ignored. `loss` is this rank's mean over its `B·T·accum`
    /// positions (ignored ones 0) and the gradients are the sums over all `tokens` positions'
    /// losses divided by `tokens`; both become means over the counted targets.
    fn agree(
        &mut self,
        loss: f64,
        scale: f32,
        ignored: usize,
        tokens: usize,
    ) -> Result<Agreed, Error> {
        let sharded = self.trained.held.layout.sharded(Part::State);
        let mut sq = 0f64;
        if self.reduces_norm {
            sq = self.trained.sum_squares(&self.dev)?;
        }
        let n = self.comm.world_size();
        let (mut loss, mut ignored) = (loss, ignored as f64);
        if n > 1 {
            let mut agreed = [
                if sharded { sq as f32 } else { 0.0 },
                loss as f32,
                ignored as f32,
            ];
            self.comm.all_reduce(&mut agreed)?;
            if sharded {
                sq = f64::from(agreed[0]);
            }
            loss = f64::from(agreed[1]) / n as f64;
            ignored = f64::from(agreed[2]);
        }
        let counted_share = counted_share(tokens, ignored);
        Ok(Agreed {
            loss: loss * counted_share,
            grad_norm: self
                .reduces_norm
                .then(|| sq.sqrt() / f64::from(scale) * counted_share),
            counted_share,
        })
    }
}

/// What the ranks agreed on after a step's micro-batches.
struct Agreed {
    /// The mean loss over the step's counted targets.
    loss: f64,
    grad_norm: Option<f64>,
    /// All positions over counted ones: what the gradients, divided by all, are multiplied by.
    counted_share: f64,
}

/// `tokens / (tokens - ignored)`: exactly 1 where nothing is ignored; 0 where everything is (a
/// step of prompts only trains on nothing).
fn counted_share(tokens: usize, ignored: f64) -> f64 {
    let counted = tokens as f64 - ignored;
    if counted > 0.0 {
        tokens as f64 / counted
    } else {
        0.0
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
