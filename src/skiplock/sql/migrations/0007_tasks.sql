-- skiplock schema, version 7: tasks, so that many job types can share a queue.
--
-- `task` names the function that runs the job (skiplock.App's @app.task, or a Django
-- task's module path).  NULL is a job of the handler-per-queue API: every job enqueued
-- before this migration, and every job `Queue.enqueue` adds without a task, keeps
-- running as it did.  `meta` carries what travels with a job but is not its arguments:
-- the trace context of the call that deferred it (W3C traceparent), so a handler's
-- span joins the request's trace.  Both columns are nullable with no default: ADD
-- COLUMN is a catalog-only change, and every pending and running job keeps its row,
-- lease token and lease.
--
-- A worker built from an App claims only the tasks it knows (the claim's `tasks`
-- filter); a job for a task no running worker knows yet (a rolling deploy: the
-- producers are on the new version, some workers still on the old) stays pending, is
-- never claimed by the old workers, so it is neither failed nor charged an attempt,
-- and waits for a worker that knows it.  `workers` is how `status` and the dashboard
-- tell such a job from one that merely waits its turn: every worker records the
-- queues and tasks it serves (tasks NULL: all of them) and refreshes `seen_at` at each
-- sweep; a row not seen for a while belongs to a worker that is gone.  No index on
-- jobs.task: the claim reads it from the heap rows its index scan visits anyway.
--
-- `workers` also carries each worker's liveness mark: a session-level advisory lock
-- (mark_key1, mark_key2) held by backend mark_pid on a connection the worker keeps for
-- it.  PostgreSQL drops the lock the moment that session ends (the worker's process
-- died and the kernel closed its socket), so other workers see a crash in well under
-- a second instead of waiting out the lease (`sweep_dead` in queries.sql).
-- mark_lost_at is when a sweeper first saw the mark gone: the jobs are given back only
-- after a short grace, so a worker that reconnects (and marks again) in time keeps
-- them.  mark_pid NULL: no mark (behind a transaction pooler, where session state does
-- not survive): the lease alone decides.

ALTER TABLE {schema}.jobs
    ADD COLUMN task text,
    ADD COLUMN meta jsonb;

CREATE TABLE {schema}.workers (
    name       text PRIMARY KEY,
    queues     text[]      NOT NULL,
    tasks      text[],
    started_at timestamptz NOT NULL DEFAULT now(),
    seen_at    timestamptz NOT NULL DEFAULT now(),
    mark_pid     integer,
    mark_key1    integer,
    mark_key2    integer,
    mark_lost_at timestamptz
);
