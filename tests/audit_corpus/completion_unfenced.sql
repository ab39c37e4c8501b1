-- expect: SL006
-- A worker whose lease expired can still mark someone else's job done.
UPDATE jobs SET status = 'done', finished_at = now() WHERE id = $1;
