-- skiplock schema, version 15: a fenced write's jobs are looked up one by one, in the
-- order sent, whatever the planner's statistics say.
--
-- Why: complete, fail, heartbeat and release join `unnest(ids, tokens, ...)` to jobs.
-- From a custom plan (a connection's first executions of a statement; psycopg prepares
-- at the fifth) the planner knows the array's length, and for a batch of some tens
-- or hundreds of ids it may prefer a hash join over a sequential scan of every generation to a primary-key
-- lookup per id: measured on PostgreSQL 15, a heartbeat of 256 ids against a
-- generation of 20,000 jobs took 8.7 ms that way against 2.5-3.0 ms by lookups, and a
-- fresh Worker of 8 draining 20,000 jobs sent 18 such writes, which read 360,000 rows
-- (pg_stat_user_tables).  More generations make the lookups look dearer (each id
-- probes every generation's key), so the cap of 0014 makes it likelier, not rarer.
-- The scan's order is also the order its rows are locked in: a hash join locks in the
-- generation's physical order, where `_ops.fenced` sends every write's jobs in id order
-- so that a heartbeat and a completion of the same jobs never wait on each other in a
-- cycle (a deadlock: both stall for deadlock_timeout and one fails).
--
-- The cure is 0010's: take the choice away.  Each shape of a fenced write's arguments
-- is a function that returns the same rows `unnest` did, declared ROWS 1 and not
-- inlined (a VOLATILE set-returning SQL function never is), so that the planner joins
-- it by a nested loop of primary-key lookups, one id after the other in the order
-- sent.  The statements, their fence and their correctness argument in queries.sql are
-- otherwise unchanged.  `unnest` of several arrays is the parser's own form (ROWS FROM),
-- never a lookup by search_path.  The functions run as their caller and need no grant beyond
-- EXECUTE, which PUBLIC keeps, so the roles of `skiplock roles` write through them as
-- before.

CREATE FUNCTION {schema}.fence_tokens(ids bigint[], tokens uuid[])
RETURNS TABLE (id bigint, token uuid)
LANGUAGE sql VOLATILE
ROWS 1
AS $fn$
    SELECT * FROM unnest(ids, tokens)
$fn$;

CREATE FUNCTION {schema}.fence_results(ids bigint[], tokens uuid[], results text[])
RETURNS TABLE (id bigint, token uuid, result text)
LANGUAGE sql VOLATILE
ROWS 1
AS $fn$
    SELECT * FROM unnest(ids, tokens, results)
$fn$;

CREATE FUNCTION {schema}.fence_errors(ids bigint[], tokens uuid[], errors text[],
                                      delays float8[], retries bool[])
RETURNS TABLE (id bigint, token uuid, error text, delay float8, retry bool)
LANGUAGE sql VOLATILE
ROWS 1
AS $fn$
    SELECT * FROM unnest(ids, tokens, errors, delays, retries)
$fn$;
