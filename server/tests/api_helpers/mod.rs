//! A server for one test: the real router over SQLite in a temporary directory, with a token
//! of every role, driven with `tower::ServiceExt::oneshot` (no socket).

#![allow(dead_code)] // each test binary uses its own part of the helpers

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use scheduler::inventory::DeviceSlot;
use scheduler::memory::{Breakdown, DeviceKind};
use serde_json::{Value, json};
use server::clock::Clock;
use server::domain::{JobId, Role};
use server::settings::Settings;
use server::store::Store;
use server::{AppState, router};
use std::collections::BTreeMap;
use std::fmt;
use tempfile::TempDir;
use tower::ServiceExt;
use wire::Op;
use wire::agent::{Heartbeat, HeartbeatResponse, RegisterRequest, Report};

pub const GIB: u64 = 1 << 30;
pub const ADMIN: &str = "admin-token";
pub const SUBMITTER: &str = "submitter-token";
pub const OTHER_SUBMITTER: &str = "other-submitter-token";
pub const VIEWER: &str = "viewer-token";
pub const JOIN: &str = "join-token";
/// The `Host` the browser requests name, and the Origin it sends from the console's pages.
pub const HOST: &str = "zerotrain.test:8080";
pub const ORIGIN: &str = "http://zerotrain.test:8080";

pub struct TestApp {
    pub state: AppState,
    /// The service's clock, standing still until a test moves it.
    pub clock: Clock,
    pub router: Router,
    pub dir: TempDir,
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub text: String,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("{e}: not JSON ({}): {}", self.status, self.text))
    }

    pub fn content_type(&self) -> &str {
        self.headers
            .get(header::CONTENT_TYPE)
            .map_or("", |v| v.to_str().unwrap())
    }
}

/// A gpt2-tiny job of `world_size` ranks that trains for `steps` steps.
pub fn tiny_spec(world_size: u32) -> Value {
    json!({
        "name": "tiny",
        "model": {"preset": "gpt2-tiny"},
        "training": {"micro_batch_size": 2, "seq_len": 32, "steps": 5},
        "precision": {"dtype": "fp16"},
        "zero": {"stage": 2},
        "world_size": world_size,
    })
}

impl TestApp {
    pub async fn new() -> TestApp {
        TestApp::with(|_| {}).await
    }

    pub async fn with(configure: impl FnOnce(&mut Settings)) -> TestApp {
        let dir = tempfile::tempdir().unwrap();
        let mut settings = Settings {
            data_dir: dir.path().to_path_buf(),
            port: 0,
            safety_margin: 0.0,
            finished_series_ttl: std::time::Duration::ZERO,
            ..Settings::default()
        };
        configure(&mut settings);
        let clock = Clock::manual();
        let store = Store::connect(&settings.database_url())
            .await
            .unwrap()
            .with_clock(clock.clone());
        for (name, role, token) in [
            ("admin", Role::Admin, ADMIN),
            ("alice", Role::Submitter, SUBMITTER),
            ("bob", Role::Submitter, OTHER_SUBMITTER),
            ("watcher", Role::Viewer, VIEWER),
            ("join", Role::AgentJoin, JOIN),
        ] {
            store.insert_token(name, role, token).await.unwrap();
        }
        let state = AppState::new(store, settings).unwrap();
        TestApp {
            router: router(state.clone()),
            state,
            clock,
            dir,
        }
    }

    pub async fn call(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> Answer {
        self.call_with(method, path, token, body, &[]).await
    }

    pub async fn call_with(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut req = Request::builder().method(method).uri(path);
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let body = match body {
            Some(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Body::from(serde_json::to_vec(v).unwrap())
            }
            None => Body::empty(),
        };
        self.send(req.body(body).unwrap()).await
    }

    pub async fn send(&self, req: Request<Body>) -> Answer {
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        Answer {
            status,
            headers,
            text: String::from_utf8(bytes.to_vec()).unwrap(),
        }
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.call(Method::GET, path, Some(VIEWER), None).await
    }

    pub async fn submit(&self, spec: &Value) -> Answer {
        self.call(Method::POST, "/v1/jobs", Some(SUBMITTER), Some(spec))
            .await
    }

    /// Submits and expects 201; the job's id.
    pub async fn submit_ok(&self, spec: &Value) -> String {
        let a = self.submit(spec).await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
        a.json()["id"].as_str().unwrap().to_string()
    }

    /// Registers a node of `count` CPU devices of `memory` bytes: (node id, agent token).
    pub async fn register(&self, name: &str, count: usize, memory: u64) -> (String, String) {
        let cpu = DeviceSlot {
            kind: DeviceKind::Cpu,
            memory_bytes: memory,
        };
        self.register_devices(name, vec![cpu; count]).await
    }

    /// Registers a node of `devices`: (node id, agent token).
    pub async fn register_devices(&self, name: &str, devices: Vec<DeviceSlot>) -> (String, String) {
        let req = RegisterRequest {
            name: name.into(),
            devices,
            host: "127.0.0.1".into(),
        };
        let a = self
            .call(
                Method::POST,
                "/v1/agents/register",
                Some(JOIN),
                Some(&serde_json::to_value(req).unwrap()),
            )
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
        let v = a.json();
        (
            v["node_id"].as_str().unwrap().into(),
            v["agent_token"].as_str().unwrap().into(),
        )
    }

    pub async fn beat(
        &self,
        node: &(String, String),
        reports: Vec<Report>,
        running: Vec<(JobId, u32)>,
    ) -> HeartbeatResponse {
        let a = self.beat_raw(node, reports, running).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
        serde_json::from_str(&a.text).unwrap()
    }

    pub async fn beat_raw(
        &self,
        node: &(String, String),
        reports: Vec<Report>,
        running: Vec<(JobId, u32)>,
    ) -> Answer {
        let beat = Heartbeat {
            reports,
            running,
            wait_ms: 0,
        };
        self.send_beat(node, &beat).await
    }

    pub async fn send_beat(&self, (id, token): &(String, String), beat: &Heartbeat) -> Answer {
        let beat = serde_json::to_value(beat).unwrap();
        self.call(
            Method::POST,
            &format!("/v1/agents/{id}/heartbeat"),
            Some(token),
            Some(&beat),
        )
        .await
    }

    /// `node` uploads `text` as the artifact `name` of `attempt` of job `job`.
    pub async fn upload(
        &self,
        (node, token): &(String, String),
        job: impl fmt::Display,
        attempt: u32,
        name: &str,
        text: &str,
    ) -> Answer {
        let name = name.replace('/', "%2F");
        let req = Request::builder()
            .method(Method::PUT)
            .uri(format!(
                "/v1/agents/{node}/jobs/{job}/attempts/{attempt}/artifacts/{name}"
            ))
            .header(header::AUTHORIZATION, format!("Bearer {token}"))
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(Body::from(text.to_string()))
            .unwrap();
        self.send(req).await
    }

    /// The server's count of refused agent reports for `reason`.
    pub async fn refused(&self, reason: &str) -> u64 {
        let prom = self.get("/metrics").await.text;
        let series = format!("zerotrain_agent_reports_refused_total{{reason=\"{reason}\"}} ");
        prom.lines()
            .find_map(|l| l.strip_prefix(&series))
            .unwrap_or_else(|| panic!("no {series} in\n{prom}"))
            .parse()
            .unwrap()
    }

    /// Runs one scheduling pass now.
    pub async fn schedule(&self) -> usize {
        server::scheduling::pass(&self.state).await.unwrap().len()
    }

    /// Logs in with `token` (`POST /v1/session`): the `Cookie` header value of the session.
    pub async fn login(&self, token: &str) -> String {
        let a = self
            .call(Method::POST, "/v1/session", Some(token), None)
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
        let set = a.headers[header::SET_COOKIE].to_str().unwrap();
        set.split(';').next().unwrap().to_string()
    }

    /// A request as the console's browser makes it: the session cookie, no bearer token, and
    /// `origin` as its Origin (`None`: no Origin header) to a server at `http://HOST`.
    pub async fn browser(
        &self,
        method: Method,
        path: &str,
        cookie: &str,
        origin: Option<&str>,
        body: Option<&Value>,
    ) -> Answer {
        let mut headers = vec![("host", HOST), ("cookie", cookie)];
        if let Some(o) = origin {
            headers.push(("origin", o));
        }
        self.call_with(method, path, None, body, &headers).await
    }

    pub async fn job(&self, id: impl fmt::Display) -> Value {
        let a = self.get(&format!("/v1/jobs/{id}")).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
        a.json()
    }
}

/// What an agent reports of rank `rank` of `job` when it ends: fixed measured bytes, bytes sent
/// by two collectives, its process's peak resident set (123,456,789) and a GPU's used bytes.
pub fn memory_report(job: &JobId, rank: usize) -> Report {
    let b = Breakdown {
        params: 1000,
        grads: 500,
        optimizer: 3000,
        activations: 700,
        buffers: 100,
        overhead: 0,
    };
    Report::Memory {
        job_id: job.clone(),
        attempt: 1,
        rank,
        measured: b,
        comm_bytes_sent: BTreeMap::from([(Op::ReduceScatter, 4096), (Op::AllGather, 2048)]),
        process_peak_rss_bytes: Some(123_456_789),
        // What a rank on a GPU adds: the driver's figure for its device.
        device_used_bytes: Some(9_000_000_000 + rank as u64),
    }
}
