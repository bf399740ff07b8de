//! An agent's files: `PUT /v1/agents/{node}/jobs/{job}/attempts/{attempt}/artifacts/{name}`
//! streams one into the artifact store as it is written (a rank's checkpoint file from the
//! node that runs that rank; the manifest and the export from rank 0's node, only while the
//! attempt is the job's current one), and `GET /v1/agents/{node}/jobs/{job}/artifacts/{name}`
//! gives a node running the job a file the job has (the checkpoint it resumes from) or one of
//! the weights files of the export its `model.init_from` names (another job's: the names the
//! assignment lists). Names are `wire::artifact`'s; `/` in one is sent as `%2F`.

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use scheduler::spec::InitFrom;
use serde::Serialize;
use utoipa::ToSchema;
use wire::agent::RefusalReason;
use wire::artifact::Artifact;

use super::reports::View;
use crate::auth::AgentNode;
use crate::domain::{Job, JobId, NodeId, NodeRecord};
use crate::error::{ApiError, Problem};
use crate::state::AppState;
use crate::store::ArtifactRecord;

/// One stored file of a job, as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ArtifactView {
    /// `model.safetensors` (or a sharded export's `model-KKKKK-of-NNNNN.safetensors` and
    /// `model.safetensors.index.json`), `config.json`, a LoRA job's `adapter_model.safetensors`,
    /// `adapter_config.json` and `merged/{model.safetensors,config.json}`, or
    /// `checkpoints/step-NNNNNNNN/FILE`.
    pub name: String,
    pub bytes: u64,
    /// SHA-256 of the bytes, hex.
    pub sha256: String,
    /// The step it was written at (a checkpoint's; the job's last for the export).
    pub step: u32,
}

impl From<&ArtifactRecord> for ArtifactView {
    fn from(a: &ArtifactRecord) -> ArtifactView {
        ArtifactView {
            name: a.name.clone(),
            bytes: a.bytes,
            sha256: a.sha256.clone(),
            step: a.step,
        }
    }
}

/// Upload one file of an attempt this node runs (its agent token).
#[utoipa::path(
    put,
    path = "/v1/agents/{node}/jobs/{job}/attempts/{attempt}/artifacts/{name}",
    operation_id = "agent_upload_artifact",
    tag = "agents",
    security(("bearer" = ["node"])),
    params(
        ("node" = String, Path, description = "The node id registration returned"),
        ("job" = String, Path, description = "The job id"),
        ("attempt" = u32, Path, description = "The attempt the node runs"),
        ("name" = String, Path, description = "The file's artifact name, `/` as `%2F`"),
    ),
    request_body(content = Vec<u8>, content_type = "application/octet-stream",
        description = "The file's bytes"),
    responses(
        (status = 201, description = "Stored", body = ArtifactView),
        (status = 400, description = "`name` is not an artifact name",
            body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Not this node's to upload: the job is not at that \
            attempt, or the node holds no rank (or not the rank) the file is of",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn upload(
    State(state): State<AppState>,
    AgentNode(node): AgentNode,
    path: Path<(NodeId, JobId, u32, String)>,
    body: Body,
) -> Result<(StatusCode, Json<ArtifactView>), ApiError> {
    let Path((_, job_id, attempt, name)) = path;
    let artifact = Artifact::parse(&name).ok_or_else(|| ApiError::BadRequest {
        field: "name".into(),
        reason: format!("{name:?} is not the name of a checkpoint file or of the export"),
    })?;
    // A rank's file comes from the node running it; the rest of a checkpoint and the export
    // from rank 0's.
    let rank = match artifact {
        Artifact::Rank { rank, .. } => u32::try_from(rank).unwrap_or(u32::MAX),
        Artifact::Manifest { .. }
        | Artifact::Model
        | Artifact::Config
        | Artifact::Adapter
        | Artifact::AdapterConfig
        | Artifact::MergedModel
        | Artifact::MergedConfig
        | Artifact::Index
        | Artifact::Shard { .. } => 0,
    };
    let view = View::load(&state, &job_id, &node).await?;
    let job = view
        .holds(attempt, Some(rank))
        .map_err(|reason| refused(&state, &name, reason))?;
    let step = artifact
        .step()
        .unwrap_or_else(|| job.spec.training.steps.get());
    let written = state
        .artifacts
        .put(&job_id, attempt, &name, body.into_data_stream())
        .await?;
    let record = ArtifactRecord {
        attempt,
        name: name.clone(),
        step,
        bytes: written.bytes,
        sha256: written.sha256,
        at: state.now_ms(),
    };
    if !state.store.add_artifact(&job_id, &record).await? {
        return Err(refused(&state, &name, RefusalReason::AttemptOver));
    }
    Ok((StatusCode::CREATED, Json(ArtifactView::from(&record))))
}

/// A file of a job this node runs ranks of, or of what it starts from: the checkpoint its spec
/// resumes from, the weights of the export its `model.init_from` names (its agent token).
#[utoipa::path(
    get,
    path = "/v1/agents/{node}/jobs/{job}/artifacts/{name}",
    operation_id = "agent_download_artifact",
    tag = "agents",
    security(("bearer" = ["node"])),
    params(
        ("node" = String, Path, description = "The node id registration returned"),
        ("job" = String, Path, description = "The job id"),
        ("name" = String, Path, description = "An artifact the job lists, or one the assignment \
            names (`resume_from.files`, `init_from`), `/` as `%2F`"),
    ),
    responses(
        (status = 200, description = "The file's bytes", content_type = "application/octet-stream"),
        (status = 404, description = "Neither the job nor the job it starts from has such an artifact",
            body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The node runs no rank of the job's current attempt",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn download(
    State(state): State<AppState>,
    AgentNode(node): AgentNode,
    path: Path<(NodeId, JobId, String)>,
) -> Result<Body, ApiError> {
    let Path((_, job_id, name)) = path;
    let job = running(&state, &node, &job_id, &name).await?;
    // The files of the checkpoint another job's spec resumes from are that job's (this job's
    // own checkpoints come after it, at later steps), and so are the weights of the export it
    // starts from (this job has no export while it runs).
    let artifact = Artifact::parse(&name);
    let owner = match (&job.spec.resume_from, &job.spec.model.init_from) {
        (Some(from), _) if artifact.and_then(Artifact::step) == Some(from.step) => {
            JobId::from(from.job.as_str())
        }
        (_, Some(InitFrom::Artifact(from))) if artifact.is_some_and(Artifact::is_weights) => {
            JobId::from(from.job.as_str())
        }
        _ => job_id,
    };
    file(&state, &owner, &name).await
}

/// The job, if `node` holds ranks of its current attempt.
async fn running(
    state: &AppState,
    node: &NodeRecord,
    job_id: &JobId,
    what: &str,
) -> Result<Job, ApiError> {
    let view = View::load(state, job_id, node).await?;
    view.current()
        .cloned()
        .map_err(|reason| refused(state, what, reason))
}

/// The answer to a request about `what` that this node may not make, counted as a refusal.
fn refused(state: &AppState, what: &str, reason: RefusalReason) -> ApiError {
    state.metrics.refused(reason, 1);
    ApiError::Refused {
        what: what.to_string(),
        reason,
    }
}

/// The file `name` job `job_id` has, streamed.
async fn file(state: &AppState, job_id: &JobId, name: &str) -> Result<Body, ApiError> {
    let a = crate::routes::jobs::artifacts::named(state, job_id, name).await?;
    Ok(Body::from_stream(
        state.artifacts.get(job_id, &a, None).await?,
    ))
}
