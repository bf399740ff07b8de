//! `/v1/tokens`: admins create, list and revoke the bearer tokens people and agents use. A
//! token's name is who it is: jobs submitted with it are owned by that name.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::auth::{Admin, new_token};
use crate::domain::{Role, TokenRecord};
use crate::error::{ApiError, Problem};
use crate::state::AppState;
use crate::store::Revoked;

/// Longest token name accepted.
const MAX_NAME: usize = 64;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateToken {
    /// 1-64 characters of `A-Z a-z 0-9 . _ -`, unique among tokens.
    #[schema(pattern = "^[A-Za-z0-9._-]{1,64}$")]
    pub name: String,
    /// `viewer`, `submitter`, `admin` or `agent_join`.
    #[schema(value_type = Role)]
    pub role: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedToken {
    #[serde(flatten)]
    pub record: TokenRecord,
    /// The bearer token. Only its hash is stored: this is the one time it is shown.
    pub token: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenList {
    pub tokens: Vec<TokenRecord>,
}

/// Create a token with a role.
#[utoipa::path(
    post,
    path = "/v1/tokens", operation_id = "create_token",
    tag = "tokens",
    security(("bearer" = ["admin"])),
    request_body = CreateToken,
    responses(
        (status = 201, body = CreatedToken),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The name is taken",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn create(
    State(state): State<AppState>,
    _: Admin,
    body: Result<Json<CreateToken>, JsonRejection>,
) -> Result<(StatusCode, Json<CreatedToken>), ApiError> {
    let Json(body) = body?;
    check_name(&body.name)?;
    let role = Role::parse(&body.role).ok_or_else(|| ApiError::BadRequest {
        field: "role".into(),
        reason: format!(
            "{:?} is not a role: use viewer, submitter, admin or agent_join",
            body.role
        ),
    })?;
    let token = new_token();
    let Some(record) = state.store.create_token(&body.name, role, &token).await? else {
        return Err(ApiError::TokenNameTaken { name: body.name });
    };
    Ok((StatusCode::CREATED, Json(CreatedToken { record, token })))
}

/// Every token's name, role and creation time; never the tokens themselves.
#[utoipa::path(
    get,
    path = "/v1/tokens", operation_id = "list_tokens",
    tag = "tokens",
    security(("bearer" = ["admin"])),
    responses((status = 200, body = TokenList)),
)]
pub async fn list(State(state): State<AppState>, _: Admin) -> Result<Json<TokenList>, ApiError> {
    Ok(Json(TokenList {
        tokens: state.store.tokens().await?,
    }))
}

/// Revoke a token: requests bearing it are refused from now on. The last admin token and the
/// last agent join token cannot be revoked (create another first), so neither the admin nor
/// new agents are ever locked out.
#[utoipa::path(
    delete,
    path = "/v1/tokens/{name}", operation_id = "revoke_token",
    tag = "tokens",
    security(("bearer" = ["admin"])),
    params(("name" = String, Path, description = "Token name")),
    responses(
        (status = 204, description = "Revoked"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "It is the last admin token or the last agent join token",
            body = Problem, content_type = "application/problem+json"),
    ),
)]
pub async fn revoke(
    State(state): State<AppState>,
    _: Admin,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    match state.store.revoke_token(&name).await? {
        Revoked::Yes => Ok(StatusCode::NO_CONTENT),
        Revoked::Unknown => Err(ApiError::NotFound {
            what: "token",
            id: name,
        }),
        Revoked::LastAdmin => Err(ApiError::LastAdmin { name }),
        Revoked::LastJoin => Err(ApiError::LastJoin { name }),
    }
}

/// 1-64 characters of `A-Z a-z 0-9 . _ -` (the CLI's `--bootstrap` checks the same).
pub fn check_name(name: &str) -> Result<(), ApiError> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(allowed) {
        return Err(ApiError::BadRequest {
            field: "name".into(),
            reason: format!("{name:?}: use 1-{MAX_NAME} characters of A-Z a-z 0-9 . _ -"),
        });
    }
    Ok(())
}
