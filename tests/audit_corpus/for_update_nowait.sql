-- expect: none
-- NOWAIT: a worker that meets a locked candidate fails fast and retries instead of queueing.
UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
WHERE id = (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT 1
    FOR NO KEY UPDATE NOWAIT
)
RETURNING id;
