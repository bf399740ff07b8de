//! The time of one scheduling pass: 10,000 queued jobs over 1,000 simulated nodes of 8 devices,
//! on SQLite and (when reachable) PostgreSQL, with the server's own pass (`Store::schedule` on
//! the scheduler's board) and policy (`scheduler::queue::decide`): in queue order (priority, then
//! FIFO) each job is gang-placed on the devices still free, and jobs that do not fit wait while
//! smaller ones behind them backfill.
//!
//! Three kinds of pass are timed, each the median of several, split into reading (renewing the
//! lease and bringing the board up to date), deciding and writing (through the commit):
//! - load: the first pass of a replica that takes the lease, which loads the board from the
//!   tables (it places nothing here, so the next passes start from the same state);
//! - placing: every device free at first, so passes of at most `scheduler::queue::RANKS_PER_PASS`
//!   ranks follow one another until the cluster is full, as the scheduling loop runs them (the
//!   database and the board are put back between fills); the fill's total is printed too;
//! - full: after that, the common case of each tick: a long queue and nothing free.
//!
//! `cargo bench -p server --bench schedule` (`ZEROTRAIN_BENCH_PG_URL` picks the PostgreSQL
//! server, default `postgres://postgres@127.0.0.1:5432/test`, `none` skips it; a schema of its
//! own is created and dropped).

use std::str::FromStr;
use std::time::{Duration, Instant};

use futures::StreamExt;
use scheduler::inventory::DeviceSlot;
use scheduler::memory::{Breakdown, DeviceKind};
use scheduler::plan::{Choices, Plan};
use scheduler::queue::{OwnerQuota, RANKS_PER_PASS, decide};
use scheduler::spec::{JobSpec, Purpose, ZeroStage};
use server::domain::{Job, JobId, JobState};
use server::store::{Board, SchedulingPass, Store, token_hash};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const JOBS: usize = 10_000;
const NODES: usize = 1_000;
const DEVICES_PER_NODE: usize = 8;
const LOADS: usize = 3;
const FILLS: usize = 5;
const FULL_PASSES: usize = 9;
const MARGIN: f64 = 0.05;
const LEASE: Duration = Duration::from_secs(600);
const GB: u64 = 1_000_000_000;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}

struct Row {
    store: &'static str,
    pass: &'static str,
    queued: usize,
    free: usize,
    placed: String,
    passes: Vec<Timed>,
}

/// Filling the free cluster: how many passes it took and how long, per fill.
struct Fill {
    store: &'static str,
    passes: usize,
    totals: Vec<Duration>,
}

async fn run() {
    let mut rows = Vec::new();
    let mut fills = Vec::new();

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("bench.db").display());
    let store = Store::connect(&url).await.unwrap();
    let raw = sqlx::SqlitePool::connect(&url).await.unwrap();
    eprintln!("sqlite: populating {JOBS} jobs, {NODES} nodes");
    populate(&store).await;
    let (r, fill) = measure("SQLite", &store, || async {
        reset_sqlite(&raw).await;
    })
    .await;
    rows.extend(r);
    fills.push(fill);
    store.close().await;

    let pg_url = std::env::var("ZEROTRAIN_BENCH_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string());
    let admin = if pg_url == "none" {
        Err("ZEROTRAIN_BENCH_PG_URL=none".to_string())
    } else {
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&pg_url)
            .await
            .map_err(|e| e.to_string())
    };
    match admin {
        Err(e) => eprintln!("PostgreSQL at {pg_url} not measured: {e}"),
        Ok(admin) => {
            let schema = format!("zt_bench_{}", uuid::Uuid::now_v7().simple());
            sqlx::query(&format!("CREATE SCHEMA {schema}"))
                .execute(&admin)
                .await
                .unwrap();
            let options = PgConnectOptions::from_str(&pg_url)
                .unwrap()
                .options([("search_path", schema.as_str())]);
            let store = Store::connect_postgres(options.clone()).await.unwrap();
            let raw = PgPoolOptions::new().connect_with(options).await.unwrap();
            eprintln!("postgres: populating {JOBS} jobs, {NODES} nodes");
            populate(&store).await;
            sqlx::query("ANALYZE").execute(&raw).await.unwrap();
            let (r, fill) = measure("PostgreSQL", &store, || async {
                reset_postgres(&raw).await;
            })
            .await;
            rows.extend(r);
            fills.push(fill);
            store.close().await;
            raw.close().await;
            sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
                .execute(&admin)
                .await
                .unwrap();
        }
    }

    println!();
    println!(
        "One scheduling pass: {JOBS} queued jobs, {NODES} nodes x {DEVICES_PER_NODE} devices, \
         at most {RANKS_PER_PASS} ranks placed per pass (medians of {LOADS} loads, the placing \
         passes of {FILLS} fills and {FULL_PASSES} full passes)"
    );
    println!();
    println!(
        "| store | pass | queued | free devices | placed | read | decide | write | pass (median) | min–max |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let median_of = |f: fn(&Timed) -> Duration| {
            let v: Vec<Duration> = r.passes.iter().map(f).collect();
            ms(median(&v))
        };
        let totals: Vec<Duration> = r.passes.iter().map(|p| p.total).collect();
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {}–{} |",
            r.store,
            r.pass,
            r.queued,
            r.free,
            r.placed,
            median_of(|p| p.pass.read),
            median_of(|p| p.pass.decide),
            median_of(|p| p.pass.write),
            ms(median(&totals)),
            ms(*totals.iter().min().unwrap()),
            ms(*totals.iter().max().unwrap()),
        );
    }
    println!();
    println!("Filling the free cluster, pass after pass (the scheduling loop's wake-up excluded):");
    println!();
    println!("| store | passes | all passes (median) | min–max |");
    println!("|---|---:|---:|---:|");
    for f in fills {
        println!(
            "| {} | {} | {} | {}–{} |",
            f.store,
            f.passes,
            ms(median(&f.totals)),
            ms(*f.totals.iter().min().unwrap()),
            ms(*f.totals.iter().max().unwrap()),
        );
    }
}

/// Nodes of 8 devices, half with 80 GB and half with 40 GB; jobs of 1 to 64 ranks needing 4 to
/// 70 GB per rank, mostly priority 0.
async fn populate(store: &Store) {
    for n in 0..NODES {
        let memory_bytes = if n % 2 == 0 { 80 * GB } else { 40 * GB };
        let devices = vec![
            DeviceSlot {
                kind: DeviceKind::Cuda,
                memory_bytes,
            };
            DEVICES_PER_NODE
        ];
        store
            .register_node(
                &format!("gpu-{n:04}"),
                &format!("10.0.{}.{}", n / 256, n % 256),
                &devices,
                &token_hash(&format!("node-{n}")),
                None,
            )
            .await
            .unwrap();
    }
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let jobs: Vec<Job> = (0..JOBS).map(|i| bench_job(i, &mut rng)).collect();
    futures::stream::iter(jobs)
        .map(|job| async move { store.insert_job(&job, None).await.unwrap() })
        .buffered(8)
        .collect::<Vec<_>>()
        .await;
}

fn next(rng: &mut u64) -> u64 {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    *rng
}

fn bench_job(i: usize, rng: &mut u64) -> Job {
    let world_size = [1, 1, 1, 1, 2, 2, 4, 4, 8, 8, 16, 64][(next(rng) % 12) as usize];
    let need_gb = [4, 10, 20, 30, 35, 50, 70][(next(rng) % 7) as usize];
    let priority = match next(rng) % 20 {
        0 => 5,
        1..=3 => 1,
        _ => 0,
    };
    let per_rank = need_gb * GB;
    let name = format!("bench-{i}");
    Job {
        id: JobId::from(String::new()),
        name: Some(name.clone()),
        state: JobState::Queued,
        priority,
        attempt: 1,
        world_size,
        spec: JobSpec::parse(
            &serde_json::json!({
                "name": name,
                "model": { "preset": "gpt2-1558M" },
                "training": { "micro_batch_size": 4, "seq_len": 1024, "steps": 1000, "lr": 3e-4 },
                "precision": { "dtype": "bf16" },
                "optimizer": { "type": "adamw" },
                "zero": { "stage": "auto" },
                "world_size": world_size,
            })
            .to_string(),
            Purpose::Train,
        )
        .expect("the bench's spec is valid")
        .spec,
        plan: Plan {
            chosen: Choices {
                zero_stage: ZeroStage::Gradients,
                activation_checkpointing: false,
                micro_batch_size: 4,
                grad_accum_steps: 1,
            },
            per_rank_bytes: Breakdown {
                params: per_rank / 4,
                grads: per_rank / 8,
                optimizer: per_rank / 4,
                activations: per_rank / 4,
                buffers: per_rank - per_rank / 4 * 3 - per_rank / 8,
                overhead: 0,
            },
            // The simulated nodes' devices are GPUs.
            device: DeviceKind::Cuda,
            comm_bytes_per_step: per_rank / 2,
            devices_that_fit: 8000,
            bytes_by_rank: Vec::new(),
        },
        unsupported_keys: Vec::new(),
        owner: format!("team-{}", i % 20),
        reason: String::new(),
        master: None,
        created_at: 0,
        updated_at: 0,
    }
}

/// One pass with the scheduler's policy, no owner limit (the default of 64 ranks per owner
/// would stop 20 owners at 1,280 devices), and how long the whole call took.
struct Timed {
    pass: SchedulingPass,
    total: Duration,
    queued: usize,
    free: usize,
}

async fn timed_pass(store: &Store, board: &mut Board) -> (Timed, bool) {
    let mut shown = (0, 0);
    let mut capped = false;
    let start = Instant::now();
    let pass = store
        .schedule(board, LEASE, |b| {
            let free = b
                .nodes()
                .iter()
                .flat_map(|n| &n.devices)
                .filter(|d| !d.held);
            shown = (b.queue().count(), free.count());
            let quota = OwnerQuota {
                held: b.held_ranks(),
                limit: u32::MAX,
            };
            let decided = decide(b.queue(), b.nodes(), MARGIN, quota, RANKS_PER_PASS);
            capped = decided.capped;
            decided.decisions
        })
        .await
        .unwrap()
        .expect("the bench's replica holds the scheduler lease");
    let timed = Timed {
        total: start.elapsed(),
        queued: shown.0,
        free: shown.1,
        pass,
    };
    (timed, capped)
}

async fn measure<R, Fut>(store_name: &'static str, store: &Store, reset: R) -> (Vec<Row>, Fill)
where
    R: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut loads = Vec::new();
    let mut loaded = Board::default();
    for i in 0..LOADS {
        loaded = Board::default();
        let start = Instant::now();
        let pass = store
            .schedule(&mut loaded, LEASE, |_| Vec::new())
            .await
            .unwrap()
            .expect("the bench's replica holds the scheduler lease");
        assert!(pass.loaded);
        let total = start.elapsed();
        let free = loaded.nodes().iter().flat_map(|n| &n.devices);
        loads.push(Timed {
            total,
            queued: loaded.queue().count(),
            free: free.filter(|d| !d.held).count(),
            pass,
        });
        eprintln!("{store_name} load {i}: {}", ms(loads[i].total));
    }
    let mut placing = Vec::new();
    let mut fill = Fill {
        store: store_name,
        passes: 0,
        totals: Vec::new(),
    };
    let mut placed_jobs = 0;
    let mut board = loaded.clone();
    for i in 0..FILLS {
        if i > 0 {
            reset().await;
            board = loaded.clone();
        }
        let (mut passes, mut jobs, mut total) = (0, 0, Duration::ZERO);
        loop {
            let (p, capped) = timed_pass(store, &mut board).await;
            assert!(!p.pass.loaded, "the board was kept");
            eprintln!(
                "{store_name} fill {i} pass {passes}: {} placed in {} (read {}, decide {}, write {})",
                p.pass.placed.len(),
                ms(p.total),
                ms(p.pass.read),
                ms(p.pass.decide),
                ms(p.pass.write),
            );
            passes += 1;
            jobs += p.pass.placed.len();
            total += p.total;
            placing.push(p);
            if !capped {
                break;
            }
        }
        if i == 0 {
            (fill.passes, placed_jobs) = (passes, jobs);
        }
        assert_eq!(
            (passes, jobs),
            (fill.passes, placed_jobs),
            "every fill places the same"
        );
        fill.totals.push(total);
    }
    let mut full = Vec::new();
    for i in 0..FULL_PASSES {
        full.push(timed_pass(store, &mut board).await.0);
        eprintln!(
            "{store_name} full pass {i}: {} free, {} placed in {}",
            full[i].free,
            full[i].pass.placed.len(),
            ms(full[i].total)
        );
    }
    let row = |pass: &'static str, placed: String, passes: Vec<Timed>| Row {
        store: store_name,
        pass,
        queued: passes[0].queued,
        free: passes[0].free,
        placed,
        passes,
    };
    let placed_by = |passes: &[Timed]| passes[0].pass.placed.len().to_string();
    let placed = format!("{placed_jobs} jobs in {} passes", fill.passes);
    let rows = vec![
        row("load (lease taken)", placed_by(&loads), loads),
        row("placing (all devices free, until full)", placed, placing),
        row("full (queue waits)", placed_by(&full), full),
    ];
    (rows, fill)
}

/// Puts the database back as before the placing pass: no assignments, the scheduled jobs
/// queued again.
const RESET: [&str; 3] = [
    "DELETE FROM assignments",
    "DELETE FROM transitions WHERE to_state = 'scheduled'",
    "UPDATE jobs SET state = 'queued', reason = 'submitted' WHERE state = 'scheduled'",
];

async fn reset_sqlite(raw: &sqlx::SqlitePool) {
    let mut tx = raw.begin().await.unwrap();
    for sql in RESET {
        sqlx::query(sql).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
}

async fn reset_postgres(raw: &sqlx::PgPool) {
    let mut tx = raw.begin().await.unwrap();
    for sql in RESET {
        sqlx::query(sql).execute(&mut *tx).await.unwrap();
    }
    // Numbers the next transitions where the board's cursor expects them, as SQLite does
    // when the last rows are deleted.
    sqlx::query(
        "SELECT setval(pg_get_serial_sequence('transitions', 'id'), (SELECT MAX(id) FROM transitions))",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    sqlx::query("VACUUM ANALYZE jobs")
        .execute(raw)
        .await
        .unwrap();
    sqlx::query("VACUUM ANALYZE assignments")
        .execute(raw)
        .await
        .unwrap();
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}
