//! The runner agent: registers this node's devices with the server, heartbeats, runs the ranks
//! it is assigned (each job on threads of its own) and reports their progress. Synchronous:
//! one thread heartbeats, every job runs its ranks on its own threads, and kernels share the
//! process's rayon pool.

mod job;
mod metrics;
pub mod protocol;

pub use metrics::AgentMetrics;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use scheduler::inventory::Device;

use crate::Error;
use crate::data::DataRoots;
use protocol::{Heartbeat, HeartbeatResponse, RegisterRequest, RegisterResponse, Report};

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

/// Reports waiting for the next heartbeat, shared with the jobs' threads.
type Outbox = Arc<Mutex<Vec<Report>>>;

struct Running {
    cancel: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// Runs the agent until `stop` is set: registers, then heartbeats every interval the server
/// asks for. A failed heartbeat is retried with the same reports at the next beat.
pub fn run(cfg: &AgentConfig, stop: &AtomicBool, metrics: &AgentMetrics) -> Result<(), Error> {
    for (i, d) in cfg.devices.iter().enumerate() {
        metrics
            .device_memory_bytes
            .with_label_values(&[&i.to_string()])
            .set(d.memory_bytes as i64);
    }
    let http: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into();
    let registered: RegisterResponse = post(
        &http,
        &format!("{}/v1/agents/register", cfg.server),
        &cfg.join_token,
        &RegisterRequest {
            name: cfg.name.clone(),
            devices: cfg.devices.clone(),
            host: cfg.host.clone(),
        },
    )?;
    let beat_url = format!("{}/v1/agents/{}/heartbeat", cfg.server, registered.node_id);
    let interval = Duration::from_millis(registered.heartbeat_interval_ms);
    let outbox: Outbox = Arc::default();
    let mut running: HashMap<(String, u32), Running> = HashMap::new();
    let mut unsent: Vec<Report> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        running.retain(|_, r| !r.thread.is_finished());
        metrics.jobs_running.set(running.len() as i64);
        unsent.append(&mut outbox.lock().unwrap_or_else(|p| p.into_inner()));
        let beat = Heartbeat {
            reports: unsent.clone(),
            running: running.keys().cloned().collect(),
        };
        match post::<_, HeartbeatResponse>(&http, &beat_url, &registered.agent_token, &beat) {
            Ok(reply) => {
                metrics.heartbeats.inc();
                metrics.steps.inc_by(
                    unsent
                        .iter()
                        .filter(|r| matches!(r, Report::Step { .. }))
                        .count() as u64,
                );
                unsent.clear();
                for a in reply.assignments {
                    let key = (a.job_id.clone(), a.attempt);
                    if running.contains_key(&key) {
                        continue;
                    }
                    let cancel = Arc::new(AtomicBool::new(false));
                    let thread = job::start(a, cfg, cancel.clone(), outbox.clone());
                    running.insert(key, Running { cancel, thread });
                }
                for key in reply.cancel {
                    if let Some(r) = running.get(&key) {
                        r.cancel.store(true, Ordering::Relaxed);
                    }
                }
            }
            Err(e) => {
                metrics.heartbeat_failures.inc();
                eprintln!("agent {}: heartbeat failed, retrying: {e}", cfg.name);
            }
        }
        std::thread::sleep(interval);
    }
    for r in running.values() {
        r.cancel.store(true, Ordering::Relaxed);
    }
    Ok(())
}

fn post<B: serde::Serialize, R: serde::de::DeserializeOwned>(
    http: &ureq::Agent,
    url: &str,
    token: &str,
    body: &B,
) -> Result<R, Error> {
    let fail = |e: ureq::Error| Error::Server {
        url: url.to_string(),
        reason: e.to_string(),
    };
    http.post(url)
        .header("Authorization", &format!("Bearer {token}"))
        .send_json(body)
        .map_err(fail)?
        .body_mut()
        .read_json()
        .map_err(fail)
}
