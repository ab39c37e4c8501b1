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
