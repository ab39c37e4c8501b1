-- expect: SL001
-- EXISTS over a limited candidate list: the candidates are not re-read after a lock wait.
UPDATE jobs AS j
SET status = 'running', worker = $1, locked_until = now() + interval '2 minutes'
WHERE EXISTS (
    SELECT 1
    FROM (SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 5) AS c
    WHERE c.id = j.id
)
RETURNING j.id;
