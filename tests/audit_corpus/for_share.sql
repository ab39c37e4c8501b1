-- expect: SL008
-- FOR SHARE: every worker share-locks the same rows, then they deadlock on the UPDATE.
WITH picked AS (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT 10
    FOR SHARE
)
UPDATE jobs j
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
FROM picked
WHERE j.id = picked.id
RETURNING j.id;
