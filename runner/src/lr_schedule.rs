//! `lr_schedule`: the learning rate of each optimizer step (counted from 0).
//!
//! Warmup rises from `warmup_start_lr` to `lr` over `warmup_steps`, then the rate stays at `lr`
//! (`constant`) or decays to `min_lr`, reaching it at `decay_horizon()` and staying there. The
//! formulas are DeepSpeed's (`deepspeed/runtime/lr_schedules.py`), evaluated at
//! `last_batch_iteration = step`, so DeepSpeed-form jobs train as they would there:
//! - linear warmup `start + (lr - start)·step/warmup` and log warmup
//!   `start + (lr - start)·ln(step + 1)/ln(warmup)` (WarmupLR); DeepSpeed warms up over at least
//!   2 steps, which log warmup needs (ln 1 = 0), so it does here too;
//! - linear decay `min + (lr - min)·(horizon - step)/(horizon - warmup)` (WarmupDecayLR);
//! - cosine decay as nanoGPT: `min + (lr - min)·(1 + cos(π·(step - warmup)/(horizon - warmup)))/2`.
//!   DeepSpeed's WarmupCosineLR computes the same curve one iteration earlier
//!   (`step - warmup + 1`); its engine applies iteration i's rate at step i + 1, so its applied
//!   rates after warmup are the ones here.

use std::f64::consts::PI;

use scheduler::spec::{LrSchedule, Training, WarmupType};

/// The learning rate for optimizer step `step`.
pub fn lr(t: &Training, step: u32) -> f64 {
    let (start, peak, floor) = (t.warmup_start_lr, t.lr, t.min_lr);
    let warmup = match t.warmup_type {
        WarmupType::Log if t.warmup_steps > 0 => t.warmup_steps.max(2),
        _ => t.warmup_steps,
    };
    if step < warmup {
        let progress = match t.warmup_type {
            WarmupType::Linear => f64::from(step) / f64::from(warmup),
            WarmupType::Log => (1.0 / f64::from(warmup).ln()) * f64::from(step + 1).ln(),
        };
        return start + (peak - start) * progress;
    }
    let horizon = t.decay_horizon();
    if t.lr_schedule == LrSchedule::Constant {
        return peak;
    }
    if step >= horizon {
        return floor;
    }
    let span = f64::from(horizon - warmup);
    let coeff = match t.lr_schedule {
        LrSchedule::Linear => f64::from(horizon - step) / span,
        LrSchedule::Cosine => 0.5 * (1.0 + (PI * f64::from(step - warmup) / span).cos()),
        LrSchedule::Constant => 1.0,
    };
    floor + coeff * (peak - floor)
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use scheduler::spec::{JobSpec, Purpose};

    use super::*;

    fn training(schedule: LrSchedule, warmup: u32, kind: WarmupType) -> Training {
        Training {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_start_lr: 1e-5,
            warmup_steps: warmup,
            warmup_type: kind,
            lr_schedule: schedule,
            steps: NonZeroU32::new(110).unwrap(),
            ..Training::default()
        }
    }

    /// The training section of a DeepSpeed-form job with this `scheduler` and optimizer lr 1e-3.
    fn deepspeed(scheduler: serde_json::Value) -> Training {
        let job = serde_json::json!({
            "deepspeed": {
                "train_batch_size": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "scheduler": scheduler,
            },
            "model": {"preset": "gpt2-tiny"},
            "training": {"steps": 200},
        });
        let parsed = JobSpec::parse(&job.to_string(), Purpose::Train).unwrap();
        assert!(parsed.unsupported_keys.is_empty());
        parsed.spec.training
    }

    #[test]
    fn linear_warmup_then_cosine_decay_follows_nanogpt() {
        let t = training(LrSchedule::Cosine, 10, WarmupType::Linear);
        assert_eq!(lr(&t, 0), 1e-5);
        assert_eq!(lr(&t, 5), 1e-5 + (1e-3 - 1e-5) * 0.5);
        assert_eq!(lr(&t, 10), 1e-3);
        // Halfway through the decay (step 60 of 10..110) cos(π/2) = 0.
        assert!((lr(&t, 60) - 5.5e-4).abs() < 1e-15);
        assert!((lr(&t, 35) - (1e-4 + 0.5 * (1.0 + (PI / 4.0).cos()) * 9e-4)).abs() < 1e-15);
        assert_eq!(lr(&t, 110), 1e-4);
        assert_eq!(lr(&t, 500), 1e-4);
    }

    #[test]
    fn constant_schedule_holds_the_peak_after_warmup() {
        let t = training(LrSchedule::Constant, 4, WarmupType::Linear);
        assert_eq!(lr(&t, 3), 1e-5 + (1e-3 - 1e-5) * 0.75);
        assert_eq!(lr(&t, 4), 1e-3);
        assert_eq!(lr(&t, 10_000), 1e-3);
    }

    #[test]
    fn no_warmup_starts_at_the_peak() {
        let t = training(LrSchedule::Linear, 0, WarmupType::Log);
        assert_eq!(lr(&t, 0), 1e-3);
        assert_eq!(lr(&t, 55), 1e-4 + 0.5 * (1e-3 - 1e-4));
    }

    #[test]
    fn log_warmup_over_one_step_lasts_two_as_in_deepspeed() {
        let t = training(LrSchedule::Constant, 1, WarmupType::Log);
        assert_eq!(lr(&t, 0), 1e-5);
        assert_eq!(
            lr(&t, 1),
            1e-5 + (1e-3 - 1e-5) * (1.0 / 2f64.ln()) * 2f64.ln()
        );
        assert_eq!(lr(&t, 2), 1e-3);
    }

    #[test]
    fn deepspeed_warmup_lr_matches_its_log_warmup_formula() {
        let t = deepspeed(serde_json::json!({"type": "WarmupLR", "params": {
            "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 50,
        }}));
        let inverse_log_warm_up = 1.0 / 50f64.ln();
        for step in [0u32, 1, 7, 49] {
            let gamma = inverse_log_warm_up * f64::from(step + 1).ln();
            assert_eq!(lr(&t, step), 1e-5 + (2e-3 - 1e-5) * gamma, "step {step}");
        }
        assert_eq!(lr(&t, 50), 2e-3);
        assert_eq!(lr(&t, 199), 2e-3);
    }

    #[test]
    fn deepspeed_warmup_decay_lr_matches_its_linear_formulas() {
        let t = deepspeed(serde_json::json!({"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 20,
            "warmup_type": "linear", "total_num_steps": 120,
        }}));
        let (min, delta) = (1e-5, 2e-3 - 1e-5);
        for step in 0u32..130 {
            let gamma = if step < 20 {
                f64::from(step) / 20.0
            } else {
                (f64::from(120i32 - step as i32) / 100.0).max(0.0)
            };
            assert_eq!(lr(&t, step), min + delta * gamma, "step {step}");
        }
    }

    #[test]
    fn deepspeed_warmup_cosine_lr_is_matched_one_iteration_later() {
        let t = deepspeed(serde_json::json!({"type": "WarmupCosineLR", "params": {
            "warmup_min_ratio": 0.1, "warmup_num_steps": 10, "cos_min_ratio": 0.05,
            "total_num_steps": 110,
        }}));
        let org_lr = 1e-3;
        // WarmupCosineLR.get_lr_ratio at `last_batch_iteration = i`.
        let ratio = |i: u32| -> f64 {
            if i < 10 {
                let r = (1.0 / 10f64.ln()) * f64::from(i + 1).ln();
                return 0.1 + r * (1.0 - 0.1);
            }
            let progress = (f64::from(i - 10 + 1) / 100.0).min(1.0);
            (0.05 + (1.0 - 0.05) * (1.0 + (PI * progress).cos()) / 2.0).max(0.0)
        };
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-14 * b.abs();
        for step in 0..10 {
            assert!(
                close(lr(&t, step), org_lr * ratio(step)),
                "warmup step {step}"
            );
        }
        for step in 11..=150 {
            assert!(close(lr(&t, step), org_lr * ratio(step - 1)), "step {step}");
        }
    }
}
