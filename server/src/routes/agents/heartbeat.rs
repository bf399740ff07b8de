//! `POST /v1/agents/{node}/heartbeat`: the node is alive; its reports are applied (those it
//! may make); the reply carries the assignments it should start, the attempts it runs that are
//! over, and the reports refused. With `wait_ms` the reply waits until there is an assignment
//! or a fence for the node, or the wait is up (a long-poll).

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use scheduler::spec::InitFrom;
use tokio::sync::broadcast::error::RecvError;
use tokio::time::Instant;
use wire::agent::{
    Assignment, Heartbeat, HeartbeatResponse, RankSlot, RankTransport, RefusalReason, ResumeFrom,
};
use wire::artifact::Artifact;

use crate::auth::AgentNode;
use crate::domain::{Job, JobId, JobState, NodeId, NodeRecord};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

/// Heartbeat of a registered agent (its agent token).
#[utoipa::path(
    post,
    path = "/v1/agents/{node}/heartbeat", operation_id = "agent_heartbeat",
    tag = "agents",
    security(("bearer" = ["node"])),
    params(("node" = String, Path, description = "The node id registration returned")),
    request_body(content = Object,
        description = "`Heartbeat`: reports since the last beat, the (job, attempt) pairs \
            running here, and `wait_ms`, how long the reply may wait for work"),
    responses(
        (status = 200, description = "`HeartbeatResponse`: assignments to start, (job, attempt) \
            pairs to stop, reports refused", body = Object),
        (status = 400, description = "The body is not a Heartbeat",
            body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "The node was declared lost: register again",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn heartbeat(
    State(state): State<AppState>,
    AgentNode(node): AgentNode,
    body: Result<Json<Heartbeat>, JsonRejection>,
) -> Result<Json<HeartbeatResponse>, ApiError> {
    let Json(beat) = body?;
    if !state.store.heartbeat(&node.id, state.now_ms()).await? {
        state
            .metrics
            .refused(RefusalReason::NodeLost, beat.reports.len());
        return Err(ApiError::NodeLost { id: node.id });
    }
    let refused = super::reports::apply(&state, &node, beat.reports).await?;
    let deadline = Instant::now() + wait(&state, beat.wait_ms);
    // Subscribed before looking, so a placement made meanwhile is not missed.
    let mut wake = state.agent_wake.subscribe();
    let mut stop = state.shutdown.subscribe();
    loop {
        let assignments = assignments(&state, &node, &beat.running).await?;
        let cancel = over(&state, &beat.running).await?;
        let now = Instant::now();
        if !assignments.is_empty() || !cancel.is_empty() || now >= deadline || *stop.borrow() {
            return Ok(Json(HeartbeatResponse {
                assignments,
                cancel,
                refused,
            }));
        }
        // Another replica's placements wake nobody here: look again now and then.
        let look_again = deadline.min(now + state.settings.scheduling_interval);
        let _waiting = Waiting::count(&state);
        tokio::select! {
            () = woken(&mut wake, &node.id) => {}
            () = tokio::time::sleep_until(look_again) => {}
            _ = stop.changed() => {}
        }
    }
}

/// Counts a heartbeat as waiting until dropped (also when its client goes away).
struct Waiting<'a>(&'a prometheus::Gauge);

impl Waiting<'_> {
    fn count(state: &AppState) -> Waiting<'_> {
        let gauge = &state.metrics.server.agent_heartbeats_waiting;
        gauge.inc();
        Waiting(gauge)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// How long a heartbeat asking for `wait_ms` may wait: well inside the request timeout and
/// the heartbeat timeout (the node counts as alive from the start of its heartbeat).
fn wait(state: &AppState, wait_ms: u64) -> Duration {
    let s = &state.settings;
    Duration::from_millis(wait_ms)
        .min(s.request_timeout / 2)
        .min(s.heartbeat_timeout / 2)
}

/// Returns once a wake for `node` (or for every node) arrives.
async fn woken(wake: &mut tokio::sync::broadcast::Receiver<Option<NodeId>>, node: &NodeId) {
    loop {
        match wake.recv().await {
            Ok(Some(n)) if n != *node => continue,
            // Missed wakes may have been for this node.
            Ok(_) | Err(RecvError::Lagged(_)) => return,
            Err(RecvError::Closed) => std::future::pending().await,
        }
    }
}

/// The attempts of `running` that are over: the job is gone, ended, back in the queue, or at
/// a later attempt.
async fn over(state: &AppState, running: &[(JobId, u32)]) -> Result<Vec<(JobId, u32)>, ApiError> {
    let mut cancel = Vec::new();
    for (id, attempt) in running {
        let stop = match state.store.get_job(id).await? {
            None => true,
            Some(job) => {
                job.attempt != *attempt || job.state.is_terminal() || job.state == JobState::Queued
            }
        };
        if stop {
            cancel.push((id.clone(), *attempt));
        }
    }
    Ok(cancel)
}

/// This node's part of every scheduled job it is not running yet. A job spanning nodes runs
/// over TCP: rank 0's node gets it at once and reports where it listens; the others get it
/// once that address is known.
async fn assignments(
    state: &AppState,
    node: &NodeRecord,
    running: &[(JobId, u32)],
) -> Result<Vec<Assignment>, ApiError> {
    let mut out = Vec::new();
    for (job, records) in state.store.assignments_for_node(&node.id).await? {
        let key = (job.id.clone(), job.attempt);
        if job.state != JobState::Scheduled || running.contains(&key) {
            continue;
        }
        let mut ranks: Vec<RankSlot> = records
            .iter()
            .filter(|r| r.attempt == job.attempt && r.node_id == node.id)
            .map(|r| RankSlot {
                rank: r.rank as usize,
                device: r.device as usize,
            })
            .collect();
        if ranks.is_empty() {
            continue;
        }
        ranks.sort_by_key(|r| r.rank);
        let spans_nodes = state
            .store
            .assignments_for_job(&job.id)
            .await?
            .iter()
            .any(|r| r.attempt == job.attempt && r.node_id != node.id);
        let transport = if !spans_nodes {
            RankTransport::Local
        } else if ranks[0].rank == 0 {
            RankTransport::Tcp { master: None }
        } else if let Some(master) = &job.master {
            RankTransport::Tcp {
                master: Some(master.clone()),
            }
        } else {
            continue;
        };
        let resume_from = resume_from(state, &job).await?;
        let init_from = init_from(state, &job).await?;
        out.push(Assignment {
            job_id: job.id,
            attempt: job.attempt,
            ranks,
            transport,
            resume_from,
            init_from,
            spec: job.spec,
            plan: job.plan,
        });
    }
    Ok(out)
}

/// The newest checkpoint an earlier attempt committed (the server recorded it, with all its
/// files), else the other job's checkpoint the spec's `resume_from` names; and the names of
/// its files (the agent fetches them through this job, `agents::artifacts::download`).
async fn resume_from(state: &AppState, job: &Job) -> Result<Option<ResumeFrom>, ApiError> {
    let committed = state.store.checkpoints(&job.id).await?;
    let (step, uploads) =
        if let Some(newest) = committed.iter().rev().find(|c| c.attempt < job.attempt) {
            let mut uploads = state.store.artifacts(&job.id).await?;
            uploads.retain(|a| a.attempt == newest.attempt);
            (newest.step, uploads)
        } else if let Some(from) = &job.spec.resume_from {
            (from.step, listed_by(state, &from.job).await?)
        } else {
            return Ok(None);
        };
    let files = uploads
        .into_iter()
        .filter(|a| Artifact::step_of(&a.name) == Some(step))
        .map(|a| a.name)
        .collect();
    Ok(Some(ResumeFrom { step, files }))
}

/// The weights files of the other job's export the spec's `model.init_from` names (the agent
/// fetches them through this job, `agents::artifacts::download`); none when it names none.
async fn init_from(state: &AppState, job: &Job) -> Result<Vec<String>, ApiError> {
    let Some(InitFrom::Artifact(from)) = &job.spec.model.init_from else {
        return Ok(Vec::new());
    };
    Ok(listed_by(state, &from.job)
        .await?
        .into_iter()
        .filter(|a| Artifact::parse(&a.name).is_some_and(Artifact::is_weights))
        .map(|a| a.name)
        .collect())
}

/// The files another job lists (of each name, its newest attempt's); none for no such job.
async fn listed_by(
    state: &AppState,
    job_id: &str,
) -> Result<Vec<crate::store::ArtifactRecord>, ApiError> {
    Ok(match state.store.get_job(&JobId::from(job_id)).await? {
        Some(other) => crate::artifacts::of_job(state, &other).await?,
        None => Vec::new(),
    })
}
