//! `error`: everything the runner can fail with, as one enum with the facts a person needs.

use std::path::PathBuf;

use scheduler::bytes::human;
use scheduler::memory::Category;
use wire::data_roots::RootsError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device the run asked for cannot be used: no CUDA driver, a build without the
    /// `cuda` feature, a failed GPU call.
    #[error("{0}")]
    Device(String),
    /// A data file (or glob pattern) under the data roots that cannot be used: missing,
    /// unreadable, not a regular file, bad header, truncated, or too short for one batch.
    /// `what` is the spec field and the path as the spec wrote it (and for a glob, which of
    /// its files); the reason never quotes the file's bytes or size.
    #[error("{what}: {reason}")]
    Data { what: String, reason: String },
    /// A job input outside the node's data roots, or a configured root that cannot be one.
    #[error(transparent)]
    Roots(RootsError),
    /// A token the model cannot embed; `index` counts tokens from the start of the file's data.
    #[error("{what}: the token at index {index} is not below the model's vocab_size {vocab_size}")]
    TokenOutOfRange {
        what: String,
        index: u64,
        vocab_size: usize,
    },
    /// The loader's arguments do not fit the data kind (e.g. a vocabulary too small for it).
    #[error("data: {reason}")]
    DataConfig { reason: String },
    /// fp16 gradients overflowed although the loss scale is already at its minimum: training has
    /// diverged. DeepSpeed stops the same way.
    #[error(
        "step {step}: gradients overflowed with the loss scale already at its minimum {scale}; \
         cannot decrease the scale any more (lower the learning rate or \
         precision.loss_scale.min, or train in bf16)"
    )]
    LossScaleAtMinimum { scale: f32, step: u64 },
    /// A rank's tracked bytes would pass its device budget.
    #[error(
        "out of device memory: allocating {} of {} with {} in use would pass the rank's budget of {}",
        human(*requested), category.name(), human(*in_use), human(*budget)
    )]
    OutOfMemory {
        category: Category,
        requested: u64,
        in_use: u64,
        budget: u64,
    },
    /// Gradients became inf or NaN without a loss scaler to skip the step (fp32/bf16).
    #[error(
        "step {step}: gradients are not finite (inf or NaN); lower the learning rate or enable clipping"
    )]
    NonFiniteGradients { step: u64 },
    /// A rank's layout holds other bytes than the plan it was given: the memory model and the
    /// trainer disagree, or the plan is not this spec's. A bug, never the job's fault.
    #[error(
        "bug: rank {rank} would hold {layout} bytes of {} where its plan says {planned}",
        category.name()
    )]
    PlanMismatch {
        rank: usize,
        category: Category,
        planned: u64,
        layout: u64,
    },
    /// The job cannot be trained as given.
    #[error("cannot train this job: {reason}")]
    Untrainable { reason: String },
    /// A checkpoint or model file that cannot be written or read.
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint { path: PathBuf, reason: String },
    /// A collective could not complete because a neighbouring rank failed, left or stalled.
    #[error("rank {rank}: peer rank {peer} {reason}")]
    Peer {
        rank: usize,
        peer: usize,
        reason: String,
    },
    /// The run was cancelled before step `step`.
    #[error("cancelled before step {step}")]
    Cancelled { step: u32 },
    /// The server could not be reached or refused a request.
    #[error("server {url}: {reason}")]
    Server { url: String, reason: String },
}

/// A data file the roots refused to open is a data error like the runner's own.
impl From<RootsError> for Error {
    fn from(e: RootsError) -> Error {
        match e {
            RootsError::Data { what, reason } => Error::Data { what, reason },
            other => Error::Roots(other),
        }
    }
}
