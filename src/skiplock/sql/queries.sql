-- skiplock's named statements.  Each block starts with "-- name: <name>"; the loader in
-- _sql.py splits on those headers.  {schema} is filled with a quoted identifier by
-- psycopg.sql; every value is a bound parameter.
--
-- The correctness argument lives in three statements: `claim` (who may take a job),
-- the fence clause shared by `complete`, `fail`, `heartbeat` and `release` (who may
-- write to a taken job), and `sweep` (when a taken job is given back).

-- name: claim
-- One statement.  The CTE locks candidate rows and skips rows another claimer holds,
-- so concurrent claimers get disjoint sets without waiting.  MATERIALIZED keeps the
-- planner from inlining the CTE and evaluating LIMIT against the join.  The UPDATE
-- re-checks status on the target row itself: that is the check the postmortem's
-- subquery claim lacked.  The fresh lease_token is the fence for every later write.
WITH picked AS MATERIALIZED (
    SELECT id
    FROM {schema}.jobs
    WHERE status = 'pending'
      AND queue = %(queue)s
      AND run_at <= now()
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs AS j
SET status       = 'running',
    worker       = %(worker)s,
    started_at   = now(),
    finished_at  = NULL,
    locked_until = now() + make_interval(secs => %(lease)s),
    attempts     = j.attempts + 1,
    lease_token  = gen_random_uuid()
FROM picked
WHERE j.id = picked.id
  AND j.status = 'pending'
RETURNING j.*;

-- name: complete
-- Fenced: only the holder of the current lease token of a running job may finish it.
-- A lease that ran out still completes if nobody swept or re-claimed the job.
UPDATE {schema}.jobs AS j
SET status       = 'done',
    finished_at  = now(),
    locked_until = NULL,
    completions  = j.completions + 1  -- verify's record; the fence keeps it at 1
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
RETURNING j.id;

-- name: fail
-- Fenced like `complete`.  While attempts remain and a retry is wanted, the job goes
-- back to pending at now() + delay; otherwise it ends failed.  The attempt counter on
-- the row decides, not the caller's copy of it.
UPDATE {schema}.jobs AS j
SET status       = CASE WHEN f.retry AND j.attempts < j.max_attempts
                        THEN 'pending' ELSE 'failed' END,
    run_at       = CASE WHEN f.retry AND j.attempts < j.max_attempts
                        THEN now() + make_interval(secs => f.delay) ELSE j.run_at END,
    finished_at  = CASE WHEN f.retry AND j.attempts < j.max_attempts
                        THEN NULL ELSE now() END,
    locked_until = NULL,
    last_error   = coalesce(f.error, j.last_error),
    handback_token = f.token  -- proof for a retry after a lost reply (fence_outcome)
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(errors)s::text[],
            %(delays)s::float8[], %(retries)s::bool[]) AS f(id, token, error, delay, retry)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
RETURNING j.id, j.status;

-- name: heartbeat
-- Fenced lease extension.  Row locks taken here make a concurrent sweep skip the row.
UPDATE {schema}.jobs AS j
SET locked_until = now() + make_interval(secs => %(lease)s)
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
RETURNING j.id, j.locked_until;

-- name: release
-- Fenced hand-back of a claimed job that never started: pending again at once, and the
-- attempt the claim counted is given back.
UPDATE {schema}.jobs AS j
SET status       = 'pending',
    attempts     = greatest(j.attempts - 1, 0),
    worker       = NULL,
    started_at   = NULL,
    locked_until = NULL,
    handback_token = f.token  -- proof for a retry after a lost reply (fence_outcome)
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
RETURNING j.id;

-- name: fence_outcome
-- After a dropped connection the caller cannot know whether its fenced write committed.
-- Tokens are kept on the row after the write, so "my token, in the state I asked for"
-- proves it did, and a retried write that matches nothing is not a lost lease.  A
-- hand-back also leaves its token in handback_token, which a re-claim does not touch.
SELECT j.id, j.status, (j.lease_token = f.token) AS current_lease
FROM {schema}.jobs AS j
JOIN unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
  ON j.id = f.id AND (j.lease_token = f.token OR j.handback_token = f.token);

-- name: sweep
-- Leases that ran out go back to pending, claimable at once and in their old place
-- (run_at is kept, and was due when the job was claimed): a dead worker is not the
-- job's fault, but the attempt it spent still counts, and a job that has used all its
-- attempts ends failed.  SKIP LOCKED: rows being heartbeated or swept by another worker
-- are left alone, so every worker can sweep at once with no leader.  Clearing the
-- status kills the old lease token: the fence needs status = 'running'.
WITH expired AS MATERIALIZED (
    SELECT id
    FROM {schema}.jobs
    WHERE status = 'running'
      AND locked_until < now()
    ORDER BY locked_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs AS j
SET status       = CASE WHEN j.attempts < j.max_attempts THEN 'pending' ELSE 'failed' END,
    finished_at  = CASE WHEN j.attempts < j.max_attempts THEN NULL ELSE now() END,
    locked_until = NULL,
    last_error   = 'lease expired on worker ' || coalesce(j.worker, '?')
                   || ' during attempt ' || j.attempts || ' of ' || j.max_attempts
FROM expired
WHERE j.id = expired.id
  AND j.status = 'running'
  AND j.locked_until < now()
RETURNING j.id, j.status;

-- name: enqueue
-- The unique index on (queue, idempotency_key) decides dedup; ON CONFLICT returns no
-- row for a duplicate and the caller looks the existing id up in a new statement.
INSERT INTO {schema}.jobs (queue, payload, priority, run_at, max_attempts, idempotency_key)
VALUES (%(queue)s, %(payload)s::jsonb, %(priority)s, coalesce(%(run_at)s::timestamptz, now()),
        %(max_attempts)s, %(idempotency_key)s)
ON CONFLICT (queue, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id;

-- name: enqueue_rows
-- The keyed path of enqueue_many: same dedup as `enqueue`, for many rows at once.  Ids
-- come from `reserve_ids`, so the caller can tell which of its rows were inserted; a
-- key repeated inside one batch conflicts with its first row and is skipped.
INSERT INTO {schema}.jobs (id, queue, payload, priority, run_at, max_attempts, idempotency_key)
SELECT r.id, r.queue, r.payload::jsonb, r.priority, coalesce(r.run_at, now()), r.max_attempts, r.key
FROM unnest(%(ids)s::bigint[], %(queues)s::text[], %(payloads)s::text[], %(priorities)s::int[],
            %(run_ats)s::timestamptz[], %(max_attempts)s::int[], %(keys)s::text[])
     AS r(id, queue, payload, priority, run_at, max_attempts, key)
ORDER BY r.id
ON CONFLICT (queue, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id;

-- name: find_by_keys
SELECT id, queue, idempotency_key
FROM {schema}.jobs
WHERE (queue, idempotency_key) IN (SELECT * FROM unnest(%(queues)s::text[], %(keys)s::text[]));

-- name: reserve_ids
-- Ids for a COPY are taken from the identity sequence first, so enqueue_many can
-- return them without a RETURNING (which COPY does not have).
SELECT nextval(pg_get_serial_sequence(format('%%I.jobs', %(schema)s::text), 'id'))
FROM generate_series(1, %(n)s);

-- name: copy_jobs
COPY {schema}.jobs (id, queue, payload, priority, max_attempts)
FROM STDIN;

-- name: copy_jobs_at
COPY {schema}.jobs (id, queue, payload, priority, max_attempts, run_at)
FROM STDIN;

-- name: get
SELECT * FROM {schema}.jobs WHERE id = %(id)s;

-- name: cancel
-- Pending jobs end at once; a running job's lease is revoked, so its worker's next
-- heartbeat or completion raises LeaseLost.
UPDATE {schema}.jobs
SET status = 'cancelled', finished_at = now(), locked_until = NULL
WHERE id = %(id)s AND status IN ('pending', 'running')
RETURNING id;

-- name: prune
-- Retention in small batches: short transactions, no long locks, little WAL at once.
WITH doomed AS MATERIALIZED (
    SELECT id
    FROM {schema}.jobs
    WHERE status IN ('done', 'failed', 'cancelled')
      AND finished_at < now() - make_interval(secs => %(older_than)s)
    ORDER BY finished_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
gone AS (
    DELETE FROM {schema}.jobs AS j
    USING doomed
    WHERE j.id = doomed.id
    RETURNING 1
)
SELECT count(*) AS n FROM gone;

-- name: status
SELECT queue,
       status,
       count(*) AS jobs,
       extract(epoch FROM now() - min(run_at) FILTER (WHERE status = 'pending' AND run_at <= now()))
           AS oldest_pending_seconds,
       count(*) FILTER (WHERE status = 'running' AND locked_until < now()) AS expired_leases,
       count(*) FILTER (WHERE attempts >= %(attempts_alert)s) AS high_attempts
FROM {schema}.jobs
GROUP BY queue, status
ORDER BY queue, status;
