-- expect: SL007
-- Correct and leased, but no ORDER BY: no FIFO, and a job can starve.
WITH picked AS (
    SELECT id FROM jobs
    WHERE status = 'pending'
    LIMIT 10
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs j
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
FROM picked
WHERE j.id = picked.id
RETURNING j.id;
