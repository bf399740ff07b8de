-- The peak resident set of the process that ran a rank (VmHWM), reported with its memory since
-- issue 15: ranks that are threads of one process report the same figure. NULL when the agent
-- did not report it.
ALTER TABLE rank_memory ADD COLUMN process_peak_rss_bytes BIGINT;
