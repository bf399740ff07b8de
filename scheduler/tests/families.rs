//! Model families: Hugging Face `config.json`s read as transformers reads them (parameter counts
//! against transformers' own, in `tests/reference/hf_configs/parameters.json`), the Llama
//! presets, what `model.config` refuses and where, and
//! the memory model of the Llama family (model states, untied head, stage-3 gathers,
//! activations).

use scheduler::inventory::Inventory;
use scheduler::memory::{self, Breakdown, DeviceKind, Setup};
use scheduler::model::{
    GptShape, LlamaActivation, LlamaPreset, LlamaShape, LlamaTensor, ModelShape, Preset, UnitKind,
};
use scheduler::report::Report;
use scheduler::spec::{
    AdamW, Architecture, Dtype, HfConfig, JobSpec, Optimizer, Purpose, ZeroStage,
};
use scheduler::{Error, FieldError};
use serde_json::{Map, Value, json};

fn reference(file: &str) -> Value {
    let path = format!(
        "{}/../tests/reference/hf_configs/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

fn read(config: Value) -> Result<ModelShape, Error> {
    HfConfig::read(object(config)).map(|c| c.shape())
}

fn llama(config: Value) -> LlamaShape {
    match read(config).unwrap() {
        ModelShape::Llama(s) => s,
        other => panic!("not a Llama: {other:?}"),
    }
}

/// The fields of a refusal, in order.
fn fields(e: Error) -> Vec<String> {
    match e {
        Error::InvalidSpec(errors) => errors.into_iter().map(|f: FieldError| f.field).collect(),
        other => panic!("not a spec error: {other}"),
    }
}

fn refusal(spec: Value, purpose: Purpose) -> Vec<FieldError> {
    match JobSpec::parse(&spec.to_string(), purpose) {
        Err(Error::InvalidSpec(errors)) => errors,
        other => panic!("{spec} was not refused: {other:?}"),
    }
}

const PRESETS: [(LlamaPreset, &str); 7] = [
    (LlamaPreset::SmolLm2_135M, "smollm2-135M.json"),
    (LlamaPreset::Qwen25_05B, "qwen2.5-0.5B.json"),
    (LlamaPreset::Qwen3_06B, "qwen3-0.6B.json"),
    (LlamaPreset::TinyLlama11B, "tinyllama-1.1B.json"),
    (LlamaPreset::Llama32_1B, "llama-3.2-1B.json"),
    (LlamaPreset::Llama2_7B, "llama-2-7B.json"),
    (LlamaPreset::Llama31_8B, "llama-3.1-8B.json"),
];

#[test]
fn parameter_counts_equal_transformers_for_every_reference_config() {
    let counts = reference("parameters.json");
    let models = counts["models"].as_object().unwrap();
    assert_eq!(models.len(), 8);
    for (name, m) in models {
        let shape = read(reference(m["config"].as_str().unwrap())).unwrap();
        let expected = m["parameters"].as_u64().unwrap();
        assert_eq!(shape.parameter_count(), expected, "{name}");
        // The layout holds exactly those parameters, tensor by tensor.
        let units = shape.units(1);
        let tensors: usize = units
            .iter()
            .flat_map(|u| &u.tensors)
            .map(|t| t.dims.numel())
            .sum();
        assert_eq!(tensors as u64, expected, "{name}");
    }
}

#[test]
fn presets_are_the_published_configs() {
    for (preset, file) in PRESETS {
        assert_eq!(preset.shape(), llama(reference(file)), "{}", preset.name());
        let spec = json!({"model": {"preset": preset.name()}});
        let parsed = JobSpec::parse(&spec.to_string(), Purpose::Estimate).unwrap();
        assert_eq!(
            parsed.spec.architecture(),
            Architecture::Llama(preset.shape())
        );
    }
    let gpt2 = read(reference("gpt2.json")).unwrap();
    assert_eq!(gpt2, ModelShape::Gpt2(Preset::Gpt2Small.shape()));
}

#[test]
fn llama_tiny_is_test_sized_with_grouped_query_attention_and_an_untied_head() {
    let s = LlamaPreset::Tiny.shape();
    assert_eq!(s.vocab_size, Preset::Tiny.shape().vocab_size);
    assert_eq!(s.hidden_size, 64);
    assert!(s.num_key_value_heads < s.num_attention_heads);
    assert!(!s.tie_word_embeddings);
    // 512·64 embedding and head, 2 blocks of 46,208, a 64-wide final norm.
    assert_eq!(s.parameter_count(), 158_016);
    let units = s.units(1);
    let kinds: Vec<UnitKind> = units.iter().map(|u| u.kind).collect();
    assert_eq!(
        kinds,
        [
            UnitKind::Embeddings,
            UnitKind::Block(0),
            UnitKind::Block(1),
            UnitKind::FinalNorm,
            UnitKind::Head
        ]
    );
    let names: Vec<String> = units
        .iter()
        .flat_map(|u| u.tensors.iter().map(move |t| t.kind.hf_name(u.layer())))
        .filter(|n| !n.starts_with("model.layers.1."))
        .collect();
    assert_eq!(
        names,
        [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.norm.weight",
            "lm_head.weight",
        ]
    );
    // (out, in), as nn.Linear stores them; k/v by key/value heads.
    let block = &units.iter().nth(1).unwrap().tensors;
    let dims = |k: LlamaTensor| block.iter().find(|t| t.kind == k).unwrap().dims.to_vec();
    assert_eq!(dims(LlamaTensor::QProj), [64, 64]);
    assert_eq!(dims(LlamaTensor::KProj), [32, 64]);
    assert_eq!(dims(LlamaTensor::DownProj), [64, 176]);
    assert!(LlamaTensor::QProj.decayed(&s) && !LlamaTensor::InputNorm.decayed(&s));
}

#[test]
fn optional_tensors_follow_the_model_type() {
    let qwen2 = LlamaPreset::Qwen25_05B.shape();
    let names =
        |s: &LlamaShape| -> Vec<String> { s.block().iter().map(|t| t.hf_name(Some(0))).collect() };
    let q2 = names(&qwen2);
    assert!(q2.contains(&"model.layers.0.self_attn.q_proj.bias".into()));
    assert!(!q2.contains(&"model.layers.0.self_attn.o_proj.bias".into()));
    let q3 = names(&LlamaPreset::Qwen3_06B.shape());
    assert!(q3.contains(&"model.layers.0.self_attn.q_norm.weight".into()));
    assert!(q3.contains(&"model.layers.0.self_attn.k_norm.weight".into()));
    // Llama's attention_bias covers all four projections, mlp_bias the three MLP ones.
    let mut config = reference("tinyllama-1.1B.json");
    config["attention_bias"] = json!(true);
    config["mlp_bias"] = json!(true);
    let biased = llama(config);
    assert_eq!(biased.block().len(), 9 + 7);
    let base = LlamaPreset::TinyLlama11B.shape();
    let extra = 2 * 2048 + 2 * 256 + 2 * 5632 + 2048;
    assert_eq!(
        biased.parameter_count(),
        base.parameter_count() + 22 * extra as u64
    );
    // Mistral's projections have none, whatever attention_bias says.
    let mut config = reference("tinyllama-1.1B.json");
    config["model_type"] = json!("mistral");
    config["sliding_window"] = Value::Null;
    config["attention_bias"] = json!(true);
    let mistral = llama(config);
    assert_eq!(mistral.parameter_count(), base.parameter_count());
    assert_eq!(mistral.sliding_window, None);
}

#[test]
fn transformers_5_configs_read_as_transformers_4_ones() {
    // Qwen3-0.6B as transformers 5 writes it: rope_parameters, layer_types, dtype.
    let mut v5 = object(reference("qwen3-0.6B.json"));
    let theta = v5.remove("rope_theta").unwrap();
    v5.remove("rope_scaling");
    v5.remove("torch_dtype");
    v5.insert("dtype".into(), json!("bfloat16"));
    v5.insert(
        "rope_parameters".into(),
        json!({"rope_theta": theta, "rope_type": "default"}),
    );
    v5.insert("layer_types".into(), json!(vec!["full_attention"; 28]));
    v5.insert("transformers_version".into(), json!("5.0.0"));
    assert_eq!(llama(Value::Object(v5)), LlamaPreset::Qwen3_06B.shape());
    // Llama 3.1 likewise, llama3 scaling inside rope_parameters.
    let mut v5 = object(reference("llama-3.1-8B.json"));
    let mut rope = v5.remove("rope_scaling").unwrap();
    rope["rope_theta"] = v5.remove("rope_theta").unwrap();
    v5.insert("rope_parameters".into(), rope);
    assert_eq!(llama(Value::Object(v5)), LlamaPreset::Llama31_8B.shape());
    // Qwen3's head_dim defaults to 128 as Qwen3Config's does; Llama's to hidden/heads.
    let mut no_head_dim = reference("qwen3-0.6B.json");
    no_head_dim.as_object_mut().unwrap().remove("head_dim");
    assert_eq!(llama(no_head_dim).head_dim, 128);
    let mut no_kv = reference("llama-2-7B.json");
    no_kv.as_object_mut().unwrap().remove("num_key_value_heads");
    assert_eq!(llama(no_kv), LlamaPreset::Llama2_7B.shape());
}

#[test]
fn unsupported_values_are_refused_at_their_fields_all_at_once() {
    let mut config = reference("llama-3.1-8B.json");
    config["hidden_act"] = json!("gelu");
    config["pretraining_tp"] = json!(2);
    config["rope_scaling"]["rope_type"] = json!("yarn");
    config["num_key_value_heads"] = json!(0);
    let spec = json!({"model": {"config": config}, "training": {"lr": -1}});
    let errors = refusal(spec, Purpose::Estimate);
    let named: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        named,
        [
            "model.config.num_key_value_heads",
            "model.config.hidden_act",
            "model.config.pretraining_tp",
            "model.config.rope_scaling.rope_type",
            "training.lr",
        ]
    );
    assert!(
        errors[1].reason.contains("\"gelu\" is not supported"),
        "{}",
        errors[1]
    );
    assert!(errors[3].reason.contains("\"yarn\""), "{}", errors[3]);

    for (config, field) in [
        (json!({"model_type": "falcon"}), "model.config.model_type"),
        (json!({"hidden_size": 8}), "model.config.model_type"),
        (
            json!({"model_type": "gpt2", "vocab_size": 512, "n_layer": 2, "n_head": 4, "n_embd": 64, "activation_function": "relu"}),
            "model.config.activation_function",
        ),
        (
            json!({"model_type": "gpt2", "vocab_size": 512, "n_layer": 2, "n_head": 4, "n_embd": 64, "tie_word_embeddings": false}),
            "model.config.tie_word_embeddings",
        ),
    ] {
        assert_eq!(
            fields(read(config.clone()).unwrap_err())[0],
            field,
            "{config}"
        );
    }
    // Missing required fields are named, each of them.
    let missing = fields(read(json!({"model_type": "llama", "vocab_size": 512})).unwrap_err());
    assert_eq!(
        missing,
        [
            "model.config.hidden_size",
            "model.config.intermediate_size",
            "model.config.num_hidden_layers",
            "model.config.num_attention_heads",
            "model.config.max_position_embeddings",
        ]
    );
    // A config beside another form of model is refused as the model's mistake.
    let both = refusal(
        json!({"model": {"preset": "gpt2-tiny", "config": reference("gpt2.json")}}),
        Purpose::Estimate,
    );
    assert_eq!(both[0].field, "model");
}

#[test]
fn a_sliding_window_shorter_than_the_sequence_is_refused() {
    let mut mistral = reference("tinyllama-1.1B.json");
    mistral["model_type"] = json!("mistral");
    mistral["max_position_embeddings"] = json!(32768);
    // MistralConfig's default window is 4096.
    let spec = |config: &Value, seq_len: u32| json!({"model": {"config": config}, "training": {"seq_len": seq_len, "micro_batch_size": 1, "batch_size": 1}});
    assert!(JobSpec::parse(&spec(&mistral, 4096).to_string(), Purpose::Estimate).is_ok());
    let errors = refusal(spec(&mistral, 8192), Purpose::Estimate);
    assert_eq!(errors[0].field, "model.config.sliding_window");
    assert!(
        errors[0]
            .reason
            .contains("4096 is shorter than training.seq_len 8192")
    );
    mistral["sliding_window"] = Value::Null;
    assert!(JobSpec::parse(&spec(&mistral, 8192).to_string(), Purpose::Estimate).is_ok());
    // Qwen: only when use_sliding_window is on or a layer type slides.
    let mut qwen = reference("qwen2.5-0.5B.json");
    qwen["sliding_window"] = json!(1024);
    assert!(JobSpec::parse(&spec(&qwen, 2048).to_string(), Purpose::Estimate).is_ok());
    qwen["use_sliding_window"] = json!(true);
    let errors = refusal(spec(&qwen, 2048), Purpose::Estimate);
    assert_eq!(errors[0].field, "model.config.sliding_window");
    qwen["use_sliding_window"] = json!(false);
    qwen["layer_types"] = json!(["full_attention", "chunked_attention"]);
    let errors = refusal(spec(&qwen, 512), Purpose::Estimate);
    assert_eq!(errors[0].field, "model.config.layer_types");
}

#[test]
fn llama_family_specs_train_and_a_gpt2_config_trains_as_its_preset() {
    for model in [
        json!({"preset": "llama-tiny"}),
        json!({"config": reference("smollm2-135M.json")}),
    ] {
        let spec = json!({"model": model});
        assert!(JobSpec::parse(&spec.to_string(), Purpose::Train).is_ok());
    }
    // A GPT-2 config trains as the same shape given as a preset does.
    let spec = json!({"model": {"config": reference("gpt2.json")}});
    let parsed = JobSpec::parse(&spec.to_string(), Purpose::Train).unwrap();
    assert_eq!(
        parsed.spec.architecture().gpt(),
        Some(&Preset::Gpt2Small.shape())
    );
}

#[test]
fn a_config_travels_as_given() {
    let config = reference("qwen3-0.6B.json");
    let spec = json!({"model": {"config": config.clone(), "init_from": "/models/qwen3"}});
    let parsed = JobSpec::parse(&spec.to_string(), Purpose::Estimate).unwrap();
    let back = serde_json::to_value(&parsed.spec).unwrap();
    assert_eq!(back["model"]["config"], config);
    assert_eq!(back["model"]["init_from"], "/models/qwen3");
    let again: JobSpec = serde_json::from_value(back).unwrap();
    assert_eq!(again, parsed.spec);
    // Presets by name, both families.
    let preset = JobSpec::parse(
        r#"{"model": {"preset": "qwen2.5-0.5B"}}"#,
        Purpose::Estimate,
    )
    .unwrap()
    .spec;
    assert_eq!(
        serde_json::to_value(&preset).unwrap()["model"],
        json!({"preset": "qwen2.5-0.5B"})
    );
    let unknown = refusal(json!({"model": {"preset": "llama-9B"}}), Purpose::Estimate);
    assert_eq!(unknown[0].field, "model.preset");
    assert!(unknown[0].reason.contains("llama-3.1-8B"));
}

fn setup(shape: LlamaShape, dtype: Dtype, stage: ZeroStage, n: usize) -> Setup {
    Setup {
        arch: Architecture::Llama(shape),
        dtype,
        optimizer: Optimizer::Adamw(AdamW::default()),
        stage,
        world_size: n,
        micro_batch: 1,
        seq_len: 128,
        grad_accum: 1,
        checkpointing: false,
        reduces_norm: false,
        token_width: 0,
        validates: false,
        lora: None,
    }
}

fn per_rank(s: &Setup) -> Breakdown {
    memory::estimate(s, DeviceKind::Cuda).per_rank
}

#[test]
fn llama_2_7b_mixed_precision_adamw_holds_16_bytes_per_parameter_at_stage_0() {
    let shape = LlamaPreset::Llama2_7B.shape();
    assert_eq!(shape.parameter_count(), 6_738_415_616);
    for dtype in [Dtype::Fp16, Dtype::Bf16] {
        let b = per_rank(&setup(shape, dtype, ZeroStage::Ddp, 1));
        assert_eq!(b.model_states(), 16 * 6_738_415_616);
        assert_eq!((b.params, b.grads), (2 * 6_738_415_616, 2 * 6_738_415_616));
    }
}

#[test]
fn stage_3_gathers_the_largest_unit_which_is_the_embedding() {
    // Whether the token embedding (and the untied head, of its size) outweighs a block: Llama
    // 3's 128,256-token vocabulary and TinyLlama's thin blocks make it so; Llama 2's 7B blocks
    // (202M parameters) outweigh its 32,000-token embedding (131M), as the test-sized model's do.
    for (preset, embedding_largest) in [
        (LlamaPreset::Llama2_7B, false),
        (LlamaPreset::Llama31_8B, true),
        (LlamaPreset::TinyLlama11B, true),
        (LlamaPreset::Tiny, false),
    ] {
        let shape = preset.shape();
        let n = 8;
        let units = shape.units(n);
        let embed = units.embeddings().padded_len;
        let block = units.iter().nth(1).unwrap().padded_len;
        assert_eq!(embed > block, embedding_largest, "{}", preset.name());
        let largest = embed.max(block);
        assert_eq!(units.pinned_padded_len(), 0);
        assert_eq!(units.largest_streamed_padded_len(), largest);
        let b = |stage| per_rank(&setup(shape, Dtype::Bf16, stage, n)).buffers;
        // Stage 2 holds one whole unit's gradient, stage 3 that and two gathered units.
        let x = 2;
        assert_eq!(
            b(ZeroStage::Gradients) - b(ZeroStage::Optimizer),
            (x * largest) as u64
        );
        assert_eq!(
            b(ZeroStage::Parameters) - b(ZeroStage::Optimizer),
            (3 * x * largest) as u64
        );
    }
    // Tied, the embedding stays gathered and blocks stream, as for GPT-2.
    let tied = LlamaPreset::Llama32_1B.shape().units(8);
    assert_eq!(tied.pinned_padded_len(), tied.embeddings().padded_len);
    assert_eq!(
        tied.largest_streamed_padded_len(),
        tied.iter().nth(1).unwrap().padded_len
    );
    // GPT-2's figures are the ones it always had.
    let gpt = scheduler::model::Units::new(&Preset::Gpt2Small.shape(), 8);
    assert_eq!(gpt.pinned_padded_len(), gpt.embeddings().padded_len);
    assert_eq!(
        gpt.largest_streamed_padded_len(),
        gpt.largest_other_padded_len()
    );
}

#[test]
fn activations_are_the_listed_tensors_with_checkpointing_as_gpt2s() {
    let s = LlamaPreset::Qwen3_06B.shape();
    let (b, t) = (2, 64);
    let bytes = |a: LlamaActivation, x: u64| a.len(&s, b, t) as u64 * a.element().bytes(x);
    let full = scheduler::model::Activations::llama(&s, b, t, false, 2);
    let ckpt = scheduler::model::Activations::llama(&s, b, t, true, 2);
    let block: u64 = LlamaActivation::BLOCK.iter().map(|&a| bytes(a, 2)).sum();
    let res3 = bytes(LlamaActivation::Res3, 2);
    assert_eq!(
        full.activations - ckpt.activations,
        (s.num_hidden_layers as u64 - 1) * (block - res3)
    );
    assert_eq!(full.buffers, ckpt.buffers);
    // Queries by heads, keys and values by KV heads, the MLP at width I, RoPE tables of D/2.
    let tokens = b * t;
    assert_eq!(LlamaActivation::Q.len(&s, b, t), tokens * 16 * 128);
    assert_eq!(LlamaActivation::K.len(&s, b, t), tokens * 8 * 128);
    assert_eq!(LlamaActivation::Gate.len(&s, b, t), tokens * 3072);
    assert_eq!(LlamaActivation::RopeCos.len(&s, b, t), t * 64);
    assert_eq!(LlamaActivation::Norm1Rstd.len(&s, b, t), tokens);
    // q/k norms keep their inputs and statistics only where the model has them.
    assert_eq!(LlamaActivation::QPreNorm.len(&s, b, t), tokens * 16 * 128);
    let llama = LlamaPreset::Llama32_1B.shape();
    assert_eq!(LlamaActivation::QPreNorm.len(&llama, b, t), 0);
    assert_eq!(LlamaActivation::KNormRstd.len(&llama, b, t), 0);
    // The whole step: what the memory model counts.
    let e = per_rank(&setup(s, Dtype::Bf16, ZeroStage::Ddp, 1));
    let expected = scheduler::model::Activations::llama(&s, 1, 128, false, 2).activations;
    assert_eq!(e.activations, expected);
}

#[test]
fn the_estimate_report_names_the_family_and_shape() {
    let spec = JobSpec::parse(
        r#"{"model": {"preset": "llama-3.1-8B"}, "precision": {"dtype": "bf16"}}"#,
        Purpose::Estimate,
    )
    .unwrap()
    .spec;
    let inventory = Inventory::uniform(1, 141 << 30, DeviceKind::Cuda);
    let report = Report::new(&spec, Vec::new(), &inventory, DeviceKind::Cuda).unwrap();
    let model = report.model.clone().unwrap();
    assert_eq!((model.family, model.model_type), ("llama", "llama"));
    assert_eq!((model.attention_heads, model.key_value_heads), (32, 8));
    assert!(!model.tied_embeddings);
    assert_eq!(report.parameters, 8_030_261_248);
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["model"]["family"], "llama");
    assert_eq!(json["model"]["intermediate_size"], 14336);
    let gpt: GptShape = Preset::Tiny.shape();
    let tiny = JobSpec::parse(r#"{"model": {"preset": "gpt2-tiny"}}"#, Purpose::Train)
        .unwrap()
        .spec;
    let report = Report::new(&tiny, Vec::new(), &inventory, DeviceKind::Cuda).unwrap();
    assert_eq!(report.model.unwrap().hidden_size, gpt.n_embd);
    // A bare parameter count has no family.
    let params = JobSpec::parse(r#"{"model": {"params": 7e9}}"#, Purpose::Estimate)
        .unwrap()
        .spec;
    let report = Report::new(&params, Vec::new(), &inventory, DeviceKind::Cuda).unwrap();
    assert!(report.model.is_none());
}

#[test]
fn the_config_an_export_writes_for_a_preset_reads_back_as_the_same_model() {
    let presets = LlamaPreset::ALL
        .map(|p| p.name())
        .into_iter()
        .chain(["gpt2-tiny", "gpt2-124M"]);
    for preset in presets {
        let spec = json!({"model": {"preset": preset}});
        let parsed = JobSpec::parse(&spec.to_string(), Purpose::Train)
            .unwrap()
            .spec;
        let config = parsed.model.hf_config().unwrap();
        let again = json!({"model": {"config": config}});
        let reread = JobSpec::parse(&again.to_string(), Purpose::Train)
            .unwrap_or_else(|e| panic!("{preset}: {e}"))
            .spec;
        assert_eq!(
            reread.architecture(),
            parsed.architecture(),
            "{preset}: {config:?}"
        );
    }
}
