//! LoRA and QLoRA jobs: the `lora` block read with PEFT's meanings and every mistake named at
//! its field, PEFT's trainable-parameter counts, and the memory model of a frozen base with
//! trained adapters (NF4 bytes as bitsandbytes stores them) per ZeRO stage.

use scheduler::inventory::Inventory;
use scheduler::kernel_figures::nf4_bytes;
use scheduler::memory::{self, DeviceKind, Setup};
use scheduler::model::{BaseStorage, ModelShape};
use scheduler::report::{PlanOutcome, Report};
use scheduler::spec::{JobSpec, Purpose, ZeroStage};
use scheduler::{Error, FieldError};
use serde_json::{Value, json};

const SEVEN: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

fn spec(v: Value) -> JobSpec {
    JobSpec::parse(&v.to_string(), Purpose::Estimate)
        .unwrap_or_else(|e| panic!("{v}: {e}"))
        .spec
}

fn refusal(v: Value, purpose: Purpose) -> Vec<FieldError> {
    match JobSpec::parse(&v.to_string(), purpose) {
        Err(Error::InvalidSpec(errors)) => errors,
        other => panic!("{v} was not refused: {other:?}"),
    }
}

fn llama_8b(lora: Value) -> JobSpec {
    spec(json!({
        "model": {"preset": "llama-3.1-8B"},
        "precision": {"dtype": "bf16"},
        "training": {"micro_batch_size": 1, "seq_len": 2048},
        "activation_checkpointing": true,
        "device": "cuda",
        "lora": lora,
    }))
}

fn report(spec: &JobSpec, gpu_bytes: u64) -> Report {
    let gpu = Inventory::uniform(1, gpu_bytes, DeviceKind::Cuda);
    Report::new(spec, Vec::new(), &gpu, DeviceKind::Cuda).unwrap()
}

#[test]
fn llama_3_1_8b_with_rank_16_on_seven_projections_trains_41_943_040_and_fits_24_gb() {
    let spec = llama_8b(json!({"rank": 16, "alpha": 32, "target_modules": SEVEN}));
    let r = report(&spec, 24_000_000_000);
    assert_eq!(r.trainable_parameters, 41_943_040);
    assert_eq!(r.parameters, 8_030_261_248 + 41_943_040);
    let PlanOutcome::Fits { plan, .. } = &r.plan else {
        panic!("does not fit one 24 GB GPU: {:?}", r.plan);
    };
    assert_eq!(plan.chosen.zero_stage, ZeroStage::Ddp);
    // Full fine-tuning of the same job does not fit: 16 bytes a parameter.
    let full = report(&llama_8b(Value::Null), 24_000_000_000);
    assert!(matches!(full.plan, PlanOutcome::DoesNotFit { .. }));
    assert_eq!(full.trainable_parameters, 8_030_261_248);
    // "all-linear" is the same seven for the Llama family.
    let all = llama_8b(json!({"rank": 16, "target_modules": "all-linear"}));
    assert_eq!(report_params(&all), 41_943_040);
}

fn report_params(spec: &JobSpec) -> u64 {
    report(spec, 1 << 50).trainable_parameters
}

#[test]
fn trainable_counts_are_peft_print_trainable_parameters() {
    // PEFT 0.x, `get_peft_model(GPT2LMHeadModel, LoraConfig())` (r 8, c_attn):
    // "trainable params: 294,912 || all params: 124,734,720".
    let gpt2 = spec(json!({"model": {"preset": "gpt2-124M"}, "lora": {}}));
    let r = report(&gpt2, 1 << 40);
    assert_eq!(
        (r.trainable_parameters, r.parameters),
        (294_912, 124_734_720)
    );
    // `c_proj` is both of GPT-2's (attention and MLP), `mlp.c_proj` one: 12·8·(768 + 768) and
    // 12·8·(3072 + 768) beside them.
    let both =
        spec(json!({"model": {"preset": "gpt2-124M"}, "lora": {"target_modules": ["c_proj"]}}));
    let mlp =
        spec(json!({"model": {"preset": "gpt2-124M"}, "lora": {"target_modules": ["mlp.c_proj"]}}));
    assert_eq!(report_params(&mlp), 12 * 8 * (3072 + 768));
    assert_eq!(
        report_params(&both),
        12 * 8 * (768 + 768) + 12 * 8 * (3072 + 768)
    );
    // Llama's default is q_proj and v_proj: 32 layers of 8·(4096 + 4096) + 8·(4096 + 1024).
    let llama = llama_8b(json!({}));
    assert_eq!(
        report_params(&llama),
        32 * 8 * ((4096 + 4096) + (4096 + 1024))
    );
}

fn reference(path: &str) -> Value {
    let path = format!("{}/../tests/reference/{path}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

#[test]
fn every_peft_count_of_the_reference_models_is_reproduced() {
    // `tests/reference/peft/make_counts.py`: PEFT's own counts for LoraConfigs on the
    // reference configs; `r`, `lora_alpha` and `target_modules` are the spec's `rank`,
    // `alpha` and `target_modules`.
    let counts = reference("peft/counts.json");
    let rows = counts["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 10);
    for row in rows {
        let given = &row["lora"];
        let mut lora = json!({});
        for (peft, ours) in [
            ("r", "rank"),
            ("lora_alpha", "alpha"),
            ("target_modules", "target_modules"),
        ] {
            if let Some(v) = given.get(peft) {
                lora[ours] = v.clone();
            }
        }
        let config = reference(&format!("hf_configs/{}", row["config"].as_str().unwrap()));
        let r = report(
            &spec(json!({"model": {"config": config}, "lora": lora})),
            1 << 50,
        );
        let want = (
            row["trainable"].as_u64().unwrap(),
            row["all"].as_u64().unwrap(),
        );
        assert_eq!((r.trainable_parameters, r.parameters), want, "{row}");
    }
}

#[test]
fn the_lora_parity_models_count_as_peft_counted_them() {
    // `tests/reference/lora_parity`: tiny Llama, Qwen3 and GPT-2 with r 4 on every linear
    // projection, counted by PEFT while it trained them.
    for (name, config) in [
        ("llama", "llama_parity/llama/config.json"),
        ("qwen3", "llama_parity/qwen3/config.json"),
        ("gpt2", "lora_parity/gpt2/config.json"),
    ] {
        let expected = reference(&format!("lora_parity/{name}/expected.json"));
        let given = spec(json!({"model": {"config": reference(config)}, "lora": expected["lora"]}));
        let r = report(&given, 1 << 40);
        let want = (
            expected["trainable_parameters"].as_u64().unwrap(),
            expected["all_parameters"].as_u64().unwrap(),
        );
        assert_eq!((r.trainable_parameters, r.parameters), want, "{name}");
        // The same adapters as PEFT saved their config: "all-linear" expanded to every
        // layer's module by its full name.
        let saved = reference(&format!("lora_parity/{name}/adapter/adapter_config.json"));
        let modules = saved["target_modules"].clone();
        let lora =
            json!({"rank": saved["r"], "alpha": saved["lora_alpha"], "target_modules": modules});
        let spec = spec(json!({"model": {"config": reference(config)}, "lora": lora}));
        assert_eq!(
            report(&spec, 1 << 40).trainable_parameters,
            want.0,
            "{name} as saved"
        );
    }
}

/// The (name, shape) of every tensor in a safetensors file, from its JSON header.
fn safetensors_tensors(path: &str) -> Vec<(String, Vec<u64>)> {
    let path = format!("{}/../tests/reference/{path}", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(&path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let mut tensors: Vec<_> = header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, t)| {
            let shape = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap());
            (name, shape.collect())
        })
        .collect();
    tensors.sort();
    tensors
}

#[test]
fn the_adapter_layout_is_the_tensors_peft_saves_by_name_and_shape() {
    for (name, config) in [
        ("llama", "llama_parity/llama/config.json"),
        ("qwen3", "llama_parity/qwen3/config.json"),
        ("gpt2", "lora_parity/gpt2/config.json"),
    ] {
        let lora = reference(&format!("lora_parity/{name}/expected.json"))["lora"].clone();
        let spec = spec(json!({"model": {"config": reference(config)}, "lora": lora}));
        let model = spec.architecture().model().unwrap();
        let layout = spec
            .lora
            .as_ref()
            .unwrap()
            .adapters(&model)
            .layout(&model, 1);
        let mut ours: Vec<(String, Vec<u64>)> = layout
            .adapters
            .iter()
            .flat_map(|unit| {
                let layer = unit.layer().unwrap();
                unit.tensors.iter().map(move |t| {
                    let dims = t.dims.to_vec().into_iter().map(|d| d as u64).collect();
                    (t.kind.peft_name(layer), dims)
                })
            })
            .collect();
        ours.sort();
        let peft = safetensors_tensors(&format!(
            "lora_parity/{name}/adapter/adapter_model.safetensors"
        ));
        assert_eq!(ours, peft, "{name}");
    }
}

#[test]
fn a_module_named_for_some_layers_only_is_refused_naming_them() {
    let errors = refusal(
        json!({
            "model": {"preset": "llama-tiny"},
            "lora": {"target_modules": ["v_proj", "model.layers.1.self_attn.q_proj"]},
        }),
        Purpose::Estimate,
    );
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].field, "lora.target_modules");
    assert!(
        errors[0]
            .reason
            .contains("self_attn.q_proj in layers [1] only"),
        "{}",
        errors[0].reason
    );
}

#[test]
fn mistakes_in_the_lora_block_are_named_at_their_fields_together() {
    let errors = refusal(
        json!({
            "model": {"preset": "llama-tiny"},
            "training": {"seq_len": 0},
            "lora": {"rank": 0, "dropout": 1.0, "target_modules": ["q_proj", "c_attn"], "quantize_base": "fp4"},
        }),
        Purpose::Estimate,
    );
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "lora.quantize_base",
            "training.seq_len",
            "lora.rank",
            "lora.dropout",
            "lora.target_modules[1]",
        ],
        "{errors:?}"
    );
    let modules = &errors[4].reason;
    assert!(
        modules.contains("\"c_attn\"")
            && modules.contains("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
        "{modules}"
    );
    assert!(errors[0].reason.contains("nf4"), "{}", errors[0].reason);

    let bare = refusal(
        json!({"model": {"params": 7e9}, "lora": {}}),
        Purpose::Estimate,
    );
    assert_eq!(bare[0].field, "lora");
    let shapes = refusal(
        json!({"model": {"preset": "llama-tiny"}, "lora": {"target_modules": "q_proj"}}),
        Purpose::Estimate,
    );
    assert_eq!(shapes[0].field, "lora.target_modules");
    let wrong = refusal(
        json!({"model": {"preset": "llama-tiny"}, "lora": {"target_modules": ["q_proj", 3]}}),
        Purpose::Estimate,
    );
    assert_eq!(wrong[0].field, "lora.target_modules[1]", "{wrong:?}");
    let none = refusal(
        json!({"model": {"preset": "llama-tiny"}, "lora": {"target_modules": []}}),
        Purpose::Estimate,
    );
    assert_eq!(none[0].field, "lora.target_modules");
    let dropout = refusal(
        json!({"model": {"preset": "llama-tiny"}, "lora": {"dropout": 1.0}}),
        Purpose::Train,
    );
    assert_eq!(dropout[0].field, "lora.dropout", "{dropout:?}");
    // Plain adapters, dropout and an NF4 base (QLoRA) are all trained.
    let every = json!({"dropout": 0.1, "quantize_base": "nf4"});
    for lora in [json!({}), every] {
        let spec = json!({"model": {"preset": "llama-tiny"}, "lora": lora});
        JobSpec::parse(&spec.to_string(), Purpose::Train).unwrap();
    }
}

fn setup(spec: &JobSpec, stage: ZeroStage, world: usize) -> Setup {
    Setup {
        world_size: world,
        ..Setup::new(spec, stage, false, 1, 1)
    }
}

#[test]
fn the_frozen_base_holds_weights_only_and_stage_3_alone_shards_it() {
    let lora = llama_8b(json!({"rank": 16, "target_modules": SEVEN}));
    let full = llama_8b(Value::Null);
    let adapters = 41_943_040u64;
    let base = 8_030_261_248u64;
    // bf16: the base and the adapters held in bf16 (no padding: every unit is a multiple of
    // 16 elements), gradients of the adapters only, fp32 master and AdamW's m and v of the
    // adapters only.
    let one = memory::rank_breakdown(&setup(&lora, ZeroStage::Ddp, 1), 0);
    assert_eq!(one.params, 2 * (base + adapters));
    assert_eq!(one.grads, 2 * adapters);
    assert_eq!(one.optimizer, (4 + 8) * adapters);
    // Stage 2 on 4 ranks shards the adapters' gradients and states, not the base.
    let two = memory::rank_breakdown(&setup(&lora, ZeroStage::Gradients, 4), 0);
    assert_eq!(two.params, one.params);
    assert_eq!(
        (two.grads, two.optimizer),
        (one.grads / 4, one.optimizer / 4)
    );
    // Stage 3 shards the base too.
    let three = memory::rank_breakdown(&setup(&lora, ZeroStage::Parameters, 4), 0);
    assert_eq!(three.params, one.params / 4);
    // The adapters' activations beside full fine-tuning's: each adapted projection's
    // rank-sized product per layer, and one rank-sized gradient scratch.
    let full_one = memory::rank_breakdown(&setup(&full, ZeroStage::Ddp, 1), 0);
    let tokens = 2048u64;
    assert_eq!(
        one.activations - full_one.activations,
        2 * (7 * 32 + 1) * tokens * 16
    );
}

#[test]
fn qlora_holds_the_adapted_weights_as_bitsandbytes_nf4() {
    let qlora = llama_8b(json!({"rank": 16, "target_modules": SEVEN, "quantize_base": "nf4"}));
    let b = memory::rank_breakdown(&setup(&qlora, ZeroStage::Ddp, 1), 0);
    // Per layer the seven weights hold 2·4096² + 2·1024·4096 + 3·14336·4096 values; NF4 keeps
    // half a byte each and an fp32 absmax per 64. The embeddings, LM head and norms stay bf16.
    let quantized = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096u64);
    assert_eq!(quantized, 6_979_321_856);
    let nf4 = quantized / 2 + 4 * quantized / 64;
    assert_eq!(nf4, 32 * nf4_bytes(218_103_808) as u64);
    let rest = 8_030_261_248 - quantized;
    assert_eq!(b.params, 2 * rest + nf4 + 2 * 41_943_040);
    // One projection, the widest, dequantized at a time: 14336·4096 bf16 values.
    let lora = llama_8b(json!({"rank": 16, "target_modules": SEVEN}));
    let plain = memory::rank_breakdown(&setup(&lora, ZeroStage::Ddp, 1), 0);
    assert_eq!(b.buffers - plain.buffers, 2 * 14336 * 4096);
    let Some(adapters) = setup(&qlora, ZeroStage::Ddp, 1).lora else {
        panic!("no adapters");
    };
    assert_eq!(adapters.base, BaseStorage::Nf4);
}

#[test]
fn stage_3_gathers_the_base_and_reduces_only_the_adapters() {
    let lora = spec(json!({
        "model": {"preset": "llama-tiny"},
        "world_size": 2,
        "lora": {"rank": 4, "target_modules": "all-linear"},
    }));
    let model: ModelShape = lora.architecture().model().unwrap();
    let layout = lora
        .lora
        .as_ref()
        .unwrap()
        .adapters(&model)
        .layout(&model, 2);
    let x = 4u64;
    let trained = x * layout.adapters.padded_len() as u64;
    let gathered = trained + x * layout.base.padded_len() as u64;
    let once = x * layout.base.gathered_once_padded_len() as u64;
    let comm = |stage| memory::estimate(&setup(&lora, stage, 2), DeviceKind::Cpu).comm;
    // Ring over 2 ranks: each sends half of a buffer per reduce-scatter or all-gather.
    let ddp = comm(ZeroStage::Ddp);
    let three = comm(ZeroStage::Parameters);
    let scalars = ddp.all_reduce - trained;
    assert_eq!(three.reduce_scatter, trained / 2);
    assert_eq!(three.all_gather, gathered - once / 2);
    assert_eq!(three.all_reduce, scalars);
}
