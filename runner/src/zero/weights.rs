//! Setting and reading the model's weights: each family's initialisation, Hugging Face
//! weights, and the fp32 values the export writes.

use std::ops::Range;

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand_distr::{Distribution, Normal, Uniform};
use scheduler::model::{ModelShape, ModelTensor, TensorInit, Unit};

use super::layout::Part;
use super::{Engine, Frozen, Held, Trainable, Trained};
use crate::Error;
use crate::accounting::Buffer;
use crate::checkpoint::{HfWeights, ModelFile};
use crate::comm::{Collective, DeviceCollectives, Summable};
use crate::device::Num;

impl<X: Num + Summable, D: DeviceCollectives> Engine<X, D> {
    /// Sets every parameter of the model (LoRA's frozen base) from Hugging Face weights,
    /// keeping this rank's part: each unit's values stream from the file a chunk at a time.
    pub fn load_weights(&mut self, weights: &HfWeights) -> Result<(), Error> {
        let Some(f) = &mut self.frozen else {
            let t = &mut self.trained;
            return load(&self.dev, &mut t.held, t.master.as_mut(), weights);
        };
        for (ui, unit) in self.model.units(self.comm.world_size()).iter().enumerate() {
            let mut values = weights.unit(ui);
            f.write_unit(&self.dev, unit, ui, |_| values.next().unwrap_or(0.0))?;
            values.result()?;
        }
        Ok(())
    }

    /// Sets a LoRA job's adapters from a PEFT adapter's weights (`checkpoint::load_peft`).
    pub fn load_adapters(&mut self, weights: &HfWeights) -> Result<(), Error> {
        debug_assert!(self.frozen.is_some(), "adapters are trained in LoRA jobs");
        let t = &mut self.trained;
        load(&self.dev, &mut t.held, t.master.as_mut(), weights)
    }

    /// Writes each unit's fp32 weights (the master copy in mixed precision) into `file`, which
    /// rank 0 holds (the others pass `None`). Sharded units are gathered piece by piece through
    /// the logits buffer, dead once training is over, so the export holds no byte the memory
    /// model does not already count.
    pub fn export(&mut self, file: Option<&ModelFile>) -> Result<(), Error> {
        let Engine {
            dev,
            trained,
            passes,
            comm,
            ..
        } = self;
        let Trained {
            held:
                Held {
                    units,
                    layout,
                    params,
                    ..
                },
            master,
            ..
        } = trained;
        let logits = &mut passes.batch().logits;
        let (n, rank) = (comm.world_size(), comm.rank());
        let part = if master.is_some() {
            Part::State
        } else {
            Part::Params
        };
        let piece = logits.len() / n;
        if layout.sharded(part) && piece == 0 {
            return Err(Error::Untrainable {
                reason: format!(
                    "the logits buffer is too small to gather the model through ({n} ranks)"
                ),
            });
        }
        for (u, unit) in units.iter().enumerate() {
            let weights = match master {
                Some(m) => m[u].view_mut(),
                None => D::as_f32_mut(params[u].view_mut())
                    .expect("without master weights the parameters are fp32"),
            };
            if !layout.sharded(part) {
                if let Some(file) = file {
                    dev.on_host(weights, |w| file.write(u, 0, &w[..unit.len]))??;
                }
                continue;
            }
            let weights = D::freeze(weights);
            let shard = layout.held(part, u).len();
            // A piece is no longer than a shard: the ring's scratch holds one shard's chunk.
            let piece = piece.min(shard);
            for start in (0..shard).step_by(piece) {
                let len = piece.min(shard - start);
                let mut pieces = logits.at_mut(0..n * piece);
                dev.copy(
                    D::slice_mut(D::reborrow(&mut pieces), rank * piece..rank * piece + len),
                    D::slice(D::reborrow_ref(&weights), start..start + len),
                )?;
                dev.collective(comm, Collective::AllGather, D::reborrow(&mut pieces))?;
                let Some(file) = file else { continue };
                dev.on_host(pieces, |p| {
                    (0..n).try_for_each(|r| {
                        let at = r * shard + start;
                        let len = len.min(unit.len.saturating_sub(at));
                        file.write(u, at, &p[r * piece..r * piece + len])
                    })
                })??;
            }
        }
        Ok(())
    }

    /// The family's initialisation (`ModelTensor::init`), and PEFT's for adapters
    /// (`AdapterTensor::init`). Each tensor draws from its own stream keyed by the seed, the
    /// unit, the tensor and its set (the model's or the adapters'), so the values do not
    /// depend on how units are sharded.
    pub(super) fn init_weights(&mut self, seed: u64) -> Result<(), Error> {
        let model = self.model;
        let t = &mut self.trained;
        for (ui, unit) in t.held.units.clone().iter().enumerate() {
            for (ti, p) in unit.tensors.iter().enumerate() {
                let (set, init) = match p.kind {
                    Trainable::Model(k) => (0, k.init(&model)),
                    Trainable::Adapter(k) => (1, k.init(&model)),
                };
                let master = t.master.as_mut().map(|m| &mut m[ui]);
                let next = values(init, [seed, ui as u64, ti as u64, set]);
                write_tensor(&self.dev, &mut t.held, master, ui, p.range(), next)?;
            }
        }
        let Some(f) = &mut self.frozen else {
            return Ok(());
        };
        for (ui, unit) in model.units(self.comm.world_size()).iter().enumerate() {
            let mut streams: Vec<_> = (unit.tensors.iter().enumerate())
                .map(|(ti, p)| seeded_values(&model, p.kind, seed, ui, ti))
                .collect();
            f.write_unit(&self.dev, unit, ui, |ti| streams[ti]())?;
        }
        Ok(())
    }
}

impl<X: Num + Summable, D: DeviceCollectives> Frozen<X, D> {
    /// Sets the model's unit `ui` (`unit`, as the model lays it out), `next(ti)` giving the
    /// next value of its `ti`-th tensor: into the base's unit, or, for an NF4 weight, through
    /// the dequantization scratch quantized into its block's NF4 unit.
    fn write_unit(
        &mut self,
        dev: &D,
        unit: &Unit<ModelTensor>,
        ui: usize,
        mut next: impl FnMut(usize) -> f32,
    ) -> Result<(), Error> {
        for (ti, t) in unit.tensors.iter().enumerate() {
            let value = || next(ti);
            if self.lora.in_base(t.kind) {
                let base = self
                    .base
                    .units
                    .iter()
                    .nth(ui)
                    .expect("the base has the model's units");
                let held = base.tensors.iter().find(|b| b.kind == t.kind);
                let range = held.expect("the base holds what is not NF4").range();
                write_tensor(dev, &mut self.base, None, ui, range, value)?;
                continue;
            }
            let (l, nf4) = (unit.layer(), self.nf4.as_mut());
            let (Some(l), Some(nf4)) = (l, nf4) else {
                unreachable!("NF4 weights are blocks' projections, with NF4 units");
            };
            self.lora.quantize(dev, t.kind, nf4.whole_mut(l), value)?;
            nf4.keep(dev, l)?;
        }
        Ok(())
    }
}

/// Sets every unit of `held` (and its master weights, given) from `weights`, unit by unit.
fn load<X: Num + Summable, D: DeviceCollectives, K>(
    dev: &D,
    held: &mut Held<X, D, K>,
    mut master: Option<&mut Vec<Buffer<f32, D>>>,
    weights: &HfWeights,
) -> Result<(), Error> {
    for ui in 0..held.params.len() {
        let mut values = weights.unit(ui);
        let len = held.unit_len(ui);
        let m = master.as_mut().map(|m| &mut m[ui]);
        write_tensor(dev, held, m, ui, 0..len, || values.next().unwrap_or(0.0))?;
        values.result()?;
    }
    Ok(())
}

/// The values the family's initialisation gives tensor `ti` (of kind `kind`) of the model's
/// unit `ui` from `seed`: what [`Engine::init_weights`] draws for it.
pub(crate) fn seeded_values(
    model: &ModelShape,
    kind: ModelTensor,
    seed: u64,
    ui: usize,
    ti: usize,
) -> Box<dyn FnMut() -> f32> {
    values(kind.init(model), [seed, ui as u64, ti as u64, 0])
}

/// The values of an initialisation, drawn from the stream `key` names.
fn values(init: TensorInit, key: [u64; 4]) -> Box<dyn FnMut() -> f32> {
    let mut bytes = [0u8; 32];
    for (chunk, k) in bytes.chunks_exact_mut(8).zip(key) {
        chunk.copy_from_slice(&k.to_le_bytes());
    }
    let mut rng = ChaCha8Rng::from_seed(bytes);
    match init {
        TensorInit::Ones => Box::new(|| 1.0),
        TensorInit::Zeros => Box::new(|| 0.0),
        TensorInit::Normal { std } => {
            let normal = Normal::new(0.0, std).expect("a positive standard deviation");
            Box::new(move || normal.sample(&mut rng) as f32)
        }
        TensorInit::Uniform { bound } => {
            let uniform = Uniform::new(-bound, bound).expect("a positive bound");
            Box::new(move || uniform.sample(&mut rng) as f32)
        }
    }
}

/// Writes the values `next` yields for elements `range` of unit `ui` into this rank's
/// parameters and master weights (`master`, the unit's), wherever they hold them.
fn write_tensor<X: Num, D: DeviceCollectives, K>(
    dev: &D,
    held: &mut Held<X, D, K>,
    master: Option<&mut Buffer<f32, D>>,
    ui: usize,
    range: Range<usize>,
    mut next: impl FnMut() -> f32,
) -> Result<(), Error> {
    // Of each buffer, only the part `range` writes goes to the host and back: `at`, the unit's
    // elements there, and where they lie in the buffer, which holds the unit's `held` ones.
    let within = |held: Range<usize>| {
        let start = range.start.clamp(held.start, held.end);
        let at = start..range.end.clamp(start, held.end);
        let local = at.start - held.start..at.end - held.start;
        (at, local)
    };
    let (params_at, p) = within(held.layout.held(Part::Params, ui));
    let (master_at, m) = within(held.layout.held(Part::State, ui));
    dev.on_host(held.params[ui].at_mut(p), |params| {
        let write = |master: &mut [f32]| {
            for i in range {
                let v = next();
                if params_at.contains(&i) {
                    params[i - params_at.start] = X::from_f32(v);
                }
                if !master.is_empty() && master_at.contains(&i) {
                    master[i - master_at.start] = v;
                }
            }
        };
        match master {
            Some(b) => dev.on_host(b.at_mut(m), write),
            None => {
                write(&mut []);
                Ok(())
            }
        }
    })?
}
