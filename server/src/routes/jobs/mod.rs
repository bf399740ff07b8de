//! `/v1/jobs`: submit, list, read, cancel, follow a job's metrics, logs and events, and
//! download its files.

pub mod artifacts;
pub mod cancel;
pub mod create;
pub mod events;
pub mod get;
pub mod list;
pub mod logs;
pub mod metrics;
pub mod spec;

use crate::domain::{Job, JobId};
use crate::error::ApiError;
use crate::state::App;

/// The job `id`, or a 404.
pub(crate) async fn find(app: &App, id: &JobId) -> Result<Job, ApiError> {
    app.store
        .get_job(id)
        .await?
        .ok_or_else(|| ApiError::NotFound {
            what: "job",
            id: id.to_string(),
        })
}
