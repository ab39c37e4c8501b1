-- Rows for claims that join jobs to queues: the queue must exist and not be paused.
INSERT INTO queues (name) VALUES ('default');
INSERT INTO jobs (payload)
SELECT jsonb_build_object('n', g) FROM generate_series(1, :jobs) AS g ORDER BY g;
