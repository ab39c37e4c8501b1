-- skiplock schema, version 8: an enqueue notifies only when some worker waits for it.
--
-- Why: a transaction that has called NOTIFY takes one lock for the whole database at
-- commit (PreCommit_Notify in PostgreSQL's async.c) and holds it until its commit
-- record is flushed, so notifying transactions commit one after another instead of
-- sharing a WAL flush.  Eight producers each enqueueing one job per transaction ran
-- 1.46-1.61 times faster with the trigger disabled (bench/README.md, "NOTIFY on
-- enqueue").  A worker whose last claim came back full does not need the notification:
-- it claims again as soon as slots free, whatever producers do.
--
-- `workers.waiting` is what each worker says about itself: true while it has free
-- slots and sleeps until a notification (or its poll), false while it is busy claiming
-- back to back or does not listen at all (behind a transaction pooler), NULL when it
-- has not said (a worker of version 7 or before, or one just registered).  The trigger
-- notifies a queue when any worker row for it is not false, or when no worker is
-- registered at all (someone may listen who does not register).  NULL and a stale true
-- cost only a notification nobody needed; the worker writes false only after a second
-- of full claims, so a worker near its capacity does not flip at every claim.
--
-- The one case a skipped notification delays a job: a producer's trigger reads a
-- worker as busy, the worker turns idle and claims before the producer commits, and
-- then sleeps.  The worker writes `waiting` before that claim and looks once more
-- shortly after it, which covers a producer that commits right after its insert; a
-- producer that holds its transaction open longer is found by the worker's poll
-- (poll_interval, 1 s by default).  Delayed jobs were never notified; they are found
-- by polling as before.
--
-- ADD COLUMN without a default is a catalog-only change; no job row is touched.

ALTER TABLE {schema}.workers ADD COLUMN waiting boolean;

CREATE OR REPLACE FUNCTION {schema}.notify_enqueued() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE run_at <= now()) AS q
    WHERE EXISTS (SELECT FROM {schema}.workers AS w
                  WHERE w.waiting IS NOT FALSE AND q.queue = ANY (w.queues))
       OR NOT EXISTS (SELECT FROM {schema}.workers);
    RETURN NULL;
END
$$;
