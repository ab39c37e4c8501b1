-- skiplock schema, version 9: `jobs` becomes a partitioned table, so that its garbage
-- goes with a TRUNCATE instead of waiting for a vacuum that a held xmin forbids, and
-- finished jobs are kept, and dropped, a day at a time.
--
-- Why (docs/architecture.md, "Storage, second round"): every transition of a job is an
-- update that leaves a dead version and dead index entries behind.  While a transaction
-- holds back xmin, no vacuum may remove them, and they grew without bound: 201,647 dead
-- tuples at minute 2 and 478,971 at minute 10 of a held xmin at 1,000 jobs/s.
--
-- The shape:
--   * `part` says where a row lives.  Below 1,000,000 it is a *generation*: live jobs
--     (pending, running) and the jobs finished since it was current.  From 1,000,000 on
--     it is a *day* (1,000,000 + days since 1970-01-01, UTC) of finished jobs.
--   * Enqueues go to the current generation (the default of `part` reads the sequence
--     jobs_gen).  The claim, the fenced writes and the sweep update rows in place, in
--     their generation, as before: none of those statements moves a row.
--   * `upkeep()` rotates: once the current generation has taken enough jobs, another
--     one becomes current.  A generation that is no longer current takes no enqueues,
--     so its rows and its garbage stop growing.  upkeep moves its finished jobs to their
--     day, and its delayed jobs (not due for a while) to the current generation, a batch
--     at a time; once it holds no row, it is TRUNCATEd, and its dead tuples and index
--     entries go at once, whatever snapshot is held.  It is then free to be current again.
--   * Retention drops whole days (`drop_finished`), not rows.
--   * Idempotency keys move to `job_keys`: a unique index on a partitioned table must
--     hold the partition key, so (queue, idempotency_key) cannot be unique across
--     partitions there.
--
-- This migration takes the old table as generation 1 as it is (no row is copied or
-- rewritten; running jobs keep their tokens and leases) and makes generation 2 current.
-- It reads the old table twice under its lock: to build the new primary key, (id,
-- part), and to check the partition bound.

LOCK TABLE {schema}.jobs IN ACCESS EXCLUSIVE MODE;

-- Dedup: one row per key, for as long as its job is kept.
CREATE TABLE {schema}.job_keys (
    queue           text   NOT NULL,
    idempotency_key text   NOT NULL,
    job_id          bigint NOT NULL,
    PRIMARY KEY (queue, idempotency_key)
);
INSERT INTO {schema}.job_keys (queue, idempotency_key, job_id)
SELECT queue, idempotency_key, id FROM {schema}.jobs WHERE idempotency_key IS NOT NULL;

-- Ids: a partitioned table cannot have an identity column before PostgreSQL 17, so the
-- ids come from a sequence owned by the column.  It starts past every id handed out.
CREATE SEQUENCE {schema}.jobs_ids AS bigint;
SELECT setval(format('%I.jobs_ids', {schema_name})::regclass, greatest(1, v), v >= 1)
FROM (SELECT greatest(coalesce(pg_sequence_last_value(pg_get_serial_sequence(
                                   format('%I.jobs', {schema_name}), 'id')::regclass), 0),
                      (SELECT coalesce(max(id), 0) FROM {schema}.jobs)) AS v) AS handed_out;
ALTER TABLE {schema}.jobs ALTER COLUMN id DROP IDENTITY;
ALTER SEQUENCE {schema}.jobs_ids RENAME TO jobs_id_seq;

-- The old table becomes generation 1.  A partition cannot carry a trigger with a
-- transition table (the parent's takes its place) nor the old single-column keys.
DROP TRIGGER jobs_notify_enqueued ON {schema}.jobs;
DROP INDEX {schema}.jobs_idempotency_key_idx;
ALTER TABLE {schema}.jobs DROP CONSTRAINT jobs_pkey;
ALTER TABLE {schema}.jobs ADD COLUMN part integer NOT NULL DEFAULT 1;
ALTER TABLE {schema}.jobs ALTER COLUMN part DROP DEFAULT;
ALTER TABLE {schema}.jobs RENAME TO jobs_g1;
ALTER INDEX {schema}.jobs_claimable_idx RENAME TO jobs_g1_claimable_idx;
ALTER INDEX {schema}.jobs_running_leases_idx RENAME TO jobs_g1_running_leases_idx;
ALTER INDEX {schema}.jobs_finished_idx RENAME TO jobs_g1_finished_idx;
ALTER TABLE {schema}.jobs_g1 ADD CONSTRAINT jobs_g1_pkey PRIMARY KEY (id, part);

CREATE TABLE {schema}.jobs (
    id               bigint      NOT NULL,
    queue            text        NOT NULL DEFAULT 'default',
    status           text        NOT NULL DEFAULT 'pending'
                     CONSTRAINT jobs_status_check
                     CHECK (status IN ('pending', 'running', 'done', 'failed', 'cancelled')),
    priority         integer     NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL DEFAULT now(),
    payload          jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    attempts         integer     NOT NULL DEFAULT 0
                     CONSTRAINT jobs_attempts_check CHECK (attempts >= 0),
    max_attempts     integer     NOT NULL DEFAULT 5
                     CONSTRAINT jobs_max_attempts_check CHECK (max_attempts >= 1),
    worker           text,
    lease_token      uuid,
    locked_until     timestamptz,
    started_at       timestamptz,
    finished_at      timestamptz,
    last_error       text,
    idempotency_key  text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completions      integer     NOT NULL DEFAULT 0
                     CONSTRAINT jobs_completions_check CHECK (completions >= 0),
    handback_token   uuid,
    result           jsonb,
    cancel_requested boolean     NOT NULL DEFAULT false,
    notify_finish    boolean     NOT NULL DEFAULT false,
    task             text,
    meta             jsonb,
    part             integer     NOT NULL,
    CONSTRAINT jobs_running_has_lease CHECK (
        status <> 'running'
        OR (worker IS NOT NULL AND lease_token IS NOT NULL AND locked_until IS NOT NULL)
    ),
    -- Unique per partition only in effect: ids come from one sequence, and a job is in
    -- one partition at a time (upkeep moves it in one statement).
    CONSTRAINT jobs_pkey PRIMARY KEY (id, part)
) PARTITION BY LIST (part);
ALTER SEQUENCE {schema}.jobs_id_seq OWNED BY {schema}.jobs.id;

-- The same partial indexes as before, now one per partition; generation 1 keeps its own.
CREATE INDEX jobs_claimable_idx ON {schema}.jobs (queue, priority, run_at, id)
    WHERE status = 'pending';
CREATE INDEX jobs_running_leases_idx ON {schema}.jobs (locked_until)
    WHERE status = 'running' AND locked_until IS NOT NULL;
CREATE INDEX jobs_finished_idx ON {schema}.jobs (finished_at)
    WHERE status IN ('done', 'failed', 'cancelled');

ALTER TABLE {schema}.jobs ATTACH PARTITION {schema}.jobs_g1 FOR VALUES IN (1);

-- A new partition: created apart, its indexes named after it (jobs_g2_claimable_idx,
-- so that a plan reads as before), then attached.  ATTACH takes SHARE UPDATE EXCLUSIVE
-- on jobs, which enqueues and claims do not wait for (CREATE TABLE ... PARTITION OF
-- would take ACCESS EXCLUSIVE), and adopts the indexes instead of building its own.
-- Generations are filled, drained and truncated over and over: they keep room on each
-- page for the updates of their jobs, as the old table did.  Days are written once.
CREATE FUNCTION {schema}.add_partition(rel text, part integer)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    ns text := {schema_name};
BEGIN
    EXECUTE format('CREATE TABLE %I.%I (LIKE %I.jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS)'
                   ' WITH (fillfactor = %s)', ns, rel, ns,
                   CASE WHEN part < 1000000 THEN 80 ELSE 100 END);
    EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I PRIMARY KEY (id, part)',
                   ns, rel, rel || '_pkey');
    EXECUTE format('CREATE INDEX %I ON %I.%I (queue, priority, run_at, id) '
                   'WHERE status = ''pending''', rel || '_claimable_idx', ns, rel);
    EXECUTE format('CREATE INDEX %I ON %I.%I (locked_until) '
                   'WHERE status = ''running'' AND locked_until IS NOT NULL',
                   rel || '_running_leases_idx', ns, rel);
    EXECUTE format('CREATE INDEX %I ON %I.%I (finished_at) '
                   'WHERE status IN (''done'', ''failed'', ''cancelled'')',
                   rel || '_finished_idx', ns, rel);
    EXECUTE format('ALTER TABLE %I.jobs ATTACH PARTITION %I.%I FOR VALUES IN (%s)',
                   ns, ns, rel, part);
END
$fn$;
REVOKE ALL ON FUNCTION {schema}.add_partition(text, integer) FROM PUBLIC;

SELECT {schema}.add_partition('jobs_g2', 2);
SELECT {schema}.add_partition('jobs_g3', 3);

-- The current generation is this sequence's value; setval is not transactional, so
-- upkeep calls it last, once the generation it names exists.
CREATE SEQUENCE {schema}.jobs_gen AS integer MINVALUE 1;
SELECT setval(format('%I.jobs_gen', {schema_name})::regclass, 2);

-- When each generation became current, and the last id handed out then: upkeep rotates
-- once the current one has taken enough ids, or has been current long enough.
CREATE TABLE {schema}.generations (
    part     integer     PRIMARY KEY CHECK (part >= 1 AND part < 1000000),
    since    timestamptz NOT NULL DEFAULT now(),
    first_id bigint      NOT NULL DEFAULT 0  -- -1: added, never current yet
);
INSERT INTO {schema}.generations (part, first_id)
SELECT g, coalesce(pg_sequence_last_value(format('%I.jobs_id_seq', {schema_name})::regclass), 0)
FROM generate_series(1, 3) AS g;

-- Defaults that name a sequence are written with its oid, resolved here once, so that
-- no row pays for a name lookup.
DO $mig$
DECLARE
    parent text := format('%I.jobs', {schema_name});
BEGIN
    EXECUTE format('ALTER TABLE %s ALTER COLUMN id SET DEFAULT nextval(%s::oid::regclass)',
                   parent, format('%I.jobs_id_seq', {schema_name})::regclass::oid);
    EXECUTE format('ALTER TABLE %s ALTER COLUMN part SET DEFAULT '
                   'pg_sequence_last_value(%s::oid::regclass)::integer',
                   parent, format('%I.jobs_gen', {schema_name})::regclass::oid);
END
$mig$;

-- The enqueue notification, now on the parent (it sees the rows of every partition),
-- and only for pending rows: upkeep's moves insert finished rows too.
CREATE OR REPLACE FUNCTION {schema}.notify_enqueued() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs
          WHERE status = 'pending' AND run_at <= now()) AS q
    WHERE EXISTS (SELECT FROM {schema}.workers AS w
                  WHERE w.waiting IS NOT FALSE AND q.queue = ANY (w.queues))
       OR NOT EXISTS (SELECT FROM {schema}.workers);
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify_enqueued
    AFTER INSERT ON {schema}.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_enqueued({channel});

-- The day partition a finished job belongs in.
CREATE FUNCTION {schema}.day_part(finished timestamptz) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN 1000000 + floor(extract(epoch FROM finished) / 86400)::integer;

-- One step of upkeep, in the caller's transaction: rotate, or move a batch out of a
-- generation that is no longer current, or truncate one that is empty.  It returns
-- what it did (no row: nothing to do, or another session is at it), and the caller
-- calls again while there is work, each call its own short transaction.
--
-- SECURITY DEFINER, owned by the schema's owner: the worker role may neither insert
-- nor delete jobs, nor truncate, but every move here keeps every job (a row is deleted
-- only in the statement that inserts it elsewhere) and a truncate happens only to a
-- partition found empty under its ACCESS EXCLUSIVE lock.  Nothing the caller passes
-- can make it drop a job.  lock_timeout: a truncate that would wait behind a long
-- statement gives up and is tried at a later call, rather than holding up every claim
-- queued behind its lock request.
CREATE FUNCTION {schema}.upkeep(rotate_rows bigint, rotate_after float8,
                                rotate_idle float8, batch integer)
RETURNS TABLE (action text, gen integer, jobs bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
AS $fn$
DECLARE
    ns      text := {schema_name};
    cur     integer;
    last_id bigint;
    info    record;
    g       integer;
    nxt     integer;
    d       integer;
    n       bigint;
    ctids   tid[];
    ids     bigint[];
    days    integer[];
    dayrel  text;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtextextended('skiplock.upkeep:' || ns, 0)) THEN
        RETURN;
    END IF;
    cur := pg_sequence_last_value(format('%I.jobs_gen', ns)::regclass)::integer;
    last_id := coalesce(pg_sequence_last_value(format('%I.jobs_id_seq', ns)::regclass), 0);
    SELECT x.since, x.first_id INTO info FROM {schema}.generations AS x WHERE x.part = cur;

    -- Rotate: the current generation took rotate_rows ids and is rotate_after seconds
    -- old, or it took any and is rotate_idle seconds old (so that a quiet queue's
    -- finished jobs still reach their day, and retention).
    IF (last_id > info.first_id AND last_id - info.first_id >= rotate_rows
        AND clock_timestamp() - info.since >= make_interval(secs => rotate_after))
       OR (last_id > info.first_id
           AND clock_timestamp() - info.since >= make_interval(secs => rotate_idle)) THEN
        SELECT x.part INTO nxt
        FROM {schema}.generations AS x
        WHERE x.part <> cur
          AND pg_relation_size(format('%I.%I', ns, 'jobs_g' || x.part)::regclass) = 0
        ORDER BY x.part
        LIMIT 1;
        IF nxt IS NULL THEN
            -- Every other generation still holds jobs (long leases, a backlog): add one,
            -- and rotate to it at the next step.  Not in this transaction: setval is
            -- seen by every enqueue at once, and the new partition only at our commit.
            nxt := (SELECT max(x.part) + 1 FROM {schema}.generations AS x);
            PERFORM {schema}.add_partition('jobs_g' || nxt, nxt);
            -- first_id -1: never current yet (see below).
            INSERT INTO {schema}.generations (part, first_id) VALUES (nxt, -1);
            action := 'added'; gen := nxt; jobs := 0;
            RETURN NEXT;
            RETURN;
        END IF;
        -- A statement that began before the new partition was attached routes rows with
        -- the partitions it saw then; were it still running when the sequence names the
        -- new one, its next row would find no partition.  ATTACH does not wait for such
        -- statements, so the first rotation to a generation does: SHARE waits for every
        -- writer of jobs in flight, and lock_timeout gives up for a later call.
        IF (SELECT x.first_id FROM {schema}.generations AS x WHERE x.part = nxt) < 0 THEN
            BEGIN
                LOCK TABLE {schema}.jobs IN SHARE MODE;
            EXCEPTION WHEN lock_not_available THEN
                action := 'busy'; gen := nxt; jobs := 0;
                RETURN NEXT;
                RETURN;
            END;
        END IF;
        UPDATE {schema}.generations AS x
        SET since = clock_timestamp(), first_id = last_id
        WHERE x.part = nxt;
        PERFORM setval(format('%I.jobs_gen', ns)::regclass, nxt);
        action := 'rotated'; gen := nxt; jobs := last_id - info.first_id;
        RETURN NEXT;
        RETURN;
    END IF;

    FOR g IN SELECT x.part FROM {schema}.generations AS x WHERE x.part <> cur ORDER BY x.part
    LOOP
        CONTINUE WHEN pg_relation_size(format('%I.%I', ns, 'jobs_g' || g)::regclass) = 0;
        -- Finished jobs go to their day; delayed jobs not due within a minute go to the
        -- current generation.  No claim can be taking those: the claim takes only rows
        -- due now.  Jobs due now and running jobs stay, to be claimed and to finish here.
        SELECT array_agg(s.ctid), array_agg(s.id),
               array_agg(DISTINCT {schema}.day_part(s.finished_at))
                   FILTER (WHERE s.status <> 'pending')
        INTO ctids, ids, days
        FROM (SELECT j.ctid, j.id, j.status, j.finished_at
              FROM {schema}.jobs AS j
              WHERE j.part = g
                AND (j.status IN ('done', 'failed', 'cancelled')
                     OR (j.status = 'pending' AND j.run_at > now() + interval '1 minute'))
              LIMIT batch
              FOR UPDATE SKIP LOCKED) AS s;
        FOREACH d IN ARRAY coalesce(days, '{{}}'::integer[])
        LOOP
            dayrel := 'jobs_d' || to_char(date '1970-01-01' + (d - 1000000), 'YYYYMMDD');
            IF to_regclass(format('%I.%I', ns, dayrel)) IS NULL THEN
                PERFORM {schema}.add_partition(dayrel, d);
            END IF;
        END LOOP;
        -- Each picked row, by the version locked above, deleted and inserted in its new
        -- place by one statement: no snapshot sees the job in both places or in neither.
        WITH gone AS (
            DELETE FROM {schema}.jobs AS j
            WHERE j.part = g AND j.ctid = ANY (ctids) AND j.id = ANY (ids)
            RETURNING j.*
        ),
        put AS (
            INSERT INTO {schema}.jobs (id, queue, status, priority, run_at, payload, attempts,
                                       max_attempts, worker, lease_token, locked_until,
                                       started_at, finished_at, last_error, idempotency_key,
                                       created_at, completions, handback_token, result,
                                       cancel_requested, notify_finish, task, meta, part)
            SELECT id, queue, status, priority, run_at, payload, attempts, max_attempts,
                   worker, lease_token, locked_until, started_at, finished_at, last_error,
                   idempotency_key, created_at, completions, handback_token, result,
                   cancel_requested, notify_finish, task, meta,
                   CASE WHEN status = 'pending' THEN cur
                        ELSE {schema}.day_part(finished_at) END
            FROM gone
            RETURNING 1
        )
        SELECT count(*) INTO n FROM put;
        IF n > 0 THEN
            action := 'moved'; gen := g; jobs := n;
            RETURN NEXT;
            RETURN;
        END IF;
        IF NOT EXISTS (SELECT FROM {schema}.jobs AS j WHERE j.part = g) THEN
            BEGIN
                EXECUTE format('LOCK TABLE %I.%I IN ACCESS EXCLUSIVE MODE', ns, 'jobs_g' || g);
                -- Looked at again under the lock: an enqueue that read the old current
                -- generation just before a rotation may have committed a row since.
                IF NOT EXISTS (SELECT FROM {schema}.jobs AS j WHERE j.part = g) THEN
                    EXECUTE format('TRUNCATE %I.%I', ns, 'jobs_g' || g);
                    action := 'truncated'; gen := g; jobs := 0;
                    RETURN NEXT;
                    RETURN;
                END IF;
            EXCEPTION WHEN lock_not_available THEN
                action := 'busy'; gen := g; jobs := 0;
                RETURN NEXT;
                RETURN;
            END;
        END IF;
    END LOOP;
END
$fn$;
REVOKE ALL ON FUNCTION {schema}.upkeep(bigint, float8, float8, integer) FROM PUBLIC;

-- Retention: drop the days whose every job finished more than `older_than` seconds
-- ago, with their idempotency keys (in the same transaction: a key stays taken exactly
-- as long as its job is kept).  Not SECURITY DEFINER: it destroys jobs, so only who
-- may delete them (the owner) runs it.  Dropping a partition takes ACCESS EXCLUSIVE on
-- jobs for a moment; lock_timeout makes it give up rather than stall every claim.
CREATE FUNCTION {schema}.drop_finished(older_than float8)
RETURNS TABLE (day date, jobs bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
AS $fn$
DECLARE
    ns  text := {schema_name};
    p   record;
BEGIN
    FOR p IN
        SELECT c.oid::regclass AS rel, to_date(substr(c.relname, 7), 'YYYYMMDD') AS d
        FROM pg_inherits AS i
        JOIN pg_class AS c ON c.oid = i.inhrelid
        WHERE i.inhparent = format('%I.jobs', ns)::regclass
          AND c.relname ~ '^jobs_d[0-9]{{8}}$'
        ORDER BY 2
    LOOP
        CONTINUE WHEN (p.d + 1)::timestamp AT TIME ZONE 'UTC'
                      > now() - make_interval(secs => older_than);
        EXECUTE format('DELETE FROM %I.job_keys AS k USING %s AS j '
                       'WHERE k.queue = j.queue AND k.idempotency_key = j.idempotency_key '
                       'AND k.job_id = j.id', ns, p.rel);
        EXECUTE format('SELECT count(*) FROM %s', p.rel) INTO jobs;
        EXECUTE format('DROP TABLE %s', p.rel);
        day := p.d;
        RETURN NEXT;
    END LOOP;
END
$fn$;
REVOKE ALL ON FUNCTION {schema}.drop_finished(float8) FROM PUBLIC;

-- Grants the old table had, given to the new one; and to the roles that had them, what
-- they now need besides: a producer (INSERT on jobs) the keys and the generation, a
-- worker (UPDATE of status) upkeep.
DO $mig$
DECLARE
    old    oid := format('%I.jobs_g1', {schema_name})::regclass::oid;
    parent text := format('%I.jobs', {schema_name});
    r      record;
BEGIN
    FOR r IN
        SELECT a.privilege_type AS priv, a.grantee
        FROM pg_class AS c, aclexplode(c.relacl) AS a
        WHERE c.oid = old AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON %s TO %s', r.priv, parent,
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC'
                            ELSE quote_ident(pg_get_userbyid(r.grantee)) END);
    END LOOP;
    FOR r IN
        SELECT att.attname, a.privilege_type AS priv, a.grantee
        FROM pg_attribute AS att, aclexplode(att.attacl) AS a
        WHERE att.attrelid = old AND att.attacl IS NOT NULL AND NOT att.attisdropped
    LOOP
        EXECUTE format('GRANT %s (%I) ON %s TO %s', r.priv, r.attname, parent,
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC'
                            ELSE quote_ident(pg_get_userbyid(r.grantee)) END);
    END LOOP;
    FOR r IN
        SELECT DISTINCT a.grantee
        FROM pg_attribute AS att, aclexplode(att.attacl) AS a
        WHERE att.attrelid = old AND att.attname = 'id' AND a.privilege_type = 'INSERT'
          AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT SELECT, INSERT ON %I.job_keys TO %I', {schema_name},
                       pg_get_userbyid(r.grantee));
        EXECUTE format('GRANT USAGE ON SEQUENCE %I.jobs_id_seq TO %I', {schema_name},
                       pg_get_userbyid(r.grantee));
        EXECUTE format('GRANT SELECT ON SEQUENCE %I.jobs_gen TO %I', {schema_name},
                       pg_get_userbyid(r.grantee));
    END LOOP;
    FOR r IN
        SELECT DISTINCT a.grantee
        FROM pg_attribute AS att, aclexplode(att.attacl) AS a
        WHERE att.attrelid = old AND att.attname = 'status' AND a.privilege_type = 'UPDATE'
          AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %I.upkeep(bigint, float8, float8, integer) '
                       'TO %I', {schema_name}, pg_get_userbyid(r.grantee));
        EXECUTE format('GRANT SELECT ON SEQUENCE %I.jobs_gen TO %I', {schema_name},
                       pg_get_userbyid(r.grantee));
    END LOOP;
END
$mig$;
