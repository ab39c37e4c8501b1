# expect: none
"""A SELECT in one function and an UPDATE by id in another are not one claim: the
two-step rule looks inside one function only."""


def pending_count(cur):
    cur.execute("SELECT id FROM jobs WHERE status = 'pending'")
    return len(cur.fetchall())


def start(cur, job_id, worker):
    cur.execute(
        "UPDATE jobs SET status = 'running', worker = %s, locked_until = now() + interval '1 hour' "
        "WHERE id = %s AND status = 'pending'",
        (worker, job_id),
    )
