-- expect: SL001
-- "Take the oldest pending job" with min(): every worker computes the same id.
UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
WHERE id = (SELECT min(id) FROM jobs WHERE status = 'pending')
RETURNING id, payload;
