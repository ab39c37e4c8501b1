-- Candidate statements for sqlcmp (python -m skiplock_bench.sqlcmp --variants new,<name>):
-- claim_<name> / complete_<name> replace today's claim / complete; setup_<name> runs on
-- the variant's fresh schema after the migrations (an index or storage change).
-- (claim_lean / complete_lean, measured here first, are today's statements now.)

-- name: setup_ff_full
-- Pages packed full: no room for the claim's and the complete's new row versions on
-- the page of the old one.
ALTER TABLE {schema}.jobs SET (fillfactor = 100);

-- name: setup_ff_half
-- Half-empty pages: room for both updates of every job on its own page.
ALTER TABLE {schema}.jobs SET (fillfactor = 50);

-- name: setup_no_finidx
-- Without jobs_finished_idx (prune's and the dashboard's index): what the complete
-- pays for it.
DROP INDEX {schema}.jobs_finished_idx;

-- name: setup_no_runidx
-- Without jobs_running_leases_idx (the sweep's index): what the claim pays for it.
DROP INDEX {schema}.jobs_running_leases_idx;

-- name: setup_no_idx
-- Without either: a claim and a complete that each write only the primary key's entry,
-- as the postmortem's plain SQL does.
DROP INDEX {schema}.jobs_running_leases_idx;
DROP INDEX {schema}.jobs_finished_idx;

-- name: complete_part
-- Today's complete, told each job's generation (the claim returns it): the join prunes
-- to that one partition at run time instead of probing every generation's primary key.
UPDATE {schema}.jobs AS j
SET status       = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'done' END,
    finished_at  = now(),
    locked_until = NULL,
    result       = f.result::jsonb,
    completions  = j.completions + 1
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::text[], %(parts)s::integer[])
     AS f(id, token, result, part)
WHERE j.id = f.id
  AND j.part = f.part
  AND j.lease_token = f.token
  AND j.status = 'running'
  AND j.part < 1000000
RETURNING j.id, j.lease_token, j.status,
          CASE WHEN j.notify_finish THEN pg_notify({channel}, 'finished:' || j.id) END
              AS notified;

-- name: setup_custom
-- The pick as before migration 0012: PL/pgSQL's plan cache left to choose, which, once a
-- generation has statistics, plans the pick again at every call (--variants custom,new
-- prices what 0012 saves).
ALTER FUNCTION {schema}.claimable(text, bigint, integer, timestamptz, bigint, text[])
    RESET plan_cache_mode;
