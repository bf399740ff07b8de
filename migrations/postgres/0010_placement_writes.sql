-- A scheduling pass that fills a cluster writes thousands of assignments and moves hundreds of
-- jobs in one transaction; these make each row cheaper to write.
--
-- The scheduler reads the queue from its board, not in index order: jobs_queue only cost every
-- state change an index update.
DROP INDEX jobs_queue;

-- Assignments without foreign keys: a pass writes them in the transaction that moves their job
-- out of the queue (which proves the job exists), onto devices of live nodes (nodes are never
-- deleted), and neither jobs nor nodes are deleted, so the checks guarded nothing; they were
-- most of the time a pass took to write 8,000 assignments (a trigger and a row lock per check).
ALTER TABLE assignments DROP CONSTRAINT assignments_job_id_fkey;
ALTER TABLE assignments DROP CONSTRAINT assignments_node_id_fkey;
