//! One rank's optimizer: its states over the part of each unit it updates (the whole unit at
//! stage 0, its shard otherwise), and the update dispatched to the kernels. Weight decay is
//! decoupled and applied first, to matrices only.

use std::ops::Range;

use kernels::Float;
use kernels::optim as k;
use scheduler::memory::Category;
use scheduler::model::{TensorDims, Unit};
use scheduler::spec::Optimizer;

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::checkpoint::StateTensor;
use crate::comm::Communicator;
use safetensors::Dtype;

mod adafactor;

use adafactor::Adafactor;

/// What the optimizer updates in one unit: this rank's `held` range of it.
pub struct Slices<'a, X> {
    pub unit: &'a Unit,
    pub held: Range<usize>,
    /// fp32 master weights of `held` (the parameters themselves in fp32 training).
    pub master: &'a mut [f32],
    pub grads: &'a [X],
    /// The compute copy to refresh, in mixed precision.
    pub param_out: Option<&'a mut [X]>,
}

/// Learning rate, step number (from 1) and the factor gradients are multiplied by.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub lr: f32,
    pub t: u64,
    pub grad_scale: f32,
}

pub struct OptimizerState {
    spec: Optimizer,
    states: States,
}

enum States {
    /// Optimizers whose states are elementwise: one per unit.
    Elementwise(Vec<UnitState>),
    Adafactor(Adafactor),
}

enum UnitState {
    Stateless,
    /// Momentum's buffer or Lion's m.
    One(Buffer<f32>),
    Adam {
        m: Buffer<f32>,
        v: Buffer<f32>,
    },
    Adam8bit {
        m: Buffer<u8>,
        v: Buffer<u8>,
        absmax_m: Buffer<f32>,
        absmax_v: Buffer<f32>,
    },
}

/// The tensors of `unit` intersecting `held`, with the intersection relative to the tensor.
fn pieces<'u>(
    unit: &'u Unit,
    held: &Range<usize>,
) -> impl Iterator<Item = (usize, TensorDims, Range<usize>)> + 'u {
    let held = held.clone();
    unit.tensors.iter().enumerate().filter_map(move |(i, t)| {
        let r = t.range();
        let (start, end) = (r.start.max(held.start), r.end.min(held.end));
        (start < end).then(|| (i, t.dims, start - r.start..end - r.start))
    })
}

fn f32s(name: String, b: &mut Buffer<f32>) -> StateTensor<'_> {
    StateTensor {
        name,
        dtype: Dtype::F32,
        bytes: bytemuck::cast_slice_mut(&mut b[..]),
    }
}

impl OptimizerState {
    pub fn new(
        spec: Optimizer,
        held: &[(&Unit, Range<usize>)],
        acct: &Accountant,
    ) -> Result<OptimizerState, Error> {
        let f32s = |n: usize| acct.alloc::<f32>(Category::Optimizer, n);
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
                        m: acct.alloc(Category::Optimizer, n)?,
                        v: acct.alloc(Category::Optimizer, n)?,
                        absmax_m: f32s(blocks)?,
                        absmax_v: f32s(blocks)?,
                    }
                }
                Optimizer::Adafactor(_) => unreachable!("Adafactor keeps its own state"),
            })
        };
        let states = match spec {
            Optimizer::Adafactor(a) => States::Adafactor(Adafactor::new(a, held, acct)?),
            _ => States::Elementwise(
                held.iter()
                    .map(|(_, range)| unit_state(range.len()))
                    .collect::<Result<_, Error>>()?,
            ),
        };
        Ok(OptimizerState { spec, states })
    }

    /// Every state buffer, named for checkpoints (Adafactor's reduction buffers are scratch).
    pub fn state(&mut self) -> Vec<StateTensor<'_>> {
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
                        bytes: &mut m[..],
                    });
                    out.push(StateTensor {
                        name: format!("u{u}.v8"),
                        dtype: Dtype::U8,
                        bytes: &mut v[..],
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
    pub fn step<X: Float>(
        &mut self,
        slices: &mut [Slices<'_, X>],
        s: Step,
        shards: Option<&mut Communicator>,
    ) -> Result<(), Error> {
        let wd = self.spec.weight_decay() as f32;
        if wd > 0.0 {
            for sl in slices.iter_mut() {
                for (i, dims, r) in pieces(sl.unit, &sl.held) {
                    if matches!(dims, TensorDims::Matrix(..)) {
                        let at = sl.unit.tensors[i].offset + r.start - sl.held.start;
                        k::decay(&mut sl.master[at..at + r.len()], 1.0 - s.lr * wd);
                    }
                }
            }
        }
        let units = match &mut self.states {
            States::Adafactor(a) => return a.step(slices, s, shards),
            States::Elementwise(units) => units,
        };
        for (state, sl) in units.iter_mut().zip(slices.iter_mut()) {
            let (p, g, out) = (&mut *sl.master, sl.grads, sl.param_out.as_deref_mut());
            match (state, self.spec) {
                (UnitState::Stateless, _) => k::sgd_step(p, g, out, s.lr, s.grad_scale),
                (UnitState::One(buf), Optimizer::Momentum(m)) => {
                    let hp = k::Momentum {
                        lr: s.lr,
                        momentum: m.momentum as f32,
                        nesterov: m.nesterov,
                    };
                    k::momentum_step(p, g, buf, out, &hp, s.grad_scale)
                }
                (UnitState::One(m), Optimizer::Lion(l)) => {
                    let hp = k::Lion {
                        lr: s.lr,
                        beta1: l.betas[0] as f32,
                        beta2: l.betas[1] as f32,
                    };
                    k::lion_step(p, g, m, out, &hp, s.grad_scale)
                }
                (UnitState::Adam { m, v }, Optimizer::Adamw(a)) => {
                    let hp = adam_hp(s.lr, a.betas, a.eps);
                    k::adamw_step(p, g, m, v, out, &hp, s.t, s.grad_scale)
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
                    let block = a.block_size as usize;
                    k::adam8bit_step(
                        p,
                        g,
                        m,
                        v,
                        absmax_m,
                        absmax_v,
                        out,
                        &hp,
                        s.t,
                        s.grad_scale,
                        block,
                    )
                }
                _ => unreachable!("optimizer state is built for its spec"),
            }
        }
        Ok(())
    }
}

fn adam_hp(lr: f32, betas: [f64; 2], eps: f64) -> k::AdamW {
    k::AdamW {
        lr,
        beta1: betas[0] as f32,
        beta2: betas[1] as f32,
        eps: eps as f32,
    }
}
