//! Bearer tokens. People's tokens carry a role (viewer < submitter < admin); one extractor per
//! role rejects a request whose token is missing (401), unknown (401) or under-privileged (403).
//! Agents register with the join token and heartbeat with the per-node token registration
//! gave them. The store keeps only tokens' SHA-256. A browser without a bearer token may bring
//! the console's session cookie instead (`session`): it stands for the token it came from.

use std::path::Path;

use axum::extract::{FromRequestParts, Path as UrlPath};
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};

use crate::domain::{NodeRecord, Role, SlurmAllocation};
use crate::error::ApiError;
use crate::session;
use crate::state::AppState;
use crate::store::{Store, StoreError, token_hash};

/// Who is calling: the token's name and role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

/// The bearer token of a request.
pub(crate) fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or(ApiError::MissingToken)
}

async fn authorize(parts: &Parts, state: &AppState, needed: Role) -> Result<Caller, ApiError> {
    let cookie = session::session_id(&parts.headers, &state.settings);
    let Caller { name, role } = match cookie {
        Some(id) if !parts.headers.contains_key(header::AUTHORIZATION) => {
            session::authenticate(parts, state, &id).await?
        }
        _ => token_caller(state, bearer(&parts.headers)?).await?,
    };
    if !role.allows(needed) {
        return Err(ApiError::Forbidden {
            needed: needed.as_str(),
        });
    }
    Ok(Caller { name, role })
}

/// Who a bearer token belongs to (401 when nobody).
pub(crate) async fn token_caller(state: &AppState, token: &str) -> Result<Caller, ApiError> {
    let (name, role) = state
        .store
        .token(token)
        .await
        .map_err(unavailable)?
        .ok_or(ApiError::UnknownToken)?;
    Ok(Caller { name, role })
}

/// Without the store nobody can be authenticated: the service is unavailable, not broken.
pub(crate) fn unavailable(e: StoreError) -> ApiError {
    tracing::warn!("checking a token: {e}");
    ApiError::Unavailable("the store does not answer".into())
}

/// Extractors that admit a token of at least one role.
macro_rules! role_extractor {
    ($($(#[$doc:meta])* $name:ident => $role:expr;)*) => {$(
        $(#[$doc])*
        pub struct $name(pub Caller);

        impl FromRequestParts<AppState> for $name {
            type Rejection = ApiError;

            async fn from_request_parts(
                parts: &mut Parts,
                state: &AppState,
            ) -> Result<Self, ApiError> {
                authorize(parts, state, $role).await.map($name)
            }
        }
    )*};
}

role_extractor! {
    /// Reads jobs, nodes, metrics and the API document.
    Viewer => Role::Viewer;
    /// Also submits jobs and cancels its own.
    Submitter => Role::Submitter;
    /// Also cancels anyone's jobs.
    Admin => Role::Admin;
}

/// Who registers a node: an agent with a join token, or one a Slurm allocation started, with
/// the token the server gave that allocation alone (its node then serves the allocation's job
/// only, and the token stops working when the allocation ends).
pub enum Joining {
    Agent,
    Allocation(SlurmAllocation),
}

impl FromRequestParts<AppState> for Joining {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(&parts.headers)?;
        let allocation = state
            .store
            .allocation_by_token(&token_hash(token))
            .await
            .map_err(unavailable)?;
        match allocation {
            Some(a) => Ok(Joining::Allocation(a)),
            None => authorize(parts, state, Role::AgentJoin)
                .await
                .map(|_| Joining::Agent),
        }
    }
}

/// The node whose agent token authenticates the request; the `{node}` in the path must be it.
pub struct AgentNode(pub NodeRecord);

impl FromRequestParts<AppState> for AgentNode {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(&parts.headers)?;
        let node = state
            .store
            .node_by_token(&token_hash(token))
            .await
            .map_err(unavailable)?;
        let Some(node) = node else {
            // A person's token is known but not allowed here; anything else is unknown.
            return Err(match state.store.token(token).await.map_err(unavailable)? {
                Some(_) => ApiError::Forbidden {
                    needed: "agent node",
                },
                None => ApiError::UnknownToken,
            });
        };
        // By name: the node's routes have other parameters after `{node}`.
        let UrlPath(params) =
            UrlPath::<std::collections::HashMap<String, String>>::from_request_parts(parts, state)
                .await?;
        if params.get("node").map(String::as_str) != Some(node.id.as_str()) {
            return Err(ApiError::Forbidden {
                needed: "this node's agent",
            });
        }
        Ok(AgentNode(node))
    }
}

/// 256 random bits, hex, with a `zt_` prefix so a leaked token is recognisable.
pub fn new_token() -> String {
    let bytes: [u8; 32] = rand::random();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("zt_{hex}")
}

/// The tokens a fresh server needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// The admin token, when this call created it (first start).
    pub new_admin_token: Option<String>,
    /// The token agents register with.
    pub join_token: String,
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{path}: {source}")]
    File {
        path: String,
        source: std::io::Error,
    },
}

/// On first start, creates an admin token (`admin`, e.g. `ZEROTRAIN_TOKEN`'s value, if given)
/// and writes it to `<data dir>/admin-token`, where the CLI looks for it; a later `admin` the
/// store does not know is added as another admin token. Creates the agent join token once and
/// keeps it in `<data dir>/join-token`. Both files are readable by their owner only.
pub async fn bootstrap(
    store: &Store,
    data_dir: &Path,
    admin: Option<&str>,
) -> Result<Bootstrap, BootstrapError> {
    let mut new_admin_token = None;
    if !store.has_admin().await? {
        let token = admin.map_or_else(new_token, str::to_string);
        store.insert_token("admin", Role::Admin, &token).await?;
        write_secret(&data_dir.join("admin-token"), &token)?;
        new_admin_token = Some(token);
    } else if let Some(token) = admin
        && store.token(token).await?.is_none()
    {
        let name = format!("admin-{}", &token_hash(token)[..8]);
        store.insert_token(&name, Role::Admin, token).await?;
    }
    let join_path = data_dir.join("join-token");
    let existing = std::fs::read_to_string(&join_path)
        .ok()
        .map(|t| t.trim().to_string());
    let join_token = match existing {
        Some(t) if matches!(store.token(&t).await?, Some((_, Role::AgentJoin))) => t,
        _ => {
            let token = new_token();
            let name = format!("agent-join-{}", &token_hash(&token)[..8]);
            store.insert_token(&name, Role::AgentJoin, &token).await?;
            write_secret(&join_path, &token)?;
            token
        }
    };
    Ok(Bootstrap {
        new_admin_token,
        join_token,
    })
}

/// What `<data dir>/admin-token` holds, as the store sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminFile {
    /// A live admin token.
    Admin,
    /// A token the store does not know as an admin's (revoked, or re-created with another role).
    Revoked,
    Missing,
}

/// Checks the admin token the CLI would use by default.
pub async fn admin_file(store: &Store, data_dir: &Path) -> Result<AdminFile, StoreError> {
    let Ok(text) = std::fs::read_to_string(data_dir.join("admin-token")) else {
        return Ok(AdminFile::Missing);
    };
    Ok(match store.token(text.trim()).await? {
        Some((_, Role::Admin)) => AdminFile::Admin,
        _ => AdminFile::Revoked,
    })
}

/// The recovery for a locked-out admin, which needs only the data dir and the store (the server
/// may be running or not): stores a new admin token named `name` and writes it to
/// `<data dir>/admin-token`. `None` when the name is taken.
pub async fn mint_admin(
    store: &Store,
    data_dir: &Path,
    name: &str,
) -> Result<Option<String>, BootstrapError> {
    let token = new_token();
    if store
        .create_token(name, Role::Admin, &token)
        .await?
        .is_none()
    {
        return Ok(None);
    }
    std::fs::create_dir_all(data_dir).map_err(|source| BootstrapError::File {
        path: data_dir.display().to_string(),
        source,
    })?;
    write_secret(&data_dir.join("admin-token"), &token)?;
    Ok(Some(token))
}

fn write_secret(path: &Path, secret: &str) -> Result<(), BootstrapError> {
    let err = |source| BootstrapError::File {
        path: path.display().to_string(),
        source,
    };
    #[cfg(unix)]
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
            .map_err(err)?;
        writeln!(f, "{secret}").map_err(err)
    }
    #[cfg(not(unix))]
    std::fs::write(path, format!("{secret}\n")).map_err(err)
}
