-- zerotrain store, PostgreSQL dialect. Keep in step with ../sqlite/0001_init.sql: same tables,
-- columns and constraints; only the types differ. Timestamps are Unix milliseconds; JSON is TEXT.

-- Jobs. `id` is a UUIDv7, so ids sort by submission time.
CREATE TABLE jobs (
    id               TEXT    PRIMARY KEY,
    name             TEXT,
    state            TEXT    NOT NULL CHECK (state IN
                         ('queued', 'scheduled', 'running', 'succeeded', 'failed', 'cancelled')),
    priority         BIGINT  NOT NULL,
    attempt          BIGINT  NOT NULL CHECK (attempt >= 1),
    world_size       BIGINT  NOT NULL CHECK (world_size >= 1),
    spec             TEXT    NOT NULL,
    plan             TEXT    NOT NULL,
    unsupported_keys TEXT    NOT NULL,
    owner            TEXT    NOT NULL,
    -- A client's retry key: one job per (owner, key). NULLs are distinct, so keyless jobs never clash.
    idempotency_key  TEXT,
    reason           TEXT    NOT NULL,
    master           TEXT,
    -- Sequence number of the job's last log line.
    log_seq          BIGINT  NOT NULL DEFAULT 0,
    created_at       BIGINT  NOT NULL,
    updated_at       BIGINT  NOT NULL,
    UNIQUE (owner, idempotency_key)
);
-- The queue in scheduling order, read without sorting. (Not a partial index: without
-- statistics SQLite prefers jobs_by_state and sorts 10,000 whole rows in a temporary B-tree.)
CREATE INDEX jobs_queue ON jobs (state, priority DESC, created_at, id);
CREATE INDEX jobs_by_state ON jobs (state, id);
CREATE INDEX jobs_by_name ON jobs (name, id);

-- Every state change; `id` orders them across all jobs.
CREATE TABLE transitions (
    id         BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id     TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    -- The job's attempt after the change.
    attempt    BIGINT  NOT NULL,
    -- NULL for the submission.
    from_state TEXT,
    to_state   TEXT    NOT NULL,
    reason     TEXT    NOT NULL,
    at         BIGINT  NOT NULL
);
CREATE INDEX transitions_by_job ON transitions (job_id, id);

-- Runner agents. `token_hash` is the SHA-256 (hex) of the node's bearer token.
CREATE TABLE nodes (
    id             TEXT    PRIMARY KEY,
    name           TEXT    NOT NULL,
    host           TEXT    NOT NULL,
    token_hash     TEXT    NOT NULL UNIQUE,
    registered_at  BIGINT  NOT NULL,
    last_heartbeat BIGINT  NOT NULL,
    lost           BOOLEAN NOT NULL DEFAULT FALSE
);

-- A node's devices, by index.
CREATE TABLE devices (
    node_id      TEXT    NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    idx          BIGINT  NOT NULL,
    kind         TEXT    NOT NULL,
    memory_bytes BIGINT  NOT NULL,
    PRIMARY KEY (node_id, idx)
);

-- Rank `rank` of attempt `attempt` of a job runs on device `device` of node `node_id`. Rows are
-- kept after release (`released_at` set) as the job's placement history.
CREATE TABLE assignments (
    job_id      TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt     BIGINT  NOT NULL,
    rank        BIGINT  NOT NULL,
    node_id     TEXT    NOT NULL REFERENCES nodes (id),
    device      BIGINT  NOT NULL,
    assigned_at BIGINT  NOT NULL,
    -- NULL while the job holds the device (it is scheduled or running at this attempt).
    released_at BIGINT,
    -- An attempt is placed once.
    PRIMARY KEY (job_id, attempt, rank)
);
-- A device runs one rank at a time: at most one unreleased assignment per device.
CREATE UNIQUE INDEX assignments_held_device ON assignments (node_id, device)
    WHERE released_at IS NULL;

-- Optimizer steps as rank 0 reported them. Real columns are NULL for NaN, as on SQLite.
CREATE TABLE steps (
    job_id            TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt           BIGINT  NOT NULL,
    step              BIGINT  NOT NULL,
    loss              DOUBLE PRECISION,
    loss_scale        DOUBLE PRECISION,
    tokens_per_second DOUBLE PRECISION,
    skipped           BOOLEAN NOT NULL,
    step_seconds      DOUBLE PRECISION,
    at                BIGINT  NOT NULL,
    PRIMARY KEY (job_id, attempt, step)
);

-- Each rank's latest measured and predicted memory (JSON breakdowns) and bytes sent by op.
CREATE TABLE rank_memory (
    job_id          TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    rank            BIGINT  NOT NULL,
    measured        TEXT    NOT NULL,
    predicted       TEXT    NOT NULL,
    comm_bytes_sent TEXT    NOT NULL,
    updated_at      BIGINT  NOT NULL,
    PRIMARY KEY (job_id, rank)
);

-- Log lines; `seq` counts from 1 per job.
CREATE TABLE logs (
    job_id TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    seq    BIGINT  NOT NULL,
    at     BIGINT  NOT NULL,
    line   TEXT    NOT NULL,
    PRIMARY KEY (job_id, seq)
);

-- Checkpoints the ranks of an attempt completed.
CREATE TABLE checkpoints (
    job_id  TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt BIGINT  NOT NULL,
    step    BIGINT  NOT NULL,
    path    TEXT    NOT NULL,
    at      BIGINT  NOT NULL,
    PRIMARY KEY (job_id, attempt, step)
);

-- Bearer tokens, by SHA-256 (hex); the token itself is never stored.
CREATE TABLE tokens (
    hash       TEXT    PRIMARY KEY,
    name       TEXT    NOT NULL,
    role       TEXT    NOT NULL CHECK (role IN ('viewer', 'submitter', 'admin', 'agent_join')),
    created_at BIGINT  NOT NULL
);
