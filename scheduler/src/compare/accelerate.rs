//! accelerate 1.15's `accelerate estimate-memory` (`accelerate/commands/estimate.py`,
//! `estimate_training_usage`): training memory of one unsharded device for batch size 1, from
//! the model's fp32 size. "Training using Adam" is the largest of four phases, not their sum.

use serde::{Deserialize, Serialize};

/// The `mixed_precision` argument of `estimate_training_usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Float32,
    Float16,
    Bfloat16,
    /// Without an MS-AMP config, as float16.
    Fp8,
    Int8,
    Int4,
}

/// Bytes of each phase accelerate considers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Phases {
    /// The fp32 weights: 4Ψ.
    pub model: u64,
    /// fp32 gradients, plus an fp16 copy under mixed precision: 4Ψ or 6Ψ.
    pub gradients: u64,
    /// Adam's m and v in fp32: 8Ψ.
    pub optimizer: u64,
    /// The optimizer step: 16Ψ in fp32, 8Ψ (the optimizer alone) under mixed precision.
    pub step: u64,
}

impl Phases {
    /// accelerate's "Training using Adam" column: the largest phase.
    pub fn training_using_adam(&self) -> u64 {
        self.model
            .max(self.gradients)
            .max(self.optimizer)
            .max(self.step)
    }
}

/// Phases for a model of `fp32_bytes` (4Ψ) trained in `dtype`; `None` for int8 and int4,
/// which accelerate prints as "N/A".
pub fn training_usage(fp32_bytes: u64, dtype: Dtype) -> Option<Phases> {
    let fp16 = fp32_bytes / 2;
    match dtype {
        Dtype::Float32 => Some(Phases {
            model: fp32_bytes,
            gradients: fp32_bytes,
            optimizer: 2 * fp32_bytes,
            step: 4 * fp32_bytes,
        }),
        Dtype::Float16 | Dtype::Bfloat16 | Dtype::Fp8 => Some(Phases {
            model: fp32_bytes,
            gradients: fp32_bytes + fp16,
            optimizer: 2 * fp32_bytes,
            step: 2 * fp32_bytes,
        }),
        Dtype::Int8 | Dtype::Int4 => None,
    }
}

/// accelerate's `convert_bytes`: divides by 1024 per unit but labels them KB, MB, GB, TB, and
/// prints Python's `round(size, 2)` (so `474.7 MB`, not `474.70 MB`).
pub fn as_printed(bytes: u64) -> String {
    let mut size = bytes as f64;
    for unit in ["bytes", "KB", "MB", "GB", "TB"] {
        if size < 1024.0 {
            return format!("{} {unit}", round2(size));
        }
        size /= 1024.0;
    }
    format!("{} PB", round2(size))
}

/// Python's `round(x, 2)` printed as Python prints a float: the shortest digits that read back
/// (`1.0`, not `1`).
fn round2(x: f64) -> String {
    let r = (x * 100.0).round() / 100.0;
    if r.fract() == 0.0 {
        format!("{r:.1}")
    } else {
        format!("{r}")
    }
}
