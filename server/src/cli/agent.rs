//! `zerotrain agent --server URL --token T [--cpu-devices N --device-memory SIZE]
//! [--data-root DIR]...`: a runner agent offering this machine's devices to a server until the
//! process ends; jobs read input files only inside its data roots.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use runner::agent::AgentMetrics;
use runner::data::DataRoots;

use scheduler::bytes::parse_size;
use scheduler::inventory::Device;
use scheduler::memory::DeviceKind;

use crate::settings::default_data_dir;

#[derive(clap::Args)]
pub struct Args {
    /// The server's URL.
    #[arg(long, env = "ZEROTRAIN_URL", default_value = "http://127.0.0.1:8080")]
    server: String,
    /// The agent join token the server printed.
    #[arg(long, env = "ZEROTRAIN_AGENT_TOKEN")]
    token: String,
    /// Virtual CPU devices to offer (no GPU back end is built).
    #[arg(long, default_value_t = 1)]
    cpu_devices: usize,
    /// Memory budget of each device, e.g. 2GiB; the trainer enforces it.
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    device_memory: u64,
    /// This node's name [default: the host name].
    #[arg(long)]
    name: Option<String>,
    /// The address other nodes reach this node's ranks at.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Kernel threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Where the agent serves its own Prometheus `/metrics` (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    metrics_addr: SocketAddr,
    /// A directory jobs may read input files from (repeatable); none may contain the data
    /// directory [default: DATA_DIR/datasets, created if missing].
    #[arg(
        long = "data-root",
        value_name = "DIR",
        env = "ZEROTRAIN_DATA_ROOTS",
        value_delimiter = ':'
    )]
    data_roots: Vec<PathBuf>,
    /// The service's data directory on this machine (tokens, database), which no data root may
    /// hold [default: as for `serve`].
    #[arg(long, env = "ZEROTRAIN_DATA_DIR")]
    data_dir: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let metrics = Arc::new(AgentMetrics::new());
    let metrics_url = serve_metrics(args.metrics_addr, metrics.clone())?;
    let cfg = config(args)?;
    eprintln!(
        "agent {}: offering {} device(s) to {}; metrics at {metrics_url}; data roots {}",
        cfg.name,
        cfg.devices.len(),
        cfg.server,
        roots_list(&cfg.data_roots)
    );
    runner::agent::run(&cfg, &AtomicBool::new(false), &metrics)?;
    Ok(())
}

/// Serves `metrics` at `/metrics` on `addr` on a thread of its own; returns their URL.
pub(super) fn serve_metrics(
    addr: SocketAddr,
    metrics: Arc<AgentMetrics>,
) -> anyhow::Result<String> {
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("serving metrics on {addr}"))?;
    let url = format!("http://{}/metrics", listener.local_addr()?);
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::spawn(move || {
        runtime.block_on(async move {
            let app = axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || async move { metrics.render() }),
            );
            let listener = tokio::net::TcpListener::from_std(listener).expect("a bound listener");
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("agent metrics: {e}");
            }
        })
    });
    Ok(url)
}

fn config(args: Args) -> anyhow::Result<runner::agent::AgentConfig> {
    let device = Device {
        kind: DeviceKind::Cpu,
        memory_bytes: args.device_memory,
    };
    let data_dir = args.data_dir.unwrap_or_else(default_data_dir);
    let data_roots = DataRoots::for_data_dir(&args.data_roots, &data_dir, &[])?;
    Ok(runner::agent::AgentConfig {
        server: args.server.trim_end_matches('/').to_string(),
        join_token: args.token,
        name: args.name.unwrap_or_else(hostname),
        host: args.host,
        devices: vec![device; args.cpu_devices],
        threads: args.threads,
        data_roots,
    })
}

/// The roots as a start-up line shows them.
pub(super) fn roots_list(roots: &DataRoots) -> String {
    let dirs: Vec<String> = roots
        .dirs()
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    dirs.join(", ")
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "agent".into())
}
