//! `GET /v1/nodes`: the registered runner agents and their devices.

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::Viewer;
use crate::domain::NodeRecord;
use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct NodeList {
    pub nodes: Vec<NodeRecord>,
}

/// Registered nodes, lost ones included (`lost: true`).
#[utoipa::path(
    get,
    path = "/v1/nodes", operation_id = "list_nodes",
    tag = "nodes",
    security(("bearer" = ["viewer"])),
    responses((status = 200, body = NodeList)),
)]
pub async fn list(State(state): State<AppState>, _: Viewer) -> Result<Json<NodeList>, ApiError> {
    Ok(Json(NodeList {
        nodes: state.store.nodes().await?,
    }))
}
