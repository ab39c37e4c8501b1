-- expect: SL009
-- DELETE-based pop: the DELETE skips rows already gone, but workers collide.
DELETE FROM jobs
WHERE id = (SELECT id FROM jobs ORDER BY id LIMIT 1)
RETURNING id, payload;
