//! `zerotrain agent --server URL --token T [--cpu-devices N --device-memory SIZE]`: a runner
//! agent offering this machine's devices to a server until the process ends.

use std::sync::atomic::AtomicBool;

use scheduler::bytes::parse_size;
use scheduler::inventory::Device;
use scheduler::memory::DeviceKind;

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
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let cfg = config(args);
    eprintln!(
        "agent {}: offering {} device(s) to {}",
        cfg.name,
        cfg.devices.len(),
        cfg.server
    );
    runner::agent::run(&cfg, &AtomicBool::new(false))?;
    Ok(())
}

fn config(args: Args) -> runner::agent::AgentConfig {
    let device = Device {
        kind: DeviceKind::Cpu,
        memory_bytes: args.device_memory,
    };
    runner::agent::AgentConfig {
        server: args.server.trim_end_matches('/').to_string(),
        join_token: args.token,
        name: args.name.unwrap_or_else(hostname),
        host: args.host,
        devices: vec![device; args.cpu_devices],
        threads: args.threads,
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "agent".into())
}
