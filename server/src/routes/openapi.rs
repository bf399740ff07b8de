//! `GET /openapi.json`: the OpenAPI 3.1 document of the router `routes::api` builds, from the
//! handlers' annotations and types, with the answers every operation shares added here;
//! `openapi/openapi.json` is a committed copy a test keeps current.

use axum::Extension;
use axum::body::Bytes;
use axum::http::header;
use axum::response::IntoResponse;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::Operation;
use utoipa::openapi::request_body::RequestBody;
use utoipa::openapi::security::{
    ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
};
use utoipa::openapi::{
    Content, ObjectBuilder, OpenApi as Document, Ref, RefOr, Required, Response, ResponseBuilder,
    Schema, Type,
};
use utoipa::{Modify, OpenApi, PartialSchema, ToSchema};

use crate::auth::Viewer;
use crate::error::{PROBLEM_JSON, Problem};
use crate::state::JobEvent;

/// The document's frame: what `routes!` does not add.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "zerotrain",
        description = "ZeRO-sharded mixed-precision training as a service. Every endpoint but \
            /healthz takes a bearer token: viewer < submitter < admin (admins manage tokens at \
            /v1/tokens); agents use the join token \
            to register and their node's token to heartbeat; each operation's bearer \
            requirement names, as its scope, the role it needs. Browsers exchange a token for a \
            session cookie at /v1/session; cookie-authenticated requests that change state \
            must carry the server's Origin. Errors are RFC 9457 \
            application/problem+json."
    ),
    components(schemas(JobEvent)),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
)]
pub(crate) struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut Document) {
        let components = openapi.components.get_or_insert_with(Default::default);
        // An operation's bearer requirement names the role it needs as its one scope (OpenAPI
        // 3.1 lets non-OAuth schemes list role names): viewer < submitter < admin, agent_join
        // (the join token) or node (the node's own token, whose `{node}` the path must name).
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        // The console's login, which its person's routes also accept in place of the token.
        components.add_security_scheme(
            "session",
            SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::with_description(
                crate::session::COOKIE,
                "The session cookie POST /v1/session sets (`__Host-` prefixed behind HTTPS)",
            ))),
        );
    }
}

/// This API's OpenAPI document, as `GET /openapi.json` serves it.
pub fn document() -> Document {
    super::api().1
}

/// Answers that come from the extractors and middleware every operation of a kind passes
/// through, rather than from its handler: (status, component name, why).
const TOKEN_ANSWERS: [(&str, &str, &str); 4] = [
    (
        "401",
        "Unauthorized",
        "No bearer token (or console session), or one the server does not know",
    ),
    (
        "403",
        "Forbidden",
        "The token's role may not do this (or a cookie-authenticated change came from another \
         origin)",
    ),
    (
        "429",
        "TooManyFailedAuthentications",
        "Too many failed authentications from this address: retry after `Retry-After` seconds",
    ),
    (
        "503",
        "Unavailable",
        "The store does not answer, so the token cannot be checked",
    ),
];

const BODY_ANSWERS: [(&str, &str, &str); 1] = [(
    "413",
    "BodyTooLarge",
    "The body is larger than the server accepts",
)];

const JSON_BODY_ANSWERS: [(&str, &str, &str); 1] = [(
    "415",
    "NotJson",
    "The body's `Content-Type` is not `application/json`",
)];

/// The router's document completed: the answers its operations share, and optional bodies
/// said the OpenAPI way.
pub(crate) fn finish(mut doc: Document) -> Document {
    add_shared_responses(&mut doc);
    for op in operations(&mut doc) {
        if let Some(body) = &mut op.request_body {
            optional_body_without_null(body);
        }
    }
    doc
}

/// Every operation of `doc`.
fn operations(doc: &mut Document) -> impl Iterator<Item = &mut Operation> {
    doc.paths.paths.values_mut().flat_map(|item| {
        [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ]
        .into_iter()
        .flatten()
    })
}

/// The answers `doc`'s operations share: those that take a token can be refused it (401,
/// 403), rate-limited (429) or find the store away (503); those with a body can send too much
/// (413), and those with a JSON body something else (415). Each is a problem+json response
/// component; an operation that documents one of these statuses itself keeps its own.
fn add_shared_responses(doc: &mut Document) {
    let components = doc.components.get_or_insert_with(Default::default);
    components
        .schemas
        .entry(Problem::name().into_owned())
        .or_insert_with(Problem::schema);
    let shared = TOKEN_ANSWERS
        .iter()
        .chain(&BODY_ANSWERS)
        .chain(&JSON_BODY_ANSWERS);
    for (status, name, why) in shared {
        components
            .responses
            .insert(name.to_string(), shared_response(status, why).into());
    }
    for op in operations(doc) {
        if takes_token(op) {
            add_refs(op, &TOKEN_ANSWERS);
        }
        if let Some(body) = &op.request_body {
            let json = body.content.contains_key("application/json");
            add_refs(op, &BODY_ANSWERS);
            if json {
                add_refs(op, &JSON_BODY_ANSWERS);
            }
        }
    }
}

/// utoipa writes an `Option<T>` body as required, with a schema of `T` or `null`; but no body
/// is not a `null` body (which a form cannot even say): it is a body that is not required.
fn optional_body_without_null(body: &mut RequestBody) {
    let is_null = |s: &RefOr<Schema>| matches!(s, RefOr::T(Schema::Object(o)) if o.schema_type == Type::Null.into());
    for content in body.content.values_mut() {
        let Some(RefOr::T(Schema::OneOf(one_of))) = &content.schema else {
            continue;
        };
        if one_of.items.len() == 2 && one_of.items.iter().any(is_null) {
            content.schema = one_of.items.iter().find(|s| !is_null(s)).cloned();
            body.required = Some(Required::False);
        }
    }
}

fn shared_response(status: &str, why: &str) -> Response {
    let problem = Content::new(Some(Ref::from_schema_name("Problem")));
    let response = ResponseBuilder::new()
        .description(why)
        .content(PROBLEM_JSON, problem);
    let seconds = || {
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(1))
    };
    match status {
        "401" => response.header(
            "WWW-Authenticate",
            HeaderBuilder::new()
                .schema(String::schema())
                .description(Some("`Bearer`"))
                .build(),
        ),
        "429" => response.header(
            "Retry-After",
            HeaderBuilder::new()
                .schema(seconds())
                .description(Some("Seconds until this address may try again"))
                .build(),
        ),
        _ => response,
    }
    .build()
}

/// Whether the operation needs a token: it has no security of its own (the document's
/// bearer applies) or a non-empty one.
fn takes_token(op: &Operation) -> bool {
    op.security.as_ref().is_none_or(|requirements| {
        requirements
            .iter()
            .any(|r| *r != SecurityRequirement::default())
    })
}

fn add_refs(op: &mut Operation, answers: &[(&str, &str, &str)]) {
    for (status, name, _) in answers {
        op.responses
            .responses
            .entry(status.to_string())
            .or_insert_with(|| RefOr::Ref(Ref::from_response_name(*name)));
    }
}

/// The document, serialized once when the router is built.
#[derive(Clone)]
pub struct Served(Bytes);

impl Served {
    pub fn new(doc: &Document) -> Served {
        Served(Bytes::from(doc.to_json().expect("a document serializes")))
    }
}

/// This API's OpenAPI 3.1 document.
#[utoipa::path(
    get,
    path = "/openapi.json", operation_id = "openapi_document",
    tag = "health",
    security(("bearer" = ["viewer"])),
    responses((status = 200, description = "OpenAPI 3.1 document", body = Object)),
)]
pub async fn openapi_json(_: Viewer, Extension(doc): Extension<Served>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], doc.0)
}
