-- expect: none
-- DELETE-based pop with SKIP LOCKED: at-most-once, no collisions.
DELETE FROM jobs
WHERE id = (SELECT id FROM jobs ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, payload;
