//! `zerotrain estimate` as a user runs it: the real binary on spec files.

use std::process::{Command, Output};

fn zerotrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures"))
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

/// README's QLoRA row: Llama-3.1-8B, r 16 on seven projections, NF4 base, on one 24 GB GPU.
#[test]
fn estimate_counts_a_qlora_job_as_peft_and_fits_it_on_one_24_gb_gpu() {
    let out = stdout(&zerotrain(&[
        "estimate",
        "llama-8b-qlora.json",
        "--device-memory",
        "24GB",
    ]));
    assert!(
        out.contains(
            "trainable params: 41,943,040 || all params: 8,072,204,288 || trainable%: 0.5196"
        ),
        "{out}"
    );
    assert!(
        out.contains("plan: stage 0, activation checkpointing on, micro-batch 1 × 1 accumulation steps: 8.9 GB per rank"),
        "{out}"
    );
    let json = stdout(&zerotrain(&[
        "estimate",
        "llama-8b-qlora.json",
        "--device-memory",
        "24GB",
        "--json",
    ]));
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(report["trainable_parameters"], 41_943_040);
    let stage0 = &report["stages"][0]["per_rank_bytes"];
    // Embeddings, LM head and norms in bf16, the seven projections as NF4, the adapters in bf16.
    assert_eq!(stage0["params"], 6_111_633_408u64);
    assert_eq!(stage0["total"], 8_948_738_052u64);
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

#[test]
fn estimate_names_every_mistake_of_a_spec_one_line_each() {
    let out = zerotrain(&["estimate", "three-mistakes.json"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        [
            "error: training.seq_len: 2048 exceeds model.context_length 1024",
            "error: training.lr: -1 must be a finite number ≥ 0",
            "error: optimizer.betas[1]: 1.5 must be in [0, 1)",
        ]
    );
}

#[test]
fn estimate_compare_prints_the_three_estimators_side_by_side_with_the_reasons() {
    let out = stdout(&zerotrain(&[
        "estimate",
        "gpt2-124m-bf16-adamw.json",
        "--devices",
        "8",
        "--compare",
    ]));
    let table = out
        .split("compared with other estimators")
        .nth(1)
        .expect("a comparison section");
    assert!(table.contains("DeepSpeed 0.19.8") && table.contains("accelerate 1.15"));
    assert!(table.contains("why they differ:"));
    insta::assert_snapshot!(out);
}

/// A Hugging Face model directory holding `reference`'s config.json.
fn model_dir(reference: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let from = format!(
        "{}/../tests/reference/hf_configs/{reference}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::copy(from, dir.path().join("config.json")).unwrap();
    dir
}

#[test]
fn estimate_model_dir_prints_transformers_parameter_count_for_every_reference_config() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/reference/hf_configs/parameters.json"
    );
    let counts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for (name, m) in counts["models"].as_object().unwrap() {
        let dir = model_dir(m["config"].as_str().unwrap());
        let dir = dir.path().to_str().unwrap();
        let out = stdout(&zerotrain(&["estimate", "--model-dir", dir, "--json"]));
        let report: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(report["parameters"], m["parameters"], "{name}");
        let family = if name == "gpt2" { "gpt2" } else { "llama" };
        assert_eq!(report["model"]["family"], family, "{name}");
    }
    // The text names the family and shape under the parameter count.
    let dir = model_dir("llama-2-7B.json");
    let out = stdout(&zerotrain(&[
        "estimate",
        "--model-dir",
        dir.path().to_str().unwrap(),
        "--devices",
        "8",
    ]));
    let mut lines = out.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("6,738,415,616 parameters on 8 CUDA device(s)")
    );
    assert_eq!(
        lines.next().unwrap(),
        "model: llama: 32 layers, hidden 4096, 32 heads / 32 KV × 128, MLP 11008, vocabulary 32000, 4096 positions, untied head"
    );
}

#[test]
fn model_dir_takes_the_rest_of_the_spec_from_the_spec_file() {
    let dir = model_dir("llama-3.1-8B.json");
    let spec = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        spec.path(),
        r#"{"precision": {"dtype": "bf16"}, "training": {"seq_len": 1024}, "world_size": 8}"#,
    )
    .unwrap();
    let args = [
        "estimate",
        spec.path().to_str().unwrap(),
        "--model-dir",
        dir.path().to_str().unwrap(),
        "--json",
    ];
    let report: serde_json::Value = serde_json::from_str(&stdout(&zerotrain(&args))).unwrap();
    assert_eq!(report["world_size"], 8);
    assert_eq!(report["parameters"], 8_030_261_248u64);
    // A spec with a model of its own is refused: the directory gives it.
    let out = zerotrain(&[
        "estimate",
        "gpt2-tiny.json",
        "--model-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("remove `model` from the spec"));
}

#[test]
fn train_starts_a_llama_family_model_from_a_hugging_face_directory() {
    // README's example: the parity reference Qwen3 on its own token shard, whose first batch
    // is the one make.py computed transformers' first loss on; zerotrain's own initialisation
    // would start near ln 256 too, but not at that value.
    let reference = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/reference/llama_parity"
    );
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(format!("{reference}/qwen3/expected.json")).unwrap())
            .unwrap();
    let out = stdout(&zerotrain(&[
        "train",
        "qwen3-finetune.json",
        "--model-dir",
        &format!("{reference}/qwen3"),
        "--json",
        "--threads",
        "1",
    ]));
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    let first = summary["losses"][0].as_f64().unwrap();
    let want = expected["losses"][0].as_f64().unwrap();
    assert!(
        (first - want).abs() < 1e-5 * want,
        "{first} vs transformers' {want}"
    );
}
