-- skiplock's named statements, split by _sql.py on their "-- name: <name>" lines.
-- {schema} is a quoted identifier and {channel} the schema's NOTIFY channel as a
-- literal, both filled by psycopg.sql; every value is a bound parameter.
-- The correctness argument lives in `claim`, the fence shared by `complete`, `fail`,
-- `heartbeat` and `release`, and `sweep`.  `jobs` is partitioned: they update rows in
-- place in the generations and say `part < 1000000` only so that no plan includes a
-- day.  Rows move in upkeep() (never one those may take), `requeue` and `retry_jobs`.
-- docs/architecture.md, "The three statements that carry the argument" and "Storage".

-- name: claim
-- The pick, claimable(), locks rows in claim order FOR UPDATE SKIP LOCKED, so
-- concurrent claimers take disjoint sets without waiting.  The UPDATE finds each by the
-- version locked (ctid) and re-checks status on the row itself: the check the
-- postmortem's subquery claim lacked.  The fresh lease_token fences every later write.
-- A paused or limited queue claims nothing here (a limited one says queue_limited: the
-- caller takes `claim_limited`).  from_* (where the worker's last claim ended) and
-- `tasks` change where the scan starts and what it may take, never exactly-once.
-- docs/architecture.md, "The claim: who may take a job"; decisions 0005 and 0015.
WITH cfg AS MATERIALIZED (
    SELECT q.paused OR q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL AS stop,
           q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL AS limited,
           q.store_results
    FROM {schema}.queues AS q
    WHERE q.name = %(queue)s
),
picked AS MATERIALIZED (
    SELECT p.id, p.row_ctid AS ctid, p.part
    FROM {schema}.claimable(%(queue)s,
                            CASE WHEN EXISTS (SELECT FROM cfg WHERE cfg.stop) THEN 0
                                 ELSE %(limit)s::bigint END,
                            %(from_priority)s::integer, %(from_run_at)s::timestamptz,
                            %(from_id)s::bigint, %(tasks)s::text[]) AS p
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
      AND j.part = picked.part  -- a ctid is unique only within its partition
      AND j.part < 1000000
      AND j.status = 'pending'
    RETURNING j.*
)
SELECT claimed.*, coalesce(cfg.limited, false) AS queue_limited,
       coalesce(cfg.store_results, true) AS store_result
FROM claimed FULL JOIN cfg ON true;

-- name: lock_queue
-- The locked path of a limited queue, inside one transaction: this row lock makes the
-- claims of that queue take turns, so the count of running jobs that `claim_limited`
-- reads (a new statement, so a new snapshot at READ COMMITTED) includes every claim
-- committed before ours.  Counting in the claim statement alone would read a snapshot
-- from before the lock wait: the postmortem's race, one level up.
SELECT name FROM {schema}.queues WHERE name = %(queue)s FOR NO KEY UPDATE;

-- name: claim_limited
-- Like `claim` (the same pick), for a queue with a concurrency or rate limit, run after
-- `lock_queue` in the same transaction: the queue row is ours, and this new snapshot
-- counts every earlier claim among the running jobs.  The pick takes at most `allowed`:
-- the limit minus those jobs, and the rate bucket's whole tokens (refilled at
-- rate_limit a second up to rate_burst, default max(rate_limit, 1)), then spends them.
-- Times are statement_timestamp(): now() is from before the wait for the queue row,
-- and the bucket must refill by the time that really passed between turns.
-- docs/control.md, "Limits"; docs/architecture.md, "The claim: who may take a job".
WITH cfg AS MATERIALIZED (
    SELECT q.paused, q.concurrency_limit, q.rate_limit, q.store_results,
           CASE WHEN q.rate_limit IS NULL THEN NULL ELSE
               least(coalesce(q.rate_burst, greatest(q.rate_limit, 1)),
                     q.rate_tokens + q.rate_limit
                         * extract(epoch FROM statement_timestamp() - coalesce(
                               q.rate_refilled_at, statement_timestamp() - interval '1 day')))
           END AS tokens
    FROM {schema}.queues AS q
    WHERE q.name = %(queue)s
),
allowed AS MATERIALIZED (
    SELECT CASE WHEN cfg.paused THEN 0 ELSE greatest(0, least(
               %(limit)s::bigint,
               cfg.concurrency_limit - (SELECT count(*) FROM {schema}.jobs AS r
                                        WHERE r.status = 'running' AND r.queue = %(queue)s
                                          AND r.locked_until IS NOT NULL),
               floor(cfg.tokens)::bigint)) END AS n
    FROM cfg
),
picked AS MATERIALIZED (
    SELECT p.id, p.row_ctid AS ctid, p.part
    FROM {schema}.claimable(%(queue)s, (SELECT coalesce(max(n), 0) FROM allowed),
                            NULL, NULL, NULL, %(tasks)s::text[]) AS p
),
claimed AS (
    UPDATE {schema}.jobs AS j
    SET status       = 'running',
        worker       = %(worker)s,
        started_at   = statement_timestamp(),
        finished_at  = NULL,
        locked_until = statement_timestamp() + make_interval(secs => %(lease)s),
        attempts     = j.attempts + 1,
        lease_token  = gen_random_uuid()
    FROM picked
    WHERE j.ctid = picked.ctid  -- the version locked above: a TID scan
      AND j.id = picked.id
      AND j.part = picked.part  -- a ctid is unique only within its partition
      AND j.part < 1000000
      AND j.status = 'pending'
    RETURNING j.*
),
spent AS (
    UPDATE {schema}.queues AS q
    SET rate_tokens      = cfg.tokens - (SELECT count(*) FROM claimed),
        rate_refilled_at = statement_timestamp()
    FROM cfg
    WHERE q.name = %(queue)s
      AND cfg.tokens IS NOT NULL
)
SELECT claimed.*, true AS queue_limited, cfg.store_results AS store_result
FROM claimed, cfg;

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
FROM {schema}.fence_results(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::text[])
     AS f(id, token, result)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
  AND j.part < 1000000  -- running jobs are in generations only
RETURNING j.id, j.lease_token, j.status,
          CASE WHEN j.notify_finish THEN pg_notify({channel}, 'finished:' || j.id) END
              AS notified;

-- name: fail
-- Fenced like `complete`.  While attempts remain and a retry is wanted, the job goes
-- back to pending at now() + delay; otherwise it ends failed (cancelled, if a cancel
-- was asked).  The attempt counter on the row decides, not the caller's copy of it.
WITH handed AS (
    UPDATE {schema}.jobs AS j
    SET status       = CASE WHEN j.cancel_requested THEN 'cancelled'
                            WHEN f.retry AND j.attempts < j.max_attempts THEN 'pending'
                            ELSE 'failed' END,
        run_at       = CASE WHEN f.retry AND j.attempts < j.max_attempts
                                 AND NOT j.cancel_requested
                            THEN now() + make_interval(secs => f.delay) ELSE j.run_at END,
        finished_at  = CASE WHEN f.retry AND j.attempts < j.max_attempts
                                 AND NOT j.cancel_requested
                            THEN NULL ELSE now() END,
        locked_until = NULL,
        last_error   = coalesce(f.error, j.last_error),
        handback_token = f.token  -- proof for a retry after a lost reply (fence_outcome)
    FROM {schema}.fence_errors(%(ids)s::bigint[], %(tokens)s::uuid[], %(errors)s::text[],
                               %(delays)s::float8[], %(retries)s::bool[])
         AS f(id, token, error, delay, retry)
    WHERE j.id = f.id
      AND j.lease_token = f.token
      AND j.status = 'running'
      AND j.part < 1000000  -- running jobs are in generations only
    RETURNING j.id, j.lease_token, j.status, j.notify_finish
)
SELECT id, lease_token, status,
       CASE WHEN notify_finish AND status <> 'pending'
            THEN pg_notify({channel}, 'finished:' || id) END AS notified
FROM handed;

-- name: heartbeat
-- Fenced lease extension.  Row locks taken here make a concurrent sweep skip the row.
-- It also carries a cancel asked since the last beat back to the worker.
UPDATE {schema}.jobs AS j
SET locked_until = now() + make_interval(secs => %(lease)s)
FROM {schema}.fence_tokens(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
  AND j.part < 1000000  -- running jobs are in generations only
RETURNING j.id, j.lease_token, j.locked_until, j.cancel_requested;

-- name: release
-- Fenced hand-back of a claimed job that never started: pending again at once (or
-- cancelled, if that was asked), and the attempt the claim counted is given back.
UPDATE {schema}.jobs AS j
SET status       = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'pending' END,
    finished_at  = CASE WHEN j.cancel_requested THEN now() END,
    attempts     = greatest(j.attempts - 1, 0),
    worker       = NULL,
    started_at   = NULL,
    locked_until = NULL,
    handback_token = f.token  -- proof for a retry after a lost reply (fence_outcome)
FROM {schema}.fence_tokens(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
  AND j.part < 1000000  -- running jobs are in generations only
RETURNING j.id, j.lease_token;

-- name: fence_outcome
-- After a dropped connection the caller cannot know whether its fenced write committed.
-- Tokens are kept on the row after the write, so "my token, in the state I asked for"
-- proves it did, and a retried write that matches nothing is not a lost lease.  A
-- hand-back also leaves its token in handback_token, which a re-claim does not touch.
SELECT j.id, f.token AS lease_token, j.status, (j.lease_token = f.token) AS current_lease
FROM {schema}.jobs AS j
JOIN {schema}.fence_tokens(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
  ON j.id = f.id AND (j.lease_token = f.token OR j.handback_token = f.token);

-- name: sweep
-- Leases that ran out go back to pending in their old place (run_at kept): the attempt
-- counts, a job out of attempts ends failed, one with a cancel asked cancelled.  The
-- UPDATE re-checks status and locked_until on the row it locked, and a heartbeat locks
-- the same row, so a lease extended meanwhile is not swept; SKIP LOCKED lets every
-- worker sweep at once with no leader.  Clearing the status kills the old lease token:
-- the fence needs status = 'running'.  `window` (NULL: all the way) looks back only
-- to a little before the worker's previous sweep (decision 0015, _cursor.SweepCursor).
-- docs/architecture.md, "The sweep: when a taken job is given back".
WITH expired AS MATERIALIZED (
    SELECT id, ctid, part
    FROM {schema}.jobs
    WHERE status = 'running'
      AND part < 1000000
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
  AND j.part = expired.part
  AND j.part < 1000000
  AND j.status = 'running'
  AND j.locked_until < now()
RETURNING j.id, j.status;

-- name: enqueue_keyed
-- Jobs of which some or all have an idempotency key (a batch may mix them): the key's
-- row in job_keys decides (migration 0009: a unique index on the partitioned jobs could
-- not span its partitions), and `enqueue_keyed` (migration 0017) what a held key gets.
-- Ids are reserved by the caller, so a retry after a lost reply can tell its own rows;
-- `spare` reserves the id of a next single enqueue, as `enqueue_one` does.
SELECT k.n, k.job_id AS id, k.outcome,
       CASE WHEN %(spare)s::boolean THEN nextval(pg_get_serial_sequence(format('%%I.jobs', %(schema)s::text), 'id')) END
           AS spare
FROM {schema}.enqueue_keyed(%(ids)s::bigint[], %(queue)s::text, %(payloads)s::text[],
                            %(keys)s::text[], %(priority)s::integer, %(run_at)s::timestamptz,
                            %(max_attempts)s::integer, %(task)s::text, %(meta)s::text,
                            %(unique_for)s::float8, %(on_conflict)s::text, %(retry)s::boolean) AS k;

-- name: enqueue_plain
-- Without a key, in the caller's transaction (nothing is retried, so no id is reserved).
-- The columns of migration 0007's jobs: a producer running this code can enqueue into a
-- schema that a rolling deploy has not migrated further yet.
INSERT INTO {schema}.jobs (queue, payload, priority, run_at, max_attempts, task, meta)
VALUES (%(queue)s, %(payload)s::jsonb, %(priority)s, coalesce(%(run_at)s::timestamptz, now()),
        %(max_attempts)s, %(task)s, %(meta)s::jsonb)
RETURNING id;

-- name: enqueue_plain_limited
-- enqueue_plain for a job with a concurrency key (migration 0018: inserted pending, the
-- jobs_key_hold trigger makes it wait for its key's slot) or a rate limit (migration
-- 0020: the jobs_rate_slot trigger takes its key's next slot and sets its run_at).
INSERT INTO {schema}.jobs (queue, payload, priority, run_at, max_attempts, task, meta,
                           concurrency_key, concurrency, rate_key, rate_every)
VALUES (%(queue)s, %(payload)s::jsonb, %(priority)s, coalesce(%(run_at)s::timestamptz, now()),
        %(max_attempts)s, %(task)s, %(meta)s::jsonb, %(concurrency_key)s,
        %(concurrency)s::integer, %(rate_key)s, %(rate_every)s::float8)
RETURNING id;

-- name: enqueue_graph
-- Jobs and the edges between them (`after`), in one statement: the function of
-- migration 0016, whose header argues why each child is released exactly once.
SELECT {schema}.enqueue_graph(%(ids)s::bigint[], %(queues)s::text[], %(payloads)s::text[],
                              %(priorities)s::integer[], %(run_ats)s::timestamptz[],
                              %(max_attempts)s::integer[], %(tasks)s::text[],
                              %(metas)s::text[], %(parents)s::bigint[],
                              %(children)s::bigint[], %(positions)s::integer[],
                              %(cancels)s::boolean[], %(workflow)s::text, {channel}) AS n;

-- name: parents
-- A job's parents (its `after`, in the order named) with their outcome.  LEFT JOIN: a
-- parent dropped by retention still has its place, with no row.
SELECT d.parent AS id, p.status, p.result, p.last_error
FROM {schema}.job_deps AS d
LEFT JOIN {schema}.jobs AS p ON p.id = d.parent
WHERE d.child = %(id)s
ORDER BY d.pos;

-- name: workflow
-- A canvas's output and its steps, in the order written, with their state (NULL
-- columns: a step dropped by retention).
SELECT w.id AS workflow, w.output, w.created_at, s.id, j.task, j.status, j.attempts,
       j.max_attempts, j.last_error
FROM {schema}.workflows AS w
CROSS JOIN LATERAL unnest(w.steps) WITH ORDINALITY AS s(id, n)
LEFT JOIN {schema}.jobs AS j ON j.id = s.id
WHERE w.id = %(id)s
ORDER BY s.n;

-- name: reserve_ids
-- Ids for a COPY are taken from the identity sequence first, so enqueue_many can
-- return them without a RETURNING (which COPY does not have).
SELECT nextval(pg_get_serial_sequence(format('%%I.jobs', %(schema)s::text), 'id'))
FROM generate_series(1, %(n)s);

-- name: enqueue_one
-- An unkeyed enqueue under an id reserved beforehand (so a retry after a lost reply can
-- look for it), which also reserves the id of the next one: the reservation costs no
-- round trip of its own after a queue's first enqueue.  Migration 0007's columns, as
-- enqueue_plain.
INSERT INTO {schema}.jobs (id, queue, payload, priority, run_at, max_attempts, task, meta)
VALUES (%(id)s, %(queue)s, %(payload)s::jsonb, %(priority)s,
        coalesce(%(run_at)s::timestamptz, now()), %(max_attempts)s, %(task)s, %(meta)s::jsonb)
RETURNING id, nextval(pg_get_serial_sequence(format('%%I.jobs', %(schema)s::text), 'id')) AS spare;

-- name: enqueue_one_limited
-- enqueue_one for a job with a concurrency key or a rate limit (see enqueue_plain_limited).
INSERT INTO {schema}.jobs (id, queue, payload, priority, run_at, max_attempts, task, meta,
                           concurrency_key, concurrency, rate_key, rate_every)
VALUES (%(id)s, %(queue)s, %(payload)s::jsonb, %(priority)s,
        coalesce(%(run_at)s::timestamptz, now()), %(max_attempts)s, %(task)s, %(meta)s::jsonb,
        %(concurrency_key)s, %(concurrency)s::integer, %(rate_key)s, %(rate_every)s::float8)
RETURNING id, nextval(pg_get_serial_sequence(format('%%I.jobs', %(schema)s::text), 'id')) AS spare;

-- name: enqueued_ids
-- After a lost reply: which of the reserved ids hold rows now (the rows of one statement
-- commit together).  Only id and queue: a producer role may not read payloads.
SELECT id FROM {schema}.jobs WHERE id = ANY(%(ids)s::bigint[]) AND queue = %(queue)s;

-- name: copy_jobs
COPY {schema}.jobs (id, queue, payload, priority, max_attempts, task, meta)
FROM STDIN;

-- name: copy_jobs_at
COPY {schema}.jobs (id, queue, payload, priority, max_attempts, task, meta, run_at)
FROM STDIN;

-- name: copy_jobs_concurrency
-- enqueue_many's COPY for jobs with concurrency keys (migration 0018): the plain COPYs
-- above stay as they were for jobs without.
COPY {schema}.jobs (id, queue, payload, priority, max_attempts, task, meta, concurrency_key,
                    concurrency)
FROM STDIN;

-- name: copy_jobs_concurrency_at
COPY {schema}.jobs (id, queue, payload, priority, max_attempts, task, meta, concurrency_key,
                    concurrency, run_at)
FROM STDIN;

-- name: copy_jobs_rate
-- enqueue_many's COPY for rate-limited jobs (migration 0020): each row takes its key's
-- next slot in the jobs_rate_slot trigger, in row order, within this one statement.
COPY {schema}.jobs (id, queue, payload, priority, max_attempts, task, meta, concurrency_key,
                    concurrency, rate_key, rate_every)
FROM STDIN;

-- name: copy_jobs_rate_at
COPY {schema}.jobs (id, queue, payload, priority, max_attempts, task, meta, concurrency_key,
                    concurrency, rate_key, rate_every, run_at)
FROM STDIN;

-- name: get
SELECT * FROM {schema}.jobs WHERE id = %(id)s;

-- name: cancel
-- A pending job ends cancelled at once, and so does a waiting one (migration 0016; its
-- waiting descendants with it, through the settle trigger).  A running job is asked to stop: its worker
-- sees the request at its next heartbeat (sooner: the NOTIFY below wakes it to beat
-- at once), and its fenced write then ends the job cancelled, never done.  A job
-- waiting for a slot of its concurrency key (throttled, migration 0018) ends at once too.
WITH asked AS (
    UPDATE {schema}.jobs
    SET status           = CASE WHEN status = 'running' THEN status ELSE 'cancelled' END,
        finished_at      = CASE WHEN status = 'running' THEN finished_at ELSE now() END,
        cancel_requested = true
    WHERE id = %(id)s
      AND status IN ('pending', 'running', 'waiting', 'throttled')
      AND part < 1000000
    RETURNING id, status, notify_finish
)
SELECT id, status,
       CASE WHEN status = 'running' THEN pg_notify({channel}, 'cancel:' || id)
            WHEN notify_finish THEN pg_notify({channel}, 'finished:' || id) END AS notified
FROM asked;

-- name: prune
-- Retention drops whole days of finished jobs (migration 0009, `drop_finished`), with
-- their idempotency keys: no row DELETE, nothing left for a vacuum.  A day goes once
-- its last job is older than `older_than`; jobs finished since their generation last
-- rotated are still in it and go with their day later.
SELECT coalesce(sum(jobs), 0)::bigint AS n FROM {schema}.drop_finished(%(older_than)s);

-- name: status
-- extract() returns numeric (a Decimal in Python, a string in JSON): float8 is a number
-- in both.
SELECT queue,
       status,
       count(*) AS jobs,
       extract(epoch FROM now() - min(run_at) FILTER (WHERE status = 'pending' AND run_at <= now()))::float8
           AS oldest_pending_seconds,
       count(*) FILTER (WHERE status = 'running' AND locked_until < now()) AS expired_leases,
       count(*) FILTER (WHERE attempts >= %(attempts_alert)s) AS high_attempts
FROM {schema}.jobs
GROUP BY queue, status
ORDER BY queue, status;

-- name: job_state
SELECT id, queue, status, result, last_error, attempts, max_attempts
FROM {schema}.jobs
WHERE id = %(id)s;

-- name: watch
-- `wait` registers itself on the row before it waits, so the final write notifies.
-- The row lock orders this against the worker's write: whichever commits second sees
-- the other's change, so a finish is never missed.
UPDATE {schema}.jobs
SET notify_finish = true
WHERE id = %(id)s
RETURNING id, queue, status, result, last_error, attempts, max_attempts;

-- name: configure_queue
-- Settings of a queue.  A queue that does not exist yet (no settings, no jobs: the rule
-- of set_paused) is created only when `create` is true; otherwise no row is returned and
-- the caller reports a likely typo.  A NULL argument leaves that setting as it is;
-- `clear_*` removes a limit.  A new bucket starts full (rate_burst tokens).
INSERT INTO {schema}.queues AS q (name, concurrency_limit, rate_limit, rate_burst,
                                  store_results)
SELECT %(queue)s, %(concurrency)s::integer, %(rate)s::float8, %(burst)s::float8,
       coalesce(%(store_results)s::boolean, true)
WHERE %(create)s::boolean
   OR EXISTS (SELECT 1 FROM {schema}.queues WHERE name = %(queue)s)
   OR EXISTS (SELECT 1 FROM {schema}.jobs WHERE queue = %(queue)s)
ON CONFLICT (name) DO UPDATE
SET concurrency_limit = CASE WHEN %(clear_concurrency)s THEN NULL
                             ELSE coalesce(excluded.concurrency_limit, q.concurrency_limit) END,
    rate_limit        = CASE WHEN %(clear_rate)s THEN NULL
                             ELSE coalesce(excluded.rate_limit, q.rate_limit) END,
    rate_burst        = CASE WHEN %(clear_rate)s THEN NULL
                             ELSE coalesce(excluded.rate_burst, q.rate_burst) END,
    store_results     = coalesce(%(store_results)s, q.store_results),
    updated_at        = now()
RETURNING name, paused, concurrency_limit, rate_limit, rate_burst, store_results;

-- name: set_paused
-- Pause or resume a queue that exists: one with settings or with jobs.  An unknown
-- name returns no row (a typo is reported, not silently paused).
INSERT INTO {schema}.queues AS q (name, paused)
SELECT %(queue)s, %(paused)s
WHERE EXISTS (SELECT 1 FROM {schema}.queues WHERE name = %(queue)s)
   OR EXISTS (SELECT 1 FROM {schema}.jobs WHERE queue = %(queue)s)
ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, updated_at = now()
RETURNING name, paused;

-- name: queue_settings
SELECT name, paused, concurrency_limit, rate_limit, rate_burst, store_results, updated_at
FROM {schema}.queues
ORDER BY name;

-- name: list_jobs
-- Newest first, a page at a time (keyset on id: no OFFSET scan); NULL filters match all.
SELECT id, queue, status, priority, attempts, max_attempts, worker, run_at, created_at,
       started_at, finished_at, locked_until, cancel_requested,
       left(last_error, 200) AS last_error_head
FROM {schema}.jobs
WHERE (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(before)s::bigint IS NULL OR id < %(before)s)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: requeue
-- An operator's retry of a finished job: pending again at once with fresh attempts.
-- Not for a running job (its lease holder would be overridden: cancel it first).  The
-- completion counter is kept, so `verify` still sees a job that was done more than once.
-- The job moves to the current generation (its day holds finished jobs only).  A job
-- with a concurrency key waits for a slot again (throttled: migration 0018's triggers
-- admit it at once if its key has one free).
UPDATE {schema}.jobs
SET status = CASE WHEN concurrency_key IS NULL THEN 'pending' ELSE 'throttled' END,
    run_at = now(), attempts = 0, finished_at = NULL,
    started_at = NULL, worker = NULL, locked_until = NULL, cancel_requested = false,
    result = NULL,
    part = pg_sequence_last_value(format('%%I.jobs_gen', %(schema)s::text)::regclass)::integer
WHERE id = %(id)s
  AND status IN ('done', 'failed', 'cancelled')
RETURNING id, status;

-- name: find_jobs
-- An operator's search (`skiplock jobs`, `Queue.find_jobs`, the dashboard): newest
-- first, a page at a time (keyset on id).  NULL filters match all.  `since` is compared
-- with a finished job's finished_at and an unfinished one's created_at.  The error
-- filter is a case-insensitive substring (strpos: no LIKE wildcards to escape).
SELECT id, queue, task, status, priority, attempts, max_attempts, worker, run_at,
       created_at, started_at, finished_at, cancel_requested, last_error
FROM {schema}.jobs
WHERE (%(statuses)s::text[] IS NULL OR status = ANY (%(statuses)s::text[]))
  AND (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(task)s::text IS NULL OR task = %(task)s)
  AND (%(since)s::timestamptz IS NULL OR coalesce(finished_at, created_at) >= %(since)s)
  AND (%(error)s::text IS NULL OR strpos(lower(last_error), lower(%(error)s)) > 0)
  AND (%(before)s::bigint IS NULL OR id < %(before)s)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: failed_ids
-- `retry --failed`: the ids of the failed jobs matching the filters, read once, in one
-- scan (no index keeps failed jobs apart from done ones: batches by keyset walked every
-- done job first; bench/README.md, "Finding and retrying failed jobs").
-- `since` is compared with finished_at (when the job failed).
SELECT id
FROM {schema}.jobs
WHERE status = 'failed'
  AND (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(task)s::text IS NULL OR task = %(task)s)
  AND (%(since)s::timestamptz IS NULL OR finished_at >= %(since)s)
ORDER BY id;

-- name: retry_jobs
-- An operator's retry of failed or cancelled jobs, by id: the same row pending again
-- (throttled with a concurrency key, as `requeue`), due now, attempts 0, last_error
-- kept, in the current generation, which claims read.  Exactly once: the UPDATE
-- re-checks the status on the row it locks, and claims see the new version only after
-- commit, when SKIP LOCKED gives it to one; a racing retry finds the job no longer
-- failed, or moved to another partition (a serialization error the caller runs again).
-- An id not retried returns the status this snapshot saw (NULL: none; failed: moved
-- meanwhile, asked again).  docs/control.md, "Failed jobs: find them, run them again".
WITH retried AS (
    UPDATE {schema}.jobs AS j
    SET status = CASE WHEN j.concurrency_key IS NULL THEN 'pending' ELSE 'throttled' END,
        run_at = now(), attempts = 0, finished_at = NULL,
        started_at = NULL, worker = NULL, locked_until = NULL, cancel_requested = false,
        result = NULL,
        part = pg_sequence_last_value(format('%%I.jobs_gen', %(schema)s::text)::regclass)::integer
    WHERE j.id = ANY (%(ids)s::bigint[])  -- each partition's key, not a join: a join
      AND j.status IN ('failed', 'cancelled')  -- was a hash over every row (0015)
    RETURNING j.id
),
seen AS (
    SELECT id, status FROM {schema}.jobs WHERE id = ANY (%(ids)s::bigint[])
)
SELECT a.id, r.id IS NOT NULL AS retried, CASE WHEN r.id IS NULL THEN s.status END AS status
FROM unnest(%(ids)s::bigint[]) AS a(id)  -- distinct ids, sent sorted
LEFT JOIN retried AS r ON r.id = a.id
LEFT JOIN seen AS s ON s.id = a.id
ORDER BY a.id;

-- name: delete_job
-- Delete a job that is not running (a running one has a lease holder: cancel first).
-- Its idempotency key goes with it, as with retention.
WITH gone AS (
    DELETE FROM {schema}.jobs
    WHERE id = %(id)s
      AND status <> 'running'
    RETURNING id, status, queue, idempotency_key
),
keys AS (
    DELETE FROM {schema}.job_keys AS k
    USING gone
    WHERE k.queue = gone.queue AND k.idempotency_key = gone.idempotency_key
      AND k.job_id = gone.id
)
SELECT id, status FROM gone;

-- name: throughput
-- Jobs finished per bucket of `bucket` seconds over the last `window` seconds, per queue
-- and final status: the dashboard's chart.  Reads jobs_finished_idx.
SELECT queue, status,
       to_timestamp(floor(extract(epoch FROM finished_at) / %(bucket)s) * %(bucket)s) AS at,
       count(*) AS jobs
FROM {schema}.jobs
WHERE status IN ('done', 'failed', 'cancelled')
  AND finished_at >= now() - make_interval(secs => %(window)s)
GROUP BY 1, 2, 3
ORDER BY 3, 1, 2;

-- name: worker_seen
-- A worker records the queues and tasks it serves (tasks NULL: every job of its
-- queues), at start and at each sweep.  Rows of workers gone for a day are removed by
-- whichever worker comes by: a crashed worker never deletes its own.
WITH gone AS (
    DELETE FROM {schema}.workers WHERE seen_at < now() - interval '1 day'
)
INSERT INTO {schema}.workers AS w (name, queues, tasks)
VALUES (%(name)s, %(queues)s::text[], %(tasks)s::text[])
ON CONFLICT (name) DO UPDATE
SET queues = excluded.queues, tasks = excluded.tasks, seen_at = now();

-- name: worker_waiting
-- Whether this worker sleeps until an enqueue notifies it (true) or claims back to back
-- (false): the enqueue trigger notifies a queue only if some worker of it is not false
-- (migration 0008).  Written only when it changes; NULL until the worker first says.
UPDATE {schema}.workers
SET waiting = %(waiting)s
WHERE name = %(name)s AND waiting IS DISTINCT FROM %(waiting)s;

-- name: worker_gone
DELETE FROM {schema}.workers WHERE name = %(name)s;

-- name: worker_mark
-- Run on the worker's liveness connection, once per (re)connect: take the session-level
-- advisory lock that marks the worker alive, and record which backend holds it.  The
-- lock is released by PostgreSQL itself when the session ends, however the worker
-- died.  pg_try_: a second worker of the same name (or a hash collision) gets no mark
-- and falls back to the lease.  The CTE is MATERIALIZED so the lock is taken once.
WITH lock AS MATERIALIZED (
    SELECT pg_try_advisory_lock(%(key1)s, %(key2)s) AS ok
)
INSERT INTO {schema}.workers AS w (name, queues, tasks, mark_pid, mark_key1, mark_key2)
SELECT %(name)s, %(queues)s::text[], %(tasks)s::text[],
       CASE WHEN lock.ok THEN pg_backend_pid() END, %(key1)s, %(key2)s
FROM lock
ON CONFLICT (name) DO UPDATE
SET queues = excluded.queues, tasks = excluded.tasks, seen_at = now(),
    mark_pid = excluded.mark_pid, mark_key1 = excluded.mark_key1,
    mark_key2 = excluded.mark_key2, mark_lost_at = NULL
RETURNING w.mark_pid IS NOT NULL AS marked;

-- name: sweep_dead
-- Crash detection, faster than the lease.  A worker whose liveness mark (worker_mark's
-- advisory lock, found in pg_locks by pid and key) is gone, with no session of it left,
-- lost its process, host or connection.  The first sweep to see it notes mark_lost_at;
-- one `grace` seconds later gives its running jobs back as `sweep` does (sub-statements
-- share one snapshot: the jobs part acts on marks lost at an earlier sweep).  A worker
-- that reconnects in time marks again; a stopped one keeps its session, and only its
-- lease can expire.  The fence is untouched: a robbed live worker gets LeaseLost.  SKIP
-- LOCKED and `limit` as in `sweep`.  Decision 0016; docs/architecture.md, "Liveness".
WITH marks AS MATERIALIZED (
    SELECT w.name, w.mark_lost_at,
           EXISTS (SELECT FROM pg_locks AS l
                   WHERE l.locktype = 'advisory' AND l.pid = w.mark_pid
                     AND l.classid = w.mark_key1::oid AND l.objid = w.mark_key2::oid
                     AND l.objsubid = 2 AND l.granted)
           -- A process that died took all its sessions with it.  A live worker whose
           -- mark's connection alone was cut (an operator's pg_terminate_backend, a
           -- server too full to reconnect) still has its other sessions, named after
           -- it, and keeps its jobs until its lease says otherwise.
           OR EXISTS (SELECT FROM pg_stat_activity AS a
                      WHERE a.application_name = left('skiplock-worker:' || w.name, 63))
               AS alive
    FROM {schema}.workers AS w
    WHERE w.mark_pid IS NOT NULL
),
noted AS (
    UPDATE {schema}.workers AS w
    SET mark_lost_at = CASE WHEN m.alive THEN NULL ELSE now() END
    FROM marks AS m
    WHERE w.name = m.name AND m.alive = (m.mark_lost_at IS NOT NULL)
),
dead AS MATERIALIZED (
    SELECT name FROM marks
    WHERE NOT alive AND mark_lost_at < now() - make_interval(secs => %(grace)s)
),
gone AS (
    -- Its jobs are handed back below; the row goes, so later sweeps do not look for
    -- them again (a worker that was alive after all registers anew when it reconnects).
    DELETE FROM {schema}.workers WHERE name IN (SELECT name FROM dead)
),
expired AS MATERIALIZED (
    SELECT id, ctid, part
    FROM {schema}.jobs
    WHERE status = 'running'
      AND part < 1000000
      AND locked_until IS NOT NULL
      AND worker IN (SELECT name FROM dead)
      AND EXISTS (SELECT FROM dead)
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
    last_error   = 'worker ' || coalesce(j.worker, '?') || ' lost its session during attempt '
                   || j.attempts || ' of ' || j.max_attempts
FROM expired
WHERE j.ctid = expired.ctid  -- the version locked above: a TID scan
  AND j.id = expired.id
  AND j.part = expired.part
  AND j.part < 1000000
  AND j.status = 'running'
RETURNING j.id, j.status;

-- name: unserved
-- Due pending jobs whose task no live worker serves (a worker is live if it refreshed
-- its row within `alive` seconds): during a rolling deploy, the jobs of a new task
-- waiting for a worker that knows it.  They are not lost and not charged attempts, but
-- an operator must see them: `skiplock status` and the dashboard list them.
SELECT j.queue, j.task, count(*) AS jobs,
       extract(epoch FROM now() - min(j.run_at))::float8 AS oldest_seconds
FROM {schema}.jobs AS j
WHERE j.status = 'pending'
  AND j.task IS NOT NULL
  AND j.run_at <= now()
  AND NOT EXISTS (SELECT FROM {schema}.workers AS w
                  WHERE w.seen_at > now() - make_interval(secs => %(alive)s)
                    AND j.queue = ANY(w.queues)
                    AND (w.tasks IS NULL OR j.task = ANY(w.tasks)))
GROUP BY j.queue, j.task
ORDER BY j.queue, j.task;

-- name: upkeep
-- One step of the generations' upkeep (migration 0009; its rules since, 0013 and 0014):
-- see `upkeep()` in the newest of them.
SELECT action, gen, jobs
FROM {schema}.upkeep(%(rotate_rows)s, %(rotate_after)s, %(rotate_idle)s, %(batch)s);

-- name: server_identity
-- Which database a connection is on, for an app whose queues live on several clusters
-- (docs/scaling.md): the cluster's identifier, fixed at initdb and kept by a streaming
-- standby promoted in its place, and the database's name within it.
SELECT system_identifier::text AS cluster, current_database() AS database
FROM pg_control_system();
