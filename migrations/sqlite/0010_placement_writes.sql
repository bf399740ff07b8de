-- A scheduling pass that fills a cluster writes thousands of assignments and moves hundreds of
-- jobs in one transaction; these make each row cheaper to write.
--
-- The scheduler reads the queue from its board, not in index order: jobs_queue only cost every
-- state change an index update.
DROP INDEX jobs_queue;

-- Assignments without foreign keys, clustered by their key: a pass writes them in the
-- transaction that moves their job out of the queue (which proves the job exists), onto devices
-- of live nodes (nodes are never deleted), and neither jobs nor nodes are deleted, so the
-- checks (two lookups per row) guarded nothing.
CREATE TABLE assignments_0008 (
    job_id      TEXT    NOT NULL,
    attempt     INTEGER NOT NULL,
    rank        INTEGER NOT NULL,
    node_id     TEXT    NOT NULL,
    device      INTEGER NOT NULL,
    assigned_at INTEGER NOT NULL,
    released_at INTEGER,
    PRIMARY KEY (job_id, attempt, rank)
) WITHOUT ROWID;
INSERT INTO assignments_0008 (job_id, attempt, rank, node_id, device, assigned_at, released_at)
    SELECT job_id, attempt, rank, node_id, device, assigned_at, released_at FROM assignments;
DROP TABLE assignments;
ALTER TABLE assignments_0008 RENAME TO assignments;
CREATE UNIQUE INDEX assignments_held_device ON assignments (node_id, device)
    WHERE released_at IS NULL;
