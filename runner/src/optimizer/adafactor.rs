//! Adafactor over this rank's held ranges: a full second moment for vectors and the first
//! moment (optional) over the held elements, and for every matrix the factored row and column
//! statistics, which every rank keeps whole and keeps equal by all-reducing exact sums.

use std::ops::Range;

use kernels::Float;
use kernels::optim::{self as k, LIMBS, Moment};
use scheduler::memory::Category;
use scheduler::model::{TensorDims, Unit};
use scheduler::spec::AdaFactor;

use super::{Slices, Step, f32s, pieces};
use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::checkpoint::StateTensor;
use crate::comm::Communicator;

pub(super) struct Adafactor {
    hp: AdaFactor,
    units: Vec<Moments>,
    factored: Factored,
}

/// One unit's moments over its held range.
struct Moments {
    /// Full second moments of the vector tensors' held elements, keyed by the tensor's index in
    /// its unit.
    vectors: Vec<(usize, Buffer<f32>)>,
    exp_avg: Option<Buffer<f32>>,
}

/// The statistics of every matrix (all ranks keep all of them) and the exact sums the ranks
/// all-reduce each step.
struct Factored {
    /// Per matrix, in unit and tensor order: row EMA then column EMA.
    stats: Vec<(Buffer<f32>, Buffer<f32>)>,
    sums: Buffer<f64>,
    rms: Buffer<f64>,
}

impl Adafactor {
    pub(super) fn new(
        hp: AdaFactor,
        held: &[(&Unit, Range<usize>)],
        acct: &Accountant,
    ) -> Result<Adafactor, Error> {
        let f32s = |n: usize| acct.alloc::<f32>(Category::Optimizer, n);
        let units = held
            .iter()
            .map(|(unit, range)| {
                Ok(Moments {
                    vectors: pieces(unit, range)
                        .filter(|(_, dims, _)| matches!(dims, TensorDims::Vector(_)))
                        .map(|(i, _, r)| Ok::<_, Error>((i, f32s(r.len())?)))
                        .collect::<Result<_, _>>()?,
                    exp_avg: hp.beta1.map(|_| f32s(range.len())).transpose()?,
                })
            })
            .collect::<Result<_, Error>>()?;
        let matrices: Vec<(usize, usize)> = held
            .iter()
            .flat_map(|(u, _)| &u.tensors)
            .filter_map(|t| match t.dims {
                TensorDims::Matrix(r, c) => Some((r, c)),
                TensorDims::Vector(_) => None,
            })
            .collect();
        let factored: usize = matrices.iter().map(|(r, c)| r + c).sum();
        let tensors = held.iter().map(|(u, _)| u.tensors.len()).sum::<usize>();
        let factored = Factored {
            stats: matrices
                .iter()
                .map(|&(r, c)| Ok((f32s(r)?, f32s(c)?)))
                .collect::<Result<_, Error>>()?,
            sums: acct.alloc(Category::Optimizer, LIMBS * factored)?,
            rms: acct.alloc(Category::Optimizer, LIMBS * tensors)?,
        };
        Ok(Adafactor {
            hp,
            units,
            factored,
        })
    }

    /// The moments and statistics, named for checkpoints (the reduction buffers are scratch).
    pub(super) fn state<'a>(&'a mut self, out: &mut Vec<StateTensor<'a>>) {
        for (u, m) in self.units.iter_mut().enumerate() {
            for (i, v) in m.vectors.iter_mut() {
                out.push(f32s(format!("u{u}.t{i}.v"), v));
            }
            if let Some(e) = &mut m.exp_avg {
                out.push(f32s(format!("u{u}.exp_avg"), e));
            }
        }
        for (i, (row, col)) in self.factored.stats.iter_mut().enumerate() {
            out.push(f32s(format!("adafactor.row{i}"), row));
            out.push(f32s(format!("adafactor.col{i}"), col));
        }
    }

    pub(super) fn step<X: Float>(
        &mut self,
        slices: &mut [Slices<'_, X>],
        s: Step,
        shards: Option<&mut Communicator>,
    ) -> Result<(), Error> {
        let a = self.hp;
        let hp = k::Adafactor {
            lr: s.lr,
            eps1: a.eps as f32,
            clip_threshold: a.clip_threshold as f32,
            decay_rate: a.decay_rate as f32,
            beta1: a.beta1.map(|b| b as f32),
        };
        phases(&mut self.units, &mut self.factored, slices, &hp, s, shards)
    }
}

/// The phases across every held range: exact row/column sums of g² (all-reduced over the
/// `shards`, when the ranges are shards); the statistics' EMAs; exact per-tensor sums of
/// squared updates (all-reduced likewise); the update.
fn phases<X: Float>(
    units: &mut [Moments],
    f: &mut Factored,
    slices: &mut [Slices<'_, X>],
    hp: &k::Adafactor,
    s: Step,
    mut shards: Option<&mut Communicator>,
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
    if let Some(comm) = shards.as_deref_mut() {
        comm.all_reduce(&mut f.sums)?;
    }
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
    if let Some(comm) = shards {
        comm.all_reduce(&mut f.rms)?;
    }
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
    units: &mut [Moments],
    f: &mut Factored,
    slices: &mut [Slices<'_, X>],
    mut visit: impl FnMut(Piece<'_, X>),
) {
    let mut rms = f.rms.chunks_mut(LIMBS);
    let mut stats = f.stats.iter();
    let mut sums: &mut [f64] = &mut f.sums;
    for (state, sl) in units.iter_mut().zip(slices.iter_mut()) {
        let Moments { vectors, exp_avg } = state;
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
                TensorDims::Matrix(rows, cols) => {
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
                TensorDims::Vector(numel) => {
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
