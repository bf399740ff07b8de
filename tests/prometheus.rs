//! A real Prometheus (Debian's `prometheus`) scraping `zerotrain up` and its local agent with
//! `deploy/prometheus.yml` while a job trains: every PromQL expression of the Grafana
//! dashboard returns data (or, for a series no job reports yet, evaluates), and the alert
//! rules of `deploy/prometheus/rules.yml` load, pass their `promtool` unit tests and evaluate
//! without error.

use crate::live;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use live::poll;
use serde_json::{Value, json};

const PROMETHEUS: &str = "/usr/bin/prometheus";
const PROMTOOL: &str = "/usr/bin/promtool";
/// How long Prometheus gets to scrape and evaluate (the dashboard queries get longer), and
/// how often it is asked.
const WAIT: Duration = Duration::from_secs(30);
const EVERY: Duration = Duration::from_millis(200);

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(path)
}

fn promtool(args: &[&str]) {
    let out = Command::new(PROMTOOL).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "promtool {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A Prometheus process, killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    http: reqwest::Client,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(config: &Path, storage: &Path) -> Prometheus {
        let addr = live::free_loopback_addr();
        let child = Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", storage.display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Prometheus {
            child,
            url: format!("http://{addr}"),
            http: reqwest::Client::new(),
        }
    }

    /// `GET /api/v1/{path}`'s `data`, or why there is none yet.
    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, String> {
        let r = self
            .http
            .get(format!("{}/api/v1/{path}", self.url))
            .query(query)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let body: Value = r.json().await.map_err(|e| e.to_string())?;
        if body["status"] != "success" {
            return Err(body.to_string());
        }
        Ok(body["data"].clone())
    }

    /// The instant vector `expr` evaluates to now, once it has at least one sample.
    async fn samples(&self, expr: &str) -> Result<Vec<Value>, String> {
        let data = self.api("query", &[("query", expr)]).await?;
        match data["result"].as_array() {
            Some(v) if !v.is_empty() => Ok(v.clone()),
            _ => Err(format!("{expr}: no data yet: {data}")),
        }
    }
}

/// `deploy/prometheus.yml` aimed at this test's server, agent, token and rules, scraping every
/// second (rates over `[1m]` need two samples).
fn config(up: &live::Up, token_file: &Path) -> String {
    let shipped = std::fs::read_to_string(deploy("prometheus.yml")).unwrap();
    let server = up.url.trim_start_matches("http://");
    let aimed = shipped
        .replace("127.0.0.1:8080", server)
        .replace("127.0.0.1:9464", &up.metrics_addr)
        .replace(
            "/etc/prometheus/zerotrain-token",
            token_file.to_str().unwrap(),
        )
        .replace(
            "prometheus/rules.yml",
            deploy("prometheus/rules.yml").to_str().unwrap(),
        );
    for (from, what) in [
        (server, "the server's target"),
        (up.metrics_addr.as_str(), "the agent's target"),
        (token_file.to_str().unwrap(), "the token file"),
        ("deploy/prometheus/rules.yml", "the rule file"),
    ] {
        assert!(aimed.contains(from), "deploy/prometheus.yml lost {what}");
    }
    format!("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n{aimed}")
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    assert!(
        Path::new(PROMTOOL).exists(),
        "{PROMTOOL} is missing: install Debian's `prometheus` (.ci/run does)"
    );
    promtool(&[
        "check",
        "rules",
        deploy("prometheus/rules.yml").to_str().unwrap(),
    ]);
    promtool(&[
        "test",
        "rules",
        deploy("prometheus/rules_test.yml").to_str().unwrap(),
    ]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_evaluates_every_dashboard_query_against_a_training_job() {
    assert!(
        Path::new(PROMETHEUS).exists(),
        "{PROMETHEUS} is missing: install Debian's `prometheus` (.ci/run does)"
    );
    // Agents report a job's memory and bytes sent when it ends (not while it trains), so a
    // finished job's series are kept past the default minute while the queries run.
    let up = live::Up::start(&[("ZEROTRAIN_FINISHED_SERIES_TTL", "10m")]).await;
    // Text in the server's data root (relative paths are read from it), for a validation loss.
    std::fs::write(
        up.dir.path().join("datasets/corpus.txt"),
        "zerotrain validates on held-out text. ".repeat(100),
    )
    .unwrap();
    let http = reqwest::Client::new();
    // The server's /metrics takes a viewer token, as deploy/prometheus.yml says.
    let created: Value = http
        .post(format!("{}/v1/tokens", up.url))
        .bearer_auth(&up.admin)
        .json(&json!({"name": "prometheus", "role": "viewer"}))
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap();
    let work = tempfile::tempdir().unwrap();
    let token_file = work.path().join("zerotrain-token");
    std::fs::write(&token_file, created["token"].as_str().unwrap()).unwrap();
    let config_file = work.path().join("prometheus.yml");
    std::fs::write(&config_file, config(&up, &token_file)).unwrap();
    promtool(&["check", "config", config_file.to_str().unwrap()]);
    let prometheus = Prometheus::start(&config_file, &work.path().join("tsdb"));

    let targets = poll(WAIT, EVERY, || async {
        let data = prometheus.api("targets", &[]).await?;
        let active = data["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let up = active.iter().filter(|t| t["health"] == "up").count();
        (active.len() == 2 && up == 2)
            .then_some(active.clone())
            .ok_or(format!("{up} of {} up: {data}", active.len()))
    })
    .await;
    let jobs: Vec<&str> = targets
        .iter()
        .map(|t| t["labels"]["job"].as_str().unwrap())
        .collect();
    assert!(jobs.contains(&"zerotrain-server") && jobs.contains(&"zerotrain-agents"));

    // Submitted once scrapes run, so queue waits and first steps land between two scrapes:
    // a short job (its memory and bytes sent per collective, reported at its end), then a long
    // one that trains while the queries run. fp16 on two ranks: a loss scale, skipped-step
    // counts and collectives to chart.
    let submit = |steps: u32| {
        let http = http.clone();
        let url = format!("{}/v1/jobs", up.url);
        let admin = up.admin.clone();
        async move {
            let job: Value = http
                .post(url)
                .bearer_auth(admin)
                .json(&json!({
                    "model": {"preset": "gpt2-tiny"},
                    "world_size": 2,
                    "zero": {"stage": 2},
                    "precision": {"dtype": "fp16"},
                    "training": {"steps": steps, "micro_batch_size": 1, "seq_len": 16},
                    "data": {"kind": "text", "path": "corpus.txt",
                             "validation": {"path": "corpus.txt", "every_steps": 5, "batches": 1}},
                }))
                .send()
                .await
                .unwrap()
                .error_for_status()
                .unwrap()
                .json()
                .await
                .unwrap();
            job["id"].as_str().unwrap().to_string()
        }
    };
    let id = submit(20).await;
    submit(100_000).await;

    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(deploy("grafana/zerotrain.json")).unwrap())
            .unwrap();
    let mut evaluated = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        // The GPU row's series exist only where agents have GPUs (this agent has CPU devices):
        // `--test zerotrain dashboard::` checks their names, scripts/gpu-check a GPU agent's series.
        if panel["type"] == "row" {
            continue;
        }
        for target in panel["targets"].as_array().unwrap() {
            // `$job` is the dashboard's multi-value job variable: "All" is a regex of them all.
            let expr = target["expr"].as_str().unwrap().replace("$job", ".+");
            poll(Duration::from_secs(60), EVERY, || prometheus.samples(&expr)).await;
            evaluated += 1;
        }
    }
    assert!(evaluated >= 17, "only {evaluated} expressions");

    // The recording rule: every rank of the job holds at most what admission predicted.
    let ratio = format!("zerotrain:training_memory_measured_over_predicted:ratio{{job=\"{id}\"}}");
    let ratios = poll(WAIT, EVERY, || prometheus.samples(&ratio)).await;
    assert_eq!(ratios.len(), 2, "one ratio per rank: {ratios:?}");
    for r in &ratios {
        let value: f64 = r["value"][1].as_str().unwrap().parse().unwrap();
        assert!(value > 0.0 && value <= 1.0, "measured over predicted: {r}");
    }
    // Every rule evaluated without error, and none of the alerts fires on a healthy job.
    let rules = poll(WAIT, EVERY, || async {
        let data = prometheus.api("rules", &[]).await?;
        let rules: Vec<Value> = data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let ok = rules.iter().filter(|r| r["health"] == "ok").count();
        (rules.len() == 6 && ok == 6)
            .then_some(rules.clone())
            .ok_or(format!("{ok} of {} rules ok: {data}", rules.len()))
    })
    .await;
    let firing: Vec<&Value> = rules
        .iter()
        .filter(|r| r["type"] == "alerting" && r["state"] != "inactive")
        .collect();
    assert!(firing.is_empty(), "alerts on a healthy job: {firing:?}");

    let (status, lines) = up.stop().await;
    assert!(status.success(), "{status}: {}", lines.join("\n"));
}
