//! `optimizer`: the update rule and its hyper-parameters (the learning rate is `training.lr`).
//! Weight decay is decoupled (applied as `p -= lr·wd·p`) for every optimizer, and only to
//! matrices.

use serde::{Deserialize, Serialize};
use strum::{EnumDiscriminants, IntoStaticStr};

use serde_json::Value;

use super::from_value;
use crate::error::{Error, Problems};

#[derive(
    Debug, Clone, Copy, PartialEq, Serialize, Deserialize, IntoStaticStr, EnumDiscriminants,
)]
#[serde(tag = "type", rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
#[strum_discriminants(
    name(OptimizerKind),
    doc = "Which update rule, without its hyper-parameters (what a checkpoint's state is of).",
    derive(Serialize, Deserialize, IntoStaticStr),
    serde(rename_all = "lowercase"),
    strum(serialize_all = "lowercase")
)]
pub enum Optimizer {
    Sgd(Sgd),
    Momentum(Momentum),
    Adamw(AdamW),
    Lion(Lion),
    Adafactor(AdaFactor),
    Adam8bit(Adam8bit),
}

impl Optimizer {
    /// The mistakes of the `optimizer` block `block` (at `path`) read as the variant its `type`
    /// names, each at its own field; `None` when the type is unknown or the variant reads.
    pub(super) fn mistake_inside(block: &Value, path: &str) -> Option<Error> {
        let mut fields = block.as_object()?.clone();
        let kind: OptimizerKind = serde_json::from_value(fields.remove("type")?).ok()?;
        let fields = Value::Object(fields);
        let inside = match kind {
            OptimizerKind::Sgd => from_value::<Sgd>(fields).err(),
            OptimizerKind::Momentum => from_value::<Momentum>(fields).err(),
            OptimizerKind::Adamw => from_value::<AdamW>(fields).err(),
            OptimizerKind::Lion => from_value::<Lion>(fields).err(),
            OptimizerKind::Adafactor => from_value::<AdaFactor>(fields).err(),
            OptimizerKind::Adam8bit => from_value::<Adam8bit>(fields).err(),
        }?;
        let Error::InvalidSpec(mut errors) = inside else {
            return None;
        };
        for e in &mut errors {
            e.field = match e.field.as_str() {
                "spec" => path.to_string(),
                inner => format!("{path}.{inner}"),
            };
        }
        Some(Error::InvalidSpec(errors))
    }
}

impl Default for Optimizer {
    fn default() -> Self {
        Optimizer::Adamw(AdamW::default())
    }
}

/// Plain SGD. Default weight_decay 0.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sgd {
    pub weight_decay: f64,
}

/// SGD with momentum, PyTorch semantics (dampening 0). Defaults: momentum 0.9, nesterov false.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Momentum {
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
}

impl Default for Momentum {
    fn default() -> Self {
        Momentum {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
        }
    }
}

/// AdamW, `torch.optim.AdamW` defaults: betas [0.9, 0.999], eps 1e-8, weight_decay 0.01.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamW {
    pub betas: [f64; 2],
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// Lion (Chen et al. 2023). Defaults: betas [0.9, 0.99], weight_decay 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Lion {
    pub betas: [f64; 2],
    pub weight_decay: f64,
}

impl Default for Lion {
    fn default() -> Self {
        Lion {
            betas: [0.9, 0.99],
            weight_decay: 0.0,
        }
    }
}

/// Adafactor with a factored second moment (Hugging Face semantics with an external learning
/// rate: `relative_step=False, scale_parameter=False`). Defaults: eps 1e-30, clip_threshold 1.0,
/// decay_rate -0.8, beta1 null (no first moment), weight_decay 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdaFactor {
    pub eps: f64,
    pub clip_threshold: f64,
    pub decay_rate: f64,
    pub beta1: Option<f64>,
    pub weight_decay: f64,
}

impl Default for AdaFactor {
    fn default() -> Self {
        AdaFactor {
            eps: 1e-30,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            weight_decay: 0.0,
        }
    }
}

/// Block-wise 8-bit AdamW (bitsandbytes semantics: dynamic quantisation maps, one fp32 absmax
/// per block of each state). Defaults as AdamW, block_size 2048.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Adam8bit {
    pub betas: [f64; 2],
    pub eps: f64,
    pub weight_decay: f64,
    pub block_size: u32,
}

impl Default for Adam8bit {
    fn default() -> Self {
        let a = AdamW::default();
        Adam8bit {
            betas: a.betas,
            eps: a.eps,
            weight_decay: a.weight_decay,
            block_size: 2048,
        }
    }
}

impl Optimizer {
    pub fn weight_decay(&self) -> f64 {
        match self {
            Optimizer::Sgd(o) => o.weight_decay,
            Optimizer::Momentum(o) => o.weight_decay,
            Optimizer::Adamw(o) => o.weight_decay,
            Optimizer::Lion(o) => o.weight_decay,
            Optimizer::Adafactor(o) => o.weight_decay,
            Optimizer::Adam8bit(o) => o.weight_decay,
        }
    }

    /// The `type` it is written with.
    pub fn name(&self) -> &'static str {
        self.into()
    }

    pub fn kind(&self) -> OptimizerKind {
        self.into()
    }

    pub(super) fn validate(&self, p: &mut Problems) {
        let wd = self.weight_decay();
        p.ensure(
            wd.is_finite() && wd >= 0.0,
            "optimizer.weight_decay",
            || format!("{wd} must be a finite number ≥ 0"),
        );
        let betas = |b: [f64; 2], p: &mut Problems| {
            for (i, v) in b.into_iter().enumerate() {
                p.ensure(
                    (0.0..1.0).contains(&v),
                    &format!("optimizer.betas[{i}]"),
                    || format!("{v} must be in [0, 1)"),
                );
            }
        };
        let eps = |e: f64, p: &mut Problems| {
            p.ensure(e.is_finite() && e > 0.0, "optimizer.eps", || {
                format!("{e} must be positive")
            });
        };
        match *self {
            Optimizer::Sgd(_) => {}
            Optimizer::Momentum(m) => {
                if p.ensure(
                    (0.0..1.0).contains(&m.momentum),
                    "optimizer.momentum",
                    || format!("{} must be in [0, 1)", m.momentum),
                ) {
                    p.ensure(
                        !m.nesterov || m.momentum > 0.0,
                        "optimizer.nesterov",
                        || "nesterov needs a positive momentum".into(),
                    );
                }
            }
            Optimizer::Adamw(a) => {
                betas(a.betas, p);
                eps(a.eps, p);
            }
            Optimizer::Lion(l) => betas(l.betas, p),
            Optimizer::Adafactor(a) => {
                eps(a.eps, p);
                p.ensure(a.clip_threshold > 0.0, "optimizer.clip_threshold", || {
                    format!("{} must be positive", a.clip_threshold)
                });
                p.ensure(
                    (-1.0..0.0).contains(&a.decay_rate),
                    "optimizer.decay_rate",
                    || format!("{} must be in [-1, 0)", a.decay_rate),
                );
                if let Some(b) = a.beta1 {
                    p.ensure((0.0..1.0).contains(&b), "optimizer.beta1", || {
                        format!("{b} must be in [0, 1)")
                    });
                }
            }
            Optimizer::Adam8bit(a) => {
                betas(a.betas, p);
                eps(a.eps, p);
                let b = a.block_size;
                p.ensure(
                    b.is_power_of_two() && (64..=1 << 16).contains(&b),
                    "optimizer.block_size",
                    || format!("{b} must be a power of two between 64 and 65536"),
                );
            }
        }
    }
}
