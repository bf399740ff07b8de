//! `GET /v1/jobs/{id}/logs`: a page of a job's log lines, or with `follow=true` a stream of
//! server-sent `log` events that ends with an `end` event once the job has ended and every
//! line was sent.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Viewer;
use crate::domain::{JobId, LogLine};
use crate::error::{ApiError, Problem};
use crate::state::{AppState, JobEvent};

const PAGE: u32 = 1000;
/// How often a follower looks at the store when nothing was announced (another replica may
/// be the one receiving the job's reports).
const POLL: Duration = Duration::from_secs(1);

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogParams {
    /// Lines after this sequence number (default 0: from the start; when following, the
    /// `Last-Event-ID` header takes its place).
    pub after: Option<i64>,
    /// Lines per page (default 1000); ignored when following.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
    /// Stream lines as server-sent events as they arrive, until the job has ended.
    #[serde(default)]
    #[param(required = false)]
    pub follow: bool,
}

/// One server-sent event of a followed log (the stream axum's `Event`s write).
#[derive(Debug, ToSchema)]
pub struct LogEvent {
    /// `log`, or `end` for the last.
    #[schema(pattern = "^(log|end)$")]
    pub event: String,
    /// `log`: a LogLine as JSON; `end`: the job's final state.
    pub data: String,
    /// The last `log` event's seq: where a reconnect (`Last-Event-ID`) resumes.
    pub id: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LogPage {
    pub lines: Vec<LogLine>,
    /// The sequence number of the last line: `after` for the next page.
    pub last_seq: i64,
}

/// A job's log lines.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/logs", operation_id = "job_logs",
    tag = "jobs",
    security(("bearer" = ["viewer"])),
    params(("id" = String, Path, description = "Job id"), LogParams),
    responses(
        (status = 200, description = "A page of lines; with `follow=true` a stream of `log` \
            events and a final `end` event", content(
            (LogPage = "application/json"),
            (LogEvent = "text/event-stream"),
        )),
        (status = 400, description = "A query parameter is not one this takes (`field` names it)",
            body = Problem, content_type = "application/problem+json"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn logs(
    State(state): State<AppState>,
    _: Viewer,
    Path(id): Path<JobId>,
    headers: HeaderMap,
    params: Result<Query<LogParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(params) = params?;
    super::find(&state, &id).await?;
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let after = params.after.or(last_event_id).unwrap_or(0);
    if params.follow {
        let follow = Follow {
            rx: state.events.subscribe(),
            stop: state.shutdown.subscribe(),
            state,
            id,
            after,
            pending: VecDeque::new(),
            ended: false,
        };
        return Ok(Sse::new(follow.into_stream())
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let limit = params.limit.unwrap_or(PAGE);
    if !(1..=PAGE).contains(&limit) {
        return Err(ApiError::BadRequest {
            field: "limit".into(),
            reason: format!("{limit} is not in 1-{PAGE}"),
        });
    }
    let lines = state.store.logs(&id, after, limit).await?;
    let last_seq = lines.last().map_or(after, |l| l.seq);
    Ok(Json(LogPage { lines, last_seq }).into_response())
}

struct Follow {
    state: AppState,
    id: JobId,
    after: i64,
    rx: broadcast::Receiver<JobEvent>,
    stop: watch::Receiver<bool>,
    pending: VecDeque<LogLine>,
    ended: bool,
}

impl Follow {
    fn into_stream(self) -> impl Stream<Item = Result<Event, Infallible>> {
        futures::stream::unfold(self, |mut f| async move {
            let event = f.next().await?;
            Some((Ok(event), f))
        })
    }

    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(line) = self.pending.pop_front() {
                self.after = line.seq;
                let data = serde_json::to_string(&line).expect("a log line serializes");
                return Some(
                    Event::default()
                        .event("log")
                        .id(line.seq.to_string())
                        .data(data),
                );
            }
            if self.ended {
                return None;
            }
            // The state first: lines stored before it ended are then all in the fetch below.
            let job = match self.state.store.get_job(&self.id).await {
                Ok(job) => job?,
                Err(e) => {
                    tracing::warn!(job = %self.id, "log follower: {e}");
                    return None;
                }
            };
            match self.state.store.logs(&self.id, self.after, PAGE).await {
                Ok(lines) if !lines.is_empty() => {
                    self.pending = lines.into();
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(job = %self.id, "log follower: {e}");
                    return None;
                }
            }
            if job.state.is_terminal() {
                self.ended = true;
                return Some(Event::default().event("end").data(job.state.as_str()));
            }
            wait_for_job(&mut self.rx, &mut self.stop, &self.id).await?;
        }
    }
}

/// Waits for an event of job `id` (`Some(Some(event))`), for `POLL` to pass or events to be
/// missed (`Some(None)`: look at the store), or for shutdown (`None`).
pub(crate) async fn wait_for_job(
    rx: &mut broadcast::Receiver<JobEvent>,
    stop: &mut watch::Receiver<bool>,
    id: &JobId,
) -> Option<Option<JobEvent>> {
    let deadline = tokio::time::sleep(POLL);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            () = &mut deadline => return Some(None),
            _ = stop.wait_for(|stopped| *stopped) => return None,
            event = rx.recv() => match event {
                Ok(e) if e.job_id() == id => return Some(Some(e)),
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => return Some(None),
                Err(broadcast::error::RecvError::Closed) => return None,
            },
        }
    }
}
