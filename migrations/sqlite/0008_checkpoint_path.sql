-- A checkpoint's files are the artifact store's (the `artifacts` rows of its step), found by
-- job, attempt and step: the path the agent once reported is never read.
ALTER TABLE checkpoints DROP COLUMN path;
