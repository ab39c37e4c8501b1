-- expect: none
-- Select-then-update where the UPDATE re-checks (compare-and-set): a lost race updates
-- nothing instead of claiming twice.
SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 1;

UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
WHERE id = $2 AND status = 'pending';
