//! The application: the router with its middleware, and `build`, which connects the store,
//! binds the listener and starts the scheduling loop. The state they share is `state`'s.

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::HttpBody;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tower_http::compression::CompressionLayer;
use tower_http::compression::predicate::{DefaultPredicate, NotForContentType, Predicate};
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

use wire::data_roots::RootsError;

use crate::artifacts::ArtifactError;
use crate::auth::{self, Bootstrap, BootstrapError};
use crate::console;
use crate::error::{ApiError, InternalDetail, problem_for_bare_errors};
use crate::routes;
use crate::scheduling;
use crate::settings::Settings;
use crate::state::AppState;
use crate::store::{Store, StoreError};
use crate::throttle::throttle_failed_auth;

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
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
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

/// Connects the store (migrating it), creates the tokens (`auth::bootstrap`, with `admin` as
/// the first admin token if given), binds the listener and spawns the HTTP server and the
/// scheduling loop. The tokens exist, and their files are written, before the first request is
/// answered: whoever waits for `/healthz` can read them. `zerotrain up` starts its local agent
/// against `Server::url` after this.
pub async fn build(
    settings: Settings,
    admin: Option<&str>,
) -> Result<(Server, Bootstrap), BuildError> {
    std::fs::create_dir_all(&settings.data_dir).map_err(|source| BuildError::DataDir {
        path: settings.data_dir.display().to_string(),
        source,
    })?;
    let store = Store::connect(&settings.database_url()).await?;
    let tokens = auth::bootstrap(&store, &settings.data_dir, admin).await?;
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
    if let Some(slurm) = &state.slurm {
        let url = slurm
            .settings
            .server_url
            .as_ref()
            .or(state.settings.public_url.as_ref());
        let url = url.map_or_else(
            || local_url(addr),
            |u| u.as_str().trim_end_matches('/').to_string(),
        );
        let _ = slurm.server_url.set(url);
        slurm.refresh_if_due().await;
    }
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
    let server = Server {
        addr,
        state,
        http,
        scheduler,
    };
    Ok((server, tokens))
}

impl Server {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, with a wildcard listen address replaced by loopback.
    pub fn url(&self) -> String {
        local_url(self.addr)
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

/// `http://ADDR`, with a wildcard listen address replaced by loopback.
fn local_url(mut addr: SocketAddr) -> String {
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    format!("http://{addr}")
}
