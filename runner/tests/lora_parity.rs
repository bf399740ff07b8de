//! Parity with PEFT on transformers: LoRA adapters on a frozen tiny Llama, Qwen3 and GPT-2,
//! started from the same PEFT adapter on the same token shard, in fp32 AdamW, give PEFT's
//! losses step by step, and so do QLoRA's on the same bases in NF4, beside PEFT on
//! bitsandbytes. The reference data was made once by `tests/reference/lora_parity/make.py` and
//! `tests/reference/qlora_parity/make.py` (versions in their JSON); this test needs neither
//! torch, PEFT nor bitsandbytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use runner::train::{Options, run};
use safetensors::SafeTensors;
use scheduler::plan::plan_local;
use scheduler::spec::{JobSpec, Purpose};
use serde_json::Value;

fn reference(dir: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/reference")
        .join(dir)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The spec `make.py` trained with: the base from `base`, the adapter from `adapter` (none:
/// the base alone, every weight trained; `nf4`: on a base in NF4), and the data, optimizer and
/// batch of `../llama_parity`, for `steps` steps at `lr`.
fn spec(base: &Path, adapter: Option<(&Path, bool)>, steps: u64, lr: f64) -> JobSpec {
    let expected = read_json(&reference("llama_parity/llama/expected.json"));
    let opt = &expected["optimizer"];
    let mut spec = serde_json::json!({
        "model": {"config": read_json(&base.join("config.json")),
                  "init_from": base.to_str().unwrap()},
        "data": {"kind": "tokens",
                 "path": reference("llama_parity/tokens.bin").to_str().unwrap()},
        "precision": {"dtype": "fp32"},
        "optimizer": {"type": "adamw", "betas": opt["betas"], "eps": opt["eps"],
                      "weight_decay": opt["weight_decay"]},
        "zero": {"stage": 0},
        "activation_checkpointing": false,
        "training": {"steps": steps, "micro_batch_size": expected["batch"],
                     "seq_len": expected["seq_len"], "lr": lr, "lr_schedule": "constant",
                     "grad_clip": 0.0},
    });
    if let Some((adapter, nf4)) = adapter {
        let lora = read_json(&adapter.join("../expected.json"))["lora"].clone();
        spec["lora"] = serde_json::json!({"rank": lora["rank"], "alpha": lora["alpha"],
            "target_modules": lora["target_modules"], "init_from": adapter.to_str().unwrap()});
        if nf4 {
            spec["lora"]["quantize_base"] = "nf4".into();
        }
    }
    JobSpec::parse(&spec.to_string(), Purpose::Train)
        .unwrap_or_else(|e| panic!("{e}"))
        .spec
}

/// Trains `spec` on one rank, writing into `out` if given; its losses.
fn losses(spec: &JobSpec, out: Option<&Path>) -> Vec<f64> {
    let plan = plan_local(spec, None).unwrap();
    let opts = Options {
        out_dir: out.map(Path::to_path_buf),
        ..Options::default()
    };
    run(spec, &plan, &opts, &mut |_| {})
        .unwrap_or_else(|e| panic!("{e}"))
        .losses
}

/// Trains `family`'s adapter on its base as `make.py` did and checks every step's loss.
fn parity(family: &str, base: &Path) {
    let dir = reference("lora_parity").join(family);
    let expected = read_json(&dir.join("expected.json"));
    let out = tempfile::tempdir().unwrap();
    let want: Vec<f64> = serde_json::from_value(expected["losses"].clone()).unwrap();
    let lr = read_json(&reference("llama_parity/llama/expected.json"))["optimizer"]["lr"]
        .as_f64()
        .unwrap();
    let adapter = dir.join("adapter");
    let job = spec(base, Some((&adapter, false)), want.len() as u64, lr);
    let got = losses(&job, Some(out.path()));
    crate::llama_parity::losses_match(family, &got, &want, "PEFT");
    // The export is PEFT's trained adapter: its tensors, named and shaped as PEFT saved them,
    // with PEFT's values.
    let ours = std::fs::read(out.path().join("adapter_model.safetensors")).unwrap();
    let theirs = std::fs::read(dir.join("trained/adapter_model.safetensors")).unwrap();
    let (ours, theirs) = (tensors(&ours), tensors(&theirs));
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "{family}: tensor names"
    );
    for (name, (shape, values)) in &ours {
        let (want_shape, want) = &theirs[name];
        assert_eq!(shape, want_shape, "{family}: {name}");
        let diff: f64 = values
            .iter()
            .zip(want)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum();
        let norm: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
        let rel = (diff / norm).sqrt();
        assert!(
            rel < 1e-5,
            "{family}: {name} differs from PEFT's by {rel:e}"
        );
    }
    merged_is_the_base_with_peft_s_product(family, base, out.path(), &theirs);
    // The merged model computes what PEFT's adapted model computed after its updates: trained
    // at a learning rate too small to move any weight, its step 11 reads window 11, where
    // PEFT measured `loss_after`.
    let merged = out.path().join("merged");
    let after = losses(&spec(&merged, None, want.len() as u64 + 1, STILL), None);
    let (got, want) = (after[want.len()], expected["loss_after"].as_f64().unwrap());
    let rel = (got - want).abs() / want;
    eprintln!("{family} merged, window 11: {got:.7} vs PEFT {want:.7} ({rel:.1e})");
    assert!(
        rel < 1e-5,
        "{family}: merged model's loss {got} vs PEFT's {want}"
    );
}

/// A learning rate that moves no weight: the trainer's f32 learning rate rounds it to 0, so
/// AdamW's step and its decay are both nothing.
const STILL: f64 = 1e-50;

/// The merged model under `out` is the base (the model files in `base`) with s·B·A of the
/// trained adapter `theirs` (PEFT's, or the export's) added to each adapted weight (transposed
/// for GPT-2's Conv1D), under the base's names; the rest is the base.
fn merged_is_the_base_with_peft_s_product(family: &str, base: &Path, out: &Path, theirs: &Tensors) {
    let merged = tensors(&std::fs::read(out.join("merged/model.safetensors")).unwrap());
    let base_file = tensors(&std::fs::read(base.join("model.safetensors")).unwrap());
    let scaling = 2.0; // alpha 8 / rank 4
    let mut adapted = 0;
    for (name, (shape, values)) in &merged {
        let local = name.strip_prefix("transformer.").unwrap_or(name);
        let (_, w) = base_file
            .get(name)
            .or_else(|| base_file.get(local))
            .unwrap_or_else(|| panic!("{family}: {name} is not the base's"));
        let module = local.strip_suffix(".weight").unwrap_or(local);
        let peft = |part: &str| {
            theirs
                .iter()
                .find(|(n, _)| n.ends_with(&format!(".{module}.{part}.weight")))
                .map(|(_, t)| t)
        };
        let want: Vec<f32> = match (peft("lora_A"), peft("lora_B")) {
            (Some((a_shape, a)), Some((b_shape, b))) => {
                adapted += 1;
                let (r, inputs, outputs) = (a_shape[0], a_shape[1], b_shape[0]);
                (0..values.len())
                    .map(|e| {
                        let (row, col) = if family == "gpt2" {
                            (e % outputs, e / outputs)
                        } else {
                            (e / inputs, e % inputs)
                        };
                        let dot: f32 = (0..r).map(|k| b[row * r + k] * a[k * inputs + col]).sum();
                        w[e] + scaling * dot
                    })
                    .collect()
            }
            _ => w.clone(),
        };
        assert_eq!(
            shape.iter().product::<usize>(),
            want.len(),
            "{family}: {name}"
        );
        let diff: f64 = values
            .iter()
            .zip(&want)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum();
        let norm: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
        // Zero tensors (GPT-2's initial biases) must come out zero.
        let rel = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
        assert!(rel < 1e-6, "{family}: merged {name} differs by {rel:e}");
    }
    assert_eq!(
        2 * adapted,
        theirs.len(),
        "{family}: every adapted weight merged"
    );
    let config = read_json(&out.join("merged/config.json"));
    let base_config = read_json(&base.join("config.json"));
    assert_eq!(config["model_type"], base_config["model_type"], "{family}");
}

pub(crate) type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Each tensor of a safetensors file (F32) by name: its shape and values.
pub(crate) fn tensors(bytes: &[u8]) -> Tensors {
    let file = SafeTensors::deserialize(bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, t)| {
            let values = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, (t.shape().to_vec(), values))
        })
        .collect()
}

#[test]
fn a_merged_export_from_a_seeded_base_is_that_base_with_the_exported_adapters_added() {
    for (preset, family) in [("gpt2-tiny", "gpt2"), ("llama-tiny", "llama")] {
        let train = |extra: &str, lr: f64, out: &Path| {
            let json = format!(
                r#"{{"model": {{"preset": "{preset}"}}{extra},
                    "training": {{"steps": 3, "micro_batch_size": 2, "lr": {lr}}}}}"#
            );
            let spec = JobSpec::parse(&json, Purpose::Train).unwrap().spec;
            losses(&spec, Some(out));
        };
        // The seed's base, as a full fine-tune exports it when no weight moves, and adapters
        // trained on it (B is zero until trained).
        let (base, lora) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        train("", STILL, base.path());
        let adapters = r#", "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear"}"#;
        train(adapters, 1e-2, lora.path());
        let ours = tensors(&std::fs::read(lora.path().join("adapter_model.safetensors")).unwrap());
        merged_is_the_base_with_peft_s_product(family, base.path(), lora.path(), &ours);
    }
}

/// `family`'s adapter trained on its base in NF4 as `qlora_parity/make.py` trained it, beside
/// PEFT on bitsandbytes step by step.
fn qlora_parity(family: &str, base: &Path) {
    let expected = read_json(&reference("qlora_parity").join(format!("{family}.json")));
    let want: Vec<f64> = serde_json::from_value(expected["losses"].clone()).unwrap();
    let lr = read_json(&reference("llama_parity/llama/expected.json"))["optimizer"]["lr"]
        .as_f64()
        .unwrap();
    let adapter = reference("lora_parity").join(family).join("adapter");
    let job = spec(base, Some((&adapter, true)), want.len() as u64, lr);
    let got = losses(&job, None);
    crate::llama_parity::losses_match(family, &got, &want, "PEFT on bitsandbytes");
}

#[test]
fn qlora_adapters_on_nf4_bases_match_peft_on_bitsandbytes() {
    qlora_parity("llama", &reference("llama_parity/llama"));
    qlora_parity("qwen3", &reference("llama_parity/qwen3"));
    qlora_parity("gpt2", &reference("lora_parity/gpt2"));
}

#[test]
fn llama_adapters_on_every_projection_match_peft() {
    parity("llama", &reference("llama_parity/llama"));
}

#[test]
fn qwen3_adapters_with_qk_norms_match_peft() {
    parity("qwen3", &reference("llama_parity/qwen3"));
}

#[test]
fn gpt2_adapters_on_conv1d_projections_match_peft() {
    parity("gpt2", &reference("lora_parity/gpt2"));
}
