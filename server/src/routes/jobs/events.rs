//! `GET /v1/jobs/{id}/events`: server-sent events of a job's state changes (`state`) and
//! steps (`step`), starting with its current state and ending after a terminal one.

use std::convert::Infallible;

use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use utoipa::ToSchema;

use crate::auth::Viewer;
use crate::domain::{Job, JobId, JobState};
use crate::error::{ApiError, Problem};
use crate::state::{AppState, JobEvent};

/// One server-sent event of the stream (axum's `Event`s write it).
#[derive(Debug, ToSchema)]
pub struct JobEventMessage {
    /// `state` or `step`.
    #[schema(pattern = "^(state|step)$")]
    pub event: String,
    /// A JobEvent as JSON.
    pub data: String,
}

/// Follow a job's state changes and steps.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/events", operation_id = "job_events",
    tag = "jobs",
    security(("bearer" = ["viewer"])),
    params(("id" = String, Path, description = "Job id")),
    responses(
        (status = 200, description = "`state` and `step` events; the stream ends after a \
            terminal state", body = JobEventMessage, content_type = "text/event-stream"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn events(
    State(state): State<AppState>,
    _: Viewer,
    Path(id): Path<JobId>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    // Subscribe before reading the state, so no change falls between the two.
    let rx = state.events.subscribe();
    let job = super::find(&state, &id).await?;
    let follower = Follower {
        stop: state.shutdown.subscribe(),
        rx,
        state,
        id,
        last: None,
        first: Some(job),
        ended: false,
    };
    let stream = futures::stream::unfold(follower, |mut f| async move {
        let event = f.next().await?;
        Some((Ok(event), f))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

struct Follower {
    state: AppState,
    id: JobId,
    rx: tokio::sync::broadcast::Receiver<JobEvent>,
    stop: tokio::sync::watch::Receiver<bool>,
    /// The state and attempt last sent, to send a change seen by polling only once.
    last: Option<(JobState, u32)>,
    first: Option<Job>,
    ended: bool,
}

impl Follower {
    async fn next(&mut self) -> Option<Event> {
        if self.ended {
            return None;
        }
        if let Some(job) = self.first.take() {
            return Some(self.state_event(JobEvent::state(&job)));
        }
        loop {
            match super::logs::wait_for_job(&mut self.rx, &mut self.stop, &self.id).await? {
                Some(e @ JobEvent::State { state, attempt, .. }) => {
                    if self.last != Some((state, attempt)) {
                        return Some(self.state_event(e));
                    }
                }
                Some(e @ JobEvent::Step { .. }) => return Some(sse("step", &e)),
                Some(JobEvent::Log { .. }) => {}
                // Nothing announced here (another replica may have moved the job), or events
                // were missed: the store has the state; missed steps are at /metrics.
                None => {
                    if let Some(e) = self.poll().await {
                        return Some(e);
                    }
                }
            }
        }
    }

    /// The job's state from the store, if it differs from the last sent.
    async fn poll(&mut self) -> Option<Event> {
        match self.state.store.get_job(&self.id).await {
            Ok(Some(job)) if self.last != Some((job.state, job.attempt)) => {
                Some(self.state_event(JobEvent::state(&job)))
            }
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(job = %self.id, "event follower: {e}");
                None
            }
        }
    }

    fn state_event(&mut self, e: JobEvent) -> Event {
        if let JobEvent::State { state, attempt, .. } = &e {
            self.last = Some((*state, *attempt));
            self.ended = state.is_terminal();
        }
        sse("state", &e)
    }
}

fn sse(name: &str, e: &JobEvent) -> Event {
    let data = serde_json::to_string(e).expect("an event serializes");
    Event::default().event(name).data(data)
}
