//! The console's pages as a browser without JavaScript gets them: server-rendered tables, a
//! strict Content-Security-Policy, the login redirect, cached assets. (The browser test,
//! `--test zerotrain console::`, drives them in Chromium.)

use crate::api_helpers;

use api_helpers::*;
use axum::http::{Method, StatusCode, header};
use scheduler::bytes::human;
use scheduler::plan::Plan;
use server::domain::JobId;

async fn page(app: &TestApp, path: &str, cookie: &str) -> Answer {
    let a = app.browser(Method::GET, path, cookie, None, None).await;
    assert_eq!(a.status, StatusCode::OK, "{path}: {}", a.text);
    assert!(a.content_type().starts_with("text/html"), "{path}");
    let csp = a.headers[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    assert!(
        !a.text.contains("<script>") && !a.text.contains(" style="),
        "{path}: inline script or style"
    );
    a
}

#[tokio::test]
async fn without_a_session_pages_send_you_to_the_login_page_and_back() {
    let app = TestApp::new().await;
    for path in ["/", "/jobs/x", "/nodes", "/plan", "/compare?id=a&id=b"] {
        let a = app.call(Method::GET, path, None, None).await;
        assert_eq!(a.status, StatusCode::SEE_OTHER, "{path}");
        let to = a.headers[header::LOCATION].to_str().unwrap();
        let next: Vec<(String, String)> =
            serde_urlencoded::from_str(to.strip_prefix("/login?").unwrap()).unwrap();
        assert_eq!(next, vec![("next".to_string(), path.to_string())]);
    }
    let a = app
        .call(Method::GET, "/login?next=/nodes", None, None)
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.text.contains(r#"action="/v1/session""#) && a.text.contains(r#"value="/nodes""#));
    // An agent's join token is no person's: refused, not redirected.
    let a = app.call(Method::GET, "/", Some(JOIN), None).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert!(a.content_type().starts_with("text/html"));
}

#[tokio::test]
async fn the_jobs_and_job_pages_render_their_tables_without_javascript() {
    let app = TestApp::new().await;
    app.register("n1", 2, 2 * GIB).await;
    let first = app.submit_ok(&tiny_spec(1)).await;
    let mut other = tiny_spec(2);
    other["name"] = "second".into();
    let second = app.submit_ok(&other).await;
    app.call(
        Method::POST,
        &format!("/v1/jobs/{second}/cancel"),
        Some(SUBMITTER),
        None,
    )
    .await;
    let cookie = app.login(VIEWER).await;
    let jobs = page(&app, "/", &cookie).await;
    assert!(jobs.text.contains(r#"<table id="jobs">"#));
    for id in [&first, &second] {
        assert!(jobs.text.contains(&format!("/jobs/{id}")), "{id} listed");
    }
    // Filters and sort come from the query string, through GET /v1/jobs's own paging.
    let cancelled = page(&app, "/?state=cancelled&sort=name", &cookie).await;
    assert!(cancelled.text.contains(&second) && !cancelled.text.contains(&first));
    assert!(
        cancelled
            .text
            .contains(r#"<option selected>cancelled</option>"#)
    );
    let alice = page(&app, "/?owner=alice&name=second", &cookie).await;
    assert!(alice.text.contains(&second) && !alice.text.contains(&format!("/jobs/{first}\"")));
    // A viewer gets no cancel button.
    assert!(!jobs.text.contains("bulk-cancel"));

    let job = page(&app, &format!("/jobs/{second}"), &cookie).await;
    for table in [r#"<table id="history">"#, r#"<table id="plan">"#] {
        assert!(job.text.contains(table), "{table}");
    }
    assert!(job.text.contains("cancelled by alice"));
    assert!(job.text.contains("ZeRO stage"));
    assert!(job.text.contains(r#"id="chart-memory""#));
    let missing = app
        .browser(Method::GET, "/jobs/nope", &cookie, None, None)
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert!(missing.content_type().starts_with("text/html"));

    let nodes = page(&app, "/nodes", &cookie).await;
    assert!(nodes.text.contains("n1") && nodes.text.contains(r#"<table class="devices">"#));
    let compare = page(&app, &format!("/compare?id={first}&id={second}"), &cookie).await;
    // world_size differs; the model does not.
    assert!(
        compare
            .text
            .contains(r#"<tr class="differs"><th>spec.world_size</th>"#),
        "{}",
        compare.text
    );
    assert!(compare.text.contains("<tr><th>spec.model.preset</th>"));
    let plan = page(&app, &format!("/plan?from={first}"), &cookie).await;
    assert!(plan.text.contains("gpt2-tiny") && plan.text.contains("viewer"));
}

#[tokio::test]
async fn a_finished_job_s_page_links_its_files_which_download_with_the_session() {
    let app = TestApp::new().await;
    let node = app.register("n1", 1, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(1)).await.into();
    app.schedule().await;
    app.beat(&node, vec![], vec![]).await;
    let cookie = app.login(VIEWER).await;
    let before = page(&app, &format!("/jobs/{id}"), &cookie).await;
    assert!(before.text.contains("No files yet"), "{}", before.text);
    for (name, text) in [("model.safetensors", "weights"), ("config.json", "{}")] {
        app.upload(&node, &id, 1, name, text).await;
    }
    let finished = wire::agent::Report::Finished {
        job_id: id.clone(),
        attempt: 1,
        final_loss: 1.0,
    };
    app.beat(&node, vec![finished], vec![]).await;
    let after = page(&app, &format!("/jobs/{id}"), &cookie).await;
    let href = format!("/v1/jobs/{id}/artifacts/model.safetensors");
    assert!(
        after.text.contains(r#"<table id="files">"#),
        "{}",
        after.text
    );
    assert!(
        after
            .text
            .contains(&format!(r#"<a href="{href}" download>"#))
    );
    let file = app.browser(Method::GET, &href, &cookie, None, None).await;
    assert_eq!(
        (file.status, file.text.as_str()),
        (StatusCode::OK, "weights")
    );
}

#[tokio::test]
async fn assets_are_embedded_with_an_etag_and_a_long_cache() {
    let app = TestApp::new().await;
    let cookie = app.login(VIEWER).await;
    let jobs = page(&app, "/", &cookie).await;
    let start = jobs.text.find("/assets/htmx.min.js?v=").unwrap();
    let url = &jobs.text[start..start + jobs.text[start..].find('"').unwrap()];
    let a = app.call(Method::GET, url, None, None).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.text.contains("htmx"));
    assert!(
        a.headers[header::CACHE_CONTROL]
            .to_str()
            .unwrap()
            .contains("max-age=31536000")
    );
    let etag = a.headers[header::ETAG].to_str().unwrap().to_string();
    let again = app
        .call_with(Method::GET, url, None, None, &[("if-none-match", &etag)])
        .await;
    assert_eq!(again.status, StatusCode::NOT_MODIFIED);
    let none = app.call(Method::GET, "/assets/nope.js", None, None).await;
    assert_eq!(none.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn the_job_page_sets_each_process_s_peak_beside_its_predicted_total_not_per_rank() {
    let app = TestApp::new().await;
    let node = app.register("n1", 2, 2 * GIB).await;
    let id: JobId = app.submit_ok(&tiny_spec(2)).await.into();
    assert_eq!(app.schedule().await, 1);
    app.beat(&node, vec![], vec![]).await;
    let reports = vec![memory_report(&id, 0), memory_report(&id, 1)];
    app.beat(&node, reports, vec![(id.clone(), 1)]).await;
    let plan: Plan = serde_json::from_value(app.job(&id).await["plan"].clone()).unwrap();
    let per_rank = plan.per_rank_bytes;
    assert!(
        per_rank.overhead > 0,
        "a CPU rank's plan counts the process overhead"
    );

    let cookie = app.login(VIEWER).await;
    let page = page(&app, &format!("/jobs/{id}"), &cookie).await.text;
    let table = |id: &str| {
        let start = page.find(&format!(r#"<table id="{id}">"#)).expect(id);
        page[start..start + page[start..].find("</table>").unwrap()].to_string()
    };
    // The ranks' table has no overhead row (a rank measures none of it) …
    let ranks = table("memory");
    assert!(ranks.contains("<th>optimizer</th>") && !ranks.contains("<th>overhead</th>"));
    // … the process's table sets its peak beside both ranks' totals and one overhead.
    let process = table("processes");
    let predicted = 2 * (per_rank.total() - per_rank.overhead) + per_rank.overhead;
    let row = format!(
        "<td>{}</td><td>0, 1</td><td>{}</td><td>{}</td>",
        node.0,
        human(123_456_789),
        human(predicted)
    );
    assert!(process.contains(&row), "{row} in {process}");
}
