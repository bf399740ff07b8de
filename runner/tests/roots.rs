//! Data roots: a job reads its inputs only inside the node's roots. Every test here tries to
//! cross the boundary (absolute paths, `..`, symlinks, globs, the data dir's secrets, FIFOs,
//! devices, oversized files) and checks that the refusal says nothing about the file.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::PathBuf;

use runner::Error;
use runner::accounting::Accountant;
use runner::checkpoint::{load_hf, load_peft, max_hf_file_bytes};
use runner::data::{BatchLayout, DataLoader, DataRoots, Inputs, Tokenizing};
use scheduler::model::{ModelShape, Preset};
use scheduler::spec::{Data, JobSpec, Purpose, Validation};
use wire::data_roots::RootsError;

/// `base/data` is a data dir holding an admin token; its one root is `base/data/datasets`,
/// with a text file, a token shard and an admin-token look-alike outside.
struct Node {
    base: tempfile::TempDir,
    roots: DataRoots,
}

impl Node {
    fn new() -> Node {
        let base = tempfile::tempdir().unwrap();
        let data_dir = base.path().join("data");
        std::fs::create_dir_all(&data_dir).unwrap();
        std::fs::write(data_dir.join("admin-token"), "zt_secret_admin_token\n").unwrap();
        std::fs::write(base.path().join("outside.txt"), "outside bytes ".repeat(20)).unwrap();
        let roots = DataRoots::for_data_dir(&[], &data_dir, &[]).unwrap();
        let node = Node { base, roots };
        std::fs::write(node.root().join("corpus.txt"), "inside bytes ".repeat(20)).unwrap();
        node
    }

    fn root(&self) -> PathBuf {
        self.base.path().join("data/datasets")
    }

    fn in_root(&self, name: &str) -> String {
        self.root().join(name).to_str().unwrap().to_string()
    }

    fn open(&self, data: &Data) -> Result<DataLoader, Error> {
        open_with(&self.roots, data)
    }
}

/// A one-rank loader of 4-token batches over `data` inside `roots`.
fn open_with(roots: &DataRoots, data: &Data) -> Result<DataLoader, Error> {
    let layout = BatchLayout {
        batch: 1,
        seq_len: 4,
        rank: 0,
        world_size: 1,
    };
    let t = Tokenizing {
        cache: &std::env::temp_dir().join("zerotrain-roots-tests"),
        seed: 1,
        vocab_size: 512,
        eos_token_id: None,
        log: &|_| {},
    };
    let inputs = Inputs::prepare(data, None, roots, &t)?;
    DataLoader::new(&inputs.train, layout, 1, 512, &Accountant::new(None))
}

fn text(path: &str) -> Data {
    Data::Text {
        path: path.into(),
        validation: None,
        tokenizer: None,
    }
}

fn tokens(path: &str) -> Data {
    Data::Tokens {
        path: path.into(),
        shuffle: false,
        validation: None,
    }
}

/// The refusal: exactly the field and "outside the data roots", nothing about the file.
fn assert_outside<T>(result: Result<T, Error>, field: &str, case: &str) {
    match result {
        Err(e @ Error::Roots(RootsError::OutsideDataRoots { .. })) => {
            assert_eq!(
                e.to_string(),
                format!("{field}: outside the data roots"),
                "{case}"
            )
        }
        Err(other) => panic!("{case}: expected outside the data roots, got {other}"),
        Ok(_) => panic!("{case}: opened"),
    }
}

#[test]
fn paths_outside_the_roots_are_refused_whether_or_not_the_file_exists() {
    let node = Node::new();
    let outside = node.base.path().join("outside.txt");
    let cases = [
        ("/etc/passwd".to_string(), "an absolute path outside"),
        ("/etc/no-such-file".into(), "a missing file outside"),
        (
            "../admin-token".into(),
            "a relative escape to the data dir's secret",
        ),
        (node.in_root("../admin-token"), "an absolute escape"),
        (
            node.in_root("sub/../../../outside.txt"),
            "an escape through a missing directory",
        ),
        (
            outside.to_str().unwrap().into(),
            "a readable file beside the data dir",
        ),
    ];
    for (path, case) in &cases {
        assert_outside(node.open(&text(path)), "data.path", case);
        assert_outside(node.open(&tokens(path)), "data.path", case);
    }
}

#[test]
fn symlinks_inside_a_root_that_lead_outside_are_refused() {
    let node = Node::new();
    let root = node.root();
    symlink("/etc/passwd", root.join("passwd")).unwrap();
    symlink("/etc/no-such-file", root.join("dangling")).unwrap();
    symlink(node.base.path().join("data"), root.join("data-dir")).unwrap();
    symlink("/etc", root.join("etc")).unwrap();
    for name in [
        "passwd",
        "dangling",
        "data-dir/admin-token",
        "etc/passwd",
        "etc/missing",
    ] {
        assert_outside(node.open(&text(&node.in_root(name))), "data.path", name);
        assert_outside(node.open(&text(name)), "data.path", name);
    }
    // A link that stays inside is followed.
    symlink(root.join("corpus.txt"), root.join("alias.txt")).unwrap();
    node.open(&text("alias.txt")).unwrap();
}

#[test]
fn globs_reaching_outside_are_refused_without_expanding_them() {
    let node = Node::new();
    let root = node.root();
    assert_outside(
        node.open(&tokens("/etc/*")),
        "data.path",
        "a pattern outside",
    );
    assert_outside(
        node.open(&tokens(&node.in_root("../*"))),
        "data.path",
        "a pattern climbing out",
    );
    assert_outside(
        node.open(&tokens("../../*.txt")),
        "data.path",
        "a relative climb",
    );
    // A match that is a link to outside fails the whole pattern, whatever else it matches.
    symlink("/etc/passwd", root.join("b.bin")).unwrap();
    assert_outside(node.open(&tokens("*.bin")), "data.path", "a matched link");
    symlink("/etc", root.join("etc")).unwrap();
    assert_outside(
        node.open(&tokens("etc/pass*")),
        "data.path",
        "a linked directory",
    );
}

#[test]
fn relative_paths_are_read_from_the_first_root_and_missing_ones_say_so() {
    let node = Node::new();
    node.open(&text("corpus.txt")).unwrap();
    node.open(&text(&node.in_root("./corpus.txt"))).unwrap();
    let err = node.open(&text("missing.txt")).err().unwrap().to_string();
    assert!(err.ends_with("no such file under the data roots"), "{err}");
    let err = node.open(&tokens("*.missing")).err().unwrap().to_string();
    assert!(err.ends_with("the pattern matches no files"), "{err}");
}

#[test]
fn only_regular_files_are_opened() {
    let node = Node::new();
    let fifo = node.root().join("fifo");
    let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    std::fs::create_dir(node.root().join("dir")).unwrap();
    // Opening a FIFO with no writer would block the job forever; it is refused instead.
    for name in ["fifo", "dir"] {
        let err = node.open(&text(name)).err().unwrap().to_string();
        assert!(err.ends_with("not a regular file"), "{name}: {err}");
    }
    // Devices are outside any root; through a link inside one they still are.
    symlink("/dev/zero", node.root().join("zero")).unwrap();
    assert_outside(
        node.open(&text("zero")),
        "data.path",
        "/dev/zero via a link",
    );
    assert_outside(node.open(&text("/dev/zero")), "data.path", "/dev/zero");
    // Anywhere (a user's own `zerotrain train`) follows links, but still to regular files only.
    let anywhere = DataRoots::anywhere();
    let shape = ModelShape::Gpt2(Preset::Tiny.shape());
    let err = load_hf(&anywhere, "/dev/zero", &shape)
        .unwrap_err()
        .to_string();
    assert!(err.ends_with("not a regular file"), "{err}");
    let link = node.base.path().join("link.txt");
    symlink(node.root().join("corpus.txt"), &link).unwrap();
    open_with(&anywhere, &text(link.to_str().unwrap())).unwrap();
}

#[test]
fn init_from_is_read_inside_the_roots_and_no_larger_than_the_model_s_weights() {
    let node = Node::new();
    let shape = ModelShape::Gpt2(Preset::Tiny.shape());
    assert_outside(
        load_hf(&node.roots, "/dev/zero", &shape),
        "model.init_from",
        "/dev/zero",
    );
    assert_outside(
        load_hf(&node.roots, "../admin-token", &shape),
        "model.init_from",
        "the admin token",
    );
    // A sparse file one byte past the bound: refused from its size, before any byte is read.
    let big = node.root().join("big.safetensors");
    let file = std::fs::File::create(&big).unwrap();
    file.set_len(max_hf_file_bytes(&shape) + 1).unwrap();
    let err = load_hf(&node.roots, "big.safetensors", &shape)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("larger than a weights file of this model"),
        "{err}"
    );
    assert!(
        !err.contains(&(max_hf_file_bytes(&shape) + 1).to_string()),
        "{err}"
    );
    // Within the bound but not weights: no byte of it in the error.
    std::fs::write(
        node.root().join("w.safetensors"),
        b"\x10\0\0\0\0\0\0\0{\"SECRET\": 1}xxx",
    )
    .unwrap();
    let err = load_hf(&node.roots, "w.safetensors", &shape)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "model.init_from \"w.safetensors\": not a safetensors file"
    );
}

#[test]
fn a_lora_adapter_is_read_inside_the_roots_and_only_if_its_config_agrees_with_the_spec() {
    let node = Node::new();
    let reference = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/reference/lora_parity/llama");
    let adapter = node.root().join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(reference.join("adapter").join(file), adapter.join(file)).unwrap();
    }
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(reference.join("../../llama_parity/llama/config.json")).unwrap(),
    )
    .unwrap();
    let spec = |lora: serde_json::Value| {
        let spec = serde_json::json!({"model": {"config": config}, "lora": lora});
        JobSpec::parse(&spec.to_string(), Purpose::Train)
            .unwrap()
            .spec
    };
    let load = |lora: serde_json::Value, dir: &str| {
        let spec = spec(lora);
        let (model, lora) = (spec.architecture().model().unwrap(), spec.lora.unwrap());
        load_peft(&node.roots, dir, &model, &lora, &lora.adapters(&model))
    };
    let ours = serde_json::json!({"rank": 4, "alpha": 8, "target_modules": "all-linear"});
    load(ours.clone(), "adapter").unwrap();
    for (dir, case) in [
        (node.base.path().to_str().unwrap(), "a folder outside"),
        ("..", "the data dir with the admin token"),
    ] {
        assert_outside(load(ours.clone(), dir), "lora.init_from", case);
        let mut crossing = ours.clone();
        crossing["init_from"] = dir.into();
        assert_eq!(
            node.roots.refused_input(&spec(crossing)),
            Some("lora.init_from"),
            "the server refuses {case} before any node sees it"
        );
    }
    for (lora, says) in [
        (
            serde_json::json!({"rank": 8, "alpha": 8, "target_modules": "all-linear"}),
            "the adapter's r is 4; the spec's lora block says rank 8",
        ),
        (
            serde_json::json!({"rank": 4, "alpha": 16, "target_modules": "all-linear"}),
            "the adapter's lora_alpha is 8; the spec's lora block says alpha 16",
        ),
        (
            serde_json::json!({"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
            "the spec's lora block says target_modules self_attn.q_proj, self_attn.v_proj",
        ),
    ] {
        let err = load(lora, "adapter").unwrap_err().to_string();
        assert!(err.starts_with("lora.init_from \""), "{err}");
        assert!(err.contains(says), "{err}");
    }
}

#[test]
fn errors_about_files_inside_the_roots_quote_neither_bytes_sizes_nor_matched_names() {
    let node = Node::new();
    let root = node.root();
    // A shard whose "magic" is text: the error must not give those bytes back.
    let mut bad = b"SECRETAB".to_vec();
    bad.resize(2048, 0);
    std::fs::write(root.join("secret-name-1.bin"), &bad).unwrap();
    std::fs::write(root.join("secret-name-0.bin"), [0u8; 100]).unwrap();
    let magic = i32::from_le_bytes(*b"SECR").to_string();
    for (data, expect) in [
        (tokens("secret-name-1.bin"), "bad magic"),
        (tokens("secret-name-0.bin"), "truncated"),
        (tokens("secret-*.bin"), "file 1 of 2: truncated"),
    ] {
        let err = node.open(&data).err().unwrap().to_string();
        assert!(err.contains(expect), "{err}");
        for leak in [magic.as_str(), "SECRET", "100", "2048"] {
            assert!(!err.contains(leak), "{err} leaks {leak}");
        }
        if let Data::Tokens { path, .. } = &data
            && path.contains('*')
        {
            assert!(!err.contains("secret-name"), "{err} names a match");
        }
    }
}

#[test]
fn a_root_holding_the_data_dir_or_the_database_is_refused() {
    let base = tempfile::tempdir().unwrap();
    let data_dir = base.path().join("data");
    std::fs::create_dir_all(&data_dir).unwrap();
    let refused = |roots: &[PathBuf], extra: &[PathBuf]| match DataRoots::for_data_dir(
        roots, &data_dir, extra,
    ) {
        Err(e @ RootsError::DataRoot { .. }) => e.to_string(),
        other => panic!("{roots:?}: {other:?}"),
    };
    assert!(refused(&[base.path().into()], &[]).contains("holds the service's tokens"));
    assert!(refused(std::slice::from_ref(&data_dir), &[]).contains("holds the service's tokens"));
    // Through a symlink to it, too.
    let link = base.path().join("link");
    symlink(&data_dir, &link).unwrap();
    refused(&[link], &[]);
    let db_dir = base.path().join("db");
    std::fs::create_dir_all(&db_dir).unwrap();
    refused(
        std::slice::from_ref(&db_dir),
        &[db_dir.join("zerotrain.db")],
    );
    refused(&[base.path().join("missing")], &[]);
    // A root inside the data dir (the default) or beside it is fine.
    let beside = base.path().join("corpora");
    std::fs::create_dir_all(&beside).unwrap();
    let roots = DataRoots::for_data_dir(std::slice::from_ref(&beside), &data_dir, &[]).unwrap();
    assert_eq!(roots.dirs(), [beside.canonicalize().unwrap().as_path()]);
    DataRoots::for_data_dir(&[], &data_dir, &[]).unwrap();
    assert!(data_dir.join("datasets").is_dir(), "the default is created");
}

#[test]
fn a_tokenizer_or_validation_file_outside_the_roots_is_refused() {
    let node = Node::new();
    std::fs::write(node.root().join("d.jsonl"), "{\"text\": \"inside\"}\n").unwrap();
    std::fs::write(node.root().join("tokenizer.json"), "{}").unwrap();
    let outside = node.base.path().join("outside.txt");
    let outside = outside.to_str().unwrap();
    let validation = |path: &str| {
        Some(Validation {
            path: Some(path.into()),
            split: None,
            every_steps: 1,
            batches: 1,
        })
    };
    let jsonl = |tokenizer: &str, validate: Option<&str>| Data::Jsonl {
        path: node.in_root("d.jsonl"),
        field: "text".into(),
        prompt: None,
        completion: None,
        messages: None,
        tokenizer: Some(tokenizer.into()),
        validation: validate.and_then(validation),
    };
    let inside = node.in_root("tokenizer.json");
    for (data, field, case) in [
        (
            jsonl(outside, None),
            "data.tokenizer",
            "a tokenizer outside",
        ),
        (
            jsonl("../admin-token", None),
            "data.tokenizer",
            "the data dir's secret",
        ),
        (
            jsonl(&inside, Some(outside)),
            "data.validation.path",
            "validation text outside",
        ),
        (
            Data::Text {
                path: node.in_root("corpus.txt"),
                tokenizer: None,
                validation: validation("../admin-token"),
            },
            "data.validation.path",
            "byte-level validation outside",
        ),
    ] {
        assert_outside(node.open(&data), field, case);
        // The server refuses the same spec before any node sees it.
        let spec = serde_json::json!({"model": {"preset": "llama-tiny"}, "data": data});
        let spec = JobSpec::parse(&spec.to_string(), Purpose::Train)
            .unwrap()
            .spec;
        assert_eq!(node.roots.refused_input(&spec), Some(field), "{case}");
    }
}
