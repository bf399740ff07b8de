//! The two databases behind one API: a pool of either kind, a connection or write transaction
//! on either, and `on!`, which type-checks a body once per database so the SQL text is shared.
//! Both dialects take `$1`-style parameters and agree on RETURNING, ON CONFLICT, UPDATE … FROM
//! and partial indexes; what differs (column types, the scheduling lock, BEGIN IMMEDIATE) lives
//! in the migrations and in this file.

use std::str::FromStr;
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{
    PgConnection, PgPool, Postgres, Row, Sqlite, SqliteConnection, SqlitePool, Transaction,
};

use super::{Backend, StoreError};
use crate::domain::JobId;

static SQLITE_MIGRATIONS: Migrator = sqlx::migrate!("../migrations/sqlite");
static POSTGRES_MIGRATIONS: Migrator = sqlx::migrate!("../migrations/postgres");

/// How long a SQLite writer waits for another writer before failing with "database is locked".
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Rows buffered between a SQLite connection's thread and the task reading them.
const SQLITE_ROW_BUFFER: usize = 1024;

#[derive(Debug, Clone)]
pub(super) enum Pool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// A connection of either kind, borrowed from a pooled connection or a transaction.
pub(super) enum Conn<'a> {
    Sqlite(&'a mut SqliteConnection),
    Postgres(&'a mut PgConnection),
}

/// `on!(conn, c => body)`: runs `body` with `c` bound to the `&mut &mut SqliteConnection` or
/// `&mut &mut PgConnection` inside `conn: &mut Conn` (execute on `&mut **c`). The body is
/// compiled once per database.
macro_rules! on {
    ($conn:expr, $c:ident => $body:expr) => {
        match $conn {
            $crate::store::backend::Conn::Sqlite($c) => $body,
            $crate::store::backend::Conn::Postgres($c) => $body,
        }
    };
}
pub(super) use on;

/// A value bound to a statement whose parameter list is built at run time.
#[derive(Debug, Clone)]
pub(super) enum Arg {
    Int(i64),
    Real(Option<f64>),
    Text(String),
    Bool(bool),
}

/// Binds `args` (an iterator of `Arg`) to the query `q` in order.
macro_rules! bind_args {
    ($q:expr, $args:expr) => {{
        let mut q = $q;
        for arg in $args {
            q = match arg {
                $crate::store::backend::Arg::Int(v) => q.bind(v),
                $crate::store::backend::Arg::Real(v) => q.bind(v),
                $crate::store::backend::Arg::Text(v) => q.bind(v),
                $crate::store::backend::Arg::Bool(v) => q.bind(v),
            };
        }
        q
    }};
}
pub(super) use bind_args;

impl Conn<'_> {
    /// Parameter `n` for statements with many parameters: `$n` on PostgreSQL, a plain `?` on
    /// SQLite, where parameters are then numbered in the order they appear in the text (so `n`
    /// must follow that order). SQLite accepts `$n` too, but as a name: preparing and binding
    /// (sqlx looks up every parameter's name) search the names linearly, which makes a
    /// statement with thousands of them take quadratic time; measured 1 s for one scheduling
    /// pass's writes.
    pub(super) fn param(&self, n: usize) -> String {
        match self {
            Conn::Sqlite(_) => "?".to_string(),
            Conn::Postgres(_) => format!("${n}"),
        }
    }
}

/// Rows per multi-row INSERT on SQLite: keeps the parameter count far below its 32,766 for the
/// widest table.
const ROWS_PER_INSERT: usize = 1000;

/// Inserts `rows` (each `cols` values) with `INSERT INTO {into} … {suffix}`.
pub(super) async fn insert_rows(
    c: &mut Conn<'_>,
    into: &str,
    cols: usize,
    rows: Vec<Vec<Arg>>,
    suffix: &str,
) -> Result<(), StoreError> {
    insert(c, into, cols, rows, suffix, false).await.map(drop)
}

/// Inserts `rows` into a table with an `id` column the database numbers: the ids given.
pub(super) async fn insert_rows_returning_ids(
    c: &mut Conn<'_>,
    into: &str,
    cols: usize,
    rows: Vec<Vec<Arg>>,
) -> Result<Vec<i64>, StoreError> {
    insert(c, into, cols, rows, "RETURNING id", true).await
}

/// PostgreSQL: one statement whatever the number of rows, each column bound as one array
/// (`INSERT … SELECT * FROM UNNEST($1::bigint[], $2::text[], …)`), which it parses and plans
/// once instead of a VALUES list of thousands of parameters. SQLite: multi-row VALUES in
/// batches (numbered `?` parameters, see [`Conn::param`]).
async fn insert(
    c: &mut Conn<'_>,
    into: &str,
    cols: usize,
    rows: Vec<Vec<Arg>>,
    suffix: &str,
    returning: bool,
) -> Result<Vec<i64>, StoreError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    match c {
        Conn::Postgres(c) => {
            let columns = Column::transpose(rows, cols);
            let arrays: Vec<String> = columns
                .iter()
                .enumerate()
                .map(|(i, col)| format!("${}::{}", i + 1, col.array_type()))
                .collect();
            let sql = format!(
                "INSERT INTO {into} SELECT * FROM UNNEST({}) {suffix}",
                arrays.join(", ")
            );
            let mut q = sqlx::query(&sql);
            for col in columns {
                q = match col {
                    Column::Int(v) => q.bind(v),
                    Column::Real(v) => q.bind(v),
                    Column::Text(v) => q.bind(v),
                    Column::Bool(v) => q.bind(v),
                };
            }
            if !returning {
                q.execute(&mut **c).await?;
                return Ok(Vec::new());
            }
            let rows = q.fetch_all(&mut **c).await?;
            Ok(rows
                .iter()
                .map(|r| r.try_get(0))
                .collect::<Result<_, _>>()?)
        }
        Conn::Sqlite(c) => {
            let mut ids = Vec::new();
            let mut rows = rows.into_iter().peekable();
            while rows.peek().is_some() {
                let batch: Vec<Vec<Arg>> = rows.by_ref().take(ROWS_PER_INSERT).collect();
                let row = format!("({})", vec!["?"; cols].join(", "));
                let sql = format!(
                    "INSERT INTO {into} VALUES {} {suffix}",
                    vec![row; batch.len()].join(", ")
                );
                let q = bind_args!(sqlx::query(&sql), batch.into_iter().flatten());
                if returning {
                    for r in q.fetch_all(&mut **c).await? {
                        ids.push(r.try_get(0)?);
                    }
                } else {
                    q.execute(&mut **c).await?;
                }
            }
            Ok(ids)
        }
    }
}

/// One column of rows to insert, as the array PostgreSQL unnests.
enum Column {
    Int(Vec<i64>),
    Real(Vec<Option<f64>>),
    Text(Vec<String>),
    Bool(Vec<bool>),
}

impl Column {
    /// The columns of `rows` (each `cols` values, column by column of one type).
    fn transpose(rows: Vec<Vec<Arg>>, cols: usize) -> Vec<Column> {
        let n = rows.len();
        let mut columns: Vec<Column> = rows[0]
            .iter()
            .map(|arg| match arg {
                Arg::Int(_) => Column::Int(Vec::with_capacity(n)),
                Arg::Real(_) => Column::Real(Vec::with_capacity(n)),
                Arg::Text(_) => Column::Text(Vec::with_capacity(n)),
                Arg::Bool(_) => Column::Bool(Vec::with_capacity(n)),
            })
            .collect();
        assert_eq!(columns.len(), cols, "a row of {cols} values");
        for row in rows {
            for (col, arg) in columns.iter_mut().zip(row) {
                match (col, arg) {
                    (Column::Int(v), Arg::Int(x)) => v.push(x),
                    (Column::Real(v), Arg::Real(x)) => v.push(x),
                    (Column::Text(v), Arg::Text(x)) => v.push(x),
                    (Column::Bool(v), Arg::Bool(x)) => v.push(x),
                    _ => panic!("values of one column must be of one type"),
                }
            }
        }
        columns
    }

    fn array_type(&self) -> &'static str {
        match self {
            Column::Int(_) => "bigint[]",
            Column::Real(_) => "double precision[]",
            Column::Text(_) => "text[]",
            Column::Bool(_) => "boolean[]",
        }
    }
}

/// A pooled connection, or a write transaction (`BEGIN IMMEDIATE` on SQLite, so a transaction
/// that reads before it writes never fails to upgrade its lock).
pub(super) enum Held {
    Sqlite(PoolConnection<Sqlite>),
    Postgres(PoolConnection<Postgres>),
    SqliteTx(Transaction<'static, Sqlite>),
    PostgresTx(Transaction<'static, Postgres>),
}

impl Held {
    pub(super) fn conn(&mut self) -> Conn<'_> {
        match self {
            Held::Sqlite(c) => Conn::Sqlite(c),
            Held::Postgres(c) => Conn::Postgres(c),
            Held::SqliteTx(t) => Conn::Sqlite(t),
            Held::PostgresTx(t) => Conn::Postgres(t),
        }
    }

    /// Commits a transaction; a plain connection goes back to the pool.
    pub(super) async fn commit(self) -> Result<(), StoreError> {
        match self {
            Held::SqliteTx(t) => t.commit().await?,
            Held::PostgresTx(t) => t.commit().await?,
            Held::Sqlite(_) | Held::Postgres(_) => {}
        }
        Ok(())
    }
}

impl Pool {
    pub(super) async fn connect(url: &str) -> Result<Pool, StoreError> {
        if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)?;
            Pool::connect_sqlite(options).await
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Pool::connect_postgres(PgConnectOptions::from_str(url)?).await
        } else {
            Err(StoreError::Url(url.to_string()))
        }
    }

    pub(super) async fn connect_sqlite(options: SqliteConnectOptions) -> Result<Pool, StoreError> {
        let path = options.get_filename();
        let in_memory = path.as_os_str().is_empty() || path.to_string_lossy().contains(":memory:");
        if !in_memory
            && let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Io {
                path: dir.display().to_string(),
                source: e,
            })?;
        }
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(SQLITE_BUSY_TIMEOUT)
            // Rows cross from the connection's thread to the caller in batches of this many; at
            // the default (50) a scheduling pass reading 10,000 jobs waits 200 times for the
            // caller's thread to be scheduled, which on a busy machine took 0.5 s more.
            .row_buffer_size(SQLITE_ROW_BUFFER);
        // An in-memory database exists once per connection: keep exactly one.
        let pool = SqlitePoolOptions::new()
            .max_connections(if in_memory { 1 } else { 8 })
            .min_connections(if in_memory { 1 } else { 0 })
            .idle_timeout(if in_memory {
                None
            } else {
                Some(Duration::from_secs(600))
            })
            .max_lifetime(if in_memory {
                None
            } else {
                Some(Duration::from_secs(1800))
            })
            .connect_with(options)
            .await?;
        SQLITE_MIGRATIONS.run(&pool).await?;
        Ok(Pool::Sqlite(pool))
    }

    /// PostgreSQL; the schema is the connection's `search_path` (e.g. `?options=-c
    /// search_path=NAME` in the URL, or [`PgConnectOptions::options`]).
    pub(super) async fn connect_postgres(options: PgConnectOptions) -> Result<Pool, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        POSTGRES_MIGRATIONS.run(&pool).await?;
        Ok(Pool::Postgres(pool))
    }

    pub(super) fn backend(&self) -> Backend {
        match self {
            Pool::Sqlite(_) => Backend::Sqlite,
            Pool::Postgres(_) => Backend::Postgres,
        }
    }

    pub(super) async fn acquire(&self) -> Result<Held, StoreError> {
        Ok(match self {
            Pool::Sqlite(p) => Held::Sqlite(p.acquire().await?),
            Pool::Postgres(p) => Held::Postgres(p.acquire().await?),
        })
    }

    pub(super) async fn write(&self) -> Result<Held, StoreError> {
        Ok(match self {
            Pool::Sqlite(p) => Held::SqliteTx(p.begin_with("BEGIN IMMEDIATE").await?),
            Pool::Postgres(p) => Held::PostgresTx(p.begin().await?),
        })
    }

    pub(super) async fn close(&self) {
        match self {
            Pool::Sqlite(p) => p.close().await,
            Pool::Postgres(p) => p.close().await,
        }
    }
}

/// Makes the calling transaction the only one, among all server replicas, that places jobs or
/// changes which nodes are live, until it ends. PostgreSQL: a transaction-scoped advisory lock,
/// keyed by the schema so separate deployments (and tests) in one database do not contend.
/// SQLite: nothing to do, a write transaction (`BEGIN IMMEDIATE`) already excludes every other
/// writer.
pub(super) async fn lock_scheduling(c: &mut Conn<'_>) -> Result<(), StoreError> {
    if let Conn::Postgres(c) = c {
        sqlx::query(
            "SELECT pg_advisory_xact_lock(hashtext('zerotrain.schedule.' || current_schema()))",
        )
        .execute(&mut **c)
        .await?;
    }
    Ok(())
}

/// Maps a violated foreign key (a report for a job that does not exist) to `UnknownJob`.
pub(super) fn unknown_job_on_fk(job_id: &JobId) -> impl FnOnce(StoreError) -> StoreError + '_ {
    move |e| match e {
        StoreError::Database(sqlx::Error::Database(d))
            if d.kind() == sqlx::error::ErrorKind::ForeignKeyViolation =>
        {
            StoreError::UnknownJob(job_id.clone())
        }
        e => e,
    }
}
