-- expect: none
-- Completions fenced by the claimant, by a lease token, or by the running state.
UPDATE jobs SET status = 'done', finished_at = now() WHERE id = $1 AND worker = $2;

UPDATE jobs SET status = 'failed', last_error = $3 WHERE id = $1 AND lease_token = $2;

UPDATE jobs SET status = 'completed' WHERE id = ANY($1) AND status = 'running';
