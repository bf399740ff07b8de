//! Parity with transformers: the Llama-family trainer, from the same random weights on the same
//! token shard, in fp32 AdamW, gives transformers' losses step by step, and its export carries
//! exactly the tensors and config keys transformers writes. The reference data was made once
//! by `tests/reference/llama_parity/make.py` (torch and transformers versions in each
//! `expected.json`); this test needs neither.

use std::path::{Path, PathBuf};

use runner::train::{Options, run};
use safetensors::SafeTensors;
use scheduler::plan::plan_local;
use scheduler::spec::{JobSpec, Purpose};
use serde_json::Value;

fn reference() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/llama_parity")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Trains `family`'s reference model as `make.py` did and checks losses and export.
fn parity(family: &str) {
    let dir = reference().join(family);
    let expected = read_json(&dir.join("expected.json"));
    let config = read_json(&dir.join("config.json"));
    let opt = &expected["optimizer"];
    let spec = serde_json::json!({
        "model": {"config": config, "init_from": dir.to_str().unwrap()},
        "data": {"kind": "tokens", "path": reference().join("tokens.bin").to_str().unwrap()},
        "precision": {"dtype": "fp32"},
        "optimizer": {"type": "adamw", "betas": opt["betas"], "eps": opt["eps"],
                      "weight_decay": opt["weight_decay"]},
        "zero": {"stage": 0},
        "activation_checkpointing": false,
        "training": {"steps": expected["steps"], "micro_batch_size": expected["batch"],
                     "seq_len": expected["seq_len"], "lr": opt["lr"], "lr_schedule": "constant",
                     "grad_clip": 0.0},
    });
    let spec = JobSpec::parse(&spec.to_string(), Purpose::Train)
        .unwrap_or_else(|e| panic!("{family}: {e}"))
        .spec;
    let out = tempfile::tempdir().unwrap();
    let opts = Options {
        out_dir: Some(out.path().to_path_buf()),
        ..Options::default()
    };
    let plan = plan_local(&spec, None).unwrap();
    let summary = run(&spec, &plan, &opts, &mut |_| {}).unwrap_or_else(|e| panic!("{family}: {e}"));

    let want: Vec<f64> = expected["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_f64().unwrap())
        .collect();
    losses_match(family, &summary.losses, &want, "transformers");

    let bytes = std::fs::read(out.path().join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = expected["export"]["tensors"].as_object().unwrap();
    let mut names = file.names();
    names.sort();
    let mut want_names: Vec<&String> = tensors.keys().collect();
    want_names.sort();
    assert_eq!(names, want_names, "{family}: exported tensor names");
    for (name, shape) in tensors {
        let shape: Vec<usize> = serde_json::from_value(shape.clone()).unwrap();
        assert_eq!(
            file.tensor(name).unwrap().shape(),
            shape,
            "{family}: {name}"
        );
    }
    let exported = read_json(&out.path().join("config.json"));
    let mut keys: Vec<&String> = exported.as_object().unwrap().keys().collect();
    keys.sort();
    let want_keys: Vec<&str> = expected["export"]["config_keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(keys, want_keys, "{family}: config.json keys");
}

/// Every step's loss of `family`'s run within 1e-5 (relative) of `reference`'s.
pub(crate) fn losses_match(family: &str, got: &[f64], want: &[f64], reference: &str) {
    assert_eq!(got.len(), want.len());
    for (step, (got, want)) in got.iter().zip(want).enumerate() {
        let rel = (got - want).abs() / want.abs();
        eprintln!(
            "{family} step {}: {got:.7} vs {reference} {want:.7} ({rel:.1e})",
            step + 1
        );
        assert!(
            rel < 1e-5,
            "{family} step {}: loss {got} vs {reference}'s {want} (relative {rel:e})",
            step + 1
        );
    }
}

#[test]
fn llama_with_grouped_query_attention_llama3_rope_and_an_untied_head_matches_transformers() {
    parity("llama");
}

#[test]
fn qwen2_with_qkv_biases_and_a_tied_head_matches_transformers() {
    parity("qwen2");
}

#[test]
fn qwen3_with_qk_norms_and_a_wide_head_dim_matches_transformers() {
    parity("qwen3");
}
