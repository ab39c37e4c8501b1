-- expect: none
-- "Keep the lock for the whole job": the row lock is the claim and the fence.
BEGIN;
SELECT id, payload FROM jobs
WHERE status = 'pending'
ORDER BY id
LIMIT 1
FOR UPDATE SKIP LOCKED;
UPDATE jobs SET status = 'done', finished_at = now() WHERE id = $1;
COMMIT;
