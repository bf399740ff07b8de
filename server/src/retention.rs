//! `retention`: finished jobs' outputs do not stay forever. A job's checkpoints (only a resume
//! reads them, and a finished job never resumes) are removed `checkpoint_retention` after it
//! ended; its whole output directory, the final model included, `model_retention` after, when
//! that is set. The scheduling loop runs this every `EVERY`.

use std::path::Path;
use std::time::Duration;

use crate::app::AppState;
use crate::store::StoreError;

/// How often the scheduling loop collects.
pub const EVERY: Duration = Duration::from_secs(600);

/// What one collection removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    /// Jobs whose checkpoints were removed.
    pub checkpoints: usize,
    /// Jobs whose whole output directory was removed.
    pub outputs: usize,
}

/// Removes what finished jobs' retention no longer covers at `now` (Unix ms). Directories of
/// jobs the store does not know, or that have not ended, are left alone.
pub async fn collect(state: &AppState, now: i64) -> Result<Removed, StoreError> {
    let limits = &state.settings.limits;
    let before = |d: Duration| now.saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let checkpoints_before = before(limits.checkpoint_retention);
    let outputs_before = limits.model_retention.map(before);
    let mut removed = Removed::default();
    let jobs_dir = state.settings.data_dir.join("jobs");
    let Ok(mut entries) = tokio::fs::read_dir(&jobs_dir).await else {
        return Ok(removed);
    };
    while let Ok(Some(entry)) = entries.next_entry().await {
        let Some(id) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(job) = state.store.get_job(&id).await? else {
            continue;
        };
        if !job.state.is_terminal() {
            continue;
        }
        let dir = entry.path();
        if outputs_before.is_some_and(|t| job.updated_at < t) {
            if remove(&dir).await {
                removed.outputs += 1;
            }
        } else if job.updated_at < checkpoints_before && remove(&dir.join("checkpoints")).await {
            removed.checkpoints += 1;
        }
    }
    Ok(removed)
}

/// Removes `dir` if it is there; whether it was.
async fn remove(dir: &Path) -> bool {
    match tokio::fs::remove_dir_all(dir).await {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), "retention: cannot remove: {e}");
            false
        }
    }
}
