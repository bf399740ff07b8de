//! Replays every trace recorded from `torch.amp.GradScaler` and DeepSpeed's `DynamicLossScaler`
//! (tests/reference/loss_scaler_traces.json). Each case's config goes through the job-spec
//! parser (native spec for PyTorch, DeepSpeed config for DeepSpeed), so the translation of the
//! config keys and their defaults is checked too.

use std::collections::BTreeMap;

use runner::Error;
use runner::loss_scale::LossScaler;
use scheduler::spec::{DynamicLossScale, JobSpec, Purpose};
use serde_json::{Map, Value, json};

const TRACES: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/reference/loss_scaler_traces.json"
));

fn traces() -> Value {
    serde_json::from_str(TRACES).unwrap()
}

/// PyTorch GradScaler keyword arguments as a native spec's dynamic loss scale.
fn torch_scaler(config: &Map<String, Value>) -> LossScaler {
    let mut scale = json!({"semantics": "torch"});
    for (key, value) in config {
        let key = if key == "init_scale" { "init" } else { key };
        scale[key] = value.clone();
    }
    let spec = json!({
        "model": {"preset": "gpt2-tiny"},
        "precision": {"dtype": "fp16", "loss_scale": scale},
    });
    scaler_for(spec)
}

/// A DeepSpeed `fp16` section inside a DeepSpeed-form job.
fn deepspeed_scaler(fp16: &Map<String, Value>) -> LossScaler {
    let mut section = fp16.clone();
    section.insert("enabled".into(), true.into());
    let job = json!({
        "deepspeed": {"train_batch_size": 1, "fp16": section},
        "model": {"preset": "gpt2-tiny"},
    });
    scaler_for(job)
}

fn scaler_for(job: Value) -> LossScaler {
    let parsed = JobSpec::parse(&job.to_string(), Purpose::Train).unwrap();
    assert!(parsed.unsupported_keys.is_empty(), "{parsed:?}");
    LossScaler::new(parsed.spec.precision.effective_loss_scale())
}

fn overflows(case: &Value) -> Vec<bool> {
    if let Some(seq) = case.get("overflow_sequence") {
        return seq
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_bool().unwrap())
            .collect();
    }
    let mut seq = Vec::new();
    for run in case["overflow_sequence_rle"].as_array().unwrap() {
        let (value, count) = (run[0].as_bool().unwrap(), run[1].as_u64().unwrap());
        seq.extend(std::iter::repeat_n(value, count as usize));
    }
    seq
}

/// The recorded entries by 0-based step: every step, or for long cases only the steps where
/// the scale changed plus the last one.
fn expected(case: &Value, len: usize) -> BTreeMap<usize, Value> {
    if let Some(trace) = case.get("trace") {
        let trace = trace.as_array().unwrap();
        assert_eq!(trace.len(), len, "{}", case["name"]);
        return trace.iter().cloned().enumerate().collect();
    }
    assert_eq!(case["trace_len"].as_u64().unwrap() as usize, len);
    let entries = case["trace_changes_only"].as_array().unwrap();
    let by_step: BTreeMap<_, _> = entries
        .iter()
        .map(|e| (e["step"].as_u64().unwrap() as usize, e.clone()))
        .collect();
    assert!(
        by_step.contains_key(&(len - 1)),
        "the last step is recorded"
    );
    by_step
}

fn replay(case: &Value, mut scaler: LossScaler) {
    let name = case["name"].as_str().unwrap();
    let overflows = overflows(case);
    let expected = expected(case, overflows.len());
    let mut skipped = 0;
    for (step, &overflow) in overflows.iter().enumerate() {
        let used = scaler.scale();
        let result = scaler.update(overflow);
        let Some(want) = expected.get(&step) else {
            assert!(result.is_ok(), "{name} step {step}: {result:?}");
            assert_eq!(scaler.scale(), used, "{name} step {step}: scale unchanged");
            continue;
        };
        let ctx = format!("{name} step {step}");
        assert_eq!(want["overflow"].as_bool(), Some(overflow), "{ctx}");
        assert_eq!(
            f64::from(used),
            want["scale_used"].as_f64().unwrap(),
            "{ctx}"
        );
        if let Some(message) = want.get("raised") {
            assert!(message.as_str().unwrap().contains("already at minimum"));
            match result {
                Err(Error::LossScaleAtMinimum { scale, step: at }) => {
                    assert_eq!((scale, at), (used, step as u64), "{ctx}");
                }
                other => panic!("{ctx}: expected the minimum-scale error, got {other:?}"),
            }
            assert_eq!(step, overflows.len() - 1, "{ctx}: the run stops here");
        } else {
            let outcome = result.unwrap_or_else(|e| panic!("{ctx}: {e}"));
            assert_eq!(
                Some(outcome.is_skipped()),
                want["step_skipped"].as_bool(),
                "{ctx}"
            );
            skipped += u64::from(outcome.is_skipped());
        }
        let state = scaler.state();
        assert_eq!(
            f64::from(state.scale),
            want["scale_after_update"].as_f64().unwrap(),
            "{ctx}"
        );
        if let Some(tracker) = want.get("growth_tracker_after") {
            assert_eq!(
                Some(state.clean_steps),
                tracker.as_u64(),
                "{ctx}: growth tracker"
            );
        }
        if let Some(hysteresis) = want.get("hysteresis_after") {
            assert_eq!(
                Some(u64::from(state.hysteresis)),
                hysteresis.as_u64(),
                "{ctx}"
            );
        }
    }
    assert_eq!(
        scaler.skipped_steps(),
        skipped,
        "{name}: skipped steps counted"
    );
}

#[test]
fn replays_every_torch_gradscaler_trace() {
    let traces = traces();
    let cases = traces["torch_gradscaler"]["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let config = case["config"].as_object().unwrap();
        replay(case, torch_scaler(config));
    }
}

#[test]
fn replays_every_deepspeed_dynamic_loss_scaler_trace() {
    let traces = traces();
    let cases = traces["deepspeed_dynamic_loss_scaler"]["cases"]
        .as_array()
        .unwrap();
    assert_eq!(cases.len(), 9);
    for case in cases {
        let config = case["fp16_config"].as_object().unwrap();
        replay(case, deepspeed_scaler(config));
    }
}

#[test]
fn spec_defaults_are_the_recorded_implementations_defaults() {
    let traces = traces();
    let torch = &traces["torch_gradscaler"]["defaults"];
    let t = DynamicLossScale::torch();
    assert_eq!(
        [
            t.init,
            t.growth_factor,
            t.backoff_factor,
            f64::from(t.growth_interval)
        ],
        [
            "init_scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval"
        ]
        .map(|k| torch[k].as_f64().unwrap())
    );
    let ds = &traces["deepspeed_dynamic_loss_scaler"]["fp16_config_defaults"];
    let d = DynamicLossScale::deepspeed();
    assert_eq!(
        d.init,
        2f64.powi(ds["initial_scale_power"].as_i64().unwrap() as i32)
    );
    assert_eq!(
        Some(u64::from(d.growth_interval)),
        ds["loss_scale_window"].as_u64()
    );
    assert_eq!(Some(u64::from(d.hysteresis)), ds["hysteresis"].as_u64());
    assert_eq!(
        Some(d.consecutive_hysteresis),
        ds["consecutive_hysteresis"].as_bool()
    );
    assert_eq!(Some(d.min), ds["min_loss_scale"].as_f64());
}

#[test]
fn deepspeed_static_loss_scale_skips_overflows_at_a_fixed_scale() {
    let fp16 = json!({"loss_scale": 512.0});
    let mut scaler = deepspeed_scaler(fp16.as_object().unwrap());
    assert!(scaler.update(true).unwrap().is_skipped());
    assert!(!scaler.update(false).unwrap().is_skipped());
    assert_eq!(scaler.scale(), 512.0);
}

#[test]
fn bf16_and_fp32_jobs_do_not_scale() {
    for dtype in ["bf16", "fp32"] {
        let mut scaler = scaler_for(json!({
            "model": {"preset": "gpt2-tiny"},
            "precision": {"dtype": dtype},
        }));
        assert_eq!(scaler.scale(), 1.0);
        assert!(!scaler.update(true).unwrap().is_skipped());
    }
}
