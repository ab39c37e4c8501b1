-- `skiplock verify`: the postmortem's production checks.  Each block starts with
-- "-- name: <name>"; the loader in _sql.py splits on those headers.  {schema}, {table},
-- {key} and {time} are filled with quoted identifiers by psycopg.sql; every value is a
-- bound parameter.  Each check returns at most %(limit)s sample rows and, in `total`,
-- how many rows it found in all (a window count, computed before the LIMIT).

-- name: jobs_table
-- Whether the schema is migrated, and to which shape, from the catalog alone: verify
-- may run as the worker role, which cannot read the migrations table.
SELECT c.oid IS NOT NULL AS migrated,
       EXISTS (SELECT 1 FROM pg_attribute a
               WHERE a.attrelid = c.oid AND a.attname = 'completions' AND NOT a.attisdropped)
           AS has_completions,
       to_regclass(format('%%I.job_deps', %(schema)s::text)) IS NOT NULL AS has_deps
FROM (SELECT to_regclass(format('%%I.jobs', %(schema)s::text))::oid AS oid) AS c;

-- name: expired_leases
-- Running jobs whose lease ran out longer than the grace ago.  The sweeper returns an
-- expired lease within seconds, so any row here means no worker is sweeping (or every
-- sweeper is failing).  Reads jobs_running_leases_idx.
SELECT id, queue, worker, attempts, max_attempts,
       extract(epoch FROM now() - locked_until)::float8 AS overdue_seconds,
       count(*) OVER () AS total
FROM {schema}.jobs
WHERE status = 'running'
  AND locked_until < now() - make_interval(secs => %(grace)s)
ORDER BY locked_until
LIMIT %(limit)s;

-- name: high_attempts
-- The postmortem's alert: live jobs that have been tried this often keep losing their
-- lease or failing, and deserve a human look before they run out of attempts.
SELECT id, queue, status, attempts, max_attempts, worker,
       right(coalesce(last_error, ''), 300) AS last_error,
       count(*) OVER () AS total
FROM {schema}.jobs
WHERE status IN ('pending', 'running')
  AND attempts >= %(attempts_alert)s
ORDER BY attempts DESC, id
LIMIT %(limit)s;

-- name: completed_twice
-- skiplock's own record: `complete` bumps the counter in the fenced UPDATE, and a done
-- job is never running again through skiplock, so a count above 1 means something moved
-- a finished job back and it ran to completion again (migration 0002 explains).
SELECT id, queue, status, completions, attempts, worker, finished_at,
       count(*) OVER () AS total
FROM {schema}.jobs
WHERE completions > 1
ORDER BY id
LIMIT %(limit)s;

-- name: stranded_waiting
-- Jobs that wait (migration 0016) for nothing that can still finish: every parent they
-- still count is finished or gone.  The release is in the transaction that finishes a
-- parent, so in one snapshot a finished parent's edge is settled and its child counted
-- down; a row here means a release was lost (or a parent deleted by hand), and the job
-- will never run: cancel it, or enqueue it again.
SELECT j.id, j.queue, j.task, j.deps_left, j.created_at,
       count(*) OVER () AS total
FROM {schema}.jobs AS j
WHERE j.status = 'waiting'
  AND NOT EXISTS (SELECT FROM {schema}.job_deps AS d
                  JOIN {schema}.jobs AS p ON p.id = d.parent
                  WHERE d.child = j.id AND NOT d.settled
                    AND p.status NOT IN ('done', 'failed', 'cancelled'))
ORDER BY j.id
LIMIT %(limit)s;

-- name: worker_sessions
-- The postmortem's pg_stat_activity query, one sample: skiplock's worker sessions in
-- this database and what each waits on.  Without pg_read_all_stats (or being the same
-- role) another role's session shows `<insufficient privilege>` and no wait event.
SELECT pid,
       application_name,
       state,
       wait_event_type,
       wait_event,
       query = '<insufficient privilege>' AS hidden
FROM pg_stat_activity
WHERE application_name LIKE %(pattern)s
  AND datname = current_database()
  AND pid <> pg_backend_pid();

-- name: audit_relation
-- The user's audit table, resolved by the server's own name rules (search_path,
-- quoting, case folding) from text that is only ever a bound value.
SELECT c.oid, n.nspname, c.relname, c.relkind
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(%(table)s);

-- name: audit_columns
SELECT a.attname
FROM pg_attribute AS a
WHERE a.attrelid = %(oid)s
  AND a.attnum > 0
  AND NOT a.attisdropped;

-- name: audit_duplicates
-- The postmortem's "confirming in production" query: a side effect recorded twice for
-- one job key.  {where} is empty or the audit_window block.
SELECT {key}::text AS key,
       count(*) AS copies,
       count(*) OVER () AS total
FROM {table}
{where}
GROUP BY {key}
HAVING count(*) > 1
ORDER BY count(*) DESC, 1
LIMIT %(limit)s;

-- name: audit_window
WHERE {time} > now() - make_interval(secs => %(window)s)
