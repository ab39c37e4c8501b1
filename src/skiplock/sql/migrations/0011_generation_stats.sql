-- skiplock schema, version 11: each generation is analyzed once it holds jobs, so
-- that the fenced writes find their rows by primary key.
--
-- Why: complete, fail, heartbeat and release join the ids they are given to the
-- generations (`j.id = f.id`).  Without statistics on a generation, PostgreSQL guesses
-- that each id matches 1/200 of its rows, prices a lookup by primary key at 100 rows,
-- and reads the whole generation into a hash instead: every completion of a batch read
-- every job of the current generation.  Measured on PostgreSQL 15, 24 jobs completed
-- against 20,000 in their generation: 6.7 ms and 436 buffers by sequential scan, 0.9
-- ms and 78 buffers by primary key once the generation had been analyzed.  Before 0009
-- `jobs` was one long-lived table that some ANALYZE had seen; a generation starts
-- empty, and with autovacuum off (or before its first pass, a minute at most) nothing
-- analyzes it, so a server without autovacuum paid the scan on every completion.
--
-- The statistics that matter survive what a generation goes through: `id` is unique
-- (n_distinct -1, a fraction, right at any size), TRUNCATE keeps pg_statistic, and an
-- ANALYZE that samples no row (a DBA's, of an empty generation) writes none.  So each
-- generation needs one ANALYZE in its life, taken with rows in it: upkeep gives it the
-- current generation once that has taken 1,000 ids and has no statistics for `id`, in
-- a step of its own (one ANALYZE of at most 10,000 rows, some milliseconds, on the
-- worker's upkeep connection, never on the claim loop).  A generation analyzed by
-- autovacuum or by hand is left alone.  ANALYZE takes SHARE UPDATE EXCLUSIVE, which
-- enqueues, claims and writes do not wait for; behind an autovacuum of the same
-- generation it gives up at lock_timeout and is tried at a later step.
--
-- The function keeps its signature, owner and grants (CREATE OR REPLACE): the roles of
-- 0009 run it unchanged, and a worker of 0009 calling it gets the new step too.  What
-- follows is 0009's upkeep with the statistics step added before the moves.

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
