//! `/jobs/{id}`: a job's state and history, spec and plan, memory measured against predicted,
//! bytes sent per collective and its log, as tables that need no JavaScript; the charts (from
//! `GET /v1/jobs/{id}/metrics`) and the followed log (`…/logs?follow=true`) are drawn by the
//! console script. `/jobs/{id}/log.txt` downloads the whole log; the files the job has (its
//! committed checkpoints and its export) link to their downloads.

use askama::Template;
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::collections::BTreeMap;

use scheduler::memory::{Category, DeviceKind};

use super::view::{self, Layout};
use super::{Signed, error_page, render};
use crate::domain::{JobId, LogLine, RankMemoryRecord, Role};
use crate::error::ApiError;
use crate::routes::jobs::get::detail;
use crate::routes::jobs::metrics::{JobMetrics, job_metrics};
use crate::state::AppState;
use wire::artifact::url_segment;

/// Log lines a page shows before following.
const LOG_PAGE: u32 = 1000;

struct HistoryRow {
    at: String,
    from: &'static str,
    to: &'static str,
    reason: String,
}

/// One category's bytes on each rank: (measured, predicted).
struct MemoryRow {
    category: &'static str,
    cells: Vec<(String, String)>,
}

/// The process that ran some of the job's ranks on a node: its peak resident set beside the
/// memory model's total for those ranks with the process overhead counted once.
struct ProcessRow {
    node: String,
    ranks: String,
    measured: String,
    predicted: String,
}

/// One file of the job: its name, where it downloads, size, step and SHA-256.
struct FileRow {
    name: String,
    href: String,
    bytes: String,
    step: u32,
    sha256: String,
}

struct CommRow {
    rank: u32,
    ops: Vec<(String, String)>,
}

#[derive(Template)]
#[template(path = "job.html")]
struct JobPage {
    layout: Layout,
    id: JobId,
    name: String,
    state: &'static str,
    live: bool,
    reason: String,
    owner: String,
    attempt: u32,
    priority: i32,
    world_size: u32,
    submitted: String,
    plan: Vec<(&'static str, String)>,
    predicted: Vec<(&'static str, String)>,
    history: Vec<HistoryRow>,
    ranks: Vec<u32>,
    memory: Vec<MemoryRow>,
    processes: Vec<ProcessRow>,
    budgets: Vec<String>,
    comm: Vec<CommRow>,
    spec: String,
    log: Vec<LogLine>,
    files: Vec<FileRow>,
    can_cancel: bool,
    can_submit: bool,
}

pub async fn page(
    State(state): State<AppState>,
    Signed(caller): Signed,
    Path(id): Path<JobId>,
) -> Response {
    match load(&state, &id, &caller).await {
        Ok(page) => render(&page),
        Err(e) => error_page(e),
    }
}

async fn load(
    state: &AppState,
    id: &JobId,
    caller: &crate::auth::Caller,
) -> Result<JobPage, ApiError> {
    let d = detail(state, id).await?;
    let job = d.job;
    let metrics = job_metrics(state, job.clone()).await?;
    let log = state.store.logs(id, 0, LOG_PAGE).await?;
    let files = crate::artifacts::of_job(state, &job)
        .await?
        .into_iter()
        .map(|a| FileRow {
            href: format!("/v1/jobs/{id}/artifacts/{}", url_segment(&a.name)),
            bytes: view::bytes(a.bytes),
            step: a.step,
            sha256: a.sha256,
            name: a.name,
        })
        .collect();
    let (chosen, per_rank) = (&job.plan.chosen, &job.plan.per_rank_bytes);
    // The process overhead is the process's, not a rank's: it is set beside the process's own
    // peak (`processes`), not beside each rank's measured bytes.
    let memory = Category::ALL
        .iter()
        .filter(|&&c| c != Category::Overhead)
        .map(|c| MemoryRow {
            category: c.name(),
            cells: metrics
                .ranks
                .iter()
                .map(|r| {
                    (
                        view::bytes(r.measured.get(*c)),
                        view::bytes(r.predicted.get(*c)),
                    )
                })
                .collect(),
        })
        .collect();
    let comm = metrics
        .ranks
        .iter()
        .map(|r| CommRow {
            rank: r.rank,
            ops: r
                .comm_bytes_sent
                .iter()
                .map(|(op, b)| (format!("{op:?}"), view::bytes(*b)))
                .collect(),
        })
        .collect();
    let live = !job.state.is_terminal();
    Ok(JobPage {
        layout: Layout::new("job", caller),
        name: job.name.clone().unwrap_or_default(),
        state: job.state.as_str(),
        live,
        reason: job.reason.clone(),
        owner: job.owner.clone(),
        attempt: job.attempt,
        priority: job.priority,
        world_size: job.world_size,
        submitted: view::time(job.created_at),
        plan: vec![
            ("model", model_line(&job.spec)),
            ("ZeRO stage", chosen.zero_stage.index().to_string()),
            ("micro-batch", chosen.micro_batch_size.to_string()),
            ("gradient accumulation", chosen.grad_accum_steps.to_string()),
            (
                "activation checkpointing",
                chosen.activation_checkpointing.to_string(),
            ),
            (
                "bytes sent per step per rank",
                view::bytes(job.plan.comm_bytes_per_step),
            ),
        ],
        predicted: Category::ALL
            .iter()
            .map(|&c| (c.name(), view::bytes(per_rank.get(c))))
            .chain([("total", view::bytes(per_rank.total()))])
            .collect(),
        history: d
            .transitions
            .iter()
            .map(|t| HistoryRow {
                at: view::time(t.at),
                from: t.from.map_or("", |s| s.as_str()),
                to: t.to.as_str(),
                reason: t.reason.clone(),
            })
            .collect(),
        ranks: metrics.ranks.iter().map(|r| r.rank).collect(),
        processes: process_rows(job.plan.device, &metrics),
        memory,
        budgets: metrics
            .ranks
            .iter()
            .map(|r| {
                metrics
                    .devices
                    .iter()
                    .find(|d| d.rank == r.rank)
                    .map_or("—".into(), |d| view::bytes(d.memory_bytes))
            })
            .collect(),
        comm,
        spec: serde_json::to_string_pretty(&job.spec).unwrap_or_default(),
        log,
        files,
        can_cancel: live && (caller.role >= Role::Admin || caller.name == job.owner),
        can_submit: caller.role.allows(Role::Submitter),
        id: job.id,
    })
}

/// A row per node that ran ranks on CPU devices (where the process's memory is the devices'),
/// from the ranks' reports: the process's peak resident set against their predicted totals
/// without overhead, plus the overhead once.
fn process_rows(device: DeviceKind, metrics: &JobMetrics) -> Vec<ProcessRow> {
    if device != DeviceKind::Cpu {
        return Vec::new();
    }
    let mut nodes: BTreeMap<&str, Vec<&RankMemoryRecord>> = BTreeMap::new();
    for r in &metrics.ranks {
        let node = metrics
            .devices
            .iter()
            .find(|d| d.rank == r.rank)
            .map_or("—", |d| d.node_id.as_str());
        nodes.entry(node).or_default().push(r);
    }
    nodes
        .into_iter()
        .map(|(node, ranks)| {
            let overhead = ranks.iter().map(|r| r.predicted.overhead).max();
            let predicted = ranks
                .iter()
                .map(|r| r.predicted.total() - r.predicted.overhead)
                .sum::<u64>()
                + overhead.unwrap_or(0);
            let measured = ranks.iter().filter_map(|r| r.process_peak_rss_bytes).max();
            ProcessRow {
                node: node.to_string(),
                ranks: ranks
                    .iter()
                    .map(|r| r.rank.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                measured: measured.map_or("—".into(), view::bytes),
                predicted: view::bytes(predicted),
            }
        })
        .collect()
}

/// `/jobs/{id}/log.txt`: every line, `seq<TAB>time<TAB>line`.
pub async fn log_text(
    State(state): State<AppState>,
    Signed(_): Signed,
    Path(id): Path<JobId>,
) -> Response {
    match whole_log(&state, &id).await {
        Ok(text) => (
            [
                (
                    header::CONTENT_TYPE,
                    "text/plain; charset=utf-8".to_string(),
                ),
                (
                    header::CONTENT_DISPOSITION,
                    format!(
                        "attachment; filename=\"{}.log\"",
                        view::short_id(id.as_str())
                    ),
                ),
            ],
            text,
        )
            .into_response(),
        Err(e) => error_page(e),
    }
}

async fn whole_log(state: &AppState, id: &JobId) -> Result<String, ApiError> {
    crate::routes::jobs::find(state, id).await?;
    let mut text = String::new();
    let mut after = 0;
    loop {
        let lines = state.store.logs(id, after, LOG_PAGE).await?;
        let Some(last) = lines.last() else {
            return Ok(text);
        };
        after = last.seq;
        for l in &lines {
            text.push_str(&format!("{}\t{}\t{}\n", l.seq, view::time(l.at), l.line));
        }
    }
}

/// The model as the estimate report names it: family, type and shape, and its parameters.
fn model_line(spec: &scheduler::spec::JobSpec) -> String {
    let arch = spec.architecture();
    match arch.model() {
        Some(m) => format!(
            "{} ({} parameters)",
            m.summary().line(),
            arch.parameter_count()
        ),
        None => arch.label(),
    }
}
