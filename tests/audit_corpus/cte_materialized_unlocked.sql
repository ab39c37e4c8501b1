-- expect: SL001, SL005
-- MATERIALIZED changes planning, not locking.
WITH picked AS MATERIALIZED (
    SELECT id FROM jobs
    WHERE state = 'queued' AND queue = $1
    ORDER BY priority, id
    LIMIT $2
)
UPDATE jobs AS j
SET state = 'processing', claimed_by = $3
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.args;
