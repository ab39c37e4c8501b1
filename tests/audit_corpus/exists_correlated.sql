-- expect: SL001
-- A correlated EXISTS on the same row still reads it from the statement's snapshot.
UPDATE jobs
SET status = 'running', worker = $1, lease_expires_at = now() + interval '1 minute'
WHERE EXISTS (
    SELECT 1 FROM jobs AS j2
    WHERE j2.id = jobs.id
      AND j2.status = 'pending'
)
RETURNING id;
