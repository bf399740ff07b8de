-- The files agents uploaded to the artifact store, one row per (job, attempt, name): what a
-- job's checkpoints are complete with, and what GET /v1/jobs/{id}/artifacts lists.
CREATE TABLE artifacts (
    job_id  TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt BIGINT NOT NULL,
    name    TEXT    NOT NULL,
    step    BIGINT NOT NULL,
    bytes   BIGINT NOT NULL,
    sha256  TEXT    NOT NULL,
    at      BIGINT NOT NULL,
    PRIMARY KEY (job_id, attempt, name)
);
