//! The scheduler lease: one row (`scheduling`) naming the replica that places jobs and until
//! when. The holder renews it inside each pass's transaction, before anything else the pass
//! writes: on PostgreSQL the renewal locks the row until the pass commits, so a replica taking
//! the lease over waits for that pass and then finds the lease renewed; on SQLite the pass's
//! write transaction excludes every other writer. Either way a pass commits placements only while
//! its replica holds the lease, whatever the replicas' clocks say; a clock only decides when an
//! abandoned lease may be taken.

use super::StoreError;
use super::backend::{Conn, on};

/// The lease as a pass that holds it sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Held {
    /// Rises each time the lease changes hands.
    pub term: i64,
    /// Rises each time nodes or their devices change.
    pub nodes_version: i64,
}

/// Takes or renews the lease for `holder` until `until` (Unix ms) if it is `holder`'s or lapsed
/// at `now`; `None` when another replica holds it.
pub(super) async fn renew(
    c: &mut Conn<'_>,
    holder: &str,
    now: i64,
    until: i64,
) -> Result<Option<Held>, StoreError> {
    let row = on!(c, c => {
        sqlx::query_as::<_, (i64, i64)>(
            "UPDATE scheduling SET term = CASE WHEN holder = $1 THEN term ELSE term + 1 END, \
             holder = $1, expires_at = $2 WHERE id = 1 AND (holder = $1 OR expires_at <= $3) \
             RETURNING term, nodes_version",
        )
        .bind(holder)
        .bind(until)
        .bind(now)
        .fetch_optional(&mut **c)
        .await?
    });
    Ok(row.map(|(term, nodes_version)| Held {
        term,
        nodes_version,
    }))
}

/// Gives the lease up, if `holder` has it, so another replica can take it at once.
pub(super) async fn release(c: &mut Conn<'_>, holder: &str) -> Result<(), StoreError> {
    on!(c, c => {
        sqlx::query("UPDATE scheduling SET expires_at = 0 WHERE id = 1 AND holder = $1")
            .bind(holder)
            .execute(&mut **c)
            .await?;
    });
    Ok(())
}

/// Records that nodes or devices changed (under the scheduling lock).
pub(super) async fn nodes_changed(c: &mut Conn<'_>) -> Result<(), StoreError> {
    on!(c, c => {
        sqlx::query("UPDATE scheduling SET nodes_version = nodes_version + 1 WHERE id = 1")
            .execute(&mut **c)
            .await?;
    });
    Ok(())
}
