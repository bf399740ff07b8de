//! What a heartbeat's reports do: steps, memory, logs and checkpoints are stored (and feed the
//! metrics and event streams); `Started`, `Finished` from rank 0's node and `Failed` move the
//! job. A report is applied only for a (job, attempt) this node holds ranks of that is still
//! the job's current attempt, and one about the whole job only from rank 0's node; the others
//! are refused, counted, and named in the reply.

use std::collections::HashMap;

use wire::agent::{Refusal, RefusalReason, Report};

use crate::artifacts;
use crate::domain::{Job, JobId, JobState, NodeRecord, RankMemoryRecord, StepRecord};
use crate::error::ApiError;
use crate::state::{App, JobEvent};

const LIVE: [JobState; 2] = [JobState::Scheduled, JobState::Running];

/// How a requeue after a peer's loss starts its reason.
const PEER_LOST: &str = "requeued, a peer was lost";
/// Attempts a job may lose to a peer's loss before such a failure fails it: a node that died
/// never reports, so its peers' reports requeue the job (sooner than the heartbeat timeout
/// would), but a rank that fails the same way every attempt must not requeue it forever.
const PEER_REQUEUES: usize = 3;

/// Steps and log lines of one beat, stored together per job before anything moves the job, so
/// a follower that sees the job end has seen its last lines.
#[derive(Default)]
struct Pending {
    steps: HashMap<JobId, Vec<StepRecord>>,
    logs: HashMap<JobId, Vec<(i64, String)>>,
}

/// A job as a node's request sees it: the job, and the (attempt, rank) pairs this node was
/// assigned.
pub(super) struct View {
    job: Option<Job>,
    ranks: Vec<(u32, u32)>,
}

impl View {
    pub(super) async fn load(
        app: &App,
        job_id: &JobId,
        node: &NodeRecord,
    ) -> Result<View, ApiError> {
        Ok(View {
            job: app.store.get_job(job_id).await?,
            ranks: app.store.node_ranks(job_id, &node.id).await?,
        })
    }

    /// Whether the node may report `report`, of `attempt`.
    fn admits(&self, attempt: u32, report: &Report) -> Result<&Job, RefusalReason> {
        self.holds(attempt, report.from_rank_0_only().then_some(0))
    }

    /// The job, if `attempt` is its current one and this node holds ranks of it (rank `rank`
    /// among them, when given).
    pub(super) fn holds(&self, attempt: u32, rank: Option<u32>) -> Result<&Job, RefusalReason> {
        let job = self.job.as_ref().ok_or(RefusalReason::UnknownJob)?;
        let mut ranks = self
            .ranks
            .iter()
            .filter(|(a, _)| *a == attempt)
            .map(|(_, r)| *r)
            .peekable();
        if ranks.peek().is_none() {
            return Err(RefusalReason::NotAssigned);
        }
        if job.attempt != attempt {
            return Err(RefusalReason::AttemptOver);
        }
        if let Some(rank) = rank
            && !ranks.any(|r| r == rank)
        {
            return Err(if rank == 0 {
                RefusalReason::NotRank0
            } else {
                RefusalReason::NotAssigned
            });
        }
        Ok(job)
    }

    /// The job, if this node holds ranks of its current attempt.
    pub(super) fn current(&self) -> Result<&Job, RefusalReason> {
        let attempt = self.job.as_ref().ok_or(RefusalReason::UnknownJob)?.attempt;
        self.holds(attempt, None)
    }

    fn runs_rank_0(&self, attempt: u32) -> bool {
        self.ranks.contains(&(attempt, 0))
    }
}

/// Applies what `node` may report of `reports`; returns the others, refused.
pub(super) async fn apply(
    app: &App,
    node: &NodeRecord,
    reports: Vec<Report>,
) -> Result<Vec<Refusal>, ApiError> {
    let now = app.now_ms();
    let mut views: HashMap<JobId, View> = HashMap::new();
    let mut pending = Pending::default();
    let mut refused = Vec::new();
    for (index, report) in reports.into_iter().enumerate() {
        let (job_id, attempt) = report.key();
        if !views.contains_key(job_id) {
            let view = View::load(app, job_id, node).await?;
            views.insert(job_id.clone(), view);
        }
        let view = &views[job_id];
        let job = match view.admits(attempt, &report) {
            Ok(job) => job.clone(),
            Err(reason) => {
                tracing::debug!(job = job_id.as_str(), attempt, node = %node.id, ?reason, "report refused");
                app.metrics.refused(reason, 1);
                refused.push(Refusal { index, reason });
                continue;
            }
        };
        let runs_rank_0 = view.runs_rank_0(attempt);
        match report {
            Report::Rendezvous { master, .. } => {
                app.store.set_master(&job.id, attempt, &master).await?;
                // The job's other nodes get their assignments now.
                app.wake_agents(None);
            }
            Report::Step {
                step,
                loss,
                loss_scale,
                tokens_per_second,
                skipped,
                step_seconds,
                validation_loss,
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
                    validation_loss,
                };
                if !job.state.is_terminal() {
                    app.metrics
                        .observe_step(&job.id, &job.spec.architecture(), &record);
                }
                pending.steps.entry(job.id).or_default().push(record);
            }
            Report::Memory {
                rank,
                measured,
                comm_bytes_sent,
                process_peak_rss_bytes,
                device_used_bytes,
                ..
            } => {
                // Admission's figures, whatever the node computed: it checked its layout
                // against them before it started.
                let predicted = job.plan.rank_bytes(rank);
                let rank = u32::try_from(rank).unwrap_or(u32::MAX);
                if !job.state.is_terminal() {
                    app.metrics.observe_memory(
                        &job.id,
                        rank,
                        &measured,
                        &predicted,
                        device_used_bytes,
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
            Report::Checkpoint { step, .. } => {
                // Committed only once complete in the artifact store: the manifest and every
                // rank's file, uploaded before rank 0 reported it.
                let world = job.spec.world_size.get() as usize;
                let uploads = app.store.artifacts(&job.id).await?;
                let reason = if let Some(name) =
                    artifacts::missing_from_checkpoint(&uploads, attempt, step, world)
                {
                    tracing::warn!(
                        job = job.id.as_str(),
                        attempt,
                        step,
                        "checkpoint without {name}"
                    );
                    Some(RefusalReason::Incomplete)
                } else {
                    let added = app.store.add_checkpoint(&job.id, attempt, step).await?;
                    // Not added: requeued since this beat read the job.
                    (!added).then_some(RefusalReason::AttemptOver)
                };
                if let Some(reason) = reason {
                    app.metrics.refused(reason, 1);
                    refused.push(Refusal { index, reason });
                }
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
                refresh(&mut views, moved);
            }
            Report::Finished { final_loss, .. } => {
                // The job is done when rank 0 is; other nodes' ranks finish with it.
                if runs_rank_0 {
                    pending.flush(app).await?;
                    let reason = format!("finished: final loss {final_loss:.4}");
                    let moved = app
                        .transition_attempt(&job.id, attempt, &LIVE, JobState::Succeeded, &reason)
                        .await?;
                    refresh(&mut views, moved);
                }
            }
            Report::Failed { error, peer, .. } => {
                pending.flush(app).await?;
                let (to, reason) = if peer && peer_requeues(app, &job.id).await? < PEER_REQUEUES {
                    (
                        JobState::Queued,
                        format!("{PEER_LOST} on {}: {error}", node.name),
                    )
                } else {
                    (
                        JobState::Failed,
                        format!("failed on {}: {error}", node.name),
                    )
                };
                let moved = app
                    .transition_attempt(&job.id, attempt, &LIVE, to, &reason)
                    .await?;
                refresh(&mut views, moved);
            }
            // The job was cancelled here first; the ranks stopping changes nothing.
            Report::Cancelled { .. } => {}
        }
    }
    pending.flush(app).await?;
    Ok(refused)
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
            app.append_logs_at(&job_id, lines).await?;
        }
        Ok(())
    }
}

/// Keeps the beat's view of a job current after it moved.
fn refresh(views: &mut HashMap<JobId, View>, moved: Option<Job>) {
    if let Some(job) = moved
        && let Some(view) = views.get_mut(&job.id)
    {
        view.job = Some(job);
    }
}

/// How often job `id` went back to the queue for a lost peer.
async fn peer_requeues(app: &App, id: &JobId) -> Result<usize, ApiError> {
    let transitions = app.store.transitions(id).await?;
    Ok(transitions
        .iter()
        .filter(|t| t.to == JobState::Queued && t.reason.starts_with(PEER_LOST))
        .count())
}
