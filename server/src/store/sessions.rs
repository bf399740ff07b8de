//! Console sessions: only the cookie's SHA-256 is stored, bound to the token it came from, so
//! revoking the token (which deletes its sessions) ends them, and every lookup joins `tokens`.

use super::StoreError;
use super::backend::{Conn, on};
use super::tokens::{parse_role, token_hash};
use crate::domain::Role;

/// Stores session `session` for `token` until `expires_at`, dropping expired sessions on the
/// way; false, writing nothing, when the token is not known.
pub(super) async fn insert(
    c: &mut Conn<'_>,
    session: &str,
    token: &str,
    now: i64,
    expires_at: i64,
) -> Result<bool, StoreError> {
    let written = on!(c, c => {
        sqlx::query("DELETE FROM sessions WHERE expires_at <= $1")
            .bind(now)
            .execute(&mut **c)
            .await?;
        sqlx::query(
            "INSERT INTO sessions (hash, token_hash, created_at, expires_at) \
             SELECT $1, hash, $3, $4 FROM tokens WHERE hash = $2",
        )
        .bind(token_hash(session))
        .bind(token_hash(token))
        .bind(now)
        .bind(expires_at)
        .execute(&mut **c)
        .await?
        .rows_affected()
    });
    Ok(written == 1)
}

/// The name and role of the token behind an unexpired session.
pub(super) async fn lookup(
    c: &mut Conn<'_>,
    session: &str,
    now: i64,
) -> Result<Option<(String, Role)>, StoreError> {
    let row = on!(c, c => {
        sqlx::query_as::<_, (String, String)>(
            "SELECT t.name, t.role FROM sessions s JOIN tokens t ON t.hash = s.token_hash \
             WHERE s.hash = $1 AND s.expires_at > $2",
        )
        .bind(token_hash(session))
        .bind(now)
        .fetch_optional(&mut **c)
        .await?
    });
    row.map(|(name, role)| Ok((name, parse_role(&role)?)))
        .transpose()
}

pub(super) async fn delete(c: &mut Conn<'_>, session: &str) -> Result<(), StoreError> {
    on!(c, c => {
        sqlx::query("DELETE FROM sessions WHERE hash = $1")
            .bind(token_hash(session))
            .execute(&mut **c)
            .await?;
    });
    Ok(())
}
