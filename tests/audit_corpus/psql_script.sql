-- expect: SL001, SL005
-- A psql script: meta-commands and :variables around the claim.
\set batch 10
\set worker_name 'w1'
UPDATE jobs
SET status = 'running', worker = :'worker_name'
WHERE id IN (
    SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT :batch
)
RETURNING id;
