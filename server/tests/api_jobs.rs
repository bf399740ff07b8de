//! `/v1/jobs` and `/v1/estimate` against the real router over SQLite.

use crate::api_helpers;

use api_helpers::*;
use axum::http::{Method, StatusCode};
use scheduler::inventory::{DeviceSlot, Inventory, Node};
use scheduler::memory::DeviceKind;
use scheduler::report::Report;
use scheduler::spec::{JobSpec, Purpose};
use serde_json::{Value, json};

#[tokio::test]
async fn submit_returns_201_with_the_plan_and_predicted_memory() {
    let app = TestApp::new().await;
    app.register("n1", 4, 2 * GIB).await;
    let mut spec = tiny_spec(4);
    spec["zero"]["stage"] = json!("auto");
    let a = app.submit(&spec).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let job = a.json();
    let id = job["id"].as_str().unwrap();
    assert_eq!(a.headers["location"], format!("/v1/jobs/{id}").as_str());
    assert_eq!(job["state"], "queued");
    assert_eq!(job["attempt"], 1);
    assert_eq!(job["world_size"], 4);
    assert_eq!(job["owner"], "alice");
    // The planner resolved "auto" to the lowest stage that fits: 0 on 2 GiB devices.
    assert_eq!(job["plan"]["zero_stage"], 0);
    let predicted = &job["predicted_per_rank_bytes"];
    assert_eq!(predicted, &job["plan"]["per_rank_bytes"]);
    assert!(predicted["total"].as_u64().unwrap() > 0);
    for category in ["params", "grads", "optimizer", "activations", "buffers"] {
        assert!(predicted[category].as_u64().unwrap() > 0, "{category}");
    }
    assert_eq!(app.job(id).await["transitions"][0]["to"], "queued");
}

#[tokio::test]
async fn submit_takes_a_deepspeed_config_and_lists_the_keys_it_ignores() {
    let app = TestApp::new().await;
    app.register("n1", 2, 2 * GIB).await;
    let spec = json!({
        "model": {"preset": "gpt2-tiny"},
        "deepspeed": {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "fp16": {"enabled": true},
            "zero_optimization": {"stage": 1},
            "wall_clock_breakdown": true,
        },
        "world_size": 2,
    });
    let a = app.submit(&spec).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let job = a.json();
    assert_eq!(job["plan"]["zero_stage"], 1);
    assert!(
        job["unsupported_keys"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k.as_str().unwrap().contains("wall_clock_breakdown")),
        "{job}"
    );
}

#[tokio::test]
async fn submit_returns_422_naming_the_field_of_a_bad_spec() {
    let app = TestApp::new().await;
    app.register("n1", 1, 80 * GIB).await;
    let a = app
        .submit(&json!({"model": {"preset": "gpt2-124M"}, "training": {"seq_len": 2048}}))
        .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.content_type(), "application/problem+json");
    let p = a.json();
    assert_eq!(p["field"], "training.seq_len");
    assert!(p["detail"].as_str().unwrap().contains("1024"), "{p}");
    let a = app
        .submit(&json!({"model": {"preset": "gpt2-tiny"}, "zero": {"stage": 7}}))
        .await;
    assert_eq!(a.json()["field"], "zero.stage");
    let a = app
        .submit(&json!({"model": {"preset": "gpt2-tiny"}, "colour": "blue"}))
        .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(a.json()["detail"].as_str().unwrap().contains("colour"));
    let list = app.get("/v1/jobs").await.json();
    assert_eq!(list["jobs"], json!([]), "nothing half-written");
}

#[tokio::test]
async fn submit_returns_422_with_the_planners_numbers_when_no_device_can_hold_a_rank() {
    let app = TestApp::new().await;
    app.register("small", 4, 256 << 20).await;
    let spec = json!({
        "model": {"preset": "gpt2-124M"},
        "precision": {"dtype": "bf16"},
        "world_size": 4,
    });
    let a = app.submit(&spec).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    let p = a.json();
    assert_eq!(p["type"], "urn:zerotrain:problem:does-not-fit");
    let numbers = &p["does_not_fit"];
    assert_eq!(numbers["world_size"], 4);
    assert_eq!(numbers["largest_device_bytes"], 256 << 20);
    assert_eq!(numbers["fitting_devices"], 0);
    assert!(numbers["need_bytes"].as_u64().unwrap() > 256 << 20, "{p}");
    assert!(p["detail"].as_str().unwrap().contains("largest device has"));
}

#[tokio::test]
async fn submit_returns_422_when_no_node_is_registered() {
    let app = TestApp::new().await;
    let a = app.submit(&tiny_spec(1)).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    assert_eq!(a.json()["does_not_fit"]["largest_device_bytes"], 0);
}

#[tokio::test]
async fn a_job_larger_than_the_free_devices_but_not_the_registered_ones_is_queued() {
    let app = TestApp::new().await;
    app.register("n1", 2, 2 * GIB).await;
    let first = app.submit_ok(&tiny_spec(2)).await;
    assert_eq!(app.schedule().await, 1);
    let second = app.submit_ok(&tiny_spec(2)).await;
    assert_eq!(app.schedule().await, 0);
    assert_eq!(app.job(&first).await["state"], "scheduled");
    assert_eq!(app.job(&second).await["state"], "queued");
    app.call(
        Method::POST,
        &format!("/v1/jobs/{first}/cancel"),
        Some(SUBMITTER),
        None,
    )
    .await;
    assert_eq!(app.schedule().await, 1);
    assert_eq!(app.job(&second).await["state"], "scheduled");
}

#[tokio::test]
async fn an_idempotency_key_returns_the_first_job_instead_of_a_second() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let key = [("idempotency-key", "ci-run-42")];
    let post = |token, spec: Value| {
        let app = &app;
        async move {
            app.call_with(Method::POST, "/v1/jobs", Some(token), Some(&spec), &key)
                .await
        }
    };
    let first = post(SUBMITTER, tiny_spec(1)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = post(SUBMITTER, tiny_spec(1)).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.json()["id"], first.json()["id"]);
    let mut other = tiny_spec(1);
    other["training"]["steps"] = json!(7);
    let conflict = post(SUBMITTER, other).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT, "{}", conflict.text);
    // Keys are per owner: another submitter's identical key is another job.
    let bobs = post(OTHER_SUBMITTER, tiny_spec(1)).await;
    assert_eq!(bobs.status, StatusCode::CREATED);
    assert_ne!(bobs.json()["id"], first.json()["id"]);
    assert_eq!(
        app.get("/v1/jobs").await.json()["jobs"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

#[tokio::test]
async fn jobs_are_listed_newest_first_filtered_and_a_page_at_a_time() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let mut spec = tiny_spec(1);
        spec["name"] = json!(if i % 2 == 0 { "even" } else { "odd" });
        ids.push(app.submit_ok(&spec).await);
    }
    app.call(
        Method::POST,
        &format!("/v1/jobs/{}/cancel", ids[1]),
        Some(SUBMITTER),
        None,
    )
    .await;
    let listed = |v: Value| -> Vec<String> {
        v["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_string())
            .collect()
    };
    let newest_first: Vec<String> = ids.iter().rev().cloned().collect();
    assert_eq!(listed(app.get("/v1/jobs").await.json()), newest_first);
    assert_eq!(
        listed(app.get("/v1/jobs?state=cancelled").await.json()),
        [ids[1].clone()]
    );
    assert_eq!(
        listed(app.get("/v1/jobs?name=even").await.json()),
        [ids[4].clone(), ids[2].clone(), ids[0].clone()]
    );
    assert_eq!(
        listed(app.get("/v1/jobs?name=odd&state=queued").await.json()),
        [ids[3].clone()]
    );
    let mut paged = Vec::new();
    let mut path = "/v1/jobs?limit=2".to_string();
    loop {
        let page = app.get(&path).await.json();
        paged.extend(listed(page.clone()));
        match page["next_cursor"].as_str() {
            Some(c) => path = format!("/v1/jobs?limit=2&cursor={c}"),
            None => break,
        }
    }
    assert_eq!(paged, newest_first);
    let bad = app.get("/v1/jobs?state=paused").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.json()["field"], "state");
    let bad = app.get("/v1/jobs?limit=0").await;
    assert_eq!(bad.json()["field"], "limit");
}

#[tokio::test]
async fn cancel_ends_a_job_once_and_only_for_its_owner_or_an_admin() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let id = app.submit_ok(&tiny_spec(1)).await;
    let cancel = |token| {
        let app = &app;
        let path = format!("/v1/jobs/{id}/cancel");
        async move { app.call(Method::POST, &path, Some(token), None).await }
    };
    assert_eq!(cancel(OTHER_SUBMITTER).await.status, StatusCode::FORBIDDEN);
    let done = cancel(SUBMITTER).await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.text);
    assert_eq!(done.json()["state"], "cancelled");
    assert_eq!(done.json()["reason"], "cancelled by alice");
    let again = cancel(SUBMITTER).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert!(
        again.json()["detail"]
            .as_str()
            .unwrap()
            .contains("cancelled")
    );

    let other = app.submit_ok(&tiny_spec(1)).await;
    let by_admin = app
        .call(
            Method::POST,
            &format!("/v1/jobs/{other}/cancel"),
            Some(ADMIN),
            None,
        )
        .await;
    assert_eq!(by_admin.status, StatusCode::OK);
    let missing = app
        .call(Method::POST, "/v1/jobs/nope/cancel", Some(ADMIN), None)
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn estimate_is_the_estimate_report_plus_the_nodes_that_could_hold_it() {
    let app = TestApp::new().await;
    let (big, _) = app.register("big", 4, 40 * GIB).await;
    let (small, _) = app.register("small", 2, 4 * GIB).await;
    let spec = json!({
        "model": {"preset": "gpt2-124M"},
        "training": {"micro_batch_size": 4, "seq_len": 64},
        "precision": {"dtype": "bf16"},
        "world_size": 4,
    });
    let a = app
        .call(Method::POST, "/v1/estimate", Some(VIEWER), Some(&spec))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let mut got = a.json();
    let nodes = got.as_object_mut().unwrap().remove("nodes").unwrap();

    // The same report `zerotrain estimate --json` prints for these devices.
    let parsed = JobSpec::parse(&spec.to_string(), Purpose::Estimate).unwrap();
    let device = |gib: u64| DeviceSlot {
        kind: DeviceKind::Cpu,
        memory_bytes: gib * GIB,
    };
    let inventory = Inventory {
        nodes: vec![
            Node {
                name: big.clone(),
                devices: vec![device(40); 4],
            },
            Node {
                name: small.clone(),
                devices: vec![device(4); 2],
            },
        ],
    };
    let want = Report::new(&parsed.spec, vec![], &inventory, DeviceKind::Cpu).unwrap();
    assert_eq!(got, serde_json::to_value(&want).unwrap());
    assert_eq!(got["stages"].as_array().unwrap().len(), 4);
    assert_eq!(got["plan"]["fits"], true);

    assert_eq!(
        nodes,
        json!([
            {"node_id": big, "name": "big", "devices_that_fit": 4, "holds_job": true},
            {"node_id": small, "name": "small", "devices_that_fit": 2, "holds_job": false},
        ])
    );
}

#[tokio::test]
async fn estimate_takes_a_bare_parameter_count() {
    let app = TestApp::new().await;
    app.register("n", 8, 80 * GIB).await;
    let spec = json!({"model": {"params": 7_500_000_000u64}, "world_size": 8});
    let a = app
        .call(Method::POST, "/v1/estimate", Some(VIEWER), Some(&spec))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(a.json()["parameters"], 7_500_000_000u64);
}

#[tokio::test]
async fn a_lora_job_is_estimated_with_peft_s_count_and_taken_unless_its_dropout_is_out_of_range() {
    let app = TestApp::new().await;
    app.register("n", 2, 8 * GIB).await;
    let spec = json!({"model": {"preset": "gpt2-124M"}, "lora": {"rank": 8}});
    let a = app
        .call(Method::POST, "/v1/estimate", Some(VIEWER), Some(&spec))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    // PEFT's `print_trainable_parameters` for GPT-2 with its default c_attn targets.
    assert_eq!(a.json()["trainable_parameters"], 294_912);
    assert_eq!(a.json()["parameters"], 124_734_720u64);
    let dropout = json!({"model": {"preset": "gpt2-124M"}, "lora": {"rank": 8, "dropout": 1.0}});
    let refused = app.submit(&dropout).await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        refused.text
    );
    assert_eq!(refused.json()["field"], "lora.dropout");
    assert!(
        refused.text.contains("must be in [0, 1)"),
        "{}",
        refused.text
    );
    let jobs = app.get("/v1/jobs").await.json();
    assert_eq!(
        jobs["jobs"].as_array().map(Vec::len),
        Some(0),
        "nothing half-written: {jobs}"
    );
    let taken = app.submit(&spec).await;
    assert_eq!(taken.status, StatusCode::CREATED, "{}", taken.text);
}

#[tokio::test]
async fn estimate_with_compare_adds_the_other_estimators_and_why_they_differ() {
    let app = TestApp::new().await;
    app.register("n", 8, 80 * GIB).await;
    let mut spec =
        json!({"model": {"preset": "gpt2-124M"}, "precision": {"dtype": "bf16"}, "world_size": 8});
    let plain = app
        .call(Method::POST, "/v1/estimate", Some(VIEWER), Some(&spec))
        .await
        .json();
    assert!(plain.get("compare").is_none(), "only when asked");
    spec["compare"] = json!(true);
    let a = app
        .call(Method::POST, "/v1/estimate", Some(VIEWER), Some(&spec))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let got = a.json();
    let psi = 124_439_808u64;
    let c = &got["compare"];
    assert_eq!(c["world_size"], 8);
    // DeepSpeed's ZeRO-2: 2Ψ + int(18Ψ/N); accelerate: 8Ψ under mixed precision.
    assert_eq!(c["stages"][2]["deepspeed_bytes"], 2 * psi + 18 * psi / 8);
    assert_eq!(c["stages"][0]["accelerate_bytes"], 8 * psi);
    assert_eq!(
        c["stages"][3]["zerotrain_bytes"],
        got["stages"][3]["per_rank_bytes"]["total"]
    );
    assert!(c["reasons"].as_array().unwrap().len() >= 4, "{c}");

    spec["compare"] = json!("yes");
    let bad = app
        .call(Method::POST, "/v1/estimate", Some(VIEWER), Some(&spec))
        .await;
    assert_eq!(bad.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(bad.json()["field"], "compare");
}

#[tokio::test]
async fn a_spec_with_three_independent_mistakes_gets_one_422_naming_all_three() {
    let app = TestApp::new().await;
    app.register("n", 2, 2 * GIB).await;
    let spec = json!({
        "model": {"preset": "gpt2-tiny"},
        "training": {"seq_len": 0},
        "optimizer": {"betas": [0.9, 1.5]},
        "precision": {"dtype": "fp8"},
    });
    let a = app.submit(&spec).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    let p = a.json();
    let fields: Vec<&str> = p["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        ["precision.dtype", "training.seq_len", "optimizer.betas[1]"]
    );
    // The first also as `field` and `detail`, for clients that read one.
    assert_eq!(p["field"], "precision.dtype");
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .starts_with("precision.dtype: unknown variant `fp8`")
    );
    assert!(
        app.get("/v1/jobs").await.json()["jobs"]
            .as_array()
            .unwrap()
            .is_empty(),
        "nothing stored"
    );
}

fn gpus(count: usize, gib: u64) -> Vec<DeviceSlot> {
    let gpu = DeviceSlot {
        kind: DeviceKind::Cuda,
        memory_bytes: gib * GIB,
    };
    vec![gpu; count]
}

fn with_device(world_size: u32, device: &str) -> Value {
    let mut spec = tiny_spec(world_size);
    spec["device"] = json!(device);
    spec
}

/// The node and device index each rank of job `id` was placed on, by rank.
async fn placed_on(app: &TestApp, id: &str) -> Vec<(String, u32)> {
    let ranks = app
        .state
        .store
        .assignments_for_job(&id.into())
        .await
        .unwrap();
    ranks
        .into_iter()
        .map(|a| (a.node_id.into(), a.device))
        .collect()
}

#[tokio::test]
async fn submit_returns_422_naming_device_when_no_node_has_the_kind_asked_for() {
    let app = TestApp::new().await;
    app.register("cpus", 4, 2 * GIB).await;
    let a = app.submit(&with_device(2, "cuda")).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    let p = a.json();
    assert_eq!(p["field"], "device");
    assert_eq!(p["type"], "urn:zerotrain:problem:no-devices-of-kind");
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .starts_with("no cuda devices are registered"),
        "{p}"
    );
    let a = app.submit(&with_device(2, "cpu")).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.json()["plan"]["device"], "cpu");
    // The same on a GPU-only cluster for a job that asks for CPU devices.
    let gpu_only = TestApp::new().await;
    gpu_only.register_devices("gpus", gpus(2, 80)).await;
    let a = gpu_only.submit(&with_device(1, "cpu")).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    assert_eq!(a.json()["field"], "device");
}

#[tokio::test]
async fn auto_jobs_land_on_the_gpus_and_cpu_jobs_on_the_cpu_devices_of_a_mixed_cluster() {
    let app = TestApp::new().await;
    let (cpus, _) = app.register("cpus", 4, 2 * GIB).await;
    let (gpu_node, _) = app.register_devices("gpus", gpus(2, 80)).await;
    let on_gpus = app.submit(&tiny_spec(2)).await;
    assert_eq!(on_gpus.status, StatusCode::CREATED, "{}", on_gpus.text);
    let on_gpus = on_gpus.json();
    assert_eq!(on_gpus["plan"]["device"], "cuda");
    assert_eq!(
        on_gpus["plan"]["devices_that_fit"], 2,
        "only the GPUs count"
    );
    assert_eq!(
        on_gpus["plan"]["per_rank_bytes"]["overhead"],
        DeviceKind::Cuda.overhead_bytes()
    );
    let on_cpus = app.submit(&with_device(3, "cpu")).await.json();
    assert_eq!(on_cpus["plan"]["device"], "cpu");
    assert_eq!(app.schedule().await, 2);
    let gpu_job = on_gpus["id"].as_str().unwrap();
    assert_eq!(
        placed_on(&app, gpu_job).await,
        [(gpu_node.clone(), 0), (gpu_node.clone(), 1)]
    );
    let cpu_job = on_cpus["id"].as_str().unwrap();
    let slots = placed_on(&app, cpu_job).await;
    assert_eq!(slots.len(), 3);
    assert!(slots.iter().all(|(n, _)| *n == cpus), "{slots:?}");
    // Both GPUs are taken: another GPU job waits, though a CPU device is free.
    let waiting = app.submit_ok(&tiny_spec(1)).await;
    assert_eq!(app.schedule().await, 0);
    assert_eq!(app.job(&waiting).await["state"], "queued");
}

#[tokio::test]
async fn with_queueing_for_unregistered_devices_a_gpu_job_waits_for_a_gpu_node() {
    let app = TestApp::with(|s| s.queue_unregistered_devices = true).await;
    app.register("cpus", 4, 2 * GIB).await;
    let a = app.submit(&with_device(2, "cuda")).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let job = a.json();
    assert_eq!(job["plan"]["device"], "cuda");
    let id = job["id"].as_str().unwrap();
    assert_eq!(app.schedule().await, 0, "CPU devices never take a GPU job");
    assert_eq!(app.job(id).await["state"], "queued");
    let (gpu_node, _) = app.register_devices("gpus", gpus(2, 80)).await;
    assert_eq!(app.schedule().await, 1);
    assert_eq!(
        placed_on(&app, id).await,
        [(gpu_node.clone(), 0), (gpu_node.clone(), 1)]
    );
}

#[tokio::test]
async fn estimate_says_no_gpu_is_registered_instead_of_refusing() {
    let app = TestApp::new().await;
    app.register("cpus", 4, 2 * GIB).await;
    let a = app
        .call(
            Method::POST,
            "/v1/estimate",
            Some(VIEWER),
            Some(&with_device(2, "cuda")),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let e = a.json();
    assert_eq!(e["device_kind"], "cuda");
    assert_eq!(e["plan"]["fits"], false);
    assert_eq!(e["plan"]["reason"], "no cuda devices are registered");
    assert_eq!(e["nodes"][0]["devices_that_fit"], 0);
    assert_eq!(e["nodes"][0]["holds_job"], false);
}
