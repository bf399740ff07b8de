//! The validation loss, a leaf type that the trainer records and checkpoints carry.

use serde::{Deserialize, Serialize};

/// The mean loss over the validation batches after a step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ValidationLoss {
    pub step: u32,
    pub loss: f64,
}
