-- skiplock schema, version 10: the claim reads pending jobs in claim order, whatever the
-- statistics say.
--
-- Why: since 0009 a claim reads an Append of the generations.  Ordered, that is a Merge
-- Append of each generation's jobs_gN_claimable_idx, which stops after the batch: 70
-- index entries for a claim of 70.  The planner may instead read every pending job of
-- every generation and sort them, and it does so whenever its estimates make that look
-- cheaper: a generation it believes empty or nearly so (analyzed while it held a few
-- running jobs, by autovacuum or by a DBA's ANALYZE) costs a sequential scan of almost
-- nothing, and a backlog that arrived after the last ANALYZE of its generation is
-- estimated at one row, so sorting "three rows" beats opening three indexes.  Measured
-- on PostgreSQL 15 with 20,000 pending jobs in one generation and five running ones,
-- analyzed, in another: 22 ms a claim of 70, against 2.7 ms ordered; the sort's cost
-- grows with the backlog, not with the batch (bench/README.md, "The claim's plan").
-- No DBA and no bench is needed to get there: autovacuum analyzes a generation whose
-- jobs finished while a few still run.
--
-- The cure is to take the choice away.  `claimable` is the claim's pick: the same
-- SELECT ... ORDER BY ... LIMIT ... FOR UPDATE SKIP LOCKED the claim held before, in a
-- function planned with enable_sort off, so the only plan left that is ordered without
-- a sort (each generation's claimable index, merged) is the one it takes.  enable_sort
-- is not a ban: had no index provided the order, the planner would still sort.  The
-- setting holds inside the function only (SET on a function is undone at its return),
-- so no caller's own queries and no other statement of skiplock see it; and it holds
-- for every caller alike: Queue.claim, both workers, behind a transaction pooler too.
-- PL/pgSQL keeps the plan for the session, as a prepared statement would.
--
-- ROWS 1 is the estimate the claim's UPDATE plans its join with.  It finds each picked
-- row by a TID scan, one row read a job; at the default estimate of 1,000 rows the
-- planner chose instead to read the whole backlog's generation and hash it (17 ms a
-- claim of 70 against 20,000 pending).  A claim of many rows is still best served by
-- TID scans, so the low estimate costs nothing when it is wrong.
--
-- The correctness argument is unchanged and stays in queries.sql (`claim`): the pick
-- locks the rows it returns and skips rows another claimer holds; the claim's UPDATE
-- finds each by the version locked here and re-checks that it is still pending.  A
-- VOLATILE function takes its own snapshot, a little later than the calling
-- statement's: a row the pick locks in a version that snapshot cannot see is not
-- updated, and stays pending for the next claim (as a row updated after the claim's
-- snapshot always was).  The function runs as its caller (SECURITY INVOKER), so the
-- grants on jobs decide what it may read and lock, and EXECUTE stays with PUBLIC: the
-- roles `skiplock roles` made before this migration claim through it unchanged, and a
-- producer role, which may not read run_at or part, is refused as before.
--
-- `lim` of 0 or less picks nothing (a paused or limited queue); NULL positions start at
-- the head; `tasks` NULL takes any task.

CREATE FUNCTION {schema}.claimable(queue_name text, lim bigint, from_priority integer,
                                   from_run_at timestamptz, from_id bigint, tasks text[])
RETURNS TABLE (id bigint, row_ctid tid, part integer)
LANGUAGE plpgsql VOLATILE
ROWS 1
SET enable_sort = off
AS $fn$
BEGIN
    IF lim IS NULL OR lim <= 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT j.id, j.ctid, j.part
    FROM {schema}.jobs AS j
    WHERE j.status = 'pending'
      AND j.part < 1000000  -- the generations: no day holds a pending job
      AND j.queue = queue_name
      AND j.run_at <= now()
      AND (j.priority, j.run_at, j.id) >= (coalesce(from_priority, -2147483648),
                                           coalesce(from_run_at, '-infinity'),
                                           coalesce(from_id, -9223372036854775808))
      AND (tasks IS NULL OR j.task = ANY (tasks))
    ORDER BY j.priority, j.run_at, j.id
    LIMIT lim
    FOR UPDATE OF j SKIP LOCKED;
END
$fn$;
