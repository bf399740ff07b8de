//! `GET /healthz` (the process answers; no token) and `GET /readyz` (the store answers, is
//! migrated, and the local agent expected under `zerotrain up` has registered).

use axum::extract::State;

use crate::auth::Viewer;
use crate::error::{ApiError, Problem};
use crate::state::AppState;
use crate::store::StoreError;

/// Liveness: the process serves requests.
#[utoipa::path(
    get,
    path = "/healthz", operation_id = "healthz",
    tag = "health",
    security(()),
    responses((status = 200, description = "ok", body = String, content_type = "text/plain")),
)]
pub async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: the store is migrated and answers; under `zerotrain up`, the local agent has
/// registered.
#[utoipa::path(
    get,
    path = "/readyz", operation_id = "readyz",
    tag = "health",
    security(("bearer" = ["viewer"])),
    responses(
        (status = 200, description = "ready", body = String, content_type = "text/plain"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn readyz(State(state): State<AppState>, _: Viewer) -> Result<&'static str, ApiError> {
    // Migrations ran when the store connected: an answering store is a migrated one.
    let unavailable = |e: StoreError| {
        tracing::warn!("readiness: {e}");
        ApiError::Unavailable("the store does not answer".into())
    };
    state.store.ping().await.map_err(unavailable)?;
    if state.settings.expect_local_agent {
        let nodes = state.store.nodes().await.map_err(unavailable)?;
        if !nodes.iter().any(|n| !n.lost) {
            return Err(ApiError::Unavailable(
                "waiting for the local agent to register".into(),
            ));
        }
    }
    Ok("ready")
}
