-- Per-owner limits (queued jobs, running ranks) count one owner's jobs in one state at
-- submission and in every scheduling pass: without this they read the whole queue.
CREATE INDEX jobs_by_owner_state ON jobs (owner, state);
