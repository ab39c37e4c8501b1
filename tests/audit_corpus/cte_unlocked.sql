-- expect: SL001
-- A CTE looks like a separate step but takes no lock either.
WITH next_job AS (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY created_at
    LIMIT 1
)
UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
FROM next_job
WHERE jobs.id = next_job.id
RETURNING jobs.*;
