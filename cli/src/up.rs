//! `zerotrain up [--port 8080] [--data-dir DIR] [--gpus all|none|0,1,…] [--cpu-devices N
//! --device-memory SIZE]`: the whole service on this machine — the server with SQLite under the
//! data directory, and one local agent offering this machine's GPUs (a build with feature
//! `cuda`) or else virtual CPU devices, serving its `/metrics` at `--metrics-addr` as a
//! standalone agent does. Prints the URL and the admin token (also written to
//! `DIR/admin-token`, where the other commands find it).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use scheduler::bytes::human;
use scheduler::inventory::DeviceSlot;
use scheduler::memory::DeviceKind;

use runner::agent::AgentMetrics;

use crate::{agent, serve};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    server: serve::Args,
    #[command(flatten)]
    offer: agent::Offer,
    /// Kernel threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Where the local agent serves its own Prometheus `/metrics` (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    metrics_addr: SocketAddr,
    #[command(flatten)]
    export: crate::train::Export,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::process::for_training(args.threads);
    let mut settings = args.server.settings();
    settings.expect_local_agent = true;
    serve::init_tracing();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let (server, tokens) = serve::start(settings).await?;
        let data_roots = server.state().data_roots.clone();
        let metrics = Arc::new(AgentMetrics::new());
        let metrics_url = agent::serve_metrics(args.metrics_addr, metrics.clone())?;
        let (devices, gpus) = args.offer.devices("local agent", 4)?;
        eprintln!(
            "local agent: {}; jobs read files only under {}; metrics at {metrics_url}",
            describe(&devices),
            crate::agent::roots_list(&data_roots)
        );
        let stop = Arc::new(AtomicBool::new(false));
        let cfg = runner::agent::AgentConfig {
            server: server.url(),
            join_token: tokens.join_token,
            name: "local".into(),
            host: "127.0.0.1".into(),
            devices,
            gpus,
            data_roots,
            work_dir: server
                .state()
                .settings
                .data_dir
                .join("agents")
                .join("local"),
            export_shard_bytes: args.export.export_shard_bytes,
            one_job: false,
        };
        let flag = stop.clone();
        let local = std::thread::spawn(move || runner::agent::run(&cfg, &flag, &metrics));
        server.run_until(serve::stop_requested()).await?;
        stop.store(true, Ordering::Relaxed);
        local
            .join()
            .map_err(|_| anyhow::anyhow!("the local agent panicked"))??;
        Ok(())
    })
}

/// `4 CPU device(s) of 2.1 GB`, `1 GPU(s) and 2 CPU device(s) of 2.1 GB`.
fn describe(devices: &[DeviceSlot]) -> String {
    let gpus = devices
        .iter()
        .filter(|d| d.kind == DeviceKind::Cuda)
        .count();
    let cpu: Vec<&DeviceSlot> = devices
        .iter()
        .filter(|d| d.kind == DeviceKind::Cpu)
        .collect();
    let cpus = match cpu.first() {
        Some(d) => format!("{} CPU device(s) of {}", cpu.len(), human(d.memory_bytes)),
        None => String::new(),
    };
    match (gpus, cpus.is_empty()) {
        (0, _) => cpus,
        (n, true) => format!("{n} GPU(s)"),
        (n, false) => format!("{n} GPU(s) and {cpus}"),
    }
}
