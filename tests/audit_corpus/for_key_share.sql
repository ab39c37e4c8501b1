-- expect: SL001, SL008
-- FOR KEY SHARE does not conflict with the claiming UPDATE: no wait, no re-check.
WITH picked AS (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT 10
    FOR KEY SHARE SKIP LOCKED
)
UPDATE jobs j
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
FROM picked
WHERE j.id = picked.id
RETURNING j.id;
