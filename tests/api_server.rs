//! The server on a bound port: `build` with port 0, the scheduling loop on its own, graceful
//! shutdown with streams open, and the client commands of the `zerotrain` binary against it.

use crate::live;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use server::settings::Settings;

struct Running {
    server: server::Server,
    admin: String,
    join: String,
    http: reqwest::Client,
    dir: tempfile::TempDir,
}

async fn start() -> Running {
    start_with(|_| {}).await
}

async fn start_with(configure: impl FnOnce(&mut Settings)) -> Running {
    let live = live::start_with(None, |s| {
        // Only wake-ups place jobs in these tests.
        s.scheduling_interval = Duration::from_secs(3600);
        s.safety_margin = 0.0;
        configure(s);
    })
    .await;
    let on_disk = std::fs::read_to_string(live.dir.path().join("admin-token")).unwrap();
    assert_eq!(on_disk.trim(), live.admin);
    Running {
        server: live.server,
        admin: live.admin,
        join: live.join,
        http: reqwest::Client::new(),
        dir: live.dir,
    }
}

impl Running {
    async fn post(&self, path: &str, token: &str, body: &Value) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.server.url()))
            .bearer_auth(token)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// Registers a one-device node: its heartbeat URL path and token.
    async fn register(&self) -> (String, String) {
        let node = json!({
            "name": "n1",
            "devices": [{"kind": "cpu", "memory_bytes": 2u64 << 30}],
            "host": "127.0.0.1",
        });
        let resp = self.post("/v1/agents/register", &self.join, &node).await;
        assert_eq!(resp.status(), 201);
        let r: Value = resp.json().await.unwrap();
        (
            format!("/v1/agents/{}/heartbeat", r["node_id"].as_str().unwrap()),
            r["agent_token"].as_str().unwrap().to_string(),
        )
    }

    /// Runs `zerotrain ARGS` against this server as the admin.
    async fn zerotrain(&self, args: &[&str]) -> (bool, String) {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerotrain"));
        cmd.args(args)
            .env("ZEROTRAIN_URL", self.server.url())
            .env("ZEROTRAIN_TOKEN", &self.admin);
        let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }
}

fn spec() -> Value {
    json!({
        "name": "tiny",
        "model": {"preset": "gpt2-tiny"},
        "training": {"micro_batch_size": 2, "seq_len": 32, "steps": 5},
    })
}

#[tokio::test]
async fn the_scheduling_loop_places_a_submitted_job_at_once() {
    let s = start().await;
    s.register().await;
    let resp = s.post("/v1/jobs", &s.admin, &spec()).await;
    assert_eq!(resp.status(), 201);
    let id = resp.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let url = s.server.url();
    live::until_state(&url, &s.admin, &id, &["scheduled"], Duration::from_secs(10)).await;
    s.server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused_by_its_length_with_a_problem() {
    let s = start_with(|s| s.body_limit = 1024).await;
    let mut big = spec();
    big["name"] = json!("x".repeat(4096));
    let resp = s.post("/v1/jobs", &s.admin, &big).await;
    assert_eq!(resp.status(), 413);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    let metrics = s
        .http
        .get(format!("{}/metrics", s.server.url()))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let counted =
        "zerotrain_http_requests_total{method=\"POST\",route=\"/v1/jobs\",status=\"413\"} 1";
    assert!(metrics.contains(counted), "{metrics}");
    s.server.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_ends_open_event_streams() {
    let s = start().await;
    s.register().await;
    let id = s
        .post("/v1/jobs", &s.admin, &spec())
        .await
        .json::<Value>()
        .await
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut stream = s
        .http
        .get(format!("{}/v1/jobs/{id}/events", s.server.url()))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    // The stream is open once its first event, the job's current state, has arrived.
    let first = stream.chunk().await.unwrap().expect("a first event");
    assert!(
        String::from_utf8_lossy(&first).contains("event: state"),
        "{first:?}"
    );
    let reading = tokio::spawn(async move { stream.text().await });
    tokio::time::timeout(Duration::from_secs(5), s.server.shutdown())
        .await
        .expect("shutdown waits for no stream")
        .unwrap();
    // The stream ended (rather than the timeout) because the server shut down.
    reading.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_client_commands_submit_list_show_logs_and_cancel() {
    let s = start().await;
    s.register().await;
    let path = s.dir.path().join("job.json");
    std::fs::write(&path, spec().to_string()).unwrap();

    let (ok, out) = s.zerotrain(&["submit", path.to_str().unwrap()]).await;
    assert!(ok, "{out}");
    let id = out.split_whitespace().nth(1).unwrap().to_string();
    assert!(out.contains("ZeRO stage"), "{out}");

    let (ok, out) = s.zerotrain(&["jobs", "--name", "tiny"]).await;
    assert!(ok, "{out}");
    assert!(out.lines().any(|l| l.starts_with(&id)), "{out}");

    let (ok, out) = s.zerotrain(&["cancel", &id]).await;
    assert!(ok, "{out}");
    assert_eq!(out.trim(), format!("job {id} cancelled"));
    let (ok, out) = s.zerotrain(&["cancel", &id]).await;
    assert!(!ok && out.contains("already cancelled"), "{out}");

    // The cancelled job's log stream ends at once; `logs -f` returns.
    let (ok, out) = s.zerotrain(&["logs", "-f", &id]).await;
    assert!(ok, "{out}");

    s.server.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_token_command_creates_lists_and_revokes() {
    let s = start().await;
    let (ok, out) = s
        .zerotrain(&["token", "create", "ci", "--role", "viewer"])
        .await;
    assert!(ok, "{out}");
    let token = out.lines().next().unwrap().trim().to_string();
    assert!(token.starts_with("zt_"), "{out}");
    let resp = s
        .http
        .get(format!("{}/v1/jobs", s.server.url()))
        .bearer_auth(&token);
    assert_eq!(resp.send().await.unwrap().status(), 200);

    let (ok, out) = s.zerotrain(&["token", "list"]).await;
    assert!(ok, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("ci ") && l.contains("viewer")),
        "{out}"
    );
    let (ok, out) = s.zerotrain(&["token", "create", "ci"]).await;
    assert!(!ok && out.contains("exists"), "{out}");

    let (ok, out) = s.zerotrain(&["token", "revoke", "ci"]).await;
    assert!(ok, "{out}");
    let resp = s
        .http
        .get(format!("{}/v1/jobs", s.server.url()))
        .bearer_auth(&token);
    assert_eq!(resp.send().await.unwrap().status(), 401);
    let (ok, out) = s.zerotrain(&["token", "revoke", "ci"]).await;
    assert!(!ok && out.contains("no token"), "{out}");

    s.server.shutdown().await.unwrap();
}

#[tokio::test]
async fn submit_wait_follows_the_job_to_its_end() {
    let s = start().await;
    let (beat, token) = s.register().await;
    let path = s.dir.path().join("job.json");
    std::fs::write(&path, spec().to_string()).unwrap();
    let args = ["submit", path.to_str().unwrap(), "--wait"];
    let waiting = s.zerotrain(&args);
    let agent = async {
        // A fake agent: take the assignment (each beat waits for it at the server, as an
        // agent's does), then report a step and the end.
        let deadline = Instant::now() + Duration::from_secs(20);
        let job = loop {
            let reply: Value = s
                .post(
                    &beat,
                    &token,
                    &json!({"reports": [], "running": [], "wait_ms": 20_000}),
                )
                .await
                .json()
                .await
                .unwrap();
            if let Some(a) = reply["assignments"].get(0) {
                break a["job_id"].as_str().unwrap().to_string();
            }
            assert!(Instant::now() < deadline, "no assignment");
        };
        let report = |kind: &str, extra: Value| {
            let mut r = json!({"kind": kind, "job_id": job, "attempt": 1});
            r.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            r
        };
        let reports = json!([
            report("started", json!({"resumed_from": null})),
            report(
                "step",
                json!({"step": 1, "loss": 5.5, "loss_scale": 1.0,
                "tokens_per_second": 900.0, "skipped": false, "step_seconds": 0.1})
            ),
        ]);
        s.post(
            &beat,
            &token,
            &json!({"reports": reports, "running": [[job, 1]]}),
        )
        .await;
        // The end is reported once `--wait` follows the job's events.
        live::poll(
            Duration::from_secs(20),
            Duration::from_millis(10),
            || async {
                match s.server.state().events.receiver_count() {
                    0 => Err("nobody follows the job's events".to_string()),
                    _ => Ok(()),
                }
            },
        )
        .await;
        let reports = json!([report("finished", json!({"final_loss": 5.5}))]);
        s.post(&beat, &token, &json!({"reports": reports, "running": []}))
            .await;
        job
    };
    let ((ok, out), job) = tokio::join!(waiting, agent);
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!("job {job} succeeded: finished: final loss 5.5000")),
        "{out}"
    );
    s.server.shutdown().await.unwrap();
}
