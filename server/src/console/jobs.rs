//! `/`: the jobs table, filtered by state, name and owner and sorted as the query string says
//! (so links and reloads keep the view), read through `GET /v1/jobs`'s own paging; polled by
//! htmx while open; rows picked for comparison or bulk cancel.

use askama::Template;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use serde::Deserialize;

use super::view::{self, Layout};
use super::{Signed, error_page, render};
use crate::domain::{JobId, JobState};
use crate::routes::jobs::list::{ListParams, page as list_page};
use crate::state::AppState;
use crate::store::JobSort;

/// The page's query string: what `GET /v1/jobs` takes, empty fields meaning "any".
#[derive(Debug, Default, Deserialize)]
struct Query {
    state: Option<String>,
    name: Option<String>,
    owner: Option<String>,
    sort: Option<String>,
    cursor: Option<String>,
}

struct Row {
    id: JobId,
    short_id: String,
    name: String,
    state: &'static str,
    owner: String,
    /// The model's type and size.
    model: String,
    world_size: u32,
    zero_stage: String,
    priority: i32,
    submitted: String,
    reason: String,
    live: bool,
}

/// A column header: its label and the link that sorts by it (toggling on the current one).
struct Column {
    label: &'static str,
    href: String,
    /// `▲`/`▼` on the current sort column.
    mark: &'static str,
}

#[derive(Template)]
#[template(path = "jobs.html")]
struct JobsPage {
    layout: Layout,
    states: Vec<(&'static str, bool)>,
    name: String,
    owner: String,
    sort: String,
    columns: Vec<Column>,
    rows: Vec<Row>,
    /// This view, for htmx to poll.
    here: String,
    next: Option<String>,
    can_cancel: bool,
}

fn nonempty(s: Option<String>) -> Option<String> {
    s.map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// `/?…` with these filters.
fn link(q: &Query, sort: &str, cursor: Option<&str>) -> String {
    let mut pairs: Vec<(&str, &str)> = Vec::new();
    for (k, v) in [("state", &q.state), ("name", &q.name), ("owner", &q.owner)] {
        if let Some(v) = v {
            pairs.push((k, v));
        }
    }
    if sort != JobSort::NEWEST.as_string() {
        pairs.push(("sort", sort));
    }
    if let Some(c) = cursor {
        pairs.push(("cursor", c));
    }
    match serde_urlencoded::to_string(&pairs) {
        Ok(q) if !q.is_empty() => format!("/?{q}"),
        _ => "/".into(),
    }
}

pub async fn page(
    State(state): State<AppState>,
    Signed(caller): Signed,
    RawQuery(raw): RawQuery,
) -> Response {
    let q: Query = serde_urlencoded::from_str(raw.as_deref().unwrap_or("")).unwrap_or_default();
    let q = Query {
        state: nonempty(q.state),
        name: nonempty(q.name),
        owner: nonempty(q.owner),
        sort: nonempty(q.sort),
        cursor: nonempty(q.cursor),
    };
    let params = ListParams {
        state: q.state.clone(),
        name: q.name.clone(),
        owner: q.owner.clone(),
        sort: q.sort.clone(),
        cursor: q.cursor.clone(),
        limit: None,
    };
    let jobs = match list_page(&state, params).await {
        Ok(jobs) => jobs,
        Err(e) => return error_page(e),
    };
    let sort = q
        .sort
        .as_deref()
        .and_then(JobSort::parse)
        .unwrap_or_default();
    let columns = [
        ("Submitted", "created"),
        ("Name", "name"),
        ("State", "state"),
        ("Owner", "owner"),
        ("Priority", "priority"),
    ]
    .into_iter()
    .map(|(label, key)| {
        let current = sort.as_string().trim_start_matches('-') == key;
        // A first click sorts names ascending and the rest newest/highest first.
        let flip = if current {
            !sort.descending
        } else {
            key != "name" && key != "owner"
        };
        let next = format!("{}{key}", if flip { "-" } else { "" });
        Column {
            label,
            href: link(&q, &next, None),
            mark: match (current, sort.descending) {
                (false, _) => "",
                (true, true) => "▼",
                (true, false) => "▲",
            },
        }
    })
    .collect();
    let rows = jobs
        .jobs
        .into_iter()
        .map(|j| Row {
            short_id: view::short_id(j.id.as_str()).to_string(),
            name: j.name.unwrap_or_default(),
            state: j.state.as_str(),
            owner: j.owner,
            model: j.spec.architecture().label(),
            world_size: j.world_size,
            zero_stage: j.plan.chosen.zero_stage.index().to_string(),
            priority: j.priority,
            submitted: view::time(j.created_at),
            reason: j.reason,
            live: !j.state.is_terminal(),
            id: j.id,
        })
        .collect();
    let sort_string = sort.as_string();
    render(&JobsPage {
        layout: Layout::new("jobs", &caller),
        states: JobState::ALL
            .iter()
            .map(|s| (s.as_str(), q.state.as_deref() == Some(s.as_str())))
            .collect(),
        name: q.name.clone().unwrap_or_default(),
        owner: q.owner.clone().unwrap_or_default(),
        here: link(&q, &sort_string, q.cursor.as_deref()),
        next: jobs
            .next_cursor
            .as_deref()
            .map(|c| link(&q, &sort_string, Some(c))),
        sort: sort_string,
        columns,
        rows,
        can_cancel: caller.role.allows(crate::domain::Role::Submitter),
    })
}
