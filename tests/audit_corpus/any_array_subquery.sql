-- expect: SL001
-- = ANY(ARRAY(subquery)): the same race as IN (subquery), spelled differently.
UPDATE jobs
SET status = 'running',
    worker = $1,
    locked_until = now() + interval '30 seconds'
WHERE id = ANY(ARRAY(
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY priority DESC, id
    LIMIT $2
))
RETURNING id, payload;
