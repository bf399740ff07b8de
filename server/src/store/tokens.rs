//! Bearer tokens: only their SHA-256 is stored, with a unique name and a role.

use sha2::{Digest, Sha256};

use super::StoreError;
use super::backend::{Conn, on};
use crate::domain::{Role, TokenRecord};

/// SHA-256 of a bearer token, lower-case hex: the only form in which tokens are stored.
pub fn token_hash(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    let mut hex = String::with_capacity(64);
    for byte in digest.iter() {
        hex.push_str(&format!("{byte:02x}"));
    }
    hex
}

/// What revoking a token by name did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revoked {
    Yes,
    /// No token has that name.
    Unknown,
    /// It is the only admin token; nobody could manage the server without it.
    LastAdmin,
    /// It is the only agent join token; no agent could register (or register again) without it.
    LastJoin,
}

/// What storing a token does when its hash or name is already stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OnConflict {
    /// A known token gets the new name and role (how `zerotrain up` adopts `ZEROTRAIN_TOKEN`).
    Rename,
    /// Nothing is written.
    Keep,
}

/// Stores `token` under `name` with `role`; false when nothing was written.
pub(super) async fn insert(
    c: &mut Conn<'_>,
    name: &str,
    role: Role,
    token: &str,
    now: i64,
    on_conflict: OnConflict,
) -> Result<bool, StoreError> {
    let sql = match on_conflict {
        OnConflict::Rename => {
            "INSERT INTO tokens (hash, name, role, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (hash) DO UPDATE SET name = excluded.name, role = excluded.role"
        }
        OnConflict::Keep => {
            "INSERT INTO tokens (hash, name, role, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT DO NOTHING"
        }
    };
    let written = on!(c, c => {
        sqlx::query(sql)
            .bind(token_hash(token))
            .bind(name)
            .bind(role.as_str())
            .bind(now)
            .execute(&mut **c)
            .await?
            .rows_affected()
    });
    Ok(written == 1)
}

/// The name and role of a bearer token, if it is known.
pub(super) async fn lookup(
    c: &mut Conn<'_>,
    token: &str,
) -> Result<Option<(String, Role)>, StoreError> {
    let row = on!(c, c => {
        sqlx::query_as::<_, (String, String)>("SELECT name, role FROM tokens WHERE hash = $1")
            .bind(token_hash(token))
            .fetch_optional(&mut **c)
            .await?
    });
    row.map(|(name, role)| Ok((name, parse_role(&role)?)))
        .transpose()
}

/// Every token's name, role and creation time, by name.
pub(super) async fn list(c: &mut Conn<'_>) -> Result<Vec<TokenRecord>, StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, (String, String, i64)>(
            "SELECT name, role, created_at FROM tokens ORDER BY name",
        )
        .fetch_all(&mut **c)
        .await?
    });
    rows.into_iter()
        .map(|(name, role, created_at)| {
            Ok(TokenRecord {
                name,
                role: parse_role(&role)?,
                created_at,
            })
        })
        .collect()
}

/// Deletes the token named `name`, unless it is the last admin token or the last agent join
/// token. Runs in a write transaction: on PostgreSQL those rows are locked first, so two admins
/// revoking each other at once cannot both succeed.
pub(super) async fn revoke(c: &mut Conn<'_>, name: &str) -> Result<Revoked, StoreError> {
    if let Conn::Postgres(c) = c {
        sqlx::query("SELECT hash FROM tokens WHERE role IN ('admin', 'agent_join') FOR UPDATE")
            .execute(&mut **c)
            .await?;
    }
    let deleted = on!(c, c => {
        sqlx::query(
            "DELETE FROM tokens WHERE name = $1 AND (role NOT IN ('admin', 'agent_join') \
             OR (SELECT COUNT(*) FROM tokens t WHERE t.role = tokens.role) > 1)",
        )
        .bind(name)
        .execute(&mut **c)
        .await?
        .rows_affected()
    });
    if deleted > 0 {
        return Ok(Revoked::Yes);
    }
    let role = on!(c, c => {
        sqlx::query_scalar::<_, String>("SELECT role FROM tokens WHERE name = $1")
            .bind(name)
            .fetch_optional(&mut **c)
            .await?
    });
    Ok(match role.as_deref().map(parse_role).transpose()? {
        None => Revoked::Unknown,
        Some(Role::AgentJoin) => Revoked::LastJoin,
        Some(_) => Revoked::LastAdmin,
    })
}

pub(super) async fn has_admin(c: &mut Conn<'_>) -> Result<bool, StoreError> {
    let n = on!(c, c => {
        sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM tokens WHERE role = 'admin'")
            .fetch_one(&mut **c)
            .await?
    });
    Ok(n > 0)
}

pub(super) fn parse_role(role: &str) -> Result<Role, StoreError> {
    Role::parse(role).ok_or_else(|| StoreError::Corrupt {
        what: "token role".into(),
        reason: format!("unknown role {role:?}"),
    })
}
