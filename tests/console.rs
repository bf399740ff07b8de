//! The console in a real headless Chromium (Debian's `chromium` and `chromium-driver`, driven
//! over WebDriver by fantoccini) against a live server and agent: log in, plan and submit a
//! job, watch it succeed with its charts drawn, cancel another, compare them, see a
//! cross-origin POST carrying the cookie refused and a job's validation losses charted; no page
//! logs a console error. Screenshots go to `target/console-screenshots/`. Without Chromium and
//! chromedriver this test fails: CI installs them (`.ci/run`).

use crate::live;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fantoccini::wd::WebDriverCompatibleCommand;
use fantoccini::{Client, ClientBuilder, Locator};
use scheduler::memory::Category;
use serde_json::{Value, json};
use server::domain::{Job, JobId, JobState, StepRecord};

const ADMIN: &str = "zt_console_admin";
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const WAIT: Duration = Duration::from_secs(120);

/// chromedriver on a free port, ended when dropped.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn chromedriver() -> Driver {
    for (path, package) in [(CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")] {
        assert!(
            std::path::Path::new(path).exists(),
            "{path} is missing: the console's browser test needs Debian's `{package}` \
             (apt-get install -y chromium chromium-driver; .ci/run installs it)"
        );
    }
    let port = free_port();
    let child = Command::new(CHROMEDRIVER)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver starts");
    let url = format!("http://127.0.0.1:{port}");
    // Ready when its status says so.
    let http = reqwest::Client::new();
    live::poll(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            if let Ok(r) = http.get(format!("{url}/status")).send().await
                && let Ok(v) = r.json::<Value>().await
                && v["value"]["ready"] == true
            {
                return Ok(());
            }
            Err("chromedriver never got ready".to_string())
        },
    )
    .await;
    Driver { child, url }
}

async fn browser(driver: &Driver, profile: &std::path::Path) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": CHROMIUM,
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                "--window-size=1400,2200",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    caps.insert("goog:loggingPrefs".into(), json!({"browser": "ALL"}));
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("a Chromium session")
}

/// chromedriver's `GET log` (`/session/{id}/se/log`): the browser console since the last call.
#[derive(Debug)]
struct BrowserLog;

impl WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base: &reqwest::Url,
        session: Option<&str>,
    ) -> Result<reqwest::Url, url::ParseError> {
        base.join(&format!("session/{}/se/log", session.unwrap_or_default()))
    }

    fn method_and_body(&self, _: &reqwest::Url) -> (axum::http::Method, Option<String>) {
        (
            axum::http::Method::POST,
            Some(json!({"type": "browser"}).to_string()),
        )
    }
}

/// The console's errors and warnings since the last call, less those `expected` matches.
async fn console_errors(c: &Client, expected: &[&str]) -> Vec<String> {
    let log = c.issue_cmd(BrowserLog).await.expect("the browser log");
    log.as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["level"] == "SEVERE" || e["level"] == "WARNING")
        .map(|e| e["message"].as_str().unwrap_or_default().to_string())
        .filter(|m| !expected.iter().any(|x| m.contains(x)))
        .collect()
}

async fn assert_no_console_errors(c: &Client, page: &str) {
    let errors = console_errors(c, &[]).await;
    assert!(errors.is_empty(), "console errors on {page}: {errors:#?}");
}

/// Evaluates `script` (a function body) until it returns something truthy.
async fn until(c: &Client, what: &str, script: &str) -> Value {
    live::poll(WAIT, Duration::from_millis(100), || async {
        let v = c.execute(script, vec![]).await.expect(what);
        match v.is_null() || v == false || v == "" || v == 0 {
            true => Err(format!("{what} (last: {v})")),
            false => Ok(v),
        }
    })
    .await
}

async fn screenshot(c: &Client, name: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/console-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join(format!("{name}.png")),
        c.screenshot().await.unwrap(),
    )
    .unwrap();
}

/// Counts pixels inside chart `name`'s plotting area whose colour is not grey: series drawn.
const COLOURED_PIXELS: &str = r#"
    const u = window.zerotrain && window.zerotrain.charts[arguments[0]];
    if (!u) return 0;
    const b = u.bbox;
    const d = u.ctx.getImageData(b.left, b.top, b.width, b.height).data;
    let n = 0;
    for (let i = 0; i < d.length; i += 4) {
        const [r, g, bl, a] = [d[i], d[i + 1], d[i + 2], d[i + 3]];
        if (a > 0 && (Math.abs(r - g) > 24 || Math.abs(g - bl) > 24)) n++;
    }
    return n;
"#;

/// Counts pixels inside chart `arguments[0]`'s plotting area within 40 of the colour
/// `arguments[1]` (`[r, g, b]`) in each channel: one series drawn.
const PIXELS_OF_COLOUR: &str = r#"
    const u = window.zerotrain && window.zerotrain.charts[arguments[0]];
    if (!u) return 0;
    const [r, g, bl] = arguments[1];
    const b = u.bbox;
    const d = u.ctx.getImageData(b.left, b.top, b.width, b.height).data;
    let n = 0;
    for (let i = 0; i < d.length; i += 4) {
        const near = Math.abs(d[i] - r) <= 40 && Math.abs(d[i + 1] - g) <= 40
            && Math.abs(d[i + 2] - bl) <= 40;
        if (d[i + 3] > 0 && near) n++;
    }
    return n;
"#;

/// The validation loss's colour on the loss chart (`COLORS[1]` of console.js, #ff7f0e).
const VALIDATION_RGB: [u8; 3] = [0xff, 0x7f, 0x0e];

async fn coloured_pixels(c: &Client, chart: &str) -> u64 {
    c.execute(COLOURED_PIXELS, vec![json!(chart)])
        .await
        .unwrap()
        .as_u64()
        .unwrap()
}

/// A page on another origin of the same site (another port of 127.0.0.1, so the SameSite
/// cookie still goes along) whose form posts to `target`.
async fn other_origin(target: String) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let page = format!(
        "<!doctype html><title>elsewhere</title><link rel=icon href=\"data:,\">\
         <form method=post action=\"{target}\"><button id=go>go</button></form>"
    );
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move || async move { axum::response::Html(page) }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_chromium_plans_runs_cancels_and_compares_jobs() {
    let started = Instant::now();
    let driver = chromedriver().await;
    let s = live::start(ADMIN).await;
    let (stop, agent) = live::agent(&s.server, &s.join, "local", 4, 1 << 30);
    let base = s.server.url();
    let profile = tempfile::tempdir().unwrap();
    let c = browser(&driver, profile.path()).await;

    // Log in: any page sends you to the login page and back.
    c.goto(&format!("{base}/nodes")).await.unwrap();
    c.wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#token"))
        .await
        .unwrap()
        .send_keys(ADMIN)
        .await
        .unwrap();
    c.find(Locator::Css("#login button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    until(
        &c,
        "the nodes page with the agent",
        "return document.querySelector('#nodes .devices') !== null",
    )
    .await;
    assert!(c.current_url().await.unwrap().path() == "/nodes");
    assert_no_console_errors(&c, "login").await;

    // Plan & submit: the estimate shows, then the job goes in.
    c.goto(&format!("{base}/plan")).await.unwrap();
    // A LoRA spec first: its estimate counts the adapters as PEFT does (gpt2-tiny, c_attn,
    // r 8: 2 layers · 8 · (64 + 192)).
    let lora = json!({"model": {"preset": "gpt2-tiny"}, "lora": {"rank": 8}});
    c.execute(
        "const t = document.querySelector('#spec'); t.value = arguments[0]; \
         t.dispatchEvent(new Event('input'));",
        vec![json!(lora.to_string())],
    )
    .await
    .unwrap();
    until(
        &c,
        "the LoRA estimate's trainable count",
        "const p = document.querySelector('#estimate-parameters'); \
         return p !== null && p.textContent.startsWith('4,096 trainable of 145,152 parameters')",
    )
    .await;
    let spec = json!({
        "name": "console-a",
        "model": {"preset": "gpt2-tiny"},
        "world_size": 2,
        "precision": {"dtype": "fp16"},
        "zero": {"stage": 2},
        "training": {"micro_batch_size": 2, "seq_len": 32, "steps": 12, "lr": 1e-3},
    });
    c.execute(
        "const t = document.querySelector('#spec'); t.value = arguments[0]; \
         t.dispatchEvent(new Event('input'));",
        vec![json!(serde_json::to_string_pretty(&spec).unwrap())],
    )
    .await
    .unwrap();
    until(
        &c,
        "the estimate of a 2-rank job, and Submit enabled",
        "return document.querySelectorAll('#estimate-table tbody tr').length === 4 \
         && document.querySelector('#plan-verdict').textContent.includes('Fits on 2') \
         && !document.querySelector('#submit').disabled",
    )
    .await;
    // The knob fields follow the JSON.
    let stage = c
        .execute(
            "return document.querySelector('[data-path=\"zero.stage\"]').value",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(stage, "2");
    screenshot(&c, "plan").await;
    assert_no_console_errors(&c, "plan").await;
    c.find(Locator::Css("#submit"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let url = until(
        &c,
        "the new job's page",
        "return location.pathname.startsWith('/jobs/') && location.pathname",
    )
    .await;
    let job_a = url
        .as_str()
        .unwrap()
        .trim_start_matches("/jobs/")
        .to_string();

    // The job page follows the job to success and draws its charts.
    until(
        &c,
        "job A succeeded",
        "const s = document.querySelector('#job-state'); return s && s.textContent === 'succeeded'",
    )
    .await;
    until(
        &c,
        "the charts' last update",
        "return document.querySelector('#job').dataset.metricsState === 'succeeded'",
    )
    .await;
    until(
        &c,
        "the memory table",
        "return document.querySelector('#memory') !== null",
    )
    .await;
    for chart in ["loss", "scale", "tokens", "step", "memory"] {
        let n = coloured_pixels(&c, chart).await;
        assert!(
            n > 50,
            "chart {chart} has {n} coloured pixels in its plotting area"
        );
    }
    let labels = c
        .execute(
            "return window.zerotrain.charts.memory.series.slice(1).map(s => s.label)",
            vec![],
        )
        .await
        .unwrap();
    let labels: Vec<String> = serde_json::from_value(labels).unwrap();
    // The agent's trainer does not validate this job: its validation line has no point.
    let validation = c
        .execute("return window.zerotrain.charts.loss.data[2]", vec![])
        .await
        .unwrap();
    let validation = validation.as_array().unwrap();
    assert!(
        validation.len() == 12 && validation.iter().all(Value::is_null),
        "job A's validation losses: {validation:?}"
    );
    for &category in Category::ALL {
        let n = labels.iter().filter(|l| *l == category.name()).count();
        assert_eq!(n, 1, "memory chart series {labels:?}: one per category");
    }
    assert_eq!(
        labels.len(),
        Category::ALL.len() + 1,
        "{labels:?}: the categories and the budget"
    );
    until(
        &c,
        "the followed log's last line",
        "return document.querySelector('#log').textContent.includes('finished, final loss')",
    )
    .await;
    screenshot(&c, "job").await;
    assert_no_console_errors(&c, "job").await;

    // A second, long job: a cross-origin form post with the cookie is refused; the console's
    // own Cancel works.
    let http = reqwest::Client::new();
    let mut long = spec.clone();
    long["name"] = "console-b".into();
    long["world_size"] = 1.into();
    long["training"]["steps"] = 100_000.into();
    let created: Value = http
        .post(format!("{base}/v1/jobs"))
        .bearer_auth(ADMIN)
        .json(&long)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let job_b = created["id"].as_str().unwrap().to_string();
    let elsewhere = other_origin(format!("{base}/v1/jobs/{job_b}/cancel")).await;
    c.goto(&elsewhere).await.unwrap();
    c.find(Locator::Css("#go"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let refused = until(&c, "the refusal", "return document.body && document.body.innerText.includes('cross-origin') && document.body.innerText").await;
    assert!(refused.as_str().unwrap().contains("403"), "{refused}");
    let unexpected = console_errors(&c, &["status of 403"]).await;
    assert!(unexpected.is_empty(), "{unexpected:#?}");
    c.goto(&format!("{base}/jobs/{job_b}")).await.unwrap();
    until(
        &c,
        "job B running",
        "return document.querySelector('#job-state').textContent === 'running'",
    )
    .await;
    // The nodes page shows which job holds which device.
    c.goto(&format!("{base}/nodes")).await.unwrap();
    until(
        &c,
        "job B on a device",
        &format!("return document.querySelector('#nodes a[href=\"/jobs/{job_b}\"]') !== null"),
    )
    .await;
    assert_eq!(
        c.execute(
            "return document.querySelectorAll('#nodes .devices tbody tr').length",
            vec![]
        )
        .await
        .unwrap(),
        4
    );
    screenshot(&c, "nodes").await;
    assert_no_console_errors(&c, "nodes").await;
    c.goto(&format!("{base}/jobs/{job_b}")).await.unwrap();
    until(
        &c,
        "job B's page",
        "return document.querySelector('#job-state').textContent === 'running'",
    )
    .await;
    c.find(Locator::Css("#cancel"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    c.accept_alert().await.unwrap();
    until(
        &c,
        "job B cancelled",
        "return document.querySelector('#job-state').textContent === 'cancelled'",
    )
    .await;
    assert!(c.source().await.unwrap().contains("cancelled by admin"));
    assert_no_console_errors(&c, "job B").await;

    // Compare: both loss curves, the specs' differences marked.
    c.goto(&format!("{base}/compare?id={job_a}&id={job_b}"))
        .await
        .unwrap();
    until(
        &c,
        "the comparison chart",
        "const u = window.zerotrain.charts.compare; return u && u.series.length === 3",
    )
    .await;
    let n = coloured_pixels(&c, "compare").await;
    assert!(n > 50, "comparison chart has {n} coloured pixels");
    let differs = c
        .execute("return Array.from(document.querySelectorAll('#spec-diff tr.differs th')).map(t => t.textContent)", vec![])
        .await
        .unwrap();
    let differs: Vec<String> = serde_json::from_value(differs).unwrap();
    for field in ["spec.name", "spec.training.steps", "spec.world_size"] {
        assert!(
            differs.iter().any(|d| d == field),
            "{field} not marked in {differs:?}"
        );
    }
    assert!(
        !differs.iter().any(|d| d == "spec.model.preset"),
        "{differs:?}"
    );
    assert_no_console_errors(&c, "compare").await;

    // The jobs page lists both, in the order the query string asks.
    c.goto(&format!("{base}/?sort=name")).await.unwrap();
    let names = until(&c, "both jobs listed", "const rows = document.querySelectorAll('#job-rows tr'); return rows.length === 2 && Array.from(rows).map(r => r.cells[3].textContent)").await;
    assert_eq!(names, json!(["console-a", "console-b"]));
    assert_no_console_errors(&c, "jobs").await;

    // A job whose steps carry validation losses gets them on its loss chart as a second line,
    // marked at each step that has one, named in the legend. The agent's trainer reports none
    // for these specs, so they are seeded in the store, on a copy of job A that nothing runs:
    // the agent stops first, and the copy is inserted once its node is lost.
    stop.store(true, Ordering::Relaxed);
    let store = &s.server.state().store;
    live::poll(WAIT, Duration::from_millis(100), || async {
        let nodes = store.nodes().await.map_err(|e| e.to_string())?;
        nodes
            .iter()
            .all(|n| n.lost)
            .then_some(())
            .ok_or(format!("nodes not lost yet: {nodes:?}"))
    })
    .await;
    let template = store
        .get_job(&job_a.as_str().into())
        .await
        .unwrap()
        .unwrap();
    let seeded = Job {
        id: JobId::from(String::new()),
        name: Some("console-validated".into()),
        reason: String::new(),
        created_at: 0,
        ..template
    };
    let job_c = store.insert_job(&seeded, None).await.unwrap().id;
    let steps: Vec<StepRecord> = (1..=12)
        .map(|step| StepRecord {
            attempt: 1,
            step,
            loss: 5.0 - 0.25 * f64::from(step),
            loss_scale: 1.0,
            tokens_per_second: 1000.0,
            skipped: false,
            step_seconds: 0.1,
            at: 1_700_000_000_000 + i64::from(step),
            validation_loss: (step % 4 == 0).then(|| 5.5 - 0.25 * f64::from(step)),
        })
        .collect();
    store.add_steps(&job_c, &steps).await.unwrap();
    store
        .transition(&job_c, &[JobState::Queued], JobState::Cancelled, "seeded")
        .await
        .unwrap()
        .expect("a queued job with no node to run it");
    c.goto(&format!("{base}/jobs/{job_c}")).await.unwrap();
    let validation = until(
        &c,
        "the seeded job's loss chart",
        "const u = window.zerotrain.charts.loss; return u && u.data[0].length === 12 && u.data[2]",
    )
    .await;
    assert_eq!(
        validation,
        json!([
            null, null, null, 4.5, null, null, null, 3.5, null, null, null, 2.5
        ])
    );
    let legend = c
        .execute(
            "return Array.from(document.querySelectorAll('#chart-loss .u-legend .u-label')).map(l => l.textContent)",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(legend, json!(["loss", "validation loss"]));
    let n = c
        .execute(PIXELS_OF_COLOUR, vec![json!("loss"), json!(VALIDATION_RGB)])
        .await
        .unwrap();
    assert!(
        n.as_u64().unwrap() > 50,
        "the validation line has {n} pixels of its colour"
    );
    screenshot(&c, "job-validation").await;
    assert_no_console_errors(&c, "job with validation losses").await;

    c.close().await.unwrap();
    s.server.shutdown().await.unwrap();
    agent.join().unwrap();
    eprintln!(
        "console browser test: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
