use std::fmt;

use serde::{Deserialize, Serialize};

use crate::memory::DeviceKind;
use crate::plan::NoFit;

/// Everything the scheduler library can refuse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A job spec's fields are malformed or inconsistent: every mistake found, in the order
    /// found (never empty). Displays one `field: reason` line each.
    #[error("{}", lines(.0))]
    InvalidSpec(Vec<FieldError>),
    /// A byte size such as `80GiB` could not be read.
    #[error("invalid size {input:?}: {reason}")]
    InvalidSize { input: String, reason: String },
    /// No configuration the spec allows fits the devices.
    #[error("{0}")]
    DoesNotFit(Box<NoFit>),
    /// The spec asks for a kind of device of which none is registered.
    #[error("no {0} devices are registered")]
    NoDevicesOfKind(DeviceKind),
}

/// One mistake in a job spec: the field's path (`training.seq_len`) and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

fn lines(errors: &[FieldError]) -> String {
    let lines: Vec<String> = errors.iter().map(FieldError::to_string).collect();
    lines.join("\n")
}

impl Error {
    pub(crate) fn spec(field: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::InvalidSpec(vec![FieldError {
            field: field.into(),
            reason: reason.into(),
        }])
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

/// The mistakes found so far in one spec, so that one answer names them all.
#[derive(Debug, Default)]
pub(crate) struct Problems(Vec<FieldError>);

impl Problems {
    /// The value of `r`, or `None` after recording its mistakes.
    pub(crate) fn note<T>(&mut self, r: Result<T, Error>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(Error::InvalidSpec(errors)) => {
                self.0.extend(errors);
                None
            }
            Err(other) => {
                self.0.push(FieldError {
                    field: "spec".into(),
                    reason: other.to_string(),
                });
                None
            }
        }
    }

    /// Records a mistake at `field` unless `ok`; returns `ok`.
    pub(crate) fn ensure(
        &mut self,
        ok: bool,
        field: &str,
        reason: impl FnOnce() -> String,
    ) -> bool {
        self.note(ensure(ok, field, reason)).is_some()
    }

    /// How many mistakes are recorded: checks that build on earlier ones compare it before and
    /// after, so that one mistake is not reported again as its consequences.
    pub(crate) fn count(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn finish(self) -> Result<(), Error> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidSpec(self.0))
        }
    }
}
