//! `zerotrain train` as a process: killed at random moments, even mid-checkpoint, it always
//! leaves a loadable checkpoint and resumes from it.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

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

#[test]
fn killing_training_mid_checkpoint_leaves_the_previous_checkpoint_loadable() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    fs::write(&spec, SPEC).unwrap();
    let out = dir.path().join("out");
    let (mut mid_write, mut last_step) = (0, 0);
    for attempt in 0..60 {
        let mut child = zerotrain(&spec, &out).spawn().unwrap();
        // Wait for a first checkpoint, then kill at a moment that varies with the attempt.
        std::thread::sleep(Duration::from_millis(150 + (attempt * 37 % 200)));
        child.kill().unwrap();
        child.wait().unwrap();
        if checkpoint::latest(&out).unwrap().is_none() {
            continue;
        }
        mid_write += usize::from(interrupted_write_left_behind(&out));
        let step = assert_loadable(&out);
        assert!(
            step >= last_step,
            "checkpoints never go back: {step} after {last_step}"
        );
        last_step = step;
        if mid_write >= 3 {
            break;
        }
    }
    assert!(
        mid_write >= 3,
        "only {mid_write} kills landed during a checkpoint write"
    );
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
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 3, "training": {"steps": 100000}}"#,
    )
    .unwrap();
    let out = dir.path().join("out");
    let port = free_port();
    let mut ranks: Vec<_> = (0..3)
        .map(|r| tcp_rank(&spec, &out, r, port, 5).spawn().unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    ranks[1].kill().unwrap();
    let killed = std::time::Instant::now();
    for rank in [0, 2] {
        let child = std::mem::replace(&mut ranks[rank], Command::new("true").spawn().unwrap());
        let result = child.wait_with_output().unwrap();
        assert!(!result.status.success(), "rank {rank} should fail");
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(stderr.contains("peer rank 1"), "rank {rank}: {stderr}");
    }
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "took {:?}",
        killed.elapsed()
    );
    ranks[1].wait().unwrap();
}
