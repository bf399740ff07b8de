//! A live service for end-to-end tests: the real server (`app::build`) on a free port over
//! SQLite in a temporary directory, its tokens bootstrapped, runner agents on threads of the
//! test process, and a proxy that cuts an agent off from the server and brings it back; or
//! `zerotrain up`, the README's main command, as a process.

#![allow(dead_code)] // each test binary uses its own part of the helpers

use std::io::BufRead;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use scheduler::inventory::DeviceSlot;
use scheduler::memory::DeviceKind;
use server::app::{self, Server};
use server::settings::Settings;
use tokio::sync::watch;

pub struct Live {
    pub server: Server,
    /// The admin token.
    pub admin: String,
    /// The agents' join token.
    pub join: String,
    pub dir: tempfile::TempDir,
}

/// A server with `admin` as its admin token; agents heartbeat every 100 ms and are lost after
/// 2 s of silence; the scheduler runs every 100 ms.
pub async fn start(admin: &str) -> Live {
    start_with(Some(admin), |s| {
        s.heartbeat_interval = Duration::from_millis(100);
        s.heartbeat_timeout = Duration::from_secs(2);
        s.scheduling_interval = Duration::from_millis(100);
    })
    .await
}

/// A server with the default settings but for `configure`'s changes, on a free port over
/// SQLite in a temporary data directory; without `admin`, the first start's bootstrap makes
/// the admin token (and writes it to the data directory).
pub async fn start_with(admin: Option<&str>, configure: impl FnOnce(&mut Settings)) -> Live {
    let dir = tempfile::tempdir().unwrap();
    let mut settings = Settings {
        port: 0,
        data_dir: dir.path().to_path_buf(),
        ..Settings::default()
    };
    configure(&mut settings);
    let (server, tokens) = app::build(settings, admin).await.unwrap();
    let admin = match admin {
        Some(admin) => admin.to_string(),
        None => tokens
            .new_admin_token
            .expect("a first start creates the admin token"),
    };
    Live {
        server,
        admin,
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
            DeviceSlot {
                kind: DeviceKind::Cpu,
                memory_bytes: memory
            };
            devices
        ],
        gpus: Vec::new(),
        data_roots: server.state().data_roots.clone(),
        // Its own folder, which neither the server nor another agent reads.
        work_dir: server.state().settings.data_dir.join("agents").join(name),
        export_shard_bytes: runner::checkpoint::EXPORT_SHARD_BYTES,
        one_job: false,
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

/// Follows job `id`'s event stream (`GET /v1/jobs/{id}/events`, which starts with the job's
/// current state) until the job's state is one of `states`, failing after `limit` or when the
/// stream ends (after a terminal state) in another. Returns the job as `GET /v1/jobs/{id}`
/// gives it then.
pub async fn until_state(
    url: &str,
    token: &str,
    id: &str,
    states: &[&str],
    limit: Duration,
) -> serde_json::Value {
    let http = reqwest::Client::new();
    let follow = async {
        let mut stream = http
            .get(format!("{url}/v1/jobs/{id}/events"))
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        assert_eq!(stream.status(), 200, "the events of job {id}");
        let (mut pending, mut last) = (Vec::new(), String::from("no state yet"));
        while let Some(chunk) = stream.chunk().await.unwrap() {
            pending.extend_from_slice(&chunk);
            // Events end with a blank line; a chunk may hold several, or part of one.
            while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = pending.drain(..end + 2).collect();
                let event = String::from_utf8(event).unwrap();
                if !event.lines().any(|l| l == "event: state") {
                    continue;
                }
                let data = event
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .unwrap();
                let change: serde_json::Value = serde_json::from_str(data).unwrap();
                last = change["state"].as_str().unwrap().to_string();
                if states.contains(&last.as_str()) {
                    return;
                }
            }
        }
        panic!("job {id} ended {last}, never {states:?}");
    };
    if tokio::time::timeout(limit, follow).await.is_err() {
        panic!("after {limit:?}: job {id} never {states:?}");
    }
    http.get(format!("{url}/v1/jobs/{id}"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Calls `probe` every `every` until it gives a value, failing after `limit` with the last
/// thing it said: for state that no stream announces (a node registering, a file appearing, a
/// metric scraped); a job's state is followed on its event stream ([`until_state`]).
pub async fn poll<T, F, Fut>(limit: Duration, every: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    loop {
        match probe().await {
            Ok(v) => return v,
            Err(why) => assert!(start.elapsed() < limit, "after {limit:?}: {why}"),
        }
        tokio::time::sleep(every).await;
    }
}

/// A free loopback address (`127.0.0.1:PORT`) for a process to listen on.
pub fn free_loopback_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// `zerotrain up` as a user runs it: its own data directory, a free port, a local agent of
/// `--cpu-devices 2 --device-memory 1GiB` serving its `/metrics` at `metrics_addr`.
pub struct Up {
    pub url: String,
    /// The admin token `up` wrote to its data directory.
    pub admin: String,
    pub metrics_addr: String,
    pub dir: tempfile::TempDir,
    child: Child,
    /// Reads `up`'s stderr to its end (so `up` never blocks on a full pipe); yields the lines.
    stderr: JoinHandle<Vec<String>>,
}

impl Up {
    /// Starts `up` with `env` set and waits until it answers `/readyz`.
    pub async fn start(env: &[(&str, &str)]) -> Up {
        let dir = tempfile::tempdir().unwrap();
        let metrics_addr = free_loopback_addr();
        let mut child = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
            .arg("up")
            .args(["--port", "0", "--data-dir", dir.path().to_str().unwrap()])
            .args(["--cpu-devices", "2", "--device-memory", "1GiB"])
            .args(["--metrics-addr", &metrics_addr])
            .env_remove("ZEROTRAIN_TOKEN")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (url_tx, url_rx) = std::sync::mpsc::channel();
        let pipe = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in std::io::BufReader::new(pipe).lines() {
                let line = line.unwrap();
                if let Some(url) = line.strip_prefix("zerotrain serving at ") {
                    url_tx.send(url.to_string()).unwrap();
                }
                lines.push(line);
            }
            lines
        });
        let url = url_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        let admin = std::fs::read_to_string(dir.path().join("admin-token")).unwrap();
        let up = Up {
            url,
            admin: admin.trim().to_string(),
            metrics_addr,
            dir,
            child,
            stderr,
        };
        let http = reqwest::Client::new();
        poll(
            Duration::from_secs(20),
            Duration::from_millis(50),
            || async {
                let r = http
                    .get(format!("{}/readyz", up.url))
                    .bearer_auth(&up.admin)
                    .send()
                    .await
                    .unwrap();
                (r.status() == StatusCode::OK)
                    .then_some(())
                    .ok_or(format!("not ready: {}", r.status()))
            },
        )
        .await;
        up
    }

    /// SIGTERM, then `up`'s exit status (within 15 s) and everything it wrote to stderr.
    pub async fn stop(mut self) -> (ExitStatus, Vec<String>) {
        let term = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(term.success());
        let child = &mut self.child;
        let status = poll(Duration::from_secs(15), Duration::from_millis(50), || {
            let exited = child.try_wait().unwrap();
            async move { exited.ok_or("still running after SIGTERM".to_string()) }
        })
        .await;
        (status, self.stderr.join().unwrap())
    }
}
