-- skiplock schema, version 18: per-key concurrency (issue 39, item 3).  A job enqueued
-- with a concurrency key and a limit N runs only while fewer than N jobs of that key
-- are admitted (pending or running), across every worker and queue.
--
-- Admission, not a check in the claim.  A keyed job is inserted `throttled`, a status
-- the claim never reads (claimable() and its partial index take status = 'pending'
-- only), and is admitted (made pending) while its key has a free slot.  The claim
-- statement is not changed at all, so a job without a key pays nothing on it; on its
-- writes it pays the WHEN clauses below, which are false for it without calling any
-- function.  Fairness across keys follows: each key has at most N claimable jobs at a
-- time, so one key's backlog of throttled jobs is never in front of another key's job.
--
-- The rule: a key's admitted jobs are its pending and running jobs, counted (through
-- jobs_key_admitted_idx) under the lock of the key's row in concurrency_keys, every
-- time something may have freed a slot or added a waiter.  No counter is kept: a count
-- cannot drift, and re-running the admission is harmless, so a trigger that fires
-- twice for one job (a cross-partition move fires DELETE and INSERT triggers, not
-- UPDATE ones) never releases a slot twice.  The key's row is updated (not merely
-- locked) by every admission, so that two admissions of one key take turns and, under
-- REPEATABLE READ, the second fails with a serialization error instead of counting
-- from a snapshot that misses the first.
--
-- A slot is held from admission until the job ends (done, failed, cancelled) or is
-- deleted; the release happens in the same transaction as the fenced write that ends
-- the job.  A retry (with or without a delay), a sweep that gives the job back and a
-- hand-back (release) keep it pending or running, so they keep the slot: the job is
-- still the key's turn, and a later job of the key does not overtake it.  Admission
-- takes a key's throttled jobs in (priority, id) order, enqueue order within a
-- priority, and moves a past run_at to the admission time (see key_admit); a job
-- admitted before its run_at holds its slot until it runs.

ALTER TABLE {schema}.jobs ADD COLUMN concurrency_key text, ADD COLUMN concurrency integer;

-- A new status.  The constraint is rebuilt from its current definition with
-- 'throttled' added, so that another migration's status (applied before this one)
-- is kept.
DO $mig$
DECLARE
    def text;
BEGIN
    SELECT pg_get_constraintdef(c.oid) INTO def
    FROM pg_constraint AS c
    WHERE c.conrelid = format('%I.jobs', {schema_name})::regclass
      AND c.conname = 'jobs_status_check';
    IF def IS NULL OR position('ARRAY[' IN def) = 0 THEN
        RAISE EXCEPTION 'jobs_status_check has an unexpected form: %', def;
    END IF;
    EXECUTE format('ALTER TABLE %I.jobs DROP CONSTRAINT jobs_status_check', {schema_name});
    EXECUTE format('ALTER TABLE %I.jobs ADD CONSTRAINT jobs_status_check %s', {schema_name},
                   replace(def, 'ARRAY[', 'ARRAY[''throttled''::text, '));
END
$mig$;

CREATE TABLE {schema}.concurrency_keys (
    key         text        PRIMARY KEY,
    max_running integer     NOT NULL CHECK (max_running > 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- A key's admitted jobs, counted at each admission; and its waiters in admission order.
-- Jobs without a key are in neither (the predicates), on every partition.
CREATE INDEX jobs_key_admitted_idx ON {schema}.jobs (concurrency_key)
    WHERE concurrency_key IS NOT NULL AND status IN ('pending', 'running');
CREATE INDEX jobs_key_waiting_idx ON {schema}.jobs (concurrency_key, priority, id)
    WHERE status = 'throttled';

-- BEFORE INSERT: a keyed job arriving pending (an enqueue, a requeue moved from its day,
-- one of upkeep's moves) waits for admission.  A moved job that held a slot gives it up
-- here and, being the oldest of its key by id, normally takes it straight back below.
CREATE FUNCTION {schema}.key_hold() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.concurrency IS NULL OR NEW.concurrency < 1 THEN
        RAISE EXCEPTION 'job % has concurrency key % but no concurrency limit of at least 1',
            NEW.id, NEW.concurrency_key;
    END IF;
    NEW.status := 'throttled';
    RETURN NEW;
END
$$;

-- Admit the oldest throttled jobs of a key while it has free slots.  SECURITY DEFINER:
-- it runs from the writes of producers and workers, whose roles may not update status
-- or the key table directly.
CREATE FUNCTION {schema}.key_admit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    k    text;
    lim  integer;
    free bigint;
BEGIN
    IF TG_OP = 'DELETE' THEN
        k := OLD.concurrency_key;
    ELSE
        k := NEW.concurrency_key;
    END IF;
    -- The key's row: created by its first job, its limit set by every enqueue (the
    -- task's current setting wins), and locked until our transaction ends.
    INSERT INTO {schema}.concurrency_keys AS c (key, max_running)
    VALUES (k, CASE WHEN TG_OP = 'INSERT' THEN NEW.concurrency ELSE 1 END)
    ON CONFLICT (key) DO UPDATE
    SET max_running = CASE WHEN TG_OP = 'INSERT' THEN excluded.max_running
                           ELSE c.max_running END,
        updated_at  = now()
    RETURNING c.max_running INTO lim;
    -- A new statement, so a new snapshot: it sees every admission committed before
    -- our lock was granted.
    SELECT lim - count(*) INTO free
    FROM {schema}.jobs AS j
    WHERE j.concurrency_key = k
      AND j.status IN ('pending', 'running')
      AND j.part < 1000000;
    IF free <= 0 THEN
        RETURN NULL;
    END IF;
    WITH admitted AS (
        -- run_at: an admitted job joins the claim order at the end, as a job enqueued
        -- now would.  At its old place, before the position a worker's claims have
        -- reached (queries.sql, `claim`), it would wait for the next claim from the head.
        UPDATE {schema}.jobs AS j
        SET status = 'pending',
            run_at = greatest(j.run_at, now())
        FROM (SELECT w.id, w.part
              FROM {schema}.jobs AS w
              WHERE w.concurrency_key = k
                AND w.status = 'throttled'
                AND w.part < 1000000
              ORDER BY w.priority, w.id
              LIMIT free
              FOR UPDATE) AS w
        WHERE j.id = w.id AND j.part = w.part AND j.status = 'throttled'
        RETURNING j.queue, j.run_at
    )
    -- Wake the workers of the queue as an enqueue does (notify_enqueued, migration
    -- 0008): only if one of them sleeps until notified; busy workers claim anyway.
    SELECT count(pg_notify(TG_ARGV[0], q.queue)) INTO free
    FROM (SELECT DISTINCT a.queue FROM admitted AS a WHERE a.run_at <= now()) AS q
    WHERE EXISTS (SELECT FROM {schema}.workers AS w
                  WHERE w.waiting IS NOT FALSE AND q.queue = ANY (w.queues))
       OR NOT EXISTS (SELECT FROM {schema}.workers);
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_key_hold
    BEFORE INSERT ON {schema}.jobs
    FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL AND NEW.status = 'pending')
    EXECUTE FUNCTION {schema}.key_hold();

CREATE TRIGGER jobs_key_admit_inserted
    AFTER INSERT ON {schema}.jobs
    FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL AND NEW.status = 'throttled')
    EXECUTE FUNCTION {schema}.key_admit({channel});

-- A job leaves pending/running for good (complete, fail with no retry left, cancel, a
-- sweep with no attempt left): its slot is free.  Or a job becomes throttled in place
-- (a requeue within its generation): it may take a free slot.
CREATE TRIGGER jobs_key_admit_updated
    AFTER UPDATE ON {schema}.jobs
    FOR EACH ROW
    WHEN (OLD.concurrency_key IS NOT NULL
          AND ((OLD.status IN ('pending', 'running')
                AND NEW.status NOT IN ('pending', 'running'))
               OR (NEW.status = 'throttled' AND OLD.status <> 'throttled')))
    EXECUTE FUNCTION {schema}.key_admit({channel});

-- A deleted admitted job (delete_job, or the first half of a move) frees its slot.
CREATE TRIGGER jobs_key_admit_deleted
    AFTER DELETE ON {schema}.jobs
    FOR EACH ROW
    WHEN (OLD.concurrency_key IS NOT NULL AND OLD.status IN ('pending', 'running'))
    EXECUTE FUNCTION {schema}.key_admit({channel});

-- Grants: a producer writes the two new columns; the roles that had INSERT on jobs'
-- columns get them (see roles.sql for new roles).
DO $mig$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee
        FROM pg_attribute AS att, aclexplode(att.attacl) AS a
        WHERE att.attrelid = format('%I.jobs', {schema_name})::regclass
          AND att.attname = 'payload' AND a.privilege_type = 'INSERT' AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT INSERT (concurrency_key, concurrency) ON %I.jobs TO %I',
                       {schema_name}, pg_get_userbyid(r.grantee));
    END LOOP;
END
$mig$;

-- upkeep() as in 0016 (0014's with 0016's columns), its move carrying the two new
-- columns too: a delayed keyed job moved without its key would run outside its limit.
-- It does not move throttled jobs (its statuses are listed): like 0016's waiting jobs,
-- they stay in their generation until admitted.
CREATE OR REPLACE FUNCTION {schema}.upkeep(rotate_rows bigint, rotate_after float8,
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
    total   integer;
    empties integer[];
    -- 0014: the most generations upkeep adds to (see above).
    most    constant integer := 12;
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
            -- No empty generation: add one only once the current one has grown to three
            -- times the rotation's size and age, or by the idle rule.  Until then the
            -- moves and truncations below may free one, at this call or a later one: a
            -- rotation every few seconds must not add a partition at each turn while a
            -- backlog keeps the others full.  0014: and never past `most`; the current
            -- generation grows instead until one is free.
            IF ((last_id - info.first_id >= 3 * rotate_rows
                 AND clock_timestamp() - info.since >= make_interval(secs => 3 * rotate_after))
                OR clock_timestamp() - info.since >= make_interval(secs => rotate_idle))
               AND (SELECT count(*) FROM {schema}.generations) < most THEN
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
        ELSE
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
    END IF;

    -- Statistics (migration 0011): the current generation, once it has taken 1,000
    -- ids, is analyzed if nothing ever analyzed it with rows in it.
    IF last_id - info.first_id >= 1000 AND NOT EXISTS (
        SELECT FROM pg_stats AS s
        WHERE s.schemaname = ns AND s.tablename = 'jobs_g' || cur AND s.attname = 'id'
    ) THEN
        BEGIN
            EXECUTE format('ANALYZE %I.%I', ns, 'jobs_g' || cur);
            action := 'analyzed'; gen := cur; jobs := 0;
        EXCEPTION WHEN lock_not_available THEN
            action := 'busy'; gen := cur; jobs := 0;
        END;
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
                                       cancel_requested, notify_finish, task, meta, has_children,
                                       deps_left, concurrency_key, concurrency, part)
            SELECT id, queue, status, priority, run_at, payload, attempts, max_attempts,
                   worker, lease_token, locked_until, started_at, finished_at, last_error,
                   idempotency_key, created_at, completions, handback_token, result,
                   cancel_requested, notify_finish, task, meta, has_children, deps_left,
                   concurrency_key, concurrency,
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

    -- 0014: nothing else to do.  A generation beyond the first three goes once two
    -- besides the current one are empty: the highest-numbered of them, one a step.
    SELECT count(*) INTO total FROM {schema}.generations;
    IF total > 3 THEN
        SELECT array_agg(x.part ORDER BY x.part DESC) INTO empties
        FROM {schema}.generations AS x
        WHERE x.part <> cur
          AND pg_relation_size(format('%I.%I', ns, 'jobs_g' || x.part)::regclass) = 0;
        IF cardinality(empties) >= 2 THEN
            g := empties[1];
            -- A transaction that has held a lock on jobs for a second or more (a report,
            -- an enqueue in a long transaction) would make every attempt wait its 10 ms
            -- while the claims queue behind it, at every sweep of every worker: wait
            -- for it to end instead.  (Without pg_read_all_stats the owner sees no
            -- other role's xact_start; the attempt then waits its 10 ms.)
            IF EXISTS (
                SELECT FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
                WHERE l.locktype = 'relation'
                  AND l.relation = format('%I.jobs', ns)::regclass
                  AND l.pid <> pg_backend_pid()
                  AND a.xact_start < clock_timestamp() - interval '1 second'
            ) THEN
                action := 'busy'; gen := g; jobs := 0;
                RETURN NEXT;
                RETURN;
            END IF;
            BEGIN
                -- ACCESS EXCLUSIVE on jobs queues every claim behind it while it waits:
                -- not for long.  The function's SET undoes this at its return.
                PERFORM set_config('lock_timeout', '10ms', true);
                LOCK TABLE {schema}.jobs IN ACCESS EXCLUSIVE MODE;
                IF NOT EXISTS (SELECT FROM {schema}.jobs AS j WHERE j.part = g) THEN
                    EXECUTE format('DROP TABLE %I.%I', ns, 'jobs_g' || g);
                    DELETE FROM {schema}.generations AS x WHERE x.part = g;
                    action := 'dropped'; gen := g; jobs := 0;
                    RETURN NEXT;
                    RETURN;
                END IF;
            EXCEPTION WHEN lock_not_available THEN
                action := 'busy'; gen := g; jobs := 0;
                RETURN NEXT;
                RETURN;
            END;
        END IF;
    END IF;
END
$fn$;
