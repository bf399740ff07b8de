//! `/v1/session`: the console's cookie — its attributes, logout, expiry, and that revoking the
//! token ends it at once.

use crate::api_helpers;

use api_helpers::*;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use serde_json::json;
use server::settings::parse_public_url;

fn set_cookie(a: &Answer) -> String {
    a.headers[header::SET_COOKIE].to_str().unwrap().to_string()
}

#[tokio::test]
async fn login_sets_an_http_only_same_site_strict_cookie_with_a_max_age() {
    let app = TestApp::new().await;
    let a = app
        .call(Method::POST, "/v1/session", Some(VIEWER), None)
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.json()["name"], "watcher");
    assert_eq!(a.json()["role"], "viewer");
    let cookie = set_cookie(&a);
    assert!(cookie.starts_with("zerotrain_session=zt_"), "{cookie}");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=43200"] {
        assert!(cookie.contains(attribute), "{attribute} in {cookie}");
    }
    // Plain HTTP: a Secure cookie would never come back.
    assert!(!cookie.contains("Secure"), "{cookie}");
}

/// A login form without a token, or an empty body whatever its `Content-Type` says, leaves the
/// token to the `Authorization` header.
#[tokio::test]
async fn a_login_form_without_a_token_leaves_it_to_the_bearer_token() {
    let app = TestApp::new().await;
    let login = |body: &'static str, token: Option<&str>| {
        let mut req = Request::post("/v1/session")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        app.send(req.body(Body::from(body)).unwrap())
    };
    let a = login("", Some(VIEWER)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.json()["name"], "watcher");
    let a = login("next=%2Fjobs", Some(VIEWER)).await;
    assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.text);
    assert_eq!(a.headers[header::LOCATION], "/jobs");
    assert!(a.headers.contains_key(header::SET_COOKIE));
    for body in ["", "next=%2Fjobs", "token=&next=%2Fjobs"] {
        let a = login(body, None).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{body:?}: {}", a.text);
    }
    let a = login("AAA", Some(VIEWER)).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text);
    assert_eq!(a.json()["field"], "body");
}

#[tokio::test]
async fn behind_https_the_cookie_is_secure_and_host_prefixed() {
    let app = TestApp::with(|s| {
        s.public_url = Some(parse_public_url("https://zt.example.com").unwrap());
    })
    .await;
    let a = app
        .call(Method::POST, "/v1/session", Some(VIEWER), None)
        .await;
    let cookie = set_cookie(&a);
    assert!(cookie.starts_with("__Host-zerotrain_session="), "{cookie}");
    assert!(
        cookie.contains("Secure") && !cookie.contains("Domain"),
        "{cookie}"
    );
    // The origin is the public URL's, whatever Host the proxy forwards.
    let session = cookie.split(';').next().unwrap();
    let job_cancel = "/v1/jobs/nope/cancel";
    let from = |origin: &'static str| {
        let headers = [
            ("host", "10.0.0.5:8080"),
            ("cookie", session),
            ("origin", origin),
        ];
        let app = &app;
        async move {
            app.call_with(Method::POST, job_cancel, None, None, &headers)
                .await
        }
    };
    assert_eq!(
        from("http://10.0.0.5:8080").await.status,
        StatusCode::FORBIDDEN
    );
    // Admitted (the viewer is then refused for its role, not for its origin).
    let a = from("https://zt.example.com").await;
    assert_eq!(
        a.json()["type"],
        "urn:zerotrain:problem:forbidden",
        "{}",
        a.text
    );
}

#[tokio::test]
async fn a_revoked_tokens_cookie_stops_working_at_once() {
    let app = TestApp::new().await;
    let a = app
        .call(
            Method::POST,
            "/v1/tokens",
            Some(ADMIN),
            Some(&json!({"name": "carol", "role": "submitter"})),
        )
        .await;
    let token = a.json()["token"].as_str().unwrap().to_string();
    let cookie = app.login(&token).await;
    let a = app
        .browser(Method::GET, "/v1/jobs", &cookie, None, None)
        .await;
    assert_eq!(a.status, StatusCode::OK);
    let a = app
        .call(Method::DELETE, "/v1/tokens/carol", Some(ADMIN), None)
        .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    let a = app
        .browser(Method::GET, "/v1/jobs", &cookie, None, None)
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{}", a.text);
    assert_eq!(a.json()["type"], "urn:zerotrain:problem:session-ended");
}

#[tokio::test]
async fn logout_ends_the_session_and_deletes_the_cookie() {
    let app = TestApp::new().await;
    let cookie = app.login(SUBMITTER).await;
    let a = app
        .browser(Method::DELETE, "/v1/session", &cookie, Some(ORIGIN), None)
        .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.text);
    let cleared = set_cookie(&a);
    assert!(
        cleared.starts_with("zerotrain_session=;") && cleared.contains("Max-Age=0"),
        "{cleared}"
    );
    // The old cookie, replayed, is dead.
    let a = app
        .browser(Method::GET, "/v1/jobs", &cookie, None, None)
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_session_ends_after_its_lifetime() {
    let app = TestApp::with(|s| s.session_ttl = std::time::Duration::ZERO).await;
    let cookie = app.login(VIEWER).await;
    let a = app
        .browser(Method::GET, "/v1/jobs", &cookie, None, None)
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn the_login_form_redirects_to_a_local_next_only() {
    let app = TestApp::new().await;
    for (next, to) in [
        ("/jobs/x?tab=logs", "/jobs/x?tab=logs"),
        ("//evil.example/", "/"),
        ("https://evil.example/", "/"),
    ] {
        let body = serde_urlencoded::to_string([("token", SUBMITTER), ("next", next)]).unwrap();
        let req = axum::http::Request::post("/v1/session")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(header::ORIGIN, ORIGIN)
            .header(header::HOST, HOST)
            .body(axum::body::Body::from(body))
            .unwrap();
        let a = app.send(req).await;
        assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.text);
        assert_eq!(a.headers[header::LOCATION], to);
        assert!(set_cookie(&a).starts_with("zerotrain_session=zt_"));
    }
}

#[tokio::test]
async fn only_a_persons_token_from_this_origin_logs_in() {
    let app = TestApp::new().await;
    let a = app
        .call(Method::POST, "/v1/session", Some(JOIN), None)
        .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.text);
    let a = app
        .call(Method::POST, "/v1/session", Some("zt_nope"), None)
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    let a = app
        .call_with(
            Method::POST,
            "/v1/session",
            Some(ADMIN),
            None,
            &[("host", HOST), ("origin", "http://evil.example")],
        )
        .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert!(!a.headers.contains_key(header::SET_COOKIE));
}
