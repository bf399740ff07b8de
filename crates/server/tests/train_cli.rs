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
