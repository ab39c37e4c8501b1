-- skiplock schema, version 6: the leases index only for the statements that scan leases.
--
-- jobs_leases_idx was partial on `status = 'running'`.  Every fenced write (complete,
-- fail, heartbeat, release) also says `status = 'running'`, so the planner could answer
-- it by reading the whole partial index and hash-joining the batch, instead of one
-- primary-key probe per job.  It does so when its statistics say few rows are running,
-- which they do: few rows are.  But while a transaction holds back xmin, the index keeps
-- an entry for every row version that was ever running and nothing can mark them dead:
-- with autovacuum on (which keeps the statistics fresh and small), a held xmin and 1,000
-- jobs/s, the complete read 6,113 buffers and took 18.8 ms a call (bench/README.md).
--
-- The new predicate adds `locked_until IS NOT NULL`.  It is true of every running row
-- (jobs_running_has_lease), so the index holds the same rows; but a fenced write does not
-- mention locked_until, so its WHERE no longer implies the predicate and the planner can
-- only find its rows by id.  The statements that want the index say `locked_until < x`
-- (the sweep, verify, status), which implies IS NOT NULL, or say it outright (the
-- limited claim's count of running jobs).
--
-- Building the index reads the table once and blocks writes to it meanwhile (the
-- migration runs in one transaction, where CONCURRENTLY is not allowed).  No row is
-- touched: pending and running jobs keep their tokens and leases.

CREATE INDEX jobs_running_leases_idx ON {schema}.jobs (locked_until)
    WHERE status = 'running' AND locked_until IS NOT NULL;

DROP INDEX {schema}.jobs_leases_idx;
