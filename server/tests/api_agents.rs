//! The agent protocol with a fake agent: registration, assignments in heartbeat replies,
//! reports moving jobs, cancellations, lost nodes, and what followers of a job see.

use crate::api_helpers;
// The Python environment helper of the end-to-end tests (tests/pyenv).
use crate::pyenv;

use std::path::Path;
use std::time::Duration;

use api_helpers::*;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use futures::StreamExt;
use scheduler::plan::Plan;
use scheduler::spec::{Auto, ZeroStage};
use serde_json::json;
use server::domain::{JobId, JobState, SlurmAllocation};
use server::store::token_hash;
use tower::ServiceExt;
use wire::agent::{Heartbeat, HeartbeatResponse, RankSlot, RankTransport, RefusalReason, Report};

fn step(job: &JobId, attempt: u32, step: u32, loss: f64) -> Report {
    Report::Step {
        job_id: job.clone(),
        attempt,
        step,
        loss,
        loss_scale: 65536.0,
        tokens_per_second: 1000.0,
        skipped: step == 1,
        step_seconds: 0.25,
        validation_loss: None,
    }
}

/// `report`, a [`step`], after which validation ran with mean loss `loss`.
fn validated(mut report: Report, loss: f64) -> Report {
    if let Report::Step {
        validation_loss, ..
    } = &mut report
    {
        *validation_loss = Some(loss);
    }
    report
}

#[tokio::test]
async fn a_fake_agent_runs_a_job_from_assignment_to_success() {
    let app = TestApp::new().await;
    let node = app.register("n1", 4, 2 * GIB).await;
    let mut spec = tiny_spec(4);
    spec["zero"]["stage"] = json!("auto");
    spec["activation_checkpointing"] = json!("auto");
    let id: JobId = app.submit_ok(&spec).await.into();

    // Nothing is assigned before the scheduler places the job.
    assert!(app.beat(&node, vec![], vec![]).await.assignments.is_empty());
    assert_eq!(app.schedule().await, 1);
    assert_eq!(app.job(&id).await["state"], "scheduled");

    let reply = app.beat(&node, vec![], vec![]).await;
    assert_eq!(reply.assignments.len(), 1);
    let a = &reply.assignments[0];
    assert_eq!(a.job_id, id);
    assert_eq!(a.attempt, 1);
    assert_eq!(a.transport, RankTransport::Local);
    assert_eq!(
        a.ranks,
        (0..4)
            .map(|r| RankSlot { rank: r, device: r })
            .collect::<Vec<_>>()
    );
    // The agent gets the spec as admitted and admission's plan, which resolves its "auto"s.
    let stored = app.job(&id).await;
    let plan: Plan = serde_json::from_value(stored["plan"].clone()).unwrap();
    assert_eq!(a.plan, plan);
    assert_eq!(a.spec.zero.stage, Auto::Auto);
    assert_eq!(serde_json::to_value(&a.spec).unwrap(), stored["spec"]);
    assert_eq!(a.plan.chosen.zero_stage, ZeroStage::Ddp);
    assert!(!a.plan.chosen.activation_checkpointing);

    // Once the agent lists it as running, it is not assigned again.
    let running = vec![(id.clone(), 1)];
    let reply = app.beat(&node, vec![], running.clone()).await;
    assert!(reply.assignments.is_empty() && reply.cancel.is_empty());

    let started = Report::Started {
        job_id: id.clone(),
        attempt: 1,
        resumed_from: None,
    };
    let log = Report::Log {
        job_id: id.clone(),
        attempt: 1,
        line: "step 1/5".into(),
    };
    let reports = vec![started, step(&id, 1, 1, 10.5), step(&id, 1, 2, 9.25), log];
    app.beat(&node, reports, running.clone()).await;
    assert_eq!(app.job(&id).await["state"], "running");

    let reports = (0..4).map(|r| memory_report(&id, r)).collect();
    app.beat(&node, reports, running.clone()).await;

    let m = app.get(&format!("/v1/jobs/{id}/metrics")).await.json();
    assert_eq!(m["state"], "running");
    let losses: Vec<f64> = m["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(losses, [10.5, 9.25]);
    assert_eq!(m["steps"][0]["skipped"], true);
    assert_eq!(m["ranks"].as_array().unwrap().len(), 4);
    assert_eq!(m["ranks"][3]["measured"]["optimizer"], 3000);
    // Beside what the node measured, admission's figures (the node reports no prediction).
    assert_eq!(m["ranks"][3]["predicted"], stored["plan"]["per_rank_bytes"]);
    assert_eq!(m["ranks"][3]["process_peak_rss_bytes"], 123_456_789);
    assert_eq!(
        m["predicted_per_rank_bytes"],
        app.job(&id).await["plan"]["per_rank_bytes"]
    );

    let prom = app.get("/metrics").await.text;
    for series in [
        format!("zerotrain_training_loss{{job=\"{id}\"}} 9.25"),
        format!("zerotrain_training_loss_scale{{job=\"{id}\"}} 65536"),
        format!("zerotrain_training_tokens_total{{job=\"{id}\"}} 500"),
        format!("zerotrain_training_skipped_steps_total{{job=\"{id}\"}} 1"),
        format!("zerotrain_training_step_duration_seconds_count{{job=\"{id}\"}} 2"),
        format!(
            "zerotrain_training_memory_bytes{{category=\"optimizer\",job=\"{id}\",rank=\"2\",source=\"measured\"}} 3000"
        ),
        format!(
            "zerotrain_training_memory_bytes{{category=\"optimizer\",job=\"{id}\",rank=\"2\",source=\"predicted\"}} {}",
            plan.per_rank_bytes.optimizer
        ),
        format!(
            "zerotrain_training_memory_bytes{{category=\"total\",job=\"{id}\",rank=\"2\",source=\"device\"}} 9000000002"
        ),
        format!(
            "zerotrain_training_comm_bytes_total{{job=\"{id}\",op=\"reduce_scatter\",rank=\"0\"}} 4096"
        ),
        "zerotrain_jobs{state=\"running\"} 1".to_string(),
        "zerotrain_queue_wait_seconds_count 1".to_string(),
        "zerotrain_scheduling_pass_duration_seconds_count".to_string(),
        "zerotrain_http_requests_total{method=\"POST\",route=\"/v1/agents/{node}/heartbeat\",status=\"200\"}".to_string(),
    ] {
        assert!(prom.contains(&series), "missing {series} in\n{prom}");
    }

    let finished = Report::Finished {
        job_id: id.clone(),
        attempt: 1,
        final_loss: 9.25,
    };
    let reply = app.beat(&node, vec![finished], vec![]).await;
    assert!(reply.assignments.is_empty());
    let job = app.job(&id).await;
    assert_eq!(job["state"], "succeeded");
    assert_eq!(job["reason"], "finished: final loss 9.2500");
    let path: Vec<&str> = job["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["to"].as_str().unwrap())
        .collect();
    assert_eq!(path, ["queued", "scheduled", "running", "succeeded"]);
    let logs = app.get(&format!("/v1/jobs/{id}/logs")).await.json();
    assert_eq!(logs["lines"][0]["line"], "step 1/5");

    // An ended job's series leave /metrics (after the grace period, zero here).
    app.schedule().await;
    let prom = app.get("/metrics").await.text;
    assert!(!prom.contains(&format!("job=\"{id}\"")), "{prom}");
    assert!(prom.contains("zerotrain_jobs{state=\"succeeded\"} 1"));
}

#[tokio::test]
async fn a_steps_validation_loss_reaches_the_job_metrics_and_its_gauge() {
    let app = TestApp::new().await;
    let node = app.register("n1", 4, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(4)).await.into();
    assert_eq!(app.schedule().await, 1);
    assert_eq!(app.beat(&node, vec![], vec![]).await.assignments.len(), 1);
    let started = Report::Started {
        job_id: id.clone(),
        attempt: 1,
        resumed_from: None,
    };
    let reports = vec![
        started,
        step(&id, 1, 1, 10.5),
        validated(step(&id, 1, 2, 9.25), 9.75),
        step(&id, 1, 3, 9.0),
    ];
    app.beat(&node, reports, vec![(id.clone(), 1)]).await;

    let m = app.get(&format!("/v1/jobs/{id}/metrics")).await.json();
    let steps = m["steps"].as_array().unwrap();
    // Every step has the field: null where validation did not run.
    let validation: Vec<&serde_json::Value> = steps
        .iter()
        .map(|s| {
            s.get("validation_loss")
                .expect("every step has validation_loss")
        })
        .collect();
    assert_eq!(validation, [&json!(null), &json!(9.75), &json!(null)]);

    // The gauge keeps the last step that validated, not the later one that did not.
    let prom = app.get("/metrics").await.text;
    let series = format!("zerotrain_training_validation_loss{{job=\"{id}\"}} 9.75");
    assert!(prom.contains(&series), "missing {series} in\n{prom}");
}

#[tokio::test]
async fn a_job_across_two_nodes_runs_over_tcp_with_the_master_rank_0_reported() {
    let app = TestApp::new().await;
    let a = app.register("a", 2, 2 * GIB).await;
    let b = app.register("b", 2, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(4)).await.into();
    assert_eq!(app.schedule().await, 1);

    let (first, second) = {
        let reply = app.beat(&a, vec![], vec![]).await;
        if reply.assignments.is_empty() {
            (b.clone(), a.clone())
        } else {
            (a.clone(), b.clone())
        }
    };
    // Rank 0's node gets its ranks at once, to listen; the other waits for the address.
    let reply = app.beat(&first, vec![], vec![]).await;
    let lead = &reply.assignments[0];
    assert_eq!(lead.transport, RankTransport::Tcp { master: None });
    assert_eq!(
        lead.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
        [0, 1]
    );
    assert!(
        app.beat(&second, vec![], vec![])
            .await
            .assignments
            .is_empty()
    );

    let rendezvous = Report::Rendezvous {
        job_id: id.clone(),
        attempt: 1,
        master: "127.0.0.1:29500".into(),
    };
    app.beat(&first, vec![rendezvous], vec![(id.clone(), 1)])
        .await;
    let reply = app.beat(&second, vec![], vec![]).await;
    let follower = &reply.assignments[0];
    assert_eq!(
        follower.transport,
        RankTransport::Tcp {
            master: Some("127.0.0.1:29500".into())
        }
    );
    assert_eq!(
        follower.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
        [2, 3]
    );

    // Only rank 0's node finishing ends the job.
    let finished = |attempt| Report::Finished {
        job_id: id.clone(),
        attempt,
        final_loss: 5.0,
    };
    app.beat(&second, vec![finished(1)], vec![]).await;
    assert_eq!(app.job(&id).await["state"], "scheduled");
    app.beat(&first, vec![finished(1)], vec![]).await;
    assert_eq!(app.job(&id).await["state"], "succeeded");
}

#[tokio::test]
async fn a_failed_report_fails_the_job_with_the_error_as_its_reason() {
    let app = TestApp::new().await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    app.schedule().await;
    app.beat(&node, vec![], vec![]).await;
    let failed = Report::Failed {
        job_id: id.clone(),
        attempt: 1,
        error: "rank 0 needs 3 GB, its device has 2 GB".into(),
        peer: false,
    };
    app.beat(&node, vec![failed], vec![]).await;
    let job = app.job(&id).await;
    assert_eq!(job["state"], "failed");
    assert_eq!(
        job["reason"],
        "failed on n1: rank 0 needs 3 GB, its device has 2 GB"
    );
}

/// A Slurm allocation's token registers nodes that serve its job alone: the scheduler gives
/// that job those nodes and no other job, and once the allocation ends its nodes are lost, the
/// job goes back to the queue and the token registers nothing more.
#[tokio::test]
async fn an_allocations_token_registers_nodes_for_its_job_only() {
    let app = TestApp::new().await;
    let open = app.register("open", 1, 2 * GIB).await;
    let busy: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    assert_eq!(app.schedule().await, 1);
    let mine: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    let other: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    let allocation = SlurmAllocation {
        slurm_job_id: 7,
        job_id: mine.clone(),
        attempt: 1,
        partition: "gpu".into(),
        nodes: 1,
        state: "SUBMITTED".into(),
        reason: "None".into(),
        submitted_at: 0,
    };
    let store = &app.state.store;
    store
        .insert_allocation(&allocation, &token_hash("alloc-token"))
        .await
        .unwrap();
    let req = json!({"name": "s1", "host": "10.9.9.9",
        "devices": [{"kind": "cpu", "memory_bytes": 2 * GIB}]});
    let register = || {
        app.call(
            Method::POST,
            "/v1/agents/register",
            Some("alloc-token"),
            Some(&req),
        )
    };
    let a = register().await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    // `other` is ahead of nothing but may not take the allocation's node; `mine` takes it.
    assert_eq!(app.schedule().await, 1);
    let placed = app.job(&mine).await;
    assert_eq!(placed["state"], "scheduled", "{placed}");
    assert!(
        placed["reason"].as_str().unwrap().contains("s1"),
        "{placed}"
    );
    assert_eq!(app.job(&other).await["state"], "queued");
    let nodes = app.get("/v1/nodes").await.json();
    let reserved: Vec<(&str, &serde_json::Value)> = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["name"].as_str().unwrap(), &n["reserved_for"]))
        .collect();
    assert_eq!(
        reserved,
        [
            ("open", &serde_json::Value::Null),
            ("s1", &json!(mine.as_str()))
        ]
    );

    let requeued = store
        .end_allocation(7, "Slurm job 7 ended: TIMEOUT")
        .await
        .unwrap();
    assert_eq!(requeued, std::slice::from_ref(&mine));
    let job = app.job(&mine).await;
    assert_eq!(
        (&job["state"], &job["attempt"]),
        (&json!("queued"), &json!(2))
    );
    assert_eq!(job["reason"], "Slurm job 7 ended: TIMEOUT");
    assert_eq!(register().await.status, StatusCode::UNAUTHORIZED);
    drop((open, busy));
}

/// A node whose ranks failed only because a peer on another node went away requeues the job
/// (the peer's node may have died and will never report), three times; the fourth such failure
/// fails it.
#[tokio::test]
async fn a_peers_loss_requeues_the_job_three_times_then_fails_it() {
    let app = TestApp::new().await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    let peer_failed = |attempt| Report::Failed {
        job_id: id.clone(),
        attempt,
        error: "rank 1: peer rank 0 closed its connection (it exited or failed)".into(),
        peer: true,
    };
    for attempt in 1..=3 {
        app.schedule().await;
        app.beat(&node, vec![peer_failed(attempt)], vec![]).await;
        let job = app.job(&id).await;
        assert_eq!(job["state"], "queued", "{job}");
        assert_eq!(job["attempt"], attempt + 1);
        assert_eq!(
            job["reason"],
            "requeued, a peer was lost on n1: rank 1: peer rank 0 closed its connection \
             (it exited or failed)"
        );
    }
    app.schedule().await;
    app.beat(&node, vec![peer_failed(4)], vec![]).await;
    let job = app.job(&id).await;
    assert_eq!(job["state"], "failed", "{job}");
    assert_eq!(job["attempt"], 4);
}

#[tokio::test]
async fn a_cancelled_job_is_stopped_at_the_agents_next_heartbeat() {
    let app = TestApp::new().await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    app.schedule().await;
    app.beat(&node, vec![], vec![]).await;
    let running = vec![(id.clone(), 1), (JobId::from("gone"), 3)];
    let reply = app.beat(&node, vec![], running.clone()).await;
    assert_eq!(
        reply.cancel,
        [(JobId::from("gone"), 3)],
        "unknown jobs stop"
    );
    let a = app
        .call(
            Method::POST,
            &format!("/v1/jobs/{id}/cancel"),
            Some(SUBMITTER),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    let reply = app.beat(&node, vec![], running).await;
    assert!(reply.cancel.contains(&(id.clone(), 1)), "{reply:?}");
}

#[tokio::test]
async fn a_lost_node_sends_its_jobs_back_to_the_queue_and_must_register_again() {
    let app = TestApp::with(|s| s.heartbeat_timeout = Duration::from_millis(200)).await;
    let lost = app.register("lost", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    app.schedule().await;
    app.beat(&lost, vec![], vec![]).await;
    app.clock.advance(Duration::from_millis(300));
    app.schedule().await;
    let job = app.job(&id).await;
    assert_eq!(job["state"], "queued");
    assert_eq!(job["attempt"], 2);

    let late_step = vec![step(&id, 1, 3, 1.0)];
    let a = app.beat_raw(&lost, late_step, vec![(id.clone(), 1)]).await;
    assert_eq!(a.status, StatusCode::GONE, "{}", a.text);
    assert_eq!(a.json()["type"], "urn:zerotrain:problem:node-lost");
    assert_eq!(app.refused("node_lost").await, 1);

    // Another node takes attempt 2; the lost node's late reports of attempt 1 change nothing.
    let other = app.register("other", 1, 2 * GIB).await;
    app.schedule().await;
    let reply = app.beat(&other, vec![], vec![]).await;
    assert_eq!(reply.assignments[0].attempt, 2);
    let late = Report::Failed {
        job_id: id.clone(),
        attempt: 1,
        error: "late".into(),
        peer: false,
    };
    let reply = app.beat(&other, vec![late], vec![(id.clone(), 1)]).await;
    assert_eq!(app.job(&id).await["state"], "scheduled");
    assert_eq!(reply.cancel, [(id.clone(), 1)], "attempt 1 must stop");
}

#[tokio::test]
async fn a_server_that_just_started_gives_silent_nodes_one_timeout_to_come_back() {
    let app = TestApp::with(|s| s.heartbeat_timeout = Duration::from_secs(600)).await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    app.schedule().await;
    // Silent for twice the timeout, as across a long server restart.
    let long_ago = app.state.now_ms() - 1_200_000;
    assert!(
        app.state
            .store
            .heartbeat(&node.0.as_str().into(), long_ago)
            .await
            .unwrap()
    );
    app.schedule().await;
    assert_eq!(app.job(&id).await["state"], "scheduled");
    assert!(app.beat(&node, vec![], vec![]).await.assignments.len() == 1);
}

#[tokio::test]
async fn a_node_token_only_beats_for_its_own_node() {
    let app = TestApp::new().await;
    let a = app.register("a", 1, 2 * GIB).await;
    let b = app.register("b", 1, 2 * GIB).await;
    let crossed = (b.0.clone(), a.1.clone());
    assert_eq!(
        app.beat_raw(&crossed, vec![], vec![]).await.status,
        StatusCode::FORBIDDEN
    );
    let register = app
        .call(
            Method::POST,
            "/v1/agents/register",
            Some(JOIN),
            Some(&json!({"name": "x", "devices": [], "host": "h"})),
        )
        .await;
    assert_eq!(register.status, StatusCode::BAD_REQUEST);
    assert_eq!(register.json()["field"], "devices");
}

/// A followed SSE response. The route subscribes its follower before it answers, so once
/// `follow` returns, no later event can be missed.
struct Events {
    body: axum::body::BodyDataStream,
    text: String,
}

async fn follow(app: &TestApp, path: &str) -> Events {
    let req = Request::builder()
        .uri(path)
        .header(header::AUTHORIZATION, format!("Bearer {VIEWER}"))
        .body(Body::empty())
        .unwrap();
    let resp = app.router.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()[header::CONTENT_TYPE], "text/event-stream");
    Events {
        body: resp.into_body().into_data_stream(),
        text: String::new(),
    }
}

impl Events {
    /// The next `n` events as (event, data) pairs, fewer if the stream ends first.
    async fn take(&mut self, n: usize) -> Vec<(String, serde_json::Value)> {
        let mut events = Vec::new();
        while events.len() < n {
            if let Some(end) = self.text.find("\n\n") {
                let block: String = self.text.drain(..end + 2).collect();
                let name = block.lines().find_map(|l| l.strip_prefix("event: "));
                let data = block.lines().find_map(|l| l.strip_prefix("data: "));
                if let (Some(name), Some(data)) = (name, data) {
                    let data = serde_json::from_str(data).unwrap_or(json!(data));
                    events.push((name.to_string(), data));
                }
                continue;
            }
            let Some(chunk) = tokio::time::timeout(Duration::from_secs(10), self.body.next())
                .await
                .expect("an event")
            else {
                break;
            };
            self.text
                .push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
        events
    }
}

#[tokio::test]
async fn events_stream_state_changes_and_steps_and_end_with_the_job() {
    let app = TestApp::new().await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    let mut follower = follow(&app, &format!("/v1/jobs/{id}/events")).await;
    // The current state first: the follower has read the job and is listening.
    let mut events = follower.take(1).await;
    app.schedule().await;
    app.beat(&node, vec![], vec![]).await;
    let started = Report::Started {
        job_id: id.clone(),
        attempt: 1,
        resumed_from: None,
    };
    let finished = Report::Finished {
        job_id: id.clone(),
        attempt: 1,
        final_loss: 7.0,
    };
    app.beat(
        &node,
        vec![started, step(&id, 1, 1, 8.0)],
        vec![(id.clone(), 1)],
    )
    .await;
    app.beat(&node, vec![finished], vec![]).await;
    events.extend(follower.take(usize::MAX).await);
    let seen: Vec<String> = events
        .iter()
        .map(|(name, data)| match name.as_str() {
            "state" => data["state"].as_str().unwrap().to_string(),
            _ => format!("{name} {}", data["step"]),
        })
        .collect();
    assert_eq!(
        seen,
        ["queued", "scheduled", "running", "step 1", "succeeded"]
    );
}

#[tokio::test]
async fn following_logs_streams_every_line_then_ends_with_the_job() {
    let app = TestApp::new().await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    app.schedule().await;
    app.beat(&node, vec![], vec![]).await;
    let log = |line: &str| Report::Log {
        job_id: id.clone(),
        attempt: 1,
        line: line.into(),
    };
    app.beat(&node, vec![log("one"), log("two")], vec![(id.clone(), 1)])
        .await;
    let mut follower = follow(&app, &format!("/v1/jobs/{id}/logs?follow=true")).await;
    // The stored lines first; then the follower waits for more.
    let mut events = follower.take(2).await;
    let failed = Report::Failed {
        job_id: id.clone(),
        attempt: 1,
        error: "boom".into(),
        peer: false,
    };
    app.beat(&node, vec![log("three"), failed], vec![]).await;
    events.extend(follower.take(usize::MAX).await);
    let lines: Vec<String> = events
        .iter()
        .map(|(name, data)| match name.as_str() {
            "log" => data["line"].as_str().unwrap().to_string(),
            other => format!("{other}: {}", data.as_str().unwrap_or_default()),
        })
        .collect();
    assert_eq!(lines, ["one", "two", "three", "end: failed"]);
}

fn refusals(reply: &HeartbeatResponse) -> Vec<(usize, RefusalReason)> {
    reply.refused.iter().map(|r| (r.index, r.reason)).collect()
}

#[tokio::test]
async fn a_node_s_reports_for_a_job_running_on_another_node_are_refused_and_counted() {
    let app = TestApp::new().await;
    let owner = app.register("owner", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    assert_eq!(app.schedule().await, 1);
    // A second node, registered with the same join token, holds nothing of the job.
    let intruder = app.register("intruder", 1, 2 * GIB).await;
    let started = Report::Started {
        job_id: id.clone(),
        attempt: 1,
        resumed_from: None,
    };
    app.beat(&owner, vec![started], vec![(id.clone(), 1)]).await;
    assert_eq!(app.job(&id).await["state"], "running");

    let before = app.refused("not_assigned").await;
    let forged = vec![
        step(&id, 1, 1, 0.5),
        Report::Log {
            job_id: id.clone(),
            attempt: 1,
            line: "forged".into(),
        },
        Report::Checkpoint {
            job_id: id.clone(),
            attempt: 1,
            step: 1,
        },
        memory_report(&id, 0),
        Report::Failed {
            job_id: id.clone(),
            attempt: 1,
            error: "forged".into(),
            peer: false,
        },
        Report::Finished {
            job_id: id.clone(),
            attempt: 1,
            final_loss: 0.0,
        },
        Report::Failed {
            job_id: "no-such-job".into(),
            attempt: 1,
            error: "forged".into(),
            peer: false,
        },
    ];
    let reply = app.beat(&intruder, forged, vec![]).await;
    let mut expected: Vec<_> = (0..6).map(|i| (i, RefusalReason::NotAssigned)).collect();
    expected.push((6, RefusalReason::UnknownJob));
    assert_eq!(refusals(&reply), expected);
    assert_eq!(app.refused("not_assigned").await, before + 6);
    assert_eq!(app.refused("unknown_job").await, 1);

    let job = app.job(&id).await;
    assert_eq!(job["state"], "running", "{job}");
    let m = app.get(&format!("/v1/jobs/{id}/metrics")).await.json();
    assert_eq!(m["steps"], json!([]), "{m}");
    assert_eq!(m["ranks"], json!([]), "{m}");
    let logs = app.get(&format!("/v1/jobs/{id}/logs")).await.json();
    assert_eq!(logs["lines"], json!([]), "{logs}");
    assert!(
        app.state
            .store
            .checkpoints(&id.as_str().into())
            .await
            .unwrap()
            .is_empty()
    );

    // The owner's own reports still go through.
    let reply = app
        .beat(&owner, vec![step(&id, 1, 1, 0.5)], vec![(id.clone(), 1)])
        .await;
    assert!(reply.refused.is_empty(), "{reply:?}");
}

#[tokio::test]
async fn a_node_without_rank_0_cannot_report_for_the_whole_job() {
    let app = TestApp::new().await;
    let a = app.register("a", 1, 2 * GIB).await;
    let b = app.register("b", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(2)).await.into();
    assert_eq!(app.schedule().await, 1);
    let lead_is_a = !app.beat(&a, vec![], vec![]).await.assignments.is_empty();
    let follower = if lead_is_a { b } else { a };
    let whole_job = vec![
        Report::Started {
            job_id: id.clone(),
            attempt: 1,
            resumed_from: None,
        },
        step(&id, 1, 1, 0.5),
        memory_report(&id, 1),
    ];
    let reply = app.beat(&follower, whole_job, vec![]).await;
    let not_rank_0 = RefusalReason::NotRank0;
    assert_eq!(refusals(&reply), [(0, not_rank_0), (1, not_rank_0)]);
    assert_eq!(app.job(&id).await["state"], "scheduled");
}

#[tokio::test]
async fn reports_of_an_attempt_that_is_over_are_refused_and_the_next_resumes_from_what_was_committed()
 {
    let app = TestApp::new().await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    app.schedule().await;
    let a = app.beat(&node, vec![], vec![]).await.assignments.remove(0);
    assert_eq!(a.resume_from, None);
    let checkpoint = |attempt, step| Report::Checkpoint {
        job_id: id.clone(),
        attempt,
        step,
    };
    let files = |step: u32| {
        [
            format!("checkpoints/step-{step:08}/manifest.json"),
            format!("checkpoints/step-{step:08}/rank-00000.safetensors"),
        ]
    };
    let started = Report::Started {
        job_id: id.clone(),
        attempt: 1,
        resumed_from: None,
    };
    let running = vec![(id.clone(), 1)];
    // A checkpoint reported before its files are all uploaded is not committed.
    app.upload(&node, &id, 1, &files(10)[1], "rank 0 at 10")
        .await;
    let reply = app
        .beat(&node, vec![started, checkpoint(1, 10)], running.clone())
        .await;
    assert_eq!(refusals(&reply), [(1, RefusalReason::Incomplete)]);
    assert_eq!(app.refused("incomplete").await, 1);
    let stored = app
        .upload(&node, &id, 1, &files(10)[0], "manifest at 10")
        .await;
    assert_eq!(stored.status, StatusCode::CREATED, "{}", stored.text);
    assert_eq!(stored.json()["step"], 10);
    assert_eq!(stored.json()["bytes"], 14);
    let reply = app
        .beat(&node, vec![checkpoint(1, 10)], running.clone())
        .await;
    assert!(reply.refused.is_empty(), "{reply:?}");

    // The job goes back to the queue (as when its node is lost): attempt 1 is over, and
    // neither its reports nor its uploads count.
    let requeued = app
        .state
        .transition(
            &id.as_str().into(),
            &[JobState::Running],
            JobState::Queued,
            "requeued",
        )
        .await
        .unwrap();
    assert!(requeued.is_some());
    for name in files(20).iter().chain([&"model.safetensors".to_string()]) {
        let late = app.upload(&node, &id, 1, name, "zombie").await;
        assert_eq!(late.status, StatusCode::CONFLICT, "{name}: {}", late.text);
        assert!(late.text.contains("attempt_over"), "{}", late.text);
    }
    let late = vec![
        checkpoint(1, 20),
        step(&id, 1, 15, 1.0),
        Report::Finished {
            job_id: id.clone(),
            attempt: 1,
            final_loss: 1.0,
        },
    ];
    let reply = app.beat(&node, late, running).await;
    let over = RefusalReason::AttemptOver;
    assert_eq!(refusals(&reply), [(0, over), (1, over), (2, over)]);
    assert_eq!(reply.cancel, [(id.clone(), 1)], "its ranks must stop");
    assert_eq!(app.refused("attempt_over").await, 6);

    // Attempt 2 resumes from the checkpoint the server committed, and fetches its files.
    app.schedule().await;
    let b = app.beat(&node, vec![], vec![]).await.assignments.remove(0);
    assert_eq!(b.attempt, 2);
    let resume = b.resume_from.expect("a committed checkpoint");
    assert_eq!(resume.step, 10);
    assert_eq!(resume.files, files(10));
    let fetched = app
        .call(
            Method::GET,
            &format!(
                "/v1/agents/{}/jobs/{id}/artifacts/{}",
                node.0,
                files(10)[0].replace('/', "%2F")
            ),
            Some(&node.1),
            None,
        )
        .await;
    assert_eq!(
        (fetched.status, fetched.text.as_str()),
        (StatusCode::OK, "manifest at 10")
    );
    let listed = || async {
        let list = app.get(&format!("/v1/jobs/{id}/artifacts")).await.json();
        list["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["name"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(listed().await, files(10), "the committed checkpoint only");

    // Attempt 2's export is the job's once it succeeds.
    for (name, text) in [("model.safetensors", "weights"), ("config.json", "{}")] {
        let up = app.upload(&node, &id, 2, name, text).await;
        assert_eq!(up.status, StatusCode::CREATED, "{}", up.text);
        assert_eq!(up.json()["step"], 5, "the job's last step");
    }
    assert_eq!(listed().await, files(10), "not before it succeeded");
    let finished = Report::Finished {
        job_id: id.clone(),
        attempt: 2,
        final_loss: 1.0,
    };
    let reply = app.beat(&node, vec![finished], vec![]).await;
    assert!(reply.refused.is_empty(), "{reply:?}");
    assert_eq!(app.job(&id).await["state"], "succeeded");
    let mut want = files(10).to_vec();
    want.extend(["config.json".into(), "model.safetensors".into()]);
    assert_eq!(listed().await, want);
    let model = app
        .get(&format!("/v1/jobs/{id}/artifacts/model.safetensors"))
        .await;
    assert_eq!(
        (model.status, model.text.as_str()),
        (StatusCode::OK, "weights")
    );
    assert_eq!(model.headers[header::CONTENT_LENGTH], "7");
    assert_eq!(model.content_type(), "application/octet-stream");
}

#[tokio::test]
async fn a_node_uploads_only_its_own_ranks_files_and_only_artifact_names() {
    let app = TestApp::new().await;
    let first = app.register("n1", 1, 2 * GIB).await;
    let second = app.register("n2", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(2)).await.into();
    app.schedule().await;
    let a = app.beat(&first, vec![], vec![]).await.assignments;
    let (rank0, rank1) = if a.is_empty() {
        (&second, &first)
    } else {
        (&first, &second)
    };
    let rank_file = |r: u32| format!("checkpoints/step-00000002/rank-{r:05}.safetensors");
    for (node, name, want) in [
        (rank1, rank_file(1), StatusCode::CREATED),
        (rank0, rank_file(0), StatusCode::CREATED),
        (rank1, rank_file(0), StatusCode::CONFLICT),
        (rank0, rank_file(1), StatusCode::CONFLICT),
        (
            rank1,
            "checkpoints/step-00000002/manifest.json".into(),
            StatusCode::CONFLICT,
        ),
        (rank1, "model.safetensors".into(), StatusCode::CONFLICT),
        (
            rank0,
            "../../../zerotrain.db".into(),
            StatusCode::BAD_REQUEST,
        ),
        (
            rank0,
            "checkpoints/step-2/manifest.json".into(),
            StatusCode::BAD_REQUEST,
        ),
    ] {
        let up = app.upload(node, &id, 1, &name, "bytes").await;
        assert_eq!(up.status, want, "{name}: {}", up.text);
    }
    // Another node's token for this node's path, and a person's token, are refused.
    let forged = app
        .upload(
            &(rank0.0.clone(), rank1.1.clone()),
            &id,
            1,
            &rank_file(0),
            "x",
        )
        .await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN, "{}", forged.text);
    let person = app
        .upload(&(rank0.0.clone(), ADMIN.into()), &id, 1, &rank_file(0), "x")
        .await;
    assert_eq!(person.status, StatusCode::FORBIDDEN, "{}", person.text);
    // Nothing refused was written: the store holds the two accepted files alone.
    let stored = app
        .state
        .store
        .artifacts(&id.as_str().into())
        .await
        .unwrap();
    let names: Vec<&str> = stored.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, [rank_file(0), rank_file(1)]);
    let mut on_disk: Vec<String> = walk(app.state.settings.artifacts().as_ref());
    on_disk.sort();
    assert_eq!(
        on_disk,
        [
            format!("jobs/{id}/attempts/1/{}", rank_file(0)),
            format!("jobs/{id}/attempts/1/{}", rank_file(1)),
        ]
    );
}

#[tokio::test]
async fn a_job_started_from_a_sharded_export_is_assigned_its_files_and_only_its_nodes_fetch_them() {
    let app = TestApp::new().await;
    let nodes = [
        app.register("n1", 1, 2 * GIB).await,
        app.register("n2", 1, 2 * GIB).await,
    ];
    // The node a job is assigned to (its assignment) and the other one.
    let placed = async |id: &JobId| {
        app.schedule().await;
        for (k, node) in nodes.iter().enumerate() {
            let mine = app.beat(node, vec![], vec![]).await.assignments;
            if let Some(a) = mine.into_iter().find(|a| a.job_id == *id) {
                return (&nodes[k], &nodes[1 - k], a);
            }
        }
        panic!("job {id} was not assigned");
    };
    let from: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    let (holder, _, _) = placed(&from).await;
    let index = "model.safetensors.index.json";
    let files = [
        ("config.json", "{}"),
        ("model-00001-of-00002.safetensors", "first"),
        ("model-00002-of-00002.safetensors", "second"),
        (index, "{\"weight_map\": {}}"),
    ];
    for (name, text) in files {
        let up = app.upload(holder, &from, 1, name, text).await;
        assert_eq!(up.status, StatusCode::CREATED, "{name}: {}", up.text);
    }
    let finished = Report::Finished {
        job_id: from.clone(),
        attempt: 1,
        final_loss: 1.0,
    };
    app.beat(holder, vec![finished], vec![]).await;

    // Its index counts as a model to start from.
    let mut spec = tiny_spec(1);
    spec["model"]["init_from"] = json!({"job": from, "artifact": "model"});
    let id: JobId = app.submit_ok(&spec).await.into();
    let (runner, idle, a) = placed(&id).await;
    assert_eq!(a.init_from, [files[1].0, files[2].0, index]);
    let fetch = async |(node, token): &(String, String), name: &str| {
        let path = format!("/v1/agents/{node}/jobs/{id}/artifacts/{name}");
        app.call(Method::GET, &path, Some(token), None).await
    };
    for (name, text) in &files[1..] {
        let got = fetch(runner, name).await;
        assert_eq!(
            (got.status, got.text.as_str()),
            (StatusCode::OK, *text),
            "{name}"
        );
    }
    // A node running no rank of the job fetches nothing for it; and the export's config is
    // not among what the job starts from.
    let refused = fetch(idle, files[1].0).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text);
    assert_eq!(
        fetch(runner, "config.json").await.status,
        StatusCode::NOT_FOUND
    );
}

/// Every file under `dir`, relative to it.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out
}

#[tokio::test]
async fn a_download_serves_byte_ranges_and_viewers_may_download() {
    downloads_serve_byte_ranges(&TestApp::new().await).await;
}

/// An S3-compatible server for one test: moto, from the environment `scripts/pyenv` makes,
/// on a free port it reports on its first line.
struct Moto {
    server: std::process::Child,
    endpoint: String,
}

impl Moto {
    fn start() -> Moto {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let python = pyenv::interpreter();
        // It serves until its stdin closes: when the test ends, however it ends.
        let script = "import logging, sys\n\
            from moto.server import ThreadedMotoServer\n\
            logging.getLogger('werkzeug').setLevel(logging.ERROR)\n\
            s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\n\
            s.start()\n\
            print(s.get_host_and_port()[1], flush=True)\n\
            sys.stdin.read()\n";
        let mut server = Command::new(python)
            .args(["-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut port = String::new();
        std::io::BufReader::new(server.stdout.take().unwrap())
            .read_line(&mut port)
            .unwrap();
        let port: u16 = port
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("moto said {port:?}"));
        Moto {
            server,
            endpoint: format!("http://127.0.0.1:{port}"),
        }
    }

    /// The configuration the server would read from `AWS_*` variables.
    fn options(&self) -> server::settings::S3Options {
        let pairs = [
            ("AWS_ENDPOINT_URL", self.endpoint.as_str()),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
        ];
        server::settings::S3Options(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

#[tokio::test]
async fn artifacts_go_to_s3_under_the_configured_prefix() {
    let moto = Moto::start();
    let http = reqwest::Client::new();
    let bucket = format!("{}/zerotrain-test", moto.endpoint);
    let made = http.put(&bucket).send().await.unwrap();
    assert!(made.status().is_success(), "{}", made.status());
    let options = moto.options();
    let app = TestApp::with(|s| {
        s.artifacts = Some("s3://zerotrain-test/team/a".into());
        s.s3 = options;
    })
    .await;
    let id = JobId::from(downloads_serve_byte_ranges(&app).await);

    // The objects are in the bucket under the prefix, where the store's records say.
    let object = format!("{bucket}/team/a/jobs/{id}/attempts/1/model.safetensors");
    let got = http.get(&object).send().await.unwrap();
    assert_eq!(got.status(), reqwest::StatusCode::OK);
    assert_eq!(got.text().await.unwrap(), "0123456789");
    assert!(
        !holds_files(&app.dir.path().join("artifacts")),
        "nothing was written to the local default"
    );
    // A checkpoint-sized file goes up in several parts (S3's are 5 MiB at least) and comes
    // back whole and in ranges.
    let big: Vec<u8> = (0..12u32 << 20).map(|i| (i % 251) as u8).collect();
    let chunks = big
        .chunks(1 << 20)
        .map(|c| Ok::<_, std::convert::Infallible>(axum::body::Bytes::copy_from_slice(c)));
    let name = "checkpoints/step-00000002/rank-00000.safetensors";
    let written = app
        .state
        .artifacts
        .put(&id, 1, name, futures::stream::iter(chunks))
        .await
        .unwrap();
    assert_eq!(written.bytes, big.len() as u64);
    let record = server::store::ArtifactRecord {
        attempt: 1,
        name: name.into(),
        step: 2,
        bytes: written.bytes,
        sha256: written.sha256,
        at: 0,
    };
    let read = |range| {
        let (app, record, id) = (&app, &record, &id);
        async move {
            let stream = app.state.artifacts.get(id, record, range).await.unwrap();
            let parts: Vec<_> = stream.map(|b| b.unwrap()).collect().await;
            parts.concat()
        }
    };
    assert!(read(None).await == big, "the whole file");
    let (from, to) = (5 << 20, (5 << 20) + 10);
    assert_eq!(read(Some(from as u64..to as u64)).await, big[from..to]);
    // What retention calls removes them there.
    let removed = app.state.artifacts.remove(&id, |_| false).await.unwrap();
    assert_eq!(removed, 3);
    let gone = http.get(&object).send().await.unwrap();
    assert_eq!(gone.status(), reqwest::StatusCode::NOT_FOUND);
}

fn holds_files(dir: &Path) -> bool {
    dir.exists() && !walk(dir).is_empty()
}

/// Uploads a job's export, lets the job succeed, and checks what its download serves; returns
/// the job's id.
async fn downloads_serve_byte_ranges(app: &TestApp) -> String {
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    app.schedule().await;
    app.beat(&node, vec![], vec![]).await;
    for (name, text) in [("model.safetensors", "0123456789"), ("config.json", "{}")] {
        app.upload(&node, &id, 1, name, text).await;
    }
    let path = format!("/v1/jobs/{id}/artifacts/model.safetensors");
    let listed = app.get(&format!("/v1/jobs/{id}/artifacts")).await.json();
    assert_eq!(
        listed["artifacts"],
        json!([]),
        "nothing before the job succeeded"
    );
    assert_eq!(app.get(&path).await.status, StatusCode::NOT_FOUND);
    let finished = Report::Finished {
        job_id: id.clone(),
        attempt: 1,
        final_loss: 1.0,
    };
    app.beat(&node, vec![finished], vec![]).await;
    let listed = app.get(&format!("/v1/jobs/{id}/artifacts")).await.json();
    assert_eq!(
        listed["artifacts"][1],
        json!({"name": "model.safetensors", "bytes": 10, "step": 5,
            "sha256": "84d89877f0d4041efb6bf91a16f0248f2fd573e6af05c19f96bedb9f882f7882"})
    );
    for (range, status, body, content_range) in [
        (
            "bytes=2-4",
            StatusCode::PARTIAL_CONTENT,
            "234",
            "bytes 2-4/10",
        ),
        (
            "bytes=7-",
            StatusCode::PARTIAL_CONTENT,
            "789",
            "bytes 7-9/10",
        ),
        (
            "bytes=-2",
            StatusCode::PARTIAL_CONTENT,
            "89",
            "bytes 8-9/10",
        ),
        (
            "bytes=10-",
            StatusCode::RANGE_NOT_SATISFIABLE,
            "",
            "bytes */10",
        ),
    ] {
        let got = app
            .call_with(Method::GET, &path, Some(VIEWER), None, &[("range", range)])
            .await;
        assert_eq!(got.status, status, "{range}: {}", got.text);
        assert_eq!(got.headers[header::CONTENT_RANGE], content_range, "{range}");
        if status == StatusCode::PARTIAL_CONTENT {
            assert_eq!(got.text, body, "{range}");
        }
    }
    let whole = app
        .call_with(
            Method::GET,
            &path,
            Some(VIEWER),
            None,
            &[("accept-encoding", "gzip")],
        )
        .await;
    assert_eq!(whole.text, "0123456789", "sent as stored, never compressed");
    assert_eq!(
        app.call(Method::GET, &path, None, None).await.status,
        StatusCode::UNAUTHORIZED
    );
    let none = app
        .get(&format!("/v1/jobs/{id}/artifacts/checkpoints%2Fnope"))
        .await;
    assert_eq!(none.status, StatusCode::NOT_FOUND);
    id.into()
}

/// Returns once a heartbeat is waiting at the server (after it looked for work and found none).
/// The server announces no event for that, only the gauge, which is read until it moves.
async fn until_a_heartbeat_waits(app: &TestApp) {
    while app.state.metrics.server.agent_heartbeats_waiting.get() < 1.0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn a_waiting_heartbeat_returns_as_soon_as_a_job_is_placed_on_its_node() {
    // The wait asked for is far longer than the test is given: only a wake returns it.
    let app = TestApp::with(|s| {
        s.request_timeout = Duration::from_secs(7200);
        s.heartbeat_timeout = Duration::from_secs(7200);
        s.scheduling_interval = Duration::from_secs(3600);
    })
    .await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let waiting = Heartbeat {
        reports: vec![],
        running: vec![],
        wait_ms: 3_600_000,
    };
    let limit = Duration::from_secs(60);
    let place = async {
        until_a_heartbeat_waits(&app).await;
        let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
        assert_eq!(app.schedule().await, 1);
        id
    };
    let (a, id) = tokio::join!(
        tokio::time::timeout(limit, app.send_beat(&node, &waiting)),
        place
    );
    let a = a.expect("the placement wakes the waiting heartbeat");
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let reply: HeartbeatResponse = serde_json::from_str(&a.text).unwrap();
    assert_eq!(reply.assignments[0].job_id, id);

    // A cancellation wakes it too: the attempt running there must stop.
    let running = Heartbeat {
        running: vec![(id.clone(), 1)],
        ..waiting
    };
    let cancel = async {
        until_a_heartbeat_waits(&app).await;
        let path = format!("/v1/jobs/{id}/cancel");
        let a = app.call(Method::POST, &path, Some(SUBMITTER), None).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    };
    let (a, ()) = tokio::join!(
        tokio::time::timeout(limit, app.send_beat(&node, &running)),
        cancel
    );
    let a = a.expect("the cancellation wakes the waiting heartbeat");
    let reply: HeartbeatResponse = serde_json::from_str(&a.text).unwrap();
    assert_eq!(reply.cancel, [(id, 1)]);
}

#[tokio::test]
async fn a_heartbeat_with_nothing_to_say_waits_as_long_as_asked() {
    let app = TestApp::new().await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let beat = Heartbeat {
        reports: vec![],
        running: vec![],
        wait_ms: 300,
    };
    let start = std::time::Instant::now();
    let a = app.send_beat(&node, &beat).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert!(
        start.elapsed() >= Duration::from_millis(300),
        "{:?}",
        start.elapsed()
    );
    let reply: HeartbeatResponse = serde_json::from_str(&a.text).unwrap();
    assert!(reply.assignments.is_empty() && reply.cancel.is_empty());
}
