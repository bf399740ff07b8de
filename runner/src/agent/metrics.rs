//! The agent's own Prometheus series, served by `zerotrain agent` on its `/metrics`.

use prometheus::{IntCounter, IntGauge, IntGaugeVec, Opts, Registry};

pub struct AgentMetrics {
    registry: Registry,
    /// Heartbeats the server answered.
    pub heartbeats: IntCounter,
    /// Heartbeats that failed (their reports are sent again with the next).
    pub heartbeat_failures: IntCounter,
    /// Registrations the server accepted: more than one after it had declared the node lost.
    pub registrations: IntCounter,
    /// Registrations that failed and were tried again.
    pub registration_failures: IntCounter,
    /// Attempts whose ranks were stopped because the server said they were over (or no
    /// longer knew the node).
    pub attempts_fenced: IntCounter,
    /// Jobs with ranks running on this node.
    pub jobs_running: IntGauge,
    /// Optimizer steps this node's rank-0 runs finished.
    pub steps: IntCounter,
    /// Memory budget of each device this node offers.
    pub device_memory_bytes: IntGaugeVec,
}

impl AgentMetrics {
    pub fn new() -> AgentMetrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(format!("zerotrain_agent_{name}"), help).expect("a valid name");
            registry
                .register(Box::new(c.clone()))
                .expect("registered once");
            c
        };
        let heartbeats = counter("heartbeats_total", "Heartbeats the server answered.");
        let heartbeat_failures = counter(
            "heartbeat_failures_total",
            "Heartbeats that failed; their reports go with the next.",
        );
        let registrations = counter(
            "registrations_total",
            "Registrations the server accepted; more than one after the node was declared lost.",
        );
        let registration_failures = counter(
            "registration_failures_total",
            "Registrations that failed and were tried again.",
        );
        let attempts_fenced = counter(
            "attempts_fenced_total",
            "Attempts whose ranks stopped because the server said they were over.",
        );
        let steps = counter(
            "steps_total",
            "Optimizer steps finished by ranks 0 on this node.",
        );
        let jobs_running = IntGauge::new(
            "zerotrain_agent_jobs_running",
            "Jobs with ranks running here.",
        )
        .expect("a valid name");
        registry
            .register(Box::new(jobs_running.clone()))
            .expect("registered once");
        let device_memory_bytes = IntGaugeVec::new(
            Opts::new(
                "zerotrain_agent_device_memory_bytes",
                "Memory budget of each device offered.",
            ),
            &["device"],
        )
        .expect("a valid name");
        registry
            .register(Box::new(device_memory_bytes.clone()))
            .expect("registered once");
        AgentMetrics {
            registry,
            heartbeats,
            heartbeat_failures,
            registrations,
            registration_failures,
            attempts_fenced,
            jobs_running,
            steps,
            device_memory_bytes,
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .expect("metrics encode as text")
    }
}

impl Default for AgentMetrics {
    fn default() -> Self {
        AgentMetrics::new()
    }
}
