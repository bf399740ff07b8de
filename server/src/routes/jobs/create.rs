//! `POST /v1/jobs`: parse the spec, plan it against the registered devices, queue it.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use scheduler::memory::Breakdown;
use scheduler::plan;
use scheduler::spec::{CheckpointRef, InitFrom, JobSpec, Purpose, checkpoint_artifact};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use wire::artifact::Artifact;

use crate::artifacts;
use crate::auth::Submitter;
use crate::domain::{Job, JobId, JobState, mint};
use crate::error::{ApiError, Problem};
use crate::routes::jobs::spec::JobSpecBody;
use crate::routes::planning_inventory;
use crate::settings::Limits;
use crate::state::AppState;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CreateParams {
    /// Higher runs first (default 0).
    #[serde(default)]
    #[param(required = false, minimum = -2147483648, maximum = 2147483647)]
    pub priority: i32,
}

/// The queued job and what one rank is predicted to hold.
#[derive(Debug, Serialize, ToSchema)]
pub struct JobCreated {
    #[serde(flatten)]
    pub job: Job,
    /// Bytes per rank by category (and `total`) under the plan.
    #[schema(value_type = Object)]
    pub predicted_per_rank_bytes: Breakdown,
}

const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Submit a training job.
///
/// The body is a job spec, native or DeepSpeed form (`{"deepspeed": {...}, ...}`). The job is
/// planned against every registered device of the kind its `device` asks for (busy or not):
/// 422 when the spec is invalid (the problem names the field), names an input file outside
/// the server's data roots, asks for a kind of device no node has registered (`field`:
/// `device`; unless the server queues such jobs), or when no registered device could ever hold
/// a rank (with the planner's numbers). A repeated `Idempotency-Key` returns the job it created, with 200.
#[utoipa::path(
    post,
    path = "/v1/jobs", operation_id = "create_job",
    tag = "jobs",
    security(("bearer" = ["submitter"])),
    params(
        CreateParams,
        ("Idempotency-Key" = Option<String>, Header,
            description = "Retries with the same key return the first job instead of a new one",
            min_length = 1, max_length = 255, pattern = "^[!-~]([ -~]*[!-~])?$"),
    ),
    request_body(content = JobSpecBody, content_type = "application/json"),
    responses(
        (status = 201, description = "Queued", body = JobCreated,
            headers(("Location" = String, description = "The job's URL"))),
        (status = 200, description = "The job this Idempotency-Key created", body = JobCreated,
            headers(("Location" = String, description = "The job's URL"))),
        (status = 400, description = "`priority` or `Idempotency-Key` is not what this takes",
            body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Idempotency-Key reused with another spec",
            body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid spec, an input file outside the data roots, past \
            a limit (steps, ranks), no registered device of the kind asked for, or no \
            registered device can hold a rank",
            body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "The owner has as many queued jobs as one may have",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn create(
    State(state): State<AppState>,
    Submitter(caller): Submitter,
    headers: HeaderMap,
    params: Result<Query<CreateParams>, QueryRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Query(params) = params?;
    let body = body?;
    let key = match headers.get(IDEMPOTENCY_KEY) {
        Some(v) => Some(
            v.to_str()
                .ok()
                .filter(|k| (1..=255).contains(&k.len()))
                .ok_or_else(|| ApiError::BadRequest {
                    field: "Idempotency-Key".into(),
                    reason: "must be 1-255 visible ASCII characters".into(),
                })?,
        ),
        None => None,
    };
    let text = std::str::from_utf8(&body)
        .map_err(|e| ApiError::spec("spec", format!("not UTF-8: {e}")))?;
    let parsed = JobSpec::parse(text, Purpose::Train)?;
    if let Some(field) = state.data_roots.refused_input(&parsed.spec) {
        return Err(ApiError::spec(field, "outside the data roots".to_string()));
    }
    within_limits(&parsed.spec, &state.settings.limits)?;
    if let Some(InitFrom::Artifact(from)) = &parsed.spec.model.init_from {
        starts_from(&state, &parsed.spec, &from.job).await?;
    }
    if let Some(from) = &parsed.spec.resume_from {
        resumes_from(&state, &parsed.spec, from).await?;
    }
    let nodes = state.store.nodes().await?;
    let plan = match plan::plan(
        &parsed.spec,
        &planning_inventory(&nodes, state.slurm.as_ref(), &state.settings),
    ) {
        // The operator queues jobs for capacity still to come: planned on unbounded devices
        // of that kind, they wait until placement finds devices that hold them.
        Err(scheduler::Error::NoDevicesOfKind(kind))
            if state.settings.queue_unregistered_devices =>
        {
            plan::plan_local_on(&parsed.spec, None, kind)?
        }
        planned => planned?,
    };
    let now = state.now_ms();
    let job = Job {
        id: mint(),
        name: parsed.spec.name.clone(),
        state: JobState::Queued,
        priority: params.priority,
        attempt: 1,
        world_size: parsed.spec.world_size.get(),
        spec: parsed.spec,
        plan,
        unsupported_keys: parsed.unsupported_keys,
        owner: caller.name,
        reason: "submitted".into(),
        master: None,
        created_at: now,
        updated_at: now,
    };
    let queued_limit = Some(state.settings.limits.queued_per_owner);
    let Some(stored) = state.store.submit_job(&job, key, queued_limit).await? else {
        return Err(ApiError::QueueFull {
            owner: job.owner,
            limit: state.settings.limits.queued_per_owner,
        });
    };
    let status = if stored.id == job.id {
        state.announce(&stored);
        StatusCode::CREATED
    } else if stored.spec != job.spec {
        return Err(ApiError::IdempotencyConflict { job_id: stored.id });
    } else {
        StatusCode::OK
    };
    let location = format!("/v1/jobs/{}", stored.id);
    let created = JobCreated {
        predicted_per_rank_bytes: stored.plan.per_rank_bytes,
        job: stored,
    };
    Ok((status, [(header::LOCATION, location)], Json(created)).into_response())
}

/// A job may start from job `source`'s model when that job succeeded (its export is listed)
/// and trained the same architecture.
async fn starts_from(state: &AppState, spec: &JobSpec, source: &str) -> Result<(), ApiError> {
    let field = "model.init_from.job";
    let (job, listed) = source_job(state, field, source).await?;
    // A succeeded job's export: one file of weights, or a sharded set's index.
    let has_model = listed.iter().any(|a| {
        matches!(
            Artifact::parse(&a.name),
            Some(Artifact::Model | Artifact::Index)
        )
    });
    if !has_model {
        return Err(ApiError::spec(
            field,
            format!(
                "job {source} is {} and has no model (a job's model is there once it succeeded)",
                job.state.as_str()
            ),
        ));
    }
    same_model(field, &job, spec)
}

/// A job may resume from another's checkpoint when that checkpoint is committed (the job
/// lists its files) and was written by the same model, dtype and optimizer; the world size and
/// stage may differ (the trainer reshards).
async fn resumes_from(
    state: &AppState,
    spec: &JobSpec,
    from: &CheckpointRef,
) -> Result<(), ApiError> {
    let field = "resume_from.job";
    let (job, listed) = source_job(state, field, &from.job).await?;
    let mut steps: Vec<u32> = listed
        .iter()
        .filter_map(|a| Artifact::step_of(&a.name))
        .collect();
    if !steps.contains(&from.step) {
        steps.dedup();
        return Err(ApiError::spec(
            "resume_from.artifact",
            format!(
                "job {} has no committed checkpoint {:?} (its checkpoints: {})",
                from.job,
                checkpoint_artifact(from.step),
                if steps.is_empty() {
                    "none".to_string()
                } else {
                    steps
                        .iter()
                        .map(|&s| checkpoint_artifact(s))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        ));
    }
    same_model(field, &job, spec)?;
    let (theirs, ours) = (&job.spec, spec);
    if (theirs.precision.dtype, theirs.optimizer.name())
        != (ours.precision.dtype, ours.optimizer.name())
    {
        return Err(ApiError::spec(
            field,
            format!(
                "job {} trained in {:?} with {}; this spec trains in {:?} with {}",
                from.job,
                theirs.precision.dtype,
                theirs.optimizer.name(),
                ours.precision.dtype,
                ours.optimizer.name()
            ),
        ));
    }
    Ok(())
}

/// Job `id`, which `field` names, and the files it has.
async fn source_job(
    state: &AppState,
    field: &str,
    id: &str,
) -> Result<(Job, Vec<crate::store::ArtifactRecord>), ApiError> {
    let Some(job) = state.store.get_job(&JobId::from(id)).await? else {
        return Err(ApiError::spec(field, format!("no job {id:?}")));
    };
    let listed = artifacts::of_job(state, &job).await?;
    Ok((job, listed))
}

/// Refuses `spec` (at `field`) unless it trains the architecture `job` trained.
fn same_model(field: &str, job: &Job, spec: &JobSpec) -> Result<(), ApiError> {
    let (theirs, ours) = (job.spec.architecture(), spec.architecture());
    if theirs != ours {
        return Err(ApiError::spec(
            field,
            format!(
                "job {} trained another model ({theirs:?}); this spec's is {ours:?}",
                job.id
            ),
        ));
    }
    Ok(())
}

/// The operator's limits on one job: its steps, and its ranks against what one owner may run.
fn within_limits(spec: &JobSpec, limits: &Limits) -> Result<(), ApiError> {
    let steps = spec.training.steps.get();
    if steps > limits.max_steps {
        return Err(ApiError::spec(
            "training.steps",
            format!(
                "{steps} is more than this server's maximum of {}",
                limits.max_steps
            ),
        ));
    }
    let ranks = spec.world_size.get();
    if ranks > limits.running_ranks_per_owner {
        return Err(ApiError::spec(
            "world_size",
            format!(
                "{ranks} ranks are more than the {} one owner may run at once",
                limits.running_ranks_per_owner
            ),
        ));
    }
    Ok(())
}
