-- expect: none
-- The postmortem's fix: CTE + FOR UPDATE SKIP LOCKED, a lease, and its sweeper.
WITH picked AS (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT 10
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs j
SET status = 'running',
    started_at = now(),
    locked_until = now() + interval '5 minutes',
    attempts = j.attempts + 1,
    worker = $1
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.payload;

UPDATE jobs SET status = 'done', locked_until = NULL
WHERE id = %s AND worker = %s;

UPDATE jobs
SET status = 'pending', worker = NULL, locked_until = NULL
WHERE status = 'running' AND locked_until < now() AND attempts < 5;
