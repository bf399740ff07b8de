//! Every error the API answers with, mapped in one place to an RFC 9457
//! `application/problem+json` body. 5xx bodies are opaque: their detail travels to the request
//! log in a response extension (`InternalDetail`), never to the client.

use axum::extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use scheduler::FieldError;
use scheduler::memory::DeviceKind;
use scheduler::plan::{Candidate, NoFit};
use serde::Serialize;
use utoipa::ToSchema;

use crate::domain::{JobId, JobState, NodeId};
use crate::store::StoreError;

pub const PROBLEM_JSON: &str = "application/problem+json";

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("a bearer token is required")]
    MissingToken,
    #[error("the bearer token is not known")]
    UnknownToken,
    #[error("this needs a {needed} token")]
    Forbidden { needed: &'static str },
    #[error("no live console session (logged out, expired, or its token revoked); log in again")]
    SessionEnded,
    #[error(
        "a request authenticated by the console's cookie that changes state must come from \
         {expected}; its Origin was {origin}"
    )]
    CrossOrigin { origin: String, expected: String },
    #[error("only the job's owner or an admin may do this")]
    NotOwner,
    #[error("no {what} {id:?}")]
    NotFound { what: &'static str, id: String },
    /// A query parameter or body that is not what the endpoint takes; `field` names it.
    #[error("{field}: {reason}")]
    BadRequest { field: String, reason: String },
    /// Every mistake found in a job spec (never empty); the first is the error's message.
    #[error("{}", .0[0])]
    InvalidSpec(Vec<FieldError>),
    #[error("{0}")]
    DoesNotFit(Box<NoFit>),
    /// The spec's `device` names a kind no live node has registered.
    #[error(
        "no {0} devices are registered (ask for \"device\": \"auto\", or the operator may queue such jobs with ZEROTRAIN_QUEUE_UNREGISTERED_DEVICES)"
    )]
    NoDevicesOfKind(DeviceKind),
    #[error("the Idempotency-Key was used for job {job_id} with a different spec")]
    IdempotencyConflict { job_id: JobId },
    #[error("job {id} is already {}", state.as_str())]
    JobFinished { id: JobId, state: JobState },
    #[error("a token named {name:?} exists; revoke it first or choose another name")]
    TokenNameTaken { name: String },
    #[error("{name:?} is the last admin token; create another admin token first")]
    LastAdmin { name: String },
    #[error(
        "{name:?} is the last agent join token; create another (role agent_join) first, so \
         agents can still register"
    )]
    LastJoin { name: String },
    #[error("node {id} was declared lost; register again")]
    NodeLost { id: NodeId },
    /// An agent's upload this node may not make (see `wire::agent::RefusalReason`).
    #[error("{what}: refused ({})", reason.as_str())]
    Refused {
        what: String,
        reason: wire::agent::RefusalReason,
    },
    #[error("the range asked for lies outside the file's {bytes} bytes")]
    RangeNotSatisfiable { bytes: u64 },
    #[error("the request body is larger than the server accepts")]
    BodyTooLarge,
    #[error("request bodies must be JSON (Content-Type: application/json), not {found:?}")]
    NotJson { found: String },
    #[error(
        "too many requests with unknown tokens from this address; try again in {retry_after_s} s"
    )]
    AuthThrottled { retry_after_s: u64 },
    #[error(
        "{owner:?} has {limit} queued jobs, the most one owner may have; wait for some to start"
    )]
    QueueFull { owner: String, limit: u32 },
    #[error("{0}")]
    Unavailable(String),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Artifacts(#[from] crate::artifacts::ArtifactError),
    #[error("{0}")]
    Internal(String),
}

/// An RFC 9457 problem. Extension members: `field` for a request that names one, the
/// planner's numbers for a job that cannot fit.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Problem {
    /// A URI naming the kind of problem (`about:blank` for plain HTTP statuses).
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// The request field at fault, as a path (`training.seq_len`); for a spec with several
    /// mistakes, the first of `errors`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// A job spec's mistakes, every one found (`field` and `detail` repeat the first).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<Vec<ProblemField>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub does_not_fit: Option<DoesNotFit>,
}

/// One mistake: the field's path and why it is wrong.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ProblemField {
    pub field: String,
    pub reason: String,
}

/// Why no registered device could ever hold a rank of the job, in bytes.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct DoesNotFit {
    pub world_size: usize,
    /// Per-rank bytes of the allowed configuration that needs the least.
    pub need_bytes: u64,
    pub closest: Configuration,
    pub largest_device_bytes: u64,
    /// Registered devices that could hold one rank of `closest`.
    pub fitting_devices: usize,
    /// A configuration beyond the spec's fixed choices: one that fits (`fits`), or else the
    /// smallest of all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alternative: Option<Alternative>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Configuration {
    pub zero_stage: u8,
    pub activation_checkpointing: bool,
    pub micro_batch_size: u32,
    pub grad_accum_steps: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Alternative {
    #[serde(flatten)]
    pub configuration: Configuration,
    pub need_bytes: u64,
    pub fits: bool,
}

impl From<&Candidate> for Configuration {
    fn from(c: &Candidate) -> Self {
        let c = &c.chosen;
        Configuration {
            zero_stage: c.zero_stage.index(),
            activation_checkpointing: c.activation_checkpointing,
            micro_batch_size: c.micro_batch_size,
            grad_accum_steps: c.grad_accum_steps,
        }
    }
}

impl ApiError {
    /// A job spec with one mistake, at `field`.
    pub fn spec(field: &str, reason: String) -> ApiError {
        ApiError::InvalidSpec(vec![FieldError {
            field: field.into(),
            reason,
        }])
    }
}

/// The detail of a 5xx, for the request log.
#[derive(Debug, Clone)]
pub struct InternalDetail(pub String);

/// Marks an answer to a request whose token the server does not know (for the throttle of
/// failed authentications).
#[derive(Debug, Clone, Copy)]
pub struct AuthFailed;

/// The most bytes of a problem's `detail` or `field`: they may echo the request (a name, a
/// path, an unknown key), and a client sending a megabyte should not get it back.
pub const MAX_ECHO_BYTES: usize = 1000;

/// `s` cut to at most `MAX_ECHO_BYTES` on a character boundary, ending in `…` when cut.
fn truncated(mut s: String) -> String {
    const MORE: &str = "…";
    if s.len() > MAX_ECHO_BYTES {
        let mut end = MAX_ECHO_BYTES - MORE.len();
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str(MORE);
    }
    s
}

impl ApiError {
    /// Status, problem type and title: the one table.
    fn kind(&self) -> (StatusCode, &'static str, &'static str) {
        use StatusCode as S;
        match self {
            ApiError::MissingToken | ApiError::UnknownToken => {
                (S::UNAUTHORIZED, "unauthorized", "Unauthorized")
            }
            ApiError::SessionEnded => (S::UNAUTHORIZED, "session-ended", "Session ended"),
            ApiError::CrossOrigin { .. } => (S::FORBIDDEN, "cross-origin", "Cross-origin request"),
            ApiError::Forbidden { .. } => (S::FORBIDDEN, "forbidden", "Forbidden"),
            ApiError::NotOwner => (S::FORBIDDEN, "not-owner", "Not the job's owner"),
            ApiError::NotFound { .. } => (S::NOT_FOUND, "not-found", "Not found"),
            ApiError::BadRequest { .. } => (S::BAD_REQUEST, "bad-request", "Bad request"),
            ApiError::InvalidSpec(_) => {
                (S::UNPROCESSABLE_ENTITY, "invalid-spec", "Invalid job spec")
            }
            ApiError::DoesNotFit(_) => (
                S::UNPROCESSABLE_ENTITY,
                "does-not-fit",
                "No registered device can hold a rank",
            ),
            ApiError::NoDevicesOfKind(_) => (
                S::UNPROCESSABLE_ENTITY,
                "no-devices-of-kind",
                "No registered device of the kind asked for",
            ),
            ApiError::IdempotencyConflict { .. } => (
                S::CONFLICT,
                "idempotency-conflict",
                "Idempotency-Key reused",
            ),
            ApiError::JobFinished { .. } => (S::CONFLICT, "job-finished", "Job already finished"),
            ApiError::TokenNameTaken { .. } => (S::CONFLICT, "token-name-taken", "Name taken"),
            ApiError::LastAdmin { .. } => (S::CONFLICT, "last-admin", "Last admin token"),
            ApiError::LastJoin { .. } => (S::CONFLICT, "last-join", "Last agent join token"),
            ApiError::NodeLost { .. } => (S::GONE, "node-lost", "Node lost"),
            ApiError::Refused { .. } => (S::CONFLICT, "refused", "Not this node's to send"),
            ApiError::RangeNotSatisfiable { .. } => (
                S::RANGE_NOT_SATISFIABLE,
                "range-not-satisfiable",
                "Range not satisfiable",
            ),
            ApiError::BodyTooLarge => (
                S::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "Request body too large",
            ),
            ApiError::NotJson { .. } => (
                S::UNSUPPORTED_MEDIA_TYPE,
                "not-json",
                "Unsupported media type",
            ),
            ApiError::AuthThrottled { .. } => (
                S::TOO_MANY_REQUESTS,
                "auth-throttled",
                "Too many failed authentications",
            ),
            ApiError::QueueFull { .. } => {
                (S::TOO_MANY_REQUESTS, "queue-full", "Too many queued jobs")
            }
            ApiError::Unavailable(_) => {
                (S::SERVICE_UNAVAILABLE, "unavailable", "Service unavailable")
            }
            ApiError::Store(_) | ApiError::Artifacts(_) | ApiError::Internal(_) => (
                S::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal server error",
            ),
        }
    }

    pub fn problem(&self) -> Problem {
        let (status, kind, title) = self.kind();
        let detail = if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
            "the server failed to answer; the error is in its log".to_string()
        } else {
            truncated(self.to_string())
        };
        let field = match self {
            ApiError::BadRequest { field, .. } => Some(truncated(field.clone())),
            ApiError::InvalidSpec(errors) => errors.first().map(|e| truncated(e.field.clone())),
            ApiError::NoDevicesOfKind(_) => Some("device".to_string()),
            _ => None,
        };
        let errors = match self {
            ApiError::InvalidSpec(errors) => Some(
                errors
                    .iter()
                    .map(|e| ProblemField {
                        field: truncated(e.field.clone()),
                        reason: truncated(e.reason.clone()),
                    })
                    .collect(),
            ),
            _ => None,
        };
        let does_not_fit = match self {
            ApiError::DoesNotFit(no) => Some(DoesNotFit {
                world_size: no.world_size,
                need_bytes: no.closest_need_bytes,
                closest: (&no.closest).into(),
                largest_device_bytes: no.largest_device_bytes,
                fitting_devices: no.fitting_devices,
                alternative: no.alternative.as_ref().map(|(c, need, fits)| Alternative {
                    configuration: c.into(),
                    need_bytes: *need,
                    fits: *fits,
                }),
            }),
            _ => None,
        };
        Problem {
            kind: format!("urn:zerotrain:problem:{kind}"),
            title: title.to_string(),
            status: status.as_u16(),
            detail,
            field,
            errors,
            does_not_fit,
        }
    }
}

impl From<scheduler::Error> for ApiError {
    fn from(e: scheduler::Error) -> Self {
        match e {
            scheduler::Error::InvalidSpec(errors) => ApiError::InvalidSpec(errors),
            scheduler::Error::DoesNotFit(no) => ApiError::DoesNotFit(no),
            scheduler::Error::NoDevicesOfKind(kind) => ApiError::NoDevicesOfKind(kind),
            e @ scheduler::Error::InvalidSize { .. } => ApiError::spec("spec", e.to_string()),
        }
    }
}

impl From<BytesRejection> for ApiError {
    fn from(e: BytesRejection) -> Self {
        match e {
            BytesRejection::FailedToBufferBody(_)
                if e.status() == StatusCode::PAYLOAD_TOO_LARGE =>
            {
                ApiError::BodyTooLarge
            }
            e => ApiError::BadRequest {
                field: "body".into(),
                reason: e.body_text(),
            },
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> Self {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError::BodyTooLarge;
        }
        ApiError::BadRequest {
            field: "body".into(),
            reason: e.body_text(),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> Self {
        ApiError::BadRequest {
            field: "query".into(),
            reason: e.body_text(),
        }
    }
}

impl From<PathRejection> for ApiError {
    fn from(e: PathRejection) -> Self {
        ApiError::BadRequest {
            field: "path".into(),
            reason: e.body_text(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let problem = self.problem();
        let mut response = problem_response(&problem);
        if matches!(
            self,
            ApiError::MissingToken | ApiError::UnknownToken | ApiError::SessionEnded
        ) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if matches!(self, ApiError::UnknownToken) {
            response.extensions_mut().insert(AuthFailed);
        }
        if let ApiError::AuthThrottled { retry_after_s } = self {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
        }
        if problem.status >= 500 {
            response
                .extensions_mut()
                .insert(InternalDetail(self.to_string()));
        }
        response
    }
}

fn problem_response(problem: &Problem) -> Response {
    let status = StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = serde_json::to_vec(problem).expect("a problem serializes");
    (
        status,
        [(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))],
        body,
    )
        .into_response()
}

/// Middleware: errors produced outside the handlers (no route, wrong method, a body over the
/// limit, a timeout) become problems too, so every error a client sees has one shape.
pub async fn problem_for_bare_errors(response: Response) -> Response {
    let status = response.status();
    // Problems, and the console's HTML error pages, already have their shape.
    let has_body_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t == PROBLEM_JSON || t.as_bytes().starts_with(b"text/html"));
    if !(status.is_client_error() || status.is_server_error()) || has_body_type {
        return response;
    }
    let (parts, _) = response.into_parts();
    let problem = Problem {
        kind: "about:blank".into(),
        title: status.canonical_reason().unwrap_or("Error").into(),
        status: status.as_u16(),
        detail: status.canonical_reason().unwrap_or("Error").into(),
        field: None,
        errors: None,
        does_not_fit: None,
    };
    let mut out = problem_response(&problem);
    for (name, value) in parts.headers.iter() {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            out.headers_mut().insert(name, value.clone());
        }
    }
    out.extensions_mut().extend(parts.extensions);
    out
}
