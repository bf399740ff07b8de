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

use std::ops::Range;

use kernels::Float;
use kernels::norm::sum_squares;
use kernels::residual::residual_accumulate;
use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use scheduler::memory::{self, Category, Setup};
use scheduler::model::{GptShape, TensorKind, Unit, Units};
use scheduler::spec::ZeroStage;

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::checkpoint::{self, StateTensor};
use crate::comm::{Communicator, Wire};
use crate::data::DataLoader;
use crate::gpt::{self, Acts, Block, Dims};
use crate::loss_scale::LossScaler;
use crate::optimizer::{OptimizerState, Slices, Step};

/// Index of the embeddings unit; block `l` is unit `l + 1`, the final norm unit `L + 1`.
const EMB: usize = 0;

/// The model's buffers on this rank.
struct Buffers<X> {
    /// Per unit: whole (stages 0-2) or this rank's shard (stage 3).
    params: Vec<Buffer<X>>,
    /// Per unit: whole (stages 0-1) or this rank's shard (stages 2-3).
    grads: Vec<Buffer<X>>,
    /// Stages 2-3: the full gradient of the embeddings and of the other unit in backward.
    unit_grads: Option<[Buffer<X>; 2]>,
    /// Stage 3: the gathered embeddings and two block-sized units (alternating).
    gathered: Option<[Buffer<X>; 3]>,
}

impl<X: Float> Buffers<X> {
    fn gathered_slot(u: usize) -> usize {
        if u == EMB { 0 } else { 1 + u % 2 }
    }

    fn grad_slot(u: usize) -> usize {
        usize::from(u != EMB)
    }

    /// Unit `u`'s whole parameters (gathered first at stage 3).
    fn param(&self, u: usize, len: usize) -> &[X] {
        match &self.gathered {
            Some(g) => &g[Self::gathered_slot(u)][..len],
            None => &self.params[u][..len],
        }
    }

    /// Where backward adds unit `u`'s whole gradient.
    fn grad(&mut self, u: usize) -> &mut [X] {
        match &mut self.unit_grads {
            Some(g) => &mut g[Self::grad_slot(u)],
            None => &mut self.grads[u],
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

pub struct Engine<X: Float> {
    shape: GptShape,
    units: Units,
    stage: ZeroStage,
    dims: Dims,
    checkpointing: bool,
    grad_accum: usize,
    /// Whether ranks agree on the gradient norm each step (fp16 overflow checks, clipping).
    reduces_norm: bool,
    bufs: Buffers<X>,
    /// Mixed precision: fp32 master weights of each unit's held range.
    master: Option<Vec<Buffer<f32>>>,
    optimizer: OptimizerState,
    acts: Acts<X>,
    comm: Communicator,
    acct: Accountant,
    /// Optimizer updates applied so far (skipped steps do not count, as in PyTorch).
    applied: u64,
}

impl<X: Float + Wire> Engine<X> {
    /// Allocates every buffer through `acct` and initialises the weights, GPT-2 style, from
    /// `seed`: the same values whatever the stage or world size.
    pub fn new(
        setup: &Setup,
        shape: GptShape,
        seed: u64,
        comm: Communicator,
        acct: Accountant,
    ) -> Result<Engine<X>, Error> {
        let (stage, rank) = (setup.stage, comm.rank());
        let units = Units::new(&shape, comm.world_size());
        let held_len = |u: &Unit, sharded: bool| if sharded { u.shard_len() } else { u.padded_len };
        let alloc_units = |category, sharded: bool| {
            units
                .iter()
                .map(|u| acct.alloc::<X>(category, held_len(u, sharded)))
                .collect::<Result<Vec<_>, Error>>()
        };
        let params = alloc_units(Category::Params, stage.shards_params())?;
        let grads = alloc_units(Category::Grads, stage.shards_grads())?;
        let mixed = X::as_f32(&[]).is_none();
        let master = if mixed {
            Some(
                units
                    .iter()
                    .map(|u| {
                        acct.alloc::<f32>(
                            Category::Optimizer,
                            held_len(u, stage.shards_optimizer()),
                        )
                    })
                    .collect::<Result<Vec<_>, Error>>()?,
            )
        } else {
            None
        };
        let held: Vec<(&Unit, Range<usize>)> = units
            .iter()
            .map(|u| (u, held_range(u, stage, rank)))
            .collect();
        let optimizer = OptimizerState::new(setup.optimizer, &held, &acct)?;
        let (emb, other) = (
            units.embeddings().padded_len,
            units.largest_other_padded_len(),
        );
        let unit_grads = if stage.shards_grads() {
            Some([
                acct.alloc(Category::Buffers, emb)?,
                acct.alloc(Category::Buffers, other)?,
            ])
        } else {
            None
        };
        let gathered = if stage.shards_params() {
            Some([
                acct.alloc(Category::Buffers, emb)?,
                acct.alloc(Category::Buffers, other)?,
                acct.alloc(Category::Buffers, other)?,
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
        let dims = Dims::new(&shape, setup.micro_batch, setup.seq_len);
        let acts = Acts::new(&acct, &shape, dims.b, dims.t, setup.checkpointing)?;
        let mut engine = Engine {
            shape,
            units,
            stage,
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
        engine.init_weights(seed);
        Ok(engine)
    }

    pub fn accountant(&self) -> &Accountant {
        &self.acct
    }

    pub fn dims(&self) -> Dims {
        self.dims
    }

    /// Optimizer updates applied so far.
    pub fn applied_steps(&self) -> u64 {
        self.applied
    }

    pub fn set_applied_steps(&mut self, applied: u64) {
        self.applied = applied;
    }

    /// Sets every parameter from one fp32 vector per unit of the single-rank layout (e.g.
    /// Hugging Face weights), keeping this rank's part.
    pub fn load_weights(&mut self, units: &[Vec<f32>]) {
        let rank = self.comm.rank();
        for (ui, values) in units.iter().enumerate() {
            let len = values.len().min(self.unit_len(ui));
            let mut it = values[..len].iter().copied();
            self.write_tensor(ui, 0..len, rank, || it.next().unwrap_or(0.0));
        }
    }

    /// Each unit's fp32 weights (the master copy in mixed precision), gathered from every rank
    /// where they are sharded, for the final export.
    pub fn unit_values(&mut self) -> Result<Vec<Vec<f32>>, Error> {
        let (stage, rank) = (self.stage, self.comm.rank());
        let mut out = Vec::with_capacity(self.bufs.params.len());
        for (u, unit) in self.units.iter().enumerate() {
            let held = held_range(unit, stage, rank);
            let mut full = vec![0f32; unit.padded_len];
            match &self.master {
                Some(m) => full[held.clone()].copy_from_slice(&m[u]),
                None => {
                    let p = &self.bufs.params[u];
                    let mine = if stage.shards_params() {
                        &p[..]
                    } else {
                        &p[held.clone()]
                    };
                    full[held.clone()]
                        .iter_mut()
                        .zip(mine)
                        .for_each(|(f, x)| *f = x.to_f32());
                }
            }
            if stage.shards_optimizer() {
                self.comm.all_gather(&mut full)?;
            }
            full.truncate(unit.len);
            out.push(full);
        }
        Ok(out)
    }

    /// Bytes this rank has sent, by collective.
    pub fn sent_bytes(&self) -> std::collections::BTreeMap<crate::comm::Op, u64> {
        self.comm.sent_bytes().clone()
    }

    /// Writes this rank's part of a checkpoint; rank 0 then publishes it (every rank waits).
    pub fn save_checkpoint(
        &mut self,
        out: &std::path::Path,
        manifest: &checkpoint::Manifest,
    ) -> Result<(), Error> {
        let rank = self.comm.rank();
        let tmp = checkpoint::staging_dir(out, manifest.step);
        if rank == 0 {
            checkpoint::begin(&tmp)?;
        }
        self.comm.barrier()?;
        checkpoint::write_rank(&tmp, rank, &self.state())?;
        self.comm.barrier()?;
        if rank == 0 {
            checkpoint::publish(out, &tmp, manifest)?;
        }
        self.comm.barrier()
    }

    /// GPT-2's initialisation: weights N(0, 0.02), the residual projections N(0, 0.02/√(2L)),
    /// biases 0, LayerNorm weights 1. Each tensor draws from its own stream keyed by the seed,
    /// the unit and the tensor, so the values do not depend on how units are sharded.
    fn init_weights(&mut self, seed: u64) {
        let rank = self.comm.rank();
        let std = 0.02;
        let residual_std = std / (2.0 * self.shape.n_layer as f64).sqrt();
        let units = self.units.clone();
        for (ui, unit) in units.iter().enumerate() {
            for (ti, t) in unit.tensors.iter().enumerate() {
                let mut key = [0u8; 32];
                key[..8].copy_from_slice(&seed.to_le_bytes());
                key[8..16].copy_from_slice(&(ui as u64).to_le_bytes());
                key[16..24].copy_from_slice(&(ti as u64).to_le_bytes());
                let mut rng = ChaCha8Rng::from_seed(key);
                let value: Box<dyn FnMut() -> f32> = match t.kind {
                    TensorKind::Ln1Weight | TensorKind::Ln2Weight | TensorKind::LnfWeight => {
                        Box::new(|| 1.0)
                    }
                    k if !k.decayed(&self.shape) => Box::new(|| 0.0),
                    k => {
                        let s = match k {
                            TensorKind::AttnProjWeight | TensorKind::FcProjWeight => residual_std,
                            _ => std,
                        };
                        let normal = Normal::new(0.0, s).expect("a positive standard deviation");
                        Box::new(move || normal.sample(&mut rng) as f32)
                    }
                };
                self.write_tensor(ui, t.range(), rank, value);
            }
        }
    }

    /// Writes the values `next` yields for elements `range` of unit `ui` into this rank's
    /// parameters and master weights, wherever they hold them.
    fn write_tensor(
        &mut self,
        ui: usize,
        range: Range<usize>,
        rank: usize,
        mut next: impl FnMut() -> f32,
    ) {
        let unit = self.units.iter().nth(ui).expect("unit index");
        let params_at = if self.stage.shards_params() {
            unit.shard_range(rank)
        } else {
            0..unit.padded_len
        };
        let master_at = held_range(unit, self.stage, rank);
        for i in range {
            let v = next();
            if params_at.contains(&i) {
                self.bufs.params[ui][i - params_at.start] = X::from_f32(v);
            }
            if let Some(master) = &mut self.master {
                if master_at.contains(&i) {
                    master[ui][i - master_at.start] = v;
                }
            }
        }
    }

    /// Stage 3: gathers unit `u`'s parameters from every rank's shard.
    fn fetch(&mut self, u: usize) -> Result<(), Error> {
        let Some(gathered) = &mut self.bufs.gathered else {
            return Ok(());
        };
        let unit = self.units.iter().nth(u).expect("unit index");
        let buf = &mut gathered[Buffers::<X>::gathered_slot(u)][..unit.padded_len];
        buf[unit.shard_range(self.comm.rank())].copy_from_slice(&self.bufs.params[u]);
        self.comm.all_gather(buf)
    }

    /// Stages 2-3: reduce-scatters unit `u`'s gradient and adds this rank's shard of it into
    /// the gradient kept across micro-batches; then clears the buffer for the next unit.
    fn grads_done(&mut self, u: usize) -> Result<(), Error> {
        let Some(unit_grads) = &mut self.bufs.unit_grads else {
            return Ok(());
        };
        let unit = self.units.iter().nth(u).expect("unit index");
        let buf = &mut unit_grads[Buffers::<X>::grad_slot(u)][..unit.padded_len];
        self.comm.reduce_scatter(buf)?;
        residual_accumulate(
            &mut self.bufs.grads[u],
            &buf[unit.shard_range(self.comm.rank())],
        );
        buf.fill(X::ZERO);
        Ok(())
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
        self.fetch(EMB)?;
        gpt::embed_forward(
            self.bufs.param(EMB, self.unit_len(EMB)),
            &shape,
            &d,
            &mut self.acts,
        );
        for l in 0..l_n {
            self.fetch(l + 1)?;
            let p = Block::new(self.bufs.param(l + 1, self.unit_len(l + 1)), &shape);
            gpt::block_forward(&p, &mut self.acts, l, slot(l), &d);
        }
        self.fetch(norm)?;
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
                    &g[Buffers::<X>::gathered_slot(norm)][..norm_len],
                    &g[0][..emb_len],
                ),
                None => (&params[norm][..], &params[EMB][..]),
            };
            let (g_norm, g_emb) = match unit_grads {
                Some([emb, other]) => (&mut other[..], &mut emb[..]),
                None => {
                    let [g_emb, g_norm] =
                        grads.get_disjoint_mut([EMB, norm]).expect("distinct units");
                    (&mut g_norm[..], &mut g_emb[..])
                }
            };
            gpt::head(
                p_norm,
                p_emb,
                g_norm,
                g_emb,
                &mut self.acts,
                &shape,
                &d,
                dloss,
            )
        };
        self.grads_done(norm)?;
        for l in (0..l_n).rev() {
            self.fetch(l + 1)?;
            let len = self.unit_len(l + 1);
            if self.checkpointing {
                let p = Block::new(self.bufs.param(l + 1, len), &shape);
                gpt::block_forward(&p, &mut self.acts, l, 0, &d);
            }
            let Buffers {
                params,
                grads,
                unit_grads,
                gathered,
            } = &mut self.bufs;
            let p = match gathered {
                Some(g) => &g[Buffers::<X>::gathered_slot(l + 1)][..len],
                None => &params[l + 1][..],
            };
            let g = match unit_grads {
                Some([_, other]) => &mut other[..len],
                None => &mut grads[l + 1][..],
            };
            gpt::block_backward(
                &Block::new(p, &shape),
                Block::new_mut(g, &shape),
                &mut self.acts,
                l,
                slot(l),
                &d,
            );
            self.grads_done(l + 1)?;
        }
        gpt::embed_backward(self.bufs.grad(EMB), &shape, &d, &self.acts);
        self.grads_done(EMB)?;
        Ok(loss)
    }

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
            g.fill(X::ZERO);
        }
        let scale = scaler.scale();
        let tokens = self.dims.tokens() * self.grad_accum * self.comm.world_size();
        // Each token's loss is divided by the tokens of the whole step on every rank, so the
        // summed gradients are the mean's; the loss scale rides along.
        let dloss = scale / tokens as f32;
        let mut loss = 0.0;
        for _ in 0..self.grad_accum {
            data.next_batch(&mut self.acts.inputs, &mut self.acts.targets)?;
            loss += self.micro_step(dloss)?;
        }
        loss /= self.grad_accum as f64;
        match self.stage {
            ZeroStage::Ddp => self
                .bufs
                .grads
                .iter_mut()
                .try_for_each(|g| self.comm.all_reduce(g))?,
            ZeroStage::Optimizer => self
                .bufs
                .grads
                .iter_mut()
                .try_for_each(|g| self.comm.reduce_scatter(g))?,
            ZeroStage::Gradients | ZeroStage::Parameters => {}
        }
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
        self.applied = step;
        Ok(report(false))
    }

    /// Makes the ranks agree on the step's mean loss and, when fp16 or clipping needs it, on
    /// ‖g‖ of the unscaled gradients (summed over shards when sharded): one all-reduce of two
    /// f32s.
    fn agree(&mut self, loss: f64, scale: f32) -> Result<(f64, Option<f64>), Error> {
        let (rank, sharded) = (self.comm.rank(), self.stage.shards_optimizer());
        let mut sq = 0f64;
        if self.reduces_norm {
            for (unit, g) in self.units.iter().zip(&self.bufs.grads) {
                let held = if self.stage.shards_grads() {
                    0..g.len()
                } else {
                    held_range(unit, self.stage, rank)
                };
                sq += sum_squares(&g[held]);
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

    /// Applies the optimizer to every unit's held range, then (stages 1-2) gathers the
    /// updated parameters from every rank.
    fn update(&mut self, s: Step) -> Result<(), Error> {
        let (stage, rank) = (self.stage, self.comm.rank());
        let mut masters: Vec<Option<&mut [f32]>> = match &mut self.master {
            Some(m) => m.iter_mut().map(|b| Some(&mut b[..])).collect(),
            None => self.bufs.params.iter().map(|_| None).collect(),
        };
        let mut slices = Vec::with_capacity(masters.len());
        let units = self
            .units
            .iter()
            .zip(self.bufs.params.iter_mut())
            .zip(&self.bufs.grads);
        for (((unit, p), g), m) in units.zip(masters.iter_mut().map(Option::take)) {
            let held = held_range(unit, stage, rank);
            let grads = if stage.shards_grads() {
                &g[..]
            } else {
                &g[held.clone()]
            };
            let params = if stage.shards_params() {
                &mut p[..]
            } else {
                &mut p[held.clone()]
            };
            let (master, param_out) = match m {
                Some(m) => (m, Some(params)),
                None => (
                    X::as_f32_mut(params).expect("fp32 parameters are their own master"),
                    None,
                ),
            };
            slices.push(Slices {
                unit,
                held,
                master,
                grads,
                param_out,
            });
        }
        self.optimizer.step(&mut slices, s, &mut self.comm)?;
        if matches!(stage, ZeroStage::Optimizer | ZeroStage::Gradients) {
            self.bufs
                .params
                .iter_mut()
                .try_for_each(|p| self.comm.all_gather(p))?;
        }
        Ok(())
    }
}

impl<X: Float + Wire> Engine<X> {
    /// This rank's persistent buffers, named for checkpoints: parameters, master weights and
    /// optimizer states (gradients and activations are rebuilt every step).
    pub fn state(&mut self) -> Vec<StateTensor<'_>> {
        let dtype = match X::NAME {
            "f16" => safetensors::Dtype::F16,
            "bf16" => safetensors::Dtype::BF16,
            _ => safetensors::Dtype::F32,
        };
        let mut out: Vec<StateTensor<'_>> = self
            .bufs
            .params
            .iter_mut()
            .enumerate()
            .map(|(u, p)| StateTensor {
                name: format!("u{u}.params"),
                dtype,
                bytes: bytemuck::cast_slice_mut(&mut p[..]),
            })
            .collect();
        if let Some(master) = &mut self.master {
            out.extend(master.iter_mut().enumerate().map(|(u, m)| StateTensor {
                name: format!("u{u}.master"),
                dtype: safetensors::Dtype::F32,
                bytes: bytemuck::cast_slice_mut(&mut m[..]),
            }));
        }
        out.extend(self.optimizer.state());
        out
    }
}

impl<X: Float + Wire> Engine<X> {
    /// Fills this rank's state from a checkpoint written by `old_world` ranks at `old_stage`:
    /// every element of each buffer is taken from whichever old rank held it.
    pub fn load_resharded(
        &mut self,
        dir: &std::path::Path,
        old_world: usize,
        old_stage: ZeroStage,
    ) -> Result<(), Error> {
        let (units, stage, rank) = (self.units.clone(), self.stage, self.comm.rank());
        let old_units = Units::new(&self.shape, old_world);
        let fail = |reason: String| Error::Checkpoint {
            path: dir.to_path_buf(),
            reason,
        };
        let mut tensors = self.state();
        let targets = tensors
            .iter()
            .map(|t| placement(&t.name, &units, stage, rank).map_err(&fail))
            .collect::<Result<Vec<_>, _>>()?;
        for old_rank in 0..old_world {
            checkpoint::read_rank(dir, old_rank, |file| {
                for (t, target) in tensors.iter_mut().zip(&targets) {
                    let view = file
                        .tensor(&t.name)
                        .map_err(|e| format!("{}: {e}", t.name))?;
                    let elem = t.dtype.bitsize() / 8;
                    match target {
                        None if old_rank == 0 => t.bytes.copy_from_slice(view.data()),
                        None => {}
                        Some((_, new)) => {
                            let (_, old) = placement(&t.name, &old_units, old_stage, old_rank)?
                                .expect("placed in both layouts");
                            let (start, end) = (new.start.max(old.start), new.end.min(old.end));
                            if start < end {
                                let src = &view.data()
                                    [(start - old.start) * elem..(end - old.start) * elem];
                                t.bytes[(start - new.start) * elem..(end - new.start) * elem]
                                    .copy_from_slice(src);
                            }
                        }
                    }
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}

/// Where state tensor `name` lies for `rank` of a layout: its unit and element range there,
/// or `None` for state every rank holds whole (Adafactor's factored statistics).
fn placement(
    name: &str,
    units: &Units,
    stage: ZeroStage,
    rank: usize,
) -> Result<Option<(usize, Range<usize>)>, String> {
    if name.starts_with("adafactor.") {
        return Ok(None);
    }
    let (u, kind) = name
        .strip_prefix('u')
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(u, kind)| Some((u.parse::<usize>().ok()?, kind)))
        .ok_or_else(|| format!("unknown state tensor {name}"))?;
    let unit = units
        .iter()
        .nth(u)
        .ok_or_else(|| format!("{name}: no unit {u} in this model"))?;
    let held = held_range(unit, stage, rank);
    let range = match kind {
        "params" if stage.shards_params() => unit.shard_range(rank),
        "params" => 0..unit.padded_len,
        "master" | "m" | "v" | "momentum" | "exp_avg" => held,
        "m8" | "v8" | "absmax_m" | "absmax_v" => {
            return Err(
                "8-bit Adam states are quantised per block of a shard and cannot be resharded; \
                        resume with the world size and stage that wrote the checkpoint"
                    .into(),
            );
        }
        vector => {
            let t = vector
                .strip_prefix('t')
                .and_then(|v| v.strip_suffix(".v"))
                .and_then(|i| unit.tensors.get(i.parse::<usize>().ok()?))
                .ok_or_else(|| format!("unknown state tensor {name}"))?
                .range();
            t.start.max(held.start)..t.end.min(held.end)
        }
    };
    Ok(Some((u, range)))
}

/// The range of a unit whose optimizer state this rank keeps and updates.
fn held_range(unit: &Unit, stage: ZeroStage, rank: usize) -> Range<usize> {
    if stage.shards_optimizer() {
        unit.shard_range(rank)
    } else {
        0..unit.padded_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::BatchLayout;
    use half::f16;
    use scheduler::spec::{JobSpec, Purpose};

    /// A single-rank stage-0 engine for `json` (seeded by `seed`) with micro-batch `b` of the
    /// spec's sequence length, and its data.
    fn engine<X: Float + Wire>(json: &str, b: usize, seed: u64) -> (Engine<X>, DataLoader) {
        let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
        let t = spec.training.seq_len.get() as usize;
        let setup = Setup::new(&spec, ZeroStage::Ddp, false, b as u32, 1);
        let shape = spec.architecture().gpt().copied().unwrap();
        let e = Engine::<X>::new(
            &setup,
            shape,
            seed,
            Communicator::solo(),
            Accountant::new(None),
        )
        .unwrap();
        let layout = BatchLayout {
            batch: b,
            seq_len: t,
            rank: 0,
            world_size: 1,
        };
        let data = DataLoader::new(&spec.data, layout, 1, shape.vocab_size).unwrap();
        (e, data)
    }

    /// Gradient elements that are zero in fp16 but not in fp32, after one micro-batch whose
    /// per-token loss gradient is multiplied by `scale`.
    fn underflowed(scale: f32) -> usize {
        let json = r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16"}}"#;
        let (mut half, mut d16) = engine::<f16>(json, 8, 1);
        let (mut full, mut d32) = engine::<f32>(json, 8, 1);
        let tokens = (half.dims.tokens()) as f32;
        d16.next_batch(&mut half.acts.inputs, &mut half.acts.targets)
            .unwrap();
        d32.next_batch(&mut full.acts.inputs, &mut full.acts.targets)
            .unwrap();
        half.micro_step(scale / tokens).unwrap();
        full.micro_step(1.0 / tokens).unwrap();
        let pairs = half.bufs.grads.iter().zip(&full.bufs.grads);
        pairs
            .map(|(h, f)| {
                h.iter()
                    .zip(f.iter())
                    .filter(|(h, f)| h.to_f32() == 0.0 && **f != 0.0)
                    .count()
            })
            .sum()
    }

    #[test]
    fn fp16_gradients_underflow_without_loss_scaling_and_survive_with_it() {
        let (unscaled, scaled) = (underflowed(1.0), underflowed(65536.0));
        // At scale 1 the smallest gradients of gpt2-tiny (below fp16's 6e-8) become 0.
        assert!(
            unscaled >= 20,
            "only {unscaled} gradients flushed to zero at scale 1"
        );
        assert_eq!(scaled, 0, "gradients still flushed to zero at scale 65536");
    }

    /// The loss of the same GPT in f64, from the kernels' plain reference implementations.
    fn reference_loss(
        units: &[Vec<f64>],
        shape: &GptShape,
        inputs: &[u32],
        targets: &[u32],
        d: Dims,
    ) -> f64 {
        use kernels::matmul::Layout::{KN, NK};
        use kernels::reference as r;
        let (n, c) = (d.tokens(), d.c);
        let [wte, wpe] = gpt::embeddings(&units[EMB], shape);
        let mut x = r::encoder_forward(inputs, wte, wpe, d.t, c);
        for l in 0..d.l {
            let p = Block::new(&units[l + 1][..], shape);
            let (ln1, _, _) = r::layernorm_forward(&x, p.ln1_w, p.ln1_b);
            let qkv = r::matmul_forward(&ln1, p.attn_w, Some(p.attn_b), KN, (n, c, 3 * c));
            let (atty, _) = r::attention_forward(&qkv, d.attention());
            let proj = r::matmul_forward(&atty, p.proj_w, Some(p.proj_b), KN, (n, c, c));
            let res2 = r::residual_forward(&x, &proj);
            let (ln2, _, _) = r::layernorm_forward(&res2, p.ln2_w, p.ln2_b);
            let fch = r::matmul_forward(&ln2, p.fc_w, Some(p.fc_b), KN, (n, c, 4 * c));
            let mlp = r::matmul_forward(
                &r::gelu_forward(&fch),
                p.fcproj_w,
                Some(p.fcproj_b),
                KN,
                (n, 4 * c, c),
            );
            x = r::residual_forward(&res2, &mlp);
        }
        let [w, b] = gpt::final_norm(&units[d.l + 1], shape);
        let (lnf, _, _) = r::layernorm_forward(&x, w, b);
        let logits = r::matmul_forward(&lnf, wte, None, NK, (n, c, d.v));
        r::crossentropy_forward(&logits, targets, d.v)
            .iter()
            .sum::<f64>()
            / n as f64
    }

    #[test]
    fn whole_model_gradients_agree_with_finite_differences_of_an_f64_reference() {
        let json = r#"{"model": {"vocab_size": 32, "context_length": 16, "n_layer": 2, "n_head": 2, "n_embd": 16},
                       "training": {"seq_len": 8}}"#;
        let (mut e, mut data) = engine::<f32>(json, 2, 3);
        let shape = e.shape;
        data.next_batch(&mut e.acts.inputs, &mut e.acts.targets)
            .unwrap();
        let loss = e.micro_step(1.0 / e.dims.tokens() as f32).unwrap();
        let mut params: Vec<Vec<f64>> = e
            .bufs
            .params
            .iter()
            .map(|p| p.iter().map(|&x| f64::from(x)).collect())
            .collect();
        let (inputs, targets) = (e.acts.inputs.to_vec(), e.acts.targets.to_vec());
        let reference = reference_loss(&params, &shape, &inputs, &targets, e.dims);
        assert!(
            (loss - reference).abs() < 1e-5,
            "f32 loss {loss} vs f64 reference {reference}"
        );
        let (mut checked, mut worst) = (0, 0f64);
        for (u, unit) in e.units.iter().enumerate() {
            for t in &unit.tensors {
                let r = t.range();
                for i in [r.start, (r.start + r.end) / 2, r.end - 1] {
                    let eps = 1e-5;
                    let keep = params[u][i];
                    params[u][i] = keep + eps;
                    let up = reference_loss(&params, &shape, &inputs, &targets, e.dims);
                    params[u][i] = keep - eps;
                    let down = reference_loss(&params, &shape, &inputs, &targets, e.dims);
                    params[u][i] = keep;
                    let fd = (up - down) / (2.0 * eps);
                    let analytic = f64::from(e.bufs.grads[u][i]);
                    let err = (analytic - fd).abs() / (analytic.abs().max(fd.abs()) + 1e-6);
                    worst = worst.max(err);
                    assert!(
                        err < 2e-4,
                        "{:?}[{}]: analytic {analytic:e} vs finite difference {fd:e}",
                        t.kind,
                        i - r.start
                    );
                    checked += 1;
                }
            }
        }
        eprintln!("{checked} gradients checked, worst relative error {worst:.1e}");
        assert_eq!(checked, 3 * (2 + 12 * 2 + 2));
    }
}
