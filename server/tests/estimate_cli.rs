//! `zerotrain estimate` as a user runs it: the real binary on spec files.

use std::process::{Command, Output};

fn zerotrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures"))
        .output()
        .expect("zerotrain runs")
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn estimate_prints_the_stage_table_and_plan_for_gpt2_124m_bf16_adamw() {
    let out = stdout(&zerotrain(&["estimate", "gpt2-124m-bf16-adamw.json"]));
    assert!(
        out.starts_with("124,439,808 parameters on 4 CUDA device(s)"),
        "{out}"
    );
    insta::assert_snapshot!(out);
}

#[test]
fn estimate_json_has_bytes_per_category_for_every_stage_and_the_plan() {
    let out = stdout(&zerotrain(&[
        "estimate",
        "gpt2-124m-bf16-adamw.json",
        "--devices",
        "8",
        "--device-memory",
        "2GiB",
        "--device-kind",
        "cpu",
        "--json",
    ]));
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["parameters"], 124_439_808);
    assert_eq!(report["world_size"], 8);
    assert_eq!(report["stages"].as_array().unwrap().len(), 4);
    insta::assert_json_snapshot!(report);
}

#[test]
fn estimate_refuses_a_bad_spec_naming_the_field() {
    let out = zerotrain(&["estimate", "bad-seq-len.json"]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        err.trim(),
        "error: training.seq_len: 2048 exceeds model.context_length 1024"
    );
}

#[test]
fn estimate_reports_a_missing_file() {
    let out = zerotrain(&["estimate", "no-such-spec.json"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("reading no-such-spec.json"));
}
