-- expect: SL004
-- The planner may evaluate the lock function on every pending row before sorting.
SELECT id, payload
FROM jobs
WHERE status = 'pending' AND pg_try_advisory_lock(id)
ORDER BY id
LIMIT 1;
