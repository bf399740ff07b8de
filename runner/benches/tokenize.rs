//! Tokenization throughput beside the `tokenizers` Python package: the Python standard
//! library's sources as JSON Lines (about 40 MB, a file a document) and a byte-level BPE of
//! 32,000 ids trained on them, both made by `scripts/bench_tokenize.py`. zerotrain's figure is
//! the whole of a job's tokenization into a fresh cache (hashing the file, parsing each line,
//! encoding in parallel, writing the uint32 shard); Python's is `Tokenizer.encode_batch` over
//! the documents already in memory. Both on every core; median of 5, MB of document text per
//! second.
//!
//! Run: `ZEROTRAIN_TOKENIZERS_PYTHON=python cargo bench -p runner --bench tokenize`, with a
//! Python that has `pip install tokenizers`.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use runner::data::{DataRoots, Inputs, Tokenizing};
use scheduler::spec::Data;

const REPEAT: usize = 5;
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bench_tokenize.py");

fn python(python: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new(python)
        .arg(SCRIPT)
        .args(args)
        .output()
        .expect("ZEROTRAIN_TOKENIZERS_PYTHON runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

/// Seconds of one tokenization of `dir`'s corpus into a cache of its own.
fn ours(dir: &Path) -> f64 {
    let cache = tempfile::tempdir().unwrap();
    let data = Data::Jsonl {
        path: dir.join("corpus.jsonl").to_str().unwrap().into(),
        field: "text".into(),
        prompt: None,
        completion: None,
        messages: None,
        tokenizer: Some(dir.join("tokenizer.json").to_str().unwrap().into()),
        validation: None,
    };
    let t = Tokenizing {
        cache: cache.path(),
        seed: 1,
        vocab_size: 32_000,
        eos_token_id: None,
        log: &|_| {},
    };
    let start = Instant::now();
    Inputs::prepare(&data, None, &DataRoots::anywhere(), &t).expect("the corpus tokenizes");
    start.elapsed().as_secs_f64()
}

fn main() {
    let Ok(py) = std::env::var("ZEROTRAIN_TOKENIZERS_PYTHON") else {
        eprintln!("set ZEROTRAIN_TOKENIZERS_PYTHON to a Python with `pip install tokenizers`");
        return;
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-tokenize");
    if !dir.join("tokenizer.json").exists() {
        python(&py, &["--make", dir.to_str().unwrap()]);
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    kernels::cpu::pool_builder(threads, kernels::cpu::Simd::Detect)
        .build_global()
        .expect("the first pool of the process");
    let theirs = python(&py, &["--encode", dir.to_str().unwrap(), "--repeat", "5"]);
    let mb = theirs["mb"].as_f64().expect("the corpus's size");
    let mut seconds: Vec<f64> = (0..REPEAT).map(|_| ours(&dir)).collect();
    seconds.sort_by(f64::total_cmp);
    let ours = seconds[REPEAT / 2];
    let theirs_s = theirs["median_s"].as_f64().expect("Python's seconds");
    println!(
        "{:>8} {:>8} {:>22} {:>26} {:>7}",
        "threads", "MB", "zerotrain MB/s (job)", "tokenizers encode_batch", "ratio"
    );
    println!(
        "{threads:>8} {mb:>8.1} {:>22.1} {:>26.1} {:>6.2}×",
        mb / ours,
        mb / theirs_s,
        theirs_s / ours
    );
}
