use crate::plan::NoFit;

/// Everything the scheduler library can refuse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A job spec field is malformed or inconsistent; `field` is its path (`training.seq_len`).
    #[error("{field}: {reason}")]
    InvalidSpec { field: String, reason: String },
    /// A byte size such as `80GiB` could not be read.
    #[error("invalid size {input:?}: {reason}")]
    InvalidSize { input: String, reason: String },
    /// No configuration the spec allows fits the devices.
    #[error("{0}")]
    DoesNotFit(Box<NoFit>),
}

impl Error {
    pub(crate) fn spec(field: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::InvalidSpec {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Fails with `Error::InvalidSpec` at `field` unless `ok`.
pub(crate) fn ensure(ok: bool, field: &str, reason: impl FnOnce() -> String) -> Result<(), Error> {
    if ok {
        Ok(())
    } else {
        Err(Error::spec(field, reason()))
    }
}
