//! A user's own text: a tokenizer trained here, a JSON Lines corpus, tokenization cached once,
//! a validation loss that falls, fine-tuning masks (prompts, chat templates), and bad input
//! named by file, line and field.

use std::num::NonZeroU32;
use std::path::Path;
use std::sync::{Arc, Mutex};

use runner::accounting::Accountant;
use runner::data::{BatchLayout, DataLoader, DataRoots, Inputs, Tokenizing};
use runner::train::{LogSink, Options, Summary, run};
use scheduler::plan::plan_local;
use scheduler::spec::{Auto, Data, JobSpec, Purpose, ZeroStage};
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    TokenizerBuilder, TokenizerImpl,
};

const EOS: &str = "<|endoftext|>";

/// A corpus of a small made-up language: sentences whose words follow each other by rules a
/// tiny model learns, so held-out documents are predictable from the training ones.
fn documents(n: usize) -> Vec<String> {
    let subjects = ["the cat", "a dog", "my friend", "the old man", "a bird"];
    let verbs = ["sees", "likes", "follows", "finds", "hears"];
    let objects = [
        "the ball",
        "a red fish",
        "the green tree",
        "some water",
        "the moon",
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |k: usize| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize % k
    };
    (0..n)
        .map(|_| {
            (0..3 + next(4))
                .map(|_| {
                    let s = next(5);
                    // The verb follows from the subject, the object mostly from the verb.
                    let o = if next(4) == 0 { next(5) } else { (s + 2) % 5 };
                    format!("{} {} {}.", subjects[s], verbs[s], objects[o])
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// A folder with `corpus.jsonl` and a byte-level BPE `tokenizer.json` (and
/// `tokenizer_config.json` naming its end-of-sequence token) trained on it.
struct Corpus {
    dir: tempfile::TempDir,
}

impl Corpus {
    fn new(docs: usize) -> Corpus {
        let dir = tempfile::tempdir().unwrap();
        let docs = documents(docs);
        let jsonl: String = docs
            .iter()
            .map(|d| serde_json::json!({"id": 1, "text": d}).to_string() + "\n")
            .collect();
        std::fs::write(dir.path().join("corpus.jsonl"), jsonl).unwrap();
        std::fs::write(dir.path().join("corpus.txt"), docs.join("\n")).unwrap();
        let mut trainer = BpeTrainerBuilder::new()
            .vocab_size(320)
            .min_frequency(2)
            .special_tokens(vec![AddedToken::from(EOS, true)])
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let mut tokenizer: TokenizerImpl<
            BPE,
            NormalizerWrapper,
            PreTokenizerWrapper,
            PostProcessorWrapper,
            DecoderWrapper,
        > = TokenizerBuilder::new()
            .with_model(BPE::default())
            .with_pre_tokenizer(Some(ByteLevel::default().into()))
            .with_decoder(Some(ByteLevel::default().into()))
            .build()
            .unwrap();
        let text = dir.path().join("corpus.txt");
        tokenizer
            .train_from_files(&mut trainer, vec![text.to_str().unwrap().into()])
            .unwrap();
        tokenizer
            .save(dir.path().join("tokenizer.json"), false)
            .unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            serde_json::json!({"eos_token": EOS}).to_string(),
        )
        .unwrap();
        Corpus { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_owned()
    }

    /// llama-tiny on `data` (a `data` block), AdamW, B 8 × T 64.
    fn spec(&self, data: serde_json::Value, steps: u32) -> JobSpec {
        let json = serde_json::json!({
            "model": {"preset": "llama-tiny"},
            "training": {"steps": steps, "micro_batch_size": 8, "seq_len": 64, "lr": 3e-3,
                         "warmup_steps": 0, "seed": 3},
            "optimizer": {"type": "adamw"},
            "data": data,
        });
        JobSpec::parse(&json.to_string(), Purpose::Train)
            .unwrap_or_else(|e| panic!("{e}: {json}"))
            .spec
    }
}

/// Trains `spec` with tokenized data cached in `cache`; returns the summary and the log lines.
fn train(spec: &JobSpec, cache: &Path) -> (Result<Summary, runner::Error>, Vec<String>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = {
        let lines = lines.clone();
        LogSink(Arc::new(move |l: &str| {
            lines.lock().unwrap().push(l.to_owned())
        }))
    };
    let opts = Options {
        data_cache: Some(cache.to_path_buf()),
        log: Some(sink),
        ..Options::default()
    };
    let plan = plan_local(spec, None).unwrap();
    let summary = run(spec, &plan, &opts, &mut |_| {});
    let lines = lines.lock().unwrap().clone();
    (summary, lines)
}

fn error(spec: &JobSpec, cache: &Path) -> String {
    match train(spec, cache).0 {
        Ok(_) => panic!("trained on bad data"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn llama_tiny_learns_a_jsonl_corpus_and_its_validation_loss_falls() {
    let corpus = Corpus::new(600);
    let cache = tempfile::tempdir().unwrap();
    let data = serde_json::json!({
        "kind": "jsonl", "path": corpus.path("corpus.jsonl"),
        "tokenizer": corpus.path("tokenizer.json"),
        "validation": {"split": 0.1, "every_steps": 10, "batches": 2},
    });
    let spec = corpus.spec(data, 40);
    let (first, log) = train(&spec, cache.path());
    let first = first.unwrap();
    let steps: Vec<u32> = first.validation.iter().map(|v| v.step).collect();
    assert_eq!(steps, [10, 20, 30, 40]);
    let (start, end) = (first.validation[0].loss, first.validation[3].loss);
    assert!(end < 0.7 * start, "validation loss {start} → {end}");
    assert!(
        log.iter()
            .any(|l| l.contains("tokenized") && l.contains("documents")),
        "{log:?}"
    );
    // What the loaders hold, the validation one included, is what admission counted.
    let rank = &first.ranks[0];
    assert_eq!(rank.measured_peak_bytes, rank.predicted_bytes);

    // Again: read from the cache, not tokenized again, the same run exactly.
    let (second, log) = train(&spec, cache.path());
    let second = second.unwrap();
    assert!(
        log.iter().any(|l| l.contains("not tokenizing again")),
        "{log:?}"
    );
    assert!(!log.iter().any(|l| l.contains(": tokenizing")), "{log:?}");
    assert_eq!(first.losses, second.losses);
    assert_eq!(first.validation, second.validation);
}

#[test]
fn validation_does_not_change_what_is_trained() {
    let corpus = Corpus::new(300);
    let cache = tempfile::tempdir().unwrap();
    let data = |validation: Option<serde_json::Value>| {
        let mut d = serde_json::json!({
            "kind": "text", "path": corpus.path("corpus.txt"),
            "tokenizer": corpus.path("tokenizer.json"),
        });
        if let Some(v) = validation {
            d["validation"] = v;
        }
        d
    };
    let validated =
        serde_json::json!({"path": corpus.path("corpus.txt"), "every_steps": 2, "batches": 1});
    // One rank, and two at stage 3, where validation's forward gathers the parameters too.
    for (world, stage) in [(1, ZeroStage::Ddp), (2, ZeroStage::Parameters)] {
        let spec = |data| {
            let mut spec = corpus.spec(data, 6);
            spec.world_size = NonZeroU32::new(world).unwrap();
            spec.zero.stage = Auto::Fixed(stage);
            spec
        };
        let plain = train(&spec(data(None)), cache.path()).0.unwrap();
        let with = train(&spec(data(Some(validated.clone()))), cache.path())
            .0
            .unwrap();
        assert_eq!(plain.losses, with.losses, "{world} ranks, {stage:?}");
        assert!(plain.validation.is_empty());
        assert_eq!(with.validation.len(), 3);
        let rank = &with.ranks[world as usize - 1];
        assert_eq!(rank.measured_peak_bytes, rank.predicted_bytes);
    }
}

#[test]
fn bad_text_is_named_by_file_line_and_field() {
    let corpus = Corpus::new(200);
    let cache = tempfile::tempdir().unwrap();
    let jsonl = |lines: &[u8]| {
        let path = corpus.dir.path().join("bad.jsonl");
        let mut good = std::fs::read(corpus.path("corpus.jsonl")).unwrap();
        good.truncate(good.iter().position(|&b| b == b'\n').unwrap() + 1);
        std::fs::write(&path, [good.as_slice(), lines].concat()).unwrap();
        let data = serde_json::json!({"kind": "jsonl", "path": path,
                                      "tokenizer": corpus.path("tokenizer.json")});
        error(&corpus.spec(data, 2), cache.path())
    };
    let at = format!("data.path {:?}, line 2", corpus.path("bad.jsonl"));
    for (line, reason) in [
        (&b"{\"text\": \"unterminated\n"[..], "not JSON"),
        (b"[\"text\"]\n", "not a JSON object"),
        (b"{\"body\": \"x\"}\n", "no field \"text\""),
        (b"{\"text\": 7}\n", "field \"text\" is not a string"),
        (b"{\"text\": \"\xff\xfe\"}\n", "not valid UTF-8"),
    ] {
        let e = jsonl(line);
        assert!(e.starts_with(&at) && e.contains(reason), "{e}");
    }

    let empty = corpus.dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n\n").unwrap();
    let data = serde_json::json!({"kind": "jsonl", "path": empty,
                                  "tokenizer": corpus.path("tokenizer.json")});
    let e = error(&corpus.spec(data, 2), cache.path());
    assert!(e.contains("no documents"), "{e}");

    let data = serde_json::json!({"kind": "jsonl", "path": corpus.path("nothing-*.jsonl"),
                                  "tokenizer": corpus.path("tokenizer.json")});
    let e = error(&corpus.spec(data, 2), cache.path());
    assert!(e.contains("matches no files"), "{e}");

    let broken = corpus.dir.path().join("broken.json");
    std::fs::write(&broken, "{\"model\": 1}").unwrap();
    let data = serde_json::json!({"kind": "jsonl", "path": corpus.path("corpus.jsonl"),
                                  "tokenizer": broken});
    let e = error(&corpus.spec(data, 2), cache.path());
    assert!(
        e.starts_with("data.tokenizer") && e.contains("not a tokenizer.json"),
        "{e}"
    );
}

#[test]
fn a_tokenizer_larger_than_the_vocabulary_is_refused_with_both_numbers() {
    let corpus = Corpus::new(200);
    let cache = tempfile::tempdir().unwrap();
    let data = serde_json::json!({"kind": "jsonl", "path": corpus.path("corpus.jsonl"),
                                  "tokenizer": corpus.path("tokenizer.json")});
    let mut spec = corpus.spec(data, 2);
    let json = serde_json::json!({"vocab_size": 256, "context_length": 64, "n_layer": 1,
                                  "n_head": 2, "n_embd": 32});
    spec.model = serde_json::from_value(json).unwrap();
    spec.validate(Purpose::Train).unwrap();
    let e = error(&spec, cache.path());
    assert!(e.contains("model.vocab_size 256"), "{e}");
    let ids: usize = e
        .split("ids up to ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{e}"));
    assert!(ids >= 256, "{e}");
}

/// The first step's loss of llama-tiny on one micro-batch of 8 tokens (a window of 9) of the
/// prompt/completion examples `lines`, tokenized a word a token.
fn first_loss(lines: &[(&str, &str)]) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let words = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/words-tokenizer");
    let jsonl: String = lines
        .iter()
        .map(|(q, a)| serde_json::json!({"q": q, "a": a}).to_string() + "\n")
        .collect();
    std::fs::write(dir.path().join("sft.jsonl"), jsonl).unwrap();
    let json = serde_json::json!({
        "model": {"preset": "llama-tiny"},
        "training": {"steps": 1, "micro_batch_size": 1, "seq_len": 8},
        "data": {"kind": "jsonl", "path": dir.path().join("sft.jsonl"),
                 "prompt": "q", "completion": "a", "tokenizer": words.join("tokenizer.json")},
    });
    let spec = JobSpec::parse(&json.to_string(), Purpose::Train)
        .unwrap()
        .spec;
    let (summary, _) = train(&spec, dir.path());
    summary.unwrap().losses[0]
}

#[test]
fn fine_tuning_counts_the_loss_of_completion_tokens_only() {
    // The window's ninth token is only a target (of the eighth position), never an input: the
    // first example is 3 + 3 + EOS tokens, so it is the second example's second token.
    let completion_second =
        |second: &str| first_loss(&[("the cat sees", "the moon ."), ("a", second)]);
    let with_prompt = |word: &str| {
        first_loss(&[
            ("the cat sees", "the moon ."),
            (&format!("a {word}"), "likes the tree ."),
        ])
    };
    // There it is a prompt token: its target is not counted, whatever it is.
    assert_eq!(with_prompt("dog"), with_prompt("bird"));
    // A completion token: it is.
    let (dog, bird) = (
        completion_second("dog likes the tree ."),
        completion_second("bird likes the tree ."),
    );
    assert_ne!(dog, bird);
    // And the mean is over the counted targets: the same text with nothing masked weighs
    // every position, so it differs.
    assert_ne!(
        with_prompt("dog"),
        first_loss(&[
            ("", "the cat sees the moon ."),
            ("", "a dog likes the tree .")
        ])
    );
}

/// A folder with the word-level fixture tokenizer and a `tokenizer_config.json` holding
/// `template` as its chat template, and `chat.jsonl` of `conversations`.
fn chat_data(template: &str, conversations: &[serde_json::Value]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let words = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/words-tokenizer");
    std::fs::copy(
        words.join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let config = serde_json::json!({"eos_token": "<eos>", "chat_template": template});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let jsonl: String = conversations
        .iter()
        .map(|m| serde_json::json!({"messages": m}).to_string() + "\n")
        .collect();
    std::fs::write(dir.path().join("chat.jsonl"), jsonl).unwrap();
    dir
}

/// The first window of `t` tokens of `dir`'s conversations: inputs and targets.
fn first_window(dir: &Path, t: usize) -> Result<(Vec<u32>, Vec<u32>), runner::Error> {
    let data = Data::Jsonl {
        path: dir.join("chat.jsonl").to_str().unwrap().into(),
        field: "text".into(),
        prompt: None,
        completion: None,
        messages: Some("messages".into()),
        tokenizer: Some(dir.join("tokenizer.json").to_str().unwrap().into()),
        validation: None,
    };
    let tokenizing = Tokenizing {
        cache: dir,
        seed: 1,
        vocab_size: 512,
        eos_token_id: None,
        log: &|_| {},
    };
    let inputs = Inputs::prepare(&data, None, &DataRoots::anywhere(), &tokenizing)?;
    let layout = BatchLayout {
        batch: 1,
        seq_len: t,
        rank: 0,
        world_size: 1,
    };
    let acct = Accountant::new(None);
    let mut loader = DataLoader::new(&inputs.train, layout, 1, 512, &acct)?;
    let (mut x, mut y) = (vec![0; t], vec![0; t]);
    loader.next_batch(&mut x, &mut y)?;
    Ok((x, y))
}

const TEMPLATE: &str = "{% for m in messages %}\
    {% if loop.first and m['role'] != 'user' %}{{ raise_exception('conversations start with the user') }}{% endif %}\
    {{ m['role'] }} : {{ m['content'].strip() }} .{% endfor %}\
    {% if add_generation_prompt %}assistant :{% endif %}";

#[test]
fn conversations_train_on_the_assistant_s_turns_only() {
    let conversation = serde_json::json!([
        {"role": "user", "content": " the cat sees "},
        {"role": "assistant", "content": "the moon"},
    ]);
    let dir = chat_data(TEMPLATE, &[conversation.clone(), conversation]);
    // "user : the cat sees . assistant :" is context (user, assistant and ':' are [UNK], 1);
    // "the moon ." and the EOS after it are trained on.
    let (inputs, targets) = first_window(dir.path(), 11).unwrap();
    assert_eq!(inputs, [1, 1, 2, 4, 6, 21, 1, 1, 2, 9, 21]);
    let ignored = kernels::crossentropy::IGNORE;
    assert_eq!(targets, [[ignored; 7].as_slice(), &[2, 9, 21, 0]].concat());

    // The template's own errors name the line.
    let dir = chat_data(
        TEMPLATE,
        &[serde_json::json!([{"role": "assistant", "content": "the moon"}])],
    );
    let e = first_window(dir.path(), 4).unwrap_err().to_string();
    assert!(
        e.contains("chat.jsonl\", line 1") && e.contains("conversations start with the user"),
        "{e}"
    );
    // A tokenizer without a template cannot read conversations.
    let dir = chat_data("", &[]);
    let config = serde_json::json!({"eos_token": "<eos>"});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let e = first_window(dir.path(), 4).unwrap_err().to_string();
    assert!(e.contains("no chat_template"), "{e}");
}

#[test]
fn the_validation_loss_is_the_training_loss_of_the_same_batch_and_weights() {
    // A file of exactly one world batch: every step trains on it, and validation (the same
    // file, one batch) reads it too, so the validation loss after step k is the loss step k + 1
    // reports (both forward passes over the same weights and tokens), to f32 rounding.
    for world in [1usize, 2] {
        let dir = tempfile::tempdir().unwrap();
        let (b, t) = (2, 16);
        let text: String = documents(40).join(" ");
        let path = dir.path().join("one-batch.txt");
        std::fs::write(&path, &text.as_bytes()[..world * b * t + 1]).unwrap();
        let json = serde_json::json!({
            "model": {"preset": "gpt2-tiny"}, "world_size": world, "zero": {"stage": 0},
            "training": {"steps": 4, "micro_batch_size": b, "seq_len": t, "lr": 1e-2},
            "data": {"kind": "text", "path": path,
                     "validation": {"path": path, "every_steps": 1, "batches": 1}},
        });
        let spec = JobSpec::parse(&json.to_string(), Purpose::Train)
            .unwrap()
            .spec;
        let summary = train(&spec, dir.path()).0.unwrap();
        for (v, next) in summary.validation.iter().zip(&summary.losses[1..]) {
            let gap = (v.loss - next).abs() / next;
            assert!(
                gap < 1e-6,
                "{world} ranks, after step {}: {} vs {next}",
                v.step,
                v.loss
            );
        }
        assert!(
            summary.losses[3] < summary.losses[0],
            "it trains: {:?}",
            summary.losses
        );
    }
}
