//! A live service for end-to-end tests: the real server (`app::build`) on a free port over
//! SQLite in a temporary directory, its tokens bootstrapped, runner agents on threads of the
//! test process, and a proxy that cuts an agent off from the server and brings it back.

#![allow(dead_code)] // each test binary uses its own part of the helpers

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::thread::JoinHandle;
use std::time::Duration;

use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use scheduler::inventory::Device;
use scheduler::memory::DeviceKind;
use server::app::{self, Server};
use server::auth;
use server::settings::Settings;
use tokio::sync::watch;

pub struct Live {
    pub server: Server,
    /// The agents' join token.
    pub join: String,
    pub dir: tempfile::TempDir,
}

/// A server with `admin` as its admin token; agents heartbeat every 100 ms and are lost after
/// 2 s of silence; the scheduler runs every 100 ms.
pub async fn start(admin: &str) -> Live {
    let dir = tempfile::tempdir().unwrap();
    let settings = Settings {
        port: 0,
        data_dir: dir.path().to_path_buf(),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(2),
        scheduling_interval: Duration::from_millis(100),
        ..Settings::default()
    };
    let server = app::build(settings).await.unwrap();
    let tokens = auth::bootstrap(&server.state().store, dir.path(), Some(admin))
        .await
        .unwrap();
    Live {
        server,
        join: tokens.join_token,
        dir,
    }
}

/// An agent of `devices` CPU devices of `memory` bytes on a thread of this process, until the
/// returned flag is set.
pub fn agent(
    server: &Server,
    join: &str,
    name: &str,
    devices: usize,
    memory: u64,
) -> (Arc<AtomicBool>, JoinHandle<()>) {
    let metrics = Arc::new(runner::agent::AgentMetrics::new());
    agent_at(server, &server.url(), join, name, devices, memory, metrics)
}

/// [`agent`], reaching `server` at `url` (a proxy, say) and counting in `metrics`.
pub fn agent_at(
    server: &Server,
    url: &str,
    join: &str,
    name: &str,
    devices: usize,
    memory: u64,
    metrics: Arc<runner::agent::AgentMetrics>,
) -> (Arc<AtomicBool>, JoinHandle<()>) {
    let cfg = runner::agent::AgentConfig {
        server: url.to_string(),
        join_token: join.to_string(),
        name: name.into(),
        host: "127.0.0.1".into(),
        devices: vec![
            Device {
                kind: DeviceKind::Cpu,
                memory_bytes: memory
            };
            devices
        ],
        threads: None,
        data_roots: server.state().data_roots.clone(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    (
        stop,
        std::thread::spawn(move || runner::agent::run(&cfg, &flag, &metrics).unwrap()),
    )
}

/// What a [`Proxy`] does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forwards it.
    Up,
    /// Holds it until the mode changes (a network that went quiet), then acts on the new mode.
    Paused,
    /// Answers 503 (a server that is down).
    Down,
}

/// An HTTP proxy in front of a server, to cut an agent off and bring it back.
pub struct Proxy {
    pub url: String,
    mode: watch::Sender<Mode>,
}

impl Proxy {
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }
}

/// A proxy to `upstream` (`http://HOST:PORT`) on a free loopback port, starting in `mode`.
pub async fn proxy(upstream: String, mode: Mode) -> Proxy {
    let (tx, rx) = watch::channel(mode);
    let http = reqwest::Client::new();
    let app = axum::Router::new().fallback(move |req: Request| {
        let (mut rx, http, upstream) = (rx.clone(), http.clone(), upstream.clone());
        async move {
            let mode = *rx.wait_for(|m| *m != Mode::Paused).await.unwrap();
            if mode == Mode::Down {
                return StatusCode::SERVICE_UNAVAILABLE.into_response();
            }
            let (parts, body) = req.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
            let mut headers = parts.headers;
            headers.remove(header::HOST);
            let answer = http
                .request(parts.method, format!("{upstream}{}", parts.uri))
                .headers(headers)
                .body(body)
                .send()
                .await
                .unwrap();
            let status = answer.status();
            let headers = answer.headers().clone();
            let bytes = answer.bytes().await.unwrap();
            (status, headers, bytes).into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Proxy { url, mode: tx }
}
