# expect: none
"""The postmortem's worker after the fix: the claim is read from a file (not audited
here), and the completion, split over two literals, is fenced by the worker."""

import psycopg

CLAIM_SQL = open("claim.sql").read()  # noqa: SIM115


def run_once(conn: psycopg.Connection, worker_id: str) -> int:
    with conn.transaction():
        rows = conn.execute(CLAIM_SQL, (worker_id,)).fetchall()
    for job_id, _payload in rows:
        with conn.transaction():
            conn.execute(
                "UPDATE jobs SET status = 'done', locked_until = NULL "
                "WHERE id = %s AND worker = %s",
                (job_id, worker_id),
            )
    return len(rows)
