-- expect: SL001, SL007
-- IN (subquery) without a lock or an order; the lease is there, the race is too.
UPDATE jobs
SET status = 'running', locked_until = now() + interval '5 minutes'
WHERE id IN (SELECT id FROM jobs WHERE status = 'pending' LIMIT 10)
RETURNING *;
