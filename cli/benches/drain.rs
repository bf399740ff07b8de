//! How fast tiny jobs drain through one agent: `--jobs` (200) one-step gpt2-tiny jobs submitted
//! at once to a server (SQLite in a temporary directory, default settings: 2 s heartbeat
//! interval, 1 s scheduling interval) and one agent of 4 virtual CPU devices, both in this
//! process. Each job waits for a device, is placed, reaches the agent, trains a step, exports
//! and reports back; jobs/s counts from the first submission to the last success. Prints each
//! run and the median of `--runs` (3).
//!
//!     cargo bench -p zerotrain --bench drain [-- --jobs 200 --runs 3]

// The benchmarks' flag parsing, shared with the server's benches.
#[path = "../../server/benches/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use scheduler::inventory::DeviceSlot;
use scheduler::memory::DeviceKind;
use serde_json::json;
use server::domain::JobState;
use server::settings::Settings;

const DEVICES: usize = 4;

struct Args {
    jobs: usize,
    runs: usize,
}

fn args() -> Args {
    Args {
        jobs: support::flag("--jobs").unwrap_or(200),
        runs: support::flag("--runs").unwrap_or(3),
    }
}

fn main() {
    let args = args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "{} one-step gpt2-tiny jobs, one agent of {DEVICES} CPU devices, {} cores",
        args.jobs,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("| run | jobs | seconds | jobs/s |\n|---|---:|---:|---:|");
    let mut rates = Vec::new();
    for run in 1..=args.runs {
        let seconds = runtime.block_on(drain(args.jobs));
        let rate = args.jobs as f64 / seconds;
        println!("| {run} | {} | {seconds:.2} | {rate:.1} |", args.jobs);
        rates.push(rate);
    }
    rates.sort_by(f64::total_cmp);
    println!("| median | | | {:.1} |", rates[rates.len() / 2]);
}

/// Seconds from the first submission until all `jobs` succeeded.
async fn drain(jobs: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let settings = Settings {
        port: 0,
        data_dir: dir.path().to_path_buf(),
        ..Settings::default()
    };
    let (server, tokens) = server::build(settings, Some("zt_bench")).await.unwrap();
    let state = server.state().clone();
    let cfg = runner::agent::AgentConfig {
        server: server.url(),
        join_token: tokens.join_token,
        name: "bench".into(),
        host: "127.0.0.1".into(),
        devices: vec![
            DeviceSlot {
                kind: DeviceKind::Cpu,
                memory_bytes: 1 << 30,
            };
            DEVICES
        ],
        gpus: Vec::new(),
        data_roots: state.data_roots.clone(),
        work_dir: dir.path().join("agents/bench"),
        export_shard_bytes: runner::checkpoint::EXPORT_SHARD_BYTES,
        one_job: false,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let agent = std::thread::spawn(move || {
        runner::agent::run(&cfg, &flag, &runner::agent::AgentMetrics::new()).unwrap()
    });
    while state.store.nodes().await.unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let spec = json!({
        "model": {"preset": "gpt2-tiny"},
        "training": {"micro_batch_size": 1, "seq_len": 16, "steps": 1},
    });
    let http = reqwest::Client::new();
    let start = Instant::now();
    for _ in 0..jobs {
        http.post(format!("{}/v1/jobs", server.url()))
            .bearer_auth("zt_bench")
            .json(&spec)
            .send()
            .await
            .unwrap()
            .error_for_status()
            .unwrap();
    }
    loop {
        let counts = state.store.count_by_state().await.unwrap();
        let count = |s: JobState| counts.iter().find(|(c, _)| *c == s).map_or(0, |c| c.1);
        assert_eq!(count(JobState::Failed), 0, "a job failed: {counts:?}");
        if count(JobState::Succeeded) as usize == jobs {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    agent.join().unwrap();
    server.shutdown().await.unwrap();
    seconds
}
