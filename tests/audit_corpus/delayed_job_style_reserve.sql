-- expect: SL003
-- A reserve in the style of delayed_job: stale locks are taken over (an implicit lease),
-- but FOR UPDATE without SKIP LOCKED makes workers wait for each other.
UPDATE delayed_jobs
SET locked_at = $1, locked_by = $2
WHERE id IN (
    SELECT id FROM delayed_jobs
    WHERE ((run_at <= $3 AND (locked_at IS NULL OR locked_at < $4)) OR locked_by = $2)
      AND failed_at IS NULL
    ORDER BY priority ASC, run_at ASC
    LIMIT 1
    FOR UPDATE
)
RETURNING *;
