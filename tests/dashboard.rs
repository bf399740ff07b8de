//! The Grafana dashboard in `deploy/grafana` queries only series the server and the agents
//! export, so renaming a metric without the dashboard fails here.

use std::collections::BTreeMap;

use runner::agent::AgentMetrics;
use runner::agent::gpus::Gpu;
use scheduler::memory::Breakdown;
use server::domain::{JobState, StepRecord};
use server::metrics::Metrics;
use wire::Op;

/// Every series family, each with at least one sample, as `/metrics` pages render them.
fn exported() -> String {
    let m = Metrics::default();
    m.set_job_counts(&[(JobState::Running, 1)]);
    let step = StepRecord {
        attempt: 1,
        step: 1,
        loss: 3.0,
        loss_scale: 1.0,
        tokens_per_second: 100.0,
        skipped: false,
        step_seconds: 0.1,
        at: 0,
        validation_loss: Some(3.5),
    };
    let model = scheduler::spec::Architecture::Gpt(scheduler::model::Preset::Tiny.shape());
    m.observe_step(&"j".into(), &model, &step);
    let sent = BTreeMap::from([(Op::AllReduce, 8u64)]);
    let b = Breakdown::default();
    m.observe_memory(&"j".into(), 0, &b, &b, Some(1 << 30), &sent);
    m.server.queue_wait_seconds.observe(1.0);
    m.server.scheduling_pass_duration_seconds.observe(0.01);
    m.server
        .http_requests_total
        .with_label_values(&["/v1/jobs", "GET", "200"])
        .inc();
    m.server
        .http_request_duration_seconds
        .with_label_values(&["/v1/jobs", "GET"])
        .observe(0.001);
    let agent = AgentMetrics::new();
    let gpu = Gpu {
        ordinal: 0,
        name: "NVIDIA H200".into(),
        uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
        total_bytes: 150_000_000_000,
    };
    agent.watch_gpus(&[gpu]);
    agent.set_gpu_memory_used(0, 1 << 30);
    m.render() + &agent.render()
}

#[test]
fn every_dashboard_query_names_an_exported_series() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/zerotrain.json"
    );
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let text = exported();
    let mut checked = 0;
    // Rows (the GPU row) hold panels of their own.
    let panels = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| match p["panels"].as_array() {
            Some(inner) if p["type"] == "row" => inner.iter().collect::<Vec<_>>(),
            _ => vec![p],
        });
    for panel in panels {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let names: Vec<&str> = expr
                .match_indices("zerotrain_")
                .map(|(at, _)| {
                    let rest = &expr[at..];
                    let end = rest
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(rest.len());
                    &rest[..end]
                })
                .collect();
            assert!(!names.is_empty(), "{}: {expr}", panel["title"]);
            for name in names {
                let sample = |sep: char| text.contains(&format!("\n{name}{sep}"));
                assert!(
                    sample('{') || sample(' '),
                    "{}: {name} is not exported",
                    panel["title"]
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 24, "only {checked} series checked");
}
