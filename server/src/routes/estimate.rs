//! `POST /v1/estimate`: what `zerotrain estimate --json` prints for a spec, planned against the
//! registered devices, and which registered nodes could hold its ranks.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use scheduler::memory::DeviceKind;
use scheduler::plan;
use scheduler::report::Report;
use scheduler::spec::{self, Auto, JobSpec, Purpose};
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::Viewer;
use crate::domain::{NodeId, NodeRecord};
use crate::error::{ApiError, Problem};
use crate::routes::jobs::spec::JobSpecBody;
use crate::routes::planning_inventory;
use crate::settings::Settings;
use crate::state::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct Estimate {
    /// `scheduler::report::Report`: per-rank bytes for every ZeRO stage, communication, and
    /// the plan on the registered devices (`plan.fits`).
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub report: serde_json::Value,
    /// Every live node, and how much of the job it could hold.
    pub nodes: Vec<NodeFit>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct NodeFit {
    #[schema(value_type = String)]
    pub node_id: NodeId,
    pub name: String,
    /// Devices of this node that could hold one rank (less the safety margin).
    pub devices_that_fit: usize,
    /// The node alone could hold every rank of the job.
    pub holds_job: bool,
}

/// Estimate a job's memory and plan it on the registered devices.
///
/// Takes what `POST /v1/jobs` takes; a bare parameter count (`model.params`) is allowed.
/// The stage table includes the overhead of the kind of device the job would run on (its
/// `device`, or for `"auto"` GPUs when any are registered). With
/// `"compare": true` beside the spec's fields, the answer adds `compare`: DeepSpeed's and
/// accelerate's estimates for the same model and world size, and why each differs.
#[utoipa::path(
    post,
    path = "/v1/estimate", operation_id = "estimate",
    tag = "jobs",
    security(("bearer" = ["viewer"])),
    request_body(content = JobSpecBody, content_type = "application/json"),
    responses(
        (status = 200, body = Estimate),
        (status = 422, body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn estimate(
    State(state): State<AppState>,
    _: Viewer,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Estimate>, ApiError> {
    let body = body?;
    let text = std::str::from_utf8(&body)
        .map_err(|e| ApiError::spec("spec", format!("not UTF-8: {e}")))?;
    let mut value = spec::read_json(text)?;
    let compare = match value.as_object_mut().and_then(|m| m.remove("compare")) {
        None => false,
        Some(serde_json::Value::Bool(b)) => b,
        Some(other) => {
            return Err(ApiError::spec(
                "compare",
                format!("must be true or false, not {other}"),
            ));
        }
    };
    let parsed = JobSpec::parse_value(value, Purpose::Estimate)?;
    let records = state.store.nodes().await?;
    let inventory = planning_inventory(&records, state.slurm.as_ref(), &state.settings);
    let kind = plan::device_kind(&parsed.spec, &inventory);
    let nodes = records
        .iter()
        .filter(|n| !n.lost)
        .map(|n| node_fit(&parsed.spec, kind, n, &state.settings))
        .collect::<Result<Vec<_>, _>>()?;
    let mut report = Report::new(&parsed.spec, parsed.unsupported_keys, &inventory, kind)?;
    if compare {
        report = report.with_comparison(&parsed.spec);
    }
    let report = serde_json::to_value(&report).map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(Estimate { report, nodes }))
}

/// Plans the job on `node` alone, on its devices of `kind` (the kind the whole cluster would
/// run it on): how many of them hold a rank, and whether they hold them all.
fn node_fit(
    spec: &JobSpec,
    kind: DeviceKind,
    node: &NodeRecord,
    settings: &Settings,
) -> Result<NodeFit, ApiError> {
    let one = planning_inventory(std::slice::from_ref(node), None, settings);
    let spec = JobSpec {
        device: Auto::Fixed(kind),
        ..spec.clone()
    };
    let (devices_that_fit, holds_job) = match plan::plan(&spec, &one) {
        Ok(plan) => (plan.devices_that_fit, true),
        Err(scheduler::Error::DoesNotFit(no)) => (no.fitting_devices, false),
        Err(scheduler::Error::NoDevicesOfKind(_)) => (0, false),
        Err(e) => return Err(e.into()),
    };
    Ok(NodeFit {
        node_id: node.id.clone(),
        name: node.name.clone(),
        devices_that_fit,
        holds_job,
    })
}
