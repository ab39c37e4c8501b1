-- skiplock schema, version 12: the claim's pick is planned once per session, not once
-- per claim.
--
-- Why: PL/pgSQL keeps a plan for the query in `claimable` (0010), but like a prepared
-- statement it first plans it five times for the values given (custom plans), then
-- compares: when the plan for any values (generic) looks dearer than those five did on
-- average, it goes on planning for each call's values, for as long as the session
-- lives.  The pick's generic plan does look dearer (its LIMIT and position are
-- unknown), so every claim planned the pick anew over every generation and its
-- indexes.  Profiled with perf on PostgreSQL 15 (pgbench running skiplock's claim and
-- complete, 8 clients, batches of 10): planning inside `claimable` was 21% of all the
-- server's CPU, and the generic plan, forced, is the same ordered plan the custom ones
-- were: a Merge Append of each generation's claimable index, stopped after the batch.
-- With it forced, the same pgbench drained 1.25 x as fast with synchronous commit and
-- 1.29 x without (medians of three rounds, bench/README.md; on a schema with this
-- migration, `python -m skiplock_bench.sqlcmp --variants custom,new` undoes it to compare).
--
-- Forcing it is safe for the reason 0010 gives: with enable_sort off the only ordered
-- plan without a sort is the index merge, whatever values or statistics the planner
-- sees, so the generic plan cannot become the sort over the whole backlog.  A cached
-- plan is still made again when it must be: ANALYZE of a generation, a generation
-- attached by upkeep and a TRUNCATE all invalidate it, and the next call plans anew.
-- The setting holds inside the function only, like enable_sort.  Nothing else changes:
-- the function's body, its grants, and the correctness argument in queries.sql.

ALTER FUNCTION {schema}.claimable(text, bigint, integer, timestamptz, bigint, text[])
    SET plan_cache_mode = force_generic_plan;
