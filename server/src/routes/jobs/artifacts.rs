//! `GET /v1/jobs/{id}/artifacts`: the files a job has (its committed checkpoints, and once it
//! succeeded its Hugging Face export); `GET /v1/jobs/{id}/artifacts/{name}`: one of them,
//! streamed from the artifact store, with `Range: bytes=…` for a part (resuming a download).
//! Anyone who may read the job may download its files.

use std::ops::Range;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::artifacts;
use crate::auth::Viewer;
use crate::domain::JobId;
use crate::error::{ApiError, Problem};
use crate::routes::agents::artifacts::ArtifactView;
use crate::state::AppState;
use crate::store::ArtifactRecord;

#[derive(Debug, Serialize, ToSchema)]
pub struct ArtifactList {
    /// By name.
    pub artifacts: Vec<ArtifactView>,
}

/// The files a job has.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/artifacts", operation_id = "list_artifacts",
    tag = "jobs",
    security(("bearer" = ["viewer"])),
    params(("id" = String, Path, description = "Job id")),
    responses(
        (status = 200, body = ArtifactList),
        (status = 404, body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    _: Viewer,
    Path(id): Path<JobId>,
) -> Result<Json<ArtifactList>, ApiError> {
    let listed = listed(&state, &id).await?;
    Ok(Json(ArtifactList {
        artifacts: listed.iter().map(ArtifactView::from).collect(),
    }))
}

/// One file of a job.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/artifacts/{name}", operation_id = "download_artifact",
    tag = "jobs",
    security(("bearer" = ["viewer"])),
    params(
        ("id" = String, Path, description = "Job id"),
        ("name" = String, Path, description = "A name the list gives, `/` as `%2F`"),
        ("Range" = Option<String>, Header, description = "`bytes=FIRST-[LAST]` or `bytes=-N`: only those bytes"),
    ),
    responses(
        (status = 200, description = "The file", content_type = "application/octet-stream"),
        (status = 206, description = "The bytes the range asked for", content_type = "application/octet-stream"),
        (status = 404, description = "No such job, or the job has no such file",
            body = Problem, content_type = "application/problem+json"),
        (status = 416, description = "The range lies outside the file",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn download(
    State(state): State<AppState>,
    _: Viewer,
    path: Path<(JobId, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Path((id, name)) = path;
    let a = named(&state, &id, &name).await?;
    let asked = headers.get(header::RANGE).and_then(|v| v.to_str().ok());
    let range = match asked.map(|r| byte_range(r, a.bytes)) {
        None | Some(Ask::Whole) => None,
        Some(Ask::Part(r)) => Some(r),
        Some(Ask::Unsatisfiable) => {
            let mut response = ApiError::RangeNotSatisfiable { bytes: a.bytes }.into_response();
            response.headers_mut().insert(
                header::CONTENT_RANGE,
                header_value(format!("bytes */{}", a.bytes)),
            );
            return Ok(response);
        }
    };
    let body = Body::from_stream(state.artifacts.get(&id, &a, range.clone()).await?);
    let mut response = body.into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    h.insert(header::ETAG, header_value(format!("\"{}\"", a.sha256)));
    let length = match &range {
        Some(r) => {
            *response.status_mut() = StatusCode::PARTIAL_CONTENT;
            let h = response.headers_mut();
            h.insert(
                header::CONTENT_RANGE,
                header_value(format!("bytes {}-{}/{}", r.start, r.end - 1, a.bytes)),
            );
            r.end - r.start
        }
        None => a.bytes,
    };
    response
        .headers_mut()
        .insert(header::CONTENT_LENGTH, header_value(length.to_string()));
    Ok(response)
}

/// Job `id`'s files (a 404 for no such job).
async fn listed(state: &AppState, id: &JobId) -> Result<Vec<ArtifactRecord>, ApiError> {
    let job = super::find(state, id).await?;
    Ok(artifacts::of_job(state, &job).await?)
}

/// The file `name` job `id` has (a 404 for no such job or file).
pub(crate) async fn named(
    state: &AppState,
    id: &JobId,
    name: &str,
) -> Result<ArtifactRecord, ApiError> {
    listed(state, id)
        .await?
        .into_iter()
        .find(|a| a.name == name)
        .ok_or_else(|| ApiError::NotFound {
            what: "artifact",
            id: name.to_string(),
        })
}

fn header_value(s: String) -> HeaderValue {
    HeaderValue::try_from(s).expect("digits, spaces and ASCII punctuation")
}

/// What a `Range` header asks of a file.
#[derive(Debug, PartialEq, Eq)]
enum Ask {
    /// Nothing this endpoint serves in part (not `bytes=`, or several ranges): the whole file.
    Whole,
    Part(Range<u64>),
    Unsatisfiable,
}

/// `bytes=FIRST-LAST`, `bytes=FIRST-` or `bytes=-SUFFIX` of a file of `len` bytes (RFC 9110
/// 14.1.2; LAST past the end is cut to it).
fn byte_range(header: &str, len: u64) -> Ask {
    let Some(spec) = header.trim().strip_prefix("bytes=") else {
        return Ask::Whole;
    };
    let Some((first, last)) = spec.trim().split_once('-').filter(|_| !spec.contains(',')) else {
        return Ask::Whole;
    };
    let number = |s: &str| s.trim().parse::<u64>().ok();
    let range = match (first.trim().is_empty(), number(first), number(last)) {
        // A suffix: the last N bytes.
        (true, _, Some(n)) if n > 0 => len.saturating_sub(n)..len,
        (false, Some(a), None) if last.trim().is_empty() => a..len,
        (false, Some(a), Some(b)) if a <= b => a..b.saturating_add(1).min(len),
        _ => return Ask::Whole,
    };
    if range.start >= len {
        Ask::Unsatisfiable
    } else {
        Ask::Part(range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_read_as_rfc_9110_says() {
        assert_eq!(byte_range("bytes=0-9", 100), Ask::Part(0..10));
        assert_eq!(byte_range("bytes=90-", 100), Ask::Part(90..100));
        assert_eq!(byte_range("bytes=-10", 100), Ask::Part(90..100));
        assert_eq!(byte_range("bytes=-500", 100), Ask::Part(0..100));
        assert_eq!(byte_range("bytes=50-500", 100), Ask::Part(50..100));
        assert_eq!(byte_range("bytes=100-", 100), Ask::Unsatisfiable);
        assert_eq!(byte_range("bytes=200-300", 100), Ask::Unsatisfiable);
        // Not something served in part: the whole file, as RFC 9110 allows.
        for whole in [
            "items=0-9",
            "bytes=9-0",
            "bytes=0-1,5-6",
            "bytes=x-",
            "bytes=-0",
        ] {
            assert_eq!(byte_range(whole, 100), Ask::Whole, "{whole}");
        }
    }
}
