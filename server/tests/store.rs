//! The store suite: every test body runs on SQLite (a fresh temporary file per test) and on
//! PostgreSQL (a fresh schema per test in database `test` on 127.0.0.1:5432, dropped after the
//! test; `ZEROTRAIN_TEST_DATABASE_URL` overrides the server). PostgreSQL tests fail, never skip,
//! when the server cannot be reached.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt;
use scheduler::inventory::DeviceSlot;
use scheduler::memory::{Breakdown, DeviceKind};
use scheduler::plan::{Choices, Plan};
use scheduler::queue::{Decision, HeldRanks, QueuedJob};
use scheduler::spec::{JobSpec, Purpose, ZeroStage};
use server::domain::{Job, JobId, JobState, LogLine, NodeId, RankMemoryRecord, Role, StepRecord};
use server::store::{
    ArtifactRecord, Backend, Board, JobFilter, JobSort, Placement, Revoked, Store, StoreError,
    token_hash,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::SqlitePoolOptions;
use sqlx::{PgPool, SqlitePool};

const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const GB: u64 = 1_000_000_000;

/// A store for one test, and a plain pool on the same database to look at its tables.
struct TestDb {
    store: Store,
    raw: Raw,
    url: String,
    schema: Option<String>,
}

enum Raw {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// `raw!(db, pool => expr)`: `expr` with `pool` bound to the test's plain pool of either kind.
macro_rules! raw {
    ($db:expr, $pool:ident => $body:expr) => {
        match &$db.raw {
            Raw::Sqlite($pool) => $body,
            Raw::Postgres($pool) => $body,
        }
    };
}

impl TestDb {
    /// Another store on the same database: a second server replica.
    async fn replica(&self) -> Store {
        match &self.schema {
            None => Store::connect(&self.url).await.unwrap(),
            Some(schema) => Store::connect_postgres(pg_options(&self.url, schema))
                .await
                .unwrap(),
        }
    }
}

fn pg_url() -> String {
    std::env::var("ZEROTRAIN_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_PG_URL.to_string())
}

fn pg_options(url: &str, schema: &str) -> PgConnectOptions {
    PgConnectOptions::from_str(url)
        .unwrap()
        .options([("search_path", schema)])
}

async fn on_sqlite<F, Fut>(body: F)
where
    F: FnOnce(TestDb) -> Fut,
    Fut: Future<Output = ()>,
{
    let dir = tempfile::tempdir().unwrap();
    // A directory that does not exist yet: connect creates it.
    let path = dir.path().join("data").join("zerotrain.db");
    let url = format!("sqlite://{}", path.display());
    let store = Store::connect(&url).await.unwrap();
    assert_eq!(store.backend(), Backend::Sqlite);
    let raw = SqlitePoolOptions::new()
        .connect(&format!("{url}?mode=rw"))
        .await
        .unwrap();
    body(TestDb {
        store,
        raw: Raw::Sqlite(raw),
        url,
        schema: None,
    })
    .await;
}

async fn on_postgres<F, Fut>(body: F)
where
    F: FnOnce(TestDb) -> Fut,
    Fut: Future<Output = ()>,
{
    let url = pg_url();
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "PostgreSQL at {url} is unreachable ({e}). The store suite runs on PostgreSQL \
                 too: start it on 127.0.0.1:5432 with trust auth and a database `test`, or set \
                 ZEROTRAIN_TEST_DATABASE_URL"
            )
        });
    let schema = format!("zt_{}", uuid::Uuid::now_v7().simple());
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await
        .unwrap();
    let outcome = AssertUnwindSafe(async {
        let store = Store::connect_postgres(pg_options(&url, &schema))
            .await
            .unwrap();
        assert_eq!(store.backend(), Backend::Postgres);
        let raw = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(pg_options(&url, &schema))
            .await
            .unwrap();
        body(TestDb {
            store,
            raw: Raw::Postgres(raw),
            url: url.clone(),
            schema: Some(schema.clone()),
        })
        .await
    })
    .catch_unwind()
    .await;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&admin)
        .await
        .unwrap();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Each listed body becomes `sqlite::NAME` and `postgres::NAME`.
macro_rules! suite {
    ($($(#[$attr:meta])* $name:ident),* $(,)?) => {
        mod sqlite {
            $( $(#[$attr])* async fn $name() { super::on_sqlite(super::$name).await } )*
        }
        mod postgres {
            $( $(#[$attr])* async fn $name() { super::on_postgres(super::$name).await } )*
        }
    };
}

suite! {
    #[tokio::test] connect_migrates_and_pings,
    #[tokio::test] insert_and_get_round_trip_every_field,
    #[tokio::test] get_of_an_unknown_id_is_none,
    #[tokio::test] list_is_newest_first_and_filters_by_state_and_name,
    #[tokio::test] list_pages_with_the_before_cursor,
    #[tokio::test] list_sorts_by_a_column_and_pages_through_ties,
    #[tokio::test] sessions_live_while_their_token_does,
    #[tokio::test] an_idempotency_key_reused_by_its_owner_returns_the_first_job,
    #[tokio::test] an_idempotency_key_is_per_owner,
    #[tokio::test] a_transition_from_a_stale_state_changes_nothing,
    #[tokio::test] transitions_are_recorded_in_order_with_reasons,
    #[tokio::test] a_transition_at_a_stale_attempt_changes_nothing,
    #[tokio::test] requeueing_raises_the_attempt_clears_master_and_frees_devices,
    #[tokio::test] a_terminal_transition_frees_devices,
    #[tokio::test] count_by_state_lists_every_state,
    #[tokio::test] a_registered_node_is_found_by_its_token_hash,
    #[tokio::test] heartbeats_of_unknown_or_lost_nodes_are_refused,
    #[tokio::test] reaping_requeues_the_jobs_of_silent_nodes_and_frees_their_devices,
    #[tokio::test] registering_again_with_a_known_token_keeps_the_id_and_requeues_its_jobs,
    #[tokio::test] an_allocation_lives_until_ended_and_its_end_requeues_the_job_on_its_nodes,
    #[tokio::test] schedule_shows_the_queue_by_priority_then_age_and_the_free_devices,
    #[tokio::test] schedule_never_hands_out_a_held_device,
    #[tokio::test] schedule_drops_invalid_decisions,
    #[tokio::test] schedule_ignores_devices_of_lost_nodes,
    #[tokio::test] assignments_are_listed_per_node_and_per_job,
    #[tokio::test] set_master_ignores_other_attempts,
    #[tokio::test] steps_round_trip_and_a_repeated_batch_changes_nothing,
    #[tokio::test] a_steps_validation_loss_round_trips_and_is_absent_on_steps_without_one,
    #[tokio::test] rank_memory_is_replaced_per_rank,
    #[tokio::test] log_lines_are_numbered_per_job_and_paged_after_a_sequence_number,
    #[tokio::test] checkpoints_are_listed_by_step,
    #[tokio::test] uploads_are_recorded_at_the_current_attempt_only_and_removed_by_kind,
    #[tokio::test] reports_for_an_unknown_job_fail_naming_it,
    #[tokio::test] tokens_are_stored_hashed_and_looked_up_with_their_role,
    #[tokio::test] a_token_name_is_taken_once_and_revoking_frees_it,
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    two_admins_revoking_each_other_at_once_leave_one,
    #[tokio::test] the_database_refuses_a_second_holder_of_a_device,
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    two_replicas_never_place_a_job_or_a_device_twice,
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    an_owner_s_queued_limit_holds_under_concurrent_submissions,
    #[tokio::test] a_pass_sees_each_owner_s_held_ranks_and_old_attempts_are_found,
    #[tokio::test] a_board_kept_between_passes_matches_one_loaded_afresh,
    #[tokio::test] only_the_lease_holder_schedules_and_another_takes_over_when_it_stops,
    #[tokio::test] two_servers_schedule_one_at_a_time_and_the_second_takes_over,
    #[tokio::test] a_pass_at_its_rank_budget_wakes_the_next,
}

// ---------------------------------------------------------------------------------------------
// Fixtures

fn job(name: &str, owner: &str, priority: i32, world_size: u32) -> Job {
    Job {
        id: JobId::from(String::new()),
        name: Some(name.to_string()),
        state: JobState::Queued,
        priority,
        attempt: 1,
        world_size,
        spec: JobSpec::parse(
            &format!(r#"{{"name": "{name}", "model": {{"preset": "gpt2-tiny"}}}}"#),
            Purpose::Train,
        )
        .unwrap()
        .spec,
        plan: Plan {
            chosen: Choices {
                zero_stage: ZeroStage::Gradients,
                activation_checkpointing: false,
                micro_batch_size: 1,
                grad_accum_steps: 1,
            },
            per_rank_bytes: Breakdown {
                params: GB,
                ..Breakdown::default()
            },
            device: DeviceKind::Cpu,
            comm_bytes_per_step: 0,
            devices_that_fit: 1,
            bytes_by_rank: Vec::new(),
        },
        unsupported_keys: vec!["fp16.loss_scale_window".to_string()],
        owner: owner.to_string(),
        reason: "submitted".to_string(),
        master: None,
        created_at: 0,
        updated_at: 0,
    }
}

async fn submit(store: &Store, name: &str, priority: i32, world_size: u32) -> Job {
    store
        .insert_job(&job(name, "alice", priority, world_size), None)
        .await
        .unwrap()
}

fn devices(count: usize) -> Vec<DeviceSlot> {
    vec![
        DeviceSlot {
            kind: DeviceKind::Cpu,
            memory_bytes: 16 * GB,
        };
        count
    ]
}

async fn node(store: &Store, name: &str, count: usize) -> server::domain::NodeRecord {
    store
        .register_node(
            name,
            "127.0.0.1",
            &devices(count),
            &token_hash(&format!("{name}-token")),
            None,
        )
        .await
        .unwrap()
}

/// The scheduler lease the tests' passes take: long enough never to lapse unless a test means
/// it to.
const LEASE: Duration = Duration::from_secs(60);

/// A device no job holds, as a pass saw it.
#[derive(Debug, Clone, PartialEq)]
struct FreeDevice {
    node_id: NodeId,
    device: u32,
    spec: DeviceSlot,
}

/// The free devices on `board`, nodes in registration order, devices by index.
fn free_devices(board: &Board) -> Vec<FreeDevice> {
    board
        .nodes()
        .iter()
        .flat_map(|n| {
            n.devices.iter().filter(|d| !d.held).map(|d| FreeDevice {
                node_id: n.id.clone(),
                device: d.index,
                spec: d.spec,
            })
        })
        .collect()
}

/// Places each job, in queue order, on the first free devices not taken yet; skips jobs that
/// do not fit (so smaller ones behind them backfill).
fn first_fit<'a>(
    queue: impl IntoIterator<Item = &'a QueuedJob>,
    free: &[FreeDevice],
) -> Vec<Decision> {
    let mut taken = vec![false; free.len()];
    let mut decisions = Vec::new();
    for job in queue {
        let picks: Vec<usize> = (0..free.len())
            .filter(|&i| !taken[i])
            .take(job.world_size as usize)
            .collect();
        if picks.len() < job.world_size as usize {
            continue;
        }
        for &i in &picks {
            taken[i] = true;
        }
        decisions.push(Decision {
            job_id: job.id.clone(),
            slots: picks
                .iter()
                .map(|&i| (free[i].node_id.clone(), free[i].device))
                .collect(),
        });
    }
    decisions
}

/// One pass of `store`'s replica with a board loaded afresh, `decide` shown the queue, the
/// free devices and the ranks each owner holds; the placements made.
async fn pass_with<F>(store: &Store, decide: F) -> Vec<Placement>
where
    F: FnOnce(&[&QueuedJob], &[FreeDevice], &HeldRanks) -> Vec<Decision>,
{
    let mut board = Board::default();
    store
        .schedule(&mut board, LEASE, |b| {
            let queue: Vec<&QueuedJob> = b.queue().collect();
            decide(&queue, &free_devices(b), b.held_ranks())
        })
        .await
        .unwrap()
        .expect("this replica holds the scheduler lease")
        .placed
}

/// One pass with `first_fit`; returns the free devices the pass saw and the placements made.
async fn schedule_first_fit(store: &Store) -> (Vec<FreeDevice>, Vec<Placement>) {
    let mut seen = Vec::new();
    let placed = pass_with(store, |queue, free, _| {
        seen = free.to_vec();
        first_fit(queue.iter().copied(), free)
    })
    .await;
    (seen, placed)
}

/// The job id and slots of each placement.
fn decisions(placed: &[Placement]) -> Vec<Decision> {
    placed
        .iter()
        .map(|p| Decision {
            job_id: p.job_id.clone(),
            slots: p.slots.clone(),
        })
        .collect()
}

fn now_ms() -> i64 {
    server::clock::Clock::system().now_ms()
}

fn ids(jobs: &[Job]) -> Vec<JobId> {
    jobs.iter().map(|j| j.id.clone()).collect()
}

// ---------------------------------------------------------------------------------------------
// Jobs

async fn connect_migrates_and_pings(db: TestDb) {
    db.store.ping().await.unwrap();
    // Connecting again finds the migrations applied.
    let again = db.replica().await;
    again.ping().await.unwrap();
    assert!(
        db.store
            .list_jobs(&JobFilter::default())
            .await
            .unwrap()
            .is_empty()
    );
}

async fn insert_and_get_round_trip_every_field(db: TestDb) {
    let mut submitted = job("tiny", "alice", 7, 4);
    submitted.unsupported_keys = vec!["a".into(), "b".into()];
    let inserted = db.store.insert_job(&submitted, None).await.unwrap();
    assert_eq!(inserted.id.as_str().len(), 36, "a UUID: {}", inserted.id);
    assert_eq!(
        uuid::Uuid::parse_str(inserted.id.as_str())
            .unwrap()
            .get_version_num(),
        7
    );
    assert_eq!(inserted.state, JobState::Queued);
    assert_eq!(inserted.attempt, 1);
    assert!(inserted.created_at > 0);
    assert_eq!(inserted.created_at, inserted.updated_at);
    let got = db.store.get_job(&inserted.id).await.unwrap().unwrap();
    assert_eq!(got, inserted);
    assert_eq!(got.name.as_deref(), Some("tiny"));
    assert_eq!(got.priority, 7);
    assert_eq!(got.world_size, 4);
    assert_eq!(got.spec, submitted.spec);
    assert_eq!(got.plan, submitted.plan);
    assert_eq!(got.unsupported_keys, vec!["a".to_string(), "b".to_string()]);
    assert_eq!(got.owner, "alice");
    assert_eq!(got.reason, "submitted");
    assert_eq!(got.master, None);

    // An id and a name chosen by the caller are kept; a job may have no name.
    let mut named = job("x", "bob", 0, 1);
    named.id = uuid::Uuid::now_v7().to_string().into();
    named.name = None;
    let inserted = db.store.insert_job(&named, None).await.unwrap();
    assert_eq!(inserted.id, named.id);
    assert_eq!(
        db.store.get_job(&named.id).await.unwrap().unwrap().name,
        None
    );
}

async fn get_of_an_unknown_id_is_none(db: TestDb) {
    assert_eq!(db.store.get_job(&"no-such-job".into()).await.unwrap(), None);
}

async fn list_is_newest_first_and_filters_by_state_and_name(db: TestDb) {
    let a = submit(&db.store, "alpha", 0, 1).await;
    let b = submit(&db.store, "beta", 0, 1).await;
    let c = submit(&db.store, "alpha", 0, 1).await;
    db.store
        .transition(&b.id, &[JobState::Queued], JobState::Cancelled, "by bob")
        .await
        .unwrap()
        .unwrap();
    let all = db.store.list_jobs(&JobFilter::default()).await.unwrap();
    assert_eq!(ids(&all), vec![c.id.clone(), b.id.clone(), a.id.clone()]);
    let queued = JobFilter {
        state: Some(JobState::Queued),
        ..JobFilter::default()
    };
    assert_eq!(
        ids(&db.store.list_jobs(&queued).await.unwrap()),
        vec![c.id.clone(), a.id.clone()]
    );
    let cancelled = JobFilter {
        state: Some(JobState::Cancelled),
        ..JobFilter::default()
    };
    assert_eq!(
        ids(&db.store.list_jobs(&cancelled).await.unwrap()),
        vec![b.id.clone()]
    );
    let alpha = JobFilter {
        name: Some("alpha".into()),
        limit: 10,
        ..JobFilter::default()
    };
    assert_eq!(
        ids(&db.store.list_jobs(&alpha).await.unwrap()),
        vec![c.id.clone(), a.id.clone()]
    );
    let none = JobFilter {
        name: Some("alpha".into()),
        state: Some(JobState::Running),
        ..JobFilter::default()
    };
    assert!(db.store.list_jobs(&none).await.unwrap().is_empty());
}

async fn list_pages_with_the_before_cursor(db: TestDb) {
    let mut submitted = Vec::new();
    for i in 0..7 {
        submitted.push(submit(&db.store, &format!("job-{i}"), 0, 1).await.id);
    }
    let newest_first: Vec<JobId> = submitted.iter().rev().cloned().collect();
    let mut pages = Vec::new();
    let mut before = None;
    loop {
        let page = db
            .store
            .list_jobs(&JobFilter {
                before: before.clone(),
                limit: 3,
                ..JobFilter::default()
            })
            .await
            .unwrap();
        if page.is_empty() {
            break;
        }
        before = page.last().map(|j| j.id.clone());
        pages.push(ids(&page));
    }
    assert_eq!(
        pages.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![3, 3, 1]
    );
    assert_eq!(pages.concat(), newest_first);
    // The cursor combines with a filter.
    let page = db
        .store
        .list_jobs(&JobFilter {
            name: Some("job-2".into()),
            before: Some(submitted[3].clone()),
            limit: 5,
            ..JobFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(&page), vec![submitted[2].clone()]);
}

async fn list_sorts_by_a_column_and_pages_through_ties(db: TestDb) {
    // Priorities 1, 0, 1, 0, 1, 0, 1 by alice, one by bob: ties broken by submission order.
    let mut submitted = Vec::new();
    for i in 0..7 {
        submitted.push(submit(&db.store, &format!("job-{i}"), 1 - i % 2, 1).await);
    }
    db.store
        .insert_job(&job("bobs", "bob", 5, 1), None)
        .await
        .unwrap();
    let sort = JobSort::parse("-priority").unwrap();
    let mut pages = Vec::new();
    let mut before = None;
    loop {
        let filter = JobFilter {
            owner: Some("alice".into()),
            sort,
            before: before.clone(),
            limit: 3,
            ..JobFilter::default()
        };
        let page = db.store.list_jobs(&filter).await.unwrap();
        if page.is_empty() {
            break;
        }
        before = page.last().map(|j| j.id.clone());
        pages.push(page);
    }
    let got: Vec<(i32, String)> = pages
        .concat()
        .into_iter()
        .map(|j| (j.priority, j.name.unwrap()))
        .collect();
    let want: Vec<(i32, String)> = [6, 4, 2, 0, 5, 3, 1]
        .map(|i| (1 - i % 2, format!("job-{i}")))
        .into();
    assert_eq!(
        got, want,
        "priority descending, newest first within a priority"
    );
    let by_name = JobFilter {
        sort: JobSort::parse("name").unwrap(),
        ..JobFilter::default()
    };
    let names: Vec<String> = db
        .store
        .list_jobs(&by_name)
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.name.unwrap())
        .collect();
    assert_eq!(names[0], "bobs");
    assert_eq!(
        names[1..],
        (0..7).map(|i| format!("job-{i}")).collect::<Vec<_>>()[..]
    );
    assert_eq!(
        JobSort::parse("-priority").unwrap().as_string(),
        "-priority"
    );
    assert!(JobSort::parse("size").is_none());
}

async fn sessions_live_while_their_token_does(db: TestDb) {
    let far = i64::MAX / 2;
    db.store
        .insert_token("carol", Role::Viewer, "zt_carol")
        .await
        .unwrap();
    db.store
        .insert_token("dave", Role::Admin, "zt_dave")
        .await
        .unwrap();
    assert!(
        db.store
            .insert_session("s1", "zt_carol", far)
            .await
            .unwrap()
    );
    assert!(
        !db.store
            .insert_session("s2", "zt_unknown", far)
            .await
            .unwrap()
    );
    assert_eq!(
        db.store.session("s1").await.unwrap(),
        Some(("carol".to_string(), Role::Viewer))
    );
    assert_eq!(db.store.session("s2").await.unwrap(), None);
    // Expired sessions are not found, and the next login drops them.
    assert!(db.store.insert_session("old", "zt_carol", 1).await.unwrap());
    assert_eq!(db.store.session("old").await.unwrap(), None);
    assert_eq!(db.store.revoke_token("carol").await.unwrap(), Revoked::Yes);
    assert_eq!(db.store.session("s1").await.unwrap(), None);
    assert!(db.store.insert_session("s3", "zt_dave", far).await.unwrap());
    db.store.delete_session("s3").await.unwrap();
    assert_eq!(db.store.session("s3").await.unwrap(), None);
    let left: i64 = raw!(db, pool => sqlx::query_scalar("SELECT COUNT(*) FROM sessions")
        .fetch_one(pool).await.unwrap());
    assert_eq!(
        left, 0,
        "revoking the token deleted its sessions; logout deleted the other"
    );
}

async fn an_idempotency_key_reused_by_its_owner_returns_the_first_job(db: TestDb) {
    let first = db
        .store
        .insert_job(&job("ci", "alice", 0, 2), Some("build-42"))
        .await
        .unwrap();
    let retry = db
        .store
        .insert_job(&job("ci-retry", "alice", 5, 4), Some("build-42"))
        .await
        .unwrap();
    assert_eq!(retry, first);
    let all = db.store.list_jobs(&JobFilter::default()).await.unwrap();
    assert_eq!(ids(&all), vec![first.id.clone()]);
    assert_eq!(db.store.transitions(&first.id).await.unwrap().len(), 1);
    // Jobs without a key never collide.
    submit(&db.store, "a", 0, 1).await;
    submit(&db.store, "a", 0, 1).await;
    assert_eq!(
        db.store
            .list_jobs(&JobFilter::default())
            .await
            .unwrap()
            .len(),
        3
    );
}

async fn an_idempotency_key_is_per_owner(db: TestDb) {
    let alice = db
        .store
        .insert_job(&job("ci", "alice", 0, 1), Some("k"))
        .await
        .unwrap();
    let bob = db
        .store
        .insert_job(&job("ci", "bob", 0, 1), Some("k"))
        .await
        .unwrap();
    assert_ne!(alice.id, bob.id);
    assert_eq!(bob.owner, "bob");
    assert_eq!(
        db.store
            .list_jobs(&JobFilter::default())
            .await
            .unwrap()
            .len(),
        2
    );
}

async fn a_transition_from_a_stale_state_changes_nothing(db: TestDb) {
    let j = submit(&db.store, "a", 0, 1).await;
    let moved = db
        .store
        .transition(&j.id, &[JobState::Queued], JobState::Cancelled, "user")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(moved.state, JobState::Cancelled);
    assert_eq!(moved.reason, "user");
    assert!(moved.updated_at >= j.updated_at);
    // Someone else moved it first: a second cancel, or a scheduler holding a stale view.
    for from in [
        &[JobState::Queued][..],
        &[JobState::Scheduled, JobState::Running],
        &[],
    ] {
        let stale = db
            .store
            .transition(&j.id, from, JobState::Failed, "late")
            .await
            .unwrap();
        assert_eq!(stale, None, "from {from:?}");
    }
    assert_eq!(
        db.store.get_job(&j.id).await.unwrap().unwrap().state,
        JobState::Cancelled
    );
    assert_eq!(db.store.transitions(&j.id).await.unwrap().len(), 2);
    // An unknown job is None too.
    assert_eq!(
        db.store
            .transition(
                &"nope".into(),
                &[JobState::Queued],
                JobState::Cancelled,
                "x"
            )
            .await
            .unwrap(),
        None
    );
}

async fn transitions_are_recorded_in_order_with_reasons(db: TestDb) {
    node(&db.store, "n", 1).await;
    let j = submit(&db.store, "a", 0, 1).await;
    let (_, applied) = schedule_first_fit(&db.store).await;
    assert_eq!(applied.len(), 1);
    let s = &db.store;
    s.transition(
        &j.id,
        &[JobState::Scheduled],
        JobState::Running,
        "rank 0 started",
    )
    .await
    .unwrap()
    .unwrap();
    s.transition(&j.id, &[JobState::Running], JobState::Queued, "node n lost")
        .await
        .unwrap()
        .unwrap();
    schedule_first_fit(s).await;
    s.transition(
        &j.id,
        &[JobState::Scheduled],
        JobState::Running,
        "rank 0 started",
    )
    .await
    .unwrap()
    .unwrap();
    s.transition(&j.id, &[JobState::Running], JobState::Succeeded, "finished")
        .await
        .unwrap()
        .unwrap();
    let history = s.transitions(&j.id).await.unwrap();
    let steps: Vec<(Option<JobState>, JobState, &str)> = history
        .iter()
        .map(|t| (t.from, t.to, t.reason.as_str()))
        .collect();
    use JobState::*;
    assert_eq!(
        steps,
        vec![
            (None, Queued, "submitted"),
            (Some(Queued), Scheduled, "placed on n[0]"),
            (Some(Scheduled), Running, "rank 0 started"),
            (Some(Running), Queued, "node n lost"),
            (Some(Queued), Scheduled, "placed on n[0]"),
            (Some(Scheduled), Running, "rank 0 started"),
            (Some(Running), Succeeded, "finished"),
        ]
    );
    assert!(history.windows(2).all(|w| w[0].at <= w[1].at));
    let done = s.get_job(&j.id).await.unwrap().unwrap();
    assert_eq!(done.reason, "finished");
    assert_eq!(done.attempt, 2);
    assert!(s.transitions(&"nope".into()).await.unwrap().is_empty());
}

async fn a_transition_at_a_stale_attempt_changes_nothing(db: TestDb) {
    node(&db.store, "n", 1).await;
    let j = submit(&db.store, "a", 0, 1).await;
    schedule_first_fit(&db.store).await;
    let s = &db.store;
    s.transition(&j.id, &[JobState::Scheduled], JobState::Queued, "node lost")
        .await
        .unwrap()
        .unwrap();
    schedule_first_fit(s).await;
    s.transition_attempt(
        &j.id,
        2,
        &[JobState::Scheduled],
        JobState::Running,
        "started",
    )
    .await
    .unwrap()
    .unwrap();
    // The agent of attempt 1 reports late.
    let late = s
        .transition_attempt(
            &j.id,
            1,
            &[JobState::Running],
            JobState::Failed,
            "rank died",
        )
        .await
        .unwrap();
    assert_eq!(late, None);
    let now = s.get_job(&j.id).await.unwrap().unwrap();
    assert_eq!((now.state, now.attempt), (JobState::Running, 2));
}

async fn requeueing_raises_the_attempt_clears_master_and_frees_devices(db: TestDb) {
    let n = node(&db.store, "n", 2).await;
    let j = submit(&db.store, "a", 0, 2).await;
    let (_, applied) = schedule_first_fit(&db.store).await;
    assert_eq!(applied.len(), 1);
    db.store
        .set_master(&j.id, 1, "10.0.0.1:29500")
        .await
        .unwrap();
    assert_eq!(
        db.store
            .get_job(&j.id)
            .await
            .unwrap()
            .unwrap()
            .master
            .as_deref(),
        Some("10.0.0.1:29500")
    );
    let requeued = db
        .store
        .transition(&j.id, &[JobState::Scheduled], JobState::Queued, "node lost")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(requeued.state, JobState::Queued);
    assert_eq!(requeued.attempt, 2);
    assert_eq!(requeued.master, None);
    assert!(
        db.store
            .assignments_for_node(&n.id)
            .await
            .unwrap()
            .is_empty()
    );
    let (free, applied) = schedule_first_fit(&db.store).await;
    assert_eq!(free.len(), 2, "both devices free again");
    assert_eq!(applied.len(), 1);
    let held = db.store.assignments_for_job(&j.id).await.unwrap();
    assert_eq!(
        held.iter().map(|a| a.attempt).collect::<Vec<_>>(),
        vec![2, 2]
    );
}

async fn a_terminal_transition_frees_devices(db: TestDb) {
    node(&db.store, "n", 2).await;
    use JobState::*;
    for (to, via_running) in [(Succeeded, true), (Failed, true), (Cancelled, false)] {
        let j = submit(&db.store, "a", 0, 2).await;
        let (free, applied) = schedule_first_fit(&db.store).await;
        assert_eq!((free.len(), applied.len()), (2, 1), "{to:?}");
        if via_running {
            db.store
                .transition(&j.id, &[Scheduled], Running, "started")
                .await
                .unwrap()
                .unwrap();
        }
        db.store
            .transition(&j.id, &[Scheduled, Running], to, "ended")
            .await
            .unwrap()
            .unwrap();
        let ended = db.store.get_job(&j.id).await.unwrap().unwrap();
        assert_eq!((ended.state, ended.attempt), (to, 1));
    }
    let (free, _) = schedule_first_fit(&db.store).await;
    assert_eq!(free.len(), 2);
}

async fn count_by_state_lists_every_state(db: TestDb) {
    let zero: Vec<(JobState, i64)> = JobState::ALL.iter().map(|&s| (s, 0)).collect();
    assert_eq!(db.store.count_by_state().await.unwrap(), zero);
    node(&db.store, "n", 1).await;
    let a = submit(&db.store, "a", 1, 1).await;
    submit(&db.store, "b", 0, 1).await;
    let c = submit(&db.store, "c", 0, 1).await;
    schedule_first_fit(&db.store).await;
    db.store
        .transition(&a.id, &[JobState::Scheduled], JobState::Running, "started")
        .await
        .unwrap()
        .unwrap();
    db.store
        .transition(&c.id, &[JobState::Queued], JobState::Cancelled, "user")
        .await
        .unwrap()
        .unwrap();
    let counts: HashMap<JobState, i64> = db
        .store
        .count_by_state()
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(counts.len(), 6);
    assert_eq!(counts[&JobState::Queued], 1);
    assert_eq!(counts[&JobState::Running], 1);
    assert_eq!(counts[&JobState::Cancelled], 1);
    assert_eq!(counts[&JobState::Succeeded], 0);
}

// ---------------------------------------------------------------------------------------------
// Nodes

async fn a_registered_node_is_found_by_its_token_hash(db: TestDb) {
    let mut devs = devices(2);
    devs[1] = DeviceSlot {
        kind: DeviceKind::Cuda,
        memory_bytes: 80 * GB,
    };
    let n = db
        .store
        .register_node("gpu-1", "10.0.0.7", &devs, &token_hash("secret"), None)
        .await
        .unwrap();
    assert_eq!(
        uuid::Uuid::parse_str(n.id.as_str())
            .unwrap()
            .get_version_num(),
        7
    );
    assert_eq!(n.devices, devs);
    assert!(!n.lost);
    let found = db
        .store
        .node_by_token(&token_hash("secret"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found, n);
    assert_eq!(
        db.store.node_by_token(&token_hash("other")).await.unwrap(),
        None
    );
    let empty = db
        .store
        .register_node("no-devices", "h", &[], &token_hash("t2"), None)
        .await
        .unwrap();
    assert_eq!(db.store.nodes().await.unwrap(), vec![n, empty]);
}

async fn heartbeats_of_unknown_or_lost_nodes_are_refused(db: TestDb) {
    let n = node(&db.store, "n", 1).await;
    let at = n.last_heartbeat + 5_000;
    assert!(db.store.heartbeat(&n.id, at).await.unwrap());
    assert_eq!(db.store.nodes().await.unwrap()[0].last_heartbeat, at);
    assert!(!db.store.heartbeat(&"unknown".into(), at).await.unwrap());
    db.store.reap_lost_nodes(at + 1).await.unwrap();
    assert!(db.store.nodes().await.unwrap()[0].lost);
    assert!(!db.store.heartbeat(&n.id, at + 2).await.unwrap());
}

async fn reaping_requeues_the_jobs_of_silent_nodes_and_frees_their_devices(db: TestDb) {
    let s = &db.store;
    let quiet = node(s, "quiet", 2).await;
    let alive = node(s, "alive", 2).await;
    // One job on each node, one across both, one still queued.
    let on_quiet = submit(s, "on-quiet", 3, 1).await;
    let across = submit(s, "across", 2, 2).await;
    let on_alive = submit(s, "on-alive", 1, 1).await;
    let waiting = submit(s, "waiting", 0, 4).await;
    let applied = pass_with(s, |_, free, _| {
        let slot = |node: &NodeId, d: u32| {
            let f = free
                .iter()
                .find(|f| f.node_id == *node && f.device == d)
                .unwrap();
            (f.node_id.clone(), f.device)
        };
        vec![
            Decision {
                job_id: on_quiet.id.clone(),
                slots: vec![slot(&quiet.id, 0)],
            },
            Decision {
                job_id: across.id.clone(),
                slots: vec![slot(&quiet.id, 1), slot(&alive.id, 0)],
            },
            Decision {
                job_id: on_alive.id.clone(),
                slots: vec![slot(&alive.id, 1)],
            },
        ]
    })
    .await;
    assert_eq!(applied.len(), 3);
    s.transition(
        &across.id,
        &[JobState::Scheduled],
        JobState::Running,
        "started",
    )
    .await
    .unwrap()
    .unwrap();
    let t = now_ms() + 60_000;
    assert!(s.heartbeat(&alive.id, t).await.unwrap());
    // Nothing is silent before `quiet` registered.
    assert!(
        s.reap_lost_nodes(quiet.last_heartbeat - 1)
            .await
            .unwrap()
            .is_empty()
    );
    let mut requeued = s.reap_lost_nodes(t - 1).await.unwrap();
    requeued.sort();
    let mut expected = vec![on_quiet.id.clone(), across.id.clone()];
    expected.sort();
    assert_eq!(requeued, expected);
    for id in &expected {
        let j = s.get_job(id).await.unwrap().unwrap();
        assert_eq!((j.state, j.attempt), (JobState::Queued, 2));
        assert_eq!(j.reason, "node quiet lost");
        let last = s.transitions(id).await.unwrap().pop().unwrap();
        assert_eq!(last.to, JobState::Queued);
        assert_eq!(last.reason, "node quiet lost");
    }
    let untouched = s.get_job(&on_alive.id).await.unwrap().unwrap();
    assert_eq!(
        (untouched.state, untouched.attempt),
        (JobState::Scheduled, 1)
    );
    assert_eq!(s.get_job(&waiting.id).await.unwrap().unwrap().attempt, 1);
    let nodes = s.nodes().await.unwrap();
    assert!(nodes.iter().find(|n| n.id == quiet.id).unwrap().lost);
    assert!(!nodes.iter().find(|n| n.id == alive.id).unwrap().lost);
    // `across` released its device on `alive`; nothing on `quiet` is offered.
    let (free, _) = schedule_first_fit(s).await;
    let free_slots: Vec<(NodeId, u32)> =
        free.iter().map(|f| (f.node_id.clone(), f.device)).collect();
    assert_eq!(free_slots, vec![(alive.id.clone(), 0)]);
    // Reaping again finds nothing new.
    assert!(s.reap_lost_nodes(t - 1).await.unwrap().is_empty());
}

async fn registering_again_with_a_known_token_keeps_the_id_and_requeues_its_jobs(db: TestDb) {
    let s = &db.store;
    let first = node(s, "n", 2).await;
    let j = submit(s, "a", 0, 2).await;
    schedule_first_fit(s).await;
    s.reap_lost_nodes(now_ms() + 1).await.unwrap();
    // The requeued job is placed nowhere: the only node is lost.
    assert!(schedule_first_fit(s).await.0.is_empty());
    let again = s
        .register_node(
            "n-restarted",
            "10.0.0.9",
            &devices(3),
            &token_hash("n-token"),
            None,
        )
        .await
        .unwrap();
    assert_eq!(again.id, first.id);
    assert!(!again.lost);
    assert_eq!(s.nodes().await.unwrap(), vec![again.clone()]);
    let (free, applied) = schedule_first_fit(s).await;
    assert_eq!(free.len(), 3);
    assert_eq!(applied.len(), 1);
    assert_eq!(s.get_job(&j.id).await.unwrap().unwrap().attempt, 2);
    // Registering again while it holds a job sends that job back too.
    s.register_node("n", "10.0.0.9", &devices(3), &token_hash("n-token"), None)
        .await
        .unwrap();
    let j = s.get_job(&j.id).await.unwrap().unwrap();
    assert_eq!((j.state, j.attempt), (JobState::Queued, 3));
    assert_eq!(j.reason, "node n registered again");
}

async fn an_allocation_lives_until_ended_and_its_end_requeues_the_job_on_its_nodes(db: TestDb) {
    let s = &db.store;
    let j = submit(s, "j", 0, 1).await;
    let a = server::domain::SlurmAllocation {
        slurm_job_id: 4_000_000_001,
        job_id: j.id.clone(),
        attempt: 1,
        partition: "gpu".into(),
        nodes: 1,
        state: "SUBMITTED".into(),
        reason: "None".into(),
        submitted_at: 5,
    };
    s.insert_allocation(&a, &token_hash("alloc")).await.unwrap();
    assert_eq!(
        s.live_allocations().await.unwrap(),
        std::slice::from_ref(&a)
    );
    assert_eq!(
        s.allocation_by_token(&token_hash("alloc")).await.unwrap(),
        Some(a.clone())
    );
    assert_eq!(
        s.allocation_by_token(&token_hash("other")).await.unwrap(),
        None
    );
    s.allocation_seen(a.slurm_job_id, "PENDING", "Resources")
        .await
        .unwrap();
    let waiting = s
        .set_waiting_reason(
            &j.id,
            1,
            "waiting for Slurm job 4000000001: PENDING (Resources)",
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!((waiting.state, waiting.attempt), (JobState::Queued, 1));
    assert_eq!(s.set_waiting_reason(&j.id, 2, "stale").await.unwrap(), None);
    let seen = &s.live_allocations().await.unwrap()[0];
    assert_eq!(
        (seen.state.as_str(), seen.reason.as_str()),
        ("PENDING", "Resources")
    );

    let n = s
        .register_node(
            "s1",
            "10.0.0.1",
            &devices(1),
            &token_hash("s1-token"),
            Some(&a),
        )
        .await
        .unwrap();
    assert_eq!(n.reserved_for.as_ref(), Some(&j.id));
    let other = node(s, "open", 1).await;
    assert_eq!(other.reserved_for, None);
    assert!(
        !s.runs_on_allocation(a.slurm_job_id, &j.id, 1)
            .await
            .unwrap()
    );
    let (_, applied) = schedule_first_fit(s).await;
    assert_eq!(applied.len(), 1);
    // First fit takes the node registered first: the allocation's.
    assert_eq!(applied[0].slots[0].0, n.id);
    assert!(
        s.runs_on_allocation(a.slurm_job_id, &j.id, 1)
            .await
            .unwrap()
    );

    let requeued = s
        .end_allocation(a.slurm_job_id, "Slurm job ended: TIMEOUT")
        .await
        .unwrap();
    assert_eq!(requeued, std::slice::from_ref(&j.id));
    let j = s.get_job(&j.id).await.unwrap().unwrap();
    assert_eq!((j.state, j.attempt), (JobState::Queued, 2));
    assert_eq!(j.reason, "Slurm job ended: TIMEOUT");
    assert!(s.live_allocations().await.unwrap().is_empty());
    assert_eq!(
        s.allocation_by_token(&token_hash("alloc")).await.unwrap(),
        None
    );
    let nodes = s.nodes().await.unwrap();
    assert!(nodes.iter().find(|x| x.id == n.id).unwrap().lost);
    assert!(!nodes.iter().find(|x| x.id == other.id).unwrap().lost);
}

// ---------------------------------------------------------------------------------------------
// Scheduling

async fn schedule_shows_the_queue_by_priority_then_age_and_the_free_devices(db: TestDb) {
    let s = &db.store;
    let n1 = node(s, "n1", 2).await;
    let n2 = node(s, "n2", 1).await;
    let low_old = submit(s, "low-old", 0, 1).await;
    let high = submit(s, "high", 5, 1).await;
    let low_new = submit(s, "low-new", 0, 1).await;
    let mid = submit(s, "mid", 1, 1).await;
    let cancelled = submit(s, "cancelled", 9, 1).await;
    s.transition(
        &cancelled.id,
        &[JobState::Queued],
        JobState::Cancelled,
        "user",
    )
    .await
    .unwrap()
    .unwrap();
    let mut seen = (Vec::new(), Vec::new());
    let applied = pass_with(s, |queue, free, _| {
        seen = (queue.iter().map(|j| j.id.clone()).collect(), free.to_vec());
        Vec::new()
    })
    .await;
    assert!(applied.is_empty());
    let (queue, free) = seen;
    assert_eq!(queue, [high.id, mid.id, low_old.id.clone(), low_new.id]);
    let slots: Vec<(NodeId, u32, u64)> = free
        .iter()
        .map(|f| (f.node_id.clone(), f.device, f.spec.memory_bytes))
        .collect();
    assert_eq!(
        slots,
        vec![
            (n1.id.clone(), 0, 16 * GB),
            (n1.id.clone(), 1, 16 * GB),
            (n2.id, 0, 16 * GB)
        ]
    );
    // Nothing was decided, so nothing moved.
    assert_eq!(
        s.get_job(&low_old.id).await.unwrap().unwrap().state,
        JobState::Queued
    );
}

async fn schedule_never_hands_out_a_held_device(db: TestDb) {
    let s = &db.store;
    node(s, "n1", 4).await;
    node(s, "n2", 4).await;
    let big = submit(s, "big", 2, 6).await;
    let small = submit(s, "small", 1, 2).await;
    let too_big = submit(s, "too-big", 0, 2).await;
    let (free, applied) = schedule_first_fit(s).await;
    assert_eq!(free.len(), 8);
    assert_eq!(
        applied.iter().map(|d| d.job_id.clone()).collect::<Vec<_>>(),
        vec![big.id.clone(), small.id.clone()]
    );
    let reasons = [&big, &small].map(|j| j.id.clone());
    let mut got = Vec::new();
    for id in &reasons {
        let j = s.get_job(id).await.unwrap().unwrap();
        assert_eq!(j.state, JobState::Scheduled);
        got.push(j.reason);
    }
    assert_eq!(
        got,
        vec!["placed on n1[0,1,2,3] n2[0,1]", "placed on n2[2,3]"]
    );
    // Every device is held: the next pass sees none and places nothing.
    let (free, applied) = schedule_first_fit(s).await;
    assert!(free.is_empty(), "{free:?}");
    assert!(applied.is_empty());
    assert_eq!(
        s.get_job(&too_big.id).await.unwrap().unwrap().state,
        JobState::Queued
    );
    // The small job finishes: exactly its two devices come back, and the waiting job gets them.
    let small_devices: Vec<(NodeId, u32)> = s
        .assignments_for_job(&small.id)
        .await
        .unwrap()
        .into_iter()
        .map(|a| (a.node_id, a.device))
        .collect();
    s.transition(
        &small.id,
        &[JobState::Scheduled],
        JobState::Succeeded,
        "done",
    )
    .await
    .unwrap()
    .unwrap();
    let (free, applied) = schedule_first_fit(s).await;
    let free: Vec<(NodeId, u32)> = free.into_iter().map(|f| (f.node_id, f.device)).collect();
    assert_eq!(free, small_devices);
    assert_eq!(applied.len(), 1);
    assert_eq!(applied[0].job_id, too_big.id);
    assert_eq!(applied[0].slots, small_devices);
}

async fn schedule_drops_invalid_decisions(db: TestDb) {
    let s = &db.store;
    let n = node(s, "n", 4).await;
    let holder = submit(s, "holder", 9, 1).await;
    schedule_first_fit(s).await; // holds device 0
    let a = submit(s, "a", 0, 1).await;
    let b = submit(s, "b", 0, 2).await;
    let c = submit(s, "c", 0, 1).await;
    let d = submit(s, "d", 0, 1).await;
    let slot = |device: u32| (n.id.clone(), device);
    let decisions = vec![
        // A held device.
        Decision {
            job_id: a.id.clone(),
            slots: vec![slot(0)],
        },
        // Too few slots for the world size.
        Decision {
            job_id: b.id.clone(),
            slots: vec![slot(1)],
        },
        // A job that is not queued, and one that does not exist.
        Decision {
            job_id: holder.id.clone(),
            slots: vec![slot(1)],
        },
        Decision {
            job_id: "nope".into(),
            slots: vec![slot(1)],
        },
        // A device that does not exist.
        Decision {
            job_id: c.id.clone(),
            slots: vec![slot(7)],
        },
        // Valid.
        Decision {
            job_id: d.id.clone(),
            slots: vec![slot(1)],
        },
        // The same job again, and a device already given in this pass.
        Decision {
            job_id: d.id.clone(),
            slots: vec![slot(2)],
        },
        Decision {
            job_id: c.id.clone(),
            slots: vec![slot(1)],
        },
        // The same device twice in one job.
        Decision {
            job_id: b.id.clone(),
            slots: vec![slot(2), slot(2)],
        },
    ];
    let applied = pass_with(s, |_, _, _| decisions).await;
    assert_eq!(
        self::decisions(&applied),
        vec![Decision {
            job_id: d.id.clone(),
            slots: vec![slot(1)]
        }]
    );
    for j in [&a, &b, &c] {
        assert_eq!(
            s.get_job(&j.id).await.unwrap().unwrap().state,
            JobState::Queued
        );
    }
    assert_eq!(s.get_job(&holder.id).await.unwrap().unwrap().attempt, 1);
    let held: Vec<u32> = s
        .assignments_for_node(&n.id)
        .await
        .unwrap()
        .into_iter()
        .flat_map(|(_, a)| a.into_iter().map(|a| a.device))
        .collect();
    assert_eq!(held, vec![0, 1]);
}

async fn schedule_ignores_devices_of_lost_nodes(db: TestDb) {
    let s = &db.store;
    let gone = node(s, "gone", 2).await;
    let live = node(s, "live", 1).await;
    assert!(s.heartbeat(&live.id, now_ms() + 60_000).await.unwrap());
    s.reap_lost_nodes(now_ms() + 30_000).await.unwrap();
    submit(s, "two", 1, 2).await;
    let one = submit(s, "one", 0, 1).await;
    let (free, applied) = schedule_first_fit(s).await;
    assert!(
        free.iter().all(|f| f.node_id == live.id),
        "{free:?} {gone:?}"
    );
    assert_eq!(applied.len(), 1);
    assert_eq!(applied[0].job_id, one.id, "the small job backfills");
}

async fn assignments_are_listed_per_node_and_per_job(db: TestDb) {
    let s = &db.store;
    let n1 = node(s, "n1", 2).await;
    let n2 = node(s, "n2", 2).await;
    let wide = submit(s, "wide", 1, 3).await;
    let single = submit(s, "single", 0, 1).await;
    let (_, applied) = schedule_first_fit(s).await;
    assert_eq!(applied.len(), 2);
    let on_n1 = s.assignments_for_node(&n1.id).await.unwrap();
    assert_eq!(on_n1.len(), 1);
    assert_eq!(on_n1[0].0.id, wide.id);
    assert_eq!(on_n1[0].0.state, JobState::Scheduled);
    let ranks: Vec<(u32, u32)> = on_n1[0].1.iter().map(|a| (a.rank, a.device)).collect();
    assert_eq!(ranks, vec![(0, 0), (1, 1)]);
    let on_n2 = s.assignments_for_node(&n2.id).await.unwrap();
    let summary: Vec<(JobId, Vec<(u32, u32)>)> = on_n2
        .iter()
        .map(|(j, a)| (j.id.clone(), a.iter().map(|a| (a.rank, a.device)).collect()))
        .collect();
    assert_eq!(
        summary,
        vec![
            (wide.id.clone(), vec![(2, 0)]),
            (single.id.clone(), vec![(0, 1)])
        ]
    );
    let all = s.assignments_for_job(&wide.id).await.unwrap();
    let placed: Vec<(u32, NodeId, u32, u32)> = all
        .iter()
        .map(|a| (a.rank, a.node_id.clone(), a.device, a.attempt))
        .collect();
    assert_eq!(
        placed,
        vec![
            (0, n1.id.clone(), 0, 1),
            (1, n1.id.clone(), 1, 1),
            (2, n2.id.clone(), 0, 1)
        ]
    );
    assert!(all.iter().all(|a| a.job_id == wide.id));
    // A running job still holds; a finished one is gone from the node but keeps its record.
    s.transition(
        &wide.id,
        &[JobState::Scheduled],
        JobState::Running,
        "started",
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        s.assignments_for_node(&n1.id).await.unwrap()[0].0.state,
        JobState::Running
    );
    s.transition(&wide.id, &[JobState::Running], JobState::Succeeded, "done")
        .await
        .unwrap()
        .unwrap();
    assert!(s.assignments_for_node(&n1.id).await.unwrap().is_empty());
    assert_eq!(s.assignments_for_node(&n2.id).await.unwrap().len(), 1);
    assert_eq!(s.assignments_for_job(&wide.id).await.unwrap(), all);
    assert!(
        s.assignments_for_job(&"nope".into())
            .await
            .unwrap()
            .is_empty()
    );
}

async fn set_master_ignores_other_attempts(db: TestDb) {
    let s = &db.store;
    node(s, "n", 1).await;
    let j = submit(s, "a", 0, 1).await;
    schedule_first_fit(s).await;
    s.set_master(&j.id, 2, "stale:1").await.unwrap();
    assert_eq!(s.get_job(&j.id).await.unwrap().unwrap().master, None);
    s.set_master(&j.id, 1, "10.0.0.1:29500").await.unwrap();
    assert_eq!(
        s.get_job(&j.id).await.unwrap().unwrap().master.as_deref(),
        Some("10.0.0.1:29500")
    );
}

// ---------------------------------------------------------------------------------------------
// Reports

fn step(attempt: u32, step: u32, loss: f64) -> StepRecord {
    StepRecord {
        attempt,
        step,
        loss,
        loss_scale: 65536.0,
        tokens_per_second: 1234.5,
        skipped: false,
        step_seconds: 0.25,
        at: 1_700_000_000_000 + i64::from(step),
        validation_loss: None,
    }
}

async fn steps_round_trip_and_a_repeated_batch_changes_nothing(db: TestDb) {
    let s = &db.store;
    let j = submit(s, "a", 0, 1).await;
    let mut skipped = step(1, 2, f64::INFINITY);
    skipped.skipped = true;
    skipped.loss_scale = 32768.0;
    let batch = vec![step(1, 0, 10.5), step(1, 1, 9.25), skipped.clone()];
    s.add_steps(&j.id, &batch).await.unwrap();
    s.add_steps(&j.id, &batch).await.unwrap();
    s.add_steps(&j.id, &[]).await.unwrap();
    // A resumed attempt repeats step numbers.
    let mut nan = step(2, 1, f64::NAN);
    nan.tokens_per_second = f64::NAN;
    s.add_steps(&j.id, &[step(2, 2, 8.0), nan]).await.unwrap();
    let got = s.steps(&j.id).await.unwrap();
    assert_eq!(got.len(), 5);
    assert_eq!(&got[..3], &batch[..]);
    assert_eq!((got[3].attempt, got[3].step), (2, 1));
    assert!(got[3].loss.is_nan() && got[3].tokens_per_second.is_nan());
    assert_eq!(got[3].loss_scale, 65536.0);
    assert_eq!(got[4], step(2, 2, 8.0));
    assert!(s.steps(&"nope".into()).await.unwrap().is_empty());
}

async fn a_steps_validation_loss_round_trips_and_is_absent_on_steps_without_one(db: TestDb) {
    let s = &db.store;
    let j = submit(s, "a", 0, 1).await;
    let validated = StepRecord {
        validation_loss: Some(7.125),
        ..step(1, 2, 8.5)
    };
    // SQLite stores NaN as NULL, so a NaN validation loss reads back as none on both stores.
    let not_a_number = StepRecord {
        validation_loss: Some(f64::NAN),
        ..step(1, 3, 8.25)
    };
    s.add_steps(&j.id, &[step(1, 1, 9.0), validated.clone(), not_a_number])
        .await
        .unwrap();
    let got = s.steps(&j.id).await.unwrap();
    let validation: Vec<Option<f64>> = got.iter().map(|s| s.validation_loss).collect();
    assert_eq!(validation, [None, Some(7.125), None]);
    assert_eq!(got[1], validated);
}

fn breakdown(base: u64) -> Breakdown {
    Breakdown {
        params: base,
        grads: base + 1,
        optimizer: base + 2,
        activations: base + 3,
        buffers: base + 4,
        overhead: 0,
    }
}

async fn rank_memory_is_replaced_per_rank(db: TestDb) {
    use wire::Op;
    let s = &db.store;
    let j = submit(s, "a", 0, 2).await;
    // Rank 1's agent reports its process's peak resident set, rank 0's does not.
    let record = |rank: u32, base: u64| RankMemoryRecord {
        rank,
        measured: breakdown(base),
        predicted: breakdown(base + 10),
        comm_bytes_sent: BTreeMap::from([(Op::AllGather, base * 3), (Op::ReduceScatter, base)]),
        process_peak_rss_bytes: (rank == 1).then_some(base << 24),
    };
    s.set_rank_memory(&j.id, &record(1, 100)).await.unwrap();
    s.set_rank_memory(&j.id, &record(0, 100)).await.unwrap();
    s.set_rank_memory(&j.id, &record(1, 200)).await.unwrap();
    assert_eq!(
        s.rank_memory(&j.id).await.unwrap(),
        vec![record(0, 100), record(1, 200)]
    );
    assert!(s.rank_memory(&"nope".into()).await.unwrap().is_empty());
}

async fn log_lines_are_numbered_per_job_and_paged_after_a_sequence_number(db: TestDb) {
    let s = &db.store;
    let a = submit(s, "a", 0, 1).await;
    let b = submit(s, "b", 0, 1).await;
    let lines = |from: usize, n: usize| -> Vec<(i64, String)> {
        (from..from + n)
            .map(|i| (1000 + i as i64, format!("line {i}")))
            .collect()
    };
    assert_eq!(s.append_logs(&a.id, &lines(1, 3)).await.unwrap(), 3);
    assert_eq!(s.append_logs(&b.id, &lines(1, 2)).await.unwrap(), 2);
    assert_eq!(s.append_logs(&a.id, &lines(4, 2)).await.unwrap(), 5);
    assert_eq!(s.append_logs(&a.id, &[]).await.unwrap(), 5);
    let all = s.logs(&a.id, 0, 100).await.unwrap();
    let expected: Vec<LogLine> = (1..=5)
        .map(|i| LogLine {
            seq: i,
            at: 1000 + i,
            line: format!("line {i}"),
        })
        .collect();
    assert_eq!(all, expected);
    assert_eq!(s.logs(&a.id, 2, 2).await.unwrap(), expected[2..4].to_vec());
    assert_eq!(s.logs(&a.id, 4, 10).await.unwrap(), expected[4..].to_vec());
    assert!(s.logs(&a.id, 5, 10).await.unwrap().is_empty());
    assert_eq!(s.logs(&b.id, 0, 10).await.unwrap().len(), 2);
    // Concurrent appends to one job get distinct, consecutive numbers.
    let appends = (0..8).map(|k| {
        let s = s.clone();
        let id = a.id.clone();
        async move {
            s.append_logs(&id, &[(k, format!("c{k}")), (k, format!("d{k}"))])
                .await
        }
    });
    let lasts = futures::future::join_all(appends).await;
    assert!(lasts.iter().all(Result::is_ok), "{lasts:?}");
    let seqs: Vec<i64> = s
        .logs(&a.id, 5, 100)
        .await
        .unwrap()
        .iter()
        .map(|l| l.seq)
        .collect();
    assert_eq!(seqs, (6..=21).collect::<Vec<_>>());
}

async fn checkpoints_are_listed_by_step(db: TestDb) {
    let s = &db.store;
    let j = submit(s, "a", 0, 1).await;
    let add = |attempt, step| s.add_checkpoint(&j.id, attempt, step);
    assert!(add(1, 100).await.unwrap());
    assert!(add(1, 50).await.unwrap());
    assert!(!add(2, 150).await.unwrap(), "not yet attempt 2");
    assert!(add(1, 100).await.unwrap(), "the same checkpoint again");
    s.transition(&j.id, &[JobState::Queued], JobState::Queued, "requeued")
        .await
        .unwrap()
        .unwrap();
    assert!(
        !add(1, 200).await.unwrap(),
        "attempt 1 is over: its checkpoints are not committed"
    );
    assert!(add(2, 150).await.unwrap());
    let got: Vec<(u32, u32)> = s
        .checkpoints(&j.id)
        .await
        .unwrap()
        .into_iter()
        .map(|c| (c.attempt, c.step))
        .collect();
    assert_eq!(got, vec![(1, 50), (1, 100), (2, 150)]);
}

async fn uploads_are_recorded_at_the_current_attempt_only_and_removed_by_kind(db: TestDb) {
    let s = &db.store;
    let j = submit(s, "a", 0, 1).await;
    let record = |attempt, name: &str, bytes| ArtifactRecord {
        attempt,
        name: name.into(),
        step: 10,
        bytes,
        sha256: format!("{bytes:064x}"),
        at: 1,
    };
    let manifest = "checkpoints/step-00000010/manifest.json";
    assert!(
        s.add_artifact(&j.id, &record(1, manifest, 5))
            .await
            .unwrap()
    );
    assert!(
        s.add_artifact(&j.id, &record(1, "model.safetensors", 1 << 40))
            .await
            .unwrap()
    );
    // The same name again replaces the record; another attempt's is not taken.
    assert!(
        s.add_artifact(&j.id, &record(1, manifest, 6))
            .await
            .unwrap()
    );
    assert!(
        !s.add_artifact(&j.id, &record(2, manifest, 7))
            .await
            .unwrap()
    );
    assert!(
        !s.add_artifact(&"nope".into(), &record(1, manifest, 7))
            .await
            .unwrap()
    );
    let got = s.artifacts(&j.id).await.unwrap();
    assert_eq!(
        got,
        [
            record(1, manifest, 6),
            record(1, "model.safetensors", 1 << 40)
        ],
        "by name, every field round-trips (sizes past 2^32 too)"
    );
    assert_eq!(
        s.jobs_with_artifacts().await.unwrap(),
        std::slice::from_ref(&j.id)
    );
    assert_eq!(s.remove_artifacts(&j.id, true).await.unwrap(), 1);
    let left: Vec<String> = s
        .artifacts(&j.id)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.name)
        .collect();
    assert_eq!(left, ["model.safetensors"], "checkpoints only");
    assert_eq!(s.remove_artifacts(&j.id, false).await.unwrap(), 1);
    assert!(s.jobs_with_artifacts().await.unwrap().is_empty());
}

async fn reports_for_an_unknown_job_fail_naming_it(db: TestDb) {
    let s = &db.store;
    let unknown = |r: Result<_, StoreError>| matches!(r, Err(StoreError::UnknownJob(id)) if id.as_str() == "nope");
    assert!(unknown(
        s.add_steps(&"nope".into(), &[step(1, 0, 1.0)])
            .await
            .map(|_| ())
    ));
    assert!(unknown(
        s.append_logs(&"nope".into(), &[(0, "x".into())])
            .await
            .map(|_| ())
    ));
    assert!(!s.add_checkpoint(&"nope".into(), 1, 1).await.unwrap());
    let memory = RankMemoryRecord {
        rank: 0,
        measured: breakdown(1),
        predicted: breakdown(1),
        comm_bytes_sent: BTreeMap::new(),
        process_peak_rss_bytes: None,
    };
    assert!(unknown(s.set_rank_memory(&"nope".into(), &memory).await));
}

async fn tokens_are_stored_hashed_and_looked_up_with_their_role(db: TestDb) {
    let s = &db.store;
    assert!(!s.has_admin().await.unwrap());
    s.insert_token("ci", Role::Submitter, "zt_ci_secret")
        .await
        .unwrap();
    s.insert_token("agents", Role::AgentJoin, "zt_join")
        .await
        .unwrap();
    assert!(!s.has_admin().await.unwrap());
    s.insert_token("admin", Role::Admin, "zt_admin")
        .await
        .unwrap();
    assert!(s.has_admin().await.unwrap());
    assert_eq!(
        s.token("zt_ci_secret").await.unwrap(),
        Some(("ci".to_string(), Role::Submitter))
    );
    assert_eq!(
        s.token("zt_join").await.unwrap(),
        Some(("agents".to_string(), Role::AgentJoin))
    );
    assert_eq!(s.token("zt_unknown").await.unwrap(), None);
    assert_eq!(s.token("").await.unwrap(), None);
    // Storing a known token again replaces its name and role.
    s.insert_token("ci-viewer", Role::Viewer, "zt_ci_secret")
        .await
        .unwrap();
    assert_eq!(
        s.token("zt_ci_secret").await.unwrap(),
        Some(("ci-viewer".to_string(), Role::Viewer))
    );
    // Only the SHA-256 is in the database.
    let stored: Vec<String> = raw!(db, pool => {
        sqlx::query_scalar("SELECT hash FROM tokens ORDER BY hash")
            .fetch_all(pool)
            .await
            .unwrap()
    });
    assert_eq!(stored.len(), 3);
    assert!(stored.contains(&token_hash("zt_admin")));
    assert_eq!(
        token_hash("abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    let leaked: i64 = raw!(db, pool => {
        sqlx::query_scalar(
            "SELECT COUNT(*) FROM tokens WHERE hash LIKE '%secret%' OR name LIKE '%zt_%'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    });
    assert_eq!(leaked, 0);
}

async fn the_database_refuses_a_second_holder_of_a_device(db: TestDb) {
    let s = &db.store;
    let n = node(s, "n", 1).await;
    let held = submit(s, "held", 1, 1).await;
    let other = submit(s, "other", 0, 1).await;
    schedule_first_fit(s).await;
    let insert = |job: &str, attempt: i64, rank: i64| {
        format!(
            "INSERT INTO assignments (job_id, attempt, rank, node_id, device, assigned_at) \
             VALUES ('{job}', {attempt}, {rank}, '{}', 0, 0)",
            n.id
        )
    };
    // Another job on the held device.
    let second_holder = raw!(db, pool => {
        sqlx::query(&insert(other.id.as_str(), 1, 0)).execute(pool).await.map(|_| ())
    });
    assert!(second_holder.is_err(), "a device held twice");
    // The same attempt and rank placed twice.
    s.transition(
        &held.id,
        &[JobState::Scheduled],
        JobState::Succeeded,
        "done",
    )
    .await
    .unwrap()
    .unwrap();
    let replaced = raw!(db, pool => {
        sqlx::query(&insert(held.id.as_str(), 1, 0)).execute(pool).await.map(|_| ())
    });
    assert!(replaced.is_err(), "an attempt placed twice");
    // Once released, the device may be held again.
    let next = raw!(db, pool => {
        sqlx::query(&insert(other.id.as_str(), 1, 0)).execute(pool).await.map(|_| ())
    });
    next.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Replicas

/// Two stores on one database (two server replicas) run scheduling passes in loops, handing
/// the scheduler lease back and forth, while jobs start and finish and a node is lost and comes
/// back. Afterwards the tables must show every
/// job attempt placed at most once, each with one assignment per rank, and no device held by
/// two job attempts at once (hold intervals ordered by transition id), and every job done.
async fn two_replicas_never_place_a_job_or_a_device_twice(db: TestDb) {
    const NODES: usize = 3;
    const DEVICES: usize = 4;
    const JOBS: usize = 150;
    let a = db.store.clone();
    let b = db.replica().await;
    for n in 0..NODES {
        node(&a, &format!("node-{n}"), DEVICES).await;
    }
    let mut world_sizes = HashMap::new();
    for i in 0..JOBS {
        let ws = [1, 2, 3, 4, 1, 2, 6][i % 7];
        let j = submit(&a, &format!("job-{i}"), (i % 3) as i32, ws).await;
        world_sizes.insert(j.id, ws);
    }

    let done = Arc::new(AtomicBool::new(false));
    // Each replica keeps its board between passes and hands the lease over every few passes
    // it places in, so both schedule, each loading the board when it takes the lease over and
    // then keeping it up to date with what the other and the loop below changed.
    let passes = |store: Store| {
        let done = done.clone();
        tokio::spawn(async move {
            let mut board = Board::default();
            let (mut placed, mut held) = (0, 0);
            while !done.load(Ordering::Relaxed) {
                let pass = store
                    .schedule(&mut board, LEASE, |b| {
                        first_fit(b.queue(), &free_devices(b))
                    })
                    .await
                    .unwrap();
                if let Some(pass) = pass {
                    placed += pass.placed.len();
                    held += 1;
                    if held % 5 == 0 {
                        store.release_lease().await.unwrap();
                    }
                }
                // A scheduling loop's pause between passes (the behaviour under test: two
                // replicas' passes interleaving), not a wait for an event.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            placed
        })
    };
    let replica_a = passes(a.clone());
    let replica_b = passes(b.clone());

    // Start what is scheduled, finish what ran in the previous round; once a third of the jobs
    // are done, node-2 goes silent (its jobs go back to the queue) and then registers again.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut running: Vec<Job> = Vec::new();
    let mut lost_once = false;
    loop {
        for j in running.drain(..) {
            a.transition_attempt(
                &j.id,
                j.attempt,
                &[JobState::Running],
                JobState::Succeeded,
                "done",
            )
            .await
            .unwrap();
        }
        let scheduled = a
            .list_jobs(&JobFilter {
                state: Some(JobState::Scheduled),
                limit: 1000,
                ..JobFilter::default()
            })
            .await
            .unwrap();
        for j in scheduled {
            let started = a
                .transition_attempt(
                    &j.id,
                    j.attempt,
                    &[JobState::Scheduled],
                    JobState::Running,
                    "started",
                )
                .await
                .unwrap();
            running.extend(started);
        }
        let counts: HashMap<JobState, i64> =
            a.count_by_state().await.unwrap().into_iter().collect();
        if counts[&JobState::Succeeded] == JOBS as i64 {
            break;
        }
        let node_2 = a
            .nodes()
            .await
            .unwrap()
            .into_iter()
            .find(|n| n.name == "node-2")
            .unwrap();
        // Only this loop ends jobs, so what node-2 holds now it still holds when reaped.
        if !lost_once
            && counts[&JobState::Succeeded] >= (JOBS / 3) as i64
            && !a.assignments_for_node(&node_2.id).await.unwrap().is_empty()
        {
            lost_once = true;
            let later = now_ms() + 600_000;
            for n in a.nodes().await.unwrap() {
                if n.id != node_2.id {
                    a.heartbeat(&n.id, later).await.unwrap();
                }
            }
            let requeued = b.reap_lost_nodes(later - 1).await.unwrap();
            assert!(!requeued.is_empty());
            running.retain(|j| !requeued.contains(&j.id));
            node(&b, "node-2", DEVICES).await;
            let live = a.nodes().await.unwrap();
            assert!(live.iter().all(|n| !n.lost), "node-2 is back");
        }
        assert!(Instant::now() < deadline, "jobs left: {counts:?}");
        // The agents' pace: the replicas place between two rounds of starts and ends.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    done.store(true, Ordering::Relaxed);
    let (placed_a, placed_b) = (replica_a.await.unwrap(), replica_b.await.unwrap());
    eprintln!("replica a placed {placed_a} job attempts, replica b {placed_b}");
    assert!(placed_a > 0 && placed_b > 0, "both replicas scheduled");
    let placed = placed_a + placed_b;
    assert!(lost_once);

    // Every attempt was placed at most once, and every placement is in the tables.
    let scheduled: Vec<(String, i64, i64)> = raw!(db, pool => {
        sqlx::query_as(
            "SELECT job_id, attempt, COUNT(*) FROM transitions WHERE to_state = 'scheduled' \
             GROUP BY job_id, attempt",
        )
        .fetch_all(pool)
        .await
        .unwrap()
    });
    assert!(scheduled.iter().all(|(_, _, n)| *n == 1), "{scheduled:?}");
    assert_eq!(
        scheduled.len(),
        placed,
        "decisions applied = attempts scheduled"
    );
    assert!(placed > JOBS, "some jobs ran twice after node-2 was lost");
    let ranks: Vec<(String, i64, i64, i64)> = raw!(db, pool => {
        sqlx::query_as(
            "SELECT job_id, attempt, COUNT(*), MAX(rank) FROM assignments GROUP BY job_id, attempt",
        )
        .fetch_all(pool)
        .await
        .unwrap()
    });
    assert_eq!(ranks.len(), placed);
    for (job, _, count, max_rank) in &ranks {
        let ws = i64::from(world_sizes[&JobId::from(job.as_str())]);
        assert_eq!((*count, *max_rank), (ws, ws - 1), "job {job}");
    }

    // Hold intervals per job attempt: from its `scheduled` transition to the next transition
    // that releases (queued or terminal), in transition-id order, which is commit order for
    // anything a later pass could see.
    let history: Vec<(i64, String, i64, String)> = raw!(db, pool => {
        sqlx::query_as("SELECT id, job_id, attempt, to_state FROM transitions ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap()
    });
    let mut open: HashMap<String, (i64, i64)> = HashMap::new();
    let mut holds: HashMap<(String, i64), (i64, i64)> = HashMap::new();
    for (id, job, attempt, to) in history {
        match to.as_str() {
            "scheduled" => {
                assert!(open.insert(job, (attempt, id)).is_none());
            }
            "queued" | "succeeded" | "failed" | "cancelled" => {
                if let Some((attempt, start)) = open.remove(&job) {
                    holds.insert((job, attempt), (start, id));
                }
            }
            _ => {}
        }
    }
    assert!(open.is_empty(), "every hold ended: {open:?}");
    let devices: Vec<(String, i64, String, i64)> = raw!(db, pool => {
        sqlx::query_as("SELECT job_id, attempt, node_id, device FROM assignments")
            .fetch_all(pool)
            .await
            .unwrap()
    });
    // (node, device) → (first transition id, last transition id, job@attempt) of each hold.
    type Holds = HashMap<(String, i64), Vec<(i64, i64, String)>>;
    let mut per_device: Holds = HashMap::new();
    for (job, attempt, node, device) in devices {
        let (start, end) = holds[&(job.clone(), attempt)];
        per_device.entry((node, device)).or_default().push((
            start,
            end,
            format!("{job}@{attempt}"),
        ));
    }
    for (device, mut intervals) in per_device {
        intervals.sort();
        for w in intervals.windows(2) {
            assert!(
                w[1].0 > w[0].1,
                "device {device:?} held by {} and {} at once",
                w[0].2,
                w[1].2
            );
        }
    }
    let open_holds: i64 = raw!(db, pool => {
        sqlx::query_scalar("SELECT COUNT(*) FROM assignments WHERE released_at IS NULL")
            .fetch_one(pool)
            .await
            .unwrap()
    });
    assert_eq!(open_holds, 0);
    b.close().await;
}

#[tokio::test]
async fn an_in_memory_sqlite_database_keeps_its_data_across_calls() {
    let store = Store::connect("sqlite::memory:").await.unwrap();
    let j = submit(&store, "a", 0, 1).await;
    node(&store, "n", 1).await;
    let (_, applied) = schedule_first_fit(&store).await;
    assert_eq!(applied.len(), 1);
    assert_eq!(
        store.get_job(&j.id).await.unwrap().unwrap().state,
        JobState::Scheduled
    );
}

#[tokio::test]
async fn an_unsupported_database_url_is_refused() {
    let err = Store::connect("mysql://localhost/x").await.unwrap_err();
    assert!(matches!(err, StoreError::Url(_)), "{err}");
}

async fn a_token_name_is_taken_once_and_revoking_frees_it(db: TestDb) {
    let s = &db.store;
    let carol = s
        .create_token("carol", Role::Submitter, "zt_carol")
        .await
        .unwrap()
        .expect("a free name");
    assert_eq!(
        (carol.name.as_str(), carol.role),
        ("carol", Role::Submitter)
    );
    // The name is taken: nothing is written, the second token is unknown.
    assert_eq!(
        s.create_token("carol", Role::Admin, "zt_carol_2")
            .await
            .unwrap(),
        None
    );
    assert_eq!(s.token("zt_carol_2").await.unwrap(), None);
    s.create_token("admin", Role::Admin, "zt_admin")
        .await
        .unwrap();
    let listed: Vec<(String, Role)> = s
        .tokens()
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.role))
        .collect();
    assert_eq!(
        listed,
        [
            ("admin".to_string(), Role::Admin),
            ("carol".to_string(), Role::Submitter)
        ]
    );
    assert_eq!(s.revoke_token("admin").await.unwrap(), Revoked::LastAdmin);
    assert!(s.token("zt_admin").await.unwrap().is_some());
    assert_eq!(s.revoke_token("carol").await.unwrap(), Revoked::Yes);
    assert_eq!(s.token("zt_carol").await.unwrap(), None);
    assert_eq!(s.revoke_token("carol").await.unwrap(), Revoked::Unknown);
    // The last agent join token stays too, until there is another.
    s.create_token("join", Role::AgentJoin, "zt_join")
        .await
        .unwrap();
    assert_eq!(s.revoke_token("join").await.unwrap(), Revoked::LastJoin);
    assert!(s.token("zt_join").await.unwrap().is_some());
    s.create_token("join-2", Role::AgentJoin, "zt_join_2")
        .await
        .unwrap();
    assert_eq!(s.revoke_token("join").await.unwrap(), Revoked::Yes);
    assert!(
        s.create_token("carol", Role::Viewer, "zt_carol_3")
            .await
            .unwrap()
            .is_some()
    );
}

async fn two_admins_revoking_each_other_at_once_leave_one(db: TestDb) {
    for round in 0..10 {
        let (a, b) = (format!("a{round}"), format!("b{round}"));
        for name in [&a, &b] {
            db.store
                .create_token(name, Role::Admin, &format!("zt_{name}"))
                .await
                .unwrap();
        }
        let replica = db.replica().await;
        let (ra, rb) = tokio::join!(db.store.revoke_token(&b), replica.revoke_token(&a));
        let mut outcomes = [ra.unwrap(), rb.unwrap()];
        outcomes.sort_by_key(|o| *o == Revoked::Yes);
        assert_eq!(
            outcomes,
            [Revoked::LastAdmin, Revoked::Yes],
            "round {round}"
        );
        let admins = db.store.tokens().await.unwrap();
        assert_eq!(admins.len(), 1, "round {round}: {admins:?}");
        // Back to no tokens for the next round.
        raw!(db, pool => {
            sqlx::query("DELETE FROM tokens").execute(pool).await.unwrap();
        });
        replica.close().await;
    }
}

async fn an_owner_s_queued_limit_holds_under_concurrent_submissions(db: TestDb) {
    let replica = db.replica().await;
    let attempts = (0..16).map(|i| {
        let store = if i % 2 == 0 { &db.store } else { &replica };
        async move {
            store
                .submit_job(&job(&format!("j{i}"), "alice", 0, 1), None, Some(5))
                .await
                .unwrap()
        }
    });
    let admitted = futures::future::join_all(attempts)
        .await
        .into_iter()
        .filter(Option::is_some)
        .count();
    assert_eq!(admitted, 5);
    let queued = JobFilter {
        state: Some(JobState::Queued),
        owner: Some("alice".into()),
        ..JobFilter::default()
    };
    assert_eq!(
        db.store.list_jobs(&queued).await.unwrap().len(),
        5,
        "nothing half-written"
    );
    // Another owner is not held back; a known idempotency key still answers with its job.
    let bob = job("b", "bob", 0, 1);
    let first = db
        .store
        .submit_job(&bob, Some("k"), Some(1))
        .await
        .unwrap()
        .unwrap();
    let again = db
        .store
        .submit_job(&bob, Some("k"), Some(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.id, first.id);
    replica.close().await;
}

async fn a_pass_sees_each_owner_s_held_ranks_and_old_attempts_are_found(db: TestDb) {
    let s = &db.store;
    node(s, "n", 4).await;
    let wide = s
        .insert_job(&job("wide", "alice", 0, 2), None)
        .await
        .unwrap();
    let narrow = s
        .insert_job(&job("narrow", "bob", 0, 1), None)
        .await
        .unwrap();
    schedule_first_fit(s).await;
    let mut held = HeldRanks::new();
    pass_with(s, |_, _, seen| {
        held = seen.clone();
        Vec::new()
    })
    .await;
    assert_eq!(
        held,
        HeldRanks::from([("alice".into(), 2), ("bob".into(), 1)])
    );
    assert_eq!(s.placed_before(0).await.unwrap(), []);
    let mut old = s.placed_before(now_ms() + 1000).await.unwrap();
    old.sort();
    let mut expected = vec![(wide.id.clone(), 1), (narrow.id.clone(), 1)];
    expected.sort();
    assert_eq!(old, expected);
    // A job that ended holds nothing and is not timed any more.
    s.transition(
        &wide.id,
        &[JobState::Scheduled],
        JobState::Cancelled,
        "test",
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        s.placed_before(now_ms() + 1000).await.unwrap(),
        [(narrow.id.clone(), 1)]
    );
}

// ---------------------------------------------------------------------------------------------
// The scheduler's board and lease

/// A first-fit pass with the replica's kept `board`, which must then show what a board loaded
/// from the tables shows.
async fn kept_pass(store: &Store, board: &mut Board) -> server::store::SchedulingPass {
    let pass = store
        .schedule(board, LEASE, |b| first_fit(b.queue(), &free_devices(b)))
        .await
        .unwrap()
        .expect("this replica holds the scheduler lease");
    let mut fresh = Board::default();
    let loading = store.schedule(&mut fresh, LEASE, |_| Vec::new()).await;
    assert!(loading.unwrap().unwrap().loaded);
    assert_eq!(*board, fresh);
    pass
}

/// The ids of the jobs placed, in order.
fn placed_ids(pass: &server::store::SchedulingPass) -> Vec<&JobId> {
    pass.placed.iter().map(|p| &p.job_id).collect()
}

/// A replica's board, kept between passes, shows what one loaded from the tables shows after
/// each kind of change another replica or an agent makes: submissions, cancellations, jobs
/// starting, ending and going back to the queue, nodes registering (again) and being lost.
/// Only its first pass loads.
async fn a_board_kept_between_passes_matches_one_loaded_afresh(db: TestDb) {
    let s = &db.store;
    let other = db.replica().await;
    let mut board = Board::default();
    let n1 = node(&other, "n1", 2).await;
    let n2 = node(&other, "n2", 2).await;
    let a = submit(&other, "a", 1, 1).await;
    let b = other
        .insert_job(&job("b", "bob", 0, 2), None)
        .await
        .unwrap();
    let c = submit(s, "c", 0, 4).await;
    let first = kept_pass(s, &mut board).await;
    assert!(first.loaded);
    assert_eq!(placed_ids(&first), [&a.id, &b.id]);
    assert_eq!(board.held_ranks()["bob"], 2);
    let idle = kept_pass(s, &mut board).await;
    assert!(!idle.loaded && idle.placed.is_empty());

    // `a` runs and ends, `b` starts, `c` is cancelled and `d` arrives: `d` gets `a`'s device.
    let to = |id: &JobId, from: JobState, to: JobState| {
        let other = other.clone();
        let id = id.clone();
        async move {
            other
                .transition(&id, &[from], to, "test")
                .await
                .unwrap()
                .unwrap();
        }
    };
    to(&a.id, JobState::Scheduled, JobState::Running).await;
    to(&a.id, JobState::Running, JobState::Succeeded).await;
    to(&b.id, JobState::Scheduled, JobState::Running).await;
    to(&c.id, JobState::Queued, JobState::Cancelled).await;
    let d = submit(&other, "d", 0, 1).await;
    let pass = kept_pass(s, &mut board).await;
    assert!(!pass.loaded);
    assert_eq!(placed_ids(&pass), [&d.id]);

    // A new node: `e` fits only once its devices are known.
    let e = submit(&other, "e", 0, 3).await;
    assert!(kept_pass(s, &mut board).await.placed.is_empty());
    let n3 = node(&other, "n3", 4).await;
    let pass = kept_pass(s, &mut board).await;
    assert!(!pass.loaded);
    assert_eq!(placed_ids(&pass), [&e.id]);

    // n1 (holding `b` or `d`) is lost, n2 registers again with fewer devices: their jobs go
    // back to the queue at a new attempt.
    let later = now_ms() + 600_000;
    for n in [&n2, &n3] {
        other.heartbeat(&n.id, later).await.unwrap();
    }
    let lost = other.reap_lost_nodes(later - 1).await.unwrap();
    assert!(!lost.is_empty());
    kept_pass(s, &mut board).await;
    other
        .register_node("n2", "10.0.0.2", &devices(1), &token_hash("n2-token"), None)
        .await
        .unwrap();
    let pass = kept_pass(s, &mut board).await;
    assert!(!pass.loaded);
    assert!(board.nodes().iter().all(|n| n.id != n1.id), "n1 is lost");

    // An agent's report sends a running job back to the queue.
    let scheduled: Vec<Job> = s
        .list_jobs(&JobFilter {
            state: Some(JobState::Scheduled),
            ..JobFilter::default()
        })
        .await
        .unwrap();
    assert!(!scheduled.is_empty());
    for j in scheduled {
        to(&j.id, JobState::Scheduled, JobState::Queued).await;
    }
    assert!(!kept_pass(s, &mut board).await.loaded);
    other.close().await;
}

/// A first-fit pass of `store`'s replica with `board`, taking or renewing the lease for
/// `lease`; `None` when another replica holds it.
async fn try_pass(
    store: &Store,
    board: &mut Board,
    lease: Duration,
) -> Option<server::store::SchedulingPass> {
    store
        .schedule(board, lease, |b| first_fit(b.queue(), &free_devices(b)))
        .await
        .unwrap()
}

async fn state_of(store: &Store, id: &JobId) -> JobState {
    store.get_job(id).await.unwrap().unwrap().state
}

/// Only the replica holding the scheduler lease places: while it renews the lease another
/// replica's passes change nothing. When it stops (as if killed), the other takes over once
/// the lease has lapsed, loading its board from the tables; the one that stopped, coming back,
/// places nothing and forgets its board; a lease handed over is taken at the next pass.
async fn only_the_lease_holder_schedules_and_another_takes_over_when_it_stops(db: TestDb) {
    let a = &db.store;
    let b = db.replica().await;
    node(a, "n", 4).await;
    let (mut board_a, mut board_b) = (Board::default(), Board::default());

    let one = submit(a, "one", 0, 1).await;
    let pass = try_pass(a, &mut board_a, LEASE).await.unwrap();
    assert_eq!(placed_ids(&pass), [&one.id]);
    let two = submit(&b, "two", 0, 1).await;
    assert!(
        try_pass(&b, &mut board_b, LEASE).await.is_none(),
        "a holds the lease"
    );
    assert_eq!(state_of(a, &two.id).await, JobState::Queued);
    // a's last pass renews the lease for a moment only; then a stops.
    let pass = try_pass(a, &mut board_a, Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(placed_ids(&pass), [&two.id]);

    let three = submit(&b, "three", 0, 1).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let taken = loop {
        if let Some(pass) = try_pass(&b, &mut board_b, LEASE).await {
            break pass;
        }
        assert!(Instant::now() < deadline, "b never took the lease over");
        // Time passing is the behaviour under test: the lease lapses only on the clock.
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(taken.loaded, "a new holder loads its board");
    assert_eq!(placed_ids(&taken), [&three.id]);

    // a comes back: b holds the lease, so a places nothing, and forgets its board.
    let four = submit(a, "four", 0, 1).await;
    assert!(try_pass(a, &mut board_a, LEASE).await.is_none());
    assert!(board_a.nodes().is_empty() && board_a.queue().next().is_none());
    assert_eq!(state_of(a, &four.id).await, JobState::Queued);

    // b hands the lease over, as a server shutting down does: a takes it at once, and loads.
    b.release_lease().await.unwrap();
    let pass = try_pass(a, &mut board_a, LEASE)
        .await
        .expect("a handed-over lease is free");
    assert!(pass.loaded);
    assert_eq!(placed_ids(&pass), [&four.id]);
    assert!(board_a.nodes()[0].devices.iter().all(|d| d.held));
    b.close().await;
}

/// Two servers' scheduling passes on one database: the one holding the lease places and
/// publishes its placements, the other places nothing; when the first dies (its connections
/// closed without handing the lease over), the second takes over once the lease lapses.
async fn two_servers_schedule_one_at_a_time_and_the_second_takes_over(db: TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let settings = server::settings::Settings {
        data_dir: dir.path().to_path_buf(),
        safety_margin: 0.0,
        scheduler_lease: Duration::from_secs(2),
        ..server::settings::Settings::default()
    };
    let first = server::AppState::new(db.replica().await, settings.clone()).unwrap();
    let second = server::AppState::new(db.store.clone(), settings).unwrap();
    let s = &db.store;
    node(s, "n", 2).await;
    let one = submit(s, "one", 0, 1).await;
    let placed = server::scheduling::pass(&first).await.unwrap();
    assert_eq!(placed.len(), 1);
    let two = submit(s, "two", 0, 1).await;
    assert!(server::scheduling::pass(&second).await.unwrap().is_empty());
    assert_eq!(state_of(s, &two.id).await, JobState::Queued);
    assert_eq!(state_of(s, &one.id).await, JobState::Scheduled);

    // The first server dies.
    first.store.close().await;
    drop(first);
    let mut events = second.events.subscribe();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let placed = server::scheduling::pass(&second).await.unwrap();
        if !placed.is_empty() {
            assert_eq!(placed[0].job_id, two.id);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second server never took over"
        );
        // Time passing is the behaviour under test: the dead server's lease lapses on the clock.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state_of(s, &two.id).await, JobState::Scheduled);
    match events.try_recv().unwrap() {
        server::state::JobEvent::State { job_id, state, .. } => {
            assert_eq!((job_id, state), (two.id.clone(), JobState::Scheduled));
        }
        other => panic!("{other:?}"),
    }
}

/// A pass that stops at `RANKS_PER_PASS` with jobs left leaves the scheduling loop a wake-up,
/// and the next pass places the rest; one that does not stop leaves none.
async fn a_pass_at_its_rank_budget_wakes_the_next(db: TestDb) {
    use futures::FutureExt;
    use scheduler::queue::RANKS_PER_PASS;

    let dir = tempfile::tempdir().unwrap();
    let mut settings = server::settings::Settings {
        data_dir: dir.path().to_path_buf(),
        safety_margin: 0.0,
        ..server::settings::Settings::default()
    };
    settings.limits.running_ranks_per_owner = u32::MAX;
    let state = server::AppState::new(db.store.clone(), settings).unwrap();
    let s = &db.store;
    node(s, "n", RANKS_PER_PASS as usize + 1).await;
    let wide = submit(s, "wide", 0, RANKS_PER_PASS).await;
    let one = submit(s, "one", 0, 1).await;
    let woken = || state.wake_scheduler.notified().now_or_never().is_some();
    assert!(!woken());

    let placed = server::scheduling::pass(&state).await.unwrap();
    assert_eq!(placed.len(), 1);
    assert_eq!(placed[0].job_id, wide.id);
    assert!(woken(), "a capped pass wakes the loop");
    assert_eq!(state_of(s, &one.id).await, JobState::Queued);

    let placed = server::scheduling::pass(&state).await.unwrap();
    assert_eq!(placed.len(), 1);
    assert_eq!(placed[0].job_id, one.id);
    assert!(
        !woken(),
        "a pass that placed all it could leaves no wake-up"
    );
}

/// PostgreSQL numbers a transition when it is inserted, not when it commits: a change whose
/// transaction commits after a later one was read must still reach a kept board.
#[tokio::test]
async fn a_change_committed_after_a_later_one_still_reaches_the_board() {
    on_postgres(|db| async move {
        let s = &db.store;
        node(s, "n", 1).await;
        let wide = submit(s, "wide", 0, 2).await;
        let mut board = Board::default();
        assert!(kept_pass(s, &mut board).await.placed.is_empty());
        let Raw::Postgres(pool) = &db.raw else {
            unreachable!()
        };
        // Cancel `wide` in a transaction left open while a later job is submitted and placed.
        let mut slow = pool.begin().await.unwrap();
        sqlx::query("UPDATE jobs SET state = 'cancelled' WHERE id = $1")
            .bind(wide.id.as_str())
            .execute(&mut *slow)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO transitions (job_id, attempt, from_state, to_state, reason, at)              VALUES ($1, 1, 'queued', 'cancelled', 'test', 0)",
        )
        .bind(wide.id.as_str())
        .execute(&mut *slow)
        .await
        .unwrap();
        let narrow = submit(s, "narrow", 0, 1).await;
        let pass = kept_pass(s, &mut board).await;
        assert_eq!(placed_ids(&pass), [&narrow.id]);
        assert!(board.queued(&wide.id).is_some());
        slow.commit().await.unwrap();
        let pass = kept_pass(s, &mut board).await;
        assert!(!pass.loaded);
        assert!(board.queued(&wide.id).is_none(), "the cancellation arrived");
    })
    .await;
}
