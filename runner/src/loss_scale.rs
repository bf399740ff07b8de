//! `loss_scale`: fp16 loss scaling. The loss is multiplied by `scale()` before backward so that
//! small gradients survive fp16; `update` is told whether the unscaled gradients held an inf or
//! NaN and says whether the optimizer step must be skipped.
//!
//! Dynamic scaling follows `torch.amp.GradScaler` or DeepSpeed's `DynamicLossScaler`, chosen by
//! `ScalerSemantics`; `tests/loss_scale.rs` replays traces recorded from both implementations.
//! They differ in when the scale grows:
//! - PyTorch grows on the `growth_interval`-th consecutive clean step, then counts again from 0;
//! - DeepSpeed grows when the clean steps *before* this one since the last overflow (or the
//!   start) are a positive multiple of `loss_scale_window`: first on the (window+1)-th clean
//!   step, then every window, without restarting the count at a growth.
//!
//! Hysteresis (DeepSpeed's delayed shift) lets `hysteresis - 1` overflows skip the step without
//! backing off; it is refilled on growth, or after every clean step with
//! `consecutive_hysteresis`. GradScaler has none, so its default of 1 keeps PyTorch's behaviour,
//! and a larger value acts as in DeepSpeed.

use scheduler::spec::{DynamicLossScale, LossScale, ScalerSemantics};
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The fp16 loss scale of one training run.
#[derive(Debug, Clone)]
pub struct LossScaler {
    rule: Rule,
    state: State,
}

#[derive(Debug, Clone, Copy)]
enum Rule {
    /// No scaling (fp32, bf16): the scale is 1 and no step is skipped.
    Off,
    /// A fixed scale; an overflowing step is still skipped, as DeepSpeed's static scaler does.
    Static,
    Dynamic(DynamicLossScale),
}

/// What the scaler remembers between steps; saved in checkpoints so that a resumed run scales
/// exactly as an uninterrupted one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// The scale the next step's loss is multiplied by.
    pub scale: f32,
    /// Consecutive clean steps counted towards the next growth: since the last overflow or
    /// growth (PyTorch's `_growth_tracker`), or since the last overflow only (DeepSpeed).
    pub clean_steps: u64,
    /// Overflows left before the scale backs off (DeepSpeed's `cur_hysteresis`).
    pub hysteresis: u32,
    /// Updates so far, i.e. the index of the next step (DeepSpeed's `cur_iter`).
    pub steps: u64,
    /// Optimizer steps skipped because of an overflow.
    pub skipped_steps: u64,
}

/// Whether the optimizer step that `update` was told about goes ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    /// Gradients overflowed: leave the weights and optimizer state untouched.
    Skipped,
}

impl Outcome {
    pub fn is_skipped(self) -> bool {
        self == Outcome::Skipped
    }
}

impl LossScaler {
    /// `None` disables scaling; pass `Precision::effective_loss_scale()`.
    pub fn new(loss_scale: Option<LossScale>) -> Self {
        let (rule, scale, hysteresis) = match loss_scale {
            None => (Rule::Off, 1.0, 1),
            Some(LossScale::Static(s)) => (Rule::Static, s as f32, 1),
            Some(LossScale::Dynamic(d)) => (Rule::Dynamic(d), d.init as f32, d.hysteresis),
        };
        LossScaler {
            rule,
            state: State {
                scale,
                clean_steps: 0,
                hysteresis,
                steps: 0,
                skipped_steps: 0,
            },
        }
    }

    /// The factor to multiply this step's loss by (and divide the gradients by).
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    pub fn skipped_steps(&self) -> u64 {
        self.state.skipped_steps
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn restore(&mut self, state: State) {
        self.state = state;
    }

    /// Records one optimizer step; `found_inf` is whether any rank's unscaled gradients held an
    /// inf or NaN. Fails, leaving the state as it was, when an overflow happens with the scale
    /// already at its minimum.
    pub fn update(&mut self, found_inf: bool) -> Result<Outcome, Error> {
        let outcome = match self.rule {
            Rule::Off => Outcome::Applied,
            Rule::Static if found_inf => Outcome::Skipped,
            Rule::Static => Outcome::Applied,
            Rule::Dynamic(d) if found_inf => {
                self.back_off(&d)?;
                Outcome::Skipped
            }
            Rule::Dynamic(d) => {
                self.clean_step(&d);
                Outcome::Applied
            }
        };
        if outcome.is_skipped() {
            self.state.skipped_steps += 1;
        }
        self.state.steps += 1;
        Ok(outcome)
    }

    fn back_off(&mut self, d: &DynamicLossScale) -> Result<(), Error> {
        let s = &mut self.state;
        if s.hysteresis > 1 {
            s.hysteresis -= 1;
        } else if f64::from(s.scale) <= d.min {
            return Err(Error::LossScaleAtMinimum {
                scale: s.scale,
                step: s.steps,
            });
        } else {
            s.scale = (f64::from(s.scale) * d.backoff_factor).max(d.min) as f32;
        }
        s.clean_steps = 0;
        Ok(())
    }

    fn clean_step(&mut self, d: &DynamicLossScale) {
        let s = &mut self.state;
        let window = u64::from(d.growth_interval);
        if d.consecutive_hysteresis {
            s.hysteresis = d.hysteresis;
        }
        let grow = match d.semantics {
            ScalerSemantics::Torch => {
                s.clean_steps += 1;
                let grow = s.clean_steps == window;
                if grow {
                    s.clean_steps = 0;
                }
                grow
            }
            ScalerSemantics::Deepspeed => {
                let grow = s.clean_steps > 0 && s.clean_steps.is_multiple_of(window);
                s.clean_steps += 1;
                grow
            }
        };
        if grow {
            s.hysteresis = d.hysteresis;
            // PyTorch keeps the old scale rather than grow to infinity; in DeepSpeed's float64
            // this cannot be reached in practice.
            let grown = (f64::from(s.scale) * d.growth_factor) as f32;
            if grown.is_finite() {
                s.scale = grown;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_scaling_keeps_scale_one_and_never_skips() {
        let mut scaler = LossScaler::new(None);
        assert_eq!(scaler.scale(), 1.0);
        assert_eq!(scaler.update(true).unwrap(), Outcome::Applied);
        assert_eq!(scaler.scale(), 1.0);
        assert_eq!(scaler.skipped_steps(), 0);
    }

    #[test]
    fn static_scale_skips_overflowing_steps_without_changing() {
        let mut scaler = LossScaler::new(Some(LossScale::Static(128.0)));
        assert_eq!(scaler.update(true).unwrap(), Outcome::Skipped);
        for _ in 0..5000 {
            assert_eq!(scaler.update(false).unwrap(), Outcome::Applied);
        }
        assert_eq!(scaler.scale(), 128.0);
        assert_eq!(scaler.skipped_steps(), 1);
    }

    #[test]
    fn torch_overflow_at_minimum_is_an_error_and_leaves_state_unchanged() {
        let d = DynamicLossScale {
            init: 4.0,
            ..DynamicLossScale::torch()
        };
        let mut scaler = LossScaler::new(Some(LossScale::Dynamic(d)));
        for scale_after in [2.0, 1.0] {
            assert!(scaler.update(true).unwrap().is_skipped());
            assert_eq!(scaler.scale(), scale_after);
        }
        let before = scaler.state();
        let err = scaler.update(true).unwrap_err();
        assert!(matches!(err, Error::LossScaleAtMinimum { scale, step: 2 } if scale == 1.0));
        assert!(err.to_string().contains("already at its minimum"));
        assert_eq!(scaler.state(), before);
    }

    #[test]
    fn growth_that_would_reach_infinity_keeps_the_scale() {
        let d = DynamicLossScale {
            init: 2f64.powi(127),
            growth_interval: 1,
            ..DynamicLossScale::torch()
        };
        let mut scaler = LossScaler::new(Some(LossScale::Dynamic(d)));
        scaler.update(false).unwrap();
        assert_eq!(scaler.scale(), 2f32.powi(127));
    }

    #[test]
    fn restored_state_continues_like_the_original() {
        let d = DynamicLossScale {
            growth_interval: 3,
            ..DynamicLossScale::deepspeed()
        };
        let pattern = [
            true, false, false, true, true, false, false, false, false, false,
        ];
        let mut whole = LossScaler::new(Some(LossScale::Dynamic(d)));
        let mut first = LossScaler::new(Some(LossScale::Dynamic(d)));
        for &inf in &pattern[..4] {
            whole.update(inf).unwrap();
            first.update(inf).unwrap();
        }
        let json = serde_json::to_string(&first.state()).unwrap();
        let mut resumed = LossScaler::new(Some(LossScale::Dynamic(d)));
        resumed.restore(serde_json::from_str(&json).unwrap());
        for &inf in &pattern[4..] {
            assert_eq!(whole.update(inf).unwrap(), resumed.update(inf).unwrap());
            assert_eq!(whole.state(), resumed.state());
        }
    }
}
