//! Where a job's files live. Each attempt writes under its own folder,
//! `<data dir>/jobs/ID/attempts/N/` (checkpoints, export), so an attempt that was fenced off
//! writes nowhere the job reads: a new attempt resumes only from a checkpoint the server
//! recorded, and the export of the attempt that succeeded is moved up into `jobs/ID/`.

use std::path::PathBuf;

use runner::checkpoint::{CONFIG_FILE, MODEL_FILE, step_dir};

use crate::settings::Settings;

pub fn attempt_dir(settings: &Settings, job_id: &str, attempt: u32) -> PathBuf {
    settings
        .job_dir(job_id)
        .join("attempts")
        .join(attempt.to_string())
}

/// Where the checkpoint of `step` by `attempt` is (the server records this path, whatever
/// path the agent's report names).
pub fn checkpoint_dir(settings: &Settings, job_id: &str, attempt: u32, step: u32) -> PathBuf {
    step_dir(&attempt_dir(settings, job_id, attempt), step)
}

/// Moves the export of `attempt`, which succeeded, into the job's folder. Missing files are
/// not an error (a job's ranks may run where this server's data dir is not mounted).
pub async fn promote_export(settings: &Settings, job_id: &str, attempt: u32) {
    let from = attempt_dir(settings, job_id, attempt);
    let to = settings.job_dir(job_id);
    for name in [MODEL_FILE, CONFIG_FILE] {
        match tokio::fs::rename(from.join(name), to.join(name)).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(job = job_id, attempt, "moving {name} into place: {e}"),
        }
    }
}
