//! `/v1/tokens`: an admin creates tokens with roles, lists them and revokes them.

use crate::api_helpers;

use api_helpers::*;
use axum::http::{Method, StatusCode};
use serde_json::{Value, json};

async fn create(app: &TestApp, body: Value) -> Answer {
    app.call(Method::POST, "/v1/tokens", Some(ADMIN), Some(&body))
        .await
}

async fn names(app: &TestApp) -> Vec<String> {
    let a = app.call(Method::GET, "/v1/tokens", Some(ADMIN), None).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    a.json()["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            assert!(t.get("token").is_none(), "a listing shows no token: {t}");
            t["name"].as_str().unwrap().to_string()
        })
        .collect()
}

#[tokio::test]
async fn a_created_token_acts_with_its_role_and_is_listed_without_its_secret() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let a = create(&app, json!({"name": "carol", "role": "submitter"})).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let created = a.json();
    assert_eq!(created["name"], "carol");
    assert_eq!(created["role"], "submitter");
    assert!(created["created_at"].as_i64().unwrap() > 0);
    let carol = created["token"].as_str().unwrap().to_string();
    assert!(carol.starts_with("zt_") && carol.len() == 67, "{carol}");
    // Jobs submitted with it belong to its name.
    let a = app
        .call(Method::POST, "/v1/jobs", Some(&carol), Some(&tiny_spec(1)))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.json()["owner"], "carol");
    // A viewer token reads but does not submit, and cannot manage tokens.
    let dave = create(&app, json!({"name": "dave", "role": "viewer"}))
        .await
        .json()["token"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        app.call(Method::GET, "/v1/jobs", Some(&dave), None)
            .await
            .status,
        StatusCode::OK
    );
    let a = app
        .call(Method::POST, "/v1/jobs", Some(&dave), Some(&tiny_spec(1)))
        .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.text);
    let a = app
        .call(Method::GET, "/v1/tokens", Some(&carol), None)
        .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.text);
    let mut listed = names(&app).await;
    listed.sort();
    assert_eq!(
        listed,
        ["admin", "alice", "bob", "carol", "dave", "join", "watcher"]
    );
}

#[tokio::test]
async fn bad_names_roles_and_fields_are_refused_naming_the_field_and_write_nothing() {
    let app = TestApp::new().await;
    let before = names(&app).await;
    let long = "x".repeat(65);
    for (body, field) in [
        (json!({"name": "", "role": "viewer"}), "name"),
        (json!({"name": "has space", "role": "viewer"}), "name"),
        (json!({"name": long, "role": "viewer"}), "name"),
        (json!({"name": "ok", "role": "root"}), "role"),
        (
            json!({"name": "ok", "role": "viewer", "expires": 3}),
            "body",
        ),
        (json!({"role": "viewer"}), "body"),
    ] {
        let a = create(&app, body.clone()).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text);
        assert_eq!(a.content_type(), "application/problem+json");
        assert_eq!(a.json()["field"], field, "{body}: {}", a.text);
    }
    // A taken name is a conflict, and the first token keeps it.
    let a = create(&app, json!({"name": "alice", "role": "admin"})).await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text);
    assert_eq!(a.json()["type"], "urn:zerotrain:problem:token-name-taken");
    assert_eq!(names(&app).await, before);
    let a = app
        .call(Method::GET, "/v1/tokens", Some(SUBMITTER), None)
        .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn a_revoked_token_is_refused_and_the_last_admin_token_stays() {
    let app = TestApp::new().await;
    let revoke = |name: &'static str, token: &'static str| {
        let app = &app;
        async move {
            app.call(
                Method::DELETE,
                &format!("/v1/tokens/{name}"),
                Some(token),
                None,
            )
            .await
        }
    };
    assert_eq!(app.get("/v1/jobs").await.status, StatusCode::OK);
    assert_eq!(
        revoke("watcher", ADMIN).await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(app.get("/v1/jobs").await.status, StatusCode::UNAUTHORIZED);
    let a = revoke("watcher", ADMIN).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text);
    // The only admin token cannot go: nobody could manage the server without it.
    let a = revoke("admin", ADMIN).await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text);
    assert_eq!(a.json()["type"], "urn:zerotrain:problem:last-admin");
    let root = create(&app, json!({"name": "root", "role": "admin"}))
        .await
        .json()["token"]
        .as_str()
        .unwrap()
        .to_string();
    let a = app
        .call(Method::DELETE, "/v1/tokens/admin", Some(&root), None)
        .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.text);
    let a = app.call(Method::GET, "/v1/tokens", Some(ADMIN), None).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
}
