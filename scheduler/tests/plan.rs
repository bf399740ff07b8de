//! The planner over a range of inventories: its choices and its explanations.

use scheduler::Error;
use scheduler::inventory::{DeviceSlot, Inventory, Node};
use scheduler::memory::{CUDA_OVERHEAD_BYTES, DeviceKind};
use scheduler::plan::{NoFit, Plan, plan};
use scheduler::spec::{JobSpec, Purpose, ZeroStage};

const GB: u64 = 1_000_000_000;

/// A CPU process's overhead, which a CPU rank's need includes.
fn cpu_overhead() -> u64 {
    DeviceKind::Cpu.overhead_bytes()
}

fn spec(json: &str) -> JobSpec {
    JobSpec::parse(json, Purpose::Estimate).unwrap().spec
}

fn fits(json: &str, inv: &Inventory) -> Plan {
    plan(&spec(json), inv).unwrap_or_else(|e| panic!("expected a plan: {e}"))
}

fn refused(json: &str, inv: &Inventory) -> NoFit {
    match plan(&spec(json), inv) {
        Err(Error::DoesNotFit(no)) => *no,
        other => panic!("expected DoesNotFit, got {other:?}"),
    }
}

fn cpus(count: usize, bytes: u64) -> Inventory {
    Inventory::uniform(count, bytes, DeviceKind::Cpu)
}

/// 7.5B parameters, mixed-precision Adam: the ZeRO paper's running example.
fn paper(stage: &str) -> String {
    format!(
        r#"{{"model": {{"params": 7.5e9}}, "precision": {{"dtype": "fp16"}}, "world_size": 4,
            "zero": {{"stage": {stage}}}}}"#
    )
}

#[test]
fn explains_in_numbers_when_a_fixed_stage_does_not_fit() {
    let no = refused(&paper("2"), &cpus(4, 40 * GB));
    assert_eq!(
        no.to_string(),
        "needs 41.3 GB per rank at stage 2 on 4 devices; largest device has 40.0 GB; \
         stage 3 needs 30.1 GB (fits)"
    );
    assert_eq!(no.closest_need_bytes, 41_250_000_000 + cpu_overhead());
}

#[test]
fn auto_stage_escalates_to_the_lowest_stage_that_fits() {
    let p = fits(&paper("\"auto\""), &cpus(4, 40 * GB));
    assert_eq!(p.chosen.zero_stage, ZeroStage::Parameters);
    assert_eq!(p.per_rank_bytes.model_states(), 30 * GB);
    assert_eq!(p.per_rank_bytes.overhead, cpu_overhead());
    let p = fits(&paper("\"auto\""), &cpus(4, 45 * GB));
    assert_eq!(p.chosen.zero_stage, ZeroStage::Gradients);
    let p = fits(&paper("\"auto\""), &cpus(4, 121 * GB));
    assert_eq!(p.chosen.zero_stage, ZeroStage::Ddp);
}

#[test]
fn a_single_rank_prefers_stage_0_because_sharding_one_rank_only_adds_buffers() {
    let p = fits(
        r#"{"model": {"preset": "gpt2-124M"}, "precision": {"dtype": "bf16"}}"#,
        &cpus(1, 80 * GB),
    );
    assert_eq!(p.chosen.zero_stage, ZeroStage::Ddp);
    assert!(!p.chosen.activation_checkpointing);
    assert_eq!(
        (p.chosen.micro_batch_size, p.chosen.grad_accum_steps),
        (4, 1)
    );
    assert_eq!(p.comm_bytes_per_step, 0);
}

#[test]
fn turns_on_activation_checkpointing_only_after_every_stage_failed() {
    let json = r#"{"model": {"preset": "gpt2-124M"}, "training": {"micro_batch_size": 32, "seq_len": 1024},
                   "precision": {"dtype": "bf16"}}"#;
    let s = spec(json);
    // Find a budget between the checkpointed and the full-activation need at stage 0.
    let full = fits(json, &cpus(1, 1000 * GB)).per_rank_bytes.total();
    let p = fits(json, &cpus(1, full - 1));
    assert!(p.chosen.activation_checkpointing);
    assert_eq!(p.chosen.zero_stage, ZeroStage::Ddp);
    assert_eq!(p.chosen.micro_batch_size, 32);
    assert!(p.per_rank_bytes.total() < full);
    assert_eq!(s.training.micro_batch_size.fixed().unwrap().get(), 32);
}

#[test]
fn shrinks_the_micro_batch_last_and_keeps_the_batch() {
    let json = r#"{"model": {"preset": "gpt2-124M"}, "training": {"micro_batch_size": "auto",
                   "batch_size": 64, "seq_len": 1024}, "activation_checkpointing": false,
                   "zero": {"stage": 0}, "world_size": 2}"#;
    let at = |m: u32| {
        let fixed = json
            .replace("\"auto\"", &m.to_string())
            .replace("\"batch_size\": 64,", "\"grad_accum_steps\": 32,");
        fits(
            &fixed.replace(
                "\"grad_accum_steps\": 32",
                &format!("\"grad_accum_steps\": {}", 32 / m),
            ),
            &cpus(2, 1000 * GB),
        )
        .per_rank_bytes
        .total()
    };
    // A budget that holds micro-batch 8 but not 16.
    let budget = at(8);
    assert!(at(16) > budget);
    let p = fits(json, &cpus(2, budget));
    assert_eq!(
        (p.chosen.micro_batch_size, p.chosen.grad_accum_steps),
        (8, 4)
    );
    assert_eq!(
        p.chosen.micro_batch_size * p.chosen.grad_accum_steps * 2,
        64
    );
}

#[test]
fn counts_devices_and_explains_when_too_few_are_large_enough() {
    let inv = Inventory {
        nodes: vec![
            Node {
                name: "big".into(),
                devices: vec![
                    DeviceSlot {
                        kind: DeviceKind::Cpu,
                        memory_bytes: 80 * GB
                    };
                    2
                ],
            },
            Node {
                name: "small".into(),
                devices: vec![
                    DeviceSlot {
                        kind: DeviceKind::Cpu,
                        memory_bytes: 16 * GB
                    };
                    2
                ],
            },
        ],
    };
    let no = refused(&paper("3"), &inv);
    assert_eq!(no.fitting_devices, 2);
    assert_eq!(
        no.to_string(),
        "needs 30.1 GB per rank at stage 3 on 4 devices; only 2 devices have that much"
    );
}

#[test]
fn refuses_more_ranks_than_devices() {
    let no = refused(
        &paper("\"auto\"").replace("\"world_size\": 4", "\"world_size\": 8"),
        &cpus(4, 1000 * GB),
    );
    assert_eq!(no.fitting_devices, 4);
    assert!(
        no.to_string()
            .contains("on 8 devices; only 4 devices have that much"),
        "{no}"
    );
}

#[test]
fn cuda_devices_pay_their_runtime_overhead() {
    let json = &paper("3");
    let exactly = 30 * GB;
    let p = fits(json, &cpus(4, exactly + cpu_overhead()));
    assert_eq!(p.per_rank_bytes.overhead, cpu_overhead());
    let gpus = Inventory::uniform(4, exactly, DeviceKind::Cuda);
    let no = refused(json, &gpus);
    assert_eq!(no.closest_need_bytes, exactly + CUDA_OVERHEAD_BYTES);
    let gpus = Inventory::uniform(4, exactly + CUDA_OVERHEAD_BYTES, DeviceKind::Cuda);
    assert_eq!(
        fits(json, &gpus).per_rank_bytes.overhead,
        CUDA_OVERHEAD_BYTES
    );
}

/// A GPU's attention launch takes at most 65,535 sequences × heads: a fixed micro-batch past it
/// is refused at its field, an automatic one is held under it; CPU devices have no such bound.
#[test]
fn a_micro_batch_past_the_gpu_attention_grid_is_refused_on_gpus_only() {
    let json = |training: &str| {
        format!(
            r#"{{"model": {{"preset": "gpt2-tiny"}}, "training": {{"seq_len": 8, {training}}}}}"#
        )
    };
    let fixed = |m: u32| json(&format!(r#""micro_batch_size": {m}"#));
    let gpus = Inventory::uniform(1, 1 << 50, DeviceKind::Cuda);
    // gpt2-tiny has 4 heads: 16,383 sequences is the most, 16,384 one too many.
    assert_eq!(fits(&fixed(16383), &gpus).chosen.micro_batch_size, 16383);
    match plan(&spec(&fixed(16384)), &gpus) {
        Err(Error::InvalidSpec(errors)) => {
            assert_eq!(errors[0].field, "training.micro_batch_size");
            assert!(
                errors[0].reason.contains("at most 16383 sequences"),
                "{}",
                errors[0].reason
            );
        }
        other => panic!("expected a refusal at training.micro_batch_size, got {other:?}"),
    }
    assert_eq!(
        fits(&fixed(16384), &cpus(1, 1 << 50))
            .chosen
            .micro_batch_size,
        16384
    );
    // "auto" picks the largest micro-batch dividing the batch that the grid takes: 10,000.
    let auto = json(r#""micro_batch_size": "auto", "batch_size": 20000"#);
    assert_eq!(fits(&auto, &gpus).chosen.micro_batch_size, 10000);
}

/// Two 30 GB GPUs beside four CPU devices of 30 GB and a CPU process's overhead.
fn gpus_beside_cpus() -> Inventory {
    let devices = |kind, memory_bytes, n| vec![DeviceSlot { kind, memory_bytes }; n];
    Inventory {
        nodes: vec![
            Node {
                name: "gpu".into(),
                devices: devices(DeviceKind::Cuda, 30 * GB, 2),
            },
            Node {
                name: "cpu".into(),
                devices: devices(DeviceKind::Cpu, 30 * GB + cpu_overhead(), 4),
            },
        ],
    }
}

fn with_device(json: &str, device: &str) -> String {
    json.replacen('{', &format!(r#"{{"device": {device}, "#), 1)
}

#[test]
fn auto_runs_on_the_gpus_when_any_are_registered_and_counts_only_them() {
    let inv = gpus_beside_cpus();
    let no = refused(&paper("3"), &inv);
    assert_eq!(
        no.fitting_devices, 0,
        "the GPUs lose 1 GiB to the CUDA runtime"
    );
    assert_eq!(no.largest_device_bytes, 30 * GB, "the largest GPU");
    assert_eq!(no.closest_need_bytes, 30 * GB + CUDA_OVERHEAD_BYTES);
    let two = paper("3").replace("\"world_size\": 4", "\"world_size\": 2");
    let bigger = Inventory::uniform(2, 80 * GB, DeviceKind::Cuda);
    let mut inv = inv;
    inv.nodes[0] = bigger.nodes[0].clone();
    let p = fits(&two, &inv);
    assert_eq!(p.device, DeviceKind::Cuda);
    assert_eq!(p.devices_that_fit, 2, "the CPU devices are not counted");
    assert_eq!(p.per_rank_bytes.overhead, CUDA_OVERHEAD_BYTES);
}

#[test]
fn auto_runs_on_cpu_devices_when_no_gpu_is_registered() {
    let p = fits(&paper("3"), &cpus(4, 30 * GB + cpu_overhead()));
    assert_eq!(p.device, DeviceKind::Cpu);
    assert_eq!(p.per_rank_bytes.overhead, cpu_overhead());
}

#[test]
fn a_job_asking_for_cpu_devices_is_planned_on_them_beside_gpus() {
    let p = fits(&with_device(&paper("3"), "\"cpu\""), &gpus_beside_cpus());
    assert_eq!(p.device, DeviceKind::Cpu);
    assert_eq!(p.devices_that_fit, 4);
    assert_eq!(p.per_rank_bytes.overhead, cpu_overhead());
}

#[test]
fn a_kind_the_spec_names_and_the_cluster_lacks_is_refused_as_such() {
    let json = with_device(&paper("3"), "\"cuda\"");
    assert_eq!(
        plan(&spec(&json), &cpus(4, 1000 * GB)),
        Err(Error::NoDevicesOfKind(DeviceKind::Cuda))
    );
    assert_eq!(
        Error::NoDevicesOfKind(DeviceKind::Cuda).to_string(),
        "no cuda devices are registered"
    );
    let json = with_device(&paper("3"), "\"cpu\"");
    let gpus = Inventory::uniform(4, 1000 * GB, DeviceKind::Cuda);
    assert_eq!(
        plan(&spec(&json), &gpus),
        Err(Error::NoDevicesOfKind(DeviceKind::Cpu))
    );
    // With nothing registered at all, `auto` is a CPU job that does not fit, as before.
    assert!(matches!(
        plan(&spec(&paper("3")), &Inventory::default()),
        Err(Error::DoesNotFit(_))
    ));
}

#[test]
fn plans_read_before_device_kinds_were_recorded_are_cpu_plans() {
    let p = fits(&paper("3"), &cpus(4, 1000 * GB));
    let mut old = serde_json::to_value(&p).unwrap();
    assert_eq!(old["device"], "cpu");
    old.as_object_mut().unwrap().remove("device");
    let read: Plan = serde_json::from_value(old).unwrap();
    assert_eq!(read, p);
}

#[test]
fn names_the_smallest_configuration_when_nothing_fits() {
    let json = r#"{"model": {"preset": "gpt2-124M"}, "training": {"micro_batch_size": 4}, "zero": {"stage": 0},
                   "activation_checkpointing": false}"#;
    let no = refused(json, &cpus(1, GB));
    let (alt, need, fits) = no.alternative.unwrap();
    let alt = alt.chosen;
    assert!(!fits);
    assert_eq!(
        alt.zero_stage,
        ZeroStage::Ddp,
        "one rank: sharding only adds buffers"
    );
    assert!(alt.activation_checkpointing);
    assert_eq!(alt.micro_batch_size, 1);
    assert!(need > GB);
    assert!(no.to_string().contains("the smallest configuration, stage 0 with activation checkpointing at micro-batch 1 × 4 accumulation steps, needs"), "{no}");
}

#[test]
fn fully_automatic_specs_have_no_alternative_to_offer() {
    let no = refused(
        r#"{"model": {"preset": "gpt2-1558M"}, "training": {"micro_batch_size": "auto"}}"#,
        &cpus(1, GB),
    );
    assert!(no.alternative.is_none());
    assert!(no.to_string().starts_with("needs "), "{no}");
    assert!(no.to_string().contains(" on 1 device; "), "{no}");
    assert!(
        no.to_string().ends_with("largest device has 1.0 GB"),
        "{no}"
    );
}

#[test]
fn an_empty_inventory_fits_nothing() {
    let no = refused(&paper("\"auto\""), &Inventory::default());
    assert_eq!(no.largest_device_bytes, 0);
    assert!(no.to_string().contains("largest device has 0 B"), "{no}");
}

#[test]
fn a_plan_reads_back_from_its_json_with_the_fields_the_api_shows() {
    let p = fits(&paper("\"auto\""), &cpus(4, 40 * GB));
    let json = serde_json::to_value(&p).unwrap();
    let keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "activation_checkpointing",
            "comm_bytes_per_step",
            "device",
            "devices_that_fit",
            "grad_accum_steps",
            "micro_batch_size",
            "per_rank_bytes",
            "zero_stage"
        ]
    );
    assert_eq!(json["zero_stage"], 3);
    assert_eq!(
        json["per_rank_bytes"]["total"],
        p.per_rank_bytes.total(),
        "the total is written, and ignored when read"
    );
    assert_eq!(serde_json::from_value::<Plan>(json).unwrap(), p);
}

#[test]
fn adafactor_ranks_get_their_own_bytes_and_a_setup_matches_only_its_own() {
    let json = r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 4, "zero": {"stage": 1},
                   "optimizer": {"type": "adafactor"}}"#;
    let spec = spec(json);
    let p = fits(json, &cpus(4, 8 * GB));
    assert_eq!(p.bytes_by_rank.len(), 4);
    let optimizer: Vec<u64> = p.bytes_by_rank.iter().map(|b| b.optimizer).collect();
    assert!(
        optimizer.iter().any(|&b| b != optimizer[0]),
        "{optimizer:?}"
    );
    assert_eq!(
        optimizer.iter().max(),
        Some(&p.per_rank_bytes.optimizer),
        "per_rank_bytes is the largest rank's"
    );
    let setup = p.chosen.setup(&spec);
    for rank in 0..4 {
        assert_eq!(
            p.differs(&setup, rank, DeviceKind::Cpu),
            None,
            "rank {rank}"
        );
    }
    let other = Plan {
        bytes_by_rank: Vec::new(),
        ..p.clone()
    };
    let smallest = (0..4).min_by_key(|&r| optimizer[r]).unwrap();
    assert_eq!(
        other.differs(&setup, smallest, DeviceKind::Cpu),
        Some((
            scheduler::memory::Category::Optimizer,
            p.per_rank_bytes.optimizer,
            optimizer[smallest]
        ))
    );
    let roundtrip: Plan = serde_json::from_value(serde_json::to_value(&p).unwrap()).unwrap();
    assert_eq!(roundtrip, p);
}

#[test]
fn the_overhead_is_not_compared_with_a_setup() {
    let json = r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 2}"#;
    let p = fits(json, &cpus(2, 8 * GB));
    assert!(p.bytes_by_rank.is_empty());
    assert_eq!(p.rank_bytes(1), p.per_rank_bytes);
    assert!(p.per_rank_bytes.overhead > 0);
    assert_eq!(
        p.differs(&p.chosen.setup(&spec(json)), 1, DeviceKind::Cpu),
        None
    );
    let wider = Plan {
        per_rank_bytes: scheduler::memory::Breakdown {
            activations: p.per_rank_bytes.activations + 1,
            ..p.per_rank_bytes
        },
        ..p.clone()
    };
    assert!(matches!(
        wider.differs(&p.chosen.setup(&spec(json)), 0, DeviceKind::Cpu),
        Some((scheduler::memory::Category::Activations, _, _))
    ));
}
