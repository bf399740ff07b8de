//! Console sessions: a browser's cookie in place of a bearer token. `POST /v1/session`
//! exchanges a person's token for a random session id in an `HttpOnly`, `SameSite=Strict`
//! cookie (`Secure` and `__Host-` prefixed when the server is reached over HTTPS). The store
//! keeps only the id's SHA-256, bound to the token's: each request joins the token, so the
//! session has exactly the token's name and role and ends the moment the token is revoked (or
//! at logout, or after `session_ttl`). Stored rather than signed so that logout and revocation
//! end it everywhere at once and replicas share no signing key.
//!
//! CSRF: a cookie-authenticated request that may change state (any method but GET, HEAD and
//! OPTIONS) must carry an `Origin` equal to the server's own.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, header};
use cookie::{Cookie, SameSite};

use crate::auth::{Caller, token_caller, unavailable};
use crate::domain::Role;
use crate::error::ApiError;
use crate::settings::Settings;
use crate::state::AppState;

pub(crate) const COOKIE: &str = "zerotrain_session";
const SECURE_COOKIE: &str = "__Host-zerotrain_session";

/// Whether browsers reach this server over HTTPS (as `ZEROTRAIN_PUBLIC_URL` says).
fn https(settings: &Settings) -> bool {
    settings
        .public_url
        .as_ref()
        .is_some_and(|u| u.scheme() == "https")
}

fn cookie_name(settings: &Settings) -> &'static str {
    if https(settings) {
        SECURE_COOKIE
    } else {
        COOKIE
    }
}

/// The session id the request's cookie carries, if any.
pub fn session_id(headers: &HeaderMap, settings: &Settings) -> Option<String> {
    let name = cookie_name(settings);
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|c| c.name() == name)
        .map(|c| c.value().to_string())
        .filter(|v| !v.is_empty())
}

/// The origin browsers see this server at: `ZEROTRAIN_PUBLIC_URL`'s, else `http://` + `Host`
/// (the server itself speaks plain HTTP).
fn own_origin(headers: &HeaderMap, settings: &Settings) -> Option<String> {
    match &settings.public_url {
        Some(url) => Some(url.origin().ascii_serialization()),
        None => headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(|host| format!("http://{host}")),
    }
}

/// Refuses a request whose `Origin` is given and is not the server's own; with `required`, a
/// request without one too.
pub fn check_origin(
    headers: &HeaderMap,
    settings: &Settings,
    required: bool,
) -> Result<(), ApiError> {
    let origin = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok());
    let expected = own_origin(headers, settings);
    match (origin, &expected) {
        (None, _) if !required => Ok(()),
        (Some(o), Some(e)) if o == e => Ok(()),
        _ => Err(ApiError::CrossOrigin {
            origin: origin.unwrap_or("none").to_string(),
            expected: expected.unwrap_or_else(|| "a Host header".into()),
        }),
    }
}

/// The caller behind the request's session cookie: the hook `auth` calls when a request
/// brings the cookie and no bearer token.
pub(crate) async fn authenticate(
    parts: &Parts,
    state: &AppState,
    session: &str,
) -> Result<Caller, ApiError> {
    let safe = [Method::GET, Method::HEAD, Method::OPTIONS].contains(&parts.method);
    check_origin(&parts.headers, &state.settings, !safe)?;
    let (name, role) = state
        .store
        .session(session)
        .await
        .map_err(unavailable)?
        .ok_or(ApiError::SessionEnded)?;
    Ok(Caller { name, role })
}

/// A live session from the request's cookie (bearer tokens are not sessions), its Origin
/// checked.
pub struct Session {
    pub id: String,
    pub caller: Caller,
}

impl FromRequestParts<AppState> for Session {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let id = session_id(&parts.headers, &state.settings).ok_or(ApiError::SessionEnded)?;
        let caller = authenticate(parts, state, &id).await?;
        Ok(Session { id, caller })
    }
}

/// A new session for a person's `token`: its caller, its id and when it expires (Unix ms).
pub async fn open(state: &AppState, token: &str) -> Result<(Caller, String, i64), ApiError> {
    let caller = token_caller(state, token).await?;
    if !caller.role.allows(Role::Viewer) {
        return Err(ApiError::Forbidden {
            needed: "viewer, submitter or admin",
        });
    }
    let id = crate::auth::new_token();
    let expires_at = state
        .now_ms()
        .saturating_add(state.settings.session_ttl.as_millis() as i64);
    if !state.store.insert_session(&id, token, expires_at).await? {
        // Revoked between the two statements.
        return Err(ApiError::UnknownToken);
    }
    Ok((caller, id, expires_at))
}

/// `Set-Cookie` for session `id` (or, with `None`, one that deletes the cookie).
pub fn set_cookie(settings: &Settings, id: Option<&str>) -> HeaderValue {
    let max_age = match id {
        Some(_) => cookie::time::Duration::seconds(settings.session_ttl.as_secs() as i64),
        None => cookie::time::Duration::ZERO,
    };
    let cookie = Cookie::build((cookie_name(settings), id.unwrap_or("")))
        .path("/")
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(https(settings))
        .max_age(max_age)
        .build();
    HeaderValue::from_str(&cookie.to_string()).expect("a session cookie is a valid header")
}
