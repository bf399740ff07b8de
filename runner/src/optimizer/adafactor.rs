//! Adafactor over this rank's held ranges: a full second moment for vectors and the first
//! moment (optional) over the held elements, and for every matrix the factored row and column
//! statistics, which every rank keeps whole and keeps equal by all-reducing exact sums.

use std::ops::Range;

use kernels::optim::{self as k, LIMBS};
use scheduler::memory::Category;
use scheduler::model::{TensorDims, Unit};
use scheduler::spec::AdaFactor;

use super::{Slices, Step, f32s, pieces};
use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::comm::Communicator;
use crate::device::{Device, Moment, Num};
use crate::state_tensor::StateTensor;

pub(super) struct Adafactor<D: Device> {
    hp: AdaFactor,
    units: Vec<Moments<D>>,
    factored: Factored<D>,
}

/// One unit's moments over its held range.
struct Moments<D: Device> {
    /// Full second moments of the vector tensors' held elements, keyed by the tensor's index in
    /// its unit.
    vectors: Vec<(usize, Buffer<f32, D>)>,
    exp_avg: Option<Buffer<f32, D>>,
}

/// The statistics of every matrix (all ranks keep all of them) and the exact sums the ranks
/// all-reduce each step.
struct Factored<D: Device> {
    /// Per matrix, in unit and tensor order: row EMA then column EMA.
    stats: Vec<(Buffer<f32, D>, Buffer<f32, D>)>,
    sums: Buffer<f64, D>,
    rms: Buffer<f64, D>,
}

impl<D: Device> Adafactor<D> {
    pub(super) fn new<K>(
        dev: &D,
        hp: AdaFactor,
        held: &[(&Unit<K>, Range<usize>)],
        acct: &Accountant,
    ) -> Result<Adafactor<D>, Error> {
        let f32s = |n: usize| acct.alloc_on::<D, f32>(dev, Category::Optimizer, n);
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
            sums: acct.alloc_on(dev, Category::Optimizer, LIMBS * factored)?,
            rms: acct.alloc_on(dev, Category::Optimizer, LIMBS * tensors)?,
        };
        Ok(Adafactor {
            hp,
            units,
            factored,
        })
    }

    /// The moments and statistics, named for checkpoints (the reduction buffers are scratch).
    pub(super) fn state<'a>(&'a mut self, out: &mut Vec<StateTensor<'a, D>>) {
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

    pub(super) fn step<X: Num, K>(
        &mut self,
        dev: &D,
        slices: &mut [Slices<'_, X, D, K>],
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
        phases(
            dev,
            &mut self.units,
            &mut self.factored,
            slices,
            &hp,
            s,
            shards,
        )
    }
}

/// The phases across every held range: exact row/column sums of g² (all-reduced over the
/// `shards`, when the ranges are shards); the statistics' EMAs; exact per-tensor sums of
/// squared updates (all-reduced likewise); the update.
fn phases<X: Num, D: Device, K>(
    dev: &D,
    units: &mut [Moments<D>],
    f: &mut Factored<D>,
    slices: &mut [Slices<'_, X, D, K>],
    hp: &k::Adafactor,
    s: Step,
    mut shards: Option<&mut Communicator>,
) -> Result<(), Error> {
    let gs = s.grad_scale;
    dev.fill_zero(f.sums.view_mut())?;
    dev.fill_zero(f.rms.view_mut())?;
    walk(units, f, slices, |p| match p {
        Piece::Matrix {
            grad,
            start,
            rows,
            sums,
            ..
        } => {
            let (rs, cs) = D::split_at_mut(sums, rows * LIMBS);
            dev.adafactor_sq_sums(grad, start, gs, hp, rs, cs)
        }
        Piece::Vector { .. } => Ok(()),
    })?;
    if let Some(comm) = shards.as_deref_mut() {
        dev.on_host(f.sums.view_mut(), |sums| comm.all_reduce(sums))??;
    }
    {
        let mut sums = f.sums.view();
        for (row, col) in f.stats.iter_mut() {
            let (mine, rest) = D::split_at(sums, (row.len() + col.len()) * LIMBS);
            let (rs, cs) = D::split_at(mine, row.len() * LIMBS);
            dev.adafactor_update_stats(row.view_mut(), col.view_mut(), rs, cs, hp, s.t)?;
            sums = rest;
        }
    }
    walk(units, f, slices, |p| match p {
        Piece::Matrix {
            grad,
            row,
            col,
            start,
            rms,
            ..
        } => dev.adafactor_rms_sum(grad, gs, Moment::Factored { row, col, start }, rms),
        Piece::Vector { grad, v, rms, .. } => dev.adafactor_vector_ema(v, grad, gs, hp, s.t, rms),
    })?;
    if let Some(comm) = shards {
        dev.on_host(f.rms.view_mut(), |rms| comm.all_reduce(rms))??;
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
            dev.adafactor_apply(master, grad, exp_avg, out, moment, D::freeze(rms), hp, gs)
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
            let moment = Moment::Full {
                v: D::freeze(v),
                numel,
            };
            dev.adafactor_apply(master, grad, exp_avg, out, moment, D::freeze(rms), hp, gs)
        }
    })
}

/// The held part of one tensor, with everything an Adafactor phase may need.
enum Piece<'a, X: 'a, D: Device> {
    Matrix {
        master: D::ViewMut<'a, f32>,
        grad: D::View<'a, X>,
        out: Option<D::ViewMut<'a, X>>,
        exp_avg: Option<D::ViewMut<'a, f32>>,
        row: D::View<'a, f32>,
        col: D::View<'a, f32>,
        /// Offset of the piece within the matrix.
        start: usize,
        rows: usize,
        /// The matrix's exact row then column sums.
        sums: D::ViewMut<'a, f64>,
        rms: D::ViewMut<'a, f64>,
    },
    Vector {
        master: D::ViewMut<'a, f32>,
        grad: D::View<'a, X>,
        out: Option<D::ViewMut<'a, X>>,
        exp_avg: Option<D::ViewMut<'a, f32>>,
        v: D::ViewMut<'a, f32>,
        numel: usize,
        rms: D::ViewMut<'a, f64>,
    },
}

/// Visits the held piece of every tensor, in unit and tensor order (the order the flat
/// statistics and sums are laid out in).
fn walk<X: Num, D: Device, K>(
    units: &mut [Moments<D>],
    f: &mut Factored<D>,
    slices: &mut [Slices<'_, X, D, K>],
    mut visit: impl FnMut(Piece<'_, X, D>) -> Result<(), Error>,
) -> Result<(), Error> {
    let mut rms = Some(f.rms.view_mut());
    let mut stats = f.stats.iter();
    let mut sums = Some(f.sums.view_mut());
    for (state, sl) in units.iter_mut().zip(slices.iter_mut()) {
        let Moments { vectors, exp_avg } = state;
        let mut vectors = vectors.iter_mut();
        let mut rest = Rest::<X, D> {
            at: sl.held.start,
            master: Some(D::reborrow(&mut sl.master)),
            grad: Some(D::reborrow_ref(&sl.grads)),
            out: sl.param_out.as_mut().map(D::reborrow),
            exp_avg: exp_avg.as_mut().map(Buffer::view_mut),
        };
        for t in &sl.unit.tensors {
            let rms = cut::<D, _>(&mut rms, 0, LIMBS);
            let r = t.range();
            let (start, end) = (r.start.max(sl.held.start), r.end.min(sl.held.end));
            match t.dims {
                TensorDims::Matrix(rows, cols) => {
                    let (row, col) = stats.next().expect("statistics per matrix");
                    let mine = cut::<D, _>(&mut sums, 0, (rows + cols) * LIMBS);
                    if start < end {
                        let (master, grad, out, exp_avg) = rest.take(start, end);
                        visit(Piece::Matrix {
                            master,
                            grad,
                            out,
                            exp_avg,
                            row: row.view(),
                            col: col.view(),
                            start: start - r.start,
                            rows,
                            sums: mine,
                            rms,
                        })?;
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
                            v: v.view_mut(),
                            numel,
                            rms,
                        })?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Elements `[skip, skip + n)` of what is left of `s`, which keeps what follows them.
fn cut<'a, D: Device, T: 'a>(
    s: &mut Option<D::ViewMut<'a, T>>,
    skip: usize,
    n: usize,
) -> D::ViewMut<'a, T> {
    let (_, v) = D::split_at_mut(s.take().expect("a view left"), skip);
    let (mine, tail) = D::split_at_mut(v, n);
    *s = Some(tail);
    mine
}

/// What is left of a unit's held slices, from element `at` of the unit on.
struct Rest<'a, X: 'a, D: Device> {
    at: usize,
    master: Option<D::ViewMut<'a, f32>>,
    grad: Option<D::View<'a, X>>,
    out: Option<D::ViewMut<'a, X>>,
    exp_avg: Option<D::ViewMut<'a, f32>>,
}

type Taken<'a, X, D> = (
    <D as Device>::ViewMut<'a, f32>,
    <D as Device>::View<'a, X>,
    Option<<D as Device>::ViewMut<'a, X>>,
    Option<<D as Device>::ViewMut<'a, f32>>,
);

impl<'a, X: 'a, D: Device> Rest<'a, X, D> {
    /// Elements `[start, end)` of the unit (`start ≥ at`).
    fn take(&mut self, start: usize, end: usize) -> Taken<'a, X, D> {
        let (skip, n) = (start - self.at, end - start);
        self.at = end;
        let (_, grad) = D::split_at(self.grad.take().expect("a view left"), skip);
        let (grad, tail) = D::split_at(grad, n);
        self.grad = Some(tail);
        let out = self
            .out
            .is_some()
            .then(|| cut::<D, _>(&mut self.out, skip, n));
        let exp_avg = self
            .exp_avg
            .is_some()
            .then(|| cut::<D, _>(&mut self.exp_avg, skip, n));
        (cut::<D, _>(&mut self.master, skip, n), grad, out, exp_avg)
    }
}
