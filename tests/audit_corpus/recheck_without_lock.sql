-- expect: SL009
-- Re-checked on the target, so no double claim, but colliding workers come back empty.
UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
WHERE status = 'pending'
  AND id IN (SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 10)
RETURNING id;
