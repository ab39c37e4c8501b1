-- expect: none
-- Subquery with FOR UPDATE SKIP LOCKED plus a re-check on the target.
UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
WHERE status = 'pending'
  AND id IN (
      SELECT id FROM jobs
      WHERE status = 'pending'
      ORDER BY id
      LIMIT 10
      FOR UPDATE SKIP LOCKED
  )
RETURNING id, payload;
