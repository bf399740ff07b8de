//! `GET /v1/jobs/{id}/metrics`: the job's steps and each rank's memory, measured next to
//! predicted, by category.

use axum::Json;
use axum::extract::{Path, State};
use scheduler::memory::Breakdown;
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::Viewer;
use crate::domain::{Job, JobId, JobState, NodeId, RankMemoryRecord, StepRecord};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct JobMetrics {
    #[schema(value_type = String)]
    pub job_id: JobId,
    pub state: JobState,
    /// The plan's bytes per rank, by category (before any rank reported).
    #[schema(value_type = Object)]
    pub predicted_per_rank_bytes: Breakdown,
    /// Every step of every attempt, in order: loss, loss scale, tokens/s, skipped, duration.
    pub steps: Vec<StepRecord>,
    /// Per rank: peak bytes measured by the trainer and predicted by the memory model.
    pub ranks: Vec<RankMemoryRecord>,
    /// Where each rank of the current attempt runs, with its device's memory (empty until
    /// the job is placed).
    pub devices: Vec<RankDevice>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RankDevice {
    pub rank: u32,
    #[schema(value_type = String)]
    pub node_id: NodeId,
    pub device: u32,
    pub memory_bytes: u64,
}

/// A job's step series and per-rank memory.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/metrics", operation_id = "job_metrics",
    tag = "jobs",
    security(("bearer" = ["viewer"])),
    params(("id" = String, Path, description = "Job id")),
    responses(
        (status = 200, body = JobMetrics),
        (status = 404, body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn metrics(
    State(state): State<AppState>,
    _: Viewer,
    Path(id): Path<JobId>,
) -> Result<Json<JobMetrics>, ApiError> {
    let job = super::find(&state, &id).await?;
    Ok(Json(job_metrics(&state, job).await?))
}

/// `job`'s metrics, as the endpoint and the console's job page show them.
pub(crate) async fn job_metrics(state: &AppState, job: Job) -> Result<JobMetrics, ApiError> {
    let steps = state.store.steps(&job.id).await?;
    let ranks = state.store.rank_memory(&job.id).await?;
    let nodes = state.store.nodes().await?;
    let devices = state
        .store
        .assignments_for_job(&job.id)
        .await?
        .into_iter()
        .map(|a| {
            let memory_bytes = nodes
                .iter()
                .find(|n| n.id == a.node_id)
                .and_then(|n| n.devices.get(a.device as usize))
                .map_or(0, |d| d.memory_bytes);
            RankDevice {
                rank: a.rank,
                node_id: a.node_id,
                device: a.device,
                memory_bytes,
            }
        })
        .collect();
    Ok(JobMetrics {
        job_id: job.id,
        state: job.state,
        predicted_per_rank_bytes: job.plan.per_rank_bytes,
        steps,
        ranks,
        devices,
    })
}
