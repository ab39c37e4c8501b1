-- expect: none
-- Select-then-update done right: the SELECT locks and skips, in the same transaction.
BEGIN;

SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED;

UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
WHERE id = ANY($2);

COMMIT;
