//! `/v1/session`: the console's login and logout. A person's bearer token (in the
//! `Authorization` header, or from the login page's form) becomes a session cookie; see
//! `crate::session`.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::auth::bearer;
use crate::domain::Role;
use crate::error::{ApiError, Problem};
use crate::session;
use crate::state::AppState;

/// The login page's form (`application/x-www-form-urlencoded`); other fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoginForm {
    /// A viewer, submitter or admin token (without one, the bearer token).
    pub token: Option<String>,
    /// Where to go afterwards: a path on this server (default `/`).
    pub next: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SessionInfo {
    /// The token's name: who the console acts as.
    pub name: String,
    pub role: Role,
    /// When the session ends (Unix ms), unless its token is revoked or it logs out first.
    pub expires_at: i64,
}

/// Log in: exchange a bearer token for a console session cookie.
///
/// The token comes as `Authorization: Bearer` (answer 201 with the session) or as the login
/// page's form (answer 303 to `next`; a form without a token falls back on the bearer token,
/// and an empty body is no form). The cookie is `HttpOnly`, `SameSite=Strict`, with a
/// `Max-Age` of the session's lifetime, and `Secure` and `__Host-` prefixed when the server's
/// public URL is HTTPS. An `Origin` other than the server's is refused.
#[utoipa::path(
    post,
    path = "/v1/session", operation_id = "create_session",
    tag = "session",
    // The token comes as a bearer token or in the form.
    security(("bearer" = ["viewer"]), ()),
    request_body(content = Option<LoginForm>, content_type = "application/x-www-form-urlencoded",
        description = "The login form; API clients send the token as a bearer token instead"),
    responses(
        (status = 201, body = SessionInfo,
            headers(("set-cookie" = String, description = "The session cookie"))),
        (status = 303, description = "From the login form: to `next`, with the cookie set"),
        (status = 400, description = "A form with fields other than these",
            body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Not a person's token, or another origin",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // Login CSRF: a page elsewhere must not log this browser in as someone else.
    session::check_origin(&headers, &state.settings, false)?;
    let body = body?;
    // An empty body is no form: the token is then the bearer token, as without one.
    let is_form = !body.is_empty()
        && headers.get(header::CONTENT_TYPE).is_some_and(|v| {
            v.as_bytes()
                .starts_with(b"application/x-www-form-urlencoded")
        });
    let form: Option<LoginForm> = is_form
        .then(|| serde_urlencoded::from_bytes(&body))
        .transpose()
        .map_err(|e| ApiError::BadRequest {
            field: "body".into(),
            reason: e.to_string(),
        })?;
    // A form without a token leaves it to the bearer token.
    let token = match form
        .as_ref()
        .and_then(|f| f.token.as_deref())
        .map(str::trim)
    {
        Some(token) if !token.is_empty() => token.to_string(),
        _ => bearer(&headers)?.to_string(),
    };
    let next = form.map(|f| local_path(f.next));
    let (caller, id, expires_at) = session::open(&state, &token).await?;
    let cookie = [(
        header::SET_COOKIE,
        session::set_cookie(&state.settings, Some(&id)),
    )];
    Ok(match next {
        Some(next) => (cookie, Redirect::to(&next)).into_response(),
        None => {
            let info = SessionInfo {
                name: caller.name,
                role: caller.role,
                expires_at,
            };
            (StatusCode::CREATED, cookie, Json(info)).into_response()
        }
    })
}

/// Log out: the session ends and its cookie is deleted.
#[utoipa::path(
    delete,
    path = "/v1/session", operation_id = "delete_session",
    tag = "session",
    security(("session" = [])),
    responses(
        (status = 204, description = "Logged out",
            headers(("set-cookie" = String, description = "Deletes the cookie"))),
        (status = 401, description = "No live session cookie",
            body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Another origin",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn delete(
    State(state): State<AppState>,
    session: session::Session,
) -> Result<Response, ApiError> {
    state.store.delete_session(&session.id).await?;
    let cookie = [(
        header::SET_COOKIE,
        session::set_cookie(&state.settings, None),
    )];
    Ok((StatusCode::NO_CONTENT, cookie).into_response())
}

/// `next` if it is a path on this server, else `/` (no open redirects).
fn local_path(next: Option<String>) -> String {
    next.filter(|n| n.starts_with('/') && !n.starts_with("//") && !n.contains('\\'))
        .unwrap_or_else(|| "/".into())
}
