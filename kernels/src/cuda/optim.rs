//! Fused optimizer updates on the GPU, with the semantics of `crate::optim`: fp32 master
//! weights and states, gradients of dtype `G` times `grad_scale`, and when `param_out` is given
//! the rounded compute copy of the new master, `decay` multiplying master first in the same pass.
//! Buffers are a whole tensor or a ZeRO shard.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig};

use super::device::{THREADS, elementwise, input_ptr, launch, optional_ptr};
use super::{DeviceFloat, Error, Gpu};
use crate::optim::{Adafactor, AdamW, LIMBS, Lion, Momentum, bias_correction, dynamic_map};

fn name<G: DeviceFloat, X: DeviceFloat>(kernel: &str) -> String {
    format!("{kernel}_{}_{}", G::NAME, X::NAME)
}

fn check_out<X>(out: &Option<&mut CudaViewMut<'_, X>>, n: usize) {
    if let Some(p) = out {
        assert_eq!(p.len(), n, "param_out must match master");
    }
}

/// Decoupled weight decay: `master *= factor`.
pub fn decay(dev: &Gpu, master: &mut CudaViewMut<'_, f32>, factor: f32) -> Result<(), Error> {
    let n = master.len() as i64;
    let cfg = elementwise(master.len());
    launch!(dev, "optim.cu", "decay", cfg; master, &factor, &n);
    Ok(())
}

/// Plain SGD: `p = p·decay - lr·g`.
pub fn sgd_step<G: DeviceFloat, X: DeviceFloat>(
    dev: &Gpu,
    master: &mut CudaViewMut<'_, f32>,
    grad: &CudaView<'_, G>,
    mut param_out: Option<&mut CudaViewMut<'_, X>>,
    lr: f32,
    grad_scale: f32,
    decay: f32,
) -> Result<(), Error> {
    let len = master.len();
    assert_eq!(grad.len(), len, "grad must match master");
    check_out(&param_out, len);
    let (n, cfg) = (len as i64, elementwise(len));
    let (out, _sync) = optional_ptr(&mut param_out, dev.stream());
    launch!(dev, "optim.cu", name::<G, X>("sgd_step"), cfg;
        master, grad, &out, &n, &lr, &grad_scale, &decay);
    Ok(())
}

/// SGD with momentum (PyTorch semantics, dampening 0).
#[allow(clippy::too_many_arguments)]
pub fn momentum_step<G: DeviceFloat, X: DeviceFloat>(
    dev: &Gpu,
    master: &mut CudaViewMut<'_, f32>,
    grad: &CudaView<'_, G>,
    buf: &mut CudaViewMut<'_, f32>,
    mut param_out: Option<&mut CudaViewMut<'_, X>>,
    hp: &Momentum,
    grad_scale: f32,
    decay: f32,
) -> Result<(), Error> {
    let len = master.len();
    assert!(
        grad.len() == len && buf.len() == len,
        "grad and buf must match master"
    );
    check_out(&param_out, len);
    let (n, cfg, nesterov) = (len as i64, elementwise(len), hp.nesterov as i32);
    let (out, _sync) = optional_ptr(&mut param_out, dev.stream());
    launch!(dev, "optim.cu", name::<G, X>("momentum_step"), cfg;
        master, grad, buf, &out, &n, &hp.lr, &hp.momentum, &nesterov, &grad_scale, &decay);
    Ok(())
}

/// AdamW step `t ≥ 1`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step<G: DeviceFloat, X: DeviceFloat>(
    dev: &Gpu,
    master: &mut CudaViewMut<'_, f32>,
    grad: &CudaView<'_, G>,
    m: &mut CudaViewMut<'_, f32>,
    v: &mut CudaViewMut<'_, f32>,
    mut param_out: Option<&mut CudaViewMut<'_, X>>,
    hp: &AdamW,
    step: u64,
    grad_scale: f32,
    decay: f32,
) -> Result<(), Error> {
    let len = master.len();
    assert!(
        grad.len() == len && m.len() == len && v.len() == len,
        "grad, m, v must match master"
    );
    check_out(&param_out, len);
    let (step_size, bc2_sqrt) = bias_correction(hp.lr, hp.beta1, hp.beta2, step);
    let (n, cfg) = (len as i64, elementwise(len));
    let (out, _sync) = optional_ptr(&mut param_out, dev.stream());
    launch!(dev, "optim.cu", name::<G, X>("adamw_step"), cfg;
        master, grad, m, v, &out, &n, &hp.beta1, &hp.beta2, &hp.eps, &step_size, &bc2_sqrt,
        &grad_scale, &decay);
    Ok(())
}

/// Lion: `p = p·decay - lr·sign(β1·m + (1-β1)·g)`, then `m = β2·m + (1-β2)·g`.
#[allow(clippy::too_many_arguments)]
pub fn lion_step<G: DeviceFloat, X: DeviceFloat>(
    dev: &Gpu,
    master: &mut CudaViewMut<'_, f32>,
    grad: &CudaView<'_, G>,
    m: &mut CudaViewMut<'_, f32>,
    mut param_out: Option<&mut CudaViewMut<'_, X>>,
    hp: &Lion,
    grad_scale: f32,
    decay: f32,
) -> Result<(), Error> {
    let len = master.len();
    assert!(
        grad.len() == len && m.len() == len,
        "grad and m must match master"
    );
    check_out(&param_out, len);
    let (n, cfg) = (len as i64, elementwise(len));
    let (out, _sync) = optional_ptr(&mut param_out, dev.stream());
    launch!(dev, "optim.cu", name::<G, X>("lion_step"), cfg;
        master, grad, m, &out, &n, &hp.lr, &hp.beta1, &hp.beta2, &grad_scale, &decay);
    Ok(())
}

/// The signed and unsigned dynamic quantisation maps of 8-bit Adam, uploaded once.
pub struct Adam8bitCodes {
    signed: CudaSlice<f32>,
    unsigned: CudaSlice<f32>,
}

impl Adam8bitCodes {
    pub fn new(dev: &Gpu) -> Result<Self, Error> {
        Ok(Self {
            signed: dev.upload(&dynamic_map(true))?,
            unsigned: dev.upload(&dynamic_map(false))?,
        })
    }
}

/// One 8-bit Adam step (`crate::optim::adam8bit_step`): one CUDA block per quantisation block.
#[allow(clippy::too_many_arguments)]
pub fn adam8bit_step<G: DeviceFloat, X: DeviceFloat>(
    dev: &Gpu,
    master: &mut CudaViewMut<'_, f32>,
    grad: &CudaView<'_, G>,
    m: &mut CudaViewMut<'_, u8>,
    v: &mut CudaViewMut<'_, u8>,
    absmax_m: &mut CudaViewMut<'_, f32>,
    absmax_v: &mut CudaViewMut<'_, f32>,
    mut param_out: Option<&mut CudaViewMut<'_, X>>,
    codes: &Adam8bitCodes,
    hp: &AdamW,
    step: u64,
    grad_scale: f32,
    block: usize,
) -> Result<(), Error> {
    let len = master.len();
    assert!(block > 0, "block size must be positive");
    assert!(
        grad.len() == len && m.len() == len && v.len() == len,
        "grad, m, v must match master"
    );
    let blocks = len.div_ceil(block);
    assert!(
        absmax_m.len() == blocks && absmax_v.len() == blocks,
        "absmax must hold one f32 per block"
    );
    check_out(&param_out, len);
    let (step_size, bc2_sqrt) = bias_correction(hp.lr, hp.beta1, hp.beta2, step);
    let (eps_hat, step_size) = (hp.eps * bc2_sqrt, step_size * bc2_sqrt);
    let (n, bl) = (len as i64, block as i64);
    let cfg = adam8bit_config(len, block);
    let (out, _sync) = optional_ptr(&mut param_out, dev.stream());
    launch!(dev, "adam8bit.cu", name::<G, X>("adam8bit_step"), cfg;
        master, grad, m, v, absmax_m, absmax_v, &out, &codes.signed, &codes.unsigned, &n, &bl,
        &hp.beta1, &hp.beta2, &eps_hat, &step_size, &grad_scale);
    Ok(())
}

/// The launch of `adam8bit_step` over `n` elements: a block of `THREADS` per quantisation
/// block of `block` elements.
pub fn adam8bit_config(n: usize, block: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (u32::try_from(n.div_ceil(block)).unwrap_or(u32::MAX), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Adafactor phase 1 (matrix): add the exact row and column sums of `g² + eps1` over
/// `[start, start + grad.len())` of a `(rows, cols)` matrix to `row_sums (rows · LIMBS)`,
/// `col_sums (cols · LIMBS)` (f64 atomics on integer-valued limbs: exact, so deterministic).
pub fn adafactor_sq_sums<G: DeviceFloat>(
    dev: &Gpu,
    grad: &CudaView<'_, G>,
    start: usize,
    grad_scale: f32,
    hp: &Adafactor,
    row_sums: &mut CudaViewMut<'_, f64>,
    col_sums: &mut CudaViewMut<'_, f64>,
) -> Result<(), Error> {
    let (rows, cols) = (row_sums.len() / LIMBS, col_sums.len() / LIMBS);
    assert!(
        start + grad.len() <= rows * cols,
        "range outside the matrix"
    );
    assert!(
        rows.max(cols) < 1 << 29,
        "exact sums hold at most 2^29 terms"
    );
    let (st, n, cl) = (start as i64, grad.len() as i64, cols as i64);
    let cfg = elementwise(grad.len());
    launch!(dev, "adafactor.cu", format!("adafactor_sq_sums_{}", G::NAME), cfg;
        grad, &st, &n, &cl, &grad_scale, &hp.eps1, row_sums, col_sums);
    Ok(())
}

/// Adafactor phase 2 (matrix): the row and column EMAs from the all-reduced sums.
pub fn adafactor_update_stats(
    dev: &Gpu,
    row: &mut CudaViewMut<'_, f32>,
    col: &mut CudaViewMut<'_, f32>,
    row_sums: &CudaView<'_, f64>,
    col_sums: &CudaView<'_, f64>,
    hp: &Adafactor,
    step: u64,
) -> Result<(), Error> {
    let (rows, cols) = (row.len(), col.len());
    assert!(
        row_sums.len() == rows * LIMBS && col_sums.len() == cols * LIMBS,
        "sums must hold LIMBS per row/col"
    );
    let b = hp.beta2t(step);
    let (nr, nc, fr, fc) = (rows as i64, cols as i64, cols as f32, rows as f32);
    launch!(dev, "adafactor.cu", "adafactor_update_stats", elementwise(rows); row, row_sums, &nr, &fr, &b);
    launch!(dev, "adafactor.cu", "adafactor_update_stats", elementwise(cols); col, col_sums, &nc, &fc, &b);
    Ok(())
}

/// Adafactor phase 1 (vector): `v = β2t·v + (1-β2t)·(g² + eps1)`, adding the exact `Σ u²` to
/// `rms_sum (LIMBS)`.
pub fn adafactor_vector_ema<G: DeviceFloat>(
    dev: &Gpu,
    v: &mut CudaViewMut<'_, f32>,
    grad: &CudaView<'_, G>,
    grad_scale: f32,
    hp: &Adafactor,
    step: u64,
    rms_sum: &mut CudaViewMut<'_, f64>,
) -> Result<(), Error> {
    assert_eq!(rms_sum.len(), LIMBS, "rms_sum holds LIMBS limbs");
    assert_eq!(v.len(), grad.len(), "v must match grad");
    let (b, n) = (hp.beta2t(step), grad.len() as i64);
    let cfg = elementwise(grad.len());
    launch!(dev, "adafactor.cu", format!("adafactor_vector_ema_{}", G::NAME), cfg;
        v, grad, &n, &grad_scale, &hp.eps1, &b, rms_sum);
    Ok(())
}

/// The second-moment statistics an Adafactor update is scaled by (`crate::optim::Moment`).
pub enum Moment<'a> {
    /// Row and column EMAs of a matrix; `row_mean` is scratch of one f32; the range starts at
    /// element `start`.
    Factored {
        row: &'a CudaView<'a, f32>,
        col: &'a CudaView<'a, f32>,
        row_mean: &'a mut CudaViewMut<'a, f32>,
        start: usize,
    },
    /// The range's slice of a vector's EMA; `numel` is the whole vector's length.
    Full {
        v: &'a CudaView<'a, f32>,
        numel: usize,
    },
}

/// `mean(row)` into `row_mean`, summed in the CPU's order (16 lanes, then pairwise).
fn row_mean(
    dev: &Gpu,
    row_mean: &mut CudaViewMut<'_, f32>,
    row: &CudaView<'_, f32>,
) -> Result<(), Error> {
    assert_eq!(row_mean.len(), 1, "row_mean is one f32");
    let rows = row.len() as i64;
    launch!(dev, "adafactor.cu", "adafactor_row_mean", row_mean_config(); row_mean, row, &rows);
    Ok(())
}

/// The launch of `adafactor_row_mean`: one block of 16 threads (the CPU's 16 lanes).
pub fn row_mean_config() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (16, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Adafactor phase 3 (matrix): add the exact `Σ u²` over the range to `rms_sum (LIMBS)`.
#[allow(clippy::too_many_arguments)]
pub fn adafactor_rms_sum<G: DeviceFloat>(
    dev: &Gpu,
    grad: &CudaView<'_, G>,
    grad_scale: f32,
    row: &CudaView<'_, f32>,
    col: &CudaView<'_, f32>,
    row_mean_scratch: &mut CudaViewMut<'_, f32>,
    start: usize,
    rms_sum: &mut CudaViewMut<'_, f64>,
) -> Result<(), Error> {
    assert_eq!(rms_sum.len(), LIMBS, "rms_sum holds LIMBS limbs");
    assert!(
        start + grad.len() <= row.len() * col.len(),
        "range outside the matrix"
    );
    row_mean(dev, row_mean_scratch, row)?;
    let (st, n, cl) = (start as i64, grad.len() as i64, col.len() as i64);
    let cfg = elementwise(grad.len());
    let mean = row_mean_scratch.as_view();
    launch!(dev, "adafactor.cu", format!("adafactor_rms_sum_{}", G::NAME), cfg;
        grad, &st, &n, &cl, &grad_scale, row, col, &mean, rms_sum);
    Ok(())
}

/// Adafactor's last phase: the clipped update, through the first moment when `beta1` is set,
/// subtracted from `master`; `rms_sum` is the all-reduced `Σ u²`.
#[allow(clippy::too_many_arguments)]
pub fn adafactor_apply<G: DeviceFloat, X: DeviceFloat>(
    dev: &Gpu,
    master: &mut CudaViewMut<'_, f32>,
    grad: &CudaView<'_, G>,
    mut exp_avg: Option<&mut CudaViewMut<'_, f32>>,
    mut param_out: Option<&mut CudaViewMut<'_, X>>,
    moment: Moment<'_>,
    rms_sum: &CudaView<'_, f64>,
    hp: &Adafactor,
    grad_scale: f32,
) -> Result<(), Error> {
    let len = master.len();
    assert_eq!(grad.len(), len, "grad must match master");
    assert_eq!(
        exp_avg.is_some(),
        hp.beta1.is_some(),
        "exp_avg must be given exactly when beta1 is set"
    );
    check_out(&param_out, len);
    let (numel, start, cols, row, col, mean, v) = match moment {
        Moment::Factored {
            row,
            col,
            row_mean: mean,
            start,
        } => {
            assert!(
                start + len <= row.len() * col.len(),
                "range outside the matrix"
            );
            row_mean(dev, mean, row)?;
            (
                row.len() * col.len(),
                start,
                col.len(),
                Some(row),
                Some(col),
                Some(&*mean),
                None,
            )
        }
        Moment::Full { v, numel } => {
            assert_eq!(v.len(), len, "v must cover the range");
            (numel, 0, 1, None, None, None, Some(v))
        }
    };
    let s = dev.stream();
    let ((row, _r), (col, _c)) = (input_ptr(row, s), input_ptr(col, s));
    let ((mean, _m), (v, _v)) = (input_ptr(mean, s), input_ptr(v, s));
    let (exp_avg, _sync_m) = optional_ptr(&mut exp_avg, dev.stream());
    let (out, _sync_out) = optional_ptr(&mut param_out, dev.stream());
    let (st, n, cl, fnumel, b1) = (
        start as i64,
        len as i64,
        cols as i64,
        numel as f32,
        hp.beta1.unwrap_or(0.0),
    );
    let cfg = elementwise(len);
    launch!(dev, "adafactor.cu", name::<G, X>("adafactor_apply"), cfg;
        master, grad, &exp_avg, &out, &st, &n, &cl, &row, &col, &mean, &v, rms_sum, &fnumel,
        &hp.lr, &hp.clip_threshold, &b1, &grad_scale);
    Ok(())
}
