//! Trust boundaries and limits, tried as a hostile client would: input files outside the data
//! roots (at submission and on the agent), the per-owner and per-job limits, the throttle of
//! failed authentications, non-JSON bodies, huge echoed values, and an admin locked out.

// The API tests' in-process server (tower oneshot), shared with the server crate's tests.
use crate::api_helpers;
use crate::live;

use std::net::SocketAddr;
use std::os::unix::fs::symlink;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use api_helpers::*;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Method, Request, StatusCode, header};
use serde_json::{Value, json};
use server::domain::JobId;

fn with_input(data: Option<Value>, init_from: Option<&str>) -> Value {
    let mut spec = json!({"model": {"preset": "gpt2-tiny"}, "training": {"steps": 2}});
    if let Some(d) = data {
        spec["data"] = d;
    }
    if let Some(p) = init_from {
        spec["model"]["init_from"] = json!(p);
    }
    spec
}

fn text(path: &str) -> Option<Value> {
    Some(json!({"kind": "text", "path": path}))
}

fn tokens(path: &str) -> Option<Value> {
    Some(json!({"kind": "tokens", "path": path}))
}

#[tokio::test]
async fn submit_refuses_input_files_outside_the_data_roots_naming_the_field() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let root = app.state.data_roots.dirs()[0].to_path_buf();
    let root = root.to_str().unwrap();
    let admin_token = app.dir.path().join("admin-token");
    let admin_token = admin_token.to_str().unwrap();
    let escape = format!("{root}/../admin-token");
    let refused = [
        (text("/etc/passwd"), None, "data.path"),
        (text("../admin-token"), None, "data.path"),
        (text(&escape), None, "data.path"),
        (tokens(admin_token), None, "data.path"),
        (tokens("/etc/*"), None, "data.path"),
        (tokens("../*"), None, "data.path"),
        (None, Some("/dev/zero"), "model.init_from"),
        (None, Some(admin_token), "model.init_from"),
        (None, Some("../zerotrain.db"), "model.init_from"),
    ];
    for (data, init_from, field) in refused {
        let spec = with_input(data, init_from);
        let a = app.submit(&spec).await;
        assert_eq!(
            a.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{spec}: {}",
            a.text
        );
        let p = a.json();
        assert_eq!(p["field"], field, "{spec}");
        assert_eq!(p["detail"], format!("{field}: outside the data roots"));
    }
    assert_eq!(app.get("/v1/jobs").await.json()["jobs"], json!([]));
    // Inside a root: accepted. The server does not open the file (its nodes hold the data).
    for (data, init_from) in [
        (text("corpus.txt"), None),
        (tokens(&format!("{root}/shards/*.bin")), None),
        (None, Some("models/gpt2-tiny.safetensors")),
    ] {
        app.submit_ok(&with_input(data, init_from)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_refuses_inputs_leading_outside_its_roots_and_trains_on_those_inside() {
    let live = live::start("zt_security_admin").await;
    let root = live.server.state().data_roots.dirs()[0].to_path_buf();
    std::fs::write(root.join("corpus.txt"), "hello data roots ".repeat(64)).unwrap();
    // Links an operator left: the server admits these names (they are inside the root), the
    // agent resolves them and refuses.
    symlink("/etc/passwd", root.join("passwd.txt")).unwrap();
    symlink("/dev/zero", root.join("zero.safetensors")).unwrap();
    symlink(live.dir.path().join("admin-token"), root.join("token.txt")).unwrap();
    let (stop, agent) = live::agent(&live.server, &live.join, "local", 1, 1 << 30);
    let http = reqwest::Client::new();
    let url = live.server.url();
    let get = |path: String| {
        let http = http.clone();
        async move {
            http.get(path)
                .bearer_auth("zt_security_admin")
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    live::poll(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            match get(format!("{url}/v1/nodes")).await["nodes"].as_array() {
                Some(nodes) if !nodes.is_empty() => Ok(()),
                _ => Err("the agent never registered".to_string()),
            }
        },
    )
    .await;
    let cases = [
        (with_input(text("corpus.txt"), None), None),
        (
            with_input(text("passwd.txt"), None),
            Some("data.path: outside the data roots"),
        ),
        (
            with_input(text("token.txt"), None),
            Some("data.path: outside the data roots"),
        ),
        (
            with_input(None, Some("zero.safetensors")),
            Some("model.init_from: outside the data roots"),
        ),
    ];
    for (spec, refusal) in cases {
        let created: Value = http
            .post(format!("{url}/v1/jobs"))
            .bearer_auth("zt_security_admin")
            .json(&spec)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = created["id"]
            .as_str()
            .unwrap_or_else(|| panic!("{created}"));
        let ended = ["succeeded", "failed"];
        let (admin, limit) = ("zt_security_admin", Duration::from_secs(60));
        let job = live::until_state(&url, admin, id, &ended, limit).await;
        let logs = get(format!("{url}/v1/jobs/{id}/logs")).await.to_string();
        match refusal {
            None => assert_eq!(job["state"], "succeeded", "{job}"),
            Some(error) => {
                assert_eq!(job["state"], "failed", "{job}");
                let reason = job["reason"].as_str().unwrap();
                assert_eq!(reason, format!("failed on local: {error}"));
                // Nothing of the file reaches the job: not its bytes, not its resolved name.
                for leak in ["root:", "zt_security_admin", "/etc", "/dev", "admin-token"] {
                    assert!(!logs.contains(leak), "the log leaks {leak:?}: {logs}");
                }
                let steps = get(format!("{url}/v1/jobs/{id}/metrics")).await["steps"].clone();
                assert_eq!(steps, json!([]), "no step trained on it");
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    agent.join().unwrap();
}

#[tokio::test]
async fn an_owner_past_its_queued_jobs_gets_429_and_others_still_submit() {
    let app = TestApp::with(|s| s.limits.queued_per_owner = 2).await;
    app.register("n1", 1, 2 * GIB).await;
    let spec = tiny_spec(1);
    let first = app
        .call_with(
            Method::POST,
            "/v1/jobs",
            Some(SUBMITTER),
            Some(&spec),
            &[("idempotency-key", "k1")],
        )
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    app.submit_ok(&spec).await;
    let third = app.submit(&spec).await;
    assert_eq!(
        third.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        third.text
    );
    assert_eq!(third.json()["type"], "urn:zerotrain:problem:queue-full");
    // A retry of a job already queued is still answered with it.
    let retry = app
        .call_with(
            Method::POST,
            "/v1/jobs",
            Some(SUBMITTER),
            Some(&spec),
            &[("idempotency-key", "k1")],
        )
        .await;
    assert_eq!(retry.status, StatusCode::OK, "{}", retry.text);
    assert_eq!(retry.json()["id"], first.json()["id"]);
    let bob = app
        .call(Method::POST, "/v1/jobs", Some(OTHER_SUBMITTER), Some(&spec))
        .await;
    assert_eq!(bob.status, StatusCode::CREATED, "{}", bob.text);
    let queued = app.get("/v1/jobs?state=queued").await.json()["jobs"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(queued, 3, "nothing half-written");
}

#[tokio::test]
async fn a_job_past_the_steps_or_ranks_limits_gets_422_naming_the_field() {
    let app = TestApp::with(|s| {
        s.limits.max_steps = 100;
        s.limits.running_ranks_per_owner = 2;
    })
    .await;
    app.register("n1", 4, 2 * GIB).await;
    let mut spec = tiny_spec(1);
    spec["training"]["steps"] = json!(101);
    let a = app.submit(&spec).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    assert_eq!(a.json()["field"], "training.steps");
    spec["training"]["steps"] = json!(100);
    app.submit_ok(&spec).await;
    let a = app.submit(&tiny_spec(4)).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    assert_eq!(a.json()["field"], "world_size");
}

#[tokio::test]
async fn an_owner_holds_at_most_its_running_ranks_while_others_start() {
    let app = TestApp::with(|s| s.limits.running_ranks_per_owner = 2).await;
    app.register("n1", 8, 2 * GIB).await;
    let a1 = app.submit_ok(&tiny_spec(2)).await;
    let a2 = app.submit_ok(&tiny_spec(2)).await;
    let b = app
        .call(
            Method::POST,
            "/v1/jobs",
            Some(OTHER_SUBMITTER),
            Some(&tiny_spec(2)),
        )
        .await
        .json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(app.schedule().await, 2);
    assert_eq!(app.job(&a1).await["state"], "scheduled");
    assert_eq!(
        app.job(&a2).await["state"],
        "queued",
        "alice already holds 2 ranks"
    );
    assert_eq!(app.job(&b).await["state"], "scheduled");
    app.call(
        Method::POST,
        &format!("/v1/jobs/{a1}/cancel"),
        Some(SUBMITTER),
        None,
    )
    .await;
    assert_eq!(app.schedule().await, 1);
    assert_eq!(app.job(&a2).await["state"], "scheduled");
}

#[tokio::test]
async fn a_job_past_its_wall_time_fails_with_that_reason_and_its_agent_is_told_to_stop() {
    let app = TestApp::with(|s| s.limits.max_wall_time = Duration::from_secs(3600)).await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    app.schedule().await;
    let beat = app.beat(&node, vec![], vec![]).await;
    assert_eq!(beat.assignments.len(), 1);
    let running = vec![(id.clone(), 1)];
    // Within the hour nothing happens; past it the job fails.
    let within = server::scheduling::end_overdue(&app.state, app.state.now_ms() + 3_500_000).await;
    assert_eq!(within.unwrap(), Vec::<JobId>::new());
    let past = server::scheduling::end_overdue(&app.state, app.state.now_ms() + 3_700_000).await;
    assert_eq!(past.unwrap(), vec![id.clone()]);
    let job = app.job(&id).await;
    assert_eq!(job["state"], "failed");
    assert_eq!(job["reason"], "exceeded max_wall_time of 1h");
    assert_eq!(
        app.beat(&node, vec![], running.clone()).await.cancel,
        running
    );
}

#[tokio::test]
async fn finished_jobs_lose_their_checkpoints_after_the_retention_and_keep_the_model() {
    let app =
        TestApp::with(|s| s.limits.model_retention = Some(Duration::from_secs(30 * 86400))).await;
    app.register("n1", 1, 2 * GIB).await;
    let done = app.submit_ok(&tiny_spec(1)).await;
    let live = app.submit_ok(&tiny_spec(1)).await;
    app.call(
        Method::POST,
        &format!("/v1/jobs/{done}/cancel"),
        Some(SUBMITTER),
        None,
    )
    .await;
    // Each job has a checkpoint file and a model in the artifact store.
    let names = [
        "checkpoints/step-00000010/manifest.json",
        "model.safetensors",
    ];
    for id in [&done, &live].map(|id| JobId::from(id.as_str())) {
        for name in names {
            let body = futures::stream::iter([Ok::<_, std::io::Error>(
                axum::body::Bytes::from_static(b"bytes"),
            )]);
            let w = app.state.artifacts.put(&id, 1, name, body).await.unwrap();
            let record = server::store::ArtifactRecord {
                attempt: 1,
                name: name.into(),
                step: 10,
                bytes: w.bytes,
                sha256: w.sha256,
                at: app.state.now_ms(),
            };
            assert!(app.state.store.add_artifact(&id, &record).await.unwrap());
        }
    }
    let kept = |id: &str| {
        let objects = std::path::PathBuf::from(app.state.settings.artifacts())
            .join("jobs")
            .join(id)
            .join("attempts/1");
        let store = &app.state.store;
        let id = JobId::from(id);
        async move {
            let rows: Vec<String> = store
                .artifacts(&id)
                .await
                .unwrap()
                .into_iter()
                .map(|a| a.name)
                .collect();
            let files: Vec<&str> = names
                .into_iter()
                .filter(|n| objects.join(n).exists())
                .collect();
            assert_eq!(rows, files, "records and files agree");
            rows
        }
    };
    let day = 86_400_000;
    let collect =
        |days: i64| server::retention::collect(&app.state, app.state.now_ms() + days * day);
    assert_eq!(
        collect(6).await.unwrap(),
        server::retention::Removed::default()
    );
    let r = collect(8).await.unwrap();
    assert_eq!((r.checkpoints, r.outputs), (1, 0));
    assert_eq!(
        kept(&done).await,
        ["model.safetensors"],
        "the final model is kept"
    );
    assert_eq!(kept(&live).await, names, "a job not ended keeps everything");
    let r = collect(31).await.unwrap();
    assert_eq!((r.checkpoints, r.outputs), (0, 1));
    assert!(kept(&done).await.is_empty());
    assert_eq!(kept(&live).await, names);
}

/// A request from `peer` (as a real connection's address reaches the middleware).
fn from_peer(peer: &str, token: &str) -> Request<Body> {
    let mut req = Request::builder()
        .uri("/v1/jobs")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::empty())
        .unwrap();
    let addr: SocketAddr = peer.parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(addr));
    req
}

#[tokio::test]
async fn an_address_guessing_tokens_gets_429_with_retry_after() {
    let app = TestApp::new().await;
    for i in 0..30 {
        let a = app
            .send(from_peer("10.1.1.1:5000", &format!("zt_guess_{i}")))
            .await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "guess {i}");
    }
    for token in ["zt_guess_31", VIEWER] {
        let a = app.send(from_peer("10.1.1.1:5001", token)).await;
        assert_eq!(
            a.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{token}: {}",
            a.text
        );
        let wait: u64 = a.headers[header::RETRY_AFTER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60).contains(&wait), "{wait}");
        assert_eq!(a.json()["type"], "urn:zerotrain:problem:auth-throttled");
    }
    let other = app.send(from_peer("10.1.1.2:5000", VIEWER)).await;
    assert_eq!(other.status, StatusCode::OK, "another address is served");
}

#[tokio::test]
async fn a_body_that_is_not_json_gets_415() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let body = tiny_spec(1).to_string();
    for (path, content_type) in [
        ("/v1/jobs", Some("text/plain")),
        ("/v1/jobs", None),
        ("/v1/estimate", Some("application/x-www-form-urlencoded")),
        ("/v1/tokens", Some("multipart/form-data; boundary=x")),
    ] {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(header::AUTHORIZATION, format!("Bearer {ADMIN}"));
        if let Some(t) = content_type {
            req = req.header(header::CONTENT_TYPE, t);
        }
        let a = app.send(req.body(Body::from(body.clone())).unwrap()).await;
        assert_eq!(
            a.status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "{path} {content_type:?}: {}",
            a.text
        );
        assert_eq!(a.content_type(), "application/problem+json");
    }
    let json_with_charset = Request::builder()
        .method(Method::POST)
        .uri("/v1/jobs")
        .header(header::AUTHORIZATION, format!("Bearer {SUBMITTER}"))
        .header(header::CONTENT_TYPE, "application/json; charset=utf-8")
        .body(Body::from(body))
        .unwrap();
    assert_eq!(
        app.send(json_with_charset).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn problems_echo_at_most_a_thousand_bytes_of_what_was_sent() {
    let app = TestApp::new().await;
    let huge = "é".repeat(500_000);
    let a = app
        .call(
            Method::POST,
            "/v1/tokens",
            Some(ADMIN),
            Some(&json!({"name": huge, "role": "viewer"})),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let p = a.json();
    let detail = p["detail"].as_str().unwrap();
    assert!(
        detail.len() <= 1000 && detail.ends_with('…'),
        "{} bytes",
        detail.len()
    );
    let mut spec = tiny_spec(1);
    spec["training"][huge.as_str()] = json!(1);
    let a = app.submit(&spec).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    // detail, field and the errors list's field and reason each echo at most 1000 bytes.
    fn longest(v: &Value) -> usize {
        match v {
            Value::String(s) => s.len(),
            Value::Array(a) => a.iter().map(longest).max().unwrap_or(0),
            Value::Object(o) => o.values().map(longest).max().unwrap_or(0),
            _ => 0,
        }
    }
    let p = a.json();
    assert!(longest(&p) <= 1000, "{} bytes in one value", longest(&p));
    assert!(a.text.len() < 5000, "{} bytes", a.text.len());
}

#[tokio::test]
async fn the_last_agent_join_token_cannot_be_revoked() {
    let app = TestApp::new().await;
    let a = app
        .call(Method::DELETE, "/v1/tokens/join", Some(ADMIN), None)
        .await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text);
    assert_eq!(a.json()["type"], "urn:zerotrain:problem:last-join");
    app.register("still-joins", 1, GIB).await;
    let created = app
        .call(
            Method::POST,
            "/v1/tokens",
            Some(ADMIN),
            Some(&json!({"name": "join-2", "role": "agent_join"})),
        )
        .await;
    assert_eq!(created.status, StatusCode::CREATED);
    let a = app
        .call(Method::DELETE, "/v1/tokens/join", Some(ADMIN), None)
        .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.text);
}

/// Runs `zerotrain ARGS` to its end: (success, stdout, stderr).
fn zerotrain(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(args)
        .env_remove("ZEROTRAIN_TOKEN")
        .env_remove("ZEROTRAIN_DATABASE_URL")
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_says_the_stored_admin_token_was_revoked_and_bootstrap_mints_one_that_works() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_string();
    // A store whose bootstrap admin was revoked by another admin (whose token is lost).
    {
        let store = server::store::Store::connect(&format!("sqlite://{data}/zerotrain.db"))
            .await
            .unwrap();
        server::auth::bootstrap(&store, dir.path(), None)
            .await
            .unwrap();
        store
            .insert_token("fuzzer", server::domain::Role::Admin, "zt_lost")
            .await
            .unwrap();
        assert_eq!(
            store.revoke_token("admin").await.unwrap(),
            server::store::Revoked::Yes
        );
        store.close().await;
    }
    let mut up = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args([
            "up",
            "--port",
            "0",
            "--data-dir",
            &data,
            "--cpu-devices",
            "1",
        ])
        .env_remove("ZEROTRAIN_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = up.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let _ = tx.send(line.unwrap());
        }
    });
    let (mut url, mut said) = (None, None);
    while url.is_none() || said.is_none() {
        let line = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        if let Some(u) = line.strip_prefix("zerotrain serving at ") {
            url = Some(u.to_string());
        }
        if line.starts_with("admin token:") {
            said = Some(line);
        }
    }
    let said = said.unwrap();
    assert!(
        said.contains("was revoked")
            && said.contains(&format!(
                "zerotrain token create NAME --bootstrap --data-dir {data}"
            )),
        "{said}"
    );
    // Recovery needs the data dir only: it works while `up` runs.
    let (ok, stdout, stderr) = zerotrain(&[
        "token",
        "create",
        "rescue",
        "--bootstrap",
        "--data-dir",
        &data,
    ]);
    assert!(ok, "{stderr}");
    let token = stdout.trim().to_string();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("admin-token"))
            .unwrap()
            .trim(),
        token
    );
    let listed = reqwest::Client::new()
        .get(format!("{}/v1/tokens", url.unwrap()))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 200);
    let names: Value = listed.json().await.unwrap();
    let names: Vec<&str> = names["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"rescue") && !names.contains(&"admin"),
        "{names:?}"
    );
    // The name is checked and unique.
    let (ok, _, stderr) = zerotrain(&[
        "token",
        "create",
        "rescue",
        "--bootstrap",
        "--data-dir",
        &data,
    ]);
    assert!(!ok && stderr.contains("exists"), "{stderr}");
    let term = Command::new("kill")
        .args(["-TERM", &up.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    assert!(up.wait().unwrap().success());
}
