//! A training run in this process: plan the spec, build the engine in its dtype, run the
//! steps, report progress, and summarise the run with measured and predicted memory.

use std::path::Path;
use std::time::Instant;

use half::{bf16, f16};
use kernels::Float;
use scheduler::inventory::Inventory;
use scheduler::memory::{self, Breakdown, DeviceKind, Setup};
use scheduler::plan;
use scheduler::spec::{Architecture, Dtype, JobSpec};
use serde::Serialize;

use crate::Error;
use crate::accounting::Accountant;
use crate::checkpoint::{self, Manifest};
use crate::comm::Communicator;
use crate::data::{BatchLayout, DataLoader};
use crate::loss_scale::LossScaler;
use crate::schedule;
use crate::zero::Engine;

/// How a run is hosted.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Each rank's device budget; the plan must fit it and the accountant enforces it.
    pub device_memory: Option<u64>,
    /// Kernel threads (default: all cores).
    pub threads: Option<usize>,
    /// Where checkpoints and the final Hugging Face export go (none: nothing is written).
    pub out_dir: Option<std::path::PathBuf>,
}

/// One finished step, as progress displays show it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Progress {
    pub step: u32,
    pub steps: u32,
    pub loss: f64,
    pub loss_scale: f32,
    pub tokens_per_second: f64,
    pub skipped: bool,
}

/// Bytes one rank held at its peak, by category, next to the memory model's prediction.
#[derive(Debug, Clone, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub measured_peak_bytes: Breakdown,
    pub predicted_bytes: Breakdown,
}

/// What `zerotrain train --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub steps: u32,
    pub final_loss: f64,
    pub losses: Vec<f64>,
    pub tokens_per_second: f64,
    pub step_seconds_median: f64,
    pub skipped_steps: u64,
    pub loss_scale: f32,
    /// The checkpoint step this run resumed from, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<u32>,
    pub ranks: Vec<RankMemory>,
}

/// Trains `spec` to completion, calling `progress` after every step.
pub fn run(
    spec: &JobSpec,
    opts: &Options,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Summary, Error> {
    let Architecture::Gpt(shape) = spec.architecture() else {
        return Err(Error::Untrainable {
            reason: "a bare parameter count has no architecture to train".into(),
        });
    };
    let world = spec.world_size.get() as usize;
    if world > 1 {
        return Err(Error::Untrainable {
            reason: format!(
                "world_size {world}: multi-rank collectives are not built yet; use world_size 1"
            ),
        });
    }
    let budget = opts.device_memory.unwrap_or(u64::MAX);
    let inventory = Inventory::uniform(world, budget, DeviceKind::Cpu);
    let plan = plan::plan(spec, &inventory)?;
    let setup = plan.chosen.setup;
    let threads = opts
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let pool = kernels::cpu::thread_pool(threads).map_err(|e| Error::Untrainable {
        reason: format!("thread pool: {e}"),
    })?;
    pool.install(|| {
        kernels::cpu::flush_denormals();
        match spec.precision.dtype {
            Dtype::Fp32 => train::<f32>(spec, &setup, shape, opts, progress),
            Dtype::Fp16 => train::<f16>(spec, &setup, shape, opts, progress),
            Dtype::Bf16 => train::<bf16>(spec, &setup, shape, opts, progress),
        }
    })
}

fn train<X: Float + bytemuck::Pod>(
    spec: &JobSpec,
    setup: &Setup,
    shape: scheduler::model::GptShape,
    opts: &Options,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Summary, Error> {
    let t = &spec.training;
    let comm = Communicator::solo();
    let rank = comm.rank();
    let acct = Accountant::new(opts.device_memory);
    let mut engine = Engine::<X>::new(setup, shape, t.seed, comm, acct.clone())?;
    let layout = BatchLayout {
        batch: setup.micro_batch,
        seq_len: setup.seq_len,
        rank,
        world_size: setup.world_size,
    };
    let mut data = DataLoader::new(&spec.data, layout, t.seed, shape.vocab_size)?;
    let mut scaler = LossScaler::new(spec.precision.effective_loss_scale());
    let tokens_per_step = (engine.dims().tokens() * setup.grad_accum * setup.world_size) as f64;
    let mut losses = Vec::with_capacity(t.steps.get() as usize);
    let out = opts.out_dir.as_deref();
    let resume = match out {
        Some(out) => checkpoint::latest(out)?,
        None => None,
    };
    let resumed_from = match resume {
        Some(dir) => {
            let m = checkpoint::load_manifest(&dir)?;
            let this = (
                setup.world_size,
                setup.stage.index(),
                spec.precision.dtype,
                spec.optimizer.name(),
            );
            if (m.world_size, m.zero_stage, m.dtype, m.optimizer.as_str()) != this {
                return Err(Error::Checkpoint {
                    path: dir,
                    reason: format!(
                        "written by world_size {}, stage {}, {:?}, {}; this run is world_size {}, stage {}, {:?}, {}",
                        m.world_size,
                        m.zero_stage,
                        m.dtype,
                        m.optimizer,
                        this.0,
                        this.1,
                        this.2,
                        this.3
                    ),
                });
            }
            checkpoint::load_rank(&dir, rank, &mut engine.state())?;
            engine.set_applied_steps(m.applied_steps);
            scaler.restore(m.loss_scaler);
            data.seek(m.data)?;
            losses = m.losses;
            Some(m.step)
        }
        None => {
            if let Some(path) = &spec.model.init_from {
                engine.load_weights(&checkpoint::load_hf(Path::new(path), &shape)?);
            }
            None
        }
    };
    let mut seconds = Vec::with_capacity(t.steps.get() as usize);
    let mut last_scale = scaler.scale();
    let every = spec.checkpoint.every_steps;
    for step in resumed_from.unwrap_or(0)..t.steps.get() {
        let lr = schedule::lr(t, step) as f32;
        let start = Instant::now();
        let r = engine.step(&mut data, &mut scaler, lr, t.grad_clip)?;
        let elapsed = start.elapsed().as_secs_f64();
        seconds.push(elapsed);
        losses.push(r.loss);
        last_scale = r.loss_scale;
        let done = step + 1;
        if let Some(out) = out.filter(|_| every > 0 && done % every == 0 && done < t.steps.get()) {
            let manifest = Manifest {
                step: done,
                applied_steps: engine.applied_steps(),
                world_size: setup.world_size,
                zero_stage: setup.stage.index(),
                dtype: spec.precision.dtype,
                optimizer: spec.optimizer.name().to_string(),
                loss_scaler: scaler.state(),
                data: data.position(),
                losses: losses.clone(),
            };
            checkpoint::save(out, &manifest, rank, &engine.state())?;
        }
        progress(Progress {
            step: done,
            steps: t.steps.get(),
            loss: r.loss,
            loss_scale: r.loss_scale,
            tokens_per_second: tokens_per_step / elapsed,
            skipped: r.skipped,
        });
    }
    if let Some(out) = out {
        checkpoint::export(out, &shape, &engine.unit_values())?;
    }
    let step_seconds_median = median(&seconds);
    Ok(Summary {
        steps: t.steps.get(),
        final_loss: *losses.last().expect("at least one step"),
        losses,
        tokens_per_second: tokens_per_step / step_seconds_median,
        step_seconds_median,
        skipped_steps: scaler.skipped_steps(),
        loss_scale: last_scale,
        resumed_from,
        ranks: vec![RankMemory {
            rank,
            measured_peak_bytes: acct.peak(),
            predicted_bytes: memory::rank_breakdown(setup, rank),
        }],
    })
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
