//! `/nodes`: every registered node, its devices, which job's rank holds each and how much of
//! it that rank takes (measured once it reported, else predicted), polled by htmx.

use askama::Template;
use axum::extract::State;
use axum::response::Response;

use super::view::{self, Layout};
use super::{Signed, error_page, render};
use crate::domain::{JobId, NodeId};
use crate::error::ApiError;
use crate::state::AppState;

struct DeviceRow {
    index: usize,
    kind: String,
    memory: String,
    /// (job id, short id, rank) of the rank holding it.
    holder: Option<(JobId, String, u32)>,
    used: String,
    free: String,
    /// Used over memory, 0-1.
    fraction: String,
}

struct NodeView {
    name: String,
    id: NodeId,
    host: String,
    lost: bool,
    heartbeat: String,
    devices: Vec<DeviceRow>,
}

#[derive(Template)]
#[template(path = "nodes.html")]
struct NodesPage {
    layout: Layout,
    nodes: Vec<NodeView>,
}

pub async fn page(State(state): State<AppState>, Signed(caller): Signed) -> Response {
    match load(&state).await {
        Ok(nodes) => render(&NodesPage {
            layout: Layout::new("nodes", &caller),
            nodes,
        }),
        Err(e) => error_page(e),
    }
}

async fn load(state: &AppState) -> Result<Vec<NodeView>, ApiError> {
    let now = state.now_ms();
    let mut views = Vec::new();
    for node in state.store.nodes().await? {
        let held = state.store.assignments_for_node(&node.id).await?;
        let mut devices = Vec::new();
        for (index, d) in node.devices.iter().enumerate() {
            let holder = held.iter().find_map(|(job, ranks)| {
                ranks
                    .iter()
                    .find(|a| a.device as usize == index)
                    .map(|a| (job, a.rank))
            });
            let used = match holder {
                Some((job, rank)) => {
                    let measured = state
                        .store
                        .rank_memory(&job.id)
                        .await?
                        .into_iter()
                        .find(|r| r.rank == rank)
                        .map(|r| r.measured.total());
                    measured.unwrap_or_else(|| job.plan.rank_bytes(rank as usize).total())
                }
                None => 0,
            };
            devices.push(DeviceRow {
                index,
                kind: format!("{:?}", d.kind).to_lowercase(),
                memory: view::bytes(d.memory_bytes),
                holder: holder.map(|(job, rank)| {
                    (
                        job.id.clone(),
                        view::short_id(job.id.as_str()).to_string(),
                        rank,
                    )
                }),
                used: view::bytes(used),
                free: view::bytes(d.memory_bytes.saturating_sub(used)),
                fraction: format!("{:.3}", used as f64 / d.memory_bytes.max(1) as f64),
            });
        }
        let ago = (now - node.last_heartbeat).max(0) as f64 / 1000.0;
        views.push(NodeView {
            heartbeat: format!("{} ({ago:.1} s ago)", view::time(node.last_heartbeat)),
            name: node.name,
            id: node.id,
            host: node.host,
            lost: node.lost,
            devices,
        });
    }
    Ok(views)
}
