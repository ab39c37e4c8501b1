-- The race lab's claim strategies that skiplock does NOT use, kept runnable so their
-- failure modes can be shown on demand.  Same format as the core's queries.sql
-- ("-- name: <name>" blocks; {schema} a quoted identifier through psycopg.sql; values
-- bound).  They run on skiplock's own jobs table in a scratch schema, so they set the
-- columns its CHECK asks of a running job (worker, lease_token, locked_until) and
-- filter and order like the core's claim: they compare claim shapes, not indexes.

-- name: naive_claim
-- The postmortem's original claim.  "Is it still pending?" lives only in the subquery,
-- which READ COMMITTED does not re-run after waiting on a row lock: a claimer that
-- waited on another's update re-checks `id IN (...)` on the new row version, still
-- matches, and takes the job a second time.
UPDATE {schema}.jobs
SET status       = 'running',
    worker       = %(worker)s,
    started_at   = now(),
    locked_until = now() + make_interval(secs => %(lease)s),
    attempts     = attempts + 1,
    lease_token  = gen_random_uuid()
WHERE id IN (
    SELECT id
    FROM {schema}.jobs
    WHERE status = 'pending'
      AND queue = %(queue)s
      AND run_at <= now()
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
)
RETURNING id;

-- name: select_pending
-- First half of select-then-update: a plain read, no row lock, so two transactions can
-- both see the same ids as pending.
SELECT id
FROM {schema}.jobs
WHERE status = 'pending'
  AND queue = %(queue)s
  AND run_at <= now()
ORDER BY priority, run_at, id
LIMIT %(limit)s;

-- name: update_by_ids
-- Second half of select-then-update: updates by id only.  Nothing re-checks status on
-- the target row, so ids another transaction claimed since our SELECT are taken again.
UPDATE {schema}.jobs
SET status       = 'running',
    worker       = %(worker)s,
    started_at   = now(),
    locked_until = now() + make_interval(secs => %(lease)s),
    attempts     = attempts + 1,
    lease_token  = gen_random_uuid()
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id;

-- name: for_update_claim
-- The postmortem's fix without SKIP LOCKED.  Correct: a claimer that waited on a row
-- lock re-checks status on the locked row and moves on.  But every claimer queues
-- behind the same first rows, so workers run one at a time.
WITH picked AS MATERIALIZED (
    SELECT id
    FROM {schema}.jobs
    WHERE status = 'pending'
      AND queue = %(queue)s
      AND run_at <= now()
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE
)
UPDATE {schema}.jobs AS j
SET status       = 'running',
    worker       = %(worker)s,
    started_at   = now(),
    locked_until = now() + make_interval(secs => %(lease)s),
    attempts     = j.attempts + 1,
    lease_token  = gen_random_uuid()
FROM picked
WHERE j.id = picked.id
RETURNING j.id;

-- name: advisory_claim
-- Advisory locks instead of row locks.  Two traps, both avoided here: (1) the lock
-- function must run only on rows the LIMIT keeps, so the candidates are ordered in a
-- subquery fenced by OFFSET 0 (a volatile qual is not pushed into it) and the outer
-- LIMIT stops calling the function once it has enough; (2) a candidate may have been
-- claimed and committed after our snapshot, its advisory lock already released, so the
-- UPDATE re-checks status on the target row.  Keys are (table oid, id): another table's
-- advisory locks cannot collide with these.
WITH picked AS MATERIALIZED (
    SELECT c.id
    FROM (
        SELECT tableoid, id
        FROM {schema}.jobs
        WHERE status = 'pending'
          AND queue = %(queue)s
          AND run_at <= now()
        ORDER BY priority, run_at, id
        OFFSET 0
    ) AS c
    WHERE pg_try_advisory_xact_lock(c.tableoid::int, c.id::int)
    LIMIT %(limit)s
)
UPDATE {schema}.jobs AS j
SET status       = 'running',
    worker       = %(worker)s,
    started_at   = now(),
    locked_until = now() + make_interval(secs => %(lease)s),
    attempts     = j.attempts + 1,
    lease_token  = gen_random_uuid()
FROM picked
WHERE j.id = picked.id
  AND j.status = 'pending'
RETURNING j.id;

-- name: hold_lock_claim
-- "Keep the lock for the whole job": the row lock is the claim, so nothing is written
-- and no lease is needed; the transaction stays open while the job runs.
SELECT id
FROM {schema}.jobs
WHERE status = 'pending'
  AND queue = %(queue)s
  AND run_at <= now()
ORDER BY priority, run_at, id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: hold_lock_finish
-- The end of a hold-lock job, in the claim's own transaction: pending straight to done.
UPDATE {schema}.jobs
SET status      = 'done',
    worker      = %(worker)s,
    attempts    = attempts + 1,
    started_at  = coalesce(started_at, now()),
    finished_at = now()
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id;

-- name: complete
-- The lab's completion for the lease-based strategies.  Deliberately unfenced: the race
-- measures claims, and a double-claimed job should still end done once.
UPDATE {schema}.jobs
SET status       = 'done',
    finished_at  = now(),
    locked_until = NULL
WHERE id = ANY(%(ids)s::bigint[])
  AND status = 'running'
RETURNING id;

-- name: pending_exists
-- An empty claim is not the end of the backlog for strategies that may come back empty
-- while jobs remain (for-update after a re-check, advisory, hold-lock).
SELECT EXISTS (
    SELECT 1 FROM {schema}.jobs WHERE status = 'pending' AND queue = %(queue)s
);

-- name: status_counts
SELECT status, count(*) FROM {schema}.jobs GROUP BY status ORDER BY status;

-- name: analyze_jobs
-- Fresh statistics after seeding, so every strategy runs with the same plan from the
-- first claim instead of whichever plan autovacuum's analyze happens to give mid-run.
ANALYZE {schema}.jobs;

-- name: drop_schema
DROP SCHEMA IF EXISTS {schema} CASCADE;

-- name: terminate_sessions
-- Workers that did not exit (a timed-out run) must not keep row locks on a schema we
-- are about to drop.
SELECT pg_terminate_backend(pid)
FROM pg_stat_activity
WHERE pid <> pg_backend_pid()
  AND starts_with(application_name, %(prefix)s);

-- name: lock_wait_sample
-- One sample of the workers' sessions, grouped like the postmortem's own query:
-- wait_event_type 'Lock' is a heavyweight lock wait (transactionid, tuple, extend,
-- advisory ...); NULL is running or idle.
SELECT wait_event_type, wait_event, count(*)
FROM pg_stat_activity
WHERE starts_with(application_name, %(prefix)s)
GROUP BY 1, 2;
