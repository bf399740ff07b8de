//! `zerotrain up [--port 8080] [--data-dir DIR] [--cpu-devices N --device-memory SIZE]`: the
//! whole service on this machine — the server with SQLite under the data directory, and one
//! local agent offering virtual CPU devices, serving its `/metrics` at `--metrics-addr` as a
//! standalone agent does. Prints the URL and the admin token (also written to
//! `DIR/admin-token`, where the other commands find it).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use scheduler::bytes::{human, parse_size};
use scheduler::inventory::Device;
use scheduler::memory::DeviceKind;

use runner::agent::AgentMetrics;

use super::{agent, serve};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    server: serve::Args,
    /// Virtual CPU devices the local agent offers.
    #[arg(long, default_value_t = 4)]
    cpu_devices: usize,
    /// Memory budget of each device.
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    device_memory: u64,
    /// Kernel threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Where the local agent serves its own Prometheus `/metrics` (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    metrics_addr: SocketAddr,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut settings = args.server.settings()?;
    settings.expect_local_agent = true;
    serve::init_tracing();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let (server, tokens) = serve::start(settings).await?;
        let data_roots = server.state().data_roots.clone();
        let metrics = Arc::new(AgentMetrics::new());
        let metrics_url = agent::serve_metrics(args.metrics_addr, metrics.clone())?;
        eprintln!(
            "local agent: {} CPU device(s) of {}; jobs read files only under {}; metrics at {metrics_url}",
            args.cpu_devices,
            human(args.device_memory),
            super::agent::roots_list(&data_roots)
        );
        let stop = Arc::new(AtomicBool::new(false));
        let device = Device {
            kind: DeviceKind::Cpu,
            memory_bytes: args.device_memory,
        };
        let cfg = runner::agent::AgentConfig {
            server: server.url(),
            join_token: tokens.join_token,
            name: "local".into(),
            host: "127.0.0.1".into(),
            devices: vec![device; args.cpu_devices],
            threads: args.threads,
            data_roots,
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
