//! `/compare?id=A&id=B…`: two or more jobs' loss curves overlaid (drawn by the console script
//! from each job's metrics) and their specs side by side, differing fields marked.

use std::collections::BTreeSet;

use askama::Template;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use serde_json::Value;

use super::view::{self, Layout};
use super::{Signed, error_page, render};
use crate::domain::JobId;
use crate::routes::jobs::find;
use crate::state::AppState;

/// Jobs one comparison shows at most.
const MAX_JOBS: usize = 8;

struct Column {
    id: JobId,
    short_id: String,
    name: String,
    state: &'static str,
}

struct FieldRow {
    path: String,
    values: Vec<String>,
    differs: bool,
}

#[derive(Template)]
#[template(path = "compare.html")]
struct ComparePage {
    layout: Layout,
    jobs: Vec<Column>,
    ids: String,
    rows: Vec<FieldRow>,
}

/// Every leaf of `v` as (`a.b.c`, value), objects walked in key order.
fn leaves(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, v) in m {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(&path, v, out);
            }
        }
        leaf => out.push((prefix.to_string(), leaf.to_string())),
    }
}

pub async fn page(
    State(state): State<AppState>,
    Signed(caller): Signed,
    RawQuery(raw): RawQuery,
) -> Response {
    let pairs: Vec<(String, String)> =
        serde_urlencoded::from_str(raw.as_deref().unwrap_or("")).unwrap_or_default();
    let mut ids: Vec<String> = Vec::new();
    for (k, v) in pairs {
        if k == "id" && !v.is_empty() && !ids.contains(&v) && ids.len() < MAX_JOBS {
            ids.push(v);
        }
    }
    let mut jobs = Vec::new();
    for id in &ids {
        match find(&state, &JobId::from(id.as_str())).await {
            Ok(job) => jobs.push(job),
            Err(e) => return error_page(e),
        }
    }
    let specs: Vec<Vec<(String, String)>> = jobs
        .iter()
        .map(|j| {
            let mut out = Vec::new();
            leaves(
                "",
                &serde_json::json!({"spec": j.spec, "plan": j.plan}),
                &mut out,
            );
            out
        })
        .collect();
    let paths: BTreeSet<&String> = specs.iter().flatten().map(|(p, _)| p).collect();
    let rows = paths
        .into_iter()
        .map(|path| {
            let values: Vec<String> = specs
                .iter()
                .map(|s| {
                    s.iter()
                        .find(|(p, _)| p == path)
                        .map_or("—".into(), |(_, v)| v.clone())
                })
                .collect();
            FieldRow {
                path: path.clone(),
                differs: values.iter().any(|v| *v != values[0]),
                values,
            }
        })
        .collect();
    render(&ComparePage {
        layout: Layout::new("compare", &caller),
        ids: ids.join(","),
        jobs: jobs
            .into_iter()
            .map(|j| Column {
                short_id: view::short_id(j.id.as_str()).to_string(),
                name: j.name.unwrap_or_default(),
                state: j.state.as_str(),
                id: j.id,
            })
            .collect(),
        rows,
    })
}
