//! `/login`: one field for a token, posted to `POST /v1/session` (by the console script, or
//! as a plain form without JavaScript), then back to the page that sent you here.

use askama::Template;
use axum::extract::Query;
use axum::http::HeaderValue;
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use serde::Deserialize;

use super::assets;

#[derive(Debug, Deserialize)]
pub struct LoginQuery {
    next: Option<String>,
}

#[derive(Template)]
#[template(path = "login.html")]
struct LoginPage {
    next: String,
    js: String,
    css: String,
}

pub async fn page(Query(q): Query<LoginQuery>) -> Response {
    let page = LoginPage {
        next: q.next.unwrap_or_else(|| "/".into()),
        js: assets::url("console.js"),
        css: assets::url("console.css"),
    };
    match page.render() {
        Ok(html) => (
            [(header::CACHE_CONTROL, HeaderValue::from_static("no-store"))],
            Html(html),
        )
            .into_response(),
        Err(e) => super::error_page(crate::error::ApiError::Internal(e.to_string())),
    }
}
