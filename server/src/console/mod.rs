//! The web ops console: server-rendered pages (askama templates, checked at compile time) over
//! the same store queries as the JSON API, htmx for live parts, uPlot charts fed by the JSON
//! metrics endpoint, all assets embedded. Browsers sign in at `/login` (`POST /v1/session`);
//! every page needs a session (or a bearer token) of at least a viewer, and what it can do
//! through the API is its token's role. Pages send a strict Content-Security-Policy: no inline
//! script or style, nothing from elsewhere.

pub(crate) mod assets;
mod compare;
mod job;
mod jobs;
mod login;
mod nodes;
mod plan;
mod view;

use askama::Template;
use axum::Router;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::get;

use crate::auth::{Caller, Viewer};
use crate::error::ApiError;
use crate::state::AppState;

/// The console's pages and assets (none of them in the OpenAPI document).
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(jobs::page))
        .route("/login", get(login::page))
        .route("/jobs/{id}", get(job::page))
        .route("/jobs/{id}/log.txt", get(job::log_text))
        .route("/compare", get(compare::page))
        .route("/nodes", get(nodes::page))
        .route("/plan", get(plan::page))
        .route("/assets/{name}", get(assets::serve))
        // Browsers ask for it on any page, the API's JSON included: none, and not again soon.
        .route("/favicon.ico", get(assets::no_icon))
        .layer(middleware::map_response(security_headers))
}

/// No inline script or style, no plug-ins, no framing, nothing fetched from elsewhere.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

async fn security_headers(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    response
}

/// Who is looking at a page: a viewer or more. Someone not signed in goes to the login page,
/// which brings them back.
pub struct Signed(pub Caller);

impl FromRequestParts<AppState> for Signed {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Response> {
        match Viewer::from_request_parts(parts, state).await {
            Ok(Viewer(caller)) => Ok(Signed(caller)),
            Err(ApiError::MissingToken | ApiError::UnknownToken | ApiError::SessionEnded) => {
                let here = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                let next: String =
                    serde_urlencoded::to_string([("next", here)]).unwrap_or_default();
                Err(Redirect::to(&format!("/login?{next}")).into_response())
            }
            Err(e) => Err(error_page(e)),
        }
    }
}

/// A rendered page.
fn render(page: &impl Template) -> Response {
    match page.render() {
        Ok(html) => (
            [(header::CACHE_CONTROL, HeaderValue::from_static("no-store"))],
            Html(html),
        )
            .into_response(),
        Err(e) => error_page(ApiError::Internal(format!("rendering a page: {e}"))),
    }
}

#[derive(Template)]
#[template(path = "error.html")]
struct ErrorPage {
    title: String,
    detail: String,
}

/// A problem as an HTML page, with the problem's status (its 5xx detail stays in the log).
fn error_page(e: ApiError) -> Response {
    let problem = e.problem();
    let status = StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let page = ErrorPage {
        title: problem.title,
        detail: problem.detail,
    };
    let html = page
        .render()
        .unwrap_or_else(|_| "the server failed to answer".into());
    let mut response = (status, Html(html)).into_response();
    if status.is_server_error() {
        response
            .extensions_mut()
            .insert(crate::error::InternalDetail(e.to_string()));
    }
    response
}
