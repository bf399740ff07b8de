//! One rank's optimizer: its states over the part of each unit it updates (the whole unit at
//! stage 0, its shard otherwise), and the update dispatched to the kernels. Weight decay is
//! decoupled and applied first, to matrices only.

use std::ops::Range;

use kernels::Float;
use kernels::optim::{self as k, LIMBS, Moment};
use scheduler::memory::Category;
use scheduler::model::{Dims, Unit};
use scheduler::spec::Optimizer;

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::checkpoint::StateTensor;
use crate::comm::Communicator;
use safetensors::Dtype;

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
    units: Vec<UnitState>,
    adafactor: Option<Factored>,
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
    /// Full second moments of the vector tensors' held elements, and the first moment.
    Adafactor {
        /// Keyed by the tensor's index in its unit.
        vectors: Vec<(usize, Buffer<f32>)>,
        exp_avg: Option<Buffer<f32>>,
    },
}

/// Adafactor's statistics of every matrix (all ranks keep all of them) and the exact sums
/// the ranks all-reduce each step.
struct Factored {
    /// Per matrix, in unit and tensor order: row EMA then column EMA.
    stats: Vec<(Buffer<f32>, Buffer<f32>)>,
    sums: Buffer<f64>,
    rms: Buffer<f64>,
}

/// The tensors of `unit` intersecting `held`, with the intersection relative to the tensor.
fn pieces<'u>(
    unit: &'u Unit,
    held: &Range<usize>,
) -> impl Iterator<Item = (usize, Dims, Range<usize>)> + 'u {
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
        let units = held
            .iter()
            .map(|(unit, range)| {
                let n = range.len();
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
                    Optimizer::Adafactor(a) => UnitState::Adafactor {
                        vectors: pieces(unit, range)
                            .filter(|(_, dims, _)| matches!(dims, Dims::Vector(_)))
                            .map(|(i, _, r)| Ok::<_, Error>((i, f32s(r.len())?)))
                            .collect::<Result<_, _>>()?,
                        exp_avg: a.beta1.map(|_| f32s(n)).transpose()?,
                    },
                })
            })
            .collect::<Result<_, Error>>()?;
        let adafactor = match spec {
            Optimizer::Adafactor(_) => {
                let matrices: Vec<(usize, usize)> = held
                    .iter()
                    .flat_map(|(u, _)| &u.tensors)
                    .filter_map(|t| match t.dims {
                        Dims::Matrix(r, c) => Some((r, c)),
                        Dims::Vector(_) => None,
                    })
                    .collect();
                let factored: usize = matrices.iter().map(|(r, c)| r + c).sum();
                let tensors = held.iter().map(|(u, _)| u.tensors.len()).sum::<usize>();
                Some(Factored {
                    stats: matrices
                        .iter()
                        .map(|&(r, c)| Ok((f32s(r)?, f32s(c)?)))
                        .collect::<Result<_, Error>>()?,
                    sums: acct.alloc(Category::Optimizer, LIMBS * factored)?,
                    rms: acct.alloc(Category::Optimizer, LIMBS * tensors)?,
                })
            }
            _ => None,
        };
        Ok(OptimizerState {
            spec,
            units,
            adafactor,
        })
    }

    /// Every state buffer, named for checkpoints (Adafactor's reduction buffers are scratch).
    pub fn state(&mut self) -> Vec<StateTensor<'_>> {
        let mut out = Vec::new();
        for (u, state) in self.units.iter_mut().enumerate() {
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
                UnitState::Adafactor { vectors, exp_avg } => {
                    for (i, v) in vectors.iter_mut() {
                        out.push(f32s(format!("u{u}.t{i}.v"), v));
                    }
                    if let Some(e) = exp_avg {
                        out.push(f32s(format!("u{u}.exp_avg"), e));
                    }
                }
            }
        }
        if let Some(f) = &mut self.adafactor {
            for (i, (row, col)) in f.stats.iter_mut().enumerate() {
                out.push(f32s(format!("adafactor.row{i}"), row));
                out.push(f32s(format!("adafactor.col{i}"), col));
            }
        }
        out
    }

    /// Applies one update to every unit's held range.
    pub fn step<X: Float>(
        &mut self,
        slices: &mut [Slices<'_, X>],
        s: Step,
        comm: &mut Communicator,
    ) -> Result<(), Error> {
        let wd = self.spec.weight_decay() as f32;
        if wd > 0.0 {
            for sl in slices.iter_mut() {
                for t in sl
                    .unit
                    .tensors
                    .iter()
                    .filter(|t| matches!(t.dims, Dims::Matrix(..)))
                {
                    let r = t.range();
                    let (start, end) = (r.start.max(sl.held.start), r.end.min(sl.held.end));
                    if start < end {
                        let local = start - sl.held.start..end - sl.held.start;
                        k::decay(&mut sl.master[local], 1.0 - s.lr * wd);
                    }
                }
            }
        }
        if let Optimizer::Adafactor(a) = self.spec {
            let hp = k::Adafactor {
                lr: s.lr,
                eps1: a.eps as f32,
                clip_threshold: a.clip_threshold as f32,
                decay_rate: a.decay_rate as f32,
                beta1: a.beta1.map(|b| b as f32),
            };
            let factored = self.adafactor.as_mut().expect("Adafactor state");
            return adafactor(&mut self.units, factored, slices, &hp, s, comm);
        }
        for (state, sl) in self.units.iter_mut().zip(slices.iter_mut()) {
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

/// Adafactor's phases across every held range: exact row/column sums of g², all-reduced; the
/// statistics' EMAs; exact per-tensor sums of squared updates, all-reduced; the update.
fn adafactor<X: Float>(
    units: &mut [UnitState],
    f: &mut Factored,
    slices: &mut [Slices<'_, X>],
    hp: &k::Adafactor,
    s: Step,
    comm: &mut Communicator,
) -> Result<(), Error> {
    let gs = s.grad_scale;
    f.sums.fill(0.0);
    f.rms.fill(0.0);
    walk(units, f, slices, |p| {
        if let Piece::Matrix {
            grad,
            start,
            rows,
            sums,
            ..
        } = p
        {
            let (rs, cs) = sums.split_at_mut(rows * LIMBS);
            k::adafactor_sq_sums(grad, start, gs, hp, rs, cs);
        }
    });
    comm.all_reduce(&mut f.sums)?;
    let mut sums: &[f64] = &f.sums;
    for (row, col) in f.stats.iter_mut() {
        let (mine, rest) = sums.split_at((row.len() + col.len()) * LIMBS);
        let (rs, cs) = mine.split_at(row.len() * LIMBS);
        k::adafactor_update_stats(row, col, rs, cs, hp, s.t);
        sums = rest;
    }
    walk(units, f, slices, |p| match p {
        Piece::Matrix {
            grad,
            row,
            col,
            start,
            rms,
            ..
        } => k::adafactor_rms_sum(grad, gs, Moment::Factored { row, col, start }, rms),
        Piece::Vector { grad, v, rms, .. } => k::adafactor_vector_ema(v, grad, gs, hp, s.t, rms),
    });
    comm.all_reduce(&mut f.rms)?;
    walk(units, f, slices, |p| match p {
        Piece::Matrix {
            master,
            grad,
            out,
            exp_avg,
            row,
            col,
            start,
            rms,
            ..
        } => {
            let moment = Moment::Factored { row, col, start };
            k::adafactor_apply(master, grad, exp_avg, out, moment, rms, hp, gs)
        }
        Piece::Vector {
            master,
            grad,
            out,
            exp_avg,
            v,
            numel,
            rms,
        } => {
            let moment = Moment::Full { v, numel };
            k::adafactor_apply(master, grad, exp_avg, out, moment, rms, hp, gs)
        }
    });
    Ok(())
}

/// The held part of one tensor, with everything an Adafactor phase may need.
enum Piece<'a, X> {
    Matrix {
        master: &'a mut [f32],
        grad: &'a [X],
        out: Option<&'a mut [X]>,
        exp_avg: Option<&'a mut [f32]>,
        row: &'a [f32],
        col: &'a [f32],
        /// Offset of the piece within the matrix.
        start: usize,
        rows: usize,
        /// The matrix's exact row then column sums.
        sums: &'a mut [f64],
        rms: &'a mut [f64],
    },
    Vector {
        master: &'a mut [f32],
        grad: &'a [X],
        out: Option<&'a mut [X]>,
        exp_avg: Option<&'a mut [f32]>,
        v: &'a mut [f32],
        numel: usize,
        rms: &'a mut [f64],
    },
}

/// Visits the held piece of every tensor, in unit and tensor order (the order the flat
/// statistics and sums are laid out in).
fn walk<X: Float>(
    units: &mut [UnitState],
    f: &mut Factored,
    slices: &mut [Slices<'_, X>],
    mut visit: impl FnMut(Piece<'_, X>),
) {
    let mut rms = f.rms.chunks_mut(LIMBS);
    let mut stats = f.stats.iter();
    let mut sums: &mut [f64] = &mut f.sums;
    for (state, sl) in units.iter_mut().zip(slices.iter_mut()) {
        let UnitState::Adafactor { vectors, exp_avg } = state else {
            unreachable!("Adafactor state")
        };
        let mut vectors = vectors.iter_mut();
        let mut rest = Rest {
            at: sl.held.start,
            master: &mut *sl.master,
            grad: sl.grads,
            out: sl.param_out.as_deref_mut(),
            exp_avg: exp_avg.as_deref_mut(),
        };
        for t in &sl.unit.tensors {
            let rms = rms.next().expect("one rms sum per tensor");
            let r = t.range();
            let (start, end) = (r.start.max(sl.held.start), r.end.min(sl.held.end));
            match t.dims {
                Dims::Matrix(rows, cols) => {
                    let (row, col) = stats.next().expect("statistics per matrix");
                    let (mine, tail) =
                        std::mem::take(&mut sums).split_at_mut((rows + cols) * LIMBS);
                    sums = tail;
                    if start < end {
                        let (master, grad, out, exp_avg) = rest.take(start, end);
                        visit(Piece::Matrix {
                            master,
                            grad,
                            out,
                            exp_avg,
                            row,
                            col,
                            start: start - r.start,
                            rows,
                            sums: mine,
                            rms,
                        });
                    }
                }
                Dims::Vector(numel) => {
                    if start < end {
                        let (_, v) = vectors.next().expect("a moment per held vector");
                        let (master, grad, out, exp_avg) = rest.take(start, end);
                        visit(Piece::Vector {
                            master,
                            grad,
                            out,
                            exp_avg,
                            v,
                            numel,
                            rms,
                        });
                    }
                }
            }
        }
    }
}

/// What is left of a unit's held slices, from element `at` of the unit on.
struct Rest<'a, X> {
    at: usize,
    master: &'a mut [f32],
    grad: &'a [X],
    out: Option<&'a mut [X]>,
    exp_avg: Option<&'a mut [f32]>,
}

type Taken<'a, X> = (
    &'a mut [f32],
    &'a [X],
    Option<&'a mut [X]>,
    Option<&'a mut [f32]>,
);

impl<'a, X> Rest<'a, X> {
    /// Elements `[start, end)` of the unit (`start ≥ at`).
    fn take(&mut self, start: usize, end: usize) -> Taken<'a, X> {
        let (skip, n) = (start - self.at, end - start);
        self.at = end;
        fn cut<'b, T>(s: &mut &'b mut [T], skip: usize, n: usize) -> &'b mut [T] {
            let (mine, tail) = std::mem::take(s)[skip..].split_at_mut(n);
            *s = tail;
            mine
        }
        let (grad, tail) = self.grad[skip..].split_at(n);
        self.grad = tail;
        (
            cut(&mut self.master, skip, n),
            grad,
            self.out.as_mut().map(|o| cut(o, skip, n)),
            self.exp_avg.as_mut().map(|e| cut(e, skip, n)),
        )
    }
}
