//! `GET /v1/jobs`: filtered by state, name and owner, sorted (newest first by default), a page
//! at a time. The console's jobs page reads the same pages through [`page`].

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Viewer;
use crate::domain::{Job, JobId, JobState};
use crate::error::{ApiError, Problem};
use crate::state::AppState;
use crate::store::{JobFilter, JobSort};

const DEFAULT_LIMIT: u32 = 50;
const MAX_LIMIT: u32 = 500;

#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// Only jobs in this state.
    #[param(value_type = Option<JobState>)]
    pub state: Option<String>,
    /// Only jobs with this name.
    pub name: Option<String>,
    /// Only jobs submitted with the token of this name.
    pub owner: Option<String>,
    /// `created`, `name`, `state`, `owner` or `priority`, with a leading `-` for descending
    /// (default `-created`: newest first); ties go in submission order.
    #[param(pattern = "^-?(created|name|state|owner|priority)$")]
    pub sort: Option<String>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
    /// Jobs per page (default 50).
    #[param(minimum = 1, maximum = 500)]
    pub limit: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobPage {
    pub jobs: Vec<Job>,
    /// Pass as `cursor` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// Jobs, newest first unless `sort` says otherwise.
#[utoipa::path(
    get,
    path = "/v1/jobs", operation_id = "list_jobs",
    tag = "jobs",
    security(("bearer" = ["viewer"])),
    params(ListParams),
    responses(
        (status = 200, body = JobPage),
        (status = 400, description = "A query parameter is not one this takes (`field` names it)",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    _: Viewer,
    params: Result<Query<ListParams>, QueryRejection>,
) -> Result<Json<JobPage>, ApiError> {
    let Query(params) = params?;
    Ok(Json(page(&state, params).await?))
}

/// The page of jobs `params` asks for.
pub(crate) async fn page(state: &AppState, params: ListParams) -> Result<JobPage, ApiError> {
    let job_state = match &params.state {
        Some(s) => Some(JobState::parse(s).ok_or_else(|| ApiError::BadRequest {
            field: "state".into(),
            reason: format!(
                "{s:?} is not a job state; use one of {}",
                JobState::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            ),
        })?),
        None => None,
    };
    let sort = match &params.sort {
        Some(s) => JobSort::parse(s).ok_or_else(|| ApiError::BadRequest {
            field: "sort".into(),
            reason: format!(
                "{s:?}: use created, name, state, owner or priority, \
                 with a leading - for descending"
            ),
        })?,
        None => JobSort::NEWEST,
    };
    let limit = params.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ApiError::BadRequest {
            field: "limit".into(),
            reason: format!("{limit} is not in 1-{MAX_LIMIT}"),
        });
    }
    // One more than asked tells whether another page follows.
    let mut jobs = state
        .store
        .list_jobs(&JobFilter {
            state: job_state,
            name: params.name,
            owner: params.owner,
            sort,
            before: params.cursor.map(JobId::from),
            limit: limit + 1,
        })
        .await?;
    let next_cursor = if jobs.len() > limit as usize {
        jobs.truncate(limit as usize);
        jobs.last().map(|j| j.id.to_string())
    } else {
        None
    };
    Ok(JobPage { jobs, next_cursor })
}
