-- expect: SL001
-- FOR UPDATE OF q locks the queue row, not the job: the job is unlocked and not re-checked.
WITH c AS (
    SELECT j.id
    FROM jobs AS j
    JOIN queues AS q ON q.name = j.queue
    WHERE j.status = 'pending' AND NOT q.paused
    ORDER BY j.id
    LIMIT 10
    FOR UPDATE OF q SKIP LOCKED
)
UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
FROM c
WHERE jobs.id = c.id
RETURNING jobs.id;
