-- skiplock schema, version 4: control of queues and jobs.
--
-- `queues` holds what operators set per queue: a pause, a global concurrency limit, a
-- rate limit (a token bucket kept on the row), and whether results are stored.  A queue
-- needs no row: no row means running, unlimited, results kept.  The claim reads the
-- row on every call, so a change takes effect at the next claim of every worker, with
-- no restart and no leader.
--
-- On jobs: `result` (a handler's return value), `cancel_requested` (a cooperative
-- cancel of a running job: its worker sees it at the next heartbeat, and the fenced
-- writes end the job `cancelled`, never `done`), and `notify_finish` (someone waits for
-- this job: its final write sends a notification, and only then, so jobs nobody waits
-- for cost no NOTIFY).  No new index on jobs: the limited claim counts a queue's
-- running rows through jobs_leases_idx (running rows are few: what workers hold), and
-- every index added here would be written by every claim.  ADD COLUMN with a constant default is a catalog-only change:
-- pending and running jobs keep their rows, tokens and leases.

CREATE TABLE {schema}.queues (
    name              text PRIMARY KEY,
    paused            boolean NOT NULL DEFAULT false,
    concurrency_limit integer CHECK (concurrency_limit IS NULL OR concurrency_limit > 0),
    rate_limit        double precision CHECK (rate_limit IS NULL OR rate_limit > 0),
    rate_burst        double precision CHECK (rate_burst IS NULL OR rate_burst >= 1),
    rate_tokens       double precision NOT NULL DEFAULT 0,
    rate_refilled_at  timestamptz,
    store_results     boolean NOT NULL DEFAULT true,
    updated_at        timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE {schema}.jobs
    ADD COLUMN result           jsonb,
    ADD COLUMN cancel_requested boolean NOT NULL DEFAULT false,
    ADD COLUMN notify_finish    boolean NOT NULL DEFAULT false;
