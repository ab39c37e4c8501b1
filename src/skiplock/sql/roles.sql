-- skiplock's least-privilege roles, run by `skiplock roles` as the schema's owner.  Each
-- block starts with "-- name: <name>"; the loader in _sql.py splits on those headers.
-- {schema} and {role} are filled with quoted identifiers by psycopg.sql, {password}
-- with a literal SCRAM verifier computed on the client (the clear text never reaches
-- the server or its logs).  Every statement is idempotent: re-run it after an upgrade.
--
-- The column lists are exactly the columns skiplock's statements (queries.sql) insert,
-- read back and update; tests/unit/test_roles_sql.py keeps them in step.

-- name: serialise
-- Two runs at once (two deploys) would GRANT on the same objects concurrently, which
-- fails with "tuple concurrently updated"; the second run waits for the first instead.
SELECT pg_advisory_xact_lock(hashtextextended('skiplock.roles', 0));

-- name: create_role
-- CREATE ROLE has no IF NOT EXISTS; the block makes a re-run (or two deploys at once) a
-- no-op.  New roles cannot log in until `--login` says so.
DO $do$
BEGIN
    CREATE ROLE {role} NOLOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;
END
$do$;

-- name: login
ALTER ROLE {role} LOGIN;

-- name: password
ALTER ROLE {role} PASSWORD {password};

-- name: grant_producer
-- Enqueue only.  INSERT on the columns enqueue, enqueue_many and its COPY write (not
-- status, worker or lease_token: a producer cannot plant a running or finished job);
-- SELECT on what RETURNING id, reserved ids and `wait` read (not other jobs' payloads);
-- UPDATE of notify_finish (how `wait` asks a job's final write to notify it); USAGE on
-- the id sequence for reserve_ids.  The enqueue trigger needs no EXECUTE (checked only
-- at CREATE TRIGGER) and pg_notify no privilege: tested (docs/security.md).
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT INSERT (id, queue, payload, priority, run_at, max_attempts, task, meta, concurrency_key,
               concurrency, rate_key, rate_every)
    ON {schema}.jobs TO {role};
GRANT SELECT (id, queue, status, result, last_error, attempts, max_attempts)
    ON {schema}.jobs TO {role};
GRANT UPDATE (notify_finish) ON {schema}.jobs TO {role};
GRANT USAGE ON SEQUENCE {schema}.jobs_id_seq TO {role};
-- A new job goes to the current generation, which the default of `part` reads from
-- jobs_gen.  A keyed job goes in through enqueue_keyed (migration 0017), a SECURITY
-- DEFINER function: deciding what a held key gets compares the holder's payload and
-- may update job_keys or a pending job's payload, none of which the producer may do
-- itself (so it needs neither job_keys nor jobs.idempotency_key).
GRANT SELECT ON SEQUENCE {schema}.jobs_gen TO {role};
GRANT EXECUTE ON FUNCTION {schema}.enqueue_keyed(bigint[], text, text[], text[], integer,
    timestamptz, integer, text, text, float8, text, boolean) TO {role};
-- The enqueue trigger reads which workers wait for a notification (migration 0008),
-- as the inserting role: the queues and the flag, not the workers' names.
GRANT SELECT (queues, waiting) ON {schema}.workers TO {role};
-- Jobs that wait for others (`after`, migration 0016) go in through a SECURITY DEFINER
-- function: it inserts them 'waiting' and marks their parents, which a producer may
-- not do itself.
GRANT EXECUTE ON FUNCTION {schema}.enqueue_graph(bigint[], text[], text[], integer[],
    timestamptz[], integer[], text[], text[], bigint[], bigint[], integer[], boolean[], text,
    text) TO {role};
-- `wait` on a workflow reads its output and steps.
GRANT SELECT ON {schema}.workflows TO {role};

-- name: grant_worker
-- Claim, heartbeat, complete, fail, retry, release, sweep: SELECT on jobs (a claim
-- returns the whole row) and UPDATE on the columns those statements set, nothing else.
-- No INSERT, no DELETE (retention runs as the owner), no TRUNCATE, and no UPDATE of
-- payload, queue, priority or max_attempts: a compromised worker host cannot rewrite
-- the work it hands to the other workers.  SELECT ... FOR UPDATE needs only UPDATE on
-- some column.  On queues: read the settings, and spend rate-limit tokens; pausing and
-- limits are the owner's (an operator's) business.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT ON {schema}.jobs TO {role};
GRANT UPDATE (status, run_at, attempts, worker, lease_token, locked_until, started_at,
              finished_at, last_error, completions, handback_token, result,
              cancel_requested)
    ON {schema}.jobs TO {role};
GRANT SELECT ON {schema}.queues TO {role};
GRANT UPDATE (rate_tokens, rate_refilled_at) ON {schema}.queues TO {role};
-- Each worker records what it serves in `workers` (its own row: insert, refresh, delete).
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.workers TO {role};
-- Upkeep of the generations (migration 0009) moves and truncates as the owner, through
-- a SECURITY DEFINER function that keeps every job and takes no argument that could
-- drop one; retention (drop_finished) stays the owner's.
GRANT EXECUTE ON FUNCTION {schema}.upkeep(bigint, float8, float8, integer) TO {role};
GRANT SELECT ON SEQUENCE {schema}.jobs_gen TO {role};
-- A child reads its parents' outcomes through their edges (migration 0016).
GRANT SELECT ON {schema}.job_deps TO {role};
GRANT SELECT ON {schema}.workflows TO {role};

-- name: superusers
-- Grants do not bind a superuser: refuse to call such a role least-privilege.
SELECT rolname
FROM pg_roles
WHERE rolname = ANY(%(roles)s::text[])
  AND rolsuper;
