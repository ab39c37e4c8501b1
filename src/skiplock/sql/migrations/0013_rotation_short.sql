-- skiplock schema, version 13: the generations rotate every few thousand jobs, and a
-- generation is added only when a backlog needs it.
--
-- Why: under a transaction that holds back xmin, a claim from the head of the claim
-- order walks the dead index entries of every job claimed in the current generation
-- (and in a retired one until its truncation), each a heap visit: the claim cursor
-- keeps most claims off the head, not all.  Fewer ids to a generation is fewer such
-- entries.  Measured with `bench/held_claims.py --fresh 40 --held 80` (a Worker of 8,
-- 1,000 jobs/s, three rounds alternated): rotating after 3,000 ids and 2 s instead of
-- 10,000 and 5 s read 280 index entries a claim under the hold instead of 680, and the
-- claim p99 fell from 5.57-6.74 ms to 3.44-3.78 held and from 4.51-5.08 to 2.96-3.87
-- fresh.  The worker passes the thresholds (QueueBase.ROTATE_ROWS, ROTATE_AFTER).
--
-- What this migration changes is the one thing that made a short rotation dangerous:
-- when no other generation is empty (a backlog keeps them full), 0009-0012 added a
-- partition at every rotation, and partitions are never dropped.  A short rotation
-- would multiply them by the backlog's length.  Now upkeep adds one only once the
-- current generation has grown to three times the rotation's size and age (or by the
-- idle rule); until then it goes on moving and truncating, which frees a generation
-- as soon as the backlog in it is claimed and finished.
--
-- The function keeps its signature, owner and grants (CREATE OR REPLACE).  A worker of
-- 0009-0012 calling it with its own thresholds (10,000 ids, 5 s) rotates as before and
-- adds generations later (30,000 ids and 15 s).  What follows is 0011's upkeep with
-- that rule.

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
            -- No empty generation: add one only once the current one has grown to three
            -- times the rotation's size and age, or by the idle rule.  Until then the
            -- moves and truncations below may free one, at this call or a later one: a
            -- rotation every few seconds must not add a partition at each turn while a
            -- backlog keeps the others full.
            IF (last_id - info.first_id >= 3 * rotate_rows
                AND clock_timestamp() - info.since >= make_interval(secs => 3 * rotate_after))
               OR clock_timestamp() - info.since >= make_interval(secs => rotate_idle) THEN
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
