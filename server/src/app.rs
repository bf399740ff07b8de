//! The application: its shared state, the router with its middleware, and `build`, which
//! connects the store, binds the listener and starts the scheduling loop.

use std::future::Future;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::HttpBody;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::{Mutex, Notify, broadcast, watch};
use tokio::task::JoinHandle;
use tower_http::compression::CompressionLayer;
use tower_http::compression::predicate::{DefaultPredicate, NotForContentType, Predicate};
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;
use utoipa::ToSchema;

use wire::data_roots::{DataRoots, RootsError};

use crate::artifacts::{ArtifactError, Artifacts};
use crate::console;
use crate::domain::{Job, JobId, JobState, LogLine, NodeId, StepRecord};
use crate::error::{ApiError, InternalDetail, problem_for_bare_errors};
use crate::metrics::Metrics;
use crate::routes;
use crate::scheduling;
use crate::settings::Settings;
use crate::store::{Board, Store, StoreError};
use crate::throttle::{AuthThrottle, throttle_failed_auth};

/// What every handler and background task shares.
pub struct App {
    /// Jobs, nodes, assignments, reports and tokens.
    pub store: Store,
    pub settings: Settings,
    /// `settings.data_roots` resolved: submissions naming a file outside them are refused,
    /// and `zerotrain up`'s local agent reads only inside them.
    pub data_roots: DataRoots,
    /// Where jobs' checkpoints and exports are kept (`settings.artifacts()`).
    pub artifacts: Artifacts,
    /// Every Prometheus series this server exports.
    pub metrics: Metrics,
    /// Job state changes, steps and log lines as this server sees them, for SSE followers.
    /// Followers also poll the store, so changes another replica makes still arrive.
    pub events: broadcast::Sender<JobEvent>,
    /// Starts a scheduling pass now (a job arrived or devices freed up).
    pub wake_scheduler: Notify,
    /// The queue and devices as the scheduling loop keeps them between passes, while this
    /// replica holds the scheduler lease (empty otherwise).
    pub board: Mutex<Board>,
    /// Wakes agents' waiting heartbeats: `Some(node)` when that node has a new assignment,
    /// `None` when any node may have one or must stop an attempt (a job was requeued,
    /// cancelled or failed, or a rendezvous address became known). Waiting heartbeats also
    /// look again every scheduling interval, for what another replica did.
    pub agent_wake: broadcast::Sender<Option<NodeId>>,
    /// Whether the last scheduling pass left devices free. While none are, a new job cannot
    /// start, and waking the scheduler for it would only make passes (which hold the store's
    /// scheduling lock) run back to back while jobs pour in.
    pub devices_free: AtomicBool,
    /// Becomes `true` when the server shuts down: streams end, the scheduling loop stops.
    pub shutdown: watch::Sender<bool>,
    /// Failed authentications by client address.
    pub auth_throttle: AuthThrottle,
    /// When this server started, by the store's clock (nodes are not declared lost in its
    /// first heartbeat timeout).
    pub started_ms: i64,
}

#[derive(Clone)]
pub struct AppState(pub Arc<App>);

impl Deref for AppState {
    type Target = App;

    fn deref(&self) -> &App {
        &self.0
    }
}

/// Something that happened to a job, as `GET /v1/jobs/{id}/events` streams it.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobEvent {
    State {
        #[schema(value_type = String)]
        job_id: JobId,
        state: JobState,
        attempt: u32,
        reason: String,
        at: i64,
    },
    Step {
        #[schema(value_type = String)]
        job_id: JobId,
        #[serde(flatten)]
        step: StepRecord,
    },
    Log {
        #[schema(value_type = String)]
        job_id: JobId,
        #[serde(flatten)]
        line: LogLine,
    },
}

impl JobEvent {
    pub fn job_id(&self) -> &JobId {
        match self {
            JobEvent::State { job_id, .. }
            | JobEvent::Step { job_id, .. }
            | JobEvent::Log { job_id, .. } => job_id,
        }
    }

    pub fn state(job: &Job) -> JobEvent {
        JobEvent::State {
            job_id: job.id.clone(),
            state: job.state,
            attempt: job.attempt,
            reason: job.reason.clone(),
            at: job.updated_at,
        }
    }
}

impl AppState {
    /// The state over `store`; fails when a data root cannot be one (missing, or holding the
    /// data dir).
    pub fn new(store: Store, settings: Settings) -> Result<AppState, BuildError> {
        let data_roots = settings.open_data_roots().map_err(BuildError::DataRoots)?;
        let artifacts = Artifacts::open(&settings.artifacts(), &settings.s3)?;
        let auth_throttle = AuthThrottle::new(settings.limits.auth_failures_per_minute);
        let started_ms = store.clock().now_ms();
        Ok(AppState(Arc::new(App {
            store,
            settings,
            data_roots,
            artifacts,
            metrics: Metrics::default(),
            events: broadcast::channel(1024).0,
            wake_scheduler: Notify::new(),
            board: Mutex::new(Board::default()),
            agent_wake: broadcast::channel(1024).0,
            devices_free: AtomicBool::new(true),
            shutdown: watch::channel(false).0,
            auth_throttle,
            started_ms,
        })))
    }
}

impl App {
    /// Unix milliseconds now, by the service's clock (the store's).
    pub fn now_ms(&self) -> i64 {
        self.store.clock().now_ms()
    }

    /// Moves a job between states in the store and tells everyone who cares: SSE followers,
    /// the scheduler (devices freed or a job requeued) and the metrics (an ended job's series
    /// go after the grace period).
    pub async fn transition(
        &self,
        id: &JobId,
        from: &[JobState],
        to: JobState,
        reason: &str,
    ) -> Result<Option<Job>, StoreError> {
        let job = self.store.transition(id, from, to, reason).await?;
        if let Some(job) = &job {
            self.announce(job);
        }
        Ok(job)
    }

    /// `transition`, only if the job is still at `attempt` (for agents' reports).
    pub async fn transition_attempt(
        &self,
        id: &JobId,
        attempt: u32,
        from: &[JobState],
        to: JobState,
        reason: &str,
    ) -> Result<Option<Job>, StoreError> {
        let job = self
            .store
            .transition_attempt(id, attempt, from, to, reason)
            .await?;
        if let Some(job) = &job {
            self.announce(job);
        }
        Ok(job)
    }

    /// Publishes a job's (new) state.
    pub fn announce(&self, job: &Job) {
        // Nobody listening is not an error.
        let _ = self.events.send(JobEvent::state(job));
        if job.state.is_terminal() {
            self.metrics.job_ended(&job.id);
            self.devices_free.store(true, Ordering::Relaxed);
        }
        let queued_and_may_fit =
            job.state == JobState::Queued && self.devices_free.load(Ordering::Relaxed);
        if job.state.is_terminal() || queued_and_may_fit {
            self.wake_scheduler.notify_one();
        }
        // Its ranks elsewhere must stop (placements wake their nodes themselves).
        if matches!(
            job.state,
            JobState::Queued | JobState::Cancelled | JobState::Failed
        ) {
            self.wake_agents(None);
        }
    }

    /// Wakes the waiting heartbeat of `node` (`None`: of every node).
    pub fn wake_agents(&self, node: Option<&NodeId>) {
        // Nobody waiting is not an error.
        let _ = self.agent_wake.send(node.cloned());
    }

    pub fn publish(&self, event: JobEvent) {
        let _ = self.events.send(event);
    }
}

/// Every route with the service's middleware.
pub fn router(state: AppState) -> Router {
    let settings = &state.settings;
    // Innermost first: errors the limit and the timeout produce still become problems, and
    // are counted and compressed like any other answer.
    let api = routes::routes();
    api.router
        .merge(console::routes())
        // The body limit below is the one limit; axum's own 2 MB default would be a second.
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(settings.body_limit))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            settings.request_timeout,
        ))
        .layer(middleware::from_fn(require_json))
        // Uploads of files: any size, as long as they take (not JSON either).
        .merge(api.transfers.layer(DefaultBodyLimit::disable()))
        .layer(middleware::map_response(problem_for_bare_errors))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            throttle_failed_auth,
        ))
        // Files (artifacts) go as they are: safetensors barely compress, and a compressed body
        // would break their Content-Length and byte ranges.
        .layer(CompressionLayer::new().compress_when(
            DefaultPredicate::new().and(NotForContentType::const_new("application/octet-stream")),
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            track_requests,
        ))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// Request bodies of the API are JSON: anything else gets 415 before a handler reads it. The
/// console's login form may post `application/x-www-form-urlencoded` to `/v1/session`.
async fn require_json(request: Request, next: Next) -> Response {
    let empty = request.body().size_hint().upper() == Some(0);
    let path = request.uri().path();
    if !empty && path.starts_with("/v1/") {
        let found = request
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default();
        let mime = found
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        let json = mime == "application/json" || mime.ends_with("+json");
        let login_form = path == "/v1/session" && mime == "application/x-www-form-urlencoded";
        if !json && !login_form {
            return ApiError::NotJson { found }.into_response();
        }
    }
    next.run(request).await
}

/// Counts and times each request by its matched route (never the raw URI, whose ids would
/// make a series per job), and logs the detail of 5xx answers.
async fn track_requests(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched".to_string(), |p| p.as_str().to_string());
    let method = request.method().as_str().to_string();
    let start = Instant::now();
    let response = next.run(request).await;
    let server = &state.metrics.server;
    server
        .http_request_duration_seconds
        .with_label_values(&[&route, &method])
        .observe(start.elapsed().as_secs_f64());
    server
        .http_requests_total
        .with_label_values(&[&route, &method, response.status().as_str()])
        .inc();
    if let Some(InternalDetail(detail)) = response.extensions().get::<InternalDetail>() {
        tracing::error!(%route, %method, status = %response.status(), "{detail}");
    }
    response
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("creating the data directory {path}: {source}")]
    DataDir {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Artifacts(#[from] ArtifactError),
    #[error(transparent)]
    DataRoots(RootsError),
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
}

/// A running server: its address, its state, and a way to stop it.
pub struct Server {
    addr: SocketAddr,
    state: AppState,
    http: JoinHandle<std::io::Result<()>>,
    scheduler: JoinHandle<()>,
}

/// Connects the store (migrating it), binds the listener and spawns the HTTP server and the
/// scheduling loop. `zerotrain up` starts its local agent against `Server::url` after this.
pub async fn build(settings: Settings) -> Result<Server, BuildError> {
    std::fs::create_dir_all(&settings.data_dir).map_err(|source| BuildError::DataDir {
        path: settings.data_dir.display().to_string(),
        source,
    })?;
    let store = Store::connect(&settings.database_url()).await?;
    let addr = SocketAddr::new(settings.listen, settings.port);
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| BuildError::Bind {
            addr: addr.to_string(),
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| BuildError::Bind {
        addr: addr.to_string(),
        source,
    })?;
    let state = AppState::new(store, settings)?;
    let scheduler = tokio::spawn(scheduling::run(state.clone()));
    let mut stop = state.shutdown.subscribe();
    let app = router(state.clone());
    let http = tokio::spawn(async move {
        // Peers' addresses reach the throttle of failed authentications.
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            })
            .await
    });
    tracing::info!(%addr, "listening");
    Ok(Server {
        addr,
        state,
        http,
        scheduler,
    })
}

impl Server {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, with a wildcard listen address replaced by loopback.
    pub fn url(&self) -> String {
        let mut addr = self.addr;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        format!("http://{addr}")
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `signal` completes (or the server fails), then shuts down.
    pub async fn run_until(mut self, signal: impl Future<Output = ()>) -> std::io::Result<()> {
        tokio::select! {
            () = signal => {}
            result = &mut self.http => {
                let _ = self.state.shutdown.send(true);
                let _ = (&mut self.scheduler).await;
                return result.unwrap_or_else(|e| Err(std::io::Error::other(e)));
            }
        }
        self.shutdown().await
    }

    /// Stops accepting connections, ends open streams, lets in-flight requests finish (for at
    /// most ten seconds) and stops the scheduling loop.
    pub async fn shutdown(self) -> std::io::Result<()> {
        let _ = self.state.shutdown.send(true);
        let _ = self.scheduler.await;
        match tokio::time::timeout(Duration::from_secs(10), self.http).await {
            Ok(joined) => joined.unwrap_or_else(|e| Err(std::io::Error::other(e))),
            Err(_) => {
                tracing::warn!("requests still open after 10 s; stopping anyway");
                Ok(())
            }
        }
    }
}
