-- expect: SL001, SL004
-- The advisory lock on the UPDATE's own rows: the planner may call it on every row it
-- scans, and the lock does not stop a claim of a row committed after the snapshot.
UPDATE jobs
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
WHERE id IN (SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 10)
  AND pg_try_advisory_xact_lock(id)
RETURNING id;
