-- skiplock schema, version 2: a completion counter on the row, so that `skiplock verify`
-- can tell from skiplock's own records whether a job was ever completed twice.
--
-- Why a counter and not an append-only completions table: `complete` already rewrites
-- the row (status, finished_at), so bumping an integer in the same UPDATE costs no
-- extra row, no extra index entry and no extra WAL record per job; a log table would
-- add an insert and an index entry to every completion on the hot path.  The fence
-- makes a second completion impossible through skiplock (a done job is never running
-- again), so a count above 1 means something moved a finished job back: an operator's
-- manual requeue, a restored backup replayed, another tool writing to the table, or a
-- bug.  Each is worth a human look, which is what verify reports.
--
-- ADD COLUMN with a constant default is a catalog change since PostgreSQL 11: no table
-- rewrite, only a brief ACCESS EXCLUSIVE lock.  No index: verify scans for the rare
-- rows above 1 once per run, and an index built here would block enqueues while it
-- scanned a large table.

ALTER TABLE {schema}.jobs
    ADD COLUMN completions integer NOT NULL DEFAULT 0 CHECK (completions >= 0);
