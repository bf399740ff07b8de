//! HTTP benchmark of the service on loopback: submissions per second and p50/p99 latency of
//! `POST /v1/jobs` and `GET /v1/jobs/{id}`, on SQLite (a temporary file) and PostgreSQL
//! (database `test` on 127.0.0.1:5432 in a fresh schema, dropped afterwards; set
//! `ZEROTRAIN_BENCH_PG_URL` to use another server, or to `none` to skip PostgreSQL). The
//! scheduling loop runs as in production, placing jobs on one registered node.
//!
//!     cargo bench -p server --bench http [-- --requests 2000 --concurrency 16]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use scheduler::inventory::DeviceSlot;
use scheduler::memory::DeviceKind;
use serde_json::{Value, json};
use server::settings::Settings;
use sqlx::Connection;
use tokio::sync::Mutex;

const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

struct Args {
    requests: usize,
    concurrency: usize,
}

fn args() -> Args {
    Args {
        requests: support::flag("--requests").unwrap_or(2000),
        concurrency: support::flag("--concurrency").unwrap_or(16),
    }
}

/// What one phase measured.
struct Phase {
    per_second: f64,
    p50: Duration,
    p99: Duration,
}

fn main() {
    let args = args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "{} requests per phase, {} concurrent clients, {} cores",
        args.requests,
        args.concurrency,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("| store | endpoint | requests/s | p50 | p99 |\n|---|---|---|---|---|");
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = format!("sqlite://{}", dir.path().join("bench.db").display());
        bench("SQLite", &sqlite, dir.path(), &args).await;

        let pg = std::env::var("ZEROTRAIN_BENCH_PG_URL").unwrap_or(DEFAULT_PG_URL.into());
        if pg == "none" {
            return;
        }
        let schema = format!("zerotrain_bench_{}", std::process::id());
        let mut admin = sqlx::PgConnection::connect(&pg).await.unwrap_or_else(|e| {
            panic!("PostgreSQL at {pg}: {e} (ZEROTRAIN_BENCH_PG_URL=none skips it)")
        });
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&mut admin)
            .await
            .unwrap();
        let sep = if pg.contains('?') { '&' } else { '?' };
        let url = format!("{pg}{sep}options=-c%20search_path%3D{schema}");
        let pg_dir = tempfile::tempdir().unwrap();
        bench("PostgreSQL", &url, pg_dir.path(), &args).await;
        sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
            .execute(&mut admin)
            .await
            .unwrap();
    });
}

async fn bench(store: &str, url: &str, data_dir: &std::path::Path, args: &Args) {
    let settings = Settings {
        port: 0,
        data_dir: data_dir.to_path_buf(),
        database_url: Some(url.to_string()),
        ..Settings::default()
    };
    let (server, tokens) = server::build(settings, Some("zt_bench")).await.unwrap();
    let base = server.url();
    let http = reqwest::Client::new();
    // One node: the first jobs are placed, the rest queue, as on a busy service.
    let register = json!({
        "name": "bench",
        "devices": vec![DeviceSlot { kind: DeviceKind::Cpu, memory_bytes: 8 << 30 }; 8],
        "host": "127.0.0.1",
    });
    http.post(format!("{base}/v1/agents/register"))
        .bearer_auth(&tokens.join_token)
        .json(&register)
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap();
    let spec: Value = json!({
        "model": {"preset": "gpt2-tiny"},
        "training": {"micro_batch_size": 2, "seq_len": 32, "steps": 10},
        "world_size": 2,
    });

    // Warm-up, then the two phases.
    run(&http, args.concurrency, args.requests / 10, |c| {
        c.post(format!("{base}/v1/jobs")).json(&spec)
    })
    .await;
    let (post, ids) = run(&http, args.concurrency, args.requests, |c| {
        c.post(format!("{base}/v1/jobs")).json(&spec)
    })
    .await;
    let mut next = 0usize;
    let (get, _) = run(&http, args.concurrency, args.requests, |c| {
        next += 1;
        c.get(format!("{base}/v1/jobs/{}", ids[next % ids.len()]))
    })
    .await;
    for (endpoint, p) in [("POST /v1/jobs", post), ("GET /v1/jobs/{id}", get)] {
        println!(
            "| {store} | `{endpoint}` | {:.0} | {:.2} ms | {:.2} ms |",
            p.per_second,
            p.p50.as_secs_f64() * 1e3,
            p.p99.as_secs_f64() * 1e3
        );
    }
    server.shutdown().await.unwrap();
}

/// Sends `total` requests made by `make`, `concurrency` at a time; the phase's numbers and the
/// ids of the jobs the answers name.
async fn run(
    http: &reqwest::Client,
    concurrency: usize,
    total: usize,
    mut make: impl FnMut(&reqwest::Client) -> reqwest::RequestBuilder,
) -> (Phase, Vec<String>) {
    let requests: Vec<reqwest::RequestBuilder> = (0..total)
        .map(|_| make(http).bearer_auth("zt_bench"))
        .collect();
    let queue = Arc::new(Mutex::new(requests));
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let queue = queue.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut ids = Vec::new();
                loop {
                    let Some(req) = queue.lock().await.pop() else {
                        break;
                    };
                    let sent = Instant::now();
                    let resp = req.send().await.unwrap();
                    let status = resp.status();
                    let body: Value = resp.json().await.unwrap();
                    latencies.push(sent.elapsed());
                    assert!(status.is_success(), "{status}: {body}");
                    if let Some(id) = body["id"].as_str() {
                        ids.push(id.to_string());
                    }
                }
                (latencies, ids)
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(total);
    let mut ids = Vec::with_capacity(total);
    for w in workers {
        let (l, i) = w.await.unwrap();
        latencies.extend(l);
        ids.extend(i);
    }
    let elapsed = start.elapsed();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    let phase = Phase {
        per_second: total as f64 / elapsed.as_secs_f64(),
        p50: at(0.5),
        p99: at(0.99),
    };
    (phase, ids)
}
