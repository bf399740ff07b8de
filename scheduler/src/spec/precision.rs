//! `precision`: the compute dtype and, for fp16, the loss scale.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::Problems;

/// Compute dtype. fp16 and bf16 keep fp32 master weights in the optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    Fp32,
    Fp16,
    Bf16,
}

impl Dtype {
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Fp32 => 4,
            Dtype::Fp16 | Dtype::Bf16 => 2,
        }
    }

    /// Whether the optimizer keeps a separate fp32 master copy of the weights.
    pub fn has_master_weights(self) -> bool {
        self != Dtype::Fp32
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Precision {
    /// `fp32` (default), `fp16` or `bf16`.
    #[serde(default)]
    pub dtype: Dtype,
    /// fp16 only: a number for a static scale, or an object for a dynamic one. Default: dynamic
    /// with PyTorch GradScaler semantics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScale>,
}

impl Precision {
    /// The loss scale in effect: none unless fp16.
    pub fn effective_loss_scale(&self) -> Option<LossScale> {
        (self.dtype == Dtype::Fp16).then(|| {
            self.loss_scale
                .unwrap_or(LossScale::Dynamic(DynamicLossScale::torch()))
        })
    }

    pub(super) fn validate(&self, p: &mut Problems) {
        let Some(scale) = self.loss_scale else {
            return;
        };
        p.ensure(self.dtype == Dtype::Fp16, "precision.loss_scale", || {
            format!("only fp16 takes a loss scale, not {:?}", self.dtype).to_lowercase()
        });
        match scale {
            LossScale::Static(s) => {
                p.ensure(s.is_finite() && s > 0.0, "precision.loss_scale", || {
                    format!("static scale {s} must be a positive number")
                });
            }
            LossScale::Dynamic(d) => d.validate(p),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossScale {
    Static(f64),
    Dynamic(DynamicLossScale),
}

impl Serialize for LossScale {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            LossScale::Static(v) => s.serialize_f64(*v),
            LossScale::Dynamic(d) => d.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for LossScale {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::Number(n) => Ok(LossScale::Static(n.as_f64().unwrap_or(f64::NAN))),
            v @ serde_json::Value::Object(_) => DynamicLossScale::deserialize(v)
                .map(LossScale::Dynamic)
                .map_err(D::Error::custom),
            other => Err(D::Error::custom(format!(
                "expected a number (static scale) or an object (dynamic scale), got {other}"
            ))),
        }
    }
}

/// Whose dynamic loss-scaling rules apply; they differ in growth timing and hysteresis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScalerSemantics {
    /// `torch.amp.GradScaler`.
    #[default]
    Torch,
    /// DeepSpeed's `DynamicLossScaler`.
    Deepspeed,
}

/// Dynamic loss scaling. Defaults follow the chosen semantics: PyTorch (init 65536, growth
/// ×2 every 2000 clean steps, backoff ×0.5, hysteresis 1) or DeepSpeed (init 2^16, window 1000,
/// hysteresis 2); both stop the job when an overflow happens at `min` (default 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(from = "DynamicDoc")]
pub struct DynamicLossScale {
    pub semantics: ScalerSemantics,
    pub init: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    /// Clean steps between growths (DeepSpeed's `loss_scale_window`).
    pub growth_interval: u32,
    /// Overflows tolerated before backing off (DeepSpeed's delayed shift); 1 backs off at once.
    pub hysteresis: u32,
    /// DeepSpeed: refill hysteresis after every clean step rather than only on growth.
    pub consecutive_hysteresis: bool,
    pub min: f64,
}

impl DynamicLossScale {
    pub fn torch() -> Self {
        DynamicLossScale {
            semantics: ScalerSemantics::Torch,
            init: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min: 1.0,
        }
    }

    pub fn deepspeed() -> Self {
        DynamicLossScale {
            semantics: ScalerSemantics::Deepspeed,
            growth_interval: 1000,
            hysteresis: 2,
            ..Self::torch()
        }
    }

    fn validate(&self, p: &mut Problems) {
        let f = |name: &str| format!("precision.loss_scale.{name}");
        let init_ok = p.ensure(self.init.is_finite() && self.init > 0.0, &f("init"), || {
            format!("{} must be a positive number", self.init)
        });
        p.ensure(
            self.growth_factor > 1.0 && self.growth_factor.is_finite(),
            &f("growth_factor"),
            || format!("{} must be greater than 1", self.growth_factor),
        );
        p.ensure(
            self.backoff_factor > 0.0 && self.backoff_factor < 1.0,
            &f("backoff_factor"),
            || format!("{} must be between 0 and 1", self.backoff_factor),
        );
        p.ensure(self.growth_interval > 0, &f("growth_interval"), || {
            "must be positive".into()
        });
        p.ensure(self.hysteresis > 0, &f("hysteresis"), || {
            "must be positive".into()
        });
        if init_ok {
            p.ensure(self.min > 0.0 && self.min <= self.init, &f("min"), || {
                format!(
                    "{} must be positive and at most init {}",
                    self.min, self.init
                )
            });
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DynamicDoc {
    #[serde(default)]
    semantics: ScalerSemantics,
    init: Option<f64>,
    growth_factor: Option<f64>,
    backoff_factor: Option<f64>,
    growth_interval: Option<u32>,
    hysteresis: Option<u32>,
    consecutive_hysteresis: Option<bool>,
    min: Option<f64>,
}

impl From<DynamicDoc> for DynamicLossScale {
    fn from(d: DynamicDoc) -> Self {
        let base = match d.semantics {
            ScalerSemantics::Torch => DynamicLossScale::torch(),
            ScalerSemantics::Deepspeed => DynamicLossScale::deepspeed(),
        };
        DynamicLossScale {
            semantics: d.semantics,
            init: d.init.unwrap_or(base.init),
            growth_factor: d.growth_factor.unwrap_or(base.growth_factor),
            backoff_factor: d.backoff_factor.unwrap_or(base.backoff_factor),
            growth_interval: d.growth_interval.unwrap_or(base.growth_interval),
            hysteresis: d.hysteresis.unwrap_or(base.hysteresis),
            consecutive_hysteresis: d
                .consecutive_hysteresis
                .unwrap_or(base.consecutive_hysteresis),
            min: d.min.unwrap_or(base.min),
        }
    }
}
