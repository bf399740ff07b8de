//! What a heartbeat's reports do: steps, memory, logs and checkpoints are stored (and feed the
//! metrics and event streams); `Started`, `Finished` from rank 0's node and `Failed` move the
//! job. Reports of an attempt that is no longer the job's current one are dropped.

use std::collections::HashMap;

use runner::agent::protocol::Report;

use crate::app::{App, JobEvent, now_ms};
use crate::domain::{Job, JobState, LogLine, NodeRecord, RankMemoryRecord, StepRecord};
use crate::error::ApiError;

const LIVE: [JobState; 2] = [JobState::Scheduled, JobState::Running];

/// Steps and log lines of one beat, stored together per job before anything moves the job, so
/// a follower that sees the job end has seen its last lines.
#[derive(Default)]
struct Pending {
    steps: HashMap<String, Vec<StepRecord>>,
    logs: HashMap<String, Vec<(i64, String)>>,
}

pub(super) async fn apply(
    app: &App,
    node: &NodeRecord,
    reports: Vec<Report>,
) -> Result<(), ApiError> {
    let now = now_ms();
    let mut jobs: HashMap<String, Option<Job>> = HashMap::new();
    let mut pending = Pending::default();
    for report in reports {
        let (job_id, attempt) = ids(&report);
        let job = match jobs.get(job_id) {
            Some(job) => job.clone(),
            None => {
                let job = app.store.get_job(job_id).await?;
                jobs.insert(job_id.to_string(), job.clone());
                job
            }
        };
        let Some(job) = job.filter(|j| j.attempt == attempt) else {
            tracing::debug!(job = job_id, attempt, "dropping a report of a past attempt");
            continue;
        };
        match report {
            Report::Rendezvous { master, .. } => {
                app.store.set_master(&job.id, attempt, &master).await?;
            }
            Report::Step {
                step,
                loss,
                loss_scale,
                tokens_per_second,
                skipped,
                step_seconds,
                ..
            } => {
                let record = StepRecord {
                    attempt,
                    step,
                    loss,
                    loss_scale,
                    tokens_per_second,
                    skipped,
                    step_seconds,
                    at: now,
                };
                if !job.state.is_terminal() {
                    app.metrics.observe_step(&job.id, &record);
                }
                pending.steps.entry(job.id).or_default().push(record);
            }
            Report::Memory {
                rank,
                measured,
                predicted,
                comm_bytes_sent,
                process_peak_rss_bytes,
                ..
            } => {
                let rank = u32::try_from(rank).unwrap_or(u32::MAX);
                if !job.state.is_terminal() {
                    app.metrics.observe_memory(
                        &job.id,
                        rank,
                        &measured,
                        &predicted,
                        &comm_bytes_sent,
                    );
                }
                let record = RankMemoryRecord {
                    rank,
                    measured,
                    predicted,
                    comm_bytes_sent,
                    process_peak_rss_bytes,
                };
                app.store.set_rank_memory(&job.id, &record).await?;
            }
            Report::Log { line, .. } => {
                pending.logs.entry(job.id).or_default().push((now, line));
            }
            Report::Checkpoint { step, path, .. } => {
                app.store
                    .add_checkpoint(&job.id, attempt, step, &path)
                    .await?;
            }
            Report::Started { resumed_from, .. } => {
                pending.flush(app).await?;
                let reason = match resumed_from {
                    Some(step) => format!("started on {}, resumed from step {step}", node.name),
                    None => format!("started on {}", node.name),
                };
                let moved = app
                    .transition_attempt(
                        &job.id,
                        attempt,
                        &[JobState::Scheduled],
                        JobState::Running,
                        &reason,
                    )
                    .await?;
                refresh(&mut jobs, moved);
            }
            Report::Finished { final_loss, .. } => {
                // The job is done when rank 0 is; other nodes' ranks finish with it.
                let runs_rank_0 = app
                    .store
                    .assignments_for_job(&job.id)
                    .await?
                    .iter()
                    .any(|a| a.attempt == attempt && a.rank == 0 && a.node_id == node.id);
                if runs_rank_0 {
                    pending.flush(app).await?;
                    let reason = format!("finished: final loss {final_loss:.4}");
                    let moved = app
                        .transition_attempt(&job.id, attempt, &LIVE, JobState::Succeeded, &reason)
                        .await?;
                    refresh(&mut jobs, moved);
                }
            }
            Report::Failed { error, .. } => {
                pending.flush(app).await?;
                let reason = format!("failed on {}: {error}", node.name);
                let moved = app
                    .transition_attempt(&job.id, attempt, &LIVE, JobState::Failed, &reason)
                    .await?;
                refresh(&mut jobs, moved);
            }
            // The job was cancelled here first; the ranks stopping changes nothing.
            Report::Cancelled { .. } => {}
        }
    }
    pending.flush(app).await
}

impl Pending {
    async fn flush(&mut self, app: &App) -> Result<(), ApiError> {
        for (job_id, steps) in self.steps.drain() {
            app.store.add_steps(&job_id, &steps).await?;
            for step in steps {
                app.publish(JobEvent::Step {
                    job_id: job_id.clone(),
                    step,
                });
            }
        }
        for (job_id, lines) in self.logs.drain() {
            let last = app.store.append_logs(&job_id, &lines).await?;
            let first = last - lines.len() as i64 + 1;
            for (i, (at, line)) in lines.into_iter().enumerate() {
                app.publish(JobEvent::Log {
                    job_id: job_id.clone(),
                    line: LogLine {
                        seq: first + i as i64,
                        at,
                        line,
                    },
                });
            }
        }
        Ok(())
    }
}

/// Keeps the beat's view of a job current after it moved.
fn refresh(jobs: &mut HashMap<String, Option<Job>>, moved: Option<Job>) {
    if let Some(job) = moved {
        jobs.insert(job.id.clone(), Some(job));
    }
}

fn ids(report: &Report) -> (&str, u32) {
    match report {
        Report::Rendezvous {
            job_id, attempt, ..
        }
        | Report::Started {
            job_id, attempt, ..
        }
        | Report::Step {
            job_id, attempt, ..
        }
        | Report::Memory {
            job_id, attempt, ..
        }
        | Report::Log {
            job_id, attempt, ..
        }
        | Report::Checkpoint {
            job_id, attempt, ..
        }
        | Report::Finished {
            job_id, attempt, ..
        }
        | Report::Failed {
            job_id, attempt, ..
        }
        | Report::Cancelled { job_id, attempt } => (job_id, *attempt),
    }
}
