//! Checkpoints: resuming is bit-identical, and the final export is Hugging Face's form (one
//! file, or shards past a limit).

use std::fs;
use std::path::Path;

use runner::checkpoint;
use runner::data::DataRoots;
use runner::train::{Options, Resume, Summary, run};
use safetensors::SafeTensors;
use scheduler::model::{ModelShape, Preset};
use scheduler::plan::plan_local;
use scheduler::spec::{JobSpec, Purpose};

fn train_in(json: &str, out: &Path) -> Summary {
    train_with(
        json,
        &Options {
            out_dir: Some(out.to_path_buf()),
            ..Options::default()
        },
    )
}

fn train_with(json: &str, opts: &Options) -> Summary {
    let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
    let plan = plan_local(&spec, None).unwrap();
    run(&spec, &plan, opts, &mut |_| {}).unwrap_or_else(|e| panic!("{e}: {json}"))
}

/// The names in `dir` that `keep` accepts, sorted.
fn names_in(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| keep(n))
        .collect();
    names.sort();
    names
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn resuming_from_a_checkpoint_is_bit_identical_to_an_uninterrupted_run() {
    let runs = [
        ("fp32", "adamw"),
        ("bf16", "adam8bit"),
        ("fp16", "adafactor"),
        ("bf16", "lion"),
    ];
    let models = ["gpt2-tiny", "llama-tiny"];
    for (model, (dtype, optimizer)) in models.into_iter().flat_map(|m| runs.map(|r| (m, r))) {
        let json = format!(
            r#"{{"model": {{"preset": "{model}"}}, "optimizer": {{"type": "{optimizer}"}},
                "precision": {{"dtype": "{dtype}"}}, "training": {{"steps": 10, "lr": 1e-3}},
                "checkpoint": {{"every_steps": 4}}}}"#
        );
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let whole = train_in(&json, a.path());
        // An interrupted run: only the step-4 checkpoint exists when it restarts.
        let step4 = Path::new("checkpoints").join("step-00000004");
        copy_dir(&a.path().join(&step4), &b.path().join(&step4));
        fs::write(b.path().join("checkpoints/latest"), "step-00000004").unwrap();
        let resumed = train_in(&json, b.path());
        assert_eq!(resumed.resumed_from, Some(4), "{model} {dtype} {optimizer}");
        assert_eq!(resumed.losses, whole.losses, "{model} {dtype} {optimizer}");
        let weights = |dir: &Path| fs::read(dir.join("model.safetensors")).unwrap();
        assert!(
            weights(a.path()) == weights(b.path()),
            "{model} {dtype} {optimizer}: exported weights differ"
        );
    }
}

#[test]
fn checkpoints_keep_the_last_two_and_point_at_the_newest() {
    let out = tempfile::tempdir().unwrap();
    train_in(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 9}, "checkpoint": {"every_steps": 2}}"#,
        out.path(),
    );
    let mut names: Vec<String> = fs::read_dir(out.path().join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["latest", "step-00000006", "step-00000008"]);
    let latest = checkpoint::latest(out.path()).unwrap().unwrap();
    assert_eq!(checkpoint::load_manifest(&latest).unwrap().step, 8);
}

#[test]
fn a_checkpoint_from_another_configuration_is_refused() {
    let out = tempfile::tempdir().unwrap();
    let json = r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 4}, "checkpoint": {"every_steps": 2}}"#;
    train_in(json, out.path());
    let opts = Options {
        out_dir: Some(out.path().to_path_buf()),
        ..Options::default()
    };
    // What resuming `json`'s run from the checkpoints written above says.
    let refusal = |json: &str| {
        let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
        let plan = plan_local(&spec, None).unwrap();
        run(&spec, &plan, &opts, &mut |_| {})
            .unwrap_err()
            .to_string()
    };
    let err = refusal(&json.replace(
        "}, \"training\"",
        "}, \"precision\": {\"dtype\": \"bf16\"}, \"training\"",
    ));
    assert!(
        err.contains("written by a Fp32 adamw job; this one is Bf16 adamw"),
        "{err}"
    );
    // The same model with adapters trains other values: its checkpoints are not these.
    let err = refusal(&json.replace(
        "}, \"training\"",
        "}, \"lora\": {\"rank\": 2}, \"training\"",
    ));
    assert!(
        err.contains("written by a job that trains 141056 parameters; this one trains 1024"),
        "{err}"
    );
}

#[test]
fn the_export_is_hugging_face_gpt2_and_loads_back() {
    let out = tempfile::tempdir().unwrap();
    train_in(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 3}, "precision": {"dtype": "bf16"}}"#,
        out.path(),
    );
    let bytes = fs::read(out.path().join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let shape = Preset::Tiny.shape();
    assert_eq!(
        file.names().len(),
        2 + 12 * shape.n_layer + 2,
        "no lm_head: it is tied to wte"
    );
    let wte = file.tensor("transformer.wte.weight").unwrap();
    assert_eq!(
        (wte.shape(), wte.dtype()),
        (&[512, 64][..], safetensors::Dtype::F32)
    );
    assert_eq!(
        file.tensor("transformer.h.1.attn.c_attn.weight")
            .unwrap()
            .shape(),
        &[64, 192]
    );
    assert_eq!(
        file.tensor("transformer.h.0.mlp.c_proj.weight")
            .unwrap()
            .shape(),
        &[256, 64]
    );
    let config: serde_json::Value =
        serde_json::from_slice(&fs::read(out.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(
        (
            config["n_embd"].as_u64(),
            config["n_layer"].as_u64(),
            config["n_head"].as_u64()
        ),
        (Some(64), Some(2), Some(4))
    );
    assert_eq!(config["activation_function"], "gelu_new");
    let exported = out.path().join("model.safetensors");
    let units = checkpoint::load_hf(
        &DataRoots::anywhere(),
        exported.to_str().unwrap(),
        &ModelShape::Gpt2(shape),
    )
    .unwrap();
    let wte_values: Vec<f32> = wte
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(&units.unit_values(0).unwrap()[..512 * 64], &wte_values[..]);
}

#[test]
fn init_from_accepts_unprefixed_names_ignores_mask_buffers_and_refuses_wrong_shapes() {
    let out = tempfile::tempdir().unwrap();
    train_in(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 2}}"#,
        out.path(),
    );
    let bytes = fs::read(out.path().join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    // Re-save as the original `gpt2` checkpoint is laid out: no prefix, with mask buffers.
    let mask = vec![0u8; 4 * 128 * 128];
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = file
        .tensors()
        .into_iter()
        .map(|(n, v)| (n.trim_start_matches("transformer.").to_string(), v))
        .collect();
    for l in 0..2 {
        let view = safetensors::tensor::TensorView::new(
            safetensors::Dtype::F32,
            vec![1, 1, 128, 128],
            &mask,
        )
        .unwrap();
        tensors.push((format!("h.{l}.attn.bias"), view));
    }
    let hf = out.path().join("gpt2-like.safetensors");
    safetensors::serialize_to_file(tensors, None, &hf).unwrap();
    let load = |path: &Path, shape: &scheduler::model::GptShape| {
        checkpoint::load_hf(
            &DataRoots::anywhere(),
            path.to_str().unwrap(),
            &ModelShape::Gpt2(*shape),
        )
    };
    let from = load(&hf, &Preset::Tiny.shape()).unwrap();
    let original = load(&out.path().join("model.safetensors"), &Preset::Tiny.shape()).unwrap();
    let units = scheduler::model::Units::new(&Preset::Tiny.shape(), 1)
        .iter()
        .count();
    for u in 0..units {
        let (a, b) = (
            from.unit_values(u).unwrap(),
            original.unit_values(u).unwrap(),
        );
        assert_eq!(a, b, "unit {u}");
    }
    let json = format!(
        r#"{{"model": {{"preset": "gpt2-tiny", "init_from": {:?}}}, "training": {{"steps": 1}}}}"#,
        hf.display().to_string()
    );
    let fresh = train_in(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 1}}"#,
        tempfile::tempdir().unwrap().path(),
    );
    let warm = train_in(&json, tempfile::tempdir().unwrap().path());
    assert!(
        warm.losses[0] < fresh.losses[0],
        "trained weights start lower: {} vs {}",
        warm.losses[0],
        fresh.losses[0]
    );
    let wrong = scheduler::model::GptShape {
        n_embd: 128,
        ..Preset::Tiny.shape()
    };
    let err = load(&hf, &wrong).unwrap_err().to_string();
    assert!(
        err.contains("wte.weight has shape [512, 64]; the model needs [512, 128]"),
        "{err}"
    );
    // A smaller model's weights file cannot be this large: refused before it is read.
    let smaller = scheduler::model::GptShape {
        n_embd: 32,
        ..Preset::Tiny.shape()
    };
    let err = load(&hf, &smaller).unwrap_err().to_string();
    assert!(
        err.contains("larger than a weights file of this model can be"),
        "{err}"
    );
}

#[test]
fn a_run_resumes_from_the_checkpoint_it_is_given_not_the_newest_on_disk() {
    let json = r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 10},
        "checkpoint": {"every_steps": 2}}"#;
    let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
    let out = tempfile::tempdir().unwrap();
    let run_with = |resume: Resume, dir: &Path| {
        let opts = Options {
            out_dir: Some(dir.to_path_buf()),
            resume,
            keep_all_checkpoints: true,
            ..Options::default()
        };
        run(&spec, &plan_local(&spec, None).unwrap(), &opts, &mut |_| {}).unwrap()
    };
    let whole = run_with(Resume::Latest, out.path());
    let steps = |dir: &Path| names_in(&dir.join("checkpoints"), |n| n.starts_with("step-"));
    let all = [
        "step-00000002",
        "step-00000004",
        "step-00000006",
        "step-00000008",
    ];
    assert_eq!(steps(out.path()), all, "every checkpoint kept");

    // Another folder, resuming from step 4 of the first although its own newest is step 8.
    let other = tempfile::tempdir().unwrap();
    run_with(Resume::Latest, other.path());
    let step4 = checkpoint::step_dir(out.path(), 4);
    let resumed = run_with(Resume::From(step4), other.path());
    assert_eq!(resumed.resumed_from, Some(4));
    assert_eq!(resumed.losses, whole.losses);
    let fresh = run_with(Resume::Fresh, other.path());
    assert_eq!(
        fresh.resumed_from, None,
        "a fresh run ignores what is on disk"
    );
}

/// The Llama parity reference model (`tests/reference/llama_parity/qwen3`).
fn qwen3_reference() -> (std::path::PathBuf, ModelShape) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/llama_parity/qwen3");
    let config = fs::read_to_string(dir.join("config.json")).unwrap();
    let spec = JobSpec::parse(
        &format!(r#"{{"model": {{"config": {config}}}}}"#),
        Purpose::Train,
    )
    .unwrap()
    .spec;
    (dir, spec.architecture().model().unwrap())
}

#[test]
fn a_sharded_hugging_face_set_reads_as_its_single_file_does() {
    let (dir, model) = qwen3_reference();
    let bytes = fs::read(dir.join("model.safetensors")).unwrap();
    let single = SafeTensors::deserialize(&bytes).unwrap();
    // Two shards, the tensors dealt alternately, and the index transformers writes.
    let sharded = tempfile::tempdir().unwrap();
    let mut names = single.names();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for k in 0..2 {
        let file = format!("model-0000{}-of-00002.safetensors", k + 1);
        let tensors: Vec<_> = names
            .iter()
            .skip(k)
            .step_by(2)
            .map(|n| (n.to_string(), single.tensor(n).unwrap()))
            .collect();
        for (n, _) in &tensors {
            weight_map.insert(n.clone(), file.clone().into());
        }
        safetensors::serialize_to_file(tensors, None, &sharded.path().join(&file)).unwrap();
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    fs::write(
        sharded.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let roots = DataRoots::anywhere();
    let load = |p: &Path| checkpoint::load_hf(&roots, p.to_str().unwrap(), &model);
    let (a, b) = (load(&dir).unwrap(), load(sharded.path()).unwrap());
    for u in 0..model.units(1).iter().count() {
        assert_eq!(
            a.unit_values(u).unwrap(),
            b.unit_values(u).unwrap(),
            "unit {u}"
        );
    }
    // An index may only name files beside it.
    let escape = serde_json::json!({"weight_map": {"model.norm.weight": "../model.safetensors"}});
    fs::write(
        sharded.path().join("model.safetensors.index.json"),
        escape.to_string(),
    )
    .unwrap();
    let err = load(sharded.path()).unwrap_err().to_string();
    assert!(err.contains("not a .safetensors file beside it"), "{err}");
    // A directory with neither names both.
    let empty = tempfile::tempdir().unwrap();
    let err = load(empty.path()).unwrap_err().to_string();
    assert!(err.contains("holds neither"), "{err}");
}

#[test]
fn an_export_past_its_shard_limit_is_transformers_shards_of_the_same_tensors() {
    // llama-tiny's embedding and LM head (131 kB each) are each larger than the limit; its
    // blocks' tensors go a few to a file.
    const LIMIT: u64 = 100_000;
    let json = r#"{"model": {"preset": "llama-tiny"}, "training": {"steps": 2}}"#;
    let (single, sharded) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    train_in(json, single.path());
    train_with(
        json,
        &Options {
            out_dir: Some(sharded.path().to_path_buf()),
            export_shard_bytes: Some(LIMIT),
            ..Options::default()
        },
    );
    let exported = |dir: &Path| names_in(dir, |n| n != "checkpoints" && n != "cache");
    // Under the limit (2 GB by default): the one file, no index.
    assert_eq!(
        exported(single.path()),
        ["config.json", "model.safetensors"]
    );
    let whole_bytes = fs::read(single.path().join("model.safetensors")).unwrap();
    let (_, whole_header) = SafeTensors::read_metadata(&whole_bytes).unwrap();
    let whole = SafeTensors::deserialize(&whole_bytes).unwrap();

    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(sharded.path().join(checkpoint::INDEX_FILE)).unwrap())
            .unwrap();
    let weight_map = index["weight_map"].as_object().unwrap();
    let mut files: Vec<&str> = weight_map.values().map(|f| f.as_str().unwrap()).collect();
    files.sort();
    files.dedup();
    let n = files.len();
    assert!(n >= 3, "{files:?}");
    let shards: Vec<String> = (1..=n)
        .map(|k| format!("model-{k:05}-of-{n:05}.safetensors"))
        .collect();
    assert_eq!(files, shards);
    let mut want = shards.clone();
    want.extend(["config.json".into(), checkpoint::INDEX_FILE.into()]);
    want.sort();
    assert_eq!(
        exported(sharded.path()),
        want,
        "nothing else, nothing temporary"
    );
    assert_eq!(
        fs::read(sharded.path().join("config.json")).unwrap(),
        fs::read(single.path().join("config.json")).unwrap()
    );

    // File by file, in order, the shards hold the single file's tensors, bit for bit.
    let (mut order, mut total, mut alone, mut shared) = (Vec::new(), 0u64, 0, 0);
    for shard in &shards {
        let bytes = fs::read(sharded.path().join(shard)).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let names = header.offset_keys();
        for name in &names {
            let (got, want) = (file.tensor(name).unwrap(), whole.tensor(name).unwrap());
            assert_eq!(
                (got.dtype(), got.shape(), got.data()),
                (want.dtype(), want.shape(), want.data()),
                "{name} in {shard}"
            );
            assert_eq!(weight_map[name], shard.as_str(), "{name}");
            total += got.data().len() as u64;
        }
        let size = bytes.len() as u64;
        assert!(
            size <= LIMIT || names.len() == 1,
            "{shard}: {size} bytes in {} tensors",
            names.len()
        );
        if size > LIMIT {
            alone += 1;
        } else if names.len() > 1 {
            shared += 1;
        }
        assert_eq!(
            header.metadata().as_ref().and_then(|m| m.get("format")),
            Some(&"pt".to_string())
        );
        order.extend(names);
    }
    assert_eq!(order, whole_header.offset_keys(), "the same order");
    assert_eq!((alone, shared > 0), (2, true), "both rules were at work");
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(total, whole_header.data_len() as u64);

    // Read back, by `init_from` and by an agent's fetched folder: the single file's values.
    let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
    let model = spec.architecture().model().unwrap();
    let roots = DataRoots::anywhere();
    let from_single = checkpoint::load_hf(&roots, single.path().to_str().unwrap(), &model).unwrap();
    let from_shards =
        checkpoint::load_hf(&roots, sharded.path().to_str().unwrap(), &model).unwrap();
    let fetched = checkpoint::load_hf_file(sharded.path(), &model).unwrap();
    for u in 0..model.units(1).iter().count() {
        let want = from_single.unit_values(u).unwrap();
        assert_eq!(from_shards.unit_values(u).unwrap(), want, "unit {u}");
        assert_eq!(fetched.unit_values(u).unwrap(), want, "unit {u}");
    }
}

#[test]
fn an_export_into_a_folder_replaces_the_weights_of_one_before_it() {
    let json = r#"{"model": {"preset": "llama-tiny"}, "training": {"steps": 1}}"#;
    let out = tempfile::tempdir().unwrap();
    let export = |limit| {
        let opts = Options {
            out_dir: Some(out.path().to_path_buf()),
            export_shard_bytes: Some(limit),
            resume: Resume::Fresh,
            ..Options::default()
        };
        train_with(json, &opts);
        names_in(out.path(), |n| n.starts_with("model"))
    };
    let sharded = export(100_000);
    assert!(sharded.len() > 3, "{sharded:?}");
    // Fewer shards: none of the earlier set is left beside them.
    let fewer = export(300_000);
    assert!(fewer.len() < sharded.len(), "{fewer:?}");
    let n = fewer.len() - 1;
    assert!(fewer.iter().all(|f| f.ends_with(&format!("-of-{n:05}.safetensors"))
        || f == checkpoint::INDEX_FILE), "{fewer:?}");
    // One file: no shard or index is left to shadow it.
    assert_eq!(
        export(checkpoint::EXPORT_SHARD_BYTES),
        ["model.safetensors"]
    );
    assert!(export(100_000).len() > 3);
    assert!(!out.path().join("model.safetensors").exists());
}
