-- expect: SL001
-- A joined copy of the table carries the condition; only the target row is re-checked.
UPDATE jobs
SET status = 'running', worker = $1, heartbeat_at = now()
FROM jobs AS candidate
JOIN queues AS q ON q.name = candidate.queue
WHERE jobs.id = candidate.id
  AND candidate.status = 'pending'
  AND NOT q.paused
RETURNING jobs.id;
