//! `zerotrain agent --server URL --token T [--gpus all|none|0,1,…] [--cpu-devices N
//! --device-memory SIZE] [--data-root DIR]... [--export-shard-bytes SIZE] [--slurm]`: a runner
//! agent offering this machine's GPUs (a build with feature `cuda`) or virtual CPU devices to a
//! server until SIGTERM or Ctrl-C stops it (`--slurm`: until its one job ends); jobs read input
//! files only inside its data roots.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use runner::agent::AgentMetrics;
use wire::data_roots::DataRoots;

use runner::agent::gpus::{self, Gpu, Selection};
use runner::agent::offered_devices;
use scheduler::bytes::{human, parse_size};
use scheduler::inventory::DeviceSlot;

use server::settings::default_data_dir;

#[derive(clap::Args)]
pub struct Args {
    /// The server's URL.
    #[arg(long, env = "ZEROTRAIN_URL", default_value = "http://127.0.0.1:8080")]
    server: String,
    /// The agent join token the server printed.
    #[arg(long, env = "ZEROTRAIN_AGENT_TOKEN")]
    token: String,
    #[command(flatten)]
    offer: Offer,
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
    /// Where attempts write their files before uploading them to the server (nothing there
    /// outlives an attempt) [default: DATA_DIR/agents/NAME].
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
    #[command(flatten)]
    export: crate::train::Export,
    /// Run as the server's Slurm allocations start agents (their batch script passes it):
    /// named after the Slurm node (`SLURMD_NODENAME`), serving the allocation's job only,
    /// leaving when it ends so that the allocation is released.
    #[arg(long)]
    slurm: bool,
}

/// What a node offers, shared by `agent` and `up`'s local agent.
#[derive(clap::Args)]
pub(super) struct Offer {
    /// GPUs to offer: all the CUDA driver finds, none, or ordinals such as 0,1; each is a
    /// `cuda` device of its total memory, and each rank placed on one trains on it alone
    /// (needs a build with feature cuda; elsewhere none are found).
    #[arg(long, default_value = "all")]
    gpus: Selection,
    /// Virtual CPU devices to offer [default: none beside GPUs; otherwise 1 (`up`: 4)].
    #[arg(long)]
    cpu_devices: Option<usize>,
    /// Memory budget of each CPU device, e.g. 2GiB; the trainer enforces it.
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    device_memory: u64,
}

impl Offer {
    /// The devices to register and the GPUs among them, saying on stderr what was found:
    /// `default_cpus` CPU devices unless GPUs are offered or `--cpu-devices` says otherwise.
    pub(super) fn devices(
        &self,
        who: &str,
        default_cpus: usize,
    ) -> anyhow::Result<(Vec<DeviceSlot>, Vec<Gpu>)> {
        let found = gpus::discover();
        // A build without CUDA looks for none: nothing to say.
        if let Some(why) = found
            .none_because
            .as_ref()
            .filter(|_| cfg!(feature = "cuda"))
        {
            eprintln!("{who}: no GPUs found ({why})");
        }
        let gpus = self.gpus.pick(&found)?;
        for g in &gpus {
            eprintln!(
                "{who}: GPU {} {} {}, {} (cuda:{})",
                g.ordinal,
                g.name,
                g.uuid,
                human(g.total_bytes),
                g.ordinal
            );
        }
        let cpus = self
            .cpu_devices
            .unwrap_or(if gpus.is_empty() { default_cpus } else { 0 });
        Ok((offered_devices(&gpus, cpus, self.device_memory), gpus))
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::process::for_training(args.threads);
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
    // SIGTERM (what Kubernetes, systemd and Slurm send first) or Ctrl-C stops the ranks and
    // ends the process with status 0, as `up` does.
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let worker = std::thread::spawn(move || runner::agent::run(&cfg, &flag, &metrics));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let ended = runtime.block_on(async {
        let mut ended = tokio::task::spawn_blocking(move || worker.join());
        tokio::select! {
            joined = &mut ended => joined,
            () = super::serve::stop_requested() => {
                stop.store(true, Ordering::Relaxed);
                ended.await
            }
        }
    })?;
    ended.map_err(|_| anyhow::anyhow!("the agent panicked"))??;
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
    let name = match (args.name, args.slurm) {
        (Some(name), _) => name,
        (None, true) => std::env::var("SLURMD_NODENAME")
            .context("--slurm: SLURMD_NODENAME is not set (srun sets it on the node)")?,
        (None, false) => hostname(),
    };
    let (devices, gpus) = args.offer.devices(&format!("agent {name}"), 1)?;
    let data_dir = args.data_dir.unwrap_or_else(default_data_dir);
    let data_roots = DataRoots::for_data_dir(&args.data_roots, &data_dir, &[])?;
    let work_dir = args
        .work_dir
        .unwrap_or_else(|| data_dir.join("agents").join(&name));
    Ok(runner::agent::AgentConfig {
        server: args.server.trim_end_matches('/').to_string(),
        join_token: args.token,
        name,
        host: args.host,
        devices,
        gpus,
        data_roots,
        work_dir,
        export_shard_bytes: args.export.export_shard_bytes,
        one_job: args.slurm,
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
