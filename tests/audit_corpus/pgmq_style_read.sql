-- expect: none
-- A visibility-timeout read in the style of pgmq: vt is the lease.
WITH cte AS (
    SELECT msg_id
    FROM pgmq.q_tasks
    WHERE vt <= clock_timestamp()
    ORDER BY msg_id ASC
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE pgmq.q_tasks m
SET vt = clock_timestamp() + make_interval(secs => $2),
    read_ct = read_ct + 1
FROM cte
WHERE m.msg_id = cte.msg_id
RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.vt, m.message;
