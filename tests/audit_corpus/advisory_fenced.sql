-- expect: none
-- Advisory locks done with care: the candidates are ordered in a subquery fenced by
-- OFFSET 0, the outer LIMIT stops the lock calls, and the UPDATE re-checks status.
WITH picked AS MATERIALIZED (
    SELECT c.id
    FROM (
        SELECT id FROM jobs
        WHERE status = 'pending'
        ORDER BY priority, id
        OFFSET 0
    ) AS c
    WHERE pg_try_advisory_xact_lock(c.id)
    LIMIT 10
)
UPDATE jobs AS j
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
FROM picked
WHERE j.id = picked.id AND j.status = 'pending'
RETURNING j.id;
