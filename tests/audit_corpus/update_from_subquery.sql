-- expect: SL001
-- UPDATE ... FROM (subquery): the subquery's rows are joined as first read.
UPDATE jobs j
SET status = 'running', worker = $1, locked_until = now() + interval '5 minutes'
FROM (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT 10
) AS c
WHERE j.id = c.id
RETURNING j.id;
