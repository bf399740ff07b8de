//! `training`: batch geometry, length, learning-rate schedule, seed and clipping.

use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

use super::{Architecture, Auto};
use crate::error::Problems;

/// The micro-batch `"auto"` starts from when no `batch_size` is given.
pub const DEFAULT_MICRO_BATCH: u32 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    Constant,
    #[default]
    Cosine,
    Linear,
}

/// How the learning rate rises during warmup: linearly, or logarithmically as DeepSpeed's
/// `warmup_type: "log"` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    #[default]
    Linear,
    Log,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Training {
    /// Sequences per rank per forward/backward. Default 4; `"auto"` lets the planner shrink it
    /// (raising accumulation so the batch is unchanged).
    pub micro_batch_size: Auto<NonZeroU32>,
    /// Global batch in sequences per optimizer step. Default: micro-batch × accumulation ×
    /// world size; when given it must agree with them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<NonZeroU32>,
    /// Tokens per sequence. Default 64; at most the model's context length.
    pub seq_len: NonZeroU32,
    /// Micro-batches per optimizer step. Default 1.
    pub grad_accum_steps: NonZeroU32,
    /// Optimizer steps. Default 50.
    pub steps: NonZeroU32,
    /// Peak learning rate. Default 3e-4.
    pub lr: f64,
    /// Learning rate the decay ends at. Default 0.
    pub min_lr: f64,
    /// Steps of warmup from `warmup_start_lr` to `lr`. Default 0.
    pub warmup_steps: u32,
    pub warmup_type: WarmupType,
    /// Default 0.
    pub warmup_start_lr: f64,
    /// After warmup: `constant`, `cosine` (default) or `linear` decay to `min_lr`.
    pub lr_schedule: LrSchedule,
    /// Step at which the decay reaches `min_lr`. Default: `steps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decay_steps: Option<NonZeroU32>,
    /// Seeds initialisation, data order and the synthetic corpus. Default 1.
    pub seed: u64,
    /// Global gradient-norm clipping threshold; 0 disables it. Default 1.0.
    pub grad_clip: f64,
}

impl Default for Training {
    fn default() -> Self {
        Training {
            micro_batch_size: Auto::Fixed(NonZeroU32::new(DEFAULT_MICRO_BATCH).unwrap()),
            batch_size: None,
            seq_len: NonZeroU32::new(64).unwrap(),
            grad_accum_steps: NonZeroU32::MIN,
            steps: NonZeroU32::new(50).unwrap(),
            lr: 3e-4,
            min_lr: 0.0,
            warmup_steps: 0,
            warmup_type: WarmupType::Linear,
            warmup_start_lr: 0.0,
            lr_schedule: LrSchedule::Cosine,
            decay_steps: None,
            seed: 1,
            grad_clip: 1.0,
        }
    }
}

impl Training {
    /// Sequences each rank processes per optimizer step (micro-batch × accumulation).
    pub fn sequences_per_rank(&self, world_size: NonZeroU32) -> u32 {
        match (self.batch_size, self.micro_batch_size) {
            (Some(b), _) => b.get() / world_size.get(),
            (None, Auto::Fixed(m)) => m.get() * self.grad_accum_steps.get(),
            (None, Auto::Auto) => DEFAULT_MICRO_BATCH * self.grad_accum_steps.get(),
        }
    }

    /// The step at which the decay reaches `min_lr`.
    pub fn decay_horizon(&self) -> u32 {
        self.decay_steps.unwrap_or(self.steps).get()
    }

    /// Records the mistakes of these fields; checks against the model and the world size run
    /// only when those were read without mistakes (`Some`).
    pub(super) fn validate(
        &self,
        arch: Option<&Architecture>,
        world: Option<NonZeroU32>,
        p: &mut Problems,
    ) {
        let t = self.seq_len.get() as usize;
        match arch {
            Some(Architecture::Gpt(s)) => {
                p.ensure(t <= s.context_length, "training.seq_len", || {
                    format!("{t} exceeds model.context_length {}", s.context_length)
                });
            }
            Some(Architecture::Llama(s)) => {
                p.ensure(t <= s.max_position_embeddings, "training.seq_len", || {
                    format!(
                        "{t} exceeds the model's max_position_embeddings {}",
                        s.max_position_embeddings
                    )
                });
                if let Some(w) = s.sliding_window {
                    p.ensure(t <= w, "model.config.sliding_window", || {
                        format!(
                            "{w} is shorter than training.seq_len {t}: zerotrain computes full \
                             causal attention, which a window no shorter than the sequence equals"
                        )
                    });
                }
            }
            Some(Architecture::Params(_)) | None => {}
        }
        if let Some(world) = world {
            self.validate_batch(world, p);
        }
        let mut finite = Vec::new();
        for (field, v) in [
            ("training.lr", self.lr),
            ("training.min_lr", self.min_lr),
            ("training.warmup_start_lr", self.warmup_start_lr),
            ("training.grad_clip", self.grad_clip),
        ] {
            if p.ensure(v.is_finite() && v >= 0.0, field, || {
                format!("{v} must be a finite number ≥ 0")
            }) {
                finite.push(field);
            }
        }
        let lr_ok = finite.contains(&"training.lr")
            && p.ensure(self.lr > 0.0, "training.lr", || "must be positive".into());
        for (field, v) in [
            ("training.min_lr", self.min_lr),
            ("training.warmup_start_lr", self.warmup_start_lr),
        ] {
            if lr_ok && finite.contains(&field) {
                p.ensure(v <= self.lr, field, || {
                    format!("{v} exceeds training.lr {}", self.lr)
                });
            }
        }
        if self.lr_schedule != LrSchedule::Constant {
            let horizon = self.decay_horizon();
            p.ensure(self.warmup_steps < horizon, "training.warmup_steps", || {
                format!(
                    "{} must be less than the decay horizon {horizon} (training.decay_steps, else training.steps)",
                    self.warmup_steps
                )
            });
        }
    }

    /// The batch geometry against `world` ranks. In u64: micro × accumulation × world can
    /// exceed u32 (and must then be refused).
    fn validate_batch(&self, world: NonZeroU32, p: &mut Problems) {
        let accum = u64::from(self.grad_accum_steps.get());
        let w = u64::from(world.get());
        match (self.batch_size, self.micro_batch_size) {
            (Some(b), micro) => {
                let b = u64::from(b.get());
                let divisible = p.ensure(b % w == 0, "training.batch_size", || {
                    format!("{b} is not divisible by world_size {world}")
                });
                if let (true, Auto::Fixed(m)) = (divisible, micro) {
                    let implied = u64::from(m.get()) * accum * w;
                    p.ensure(b == implied, "training.batch_size", || {
                        format!(
                            "{b} disagrees with micro_batch_size {m} × grad_accum_steps {accum} × world_size {world} = {implied}"
                        )
                    });
                }
            }
            (None, micro) => {
                let m = u64::from(micro.fixed().map_or(DEFAULT_MICRO_BATCH, NonZeroU32::get));
                let implied = m * accum * w;
                p.ensure(
                    implied <= u64::from(u32::MAX),
                    "training.grad_accum_steps",
                    || {
                        format!(
                            "micro_batch_size {m} × grad_accum_steps {accum} × world_size {world} = {implied} is more than {} sequences per step",
                            u32::MAX
                        )
                    },
                );
            }
        }
    }
}
