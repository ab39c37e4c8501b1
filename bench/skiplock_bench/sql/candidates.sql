-- Candidate statements for sqlcmp (python -m skiplock_bench.sqlcmp --variants new,<name>):
-- claim_<name> / complete_<name> replace today's claim / complete; setup_<name> runs on
-- the variant's fresh schema after the migrations (an index or storage change).

-- name: claim_lean
-- The queues row read without an aggregate (zero or one row), and a FULL JOIN that gives
-- the row alone when nothing was claimed, claimed rows alone when the queue has no row.
WITH cfg AS MATERIALIZED (
    SELECT q.paused OR q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL AS stop,
           q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL AS limited,
           q.store_results
    FROM {schema}.queues AS q
    WHERE q.name = %(queue)s
),
picked AS MATERIALIZED (
    SELECT id
    FROM {schema}.jobs
    WHERE status = 'pending'
      AND queue = %(queue)s
      AND run_at <= now()
      AND NOT EXISTS (SELECT FROM cfg WHERE cfg.stop)
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {schema}.jobs AS j
    SET status       = 'running',
        worker       = %(worker)s,
        started_at   = now(),
        finished_at  = NULL,
        locked_until = now() + make_interval(secs => %(lease)s),
        attempts     = j.attempts + 1,
        lease_token  = gen_random_uuid()
    FROM picked
    WHERE j.id = picked.id
      AND j.status = 'pending'
    RETURNING j.*
)
SELECT claimed.*, coalesce(cfg.limited, false) AS queue_limited,
       coalesce(cfg.store_results, true) AS store_result
FROM claimed FULL JOIN cfg ON true;

-- name: complete_lean
-- The NOTIFY in RETURNING itself: no CTE to materialise and scan again.
UPDATE {schema}.jobs AS j
SET status       = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'done' END,
    finished_at  = now(),
    locked_until = NULL,
    result       = f.result::jsonb,
    completions  = j.completions + 1
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::text[])
     AS f(id, token, result)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
RETURNING j.id, j.lease_token, j.status,
          CASE WHEN j.notify_finish THEN pg_notify({channel}, 'finished:' || j.id) END
              AS notified;
