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

use axum::{Extension, Router};
use utoipa::OpenApi as _;
use utoipa::openapi::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::domain::NodeRecord;
use crate::settings::Settings;
use crate::slurm::Slurm;
use crate::state::AppState;
use scheduler::inventory::{DeviceSlot, Inventory, Node};

/// Every endpoint, and the OpenAPI document of exactly these. Each is registered through
/// `routes!`, which takes its path and methods from the handler's `#[utoipa::path]`, and
/// nothing else adds a route here: the router and the document cannot disagree. (One `routes!`
/// per path: utoipa-axum would route every handler of one call on every path of it.)
pub fn api() -> (Api, OpenApi) {
    let (router, doc) = OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(metrics::metrics))
        .routes(routes!(openapi::openapi_json))
        .routes(routes!(jobs::create::create, jobs::list::list))
        .routes(routes!(jobs::get::get))
        .routes(routes!(jobs::cancel::cancel))
        .routes(routes!(jobs::metrics::metrics))
        .routes(routes!(jobs::logs::logs))
        .routes(routes!(jobs::events::events))
        .routes(routes!(jobs::artifacts::list))
        .routes(routes!(jobs::artifacts::download))
        .routes(routes!(estimate::estimate))
        .routes(routes!(nodes::list))
        .routes(routes!(session::create, session::delete))
        .routes(routes!(tokens::create, tokens::list))
        .routes(routes!(tokens::revoke))
        .routes(routes!(agents::register::register))
        .routes(routes!(agents::heartbeat::heartbeat))
        .routes(routes!(agents::artifacts::download))
        .split_for_parts();
    let (transfers, transfers_doc) = OpenApiRouter::new()
        .routes(routes!(agents::artifacts::upload))
        .split_for_parts();
    let mut doc = doc;
    doc.merge(transfers_doc);
    (Api { router, transfers }, openapi::finish(doc))
}

/// The endpoints, in two routers: `transfers` take bodies of any size and length of time
/// (uploads of model files), so `app::router` gives them no body limit and no timeout.
pub struct Api {
    pub router: Router<AppState>,
    pub transfers: Router<AppState>,
}

/// Every endpoint, serving its own document at `/openapi.json`; `app::router` adds the
/// console and the middleware.
pub fn routes() -> Api {
    let (api, doc) = api();
    let served = Extension(openapi::Served::new(&doc));
    Api {
        router: api.router.layer(served.clone()),
        transfers: api.transfers.layer(served),
    }
}

/// The live nodes' devices as the planner sees them, and those of the Slurm partitions'
/// nodes (`slurm`): each device less the safety margin placement keeps free, so a job admitted
/// here can always be placed once devices are free.
pub(crate) fn planning_inventory(
    nodes: &[NodeRecord],
    slurm: Option<&Slurm>,
    settings: &Settings,
) -> Inventory {
    let keep = 1.0 - settings.safety_margin;
    let registered = nodes.iter().filter(|n| !n.lost).map(|n| Node {
        name: n.id.to_string(),
        devices: n.devices.clone(),
    });
    let partitions = slurm.map(|s| s.inventory(None, false)).unwrap_or_default();
    Inventory {
        nodes: registered
            .chain(partitions)
            .map(|n| Node {
                devices: n
                    .devices
                    .iter()
                    .map(|d| DeviceSlot {
                        kind: d.kind,
                        memory_bytes: (d.memory_bytes as f64 * keep) as u64,
                    })
                    .collect(),
                ..n
            })
            .collect(),
    }
}
