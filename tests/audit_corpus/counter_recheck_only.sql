-- expect: SL001
-- The UPDATE's own WHERE tests a counter, which stays true after the first claim: that is
-- no re-check of the claim.
UPDATE jobs
SET status = 'running',
    attempts = attempts + 1,
    locked_until = now() + interval '5 minutes'
WHERE attempts < 5
  AND id IN (SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 10)
RETURNING id;
