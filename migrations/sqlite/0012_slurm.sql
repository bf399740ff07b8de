-- Slurm allocations the scheduler asked for, one per attempt of a job (issue 40). A live one has
-- no ended_at; its agents join with the token whose hash is kept here and serve that job only.
-- state and reason are what squeue said last (the job's events show changes).
CREATE TABLE slurm_allocations (
    slurm_job_id INTEGER PRIMARY KEY,
    job_id       TEXT    NOT NULL,
    attempt      INTEGER NOT NULL,
    partition    TEXT    NOT NULL,
    nodes        INTEGER NOT NULL,
    token_hash   TEXT    NOT NULL UNIQUE,
    state        TEXT    NOT NULL,
    reason       TEXT    NOT NULL,
    submitted_at INTEGER NOT NULL,
    ended_at     INTEGER
);
CREATE INDEX slurm_allocations_live ON slurm_allocations (job_id) WHERE ended_at IS NULL;

-- The allocation that started a node's agent, and its job and attempt: the node serves that
-- attempt only.
ALTER TABLE nodes ADD COLUMN allocation INTEGER;
ALTER TABLE nodes ADD COLUMN reserved_for TEXT;
ALTER TABLE nodes ADD COLUMN reserved_attempt INTEGER;
