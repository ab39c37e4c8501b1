-- The prototype of the five-table storage design (docs/decisions/0001-*.md), for the
-- bench only (python -m skiplock_bench.proto): no migration, no Python API.  {schema} is
-- the prototype's own schema; {part}, where it appears, one partition of a table, and
-- {n} a partition's bound; all filled in through psycopg.sql (Identifier / Literal).
-- Values travel as parameters.

-- name: create_schema
-- The current generation lives in a one-row table, not a sequence: the rotation's
-- advance is then transactional (it commits or it does not, and a reader sees one value
-- for its whole statement), it can be locked (FOR UPDATE) so two rotators take turns,
-- and readers join it like any table.  A sequence's value is not MVCC: a rotator could
-- not read "the current one" and "the next one" consistently, nor undo an advance.  Its
-- price under a held xmin is one dead version per rotation (a few a minute), on one page.
CREATE TABLE {schema}.gen_state (
    one        boolean PRIMARY KEY DEFAULT true CHECK (one),
    current    integer NOT NULL,
    ngens      integer NOT NULL,
    rotated_at timestamptz NOT NULL DEFAULT now()
);
CREATE SEQUENCE {schema}.job_ids;

-- The immutable part of a job: written once at enqueue, read by the claim by key.
CREATE TABLE {schema}.job_data (
    id              bigint NOT NULL DEFAULT nextval('{schema}.job_ids'),
    queue           text NOT NULL DEFAULT 'default',
    task            text,
    payload         jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    meta            jsonb,
    max_attempts    integer NOT NULL DEFAULT 5,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id)
) PARTITION BY RANGE (id);

-- Pending and delayed jobs, insert-only (a claim deletes), one partition a generation.
CREATE TABLE {schema}.ready (
    id             bigint NOT NULL,
    queue          text NOT NULL,
    priority       integer NOT NULL DEFAULT 0,
    run_at         timestamptz NOT NULL DEFAULT now(),
    task           text,
    attempts       integer NOT NULL DEFAULT 0,
    handback_token uuid,
    notify_finish  boolean NOT NULL DEFAULT false,
    gen            integer NOT NULL
) PARTITION BY LIST (gen);

-- Running jobs only; narrow; locked_until in no index, so a heartbeat can be HOT.
-- fillfactor leaves room on each page for the HOT versions of heartbeats.
CREATE TABLE {schema}.leases (
    id               bigint NOT NULL,
    queue            text NOT NULL,
    token            uuid NOT NULL,
    worker           text NOT NULL,
    locked_until     timestamptz NOT NULL,
    started_at       timestamptz NOT NULL,
    attempts         integer NOT NULL,
    cancel_requested boolean NOT NULL DEFAULT false,
    notify_finish    boolean NOT NULL DEFAULT false,
    gen              integer NOT NULL,
    PRIMARY KEY (id, gen)
) PARTITION BY LIST (gen);

-- Finished jobs, insert-only, one partition a day; retention drops partitions.
CREATE TABLE {schema}.history (
    id             bigint NOT NULL,
    queue          text NOT NULL,
    task           text,
    status         text NOT NULL,
    attempts       integer NOT NULL,
    worker         text,
    started_at     timestamptz,
    finished_at    timestamptz NOT NULL,
    result         jsonb,
    last_error     text,
    lease_token    uuid,
    handback_token uuid,
    completions    integer NOT NULL DEFAULT 1
) PARTITION BY RANGE (finished_at);
CREATE INDEX history_id_idx ON {schema}.history (id);
CREATE TABLE {schema}.history_default PARTITION OF {schema}.history DEFAULT;

-- Dedup across partitions: only keyed jobs write here.
CREATE TABLE {schema}.job_keys (
    queue           text NOT NULL,
    idempotency_key text NOT NULL,
    job_id          bigint NOT NULL,
    PRIMARY KEY (queue, idempotency_key)
);

-- name: create_gen
-- One generation: a partition of ready (claim index and key per partition, as the
-- partitioned parent's indexes cannot be unique on id alone) and one of leases.
CREATE TABLE {part} PARTITION OF {schema}.ready FOR VALUES IN ({n});
CREATE INDEX ON {part} (queue, priority, run_at, id);
ALTER TABLE {part} ADD PRIMARY KEY (id);

-- name: create_lease_gen
CREATE TABLE {part} PARTITION OF {schema}.leases FOR VALUES IN ({n})
    WITH (fillfactor = 70);

-- name: create_data_part
CREATE TABLE {part} PARTITION OF {schema}.job_data FOR VALUES FROM ({lo}) TO ({n});

-- name: create_history_day
CREATE TABLE {part} PARTITION OF {schema}.history
    FOR VALUES FROM (date_trunc('day', now()) + make_interval(days => {lo}))
                 TO (date_trunc('day', now()) + make_interval(days => {n}));

-- name: init_gen
INSERT INTO {schema}.gen_state (current, ngens) VALUES (0, %(ngens)s);

-- name: enqueue
-- One statement: the immutable row and the ready row, into the current generation.
WITH d AS (
    INSERT INTO {schema}.job_data (queue, task, payload)
    SELECT %(queue)s, %(task)s, p FROM unnest(%(payloads)s::jsonb[]) AS p
    RETURNING id, queue, task
)
INSERT INTO {schema}.ready (id, queue, task, gen)
SELECT d.id, d.queue, d.task, g.current
FROM d, {schema}.gen_state AS g;

-- name: claim
-- picked locks rows in claim order over every generation and skips rows another
-- claimer holds; taken deletes exactly the versions picked locked (tableoid and ctid: a
-- ctid is unique only in its partition); leased inserts their leases, each with a fresh
-- token, into the current generation.  A version is deleted once: a claimer that
-- skipped it finds it gone after we commit, so claimed sets stay disjoint and a job is
-- in ready or in leases, never both.  taken filters TID scans by the picked pairs: as a
-- join, the generic plan (LIMIT unknown, 2,000 rows guessed) hashed the whole table.
-- Decision 0001; bench/README.md, "Prototype storage".
WITH picked AS MATERIALIZED (
    SELECT tableoid AS part, ctid, id
    FROM {schema}.ready
    WHERE queue = %(queue)s
      AND run_at <= now()
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
taken AS (
    DELETE FROM {schema}.ready AS r
    WHERE r.ctid = ANY (ARRAY(SELECT ctid FROM picked))
      AND (r.tableoid, r.ctid) = ANY (ARRAY(SELECT (part, ctid) FROM picked))
    RETURNING r.id, r.queue, r.attempts, r.notify_finish
),
leased AS (
    INSERT INTO {schema}.leases (id, queue, token, worker, locked_until, started_at,
                                 attempts, notify_finish, gen)
    SELECT t.id, t.queue, gen_random_uuid(), %(worker)s,
           now() + make_interval(secs => %(lease)s), now(), t.attempts + 1,
           t.notify_finish, g.current
    FROM taken AS t, {schema}.gen_state AS g
    RETURNING id, token, attempts
)
SELECT l.id, l.token AS lease_token, l.attempts, d.task, d.payload, d.meta,
       d.max_attempts
FROM leased AS l
CROSS JOIN LATERAL (
    -- by key, one row each: a plain join was planned as a hash join over a sequential
    -- scan of job_data (decision 0001); the LIMIT keeps the subquery from being
    -- flattened, so it is an index probe per claimed row, and run-time pruning reads
    -- one partition
    SELECT j.task, j.payload, j.meta, j.max_attempts
    FROM {schema}.job_data AS j
    WHERE j.id = l.id
    LIMIT 1
) AS d;

-- name: complete
-- Fenced and fused: the lease row with my token goes, and the job's history row comes,
-- in one statement.  A stale token (swept, re-claimed) matches no lease and writes nothing.
WITH done AS (
    DELETE FROM {schema}.leases AS l
    USING unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::text[])
          AS f(id, token, result)
    WHERE l.id = f.id
      AND l.token = f.token
    RETURNING l.id, l.queue, l.token, l.worker, l.started_at, l.attempts,
              l.cancel_requested, f.result
)
INSERT INTO {schema}.history (id, queue, task, status, attempts, worker, started_at,
                              finished_at, result, lease_token)
SELECT d.id, d.queue, j.task,
       CASE WHEN d.cancel_requested THEN 'cancelled' ELSE 'done' END,
       d.attempts, d.worker, d.started_at, now(), d.result::jsonb, d.token
FROM done AS d
JOIN {schema}.job_data AS j ON j.id = d.id
RETURNING id;

-- name: heartbeat
-- Fenced lease extension: HOT, as no index holds locked_until.
UPDATE {schema}.leases AS l
SET locked_until = now() + make_interval(secs => %(lease)s)
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
WHERE l.id = f.id
  AND l.token = f.token
RETURNING l.id, l.token, l.locked_until, l.cancel_requested;

-- name: advance
-- Rotation, step 1: the next generation takes the inserts from now on.  The row lock
-- makes two rotators take turns.
UPDATE {schema}.gen_state
SET current = (current + 1) % ngens, rotated_at = now()
RETURNING current, ngens;

-- name: gen_rows
-- Live rows of one partition (ready or leases): zero means it may be truncated.
SELECT count(*) FROM (SELECT 1 FROM {part} LIMIT %(limit)s) AS x;

-- name: lock_part
-- Rotation, step 2, in one transaction with lock_timeout: lock the partition (this waits
-- for every statement writing or reading it, so the count after it sees all of them),
-- count its rows, and TRUNCATE it only if there are none.
LOCK TABLE {part} IN ACCESS EXCLUSIVE MODE;

-- name: truncate_part
TRUNCATE {part};

-- name: move_ready
-- Rotation, step 3, for a generation that does not empty by itself: its live rows go to
-- the current generation in small batches, each one statement.  Rows a claimer holds
-- are skipped (it is taking them anyway); a claimer that meets a moved row finds it
-- deleted and skips it, and finds the new one in its next claim.
WITH m AS (
    DELETE FROM {part} AS r
    WHERE r.ctid IN (SELECT ctid FROM {part} LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
    RETURNING r.*
)
INSERT INTO {schema}.ready (id, queue, priority, run_at, task, attempts, handback_token,
                            notify_finish, gen)
SELECT m.id, m.queue, m.priority, m.run_at, m.task, m.attempts, m.handback_token,
       m.notify_finish, g.current
FROM m, {schema}.gen_state AS g;

-- name: move_leases
-- The same for leases, tokens kept, so a moved lease still fences.  (A fenced write
-- whose snapshot predates the move finds the old version deleted and matches nothing:
-- the real statements must run again once when they match fewer rows than asked.)
WITH m AS (
    DELETE FROM {part} AS l
    WHERE l.ctid IN (SELECT ctid FROM {part} LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
    RETURNING l.*
)
INSERT INTO {schema}.leases (id, queue, token, worker, locked_until, started_at, attempts,
                             cancel_requested, notify_finish, gen)
SELECT m.id, m.queue, m.token, m.worker, m.locked_until, m.started_at, m.attempts,
       m.cancel_requested, m.notify_finish, g.current
FROM m, {schema}.gen_state AS g;

-- name: check_once
-- The self-check: every enqueued id finished exactly once, nothing left behind.
SELECT (SELECT count(*) FROM {schema}.job_data) AS enqueued,
       (SELECT count(DISTINCT id) FROM {schema}.history) AS finished_ids,
       (SELECT count(*) FROM {schema}.history) AS history_rows,
       (SELECT count(*) FROM (SELECT id FROM {schema}.history GROUP BY id
                              HAVING count(*) > 1) AS x) AS twice,
       (SELECT count(*) FROM {schema}.job_data AS d
        WHERE NOT EXISTS (SELECT FROM {schema}.history AS h WHERE h.id = d.id)) AS never,
       (SELECT count(*) FROM {schema}.ready) AS ready_left,
       (SELECT count(*) FROM {schema}.leases) AS leases_left;
