//! `POST /v1/agents/register`: a node announces its devices; it gets an id and the token its
//! heartbeats carry.

use std::sync::atomic::Ordering;

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use wire::agent::{RegisterRequest, RegisterResponse};

use crate::auth::{Joining, new_token};
use crate::error::{ApiError, Problem};
use crate::state::AppState;
use crate::store::token_hash;

/// Register a runner agent (agent join token, or a Slurm allocation's token: its node then
/// serves that allocation's job only).
#[utoipa::path(
    post,
    path = "/v1/agents/register", operation_id = "register_agent",
    tag = "agents",
    security(("bearer" = ["agent_join"])),
    request_body(content = Object,
        description = "`RegisterRequest`: the node's name, its devices ({kind, memory_bytes}) \
            and the host its ranks accept TCP connections on"),
    responses(
        (status = 201, description = "`RegisterResponse`: node_id, agent_token, \
            heartbeat_interval_ms, and host when the server knows the node's address better \
            (a Slurm node's)", body = Object),
        (status = 400, body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn register(
    State(state): State<AppState>,
    joining: Joining,
    body: Result<Json<RegisterRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<RegisterResponse>), ApiError> {
    let Json(req) = body?;
    if req.devices.is_empty() {
        return Err(ApiError::BadRequest {
            field: "devices".into(),
            reason: "a node offers at least one device".into(),
        });
    }
    if req.name.trim().is_empty() {
        return Err(ApiError::BadRequest {
            field: "name".into(),
            reason: "must not be empty".into(),
        });
    }
    // An allocation's node is where Slurm says it is, whatever its agent thinks.
    let (slurm_host, allocation) = match &joining {
        Joining::Agent => (None, None),
        Joining::Allocation(a) => {
            let slurm_node = state.slurm.as_ref().and_then(|s| s.node(&req.name));
            (slurm_node.map(|n| n.addr), Some(a))
        }
    };
    let host = slurm_host.clone().unwrap_or_else(|| req.host.clone());
    let token = new_token();
    let node = state
        .store
        .register_node(
            &req.name,
            &host,
            &req.devices,
            &token_hash(&token),
            allocation,
        )
        .await?;
    tracing::info!(node = %node.id, name = %node.name, devices = node.devices.len(), "registered");
    // New devices: queued jobs may fit now.
    state.devices_free.store(true, Ordering::Relaxed);
    state.wake_scheduler.notify_one();
    let interval = state.settings.heartbeat_interval.as_millis();
    Ok((
        StatusCode::CREATED,
        Json(RegisterResponse {
            node_id: node.id,
            agent_token: token,
            heartbeat_interval_ms: u64::try_from(interval).unwrap_or(u64::MAX),
            host: slurm_host,
        }),
    ))
}
