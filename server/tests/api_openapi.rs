//! `openapi/openapi.json` is the document the handlers' annotations generate, and the server
//! serves the same.

mod api_helpers;

use std::path::PathBuf;

use api_helpers::*;
use axum::http::StatusCode;
use server::routes::openapi::ApiDoc;
use utoipa::OpenApi;

const REGENERATE: &str = "UPDATE_OPENAPI=1 cargo test -p server --test api_openapi";

fn committed() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../openapi/openapi.json")
}

#[test]
fn the_committed_openapi_document_is_current() {
    let generated = ApiDoc::openapi().to_pretty_json().unwrap() + "\n";
    if std::env::var_os("UPDATE_OPENAPI").is_some() {
        std::fs::write(committed(), &generated).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(committed()).unwrap_or_default();
    assert!(
        on_disk == generated,
        "openapi/openapi.json is stale; regenerate it with `{REGENERATE}`"
    );
}

#[test]
fn the_document_is_openapi_3_1_with_bearer_auth() {
    let doc = serde_json::to_value(ApiDoc::openapi()).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    assert_eq!(
        doc["paths"]["/healthz"]["get"]["security"],
        serde_json::json!([{}])
    );
    assert!(doc["components"]["schemas"]["Problem"].is_object());
}

#[tokio::test]
async fn the_server_serves_the_document() {
    let app = TestApp::new().await;
    let a = app.get("/openapi.json").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.json(), serde_json::to_value(ApiDoc::openapi()).unwrap());
}
