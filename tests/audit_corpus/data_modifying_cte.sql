-- expect: SL001, SL005
-- The claim inside a data-modifying CTE, its result read by the outer SELECT.
WITH claimed AS (
    UPDATE tasks
    SET state = 'running', worker_id = $1
    WHERE id IN (
        SELECT id FROM tasks WHERE state = 'ready' ORDER BY id LIMIT $2
    )
    RETURNING id, payload
)
SELECT id, payload FROM claimed;
