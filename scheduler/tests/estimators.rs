//! DeepSpeed's and accelerate's estimators against what they printed when run
//! (`tests/reference/estimators_reference.json`), and the comparison's explanations against the
//! differences they explain.

use scheduler::compare::{Comparison, accelerate, deepspeed};
use scheduler::inventory::Inventory;
use scheduler::memory::DeviceKind;
use scheduler::report::Report;
use scheduler::spec::{JobSpec, Purpose};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    deepspeed_estimator: DeepSpeedGroup,
    accelerate: AccelerateGroup,
}

#[derive(Deserialize)]
struct DeepSpeedGroup {
    rows: Vec<DeepSpeedRow>,
}

#[derive(Deserialize)]
struct DeepSpeedRow {
    zero_stage: u8,
    model: String,
    total_params: f64,
    largest_layer_params: Option<f64>,
    num_gpus_per_node: u64,
    num_nodes: u64,
    offload_optimizer: String,
    offload_param: Option<String>,
    zero_init: Option<bool>,
    additional_buffer_factor: f64,
    gpu_bytes_per_gpu: u64,
    cpu_bytes_per_node: u64,
    largest_layer_memory_bytes: Option<u64>,
    #[serde(rename = "gpu_GiB_as_printed")]
    gpu_printed: String,
    #[serde(rename = "cpu_GiB_as_printed")]
    cpu_printed: String,
}

#[derive(Deserialize)]
struct AccelerateGroup {
    rows: Vec<AccelerateRow>,
    local_model_run: LocalRun,
}

#[derive(Deserialize)]
struct AccelerateRow {
    fp32_model_bytes: u64,
    dtype_arg: accelerate::Dtype,
    stages_bytes: Stages,
    training_using_adam_bytes: Option<u64>,
    as_printed: String,
}

#[derive(Deserialize)]
struct Stages {
    model: i64,
    optimizer: i64,
    gradients: i64,
    step: i64,
}

#[derive(Deserialize)]
struct LocalRun {
    /// `[dtype, largest layer, total size, stages]` per dtype, as `gather_data` returns them.
    gather_data_rows: Vec<(accelerate::Dtype, f64, f64, Stages)>,
    estimate_command_stdout: String,
}

fn reference() -> Reference {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/reference/estimators_reference.json"
    );
    let text = std::fs::read_to_string(path).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn offload(s: &str) -> deepspeed::Offload {
    match s {
        "cpu" => deepspeed::Offload::Cpu,
        "none" => deepspeed::Offload::None,
        other => panic!("offload {other:?}"),
    }
}

#[test]
fn deepspeed_formulas_reproduce_every_row_deepspeed_printed() {
    let rows = reference().deepspeed_estimator.rows;
    assert_eq!(rows.len(), 192);
    let mut checked = [0; 2];
    for r in &rows {
        let cluster = deepspeed::Cluster {
            gpus_per_node: r.num_gpus_per_node,
            nodes: r.num_nodes,
            buffer_factor: r.additional_buffer_factor,
        };
        let needs = match r.zero_stage {
            2 => deepspeed::zero2(r.total_params, &cluster, offload(&r.offload_optimizer)),
            3 => {
                let l = r.largest_layer_params.expect("ZeRO-3 rows give L");
                assert_eq!(
                    Some(deepspeed::largest_layer_memory(l)),
                    r.largest_layer_memory_bytes
                );
                let o = deepspeed::Zero3Options {
                    offload_param: offload(r.offload_param.as_deref().unwrap()),
                    offload_optimizer: offload(&r.offload_optimizer),
                    zero_init: r.zero_init.unwrap(),
                };
                deepspeed::zero3(r.total_params, l, &cluster, o)
            }
            s => panic!("stage {s}"),
        };
        let row = format!(
            "{} stage {} {}x{} offload {:?}/{:?} zero_init {:?}",
            r.model,
            r.zero_stage,
            r.num_nodes,
            r.num_gpus_per_node,
            r.offload_optimizer,
            r.offload_param,
            r.zero_init
        );
        assert_eq!(
            (needs.gpu_bytes_per_gpu, needs.cpu_bytes_per_node),
            (r.gpu_bytes_per_gpu, r.cpu_bytes_per_node),
            "{row}"
        );
        assert_eq!(
            (
                deepspeed::as_printed(needs.gpu_bytes_per_gpu),
                deepspeed::as_printed(needs.cpu_bytes_per_node)
            ),
            (r.gpu_printed.clone(), r.cpu_printed.clone()),
            "{row}"
        );
        checked[usize::from(r.zero_stage - 2)] += 1;
    }
    assert_eq!(checked, [48, 144]);
}

fn phases_of(s: &Stages) -> Option<accelerate::Phases> {
    let all = [s.model, s.optimizer, s.gradients, s.step];
    if all == [-1; 4] {
        return None;
    }
    let b = |v: i64| u64::try_from(v).unwrap();
    Some(accelerate::Phases {
        model: b(s.model),
        gradients: b(s.gradients),
        optimizer: b(s.optimizer),
        step: b(s.step),
    })
}

#[test]
fn accelerate_formula_reproduces_every_row_accelerate_printed() {
    let group = reference().accelerate;
    assert_eq!(group.rows.len(), 36);
    for r in &group.rows {
        let phases = accelerate::training_usage(r.fp32_model_bytes, r.dtype_arg);
        let what = format!("{} bytes as {:?}", r.fp32_model_bytes, r.dtype_arg);
        assert_eq!(phases, phases_of(&r.stages_bytes), "{what}");
        let adam = phases.map(|p| p.training_using_adam());
        assert_eq!(adam, r.training_using_adam_bytes, "{what}");
        let printed = adam.map_or("N/A".to_string(), accelerate::as_printed);
        assert_eq!(printed, r.as_printed, "{what}");
    }
    // The end-to-end run on a GPT-2-small-shaped model: its phases, and the "Training using
    // Adam" cells of the table it printed.
    for (dtype, _, _, stages) in &group.local_model_run.gather_data_rows {
        let phases = accelerate::training_usage(497_759_232, *dtype);
        assert_eq!(phases, phases_of(stages), "{dtype:?}");
        if let Some(p) = phases {
            let cell = accelerate::as_printed(p.training_using_adam());
            assert!(
                group
                    .local_model_run
                    .estimate_command_stdout
                    .contains(&cell),
                "{cell} is not in the printed table"
            );
        }
    }
}

fn compare(json: &str) -> Comparison {
    let spec = JobSpec::parse(json, Purpose::Estimate).unwrap().spec;
    let n = spec.world_size.get() as usize;
    let inventory = Inventory::uniform(n, 80 << 30, DeviceKind::Cuda);
    Report::new(&spec, Vec::new(), &inventory, DeviceKind::Cuda)
        .unwrap()
        .with_comparison(&spec)
        .compare
        .unwrap()
}

fn stage(c: &Comparison, s: u8) -> scheduler::compare::StageFigures {
    c.stages[usize::from(s)]
}

#[test]
fn the_differences_are_the_terms_the_reasons_name() {
    // A bare parameter count: zerotrain's model states are the paper's, exactly.
    let psi = 7_500_000_000u64;
    let n = 64u64;
    let c = compare(&format!(
        r#"{{"model": {{"params": {psi}}}, "precision": {{"dtype": "bf16"}}, "world_size": {n}}}"#
    ));
    let s2 = stage(&c, 2);
    assert_eq!(
        s2.deepspeed_bytes.unwrap() - s2.zerotrain_model_states_bytes,
        4 * psi / n,
        "ZeRO-2: an fp32 gradient shard"
    );
    let s3 = stage(&c, 3);
    assert_eq!(c.largest_layer_params, None);
    assert_eq!(
        s3.deepspeed_bytes.unwrap() - s3.zerotrain_model_states_bytes,
        2 * psi / n,
        "ZeRO-3 with L unknown: 18Ψ/N against 16Ψ/N"
    );
    let s0 = stage(&c, 0);
    assert_eq!(s0.zerotrain_model_states_bytes, 16 * psi);
    assert_eq!(s0.accelerate_bytes, Some(8 * psi), "max of phases, halved");
    assert!(s0.deepspeed_bytes.is_none() && s2.accelerate_bytes.is_none());
    let text = c.reasons.join("\n");
    for needle in [
        "2Ψ + 18Ψ/N",
        "2Ψ + 14Ψ/N",
        "4L + 18Ψ/N",
        "16Ψ/N",
        "not their sum",
        "L is unknown",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from\n{text}");
    }
    assert!(
        !text.contains("activations"),
        "a bare count has none:\n{text}"
    );
}

#[test]
fn a_gpt_comparison_names_the_largest_layer_activations_and_what_else_differs() {
    let c = compare(
        r#"{"model": {"preset": "gpt2-124M"}, "optimizer": {"type": "sgd"}, "world_size": 8}"#,
    );
    assert_eq!(c.largest_layer_params, Some(50257 * 768));
    let s3 = stage(&c, 3);
    // 4L + int(18Ψ/N), Ψ = 124,439,808.
    assert_eq!(
        s3.deepspeed_bytes,
        Some(4 * 50257 * 768 + 18 * 124_439_808 / 8)
    );
    assert_eq!(
        stage(&c, 0).accelerate_bytes,
        Some(16 * 124_439_808),
        "fp32: 16Ψ"
    );
    let text = c.reasons.join("\n");
    for needle in [
        "the token embedding",
        "activations",
        "trains in fp32",
        "sgd keeps 0",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from\n{text}");
    }
}
