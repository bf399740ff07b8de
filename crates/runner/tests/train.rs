//! End-to-end training of gpt2-tiny in this process.

use runner::train::{Options, run};
use scheduler::spec::{JobSpec, Purpose};

fn spec(json: &str) -> JobSpec {
    JobSpec::parse(json, Purpose::Train).unwrap().spec
}

#[test]
fn smoke() {
    for dtype in ["fp32", "bf16", "fp16"] {
        let s = spec(&format!(
            r#"{{"model": {{"preset": "gpt2-tiny"}}, "training": {{"steps": 40, "lr": 1e-3, "seq_len": 64}}, "precision": {{"dtype": "{dtype}"}}}}"#
        ));
        let sum = run(&s, &Options::default(), &mut |_| {}).unwrap();
        eprintln!(
            "{dtype}: losses {:?}",
            sum.losses
                .iter()
                .step_by(5)
                .map(|l| format!("{l:.3}"))
                .collect::<Vec<_>>()
        );
        eprintln!(
            "{dtype}: measured {:?}\n predicted {:?}",
            sum.ranks[0].measured_peak_bytes, sum.ranks[0].predicted_bytes
        );
        eprintln!(
            "step {:.4}s tok/s {:.0}",
            sum.step_seconds_median, sum.tokens_per_second
        );
    }
}
