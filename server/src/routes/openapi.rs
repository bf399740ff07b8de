//! `GET /openapi.json`: the OpenAPI 3.1 document, generated from the handlers' annotations
//! and types; `openapi/openapi.json` is a committed copy a test keeps current.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::app::JobEvent;
use crate::auth::Viewer;
use crate::domain::{
    AssignmentRecord, Job, JobState, LogLine, NodeRecord, RankMemoryRecord, Role, StepRecord,
    TokenRecord, Transition,
};
use crate::error::{Alternative, Configuration, DoesNotFit, Problem};
use crate::routes::{agents, estimate, health, jobs, metrics, nodes, session, tokens};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "zerotrain",
        description = "ZeRO-sharded mixed-precision training as a service. Every endpoint but \
            /healthz takes a bearer token: viewer < submitter < admin (admins manage tokens at \
            /v1/tokens); agents use the join token \
            to register and their node's token to heartbeat. Browsers exchange a token for a \
            session cookie at /v1/session; cookie-authenticated requests that change state \
            must carry the server's Origin. Errors are RFC 9457 \
            application/problem+json."
    ),
    paths(
        health::healthz,
        health::readyz,
        metrics::metrics,
        openapi_json,
        jobs::create::create,
        jobs::list::list,
        jobs::get::get,
        jobs::cancel::cancel,
        jobs::metrics::metrics,
        jobs::logs::logs,
        jobs::events::events,
        estimate::estimate,
        nodes::list,
        session::create,
        session::delete,
        tokens::create,
        tokens::list,
        tokens::revoke,
        agents::register::register,
        agents::heartbeat::heartbeat,
    ),
    components(schemas(
        Job, JobState, Transition, NodeRecord, AssignmentRecord, StepRecord, RankMemoryRecord,
        LogLine, JobEvent, Problem, DoesNotFit, Configuration, Alternative, Role, TokenRecord,
    )),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// This API's OpenAPI 3.1 document.
#[utoipa::path(
    get,
    path = "/openapi.json", operation_id = "openapi_document",
    tag = "health",
    responses((status = 200, description = "OpenAPI 3.1 document", body = Object)),
)]
pub async fn openapi_json(_: Viewer) -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
