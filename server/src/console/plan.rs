//! `/plan[?from=JOB]`: a spec editor (JSON, native or DeepSpeed form, with fields for the
//! common knobs) whose estimate per ZeRO stage the console script fetches from
//! `POST /v1/estimate` as you type, and which submits to `POST /v1/jobs`. `from` starts from
//! another job's spec (resubmit).

use askama::Template;
use axum::extract::{Query, State};
use axum::response::Response;
use serde::Deserialize;

use super::view::Layout;
use super::{Signed, error_page, render};
use crate::domain::{JobId, Role};
use crate::routes::jobs::find;
use crate::state::AppState;

/// What a fresh editor holds: the smallest model, a few steps.
const STARTER: &str = r#"{
  "name": "tiny",
  "model": {"preset": "gpt2-tiny"},
  "world_size": 1,
  "precision": {"dtype": "fp32"},
  "zero": {"stage": "auto"},
  "training": {"micro_batch_size": 4, "seq_len": 64, "steps": 50}
}"#;

#[derive(Debug, Deserialize)]
pub struct PlanQuery {
    from: Option<String>,
}

#[derive(Template)]
#[template(path = "plan.html")]
struct PlanPage {
    layout: Layout,
    spec: String,
    presets: &'static [&'static str],
    /// The largest registered device, in GiB: what the estimate compares against at first.
    device_gib: String,
    can_submit: bool,
}

pub async fn page(
    State(state): State<AppState>,
    Signed(caller): Signed,
    Query(q): Query<PlanQuery>,
) -> Response {
    let spec = match q.from.filter(|f| !f.is_empty()) {
        Some(id) => match find(&state, &JobId::from(id)).await {
            Ok(job) => serde_json::to_string_pretty(&job.spec).unwrap_or_default(),
            Err(e) => return error_page(e),
        },
        None => STARTER.to_string(),
    };
    let largest = match state.store.nodes().await {
        Ok(nodes) => nodes
            .iter()
            .filter(|n| !n.lost)
            .flat_map(|n| n.devices.iter().map(|d| d.memory_bytes))
            .max(),
        Err(e) => return error_page(e.into()),
    };
    let gib = largest.map_or(80.0, |b| b as f64 / (1u64 << 30) as f64);
    render(&PlanPage {
        layout: Layout::new("plan", &caller),
        spec,
        presets: scheduler::spec::PRESET_NAMES,
        device_gib: format!("{gib:.2}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string(),
        can_submit: caller.role.allows(Role::Submitter),
    })
}
