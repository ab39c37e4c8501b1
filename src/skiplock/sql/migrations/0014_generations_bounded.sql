-- skiplock schema, version 14: the generations a backlog adds are bounded, and go
-- again once the queue no longer needs them.
--
-- Why: every statement that reads the generations (the claim's pick, the fenced
-- writes, the sweep) plans and locks each generation and its four indexes, and the
-- pick merges each one's claimable index, empty or not.  Until now upkeep added a
-- generation whenever every other one still held jobs and never dropped one.  Measured
-- with `python bench/surplus_generations.py --backlog 120` (3,000 jobs/s offered for
-- two minutes to a Worker of 8 that runs about 750 a second): the backlog left 19
-- generations, all kept after it drained, each claim then locking 97 relations, 81 of
-- them outside the backend's 16 fast-path slots, in the shared lock table that
-- max_locks_per_transaction (64 a connection by default) sizes.  An hour of such a
-- backlog would leave hundreds, and claims that fail with "out of shared memory".
--
-- Two rules, both in upkeep():
--   * At most MOST (12) generations.  Past it a backlog grows the current generation
--     instead, until its oldest generation is claimed, finished, truncated and free.
--     Twelve keeps a statement's relation locks (5 a generation, 2 for the parent)
--     within the default 64 a connection.  What the cap gives up: with all twelve
--     pinned (a backlog, or long leases in every one) a held xmin's dead versions in
--     the current generation wait for it to rotate, as in one big table.
--   * A generation added beyond the first three is dropped once it is surplus: when
--     upkeep has nothing else to do and at least two generations besides the current
--     one are empty, the highest-numbered empty one goes (one a step), leaving one
--     spare to rotate into.  DROP of a partition takes ACCESS EXCLUSIVE on jobs, which
--     queues every claim behind it while it waits: it waits at most 10 ms (lock_timeout)
--     and says 'busy' otherwise, to be tried at a later sweep; and it does not try
--     while a transaction that has held a lock on jobs for a second is open.  Under that lock it
--     looks again that the generation holds no row: an enqueue that read the sequence
--     just before a rotation has committed by then, and nothing can make it current
--     meanwhile (upkeep is one session at a time).  Its row in generations goes in the
--     same transaction, so a later add takes the number again, with a new partition
--     that waits for the writers in flight at its first rotation, as any added one.
--
-- The function keeps its signature, owner and grants (CREATE OR REPLACE); an 0009-0013
-- worker calling it gets both rules.  Nothing else changes: no table, no statement a
-- worker sends, and the correctness argument in queries.sql.  What follows is 0013's
-- upkeep with the two rules (marked 0014).

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
