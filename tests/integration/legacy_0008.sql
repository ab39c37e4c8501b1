-- The statements of a skiplock worker and producer at schema 0008 (skiplock at commit
-- 26344a3, src/skiplock/sql/queries.sql), verbatim: the "old worker" of the migration
-- test in test_generations.py, which keeps running while migration 0009 turns `jobs`
-- into a partitioned table, and the grants `skiplock roles` gave its roles (sql/roles.sql
-- at the same commit).  Not used by skiplock itself.

-- name: claim
-- One statement.  The CTE locks candidate rows and skips rows another claimer holds,
-- so concurrent claimers get disjoint sets without waiting.  MATERIALIZED keeps the
-- planner from inlining the CTE and evaluating LIMIT against the join.  The UPDATE
-- re-checks status on the target row itself: that is the check the postmortem's
-- subquery claim lacked.  The fresh lease_token is the fence for every later write.
-- The queue's row in `queues` (if any) is read first: a paused queue gives nothing,
-- and a limited one gives nothing here either but says so (queue_limited), and the
-- caller takes the locked path, `claim_limited`.  The row is read as it is (zero or one
-- row, no aggregate) and the FULL JOIN returns it alone when nothing was claimed; a
-- queue without a row and nothing claimed returns no row at all.  (An aggregate over
-- the lookup and a LEFT JOIN from it cost the claim a seventh of its server time and
-- an idle poll a fifth of its rate: bench/README.md, sqlcmp.)
-- The scan may start at a position in claim order (from_*; all NULL: the head).  A
-- worker passes where its last claim ended: the index entries before it are jobs
-- already taken, and while a transaction holds back xmin (or nothing has vacuumed a
-- long history) each costs a heap visit to every claim that walks past it, so a claim
-- from the head grows with the history instead of with the batch.  Which jobs a claim
-- may take does not depend on it, only how soon one that sorts before the position is
-- seen: the worker claims from the head again after 20 times that claim's own duration
-- (every 50 ms on a clean table, at most every 10 s: _cursor.py).
-- `tasks` (NULL: any) limits the claim to the tasks this worker knows: a job for a task
-- it does not know is not taken, so it is not failed and not charged an attempt; it
-- stays pending for a worker that knows it (migration 0007, a rolling deploy).
-- The UPDATE finds each picked row by its ctid, the version the CTE locked (nobody can
-- change it while we hold the lock): by id alone, the planner trusted a stale estimate
-- of one pending row and scanned jobs_claimable_idx for every picked row, 72 ms a claim
-- after a million-job history (0.46 ms by ctid).  A picked row updated by another
-- transaction after our snapshot is not found by ctid and simply not claimed this time.
WITH cfg AS MATERIALIZED (
    SELECT q.paused OR q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL AS stop,
           q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL AS limited,
           q.store_results
    FROM {schema}.queues AS q
    WHERE q.name = %(queue)s
),
picked AS MATERIALIZED (
    SELECT id, ctid
    FROM {schema}.jobs
    WHERE status = 'pending'
      AND queue = %(queue)s
      AND run_at <= now()
      AND (priority, run_at, id) >= (coalesce(%(from_priority)s::integer, -2147483648),
                                     coalesce(%(from_run_at)s::timestamptz, '-infinity'),
                                     coalesce(%(from_id)s::bigint, -9223372036854775808))
      AND NOT EXISTS (SELECT FROM cfg WHERE cfg.stop)
      AND (%(tasks)s::text[] IS NULL OR task = ANY(%(tasks)s::text[]))
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {schema}.jobs AS j
    SET status       = 'running',
        worker       = %(worker)s,
        started_at   = now(),
        finished_at  = NULL,
        locked_until = now() + make_interval(secs => %(lease)s),
        attempts     = j.attempts + 1,
        lease_token  = gen_random_uuid()
    FROM picked
    WHERE j.ctid = picked.ctid  -- the version locked above: a TID scan
      AND j.id = picked.id
      AND j.status = 'pending'
    RETURNING j.*
)
SELECT claimed.*, coalesce(cfg.limited, false) AS queue_limited,
       coalesce(cfg.store_results, true) AS store_result
FROM claimed FULL JOIN cfg ON true;

-- name: complete
-- Fenced: only the holder of the current lease token of a running job may finish it.
-- A lease that ran out still completes if nobody swept or re-claimed the job.  A job
-- whose cancel was asked while it ran ends `cancelled`: done is never written over a
-- cancel.  Someone waiting on the job (notify_finish) is told; nobody else pays for a
-- NOTIFY.  The NOTIFY sits in RETURNING: no CTE to materialise and read again.
UPDATE {schema}.jobs AS j
SET status       = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'done' END,
    finished_at  = now(),
    locked_until = NULL,
    result       = f.result::jsonb,
    completions  = j.completions + 1  -- verify's record; the fence keeps it at 1
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::text[])
     AS f(id, token, result)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
RETURNING j.id, j.lease_token, j.status,
          CASE WHEN j.notify_finish THEN pg_notify({channel}, 'finished:' || j.id) END
              AS notified;

-- name: heartbeat
-- Fenced lease extension.  Row locks taken here make a concurrent sweep skip the row.
-- It also carries a cancel asked since the last beat back to the worker.
UPDATE {schema}.jobs AS j
SET locked_until = now() + make_interval(secs => %(lease)s)
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
RETURNING j.id, j.lease_token, j.locked_until, j.cancel_requested;

-- name: sweep
-- Leases that ran out go back to pending, claimable at once and in their old place
-- (run_at is kept, and was due when the job was claimed): a dead worker is not the
-- job's fault, but the attempt it spent still counts, and a job that has used all its
-- attempts ends failed (a job whose cancel was asked ends cancelled).  SKIP LOCKED:
-- rows being heartbeated or swept by another worker are left alone, so every worker
-- can sweep at once with no leader.  Clearing the status kills the old lease token:
-- the fence needs status = 'running'.
-- A sweep may look back only `window` seconds (NULL: all the way).  jobs_running_leases_idx
-- keeps an entry for every lease a running row ever had; while a transaction holds back
-- xmin none of them can be marked dead, and a sweep from the start visits the heap for
-- each (20,761 buffers and 99 ms a sweep after minutes of a held xmin, bench/README.md).
-- A lease that ran out before the worker's previous sweep was that sweep's to take, so
-- the worker looks back to a little before it, and all the way now and then
-- (_cursor.SweepCursor).
WITH expired AS MATERIALIZED (
    SELECT id, ctid
    FROM {schema}.jobs
    WHERE status = 'running'
      AND locked_until < now()
      AND locked_until >= coalesce(now() - make_interval(secs => %(window)s::float8),
                                   '-infinity')
    ORDER BY locked_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs AS j
SET status       = CASE WHEN j.cancel_requested THEN 'cancelled'
                        WHEN j.attempts < j.max_attempts THEN 'pending' ELSE 'failed' END,
    finished_at  = CASE WHEN j.attempts < j.max_attempts AND NOT j.cancel_requested
                        THEN NULL ELSE now() END,
    locked_until = NULL,
    last_error   = 'lease expired on worker ' || coalesce(j.worker, '?')
                   || ' during attempt ' || j.attempts || ' of ' || j.max_attempts
FROM expired
WHERE j.ctid = expired.ctid  -- the version locked above: a TID scan
  AND j.id = expired.id
  AND j.status = 'running'
  AND j.locked_until < now()
RETURNING j.id, j.status;

-- name: enqueue
-- The unique index on (queue, idempotency_key) decides dedup; ON CONFLICT returns no
-- row for a duplicate and the caller looks the existing id up in a new statement.
INSERT INTO {schema}.jobs (queue, payload, priority, run_at, max_attempts, idempotency_key,
                           task, meta)
VALUES (%(queue)s, %(payload)s::jsonb, %(priority)s, coalesce(%(run_at)s::timestamptz, now()),
        %(max_attempts)s, %(idempotency_key)s, %(task)s, %(meta)s::jsonb)
ON CONFLICT (queue, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id;

-- name: grant_producer
-- Enqueue only.  INSERT on the columns enqueue, enqueue_many and its COPY write (not
-- status, worker or lease_token: a producer cannot plant a running or finished job);
-- SELECT on the columns the idempotency-key lookup, RETURNING id and `wait` read (not
-- the payloads of other jobs); UPDATE of notify_finish, which is how `wait` asks a
-- job's final write to notify it; USAGE on the id sequence for reserve_ids' nextval.  The
-- enqueue-notification trigger runs its function as the inserting role, but EXECUTE on
-- a trigger function is checked only at CREATE TRIGGER, and pg_notify needs no
-- privilege: the producer notifies even where EXECUTE was revoked from PUBLIC (tested).
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT INSERT (id, queue, payload, priority, run_at, max_attempts, idempotency_key, task, meta)
    ON {schema}.jobs TO {role};
GRANT SELECT (id, queue, idempotency_key, status, result, last_error, attempts,
              max_attempts)
    ON {schema}.jobs TO {role};
GRANT UPDATE (notify_finish) ON {schema}.jobs TO {role};
GRANT USAGE ON SEQUENCE {schema}.jobs_id_seq TO {role};
-- The enqueue trigger reads which workers wait for a notification (migration 0008),
-- as the inserting role: the queues and the flag, not the workers' names.
GRANT SELECT (queues, waiting) ON {schema}.workers TO {role};

-- name: grant_worker
-- Claim, heartbeat, complete, fail, retry, release, sweep: SELECT on jobs (a claim
-- returns the whole row) and UPDATE on the columns those statements set, nothing else.
-- No INSERT, no DELETE (retention runs as the owner), no TRUNCATE, and no UPDATE of
-- payload, queue, priority or max_attempts: a compromised worker host cannot rewrite
-- the work it hands to the other workers.  SELECT ... FOR UPDATE needs only UPDATE on
-- some column.  On queues: read the settings, and spend rate-limit tokens; pausing and
-- limits are the owner's (an operator's) business.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT ON {schema}.jobs TO {role};
GRANT UPDATE (status, run_at, attempts, worker, lease_token, locked_until, started_at,
              finished_at, last_error, completions, handback_token, result,
              cancel_requested)
    ON {schema}.jobs TO {role};
GRANT SELECT ON {schema}.queues TO {role};
GRANT UPDATE (rate_tokens, rate_refilled_at) ON {schema}.queues TO {role};
-- Each worker records what it serves in `workers` (its own row: insert, refresh, delete).
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.workers TO {role};
