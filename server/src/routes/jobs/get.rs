//! `GET /v1/jobs/{id}`: a job and the history of its states.

use axum::Json;
use axum::extract::{Path, State};
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::Viewer;
use crate::domain::{Job, JobId, Transition};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct JobDetail {
    #[serde(flatten)]
    pub job: Job,
    /// Every state change, oldest first, with its time and reason.
    pub transitions: Vec<Transition>,
}

/// A job with its state history.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}", operation_id = "get_job",
    tag = "jobs",
    security(("bearer" = ["viewer"])),
    params(("id" = String, Path, description = "Job id")),
    responses(
        (status = 200, body = JobDetail),
        (status = 404, body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn get(
    State(state): State<AppState>,
    _: Viewer,
    Path(id): Path<JobId>,
) -> Result<Json<JobDetail>, ApiError> {
    Ok(Json(detail(&state, &id).await?))
}

/// Job `id` with its history (or a 404), as the endpoint and the console's job page show it.
pub(crate) async fn detail(state: &AppState, id: &JobId) -> Result<JobDetail, ApiError> {
    let job = super::find(state, id).await?;
    let transitions = state.store.transitions(id).await?;
    Ok(JobDetail { job, transitions })
}
