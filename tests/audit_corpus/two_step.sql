-- expect: SL002
-- Select-then-update, even inside one transaction.
BEGIN;

SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 10;

UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
WHERE id = ANY($2);

COMMIT;
