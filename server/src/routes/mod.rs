//! The HTTP endpoints, one module per noun (and per verb where a noun has several).

pub mod agents;
pub mod estimate;
pub mod health;
pub mod jobs;
pub mod metrics;
pub mod nodes;
pub mod openapi;
pub mod session;
pub mod tokens;

use axum::Router;
use axum::routing::{delete, get, post};

use crate::app::AppState;
use crate::domain::NodeRecord;
use crate::settings::Settings;
use scheduler::inventory::{Device, Inventory, Node};

/// Every endpoint; `app::router` adds the middleware.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(metrics::metrics))
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/v1/jobs", post(jobs::create::create).get(jobs::list::list))
        .route("/v1/jobs/{id}", get(jobs::get::get))
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel::cancel))
        .route("/v1/jobs/{id}/metrics", get(jobs::metrics::metrics))
        .route("/v1/jobs/{id}/logs", get(jobs::logs::logs))
        .route("/v1/jobs/{id}/events", get(jobs::events::events))
        .route("/v1/estimate", post(estimate::estimate))
        .route("/v1/nodes", get(nodes::list))
        .route("/v1/session", post(session::create).delete(session::delete))
        .route("/v1/tokens", post(tokens::create).get(tokens::list))
        .route("/v1/tokens/{name}", delete(tokens::revoke))
        .route("/v1/agents/register", post(agents::register::register))
        .route(
            "/v1/agents/{node}/heartbeat",
            post(agents::heartbeat::heartbeat),
        )
}

/// The live nodes' devices as the planner sees them: each device less the safety margin
/// placement keeps free, so a job admitted here can always be placed once devices are free.
pub(crate) fn planning_inventory(nodes: &[NodeRecord], settings: &Settings) -> Inventory {
    let keep = 1.0 - settings.safety_margin;
    Inventory {
        nodes: nodes
            .iter()
            .filter(|n| !n.lost)
            .map(|n| Node {
                name: n.id.clone(),
                devices: n
                    .devices
                    .iter()
                    .map(|d| Device {
                        kind: d.kind,
                        memory_bytes: (d.memory_bytes as f64 * keep) as u64,
                    })
                    .collect(),
            })
            .collect(),
    }
}
