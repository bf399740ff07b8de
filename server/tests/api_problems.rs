//! Every error is an RFC 9457 problem; these snapshots fix their shape. A 5xx says nothing of
//! its cause.

use crate::api_helpers;

use api_helpers::*;
use axum::http::{Method, StatusCode};
use serde_json::json;

async fn problem(a: Answer) -> serde_json::Value {
    assert_eq!(a.content_type(), "application/problem+json", "{}", a.text);
    let p = a.json();
    assert_eq!(p["status"], a.status.as_u16());
    p
}

#[tokio::test]
async fn problems_have_type_title_status_detail_and_the_field_at_fault() {
    let app = TestApp::new().await;
    app.register("small", 2, 256 << 20).await;

    let bad_spec = app
        .submit(&json!({"model": {"preset": "gpt2-124M"}, "training": {"seq_len": 2048}}))
        .await;
    insta::assert_json_snapshot!("invalid_spec", problem(bad_spec).await);

    let too_big = app
        .submit(&json!({"model": {"preset": "gpt2-124M"}, "world_size": 2}))
        .await;
    insta::assert_json_snapshot!("does_not_fit", problem(too_big).await);

    let not_json = app
        .call_with(
            Method::POST,
            "/v1/jobs",
            Some(SUBMITTER),
            None,
            &[("content-type", "application/json")],
        )
        .await;
    insta::assert_json_snapshot!("empty_body", problem(not_json).await);

    let unknown_job = app.get("/v1/jobs/0190-missing").await;
    insta::assert_json_snapshot!("not_found", problem(unknown_job).await);

    let bad_query = app.get("/v1/jobs?state=paused").await;
    insta::assert_json_snapshot!("bad_query", problem(bad_query).await);

    let no_token = app.call(Method::GET, "/v1/jobs", None, None).await;
    insta::assert_json_snapshot!("missing_token", problem(no_token).await);

    let viewer_submits = app
        .call(Method::POST, "/v1/jobs", Some(VIEWER), Some(&tiny_spec(1)))
        .await;
    insta::assert_json_snapshot!("forbidden", problem(viewer_submits).await);

    let no_route = app.get("/v2/nothing").await;
    insta::assert_json_snapshot!("no_route", problem(no_route).await);

    let wrong_method = app
        .call(Method::DELETE, "/v1/jobs", Some(ADMIN), None)
        .await;
    assert_eq!(wrong_method.status, StatusCode::METHOD_NOT_ALLOWED);
    insta::assert_json_snapshot!("wrong_method", problem(wrong_method).await);
}

#[tokio::test]
async fn a_body_over_the_limit_is_a_413_problem() {
    let app = TestApp::with(|s| s.body_limit = 1024).await;
    let mut spec = tiny_spec(1);
    spec["name"] = json!("x".repeat(2000));
    let a = app.submit(&spec).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    insta::assert_json_snapshot!("body_too_large", problem(a).await);
}

#[tokio::test]
async fn a_server_error_is_opaque() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let id = app.submit_ok(&tiny_spec(1)).await;
    // Break the database under the store.
    let url = app.state.settings.database_url();
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("DROP TABLE steps")
        .execute(&pool)
        .await
        .unwrap();
    let a = app.get(&format!("/v1/jobs/{id}/metrics")).await;
    assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR);
    let p = problem(a).await;
    assert!(!p.to_string().contains("steps"), "{p}");
    insta::assert_json_snapshot!("internal", p);
}

#[tokio::test]
async fn a_store_that_does_not_answer_makes_the_server_unavailable() {
    let app = TestApp::new().await;
    assert_eq!(app.get("/readyz").await.status, StatusCode::OK);
    app.state.store.close().await;
    let a = app.get("/readyz").await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    insta::assert_json_snapshot!("unavailable", problem(a).await);
    assert_eq!(app.get("/healthz").await.status, StatusCode::OK);
}

#[tokio::test]
async fn readiness_waits_for_the_local_agent_when_one_is_expected() {
    let app = TestApp::with(|s| s.expect_local_agent = true).await;
    assert_eq!(
        app.get("/readyz").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    app.register("local", 1, GIB).await;
    assert_eq!(app.get("/readyz").await.status, StatusCode::OK);
}
