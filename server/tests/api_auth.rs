//! Every route rejects a missing or unknown token (401) and an under-privileged one (403): the
//! routes and the role each needs are read from the router's OpenAPI document, so a new route
//! cannot skip these tests, and its documented role is the one the server enforces. The
//! console's session cookie gets exactly its token's access, and only from the server's origin.

use crate::api_helpers;

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

/// Every operation of the router's document with the role its security requirement names
/// (the bearer scheme's one scope, or the session scheme): the routes are listed once, by
/// `routes::api`, and these tests cross each one's boundary with every other kind of token.
fn routes() -> Vec<(String, String, Needs)> {
    let doc = serde_json::to_value(document()).unwrap();
    let mut routes = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let requirements = op["security"]
                .as_array()
                .unwrap_or_else(|| panic!("{method} {path} names its own security"));
            let named: Vec<(&String, &serde_json::Value)> = requirements
                .iter()
                .flat_map(|r| r.as_object().unwrap())
                .collect();
            let needs = match named.as_slice() {
                [] => Needs::Nobody,
                [(scheme, scopes)] => {
                    match (scheme.as_str(), scopes.as_array().unwrap().as_slice()) {
                        ("session", []) => Needs::Session,
                        ("bearer", [role]) => match role.as_str().unwrap() {
                            "viewer" => Needs::Viewer,
                            "submitter" => Needs::Submitter,
                            "admin" => Needs::Admin,
                            "agent_join" => Needs::Join,
                            "node" => Needs::NodeToken,
                            other => panic!("{method} {path}: unknown role {other}"),
                        },
                        _ => panic!("{method} {path}: a bearer requirement names one role: {op}"),
                    }
                }
                _ => panic!("{method} {path}: one scheme with its role: {op}"),
            };
            routes.push((method.to_uppercase(), path.clone(), needs));
        }
    }
    routes
}

#[test]
fn the_document_names_a_role_for_every_operation() {
    let routes = routes();
    let needs = |m: &str, p: &str| {
        routes
            .iter()
            .find(|(method, path, _)| (method.as_str(), path.as_str()) == (m, p))
            .map(|r| r.2)
    };
    // The boundaries a wrong annotation would open: the tests below prove the server holds
    // each route to what the document says, these that the document says what it must.
    assert_eq!(needs("GET", "/healthz"), Some(Needs::Nobody));
    assert_eq!(needs("POST", "/v1/jobs"), Some(Needs::Submitter));
    assert_eq!(needs("POST", "/v1/tokens"), Some(Needs::Admin));
    assert_eq!(needs("GET", "/v1/tokens"), Some(Needs::Admin));
    assert_eq!(needs("POST", "/v1/agents/register"), Some(Needs::Join));
    for (method, path, n) in &routes {
        if path.starts_with("/v1/agents/{node}") {
            assert_eq!(*n, Needs::NodeToken, "{method} {path}");
        }
    }
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
    for (method, template, needs) in routes() {
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
        for (method, template, needs) in routes() {
            if needs == Needs::Nobody {
                continue;
            }
            if (method.as_str(), template.as_str()) == ("POST", "/v1/session") {
                // Logging in takes a token, not a session.
                let cookie = app.login(role_token).await;
                let a = app
                    .browser(Method::POST, &template, &cookie, Some(ORIGIN), None)
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
