-- expect: SL005
-- Locked and skipped correctly, but a crashed worker leaves its jobs running forever.
WITH picked AS (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT 10
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs j
SET status = 'running', worker = $1, started_at = now()
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.payload;
