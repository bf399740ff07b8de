//! `GET /metrics`: every series in the Prometheus text format.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use crate::auth::Viewer;
use crate::error::ApiError;
use crate::state::AppState;

/// Prometheus metrics: jobs by state, scheduling, HTTP requests, and running jobs' training
/// series.
#[utoipa::path(
    get,
    path = "/metrics", operation_id = "prometheus_metrics",
    tag = "health",
    security(("bearer" = ["viewer"])),
    responses((status = 200, body = String, content_type = "text/plain; version=0.0.4")),
)]
pub async fn metrics(
    State(state): State<AppState>,
    _: Viewer,
) -> Result<impl IntoResponse, ApiError> {
    // Counted at scrape time, so every replica reports the store's truth.
    state
        .metrics
        .set_job_counts(&state.store.count_by_state().await?);
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    ))
}
