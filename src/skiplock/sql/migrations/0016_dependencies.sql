-- skiplock schema, version 16: jobs that wait for other jobs (issue 39).
--
-- A job enqueued with `after` is inserted 'waiting', with `deps_left` its number of
-- parents and one edge (parent, child) per parent in `job_deps`.  'waiting' is not in
-- any claimable index (they hold status = 'pending' only), so the claim never sees it.
-- A parent row gets `has_children`, set under its row lock when a child is enqueued.
--
-- Exactly-once release.  The row trigger `jobs_settle` fires when a row with
-- has_children reaches done, failed or cancelled from any other status, in the
-- transaction of that write: the fenced `complete` and `fail`, `sweep`, `sweep_dead`,
-- `cancel`, and a cascade's own cancellations.  A job leaves 'running' once per lease,
-- and only the holder of the current token may write it (the fence): a parent that ran
-- twice (a lost lease, a crash after the side effect) has one write that ended it, so
-- one firing.  The trigger runs `settle(parent)`, whose first statement marks the
-- parent's edges `settled` (UPDATE ... WHERE NOT settled): an edge is counted down by
-- the transaction that flips it, never twice, even if the parent were finished again
-- (an operator's requeue).  Each flipped edge takes one off its child's deps_left
-- under the child's row lock; the child turns 'pending' in the UPDATE that reaches 0.
-- Two parents finishing at once both update the child row: the second waits for the
-- first's lock, and PostgreSQL re-reads the row it then updates (READ COMMITTED's
-- re-check), so it counts from the first's result; exactly one of them reaches 0.
-- A count in the child row, not a "no parent left unfinished" test: two transactions
-- that each see the other's parent still running in their snapshot would both hold back.
--
-- A child enqueued after a parent finished: `enqueue_graph` locks each existing parent
-- row (FOR NO KEY UPDATE, in id order) before it reads its status, which the lock
-- makes current: a completion either committed before (the lock returns the finished
-- row, and the new edge is settled by the enqueue itself, in the same transaction) or
-- waits for the enqueue's commit, by which time the edge and has_children are there
-- for its trigger to find (the trigger's statements take a snapshot after the wait).
--
-- What jobs without dependencies pay: the trigger's WHEN clause, evaluated per updated
-- row (has_children is false: nothing is queued), and one boolean per row.  The claim,
-- the fenced writes and the sweep are unchanged statements.  bench/README.md has the
-- drain before and after.

ALTER TABLE {schema}.jobs ADD COLUMN has_children boolean NOT NULL DEFAULT false;
ALTER TABLE {schema}.jobs ADD COLUMN deps_left integer;

-- The status list gains 'waiting'.  Generation 1 of a schema older than 0009 holds
-- the old check as a local constraint of its own: it goes too.
ALTER TABLE {schema}.jobs DROP CONSTRAINT jobs_status_check;
DO $mig$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT c.conrelid::regclass AS rel
        FROM pg_constraint AS c JOIN pg_inherits AS i ON i.inhrelid = c.conrelid
        WHERE i.inhparent = format('%I.jobs', {schema_name})::regclass
          AND c.conname = 'jobs_status_check'
    LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT jobs_status_check', r.rel);
    END LOOP;
END
$mig$;
ALTER TABLE {schema}.jobs ADD CONSTRAINT jobs_status_check
    CHECK (status IN ('pending', 'running', 'done', 'failed', 'cancelled', 'waiting'));

-- One row per (parent, child).  pos: the parent's place in the child's `after` list,
-- so a child reads its parents' results in the order it named them.
-- cancel_on_failure: a failed or cancelled parent cancels the child (and its waiting
-- descendants); false: the child runs once every parent has finished, however.
CREATE TABLE {schema}.job_deps (
    parent            bigint  NOT NULL,
    child             bigint  NOT NULL,
    pos               integer NOT NULL,
    cancel_on_failure boolean NOT NULL DEFAULT true,
    settled           boolean NOT NULL DEFAULT false,
    PRIMARY KEY (parent, child)
);
CREATE INDEX job_deps_child_idx ON {schema}.job_deps (child, pos);

-- A canvas (chain, group, chord of tasks): its steps in the order written, and its
-- output, the ids whose results make its result (a job id, or a JSON list of them,
-- nested as the canvas's groups are).  Its id is the id of its first job.  Retention
-- drops it with the day of that job.
CREATE TABLE {schema}.workflows (
    id         bigint      PRIMARY KEY,
    output     jsonb       NOT NULL,
    steps      bigint[]    NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- A parent reached a final status: settle its edges (see the header).  Children are
-- locked in id order, so that two parents' settlements never wait on each other in a
-- cycle within one child set.  A cascade cancels every waiting descendant reached
-- through cancel_on_failure edges in one statement (not one trigger level per
-- generation of the graph: a chain of 1,000 would nest 1,000 deep); each cancelled
-- one fires this again, which finds its cancel edges' children already cancelled and
-- only counts down the children that run whatever.
CREATE FUNCTION {schema}.settle(parent_id bigint, parent_status text, channel text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    counted bigint[];
    doomed  bigint[];
    vias    bigint[];
    woken   text[];
    q       text;
BEGIN
    WITH s AS (
        UPDATE {schema}.job_deps AS d
        SET settled = true
        WHERE d.parent = parent_id AND NOT d.settled
        RETURNING d.child, d.cancel_on_failure
    )
    SELECT array_agg(s.child ORDER BY s.child)
               FILTER (WHERE parent_status = 'done' OR NOT s.cancel_on_failure),
           array_agg(s.child ORDER BY s.child)
               FILTER (WHERE parent_status <> 'done' AND s.cancel_on_failure)
    INTO counted, doomed
    FROM s;

    IF counted IS NOT NULL THEN
        PERFORM FROM (SELECT j.id FROM {schema}.jobs AS j
                      WHERE j.id = ANY (counted) AND j.status = 'waiting'
                      ORDER BY j.id
                      FOR NO KEY UPDATE) AS locked;
        WITH released AS (
            UPDATE {schema}.jobs AS j
            SET deps_left = j.deps_left - 1,
                status    = CASE WHEN j.deps_left <= 1 THEN 'pending' ELSE 'waiting' END
            WHERE j.id = ANY (counted) AND j.status = 'waiting'
            RETURNING j.queue, j.status, j.run_at
        )
        SELECT array_agg(DISTINCT r.queue) INTO woken
        FROM released AS r
        WHERE r.status = 'pending' AND r.run_at <= now();
        -- Wake the queue's workers, as the enqueue trigger does (migration 0008).
        FOREACH q IN ARRAY coalesce(woken, '{{}}'::text[])
        LOOP
            IF EXISTS (SELECT FROM {schema}.workers AS w
                       WHERE w.waiting IS NOT FALSE AND q = ANY (w.queues))
               OR NOT EXISTS (SELECT FROM {schema}.workers) THEN
                PERFORM pg_notify(channel, q);
            END IF;
        END LOOP;
    END IF;

    IF doomed IS NOT NULL THEN
        WITH RECURSIVE reach (id, via) AS (
            SELECT j.id, parent_id
            FROM {schema}.jobs AS j
            WHERE j.id = ANY (doomed) AND j.status = 'waiting'
            UNION
            SELECT d.child, d.parent
            FROM reach
            JOIN {schema}.job_deps AS d
              ON d.parent = reach.id AND d.cancel_on_failure AND NOT d.settled
            JOIN {schema}.jobs AS j ON j.id = d.child AND j.status = 'waiting'
        )
        SELECT array_agg(x.id ORDER BY x.id), array_agg(x.via ORDER BY x.id)
        INTO doomed, vias
        FROM (SELECT reach.id, min(reach.via) AS via FROM reach GROUP BY reach.id) AS x;
        IF doomed IS NOT NULL THEN
            PERFORM FROM (SELECT j.id FROM {schema}.jobs AS j
                          WHERE j.id = ANY (doomed) AND j.status = 'waiting'
                          ORDER BY j.id
                          FOR NO KEY UPDATE) AS locked;
            UPDATE {schema}.jobs AS j
            SET status      = 'cancelled',
                finished_at = now(),
                last_error  = CASE WHEN x.via = parent_id
                                   THEN format('cancelled: parent job %s %s',
                                               parent_id, parent_status)
                                   ELSE format('cancelled: parent job %s was cancelled '
                                               'after job %s %s', x.via, parent_id,
                                               parent_status) END
            FROM unnest(doomed, vias) AS x(id, via)
            WHERE j.id = x.id AND j.status = 'waiting';
        END IF;
    END IF;
END
$fn$;
REVOKE ALL ON FUNCTION {schema}.settle(bigint, text, text) FROM PUBLIC;

CREATE FUNCTION {schema}.jobs_settle() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM {schema}.settle(NEW.id, NEW.status, TG_ARGV[0]);
    RETURN NULL;
END
$fn$;

-- On the partitioned table: PostgreSQL clones a row trigger to every partition,
-- present and attached later (add_partition).  Upkeep's moves are a DELETE and an
-- INSERT, so they never fire it; nor does `requeue` (its new status is pending).
CREATE TRIGGER jobs_settle
    AFTER UPDATE OF status ON {schema}.jobs
    FOR EACH ROW
    WHEN (NEW.has_children
          AND NEW.status IN ('done', 'failed', 'cancelled')
          AND OLD.status NOT IN ('done', 'failed', 'cancelled'))
    EXECUTE FUNCTION {schema}.jobs_settle({channel});

-- Enqueue jobs and the edges between them, in the caller's transaction.  Rows: ids
-- reserved by the caller (reserve_ids), one array per column.  Edges: parent ids (a
-- job of this batch or one that exists), child ids (jobs of this batch), positions,
-- cancel_on_failure.  A parent outside the batch is locked before its status is read
-- (see the header); one that upkeep moved to another partition while we looked (its
-- old version deleted, the new one too new for our snapshot) is looked for again by
-- a new statement.  A parent not found then is an error, and nothing is inserted.
-- Parents already finished are settled here, after the insert, as their trigger would
-- have.  SECURITY DEFINER: a producer role inserts waiting rows and edges, and locks
-- its parents, without the right to update jobs.
CREATE FUNCTION {schema}.enqueue_graph(
    ids bigint[], queues text[], payloads text[], priorities integer[],
    run_ats timestamptz[], max_attempts integer[], tasks text[], metas text[],
    parents bigint[], children bigint[], positions integer[], cancel_on_failure boolean[],
    workflow text, channel text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    outside  bigint[];
    found    bigint[];
    statuses text[];
    tries    integer := 0;
    n        integer;
    i        integer;
BEGIN
    IF EXISTS (SELECT unnest(children) EXCEPT SELECT unnest(ids)) THEN
        RAISE EXCEPTION 'enqueue_graph: an edge names a child outside the batch'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT array_agg(o.p) INTO outside
    FROM (SELECT unnest(parents) AS p EXCEPT SELECT unnest(ids)) AS o;
    IF outside IS NOT NULL THEN
        LOOP
            SELECT array_agg(l.id ORDER BY l.id), array_agg(l.status ORDER BY l.id)
            INTO found, statuses
            FROM (SELECT j.id, j.status FROM {schema}.jobs AS j
                  WHERE j.id = ANY (outside)
                  ORDER BY j.id
                  FOR NO KEY UPDATE) AS l;
            EXIT WHEN cardinality(coalesce(found, '{{}}')) = cardinality(outside);
            tries := tries + 1;
            IF tries >= 3 THEN
                RAISE EXCEPTION 'after: no job %',
                    (SELECT min(m.p) FROM (SELECT unnest(outside) AS p
                                           EXCEPT SELECT unnest(found)) AS m)
                    USING ERRCODE = 'no_data_found';
            END IF;
        END LOOP;
        UPDATE {schema}.jobs AS j
        SET has_children = true
        FROM unnest(found, statuses) AS f(id, status)
        WHERE j.id = f.id AND NOT j.has_children
          AND f.status NOT IN ('done', 'failed', 'cancelled');
    END IF;

    INSERT INTO {schema}.jobs (id, queue, status, payload, priority, run_at, max_attempts,
                               task, meta, has_children, deps_left)
    SELECT r.id, r.queue,
           CASE WHEN e.n IS NOT NULL THEN 'waiting' ELSE 'pending' END,
           r.payload::jsonb, r.priority, coalesce(r.run_at, now()), r.max_attempts,
           r.task, r.meta::jsonb,
           h.p IS NOT NULL,
           e.n
    FROM unnest(ids, queues, payloads, priorities, run_ats, max_attempts, tasks, metas)
         AS r(id, queue, payload, priority, run_at, max_attempts, task, meta)
    LEFT JOIN (SELECT c, count(*)::integer AS n FROM unnest(children) AS c GROUP BY c) AS e
           ON e.c = r.id
    LEFT JOIN (SELECT DISTINCT p FROM unnest(parents) AS p) AS h ON h.p = r.id
    ORDER BY r.id;
    GET DIAGNOSTICS n = ROW_COUNT;

    INSERT INTO {schema}.job_deps (parent, child, pos, cancel_on_failure)
    SELECT e.parent, e.child, e.pos, e.cancel
    FROM unnest(parents, children, positions, cancel_on_failure)
         AS e(parent, child, pos, cancel);

    -- A canvas (docs/workflows.md) records itself under the id of its first job.
    IF workflow IS NOT NULL THEN
        INSERT INTO {schema}.workflows (id, output, steps)
        VALUES (ids[1], workflow::jsonb, ids);
    END IF;

    -- Parents that had finished: settled now, in id order, as their trigger would have.
    FOR i IN 1 .. cardinality(coalesce(found, '{{}}')) LOOP
        IF statuses[i] IN ('done', 'failed', 'cancelled') THEN
            PERFORM {schema}.settle(found[i], statuses[i], channel);
        END IF;
    END LOOP;
    RETURN n;
END
$fn$;

-- Upkeep copies every column of a row it moves: a delayed parent moved to the current
-- generation keeps has_children, so its completion still releases its children.  It
-- does not move waiting jobs (its statuses are listed): they stay in their generation
-- until released, as running jobs do.  0014's function with the two columns added.
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
                                       deps_left, part)
            SELECT id, queue, status, priority, run_at, payload, attempts, max_attempts,
                   worker, lease_token, locked_until, started_at, finished_at, last_error,
                   idempotency_key, created_at, completions, handback_token, result,
                   cancel_requested, notify_finish, task, meta, has_children, deps_left,
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

-- Retention: 0009's drop_finished, which now drops the edges of the jobs it drops.
CREATE OR REPLACE FUNCTION {schema}.drop_finished(older_than float8)
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
        -- 0016: the edges of the day's jobs go with them (a child finishes after its
        -- parents, so its day is the later one, and its edges go with it).
        EXECUTE format('DELETE FROM %I.job_deps AS d USING %s AS j WHERE d.child = j.id',
                       ns, p.rel);
        EXECUTE format('DELETE FROM %I.workflows AS w USING %s AS j WHERE w.id = j.id',
                       ns, p.rel);
        EXECUTE format('SELECT count(*) FROM %s', p.rel) INTO jobs;
        EXECUTE format('DROP TABLE %s', p.rel);
        day := p.d;
        RETURN NEXT;
    END LOOP;
END
$fn$;

-- Roles: a producer enqueues dependent jobs through enqueue_graph, a worker reads a
-- job's parents through job_deps, both read workflows (roles.sql grants both to new roles; here, to the
-- roles that exist).
REVOKE ALL ON FUNCTION {schema}.enqueue_graph(bigint[], text[], text[], integer[],
    timestamptz[], integer[], text[], text[], bigint[], bigint[], integer[], boolean[], text, text)
    FROM PUBLIC;
DO $mig$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee, a.privilege_type AS priv
        FROM pg_class AS c, aclexplode(c.relacl) AS a
        WHERE c.oid = format('%I.job_keys', {schema_name})::regclass
          AND a.grantee <> c.relowner AND a.grantee <> 0 AND a.privilege_type = 'INSERT'
    LOOP
        EXECUTE format('GRANT SELECT ON %I.workflows TO %I', {schema_name},
                       pg_get_userbyid(r.grantee));
        EXECUTE format('GRANT EXECUTE ON FUNCTION %I.enqueue_graph(bigint[], text[], text[], '
                       'integer[], timestamptz[], integer[], text[], text[], bigint[], '
                       'bigint[], integer[], boolean[], text, text) TO %I',
                       {schema_name}, pg_get_userbyid(r.grantee));
    END LOOP;
    FOR r IN
        SELECT DISTINCT a.grantee
        FROM pg_class AS c, aclexplode(c.relacl) AS a
        WHERE c.oid = format('%I.workers', {schema_name})::regclass
          AND a.grantee <> c.relowner AND a.grantee <> 0 AND a.privilege_type = 'DELETE'
    LOOP
        EXECUTE format('GRANT SELECT ON %I.job_deps TO %I', {schema_name},
                       pg_get_userbyid(r.grantee));
        EXECUTE format('GRANT SELECT ON %I.workflows TO %I', {schema_name},
                       pg_get_userbyid(r.grantee));
    END LOOP;
END
$mig$;
