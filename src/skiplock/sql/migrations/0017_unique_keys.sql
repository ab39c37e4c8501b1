-- skiplock schema, version 17: unique jobs.  An idempotency key says how long it holds
-- and what a second deferral with it gets; a reused key with other arguments is an
-- error, never the old job.
--
-- Why (issue 39): a key used to hold for as long as its job was kept, and a second
-- enqueue with it got the first job's id whatever its payload, so
-- `configure(key="charge:42:2026-12").defer(customer_id=99)` silently returned the job
-- of customer 42.  Now each keyed enqueue says:
--   * how long the key holds (`unique_for`): NULL, for as long as the holding job is
--     kept (as before: an idempotency key); else while the job is pending or running
--     and for that many seconds after it finished (0: while it is live only).  A key
--     whose job finished longer ago than that passes to the new job.  The enqueuer's
--     period decides, not the holder's: "is there a job with this key that is live, or
--     finished in the last hour?" is the question each deferral asks.
--   * what a conflict gets (`on_conflict`): 'return' the holder's id when its task and
--     arguments are the same (jsonb equality), else raise; 'replace' its arguments if it
--     has not started (pending, never attempted), else as 'return'; 'raise' always.
--     Raising is SQLSTATE SL409, its DETAIL a JSON object naming the holding job.
--
-- Only keyed enqueues come here: an unkeyed one does not touch job_keys and pays nothing.
--
-- A function, SECURITY DEFINER, because deciding needs what the producer role may not
-- have: the holder's payload (to compare, not to read: nothing of it is returned), its
-- finished_at, and updates of job_keys (a lapsed key passing on) and of a pending job's
-- payload (replace).  It does nothing a producer could not do by enqueueing with that
-- key in the first place.  EXECUTE is for who may enqueue (INSERT on jobs), below and in
-- `skiplock roles`, not PUBLIC: it inserts jobs as the owner.
--
-- Concurrency: the free keys go in with one INSERT ... ON CONFLICT DO NOTHING, which
-- waits for a concurrent inserter of the same key and then sees its row.  A conflicting
-- key's row is then locked (FOR UPDATE) before its holder is read, each statement with
-- a new snapshot (READ COMMITTED): two enqueuers of one lapsed key pass it on once, the
-- second waits for the first and finds the new holder.  A replace updates the holder
-- only if it is still pending and unattempted when its row lock is had, so a claim
-- that got there first wins and the replace raises.  Keys are taken and locked in key
-- order, so two batches never wait on each other in a cycle over their keys.
--
-- `p_retry`: the caller sends again after a lost reply; rows with its reserved ids
-- that exist are from the attempt that committed, and count as enqueued.

CREATE FUNCTION {schema}.enqueue_keyed(
    p_ids bigint[], p_queue text, p_payloads text[], p_keys text[], p_priority integer,
    p_run_at timestamptz, p_max_attempts integer, p_task text, p_meta text,
    p_unique_for float8, p_on_conflict text, p_retry boolean)
RETURNS TABLE (n integer, job_id bigint, outcome text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    c_n       integer[];
    c_id      bigint[];
    c_payload text[];
    c_key     text[];
    holder    bigint;
    h         record;
    st        text;
    unstarted boolean;
    reason    text;
BEGIN
    IF p_on_conflict IS NULL OR p_on_conflict NOT IN ('return', 'replace', 'raise') THEN
        RAISE EXCEPTION 'on_conflict must be return, replace or raise, not %', p_on_conflict
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Every row whose key is free, or that has none, in two statements; the rows whose
    -- key is held are kept, in key order, for the loop below.
    WITH u AS MATERIALIZED (
        SELECT u.id, u.payload, u.key, u.n::integer AS n,
               p_retry AND EXISTS (SELECT 1 FROM {schema}.jobs AS j
                                   WHERE j.id = u.id AND j.queue = p_queue) AS present
        FROM unnest(p_ids, p_payloads, p_keys) WITH ORDINALITY AS u(id, payload, key, n)
    ),
    k AS (
        INSERT INTO {schema}.job_keys (queue, idempotency_key, job_id)
        SELECT p_queue, u.key, u.id FROM u
        WHERE u.key IS NOT NULL AND NOT u.present
        ORDER BY u.key, u.n
        ON CONFLICT DO NOTHING
        RETURNING job_id
    ),
    ins AS (
        INSERT INTO {schema}.jobs (id, queue, payload, priority, run_at, max_attempts,
                                   idempotency_key, task, meta)
        SELECT u.id, p_queue, u.payload::jsonb, p_priority, coalesce(p_run_at, now()),
               p_max_attempts, u.key, p_task, p_meta::jsonb
        FROM u
        WHERE NOT u.present AND (u.key IS NULL OR u.id IN (SELECT k.job_id FROM k))
        ORDER BY u.id
        RETURNING id
    )
    SELECT array_agg(u.n ORDER BY u.key, u.n), array_agg(u.id ORDER BY u.key, u.n),
           array_agg(u.payload ORDER BY u.key, u.n), array_agg(u.key ORDER BY u.key, u.n)
    INTO c_n, c_id, c_payload, c_key
    FROM u
    WHERE NOT u.present AND u.key IS NOT NULL AND u.id NOT IN (SELECT ins.id FROM ins);

    RETURN QUERY
        SELECT u.n::integer, u.id, 'new'::text
        FROM unnest(p_ids) WITH ORDINALITY AS u(id, n)
        WHERE u.n NOT IN (SELECT unnest(coalesce(c_n, '{{}}')));

    <<each>>
    FOR i IN 1 .. coalesce(cardinality(c_n), 0) LOOP
        n := c_n[i];
        LOOP
            SELECT k.job_id INTO holder
            FROM {schema}.job_keys AS k
            WHERE k.queue = p_queue AND k.idempotency_key = c_key[i]
            FOR UPDATE;
            IF NOT FOUND THEN
                -- Its job went (retention, delete) since the insert above: take it now,
                -- or, if another enqueuer just did, look again.
                INSERT INTO {schema}.job_keys (queue, idempotency_key, job_id)
                VALUES (p_queue, c_key[i], c_id[i])
                ON CONFLICT DO NOTHING;
                EXIT WHEN FOUND;
                CONTINUE;
            END IF;
            SELECT j.status, j.attempts,
                   j.task IS NOT DISTINCT FROM p_task AS same_task,
                   j.task IS NOT DISTINCT FROM p_task AND j.payload = c_payload[i]::jsonb AS same,
                   j.status IN ('done', 'failed', 'cancelled')
                       AND j.finished_at <= clock_timestamp()
                                            - make_interval(secs => p_unique_for) AS lapsed
            INTO h
            FROM {schema}.jobs AS j
            WHERE j.id = holder;
            IF NOT FOUND OR (p_unique_for IS NOT NULL AND h.lapsed) THEN
                -- The key has lapsed for this enqueuer: it passes to the new job.
                UPDATE {schema}.job_keys AS k SET job_id = c_id[i]
                WHERE k.queue = p_queue AND k.idempotency_key = c_key[i];
                EXIT;
            END IF;
            st := h.status;
            IF p_on_conflict = 'raise' THEN
                reason := 'exists';
            ELSIF h.same THEN
                job_id := holder;
                outcome := 'existing';
                RETURN NEXT;
                CONTINUE each;
            ELSIF p_on_conflict = 'replace' AND h.same_task THEN
                FOR attempt IN 1 .. 3 LOOP
                    UPDATE {schema}.jobs AS j
                    SET payload = c_payload[i]::jsonb, meta = p_meta::jsonb
                    WHERE j.id = holder AND j.status = 'pending' AND j.attempts = 0;
                    IF FOUND THEN
                        job_id := holder;
                        outcome := 'replaced';
                        RETURN NEXT;
                        CONTINUE each;
                    END IF;
                    -- A claim got there first: too late to replace.  Or upkeep moved the
                    -- (delayed) job to another partition while we waited for its row: a
                    -- move deletes the version we waited on, so look it up again.
                    SELECT j.status, j.status = 'pending' AND j.attempts = 0
                    INTO st, unstarted
                    FROM {schema}.jobs AS j WHERE j.id = holder;
                    EXIT WHEN NOT coalesce(unstarted, false);
                END LOOP;
                reason := 'started';
            ELSE
                reason := 'arguments';
            END IF;
            RAISE EXCEPTION 'job % (%) holds key % in queue %', holder, st,
                            quote_literal(c_key[i]), quote_literal(p_queue)
                USING ERRCODE = 'SL409',
                      DETAIL = json_build_object('job_id', holder, 'status', st,
                                                 'reason', reason, 'key', c_key[i],
                                                 'queue', p_queue)::text;
        END LOOP;
        -- The key is this row's now: its job goes in.
        INSERT INTO {schema}.jobs (id, queue, payload, priority, run_at, max_attempts,
                                   idempotency_key, task, meta)
        VALUES (c_id[i], p_queue, c_payload[i]::jsonb, p_priority, coalesce(p_run_at, now()),
                p_max_attempts, c_key[i], p_task, p_meta::jsonb);
        job_id := c_id[i];
        outcome := 'new';
        RETURN NEXT;
    END LOOP;
END
$fn$;
REVOKE ALL ON FUNCTION {schema}.enqueue_keyed(bigint[], text, text[], text[], integer,
    timestamptz, integer, text, text, float8, text, boolean) FROM PUBLIC;

-- The roles that may enqueue (INSERT on jobs.id: `skiplock roles`' producer) may enqueue
-- with a key.
DO $mig$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee
        FROM pg_attribute AS att, aclexplode(att.attacl) AS a
        WHERE att.attrelid = format('%I.jobs', {schema_name})::regclass
          AND att.attname = 'id' AND a.privilege_type = 'INSERT' AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %I.enqueue_keyed(bigint[], text, text[], '
                       'text[], integer, timestamptz, integer, text, text, float8, text, '
                       'boolean) TO %I', {schema_name}, pg_get_userbyid(r.grantee));
    END LOOP;
END
$mig$;
