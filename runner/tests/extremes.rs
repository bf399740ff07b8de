//! The spec's extremes: each spec is either refused at admission (a spec error or a plan that
//! does not fit, never a panic) or admitted and trained for one step on this machine's CPU.
//! No spec admission accepts may fail, let alone panic, on a rank.

use std::panic::{AssertUnwindSafe, catch_unwind};

use runner::train::{Options, run};
use scheduler::plan::plan_local;
use scheduler::spec::{JobSpec, Purpose};

/// What a rank may hold here (CI has 24 GiB): a spec that needs more is refused by the plan.
const MEMORY_PER_RANK: u64 = 8 << 30;

/// What became of a spec.
#[derive(Debug, PartialEq)]
enum Outcome {
    Refused(String),
    Trained,
}

/// Admits `json` as `zerotrain train` does and trains it; a rank's error or panic fails.
fn admit_and_train(json: &str) -> Outcome {
    let spec = match JobSpec::parse(json, Purpose::Train) {
        Ok(parsed) => parsed.spec,
        Err(e) => return Outcome::Refused(e.to_string()),
    };
    let plan = match plan_local(&spec, Some(MEMORY_PER_RANK)) {
        Ok(plan) => plan,
        Err(e) => return Outcome::Refused(e.to_string()),
    };
    match catch_unwind(AssertUnwindSafe(|| {
        run(&spec, &plan, &Options::default(), &mut |_| {})
    })) {
        Ok(Ok(summary)) => {
            assert!(
                summary.losses.iter().all(|l| l.is_finite()),
                "{json}: losses {:?}",
                summary.losses
            );
            Outcome::Trained
        }
        Ok(Err(e)) => panic!("admitted, then the run failed: {e}\n{json}"),
        Err(_) => panic!("admitted, then a rank panicked\n{json}"),
    }
}

fn gpt(vocab: usize, t: usize, heads: usize, embd: usize, b: usize) -> String {
    format!(
        r#"{{"model": {{"vocab_size": {vocab}, "context_length": {t}, "n_layer": 1, "n_head": {heads}, "n_embd": {embd}}},
            "training": {{"steps": 1, "seq_len": {t}, "micro_batch_size": {b}, "grad_accum_steps": 1}}}}"#
    )
}

fn llama(t: usize, heads: usize, kv: usize, head_dim: usize) -> String {
    format!(
        r#"{{"model": {{"config": {{"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": {heads},
            "num_key_value_heads": {kv}, "head_dim": {head_dim}, "max_position_embeddings": {t}}}}},
            "training": {{"steps": 1, "seq_len": {t}, "micro_batch_size": 1, "grad_accum_steps": 1}}}}"#
    )
}

#[test]
fn sequences_far_past_1024_tokens_train() {
    assert_eq!(admit_and_train(&gpt(64, 8192, 2, 16, 1)), Outcome::Trained);
    assert_eq!(admit_and_train(&llama(16384, 2, 1, 8)), Outcome::Trained);
}

#[test]
fn the_widest_head_trains_and_a_wider_one_is_refused() {
    assert_eq!(admit_and_train(&gpt(64, 64, 1, 256, 1)), Outcome::Trained);
    assert_eq!(admit_and_train(&llama(64, 2, 1, 256)), Outcome::Trained);
    for json in [gpt(64, 64, 1, 264, 1), llama(64, 2, 1, 258)] {
        let Outcome::Refused(why) = admit_and_train(&json) else {
            panic!("a 257+ channel head was admitted: {json}")
        };
        assert!(why.contains("at most 256"), "{why}");
    }
}

#[test]
fn the_smallest_and_largest_vocabularies_train() {
    // The synthetic corpus draws four successors per context: vocabulary 3 is refused, 4 trains.
    let Outcome::Refused(why) = admit_and_train(&gpt(3, 64, 1, 8, 2)) else {
        panic!("synthetic data over 3 tokens was admitted")
    };
    assert!(
        why.contains("synthetic data needs model.vocab_size ≥ 4"),
        "{why}"
    );
    assert_eq!(admit_and_train(&gpt(4, 64, 1, 8, 2)), Outcome::Trained);
    assert_eq!(
        admit_and_train(&gpt(1 << 20, 64, 1, 2, 1)),
        Outcome::Trained
    );
}

#[test]
fn logits_of_more_than_2_pow_31_elements_are_never_held_at_once() {
    // B·T·V = 2 · 1024 · 2^20 = 2^31: the loss runs over chunks of 64 rows.
    assert_eq!(
        admit_and_train(&gpt(1 << 20, 1024, 1, 2, 2)),
        Outcome::Trained
    );
}
