-- expect: none
-- A recursive CTE walking candidates with advisory locks in the select list (Que style):
-- the lock is taken only on rows the walk reaches, one at a time.
WITH RECURSIVE jobs AS (
    SELECT (j).*, pg_try_advisory_lock((j).job_id) AS locked
    FROM (
        SELECT j FROM que_jobs AS j
        WHERE queue = $1::text AND run_at <= now()
        ORDER BY priority, run_at, job_id
        LIMIT 1
    ) AS t1
    UNION ALL (
        SELECT (j).*, pg_try_advisory_lock((j).job_id) AS locked
        FROM (
            SELECT (
                SELECT j FROM que_jobs AS j
                WHERE queue = $1::text AND run_at <= now()
                  AND (priority, run_at, job_id) > (jobs.priority, jobs.run_at, jobs.job_id)
                ORDER BY priority, run_at, job_id
                LIMIT 1
            ) AS j
            FROM jobs
            WHERE jobs.job_id IS NOT NULL
            LIMIT 1
        ) AS t1
    )
)
SELECT queue, priority, run_at, job_id, job_class, args, error_count
FROM jobs
WHERE locked
LIMIT 1;
