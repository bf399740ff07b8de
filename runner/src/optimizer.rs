//! One rank's optimizer: its states over the part of each unit it updates (the whole unit at
//! stage 0, its shard otherwise), and the update dispatched to the kernels. Weight decay is
//! decoupled and applied first, to matrices only: in the update's own pass for the elementwise
//! optimizers, as a pass of its own for 8-bit Adam and Adafactor.

use std::ops::Range;

use kernels::optim as k;
use scheduler::memory::Category;
use scheduler::model::{ModelTensor, TensorDims, Unit};
use scheduler::spec::Optimizer;

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::comm::Communicator;
use crate::device::{Adam8bitState, Cpu, Device, Num};
use crate::state_tensor::StateTensor;
use safetensors::Dtype;

mod adafactor;

use adafactor::Adafactor;

/// What the optimizer updates in one unit: this rank's `held` range of it.
pub struct Slices<'a, X: 'a, D: Device = Cpu, K = ModelTensor> {
    pub unit: &'a Unit<K>,
    pub held: Range<usize>,
    /// fp32 master weights of `held` (the parameters themselves in fp32 training).
    pub master: D::ViewMut<'a, f32>,
    pub grads: D::View<'a, X>,
    /// The compute copy to refresh, in mixed precision.
    pub param_out: Option<D::ViewMut<'a, X>>,
}

/// Learning rate, step number (from 1) and the factor gradients are multiplied by.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub lr: f32,
    pub t: u64,
    pub grad_scale: f32,
}

pub struct OptimizerState<D: Device = Cpu> {
    spec: Optimizer,
    states: States<D>,
}

enum States<D: Device> {
    /// Optimizers whose states are elementwise: one per unit.
    Elementwise(Vec<UnitState<D>>),
    Adafactor(Adafactor<D>),
}

enum UnitState<D: Device> {
    Stateless,
    /// Momentum's buffer or Lion's m.
    One(Buffer<f32, D>),
    Adam {
        m: Buffer<f32, D>,
        v: Buffer<f32, D>,
    },
    Adam8bit {
        m: Buffer<u8, D>,
        v: Buffer<u8, D>,
        absmax_m: Buffer<f32, D>,
        absmax_v: Buffer<f32, D>,
    },
}

/// The tensors of `unit` intersecting `held`, with the intersection relative to the tensor.
fn pieces<'u, K>(
    unit: &'u Unit<K>,
    held: &Range<usize>,
) -> impl Iterator<Item = (usize, TensorDims, Range<usize>)> + 'u {
    let held = held.clone();
    unit.tensors.iter().enumerate().filter_map(move |(i, t)| {
        let r = t.range();
        let (start, end) = (r.start.max(held.start), r.end.min(held.end));
        (start < end).then(|| (i, t.dims, start - r.start..end - r.start))
    })
}

fn f32s<D: Device>(name: String, b: &mut Buffer<f32, D>) -> StateTensor<'_, D> {
    StateTensor {
        name,
        dtype: Dtype::F32,
        bytes: D::bytes_mut(b.view_mut()),
    }
}

impl<D: Device> OptimizerState<D> {
    pub fn new<K>(
        dev: &D,
        spec: Optimizer,
        held: &[(&Unit<K>, Range<usize>)],
        acct: &Accountant,
    ) -> Result<OptimizerState<D>, Error> {
        let f32s = |n: usize| acct.alloc_on::<D, f32>(dev, Category::Optimizer, n);
        let unit_state = |n: usize| {
            Ok(match spec {
                Optimizer::Sgd(_) => UnitState::Stateless,
                Optimizer::Momentum(_) | Optimizer::Lion(_) => UnitState::One(f32s(n)?),
                Optimizer::Adamw(_) => UnitState::Adam {
                    m: f32s(n)?,
                    v: f32s(n)?,
                },
                Optimizer::Adam8bit(a) => {
                    let blocks = k::adam8bit_blocks(n, a.block_size as usize);
                    UnitState::Adam8bit {
                        m: acct.alloc_on(dev, Category::Optimizer, n)?,
                        v: acct.alloc_on(dev, Category::Optimizer, n)?,
                        absmax_m: f32s(blocks)?,
                        absmax_v: f32s(blocks)?,
                    }
                }
                Optimizer::Adafactor(_) => unreachable!("Adafactor keeps its own state"),
            })
        };
        let states = match spec {
            Optimizer::Adafactor(a) => States::Adafactor(Adafactor::new(dev, a, held, acct)?),
            _ => States::Elementwise(
                held.iter()
                    .map(|(_, range)| unit_state(range.len()))
                    .collect::<Result<_, Error>>()?,
            ),
        };
        Ok(OptimizerState { spec, states })
    }

    /// Every state buffer, named for checkpoints (Adafactor's reduction buffers are scratch).
    pub fn state(&mut self) -> Vec<StateTensor<'_, D>> {
        let mut out = Vec::new();
        let units = match &mut self.states {
            States::Adafactor(a) => {
                a.state(&mut out);
                return out;
            }
            States::Elementwise(units) => units,
        };
        for (u, state) in units.iter_mut().enumerate() {
            match state {
                UnitState::Stateless => {}
                UnitState::One(b) => out.push(f32s(format!("u{u}.momentum"), b)),
                UnitState::Adam { m, v } => {
                    out.push(f32s(format!("u{u}.m"), m));
                    out.push(f32s(format!("u{u}.v"), v));
                }
                UnitState::Adam8bit {
                    m,
                    v,
                    absmax_m,
                    absmax_v,
                } => {
                    out.push(StateTensor {
                        name: format!("u{u}.m8"),
                        dtype: Dtype::U8,
                        bytes: m.view_mut(),
                    });
                    out.push(StateTensor {
                        name: format!("u{u}.v8"),
                        dtype: Dtype::U8,
                        bytes: v.view_mut(),
                    });
                    out.push(f32s(format!("u{u}.absmax_m"), absmax_m));
                    out.push(f32s(format!("u{u}.absmax_v"), absmax_v));
                }
            }
        }
        out
    }

    /// Applies one update to every unit's held range. `shards` holds the other ranks when the
    /// held ranges are shards: Adafactor sums its statistics over every shard through it.
    pub fn step<X: Num, K>(
        &mut self,
        dev: &D,
        slices: &mut [Slices<'_, X, D, K>],
        s: Step,
        shards: Option<&mut Communicator>,
    ) -> Result<(), Error> {
        let decay = 1.0 - s.lr * self.spec.weight_decay() as f32;
        let units = match &mut self.states {
            States::Elementwise(units) => units,
            States::Adafactor(a) => {
                decay_matrices(dev, slices, decay)?;
                return a.step(dev, slices, s, shards);
            }
        };
        for (state, sl) in units.iter_mut().zip(slices.iter_mut()) {
            let runs = if matches!(state, UnitState::Adam8bit { .. }) {
                // Its blocks count from the held range's start: one call over the range,
                // decayed first.
                decay_matrices(dev, std::slice::from_mut(sl), decay)?;
                vec![(0..sl.held.len(), 1.0)]
            } else {
                decay_runs(sl.unit, &sl.held, decay)
            };
            // One call per run of equal decay, which the update applies in its own pass.
            for (r, decay) in runs {
                let p = D::slice_mut(D::reborrow(&mut sl.master), r.clone());
                let g = D::slice(D::share(&sl.grads), r.clone());
                let out = sl
                    .param_out
                    .as_mut()
                    .map(|o| D::slice_mut(D::reborrow(o), r.clone()));
                let gs = s.grad_scale;
                match (&mut *state, self.spec) {
                    (UnitState::Stateless, _) => dev.sgd_step(p, g, out, s.lr, gs, decay)?,
                    (UnitState::One(buf), Optimizer::Momentum(m)) => {
                        let hp = k::Momentum {
                            lr: s.lr,
                            momentum: m.momentum as f32,
                            nesterov: m.nesterov,
                        };
                        let buf = D::slice_mut(buf.view_mut(), r);
                        dev.momentum_step(p, g, buf, out, &hp, gs, decay)?
                    }
                    (UnitState::One(m), Optimizer::Lion(l)) => {
                        let hp = k::Lion {
                            lr: s.lr,
                            beta1: l.betas[0] as f32,
                            beta2: l.betas[1] as f32,
                        };
                        let m = D::slice_mut(m.view_mut(), r);
                        dev.lion_step(p, g, m, out, &hp, gs, decay)?
                    }
                    (UnitState::Adam { m, v }, Optimizer::Adamw(a)) => {
                        let hp = adam_hp(s.lr, a.betas, a.eps);
                        let m = D::slice_mut(m.view_mut(), r.clone());
                        let v = D::slice_mut(v.view_mut(), r);
                        dev.adamw_step(p, g, m, v, out, &hp, s.t, gs, decay)?
                    }
                    (
                        UnitState::Adam8bit {
                            m,
                            v,
                            absmax_m,
                            absmax_v,
                        },
                        Optimizer::Adam8bit(a),
                    ) => {
                        let hp = adam_hp(s.lr, a.betas, a.eps);
                        let state = Adam8bitState {
                            m: m.view_mut(),
                            v: v.view_mut(),
                            absmax_m: absmax_m.view_mut(),
                            absmax_v: absmax_v.view_mut(),
                        };
                        let block = a.block_size as usize;
                        dev.adam8bit_step(p, g, state, out, &hp, s.t, gs, block)?
                    }
                    _ => unreachable!("optimizer state is built for its spec"),
                }
            }
        }
        Ok(())
    }
}

/// `master *= decay` over the matrices of each slice's held range, as its own pass (for the
/// updates that do not take a decay factor: 8-bit Adam's blocks, Adafactor).
fn decay_matrices<X, D: Device, K>(
    dev: &D,
    slices: &mut [Slices<'_, X, D, K>],
    decay: f32,
) -> Result<(), Error> {
    for sl in slices.iter_mut() {
        for (r, factor) in decay_runs(sl.unit, &sl.held, decay) {
            if factor != 1.0 {
                dev.decay(D::slice_mut(D::reborrow(&mut sl.master), r), factor)?;
            }
        }
    }
    Ok(())
}

/// `held`, relative to its start, cut into runs of one decay factor each: `decay` over the
/// matrices, 1 elsewhere (vectors, and any gap between tensors). One run when `decay` is 1.
fn decay_runs<K>(unit: &Unit<K>, held: &Range<usize>, decay: f32) -> Vec<(Range<usize>, f32)> {
    let mut runs: Vec<(Range<usize>, f32)> = Vec::new();
    let mut push = |r: Range<usize>, f: f32| match runs.last_mut() {
        _ if r.is_empty() => {}
        Some((last, lf)) if *lf == f && last.end == r.start => last.end = r.end,
        _ => runs.push((r, f)),
    };
    let mut at = 0;
    for (i, dims, r) in pieces(unit, held) {
        if matches!(dims, TensorDims::Matrix(..)) {
            let start = unit.tensors[i].offset + r.start - held.start;
            push(at..start, 1.0);
            push(start..start + r.len(), decay);
            at = start + r.len();
        }
    }
    push(at..held.len(), 1.0);
    runs
}

fn adam_hp(lr: f32, betas: [f64; 2], eps: f64) -> k::AdamW {
    k::AdamW {
        lr,
        beta1: betas[0] as f32,
        beta2: betas[1] as f32,
        eps: eps as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scheduler::spec::{JobSpec, Purpose};

    /// Every element of every shard of every unit gets the decay of its tensor's kind (padding
    /// none), in runs that tile the shard and change factor at each boundary.
    #[test]
    fn decay_runs_cover_matrices_only() {
        let json = r#"{"model": {"preset": "llama-tiny"}}"#;
        let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
        let model = spec.architecture().model().unwrap();
        let units = model.units(3);
        for unit in units.iter() {
            let matrix = |i: usize| {
                unit.tensors
                    .iter()
                    .any(|t| t.range().contains(&i) && matches!(t.dims, TensorDims::Matrix(..)))
            };
            for rank in 0..3 {
                let held = unit.shard_range(rank);
                let runs = decay_runs(unit, &held, 0.5);
                assert_eq!(runs.first().unwrap().0.start, 0);
                assert_eq!(runs.last().unwrap().0.end, held.len());
                for w in runs.windows(2) {
                    assert_eq!(w[0].0.end, w[1].0.start, "runs tile the shard");
                    assert_ne!(w[0].1, w[1].1, "neighbouring runs differ");
                }
                for (r, f) in runs {
                    for i in r {
                        let want = if matrix(held.start + i) { 0.5 } else { 1.0 };
                        assert_eq!(f, want, "{:?} rank {rank} element {i}", unit.kind);
                    }
                }
                assert_eq!(decay_runs(unit, &held, 1.0).len(), 1);
            }
        }
    }
}
