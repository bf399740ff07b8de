//! The runner agent: registers this node's devices with the server, keeps a heartbeat
//! waiting at the server (a long-poll, so assignments arrive as soon as they are made), runs
//! the ranks it is assigned (each job on threads of its own), reports their progress, and
//! stops an attempt the moment the server says it is over. A node the server declared lost
//! stops all its work and registers again. Synchronous: one thread runs the loop, each
//! request goes out on a thread of its own, and kernels share the process's rayon pool.

mod client;
mod job;
mod metrics;
mod session;

pub use metrics::AgentMetrics;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use scheduler::inventory::Device;

use crate::Error;
use crate::data::DataRoots;
use client::Client;
use session::{Ended, Session};
use wire::agent::RegisterRequest;

/// Where to find the server and what this node offers.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The server's base URL, e.g. `http://127.0.0.1:8080`.
    pub server: String,
    /// The join token agents register with.
    pub join_token: String,
    pub name: String,
    /// The address other nodes reach this node's ranks at.
    pub host: String,
    pub devices: Vec<Device>,
    /// Kernel threads (default: all cores).
    pub threads: Option<usize>,
    /// The only directories jobs may read their inputs from.
    pub data_roots: DataRoots,
}

/// Longest an HTTP call may take, a long-poll's wait included.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the agent until `stop` is set: registers (trying again with backoff until the server
/// answers), then heartbeats; when the server has declared the node lost, stops every rank
/// it ran and registers again.
pub fn run(cfg: &AgentConfig, stop: &AtomicBool, metrics: &AgentMetrics) -> Result<(), Error> {
    for (i, d) in cfg.devices.iter().enumerate() {
        metrics
            .device_memory_bytes
            .with_label_values(&[&i.to_string()])
            .set(d.memory_bytes as i64);
    }
    let client = Client::new(&cfg.server, HTTP_TIMEOUT);
    let request = RegisterRequest {
        name: cfg.name.clone(),
        devices: cfg.devices.clone(),
        host: cfg.host.clone(),
    };
    loop {
        let registered = client.register(&cfg.join_token, &request, stop, |e, again| {
            metrics.registration_failures.inc();
            eprintln!(
                "agent {}: registering failed ({e}); trying again in {again:.1?}",
                cfg.name
            );
        })?;
        let Some(registered) = registered else {
            return Ok(());
        };
        metrics.registrations.inc();
        match Session::new(cfg, &client, metrics, registered).run(stop) {
            Ended::Stopped => return Ok(()),
            Ended::Lost => eprintln!(
                "agent {}: the server no longer knows this node; its ranks stopped, registering again",
                cfg.name
            ),
        }
    }
}
