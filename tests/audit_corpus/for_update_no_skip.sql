-- expect: SL003
-- Correct, but every worker queues behind the first one's lock.
WITH picked AS (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT 10
    FOR UPDATE
)
UPDATE jobs j
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
FROM picked
WHERE j.id = picked.id
RETURNING j.id;
