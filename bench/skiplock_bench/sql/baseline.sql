-- The claim and complete of skiplock before issue 8's control features (commit a8408a3):
-- no queues lookup, no result column, no NOTIFY on finish.  The bench's sqlcmp runs them
-- beside today's statements in the same run, to price what those features cost.

-- name: claim
-- One statement.  The CTE locks candidate rows and skips rows another claimer holds,
-- so concurrent claimers get disjoint sets without waiting.  MATERIALIZED keeps the
-- planner from inlining the CTE and evaluating LIMIT against the join.  The UPDATE
-- re-checks status on the target row itself: that is the check the postmortem's
-- subquery claim lacked.  The fresh lease_token is the fence for every later write.
WITH picked AS MATERIALIZED (
    SELECT id
    FROM {schema}.jobs
    WHERE status = 'pending'
      AND queue = %(queue)s
      AND run_at <= now()
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
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
RETURNING j.*;

-- name: complete
-- Fenced: only the holder of the current lease token of a running job may finish it.
-- A lease that ran out still completes if nobody swept or re-claimed the job.
UPDATE {schema}.jobs AS j
SET status       = 'done',
    finished_at  = now(),
    locked_until = NULL,
    completions  = j.completions + 1  -- verify's record; the fence keeps it at 1
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS f(id, token)
WHERE j.id = f.id
  AND j.lease_token = f.token
  AND j.status = 'running'
RETURNING j.id;
