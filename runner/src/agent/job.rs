//! One assignment on this node: build the communicators of its ranks here (the in-process ring,
//! or TCP with rank 0 listening on a port this node picks and reports; ranks on GPUs then join
//! NCCL through it), pin each rank to the device it was placed on, train, and report steps,
//! logs, checkpoints, memory and the outcome.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::thread::JoinHandle;
use std::time::Duration;

use scheduler::memory::DeviceKind;
use scheduler::spec::{InitFrom, JobSpec};

use super::AgentConfig;
use super::client::Files;
use super::registration::Outbox;
use crate::Error;
use crate::checkpoint;
use crate::comm::{Communicator, TcpConfig, local_ring, tcp_ring, tcp_ring_with_master};
use crate::device::Target;
use crate::train::{LogSink, Options, Progress, Resume, Summary, run_ranks};
use wire::agent::{Assignment, RankTransport, Report, ResumeFrom};
use wire::artifact::Artifact;

/// How long ranks wait for each other (the rendezvous included).
const COMM_TIMEOUT: Duration = Duration::from_secs(60);

/// Starts `a` on a thread of its own; it reports through `outbox` until it ends, and then
/// says so.
pub(super) fn start(
    a: Assignment,
    cfg: &AgentConfig,
    files: Files,
    cancel: Arc<AtomicBool>,
    outbox: Outbox,
) -> JoinHandle<()> {
    let cfg = cfg.clone();
    std::thread::spawn(move || {
        // The attempt's own folder on this node: what it writes before uploading, and the
        // checkpoint it resumes from. Nothing in it outlives the attempt.
        let dir = cfg
            .work_dir
            .join("jobs")
            .join(a.job_id.as_str())
            .join("attempts")
            .join(a.attempt.to_string());
        let (job_id, attempt) = (a.job_id.clone(), a.attempt);
        let send = |r: Report| outbox.report(r);
        let ranks: Vec<usize> = a.ranks.iter().map(|r| r.rank).collect();
        // Each line names the ranks it speaks for (this node's), so readers can filter by rank.
        let tag = rank_tag(&ranks);
        let sink = {
            let (outbox, job_id) = (outbox.clone(), job_id.clone());
            LogSink(Arc::new(move |line: &str| {
                outbox.report(Report::Log {
                    job_id: job_id.clone(),
                    attempt,
                    line: format!("{tag} {line}"),
                })
            }))
        };
        let log = |line: String| (sink.0)(&line);
        log(format!(
            "{}: starting ranks {ranks:?} of attempt {attempt}",
            cfg.name
        ));
        let result = train(&a, &cfg, &dir, files, cancel, &send, &sink);
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            log(format!("{}: removing {}: {e}", cfg.name, dir.display()));
        }
        match result {
            Ok(summary) => {
                for r in &summary.ranks {
                    send(Report::Memory {
                        job_id: job_id.clone(),
                        attempt,
                        rank: r.rank,
                        measured: r.measured_peak_bytes,
                        comm_bytes_sent: r.comm_bytes_sent.clone(),
                        process_peak_rss_bytes: summary.process.peak_rss_bytes,
                        device_used_bytes: r.device_used_peak_bytes,
                    });
                }
                log(format!(
                    "{}: finished, final loss {:.4}",
                    cfg.name, summary.final_loss
                ));
                send(Report::Finished {
                    job_id: job_id.clone(),
                    attempt,
                    final_loss: summary.final_loss,
                });
            }
            Err(Error::Cancelled { step }) => {
                log(format!("{}: cancelled before step {step}", cfg.name));
                send(Report::Cancelled {
                    job_id: job_id.clone(),
                    attempt,
                });
            }
            Err(e) => {
                log(format!("{}: failed: {e}", cfg.name));
                send(Report::Failed {
                    job_id: job_id.clone(),
                    attempt,
                    error: e.to_string(),
                    peer: matches!(e, Error::Peer { .. }),
                });
            }
        }
        outbox.ended((job_id, attempt));
    })
}

/// `[rank 0]`, `[ranks 0,1,2,3]`: the tag that starts each log line of this node.
fn rank_tag(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    let s = if ranks.len() == 1 { "" } else { "s" };
    format!("[rank{s} {}]", list.join(","))
}

fn train(
    a: &Assignment,
    cfg: &AgentConfig,
    dir: &Path,
    files: Files,
    cancel: Arc<AtomicBool>,
    send: &(dyn Fn(Report) + Sync),
    sink: &LogSink,
) -> Result<Summary, Error> {
    let log = |line: String| (sink.0)(&line);
    let mut comms = communicators(a, &a.spec, cfg, send)?;
    if a.plan.device == DeviceKind::Cuda {
        // Ranks on GPUs reduce on them: NCCL, joined through the ring just built.
        comms.iter_mut().for_each(Communicator::request_nccl);
    }
    let leads = comms.first().is_some_and(|c| c.rank() == 0);
    let budget = a
        .ranks
        .iter()
        .filter_map(|r| cfg.devices.get(r.device))
        .map(|d| d.memory_bytes)
        .min();
    // Only what the server committed, fetched from it, never what an earlier attempt left.
    let resume = match &a.resume_from {
        Some(r) => Resume::From(fetch_checkpoint(&files, r, &dir.join("resume"))?),
        None => Resume::Fresh,
    };
    // Another job's model to start from comes from the server too (a resume needs none).
    let from_job = matches!(a.spec.model.init_from, Some(InitFrom::Artifact(_)));
    let init_weights = if from_job && a.resume_from.is_none() {
        Some(fetch_init_from(&files, &a.init_from, &dir.join("init"))?)
    } else {
        None
    };
    let opts = Options {
        device_memory: budget,
        device: Target::Cpu,
        // Each rank on the device it was placed on: its own GPU, or a CPU device.
        rank_devices: a
            .ranks
            .iter()
            .map(|r| (r.rank, cfg.target(r.device)))
            .collect(),
        out_dir: Some(dir.to_path_buf()),
        export_shard_bytes: Some(cfg.export_shard_bytes),
        comm_timeout: Some(COMM_TIMEOUT),
        distributed: None,
        cancel: Some(cancel),
        data_roots: cfg.data_roots.clone(),
        resume,
        init_weights,
        // Each file is removed once uploaded; the folders go with the attempt.
        keep_all_checkpoints: true,
        upload: Some(Arc::new(files)),
        // Tokenized text outlives the attempt: later attempts and jobs read it again.
        data_cache: Some(cfg.work_dir.join("cache")),
        log: Some(sink.clone()),
    };
    let (job_id, attempt) = (a.job_id.clone(), a.attempt);
    let mut started = false;
    let mut progress = |p: Progress| {
        if !leads {
            return;
        }
        if !started {
            started = true;
            let resumed_from = (p.step > 1).then_some(p.step - 1);
            send(Report::Started {
                job_id: job_id.clone(),
                attempt,
                resumed_from,
            });
            if let Some(step) = resumed_from {
                log(format!("resumed from the checkpoint of step {step}"));
            }
        }
        send(Report::Step {
            job_id: job_id.clone(),
            attempt,
            step: p.step,
            loss: p.loss,
            loss_scale: p.loss_scale,
            tokens_per_second: p.tokens_per_second,
            skipped: p.skipped,
            step_seconds: p.step_seconds,
            validation_loss: p.validation_loss,
        });
        if p.checkpointed {
            // Sent after every rank uploaded its file and rank 0 the manifest.
            send(Report::Checkpoint {
                job_id: job_id.clone(),
                attempt,
                step: p.step,
            });
        }
        if p.step == 1 || p.step.is_multiple_of(10) || p.step == p.steps {
            log(format!(
                "step {}/{}: loss {:.4}, {:.0} tokens/s",
                p.step, p.steps, p.loss, p.tokens_per_second
            ));
        }
    };
    run_ranks(&a.spec, &a.plan, comms, &opts, &mut progress)
}

/// Fetches the files of the committed checkpoint `r` into `into`; the checkpoint's folder.
fn fetch_checkpoint(files: &Files, r: &ResumeFrom, into: &Path) -> Result<PathBuf, Error> {
    let what = format!("checkpoint {}", r.step);
    fetch_named(files, &r.files, into, &what, |a| a.step() == Some(r.step))?;
    Ok(checkpoint::step_dir(into, r.step))
}

/// Fetches the weights of the export the job starts from (`model.safetensors`, or a sharded
/// export's index and shards: the names the server gave) into `into`; the folder, which
/// `checkpoint::load_hf_file` reads.
fn fetch_init_from(files: &Files, names: &[String], into: &Path) -> Result<PathBuf, Error> {
    const WHAT: &str = "the model to start from";
    if names.is_empty() {
        return Err(Error::Untrainable {
            reason: format!("the server named no files of {WHAT}"),
        });
    }
    fetch_named(files, names, into, WHAT, Artifact::is_weights)?;
    Ok(into.to_path_buf())
}

/// Fetches the files `names` of `what` into `into`, each under its name there: only names of
/// artifacts that `belongs` accepts, so nothing lands outside `into`.
fn fetch_named(
    files: &Files,
    names: &[String],
    into: &Path,
    what: &str,
    belongs: impl Fn(Artifact) -> bool,
) -> Result<(), Error> {
    for name in names {
        let a = Artifact::parse(name)
            .filter(|&a| belongs(a))
            .ok_or_else(|| Error::Untrainable {
                reason: format!("the server named {name:?} as a file of {what}"),
            })?;
        files.get(a, &into.join(a.name()))?;
    }
    Ok(())
}

/// The communicators of this node's ranks. Over TCP every rank joins the rendezvous at once
/// (each blocks until all have), so they are built on threads of their own.
fn communicators(
    a: &Assignment,
    spec: &JobSpec,
    cfg: &AgentConfig,
    send: &(dyn Fn(Report) + Sync),
) -> Result<Vec<Communicator>, Error> {
    let world = spec.world_size.get() as usize;
    let master = match &a.transport {
        RankTransport::Local => return Ok(local_ring(world, COMM_TIMEOUT)),
        RankTransport::Tcp { master: Some(m) } => {
            let addr: SocketAddr = m.parse().map_err(|e| Error::Untrainable {
                reason: format!("rendezvous address {m:?}: {e}"),
            })?;
            (addr, None)
        }
        RankTransport::Tcp { master: None } => {
            let listener = TcpListener::bind(("0.0.0.0", 0)).map_err(|e| Error::Untrainable {
                reason: format!("cannot listen for the rendezvous: {e}"),
            })?;
            let port = listener
                .local_addr()
                .map_err(|e| Error::Untrainable {
                    reason: e.to_string(),
                })?
                .port();
            let master = format!("{}:{port}", cfg.host);
            send(Report::Rendezvous {
                job_id: a.job_id.clone(),
                attempt: a.attempt,
                master: master.clone(),
            });
            let addr = master.parse().map_err(|e| Error::Untrainable {
                reason: format!("rendezvous address {master:?}: {e}"),
            })?;
            (addr, Some(listener))
        }
    };
    let (addr, mut listener) = master;
    let built: Vec<Result<Communicator, Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = a
            .ranks
            .iter()
            .map(|slot| {
                let cfg = TcpConfig::new(slot.rank, world, addr, COMM_TIMEOUT);
                let own = if slot.rank == 0 {
                    listener.take()
                } else {
                    None
                };
                s.spawn(move || match own {
                    Some(l) => tcp_ring_with_master(&cfg, l),
                    None => tcp_ring(&cfg),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    built.into_iter().collect()
}
