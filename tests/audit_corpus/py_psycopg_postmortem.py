# expect: SL001, SL005
"""The postmortem's worker before the fix: the claim is a module constant run by a function."""

import psycopg

CLAIM_SQL = """
UPDATE jobs
SET status = 'running', started_at = now(), worker = %s
WHERE id IN (
    SELECT id FROM jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT 10
)
RETURNING id, payload
"""


def run_once(conn: psycopg.Connection, worker_id: str) -> int:
    with conn.transaction():
        rows = conn.execute(CLAIM_SQL, (worker_id,)).fetchall()
    for job_id, _payload in rows:
        with conn.transaction():
            conn.execute(
                "UPDATE jobs SET status = 'done' WHERE id = %s AND worker = %s",
                (job_id, worker_id),
            )
    return len(rows)
