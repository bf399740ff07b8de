//! The whole service: a server and runner agents (threads of this test, or `zerotrain agent`
//! processes) training real jobs end to end.

use crate::live;
use crate::pyenv;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use live::{Mode, free_loopback_addr, poll};
use runner::agent::AgentMetrics;
use runner::train::{Options, run};
use scheduler::memory::Category;
use scheduler::plan::plan_local;
use scheduler::spec::{JobSpec, Purpose};
use serde_json::{Value, json};
use server::app::Server;

const ADMIN: &str = "zt_e2e_admin";

struct Service {
    server: Server,
    join: String,
    http: reqwest::Client,
    dir: tempfile::TempDir,
}

async fn service() -> Service {
    let live = live::start(ADMIN).await;
    Service {
        server: live.server,
        join: live.join,
        http: reqwest::Client::new(),
        dir: live.dir,
    }
}

/// An agent on a thread of this process, until the returned flag is set.
fn agent(
    s: &Service,
    name: &str,
    devices: usize,
    memory: u64,
) -> (Arc<AtomicBool>, JoinHandle<()>) {
    live::agent(&s.server, &s.join, name, devices, memory)
}

/// A `zerotrain agent` process, working in a folder of its own under `work`.
fn agent_process(s: &Service, work: &Path, name: &str, devices: usize, extra: &[&str]) -> Child {
    let work_dir = work.join(name);
    Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args([
            "agent",
            "--server",
            &s.server.url(),
            "--token",
            &s.join,
            "--name",
            name,
        ])
        .arg("--work-dir")
        .arg(&work_dir)
        .args([
            "--cpu-devices",
            &devices.to_string(),
            "--device-memory",
            "1GiB",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

impl Service {
    /// `method path` as the admin; fails unless it succeeds.
    async fn call(&self, method: reqwest::Method, path: &str) -> reqwest::Response {
        let r = self
            .http
            .request(method.clone(), format!("{}{path}", self.server.url()))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{method} {path}: {}", r.status());
        r
    }

    async fn get(&self, path: &str) -> Value {
        self.call(reqwest::Method::GET, path)
            .await
            .json()
            .await
            .unwrap()
    }

    async fn submit(&self, spec: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}/v1/jobs", self.server.url()))
            .bearer_auth(ADMIN)
            .json(&spec)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// Follows job `id` until it reaches a terminal state (or `limit` passes).
    async fn finished(&self, id: &str, limit: Duration) -> Value {
        let ended = ["succeeded", "failed", "cancelled"];
        live::until_state(&self.server.url(), ADMIN, id, &ended, limit).await
    }

    /// Submits `spec` (two ranks of one sequence each, the reference's batch of two), waits
    /// for it to succeed and checks that its first loss is `want`, `whose` on the same batch,
    /// within 1e-5; its id.
    async fn succeeds_from(&self, spec: Value, want: f64, whose: &str) -> String {
        let (status, created) = self.submit(spec).await;
        assert_eq!(status, 201, "{created}");
        let id = job_id(&created);
        let job = self.finished(&id, Duration::from_secs(120)).await;
        assert_eq!(job["state"], "succeeded", "{job}");
        let m = self.get(&format!("/v1/jobs/{id}/metrics")).await;
        let first = m["steps"][0]["loss"].as_f64().unwrap();
        assert!(
            (first - want).abs() < 1e-5 * want,
            "{first} vs {whose}'s {want}"
        );
        id
    }

    /// Waits until `n` nodes have registered: admission plans against registered devices.
    async fn wait_nodes(&self, n: usize) {
        poll(
            Duration::from_secs(20),
            Duration::from_millis(50),
            || async {
                let nodes = self.get("/v1/nodes").await["nodes"]
                    .as_array()
                    .map_or(0, Vec::len);
                (nodes >= n)
                    .then_some(())
                    .ok_or(format!("{nodes} of {n} node(s) registered"))
            },
        )
        .await
    }

    /// `zerotrain pull` of job `id`'s model into a new folder.
    fn pull(&self, id: &str) -> tempfile::TempDir {
        let pulled = tempfile::tempdir().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
            .args([
                "pull",
                id,
                "--url",
                &self.server.url(),
                "--token",
                ADMIN,
                "--to",
            ])
            .arg(pulled.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        pulled
    }

    async fn wait_state(&self, id: &str, state: &str, limit: Duration) {
        live::until_state(&self.server.url(), ADMIN, id, &[state], limit).await;
    }
}

fn job_id(created: &Value) -> String {
    created["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no job id in {created}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fp16_zero2_job_on_four_devices_trains_and_reports_its_memory() {
    let s = service().await;
    let (stop, agent) = agent(&s, "local", 4, 1 << 30);
    s.wait_nodes(1).await;
    let spec = json!({"name": "tiny-z2", "model": {"preset": "gpt2-tiny"}, "world_size": 4,
        "precision": {"dtype": "fp16"}, "zero": {"stage": 2},
        "training": {"steps": 30, "lr": 1e-3, "micro_batch_size": 2}});
    let (status, created) = s.submit(spec).await;
    assert_eq!(status, 201, "{created}");
    let id = job_id(&created);
    let job = s.finished(&id, Duration::from_secs(180)).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    let m = s.get(&format!("/v1/jobs/{id}/metrics")).await;
    let steps = m["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 30);
    let loss = |i: usize| steps[i]["loss"].as_f64().unwrap();
    assert!(
        loss(29) < loss(0) - 1.0,
        "loss falls: {} → {}",
        loss(0),
        loss(29)
    );
    assert_eq!(steps[0]["loss_scale"], 65536.0);
    let ranks = m["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    // What admission planned and stored with the job, byte for byte: measured, and as the
    // prediction shown beside it. The process overhead is not an allocation the accountant
    // sees: admission reserves it in every rank's figure, the runner reports it once per
    // process beside the peak RSS (train_rss checks that).
    let planned = &m["predicted_per_rank_bytes"];
    for r in ranks {
        for c in Category::ALL
            .iter()
            .copied()
            .filter(|&c| c != Category::Overhead)
        {
            let bytes = |of: &Value| of[c.name()].as_u64().unwrap();
            assert_eq!(
                bytes(&r["measured"]),
                bytes(planned),
                "rank {} {}: measured vs the admission plan",
                r["rank"],
                c.name()
            );
            assert_eq!(
                bytes(&r["predicted"]),
                bytes(planned),
                "rank {} {}: the prediction shown vs the admission plan",
                r["rank"],
                c.name()
            );
        }
    }
    let metrics = s.call(reqwest::Method::GET, "/metrics").await;
    let metrics = metrics.text().await.unwrap();
    for series in [
        "zerotrain_training_loss",
        "zerotrain_training_loss_scale",
        "zerotrain_training_memory_bytes",
    ] {
        assert!(
            metrics.contains(&format!("{series}{{")) && metrics.contains(&id),
            "/metrics lacks {series} of {id}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    agent.join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_no_device_could_hold_is_refused_and_one_waiting_for_devices_queues() {
    let s = service().await;
    let (stop, agent) = agent(&s, "local", 4, 256 << 20);
    s.wait_nodes(1).await;
    let (status, problem) = s
        .submit(json!({"model": {"preset": "gpt2-350M"}, "zero": {"stage": 0}}))
        .await;
    assert_eq!(status, 422, "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    // 256 MiB devices less the 5% safety margin placement keeps free.
    assert!(
        detail.contains("per rank at stage 0") && detail.contains("largest device has 255.0 MB"),
        "{problem}"
    );

    let long =
        json!({"model": {"preset": "gpt2-tiny"}, "world_size": 4, "training": {"steps": 60}});
    let (_, first) = s.submit(long).await;
    let first = job_id(&first);
    s.wait_state(&first, "running", Duration::from_secs(30))
        .await;
    let (status, second) = s
        .submit(
            json!({"model": {"preset": "gpt2-tiny"}, "world_size": 2, "training": {"steps": 5}}),
        )
        .await;
    assert_eq!(status, 201);
    let second = job_id(&second);
    // Of two scheduling passes ending after the submission, the second began after it.
    let passes = || {
        let pass = &s
            .server
            .state()
            .metrics
            .server
            .scheduling_pass_duration_seconds;
        pass.get_sample_count()
    };
    let two_later = passes() + 2;
    poll(
        Duration::from_secs(10),
        Duration::from_millis(10),
        || async {
            match passes() >= two_later {
                true => Ok(()),
                false => Err("two scheduling passes have not run".to_string()),
            }
        },
    )
    .await;
    assert_eq!(
        s.get(&format!("/v1/jobs/{second}")).await["state"],
        "queued",
        "no device is free yet"
    );
    assert_eq!(
        s.finished(&first, Duration::from_secs(120)).await["state"],
        "succeeded"
    );
    assert_eq!(
        s.finished(&second, Duration::from_secs(120)).await["state"],
        "succeeded"
    );
    stop.store(true, Ordering::Relaxed);
    agent.join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_of_two_devices_run_a_four_rank_job_over_tcp() {
    let s = service().await;
    let agents = [agent(&s, "a", 2, 1 << 30), agent(&s, "b", 2, 1 << 30)];
    s.wait_nodes(2).await;
    let (status, created) = s
        .submit(
            json!({"model": {"preset": "gpt2-tiny"}, "world_size": 4, "zero": {"stage": 1},
                       "training": {"steps": 10, "micro_batch_size": 2}}),
        )
        .await;
    assert_eq!(status, 201, "{created}");
    let id = job_id(&created);
    let job = s.finished(&id, Duration::from_secs(120)).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    // The job ends with rank 0's node's report; the other node's comes with its next beat.
    poll(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            let m = s.get(&format!("/v1/jobs/{id}/metrics")).await;
            let ranks = m["ranks"].as_array().map_or(0, Vec::len);
            (ranks == 4)
                .then_some(())
                .ok_or(format!("{ranks} of 4 ranks reported their memory"))
        },
    )
    .await;
    let logs = s.get(&format!("/v1/jobs/{id}/logs")).await.to_string();
    assert!(
        logs.contains("a: starting ranks") && logs.contains("b: starting ranks"),
        "{logs}"
    );
    for (stop, thread) in agents {
        stop.store(true, Ordering::Relaxed);
        thread.join().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_s_job_resumes_elsewhere_from_its_checkpoint_to_the_same_loss() {
    let spec = json!({"model": {"preset": "gpt2-tiny"}, "world_size": 2, "zero": {"stage": 1},
        "training": {"steps": 80, "micro_batch_size": 2}, "checkpoint": {"every_steps": 10}});
    // The uninterrupted run, in this process.
    let reference = {
        let spec = JobSpec::parse(&spec.to_string(), Purpose::Train)
            .unwrap()
            .spec;
        let plan = plan_local(&spec, None).unwrap();
        tokio::task::spawn_blocking(move || {
            run(&spec, &plan, &Options::default(), &mut |_| {}).unwrap()
        })
        .await
        .unwrap()
    };
    let s = service().await;
    // Each agent works in a folder of its own, outside the server's data dir: the second
    // resumes from what the first uploaded, with no directory shared between them.
    let (work_a, work_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut first = agent_process(&s, work_a.path(), "doomed", 2, &[]);
    s.wait_nodes(1).await;
    let (status, created) = s.submit(spec).await;
    assert_eq!(status, 201, "{created}");
    let id = job_id(&created);
    // Kill the agent once a checkpoint exists and training has gone past it.
    poll(
        Duration::from_secs(120),
        Duration::from_millis(20),
        || async {
            let m = s.get(&format!("/v1/jobs/{id}/metrics")).await;
            let steps = m["steps"].as_array().map_or(0, Vec::len);
            (steps >= 25)
                .then_some(())
                .ok_or(format!("no progress: {m}"))
        },
    )
    .await;
    first.kill().unwrap();
    first.wait().unwrap();
    let mut second = agent_process(&s, work_b.path(), "rescuer", 2, &[]);
    let job = s.finished(&id, Duration::from_secs(180)).await;
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["attempt"], 2, "requeued once");
    let logs = s.get(&format!("/v1/jobs/{id}/logs")).await.to_string();
    assert!(
        logs.contains("resumed from the checkpoint of step"),
        "{logs}"
    );
    let steps = s.get(&format!("/v1/jobs/{id}/metrics")).await["steps"]
        .as_array()
        .unwrap()
        .clone();
    let last = steps.last().unwrap();
    assert_eq!(last["step"], 80);
    assert_eq!(
        last["loss"].as_f64().unwrap(),
        reference.final_loss,
        "resumed run ends where an uninterrupted one does"
    );

    // The job's files came through the server: both checkpoints' ranks and the export are
    // listed, and the model downloads with the listed digest.
    let listed = s.get(&format!("/v1/jobs/{id}/artifacts")).await;
    let names: Vec<&str> = listed["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"config.json") && names.contains(&"model.safetensors"),
        "{names:?}"
    );
    let step_70 = "checkpoints/step-00000070/";
    for file in [
        "manifest.json",
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ] {
        assert!(
            names.contains(&format!("{step_70}{file}").as_str()),
            "{names:?}"
        );
    }
    let model = listed["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "model.safetensors")
        .unwrap()
        .clone();
    let bytes = s
        .call(
            reqwest::Method::GET,
            &format!("/v1/jobs/{id}/artifacts/model.safetensors"),
        )
        .await
        .bytes()
        .await
        .unwrap();
    assert_eq!(bytes.len() as u64, model["bytes"].as_u64().unwrap());
    let digest = sha256_hex(&bytes);
    assert_eq!(digest, model["sha256"].as_str().unwrap());
    // `zerotrain pull` writes the folder `from_pretrained` loads: the config and the weights.
    let pulled = s.pull(&id);
    let weights = std::fs::read(pulled.path().join("model.safetensors")).unwrap();
    assert_eq!(sha256_hex(&weights), digest);
    let tensors = safetensors::SafeTensors::deserialize(&weights).unwrap();
    assert!(
        tensors.names().contains(&"transformer.wte.weight"),
        "{:?}",
        tensors.names()
    );
    let config: Value =
        serde_json::from_slice(&std::fs::read(pulled.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    // The attempt that succeeded left nothing in its agent's folder.
    let rescuer_attempt = work_b
        .path()
        .join("rescuer/jobs")
        .join(&id)
        .join("attempts/2");
    assert!(
        !rescuer_attempt.exists(),
        "{} is left",
        rescuer_attempt.display()
    );
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_started_from_another_job_s_model_computes_that_model_s_last_loss() {
    let s = service().await;
    let (stop, thread) = agent(&s, "tuner", 1, 1 << 30);
    s.wait_nodes(1).await;
    // A text file of exactly one window (B·T + 1 bytes): every step trains on the same batch.
    let root = s.server.state().data_roots.dirs()[0].to_path_buf();
    let data = root.join("one-batch.txt");
    let text: String = (0..65)
        .map(|i| char::from(b'a' + (i * 7 % 26) as u8))
        .collect();
    std::fs::write(&data, text).unwrap();
    let spec = |steps: u32, init_from: Value| {
        json!({"model": {"preset": "gpt2-tiny", "init_from": init_from},
            "precision": {"dtype": "fp32"},
            "data": {"kind": "text", "path": data.display().to_string()},
            // The rate decays to 0 at the last step, which so leaves the weights as they were:
            // the exported model is the one the last logged loss was computed with.
            "training": {"steps": steps, "micro_batch_size": 2, "seq_len": 32,
                "decay_steps": 3, "min_lr": 0.0}})
    };
    let (status, created) = s.submit(spec(4, Value::Null)).await;
    assert_eq!(status, 201, "{created}");
    let first = job_id(&created);
    let from_first = json!({"job": first, "artifact": "model"});
    // Until it succeeded it has no model to start from.
    let (status, refused) = s.submit(spec(1, from_first.clone())).await;
    assert_eq!(status, 422, "{refused}");
    assert_eq!(refused["field"], "model.init_from.job", "{refused}");
    let done = s.finished(&first, Duration::from_secs(60)).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    let s = &s;
    let last_loss = |id: String| async move {
        let m = s.get(&format!("/v1/jobs/{id}/metrics")).await;
        m["steps"].as_array().unwrap().last().unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    let (status, created) = s.submit(spec(1, from_first)).await;
    assert_eq!(status, 201, "{created}");
    let second = job_id(&created);
    let tuned = s.finished(&second, Duration::from_secs(60)).await;
    assert_eq!(tuned["state"], "succeeded", "{tuned}");
    // The first job's training moved its weights, so only its model gives its last loss.
    let losses = s.get(&format!("/v1/jobs/{first}/metrics")).await["steps"].clone();
    assert_ne!(losses[0]["loss"], losses[3]["loss"], "{losses}");
    assert_eq!(last_loss(second).await, last_loss(first).await);
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_export_is_pulled_as_transformers_lays_it_out_and_fine_tuned_from() {
    let s = service().await;
    let work = tempfile::tempdir().unwrap();
    // llama-tiny's export is about 0.6 MB: past 100 kB it is sharded.
    let mut agent = agent_process(
        &s,
        work.path(),
        "sharder",
        1,
        &["--export-shard-bytes", "100kB"],
    );
    s.wait_nodes(1).await;
    let spec = |init_from: Value| {
        json!({"model": {"preset": "llama-tiny", "init_from": init_from},
            "training": {"steps": 2, "micro_batch_size": 1, "seq_len": 32}})
    };
    let (status, created) = s.submit(spec(Value::Null)).await;
    assert_eq!(status, 201, "{created}");
    let first = job_id(&created);
    let done = s.finished(&first, Duration::from_secs(120)).await;
    assert_eq!(done["state"], "succeeded", "{done}");

    // Listed: the config, the index and its shards, no single file.
    let listed = s.get(&format!("/v1/jobs/{first}/artifacts")).await["artifacts"]
        .as_array()
        .unwrap()
        .clone();
    let names: Vec<&str> = listed.iter().map(|a| a["name"].as_str().unwrap()).collect();
    let n = names.len() - 2;
    assert!(n >= 3, "{names:?}");
    let mut want: Vec<String> = (1..=n)
        .map(|k| format!("model-{k:05}-of-{n:05}.safetensors"))
        .collect();
    want.insert(0, "config.json".into());
    want.push("model.safetensors.index.json".into());
    assert_eq!(names, want);

    // `zerotrain pull` writes them all, each as listed, into the folder `from_pretrained` reads.
    let pulled = s.pull(&first);
    let mut files: Vec<String> = std::fs::read_dir(pulled.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, want);
    for a in &listed {
        let bytes = std::fs::read(pulled.path().join(a["name"].as_str().unwrap())).unwrap();
        assert_eq!(sha256_hex(&bytes), a["sha256"].as_str().unwrap(), "{a}");
    }
    let index: Value = serde_json::from_slice(
        &std::fs::read(pulled.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut in_index: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|f| f.as_str().unwrap())
        .collect();
    in_index.sort();
    in_index.dedup();
    assert_eq!(in_index, want[1..=n]);

    // A job started from that export gets the weights the pulled folder holds: its first loss
    // is a run's from that folder in this process.
    let (status, created) = s
        .submit(spec(json!({"job": first, "artifact": "model"})))
        .await;
    assert_eq!(status, 201, "{created}");
    let second = job_id(&created);
    let tuned = s.finished(&second, Duration::from_secs(120)).await;
    assert_eq!(tuned["state"], "succeeded", "{tuned}");
    let reference = {
        let local = spec(json!(pulled.path().display().to_string())).to_string();
        let spec = JobSpec::parse(&local, Purpose::Train).unwrap().spec;
        let plan = plan_local(&spec, None).unwrap();
        tokio::task::spawn_blocking(move || {
            run(&spec, &plan, &Options::default(), &mut |_| {}).unwrap()
        })
        .await
        .unwrap()
    };
    let m = s.get(&format!("/v1/jobs/{second}/metrics")).await;
    assert_eq!(m["steps"][0]["loss"].as_f64().unwrap(), reference.losses[0]);
    let from_scratch = s.get(&format!("/v1/jobs/{first}/metrics")).await;
    assert_ne!(m["steps"][0]["loss"], from_scratch["steps"][0]["loss"]);
    agent.kill().unwrap();
    agent.wait().unwrap();
}

/// SIGTERM (what Kubernetes, systemd and Slurm send an agent first) stops `zerotrain agent`
/// cleanly: status 0, not death by the signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_stops_cleanly_on_sigterm() {
    let s = service().await;
    let work = tempfile::tempdir().unwrap();
    let mut agent = agent_process(&s, work.path(), "terminated", 1, &[]);
    s.wait_nodes(1).await;
    // SAFETY: kill has no preconditions; the pid is our child's.
    assert_eq!(unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) }, 0);
    let status = poll(Duration::from_secs(30), Duration::from_millis(20), || {
        let exited = agent.try_wait().unwrap();
        async move { exited.ok_or("still running after SIGTERM".to_string()) }
    })
    .await;
    assert!(status.success(), "the agent ended with {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen2_job_from_a_hugging_face_directory_trains_and_is_pulled_in_transformers_form() {
    let s = service().await;
    let (stop, thread) = agent(&s, "llama", 2, 1 << 30);
    s.wait_nodes(1).await;
    // A Hugging Face model directory (config.json + model.safetensors, as transformers saved
    // it) and a token shard, inside the data roots.
    let reference = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/llama_parity");
    let root = s.server.state().data_roots.dirs()[0].to_path_buf();
    let dir = root.join("qwen2");
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "model.safetensors", "expected.json"] {
        std::fs::copy(reference.join("qwen2").join(file), dir.join(file)).unwrap();
    }
    std::fs::copy(reference.join("tokens.bin"), root.join("tokens.bin")).unwrap();
    let read =
        |path: &Path| -> Value { serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap() };
    let expected = read(&dir.join("expected.json"));
    let spec = json!({"model": {"config": read(&dir.join("config.json")),
            "init_from": dir.display().to_string()},
        "data": {"kind": "tokens", "path": root.join("tokens.bin").display().to_string()},
        "world_size": 2, "zero": {"stage": 3}, "precision": {"dtype": "fp32"},
        "training": {"steps": 3, "micro_batch_size": 1, "seq_len": 32}});
    // Started from transformers' weights: the first loss is theirs on the same batch.
    let want = expected["losses"][0].as_f64().unwrap();
    let id = s.succeeds_from(spec, want, "transformers").await;
    let pulled = s.pull(&id);
    let weights = std::fs::read(pulled.path().join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&weights).unwrap();
    let want = expected["export"]["tensors"].as_object().unwrap();
    let mut names = tensors.names();
    names.sort();
    let mut want_names: Vec<&String> = want.keys().collect();
    want_names.sort();
    assert_eq!(names, want_names);
    for (name, shape) in want {
        let shape: Vec<usize> = serde_json::from_value(shape.clone()).unwrap();
        assert_eq!(tensors.tensor(name).unwrap().shape(), shape, "{name}");
    }
    let config = read(&pulled.path().join("config.json"));
    let mut keys: Vec<&String> = config.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        expected["export"]["config_keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap())
            .collect::<Vec<_>>()
    );
    assert_eq!(config["model_type"], "qwen2");
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_job_from_a_peft_adapter_trains_on_two_ranks_and_is_pulled_as_peft_saves_it() {
    let s = service().await;
    let (stop, thread) = agent(&s, "lora", 2, 1 << 30);
    s.wait_nodes(1).await;
    // The base (a transformers directory), the starting adapter (as PEFT saved it) and a token
    // shard, inside the data roots.
    let reference = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference");
    let root = s.server.state().data_roots.dirs()[0].to_path_buf();
    let (base, adapter) = (root.join("llama"), root.join("adapter"));
    for (from, to, files) in [
        (
            "llama_parity/llama",
            &base,
            &["config.json", "model.safetensors"][..],
        ),
        (
            "lora_parity/llama/adapter",
            &adapter,
            &["adapter_config.json", "adapter_model.safetensors"],
        ),
    ] {
        std::fs::create_dir_all(to).unwrap();
        for file in files {
            std::fs::copy(reference.join(from).join(file), to.join(file)).unwrap();
        }
    }
    std::fs::copy(
        reference.join("llama_parity/tokens.bin"),
        root.join("tokens.bin"),
    )
    .unwrap();
    let read =
        |path: &Path| -> Value { serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap() };
    let expected = read(&reference.join("lora_parity/llama/expected.json"));
    let spec = json!({"model": {"config": read(&base.join("config.json")),
            "init_from": base.display().to_string()},
        "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear",
                 "init_from": adapter.display().to_string()},
        "data": {"kind": "tokens", "path": root.join("tokens.bin").display().to_string()},
        "world_size": 2, "zero": {"stage": 2}, "precision": {"dtype": "fp32"},
        "training": {"steps": 3, "micro_batch_size": 1, "seq_len": 32}});
    // Started from PEFT's adapter on transformers' weights: the first loss is PEFT's on the
    // same batch.
    let want = expected["losses"][0].as_f64().unwrap();
    let id = s.succeeds_from(spec.clone(), want, "PEFT").await;
    let tensor_names = |path: &Path| {
        let bytes = std::fs::read(path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = file.names().into_iter().map(str::to_string).collect();
        names.sort();
        names
    };
    // Pulled, it is PEFT's files (the tensors PEFT's own save holds, and a config that this
    // trainer reads back as the same adapters) and the merged model in transformers' form.
    let pulled = s.pull(&id);
    let mut names: Vec<String> = std::fs::read_dir(pulled.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["adapter_config.json", "adapter_model.safetensors", "merged"]
    );
    let merged = pulled.path().join("merged");
    assert_eq!(read(&merged.join("config.json"))["model_type"], "llama");
    assert_eq!(
        tensor_names(&merged.join("model.safetensors")),
        tensor_names(&base.join("model.safetensors"))
    );
    assert_eq!(
        tensor_names(&pulled.path().join("adapter_model.safetensors")),
        tensor_names(&reference.join("lora_parity/llama/trained/adapter_model.safetensors"))
    );
    let spec = JobSpec::parse(&spec.to_string(), Purpose::Train)
        .unwrap()
        .spec;
    let (model, lora) = (spec.architecture().model().unwrap(), spec.lora.unwrap());
    let adapters = lora.adapters(&model);
    let roots = wire::data_roots::DataRoots::anywhere();
    let dir = pulled.path().display().to_string();
    runner::checkpoint::load_peft(&roots, &dir, &model, &lora, &adapters).unwrap();
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_resumed_from_another_job_s_checkpoint_continues_it_exactly() {
    let s = service().await;
    let (stop, thread) = agent(&s, "resumer", 2, 1 << 30);
    s.wait_nodes(1).await;
    let spec = |stage: u8, optimizer: &str, resume_from: Value| {
        json!({"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp32"},
            "optimizer": {"type": optimizer}, "world_size": 2, "zero": {"stage": stage},
            "checkpoint": {"every_steps": 2},
            "training": {"steps": 4, "micro_batch_size": 2, "seq_len": 32},
            "resume_from": resume_from})
    };
    let (status, created) = s.submit(spec(0, "adamw", Value::Null)).await;
    assert_eq!(status, 201, "{created}");
    let first = job_id(&created);
    let done = s.finished(&first, Duration::from_secs(60)).await;
    assert_eq!(done["state"], "succeeded", "{done}");

    let step_2 = json!({"job": first, "artifact": "checkpoints/step-00000002"});
    for (bad, field) in [
        (
            spec(
                0,
                "adamw",
                json!({"job": first, "artifact": "checkpoints/step-00000003"}),
            ),
            "resume_from.artifact",
        ),
        (spec(0, "lion", step_2.clone()), "resume_from.job"),
        (
            spec(
                0,
                "adamw",
                json!({"job": "nope", "artifact": "checkpoints/step-00000002"}),
            ),
            "resume_from.job",
        ),
    ] {
        let (status, refused) = s.submit(bad).await;
        assert_eq!(status, 422, "{refused}");
        assert_eq!(refused["field"], field, "{refused}");
    }
    // Stage 2 takes over a stage-0 checkpoint, resharded (each rank's own shard of the state).
    let (status, created) = s.submit(spec(2, "adamw", step_2)).await;
    assert_eq!(status, 201, "{created}");
    let second = job_id(&created);
    let resumed = s.finished(&second, Duration::from_secs(60)).await;
    assert_eq!(resumed["state"], "succeeded", "{resumed}");
    let s = &s;
    let losses = |id: String| async move {
        let m = s.get(&format!("/v1/jobs/{id}/metrics")).await;
        m["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["step"].as_u64().unwrap(), p["loss"].as_f64().unwrap()))
            .collect::<Vec<_>>()
    };
    let (theirs, ours) = (losses(first.clone()).await, losses(second.clone()).await);
    let steps = |l: &[(u64, f64)]| l.iter().map(|p| p.0).collect::<Vec<_>>();
    assert_eq!(steps(&ours), [3, 4], "trained on from step 3: {ours:?}");
    assert_eq!(ours, theirs[2..], "the same steps 3 and 4");
    // The weights are the same bits at every stage, so the two models are the same file.
    let model = |id: String| async move {
        let listed = s.get(&format!("/v1/jobs/{id}/artifacts")).await;
        listed["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["name"] == "model.safetensors")
            .map(|a| a["sha256"].clone())
            .unwrap()
    };
    assert_eq!(model(second).await, model(first).await);
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap();
}

/// The newest checkpoint step rank 0 wrote under `attempt_dir` that is still waiting there to
/// be uploaded (a file is removed once the server has it).
fn newest_unsent(attempt_dir: &Path) -> Option<u32> {
    std::fs::read_dir(attempt_dir.join("checkpoints"))
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            e.path()
                .join("rank-00000.safetensors")
                .exists()
                .then_some(())?;
            let name = e.file_name().into_string().ok()?;
            name.strip_prefix(".step-")?
                .strip_suffix(".tmp")?
                .parse()
                .ok()
        })
        .max()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_past_the_timeout_is_fenced_off_and_comes_back() {
    let s = service().await;
    let store = &s.server.state().store;
    let counter = |m: &AgentMetrics| {
        (
            m.series.registrations_total.get(),
            m.series.attempts_fenced_total.get(),
            m.series.jobs_running.get(),
        )
    };
    // Registration waits out a server that is down, backing off and trying again.
    let proxy = live::proxy(s.server.url(), Mode::Down).await;
    let zombie = Arc::new(AgentMetrics::new());
    let (stop_zombie, zombie_thread) = live::agent_at(
        &s.server,
        &proxy.url,
        &s.join,
        "zombie",
        1,
        1 << 30,
        zombie.clone(),
    );
    let second = Duration::from_secs(1);
    poll(20 * second, Duration::from_millis(10), || async {
        let failures = zombie.series.registration_failures_total.get();
        (failures >= 2)
            .then_some(())
            .ok_or(format!("{failures} failures"))
    })
    .await;
    proxy.set(Mode::Up);
    s.wait_nodes(1).await;

    let spec = json!({"model": {"preset": "gpt2-tiny"}, "training": {"steps": 1000000,
        "micro_batch_size": 2}, "checkpoint": {"every_steps": 10}});
    let (status, created) = s.submit(spec).await;
    assert_eq!(status, 201, "{created}");
    let id = job_id(&created);
    // Once the server has committed a checkpoint, the node's network goes quiet.
    poll(120 * second, Duration::from_millis(10), || async {
        let n = store.checkpoints(&id.as_str().into()).await.unwrap().len();
        (n > 0)
            .then_some(())
            .ok_or("no checkpoint committed".to_string())
    })
    .await;
    proxy.set(Mode::Paused);
    // Past the heartbeat timeout its node is lost and the job requeued, while the agent, cut
    // off, trains on and writes a checkpoint the server never receives.
    s.wait_state(&id, "queued", 30 * second).await;
    let committed = store.checkpoints(&id.as_str().into()).await.unwrap();
    assert!(committed.iter().all(|c| c.attempt == 1), "{committed:?}");
    let committed = committed.iter().map(|c| c.step).max().unwrap();
    let zombie_dir = s
        .dir
        .path()
        .join("agents/zombie/jobs")
        .join(&id)
        .join("attempts/1");
    poll(60 * second, Duration::from_millis(10), || async {
        let newest = newest_unsent(&zombie_dir);
        (newest > Some(committed))
            .then_some(())
            .ok_or(format!("newest unsent {newest:?}, committed {committed}"))
    })
    .await;

    // Another node takes attempt 2 and resumes from the committed checkpoint only.
    let (stop_rescuer, rescuer) = agent(&s, "rescuer", 1, 1 << 30);
    s.wait_state(&id, "running", 60 * second).await;
    let job = s.get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(job["attempt"], 2, "{job}");
    let started = job["transitions"].as_array().unwrap().last().unwrap()["reason"].clone();
    assert_eq!(
        started,
        format!("started on rescuer, resumed from step {committed}"),
        "{job}"
    );

    // The cut-off agent hears again: the server no longer knows its node. It stops its ranks
    // at once (its reports refused), registers again and takes the next job, since the
    // rescuer's one device is busy.
    let refused = |text: &str| -> u64 {
        let series = "zerotrain_agent_reports_refused_total{reason=\"node_lost\"} ";
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.parse().ok())
            .unwrap()
    };
    assert_eq!(counter(&zombie), (1, 0, 1));
    proxy.set(Mode::Up);
    poll(60 * second, Duration::from_millis(10), || async {
        let c = counter(&zombie);
        (c == (2, 1, 0)).then_some(()).ok_or(format!("{c:?}"))
    })
    .await;
    let prometheus = s.call(reqwest::Method::GET, "/metrics").await;
    assert!(refused(&prometheus.text().await.unwrap()) > 0);
    let recorded = store.checkpoints(&id.as_str().into()).await.unwrap();
    assert!(
        recorded
            .iter()
            .all(|c| c.attempt == 2 || c.step <= committed),
        "nothing attempt 1 wrote after the cut counts: {recorded:?}"
    );
    let (status, created) = s
        .submit(json!({"model": {"preset": "gpt2-tiny"}, "training": {"steps": 2}}))
        .await;
    assert_eq!(status, 201, "{created}");
    let next = s.finished(&job_id(&created), 60 * second).await;
    assert_eq!(next["state"], "succeeded", "{next}");
    assert_eq!(
        next["transitions"][1]["reason"], "placed on zombie[0]",
        "{next}"
    );

    s.call(reqwest::Method::POST, &format!("/v1/jobs/{id}/cancel"))
        .await;
    for (stop, thread) in [(stop_zombie, zombie_thread), (stop_rescuer, rescuer)] {
        stop.store(true, Ordering::Relaxed);
        thread.join().unwrap();
    }
}

/// A loopback address no one listens on now (for a process to bind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_serves_its_own_metrics() {
    let s = service().await;
    let addr = free_loopback_addr();
    let work = tempfile::tempdir().unwrap();
    let mut agent = agent_process(&s, work.path(), "watched", 3, &["--metrics-addr", &addr]);
    s.wait_nodes(1).await;
    let text = poll(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let text = reqwest::get(format!("http://{addr}/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            match text.contains("zerotrain_agent_heartbeats_total 0") {
                false => Ok(text),
                true => Err(format!("no heartbeat counted: {text}")),
            }
        },
    )
    .await;
    agent.kill().unwrap();
    agent.wait().unwrap();
    assert!(text.contains("zerotrain_agent_heartbeats_total"), "{text}");
    assert!(
        text.contains("zerotrain_agent_device_memory_bytes{device=\"2\"} 1073741824"),
        "{text}"
    );
    assert!(text.contains("zerotrain_agent_jobs_running 0"), "{text}");
}

/// The Python package's pytest suite (`clients/python/tests`) against this server and an agent
/// of two devices, run by the interpreter of the environment `scripts/pyenv` makes (pytest,
/// tqdm, pandas from PyPI, and the package installed from this checkout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_package_passes_its_tests_against_a_live_server() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let interpreter = pyenv::interpreter();

    let s = service().await;
    let (stop, agent) = agent(&s, "local", 2, 1 << 30);
    s.wait_nodes(1).await;
    let mut pytest = Command::new(interpreter);
    pytest
        .args(["-m", "pytest", "-q", "-rs", "clients/python/tests"])
        .current_dir(root)
        .env("ZEROTRAIN_URL", s.server.url())
        .env("ZEROTRAIN_TOKEN", ADMIN)
        .env("PYTHONDONTWRITEBYTECODE", "1");
    let out = tokio::task::spawn_blocking(move || pytest.output().unwrap())
        .await
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    agent.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    // pytest exits 0 only when tests ran and all passed: 1 is failures, 2-4 a broken run, 5
    // no tests collected.
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(" passed"), "{text}");
}

/// The README's main command as a user runs it: `zerotrain up`, a job submitted with the CLI
/// (which finds the admin token in the data directory), and SIGTERM for a clean stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zerotrain_up_runs_a_submitted_job_and_stops_cleanly_on_sigterm() {
    let up = live::Up::start(&[]).await;
    let (url, metrics_addr, data) = (
        up.url.clone(),
        up.metrics_addr.clone(),
        up.dir.path().to_str().unwrap().to_string(),
    );

    // The local agent serves its own metrics, as a standalone one does.
    let agent_metrics = reqwest::get(format!("http://{metrics_addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        agent_metrics.contains("zerotrain_agent_registrations_total 1"),
        "{agent_metrics}"
    );
    assert!(
        agent_metrics.contains("zerotrain_agent_device_memory_bytes{device=\"1\"} 1073741824"),
        "{agent_metrics}"
    );

    let spec = up.dir.path().join("job.json");
    std::fs::write(
        &spec,
        json!({"model": {"preset": "gpt2-tiny"}, "world_size": 2, "zero": {"stage": 1},
               "training": {"steps": 10, "micro_batch_size": 2}})
        .to_string(),
    )
    .unwrap();
    let mut submit = Command::new(env!("CARGO_BIN_EXE_zerotrain"));
    submit
        .args(["submit", spec.to_str().unwrap(), "--wait"])
        .env("ZEROTRAIN_URL", &url)
        .env("ZEROTRAIN_DATA_DIR", &data)
        .env_remove("ZEROTRAIN_TOKEN");
    let out = tokio::task::spawn_blocking(move || submit.output().unwrap())
        .await
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("succeeded"), "{text}");

    let (status, lines) = up.stop().await;
    assert!(status.success(), "{status}: {}", lines.join("\n"));
    let console = format!("console: {url}/ (log in with a token)");
    assert!(lines.contains(&console), "{console:?} in {lines:#?}");
}
