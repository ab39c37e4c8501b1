-- expect: SL001, SL005
-- The claim from the postmortem, verbatim: status = 'pending' lives only in the subquery,
-- and nothing records when the claim runs out.
UPDATE jobs
SET status = 'running', started_at = now(), worker = $1
WHERE id IN (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT 10
)
RETURNING id, payload;
