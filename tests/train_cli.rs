//! `zerotrain train` as a process: killed between checkpoints and in the middle of writing one,
//! it always leaves a loadable checkpoint and resumes from it.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use runner::checkpoint;
use safetensors::SafeTensors;

const SPEC: &str = r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 300},
                       "checkpoint": {"every_steps": 1}}"#;

fn zerotrain(spec: &Path, out: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerotrain"));
    cmd.args(["train", "--json", "--threads", "1", "--out"])
        .arg(out)
        .arg(spec);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// The checkpoint `latest` names loads completely; returns its step.
fn assert_loadable(out: &Path) -> u32 {
    let dir = checkpoint::latest(out)
        .unwrap()
        .expect("a checkpoint exists");
    let manifest = checkpoint::load_manifest(&dir).unwrap();
    let bytes = fs::read(dir.join("rank-00000.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    assert!(file.tensor("u0.params").is_ok() && file.tensor("u3.v").is_ok());
    manifest.step
}

fn interrupted_write_left_behind(out: &Path) -> bool {
    fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".tmp"))
}

/// The step of the checkpoint `latest` names (from the name alone, as the writer may be
/// replacing older directories meanwhile), 0 before the first.
fn latest_step(out: &Path) -> u32 {
    checkpoint::latest(out).unwrap().map_or(0, |dir| {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        name.strip_prefix("step-").unwrap().parse().unwrap()
    })
}

/// Whether a checkpoint is being staged (`checkpoint::staging_dir`).
fn staging(out: &Path) -> bool {
    fs::read_dir(out.join("checkpoints")).unwrap().any(|e| {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        name.starts_with(".step-") && name.ends_with(".tmp")
    })
}

/// Waits until `done` holds, failing if `child` exits first or a minute passes (a liveness
/// bound far above the seconds a step of gpt2-tiny takes). `done` reads files the child
/// writes, which no event announces: they are looked at every millisecond.
fn wait_until(child: &mut Child, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("zerotrain exited ({status}) before {what}");
        }
        assert!(start.elapsed() < Duration::from_secs(60), "never {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn killing_training_mid_checkpoint_leaves_the_previous_checkpoint_loadable() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    fs::write(&spec, SPEC).unwrap();
    let out = dir.path().join("out");
    let (mut mid_write, mut last_step, mut kills) = (0, 0, 0);
    for attempt in 0..60 {
        kills += 1;
        let mut child = zerotrain(&spec, &out)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Once this process has published a checkpoint of its own (any staging directory
        // left by the last kill is then gone), kill it: on odd attempts at once, between
        // writes; on even ones as soon as it starts staging the next checkpoint.
        let start = last_step;
        wait_until(&mut child, "published a checkpoint", || {
            latest_step(&out) > start
        });
        if attempt % 2 == 0 {
            wait_until(&mut child, "staged a checkpoint", || staging(&out));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        mid_write += usize::from(interrupted_write_left_behind(&out));
        let step = assert_loadable(&out);
        assert!(
            step > last_step,
            "each run published a checkpoint past {last_step}: {step}"
        );
        last_step = step;
        if mid_write >= 3 {
            break;
        }
    }
    eprintln!("{mid_write} of {kills} kills landed during a checkpoint write");
    assert!(
        mid_write >= 3,
        "only {mid_write} kills landed during a checkpoint write"
    );
    assert!(last_step < 300, "the kills left training unfinished");
    let done = zerotrain(&spec, &out).output().unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&done.stdout).unwrap();
    assert!(summary["resumed_from"].as_u64().unwrap() >= u64::from(last_step));
    assert_eq!(summary["losses"].as_array().unwrap().len(), 300);
    assert!(out.join("model.safetensors").exists());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn tcp_rank(spec: &Path, out: &Path, rank: usize, port: u16, timeout_s: u64) -> Command {
    let mut cmd = zerotrain(spec, out);
    cmd.args([
        "--rank",
        &rank.to_string(),
        "--master",
        &format!("127.0.0.1:{port}"),
    ]);
    cmd.args(["--comm-timeout", &timeout_s.to_string()]);
    cmd
}

#[test]
fn ranks_as_tcp_processes_train_the_same_bits_as_ranks_as_threads() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    fs::write(
        &spec,
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 3, "zero": {"stage": 2},
            "training": {"steps": 4, "micro_batch_size": 2}}"#,
    )
    .unwrap();
    let threads = dir.path().join("threads");
    let out = zerotrain(&spec, &threads).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let processes = dir.path().join("processes");
    let port = free_port();
    let children: Vec<_> = (0..3)
        .map(|r| tcp_rank(&spec, &processes, r, port, 30).spawn().unwrap())
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "rank {rank}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(summary["ranks"][0]["rank"], rank);
    }
    let model = |d: &Path| fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        model(&threads) == model(&processes),
        "TCP and in-process rings disagree"
    );
}

#[test]
fn a_killed_rank_makes_the_others_exit_with_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    fs::write(
        &spec,
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 3, "training": {"steps": 100000},
            "checkpoint": {"every_steps": 1}}"#,
    )
    .unwrap();
    let out = dir.path().join("out");
    let port = free_port();
    // A timeout far beyond the liveness bound below: the others must notice the closed links,
    // not a silence.
    let comm_timeout = 600;
    let mut ranks: Vec<_> = (0..3)
        .map(|r| {
            tcp_rank(&spec, &out, r, port, comm_timeout)
                .spawn()
                .unwrap()
        })
        .collect();
    // A published checkpoint means every rank has joined and trained a step.
    wait_until(&mut ranks[0], "published a checkpoint", || {
        latest_step(&out) > 0
    });
    ranks[1].kill().unwrap();
    let killed = Instant::now();
    for rank in [0, 2] {
        let child = std::mem::replace(&mut ranks[rank], Command::new("true").spawn().unwrap());
        let result = child.wait_with_output().unwrap();
        assert!(!result.status.success(), "rank {rank} should fail");
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(stderr.contains("peer rank 1"), "rank {rank}: {stderr}");
    }
    eprintln!("the others exited {:?} after the kill", killed.elapsed());
    assert!(
        killed.elapsed() < Duration::from_secs(60),
        "took {:?} (the communication timeout is {comm_timeout} s)",
        killed.elapsed()
    );
    ranks[1].wait().unwrap();
}

#[test]
fn training_on_cuda_without_a_driver_fails_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    fs::write(&spec, SPEC).unwrap();
    let out = dir.path().join("out");
    // This test is for machines without a GPU; where a driver is present it proves nothing.
    let driver = [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/lib64/libcuda.so.1",
    ]
    .iter()
    .any(|p| Path::new(p).exists());
    if driver && cfg!(feature = "cuda") {
        eprintln!("skipped: a CUDA driver is installed here");
        return;
    }
    let result = zerotrain(&spec, &out)
        .args(["--device", "cuda:0"])
        .output()
        .unwrap();
    assert!(!result.status.success(), "training without a GPU must fail");
    let stderr = String::from_utf8_lossy(&result.stderr);
    let want = if cfg!(feature = "cuda") {
        "no CUDA driver found: "
    } else {
        "built without CUDA support"
    };
    assert!(stderr.contains(want), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        !out.join("checkpoints").exists(),
        "nothing trained, nothing written"
    );

    let bad = zerotrain(&spec, &out)
        .args(["--device", "tpu"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("expected cpu, cuda or cuda:N"), "{stderr}");
}

/// The cache folders of complete tokenizations under `out` (named by their key alone), and
/// whether a partial one is there.
fn tokenizations(out: &Path) -> (Vec<std::path::PathBuf>, bool) {
    let Ok(entries) = fs::read_dir(out.join("cache/tokens")) else {
        return (Vec::new(), false);
    };
    let (mut done, mut partial) = (Vec::new(), false);
    for e in entries {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".partial") {
            partial = true;
        } else if path.is_dir() {
            done.push(path);
        }
    }
    (done, partial)
}

/// Bytes written so far into a partial tokenization's first training shard.
fn partial_shard_bytes(out: &Path) -> u64 {
    fs::read_dir(out.join("cache/tokens"))
        .into_iter()
        .flatten()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".partial"))
        .filter_map(|p| p.join("train_000000.bin").metadata().ok())
        .map(|m| m.len())
        .max()
        .unwrap_or(0)
}

#[test]
fn a_killed_tokenization_never_leaves_shards_a_later_run_reads() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/words-tokenizer");
    // About 24 MB of JSON Lines: long enough to tokenize that kills land mid-write.
    let words = [
        "the", "cat", "sees", "a", "red", "ball", "my", "old", "friend", "likes",
    ];
    let mut jsonl = String::new();
    for i in 0..120_000usize {
        let doc: Vec<&str> = (0..30)
            .map(|j| words[(i * 7 + j * j) % words.len()])
            .collect();
        jsonl += &format!("{{\"text\": \"{} .\"}}\n", doc.join(" "));
    }
    let held_out: String = jsonl.lines().take(200).map(|l| format!("{l}\n")).collect();
    fs::write(dir.path().join("corpus.jsonl"), jsonl).unwrap();
    fs::write(dir.path().join("held-out.jsonl"), held_out).unwrap();
    let spec = dir.path().join("spec.json");
    let data = serde_json::json!({"kind": "jsonl", "path": dir.path().join("corpus.jsonl"),
                                  "tokenizer": fixture.join("tokenizer.json"),
                                  "validation": {"path": dir.path().join("held-out.jsonl"),
                                                 "every_steps": 1, "batches": 2}});
    let json = serde_json::json!({"model": {"preset": "llama-tiny"}, "data": data,
                                  "training": {"steps": 1, "seq_len": 64, "micro_batch_size": 1}});
    fs::write(&spec, json.to_string()).unwrap();
    let out = dir.path().join("out");
    // 120,000 documents of 32 tokens, 4 bytes a token: kill at sizes spread over the shard.
    let expected = 120_000 * 32 * 4;
    for k in 0..4u64 {
        let mut child = zerotrain(&spec, &out)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let at = expected * (2 * k + 1) / 9;
        wait_until(&mut child, "wrote part of the shard", || {
            partial_shard_bytes(&out) > at
        });
        child.kill().unwrap();
        child.wait().unwrap();
        let (done, partial) = tokenizations(&out);
        assert!(done.is_empty() && partial, "kill {k}: {done:?}");
    }
    let run = |out: &Path| {
        let done = zerotrain(&spec, out).output().unwrap();
        let stderr = String::from_utf8_lossy(&done.stderr).into_owned();
        assert!(done.status.success(), "{stderr}");
        let (tokenized, partial) = tokenizations(out);
        assert_eq!((tokenized.len(), partial), (1, false), "{stderr}");
        // The held-out text's loss after the one step, in the JSON summary.
        let summary: serde_json::Value = serde_json::from_slice(&done.stdout).unwrap();
        let validation = &summary["validation"];
        assert_eq!(validation[0]["step"], 1, "{summary}");
        assert!(validation[0]["loss"].as_f64().unwrap() > 0.0, "{summary}");
        (
            fs::read(tokenized[0].join("train_000000.bin")).unwrap(),
            stderr,
        )
    };
    let (after_kills, stderr) = run(&out);
    assert!(
        stderr.contains("tokenized") && stderr.contains("validation loss"),
        "{stderr}"
    );
    let (clean, _) = run(&dir.path().join("clean"));
    assert!(
        after_kills == clean,
        "the shard after the kills differs from a clean run's"
    );
    assert_eq!(after_kills.len(), 1024 + expected as usize);
    // A third run reads what the first finished.
    let (_, again) = run(&out);
    assert!(again.contains("not tokenizing again"), "{again}");
}
