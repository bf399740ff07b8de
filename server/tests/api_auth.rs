//! Every route rejects a missing or unknown token (401) and an under-privileged one (403); the
//! table must list every operation of the OpenAPI document, so a new route cannot skip it. The
//! console's session cookie gets exactly its token's access, and only from the server's origin.

mod api_helpers;

use api_helpers::*;
use axum::http::{Method, StatusCode};
use serde_json::json;
use server::routes::openapi::document;

/// Who may call a route.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Needs {
    Nobody,
    Viewer,
    Submitter,
    Admin,
    Join,
    NodeToken,
    /// A console session cookie (bearer tokens are not sessions).
    Session,
}

const ROUTES: &[(&str, &str, Needs)] = &[
    ("GET", "/healthz", Needs::Nobody),
    ("GET", "/readyz", Needs::Viewer),
    ("GET", "/metrics", Needs::Viewer),
    ("GET", "/openapi.json", Needs::Viewer),
    ("POST", "/v1/jobs", Needs::Submitter),
    ("GET", "/v1/jobs", Needs::Viewer),
    ("GET", "/v1/jobs/{id}", Needs::Viewer),
    ("POST", "/v1/jobs/{id}/cancel", Needs::Submitter),
    ("GET", "/v1/jobs/{id}/metrics", Needs::Viewer),
    ("GET", "/v1/jobs/{id}/logs", Needs::Viewer),
    ("GET", "/v1/jobs/{id}/events", Needs::Viewer),
    ("GET", "/v1/jobs/{id}/artifacts", Needs::Viewer),
    ("GET", "/v1/jobs/{id}/artifacts/{name}", Needs::Viewer),
    ("POST", "/v1/estimate", Needs::Viewer),
    ("GET", "/v1/nodes", Needs::Viewer),
    ("POST", "/v1/session", Needs::Viewer),
    ("DELETE", "/v1/session", Needs::Session),
    ("POST", "/v1/tokens", Needs::Admin),
    ("GET", "/v1/tokens", Needs::Admin),
    ("DELETE", "/v1/tokens/{name}", Needs::Admin),
    ("POST", "/v1/agents/register", Needs::Join),
    ("POST", "/v1/agents/{node}/heartbeat", Needs::NodeToken),
    (
        "PUT",
        "/v1/agents/{node}/jobs/{job}/attempts/{attempt}/artifacts/{name}",
        Needs::NodeToken,
    ),
    (
        "GET",
        "/v1/agents/{node}/jobs/{job}/artifacts/{name}",
        Needs::NodeToken,
    ),
    (
        "GET",
        "/v1/agents/{node}/jobs/{job}/init_from",
        Needs::NodeToken,
    ),
];

#[test]
fn the_table_lists_every_operation_of_the_api() {
    let doc = serde_json::to_value(document()).unwrap();
    let mut operations: Vec<(String, String)> = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            operations.push((method.to_uppercase(), path.clone()));
        }
    }
    operations.sort();
    let mut table: Vec<(String, String)> = ROUTES
        .iter()
        .map(|(m, p, _)| (m.to_string(), p.to_string()))
        .collect();
    table.sort();
    assert_eq!(table, operations);
}

#[tokio::test]
async fn every_route_rejects_missing_unknown_and_under_privileged_tokens() {
    let app = TestApp::new().await;
    let (node, node_token) = app.register("n1", 1, 2 * GIB).await;
    // An ended job, so that its event stream ends after the first event.
    let job = app.submit_ok(&tiny_spec(1)).await;
    let cancel = format!("/v1/jobs/{job}/cancel");
    app.call(Method::POST, &cancel, Some(SUBMITTER), None).await;
    let body = json!({});
    for &(method, template, needs) in ROUTES {
        // A token name nobody has: an allowed DELETE answers 404 and revokes nothing.
        let path = template
            .replace("{id}", &job)
            .replace("{node}", &node)
            .replace("{job}", &job)
            .replace("{attempt}", "1")
            .replace("{name}", "nobody");
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let call = |token: Option<&str>| {
            let (app, method, path, body) = (&app, method.clone(), path.clone(), &body);
            let token = token.map(str::to_string);
            async move {
                let body = (method == Method::POST).then_some(body);
                app.call(method, &path, token.as_deref(), body).await
            }
        };
        let status = |a: &Answer| a.status;
        let missing = call(None).await;
        if needs == Needs::Nobody {
            assert_eq!(status(&missing), StatusCode::OK, "{template}");
            continue;
        }
        assert_eq!(
            status(&missing),
            StatusCode::UNAUTHORIZED,
            "{template} without a token"
        );
        assert_eq!(missing.content_type(), "application/problem+json");
        assert_eq!(missing.headers["www-authenticate"], "Bearer");
        assert_eq!(
            status(&call(Some("not-a-token")).await),
            StatusCode::UNAUTHORIZED,
            "{template} with an unknown token"
        );
        let (denied, allowed): (Vec<&str>, Vec<&str>) = match needs {
            Needs::Viewer => (vec![JOIN, &node_token], vec![VIEWER, SUBMITTER, ADMIN]),
            Needs::Submitter => (vec![JOIN, &node_token, VIEWER], vec![SUBMITTER, ADMIN]),
            Needs::Admin => (vec![JOIN, &node_token, VIEWER, SUBMITTER], vec![ADMIN]),
            Needs::Join => (vec![&node_token, VIEWER, SUBMITTER, ADMIN], vec![JOIN]),
            Needs::NodeToken => (vec![JOIN, VIEWER, SUBMITTER, ADMIN], vec![&node_token]),
            Needs::Session => {
                for token in [JOIN, &node_token, VIEWER, SUBMITTER, ADMIN] {
                    let a = call(Some(token)).await;
                    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{template}: {}", a.text);
                }
                continue;
            }
            Needs::Nobody => unreachable!(),
        };
        for token in denied {
            let a = call(Some(token)).await;
            // A node token is not a person's token: unknown to the people's routes.
            let want = if token == node_token {
                StatusCode::UNAUTHORIZED
            } else {
                StatusCode::FORBIDDEN
            };
            assert_eq!(a.status, want, "{template} with {token}: {}", a.text);
        }
        for token in allowed {
            let a = call(Some(token)).await;
            assert!(
                ![StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN].contains(&a.status),
                "{template} with {token}: {} {}",
                a.status,
                a.text
            );
        }
    }
}

/// What each role's token may call, as the bearer-token test above checks it.
fn allowed(needs: Needs, role_token: &str) -> bool {
    match needs {
        Needs::Nobody => true,
        Needs::Viewer | Needs::Session => [VIEWER, SUBMITTER, ADMIN].contains(&role_token),
        Needs::Submitter => [SUBMITTER, ADMIN].contains(&role_token),
        Needs::Admin => role_token == ADMIN,
        // Agents never use the console's cookie.
        Needs::Join | Needs::NodeToken => false,
    }
}

#[tokio::test]
async fn a_session_cookie_has_exactly_its_tokens_access_on_every_route() {
    let app = TestApp::new().await;
    let (node, _) = app.register("n1", 1, 2 * GIB).await;
    let job = app.submit_ok(&tiny_spec(1)).await;
    app.call(
        Method::POST,
        &format!("/v1/jobs/{job}/cancel"),
        Some(SUBMITTER),
        None,
    )
    .await;
    for role_token in [VIEWER, SUBMITTER, ADMIN] {
        for &(method, template, needs) in ROUTES {
            if needs == Needs::Nobody {
                continue;
            }
            if (method, template) == ("POST", "/v1/session") {
                // Logging in takes a token, not a session.
                let cookie = app.login(role_token).await;
                let a = app
                    .browser(Method::POST, template, &cookie, Some(ORIGIN), None)
                    .await;
                assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{}", a.text);
                continue;
            }
            // A fresh session each time: DELETE /v1/session ends it.
            let cookie = app.login(role_token).await;
            let path = template
                .replace("{id}", &job)
                .replace("{node}", &node)
                .replace("{job}", &job)
                .replace("{attempt}", "1")
                .replace("{name}", "nobody");
            let method = Method::from_bytes(method.as_bytes()).unwrap();
            let body = (method == Method::POST).then(|| json!({}));
            let a = app
                .browser(method, &path, &cookie, Some(ORIGIN), body.as_ref())
                .await;
            let refused = [StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN].contains(&a.status);
            assert_eq!(
                !refused,
                allowed(needs, role_token),
                "{template} with {role_token}'s cookie: {} {}",
                a.status,
                a.text
            );
        }
    }
}

#[tokio::test]
async fn a_cookie_request_that_changes_state_needs_the_servers_origin() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let cookie = app.login(ADMIN).await;
    let job = app.submit_ok(&tiny_spec(1)).await;
    let cancel = format!("/v1/jobs/{job}/cancel");
    for origin in [
        Some("http://evil.example"),
        Some("null"),
        Some("https://zerotrain.test:8080"),
        None,
    ] {
        for (method, path) in [
            (Method::POST, cancel.as_str()),
            (Method::POST, "/v1/jobs"),
            (Method::POST, "/v1/tokens"),
            (Method::DELETE, "/v1/session"),
        ] {
            let body = (method == Method::POST).then(|| tiny_spec(1));
            let a = app
                .browser(method, path, &cookie, origin, body.as_ref())
                .await;
            assert_eq!(
                a.status,
                StatusCode::FORBIDDEN,
                "{path} from {origin:?}: {}",
                a.text
            );
            assert_eq!(a.json()["type"], "urn:zerotrain:problem:cross-origin");
        }
    }
    // Nothing happened: the job is still queued, and the session still works.
    assert_eq!(app.job(&job).await["state"], "queued");
    let a = app
        .browser(Method::POST, &cancel, &cookie, Some(ORIGIN), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    // Reading needs no Origin (browsers send none on same-origin GETs).
    let a = app
        .browser(Method::GET, "/v1/jobs", &cookie, None, None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
}
