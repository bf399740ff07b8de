//! `POST /v1/jobs/{id}/cancel`: the job ends as cancelled; its agents are told to stop at
//! their next heartbeat.

use axum::Json;
use axum::extract::{Path, State};

use crate::auth::Submitter;
use crate::domain::{Job, JobId, JobState, Role};
use crate::error::{ApiError, Problem};
use crate::state::AppState;

/// Cancel a job (its owner, or an admin).
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/cancel", operation_id = "cancel_job",
    tag = "jobs",
    security(("bearer" = ["submitter"])),
    params(("id" = String, Path, description = "Job id")),
    responses(
        (status = 200, description = "Cancelled", body = Job),
        (status = 403, description = "Not the job's owner or an admin, or not a submitter's \
            token", body = Problem, content_type = "application/problem+json"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The job had already ended",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn cancel(
    State(state): State<AppState>,
    Submitter(caller): Submitter,
    Path(id): Path<JobId>,
) -> Result<Json<Job>, ApiError> {
    let job = super::find(&state, &id).await?;
    if job.owner != caller.name && caller.role < Role::Admin {
        return Err(ApiError::NotOwner);
    }
    const LIVE: [JobState; 3] = [JobState::Queued, JobState::Scheduled, JobState::Running];
    let reason = format!("cancelled by {}", caller.name);
    match state
        .transition(&id, &LIVE, JobState::Cancelled, &reason)
        .await?
    {
        Some(job) => Ok(Json(job)),
        // Ended meanwhile (or before): say how.
        None => {
            let job = super::find(&state, &id).await?;
            Err(ApiError::JobFinished {
                id,
                state: job.state,
            })
        }
    }
}
