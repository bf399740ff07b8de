//! `retention`: finished jobs' files do not stay forever. A job's checkpoints (only a resume
//! reads them, and a finished job never resumes) are removed from the artifact store
//! `checkpoint_retention` after it ended; all its files, the final model included,
//! `model_retention` after, when that is set. The scheduling loop runs this every `EVERY`.

use std::time::Duration;

use crate::error::ApiError;
use crate::state::AppState;

/// How often the scheduling loop collects.
pub const EVERY: Duration = Duration::from_secs(600);

/// What one collection removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    /// Jobs whose checkpoints were removed.
    pub checkpoints: usize,
    /// Jobs all of whose files were removed.
    pub outputs: usize,
}

/// Removes what finished jobs' retention no longer covers at `now` (Unix ms). Files of jobs
/// that have not ended are left alone.
pub async fn collect(state: &AppState, now: i64) -> Result<Removed, ApiError> {
    let limits = &state.settings.limits;
    let before = |d: Duration| now.saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let checkpoints_before = before(limits.checkpoint_retention);
    let outputs_before = limits.model_retention.map(before);
    let mut removed = Removed::default();
    for id in state.store.jobs_with_artifacts().await? {
        let Some(job) = state.store.get_job(&id).await? else {
            continue;
        };
        if !job.state.is_terminal() {
            continue;
        }
        if outputs_before.is_some_and(|t| job.updated_at < t) {
            // The records go first: a file no record names is never listed.
            state.store.remove_artifacts(&id, false).await?;
            state.artifacts.remove(&id, |_| false).await?;
            removed.outputs += 1;
        } else if job.updated_at < checkpoints_before
            && state.store.remove_artifacts(&id, true).await? > 0
        {
            let checkpoint = format!("/{}/", wire::artifact::CHECKPOINTS);
            state
                .artifacts
                .remove(&id, |key| !key.contains(&checkpoint))
                .await?;
            removed.checkpoints += 1;
        }
    }
    Ok(removed)
}
