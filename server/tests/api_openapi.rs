//! `openapi/openapi.json` is the document the router generates, the server serves the same,
//! and the document says what the server does: the routes it has, where its parameters go,
//! the bounds it enforces, the fields it requires, the answers every route can give and the
//! streams it sends.

use crate::api_helpers;

use std::path::PathBuf;

use api_helpers::*;
use axum::http::{Method, StatusCode};
use serde_json::{Value, json};
use server::routes::openapi::document;

const REGENERATE: &str = "UPDATE_OPENAPI=1 cargo test -p server --test server api_openapi::";

fn committed() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../openapi/openapi.json")
}

fn doc() -> Value {
    serde_json::to_value(document()).unwrap()
}

/// Every (method, path template, operation) of the document.
fn operations(doc: &Value) -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            out.push((method.to_uppercase(), path.clone(), op.clone()));
        }
    }
    out
}

#[test]
fn the_committed_openapi_document_is_current() {
    let generated = document().to_pretty_json().unwrap() + "\n";
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
    let doc = doc();
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
    assert_eq!(a.content_type(), "application/json");
    assert_eq!(a.json(), doc());
}

/// The router answers every documented operation, and every other method on a documented
/// path is 405: no route the document lacks, no operation the router lacks. (A path the
/// document lacks cannot be asked for; `routes::api` registers only through `routes!`.)
#[tokio::test]
async fn the_router_has_exactly_the_documented_operations() {
    let app = TestApp::new().await;
    let doc = doc();
    let methods = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
    ];
    for (path, item) in doc["paths"].as_object().unwrap() {
        let concrete = path
            .replace("{id}", "no-such-job")
            .replace("{node}", "no-such-node")
            .replace("{name}", "no-such-token");
        for method in &methods {
            let documented = item.get(method.as_str().to_lowercase()).is_some();
            let a = app.call(method.clone(), &concrete, None, None).await;
            if documented {
                // Unauthenticated: 401, or 200 where no token is needed; never "no route".
                assert!(
                    matches!(a.status, StatusCode::UNAUTHORIZED | StatusCode::OK),
                    "{method} {path}: {} {}",
                    a.status,
                    a.text
                );
            } else {
                assert_eq!(
                    a.status,
                    StatusCode::METHOD_NOT_ALLOWED,
                    "{method} {path} is routed but not documented"
                );
            }
        }
    }
}

#[test]
fn parameters_are_where_the_handlers_read_them() {
    let doc = doc();
    for (method, path, op) in operations(&doc) {
        for p in op["parameters"].as_array().into_iter().flatten() {
            let (name, place) = (p["name"].as_str().unwrap(), p["in"].as_str().unwrap());
            let in_template = path.contains(&format!("{{{name}}}"));
            assert_eq!(
                place == "path",
                in_template,
                "{method} {path}: {name} is declared in {place}"
            );
        }
    }
    let list = &doc["paths"]["/v1/jobs"]["get"]["parameters"];
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["in"] == "query" && p["required"] != true)
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["state", "name", "owner", "sort", "cursor", "limit"],
        "{list:#}"
    );
}

/// The query parameter `name` of an operation.
fn query_param<'a>(doc: &'a Value, method: &str, path: &str, name: &str) -> &'a Value {
    doc["paths"][path][method]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name && p["in"] == "query")
        .unwrap_or_else(|| panic!("{method} {path} has no query parameter {name}"))
}

/// At each documented bound of every bounded integer query parameter the server answers, and
/// one past it the server refuses with a 400 naming the parameter.
#[tokio::test]
async fn the_server_enforces_exactly_the_documented_bounds() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let job = app.submit_ok(&tiny_spec(1)).await;
    let doc = doc();
    let limit = &query_param(&doc, "get", "/v1/jobs", "limit")["schema"];
    assert_eq!(
        (&limit["minimum"], &limit["maximum"]),
        (&json!(1), &json!(500))
    );
    let mut checked = 0;
    for (method, template, op) in operations(&doc) {
        if method != "GET" {
            continue;
        }
        let path = template.replace("{id}", &job);
        for p in op["parameters"].as_array().into_iter().flatten() {
            let schema = &p["schema"];
            if p["in"] != "query" || schema["type"] != "integer" {
                continue;
            }
            let name = p["name"].as_str().unwrap();
            let bounds = [("minimum", -1), ("maximum", 1)];
            for (bound, step) in bounds {
                let Some(at) = schema[bound].as_i64() else {
                    continue;
                };
                let inside = app.get(&format!("{path}?{name}={at}")).await;
                assert_eq!(inside.status, StatusCode::OK, "{path} {name}={at}");
                let past = at + step;
                let outside = app.get(&format!("{path}?{name}={past}")).await;
                assert_eq!(
                    outside.status,
                    StatusCode::BAD_REQUEST,
                    "{path} {name}={past}"
                );
                assert_eq!(outside.json()["field"], name);
                checked += 1;
            }
        }
    }
    // list's and logs' `limit`, two bounds each.
    assert_eq!(checked, 4);
}

#[tokio::test]
async fn the_job_spec_requires_model_as_the_server_does() {
    let doc = doc();
    let schema = &doc["components"]["schemas"]["JobSpec"];
    assert_eq!(schema["required"], json!(["model"]));
    for path in ["/v1/jobs", "/v1/estimate"] {
        let body = &doc["paths"][path]["post"]["requestBody"];
        assert_eq!(body["required"], true, "{path}");
        assert_eq!(
            body["content"]["application/json"]["schema"]["$ref"], "#/components/schemas/JobSpec",
            "{path}"
        );
    }
    let app = TestApp::new().await;
    let a = app.submit(&json!({"name": "no-model"})).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    assert_eq!(a.json()["field"], "model");
}

/// The schema's top-level keys are the spec's: every field of a normalised spec, and
/// `deepspeed` for the DeepSpeed form.
#[tokio::test]
async fn the_job_spec_schema_names_every_field_of_the_spec() {
    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    // With adapters, so that the optional `lora` block is there too.
    let mut submitted = tiny_spec(1);
    submitted["lora"] = serde_json::json!({"rank": 2});
    let id = app.submit_ok(&submitted).await;
    let spec = app.job(&id).await["spec"].clone();
    let mut fields: Vec<&str> = spec
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    fields.push("deepspeed");
    fields.sort();
    let doc = doc();
    let schema = &doc["components"]["schemas"]["JobSpec"];
    let mut documented: Vec<&str> = schema["properties"]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    documented.sort();
    assert_eq!(documented, fields);
    assert_eq!(schema["additionalProperties"], false);
}

#[test]
fn every_route_documents_the_answers_it_shares() {
    let doc = doc();
    for (method, path, op) in operations(&doc) {
        let responses = op["responses"].as_object().unwrap();
        let public = op["security"] == json!([{}]);
        for status in ["401", "403", "429", "503"] {
            assert_eq!(
                responses.contains_key(status),
                !public,
                "{method} {path} and {status}"
            );
        }
        let body = &op["requestBody"]["content"];
        if body.is_object() {
            assert!(responses.contains_key("413"), "{method} {path} and 413");
        }
        if body.get("application/json").is_some() {
            assert!(responses.contains_key("415"), "{method} {path} and 415");
        }
    }
    let shared = &doc["components"]["responses"];
    assert_eq!(
        shared["Unauthorized"]["content"]["application/problem+json"]["schema"]["$ref"],
        "#/components/schemas/Problem"
    );
    assert!(shared["TooManyFailedAuthentications"]["headers"]["Retry-After"].is_object());
}

/// `logs?follow=true` is documented as the event stream it is.
#[tokio::test]
async fn followed_logs_are_a_documented_event_stream() {
    let doc = doc();
    let ok = &doc["paths"]["/v1/jobs/{id}/logs"]["get"]["responses"]["200"]["content"];
    assert_eq!(
        ok["application/json"]["schema"]["$ref"],
        "#/components/schemas/LogPage"
    );
    assert_eq!(
        ok["text/event-stream"]["schema"]["$ref"],
        "#/components/schemas/LogEvent"
    );
    let events = &doc["paths"]["/v1/jobs/{id}/events"]["get"]["responses"]["200"]["content"];
    assert!(events["text/event-stream"].is_object(), "{events:#}");

    let app = TestApp::new().await;
    app.register("n1", 1, 2 * GIB).await;
    let job = app.submit_ok(&tiny_spec(1)).await;
    let cancel = format!("/v1/jobs/{job}/cancel");
    app.call(Method::POST, &cancel, Some(SUBMITTER), None).await;
    let a = app.get(&format!("/v1/jobs/{job}/logs?follow=true")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.content_type(), "text/event-stream");
    assert!(a.text.contains("event: end\ndata: cancelled"), "{}", a.text);
}

/// The login form is optional (the token may come as a bearer token instead): a body that is
/// not required, rather than a form that may be `null`.
#[test]
fn an_optional_body_is_not_required_rather_than_null() {
    let doc = doc();
    let body = &doc["paths"]["/v1/session"]["post"]["requestBody"];
    assert_eq!(body["required"], false, "{body:#}");
    assert_eq!(
        body["content"]["application/x-www-form-urlencoded"]["schema"]["$ref"],
        "#/components/schemas/LoginForm"
    );
}
