-- The periodic scheduler's statements (see _periodic.py and docs/periodic.md).  Same
-- format as queries.sql: "-- name: <name>" headers, {schema} a quoted identifier,
-- every value a bound parameter.

-- name: periodic_last
-- The database's clock (every scheduler on every host agrees on it) and the last
-- enqueued tick of each schedule; the primary key makes each max() one index probe.
SELECT clock_timestamp() AS now,
       n.name,
       (SELECT max(t.scheduled_at)
        FROM {schema}.periodic_ticks AS t
        WHERE t.name = n.name) AS last
FROM unnest(%(names)s::text[]) AS n(name);

-- name: periodic_enqueue
-- A tick and its job, together or not at all, in one statement.  The job's id is taken
-- from the jobs' sequence first so that the tick row can carry it; the job is inserted
-- only from the tick's RETURNING, so a tick that conflicts (another scheduler got there
-- first, or is inserting it right now: ON CONFLICT waits for its commit) inserts no job.
-- The guard refuses a tick at or before the schedule's last one: ticks only move
-- forward, which is also what lets `periodic_prune` delete old ticks safely.
WITH tick AS (
    INSERT INTO {schema}.periodic_ticks (name, scheduled_at, job_id)
    SELECT %(name)s, %(scheduled_at)s,
           nextval(pg_get_serial_sequence(format('%%I.jobs', %(schema)s::text), 'id'))
    WHERE %(scheduled_at)s::timestamptz > coalesce(
        (SELECT max(t.scheduled_at) FROM {schema}.periodic_ticks AS t
         WHERE t.name = %(name)s),
        '-infinity')
    ON CONFLICT (name, scheduled_at) DO NOTHING
    RETURNING job_id
)
INSERT INTO {schema}.jobs (id, queue, payload, priority, run_at, max_attempts, task)
SELECT tick.job_id, %(queue)s, %(payload)s::jsonb, %(priority)s, %(scheduled_at)s,
       %(max_attempts)s, %(task)s
FROM tick
RETURNING id;

-- name: periodic_prune
-- Old ticks in small batches, never a schedule's latest one (the guard above and the
-- catch-up both read it).  SKIP LOCKED: schedulers pruning at once do not queue up.
DELETE FROM {schema}.periodic_ticks AS t
WHERE (t.name, t.scheduled_at) IN (
    SELECT o.name, o.scheduled_at
    FROM {schema}.periodic_ticks AS o
    WHERE o.name = ANY(%(names)s::text[])
      AND o.scheduled_at < clock_timestamp() - make_interval(secs => %(keep)s)
      AND o.scheduled_at < (SELECT max(m.scheduled_at) FROM {schema}.periodic_ticks AS m
                            WHERE m.name = o.name)
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
);
