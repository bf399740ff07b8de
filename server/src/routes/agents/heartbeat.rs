//! `POST /v1/agents/{node}/heartbeat`: the node is alive; its reports are applied; the reply
//! carries the assignments it should start and the runs it should stop.

use std::num::NonZeroU32;

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use runner::agent::protocol::{Assignment, Heartbeat, HeartbeatResponse, RankSlot, RankTransport};
use scheduler::spec::{Auto, JobSpec, ZeroStage};

use crate::app::{AppState, now_ms};
use crate::auth::AgentNode;
use crate::domain::{Job, JobState, NodeRecord};
use crate::error::{ApiError, Problem};
use crate::scheduling::StoredPlan;

/// Heartbeat of a registered agent (its agent token).
#[utoipa::path(
    post,
    path = "/v1/agents/{node}/heartbeat", operation_id = "agent_heartbeat",
    tag = "agents",
    params(("node" = String, Path, description = "The node id registration returned")),
    request_body(content = Object,
        description = "`Heartbeat`: reports since the last beat and the (job, attempt) pairs \
            running here"),
    responses(
        (status = 200, description = "`HeartbeatResponse`: assignments to start, (job, attempt) \
            pairs to stop", body = Object),
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
    if !state.store.heartbeat(&node.id, now_ms()).await? {
        return Err(ApiError::NodeLost { id: node.id });
    }
    super::reports::apply(&state, &node, beat.reports).await?;
    let assignments = assignments(&state, &node, &beat.running).await?;
    let mut cancel = Vec::new();
    for (id, attempt) in beat.running {
        let stop = match state.store.get_job(&id).await? {
            None => true,
            Some(job) => {
                job.attempt != attempt || job.state.is_terminal() || job.state == JobState::Queued
            }
        };
        if stop {
            cancel.push((id, attempt));
        }
    }
    Ok(Json(HeartbeatResponse {
        assignments,
        cancel,
    }))
}

/// This node's part of every scheduled job it is not running yet. A job spanning nodes runs
/// over TCP: rank 0's node gets it at once and reports where it listens; the others get it
/// once that address is known.
async fn assignments(
    state: &AppState,
    node: &NodeRecord,
    running: &[(String, u32)],
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
        let spec = match assignment_spec(&job) {
            Ok(spec) => spec,
            // Sending it would fail on the node; retrying it would fail again.
            Err(reason) => {
                tracing::error!(job = %job.id, "{reason}");
                let (from, to) = ([JobState::Scheduled], JobState::Failed);
                state
                    .transition_attempt(&job.id, job.attempt, &from, to, &reason)
                    .await?;
                continue;
            }
        };
        out.push(Assignment {
            spec,
            job_id: job.id.clone(),
            attempt: job.attempt,
            ranks,
            transport,
            out_dir: state.settings.job_dir(&job.id).display().to_string(),
        });
    }
    Ok(out)
}

/// The stored spec with the plan's choices in place of its `"auto"` fields, so every node
/// trains exactly the configuration admission planned.
pub fn assignment_spec(job: &Job) -> Result<serde_json::Value, String> {
    let corrupt = |what: &str| format!("the stored {what}");
    let plan = StoredPlan::of(job).ok_or_else(|| corrupt("plan is unreadable"))?;
    let mut spec: JobSpec =
        serde_json::from_value(job.spec.clone()).map_err(|e| corrupt(&format!("spec: {e}")))?;
    let stage = ZeroStage::from_index(u64::from(plan.zero_stage))
        .ok_or_else(|| corrupt("plan has no such ZeRO stage"))?;
    let micro = NonZeroU32::new(plan.micro_batch_size)
        .ok_or_else(|| corrupt("plan has a zero micro-batch"))?;
    let accum = NonZeroU32::new(plan.grad_accum_steps)
        .ok_or_else(|| corrupt("plan has zero accumulation steps"))?;
    spec.zero.stage = Auto::Fixed(stage);
    spec.activation_checkpointing = Auto::Fixed(plan.activation_checkpointing);
    spec.training.micro_batch_size = Auto::Fixed(micro);
    spec.training.grad_accum_steps = accum;
    serde_json::to_value(&spec).map_err(|e| corrupt(&format!("spec: {e}")))
}
