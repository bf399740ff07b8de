//! A training run in this process: check the plan it is given against the ranks' layout, build
//! the engine in its dtype, run the steps, report progress, and summarise the run with
//! measured memory next to the plan's.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use scheduler::memory::{self, Breakdown, Setup};
use scheduler::model::ModelShape;
use scheduler::plan::Plan;
use scheduler::spec::{Dtype, InitFrom, JobSpec};
use serde::Serialize;

use crate::Error;
use crate::accounting::Accountant;
use crate::checkpoint::{self, Manifest};
use crate::comm::{Communicator, DeviceCollectives, Op, Summable, TcpConfig, local_ring, tcp_ring};
use crate::data::{BatchLayout, DataLoader, DataRoots, Inputs, Position, Tokenizing};
use crate::device::{Cpu, Device, Num, Target};
use crate::loss_scale::LossScaler;
use crate::validation::ValidationLoss;
use crate::zero::{Engine, StepReport};
use crate::{lr_schedule, process};

/// How a run is hosted.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Each rank's device budget, which the accountant enforces.
    pub device_memory: Option<u64>,
    /// The device every rank of this process trains on, but those `rank_devices` names.
    pub device: Target,
    /// Ranks pinned to devices of their own (an agent puts each rank on the GPU it was placed
    /// on: NCCL refuses two ranks on one GPU).
    pub rank_devices: BTreeMap<usize, Target>,
    /// Where checkpoints and the final Hugging Face export go (none: nothing is written).
    pub out_dir: Option<std::path::PathBuf>,
    /// The largest file of the export: a larger one is sharded (default
    /// `checkpoint::EXPORT_SHARD_BYTES`, 2 GB).
    pub export_shard_bytes: Option<u64>,
    /// How long a rank waits for a neighbour before failing (default 60 s).
    pub comm_timeout: Option<Duration>,
    /// Run only this rank, joining the others over TCP; otherwise every rank runs here.
    pub distributed: Option<Distributed>,
    /// Set to stop the run after the current step (`Error::Cancelled`).
    pub cancel: Option<Arc<AtomicBool>>,
    /// Where the spec's input files may be read (default: anywhere, for a run in a user's own
    /// process; the agent passes its node's data roots).
    pub data_roots: DataRoots,
    /// Which checkpoint the run resumes from.
    pub resume: Resume,
    /// Keep every checkpoint under `out_dir`; otherwise the newest `checkpoint::KEEP` are kept.
    pub keep_all_checkpoints: bool,
    /// The weights `model.init_from` names, already fetched by the host (an agent: another
    /// job's export, from the server).
    pub init_weights: Option<std::path::PathBuf>,
    /// Where checkpoint files and the export go as soon as they are written (an agent's
    /// uploads to the server), besides `out_dir`.
    pub upload: Option<Arc<dyn checkpoint::Upload>>,
    /// Where tokenized text is kept for later runs (default: `out_dir/cache`, or the system's
    /// temporary folder).
    pub data_cache: Option<std::path::PathBuf>,
    /// Where progress lines that are not steps go (tokenizing); default: nowhere.
    pub log: Option<LogSink>,
}

/// A place for progress lines (a terminal, a job's log on the server).
#[derive(Clone)]
pub struct LogSink(pub Arc<dyn Fn(&str) + Send + Sync>);

impl std::fmt::Debug for LogSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogSink")
    }
}

impl Options {
    fn data_cache(&self) -> std::path::PathBuf {
        match (&self.data_cache, &self.out_dir) {
            (Some(cache), _) => cache.clone(),
            (None, Some(out)) => out.join("cache"),
            (None, None) => std::env::temp_dir().join("zerotrain-cache"),
        }
    }

    /// The device rank `rank` trains on.
    pub fn target(&self, rank: usize) -> Target {
        self.rank_devices.get(&rank).copied().unwrap_or(self.device)
    }
}

/// Where a run's starting state comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Resume {
    /// The checkpoint `out_dir/checkpoints/latest` points to, if there is one.
    #[default]
    Latest,
    /// This checkpoint directory.
    From(std::path::PathBuf),
    /// No checkpoint: step 0 (or `model.init_from`).
    Fresh,
}

/// One rank of a job whose ranks are separate processes, possibly on several hosts.
#[derive(Debug, Clone, Copy)]
pub struct Distributed {
    pub rank: usize,
    /// Rank 0's rendezvous address (rank 0 listens on it).
    pub master: SocketAddr,
}

/// One finished step, as progress displays show it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Progress {
    pub step: u32,
    pub steps: u32,
    pub loss: f64,
    pub loss_scale: f32,
    pub tokens_per_second: f64,
    pub step_seconds: f64,
    pub skipped: bool,
    /// The mean validation loss, when validation ran after this step.
    pub validation_loss: Option<f64>,
    /// A checkpoint of this step was written.
    pub checkpointed: bool,
}

/// Bytes one rank held at its peak, by category, next to the memory model's prediction, and
/// the bytes it sent, by collective.
#[derive(Debug, Clone, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub measured_peak_bytes: Breakdown,
    pub predicted_bytes: Breakdown,
    pub comm_bytes_sent: BTreeMap<Op, u64>,
    /// The most memory the rank's device had in use after a step, by every process, as its
    /// driver reports it (GPUs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_used_peak_bytes: Option<u64>,
}

/// The process's own view of a run: the operating system's peak resident set beside the
/// memory model's total for the ranks it ran, with the process overhead counted once.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ProcessMemory {
    /// `VmHWM` (or `getrusage`'s maximum) at the end of the run; `None` where the system does
    /// not say.
    pub peak_rss_bytes: Option<u64>,
    /// Every rank's predicted total plus `overhead_bytes`.
    pub predicted_bytes: u64,
    /// The process overhead (`scheduler::memory::process`): what it had resident at start, its
    /// threads' stacks and GEMM workspace, and an allowance for growth.
    pub overhead_bytes: u64,
    /// `VmRSS` before training started (0 where the system does not say).
    pub resident_at_start_bytes: u64,
    /// Threads that run GEMMs: the kernel pool's and one per rank.
    pub threads: usize,
}

/// What `zerotrain train --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub steps: u32,
    pub final_loss: f64,
    /// Per step, the mean token loss over every rank's batch.
    pub losses: Vec<f64>,
    /// The validation losses, in step order (none without `data.validation`).
    pub validation: Vec<ValidationLoss>,
    pub tokens_per_second: f64,
    pub step_seconds_median: f64,
    pub skipped_steps: u64,
    pub loss_scale: f32,
    /// The checkpoint step this run resumed from, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<u32>,
    pub ranks: Vec<RankMemory>,
    pub process: ProcessMemory,
}

/// Trains `spec` as `plan` says to completion with its `world_size` ranks as threads of this
/// process (or, `distributed`, just one of them), calling `progress` after every step of the
/// first.
pub fn run(
    spec: &JobSpec,
    plan: &Plan,
    opts: &Options,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Summary, Error> {
    let world = spec.world_size.get() as usize;
    let timeout = opts.comm_timeout.unwrap_or(Duration::from_secs(60));
    let comms = match opts.distributed {
        Some(d) => vec![tcp_ring(&TcpConfig::new(d.rank, world, d.master, timeout))?],
        None => local_ring(world, timeout),
    };
    run_ranks(spec, plan, comms, opts, progress)
}

/// Trains the ranks of `spec` that `comms` stand for, each on a thread of its own, with the
/// configuration `plan` chose: the runner never plans. Each rank's layout must hold the bytes
/// the plan holds it to, category by category; a difference is a bug, and fails the run.
pub fn run_ranks(
    spec: &JobSpec,
    plan: &Plan,
    comms: Vec<Communicator>,
    opts: &Options,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Summary, Error> {
    let (Some(model), Some(hf_config)) = (spec.architecture().model(), spec.model.hf_config())
    else {
        return Err(Error::Untrainable {
            reason: "a bare parameter count has no architecture to train".into(),
        });
    };
    let hf_config = &hf_config;
    let setup = plan.chosen.setup(spec);
    for rank in comms.iter().map(Communicator::rank) {
        if let Some((category, planned, layout)) =
            plan.differs(&setup, rank, opts.target(rank).kind())
        {
            return Err(Error::PlanMismatch {
                rank,
                category,
                planned,
                layout,
            });
        }
    }
    // Before any buffer: what the process is before it trains. Its allocator, heap and kernel
    // pool are the binary's (zerotrain's `cli/src/process.rs`).
    let resident_at_start = process::rss_bytes().unwrap_or(0);
    let gemm = kernels::matmul::gemm_workspace();
    let pool_threads = kernels::cpu::pool_threads();
    let cpu_process = memory::process::CpuProcess {
        resident_at_start,
        // A rank alone on a pool of its own (below) runs its GEMMs on that pool's threads, as
        // many as the shared pool's; the thread counted for it then waits and runs none.
        threads: pool_threads + comms.len(),
        ranks: comms.len(),
        gemm_per_thread: gemm.per_thread,
        gemm_per_call: gemm.per_call,
    };
    // Text is tokenized once here, for every rank of this process, before any trains.
    let quiet = |_: &str| {};
    let log: &(dyn Fn(&str) + Sync) = match &opts.log {
        Some(LogSink(log)) => log.as_ref(),
        None => &quiet,
    };
    let inputs = Inputs::prepare(
        &spec.data,
        spec.model.init_from.as_ref(),
        &opts.data_roots,
        &Tokenizing {
            cache: &opts.data_cache(),
            seed: spec.training.seed,
            vocab_size: model.vocab_size(),
            eos_token_id: eos_token_id(hf_config),
            log,
        },
    )?;
    let inputs = &inputs;
    let mut progress = Some(progress);
    // A CPU rank alone in its process trains on a worker of a kernel pool of its own, as many
    // threads as the shared one, so that each kernel call forks on the thread that makes it.
    // Handed in from a thread outside the pool, every call cost two futex waits and a wake-up,
    // more than a tiny model's kernels take (docs/testing.md, "CI"). Ranks that share a
    // process stay threads of their own over the shared pool, where one blocked on a
    // neighbour holds no kernel thread.
    let own_pool = comms.len() == 1 && opts.target(comms[0].rank()) == Target::Cpu;
    let results: Vec<Result<RankRun, Error>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let report = progress.take();
                let setup = &setup;
                scope.spawn(move || {
                    let job = RankJob {
                        spec,
                        plan,
                        setup,
                        model,
                        hf_config,
                        opts,
                        inputs,
                        progress: report,
                    };
                    let train = move || {
                        kernels::cpu::flush_denormals();
                        let _gemm_buffer = kernels::matmul::Workspace::keep();
                        match spec.precision.dtype {
                            Dtype::Fp32 => on_device::<f32>(job, comm),
                            Dtype::Fp16 => on_device::<f16>(job, comm),
                            Dtype::Bf16 => on_device::<bf16>(job, comm),
                        }
                    };
                    if !own_pool {
                        return train();
                    }
                    kernels::cpu::thread_pool(pool_threads)
                        .map_err(|e| {
                            Error::Device(format!("a kernel pool of {pool_threads} threads: {e}"))
                        })?
                        .install(train)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    summarise(results, cpu_process)
}

/// The model config's `eos_token_id` (a list's first), which tokenizes text when the
/// tokenizer's own files name no end-of-sequence token.
fn eos_token_id(config: &serde_json::Map<String, serde_json::Value>) -> Option<u32> {
    let id = config.get("eos_token_id")?;
    let id = id.as_array().and_then(|ids| ids.first()).unwrap_or(id);
    id.as_u64().and_then(|id| u32::try_from(id).ok())
}

/// What one rank did.
struct RankRun {
    losses: Vec<f64>,
    validation: Vec<ValidationLoss>,
    seconds: Vec<f64>,
    tokens_per_step: f64,
    skipped_steps: u64,
    loss_scale: f32,
    resumed_from: Option<u32>,
    memory: RankMemory,
}

/// One summary from every rank's run; if any failed, the error that started it (a rank whose
/// neighbour failed reports only that).
fn summarise(
    results: Vec<Result<RankRun, Error>>,
    cpu_process: memory::process::CpuProcess,
) -> Result<Summary, Error> {
    let mut runs = Vec::with_capacity(results.len());
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(run) => runs.push(run),
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        let root = errors
            .iter()
            .position(|e| !matches!(e, Error::Peer { .. }))
            .unwrap_or(0);
        return Err(errors.swap_remove(root));
    }
    let first = &runs[0];
    let overhead = cpu_process.overhead_bytes();
    let process = ProcessMemory {
        peak_rss_bytes: process::peak_rss_bytes(),
        predicted_bytes: runs
            .iter()
            .map(|r| r.memory.predicted_bytes.total())
            .sum::<u64>()
            + overhead,
        overhead_bytes: overhead,
        resident_at_start_bytes: cpu_process.resident_at_start,
        threads: cpu_process.threads,
    };
    // The ranks agree on each step's loss, so rank 0's history is everyone's.
    let losses = first.losses.clone();
    let step_seconds_median = median(&first.seconds);
    Ok(Summary {
        steps: losses.len() as u32,
        final_loss: *losses.last().expect("at least one step"),
        tokens_per_second: first.tokens_per_step / step_seconds_median,
        step_seconds_median,
        skipped_steps: first.skipped_steps,
        loss_scale: first.loss_scale,
        resumed_from: first.resumed_from,
        validation: first.validation.clone(),
        losses,
        ranks: runs.into_iter().map(|r| r.memory).collect(),
        process,
    })
}

/// What one rank trains, with which configuration, and whom it tells of its steps.
struct RankJob<'a, 'p> {
    spec: &'a JobSpec,
    plan: &'a Plan,
    setup: &'a Setup,
    model: ModelShape,
    /// The `config.json` the export carries.
    hf_config: &'a serde_json::Map<String, serde_json::Value>,
    opts: &'a Options,
    /// The files the rank's loaders read.
    inputs: &'a Inputs,
    progress: Option<&'a mut (dyn FnMut(Progress) + Send + 'p)>,
}

/// [`train_rank`] on the device the options name for the rank.
fn on_device<X: Num + Summable>(
    job: RankJob<'_, '_>,
    comm: Communicator,
) -> Result<RankRun, Error> {
    match job.opts.target(comm.rank()) {
        Target::Cpu => train_rank::<X, _>(Cpu, comm, job),
        #[cfg(feature = "cuda")]
        Target::Cuda(n) => train_rank::<X, _>(crate::device::Cuda::new(n)?, comm, job),
        #[cfg(not(feature = "cuda"))]
        Target::Cuda(_) => Err(Error::Device(
            "this zerotrain was built without CUDA support (cargo feature `cuda`)".into(),
        )),
    }
}

/// The Hugging Face weights `model.init_from` names (or the agent fetched for it), if any.
fn model_weights(job: &RankJob<'_, '_>) -> Result<Option<checkpoint::HfWeights>, Error> {
    let model = &job.model;
    Ok(Some(
        match (&job.opts.init_weights, &job.spec.model.init_from) {
            (Some(file), _) => checkpoint::load_hf_file(file, model)?,
            (None, Some(InitFrom::Path(path))) => {
                checkpoint::load_hf(&job.opts.data_roots, path, model)?
            }
            (None, Some(InitFrom::Artifact(a))) => {
                return Err(Error::Untrainable {
                    reason: format!(
                        "model.init_from names job {}'s model, which only an agent fetches (from its server); give a file",
                        a.job
                    ),
                });
            }
            (None, None) => return Ok(None),
        },
    ))
}

/// One rank's run, in order: resume or initialise, run the steps (checkpointing when due and
/// reporting each), export, and report what it measured.
fn train_rank<X: Num + Summable, D: DeviceCollectives>(
    dev: D,
    comm: Communicator,
    mut job: RankJob<'_, '_>,
) -> Result<RankRun, Error> {
    let mut rank = Rank::<X, D>::new(dev, comm, &job)?;
    let resumed_from = rank.resume_or_init(&job)?;
    let steps = job.spec.training.steps.get();
    for step in resumed_from.unwrap_or(0)..steps {
        if job
            .opts
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed))
        {
            return Err(Error::Cancelled { step });
        }
        let (done, elapsed) = rank.step(&job, step)?;
        let validation_loss = rank.validate_if_due(&job, step + 1)?;
        let checkpointed = rank.checkpoint_if_due(&job, step + 1)?;
        if let Some(report) = job.progress.as_mut() {
            report(Progress {
                step: step + 1,
                steps,
                loss: done.loss,
                loss_scale: done.loss_scale,
                tokens_per_second: rank.tokens_per_step / elapsed,
                step_seconds: elapsed,
                skipped: done.skipped,
                validation_loss,
                checkpointed,
            });
        }
    }
    // A step's traffic, which the memory model counts: the export's gathers are not.
    let comm_bytes_sent = rank.engine.sent_bytes();
    rank.export(&job)?;
    Ok(rank.finish(&job, resumed_from, comm_bytes_sent))
}

/// A rank's state while it trains: the engine, its data and loss scaler, and what it has
/// measured so far.
struct Rank<X: Num, D: Device> {
    engine: Engine<X, D>,
    data: DataLoader,
    /// The validation data's loader, read from its start at every evaluation.
    validation: Option<DataLoader>,
    validation_losses: Vec<ValidationLoss>,
    scaler: LossScaler,
    /// Sequences in one batch across all ranks: checkpoints count data positions in these.
    sequences_per_batch: usize,
    tokens_per_step: f64,
    losses: Vec<f64>,
    seconds: Vec<f64>,
    loss_scale: f32,
    device_used_peak_bytes: Option<u64>,
}

impl<X: Num + Summable, D: DeviceCollectives> Rank<X, D> {
    fn new(dev: D, comm: Communicator, job: &RankJob<'_, '_>) -> Result<Self, Error> {
        let (spec, setup, t) = (job.spec, job.setup, &job.spec.training);
        let rank = comm.rank();
        let acct = Accountant::new(job.opts.device_memory);
        let engine = Engine::<X, D>::on(dev, setup, job.model, t.seed, comm, acct)?;
        let layout = BatchLayout {
            batch: setup.micro_batch,
            seq_len: setup.seq_len,
            rank,
            world_size: setup.world_size,
        };
        let vocab = job.model.vocab_size();
        let loader = |input| DataLoader::new(input, layout, t.seed, vocab, engine.accountant());
        let data = loader(&job.inputs.train)?;
        let validation = job.inputs.validation.as_ref().map(loader).transpose()?;
        let scaler = LossScaler::new(spec.precision.effective_loss_scale());
        let tokens_per_step =
            (engine.micro_batch_tokens() * setup.grad_accum * setup.world_size) as f64;
        Ok(Rank {
            engine,
            data,
            validation,
            validation_losses: Vec::new(),
            loss_scale: scaler.scale(),
            scaler,
            sequences_per_batch: setup.micro_batch * setup.world_size,
            tokens_per_step,
            losses: Vec::with_capacity(t.steps.get() as usize),
            seconds: Vec::with_capacity(t.steps.get() as usize),
            device_used_peak_bytes: None,
        })
    }

    /// Loads the checkpoint the options point to (resharding it if it was written by another
    /// world size or stage) and returns its step; without one, loads `model.init_from`'s
    /// weights, if any.
    fn resume_or_init(&mut self, job: &RankJob<'_, '_>) -> Result<Option<u32>, Error> {
        let out = job.opts.out_dir.as_deref();
        let dir = match (&job.opts.resume, out) {
            (Resume::Latest, Some(out)) => checkpoint::latest(out)?,
            (Resume::From(dir), _) => Some(dir.clone()),
            (Resume::Latest, None) | (Resume::Fresh, _) => None,
        };
        match dir {
            Some(dir) => self.resume(job, &dir).map(Some),
            None => self.init(job).map(|()| None),
        }
    }

    fn resume(&mut self, job: &RankJob<'_, '_>, dir: &std::path::Path) -> Result<u32, Error> {
        let (spec, setup) = (job.spec, job.setup);
        let m = checkpoint::load_manifest(dir)?;
        let fail = |reason: String| Error::Checkpoint {
            path: dir.to_path_buf(),
            reason,
        };
        if (m.dtype, m.optimizer) != (spec.precision.dtype, spec.optimizer.kind()) {
            return Err(fail(format!(
                "written by a {:?} {} job; this one is {:?} {}",
                m.dtype,
                <&str>::from(m.optimizer),
                spec.precision.dtype,
                spec.optimizer.name()
            )));
        }
        let (_, trained) = setup.parameter_counts();
        // Checkpoints that do not say were written by full fine-tuning, of the whole model.
        let written = m
            .trained_parameters
            .unwrap_or_else(|| setup.arch.parameter_count());
        if written != trained {
            return Err(fail(format!(
                "written by a job that trains {written} parameters; this one trains {trained} \
                 (a LoRA job's checkpoints hold its adapters only)"
            )));
        }
        if setup.lora.is_some() {
            self.load_model(job)?;
        }
        if (m.world_size, m.zero_stage) == (setup.world_size, setup.stage) {
            self.engine.load_rank(dir)?;
        } else {
            self.engine
                .load_resharded(dir, m.world_size, m.zero_stage)?;
        }
        // The position counts batches of the writer's `sequences_per_batch`; convert to ours.
        let ours = self.sequences_per_batch as u64;
        let consumed = m.data.batch * m.sequences_per_batch as u64;
        if !consumed.is_multiple_of(ours) {
            return Err(fail(format!(
                "{consumed} sequences were read, not a whole number of this run's {ours}-sequence batches"
            )));
        }
        self.engine.set_applied_steps(m.applied_steps);
        self.scaler.restore(m.loss_scaler);
        self.loss_scale = self.scaler.scale();
        self.data.seek(Position {
            batch: consumed / ours,
            ..m.data
        })?;
        self.losses = m.losses;
        self.validation_losses = m.validation;
        Ok(m.step)
    }

    /// A fresh start: the model's weights from `model.init_from` (else the seed's) and, for a
    /// LoRA job, its adapters from `lora.init_from` (else PEFT's initialisation).
    fn init(&mut self, job: &RankJob<'_, '_>) -> Result<(), Error> {
        self.load_model(job)?;
        let lora = job.spec.lora.as_ref();
        if let (Some(lora), Some(adapters)) = (lora, &job.setup.lora)
            && let Some(dir) = &lora.init_from
        {
            let roots = &job.opts.data_roots;
            let weights = checkpoint::load_peft(roots, dir, &job.model, lora, adapters)?;
            self.engine.load_adapters(&weights)?;
        }
        Ok(())
    }

    /// Loads `model.init_from`'s weights, if it names any: the model's start, or a LoRA job's
    /// frozen base (which its checkpoints do not hold).
    fn load_model(&mut self, job: &RankJob<'_, '_>) -> Result<(), Error> {
        match model_weights(job)? {
            Some(weights) => self.engine.load_weights(&weights),
            None => Ok(()),
        }
    }

    /// Optimizer step `step` (from 0) at its scheduled learning rate; returns it and its
    /// seconds.
    fn step(&mut self, job: &RankJob<'_, '_>, step: u32) -> Result<(StepReport, f64), Error> {
        let t = &job.spec.training;
        let lr = lr_schedule::lr(t, step) as f32;
        let start = Instant::now();
        let r = self
            .engine
            .step(&mut self.data, &mut self.scaler, lr, t.grad_clip)?;
        let elapsed = start.elapsed().as_secs_f64();
        if let Some(used) = self.engine.device().used_bytes()? {
            self.device_used_peak_bytes = self.device_used_peak_bytes.max(Some(used));
        }
        self.seconds.push(elapsed);
        self.losses.push(r.loss);
        self.loss_scale = r.loss_scale;
        Ok((r, elapsed))
    }

    /// The validation loss after `done` steps if validation is due then: every
    /// `data.validation.every_steps` steps and after the last.
    fn validate_if_due(&mut self, job: &RankJob<'_, '_>, done: u32) -> Result<Option<f64>, Error> {
        let (Some(data), Some(v)) = (&mut self.validation, job.spec.data.validation()) else {
            return Ok(None);
        };
        if !done.is_multiple_of(v.every_steps) && done != job.spec.training.steps.get() {
            return Ok(None);
        }
        let loss = self.engine.evaluate(data, v.batches)?;
        self.validation_losses
            .push(ValidationLoss { step: done, loss });
        Ok(Some(loss))
    }

    /// Writes a checkpoint after `done` steps if one is due then (not after the last: the
    /// export follows) and there is an output folder; says whether it did.
    fn checkpoint_if_due(&mut self, job: &RankJob<'_, '_>, done: u32) -> Result<bool, Error> {
        let (spec, setup, opts) = (job.spec, job.setup, job.opts);
        let every = spec.checkpoint.every_steps;
        let due = every > 0 && done.is_multiple_of(every) && done < spec.training.steps.get();
        let Some(out) = opts.out_dir.as_deref().filter(|_| due) else {
            return Ok(false);
        };
        let manifest = Manifest {
            step: done,
            applied_steps: self.engine.applied_steps(),
            world_size: setup.world_size,
            zero_stage: setup.stage,
            sequences_per_batch: self.sequences_per_batch,
            dtype: spec.precision.dtype,
            optimizer: spec.optimizer.kind(),
            loss_scaler: self.scaler.state(),
            data: self.data.position(),
            losses: self.losses.clone(),
            validation: self.validation_losses.clone(),
            trained_parameters: Some(setup.parameter_counts().1),
        };
        self.engine
            .save_checkpoint(out, &manifest, opts.upload.as_deref())?;
        if self.engine.rank() == 0 && !opts.keep_all_checkpoints {
            checkpoint::keep_newest(out, checkpoint::KEEP)?;
        }
        Ok(true)
    }

    /// Writes the Hugging Face export (rank 0 writes; every rank gathers its shards) if there
    /// is an output folder, and uploads it where the host wants it.
    fn export(&mut self, job: &RankJob<'_, '_>) -> Result<(), Error> {
        let Some(out) = job.opts.out_dir.as_deref() else {
            return Ok(());
        };
        let shard_bytes = job
            .opts
            .export_shard_bytes
            .unwrap_or(checkpoint::EXPORT_SHARD_BYTES);
        let create = || match (&job.spec.lora, &job.setup.lora) {
            (Some(lora), Some(adapters)) => {
                let units = adapters.layout(&job.model, 1).adapters;
                let config = checkpoint::adapter_config(&job.model, lora, adapters);
                checkpoint::ModelFile::adapter(out, &units, config)
            }
            _ => checkpoint::ModelFile::create(out, &job.model, job.hf_config, shard_bytes),
        };
        let file = (self.engine.rank() == 0).then(create).transpose()?;
        self.engine.export(file.as_ref())?;
        let Some(file) = file else {
            return Ok(());
        };
        let mut written = file.finish()?;
        if let Some(adapters) = &job.setup.lora {
            let weights = model_weights(job)?;
            let base = match &weights {
                Some(w) => checkpoint::Base::File(w),
                None => checkpoint::Base::Seeded(job.spec.training.seed),
            };
            let round = |v: f32| X::from_f32(v).to_f32();
            let (model, config) = (&job.model, job.hf_config);
            written.extend(checkpoint::write_merged(
                out, model, config, base, adapters, round,
            )?);
        }
        if let Some(up) = &job.opts.upload {
            for (artifact, path) in &written {
                up.upload(*artifact, path)?;
            }
        }
        Ok(())
    }

    fn finish(
        self,
        job: &RankJob<'_, '_>,
        resumed_from: Option<u32>,
        comm_bytes_sent: BTreeMap<Op, u64>,
    ) -> RankRun {
        let rank = self.engine.rank();
        RankRun {
            losses: self.losses,
            validation: self.validation_losses,
            seconds: self.seconds,
            tokens_per_step: self.tokens_per_step,
            skipped_steps: self.scaler.skipped_steps(),
            loss_scale: self.loss_scale,
            resumed_from,
            memory: RankMemory {
                rank,
                measured_peak_bytes: self.engine.accountant().peak(),
                // The plan's figures; the overhead is the process's, counted once in `process`.
                predicted_bytes: Breakdown {
                    overhead: 0,
                    ..job.plan.rank_bytes(rank)
                },
                comm_bytes_sent,
                device_used_peak_bytes: self.device_used_peak_bytes,
            },
        }
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
