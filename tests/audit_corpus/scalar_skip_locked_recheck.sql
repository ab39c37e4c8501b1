-- expect: none
-- UPDATE ... WHERE status = 'pending' AND id = (SELECT ... FOR UPDATE SKIP LOCKED).
UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
WHERE status = 'pending'
  AND id = (
      SELECT id FROM jobs
      WHERE status = 'pending'
      ORDER BY priority, id
      LIMIT 1
      FOR UPDATE SKIP LOCKED
  )
RETURNING id, payload;
